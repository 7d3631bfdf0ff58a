"""fp8 attention: quantize_fp8's scale rule, fp8 q/k/v with descales against the float64
oracle on the dequantized inputs (FlashAttention's rule, with a plain bfloat16 computation of
the same dequantized inputs as the baseline), p_scale, out_dtype, the amax outputs, gradients
and the errors."""

from __future__ import annotations

import pytest
import torch
from conftest import fa_tolerance_ok

import attnkit
from attnkit import masks, score_mods
from attnkit.reference import attention_reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
B, HQ, HKV, LQ, LK, D = 2, 4, 2, 37, 53, 24


def _inputs(seed=0, dtype=E4M3, granularity="head", lq=LQ, lk=LK, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, lq, D, generator=g) * spread
    k = torch.randn(B, HKV, lk, D, generator=g)
    v = torch.randn(B, HKV, lk, D, generator=g) * 2
    return tuple(attnkit.quantize_fp8(x, dtype, granularity) for x in (q, k, v))


def _deq(x8, d):
    """The real input, float64: x8 * descale (per tensor or per (batch, head))."""
    d = d.double()
    if d.dim():
        d = d.repeat_interleave(x8.shape[-3] // d.shape[-1], -1)[..., None, None]
    return x8.double() * d


def _plain(qd, kd, vd, **kw):
    """The same math done plainly in bfloat16: the oracle's weights rounded to bfloat16, a
    bfloat16 P V (the error baseline of FlashAttention's rule)."""
    _, w = attention_reference(qd.bfloat16().double(), kd.bfloat16().double(),
                               vd.bfloat16().double(), return_weights=True, **kw)
    g = qd.shape[-3] // kd.shape[-3]
    return w.bfloat16() @ vd.bfloat16().repeat_interleave(g, -3)


def _check(out, qd, kd, vd, mult=2.0, **kw):
    ref = attention_reference(qd, kd, vd, **kw)
    ok, err, base = fa_tolerance_ok(out, ref, _plain(qd, kd, vd, **kw), mult)
    assert ok, (err, base)
    return ref


# ---- quantize_fp8 -------------------------------------------------------------------------


def test_quantize_scale_rule_by_hand():
    """cuDNN's suggested scale: max / amax rounded down to a power of two."""
    x = torch.tensor([[0.5, -3.0], [1.0, 2.0]])
    x8, d = attnkit.quantize_fp8(x)  # 448 / 3 = 149.3 -> 128
    assert x8.dtype == E4M3 and d.dtype == torch.float32 and d.shape == ()
    assert d.item() == 1 / 128
    assert x8.float().tolist() == [[64.0, -384.0], [128.0, 256.0]]
    _, d = attnkit.quantize_fp8(x, E5M2)  # 57344 / 3 = 19114.7 -> 16384
    assert d.item() == 1 / 16384
    _, d = attnkit.quantize_fp8(torch.full((2, 2), 448.0))  # exactly the max: scale 1
    assert d.item() == 1.0
    _, d = attnkit.quantize_fp8(torch.full((2, 2), 449.0))  # just above: 0.5
    assert d.item() == 2.0


def test_quantize_amax_zero_and_tiny():
    x8, d = attnkit.quantize_fp8(torch.zeros(3, 4))
    assert d.item() == 1.0 and not x8.float().any()
    x8, d = attnkit.quantize_fp8(torch.full((2, 2), 1e-30))
    assert torch.isfinite(d) and d > 0
    assert torch.allclose(x8.float() * d, torch.full((2, 2), 1e-30), rtol=0.07)


def test_quantize_per_head_layout_and_round_trip():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 17, 8, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).view(1, 3, 1, 1)
    x8, d = attnkit.quantize_fp8(x, granularity="head")
    assert d.shape == (2, 3)  # FlashAttention-3: (batch, heads)
    amax = x.abs().amax(dim=(-2, -1))
    scale = 1 / d
    assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(448 / amax))))
    back = x8.float() * d[..., None, None]
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value (subnormals: 2^-10)
    bound = torch.maximum(x.abs() * 2 ** -4, 2 ** -10 * d[..., None, None])
    assert bool(((back - x).abs() <= bound).all())
    # per head is finer than per tensor on heads of very different size
    x8t, dt = attnkit.quantize_fp8(x)
    err_t = (x8t.float() * dt - x)[:, 0].abs().max()
    assert (back - x)[:, 0].abs().max() < err_t / 3


def test_quantize_refuses_bad_input():
    with pytest.raises(ValueError, match="inf or NaN"):
        attnkit.quantize_fp8(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="dtype must be torch.float8"):
        attnkit.quantize_fp8(torch.ones(2, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="granularity='head' needs"):
        attnkit.quantize_fp8(torch.ones(2, 2), granularity="head")
    with pytest.raises(ValueError, match="granularity must be"):
        attnkit.quantize_fp8(torch.ones(2, 2), granularity="row")
    with pytest.raises(TypeError, match="float tensor"):
        attnkit.quantize_fp8(torch.ones(2, 2, dtype=torch.int32))


# ---- attention on fp8 inputs ---------------------------------------------------------------

CASES = {
    "plain": {},
    "causal": {"causal": True},
    "bottom_right_window": {"window": (9, 2), "diagonal": "bottom_right"},
    "padding": {"seqlens_q": [37, 20], "seqlens_kv": [40, 53], "causal": True},
    "documents": {"mask": masks.document(torch.arange(LQ) // 11, torch.arange(LK) // 16)},
    "alibi": {"alibi_slopes": score_mods.alibi_slopes(HQ), "causal": True},
    "softcap": {"softcap": 4.0},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_fp8_matches_the_dequantized_oracle(name, granularity):
    kw = CASES[name]
    (q8, dq), (k8, dk), (v8, dv) = _inputs(granularity=granularity)
    out = attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == (B, HQ, LQ, D)
    _check(out, _deq(q8, dq), _deq(k8, dk), _deq(v8, dv), **kw)


@pytest.mark.parametrize("backend", ["fused", "tiled"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_fp8_each_executor_and_format(backend, fmt):
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=2, dtype=fmt)
    out = attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, causal=True,
                            backend=backend)
    _check(out, _deq(q8, dq), _deq(k8, dk), _deq(v8, dv), causal=True)


def test_fp8_descale_layouts_are_the_same_call():
    """A python float, a 0-d tensor, (B, Hkv) for q (FlashAttention-3: one per query group)
    and (B, Hq): each means x8 * descale."""
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=3, granularity="tensor")
    base = attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)
    same = attnkit.attention(q8, k8, v8, descale_q=dq.item(), descale_k=dk.expand(B, HKV),
                             descale_v=dv.reshape(1))
    assert torch.equal(base, same)
    per_group = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    out = attnkit.attention(q8, k8, v8, descale_q=per_group, descale_k=dk, descale_v=dv)
    qd = q8.double() * per_group.double().repeat_interleave(2, -1)[..., None, None]
    _check(out, qd, _deq(k8, dk), _deq(v8, dv))


def test_fp8_out_dtype_float32_is_more_accurate():
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=4)
    out = attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv,
                            out_dtype=torch.float32, causal=True)
    assert out.dtype == torch.float32
    ref = attention_reference(_deq(q8, dq), _deq(k8, dk), _deq(v8, dv), causal=True)
    assert (out.double() - ref).abs().max() < 1e-5  # no bfloat16 rounding anywhere


def test_fp8_output_with_out_scale_and_amax():
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=5)
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv, causal=True)
    out, aux = attnkit.attention(q8, k8, v8, **kw, return_aux=attnkit.AuxRequest(
        amax_s=True, amax_o=True))
    o8, aux8 = attnkit.attention(q8, k8, v8, **kw, out_dtype=E4M3, out_scale=64.0,
                                 return_aux=attnkit.AuxRequest(amax_s=True, amax_o=True))
    assert o8.dtype == E4M3
    assert torch.equal(o8, (out.float() * 64).clamp(-448, 448).to(E4M3))
    assert torch.equal(aux8.amax_o, out.abs().amax().float())  # before out_scale
    ref, w = attention_reference(_deq(q8, dq), _deq(k8, dk), _deq(v8, dv), causal=True,
                                 return_weights=True)
    assert aux.amax_s.dtype == torch.float32 and aux.amax_s.shape == ()
    assert abs(aux.amax_s.item() - w.max().item()) < 1e-5
    assert abs(aux.amax_o.item() - ref.abs().max().item()) < 2e-2  # one bfloat16 rounding


def test_amax_s_on_rows_that_see_no_key_and_small_weights():
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=6, spread=0.3)
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv, seqlens_q=[10, 37], seqlens_kv=[0, 53])
    _, aux = attnkit.attention(q8, k8, v8, **kw, return_aux=attnkit.AuxRequest(amax_s=True))
    _, w = attention_reference(_deq(q8, dq), _deq(k8, dk), _deq(v8, dv), return_weights=True,
                               seqlens_q=[10, 37], seqlens_kv=[0, 53])
    assert torch.isfinite(aux.amax_s) and abs(aux.amax_s.item() - w.max().item()) < 1e-5
    assert aux.amax_s.item() < 0.5  # (not the 1 of a row with one key)


@pytest.mark.parametrize("kw", [{"causal": True}, {"window": (5, 5), "softcap": 3.0},
                                {"dropout_p": 0.2, "seed": 7}])
def test_p_scale_quantizes_the_weights(kw, small_tiles):
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=7)
    qd, kd, vd = _deq(q8, dq), _deq(k8, dk), _deq(v8, dv)
    out = attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, p_scale=16.0,
                            out_dtype=torch.float32, **kw)
    ref = attention_reference(qd, kd, vd, p_scale=16.0, **kw)
    assert (out.double() - ref).abs().max() < 1e-4  # the same rounded P, float32 elsewhere
    unrounded = attention_reference(qd, kd, vd, **kw)
    assert (out.double() - unrounded).abs().max() > 1e-2  # (the rounding shows)


def test_p_scale_runs_on_tiled_only_and_is_forward_only():
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=8)
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv, p_scale=256.0)
    with pytest.raises(NotImplementedError, match="fused does not run p_scale"):
        attnkit.attention(q8, k8, v8, backend="fused", **kw)
    q = _deq(q8, dq).float().requires_grad_(True)
    with pytest.raises(NotImplementedError, match="p_scale .* is forward only"):
        attnkit.attention(q, _deq(k8, dk).float(), _deq(v8, dv).float(), p_scale=256.0)
    out, lse = attnkit.attention_forward(q8, k8, v8, **kw)
    with pytest.raises(NotImplementedError, match="forward only"):
        attnkit.attention_backward(q8, k8, v8, out, lse, torch.ones_like(out), **kw)


def test_fp8_backward_through_attention_backward():
    """Gradients with respect to the dequantized inputs, in bfloat16, for an e5m2 dout (the
    usual gradient format) with its descale."""
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=9)
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv, causal=True)
    out, lse = attnkit.attention_forward(q8, k8, v8, **kw)
    g = torch.Generator().manual_seed(10)
    dout8, ddo = attnkit.quantize_fp8(torch.randn(B, HQ, LQ, D, generator=g), E5M2)
    grads = attnkit.attention_backward(q8, k8, v8, out, lse, dout8, **kw, descale_do=ddo)
    assert grads.dq.dtype == grads.dk.dtype == grads.dv.dtype == torch.bfloat16
    real = [x.requires_grad_(True) for x in (_deq(q8, dq), _deq(k8, dk), _deq(v8, dv))]
    ref = attention_reference(*real, causal=True)
    ref_grads = torch.autograd.grad(ref, real, _deq(dout8, ddo))
    plain = [x.bfloat16().detach().requires_grad_(True) for x in real]
    from conftest import naive_attention

    plain_grads = torch.autograd.grad(naive_attention(*plain, causal=True), plain,
                                      _deq(dout8, ddo).bfloat16())
    for got, want, base in zip(grads[:3], ref_grads, plain_grads):
        ok, err, b = fa_tolerance_ok(got, want, base, mult=3.0)
        assert ok, (err, b)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(5, 3)), dict()],
                         ids=["causal", "window", "none"])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_quantized_gradients_and_their_amax(kw, backend):
    """cuDNN's FP8 backward outputs: grad_dtype=e5m2 with scale_dq/dk/dv stores each gradient
    as fp8(grad * scale) of the unquantized gradient (the same call without them), and
    return_amax gives max |grad| before scaling and max |dO . v_j| over the visible pairs,
    against the float64 oracle's dP on the dequantized inputs."""
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=21)
    kw = dict(kw, descale_q=dq, descale_k=dk, descale_v=dv)
    out, lse = attnkit.attention_forward(q8, k8, v8, **kw)
    dout = torch.randn(B, HQ, LQ, D, generator=torch.Generator().manual_seed(22)).bfloat16()
    plain = attnkit.attention_backward(q8, k8, v8, out, lse, dout, backend=backend, **kw)
    scales = dict(scale_dq=8.0, scale_dk=2.0, scale_dv=0.5)
    grads, amax = attnkit.attention_backward(q8, k8, v8, out, lse, dout, backend=backend,
                                             grad_dtype=E5M2, return_amax=True, **scales,
                                             **kw)
    assert isinstance(amax, attnkit.GradAmax)
    for got, want, scale, top in zip(grads[:3], plain[:3], scales.values(), amax[:3]):
        assert got.dtype == E5M2
        assert torch.equal(got, (want.float() * scale).to(E5M2))
        assert top.dtype == torch.float32 and top.item() == want.float().abs().max().item()
    qd, kd, vd = _deq(q8, dq), _deq(k8, dk), _deq(v8, dv)
    _, w = attention_reference(qd, kd, vd, return_weights=True,
                               **{n: x for n, x in kw.items() if not n.startswith("descale")})
    dp = dout.double() @ vd.repeat_interleave(HQ // HKV, 1).transpose(-1, -2)
    want_dp = dp.abs().masked_fill(w == 0, 0).max().item()
    assert abs(amax.dp.item() - want_dp) <= 1e-2 * want_dp
    g32 = attnkit.attention_backward(q8, k8, v8, out, lse, dout, grad_dtype=torch.float32,
                                     **kw)
    assert all(x.dtype == torch.float32 for x in g32[:3])


@pytest.mark.parametrize("kw", [dict(causal=True), dict()], ids=["causal", "none"])
def test_dp_scale_rounds_dp_inside_the_backward(kw):
    """dp_scale (cuDNN's scale_dP): the gradients are those of dS = P (fp8(dP * s) / s -
    rowsum(dO out)), dP = dO V^T rounded to e5m2, against a float64 computation of the same
    (on the dequantized inputs, in float32 so that dP rounds the same way); dV does not see
    dP. Without dp_scale the gradients differ by far more than the tolerance."""
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=31)
    kw = dict(kw, descale_q=dq, descale_k=dk, descale_v=dv, out_dtype=torch.float32)
    out, lse = attnkit.attention_forward(q8, k8, v8, **kw)
    dout = torch.randn(B, HQ, LQ, D, generator=torch.Generator().manual_seed(32))
    got = attnkit.attention_backward(q8, k8, v8, out, lse, dout, dp_scale=2.0, **kw)
    plain = attnkit.attention_backward(q8, k8, v8, out, lse, dout, **kw)
    qd, kd, vd = (x.double() for x in (_deq(q8, dq), _deq(k8, dk), _deq(v8, dv)))
    g = HQ // HKV
    kg, vg = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    _, w = attention_reference(qd, kd, vd, return_weights=True,
                               **{n: x for n, x in kw.items() if n in ("causal",)})
    dp = dout.double() @ vg.transpose(-1, -2)
    dpq = (dp.float() * 2.0).clamp(-57344, 57344).to(E5M2).double() / 2.0
    delta = (dout.double() * out.double()).sum(-1, keepdim=True)
    ds = w * (dpq - delta)
    scale = D ** -0.5
    want_dq = scale * ds @ kg
    want_dk = (scale * ds.transpose(-1, -2) @ qd).unflatten(1, (HKV, g)).sum(2)
    want_dv = (w.transpose(-1, -2) @ dout.double()).unflatten(1, (HKV, g)).sum(2)
    for name, a, want, b in zip("qkv", got[:3], (want_dq, want_dk, want_dv), plain[:3]):
        err = (a.double() - want).abs().max().item()
        tol = 2e-3 * want.abs().max().item()
        assert err < tol, (name, err, tol)
        far = (b.double() - want).abs().max().item()
        assert far > 5 * tol if name != "v" else far < tol, (name, far, tol)
    with pytest.raises(NotImplementedError, match="dp_scale"):
        attnkit.attention_backward(q8, k8, v8, out, lse, dout, dp_scale=2.0, backend="fused",
                                   **kw)
    with pytest.raises(ValueError, match="dp_scale"):
        attnkit.attention_backward(q8, k8, v8, out, lse, dout, dp_scale=0.0, **kw)


def test_quantized_gradient_options_are_checked():
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=23)
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    out, lse = attnkit.attention_forward(q8, k8, v8, **kw)
    dout = torch.ones_like(out)
    with pytest.raises(ValueError, match="scale_dk"):
        attnkit.attention_backward(q8, k8, v8, out, lse, dout, grad_dtype=E5M2, scale_dq=1.0,
                                   scale_dv=1.0, **kw)
    with pytest.raises(ValueError, match="scale_dq is for an fp8 grad_dtype"):
        attnkit.attention_backward(q8, k8, v8, out, lse, dout, scale_dq=1.0, **kw)
    with pytest.raises(TypeError, match="grad_dtype must be"):
        attnkit.attention_backward(q8, k8, v8, out, lse, dout, grad_dtype=torch.int8, **kw)
    with pytest.raises(ValueError, match="scale_dv"):
        attnkit.attention_backward(q8, k8, v8, out, lse, dout, grad_dtype=E4M3, scale_dq=1.0,
                                   scale_dk=1.0, scale_dv=-2.0, **kw)


def test_fp8_out_in_attention_backward_is_its_dequantized_value():
    """An fp8 output (out_dtype with out_scale) goes back in with descale_o = 1 / out_scale:
    the same gradients as its dequantized bfloat16 value."""
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=14)
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    out8, lse = attnkit.attention_forward(q8, k8, v8, **kw, out_dtype=E4M3, out_scale=32.0)
    assert out8.dtype == E4M3
    dout = torch.randn(B, HQ, LQ, D, generator=torch.Generator().manual_seed(15))
    g8 = attnkit.attention_backward(q8, k8, v8, out8, lse, dout, **kw, descale_o=1 / 32)
    g = attnkit.attention_backward(q8, k8, v8, (out8.float() / 32).bfloat16(), lse, dout, **kw)
    for a, b in zip(g8[:3], g[:3]):
        assert torch.equal(a, b)


def test_descales_get_gradients_and_fp8_tensors_cannot():
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=11, granularity="tensor")
    d = dq.clone().requires_grad_(True)
    out = attnkit.attention(q8, k8, v8, descale_q=d, descale_k=dk, descale_v=dv,
                            out_dtype=torch.float32)
    (out ** 2).sum().backward()
    dd = d.detach().double().requires_grad_(True)
    ref = attention_reference(q8.double() * dd, _deq(k8, dk), _deq(v8, dv))
    (ref ** 2).sum().backward()
    assert abs(d.grad.item() - dd.grad.item()) <= 1e-4 * abs(dd.grad.item()) + 1e-6
    q8.requires_grad_(True)
    with pytest.raises(ValueError, match="q is float8_e4m3fn and requires grad.*dequantized"):
        attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)
    with torch.no_grad():  # nothing to differentiate: fine
        attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv)


def test_fp8_reaches_the_other_front_doors():
    """varlen goes through the same spec: fp8 works there too."""
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=12, granularity="tensor")
    q, k, v = q8[0].transpose(0, 1)[:, :2], k8[0].transpose(0, 1), v8[0].transpose(0, 1)
    cu_q, cu_k = torch.tensor([0, 15, 37]), torch.tensor([0, 20, 53])
    out = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True, descale_q=dq,
                                   descale_k=dk, descale_v=dv)
    want = attnkit.varlen_attention(*(x.double() * d.double() for x, d in ((q, dq), (k, dk),
                                                                          (v, dv))),
                                    cu_q, cu_k, causal=True)
    assert out.dtype == torch.bfloat16
    assert (out.double() - want).abs().max() < 2e-2


# ---- errors --------------------------------------------------------------------------------


def _fp8(seed=13, fmt=E4M3):
    (q8, dq), (k8, dk), (v8, dv) = _inputs(seed=seed, dtype=fmt, granularity="tensor")
    return q8, k8, v8, dict(descale_q=dq, descale_k=dk, descale_v=dv)


def test_missing_descales_are_named():
    q8, k8, v8, kw = _fp8()
    del kw["descale_k"], kw["descale_v"]
    with pytest.raises(ValueError, match="missing descale_k, descale_v"):
        attnkit.attention(q8, k8, v8, **kw)


def test_fp8_mixed_with_bfloat16():
    q8, k8, v8, kw = _fp8()
    with pytest.raises(TypeError, match="q, k are fp8 but v bfloat16"):
        attnkit.attention(q8, k8, v8.to(torch.bfloat16), **kw)


def test_e4m3_with_e5m2_is_refused():
    q8, k8, v8, kw = _fp8()
    with pytest.raises(TypeError, match="one fp8 format; got q float8_e4m3fn, k float8_e5m2"):
        attnkit.attention(q8, k8.float().to(E5M2), v8, **kw)


def test_descale_shapes_and_values():
    q8, k8, v8, kw = _fp8()
    with pytest.raises(ValueError, match=r"descale_k has shape \(2, 4\); expected \(\) or "
                                         r"\(2, 2\) \(batch, kv heads\)"):
        attnkit.attention(q8, k8, v8, **dict(kw, descale_k=torch.ones(2, 4)))
    with pytest.raises(ValueError, match=r"descale_q has shape \(3,\)"):
        attnkit.attention(q8, k8, v8, **dict(kw, descale_q=torch.ones(3)))
    with pytest.raises(ValueError, match="descale_v holds inf or NaN"):
        attnkit.attention(q8, k8, v8, **dict(kw, descale_v=float("nan")))
    with pytest.raises(TypeError, match="descale_q must be a float"):
        attnkit.attention(q8, k8, v8, **dict(kw, descale_q="1"))


def test_descale_for_inputs_that_are_not_fp8():
    q = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="descale_q is for fp8 inputs.*q is float32"):
        attnkit.attention(q, q, q, descale_q=1.0)


def test_out_dtype_and_scale_errors():
    q8, k8, v8, kw = _fp8()
    with pytest.raises(ValueError, match="needs out_scale"):
        attnkit.attention(q8, k8, v8, **kw, out_dtype=E4M3)
    with pytest.raises(ValueError, match="out_scale is for an fp8 out_dtype"):
        attnkit.attention(q8, k8, v8, **kw, out_scale=2.0)
    with pytest.raises(TypeError, match="out_dtype must be"):
        attnkit.attention(q8, k8, v8, **kw, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="p_scale must be a finite float > 0"):
        attnkit.attention(q8, k8, v8, **kw, p_scale=0.0)
    with pytest.raises(ValueError, match="dout is torch.float8_e5m2: pass descale_do"):
        attnkit.attention_backward(q8, k8, v8, torch.zeros(B, HQ, LQ, D),
                                   torch.zeros(B, HQ, LQ), torch.zeros(B, HQ, LQ, D).to(E5M2),
                                   **kw)


# ---- the fp8 paged KV cache ----------------------------------------------------------------

PAGE, NPAGES, CACHE_HKV, CACHE_D = 8, 24, 2, 32


def _fp8_cache(fmt=E4M3, lengths=(29, 17, 40), seed=20, **kw):
    """An fp8 cache and a float32 cache of the same tokens, appended in uneven chunks whose
    magnitude grows (so pages are rescaled as they fill)."""
    g = torch.Generator().manual_seed(seed)
    c8 = attnkit.PagedKVCache(NPAGES, PAGE, CACHE_HKV, CACHE_D, dtype=fmt, **kw)
    c32 = attnkit.PagedKVCache(NPAGES, PAGE, CACHE_HKV, CACHE_D, dtype=torch.float32)
    ids = [f"s{i}" for i in range(len(lengths))]
    for sid in ids:
        c8.allocate(sid)
        c32.allocate(sid)
    for step in range(3):  # interleaved appends: pages of different sequences alternate
        for sid, n in zip(ids, lengths):
            t = n // 3 + (n % 3 if step == 2 else 0)
            k = torch.randn(t, CACHE_HKV, CACHE_D, generator=g) * (1 + 4 * step)
            v = torch.randn(t, CACHE_HKV, CACHE_D, generator=g) * (0.1 + step)
            c8.append(sid, k.bfloat16(), v)
            c32.append(sid, k.bfloat16().float(), v)
    return c8, c32, ids


def _dequantized_pages(cache):
    return (cache.k_pages.double() * cache.k_descale.double()[:, None, :, None],
            cache.v_pages.double() * cache.v_descale.double()[:, None, :, None])


def test_fp8_cache_quantizes_on_append_with_per_page_scales():
    c8, c32, ids = _fp8_cache()
    assert c8.k_pages.dtype == E4M3 and c8.k_descale.shape == (NPAGES, CACHE_HKV)
    k, v = c8.gather(ids, dtype=torch.float64)
    k_true, v_true = c32.gather(ids)
    table, lens = c8.block_table(ids)
    for x, true, descale in ((k, k_true, c8.k_descale), (v, v_true, c8.v_descale)):
        # each (page, head)'s scale is cuDNN's rule for what the page holds
        for b, sid in enumerate(ids):
            for col, page in enumerate(c8.pages_of(sid)):
                held = true[b, :, col * PAGE:min((col + 1) * PAGE, int(lens[b]))]
                amax = held.abs().amax(dim=(1, 2)).float()  # per head
                assert torch.equal(1 / descale[page], torch.exp2(torch.floor(torch.log2(
                    448 / amax))))
        # each value within half an e4m3 ulp (2^-4 relative; subnormals 2^-10 * descale)
        page_of = table.long()[:, torch.arange(true.shape[2]) // PAGE]  # (B, L)
        d = descale[page_of].permute(0, 2, 1)[..., None].double()  # (B, Hkv, L, 1)
        bound = torch.maximum(true.double().abs() * 2 ** -4, d * 2 ** -10)
        assert bool(((x - true.double()).abs() <= bound + 1e-12).all())


@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("kw", [{}, {"window": (11, 0), "softcap": 6.0},
                                {"alibi_slopes": score_mods.alibi_slopes(4),
                                 "sinks": torch.tensor([0.3, -1.0, 0.0, 2.0])}],
                         ids=["plain", "window_softcap", "alibi_sinks"])
def test_fp8_cache_decode_matches_the_oracle(native_on, fmt, kw, fresh_native, monkeypatch):
    """The kernel reading fp8 pages (or, without it, the torch path) against the oracle on
    the dequantized pages, float32 queries (tight) and bfloat16 (FlashAttention's rule)."""
    from conftest import spy

    from attnkit import native
    from attnkit.pages import gather_kv

    if not native_on:
        fresh_native.setenv("ATTNKIT_NATIVE", "0")
    c8, _, ids = _fp8_cache(fmt)
    calls = spy(monkeypatch, native, "paged_decode")
    g = torch.Generator().manual_seed(21)
    q = torch.randn(3, 4, 2, CACHE_D, generator=g)  # two query rows (GQA 2)
    table, lens = c8.block_table(ids)
    kp, vp = _dequantized_pages(c8)
    kd, vd = gather_kv(kp, vp, table, lens)
    want = dict(causal=True, diagonal="bottom_right", seqlens_kv=lens.tolist(), **kw)
    for qq in (q, q.bfloat16()):
        out = attnkit.paged_attention(qq, c8, ids, **kw)
        assert out.dtype == qq.dtype
        ref = attention_reference(qq.double(), kd, vd, **want)
        if qq.dtype == torch.float32:
            assert (out.double() - ref).abs().max() < 2e-5
        else:
            _, w = attention_reference(qq.double(), kd, vd, return_weights=True, **want)
            plain = w.bfloat16() @ vd.bfloat16().repeat_interleave(2, 1)
            ok, err, base = fa_tolerance_ok(out, ref, plain)
            assert ok, (err, base)
    assert bool(calls) == native_on  # the kernel read the fp8 pages itself


def test_fp8_cache_native_and_torch_paths_agree(fresh_native):
    c8, _, ids = _fp8_cache(seed=22)
    q = torch.randn(3, 4, 1, CACHE_D, generator=torch.Generator().manual_seed(23))
    fast = attnkit.paged_attention(q, c8, ids)
    fresh_native.setenv("ATTNKIT_NATIVE", "0")
    from attnkit import native

    native._reset()
    slow = attnkit.paged_attention(q, c8, ids)
    assert (fast - slow).abs().max() < 1e-5


def test_fp8_nan_in_a_page_is_nan_on_both_paths(fresh_native):
    """An e4m3 NaN byte written into a page directly reads as NaN in the kernel's in-register
    conversion, as in torch's (the row that sees it is NaN, the others are not)."""
    from attnkit import native

    c8, _, ids = _fp8_cache(seed=26)
    page = c8.pages_of(ids[1])[0]
    c8.k_pages.view(torch.uint8)[page, 3, 1, 5] = 0x7F  # e4m3fn NaN, kv head 1
    q = torch.randn(3, 4, 1, CACHE_D, generator=torch.Generator().manual_seed(27))
    outs = [attnkit.paged_attention(q, c8, ids)]
    fresh_native.setenv("ATTNKIT_NATIVE", "0")
    native._reset()
    outs.append(attnkit.paged_attention(q, c8, ids))
    for out in outs:
        assert bool(out[1, 2:].isnan().all()) and not bool(out[1, :2].isnan().any())
        assert not bool(out[[0, 2]].isnan().any())


def test_fp8_cache_long_prefill_chunk_matches_the_dequantized_pages():
    """More query rows than the decode kernel takes: the flash kernel reads the pages in
    place, dequantized into q's dtype (or, without it, they are gathered so), with the
    result of attention on the dequantized pages."""
    c8, _, ids = _fp8_cache(seed=24, lengths=(40, 33))
    q = torch.randn(2, 4, 20, CACHE_D, generator=torch.Generator().manual_seed(25))
    out = attnkit.paged_attention(q, c8, ids)
    k, v = c8.gather(ids, dtype=torch.float64)
    ref = attention_reference(q.double(), k, v, causal=True, diagonal="bottom_right",
                              seqlens_kv=[40, 33])
    assert (out.double() - ref).abs().max() < 2e-5


def test_fp8_cache_static_scales():
    c8 = attnkit.PagedKVCache(4, 8, 2, 16, dtype=E4M3, k_descale=torch.tensor([0.5, 2.0]),
                              v_descale=1.0)
    c8.allocate("a")
    k = torch.ones(3, 2, 16) * torch.tensor([96.0, 768.0]).view(1, 2, 1)  # (exact in e4m3)
    c8.append("a", k, torch.full((3, 2, 16), 5.0))
    assert c8.k_descale[0].tolist() == [0.5, 2.0] and c8.k_pages[0, 0, 1, 0].float() == 384
    kk, _ = c8.gather(["a"])
    assert torch.equal(kk[0].transpose(0, 1), k)
    with pytest.raises(ValueError, match=r"k has \|values\| up to 300 in kv head 0, beyond"):
        c8.append("a", torch.full((1, 2, 16), 300.0), torch.zeros(1, 2, 16))
    assert c8.seq_len("a") == 3  # nothing changed


def test_fp8_cache_errors():
    c8 = attnkit.PagedKVCache(4, 8, 2, 16, dtype=E4M3)
    c8.allocate("a")
    with pytest.raises(TypeError, match="an fp8 cache takes the real values"):
        c8.append("a", torch.zeros(2, 2, 16).to(E4M3), torch.zeros(2, 2, 16))
    with pytest.raises(ValueError, match="k holds inf or NaN"):
        c8.append("a", torch.full((2, 2, 16), float("nan")), torch.zeros(2, 2, 16))
    assert c8.seq_len("a") == 0 and c8.num_free_pages == 4
    with pytest.raises(ValueError, match="are for an fp8 cache"):
        attnkit.PagedKVCache(4, 8, 2, 16, k_descale=1.0, v_descale=1.0)
    c8.append("a", torch.randn(5, 2, 16), torch.randn(5, 2, 16))
    table, lens = c8.block_table(["a"])
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(ValueError, match="fp8 pages need k_descale"):
        attnkit.paged_attention_blocks(q, c8.k_pages, c8.v_pages, table, lens)
    with pytest.raises(ValueError, match=r"k_descale has shape \(3,\); expected \(4, 2\)"):
        attnkit.paged_attention_blocks(q, c8.k_pages, c8.v_pages, table, lens,
                                       k_descale=torch.ones(3), v_descale=c8.v_descale)
    with pytest.raises(TypeError, match="over fp8 pages q must be float32, bfloat16"):
        attnkit.paged_attention_blocks(q.double(), c8.k_pages, c8.v_pages, table, lens,
                                       k_descale=c8.k_descale, v_descale=c8.v_descale)
    with pytest.raises(NotImplementedError, match="does not take descale_k"):
        attnkit.paged_attention(q, c8, ["a"], descale_k=1.0)


def test_fp8_kernel_refuses_missing_descales_itself():
    """The C kernel checks its arguments before it runs: fp8 pages without descales, bf16
    query dot products over fp8 keys, a query dtype it does not read, negative query strides
    or key splits without an LSE to merge them by are refused (return code 2), never read."""
    import ctypes

    from attnkit import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    lib = native._lib()
    q = torch.zeros(1, 16)
    pages = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    d = torch.ones(1, 1)
    st = torch.tensor([16, 16, 16], dtype=torch.int64)
    bt = torch.zeros(1, 1, dtype=torch.int64)
    lens = torch.ones(1, dtype=torch.int64)
    dims = torch.tensor([1, 1, 1, 1, 16, 16, 1, 1, 16, 16, 16], dtype=torch.int64)
    bad_q = torch.tensor([1, 1, 1, 1, 16, 16, 1, 1, -16, 16, 16], dtype=torch.int64)
    out, lse = torch.zeros(2, 16), torch.zeros(2)

    def call(kd, vd, dtype=3, bf16_dot=0, q_dtype=0, dims=dims, splits=1, lse_ptr=-1):
        return lib.attnkit_decode(q.data_ptr(), q_dtype, bf16_dot, 1.0, pages.data_ptr(),
                                  pages.data_ptr(), kd, vd, st.data_ptr(), st.data_ptr(),
                                  bt.data_ptr(), 1, lens.data_ptr(), None, dims.data_ptr(),
                                  splits, 1, dtype, 0, 1, 0, 0, 0, 0, ctypes.c_float(0.0), None,
                                  out.data_ptr(), lse.data_ptr() if lse_ptr else None, 1)

    assert call(d.data_ptr(), d.data_ptr(), lse_ptr=None) == 0  # one split needs no LSE
    assert call(None, None) == 2
    assert call(d.data_ptr(), None) == 2
    assert call(d.data_ptr(), d.data_ptr(), bf16_dot=1) == 2  # needs bfloat16 q, D % 32 == 0
    assert call(d.data_ptr(), d.data_ptr(), bf16_dot=2) == 2  # float16 math: the same, e4m3
    assert call(d.data_ptr(), d.data_ptr(), bf16_dot=8) == 2  # no such option
    # bit 2: the value rows lie inside the key rows (MLA); true here (one tensor for both)
    assert call(d.data_ptr(), d.data_ptr(), bf16_dot=4) == 0
    assert call(d.data_ptr(), d.data_ptr(), q_dtype=3) == 2  # q is never fp8
    assert call(d.data_ptr(), d.data_ptr(), dims=bad_q) == 2
    assert call(d.data_ptr(), d.data_ptr(), splits=2, lse_ptr=None) == 2
    assert call(d.data_ptr(), d.data_ptr(), dtype=1) == 2  # descales on bf16 pages
    assert call(d.data_ptr(), d.data_ptr()) == 0
    assert call(None, None, dtype=5) == 2


# ---- fp8 pages by table (bfloat16 queries) --------------------------------------------------


def _pages_oracle(q, k8, v8, kd, vd, bt, lens, window=None):
    """float64 decode of q (B, Hq, Lq, D) over fp8 pages times their (page, head) descales,
    the last Lq positions of each sequence, causal (bottom right) within an optional left
    window."""
    bsz, hq, lq, d = q.shape
    hkv = k8.shape[2]
    out = torch.zeros(bsz, hq, lq, v8.shape[3], dtype=torch.float64)
    for b in range(bsz):
        pages = bt[b]
        kk = (k8[pages].double() * kd[pages].double()[:, None, :, None]).flatten(0, 1)
        vv = (v8[pages].double() * vd[pages].double()[:, None, :, None]).flatten(0, 1)
        n = int(lens[b])
        kk = kk[:n].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vv = vv[:n].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        s = (q[b].double() @ kk.transpose(1, 2)) * d ** -0.5
        i = torch.arange(n - lq, n)[:, None]
        j = torch.arange(n)[None]
        keep = j <= i
        if window is not None:
            keep &= j >= i - window
        out[b] = s.masked_fill(~keep, float("-inf")).softmax(-1) @ vv
    return out


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("hq,hkv,d,dv,page,lq,window", [
    (32, 8, 128, 128, 16, 1, None),  # the decode case: 4 rows a kv head
    (6, 2, 96, 64, 7, 1, None),      # 3 rows a head (the single-row loops), odd blocks of 32
    (4, 2, 64, 48, 5, 3, None),      # values not in blocks of 32: P V by conversion
    (8, 2, 32, 32, 16, 2, 9),        # a window: rows that see part of a chunk
])
def test_fp8_pages_by_table_match_the_conversion_and_the_oracle(dtype, hq, hkv, d, dv, page,
                                                               lq, window, monkeypatch):
    """With bfloat16 queries the kernel converts fp8 pages by table (keys into the bfloat16
    dot products, values to float32): the result is the float32 conversion path's and the
    float64 oracle's on the dequantized pages, per-(page, head) descales, odd page sizes,
    sequences that end mid-chunk, GQA groups of 4 and of 3 rows, windows."""
    from attnkit import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    g = torch.Generator().manual_seed(hq * 100 + d + lq)
    lens = torch.tensor([203, 70, lq + 2])
    cols = -(-int(lens.max()) // page)
    num_pages = 3 * cols + 2
    q = torch.randn(3, hq, lq, d, generator=g).bfloat16()
    # every finite fp8 byte can turn up (denormals and the largest values among them)
    k8 = (torch.randn(num_pages, page, hkv, d, generator=g) * 3).to(dtype)
    v8 = (torch.randn(num_pages, page, hkv, dv, generator=g) * 3).to(dtype)
    kd = torch.rand(num_pages, hkv, generator=g) + 0.5
    vd = torch.rand(num_pages, hkv, generator=g) + 0.5
    bt = torch.randperm(num_pages, generator=g)[:3 * cols].view(3, cols)
    kw = dict(scale=d ** -0.5, k_descale=kd, v_descale=vd,
              window=None if window is None else (window, 0))
    info = native._state["info"]
    monkeypatch.setitem(info, "h16", False)  # (the float16 arithmetic: tests below)
    table, _ = native.paged_decode(q, k8, v8, bt, lens, **kw)
    assert native.DecodeCall(q, dtype, scale=1.0).bf16_dot == bool(info.get("fp8_dot"))
    monkeypatch.setitem(info, "fp8_dot", False)
    assert not native.DecodeCall(q, dtype, scale=1.0).bf16_dot
    converted, _ = native.paged_decode(q, k8, v8, bt, lens, **kw)
    ref = _pages_oracle(q, k8, v8, kd, vd, bt, lens, window)
    tol = 2e-5 * ref.abs().max().item()
    assert (table.double() - ref).abs().max().item() < tol
    assert (converted.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_table_gives_every_byte_its_value(dtype):
    """One key, all of whose scores are 0: the output is its value row, so a value row that
    holds each of the 256 bytes shows the table's value of every byte (NaN, e5m2's infinities,
    signed zeros and denormals among them) against torch's own conversion; a NaN key byte
    makes its rows NaN."""
    from attnkit import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    q = torch.zeros(1, 4, 1, 32).bfloat16()
    k8 = torch.zeros(1, 1, 1, 32, dtype=dtype)
    v8 = torch.arange(256, dtype=torch.uint8).view(dtype).view(1, 1, 1, 256)
    ones = torch.ones(1, 1)
    bt = torch.zeros(1, 1, dtype=torch.int64)
    out, _ = native.paged_decode(q, k8, v8, bt, torch.tensor([1]), scale=1.0, k_descale=ones,
                                 v_descale=ones)
    want = v8.float().view(256).expand(4, 256)
    got = out.view(4, 256)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    nan_byte = torch.tensor([0x7F], dtype=torch.uint8).view(dtype)
    k8[0, 0, 0, 5] = nan_byte[0]
    out, _ = native.paged_decode(q, k8, v8, bt, torch.tensor([1]), scale=1.0, k_descale=ones,
                                 v_descale=ones)
    assert out.isnan().all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_fp8_special_byte_in_every_position_of_the_rows(dtype, tensor):
    """A NaN byte (in e5m2 values also an infinity) at every position of a 128-byte row, in
    the first and second key of a pair and in an odd last key: the kernel converts 16 bytes
    at a time and (AVX2, e4m3) looks for NaN 32 bytes at a time before converting without the
    NaN step, so each position goes through its own lanes. The kv head that holds it gets
    what the dequantized value gives (a key's NaN: its rows NaN; a value's: NaN or the
    infinity in that dim), and every other result keeps the clean call's bits."""
    from attnkit import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    g, lens, k8, v8, kd, vd, bt = _e4m3_case(8, 2, 128, 128, 16, [21], 31)
    if dtype == E5M2:
        k8, v8 = k8.float().to(E5M2), v8.float().to(E5M2)
    q = torch.randn(1, 8, 1, 128, generator=g).bfloat16()
    kw = dict(scale=0.05, k_descale=kd, v_descale=vd)
    clean, _ = native.paged_decode(q, k8, v8, bt, lens, **kw)
    assert not clean.isnan().any()
    specials = [0x7F, 0xFF] + ([0x7E] if dtype == E5M2 else [])
    if dtype == E5M2 and tensor == "v":
        specials += [0x7C, 0xFC]  # (+-inf: in a key, an infinite score of either sign)
    tokens = [0, 1, 10, 19, 20]  # (pairs (0, 1), (10, 11), (18, 19); 20 the odd last key)
    for pos in range(128):
        byte, token, head = specials[pos % len(specials)], tokens[pos % 5], pos % 2
        page, slot = bt[0, token // 16], token % 16
        k_x, v_x = k8.clone(), v8.clone()
        x = k_x if tensor == "k" else v_x
        x.view(torch.uint8)[page, slot, head, pos] = byte
        out, _ = native.paged_decode(q, k_x, v_x, bt, lens, **kw)
        rows = slice(4 * head, 4 * head + 4)
        mine = torch.zeros_like(out, dtype=torch.bool)
        if tensor == "k":
            mine[0, rows] = True
            assert out[mine].isnan().all(), (pos, byte, token)
        else:
            mine[0, rows, :, pos] = True
            want = torch.tensor([byte], dtype=torch.uint8).view(dtype).float()
            got = out[mine]
            if want.isnan().all():
                assert got.isnan().all(), (pos, byte, token)
            else:
                assert torch.equal(got, want.expand_as(got)), (pos, byte, token, got)
            mine[0, rows] = True  # (the head's other dims: its sums took the same path)
            assert torch.allclose(out[mine & ~out.isinf() & ~out.isnan()],
                                  clean[mine & ~out.isinf() & ~out.isnan()], rtol=0, atol=1e-6)
        assert torch.equal(out[~mine], clean[~mine]), (pos, byte, token)


# ---- e4m3 pages in float16 arithmetic (AVX512-FP16, bfloat16 queries) --------------------


def _h16_native():
    from attnkit import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    if not native.build_info().get("h16"):
        pytest.skip("this CPU has no AVX512-FP16: e4m3 pages take the exact paths only")
    return native


def _e4m3_case(hq, hkv, d, dv, page, lens, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens)
    cols = -(-int(lens.max()) // page)
    num_pages = len(lens) * cols + 2
    k8 = (torch.randn(num_pages, page, hkv, d, generator=g) * 3).to(E4M3)
    v8 = (torch.randn(num_pages, page, hkv, dv, generator=g) * 3).to(E4M3)
    kd = torch.rand(num_pages, hkv, generator=g) + 0.5
    vd = torch.rand(num_pages, hkv, generator=g) + 0.5
    bt = torch.randperm(num_pages, generator=g)[:len(lens) * cols].view(len(lens), cols)
    return g, lens, k8, v8, kd, vd, bt


@pytest.mark.parametrize("hq,hkv,d,dv,page,lq,window,lens", [
    (32, 8, 128, 128, 16, 1, None, [203, 70, 3]),  # the decode case: 4 rows a kv head
    (8, 2, 96, 160, 7, 2, 9, [203, 70, 4]),  # 8 rows a head, D in 3 blocks, Dv 128 + 32, window
    (8, 2, 64, 64, 256, 1, None, [600, 129, 2]),  # 256-token pages in 64-token segments
])
def test_e4m3_pages_in_float16_arithmetic_are_within_flash_rule(hq, hkv, d, dv, page, lq,
                                                                window, lens, monkeypatch):
    """On a CPU with AVX512-FP16, bfloat16 queries over e4m3 pages are computed with float16
    products and short float16 sums (decode.c, AK_H16): within FlashAttention's rule of the
    float64 oracle on the dequantized pages (the plain computation: the oracle's weights and
    the values in bfloat16), per-(page, head) descales, odd page sizes, windows; and not the
    exact paths' result (which stays within 2e-5), so the float16 path is the one that ran."""
    native = _h16_native()
    g, lens, k8, v8, kd, vd, bt = _e4m3_case(hq, hkv, d, dv, page, lens, hq + d + page)
    q = torch.randn(len(lens), hq, lq, d, generator=g).bfloat16()
    kw = dict(scale=d ** -0.5, k_descale=kd, v_descale=vd,
              window=None if window is None else (window, 0))
    assert native.DecodeCall(q, E4M3, scale=1.0).h16
    fast, _ = native.paged_decode(q, k8, v8, bt, lens, **kw)
    monkeypatch.setitem(native._state["info"], "h16", False)
    assert not native.DecodeCall(q, E4M3, scale=1.0).h16
    exact, _ = native.paged_decode(q, k8, v8, bt, lens, **kw)
    ref = _pages_oracle(q, k8, v8, kd, vd, bt, lens, window)
    assert (exact.double() - ref).abs().max().item() < 2e-5 * ref.abs().max().item()
    assert not torch.equal(fast, exact)
    for b in range(len(lens)):  # the plain computation, sequence by sequence
        pages = bt[b]
        n = int(lens[b])
        kk = (k8[pages].double() * kd[pages].double()[:, None, :, None]).flatten(0, 1)[:n]
        vv = (v8[pages].double() * vd[pages].double()[:, None, :, None]).flatten(0, 1)[:n]
        kk = kk.repeat_interleave(hq // hkv, 1).transpose(0, 1)
        vv = vv.repeat_interleave(hq // hkv, 1).transpose(0, 1)
        s = (q[b].double() @ kk.transpose(1, 2)) * d ** -0.5
        i, j = torch.arange(n - lq, n)[:, None], torch.arange(n)[None]
        keep = (j <= i) & ((j >= i - window) if window is not None else True)
        w = s.masked_fill(~keep, float("-inf")).softmax(-1)
        plain = w.bfloat16() @ vv.bfloat16()
        ok, err, base = fa_tolerance_ok(fast[b], ref[b], plain)
        assert ok, (b, err, base)


def test_e4m3_float16_values_are_exact_for_every_byte():
    """One key: the output is its value row times the descale, so a row holding every e4m3
    byte but the two NaNs (signed zeros, denormals, 448) shows the float16 conversion of
    each, against torch's; a NaN value byte (or key byte) leaves that page and head to the
    exact paths, which give NaN."""
    native = _h16_native()
    q = torch.randn(1, 4, 1, 32).bfloat16()
    k8 = torch.randn(1, 1, 1, 32).to(E4M3)
    b = torch.arange(256, dtype=torch.uint8)
    b[0x7F], b[0xFF] = 0x00, 0x80
    v8 = b.view(E4M3).view(1, 1, 1, 256)
    half = torch.full((1, 1), 0.5)
    bt = torch.zeros(1, 1, dtype=torch.int64)
    out, _ = native.paged_decode(q, k8, v8, bt, torch.tensor([1]), scale=1.0, k_descale=half,
                                 v_descale=half)
    assert torch.equal(out.view(4, 256), (v8.float().view(256) * 0.5).expand(4, 256))
    for pages, col in ((v8, 7), (k8, 5)):
        pages = pages.clone()
        pages.view(torch.uint8)[0, 0, 0, col] = 0xFF
        k, v = (pages, v8) if pages.shape == k8.shape else (k8, pages)
        out, _ = native.paged_decode(q, k, v, bt, torch.tensor([1]), scale=1.0,
                                     k_descale=half, v_descale=half)
        assert out.view(4, 256)[:, col].isnan().all()


def test_e4m3_nan_pages_and_calls_the_float16_path_does_not_take_are_exact(monkeypatch):
    """A NaN byte in one (page, kv head) of K and one of V: those heads' rows are NaN where
    they see it and every other result is the float16 path's; what does not qualify (the
    sequence of a non-finite query element, 3 query rows a kv head, float32 queries) gets
    the exact paths' bits."""
    native = _h16_native()
    g, lens, k8, v8, kd, vd, bt = _e4m3_case(8, 2, 64, 64, 16, [100, 40], 3)
    q = torch.randn(2, 8, 1, 64, generator=g).bfloat16()
    kw = dict(scale=0.125, k_descale=kd, v_descale=vd)
    clean, _ = native.paged_decode(q, k8, v8, bt, lens, **kw)
    k_nan, v_nan = k8.clone(), v8.clone()
    k_nan.view(torch.uint8)[bt[0, 2], 3, 1, 10] = 0x7F  # sequence 0, kv head 1 (rows 4-7)
    v_nan.view(torch.uint8)[bt[1, 1], 0, 0, 20] = 0xFF  # sequence 1, kv head 0 (rows 0-3)
    out, _ = native.paged_decode(q, k_nan, v_nan, bt, lens, **kw)
    nan = out.isnan()
    assert nan[0, 4:].all() and nan[1, :4, :, 20].all()  # (a value's NaN: its own dim)
    assert nan.sum() == 4 * 64 + 4
    assert torch.equal(out[0, :4], clean[0, :4]) and torch.equal(out[1, 4:], clean[1, 4:])

    q_inf = q.clone()
    q_inf[1, 2, 0, 5] = float("inf")
    g3, lens3, k3, v3, kd3, vd3, bt3 = _e4m3_case(6, 2, 64, 64, 16, [50, 9], 4)
    q3 = torch.randn(2, 6, 1, 64, generator=g3).bfloat16()
    cases = [(q_inf, k8, v8, bt, lens, kw),
             (q3, k3, v3, bt3, lens3, dict(scale=0.125, k_descale=kd3, v_descale=vd3)),
             (q.float(), k8, v8, bt, lens, kw)]
    fast = [native.paged_decode(a, k, v, t, n, **o)[0] for a, k, v, t, n, o in cases]
    monkeypatch.setitem(native._state["info"], "h16", False)
    exact = [native.paged_decode(a, k, v, t, n, **o)[0] for a, k, v, t, n, o in cases]
    fast[0], exact[0] = fast[0][1], exact[0][1]  # (the infinite element's sequence)
    for f, e in zip(fast, exact):
        assert torch.equal(f.nan_to_num(), e.nan_to_num()) and torch.equal(f.isnan(), e.isnan())


@pytest.mark.parametrize("dv,token,tensor", [
    (64, 12, "k"),  # a key byte in a 13-token segment's last token (the 4-key groups' remainder)
    (160, 3, "v"),  # a value byte in dim 150: the second 128-dim block of P V
])
def test_e4m3_nan_byte_is_found_by_the_loops_that_convert_it(dv, token, tensor):
    """The float16 loops look at the bytes they convert: a NaN byte anywhere in a (page
    segment, kv head) sends that head to the exact paths (with 8 query rows a head, so two
    groups of 4), and every other head's output keeps the float16 path's bits."""
    native = _h16_native()
    g, lens, k8, v8, kd, vd, bt = _e4m3_case(16, 2, 64, dv, 16, [45, 30], 5)
    q = torch.randn(2, 16, 1, 64, generator=g).bfloat16()
    kw = dict(scale=0.125, k_descale=kd, v_descale=vd)
    clean, _ = native.paged_decode(q, k8, v8, bt, lens, **kw)
    k_nan, v_nan = k8.clone(), v8.clone()
    if tensor == "k":  # sequence 0, tokens 32-44 (page column 2), kv head 1: rows 8-15
        k_nan.view(torch.uint8)[bt[0, 2], token, 1, 5] = 0xFF
        rows, seq, dims = slice(8, 16), 0, slice(None)
    else:  # sequence 1, kv head 0: rows 0-7, dim 150 only
        v_nan.view(torch.uint8)[bt[1, 1], token, 0, 150] = 0x7F
        rows, seq, dims = slice(0, 8), 1, slice(150, 151)
    out, _ = native.paged_decode(q, k_nan, v_nan, bt, lens, **kw)
    want = torch.zeros_like(out, dtype=torch.bool)
    want[seq, rows, :, dims] = True
    assert torch.equal(out.isnan(), want)
    head = torch.zeros_like(want)
    head[seq, rows] = True  # (a value NaN: the head's other dims, this segment, exactly)
    assert torch.equal(out[~head], clean[~head])
    ok = ~want & head
    assert torch.allclose(out[ok], clean[ok], rtol=2e-2, atol=2e-2)


# ---- the benchmark's fp8 cases -------------------------------------------------------------


@pytest.mark.parametrize("extra", [{"fp8": "e4m3"}, {"fp8": "e4m3", "page_size": 16}],
                         ids=["prefill", "paged_decode"])
def test_bench_fp8_cases_run_attnkit_on_quantized_inputs(extra):
    """The benchmark's fp8 peers: attnkit quantizes (per head, or into an fp8 cache) and its
    output is the oracle's on the dequantized inputs; peers without fp8 decline."""
    from attnkit.bench.cases import Case, catalog
    from attnkit.bench.peers import PEERS, make_call, paged_cache
    from attnkit.bench.workloads import make_workload

    decode = "page_size" in extra
    case = Case("t_fp8", batch=2, heads_q=4, heads_kv=2, len_q=1 if decode else 40,
                len_kv=70 if decode else None, d_qk=16, causal=True,
                diagonal="bottom_right" if decode else "top_left", passes=("fwd",),
                extra=extra)
    assert "fp8" in case.features() and PEERS["sdpa"].supports(case, "fwd")
    w = make_workload(case, torch.bfloat16)
    out = make_call(PEERS["attnkit"], w, "fwd")()
    if decode:
        k, v = paged_cache(w).gather(list(range(case.batch)), dtype=torch.float64)
    else:
        (k8, dk), (v8, dv) = (attnkit.quantize_fp8(x, E4M3, "head") for x in (w.k, w.v))
        k, v = _deq(k8, dk), _deq(v8, dv)
        q8, dq = attnkit.quantize_fp8(w.q, E4M3, "head")
    q = w.q.double() if decode else _deq(q8, dq)
    kw = dict(causal=True, diagonal=case.diagonal)
    ok, err, base = fa_tolerance_ok(out, attention_reference(q, k, v, **kw),
                                    _plain(q, k, v, **kw))
    assert ok, (err, base)
    big = catalog()["paged_decode_fp8" if decode else "causal_4k_fp8"]
    assert big.features() - {"fp8"} == catalog()[
        "paged_decode" if decode else "causal_4k"].features()


def test_bench_wide_cache_peer_times_the_same_kv_in_a_16_bit_cache():
    """``--peers attnkit,attnkit-wide``: on an fp8 paged case the yardstick runs
    paged_attention over the same K/V in a bfloat16 cache (the oracle's result on the
    unquantized K/V), so its ratio to attnkit is the fp8 cache's speedup; it declines every
    other case."""
    from attnkit.bench.cases import Case, catalog
    from attnkit.bench.peers import PEERS, make_call, paged_cache
    from attnkit.bench.workloads import make_workload

    wide = PEERS["attnkit-wide"]
    case = Case("t_fp8_wide", batch=2, heads_q=4, heads_kv=2, len_q=1, len_kv=70, d_qk=16,
                causal=True, diagonal="bottom_right", passes=("fwd",),
                extra={"fp8": "e4m3", "page_size": 16})
    assert wide.supports(case, "fwd") == []
    assert wide.supports(catalog()["paged_decode"], "fwd")
    assert wide.supports(catalog()["causal_4k_fp8"], "fwd")
    w = make_workload(case, torch.bfloat16)
    assert paged_cache(w, wide=True).k_pages.dtype == torch.bfloat16
    out = make_call(wide, w, "fwd")()
    kw = dict(causal=True, diagonal="bottom_right")
    ref = attention_reference(w.q.double(), w.k.double(), w.v.double(), **kw)
    ok, err, base = fa_tolerance_ok(out, ref, _plain(w.q.double(), w.k.double(), w.v.double(),
                                                     **kw))
    assert ok, (err, base)


def test_fp8_pages_are_a_feature_only_decode_declares():
    """An executor that reads pages but not their descales must refuse fp8 pages."""
    from attnkit import backends
    from attnkit.ops import stand_ins
    from attnkit.spec import PagedKV, build_spec

    c8, _, ids = _fp8_cache(seed=28)
    table, lens = c8.block_table(ids)
    k, v = stand_ins(c8.k_pages, c8.v_pages, table, dtype=torch.float32)
    spec = build_spec(torch.randn(3, 4, 1, CACHE_D), k, v, seqlens_kv=lens.long(),
                      paged=PagedKV(c8.k_pages, c8.v_pages, table.long(), c8.k_descale,
                                    c8.v_descale))
    assert {"paged_kv", "fp8_kv"} <= spec.features()
    why = backends.explain(spec)
    assert why["decode"] == [] and any("fp8_kv" in r for r in why["triton"])


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dequantization_is_the_torch_cast_bit_for_bit(fmt, dtype):
    """The kernel's one-pass x8 * descale (every byte value, NaN included, slabs whose length
    is no multiple of 16) against torch's fp8 cast and float32 multiply."""
    from attnkit import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    x = torch.arange(256, dtype=torch.uint8).repeat(6)[:3 * 2 * 9 * 28].view(fmt)
    x = x.view(3, 2, 9, 28)
    d = torch.tensor([[0.5, 3.0], [1e-3, 7.25], [1.0, 2.0 ** -20]])
    got = native.fp8_dequantize(x, d, dtype)
    want = (x.float() * d[..., None, None]).to(dtype)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.float().nan_to_num(0.0), want.float().nan_to_num(0.0))
    scalar = native.fp8_dequantize(x, torch.tensor(0.75), dtype)
    assert torch.equal(scalar.float().nan_to_num(0.0),
                       (x.float() * 0.75).to(dtype).float().nan_to_num(0.0))
