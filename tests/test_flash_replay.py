"""Recurring calls replayed on the flash kernel: a no-grad call the flash executor ran is
remembered by its form (shapes, strides, dtypes, options), and the next calls of that form run
straight on the kernel with the terms and argument block made once. A replayed call must give
the full path's bits; a call of another form (other key length, strides, padding tensors), a
non-finite input, a changed bfloat16 setting or gradients take the full path."""

from __future__ import annotations

import pytest
import torch
from conftest import check_oracle, rand

import attnkit
from attnkit import api, backends, native
from attnkit.backends import flash
from attnkit.reference import attention_reference
from attnkit.spec import build_spec

pytestmark = pytest.mark.skipif(not native.build_info().get("flash", False),
                                reason="native flash kernel unavailable")


def _r(g, *shape):
    return rand(*shape, gen=g, dtype=torch.float32)


def _on_flash(q, k, v, kw):
    """``kw`` for a call of this form that the flash executor runs: as given where ``auto``
    chooses flash (:func:`attnkit.backends.choose`), else with ``backend="flash"`` (a 256-bit
    build leaves dense and plain causal float32 calls to the fused executor, which replays
    nothing), so that every CPU checks the flash executor's replay."""
    if backends.choose(build_spec(q, k, v, **kw)) is flash:
        return kw
    return dict(kw, backend="flash")


def _full(q, k, v, kw):
    """The full path's result (the replay cache bypassed by a fresh one)."""
    saved = dict(api._REPLAYS)
    api._REPLAYS.clear()
    try:
        with torch.no_grad():
            return attnkit.attention(q, k, v, **kw)
    finally:
        api._REPLAYS.clear()
        api._REPLAYS.update(saved)


FORMS = [
    dict(),
    dict(causal=True),
    dict(causal=True, diagonal="bottom_right", scale=0.2),
    dict(window=(40, 7)),
    dict(causal=True, softcap=4.0),
]


@pytest.mark.parametrize("kw", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurring_calls_are_replayed_with_the_full_paths_bits(kw, dtype, specs_built):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for step in range(4):
            q = rand(2, 4, 96, 64, gen=g, dtype=dtype)
            k, v = rand(2, 2, 130, 64, gen=g, dtype=dtype), rand(2, 2, 130, 64, gen=g,
                                                                  dtype=dtype)
            call = _on_flash(q, k, v, kw)
            built = len(specs_built)
            out = attnkit.attention(q, k, v, **call)
            assert out.dtype == dtype and out.shape == (2, 4, 96, 64) and out.is_contiguous()
            if step:
                assert len(specs_built) == built  # replayed: no spec built
                assert torch.equal(out, _full(q, k, v, call))
            check_oracle(out, q, k, v, kw, dtype)


def test_another_form_takes_the_full_path_and_is_right(specs_built):
    g = torch.Generator().manual_seed(2)
    kw = dict(causal=True, diagonal="bottom_right")
    q = _r(g, 1, 4, 64, 32)
    with torch.no_grad():
        attnkit.attention(q, *(_r(g, 1, 4, 100, 32) for _ in range(2)), **kw)
        for lk in (101, 160, 64):  # a longer cache: other bounds, other packed blocks
            k, v = _r(g, 1, 4, lk, 32), _r(g, 1, 4, lk, 32)
            check_oracle(attnkit.attention(q, k, v, **kw), q, k, v, kw, torch.float32)
        kt = _r(g, 1, 64, 4, 32).transpose(1, 2)  # other strides
        v = _r(g, 1, 4, 64, 32)
        check_oracle(attnkit.attention(q, kt, v, **kw), q, kt, v, kw, torch.float32)
        lens = torch.tensor([40])
        out = attnkit.attention(q, kt, v, seqlens_kv=lens, **kw)
        check_oracle(out, q, kt, v, dict(kw, seqlens_kv=lens), torch.float32)
    assert len(specs_built) == 6  # each of another form


def test_a_non_finite_input_on_a_replayed_call_gives_the_full_paths_nan():
    g = torch.Generator().manual_seed(3)
    q, k, v = _r(g, 1, 2, 64, 64), _r(g, 1, 2, 64, 64), _r(g, 1, 2, 64, 64)
    call = _on_flash(q, k, v, dict(causal=True))
    api._REPLAYS.clear()
    with torch.no_grad():
        attnkit.attention(q, k, v, **call)
        launch = next(iter(api._REPLAYS.values()))
        assert launch is not None
        q2 = q.clone()
        q2[0, 1, 5, 3] = float("nan")
        assert launch(q2, k, v, None, None) is None  # the kernel refused it
        out = attnkit.attention(q2, k, v, **call)
    ref = attention_reference(q2.double(), k.double(), v.double(), causal=True)
    assert torch.isnan(out[0, 1, 5]).all() and torch.isnan(ref[0, 1, 5]).all()
    torch.testing.assert_close(out[0, 0].double(), ref[0, 0], atol=2e-6, rtol=2e-5)
    api._REPLAYS.clear()


@pytest.mark.skipif(not native.build_info().get("flash_bf16", False),
                    reason="no AVX512-BF16 flash kernel")
@pytest.mark.parametrize("dot", [False, True])
def test_the_bfloat16_dot_setting_is_read_at_every_replayed_call(dot, monkeypatch,
                                                                  specs_built):
    g = torch.Generator().manual_seed(4)
    q, k, v = (rand(1, 2, 64, 64, gen=g, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        attnkit.attention(q, k, v)  # remembered with the setting as it was
        monkeypatch.setattr(native, "FLASH_BF16_DOT", dot)
        replayed = attnkit.attention(q, k, v)
    assert len(specs_built) == 1
    qd, kd, vd = (x.detach() for x in (q, k, v))
    t = flash.terms(attnkit.spec.build_spec(qd, kd, vd, attnkit.spec.Options()))
    direct, _ = native.flash_forward(qd, kd, vd, 64 ** -0.5, t)
    assert torch.equal(replayed, direct)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("needs", [(True, True, True), (False, True, False)])
def test_training_calls_are_replayed_through_the_autograd_node(dtype, needs, monkeypatch,
                                                               specs_built):
    """Same output and gradients, bit for bit, as the full path; the backward reuses the
    forward's prepared kernel call (no second argument block)."""
    args = []
    real = native._flash_args
    monkeypatch.setattr(native, "_flash_args", lambda *a, **kw: args.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(5)
    kw = dict(causal=True, softcap=3.0)
    for step in range(3):
        q, k, v = (rand(1, 4, 80, 64, gen=g, dtype=dtype).requires_grad_(r) for r in needs)
        go = rand(1, 4, 80, 64, gen=g, dtype=dtype)
        built, made = len(specs_built), len(args)
        out = attnkit.attention(q, k, v, **kw)
        leaves = [x for x in (q, k, v) if x.requires_grad]
        grads = torch.autograd.grad(out, leaves, go)
        if step:
            assert len(specs_built) == built and len(args) == made  # all of it replayed
        api._REPLAYS.clear()
        q2, k2, v2 = (x.detach().requires_grad_(x.requires_grad) for x in (q, k, v))
        out2 = attnkit.attention(q2, k2, v2, **kw)
        made = len(args)
        want = torch.autograd.grad(out2, [x for x in (q2, k2, v2) if x.requires_grad], go)
        assert len(args) == made  # the full path's backward reuses its forward's block too
        assert torch.equal(out, out2)
        for a, b in zip(grads, want):
            assert a.dtype == dtype and torch.equal(a, b)


def test_gradients_of_a_replayed_call_match_the_oracle(specs_built):
    g = torch.Generator().manual_seed(7)
    kw = dict(window=(20, 3))
    for _ in range(2):
        q, k, v = (_r(g, 2, 2, 70, 32).requires_grad_() for _ in range(3))
        out = attnkit.attention(q, k, v, **kw)
        out.square().sum().backward()
        qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = attention_reference(qd, kd, vd, **kw)
        ref.square().sum().backward()
        for a, b in ((q, qd), (k, kd), (v, vd)):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-5, rtol=1e-4)
    assert len(specs_built) == 1


def test_the_launcher_holds_no_input():
    g = torch.Generator().manual_seed(6)
    q, k, v = (_r(g, 1, 2, 64, 64) for _ in range(3))
    api._REPLAYS.clear()
    with torch.no_grad():
        attnkit.attention(q, k, v, **_on_flash(q, k, v, {}))
    launch = next(iter(api._REPLAYS.values()))
    held = [c.cell_contents for c in launch.__closure__ or ()]
    call = next(x for x in held if isinstance(x, native.FlashForward))
    for x in (q, k, v):
        assert all(t is not x for t in vars(call).values())
        assert all(t is not x for t in held)
    api._REPLAYS.clear()


def test_a_prepared_call_fits_only_tensors_of_its_form():
    g = torch.Generator().manual_seed(8)
    q, k, v = (_r(g, 1, 2, 64, 32) for _ in range(3))
    t = flash.terms(attnkit.spec.build_spec(q, k, v, attnkit.spec.Options()))
    call = native.flash_prepare(q, k, v, 0.3, t)
    assert call.fits(q, k, v) and call.fits(q.clone(), k.clone(), v.clone())
    assert not call.fits(q.to(torch.bfloat16), k, v)  # dtype
    assert not call.fits(q, k[:, :, :63], v)  # shape
    assert not call.fits(q, k, v.transpose(2, 3).contiguous().transpose(2, 3))  # strides
    out, lse = call.run(q, k, v)
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), scale=0.3,
                                       return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=2e-5)


def test_a_plan_run_per_vmap_slice_prepares_each_slices_own_call():
    """torch.func.vmap runs one plan per slice: a slice with other sinks (the same q, k, v)
    must not reuse the previous slice's prepared call."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (_r(g, 1, 2, 64, 32) for _ in range(3))
    sinks = _r(g, 3, 2) * 3
    f = torch.func.vmap(lambda s: attnkit.attention(q, k, v, causal=True, sinks=s))
    out = f(sinks)
    for i in range(3):
        ref = attention_reference(q.double(), k.double(), v.double(), causal=True,
                                  sinks=sinks[i].double())
        torch.testing.assert_close(out[i].double(), ref, atol=2e-6, rtol=2e-5)


def test_a_launcher_another_thread_dropped_meanwhile_takes_the_full_path(specs_built):
    """Two threads can both find a launcher refusing their call; the second one's entry is
    gone by the time it drops it."""
    g = torch.Generator().manual_seed(10)
    q, k, v = (_r(g, 1, 2, 64, 32) for _ in range(3))
    call = _on_flash(q, k, v, dict(causal=True))
    with torch.no_grad():
        attnkit.attention(q, k, v, **call)
        (key,) = api._REPLAYS
        assert api._REPLAYS[key] is not None  # the flash executor's launcher

        def refusing(*args):
            api._REPLAYS.pop(key, None)  # (what the other thread did meanwhile)
            return None

        api._REPLAYS[key] = refusing
        out = attnkit.attention(q, k, v, **call)
    check_oracle(out, q, k, v, dict(causal=True), torch.float32)
    assert len(specs_built) == 2
