"""Builtin mask_mods against explicit dense formulas, their names, hints, algebra and errors."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask as torch_create_mask

from attnkit import masks as M


def dense(mod, B, H, Lq, Lk):
    """Evaluate a mask_mod on broadcast index grids -> bool (B, H, Lq, Lk)."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(Lq).view(1, 1, Lq, 1)
    k = torch.arange(Lk).view(1, 1, 1, Lk)
    out = mod(b, h, q, k)
    assert out.dtype == torch.bool
    return out.expand(B, H, Lq, Lk)


def grid(Lq, Lk):
    return torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]


def picture(text):
    rows = [r.split() for r in text.strip().splitlines()]
    return torch.tensor([[c == "1" for c in r] for r in rows])


SHAPES = [(7, 7), (5, 11), (11, 5), (1, 9)]


@pytest.mark.parametrize("Lq,Lk", SHAPES)
def test_causal_top_left_and_bottom_right(Lq, Lk):
    i, j = grid(Lq, Lk)
    assert torch.equal(dense(M.causal(), 1, 1, Lq, Lk)[0, 0], j <= i)
    br = M.causal("bottom_right", q_len=Lq, kv_len=Lk)
    assert torch.equal(dense(br, 1, 1, Lq, Lk)[0, 0], j <= i + Lk - Lq)


def test_pictures_from_docstrings():
    assert torch.equal(dense(M.causal("bottom_right", 2, 5), 1, 1, 2, 5)[0, 0],
                       picture("1 1 1 1 0\n1 1 1 1 1"))
    assert torch.equal(dense(M.sliding_window(1), 1, 1, 5, 5)[0, 0], picture("""
        1 0 0 0 0
        1 1 0 0 0
        0 1 1 0 0
        0 0 1 1 0
        0 0 0 1 1"""))
    assert torch.equal(dense(M.prefix_lm(2), 1, 1, 5, 5)[0, 0], picture("""
        1 1 0 0 0
        1 1 0 0 0
        1 1 1 0 0
        1 1 1 1 0
        1 1 1 1 1"""))
    assert torch.equal(dense(M.chunked(2), 1, 1, 5, 5)[0, 0], picture("""
        1 0 0 0 0
        1 1 0 0 0
        0 0 1 0 0
        0 0 1 1 0
        0 0 0 0 1"""))
    assert torch.equal(dense(M.document_from_lengths([2, 3]), 1, 1, 5, 5)[0, 0], picture("""
        1 1 0 0 0
        1 1 0 0 0
        0 0 1 1 1
        0 0 1 1 1
        0 0 1 1 1"""))
    assert torch.equal(dense(M.dilated_sliding_window(2, 2), 1, 1, 5, 5)[0, 0], picture("""
        1 0 0 0 0
        0 1 0 0 0
        1 0 1 0 0
        0 1 0 1 0
        0 0 1 0 1"""))


@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (3, 1), (None, 0), (1, None),
                                        (None, None), (0, 2)])
@pytest.mark.parametrize("diagonal", ["top_left", "bottom_right"])
def test_sliding_window(Lq, Lk, left, right, diagonal):
    i, j = grid(Lq, Lk)
    qp = i + (Lk - Lq if diagonal == "bottom_right" else 0)
    want = torch.ones(Lq, Lk, dtype=torch.bool)
    if left is not None:
        want &= qp - left <= j
    if right is not None:
        want &= j <= qp + right
    mod = M.sliding_window(left, right, diagonal, q_len=Lq, kv_len=Lk)
    assert torch.equal(dense(mod, 1, 1, Lq, Lk)[0, 0], want)


def test_sliding_window_flash_attention_convention():
    # FlashAttention: visible iff i + sk - sq - left <= j <= i + sk - sq + right.
    sq, sk, left, right = 3, 8, 2, 1
    i, j = grid(sq, sk)
    want = (i + sk - sq - left <= j) & (j <= i + sk - sq + right)
    mod = M.sliding_window(left, right, "bottom_right", sq, sk)
    assert torch.equal(dense(mod, 1, 1, sq, sk)[0, 0], want)


@pytest.mark.parametrize("P", [0, 1, 3, 20])
def test_prefix_lm(P):
    i, j = grid(9, 12)
    assert torch.equal(dense(M.prefix_lm(P), 1, 1, 9, 12)[0, 0], (j <= i) | (j < P))


def test_document_1d_cross_and_2d():
    ids_q = torch.tensor([0, 0, 1, 1, 1, 2])
    ids_k = torch.tensor([0, 1, 1, 2, 2, 2, 2])
    want = ids_q[:, None] == ids_k[None, :]
    assert torch.equal(dense(M.document(ids_q, ids_k), 1, 1, 6, 7)[0, 0], want)
    assert torch.equal(dense(M.document(ids_q), 1, 1, 6, 6)[0, 0],
                       ids_q[:, None] == ids_q[None, :])
    ids2 = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [5, 5, 5, 5]])
    got = dense(M.document(ids2), 3, 2, 4, 4)
    for b in range(3):
        for h in range(2):
            assert torch.equal(got[b, h], ids2[b][:, None] == ids2[b][None, :])


def test_document_from_lengths_with_empty_document():
    mod = M.document_from_lengths(torch.tensor([3, 0, 2]))
    ids = torch.tensor([0, 0, 0, 2, 2])
    assert torch.equal(dense(mod, 1, 1, 5, 5)[0, 0], ids[:, None] == ids[None, :])
    assert torch.equal(M.structure_of(mod)["doc_ids_q"], ids)
    assert M.structure_of(mod)["lengths"].tolist() == [3, 0, 2]


def test_padding():
    sq, sk = torch.tensor([3, 5, 0]), torch.tensor([4, 2, 6])
    got = dense(M.padding(sq, sk), 3, 2, 5, 6)
    i, j = grid(5, 6)
    for b in range(3):
        want = (i < sq[b]) & (j < sk[b])
        assert torch.equal(got[b, 0], want) and torch.equal(got[b, 1], want)


@pytest.mark.parametrize("C", [1, 3, 4])
def test_chunked(C):
    i, j = grid(10, 10)
    assert torch.equal(dense(M.chunked(C), 1, 1, 10, 10)[0, 0], (i // C == j // C) & (j <= i))


@pytest.mark.parametrize("W,D", [(1, 1), (3, 1), (2, 3), (4, 2)])
def test_dilated_sliding_window(W, D):
    want = torch.zeros(12, 12, dtype=torch.bool)
    for i in range(12):
        for k in range(W):  # the k-th kept key, k * D positions back
            if i - k * D >= 0:
                want[i, i - k * D] = True
    assert torch.equal(dense(M.dilated_sliding_window(W, D), 1, 1, 12, 12)[0, 0], want)


def test_noop_mask_shape_and_values():
    out = dense(M.noop_mask, 2, 3, 4, 5)
    assert out.all()
    q, k = torch.arange(4).view(1, 1, 4, 1), torch.arange(5).view(1, 1, 1, 5)
    assert M.noop_mask(torch.zeros(1), torch.zeros(1), q, k).shape == (1, 1, 4, 5)


def test_algebra():
    a, b = M.causal(), M.sliding_window(2, 1)
    da, db = dense(a, 1, 1, 8, 8), dense(b, 1, 1, 8, 8)
    assert torch.equal(dense(M.and_masks(a, b), 1, 1, 8, 8), da & db)
    assert torch.equal(dense(M.or_masks(a, b), 1, 1, 8, 8), da | db)
    assert torch.equal(dense(M.not_mask(a), 1, 1, 8, 8), ~da)
    assert torch.equal(dense(M.and_masks(a, b, M.not_mask(M.prefix_lm(3))), 1, 1, 8, 8),
                       da & db & ~dense(M.prefix_lm(3), 1, 1, 8, 8))
    assert dense(M.and_masks(), 1, 1, 3, 4).all()
    assert not dense(M.or_masks(), 1, 1, 3, 4).any()
    # Plain (non-builtin) callables compose too.
    assert torch.equal(dense(M.and_masks(lambda b, h, q, k: k % 2 == 0, a), 1, 1, 6, 6),
                       da[..., :6, :6] & (torch.arange(6) % 2 == 0))


def test_names():
    assert M.causal().__name__ == "causal"
    assert M.causal("bottom_right", 3, 9).__name__ == "causal_bottom_right_3_9"
    assert M.sliding_window(512, 0).__name__ == "sliding_window_512_0"
    assert M.sliding_window(None, 4).__name__ == "sliding_window_none_4"
    assert M.prefix_lm(7).__name__ == "prefix_lm_7"
    assert M.chunked(64).__name__ == "chunked_64"
    assert M.dilated_sliding_window(4, 2).__name__ == "dilated_sliding_window_4_2"
    assert M.document_from_lengths([2, 3]).__name__ == "document_from_lengths_2docs_5"
    assert M.padding([1, 2], [3, 4]).__name__ == "padding_B2"
    assert M.noop_mask.__name__ == "noop_mask"
    assert M.and_masks(M.causal(), M.prefix_lm(2)).__name__ == "and(causal,prefix_lm_2)"
    assert M.or_masks(M.causal(), M.chunked(2)).__name__ == "or(causal,chunked_2)"
    assert M.not_mask(M.causal()).__name__ == "not(causal)"


def test_structure_hints():
    s = M.structure_of(M.causal("bottom_right", 2, 7))
    assert s == {"kind": "causal", "diagonal": "bottom_right", "offset": 5, "q_len": 2,
                 "kv_len": 7, "band": (None, 5)}
    s = M.structure_of(M.sliding_window(3, 1))
    assert s["kind"] == "window" and s["band"] == (-3, 1) and (s["left"], s["right"]) == (3, 1)
    assert M.structure_of(M.sliding_window(None, 2, "bottom_right", 1, 4))["band"] == (None, 5)
    assert M.structure_of(M.prefix_lm(4)) == {"kind": "prefix_lm", "prefix_len": 4}
    assert M.structure_of(M.chunked(8)) == {"kind": "chunked", "chunk_size": 8}
    assert M.structure_of(M.dilated_sliding_window(2, 3)) == {
        "kind": "dilated_window", "window": 2, "dilation": 3}
    assert M.structure_of(M.noop_mask) == {"kind": "full"}
    pad = M.structure_of(M.padding([1], [2]))
    assert pad["kind"] == "padding" and pad["seqlens_kv"].tolist() == [2]
    s = M.structure_of(M.and_masks(M.causal(), lambda b, h, q, k: q >= 0))
    assert s["kind"] == "and" and s["parts"][0]["kind"] == "causal" and s["parts"][1] is None
    assert M.structure_of(M.not_mask(M.prefix_lm(1)))["part"]["prefix_len"] == 1


def test_structure_hint_not_trusted_on_wrappers():
    base = M.causal()

    @functools.wraps(base)
    def wrapper(b, h, q, k):
        return base(b, h, q, k) & (k % 2 == 0)

    assert hasattr(wrapper, "_info")  # the description is copied by functools.wraps ...
    assert M.structure_of(wrapper) is None  # ... but not trusted
    assert M.structure_of(lambda b, h, q, k: q >= k) is None
    assert M.structure_of(base) is not None


@pytest.mark.parametrize("mod", [
    M.causal(), M.causal("bottom_right", 5, 9), M.sliding_window(2, 1),
    M.sliding_window(None, None), M.prefix_lm(3), M.document_from_lengths([4, 1, 4]),
    M.document(torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2, 2], [0] * 9])),
    M.padding([3, 9], [9, 2]), M.chunked(4), M.dilated_sliding_window(3, 2), M.noop_mask,
    M.and_masks(M.causal(), M.padding([5, 7], [6, 9])),
], ids=lambda m: m.__name__)
def test_matches_torch_create_mask(mod):
    """The same mask_mods run under torch's vmap-based evaluation."""
    want = torch_create_mask(mod, 2, 2, 5, 9, device="cpu")
    assert torch.equal(want, dense(mod, 2, 2, 5, 9))


@pytest.mark.parametrize("call,exc,words", [
    (lambda: M.causal("bottom-right"), ValueError, ["diagonal", "'bottom_right'"]),
    (lambda: M.causal("bottom_right"), ValueError, ["q_len", "kv_len"]),
    (lambda: M.causal("bottom_right", -1, 4), ValueError, ["q_len", ">= 0"]),
    (lambda: M.sliding_window(-1), ValueError, ["left", "None for an unbounded"]),
    (lambda: M.sliding_window(2, -3), ValueError, ["right"]),
    (lambda: M.sliding_window(2.5), TypeError, ["left", "float"]),
    (lambda: M.sliding_window(True), TypeError, ["left", "bool"]),
    (lambda: M.prefix_lm(-2), ValueError, ["prefix_len", "-2"]),
    (lambda: M.chunked(0), ValueError, ["chunk_size", ">= 1"]),
    (lambda: M.dilated_sliding_window(0, 1), ValueError, ["window"]),
    (lambda: M.dilated_sliding_window(2, 0), ValueError, ["dilation"]),
    (lambda: M.document(torch.tensor([0.0, 1.0])), TypeError, ["doc_ids_q", "integer"]),
    (lambda: M.document(torch.zeros(2, 2, 2, dtype=torch.long)), ValueError, ["1-D or 2-D"]),
    (lambda: M.document(torch.zeros(3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)),
     ValueError, ["1-D", "2-D"]),
    (lambda: M.document(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 3,
                                                                          dtype=torch.long)),
     ValueError, ["batch size"]),
    (lambda: M.document_from_lengths([2, -1]), ValueError, ["lengths", "non-negative"]),
    (lambda: M.padding([1, 2], [1]), ValueError, ["seqlens_q", "seqlens_kv", "(B,)"]),
    (lambda: M.padding([1, -2], [1, 1]), ValueError, ["non-negative"]),
    (lambda: M.and_masks(M.causal(), 3), TypeError, ["and_masks", "argument 1"]),
    (lambda: M.or_masks("causal"), TypeError, ["or_masks"]),
    (lambda: M.not_mask(None), TypeError, ["not_mask"]),
])
def test_errors(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value)
