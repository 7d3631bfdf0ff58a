"""Every builtin mask_mod and score_mod through ``attnkit.attention`` against the dense float64
reference: forward (output, LSE, max_scores) and gradients of q, k, v and captured tensors, as
mask_mod callables and as BlockMasks, on both executors; low precision by FlashAttention's rule;
gradcheck; and a count of the mask_mod calls a block-sparse run makes.

The oracle for a mask is the reference fed the mask's *dense* bool tensor (the mask_mod called
once on the full index grid), so it does not share attnkit's structure shortcuts (absorbing
builtin masks into bands and segments, BlockMask classification) with the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import fa_tolerance_ok, rand

import attnkit
from attnkit import masks as M
from attnkit import score_mods as S
from attnkit.block_mask import BLOCK_PARTIAL
from attnkit.reference import attention_reference as ref
from attnkit.reference import scores as ref_scores

ATOL = 1e-10

# ---- helpers -------------------------------------------------------------------------------


def grids(B, H, Lq, Lk):
    """Broadcast index tensors (b, h, q_idx, kv_idx) over the full score grid."""
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(Lq).view(1, 1, Lq, 1), torch.arange(Lk).view(1, 1, 1, Lk))


def dense(mod, B, H, Lq, Lk):
    """The mask_mod's meaning: bool (B, H, Lq, Lk)."""
    out = mod(*grids(B, H, Lq, Lk))
    assert out.dtype == torch.bool
    return out.expand(B, H, Lq, Lk)


def qkv(B, Hq, Hkv, Lq, Lk, d=16, dv=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = rand(B, Hq, Lq, d, gen=g, dtype=dtype, requires_grad=True)
    k = rand(B, Hkv, Lk, d, gen=g, dtype=dtype, requires_grad=True)
    v = rand(B, Hkv, Lk, dv, gen=g, dtype=dtype, requires_grad=True)
    dout = rand(B, Hq, Lq, dv, gen=g, dtype=dtype)
    return q, k, v, dout


def assert_out_lse(out, lse, r, rl, atol=ATOL):
    assert out.shape == r.shape and lse.shape == rl.shape
    assert torch.allclose(out, r, atol=atol, rtol=0), (out - r).abs().max().item()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert torch.isfinite(lse[fin]).all()
    assert torch.allclose(lse[fin], rl[fin], atol=atol, rtol=0)


def assert_grads(got, want, atol=ATOL):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None, i
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert torch.allclose(a, b, atol=atol, rtol=0), (i, (a - b).abs().max().item())


def doc_ids(L, cuts):
    """Sorted document ids of length L, a new document at each position in ``cuts``."""
    ids = torch.zeros(L, dtype=torch.int64)
    for c in cuts:
        ids[c:] += 1
    return ids


# ---- every builtin mask, as a mask_mod and as a BlockMask, on both executors ---------------

B, HQ, HKV, LQ, LK = 2, 4, 2, 37, 53

MASKS = {
    "causal": lambda lq, lk: M.causal(),
    "causal_bottom_right": lambda lq, lk: M.causal("bottom_right", lq, lk),
    "causal_bottom_right_tall": lambda lq, lk: M.causal("bottom_right", lq, lk),  # Lq > Lk
    "sliding_window": lambda lq, lk: M.sliding_window(6),
    "sliding_window_right": lambda lq, lk: M.sliding_window(4, 3),
    "sliding_window_bottom_right": lambda lq, lk: M.sliding_window(5, 2, "bottom_right", lq, lk),
    "sliding_window_left_none": lambda lq, lk: M.sliding_window(None, 2),
    "sliding_window_right_none": lambda lq, lk: M.sliding_window(3, None),
    "prefix_lm": lambda lq, lk: M.prefix_lm(9),
    "document": lambda lq, lk: M.document(doc_ids(lq, [10, 30]), doc_ids(lk, [15, 45])),
    "document_batched": lambda lq, lk: M.document(
        torch.stack([doc_ids(lq, [10, 30]), doc_ids(lq, [3, 4, 20])]),
        torch.stack([doc_ids(lk, [15, 45]), doc_ids(lk, [5, 6, 40])])),
    # ids of length lk (queries index the first lq): kept as an evaluated mask_mod
    "document_from_lengths": lambda lq, lk: M.document_from_lengths([20, 0, 17, 16]),
    "padding": lambda lq, lk: M.padding([30, lq], [lk, 20]),
    "chunked": lambda lq, lk: M.chunked(8),
    "dilated_sliding_window": lambda lq, lk: M.dilated_sliding_window(4, 3),
    "and": lambda lq, lk: M.and_masks(M.causal("bottom_right", lq, lk),
                                      M.document(doc_ids(lq, [10, 30]), doc_ids(lk, [15, 45]))),
    "or": lambda lq, lk: M.or_masks(M.sliding_window(2, 2), M.prefix_lm(5)),
    "not": lambda lq, lk: M.not_mask(M.causal()),
    "and_or_not": lambda lq, lk: M.and_masks(M.not_mask(M.chunked(5)),
                                             M.or_masks(M.causal(), M.sliding_window(0, 7))),
    "noop": lambda lq, lk: M.noop_mask,
    "or_empty": lambda lq, lk: M.or_masks(),  # nothing visible anywhere
}


def shapes_for(name):
    # "tall": more queries than keys, so bottom-right alignment leaves the first rows empty
    return (LK, LQ) if name.endswith("_tall") else (LQ, LK)


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_matches_dense_reference(name, backend, small_tiles):
    lq, lk = shapes_for(name)
    mod = MASKS[name](lq, lk)
    q, k, v, dout = qkv(B, HQ, HKV, lq, lk)
    want_mask = dense(mod, B, HQ, lq, lk)
    r, rl = ref(q, k, v, mask=want_mask, return_lse=True)
    want = torch.autograd.grad(r, (q, k, v), dout)
    block_mask = attnkit.create_block_mask(mod, B, None, lq, lk, BLOCK_SIZE=(8, 16))
    for mask in (mod, block_mask):
        out, lse = attnkit.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
        assert_out_lse(out, lse, r, rl)
        assert_grads(torch.autograd.grad(out, (q, k, v), dout), want)


def test_mask_list_covers_every_builtin():
    made = {f(LQ, LK).__name__ for f in MASKS.values()}
    for builtin in set(M.__all__) - {"MaskMod", "structure_of"}:
        stem = {"and_masks": "and(", "or_masks": "or(", "not_mask": "not("}.get(builtin, builtin)
        assert any(stem in name for name in made), builtin


# Lq = Lk = 300 with BLOCK_SIZE = 128: the last block row and column are cut (300 = 2*128 + 44)
LONG = {
    "causal": M.causal(),
    "sliding_window": M.sliding_window(50, 10),
    "document_from_lengths": M.document_from_lengths([100, 77, 123]),  # absorbed into segments
    "prefix_lm": M.prefix_lm(140),
    "per_head": lambda b, h, q, k: (q - k <= 40 * h) & (k - q <= 100 - 30 * h),
}


@pytest.mark.parametrize("name", list(LONG))
def test_long_masks_cut_blocks(name, backend):
    mod = LONG[name]
    q, k, v, dout = qkv(1, 4, 2, 300, 300, seed=1)
    r, rl = ref(q, k, v, mask=dense(mod, 1, 4, 300, 300), return_lse=True)
    want = torch.autograd.grad(r, (q, k, v), dout)
    block_mask = attnkit.create_block_mask(mod, 1, 4, 300, 300, BLOCK_SIZE=128)
    assert block_mask.kv_num_blocks.shape == (1, 4, 3)
    assert (block_mask.block_kinds() == BLOCK_PARTIAL).any()
    for mask in (mod, block_mask):
        out, lse = attnkit.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
        assert_out_lse(out, lse, r, rl)
        assert_grads(torch.autograd.grad(out, (q, k, v), dout), want)


# ---- every builtin score mod -----------------------------------------------------------------


def _score_mod_case(name, lq, lk, gen):
    """(score_mod, learnable tensors it captures, mask it runs with, additive?)"""
    if name == "alibi":
        slopes = S.alibi_slopes(HQ).double().requires_grad_()
        return S.alibi(slopes), [slopes], None, True
    if name == "alibi_bottom_right":
        return (S.alibi(S.alibi_slopes(HQ), offset=lk - lq), [],
                M.causal("bottom_right", lq, lk), True)
    if name == "softcap":
        return S.softcap(2.0), [], M.sliding_window(7, 3), False
    if name == "relative_bias":
        table = rand(11, gen=gen, requires_grad=True)
        return S.relative_bias(table), [table], M.causal(), True
    if name == "relative_bias_per_head":
        table = rand(HQ, 9, gen=gen, requires_grad=True)
        return S.relative_bias(table), [table], None, True
    if name == "head_bias":
        values = rand(HQ, gen=gen, requires_grad=True)
        mask = M.document(doc_ids(lq, [12]), doc_ids(lk, [20]))
        return S.head_bias(values), [values], mask, True
    if name == "compose_additive":
        table = rand(HQ, 7, gen=gen, requires_grad=True)
        values = rand(HQ, gen=gen, requires_grad=True)
        mod = S.compose(S.alibi(S.alibi_slopes(HQ)), S.relative_bias(table), S.head_bias(values))
        return mod, [table, values], M.prefix_lm(4), True
    if name == "compose_softcap":
        table = rand(13, gen=gen, requires_grad=True)
        mod = S.compose(S.relative_bias(table), S.softcap(1.5))
        return mod, [table], M.causal("bottom_right", lq, lk), False
    raise KeyError(name)


SCORE_MODS = ["alibi", "alibi_bottom_right", "softcap", "relative_bias",
              "relative_bias_per_head", "head_bias", "compose_additive", "compose_softcap"]


@pytest.mark.parametrize("name", SCORE_MODS)
def test_score_mod_matches_reference(name, backend, small_tiles):
    g = torch.Generator().manual_seed(2)
    mod, params, mask, additive = _score_mod_case(name, LQ, LK, g)
    q, k, v, dout = qkv(B, HQ, HKV, LQ, LK, seed=3)
    if backend == "fused" and not additive:
        with pytest.raises(NotImplementedError, match="fused does not run score_mod.*not additive"):
            attnkit.attention(q, k, v, score_mod=mod, mask=mask, backend=backend)
        return
    dense_mask = None if mask is None else dense(mask, B, HQ, LQ, LK)
    inputs = (q, k, v, *params)
    r, rl = ref(q, k, v, score_mod=mod, mask=dense_mask, return_lse=True)
    want = torch.autograd.grad(r, inputs, dout)
    masks = [mask] if mask is None else [mask, attnkit.create_block_mask(
        mask, 1, 1, LQ, LK, BLOCK_SIZE=16)]
    for m in masks:
        out, lse = attnkit.attention(q, k, v, score_mod=mod, mask=m, return_lse=True,
                                     backend=backend)
        assert_out_lse(out, lse, r, rl)
        assert_grads(torch.autograd.grad(out, inputs, dout), want)


def test_score_mod_list_covers_every_builtin():
    used = {n.split("_")[0] for n in SCORE_MODS}
    for builtin in set(S.__all__) - {"ScoreMod", "alibi_slopes", "describe"}:
        assert builtin.split("_")[0] in used, builtin


def test_learnable_relative_bias_table_gradient_equals_reference(backend):
    """A T5-style table trained through attention: its gradient is the reference's."""
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = qkv(2, 4, 1, 29, 41, seed=4)
    table = rand(4, 15, gen=g, requires_grad=True)
    mod = S.relative_bias(table)
    out = attnkit.attention(q, k, v, score_mod=mod, causal=True, diagonal="bottom_right",
                            backend=backend)
    got = torch.autograd.grad(out, table, dout)[0]
    r = ref(q, k, v, score_mod=mod, causal=True, diagonal="bottom_right")
    want = torch.autograd.grad(r, table, dout)[0]
    assert got.abs().max() > 1e-3  # the table matters
    assert torch.allclose(got, want, atol=ATOL, rtol=0)


# ---- keyword shortcuts: softcap=, alibi_slopes= (FlashAttention's convention) --------------


def fa_alibi_bias(slopes, lq, lk, offset):
    """FlashAttention: -slope * |i + offset - j|, offset = Lk - Lq for bottom-right; slopes
    (H,) or (N, H); offset int or (N,)."""
    i = torch.arange(lq, dtype=torch.float64).view(1, 1, lq, 1)
    j = torch.arange(lk, dtype=torch.float64).view(1, 1, 1, lk)
    off = torch.as_tensor(offset, dtype=torch.float64).reshape(-1, 1, 1, 1)
    s = slopes.double()
    s = s.view(1, -1, 1, 1) if s.dim() == 1 else s.view(s.shape[0], -1, 1, 1)
    return -s * (i + off - j).abs()


SHORTCUTS = [
    dict(name="alibi_top_left", diagonal="top_left", causal=False),
    dict(name="alibi_bottom_right", diagonal="bottom_right", causal=False),
    dict(name="alibi_bottom_right_causal", diagonal="bottom_right", causal=True),
    dict(name="alibi_per_batch_window", diagonal="top_left", causal=False, per_batch=True,
         window=(9, 4)),
    dict(name="alibi_bottom_right_seqlens", diagonal="bottom_right", causal=True, seqlens=True),
]


@pytest.mark.parametrize("case", SHORTCUTS, ids=lambda c: c["name"])
def test_alibi_slopes_keyword_is_flash_attention_bias(case, backend, small_tiles):
    q, k, v, dout = qkv(B, HQ, HKV, LQ, LK, seed=5)
    slopes = S.alibi_slopes(HQ)
    if case.get("per_batch"):
        slopes = torch.stack([slopes, slopes.flip(0) * 2])
    kw = dict(diagonal=case["diagonal"], causal=case["causal"], window=case.get("window"))
    offset = LK - LQ if case["diagonal"] == "bottom_right" else 0
    if case.get("seqlens"):
        kw.update(seqlens_q=torch.tensor([LQ, 20]), seqlens_kv=torch.tensor([40, LK]))
        offset = torch.tensor([40 - LQ, LK - 20])
    out, lse = attnkit.attention(q, k, v, alibi_slopes=slopes, return_lse=True,
                                 backend=backend, **kw)
    bias = fa_alibi_bias(slopes, LQ, LK, offset)
    r, rl = ref(q, k, v, bias=bias, return_lse=True, **kw)
    assert_out_lse(out, lse, r, rl)
    want = torch.autograd.grad(r, (q, k, v), dout)
    assert_grads(torch.autograd.grad(out, (q, k, v), dout), want)
    if not case.get("seqlens") and not case.get("per_batch"):
        # the score_mod spelling gives the same (alibi(offset=...) is FA's formula too)
        same = attnkit.attention(q, k, v, score_mod=S.alibi(slopes, offset=offset),
                                 backend=backend, **kw)
        assert torch.allclose(same, out, atol=ATOL, rtol=0)


def test_alibi_slopes_keyword_per_head_on_tiled_executor():
    """Regression: the tiled executor once scaled the (1, 1, bq, bk) distance tile in place by
    the (1, Hq, 1, 1) slopes, which fails for more than one head."""
    q, k, v, _ = qkv(1, 2, 2, 3, 4, d=2, dv=2, seed=14)
    slopes = torch.tensor([0.5, 0.25])
    out = attnkit.attention(q, k, v, alibi_slopes=slopes, backend="tiled")
    want = ref(q, k, v, bias=fa_alibi_bias(slopes, 3, 4, 0))
    assert torch.allclose(out, want, atol=ATOL, rtol=0)


def test_softcap_keyword(backend, small_tiles):
    q, k, v, dout = qkv(B, HQ, HKV, LQ, LK, seed=6)
    cap = 1.7
    if backend == "fused":
        with pytest.raises(NotImplementedError, match="fused does not run softcap.*not additive"):
            attnkit.attention(q, k, v, softcap=cap, backend=backend)
        return
    mask = M.sliding_window(8, 8)
    out, lse = attnkit.attention(q, k, v, softcap=cap, mask=mask, return_lse=True,
                                 backend=backend)
    # oracle spelled out by hand rather than through the reference's own softcap term
    r, rl = ref(q, k, v, score_mod=lambda s, b, h, i, j: cap * torch.tanh(s / cap),
                mask=dense(mask, B, HQ, LQ, LK), return_lse=True)
    assert_out_lse(out, lse, r, rl)
    assert_grads(torch.autograd.grad(out, (q, k, v), dout),
                 torch.autograd.grad(r, (q, k, v), dout))
    # softcap= and score_mod=softcap() are the same function
    same = attnkit.attention(q, k, v, score_mod=S.softcap(cap), mask=mask, backend=backend)
    assert torch.allclose(same, out, atol=ATOL, rtol=0)


# ---- low precision: FlashAttention's tolerance rule -----------------------------------------


def plain_attention(q, k, v, mask, score_mod):
    """Textbook attention in the inputs' dtype: the error baseline for the FA rule."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    s = score_mod(s, *grids(*s.shape)).to(q.dtype)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    return p @ v


LOW = [
    ("document_causal_alibi_block_mask", "fused"),
    ("document_causal_alibi_block_mask", "tiled"),
    ("window_softcap_mask_mod", "tiled"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case,backend", LOW)
def test_low_precision_fa_rule(case, backend, dtype):
    lq = lk = 160
    if case.startswith("document"):
        mod = M.and_masks(M.causal(), M.document_from_lengths([50, 61, 49]))
        score_mod = S.alibi(S.alibi_slopes(4))
        mask = attnkit.create_block_mask(mod, 1, 1, lq, lk, BLOCK_SIZE=64)
    else:
        mod = M.sliding_window(33, 5)
        score_mod = S.softcap(5.0)
        mask = mod
    q, k, v, _ = qkv(2, 4, 2, lq, lk, d=32, dv=32, seed=7)
    ql, kl, vl = (t.detach().mul(2).to(dtype) for t in (q, k, v))  # 2x: sharper softmax
    r = ref(ql, kl, vl, mask=dense(mod, 2, 4, lq, lk), score_mod=score_mod)
    out = attnkit.attention(ql, kl, vl, mask=mask, score_mod=score_mod, backend=backend)
    assert out.dtype == dtype
    plain = plain_attention(ql, kl, vl, dense(mod, 2, 4, lq, lk), score_mod)
    ok, err, base = fa_tolerance_ok(out, r, plain)
    assert ok, (err, base)


# ---- gradcheck in float64 on tiny shapes -----------------------------------------------------


def _tiny(seed):
    g = torch.Generator().manual_seed(seed)
    q = rand(2, 2, 5, 3, gen=g, requires_grad=True)
    k = rand(2, 1, 7, 3, gen=g, requires_grad=True)
    v = rand(2, 1, 7, 2, gen=g, requires_grad=True)
    return g, q, k, v


@pytest.mark.parametrize("per_head", [False, True], ids=["table_1d", "table_per_head"])
def test_gradcheck_relative_bias_table(per_head, backend, small_tiles):
    g, q, k, v = _tiny(8)
    table = rand(*((2, 5) if per_head else (5,)), gen=g, requires_grad=True)
    mask = M.causal("bottom_right", 5, 7)

    def fn(q, k, v, table):
        return attnkit.attention(q, k, v, score_mod=S.relative_bias(table), mask=mask,
                                 backend=backend)

    assert torch.autograd.gradcheck(fn, (q, k, v, table))


@pytest.mark.parametrize("spelling", ["score_mod", "keyword"])
def test_gradcheck_softcap(spelling, small_tiles):
    _, q, k, v = _tiny(9)
    kw = dict(score_mod=S.softcap(0.8)) if spelling == "score_mod" else dict(softcap=0.8)

    def fn(q, k, v):
        return attnkit.attention(q * 3, k, v, mask=M.sliding_window(3, 1), backend="tiled",
                                 **kw)

    assert torch.autograd.gradcheck(fn, (q, k, v))


# ---- block-sparse runs call the mask_mod only on partial blocks ------------------------------


def test_block_mask_evaluates_mask_mod_only_on_partial_blocks():
    docs = M.and_masks(M.causal(), M.document_from_lengths([40, 90, 70, 56]))  # L = 256
    calls = []

    def counting(b, h, q_idx, kv_idx):
        calls.append((int(q_idx.min()), int(q_idx.max()), int(kv_idx.min()),
                      int(kv_idx.max()), q_idx.numel(), kv_idx.numel()))
        return docs(b, h, q_idx, kv_idx)

    bs = 32
    block_mask = attnkit.create_block_mask(counting, 1, 1, 256, 256, BLOCK_SIZE=bs)
    kinds = block_mask.block_kinds()[0, 0]
    partial = {(int(a), int(c)) for a, c in torch.nonzero(kinds == BLOCK_PARTIAL)}
    total = kinds.numel()
    assert 0 < len(partial) < total
    q, k, v, dout = qkv(1, 2, 2, 256, 256, seed=10)

    def seen_tiles():
        tiles = []
        for q0, q1, k0, k1, nq, nk in calls:
            assert (nq, nk) == (bs, bs), "the mask_mod ran on more than one tile"
            assert q0 % bs == 0 and q1 == q0 + bs - 1 and k0 % bs == 0 and k1 == k0 + bs - 1
            tiles.append((q0 // bs, k0 // bs))
        return tiles

    calls.clear()
    out = attnkit.attention(q, k, v, mask=block_mask, backend="tiled")
    tiles = seen_tiles()
    assert 0 < len(tiles) < total
    assert len(set(tiles)) == len(tiles)  # no tile twice
    assert set(tiles) <= partial  # never on a full or an empty tile
    assert len(tiles) == len(partial)  # today: every partial tile, once

    calls.clear()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    tiles = seen_tiles()
    assert len(set(tiles)) == len(tiles) and set(tiles) <= partial

    r = ref(q, k, v, mask=dense(docs, 1, 2, 256, 256))
    assert torch.allclose(out, r, atol=ATOL, rtol=0)
    assert_grads(grads, torch.autograd.grad(r, (q, k, v), dout))


# ---- fully masked rows through mask_mods -----------------------------------------------------


@pytest.mark.parametrize("how", ["padding_mask_mod", "padding_block_mask", "seqlens_q_keyword"])
def test_fully_masked_rows_give_zero_and_minus_inf(how, backend, small_tiles):
    q, k, v, dout = qkv(B, HQ, HKV, LQ, LK, seed=11)
    pad = M.padding([25, LQ], [LK, 0])  # batch 1 sees no key at all
    if how == "padding_mask_mod":
        kw = dict(mask=pad)
    elif how == "padding_block_mask":
        kw = dict(mask=attnkit.create_block_mask(pad, B, 1, LQ, LK, BLOCK_SIZE=16))
    else:
        kw = dict(mask=M.document(doc_ids(LQ, [20]), doc_ids(LK, [10])),
                  seqlens_q=torch.tensor([25, LQ]), seqlens_kv=torch.tensor([LK, 0]))
    dead = torch.zeros(B, HQ, LQ, dtype=torch.bool)
    dead[0, :, 25:] = True
    dead[1] = True
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend=backend, **kw)
    assert torch.all(out[dead] == 0)
    assert torch.all(torch.isneginf(lse[dead]))
    assert torch.isfinite(lse[~dead]).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for gt in (dq, dk, dv):
        assert torch.isfinite(gt).all()
    assert torch.all(dq[dead] == 0)
    assert torch.all(dk[1] == 0) and torch.all(dv[1] == 0)
    vis = dense(pad, B, HQ, LQ, LK)
    if how == "seqlens_q_keyword":
        vis = vis & dense(kw["mask"], B, HQ, LQ, LK)
    r, rl = ref(q, k, v, mask=vis, return_lse=True)
    assert_out_lse(out, lse, r, rl)
    assert_grads((dq, dk, dv), torch.autograd.grad(r, (q, k, v), dout))


# ---- return_aux max_scores ----------------------------------------------------------------


@pytest.mark.parametrize("as_block_mask", [False, True], ids=["mask_mod", "block_mask"])
def test_max_scores_is_masked_row_max_of_final_scores(as_block_mask, small_tiles):
    g = torch.Generator().manual_seed(12)
    q, k, v, _ = qkv(B, HQ, HKV, LQ, LK, seed=12)
    mask = M.and_masks(M.padding([30, LQ], [LK, 41]), M.sliding_window(5, 2))
    mod = S.compose(S.relative_bias(rand(HQ, 9, gen=g)), S.softcap(3.0))
    m = attnkit.create_block_mask(mask, B, 1, LQ, LK, BLOCK_SIZE=16) if as_block_mask else mask
    request = attnkit.AuxRequest(lse=True, max_scores=True)
    out, aux = attnkit.attention(q, k, v, mask=m, score_mod=mod, return_aux=request)
    assert isinstance(aux, attnkit.AuxOutput) and aux.dropout_mask is None
    s, vis = ref_scores(q.detach(), k.detach(), v.detach(), mask=dense(mask, B, HQ, LQ, LK),
                        score_mod=mod)
    want = s.masked_fill(~vis, float("-inf")).amax(-1)
    assert torch.isneginf(want).any() and torch.isfinite(want).any()
    assert torch.equal(torch.isneginf(aux.max_scores), torch.isneginf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(aux.max_scores[fin], want[fin], atol=ATOL, rtol=0)
    # max_scores bounds lse from below, with equality only for a single visible key
    assert torch.all(aux.lse[fin] >= aux.max_scores[fin] - 1e-12)
    r, rl = ref(q, k, v, mask=dense(mask, B, HQ, LQ, LK), score_mod=mod, return_lse=True)
    assert_out_lse(out, aux.lse, r, rl)
    with pytest.raises(NotImplementedError, match="max_scores"):
        attnkit.attention(q, k, v, mask=m, return_aux=request, backend="fused")


# ---- bugs --------------------------------------------------------------------------------


@pytest.mark.parametrize("mod", [M.causal(), M.sliding_window(2, 0)], ids=lambda m: m.__name__)
def test_mask_mod_with_bottom_right_diagonal_no_seqlens(mod, backend):
    """A mask_mod sees absolute indices whatever ``diagonal`` says (passes today)."""
    q, k, v, _ = qkv(2, 2, 2, 8, 11, d=4, dv=4, seed=13)
    out = attnkit.attention(q, k, v, mask=mod, diagonal="bottom_right", backend=backend)
    assert torch.allclose(out, ref(q, k, v, mask=dense(mod, 2, 2, 8, 11)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("mod", [M.causal(), M.sliding_window(2, 0)], ids=lambda m: m.__name__)
def test_mask_mod_with_bottom_right_diagonal_and_seqlens(mod, backend):
    """Regression: build_spec once absorbed a builtin causal/window mask_mod into the band
    before seqlens were set, shifting it by the per-batch bottom-right offset."""
    q, k, v, _ = qkv(2, 2, 2, 8, 8, d=4, dv=4, seed=13)
    lens = dict(seqlens_q=torch.tensor([8, 5]), seqlens_kv=torch.tensor([8, 8]))
    out = attnkit.attention(q, k, v, mask=mod, diagonal="bottom_right", backend=backend, **lens)
    # the mask_mod's meaning (absolute indices) AND the padding; diagonal touches neither
    want = ref(q, k, v, mask=dense(mod, 2, 2, 8, 8), diagonal="bottom_right", **lens)
    assert torch.allclose(out, want, atol=ATOL, rtol=0)


KV_INDEPENDENT = {
    "query_only": lambda b, h, q_idx, kv_idx: q_idx % 3 != 1,  # result (1, 1, bq, 1)
    "batch_head_only": lambda b, h, q_idx, kv_idx: (b == 0) | (h == 1),  # (N, Hq, 1, 1)
}


@pytest.mark.parametrize("name", list(KV_INDEPENDENT))
def test_mask_mod_result_broadcast_over_keys(name, backend, small_tiles):
    mod = KV_INDEPENDENT[name]
    q, k, v, _ = qkv(B, HQ, HKV, LQ, LK, seed=15)
    out = attnkit.attention(q, k, v, mask=mod, backend=backend)
    assert torch.allclose(out, ref(q, k, v, mask=dense(mod, B, HQ, LQ, LK)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(KV_INDEPENDENT))
def test_kv_independent_mask_mod_as_block_mask(name, backend, small_tiles):
    """The same masks through a BlockMask (evaluated per tile) are right today."""
    mod = KV_INDEPENDENT[name]
    q, k, v, _ = qkv(B, HQ, HKV, LQ, LK, seed=15)
    bm = attnkit.create_block_mask(mod, B, HQ, LQ, LK, BLOCK_SIZE=16)
    out = attnkit.attention(q, k, v, mask=bm, backend=backend)
    assert torch.allclose(out, ref(q, k, v, mask=dense(mod, B, HQ, LQ, LK)), atol=ATOL, rtol=0)
