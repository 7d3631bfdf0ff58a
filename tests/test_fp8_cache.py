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
    # e4m3 keeps 3 mantissa bits: within half an ulp (2^-4 relative) of the scaled output
    assert bool(((o8.double() / 4 - ref).abs() <= ref.abs() * 2 ** -4 + 1e-3).all())


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
