"""An fp8 K/V cache held as contiguous ``(N, Hkv, Lk, D)`` tensors (FlashAttention-3's descale
layout): a decoding step reads it in place (each batch row one page for the decode kernel, no
dequantized copy) and equals the float64 oracle on the dequantized inputs; what the in-place
read cannot take (descales that need gradients, attention weights, prefill) runs as before."""

from __future__ import annotations

import pytest
import torch
from conftest import fa_tolerance_ok

import attnkit
from attnkit import native
from attnkit.reference import attention_reference

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernel unavailable")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _inputs(fmt, granularity, lq=1, lk=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 8, lq, 64, generator=g) * 2
    k = torch.randn(3, 2, lk, 64, generator=g)
    v = torch.randn(3, 2, lk, 64, generator=g) * 3
    return [attnkit.quantize_fp8(x, fmt, granularity) for x in (q, k, v)]


def _deq(x8, d):
    d = d.double()
    if d.dim():
        d = d.repeat_interleave(x8.shape[1] // d.shape[-1], -1)[..., None, None]
    return x8.double() * d


def _dequantized_kv(monkeypatch):
    """The shapes of the tensors dequantized by the native pass, call by call."""
    seen = []
    real = native.fp8_dequantize

    def dequantize(x, *args, **kwargs):
        seen.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(native, "fp8_dequantize", dequantize)
    return seen


OPTIONS = [dict(causal=True, diagonal="bottom_right"),
           dict(window=(20, 0), diagonal="bottom_right", softcap=10.0),
           dict(causal=True, diagonal="bottom_right", seqlens_kv=torch.tensor([150, 90, 3])),
           dict(causal=True, diagonal="bottom_right", starts_kv=torch.tensor([0, 40, 149])),
           dict()]


@pytest.mark.parametrize("kw", OPTIONS, ids=["causal", "window_softcap", "right_pad",
                                             "left_pad", "none"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("lq", [1, 3])
def test_a_decoding_step_reads_the_fp8_cache_in_place(kw, fmt, granularity, lq, monkeypatch,
                                                     kernel_pages):
    (q8, dq), (k8, dk), (v8, dv) = _inputs(fmt, granularity, lq=lq)
    pages, dequantized = kernel_pages, _dequantized_kv(monkeypatch)
    with torch.no_grad():
        out = attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk, descale_v=dv, **kw)
    assert pages == [fmt]  # the kernel read the fp8 cache itself
    assert all(shape == tuple(q8.shape) for shape in dequantized)  # only q was dequantized
    assert out.dtype == torch.bfloat16 and out.shape == (3, 8, lq, 64)
    qd, kd, vd = _deq(q8, dq), _deq(k8, dk), _deq(v8, dv)
    ref = attention_reference(qd, kd, vd, **kw)
    plain = attention_reference(qd.bfloat16().double(), kd.bfloat16().double(),
                                vd.bfloat16().double(), **kw).bfloat16()
    ok, err, bound = fa_tolerance_ok(out, ref, plain)
    assert ok, (err, bound)


def test_out_dtype_and_fp8_output_follow_the_options(kernel_pages):
    (q8, dq), (k8, dk), (v8, dv) = _inputs(E4M3, "head")
    pages = kernel_pages
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv, causal=True, diagonal="bottom_right")
    with torch.no_grad():
        f32 = attnkit.attention(q8, k8, v8, out_dtype=torch.float32, **kw)
        o8 = attnkit.attention(q8, k8, v8, out_dtype=E4M3, out_scale=4.0, **kw)
    assert pages == [E4M3, E4M3] and f32.dtype == torch.float32 and o8.dtype == E4M3
    ref = attention_reference(_deq(q8, dq), _deq(k8, dk), _deq(v8, dv), causal=True,
                              diagonal="bottom_right")
    torch.testing.assert_close(f32.double(), ref, atol=1e-5, rtol=1e-4)
    # e4m3 keeps 3 mantissa bits: within half an ulp (2^-4 relative) of the scaled output,
    # plus the error of the output before rounding (bfloat16 q: the kernel may compute in
    # float16, about 1e-3 of the largest output; bounded here by bfloat16's half ulp there)
    slack = 2 ** -8 * ref.abs().max().item()
    assert bool(((o8.double() / 4 - ref).abs() <= ref.abs() * 2 ** -4 + slack).all())


def test_what_the_in_place_read_cannot_take_is_dequantized_as_before(kernel_pages):
    (q8, dq), (k8, dk), (v8, dv) = _inputs(E4M3, "tensor")
    pages = kernel_pages
    kw = dict(descale_q=dq, descale_v=dv, causal=True, diagonal="bottom_right")
    learnable = dk.clone().requires_grad_(True)
    out = attnkit.attention(q8, k8, v8, descale_k=learnable, **kw)  # its gradient
    out.float().sum().backward()
    assert learnable.grad is not None and E4M3 not in pages
    with torch.no_grad():
        _, weights = attnkit.attention(q8, k8, v8, descale_k=dk, return_weights=True, **kw)
        assert weights.shape == (3, 8, 1, 150) and E4M3 not in pages
        prefill = _inputs(E4M3, "tensor", lq=40)
        attnkit.attention(*(x for x, _ in prefill), descale_q=prefill[0][1],
                          descale_k=prefill[1][1], descale_v=prefill[2][1], causal=True)
        assert E4M3 not in pages


def test_bad_fp8_cache_input_still_names_the_argument():
    (q8, dq), (k8, dk), (v8, dv) = _inputs(E4M3, "head")
    with pytest.raises(ValueError, match="descale_k has shape"):
        attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=torch.ones(3, 5), descale_v=dv)
    with pytest.raises(ValueError, match="missing descale_v"):
        attnkit.attention(q8, k8, v8, descale_q=dq, descale_k=dk)
    with pytest.raises(TypeError, match="one fp8 format"):
        attnkit.attention(q8, k8, v8.to(torch.float32).to(E5M2), descale_q=dq, descale_k=dk,
                          descale_v=dv)


# ---- packed (varlen) fp8 caches ------------------------------------------------------------

LENS_K = [50, 7, 130, 1]


def _packed(fmt, granularity, rows, seed=0):
    """Packed q (S * rows, 8, 64) and k, v (sum(LENS_K), 2, 64) quantized per tensor, or per
    head over the packed tokens (descales (1, H): the varlen call's (1, H, T, D) view)."""
    g = torch.Generator().manual_seed(seed)
    xs = (torch.randn(len(LENS_K) * rows, 8, 64, generator=g) * 2,
          torch.randn(sum(LENS_K), 2, 64, generator=g),
          torch.randn(sum(LENS_K), 2, 64, generator=g) * 3)
    out = []
    for x in xs:
        x8, d = attnkit.quantize_fp8(x.transpose(0, 1).unsqueeze(0), fmt, granularity)
        out.append((x8[0].transpose(0, 1).contiguous(), d))
    return out


def _packed_oracle(q8, dq, k8, dk, v8, dv, rows, **kw):
    """Each sequence on its own, float64 on the dequantized inputs (and in bfloat16 for
    FlashAttention's baseline), packed again: (out, plain)."""
    def deq(x8, d):
        d = d.double()
        return x8.double() * (d[0][None, :, None].repeat_interleave(
            x8.shape[1] // d.shape[-1], 1) if d.dim() else d)

    qd, kd, vd = deq(q8, dq), deq(k8, dk), deq(v8, dv)
    outs, plains, start = [], [], 0
    for s, n in enumerate(LENS_K):
        qs = qd[s * rows:(s + 1) * rows].transpose(0, 1)[None]
        ks, vs = (x[start:start + n].transpose(0, 1)[None] for x in (kd, vd))
        outs.append(attention_reference(qs, ks, vs, **kw)[0].transpose(0, 1))
        plains.append(attention_reference(*(x.bfloat16().double() for x in (qs, ks, vs)),
                                          **kw)[0].transpose(0, 1).bfloat16())
        start += n
    return torch.cat(outs), torch.cat(plains)


def _cu(rows):
    cu_q = torch.arange(len(LENS_K) + 1) * rows
    cu_k = torch.tensor([0] + LENS_K).cumsum(0)
    return cu_q, cu_k


PACKED_OPTIONS = [dict(causal=True, diagonal="bottom_right"),
                  dict(window=(20, 0), diagonal="bottom_right", causal=True, softcap=10.0),
                  dict()]


@pytest.mark.parametrize("kw", PACKED_OPTIONS, ids=["causal", "window_softcap", "none"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_packed_decoding_step_reads_the_fp8_cache_in_place(kw, fmt, granularity, rows,
                                                            monkeypatch, kernel_pages):
    """varlen_attention over a packed fp8 cache (every sequence the same number of query
    rows, at most the decode executor's) reads the packed K/V in place: the kernel gets the
    fp8 keys, only q is dequantized, and every sequence equals the float64 oracle on the
    dequantized inputs (FlashAttention's rule), a 1-key and a 7-key sequence among them."""
    if kw.get("window") and rows == 3:
        kw = dict(kw, window=(2, 0))  # (a window shorter than the query block)
    (q8, dq), (k8, dk), (v8, dv) = _packed(fmt, granularity, rows)
    dequantized = _dequantized_kv(monkeypatch)
    cu_q, cu_k = _cu(rows)
    with torch.no_grad():
        out, lse = attnkit.varlen_attention(q8, k8, v8, cu_q, cu_k, descale_q=dq,
                                            descale_k=dk, descale_v=dv, return_lse=True, **kw)
    assert kernel_pages == [fmt]
    assert dequantized == [(1, 8, q8.shape[0], 64)]  # only q
    assert out.shape == (q8.shape[0], 8, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (8, q8.shape[0])
    ref, plain = _packed_oracle(q8, dq, k8, dk, v8, dv, rows, **kw)
    ok, err, bound = fa_tolerance_ok(out, ref, plain)
    assert ok, (err, bound)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window=(2, 0)),
                                dict(window=(3, 1))], ids=["causal", "causal_window", "window"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_packed_fp8_call_with_a_top_left_diagonal_is_right_for_every_sequence(kw, rows):
    """The top-left diagonal (varlen's default) counts from each sequence's first key; a read
    of the packed cache in place that placed it at absolute key positions gave zeros (every
    key masked) for every sequence after the first."""
    (q8, dq), (k8, dk), (v8, dv) = _packed(E4M3, "tensor", rows)
    cu_q, cu_k = _cu(rows)
    with torch.no_grad():
        out = attnkit.varlen_attention(q8, k8, v8, cu_q, cu_k, descale_q=dq, descale_k=dk,
                                       descale_v=dv, **kw)
    ref, plain = _packed_oracle(q8, dq, k8, dk, v8, dv, rows, **kw)
    ok, err, bound = fa_tolerance_ok(out, ref, plain)
    assert ok, (err, bound)


def test_packed_fp8_calls_the_in_place_read_cannot_take_dequantize_as_before(kernel_pages):
    """Sequences with different numbers of query rows, a descale that needs its gradient, an
    option beyond the in-place read's (ALiBi): the call dequantizes the packed K/V (the kernel,
    where it runs, reads a dequantized copy) and the result is the oracle's."""
    (q8, dq), (k8, dk), (v8, dv) = _packed(E4M3, "tensor", 2)
    cu_k = _cu(2)[1]
    uneven = torch.tensor([0, 1, 4, 6, 8])
    with torch.no_grad():
        attnkit.varlen_attention(q8, k8, v8, uneven, cu_k, descale_q=dq, descale_k=dk,
                                 descale_v=dv, causal=True, diagonal="bottom_right")
    assert E4M3 not in kernel_pages
    kernel_pages.clear()
    dk_grad = dk.clone().requires_grad_(True)
    out = attnkit.varlen_attention(q8, k8, v8, _cu(2)[0], cu_k, descale_q=dq, descale_k=dk_grad,
                                   descale_v=dv, causal=True, diagonal="bottom_right")
    out.float().sum().backward()
    assert dk_grad.grad is not None and E4M3 not in kernel_pages
    ref, plain = _packed_oracle(q8, dq, k8, dk, v8, dv, 2, causal=True, diagonal="bottom_right")
    ok, err, bound = fa_tolerance_ok(out.detach(), ref, plain)
    assert ok, (err, bound)
    kernel_pages.clear()
    with torch.no_grad():
        attnkit.varlen_attention(q8, k8, v8, _cu(2)[0], cu_k, descale_q=dq, descale_k=dk,
                                 descale_v=dv, alibi_slopes=torch.full((8,), 0.1))
    assert E4M3 not in kernel_pages


def test_packed_fp8_output_follows_out_dtype_and_out_scale(monkeypatch):
    """varlen_attention with out_dtype=fp8 and out_scale returns fp8(out * out_scale), as
    attention() does (it returned bfloat16 before), in place or dequantizing alike."""
    from attnkit import native

    if native.available():  # one arithmetic for all three (bfloat16 q would take float16,
        monkeypatch.setitem(native._state["info"], "h16", False)  # and bfloat16 P V)
        monkeypatch.setattr(native, "DECODE_BF16_PV", False)
    (q8, dq), (k8, dk), (v8, dv) = _packed(E4M3, "tensor", 1)
    cu_q, cu_k = _cu(1)
    kw = dict(descale_q=dq, descale_k=dk, descale_v=dv, causal=True, diagonal="bottom_right")
    with torch.no_grad():
        plain = attnkit.varlen_attention(q8, k8, v8, cu_q, cu_k, **kw)
        out8 = attnkit.varlen_attention(q8, k8, v8, cu_q, cu_k, out_dtype=E4M3, out_scale=4.0,
                                        **kw)
        wide = attnkit.varlen_attention(q8, k8, v8, cu_q, cu_k, out_dtype=torch.float32, **kw)
    assert out8.dtype == E4M3 and wide.dtype == torch.float32
    assert torch.equal(out8, (plain.float() * 4.0).clamp(-448, 448).to(E4M3))
