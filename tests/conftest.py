"""Oracle helpers shared by the tests: the float64 reference, a naive same-dtype computation
and FlashAttention's tolerance rule for low precision."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import api, native
from attnkit import plan as plan_module
from attnkit.backends import fused
from attnkit.reference import attention_reference

# every replayed call in the tests is checked against the full path's normalised form
api.CHECK_REPLAYS = True


def naive_attention(q, k, v, *, mask=None, bias=None, scale=None, causal=False):
    """Textbook attention done entirely in the inputs' dtype (the 'plain' error baseline)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(g, dim=-3)
    v = v.repeat_interleave(g, dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(s.dtype)
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    return p @ v


def fa_tolerance_ok(out, ref, plain, mult: float = 2.0) -> tuple:
    """FlashAttention's rule: max|out - ref| <= mult * max|plain - ref| + 1e-5."""
    err = (out.double() - ref.double()).abs().max().item()
    base = (plain.double() - ref.double()).abs().max().item()
    return err <= mult * base + 1e-5, err, base


def assert_plan_follows(spec, plan, vis):
    """The plan against the dense visibility ``vis`` (N, Hq, Lq, Lk) of the raw keywords: no
    tile with a visible pair is skipped, a tile marked full by every term is all visible, and
    each planned tile's visibility equals the dense one."""
    from attnkit.plan import tile_visibility

    for qb in range(plan.nqb):
        q0, q1 = plan.q_range(qb)
        for kb in range(plan.nkb):
            k0, k1 = plan.k_range(kb)
            dense = vis[:, :, q0:q1, k0:k1]
            if bool(dense.any()):  # work is never skipped
                assert bool(plan.any[qb, kb]), (qb, kb)
            if not bool(plan.any[qb, kb]):
                continue
            if all(bool(f[qb, kb]) for f in plan.term_full.values()):
                assert bool(dense.all()), (qb, kb)  # "full" means every pair visible
            got = tile_visibility(spec, plan, qb, kb)
            got = torch.ones_like(dense) if got is None else got.expand_as(dense)
            assert torch.equal(got, dense), (qb, kb)


def rand(*shape, dtype=torch.float64, requires_grad=False, gen=None):
    x = torch.randn(*shape, dtype=torch.float64, generator=gen).to(dtype)
    return x.requires_grad_(requires_grad)


def spy(monkeypatch, module, name):
    """Wrap ``module.name`` so that each call appends ``name`` to the returned list."""
    calls = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.fixture
def for_each_threads(monkeypatch):
    """The ``threads`` argument of every ``workers.for_each`` call, in order."""
    from attnkit.backends import workers

    seen = []
    real = workers.for_each

    def counting(items, fn, threads=None):
        seen.append(threads)
        return real(items, fn, threads=threads)

    monkeypatch.setattr(workers, "for_each", counting)
    return seen


@pytest.fixture
def small_tiles(monkeypatch):
    """Force many small tiles so the online softmax crosses tile boundaries."""
    monkeypatch.setattr(plan_module, "TILE_ELEMENTS", 64)
    monkeypatch.setattr(plan_module, "MAX_KEY_TILE", 16)
    monkeypatch.setattr(fused, "BLOCK", 16)


@pytest.fixture(params=["fused", "tiled"])
def backend(request):
    """Run a test on each executor."""
    return request.param


@pytest.fixture
def fresh_native(monkeypatch):
    """Let a test change the native kernel's build environment (ATTNKIT_NATIVE, CC,
    ATTNKIT_CACHE_DIR); the kernel is reloaded before and after."""
    from attnkit import native

    native._reset()
    yield monkeypatch
    monkeypatch.undo()
    native._reset()


@pytest.fixture
def reference():
    return attention_reference


@pytest.fixture
def kernel_pages(monkeypatch):
    """The dtype of the K pages each native decode call was given, call by call (what the
    kernel read: fp8 pages in place, or a dequantized copy)."""
    from attnkit import native

    seen = []
    real = native.DecodeCall.run

    def run(self, q, k_pages, *args, **kwargs):
        seen.append(k_pages.dtype)
        return real(self, q, k_pages, *args, **kwargs)

    monkeypatch.setattr(native.DecodeCall, "run", run)
    return seen


@pytest.fixture
def specs_built(monkeypatch):
    """How many calls built a spec (the full path); the replay cache starts empty and the
    native kernels loaded (a call that loads them is not remembered: after a test that
    reloads them, the first two calls would take the full path)."""
    native.available()
    monkeypatch.setattr(api, "_REPLAYS", {})
    calls = []
    real = api.build_spec

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "build_spec", counting)
    return calls


def check_oracle(out, q, k, v, kw, dtype):
    """``out`` against the float64 reference of ``attention(q, k, v, **kw)``: float32 to
    2e-6 / 2e-5, lower precision by FlashAttention's rule."""
    ref = attention_reference(q.double(), k.double(), v.double(), **kw)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    else:
        plain = attention_reference(q.double().to(dtype).double(), k.double(), v.double(),
                                    **kw).to(dtype)
        ok, err, bound = fa_tolerance_ok(out, ref, plain)
        assert ok, (err, bound)
