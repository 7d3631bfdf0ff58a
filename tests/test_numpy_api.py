"""Tests for attnkit.numpy: the numpy statement of attention, forward and hand backward.

The oracle is the formula written out row by row in float64 (scores, masked softmax over the
keys, weighted sum of values); gradients are checked against central differences of
``sum(oracle(q, k, v) * g)``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnkit.numpy import (
    dropout_mult,
    scaled_dot_product_attention,
    sdpa_backward,
    sdpa_forward,
)

# ----------------------------------------------------------------------------------------------
# oracle and helpers


def oracle(q, k, v, mask=None, scale=None, mult=None):
    """Dense float64 attention, one row at a time. Returns (O, P) with P before dropout."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * np.einsum("...id,...jd->...ij", q, k)
    batch = np.broadcast_shapes(s.shape[:-2], v.shape[:-2])
    s = np.broadcast_to(s, batch + s.shape[-2:])
    allowed = np.ones(s.shape, bool) if mask is None else np.broadcast_to(mask, s.shape)
    p = np.zeros(s.shape)
    for idx in np.ndindex(s.shape[:-1]):
        open_ = allowed[idx]
        if open_.any():
            e = np.exp(s[idx][open_] - s[idx][open_].max())
            p[idx + (open_,)] = e / e.sum()
    pm = p if mult is None else p * mult
    return np.einsum("...ij,...jd->...id", pm, v), p


def numeric_grad(f, x, h=1e-6):
    """Central differences of the scalar f() with respect to every element of x (in place)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        fp = f()
        x[idx] = old - h
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * h)
    return g


def randn(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def hand_example():
    q = np.array([[2.0, 0, 0, 0]])
    k = np.array([[1.0, 0, 0, 0], [0, 1, 0, 0], [2, 0, 0, 0]])
    v = np.array([[1.0, 0], [0, 1], [1, 1]])
    return q, k, v


def causal(tq, tk):
    return np.tril(np.ones((tq, tk), bool))


# ----------------------------------------------------------------------------------------------
# section 3, by hand


def test_hand_example_forward():
    o, p = sdpa_forward(*hand_example())
    np.testing.assert_allclose(p, [[0.244728, 0.090031, 0.665241]], atol=1e-6, rtol=0)
    np.testing.assert_allclose(o, [[0.909969, 0.755272]], atol=1e-6, rtol=0)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=0, atol=1e-15)


def test_hand_example_backward():
    q, k, v = hand_example()
    o, p = sdpa_forward(q, k, v)
    dout = np.array([[1.0, 0.0]])
    dq, dk, dv = sdpa_backward(q, k, v, p, dout)
    np.testing.assert_allclose(dv, [[0.244728, 0], [0.090031, 0], [0.665241, 0]], atol=1e-6, rtol=0)
    # dK row j is scale * dS_j * q = (dS_j, 0, 0, 0) here, so dK's first column is dS.
    np.testing.assert_allclose(dk[:, 0], [0.022033, -0.081925, 0.059892], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(dk[:, 1:], 0.0)
    np.testing.assert_allclose(dq, [[0.070909, -0.040963, 0, 0]], atol=1e-6, rtol=0)
    # D = rowsum(P * dP) = dO . O = 0.909969: the softmax VJP's dS sums to 0 over the row.
    assert abs(float((dout * o).sum()) - 0.909969) < 1e-6
    assert abs(dk[:, 0].sum()) < 1e-12


# ----------------------------------------------------------------------------------------------
# gradients against central differences

GRAD_CASES = {
    "plain": dict(q=(2, 3, 3), k=(2, 4, 3), v=(2, 4, 2), mask=None, scale=None),
    "causal": dict(q=(4, 3), k=(4, 3), v=(4, 5), mask=causal(4, 4), scale=None),
    "random_mask_custom_scale": dict(
        q=(2, 3, 4),
        k=(2, 5, 4),
        v=(2, 5, 2),
        # query row 1 of batch 0 fully blocked; key 3 blocked everywhere
        mask=np.array(
            [
                [[1, 1, 0, 0, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]],
                [[0, 1, 1, 0, 0], [1, 1, 1, 0, 1], [1, 0, 0, 0, 0]],
            ],
            bool,
        ),
        scale=0.7,
    ),
    "broadcast_batch": dict(
        # k shared across heads, v shared across the whole batch (fewer dims than q)
        q=(2, 3, 3, 4),
        k=(2, 1, 5, 4),
        v=(5, 2),
        mask=np.tril(np.ones((3, 5), bool), 2),
        scale=None,
    ),
}


def _check_grads_against_central_differences(q, k, v, mask, scale, mult):
    rng = np.random.default_rng(7)
    o, p = sdpa_forward(q, k, v, mask=mask, scale=scale)
    g = randn(rng, *o.shape)
    dq, dk, dv = sdpa_backward(q, k, v, p, g, scale=scale, dropout_mult=mult)

    def loss():
        return float((oracle(q, k, v, mask=mask, scale=scale, mult=mult)[0] * g).sum())

    for name, x, analytic in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        assert analytic.shape == x.shape, name
        np.testing.assert_allclose(
            analytic, numeric_grad(loss, x), rtol=1e-6, atol=1e-8, err_msg=name
        )


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradcheck_float64(case):
    c = GRAD_CASES[case]
    rng = np.random.default_rng(1)
    q, k, v = (randn(rng, *c[n]) for n in "qkv")
    _check_grads_against_central_differences(q, k, v, c["mask"], c["scale"], None)


@pytest.mark.parametrize("case", ["plain", "random_mask_custom_scale", "broadcast_batch"])
def test_gradcheck_through_dropout(case):
    c = GRAD_CASES[case]
    rng = np.random.default_rng(2)
    q, k, v = (randn(rng, *c[n]) for n in "qkv")
    _, p = sdpa_forward(q, k, v, mask=c["mask"], scale=c["scale"])
    mult = dropout_mult(p.shape, 0.4, np.random.default_rng(3))
    assert (mult == 0).any() and (mult > 1).any()
    _check_grads_against_central_differences(q, k, v, c["mask"], c["scale"], mult)


def test_dropout_forward_matches_replayed_oracle_and_backward():
    rng = np.random.default_rng(4)
    q, k, v = randn(rng, 2, 3, 4), randn(rng, 2, 5, 4), randn(rng, 2, 5, 3)
    out, w = scaled_dot_product_attention(
        q, k, v, mask=causal(3, 5), dropout_p=0.3, rng=np.random.default_rng(11)
    )
    mult = dropout_mult(w.shape, 0.3, np.random.default_rng(11))
    ref, ref_p = oracle(q, k, v, mask=causal(3, 5), mult=mult)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w, ref_p, rtol=1e-12, atol=1e-15)  # weights before dropout


# ----------------------------------------------------------------------------------------------
# structural properties


def test_key_permutation_equivariance():
    rng = np.random.default_rng(5)
    q, k, v = randn(rng, 2, 4, 3), randn(rng, 2, 6, 3), randn(rng, 2, 6, 2)
    mask = rng.random((2, 4, 6)) < 0.7
    perm = rng.permutation(6)
    o, p = sdpa_forward(q, k, v, mask=mask)
    o2, p2 = sdpa_forward(q, k[:, perm], v[:, perm], mask=mask[..., perm])
    np.testing.assert_allclose(o2, o, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(p2, p[..., perm], rtol=1e-12, atol=1e-15)
    g = randn(rng, *o.shape)
    dq, dk, dv = sdpa_backward(q, k, v, p, g)
    dq2, dk2, dv2 = sdpa_backward(q, k[:, perm], v[:, perm], p2, g)
    np.testing.assert_allclose(dq2, dq, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(dk2, dk[:, perm], rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(dv2, dv[:, perm], rtol=1e-10, atol=1e-13)


def test_queries_are_independent():
    rng = np.random.default_rng(6)
    q, k, v = randn(rng, 5, 4), randn(rng, 7, 4), randn(rng, 7, 3)
    o, p = sdpa_forward(q, k, v)
    perm = rng.permutation(5)
    o2, p2 = sdpa_forward(q[perm], k, v)
    np.testing.assert_allclose(o2, o[perm], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(p2, p[perm], rtol=1e-12, atol=1e-15)
    for i in range(5):
        oi, pi = sdpa_forward(q[i : i + 1], k, v)
        np.testing.assert_allclose(oi[0], o[i], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(pi[0], p[i], rtol=1e-12, atol=1e-15)


def test_batched_equals_per_item():
    rng = np.random.default_rng(8)
    b, h, tq, tk, d, dv_ = 2, 3, 4, 6, 5, 2
    q, k, v = randn(rng, b, h, tq, d), randn(rng, b, h, tk, d), randn(rng, b, h, tk, dv_)
    mask = rng.random((b, 1, tq, tk)) < 0.8
    o, p = sdpa_forward(q, k, v, mask=mask)
    g = randn(rng, *o.shape)
    dq, dk, dv = sdpa_backward(q, k, v, p, g)
    for i in range(b):
        for j in range(h):
            oi, pi = sdpa_forward(q[i, j], k[i, j], v[i, j], mask=mask[i, 0])
            np.testing.assert_allclose(o[i, j], oi, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(p[i, j], pi, rtol=1e-12, atol=1e-15)
            gi = sdpa_backward(q[i, j], k[i, j], v[i, j], pi, g[i, j])
            for full, item in zip((dq, dk, dv), gi):
                np.testing.assert_allclose(full[i, j], item, rtol=1e-10, atol=1e-13)


def test_broadcast_kv_gradients_sum_over_heads():
    rng = np.random.default_rng(9)
    q, k, v = randn(rng, 2, 3, 4, 5), randn(rng, 2, 1, 6, 5), randn(rng, 2, 1, 6, 2)
    o, p = sdpa_forward(q, k, v)
    assert o.shape == (2, 3, 4, 2) and p.shape == (2, 3, 4, 6)
    g = randn(rng, *o.shape)
    dq, dk, dv = sdpa_backward(q, k, v, p, g)
    assert dk.shape == k.shape and dv.shape == v.shape
    kf, vf = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    dqf, dkf, dvf = sdpa_backward(q, kf, vf, p, g)
    np.testing.assert_allclose(dq, dqf, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk, dkf.sum(1, keepdims=True), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(dv, dvf.sum(1, keepdims=True), rtol=1e-10, atol=1e-13)


# ----------------------------------------------------------------------------------------------
# masks and boundaries


def test_masked_keys_get_no_weight_or_gradient():
    rng = np.random.default_rng(10)
    q, k, v = randn(rng, 4, 3), randn(rng, 6, 3), randn(rng, 6, 2)
    mask = rng.random((4, 6)) < 0.6
    mask[:, 2] = False  # key 2 blocked for every query
    mask[:, 0] = True  # every row keeps at least one key
    o, p = sdpa_forward(q, k, v, mask=mask)
    assert (p[~mask] == 0.0).all()
    assert (p[mask] > 0.0).all()
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=0, atol=1e-14)
    np.testing.assert_allclose(o, oracle(q, k, v, mask=mask)[0], rtol=1e-12, atol=1e-14)
    dq, dk, dv = sdpa_backward(q, k, v, p, randn(rng, 4, 2))
    assert (dk[2] == 0.0).all() and (dv[2] == 0.0).all()
    assert np.abs(dk[[0, 1, 3, 4, 5]]).min() > 0  # the open keys do learn


def test_fully_masked_row_gives_zeros():
    rng = np.random.default_rng(12)
    q, k, v = randn(rng, 3, 4), randn(rng, 5, 4), randn(rng, 5, 2) + 3.0
    mask = np.ones((3, 5), bool)
    mask[1] = False
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        o, p = sdpa_forward(q, k, v, mask=mask)
        dq, dk, dv = sdpa_backward(q, k, v, p, np.ones_like(o))
    assert (p[1] == 0.0).all() and (o[1] == 0.0).all() and (dq[1] == 0.0).all()
    for x in (o, p, dq, dk, dv):
        assert np.isfinite(x).all()
    o_rest, p_rest = sdpa_forward(q[[0, 2]], k, v)
    np.testing.assert_array_equal(o[[0, 2]], o_rest)
    # no keys at all: every row is fully masked
    o0, p0 = sdpa_forward(q, k[:0], v[:0])
    assert p0.shape == (3, 0) and (o0 == 0.0).all() and o0.shape == (3, 2)


def test_large_scores_do_not_overflow():
    q = np.array([[100.0, 0.0], [0.0, 0.0]])
    k = np.array([[100.0, 0.0], [0.0, 0.0], [-100.0, 0.0]])  # scores 1e4, 0, -1e4
    v = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    for dtype in (np.float32, np.float64):
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            o, p = sdpa_forward(q.astype(dtype), k.astype(dtype), v.astype(dtype), scale=1.0)
        np.testing.assert_array_equal(p[0], [1.0, 0.0, 0.0])
        np.testing.assert_array_equal(o[0], [1.0, 2.0])
        np.testing.assert_allclose(p[1], [1 / 3] * 3, rtol=1e-6)


def test_default_scale_is_inverse_sqrt_d():
    rng = np.random.default_rng(13)
    q, k, v = randn(rng, 3, 16), randn(rng, 4, 16), randn(rng, 4, 2)
    o, p = sdpa_forward(q, k, v)
    o_explicit, p_explicit = sdpa_forward(q, k, v, scale=0.25)
    np.testing.assert_array_equal(o, o_explicit)
    np.testing.assert_array_equal(p, p_explicit)
    assert not np.allclose(p, sdpa_forward(q, k, v, scale=1 / 16)[1])
    g = randn(rng, 3, 2)
    for a, b in zip(sdpa_backward(q, k, v, p, g), sdpa_backward(q, k, v, p, g, scale=0.25)):
        np.testing.assert_array_equal(a, b)
    out, w = scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(out, o)


@pytest.mark.parametrize("d", [4, 64])
def test_score_variance_property(d):
    # Scores q.k / sqrt(d) of unit-normal q, k have variance 1 for every d; two independent
    # keys give score differences of variance 2, read back from the weights as log P0 - log P1.
    rng = np.random.default_rng(14)
    n = 20000
    q, k, v = randn(rng, n, 1, d), randn(rng, n, 2, d), np.zeros((n, 2, 1))
    _, p = sdpa_forward(q, k, v)
    diff = np.log(p[:, 0, 0]) - np.log(p[:, 0, 1])
    assert abs(diff.var() - 2.0) < 0.15


# ----------------------------------------------------------------------------------------------
# dropout


def test_dropout_draws_and_scaling():
    rng = np.random.default_rng(15)
    q, k, v = randn(rng, 2, 3, 4), randn(rng, 2, 5, 4), randn(rng, 2, 5, 3)
    p_drop = 0.35
    gen = np.random.default_rng(99)
    out, w = scaled_dot_product_attention(q, k, v, dropout_p=p_drop, rng=gen)
    replay = np.random.default_rng(99)
    u = replay.random(w.shape)  # one uniform per weight, C order
    m = np.where(u >= p_drop, 1.0 / (1.0 - p_drop), 0.0)
    np.testing.assert_allclose(out, (w * m) @ v, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w, sdpa_forward(q, k, v)[1], rtol=0, atol=0)
    assert gen.random() == replay.random()  # exactly w.size uniforms were drawn
    mult = dropout_mult(w.shape, p_drop, np.random.default_rng(99))
    np.testing.assert_array_equal(mult, m)
    assert set(np.unique(mult)) == {0.0, 1.0 / (1.0 - p_drop)}


def test_dropout_p_zero_draws_nothing():
    rng = np.random.default_rng(16)
    q, k, v = randn(rng, 3, 4), randn(rng, 5, 4), randn(rng, 5, 2)
    gen = np.random.default_rng(5)
    before = gen.bit_generator.state
    out, w = scaled_dot_product_attention(q, k, v, dropout_p=0.0, rng=gen)
    assert gen.bit_generator.state == before
    o, p = sdpa_forward(q, k, v)
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(w, p)
    np.testing.assert_array_equal(dropout_mult((2, 3), 0.0, gen), np.ones((2, 3)))
    assert gen.bit_generator.state == before
    out2, _ = scaled_dot_product_attention(q, k, v)  # no rng needed without dropout
    np.testing.assert_array_equal(out2, o)


# ----------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtype_is_preserved(dtype):
    rng = np.random.default_rng(17)
    q, k, v = randn(rng, 2, 3, 4), randn(rng, 2, 5, 4), randn(rng, 2, 5, 3)
    qd, kd, vd = (x.astype(dtype) for x in (q, k, v))
    o, p = sdpa_forward(qd, kd, vd, mask=causal(3, 5))
    assert o.dtype == dtype and p.dtype == dtype
    grads = sdpa_backward(qd, kd, vd, p, np.ones_like(o))
    assert all(g.dtype == dtype for g in grads)
    out, w = scaled_dot_product_attention(qd, kd, vd, dropout_p=0.2, rng=np.random.default_rng(0))
    assert out.dtype == dtype and w.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    ref_o, ref_p = oracle(qd, kd, vd, mask=causal(3, 5))
    np.testing.assert_allclose(o, ref_o, rtol=tol, atol=tol)
    ref_grads = sdpa_backward(q, k, v, ref_p, np.ones_like(ref_o))
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=10 * tol, atol=10 * tol)


def test_float16_computed_in_float32_and_returned_in_float16():
    rng = np.random.default_rng(18)
    q, k, v = (randn(rng, 4, 8, 16, dtype=np.float16) for _ in range(3))
    o, p = sdpa_forward(q, k, v)
    assert o.dtype == np.float16 and p.dtype == np.float16
    ref_o, _ = oracle(q, k, v)  # the same float16 inputs, exact arithmetic
    # computing in float32 leaves only the final rounding to float16: 2**-11 relative
    np.testing.assert_array_less(np.abs(o - ref_o), 2.0**-10 * np.abs(ref_o) + 1e-4)
    # a plain float16 computation does measurably worse
    s16 = (q @ np.swapaxes(k, -1, -2)) * np.float16(0.25)
    e16 = np.exp(s16 - s16.max(-1, keepdims=True))
    plain = (e16 / e16.sum(-1, keepdims=True)) @ v
    assert np.abs(o - ref_o).max() <= np.abs(plain - ref_o).max()


def test_mixed_float_dtypes_promote():
    rng = np.random.default_rng(19)
    q, k, v = randn(rng, 3, 4, dtype=np.float32), randn(rng, 5, 4), randn(rng, 5, 2)
    o, p = sdpa_forward(q, k, v)
    assert o.dtype == np.float64 and p.dtype == np.float64
    dq, dk, dv = sdpa_backward(q, k, v, p, np.ones_like(o))
    assert dq.dtype == np.float32 and dk.dtype == np.float64  # each in its input's dtype


# ----------------------------------------------------------------------------------------------
# errors

_Q, _K, _V = np.zeros((3, 4)), np.zeros((5, 4)), np.zeros((5, 2))
_P, _DO = np.full((3, 5), 0.2), np.zeros((3, 2))

BAD_CALLS = [
    ("q_1d", lambda: sdpa_forward(np.zeros(4), _K, _V), ValueError, r"q must have at least 2"),
    ("k_1d", lambda: sdpa_forward(_Q, np.zeros(4), _V), ValueError, r"k must have at least 2"),
    ("v_1d", lambda: sdpa_forward(_Q, _K, np.zeros(5)), ValueError, r"v must have at least 2"),
    (
        "d_mismatch",
        lambda: sdpa_forward(_Q, np.zeros((5, 3)), _V),
        ValueError,
        r"q has width d = 4.*k has width 3",
    ),
    ("d_zero", lambda: sdpa_forward(np.zeros((3, 0)), np.zeros((5, 0)), _V), ValueError, r"d = 0"),
    (
        "tk_mismatch",
        lambda: sdpa_forward(_Q, _K, np.zeros((6, 2))),
        ValueError,
        r"k has Tk = 5.*v has 6",
    ),
    (
        "int_q",
        lambda: sdpa_forward(np.zeros((3, 4), int), _K, _V),
        TypeError,
        r"q has dtype int64.*astype",
    ),
    ("complex_v", lambda: sdpa_forward(_Q, _K, _V.astype(complex)), TypeError, r"v has dtype"),
    (
        "float_mask",
        lambda: sdpa_forward(_Q, _K, _V, mask=np.ones((3, 5))),
        TypeError,
        r"mask has dtype float64; use a bool mask",
    ),
    (
        "int_mask",
        lambda: sdpa_forward(_Q, _K, _V, mask=np.ones((3, 5), int)),
        TypeError,
        r"use a bool mask",
    ),
    (
        "mask_no_broadcast",
        lambda: sdpa_forward(_Q, _K, _V, mask=np.ones((3, 4), bool)),
        ValueError,
        r"mask of shape \(3, 4\) must broadcast to the scores shape \(3, 5\)",
    ),
    (
        "mask_grows_scores",
        lambda: sdpa_forward(_Q, _K, _V, mask=np.ones((2, 3, 5), bool)),
        ValueError,
        r"mask of shape \(2, 3, 5\).*without changing it",
    ),
    ("scale_zero", lambda: sdpa_forward(_Q, _K, _V, scale=0.0), ValueError, r"scale must be"),
    ("scale_negative", lambda: sdpa_forward(_Q, _K, _V, scale=-1.0), ValueError, r"> 0"),
    (
        "scale_inf",
        lambda: sdpa_forward(_Q, _K, _V, scale=float("inf")),
        ValueError,
        r"scale must be finite",
    ),
    (
        "scale_nan",
        lambda: sdpa_forward(_Q, _K, _V, scale=float("nan")),
        ValueError,
        r"scale must be finite",
    ),
    (
        "scale_str",
        lambda: sdpa_forward(_Q, _K, _V, scale="0.5"),
        TypeError,
        r"scale must be a real number",
    ),
    (
        "batch_no_broadcast",
        lambda: sdpa_forward(np.zeros((2, 3, 4)), np.zeros((3, 5, 4)), np.zeros((3, 5, 2))),
        ValueError,
        r"batch dims of q \(2,\), k \(3,\)",
    ),
    (
        "dropout_p_one",
        lambda: scaled_dot_product_attention(
            _Q, _K, _V, dropout_p=1.0, rng=np.random.default_rng(0)
        ),
        ValueError,
        r"dropout_p must be in \[0, 1\)",
    ),
    (
        "dropout_p_negative",
        lambda: scaled_dot_product_attention(
            _Q, _K, _V, dropout_p=-0.1, rng=np.random.default_rng(0)
        ),
        ValueError,
        r"dropout_p",
    ),
    (
        "dropout_without_rng",
        lambda: scaled_dot_product_attention(_Q, _K, _V, dropout_p=0.1),
        ValueError,
        r"needs rng",
    ),
    (
        "dropout_bad_rng",
        lambda: scaled_dot_product_attention(
            _Q, _K, _V, dropout_p=0.1, rng=np.random.RandomState(0)
        ),
        TypeError,
        r"rng must be a numpy.random.Generator",
    ),
    (
        "backward_bad_p",
        lambda: sdpa_backward(_Q, _K, _V, _P[:, :4], _DO),
        ValueError,
        r"p must have shape \(3, 5\)",
    ),
    (
        "backward_bad_dout",
        lambda: sdpa_backward(_Q, _K, _V, _P, np.zeros((3, 3))),
        ValueError,
        r"dout must have shape \(3, 2\)",
    ),
    (
        "backward_bad_mult",
        lambda: sdpa_backward(_Q, _K, _V, _P, _DO, dropout_mult=np.ones((2, 3, 5))),
        ValueError,
        r"dropout_mult of shape",
    ),
    (
        "backward_bad_scale",
        lambda: sdpa_backward(_Q, _K, _V, _P, _DO, scale=-2.0),
        ValueError,
        r"scale",
    ),
    (
        "backward_tk_mismatch",
        lambda: sdpa_backward(_Q, _K, np.zeros((4, 2)), _P, _DO),
        ValueError,
        r"k has Tk",
    ),
]


@pytest.mark.parametrize(
    "call, exc, pattern", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_rejects_bad_arguments(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ----------------------------------------------------------------------------------------------
# torch as a second oracle


def _torch_case(q, k, v, mask):
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.from_numpy(np.ascontiguousarray(mask))
    )
    return out, (tq, tk, tv)


@pytest.mark.parametrize("case", ["causal", "padding"])
def test_matches_torch_float64(case):
    rng = np.random.default_rng(20)
    if case == "causal":
        q, k, v = randn(rng, 2, 3, 6, 8), randn(rng, 2, 3, 6, 8), randn(rng, 2, 3, 6, 5)
        mask = causal(6, 6)
    else:  # cross attention over padded keys: lengths 7 and 4 of Tk = 7
        q, k, v = randn(rng, 2, 3, 4, 8), randn(rng, 2, 3, 7, 8), randn(rng, 2, 3, 7, 5)
        mask = (np.arange(7) < np.array([7, 4])[:, None])[:, None, None, :]
    o, p = sdpa_forward(q, k, v, mask=mask)
    out, leaves = _torch_case(q, k, v, mask)
    np.testing.assert_allclose(o, out.detach().numpy(), rtol=1e-12, atol=1e-13)
    g = randn(rng, *o.shape)
    out.backward(torch.from_numpy(g))
    for ours, leaf in zip(sdpa_backward(q, k, v, p, g), leaves):
        np.testing.assert_allclose(ours, leaf.grad.numpy(), rtol=1e-10, atol=1e-12)
