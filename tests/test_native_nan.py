"""NaN and infinities in the native decode kernel: they propagate as in softmax(s) =
exp(s - max) / sum over the keys a row sees (torch's math attention), and keys a row does not
see never reach it, whatever they hold."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import fa_tolerance_ok, naive_attention, rand
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnkit import native
from attnkit.paged import paged_attention_blocks
from attnkit.reference import attention_reference

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native kernel: {native.unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN, INF = float("nan"), float("inf")
LENS = [40, 77, 23]
HQ, HKV, PAGE = 8, 2, 8


def _skip_f16(dtype):
    if dtype == torch.float16 and not native.build_info().get("f16"):
        pytest.skip("compiler without _Float16")


def _visibility(lens, lq, lk, window=None, causal=True, diagonal="bottom_right"):
    """(B, 1, Lq, Lk) bool: which keys each query row sees (i' as in the kernel)."""
    i = torch.arange(lq).view(1, lq, 1)
    j = torch.arange(lk).view(1, 1, lk)
    length = torch.as_tensor(lens).view(-1, 1, 1)
    ip = i + length - lq if diagonal == "bottom_right" else i.expand(len(lens), lq, 1)
    vis = j < length
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        vis = vis & (j >= ip - left)
    if right is not None:
        vis = vis & (j <= ip + right)
    return vis.unsqueeze(1)


def _per_row_oracle(q, k, v, vis, **kw):
    """Float64 attention of each query row over the keys it sees and no others (the oracle on
    those keys alone), and the same-dtype textbook result for FlashAttention's rule."""
    bsz, hq, lq, _ = q.shape
    out = torch.zeros(bsz, hq, lq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((bsz, hq, lq), -INF, dtype=torch.float64)
    plain = torch.zeros(bsz, hq, lq, v.shape[-1], dtype=q.dtype)
    for b in range(bsz):
        for i in range(lq):
            keys = vis[b, 0, i].nonzero().flatten()
            if keys.numel() == 0:
                continue
            qi, ki, vi = q[b:b + 1, :, i:i + 1], k[b:b + 1, :, keys], v[b:b + 1, :, keys]
            o, l_ = attention_reference(qi, ki, vi, return_lse=True, **kw)
            out[b, :, i], lse[b, :, i] = o[0, :, 0], l_[0, :, 0]
            if "softcap" not in kw:
                plain[b, :, i] = naive_attention(qi, ki, vi, scale=kw.get("scale"))[0, :, 0]
    return out, lse, plain


def _torch_math(q, k, v, vis, scale):
    """torch's math SDPA with the visibility as a boolean mask (every row sees some key)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=vis, scale=scale,
                                              enable_gqa=True)


def _same_non_finite(out, ref):
    assert torch.equal(out.isnan(), ref.isnan()), (out.isnan().nonzero(), ref.isnan().nonzero())
    inf = ref.isinf()
    assert torch.equal(out.isinf(), inf)
    assert torch.equal(out[inf].double(), ref[inf].double())


def _check(out, lse, ref, ref_lse, plain):
    """NaN and inf where the oracle has them; the finite rest within tolerance. The oracle's
    LSE of a row with a +inf score is +inf, the kernel's NaN (inf - inf in the formula)."""
    _same_non_finite(out, ref)
    assert torch.equal(lse.isnan(), ref_lse.isnan() | (ref_lse == INF))
    assert torch.equal(lse == -INF, ref_lse == -INF)
    fin = torch.isfinite(ref_lse)
    assert (lse[fin].double() - ref_lse[fin]).abs().max() < 2e-5
    ok = ref.isfinite()
    if out.dtype == torch.float32:
        assert (out[ok].double() - ref[ok]).abs().max() < 2e-6
    else:
        good, err, base = fa_tolerance_ok(out[ok], ref[ok], plain[ok])
        assert good, (err, base)


def _to_pages(k, v, lens, gen, fill=0.0, table=None):
    """The dense (B, Hkv, L, D) cache on shuffled pages (or those of ``table``); page padding
    and a spare page hold ``fill``."""
    bsz, hkv, lk, d = k.shape
    width = -(-lk // PAGE)
    num_pages = bsz * width + 1
    kp = torch.full((num_pages, PAGE, hkv, d), fill, dtype=k.dtype)
    vp = torch.full((num_pages, PAGE, hkv, v.shape[-1]), fill, dtype=v.dtype)
    if table is None:
        table = torch.randperm(num_pages, generator=gen)[: bsz * width].view(bsz, width)
    for b in range(bsz):
        for j in range(int(lens[b])):
            kp[table[b, j // PAGE], j % PAGE] = k[b, :, j]
            vp[table[b, j // PAGE], j % PAGE] = v[b, :, j]
    return kp, vp, table


CASES = ["q_row", "k_row", "k_inf", "v_values", "hidden", "diagonal"]


def _problem(case, lq, dtype, d, gen):
    """q, k, v with non-finite values placed for ``case``; the dense keys past each sequence's
    length hold NaN in every case (they are never visible)."""
    lens = torch.tensor(LENS)
    lk = max(LENS)
    q = rand(len(LENS), HQ, lq, d, gen=gen, dtype=dtype)
    k = rand(len(LENS), HKV, lk, d, gen=gen, dtype=dtype)
    v = rand(len(LENS), HKV, lk, d, gen=gen, dtype=dtype)
    if case == "q_row":        # one query row: that row alone
        q[1, 3, lq - 1, 5] = NAN
    elif case == "k_row":      # one visible key: every row of its kv head
        k[0, 1, 10, 7] = NAN
    elif case == "k_inf":      # +inf scores (q > 0) give NaN rows, -inf scores weight 0
        k[2, 0, 4, 0] = INF
        k[1, 1, 30, 2] = -INF
    elif case == "v_values":   # value columns, through positive weights
        v[1, 0, 20, 3] = NAN
        v[1, 1, 21, 2] = INF
        v[0, 0, 5, 1] = -INF
    elif case == "diagonal":   # the last key: only the last row sees it (lq > 1)
        k[0, 0, LENS[0] - 1] = NAN
        v[0, 0, LENS[0] - 1] = NAN
        v[0, 1, LENS[0] - 1, 0] = NAN
    for b, n in enumerate(LENS):
        k[b, :, n:] = NAN
        v[b, :, n:] = NAN
    return q, k, v, lens


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("lq", [1, 3], ids=["decode", "lq3"])
@pytest.mark.parametrize("layout", ["paged", "dense"])
@pytest.mark.parametrize("case", CASES)
def test_non_finite_values_propagate_like_torch(case, layout, lq, dtype):
    _skip_f16(dtype)
    gen = torch.Generator().manual_seed(7 * CASES.index(case) + lq)
    d = 64
    q, k, v, lens = _problem(case, lq, dtype, d, gen)
    scale = 1 / math.sqrt(d)
    lk = k.shape[2]
    vis = _visibility(lens, lq, lk)
    if layout == "paged":
        kp, vp, table = _to_pages(k, v, lens, gen, fill=NAN)
        out, lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True,
                                          backend="decode")
        split_out, split_lse = native.paged_decode(q, kp, vp, table, lens, scale=scale,
                                                   splits=3, threads=2)
    else:
        out, lse = native.dense_decode(q, k, v, scale, seqlens=lens, causal=True,
                                       diagonal="bottom_right")
        split_out, split_lse = native.dense_decode(q, k, v, scale, seqlens=lens, causal=True,
                                                   diagonal="bottom_right", splits=3)
    ref, ref_lse, plain = _per_row_oracle(q, k, v, vis)
    # (bfloat16: dense_decode's float32 output carries P rounded to bfloat16 where P V runs
    # in bfloat16 dot products, native.DECODE_BF16_PV: FlashAttention's rule, as the paged)
    _check(out.to(dtype), lse, ref, ref_lse, plain)
    _check(split_out.to(dtype), split_lse, ref, ref_lse, plain)  # merged by LSE
    if case not in ("hidden", "diagonal"):
        # torch's math SDPA on the dense cache (the NaN padding replaced: its masked keys
        # multiply their 0 weights into the output)
        kc = torch.where(vis.any(2, keepdim=True).transpose(2, 3), k, torch.zeros((), dtype=dtype))
        vc = torch.where(vis.any(2, keepdim=True).transpose(2, 3), v, torch.zeros((), dtype=dtype))
        want = _torch_math(q, kc, vc, vis, scale)
        assert torch.equal(out.isnan(), want.isnan())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
def test_hidden_non_finite_keys_change_nothing(dtype):
    """NaN and inf in keys no row sees (outside a window on both sides, page padding, pages
    past a sequence, causal keys of later rows) leave every bit of the result as it was."""
    _skip_f16(dtype)
    gen = torch.Generator().manual_seed(11)
    lq, d = 3, 32
    q = rand(len(LENS), HQ, lq, d, gen=gen, dtype=dtype)
    k = rand(len(LENS), HKV, max(LENS), d, gen=gen, dtype=dtype)
    v = rand(len(LENS), HKV, max(LENS), d, gen=gen, dtype=dtype)
    lens = torch.tensor(LENS)
    scale = 0.3
    for window, causal in (((6, 0), True), ((-2, 9), False), ((12, -3), True), (None, True)):
        vis = _visibility(lens, lq, k.shape[2], window=window, causal=causal)
        assert (vis.any(2) & ~vis.all(2)).any()  # keys that some rows see and others not
        seen = vis.any(2, keepdim=True).transpose(2, 3)  # (B, 1, Lk, 1): some row sees it
        bad = torch.tensor([NAN, INF, -INF], dtype=dtype)
        k_nan = torch.where(seen, k, bad[torch.randint(0, 3, k.shape, generator=gen)])
        v_nan = torch.where(seen, v, bad[torch.randint(0, 3, v.shape, generator=gen)])
        kp, vp, table = _to_pages(k, v, lens, gen)
        kp_nan, vp_nan, _ = _to_pages(k_nan, v_nan, lens, gen, fill=NAN, table=table)
        opts = dict(scale=scale, causal=causal, window=window)
        for splits in (1, 4):
            clean = native.paged_decode(q, kp, vp, table, lens, splits=splits, **opts)
            dirty = native.paged_decode(q, kp_nan, vp_nan, table, lens, splits=splits, **opts)
            for a, b in zip(clean, dirty):
                assert torch.equal(a, b), (window, causal, splits)
        ref, ref_lse, plain = _per_row_oracle(q, k, v, vis, scale=scale)
        out, lse = native.paged_decode(q, kp_nan, vp_nan, table, lens, **opts)
        _check(out.to(dtype), lse, ref, ref_lse, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_softcap_of_infinite_scores_is_finite(dtype):
    """cap * tanh(s / cap) of s = +-inf is +-cap: a finite score, as in the oracle; NaN stays
    NaN through the cap."""
    gen = torch.Generator().manual_seed(12)
    q, k, v, lens = _problem("k_inf", 1, dtype, 64, gen)
    k[0, 0, 3, 9] = NAN
    kp, vp, table = _to_pages(k, v, lens, gen, fill=NAN)
    out, lse = paged_attention_blocks(q, kp, vp, table, lens, softcap=4.0, return_lse=True,
                                      backend="decode")
    vis = _visibility(lens, 1, k.shape[2])
    ref, ref_lse, _ = _per_row_oracle(q, k, v, vis, softcap=4.0, causal=False)
    assert out[2].isfinite().all() and out[0, :4].isnan().all() and out[0, 4:].isfinite().all()
    _same_non_finite(out, ref)
    fin = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), fin)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert (out[ref.isfinite()].double() - ref[ref.isfinite()]).abs().max() < tol
    assert (lse[fin].double() - ref_lse[fin]).abs().max() < 2e-5


def test_fully_masked_rows_stay_zero():
    """A row that sees no key (a window past its keys) or only -inf scores is 0 with LSE -inf,
    not NaN."""
    gen = torch.Generator().manual_seed(13)
    q, k, v, lens = _problem("none", 2, torch.float32, 32, gen)
    k[1, :, :LENS[1]] = -INF
    q[1] = q[1].abs()  # every score of sequence 1: -inf
    kp, vp, table = _to_pages(k, v, lens, gen, fill=NAN)
    out, lse = native.paged_decode(q, kp, vp, table, lens, scale=0.2, causal=False,
                                   window=(-200, None))
    assert torch.equal(out, torch.zeros_like(out)) and (lse == -INF).all()
    out, lse = native.paged_decode(q, kp, vp, table, lens, scale=0.2)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and (lse[1] == -INF).all()
    assert out[0].isfinite().all() and lse[0].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
def test_decode_through_attention_shows_nan_like_torch(padded, dtype):
    """attention() on a decoding step (its rows run in the kernel): a NaN query row, a +inf
    key and a NaN value come out where torch's math SDPA has them; NaN padding past
    ``seqlens_kv`` stays out."""
    import attnkit

    gen = torch.Generator().manual_seed(14)
    q = rand(2, HQ, 1, 64, gen=gen, dtype=dtype)
    k = rand(2, HKV, 100, 64, gen=gen, dtype=dtype)
    v = rand(2, HKV, 100, 64, gen=gen, dtype=dtype)
    q[0, 1, 0, 3] = NAN
    k[1, 0, 5, 0] = INF
    v[0, 1, 7, 2] = NAN
    lens = torch.tensor([100, 60] if padded else [100, 100])
    vis = _visibility(lens, 1, 100, causal=False)
    kw = {}
    if padded:
        kw["seqlens_kv"] = lens
        k[1, :, 60:] = NAN
        v[1, :, 60:] = NAN
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse, plain = _per_row_oracle(q, k, v, vis)
    # (bfloat16: dense_decode's float32 output carries P rounded to bfloat16 where P V runs
    # in bfloat16 dot products, native.DECODE_BF16_PV: FlashAttention's rule, as the paged)
    _check(out.to(dtype), lse, ref, ref_lse, plain)
    seen = vis.transpose(2, 3)
    zero = torch.zeros((), dtype=dtype)
    want = _torch_math(q, torch.where(seen, k, zero), torch.where(seen, v, zero), vis,
                       1 / math.sqrt(64))
    assert torch.equal(out.isnan(), want.isnan()) and out.isnan().any()
