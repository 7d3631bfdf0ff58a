"""attnkit's native CPU flash kernel (backend "flash"): every term it evaluates in registers
against the float64 oracle, its place in executor selection, its backward (the next
executor's, from this forward's out and lse) and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import fa_tolerance_ok, naive_attention, rand, spy

import attnkit
from attnkit import backends, masks, native, score_mods
from attnkit.backends import flash, fused, tiled
from attnkit.block_mask import create_block_mask
from attnkit.reference import attention_reference as ref
from attnkit.spec import build_spec

pytestmark = pytest.mark.skipif(
    not (native.available() and native.build_info().get("flash")),
    reason="the native flash kernel needs a C compiler and an AVX-512 or AVX2 + FMA CPU")


def _qkv(n=2, hq=4, hkv=2, lq=150, lk=None, d=32, dv=None, dtype=torch.float32, seed=0,
         grad=False):
    g = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    dv = d if dv is None else dv
    return (rand(n, hq, lq, d, dtype=dtype, gen=g, requires_grad=grad),
            rand(n, hkv, lk, d, dtype=dtype, gen=g, requires_grad=grad),
            rand(n, hkv, lk, dv, dtype=dtype, gen=g, requires_grad=grad))


def _auto(spec):
    """What auto picks for a call flash runs: flash, or (dense and plain causal calls where
    the cost table says torch's kernel is faster) the fused executor."""
    return fused if flash.auto_defers(spec) else flash


def _check(q, k, v, atol=3e-6, **kw):
    spec = build_spec(q, k, v, **kw)
    assert backends.select(spec) is _auto(spec), backends.explain(spec)["flash"]
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend="flash", **kw)
    r, rl = ref(q.double(), k.double(), v.double(), return_lse=True, **kw)
    assert (out.double() - r).abs().max().item() < atol
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert (lse[fin].double() - rl[fin]).abs().max().item() < atol
    return out, lse


TERMS = {
    "dense": dict(),
    "causal": dict(causal=True),
    "causal_br": dict(causal=True, diagonal="bottom_right"),
    "window": dict(window=(40, 3)),
    "window_left_only": dict(window=(70, None)),
    "window_br": dict(window=(16, 0), diagonal="bottom_right"),
    "scale": dict(scale=0.05),
    "softcap": dict(softcap=2.0, causal=True),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]), causal=True),
    "alibi_batch": dict(alibi_slopes=torch.rand(2, 4)),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]), causal=True),
    "seqlens": dict(seqlens_q=torch.tensor([100, 150]), seqlens_kv=torch.tensor([150, 7])),
    "starts_kv": dict(starts_kv=torch.tensor([0, 90]), causal=True, diagonal="bottom_right"),
    "relbias": dict(score_mods=("relative_bias", 30, True), causal=True),
    "relbias_shared": dict(score_mods=("relative_bias", 200, False)),
    "prefix_lm": dict(mask=masks.prefix_lm(37)),
    "chunked": dict(mask=masks.chunked(48)),
    "documents_causal": dict(mask=masks.and_masks(masks.causal(),
                                                  masks.document_from_lengths([20, 70, 60]))),
    "documents": dict(mask=masks.document_from_lengths([64, 1, 85])),
}


def _kw(name):
    kw = dict(TERMS[name])
    if "score_mods" in kw:
        _, m, per_head = kw.pop("score_mods")
        g = torch.Generator().manual_seed(5)
        table = torch.randn(*((4,) if per_head else ()), 2 * m - 1, generator=g)
        kw["score_mod"] = score_mods.relative_bias(table)
    return kw


@pytest.mark.parametrize("name", list(TERMS))
def test_every_term_matches_the_oracle(name):
    _check(*_qkv(lk=None if "br" not in name and "starts" not in name else 211), **_kw(name))


@pytest.mark.parametrize("shape", [dict(lq=1 + 64, lk=3), dict(lq=17, lk=64 * 3),
                                   dict(lq=200, lk=129, d=48, dv=16), dict(d=192, dv=64),
                                   dict(hq=6, hkv=1, d=256, dv=256, lq=70),
                                   dict(n=1, hq=1, hkv=1, lq=20, lk=20, d=16)])
def test_shapes_block_edges_and_gqa(shape):
    _check(*_qkv(**shape), causal=True, diagonal="bottom_right")
    _check(*_qkv(**shape))


def test_segments_ascending_and_in_any_order():
    q, k, v = _qkv(lq=130)
    ascending = torch.arange(130) // 40
    shuffled = torch.tensor([3, 1, 2, 1, 0] * 26)
    for ids in (ascending, shuffled, torch.stack([ascending, shuffled])):
        spec_kw = dict(mask=masks.document(ids))
        _check(q, k, v, **spec_kw)
        _check(q, k, v, causal=True, **spec_kw)


def test_a_block_mask_runs_when_its_blocks_agree_with_its_mask_mod():
    q, k, v = _qkv(lq=300)
    mod = masks.and_masks(masks.causal(), masks.document_from_lengths([100, 150, 50]))
    bm = create_block_mask(mod, None, None, 300, 300, BLOCK_SIZE=64)
    _check(q, k, v, mask=bm)
    # blocks that claim more than the mask_mod gives: the kernel would hide their pairs
    kinds = bm.block_kinds()
    nk = kinds.shape[-1]
    idx = torch.arange(nk, dtype=torch.int32).expand(*kinds.shape[:-1], nk).contiguous()
    cnt = torch.full(kinds.shape[:-1], nk, dtype=torch.int32)
    every_full = attnkit.block_mask.BlockMask(
        (300, 300), torch.zeros_like(cnt), torch.zeros_like(idx), cnt, idx, None, None, None,
        None, BLOCK_SIZE=(64, 64), mask_mod=mod)
    spec = build_spec(q, k, v, mask=every_full)
    assert backends.select(spec) is not flash
    assert "agree" in " ".join(backends.reasons(flash, spec))
    out = attnkit.attention(q, k, v, mask=every_full)
    assert torch.allclose(out.double(), ref(q.double(), k.double(), v.double(), mask=every_full),
                          atol=3e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_flash_attentions_rule(dtype):
    q, k, v = _qkv(dtype=dtype, lq=300, d=64)
    for kw in (dict(), dict(causal=True), dict(window=(50, 0))):
        spec = build_spec(q, k, v, **kw)
        assert backends.select(spec) is _auto(spec)
        out = attnkit.attention(q, k, v, backend="flash", **kw)
        assert out.dtype == dtype
        r = ref(q.double(), k.double(), v.double(), **kw)
        mask = None
        if kw:
            mask = torch.ones(300, 300, dtype=torch.bool).tril()
            if "window" in kw:
                mask &= ~torch.ones(300, 300, dtype=torch.bool).tril(-51)
        plain = naive_attention(q, k, v, mask=mask)
        ok, err, base = fa_tolerance_ok(out, r, plain)
        assert ok, (kw, err, base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scratch_memory_is_never_read_before_it_is_written(dtype, monkeypatch):
    """Every buffer the kernel gets comes from torch.empty: filled with NaN here, the result
    must not change. Rows that see no key of the first blocks they visit (a window) once read
    weights left in the scratch row of another layout (bfloat16 pairs), which mattered only
    when the memory held a NaN or an infinity."""
    q, k, v = _qkv(n=1, hq=2, hkv=1, lq=300, d=64, dtype=dtype, grad=True)
    kw = dict(window=(50, 0))
    dout = torch.randn(1, 2, 300, 64, generator=torch.Generator().manual_seed(1)).to(dtype)

    def run():
        out = attnkit.attention(q, k, v, backend="flash", **kw)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))

    clean = run()
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x.fill_(-1)

    monkeypatch.setattr(torch, "empty", poisoned)
    got = run()
    monkeypatch.undo()
    for a, b in zip(got, clean):
        assert bool(torch.isfinite(a).all()) and torch.equal(a, b)
    out = got[0]
    r = ref(q.detach().double(), k.detach().double(), v.detach().double(), **kw)
    assert float((out.double() - r).abs().max()) < (1e-5 if dtype == torch.float32 else 5e-2)


def test_rows_that_see_nothing_get_zero_and_minus_infinity():
    q, k, v = _qkv(lq=100, lk=100)
    out, lse = _check(q, k, v, seqlens_q=torch.tensor([30, 100]),
                      seqlens_kv=torch.tensor([0, 100]))
    assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())
    # a window right of the last key: rows 0..9 see keys 0..9 shifted past the end
    out, lse = _check(*_qkv(lq=64, lk=40), window=(0, 0))
    assert bool((out[:, :, 40:] == 0).all()) and bool(torch.isneginf(lse[:, :, 40:]).all())


BACKWARD = {
    "causal": dict(causal=True),
    "causal_br": dict(causal=True, diagonal="bottom_right"),
    "window": dict(window=(20, 5)),
    "softcap": dict(softcap=3.0, causal=True),
    "alibi": dict(alibi_slopes=torch.rand(4)),
    "relbias_fixed": "relbias",
    "sinks": dict(sinks=torch.randn(4, requires_grad=True), causal=True),
    "seqlens": dict(seqlens_q=torch.tensor([100, 130]), seqlens_kv=torch.tensor([130, 7])),
    "documents": dict(mask=masks.document(torch.tensor([3, 1, 2, 1, 0] * 26))),
    "prefix_lm": dict(mask=masks.prefix_lm(37)),
}


@pytest.mark.parametrize("name", list(BACKWARD))
@pytest.mark.parametrize("shape", [dict(), dict(hkv=1, d=64, dv=16)], ids=str)
@pytest.mark.parametrize("with_lse", [False, True])
def test_backward_matches_the_oracle(name, shape, with_lse):
    """dq, dk, dv (and the sinks' gradient) of a loss on out, and on lse too."""
    kw = _kw("relbias") if BACKWARD[name] == "relbias" else dict(BACKWARD[name])
    q, k, v = _qkv(grad=True, lq=130, **shape)
    spec = build_spec(q, k, v, **kw)
    assert backends.select(spec) is _auto(spec)
    dv = v.shape[-1]
    w = torch.linspace(-1, 1, dv)

    def loss(out, lse):
        fin = lse.isfinite()
        extra = (torch.where(fin, lse, 0) * 0.3).sum() if with_lse else 0
        return (out * w.to(out.dtype)).sum() + extra

    leaves = [q, k, v] + [x for x in kw.values() if isinstance(x, torch.Tensor)
                          and x.requires_grad]
    got = torch.autograd.grad(loss(*attnkit.attention(q, k, v, return_lse=True, backend="flash",
                                                      **kw)), leaves)
    dbl = [x.detach().double().requires_grad_() for x in leaves]
    kwd = {key: dbl[3] if isinstance(val, torch.Tensor) and val.requires_grad else val
           for key, val in kw.items()}
    want = torch.autograd.grad(loss(*ref(*dbl[:3], return_lse=True, **kwd)), dbl)
    for name_, a, b in zip("q k v sinks".split(), got, want):
        scale = max(1.0, b.abs().max().item())
        assert (a.double() - b).abs().max().item() < 3e-6 * scale * 10, (name, name_)


def test_both_passes_are_native_and_a_learnable_table_gets_its_gradient(monkeypatch):
    fwd = spy(monkeypatch, fused, "FWD_OP")
    bwd = spy(monkeypatch, fused, "BWD_OP")
    tiled_bwd = spy(monkeypatch, tiled, "backward")
    kernel = spy(monkeypatch, native.FlashForward, "run")
    kernel_bwd = spy(monkeypatch, native, "flash_backward")
    q, k, v = _qkv(grad=True)
    for kw in (dict(causal=True), dict(softcap=2.0), _kw("relbias")):
        attnkit.attention(q, k, v, backend="flash", **kw).sum().backward()
    assert kernel and kernel_bwd and not fwd and not bwd and not tiled_bwd
    for shape, kw in (((4, 59), dict(causal=True)), ((59,), dict(softcap=3.0)),
                      ((4, 401), dict(window=(30, 30)))):
        table = torch.randn(*shape, requires_grad=True)
        out = attnkit.attention(q, k, v, score_mod=score_mods.relative_bias(table), **kw)
        kernel_bwd.clear()
        got = torch.autograd.grad(out.sum(), (q, table))
        assert kernel_bwd and not tiled_bwd
        qd, td = q.detach().double().requires_grad_(), table.detach().double().requires_grad_()
        r = ref(qd, k.double(), v.double(), score_mod=score_mods.relative_bias(td), **kw)
        want = torch.autograd.grad(r.sum(), (qd, td))
        for a, b in zip(got, want):
            assert (a.double() - b).abs().max().item() < 1e-4, shape


def test_other_learnable_tensors_take_the_next_executors_backward(monkeypatch):
    tiled_bwd = spy(monkeypatch, tiled, "backward")
    q, k, v = _qkv(grad=True)
    values = torch.randn(4, requires_grad=True)
    head = score_mods.head_bias(values)
    assert backends.select(build_spec(q, k, v, score_mod=head)) is not flash
    out = attnkit.attention(q, k, v, score_mod=head)
    (dv,) = torch.autograd.grad(out.sum(), values)
    assert tiled_bwd and torch.isfinite(dv).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_backward_items_of_several_key_blocks(threads):
    """Enough (batch, kv head) rows that each backward item takes several key blocks."""
    q, k, v = _qkv(n=2, hq=8, hkv=4, lq=600, d=32, grad=True)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for kw in (dict(causal=True), dict(window=(100, 20)), dict(softcap=4.0)):
            out = attnkit.attention(q, k, v, **kw)
            got = torch.autograd.grad(out.sum(), (q, k, v))
            qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
            want = torch.autograd.grad(ref(qd, kd, vd, **kw).sum(), (qd, kd, vd))
            for a, b in zip(got, want):
                assert (a.double() - b).abs().max().item() < 2e-5, kw
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dot", [True, False])
def test_bfloat16_dot_products_and_float32_arithmetic_both_keep_the_rule(dot, monkeypatch):
    """Within 3x the error of the float32 result rounded to bfloat16: stricter than
    FlashAttention's rule against a naive bfloat16 computation."""
    monkeypatch.setattr(native, "FLASH_BF16_DOT", dot)
    for d in (64, 48):  # (48: not a multiple of 32, always float32 arithmetic)
        q, k, v = _qkv(dtype=torch.bfloat16, lq=257, lk=333, d=d, dv=32)
        for kw in (dict(), dict(causal=True, diagonal="bottom_right"), dict(window=(40, 0)),
                   dict(softcap=3.0), dict(alibi_slopes=torch.rand(4)),
                   dict(scale=-0.2), dict(scale=0.4, window=(3, 3))):  # (the scale's sign)
            out = attnkit.attention(q, k, v, **kw)
            r = ref(q.double(), k.double(), v.double(), **kw)
            qf, kf, vf = (x.float() for x in (q, k, v))
            plain = attnkit.attention(qf, kf, vf, backend="tiled", **kw).bfloat16()
            ok, err, base = fa_tolerance_ok(out, r, plain, mult=3.0)
            assert ok, (d, kw, err, base)


def test_non_finite_inputs_take_the_next_executors_forward():
    q, k, v = _qkv(lq=70)
    q[0, 1, 5, 3] = float("nan")
    k[1, 0, 9, 0] = float("inf")
    out = attnkit.attention(q, k, v, causal=True)
    same = attnkit.attention(q, k, v, causal=True, backend="fused")
    assert torch.equal(out.isnan(), same.isnan()) and bool(out.isnan().any())
    fin = ~out.isnan()
    assert torch.allclose(out[fin], same[fin], atol=1e-5)


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_inputs_in_both_passes_match_the_fused_executor(where, dtype):
    q, k, v = _qkv(lq=70, dtype=dtype)
    x = {"q": q, "k": k, "v": v}[where]
    x[0, 1, 5, 3] = float("nan")
    x[1, 0, 9, 0] = float("inf")
    grads = []
    for backend in ("auto", "fused"):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attnkit.attention(*leaves, causal=True, backend=backend)
        grads.append((out, *torch.autograd.grad(out.float().sum(), leaves)))
    for a, b in zip(*grads):
        assert torch.equal(a.isnan(), b.isnan())
        fin = ~a.isnan()
        assert torch.allclose(a[fin].float(), b[fin].float(), atol=2e-2)


_NON_FINITE_SCRIPT = r"""
import torch
from attnkit import native
g = torch.Generator().manual_seed(0)
lo = torch.zeros(1, 150, dtype=torch.int64)
hi = torch.full((1, 150), 150)
terms = native.FlashTerms(lo=lo, hi=hi)
# 70 causal rows: no query needs the last key block (keys 128 .. 149)
early = native.FlashTerms(lo=lo[:, :70], hi=torch.arange(1, 71).view(1, 70))
seen = missed = 0
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    q, k, v = (torch.randn(2, 4, 150, 48, generator=g).to(dtype) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    native.flash_forward(q, k, v, 0.1, terms)  # (finite: no error)
    # a full key block and the last one (22 keys), the first and the last square of dims
    for which, n, h, j, c, rows in (("k", 0, 0, 10, 47, 150), ("k", 1, 1, 149, 33, 150),
                                    ("k", 1, 0, 64, 0, 150), ("v", 1, 1, 149, 47, 150),
                                    ("v", 0, 1, 64, 0, 150), ("v", 0, 0, 3, 20, 150),
                                    ("k", 1, 0, 140, 5, 70), ("v", 0, 1, 149, 40, 70)):
        for bad in (float("nan"), float("inf"), -float("inf")):
            kk, vv = k.clone(), v.clone()
            (kk if which == "k" else vv)[n, h, j, c] = bad
            try:
                native.flash_forward(q[:, :, :rows], kk, vv, 0.1,
                                     terms if rows == 150 else early)
                missed += 1
                print("MISSED", dtype, which, n, h, j, c, rows, bad)
            except native.FlashNonFinite:
                seen += 1
print("BITS", native.build_info()["flash_bits"], "SEEN", seen, "MISSED", missed)
"""


@pytest.mark.parametrize("avx512", ["1", "0"], ids=["default", "256-bit"])
def test_a_non_finite_key_or_value_anywhere_is_seen(avx512):
    """The packing of the keys (transposed in registers, square by square) and its look at the
    values see a NaN or an infinity in any key block (a full one, the last partial one, one
    that no query needs) and any square of head dims, in each input dtype, in each build (a
    fresh process each)."""
    import os
    import re
    import subprocess
    import sys
    env = dict(os.environ, ATTNKIT_NATIVE_AVX512=avx512)
    proc = subprocess.run([sys.executable, "-c", _NON_FINITE_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bits, seen, missed = re.search(r"BITS (\d+) SEEN (\d+) MISSED (\d+)", proc.stdout).groups()
    if avx512 == "0":
        assert bits == "256", proc.stdout
    assert (int(seen), int(missed)) == (72, 0), proc.stdout


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(30, 4)), dict(softcap=2.0),
                                dict(alibi_slopes=torch.rand(4), causal=True)], ids=str)
@pytest.mark.parametrize("shape", [dict(), dict(hkv=1, d=64, dv=16, lq=140, lk=203)], ids=str)
def test_dropout_replays_the_reference_keep_mask_in_both_passes(kw, shape):
    q, k, v = _qkv(grad=True, **shape)
    kw = dict(kw, dropout_p=0.3, seed=2**40 + 12345, offset=7)
    assert backends.select(build_spec(q, k, v, **kw)) is flash
    w = torch.linspace(-1, 1, v.shape[-1])
    out = attnkit.attention(q, k, v, **kw)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    r = ref(qd, kd, vd, **kw)
    want = torch.autograd.grad((r * w.double()).sum(), (qd, kd, vd))
    assert (out.double() - r).abs().max().item() < 3e-6
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max().item() < 2e-5
    other = attnkit.attention(q, k, v, **dict(kw, seed=kw["seed"] + 1))
    assert (other - out).abs().max().item() > 1e-2  # (another seed, another mask)


@pytest.mark.parametrize("dot", [True, False])
@pytest.mark.parametrize("dims", [(64, 64), (64, 16)], ids=str)
def test_bfloat16_gradients_keep_the_rule(dot, dims, monkeypatch):
    """dq, dk, dv with bfloat16 dot products (d and dv multiples of 32) or float32 arithmetic,
    within 3x the error of the naive bfloat16 computation (FlashAttention's rule for
    gradients)."""
    monkeypatch.setattr(native, "FLASH_BF16_DOT", dot)
    d, dv = dims
    q, k, v = _qkv(dtype=torch.bfloat16, lq=300, d=d, dv=dv, grad=True)
    w = torch.randn(2, 4, 300, dv)
    mask = torch.ones(300, 300, dtype=torch.bool).tril()
    for kw, m in ((dict(causal=True), mask), (dict(), None)):
        got = torch.autograd.grad((attnkit.attention(q, k, v, **kw).float() * w).sum(),
                                  (q, k, v))
        plain = torch.autograd.grad((naive_attention(q, k, v, mask=m).float() * w).sum(),
                                    (q, k, v))
        dbl = [x.detach().double().requires_grad_() for x in (q, k, v)]
        want = torch.autograd.grad((ref(*dbl, **kw) * w.double()).sum(), dbl)
        for a, b, c in zip(got, plain, want):
            ok, err, base = fa_tolerance_ok(a, c, b, mult=3.0)
            assert ok, (kw, err, base)


def test_dropout_in_bfloat16_keeps_the_rule():
    q, k, v = _qkv(dtype=torch.bfloat16, lq=257, d=64)
    kw = dict(causal=True, dropout_p=0.2, seed=3)
    out = attnkit.attention(q, k, v, **kw)
    r = ref(q.double(), k.double(), v.double(), **kw)
    plain = attnkit.attention(q.float(), k.float(), v.float(), backend="tiled",
                              **kw).bfloat16()
    ok, err, base = fa_tolerance_ok(out, r, plain, mult=3.0)
    assert ok, (err, base)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(window=(70, 10))], ids=str)
def test_threads_do_not_change_the_bits(kw):
    """Whichever worker packs a key block (the first query block to need it), the bits are
    one thread's: 2 threads, and 4 (more than this machine's cores: packing workers lose their
    core while others wait for their blocks); query heads sharing a kv head's blocks."""
    q, k, v = _qkv(n=2, hq=4, hkv=2, lq=333, d=64)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attnkit.attention(q, k, v, backend="flash", **kw)
        for threads in (2, 4):
            torch.set_num_threads(threads)
            for _ in range(3):
                assert torch.equal(attnkit.attention(q, k, v, backend="flash", **kw), one)
    finally:
        torch.set_num_threads(old)


def test_strided_inputs():
    q, k, v = _qkv(lq=96, d=32)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qt.is_contiguous()
    assert torch.equal(attnkit.attention(qt, kt, vt, causal=True),
                       attnkit.attention(q, k, v, causal=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=(40, 0))])
def test_transposed_views_give_the_contiguous_calls_bits(dtype, kw):
    """q, k, v and the output's gradient as (N, L, H, D) tensors seen as (N, H, L, D), the
    layout models pass (rows H * D apart): the forward packs such value rows and asks for such
    query rows ahead, and out, lse and every gradient keep the contiguous call's bits (150
    keys: a partial last block)."""
    q, k, v = _qkv(n=2, hq=4, hkv=2, lq=150, d=32, dv=48, dtype=dtype)
    go = rand(2, 4, 150, 48, dtype=dtype, gen=torch.Generator().manual_seed(1))
    views = [x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in
             (q, k, v, go)]
    assert all(x.stride(2) != x.shape[-1] for x in views)
    got, want = [], []
    for args, res in ((views[:3], got), ([x.requires_grad_() for x in (q, k, v)], want)):
        out, lse = attnkit.attention(*args, return_lse=True, backend="flash", **kw)
        res += [out, lse, *torch.autograd.grad(out, args, views[3] if res is got else go)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw, why", [
    (dict(mask=torch.ones(150, 150, dtype=torch.bool)), "mask"),
    (dict(bias=torch.zeros(150, 150)), "bias"),
    (dict(dropout_p=0.1, dropout_mask=torch.ones(150, 150, dtype=torch.bool)), "dropout_mask"),
    (dict(dropout_p=1.0, seed=0), "dropout"),
    (dict(mask=lambda b, h, i, j: i >= j), "mask_mod"),
    (dict(score_mod=score_mods.softcap(3.0)), "score_mod"),
    (dict(mask=masks.dilated_sliding_window(8, 2)), "interval"),
])
def test_refusals_name_the_feature_and_auto_runs_the_next(kw, why):
    q, k, v = _qkv()
    spec = build_spec(q, k, v, **kw)
    reasons = " ".join(backends.reasons(flash, spec))
    assert why in reasons
    assert backends.select(spec) is not flash
    with pytest.raises(NotImplementedError, match="backend='flash'"):
        attnkit.attention(q, k, v, backend="flash", **kw)


def test_dtypes_and_dims_it_refuses():
    for q, k, v in (_qkv(dtype=torch.float64), _qkv(d=24)):
        spec = build_spec(q, k, v)
        assert backends.reasons(flash, spec) and backends.select(spec) is not flash


def test_without_the_kernel_auto_runs_fused_and_forcing_flash_says_why(monkeypatch):
    monkeypatch.setitem(native._state["info"], "flash", False)
    q, k, v = _qkv()
    spec = build_spec(q, k, v, causal=True)
    assert backends.select(spec) is fused
    with pytest.raises(NotImplementedError, match="flash kernel is unavailable"):
        attnkit.attention(q, k, v, causal=True, backend="flash")


def test_the_wrapper_checks_its_arguments():
    q, k, v = _qkv()
    lo = torch.zeros(1, 150, dtype=torch.int64)
    hi = torch.full((1, 150), 150)
    t = native.FlashTerms(lo=lo, hi=hi)
    with pytest.raises(TypeError, match="one dtype"):
        native.flash_forward(q, k.double(), v, 0.1, t)
    with pytest.raises(ValueError, match="multiples of 16"):
        native.flash_forward(q[..., :8], k[..., :8], v, 0.1, t)
    with pytest.raises(ValueError, match="lo must be"):
        native.flash_forward(q, k, v, 0.1, native.FlashTerms(lo=lo[:, :10], hi=hi))
    with pytest.raises(ValueError, match="rel must be"):
        native.flash_forward(q, k, v, 0.1, native.FlashTerms(lo=lo, hi=hi,
                                                             rel=torch.zeros(1, 10),
                                                             rel_base=149))
    with pytest.raises(ValueError, match="alibi needs ipos"):
        native.flash_forward(q, k, v, 0.1, native.FlashTerms(lo=lo, hi=hi,
                                                             alibi=torch.zeros(1, 4)))
    with pytest.raises(ValueError, match="dout and out must be"):
        native.flash_backward(q, k, v, 0.1, t, torch.zeros(2, 4, 150, 8),
                              torch.zeros(2, 4, 150, 32), torch.zeros(2, 4, 150))
    bad = q.clone()
    bad[1, 2, 3, 4] = float("inf")
    with pytest.raises(native.FlashNonFinite):
        native.flash_forward(bad, k, v, 0.1, t)
    with pytest.raises(native.FlashNonFinite):
        native.flash_backward(q, k, v.masked_fill(v > 3, float("nan")), 0.1, t,
                              torch.zeros(2, 4, 150, 32), torch.zeros(2, 4, 150, 32),
                              torch.zeros(2, 4, 150))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_gradients_written_in_the_inputs_dtype_are_the_float32_ones_rounded(dtype, threads):
    """grad_dtype: the kernel writes dQ, dK and dV in bfloat16/float16 itself (no conversion
    op after it); the same bits as its float32 gradients rounded by torch (GQA, a window,
    more rows than one block)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 150, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 150, 64, generator=g).to(dtype) for _ in range(2))
    lo = (torch.arange(150) - 40).clamp(min=0).view(1, -1)
    hi = (torch.arange(150) + 1).view(1, -1)
    t = native.FlashTerms(lo=lo, hi=hi)
    out, lse = native.flash_forward(q, k, v, 0.125, t)
    dout = torch.randn(2, 4, 150, 64, generator=g).to(dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = native.flash_backward(q, k, v, 0.125, t, dout, out, lse)
        got = native.flash_backward(q, k, v, 0.125, t, dout, out, lse, grad_dtype=dtype)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(got[:3], want[:3]):
        assert a.dtype == dtype and b.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(a, b.to(dtype))
    assert torch.equal(got[4], want[4])  # delta
    with pytest.raises(TypeError, match="grad_dtype"):
        native.flash_backward(q, k, v, 0.125, t, dout, out, lse, grad_dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_row_maxima_that_grow_block_by_block(dtype):
    """The forward keeps a row group's weights on its running maxima while no row's new
    maximum passes its own by more than 8 (base 2), and recomputes them on the new maxima
    when one does. Scores that ramp along the keys, each row by its own step per key block
    (0.5 to 7.9 in the first group of four rows: kept after the first block; 8.1 to 30 and a
    falling one in the second: recomputed on every block), against the float64 oracle:
    output, lse and the rows' largest scores. FlashAttention's rule for bfloat16."""
    steps = [0.5, 2.0, 6.0, 7.9, 8.1, 12.0, 30.0, -3.0]  # base 2, per 64 keys
    lk, d = 512, 16
    g = torch.Generator().manual_seed(5)
    j = torch.arange(lk, dtype=torch.float64)
    q = torch.zeros(1, 1, len(steps), d, dtype=torch.float64)
    k = torch.zeros(1, 1, lk, d, dtype=torch.float64)
    q[0, 0, :, 0] = torch.tensor(steps, dtype=torch.float64) * math.log(2.0) / 64.0
    k[0, 0, :, 0] = j
    q[0, 0, :, 1:] = 0.1 * torch.randn(len(steps), d - 1, generator=g, dtype=torch.float64)
    k[0, 0, :, 1:] = torch.randn(lk, d - 1, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, lk, d, generator=g, dtype=torch.float64)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    request = attnkit.AuxRequest(lse=True, max_scores=True)
    out, aux = attnkit.attention(q, k, v, scale=1.0, backend="flash", return_aux=request)
    qd, kd, vd = (x.double() for x in (q, k, v))
    r, rl = ref(qd, kd, vd, scale=1.0, return_lse=True)
    top = (qd @ kd.transpose(-1, -2)).amax(-1)
    # (scores up to 166: their float32 rounding is the float32 baseline's error too)
    plain = attnkit.attention(q, k, v, scale=1.0, backend="tiled")
    assert fa_tolerance_ok(out, r, plain)[0]
    tol = (1e-6 if dtype == torch.float32 else 4e-3) * top.abs().max().item() + 1e-5
    assert (aux.lse.double() - rl).abs().max().item() < tol
    assert (aux.max_scores.double() - top).abs().max().item() < tol


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gradients_hold_no_more_memory_than_their_size(threads):
    """The backward sums dQ over one float32 buffer per thread; the gradient it returns (and
    the one autograd then keeps as q.grad) owns its own storage, not a view of those buffers,
    which would keep threads x its size alive for as long as the gradient lives. The values
    are the oracle's."""
    q, k, v = _qkv(n=1, hq=4, hkv=2, lq=200, d=32, grad=True)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attnkit.attention(q, k, v, causal=True, backend="flash")
        out.backward(torch.ones_like(out))
    finally:
        torch.set_num_threads(old)
    for x in (q, k, v):
        assert x.grad.untyped_storage().nbytes() == x.grad.numel() * x.grad.element_size()
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    r = ref(qd, kd, vd, causal=True)
    r.backward(torch.ones_like(r))
    for x, xd in zip((q, k, v), (qd, kd, vd)):
        assert (x.grad.double() - xd.grad).abs().max().item() < 3e-5


@pytest.mark.parametrize("shared_kv", [False, True], ids=["own_kv", "kv_shared_by_batch"])
def test_bfloat16_gradients_from_the_kernel_or_summed_in_float32(shared_kv, monkeypatch):
    """The executor has the kernel write bfloat16 gradients, except for a k and v shared by
    the batch (their gradient is summed over it afterwards, in float32); either way the
    oracle's gradients within FlashAttention's rule (3x for gradients)."""
    g = torch.Generator().manual_seed(4)
    q = rand(3, 2, 70, 32, gen=g, dtype=torch.bfloat16, requires_grad=True)
    k, v = (rand(1 if shared_kv else 3, 2, 70, 32, gen=g, dtype=torch.bfloat16,
                 requires_grad=True) for _ in range(2))
    asked = []
    real = native.flash_backward

    def recording(*args, **kwargs):
        asked.append(kwargs.get("grad_dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "flash_backward", recording)
    out = attnkit.attention(q, k, v, causal=True, backend="flash")
    do = rand(*out.shape, gen=g, dtype=torch.bfloat16)
    got = torch.autograd.grad(out, (q, k, v), do)
    assert asked == [None if shared_kv else torch.bfloat16]
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(ref(*x64, causal=True), x64, do.double())
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    plain = torch.autograd.grad(naive_attention(*xs, causal=True), xs, do)
    for a, r, p in zip(got, want, plain):
        assert a.dtype == torch.bfloat16 and a.shape == r.shape
        ok, err, base = fa_tolerance_ok(a, r, p, mult=3.0)
        assert ok, (err, base)


# ---- the 256-bit build (AVX2 + FMA + F16C: flash.c on simd.h's AVX2 backend) -------------

_AVX2_SCRIPT = r"""
import torch, attnkit
from attnkit import backends, masks, native
from attnkit.backends import flash
from attnkit.reference import attention_reference as ref
from attnkit.spec import build_spec
assert native.build_info()["flash_bits"] == 256, native.build_info()
g = torch.Generator().manual_seed(0)
worst = 0.0
cases = [dict(causal=True), dict(window=(40, 3), alibi_slopes=torch.rand(2, 4), softcap=3.0),
         dict(mask=masks.document_from_lengths([64, 1, 85])),
         dict(causal=True, diagonal="bottom_right", sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))]
for dt in (torch.float32, torch.bfloat16):
    for d, dv in ((32, 32), (64, 48), (80, 80), (128, 96)):
        for kw in cases:
            q = torch.randn(2, 4, 150, d, generator=g).to(dt).requires_grad_()
            k = torch.randn(2, 2, 133, d, generator=g).to(dt).requires_grad_()
            v = torch.randn(2, 2, 133, dv, generator=g).to(dt).requires_grad_()
            out, lse = attnkit.attention(q, k, v, return_lse=True, backend="flash", **kw)
            dout = torch.randn(out.shape, generator=g).to(dt)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
            r = ref(qd, kd, vd, **kw)
            rg = torch.autograd.grad(r, (qd, kd, vd), dout.double())
            if dt == torch.float32:
                for a, b in zip((out, *grads), (r, *rg)):
                    worst = max(worst, ((a.double() - b).abs().max() / 3e-5).item())
                continue
            # bfloat16: FlashAttention's rule against the tiled executor's bfloat16 torch ops
            plain = attnkit.attention(q, k, v, backend="tiled", **kw)
            pg = torch.autograd.grad(plain, (q, k, v), dout)
            for a, p, b in zip((out, *grads), (plain, *pg), (r, *rg)):
                err = (a.double() - b).abs().max().item()
                base = (p.double() - b).abs().max().item()
                worst = max(worst, err / (2 * base + 1e-5))
print("WORST", worst)
"""


def test_the_256_bit_build_matches_the_oracle(tmp_path):
    """ATTNKIT_NATIVE_AVX512=0 builds flash.c on 256-bit registers (what CPUs without AVX-512
    run); its forward and backward against the float64 oracle, in a fresh process. The head
    dims take every split of the 256-bit products' columns into tiles of 24 and 16 (32: 16+16,
    48: 24+24, 80: 24+24+16+16, 96: four 24s, 128: four 24s and 16+16)."""
    import os
    import re
    import subprocess
    import sys
    env = dict(os.environ, ATTNKIT_NATIVE_AVX512="0", ATTNKIT_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    worst = float(re.search(r"WORST (\S+)", proc.stdout).group(1))
    assert worst < 1.0, worst


_TINY_WEIGHTS_SCRIPT = r"""
import math, torch, attnkit
from attnkit import native
# row r: key 0 scores 0, key 1 scores -(126 + 4.1 r) ln 2 (weight 2^-(126 + 4.1 r): below
# float32's normal range from r = 1 on); V is 0 on key 0 and 1 on key 1, so the output is the
# weight itself, as small as it is
rows = 6
a = torch.tensor([-(126.0 + 4.1 * r) * math.log(2.0) for r in range(rows)])
q = torch.zeros(1, 1, rows, 16); q[0, 0, :, 0] = a
k = torch.zeros(1, 1, 2, 16); k[0, 0, 1, 0] = 1.0
v = torch.zeros(1, 1, 2, 16); v[0, 0, 1] = 1.0
out = attnkit.attention(q, k, v, scale=1.0, backend="flash")[0, 0, :, 0].double()
want = torch.exp(a.double()) / (1.0 + torch.exp(a.double()))
err = ((out - want).abs() / (2.0 ** -148 + 1e-4 * want)).max().item()
print("BITS", native.build_info()["flash_bits"], "ERR", err, out.tolist())
"""


@pytest.mark.parametrize("avx512", ["1", "0"], ids=["default", "256-bit"])
def test_weights_below_the_normal_range(avx512):
    """Softmax weights between 2^-150 and 2^-126 (float32's subnormals) come out as the oracle's
    in each build (the 256-bit one builds 2^n from a rounding constant instead of scalef: its
    exponent, and the one rounding of a subnormal result, are what this checks); a fresh
    process per build."""
    import os
    import re
    import subprocess
    import sys
    env = dict(os.environ, ATTNKIT_NATIVE_AVX512=avx512)
    proc = subprocess.run([sys.executable, "-c", _TINY_WEIGHTS_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bits, err = re.search(r"BITS (\d+) ERR (\S+)", proc.stdout).groups()
    if avx512 == "0":
        assert bits == "256", proc.stdout
    assert float(err) <= 1.0, proc.stdout


def test_auto_defers_where_the_cost_table_says_fused_is_faster(monkeypatch):
    """auto leaves a dense or plain causal call to the fused executor where this kind's cost
    table (attnkit.backends.costs) says torch's kernel is faster, with or without gradients;
    any other term, a forced backend or a kind without data run flash."""
    from attnkit.backends import costs

    q, k, v = _qkv(lq=128, d=64)
    info = dict(native.build_info(), flash_bits=256)
    monkeypatch.setattr(native, "build_info", lambda: info)
    points = [dict(bh=1, lq=128, lk=128, d=64, dtype=dt, mask=m, mode=mode, flash_ms=1.0,
                   ratio=0.5 if dt == "float32" else 2.0)
              for dt in ("float32", "bfloat16") for m in ("causal", "dense")
              for mode in ("forward", "train")]
    costs.use({"version": costs.VERSION, "kinds": {"avx2": {"points": points}}})
    try:
        qg = q.clone().requires_grad_()
        for kw in (dict(), dict(causal=True)):
            assert backends.select(build_spec(q, k, v, **kw)) is fused
            assert backends.select(build_spec(qg, k, v, **kw)) is fused
            assert backends.select(build_spec(q, k, v, **kw), "flash") is flash
            qb, kb, vb = (x.bfloat16() for x in (q, k, v))
            assert backends.select(build_spec(qb, kb, vb, **kw)) is flash
        for kw in (dict(window=(40, 3)), dict(causal=True, diagonal="bottom_right"),
                   dict(causal=True, alibi_slopes=torch.rand(2, 4)),
                   dict(mask=masks.document_from_lengths([64, 64]))):
            assert backends.select(build_spec(q, k, v, **kw)) is flash, kw
        info["flash_bits"] = 512  # (the table has no avx512 rows)
        assert backends.select(build_spec(q, k, v, causal=True)) is flash
    finally:
        costs.reload()



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_window_edges_at_every_offset_within_a_block(dtype):
    """Windows whose edges fall at every position of a key block (left 0..69 keys, right
    0/5/None; top-left and bottom-right; 130 queries over 200 keys): the kernel computes
    only the 16-key quarters of an edge block some row of a 4-row group sees, and P V only
    its keys, so a wrong edge drops visible keys. Output and gradients against the float64
    oracle by FlashAttention's rule (bf16: with 3x, as the other bf16 tests)."""
    mult = 2.0 if dtype == torch.float32 else 3.0
    for left in list(range(0, 70, 3)) + [15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64]:
        for right, diagonal in ((0, "top_left"), (5, "bottom_right"), (None, "top_left")):
            kw = dict(window=(left, right), diagonal=diagonal)
            q, k, v = _qkv(n=1, hq=4, hkv=4, lq=130, lk=200, d=32, dtype=dtype,
                           seed=left, grad=True)
            out = attnkit.attention(q, k, v, backend="flash", **kw)
            go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
            grads = torch.autograd.grad(out, (q, k, v), go)
            qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
            r = ref(qd, kd, vd, **kw)
            rgrads = torch.autograd.grad(r, (qd, kd, vd), go.double())
            qp, kp, vp = (x.detach().requires_grad_() for x in (q, k, v))
            keep = _window_mask(130, 200, left, right, diagonal)
            plain = naive_attention(qp, kp, vp, mask=keep)
            pgrads = torch.autograd.grad(plain, (qp, kp, vp), go)
            for a, b, c, name in zip((out, *grads), (r, *rgrads), (plain, *pgrads),
                                     ("out", "dq", "dk", "dv")):
                ok, err, base = fa_tolerance_ok(a.detach(), b, c.detach(), mult=mult)
                assert ok, (left, right, diagonal, name, err, base)


def _window_mask(lq, lk, left, right, diagonal):
    """(lq, lk) bool: key j visible to query i under the window, i' = i (+ lk - lq)."""
    i = torch.arange(lq)[:, None] + (lk - lq if diagonal == "bottom_right" else 0)
    j = torch.arange(lk)[None, :]
    keep = j >= i - left
    return keep & (j <= i + right) if right is not None else keep
