"""Packed (varlen), padded (seqlens) and paged attention against separate per-sequence calls
of the float64 reference, and split-KV merging against the unsplit result.

Every front door here must equal "attend each sequence on its own": the oracle slices one
sequence at a time and calls :func:`attention_reference`, so masks, diagonals and positions are
per sequence by construction.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fa_tolerance_ok, naive_attention, rand

import attnkit
from attnkit.paged import OutOfPagesError, UnknownSequenceError
from attnkit.reference import attention_reference as ref

SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])

def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(lens_q, lens_k, dtype=torch.float64, hq=4, hkv=2, d=8, dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = rand(sum(lens_q), hq, d, gen=g, dtype=dtype, requires_grad=True)
    k = rand(sum(lens_k), hkv, d, gen=g, dtype=dtype, requires_grad=True)
    v = rand(sum(lens_k), hkv, dv, gen=g, dtype=dtype, requires_grad=True)
    dout = rand(sum(lens_q), hq, dv, gen=g, dtype=dtype)
    return q, k, v, dout


def _per_sequence(fn, q, k, v, cu_q, cu_k, **kw):
    """Call ``fn`` on each sequence (heads first) and pack the results like varlen does:
    out (Tq, Hq, Dv), lse (Hq, Tq)."""
    outs, lses = [], []
    for s in range(cu_q.numel() - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)
        ks = k[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        vs = v[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        o, lse = fn(qs, ks, vs, **kw)
        outs.append(o.transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _ref_lse(q, k, v, **kw):
    return ref(q, k, v, return_lse=True, **kw)


def _naive_lse(q, k, v, causal=False, diagonal="top_left", window=None):
    """Plain same-dtype attention of one sequence with the varlen mask terms; the second
    result is a placeholder lse so that it fits :func:`_per_sequence`."""
    lq, lk = q.shape[-2], k.shape[-2]
    i = torch.arange(lq).view(-1, 1) + (lk - lq if diagonal == "bottom_right" else 0)
    j = torch.arange(lk).view(1, -1)
    vis = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (j >= i - window[0]) & (j <= i + window[1])
    return naive_attention(q, k, v, mask=vis), torch.zeros(q.shape[:-1])


def _assert_lse_equal(lse, expected, atol=1e-12):
    assert lse.shape == expected.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected))
    fin = torch.isfinite(expected)
    assert torch.allclose(lse[fin].double(), expected[fin].double(), atol=atol)


# ---- varlen against per-sequence calls -----------------------------------------------------

# Lq != Lk per sequence, a zero-length sequence on each side, a one-token sequence, and a
# sequence where Lq > Lk (bottom-right leaves its first rows with no key).
LENS_Q = [5, 0, 1, 13, 7, 3, 4]
LENS_K = [9, 3, 1, 0, 7, 6, 2]

VARLEN_CASES = {
    "dense": dict(),
    "causal_top_left": dict(causal=True),
    "causal_bottom_right": dict(causal=True, diagonal="bottom_right"),
    "window": dict(window=(2, 1)),
    "window_bottom_right": dict(window=(3, 0), diagonal="bottom_right"),
    "alibi": dict(alibi_slopes=SLOPES),
    "alibi_causal_bottom_right": dict(alibi_slopes=SLOPES, causal=True, diagonal="bottom_right"),
    "softcap": dict(softcap=2.0),
    "scale": dict(scale=0.3),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_matches_per_sequence_reference_float64(case, small_tiles, backend):
    kw = VARLEN_CASES[case]
    q, k, v, dout = _packed(LENS_Q, LENS_K)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    if "softcap" in kw and backend == "fused":
        with pytest.raises(NotImplementedError, match="softcap"):
            attnkit.varlen_attention(q, k, v, cu_q, cu_k, backend=backend, **kw)
        return
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                        return_lse=True, backend=backend, **kw)
    r, rl = _per_sequence(_ref_lse, q, k, v, cu_q, cu_k, **kw)
    assert out.shape == (sum(LENS_Q), 4, 5) and lse.shape == (4, sum(LENS_Q))
    assert torch.allclose(out, r, atol=1e-12)
    _assert_lse_equal(lse, rl)
    # gradients of out and of the finite lse entries together
    g = torch.Generator().manual_seed(1)
    dlse = rand(*lse.shape, gen=g)
    fin = torch.isfinite(rl)
    grads = [torch.autograd.grad((o * dout).sum() + (l[fin] * dlse[fin]).sum(), (q, k, v))
             for o, l in ((out, lse), (r, rl))]
    for name, a, b in zip("qkv", *grads):
        assert torch.allclose(a, b, atol=1e-12), name


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, diagonal="bottom_right"),
                                dict(window=(2, 2))], ids=["dense", "causal_br", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_low_precision_fa_tolerance(kw, dtype, backend):
    q, k, v, dout = _packed(LENS_Q, LENS_K, dtype=dtype, d=16, dv=16, seed=2)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    out = attnkit.varlen_attention(q, k, v, cu_q, cu_k, backend=backend, **kw)
    assert out.dtype == dtype
    g_out = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r, _ = _per_sequence(_ref_lse, q64, k64, v64, cu_q, cu_k, **kw)
    g_ref = torch.autograd.grad(r, (q64, k64, v64), dout.double())
    qp, kp, vp = (t.detach().requires_grad_() for t in (q, k, v))
    plain, _ = _per_sequence(_naive_lse, qp, kp, vp, cu_q, cu_k, **kw)
    g_plain = torch.autograd.grad(plain, (qp, kp, vp), dout)
    ok, err, base = fa_tolerance_ok(out, r, plain)
    assert ok, (err, base)
    for name, a, gr, gp in zip("qkv", g_out, g_ref, g_plain):
        ok, err, base = fa_tolerance_ok(a, gr, gp, mult=3.0)
        assert ok, (name, err, base)


def test_varlen_one_token_sequences_attend_to_their_own_token(backend):
    # each sequence is one query and one key, so causal attention returns that key's value
    n = 6
    q, k, v, _ = _packed([1] * n, [1] * n, seed=3)
    cu = _cu([1] * n)
    for diagonal in ("top_left", "bottom_right"):
        out, lse = attnkit.varlen_attention(q, k, v, cu, cu, causal=True, diagonal=diagonal,
                                            return_lse=True, backend=backend)
        expected = v.detach().repeat_interleave(2, dim=1)
        assert torch.allclose(out, expected, atol=1e-12)
        scores = (q * k.repeat_interleave(2, dim=1)).sum(-1) / 8 ** 0.5  # (T, Hq)
        assert torch.allclose(lse, scores.detach().T, atol=1e-12)


def test_varlen_empty_sequences_give_zero_rows_and_zero_gradients(backend):
    lens_q, lens_k = [0, 3, 2, 0], [4, 0, 5, 0]
    q, k, v, dout = _packed(lens_q, lens_k, seed=4)
    out, lse = attnkit.varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), causal=True,
                                        diagonal="bottom_right", return_lse=True,
                                        backend=backend)
    assert torch.all(out[:3] == 0) and torch.all(torch.isneginf(lse[:, :3]))  # no keys
    assert torch.isfinite(out).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.all(dq[:3] == 0)
    assert torch.all(dk[:4] == 0) and torch.all(dv[:4] == 0)  # keys no query sees
    assert dk[4:].abs().sum() > 0 and dv[4:].abs().sum() > 0


def test_varlen_with_no_keys_at_all(backend):
    lens_q, lens_k = [2, 3], [0, 0]
    q, k, v, _ = _packed(lens_q, lens_k, seed=5)
    out, lse = attnkit.varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), return_lse=True,
                                        backend=backend)
    assert out.shape == (5, 4, 5) and torch.all(out == 0)
    assert torch.all(torch.isneginf(lse))


def test_varlen_with_no_queries_at_all(backend):
    lens_q, lens_k = [0, 0], [2, 3]
    q, k, v, _ = _packed(lens_q, lens_k, seed=6)
    out, lse = attnkit.varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), causal=True,
                                        return_lse=True, backend=backend)
    assert out.shape == (0, 4, 5) and lse.shape == (4, 0)


# ---- varlen misuse --------------------------------------------------------------------------

_Q, _K, _V = torch.randn(5, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 3)
_CQ, _CK = torch.tensor([0, 2, 5]), torch.tensor([0, 4, 7])


@pytest.mark.parametrize("args,kwargs,exc,words", [
    ((torch.tensor([1, 2, 5]), _CK), {}, ValueError, ["cu_seqlens_q", "start with 0", "1"]),
    ((_CQ, torch.tensor([0, 5, 4, 7])), {}, ValueError, ["cu_seqlens_kv", "non-decreasing"]),
    ((torch.tensor([0, 2, 6]), _CK), {}, ValueError, ["cu_seqlens_q", "6", "5", "total"]),
    ((_CQ, torch.tensor([0, 4, 6])), {}, ValueError, ["cu_seqlens_kv", "6", "7"]),
    ((_CQ.float(), _CK), {}, TypeError, ["cu_seqlens_q", "int32", "float32"]),
    (([0, 2.5, 5], _CK), {}, TypeError, ["cu_seqlens_q", "tensor", "list"]),
    ((torch.tensor([0, 1, 2, 5]), _CK), {}, ValueError, ["3 sequences", "2", "agree"]),
    ((_CQ, _CK, 2), {}, ValueError, ["max_seqlen_q=2", "3"]),
    ((_CQ, _CK, None, 3), {}, ValueError, ["max_seqlen_kv=3", "4"]),
    ((_CQ, _CK), {"diagonal": "bottom-right"}, ValueError, ["diagonal", "bottom-right"]),
])
def test_varlen_misuse_raises_clear_errors(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        attnkit.varlen_attention(_Q, _K, _V, *args, **kwargs)
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)


def test_varlen_rejects_batched_4d_inputs():
    with pytest.raises(ValueError, match=r"q must be 3-D .*\(1, 5, 4, 8\)"):
        attnkit.varlen_attention(_Q[None], _K, _V, _CQ, _CK)


# ---- padding API (seqlens_q / seqlens_kv) against slicing each batch row --------------------

PAD_CASES = {
    "dense": dict(),
    "causal_top_left": dict(causal=True),
    "causal_bottom_right": dict(causal=True, diagonal="bottom_right"),
    "window_bottom_right": dict(window=(1, 1), diagonal="bottom_right"),
    "alibi_bottom_right": dict(alibi_slopes=SLOPES, diagonal="bottom_right"),
}


@pytest.mark.parametrize("case", list(PAD_CASES))
def test_padding_matches_slicing_each_row(case, small_tiles, backend):
    kw = PAD_CASES[case]
    g = torch.Generator().manual_seed(7)
    n, lq, lk = 4, 9, 11
    sq, sk = torch.tensor([9, 0, 3, 6]), torch.tensor([5, 4, 11, 0])
    q = rand(n, 4, lq, 8, gen=g)
    k = rand(n, 2, lk, 8, gen=g)
    v = rand(n, 2, lk, 5, gen=g)
    for b in range(n):  # padding holds large garbage that must never be read
        q[b, :, sq[b]:] = 1e3
        k[b, :, sk[b]:] = -1e3
        v[b, :, sk[b]:] = 1e3
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = rand(n, 4, lq, 5, gen=g)
    out, lse = attnkit.attention(q, k, v, seqlens_q=sq, seqlens_kv=sk, return_lse=True,
                                 backend=backend, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(n):
        qb, kb, vb = q[b, :, :sq[b]], k[b, :, :sk[b]], v[b, :, :sk[b]]
        r, rl = ref(qb, kb, vb, return_lse=True, **kw)  # actual lengths: bottom-right per row
        assert torch.allclose(out[b, :, :sq[b]], r, atol=1e-12), b
        _assert_lse_equal(lse[b, :, :sq[b]], rl)
        assert torch.all(out[b, :, sq[b]:] == 0), b
        assert torch.all(torch.isneginf(lse[b, :, sq[b]:])), b
        rq, rk, rv = torch.autograd.grad(r, (q, k, v), dout[b, :, :sq[b]], allow_unused=True)
        zero = torch.zeros_like
        rq, rk, rv = (zero(t) if g_ is None else g_ for g_, t in ((rq, q), (rk, k), (rv, v)))
        assert torch.allclose(dq[b], rq[b], atol=1e-12), b
        assert torch.allclose(dk[b], rk[b], atol=1e-12), b
        assert torch.allclose(dv[b], rv[b], atol=1e-12), b
        assert torch.all(dq[b, :, sq[b]:] == 0)  # padded queries
        assert torch.all(dk[b, :, sk[b]:] == 0) and torch.all(dv[b, :, sk[b]:] == 0)


def test_padding_bottom_right_uses_actual_lengths_not_padded_ones(backend):
    # with padded lengths the diagonal would sit elsewhere; the result must differ from that
    g = torch.Generator().manual_seed(8)
    q, k, v = rand(1, 2, 6, 4, gen=g), rand(1, 2, 10, 4, gen=g), rand(1, 2, 10, 3, gen=g)
    sq, sk = torch.tensor([3]), torch.tensor([5])
    out = attnkit.attention(q, k, v, seqlens_q=sq, seqlens_kv=sk, causal=True,
                            diagonal="bottom_right", backend=backend)
    r = ref(q[..., :3, :], k[..., :5, :], v[..., :5, :], causal=True, diagonal="bottom_right")
    assert torch.allclose(out[..., :3, :], r, atol=1e-12)
    wrong = ref(q, k, v, causal=True, diagonal="bottom_right",
                mask=torch.arange(10) < 5)[..., :3, :]  # diagonal from padded lengths 6, 10
    assert not torch.allclose(out[..., :3, :], wrong, atol=1e-3)


# ---- paged KV cache against contiguous keys --------------------------------------------------


class _Contiguous:
    """What the paged cache should hold, kept as plain per-sequence tensors."""

    def __init__(self, cache, gen):
        self.cache, self.gen, self.k, self.v = cache, gen, {}, {}

    def append(self, seq, n):
        c = self.cache
        k = rand(n, c.num_kv_heads, c.head_dim, gen=self.gen, dtype=c.dtype)
        v = rand(n, c.num_kv_heads, c.v_head_dim, gen=self.gen, dtype=c.dtype)
        c.append(seq, k, v)
        self.k[seq] = torch.cat([self.k.get(seq, k[:0]), k])
        self.v[seq] = torch.cat([self.v.get(seq, v[:0]), v])

    def free(self, seq):
        self.cache.free(seq)
        del self.k[seq], self.v[seq]

    def padded(self, seqs):
        lens = torch.tensor([self.k[s].shape[0] for s in seqs])
        lmax = int(lens.max())
        c = self.cache
        k = torch.zeros(len(seqs), c.num_kv_heads, lmax, c.head_dim, dtype=c.dtype)
        v = torch.zeros(len(seqs), c.num_kv_heads, lmax, c.v_head_dim, dtype=c.dtype)
        for b, s in enumerate(seqs):
            k[b, :, :lens[b]] = self.k[s].transpose(0, 1)
            v[b, :, :lens[b]] = self.v[s].transpose(0, 1)
        return k, v, lens


def _shuffled_cache(dtype, page_size=4, seed=9, head_dim=8, v_head_dim=6):
    """Three sequences on out-of-order pages: allocations interleaved with a free.
    Lengths: "a" 8 (exactly two pages), "b" 9 (one token past), "c" 6 (mid-page)."""
    cache = attnkit.PagedKVCache(num_pages=12, page_size=page_size, num_kv_heads=2,
                                 head_dim=head_dim, dtype=dtype, v_head_dim=v_head_dim)
    ref_kv = _Contiguous(cache, torch.Generator().manual_seed(seed))
    for s in ("x", "a", "b", "c"):
        cache.allocate(s)
    ref_kv.append("x", 9)
    ref_kv.append("a", 3)
    ref_kv.append("b", 5)
    ref_kv.append("x", 2)
    ref_kv.append("c", 4)
    ref_kv.free("x")  # its three pages go back and are reused, newest first
    ref_kv.append("a", 5)
    ref_kv.append("b", 4)
    ref_kv.append("c", 2)
    return cache, ref_kv


def test_shuffled_cache_really_is_out_of_order():
    cache, _ = _shuffled_cache(torch.float64)
    pages = {s: cache.pages_of(s) for s in "abc"}
    assert any(p != sorted(p) or p[-1] - p[0] != len(p) - 1 for p in pages.values()), pages
    assert [cache.seq_len(s) for s in "abc"] == [8, 9, 6]


@pytest.mark.parametrize("lq", [1, 3], ids=["decode", "chunked_prefill"])
@pytest.mark.parametrize("kw", [dict(), dict(window=(4, 0)), dict(alibi_slopes=SLOPES),
                                dict(causal=False)], ids=["causal", "window", "alibi", "full"])
def test_paged_matches_contiguous_and_reference(lq, kw, backend):
    cache, contig = _shuffled_cache(torch.float64)
    seqs = ["b", "c", "a"]
    g = torch.Generator().manual_seed(10)
    q = rand(3, 4, lq, 8, gen=g, requires_grad=True)
    out, lse = attnkit.paged_attention(q, cache, seqs, return_lse=True, backend=backend, **kw)
    # the same padded tensors, contiguous, through the padding API: bitwise the same call
    k, v, lens = contig.padded(seqs)
    kw = dict(kw)
    causal = kw.pop("causal", True)
    o2, l2 = attnkit.attention(q, k, v, seqlens_kv=lens, causal=causal,
                               diagonal="bottom_right", return_lse=True, backend=backend, **kw)
    assert torch.equal(out, o2) and torch.equal(lse, l2)
    dq = torch.autograd.grad(out.sum(), q)[0]
    for b, s in enumerate(seqs):
        r, rl = ref(q[b], contig.k[s].transpose(0, 1), contig.v[s].transpose(0, 1),
                    causal=causal, diagonal="bottom_right", return_lse=True, **kw)
        assert torch.allclose(out[b], r, atol=1e-12), s
        _assert_lse_equal(lse[b], rl)
        assert torch.allclose(dq[b], torch.autograd.grad(r.sum(), q)[0][b], atol=1e-12), s


def test_paged_decode_sees_every_cached_token():
    # decode with causal bottom-right: the single query sees all keys of its sequence, so
    # it equals non-causal attention over the sequence (an oracle-free check of the diagonal)
    cache, contig = _shuffled_cache(torch.float64)
    g = torch.Generator().manual_seed(11)
    q = rand(3, 4, 1, 8, gen=g)
    out = attnkit.paged_attention(q, cache, ["a", "b", "c"])
    for b, s in enumerate("abc"):
        k = contig.k[s].transpose(0, 1)
        v = contig.v[s].transpose(0, 1)
        assert torch.allclose(out[b], attnkit.attention(q[b], k, v), atol=1e-12), s


def test_paged_block_table_form_equals_high_level(backend):
    cache, _ = _shuffled_cache(torch.float64)
    seqs = ["c", "a", "b"]
    g = torch.Generator().manual_seed(12)
    q = rand(3, 4, 2, 8, gen=g)
    hi = attnkit.paged_attention(q, cache, seqs, return_lse=True, backend=backend)
    table, lens = cache.block_table(seqs)
    lo = attnkit.paged_attention_blocks(q, cache.k_pages, cache.v_pages, table, lens,
                                        return_lse=True, backend=backend)
    assert torch.equal(hi[0], lo[0]) and torch.equal(hi[1], lo[1])
    # a hand-made table with -1 padding past each sequence's pages means the same
    width = table.shape[1] + 1
    rows = [cache.pages_of(s) + [-1] * (width - len(cache.pages_of(s))) for s in seqs]
    hand = attnkit.paged_attention_blocks(q, cache.k_pages, cache.v_pages,
                                          torch.tensor(rows, dtype=torch.int32), lens,
                                          return_lse=True, backend=backend)
    assert torch.equal(hand[0], hi[0]) and torch.equal(hand[1], hi[1])


@pytest.mark.parametrize("lq", [1, 3], ids=["decode", "chunked_prefill"])
def test_paged_bfloat16_fa_tolerance(lq, backend):
    cache, contig = _shuffled_cache(torch.bfloat16, seed=13, head_dim=32, v_head_dim=32)
    seqs = ["a", "b", "c"]
    g = torch.Generator().manual_seed(14)
    q = rand(3, 4, lq, 32, gen=g, dtype=torch.bfloat16)
    out = attnkit.paged_attention(q, cache, seqs, backend=backend)
    assert out.dtype == torch.bfloat16
    refs, plains = [], []
    for b, s in enumerate(seqs):
        k, v = contig.k[s].transpose(0, 1), contig.v[s].transpose(0, 1)
        n = k.shape[1]
        refs.append(ref(q[b], k, v, causal=True, diagonal="bottom_right"))
        vis = torch.arange(n).view(1, -1) <= torch.arange(lq).view(-1, 1) + n - lq
        plains.append(naive_attention(q[b], k, v, mask=vis))
    ok, err, base = fa_tolerance_ok(out, torch.stack(refs), torch.stack(plains))
    assert ok, (err, base)


def test_paged_grouped_query_heads_share_kv_heads():
    cache, contig = _shuffled_cache(torch.float64)
    g = torch.Generator().manual_seed(15)
    q = rand(2, 8, 2, 8, gen=g)  # 8 query heads over 2 kv heads
    out = attnkit.paged_attention(q, cache, ["a", "c"])
    for b, s in enumerate("ac"):
        k = contig.k[s].transpose(0, 1).repeat_interleave(4, dim=0)
        v = contig.v[s].transpose(0, 1).repeat_interleave(4, dim=0)
        r = ref(q[b], k, v, causal=True, diagonal="bottom_right")
        assert torch.allclose(out[b], r, atol=1e-12), s


def test_paged_misuse_raises_clear_errors():
    cache, _ = _shuffled_cache(torch.float64)
    free = cache.num_free_pages
    cache.allocate("big")
    big = torch.zeros(free * 4 + 1, 2, 8, dtype=torch.float64)
    with pytest.raises(OutOfPagesError, match=rf"needs {free + 1} more pages .* {free} of 12"):
        cache.append("big", big, torch.zeros(free * 4 + 1, 2, 6, dtype=torch.float64))
    assert cache.seq_len("big") == 0 and cache.num_free_pages == free
    q = torch.zeros(2, 4, 1, 8, dtype=torch.float64)
    with pytest.raises(UnknownSequenceError, match="unknown sequence 'zz'.*allocate"):
        attnkit.paged_attention(q, cache, ["a", "zz"])
    with pytest.raises(KeyError):  # it is a KeyError too
        attnkit.paged_attention(q, cache, ["zz", "a"])
    q7 = torch.zeros(2, 4, 7, 8, dtype=torch.float64)  # "c" holds only 6 tokens
    with pytest.raises(ValueError, match="7 query tokens.*append.*shortest has 6"):
        attnkit.paged_attention(q7, cache, ["a", "c"])
    with pytest.raises(ValueError, match="shortest has 0"):  # allocated, nothing appended
        attnkit.paged_attention(q[:1], cache, ["big"])
    with pytest.raises(ValueError, match="block_table .* B = 2"):
        table, lens = cache.block_table(["a"])
        attnkit.paged_attention_blocks(q, cache.k_pages, cache.v_pages, table, lens)


# ---- merging partial states of a key split -------------------------------------------------

SPLITS = {
    "one_part": [0, 11],
    "empty_first": [0, 0, 11],
    "empty_last": [0, 11, 11],
    "empty_middle": [0, 4, 4, 11],
    "halves": [0, 5, 11],
    "ragged": [0, 1, 5, 6, 11],
}


def _merge_split(q, k, v, cuts, mask=None, **kw):
    outs, lses = [], []
    for a, b in zip(cuts, cuts[1:]):
        m = None if mask is None else mask[:, a:b]
        o, lse = attnkit.attention(q, k[..., a:b, :], v[..., a:b, :], mask=m, return_lse=True,
                                   **kw)
        outs.append(o)
        lses.append(lse)
    return attnkit.merge_states(outs, lses)


@pytest.mark.parametrize("split", list(SPLITS))
def test_merge_of_plain_key_split_equals_unsplit(split, backend):
    g = torch.Generator().manual_seed(16)
    q, k, v = rand(2, 4, 7, 8, gen=g), rand(2, 2, 11, 8, gen=g), rand(2, 2, 11, 5, gen=g)
    full, lse_full = attnkit.attention(q, k, v, return_lse=True)
    o, lse = _merge_split(q, k, v, SPLITS[split], backend=backend)
    assert torch.allclose(o, full, atol=1e-12)
    assert torch.allclose(lse, lse_full, atol=1e-12)


@pytest.mark.parametrize("split", [s for s in SPLITS if "empty" not in s])
def test_merge_of_causal_key_split_with_sliced_masks(split, backend):
    g = torch.Generator().manual_seed(17)
    q, k, v = rand(2, 4, 7, 8, gen=g), rand(2, 2, 11, 8, gen=g), rand(2, 2, 11, 5, gen=g)
    full, lse_full = attnkit.attention(q, k, v, causal=True, diagonal="bottom_right",
                                       return_lse=True)
    vis = torch.arange(11).view(1, -1) <= torch.arange(7).view(-1, 1) + 4  # bottom-right
    o, lse = _merge_split(q, k, v, SPLITS[split], mask=vis, backend=backend)
    assert torch.allclose(o, full, atol=1e-12)
    assert torch.allclose(lse, lse_full, atol=1e-12)


def test_merge_of_causal_key_split_with_an_empty_masked_part(backend):
    g = torch.Generator().manual_seed(17)
    q, k, v = rand(2, 4, 7, 8, gen=g), rand(2, 2, 11, 8, gen=g), rand(2, 2, 11, 5, gen=g)
    full = attnkit.attention(q, k, v, causal=True, diagonal="bottom_right")
    vis = torch.arange(11).view(1, -1) <= torch.arange(7).view(-1, 1) + 4
    o, _ = _merge_split(q, k, v, [0, 4, 4, 11], mask=vis, backend=backend)
    assert torch.allclose(o, full, atol=1e-12)


@pytest.mark.parametrize("lq,prefix", [(1, 0), (1, 6), (1, 10), (3, 0), (3, 5), (3, 9)])
def test_cascade_split_prefix_plus_bottom_right_suffix(lq, prefix, backend):
    # shared prefix (every query sees it: no mask) + own suffix (causal, bottom-right);
    # prefix = 0 gives an empty first part, (3, 9) a suffix shorter than Lq
    g = torch.Generator().manual_seed(18)
    q, k, v = rand(2, 4, lq, 8, gen=g), rand(2, 2, 11, 8, gen=g), rand(2, 2, 11, 5, gen=g)
    full, lse_full = attnkit.attention(q, k, v, causal=True, diagonal="bottom_right",
                                       return_lse=True)
    o1, l1 = attnkit.attention(q, k[..., :prefix, :], v[..., :prefix, :], return_lse=True,
                               backend=backend)
    o2, l2 = attnkit.attention(q, k[..., prefix:, :], v[..., prefix:, :], causal=True,
                               diagonal="bottom_right", return_lse=True, backend=backend)
    o, lse = attnkit.merge_state(o1, l1, o2, l2)
    assert torch.allclose(o, full, atol=1e-12)
    assert torch.allclose(lse, lse_full, atol=1e-12)


_EMPTY_SUFFIX = """
import torch
import attnkit
q = torch.randn(2, 4, {lq}, 8, dtype=torch.float64)
k, v = torch.zeros(2, 2, 0, 8, dtype=torch.float64), torch.zeros(2, 2, 0, 5, dtype=torch.float64)
out, lse = attnkit.attention(q, k, v, causal=True, diagonal="bottom_right", return_lse=True,
                             backend="fused")
assert out.shape == (2, 4, {lq}, 5) and bool((out == 0).all()), out
assert bool(torch.isneginf(lse).all()), lse
"""


def test_cascade_empty_suffix_tiled():
    # decode (Lq = 1) whose whole cache is the shared prefix: the causal part has no keys
    for lq in (1, 3):
        q = torch.randn(2, 4, lq, 8, dtype=torch.float64)
        k, v = torch.zeros(2, 2, 0, 8, dtype=torch.float64), torch.zeros(2, 2, 0, 5)
        out, lse = attnkit.attention(q, k, v.double(), causal=True, diagonal="bottom_right",
                                     return_lse=True, backend="tiled")
        assert out.shape == (2, 4, lq, 5) and torch.all(out == 0)
        assert torch.all(torch.isneginf(lse))


def test_cascade_empty_suffix_fused_does_not_crash():
    # run in a fresh interpreter: the failure is a signal that would end the test session
    code = _EMPTY_SUFFIX.format(lq=1) + _EMPTY_SUFFIX.format(lq=3)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
