"""BlockMask / create_block_mask against torch's FlexAttention field by field, and against a
dense per-tile oracle; chunked evaluation, the analytic fast path, accessors and errors."""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

from attnkit import block_mask as BM
from attnkit import masks as M
from attnkit.block_mask import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, BlockMask

FIELDS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]


def assert_same_fields(ours, theirs):
    for name in FIELDS:
        a, b = getattr(ours, name), getattr(theirs, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype == torch.int32, name
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert a.is_contiguous(), name
        assert torch.equal(a, b), name
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE)
    assert tuple(ours.seq_lengths) == tuple(theirs.seq_lengths)
    assert ours.shape == theirs.shape


def dense_mask(mod, B, H, Lq, Lk):
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(Lq).view(1, 1, Lq, 1)
    k = torch.arange(Lk).view(1, 1, 1, Lk)
    return mod(b, h, q, k).expand(B, H, Lq, Lk)


def tile_oracle(mod, B, H, Lq, Lk, bq, bk):
    """Per-tile any / all of the dense mask, positions past the end counted as hidden."""
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    padded = torch.zeros(B, H, nq * bq, nk * bk, dtype=torch.bool)
    padded[:, :, :Lq, :Lk] = dense_mask(mod, B, H, Lq, Lk)
    tiles = padded.view(B, H, nq, bq, nk, bk)
    return tiles.any(dim=5).any(dim=3), tiles.all(dim=5).all(dim=3)


def unhinted(mod):
    """Same mask without the structure hint: forces evaluation."""
    def plain(b, h, q, k):
        return mod(b, h, q, k)
    return plain


def head_window(b, h, q_idx, kv_idx):
    """A mask that depends on the head (exercises per-head evaluation)."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 40 * (h + 1))


def batch_doc(b, h, q_idx, kv_idx):
    return ((q_idx // (50 + 30 * b)) == (kv_idx // (50 + 30 * b))) & (kv_idx <= q_idx)


MASKS = [
    M.causal(),
    M.causal("bottom_right", 300, 517),
    M.sliding_window(100),
    M.sliding_window(64, 200, "bottom_right", 300, 517),
    M.prefix_lm(200),
    M.document_from_lengths([100, 250, 167]),
    M.and_masks(M.causal(), M.document_from_lengths([130, 387])),
    M.chunked(96),
    M.noop_mask,
    head_window,
    batch_doc,
]


@pytest.mark.parametrize("mod", MASKS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("B,H", [(None, None), (2, 3)])
def test_fields_match_torch_odd_lengths(mod, B, H):
    ours = BM.create_block_mask(mod, B, H, 300, 517, device="cpu", BLOCK_SIZE=128)
    theirs = torch_create_block_mask(mod, B, H, 300, 517, device="cpu", BLOCK_SIZE=128)
    assert_same_fields(ours, theirs)
    assert ours.mask_mod is mod


@pytest.mark.parametrize("mod", [M.causal(), M.sliding_window(70, 10), M.prefix_lm(100),
                                 M.document_from_lengths([64, 64, 300, 84])],
                         ids=lambda m: m.__name__)
@pytest.mark.parametrize("shape,block", [((512, 512), 128), ((512, 512), (64, 128)),
                                         ((1, 512), 128), ((512, 37), (32, 16))])
def test_fields_match_torch_block_sizes(mod, shape, block):
    ours = BM.create_block_mask(mod, 1, 2, *shape, BLOCK_SIZE=block)
    theirs = torch_create_block_mask(mod, 1, 2, *shape, device="cpu", BLOCK_SIZE=block)
    assert_same_fields(ours, theirs)


def test_separate_full_blocks_false_matches_torch():
    ours = BM.create_block_mask(M.causal(), 2, 1, 300, 517, separate_full_blocks=False)
    theirs = torch_create_block_mask(M.causal(), 2, 1, 300, 517, device="cpu",
                                     separate_full_blocks=False)
    assert_same_fields(ours, theirs)
    assert ours.full_kv_num_blocks is None and ours.full_q_indices is None


def test_last_partial_block_is_never_full():
    # noop mask on 300 x 517: tiles cut by either length are partial, as in torch.
    bm = BM.create_block_mask(M.noop_mask, 1, 1, 300, 517)
    kinds = bm.block_kinds()[0, 0]
    assert (kinds[:2, :4] == BLOCK_FULL).all()
    assert (kinds[2, :] == BLOCK_PARTIAL).all() and (kinds[:, 4] == BLOCK_PARTIAL).all()


@pytest.mark.parametrize("mod", MASKS[:8] + [head_window, batch_doc],
                         ids=lambda m: m.__name__)
def test_block_kinds_and_to_dense_match_tile_oracle(mod):
    B, H, Lq, Lk, bq, bk = 2, 3, 300, 517, 64, 128
    any_, all_ = tile_oracle(mod, B, H, Lq, Lk, bq, bk)
    bm = BM.create_block_mask(mod, B, H, Lq, Lk, BLOCK_SIZE=(bq, bk))
    want = torch.where(all_, BLOCK_FULL, torch.where(any_, BLOCK_PARTIAL, BLOCK_EMPTY))
    assert torch.equal(bm.block_kinds(), want.to(torch.int8))
    dense = bm.to_dense()
    assert dense.dtype == torch.int32 and torch.equal(dense, any_.to(torch.int32))


def _random_band_mask(rng, Lq, Lk):
    left = rng.choice([None, 0, 1, rng.randrange(0, 120)])
    right = rng.choice([None, 0, rng.randrange(0, 90)])
    diag = rng.choice(["top_left", "bottom_right"])
    kind = rng.randrange(5)
    if kind == 0:
        return M.causal(diag, Lq, Lk)
    if kind == 1:
        return M.sliding_window(left, right, diag, Lq, Lk)
    if kind == 2:
        return M.prefix_lm(rng.randrange(0, Lk + 50))
    if kind == 3:
        return M.and_masks(M.sliding_window(left, right, diag, Lq, Lk),
                           M.causal(rng.choice(["top_left", "bottom_right"]), Lq, Lk))
    return M.and_masks(M.sliding_window(left, 0), M.sliding_window(0, right))


def test_structure_fast_path_equals_evaluation():
    """The analytic classification of builtin band masks equals evaluating the mask."""
    rng = random.Random(1234)
    for _ in range(120):
        # Small on purpose: tensors under torch's parallel grain stay cheap on a busy CPU.
        Lq, Lk = rng.randrange(1, 200), rng.randrange(1, 200)
        block = (rng.choice([8, 16, 32, 13]), rng.choice([8, 16, 32, 24]))
        mod = _random_band_mask(rng, Lq, Lk)
        assert M.structure_of(mod) is not None
        fast = BM.create_block_mask(mod, 1, 1, Lq, Lk, BLOCK_SIZE=block)
        slow = BM.create_block_mask(unhinted(mod), 1, 1, Lq, Lk, BLOCK_SIZE=block)
        assert torch.equal(fast.block_kinds(), slow.block_kinds()), (mod.__name__, Lq, Lk,
                                                                      block)
        assert_same_fields(fast, slow)


def test_disjoint_band_intersection_is_empty():
    mod = M.and_masks(M.sliding_window(0, None), M.sliding_window(None, 0, "bottom_right",
                                                                  10, 5))
    bm = BM.create_block_mask(mod, 1, 1, 300, 200, BLOCK_SIZE=64)  # kv >= q and kv <= q - 5
    assert int(bm.kv_num_blocks.sum()) == 0 and int(bm.full_kv_num_blocks.sum()) == 0


def test_chunked_evaluation_matches_and_is_bounded(monkeypatch):
    """Tiny chunk budget: many row and column chunks, same result; no call sees more than
    one chunk of positions."""
    biggest = [0]

    def watched(b, h, q, k):
        out = head_window(b, h, q, k)
        biggest[0] = max(biggest[0], q.numel() * k.numel() * out.shape[1])
        return out

    want = BM.create_block_mask(head_window, 2, 3, 300, 517, BLOCK_SIZE=(32, 48))
    monkeypatch.setattr(BM, "_CHUNK_ELEMENTS", 3 * 32 * 48 * 2)
    got = BM.create_block_mask(watched, 2, 3, 300, 517, BLOCK_SIZE=(32, 48))
    assert_same_fields(got, want)
    assert biggest[0] <= 3 * 32 * 48 * 2
    assert biggest[0] >= 32 * 48 * 3  # a chunk holds at least one tile per head


def test_mask_never_sees_out_of_range_positions():
    ids = torch.tensor([0] * 70 + [1] * 60)  # length 130, not a multiple of 64

    def strict(b, h, q, k):
        assert int(q.max()) < 130 and int(k.max()) < 130
        return ids[q] == ids[k]

    ours = BM.create_block_mask(strict, 1, 1, 130, 130, BLOCK_SIZE=64)
    theirs = torch_create_block_mask(M.document(ids), 1, 1, 130, 130, device="cpu",
                                     BLOCK_SIZE=64)
    assert_same_fields(ours, theirs)


def test_causal_131072_builds_fast():
    start = time.perf_counter()
    bm = BM.create_block_mask(M.causal(), 1, 1, 131072, 131072)
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, elapsed
    n = 1024
    assert bm.kv_indices.shape == (1, 1, n, n)
    assert (bm.kv_num_blocks == 1).all()
    assert torch.equal(bm.full_kv_num_blocks[0, 0], torch.arange(n, dtype=torch.int32))
    assert torch.equal(bm.kv_indices[0, 0, :, 0], torch.arange(n, dtype=torch.int32))
    assert torch.equal(bm.q_num_blocks[0, 0], torch.ones(n, dtype=torch.int32))
    assert bm.sparsity() == pytest.approx(100 * (1 - (n * (n + 1) / 2) / n ** 2))


def test_generic_mask_16384_builds_in_bounded_chunks():
    calls = []

    def plain_causal(b, h, q, k):
        calls.append(q.numel() * k.numel())
        return q >= k

    bm = BM.create_block_mask(plain_causal, 1, 1, 16384, 16384)
    assert max(calls) <= BM._CHUNK_ELEMENTS and len(calls) > 2
    assert (bm.kv_num_blocks == 1).all() and int(bm.full_kv_num_blocks[0, 0, -1]) == 127


def test_to_string_matches_torch_and_draws_causal():
    ours = BM.create_block_mask(M.causal(), 2, 3, 512, 512)
    theirs = torch_create_block_mask(M.causal(), 2, 3, 512, 512, device="cpu")
    assert ours.to_string() == theirs.to_string()
    assert ours.to_string(limit=1) == theirs.to_string(limit=1)
    assert ours.to_string(grid_size=2) == theirs.to_string(grid_size=2)
    assert ours.to_string(grid_size=-1, limit=10) == theirs.to_string(grid_size=-1, limit=10)
    small = BM.create_block_mask(M.causal(), 1, 1, 512, 512).to_string()
    assert small == "(0, 0)\n██      \n████    \n██████  \n████████\n"
    big = BM.create_block_mask(M.sliding_window(1024), None, None, 4096, 4096).to_string()
    assert "░░" in big and "██" in big and "To print" not in big
    assert "To print out more" in ours.to_string()
    assert str(ours).startswith("BlockMask(shape=(2, 3, 512, 512), sparsity=37.50%")


def test_from_kv_blocks_matches_torch_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(2, 3, 5, 7, generator=g) < 0.4
    num = dense.sum(-1).to(torch.int32)
    order = torch.argsort(dense.to(torch.int32), dim=-1, descending=True, stable=True)
    idx = order.to(torch.int32)
    # Garbage past the counts must be ignored.
    garbage = torch.where(torch.arange(7) < num.unsqueeze(-1), idx, torch.zeros_like(idx))
    full_dense = ~dense & (torch.rand(2, 3, 5, 7, generator=g) < 0.3)
    fnum = full_dense.sum(-1).to(torch.int32)
    fidx = torch.argsort(full_dense.to(torch.int32), dim=-1, descending=True,
                         stable=True).to(torch.int32)
    ours = BlockMask.from_kv_blocks(num, garbage, fnum, fidx, BLOCK_SIZE=(16, 32))
    theirs = TorchBlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=(16, 32))
    assert_same_fields_except(ours, theirs, skip={"kv_indices"})
    assert ours.seq_lengths == (80, 224)
    kinds = ours.block_kinds()
    assert torch.equal(kinds == BLOCK_PARTIAL, dense) and torch.equal(kinds == BLOCK_FULL,
                                                                      full_dense)
    assert ours.mask_mod is M.noop_mask
    no_q = BlockMask.from_kv_blocks(num, idx, compute_q_blocks=False)
    assert no_q.q_indices is None and no_q.full_kv_indices is None


def assert_same_fields_except(ours, theirs, skip):
    for name in FIELDS:
        if name not in skip:
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name


def test_getitem_matches_torch_and_remaps_mask_mod():
    ours = BM.create_block_mask(batch_doc, 3, 2, 300, 517)
    theirs = torch_create_block_mask(batch_doc, 3, 2, 300, 517, device="cpu")
    for index in [1, (2, 1), (slice(0, 2), slice(1, 2)), -1,
                  (0, 1, torch.tensor([2, 0]))]:
        assert_same_fields(ours[index], theirs[index])
    sub = ours[2, 1]
    assert sub.kv_num_blocks.shape == (1, 1, 3)
    fresh = BM.create_block_mask(sub.mask_mod, 1, 1, 300, 517)
    assert_same_fields(fresh, theirs[2, 1])  # b = 0 of the slice means the original b = 2
    with pytest.raises(RuntimeError, match="query-block"):
        ours[0, 0, torch.tensor([1])].mask_mod(*[torch.zeros(1, dtype=torch.long)] * 4)
    with pytest.raises(IndexError):
        ours[3]


def test_kv_blocks_for_and_broadcast():
    bm = BM.create_block_mask(M.sliding_window(200), None, None, 1024, 1024)
    kinds = bm.block_kinds()
    for qb in range(8):
        partial, full = bm.kv_blocks_for(5, 7, qb)  # size-1 dims broadcast
        assert partial.dtype == full.dtype == torch.int64
        row = kinds[0, 0, qb]
        assert partial.tolist() == torch.nonzero(row == BLOCK_PARTIAL).flatten().tolist()
        assert full.tolist() == torch.nonzero(row == BLOCK_FULL).flatten().tolist()
    assert bm.kv_blocks_for(0, 0, 3)[0].tolist() == [1, 2, 3]
    assert bm.kv_blocks_for(0, 0, 3)[1].tolist() == []
    per_head = BM.create_block_mask(head_window, 1, 4, 512, 512, BLOCK_SIZE=32)
    assert per_head.kv_blocks_for(0, 3, 15)[1].tolist() == [11, 12, 13, 14]
    with pytest.raises(IndexError, match="h=4"):
        per_head.kv_blocks_for(0, 4, 0)
    no_full = BM.create_block_mask(M.causal(), 1, 1, 256, 256, separate_full_blocks=False)
    assert no_full.kv_blocks_for(0, 0, 1)[0].tolist() == [0, 1]
    assert no_full.kv_blocks_for(0, 0, 1)[1].numel() == 0


def test_shape_numel_sparsity_repr_to():
    bm = BM.create_block_mask(M.causal(), 2, 4, 1024, 1024)
    theirs = torch_create_block_mask(M.causal(), 2, 4, 1024, 1024, device="cpu")
    assert bm.shape == (2, 4, 1024, 1024) and bm.numel() == 2 * 4 * 1024 * 1024
    assert bm.sparsity() == pytest.approx(theirs.sparsity())
    r = repr(bm)
    assert "kv_indices=torch.Size([2, 4, 8, 8])" in r and "mask_mod=causal" in r
    assert "sparsity=43.75%" in r
    moved = bm.to("cpu")
    assert moved is not bm and moved.mask_mod is bm.mask_mod
    assert_same_fields(moved, theirs)
    # Ragged lengths: only in-range positions of computed tiles count.
    ragged = BM.create_block_mask(M.noop_mask, 1, 1, 300, 517)
    assert ragged.sparsity() == pytest.approx(0.0)
    assert BM.create_block_mask(M.or_masks(), 1, 1, 300, 517).sparsity() == 100.0


def test_torch_interop_runs_flex_attention():
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    mod = M.and_masks(M.causal(), M.document_from_lengths([50, 43]))
    ours = BM.create_block_mask(mod, 1, 2, 93, 93, BLOCK_SIZE=32)
    theirs = ours.to_torch()
    assert isinstance(theirs, TorchBlockMask)
    assert_same_fields(BlockMask.from_torch(theirs), ours)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 93, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        out = flex_attention(q, k, v, block_mask=theirs)
    s = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    s = s.masked_fill(~dense_mask(mod, 1, 2, 93, 93), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def test_zero_length():
    bm = BM.create_block_mask(M.causal(), 2, 1, 0, 300)
    assert bm.kv_num_blocks.shape == (2, 1, 0) and bm.kv_indices.shape == (2, 1, 0, 3)
    assert bm.q_indices.shape == (2, 1, 3, 0) and bm.sparsity() == 0.0


@pytest.mark.parametrize("call,exc,words", [
    (lambda: BM.create_block_mask("causal", 1, 1, 8, 8), TypeError, ["mask_mod", "callable"]),
    (lambda: BM.create_block_mask(lambda s, b, h, q, k: s, 1, 1, 8, 8), TypeError,
     ["score_mod", "5 arguments"]),
    (lambda: BM.create_block_mask(lambda b, h, q, k: (q - k).float(), 1, 1, 8, 8), TypeError,
     ["bool", "torch.float32"]),
    (lambda: BM.create_block_mask(lambda b, h, q, k: torch.ones(3, 3, dtype=torch.bool),
                                  1, 1, 8, 8), ValueError, ["does not broadcast", "(3, 3)"]),
    (lambda: BM.create_block_mask(M.causal(), 0, 1, 8, 8), ValueError, ["B", ">= 1", "None"]),
    (lambda: BM.create_block_mask(M.causal(), 1, 1.5, 8, 8), TypeError, ["H"]),
    (lambda: BM.create_block_mask(M.causal(), 1, 1, -8, 8), ValueError, ["Q_LEN"]),
    (lambda: BM.create_block_mask(M.causal(), 1, 1, 8, 8, BLOCK_SIZE=0), ValueError,
     ["BLOCK_SIZE", ">= 1"]),
    (lambda: BM.create_block_mask(M.causal(), 1, 1, 8, 8, BLOCK_SIZE=(8, 8, 8)), ValueError,
     ["BLOCK_SIZE", "2 entries"]),
    (lambda: BlockMask.from_kv_blocks(torch.zeros(2, dtype=torch.int32),
                                      torch.zeros(3, 4, dtype=torch.int32)), ValueError,
     ["kv_num_blocks", "(3,)"]),
    (lambda: BlockMask.from_kv_blocks(torch.zeros(3, dtype=torch.int32),
                                      torch.zeros(3, 4, dtype=torch.int32),
                                      full_kv_num_blocks=torch.zeros(3, dtype=torch.int32)),
     ValueError, ["together"]),
    (lambda: BlockMask.from_kv_blocks(torch.zeros(3), torch.zeros(3, 4)), TypeError,
     ["integer"]),
    (lambda: BlockMask.from_kv_blocks(torch.zeros((), dtype=torch.int32),
                                      torch.zeros(4, dtype=torch.int32)), ValueError,
     ["at least 2 dims"]),
])
def test_errors(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value)


# --------------------------------------------------------------------------- torch's flex_attention
# and pickling


def _torch_flex(q, k, v, block_mask):
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        return flex_attention(q, k, v, block_mask=block_mask)


@pytest.mark.parametrize("make", [
    lambda: BM.create_block_mask(M.and_masks(M.causal(), M.document_from_lengths([50, 43])),
                                 1, 2, 93, 93, BLOCK_SIZE=32),
    lambda: BM.create_block_mask(head_window, 2, 2, 93, 130, BLOCK_SIZE=(16, 32)),
    lambda: BM.create_block_mask(batch_doc, 3, 2, 93, 93, BLOCK_SIZE=32)[1],
    lambda: BM.create_block_mask(batch_doc, 3, 2, 93, 93, BLOCK_SIZE=32,
                                 separate_full_blocks=False)[0:2, 1:2],
], ids=["doc_causal", "head_window_rect", "sliced_batch", "sliced_no_full"])
def test_torch_flex_attention_takes_attnkit_block_mask(make):
    ours = make()
    b, h, lq, lk = ours.shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, lq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, h, lk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = _torch_flex(q, k, v, ours)  # attnkit's BlockMask, as it is
    torch.testing.assert_close(out, _torch_flex(q, k, v, ours.to_torch()), rtol=0, atol=0)
    assert len(ours.as_tuple()) == len(ours.to_torch().as_tuple())
    # and the meaning is the mask_mod's, against a dense computation
    bi = torch.arange(b).view(b, 1, 1, 1)
    hi = torch.arange(h).view(1, h, 1, 1)
    vis = ours.mask_mod(bi, hi, torch.arange(lq).view(1, 1, lq, 1),
                        torch.arange(lk).view(1, 1, 1, lk)).expand(b, h, lq, lk)
    s = ((q @ k.transpose(-1, -2)) / 8 ** 0.5).masked_fill(~vis, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def _assert_same_block_mask(a, b):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.seq_lengths == b.seq_lengths and a.BLOCK_SIZE == b.BLOCK_SIZE
    assert torch.equal(a.to_dense(), b.to_dense())
    assert torch.equal(a.block_kinds(), b.block_kinds())


def _pickle_round_trip(bm):
    import pickle

    return pickle.loads(pickle.dumps(bm))


def _torch_save_round_trip(bm):
    import io

    buf = io.BytesIO()
    torch.save(bm, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("round_trip", [_pickle_round_trip, _torch_save_round_trip],
                         ids=["pickle", "torch.save"])
@pytest.mark.parametrize("select", [None, 0, (slice(1, 3), 1), (2, 0, slice(1, 3))],
                         ids=["whole", "bm[0]", "bm[1:3, 1]", "bm[2, 0, 1:3]"])
def test_block_mask_pickles_and_torch_saves(round_trip, select):
    whole = BM.create_block_mask(batch_doc, 3, 2, 300, 517, BLOCK_SIZE=64)
    bm = whole if select is None else whole[select]
    back = round_trip(bm)
    assert back is not bm and isinstance(back, BlockMask)
    _assert_same_block_mask(back, bm)
    assert back.mask_mod.__name__ == bm.mask_mod.__name__
    if select is None or len(select if isinstance(select, tuple) else (select,)) < 3:
        assert back.mask_mod.__name__ == "batch_doc"
        # the loaded mask_mod still means the selected batch/head entries
        nb, nh = bm.shape[:2]
        args = (torch.arange(nb).view(nb, 1, 1, 1), torch.arange(nh).view(1, nh, 1, 1),
                torch.arange(300).view(1, 1, 300, 1), torch.arange(517).view(1, 1, 1, 517))
        assert torch.equal(back.mask_mod(*args), bm.mask_mod(*args))
        _assert_same_block_mask(BM.create_block_mask(back.mask_mod, nb, nh, 300, 517,
                                                     BLOCK_SIZE=64), bm)
    else:  # query blocks selected: the mask_mod still refuses to be called
        with pytest.raises(RuntimeError, match="query-block"):
            back.mask_mod(*[torch.zeros(1, dtype=torch.long)] * 4)


def test_to_torch_without_flex_attention_says_what_to_do(monkeypatch):
    import sys

    import torch.nn.attention

    bm = BM.create_block_mask(M.causal(), 1, 1, 64, 64)
    monkeypatch.delattr(torch.nn.attention, "flex_attention")
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)
    with pytest.raises(NotImplementedError, match=r"torch >= 2\.5.*attnkit\.flex_attention"):
        bm.to_torch()
