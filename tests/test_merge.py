"""Tests for attnkit.merge: partial attention states merge exactly into full attention.

The oracle is dense float64 attention over a subset of the keys, returning the subset's
normalised output and the natural-log log-sum-exp of its scores (``-inf`` for no keys).
"""

from __future__ import annotations

import doctest

import pytest
import torch

import attnkit.merge
from attnkit.merge import merge_state, merge_states

NEG_INF = float("-inf")


def attend(q, k, v, keys):
    """Dense float64 attention of q (..., L, d) over k, v [..., keys, :], with its lse."""
    keys = torch.as_tensor(keys, dtype=torch.long)
    if keys.numel() == 0:
        return (
            torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float64),
            torch.full(q.shape[:-1], NEG_INF, dtype=torch.float64),
        )
    s = q @ k[..., keys, :].transpose(-1, -2) / q.shape[-1] ** 0.5
    m = s.max(dim=-1, keepdim=True).values
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    return (e / total) @ v[..., keys, :], (m + torch.log(total)).squeeze(-1)


def make_qkv(seed, batch=(2, 3), L=5, tk=11, d=6, dv=4):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*batch, L, d, generator=g, dtype=torch.float64),
        torch.randn(*batch, tk, d, generator=g, dtype=torch.float64),
        torch.randn(*batch, tk, dv, generator=g, dtype=torch.float64),
    )


SPLITS = {
    "halves": [range(0, 5), range(5, 11)],
    "thirds": [range(0, 4), range(4, 8), range(8, 11)],
    "uneven": [range(0, 1), range(1, 11)],
    "with_empty_part": [range(0, 6), range(0), range(6, 11)],
    "interleaved": [range(0, 11, 3), range(1, 11, 3), range(2, 11, 3)],
    "one_part": [range(0, 11)],
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_any_split_merges_to_unsplit(split):
    q, k, v = make_qkv(0)
    o_full, lse_full = attend(q, k, v, range(11))
    parts = [attend(q, k, v, list(keys)) for keys in SPLITS[split]]
    o, lse = merge_states([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(o, o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_full, rtol=1e-12, atol=1e-12)
    # folding pairwise with merge_state gives the same answer
    o2, lse2 = parts[0]
    for part in parts[1:]:
        o2, lse2 = merge_state(o2, lse2, *part)
    torch.testing.assert_close(o2, o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse2, lse_full, rtol=1e-12, atol=1e-12)


def test_empty_part_contributes_nothing_even_with_garbage_output():
    q, k, v = make_qkv(1)
    o_full, lse_full = attend(q, k, v, range(11))
    o1, l1 = attend(q, k, v, range(0, 7))
    o2, l2 = attend(q, k, v, range(7, 11))
    garbage = torch.full_like(o1, float("nan"))
    garbage[..., 0] = float("inf")
    empty_lse = torch.full_like(l1, NEG_INF)
    o, lse = merge_states([o1, garbage, o2], [l1, empty_lse, l2])
    torch.testing.assert_close(o, o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_full, rtol=1e-12, atol=1e-12)
    o, lse = merge_state(garbage, empty_lse, o_full, lse_full)
    torch.testing.assert_close(o, o_full, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_full, rtol=0, atol=0)


def test_nan_propagates_from_a_live_part():
    q, k, v = make_qkv(2)
    o1, l1 = attend(q, k, v, range(0, 5))
    o2, l2 = attend(q, k, v, range(5, 11))
    o1 = o1.clone()
    o1[0, 0, 2, 1] = float("nan")
    o, lse = merge_state(o1, l1, o2, l2)
    assert torch.isnan(o[0, 0, 2, 1])
    assert torch.isfinite(o[0, 0, 2, [0, 2, 3]]).all() and torch.isfinite(lse).all()


def test_stacked_and_list_inputs_agree():
    q, k, v = make_qkv(3)
    parts = [attend(q, k, v, keys) for keys in SPLITS["thirds"]]
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    o_list, lse_list = merge_states(outs, lses)
    o_stack, lse_stack = merge_states(torch.stack(outs), torch.stack(lses))
    assert torch.equal(o_list, o_stack) and torch.equal(lse_list, lse_stack)
    o_mixed, lse_mixed = merge_states(tuple(outs), torch.stack(lses))
    assert torch.equal(o_list, o_mixed) and torch.equal(lse_list, lse_mixed)


def test_merge_state_is_symmetric_and_matches_merge_states():
    q, k, v = make_qkv(4)
    (o1, l1), (o2, l2) = attend(q, k, v, range(0, 3)), attend(q, k, v, range(3, 11))
    a = merge_state(o1, l1, o2, l2)
    b = merge_state(o2, l2, o1, l1)
    c = merge_states([o1, o2], [l1, l2])
    for x, y in ((a, b), (a, c)):
        torch.testing.assert_close(x[0], y[0], rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(x[1], y[1], rtol=1e-14, atol=1e-14)


def test_large_lse_does_not_overflow():
    o1 = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    o2 = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    l1 = torch.tensor([1000.0], dtype=torch.float64)
    l2 = torch.tensor([999.0], dtype=torch.float64)
    o, lse = merge_state(o1, l1, o2, l2)
    e = torch.exp(torch.tensor(-1.0, dtype=torch.float64))
    torch.testing.assert_close(lse, torch.log1p(e).reshape(1) + 1000.0, rtol=1e-15, atol=0)
    torch.testing.assert_close(o, torch.stack([1 / (1 + e), e / (1 + e)]).reshape(1, 2))


def test_all_neg_inf_rows_give_zero_output_and_finite_gradients():
    g = torch.Generator().manual_seed(5)
    o1 = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    o2 = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    l1 = torch.randn(2, 4, generator=g, dtype=torch.float64)
    l2 = torch.randn(2, 4, generator=g, dtype=torch.float64)
    dead = torch.tensor([[False, True, False, False], [True, False, False, True]])
    l1, l2 = l1.masked_fill(dead, NEG_INF), l2.masked_fill(dead, NEG_INF)
    l2 = l2.masked_fill(torch.tensor([[True, False, False, False], [False] * 4]), NEG_INF)
    o1 = o1.masked_fill(dead.unsqueeze(-1), float("nan"))  # garbage in dead rows
    leaves = [t.clone().requires_grad_() for t in (o1, l1, o2, l2)]
    o, lse = merge_state(*leaves)
    assert (o[dead] == 0).all() and torch.isfinite(o[~dead]).all()
    assert (lse[dead] == NEG_INF).all() and torch.isfinite(lse[~dead]).all()
    loss = (o * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
    loss = loss + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()
    loss.backward()
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all()
    assert (leaves[0].grad[dead] == 0).all() and (leaves[1].grad[dead] == 0).all()
    assert (leaves[2].grad[0, 0] == 0).all() and leaves[3].grad[0, 0] == 0  # lse2 -inf only
    assert (leaves[0].grad[0, 0] != 0).any()  # ... while part 1 carries that row alone
    # the stacked front door behaves the same
    o_s, lse_s = merge_states(torch.stack([o1, o2]), torch.stack([l1, l2]))
    assert torch.equal(o_s, o.detach()) and torch.equal(lse_s, lse.detach())


@pytest.mark.parametrize("with_dead_part", [False, True])
def test_gradcheck_merge_state(with_dead_part):
    g = torch.Generator().manual_seed(6)
    o1, o2 = (torch.randn(2, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    l1, l2 = (3 * torch.randn(2, 3, generator=g, dtype=torch.float64) for _ in range(2))
    if with_dead_part:  # part 2 has no keys for some rows; part 1 keeps every row alive
        l2 = l2.masked_fill(torch.tensor([[True, False, True], [False, False, True]]), NEG_INF)
    inputs = [t.requires_grad_() for t in (o1, l1, o2, l2)]
    assert torch.autograd.gradcheck(merge_state, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradients_through_merge_match_unsplit_attention():
    q, k, v = (t.requires_grad_() for t in make_qkv(7, batch=(2,), L=3, tk=7, d=4, dv=3))
    o_full, lse_full = attend(q, k, v, range(7))
    g_o = torch.randn(o_full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    full = torch.autograd.grad((o_full * g_o).sum() + lse_full.sum(), (q, k, v))
    parts = [attend(q, k, v, keys) for keys in ([0, 4], [1, 2, 6], [3, 5])]
    o, lse = merge_states([p[0] for p in parts], [p[1] for p in parts])
    split = torch.autograd.grad((o * g_o).sum() + lse.sum(), (q, k, v))
    for a, b in zip(split, full):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_dtypes():
    q, k, v = make_qkv(9)
    (o1, l1), (o2, l2) = attend(q, k, v, range(0, 5)), attend(q, k, v, range(5, 11))
    o, lse = merge_state(o1.float(), l1.float(), o2.float(), l2.float())
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    o, lse = merge_state(o1, l1, o2, l2)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    o, lse = merge_states([o1.half(), o2.half()], [l1.half(), l2.half()])
    assert o.dtype == torch.float16 and lse.dtype == torch.float32


def test_bfloat16_outputs_are_merged_in_float32():
    q, k, v = make_qkv(10, batch=(4, 8), L=16, tk=40, d=16, dv=32)
    parts = [attend(q, k, v, keys) for keys in (range(0, 13), range(13, 14), range(14, 40))]
    outs = [p[0].to(torch.bfloat16) for p in parts]
    lses = [p[1].float() for p in parts]
    o, lse = merge_states(outs, lses)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # oracle: the same rounded inputs merged in float64
    ref, ref_lse = merge_states([t.double() for t in outs], [t.double() for t in lses])
    err = (o.double() - ref).abs()
    # float32 arithmetic leaves only the final rounding to bfloat16 (2**-9 relative)
    assert (err <= 2.0**-8 * ref.abs() + 1e-30).all()
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    # and it is no worse than the same formula run in plain bfloat16
    lse_bf = torch.stack(lses).to(torch.bfloat16)
    w = torch.softmax(lse_bf, dim=0).unsqueeze(-1)
    plain = (w * torch.stack(outs)).sum(0)
    assert err.max() <= 2 * (plain.double() - ref).abs().max()


def test_docstring_example_runs():
    result = doctest.testmod(attnkit.merge, verbose=False)
    assert result.attempted > 0 and result.failed == 0


_O, _L = torch.zeros(2, 5, 4), torch.zeros(2, 5)

BAD_CALLS = [
    ("empty_list", lambda: merge_states([], []), ValueError, r"outputs is empty"),
    (
        "empty_stack",
        lambda: merge_states(torch.zeros(0, 5, 4), torch.zeros(0, 5)),
        ValueError,
        r"outputs is empty",
    ),
    (
        "count_mismatch",
        lambda: merge_states([_O, _O, _O], [_L, _L]),
        ValueError,
        r"outputs has 3 partial states but lses has 2",
    ),
    (
        "part_shape_mismatch",
        lambda: merge_states([_O, torch.zeros(2, 5, 3)], [_L, _L]),
        ValueError,
        r"outputs\[1\] has shape \(2, 5, 3\) but outputs\[0\] has \(2, 5, 4\)",
    ),
    (
        "lse_shape",
        lambda: merge_states([_O, _O], [torch.zeros(2, 4), torch.zeros(2, 4)]),
        ValueError,
        r"lses has shape \(2, 2, 4\) but must be \(2, 2, 5\)",
    ),
    (
        "stacked_too_few_dims",
        lambda: merge_states(torch.zeros(2, 4), torch.zeros(2)),
        ValueError,
        r"at least 3 dims",
    ),
    (
        "dtype_mismatch",
        lambda: merge_states([_O, _O.double()], [_L, _L]),
        TypeError,
        r"outputs\[1\] has dtype torch.float64",
    ),
    (
        "int_outputs",
        lambda: merge_states([_O.long(), _O.long()], [_L, _L]),
        TypeError,
        r"outputs has dtype torch.int64",
    ),
    (
        "not_a_tensor",
        lambda: merge_states([_O, 3.0], [_L, _L]),
        TypeError,
        r"outputs\[1\] must be a torch.Tensor",
    ),
    ("not_a_list", lambda: merge_states({"a": _O}, [_L]), TypeError, r"outputs must be a list"),
    (
        "pair_shape",
        lambda: merge_state(_O, _L, torch.zeros(2, 6, 4), _L),
        ValueError,
        r"o1 has shape \(2, 5, 4\) but o2 has \(2, 6, 4\)",
    ),
    (
        "pair_lse_shape",
        lambda: merge_state(_O, _L, _O, torch.zeros(2, 4)),
        ValueError,
        r"lse2 has shape \(2, 4\) but must be \(2, 5\)",
    ),
    (
        "pair_dtype",
        lambda: merge_state(_O, _L, _O.double(), _L),
        TypeError,
        r"o1 has dtype torch.float32 but o2 has torch.float64",
    ),
    (
        "pair_1d",
        lambda: merge_state(torch.zeros(4), torch.zeros(()), torch.zeros(4), torch.zeros(())),
        ValueError,
        r"o1 must have at least 2",
    ),
    (
        "pair_int_lse",
        lambda: merge_state(_O, _L.long(), _O, _L),
        TypeError,
        r"lse1 has dtype torch.int64",
    ),
    (
        "pair_not_tensor",
        lambda: merge_state(_O, _L, _O, 0.0),
        TypeError,
        r"lse2 must be a torch.Tensor",
    ),
]


@pytest.mark.parametrize(
    "call, exc, pattern", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_rejects_bad_arguments(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()
