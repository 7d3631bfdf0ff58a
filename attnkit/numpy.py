"""Scaled dot-product attention in plain numpy: forward, hand-written backward, dropout.

This module is the readable, dependency-light statement of the math that the torch backends
reproduce. It imports no torch.

Shape legend::

    q     (..., Tq, d)     queries, one row per position asking
    k     (..., Tk, d)     keys, one row per position offering
    v     (..., Tk, dv)    values
    S     (..., Tq, Tk)    scores  S = scale * q @ k^T
    mask  bool, broadcastable to S (True = may attend); it never changes S's shape
    P     (..., Tq, Tk)    weights P = softmax(S) over the keys; each open row sums to 1
    O     (..., Tq, dv)    output  O = P @ v

The leading ``...`` dims of q, k and v broadcast against each other (for example k and v of
shape ``(B, 1, Tk, d)`` shared by every head of ``(B, H, Tq, d)`` queries); S, P and O carry the
broadcast batch shape, and gradients are summed back to each input's own shape.

A row whose keys are all masked has P = 0 and O = 0 (never NaN), and its gradients are 0.

Dtypes: float32 in gives float32 out and float64 in gives float64 out. The inputs' dtypes are
promoted with numpy's rules (float32 with float64 gives float64). Float16 inputs are computed
in float32 and the results rounded back to float16; every computation runs in at least float32.
Integer, bool and complex arrays are rejected with a TypeError.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

__all__ = [
    "dropout_mult",
    "scaled_dot_product_attention",
    "sdpa_backward",
    "sdpa_forward",
]


# ----------------------------------------------------------------------------------------------
# validation: small named checks that raise with the argument, expected vs given, and the fix


def _as_float_array(name: str, x: ArrayLike) -> NDArray:
    """Return ``x`` as an ndarray with a real floating dtype, or raise a TypeError."""
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(
            f"{name} has dtype {arr.dtype}; attention needs a real floating-point array "
            f"(float16, float32 or float64). Convert it first, e.g. {name}.astype(np.float32)."
        )
    return arr


def _check_min_ndim(name: str, arr: NDArray, legend: str) -> None:
    if arr.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dims {legend}, got shape {arr.shape}. "
            f"Add a length-1 sequence axis, e.g. {name}[None, :] for a single position."
        )


def _check_qkv(q: NDArray, k: NDArray, v: NDArray) -> Tuple[int, ...]:
    """Validate q, k, v shapes and return the broadcast batch shape."""
    _check_min_ndim("q", q, "(..., Tq, d)")
    _check_min_ndim("k", k, "(..., Tk, d)")
    _check_min_ndim("v", v, "(..., Tk, dv)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q has width d = {q.shape[-1]} (shape {q.shape}) but k has width {k.shape[-1]} "
            f"(shape {k.shape}); queries and keys must have the same last dim d. "
            f"Project them to a common width."
        )
    if q.shape[-1] == 0:
        raise ValueError(
            f"q and k have width d = 0 (q shape {q.shape}); attention needs d >= 1 "
            f"to form scores and the default scale 1/sqrt(d)."
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k has Tk = {k.shape[-2]} keys (shape {k.shape}) but v has {v.shape[-2]} values "
            f"(shape {v.shape}); k and v must have the same second-to-last dim, "
            f"one value per key."
        )
    try:
        return tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    except ValueError:
        raise ValueError(
            f"the batch dims of q {q.shape[:-2]}, k {k.shape[:-2]} and v {v.shape[:-2]} "
            f"(everything before the last two dims) do not broadcast together. Give them "
            f"equal sizes or size 1 where a tensor is shared, e.g. k of shape (B, 1, Tk, d)."
        ) from None


def _resolve_scale(scale: Optional[float], d: int) -> float:
    """Return the score scale: ``1/sqrt(d)`` by default, else a finite positive ``scale``."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale must be a real number or None (for 1/sqrt(d)), got {type(scale).__name__} "
            f"{scale!r}."
        )
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(
            f"scale must be finite and > 0, got {value!r}; pass None for the default "
            f"1/sqrt(d) = {1.0 / math.sqrt(d):.6g}."
        )
    return value


def _check_broadcasts_to(name: str, arr: NDArray, shape: Tuple[int, ...], what: str) -> None:
    """Raise unless ``arr`` broadcasts to ``shape`` without changing it."""
    try:
        ok = tuple(np.broadcast_shapes(arr.shape, shape)) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name} of shape {arr.shape} must broadcast to the {what} shape {tuple(shape)} "
            f"without changing it. Give it at most {len(shape)} dims, each equal to the "
            f"{what}' size or 1."
        )


def _check_mask(mask: ArrayLike, score_shape: Tuple[int, ...]) -> NDArray:
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        raise TypeError(
            f"mask has dtype {arr.dtype}; use a bool mask (True = may attend, False = blocked). "
            f"For a 0/1 mask use mask.astype(bool); for a 0/-inf additive mask use "
            f"np.isfinite(mask)."
        )
    _check_broadcasts_to("mask", arr, score_shape, "scores")
    return arr


def _check_exact_shape(name: str, arr: NDArray, shape: Tuple[int, ...], legend: str) -> None:
    if arr.shape != tuple(shape):
        raise ValueError(
            f"{name} must have shape {tuple(shape)} {legend}, got {arr.shape}. Pass the array "
            f"that the forward returned for these q, k, v (or its gradient)."
        )


def _check_dropout_p(dropout_p: float) -> float:
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(
            f"dropout_p must be a real number in [0, 1), got {type(dropout_p).__name__} "
            f"{dropout_p!r}."
        )
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(
            f"dropout_p must be in [0, 1), got {dropout_p!r}. Use 0.0 for no dropout (e.g. at "
            f"evaluation); 1.0 would drop every weight."
        )
    return p


def _compute_dtype(*arrays: NDArray) -> Tuple[np.dtype, np.dtype]:
    """Return (result dtype, compute dtype): numpy promotion, computed in at least float32."""
    result = np.result_type(*arrays)
    return result, np.promote_types(result, np.float32)


def _sum_to_shape(x: NDArray, shape: Tuple[int, ...]) -> NDArray:
    """Sum a broadcast result back to ``shape`` (the inverse of broadcasting, for gradients)."""
    lead = x.ndim - len(shape)
    if lead > 0:
        x = x.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x


def _broadcast_qkv(
    q: NDArray, k: NDArray, v: NDArray, batch: Tuple[int, ...], dtype: np.dtype
) -> Tuple[NDArray, NDArray, NDArray]:
    return (
        np.broadcast_to(q.astype(dtype, copy=False), batch + q.shape[-2:]),
        np.broadcast_to(k.astype(dtype, copy=False), batch + k.shape[-2:]),
        np.broadcast_to(v.astype(dtype, copy=False), batch + v.shape[-2:]),
    )


# ----------------------------------------------------------------------------------------------
# the math


def _masked_softmax(s: NDArray) -> NDArray:
    """Softmax over the last axis, max-subtracted; an all ``-inf`` row gives zeros, not NaN."""
    row_max = s.max(axis=-1, keepdims=True, initial=-np.inf)
    # A fully masked (or empty) row has max -inf; shifting by 0 keeps exp(-inf) = 0 and
    # avoids -inf - (-inf) = NaN.
    row_max = np.where(np.isneginf(row_max), 0.0, row_max).astype(s.dtype, copy=False)
    e = np.exp(s - row_max)
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0).astype(s.dtype, copy=False)


def _weights(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: Optional[ArrayLike],
    scale: Optional[float],
) -> Tuple[NDArray, NDArray, np.dtype]:
    """Validate, then return (P, v broadcast to the batch, result dtype), P in compute dtype."""
    q, k, v = (_as_float_array(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    batch = _check_qkv(q, k, v)
    alpha = _resolve_scale(scale, q.shape[-1])
    score_shape = batch + (q.shape[-2], k.shape[-2])
    mask_arr = None if mask is None else _check_mask(mask, score_shape)
    out_dtype, dt = _compute_dtype(q, k, v)
    qb, kb, vb = _broadcast_qkv(q, k, v, batch, dt)
    s = (qb @ np.swapaxes(kb, -1, -2)) * dt.type(alpha)
    if mask_arr is not None:
        s = np.where(mask_arr, s, dt.type(-np.inf))
    return _masked_softmax(s), vb, out_dtype


def sdpa_forward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: Optional[ArrayLike] = None,
    scale: Optional[float] = None,
) -> Tuple[NDArray, NDArray]:
    """Attention forward: ``O = softmax(scale * q @ k^T, masked) @ v``.

    Args:
        q: queries ``(..., Tq, d)``.
        k: keys ``(..., Tk, d)``.
        v: values ``(..., Tk, dv)``. The leading dims of q, k, v broadcast.
        mask: optional bool array broadcastable to the scores ``(..., Tq, Tk)``
            (True = may attend). It must not change the scores' shape. Blocked scores become
            ``-inf`` before the softmax, so blocked weights are exactly 0. Example, causal with
            Tq = 3, Tk = 3 (``np.tril(np.ones((3, 3), bool))``)::

                1 0 0
                1 1 0
                1 1 1

        scale: score scale, default ``1/sqrt(d)``; must be finite and > 0.

    Returns:
        ``(O, P)``: output ``(..., Tq, dv)`` and weights ``(..., Tq, Tk)`` with the broadcast
        batch shape, in the inputs' (promoted) dtype. A fully masked row gives P = 0, O = 0.

    Raises:
        TypeError: non-float q/k/v, non-bool mask, non-real scale.
        ValueError: bad shapes, a mask that does not broadcast to the scores, a bad scale.
    """
    p, vb, out_dtype = _weights(q, k, v, mask, scale)
    return (p @ vb).astype(out_dtype, copy=False), p.astype(out_dtype, copy=False)


def sdpa_backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    p: ArrayLike,
    dout: ArrayLike,
    scale: Optional[float] = None,
    dropout_mult: Optional[ArrayLike] = None,
) -> Tuple[NDArray, NDArray, NDArray]:
    """Attention backward by hand: the gradients of ``O = (P * m) @ v`` w.r.t. q, k, v.

    With ``m = dropout_mult`` (or 1)::

        dV = (P * m)^T dO          dP = (dO V^T) * m
        D  = rowsum(P * dP)        (equals rowsum(dO * O) without dropout)
        dS = P * (dP - D)          the softmax VJP
        dQ = scale * dS K          dK = scale * dS^T Q

    The mask is not needed: blocked weights are exactly 0 in ``p``, so every gradient through
    them is 0.

    Args:
        q, k, v: the forward's inputs (shapes as in :func:`sdpa_forward`).
        p: the weights the forward returned, ``(..., Tq, Tk)`` with the broadcast batch shape.
        dout: gradient of the loss w.r.t. the output, ``(..., Tq, dv)``, same shape as O.
        scale: the forward's scale (default ``1/sqrt(d)``).
        dropout_mult: the dropout multiplier used in the forward, broadcastable to ``p``
            (``keep / (1 - dropout_p)``, see :func:`dropout_mult`), or None for no dropout.

    Returns:
        ``(dq, dk, dv)``, each with its input's shape (broadcast dims summed back) and dtype.
    """
    q, k, v = (_as_float_array(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    p_arr = _as_float_array("p", p)
    dout_arr = _as_float_array("dout", dout)
    batch = _check_qkv(q, k, v)
    alpha = _resolve_scale(scale, q.shape[-1])
    score_shape = batch + (q.shape[-2], k.shape[-2])
    _check_exact_shape("p", p_arr, score_shape, "(..., Tq, Tk)")
    _check_exact_shape("dout", dout_arr, batch + (q.shape[-2], v.shape[-1]), "(..., Tq, dv)")
    arrays = [q, k, v, p_arr, dout_arr]
    mult = None
    if dropout_mult is not None:
        mult = _as_float_array("dropout_mult", dropout_mult)
        _check_broadcasts_to("dropout_mult", mult, score_shape, "weights")
        arrays.append(mult)
    _, dt = _compute_dtype(*arrays)
    qb, kb, vb = _broadcast_qkv(q, k, v, batch, dt)
    pw = p_arr.astype(dt, copy=False)
    do = dout_arr.astype(dt, copy=False)

    dp = do @ np.swapaxes(vb, -1, -2)
    if mult is None:
        p_kept = pw
    else:
        m = mult.astype(dt, copy=False)
        p_kept = pw * m
        dp = dp * m
    d_v = np.swapaxes(p_kept, -1, -2) @ do
    row = (pw * dp).sum(axis=-1, keepdims=True)
    ds = pw * (dp - row)
    d_q = (ds @ kb) * dt.type(alpha)
    d_k = (np.swapaxes(ds, -1, -2) @ qb) * dt.type(alpha)
    return (
        _sum_to_shape(d_q, q.shape).astype(q.dtype, copy=False),
        _sum_to_shape(d_k, k.shape).astype(k.dtype, copy=False),
        _sum_to_shape(d_v, v.shape).astype(v.dtype, copy=False),
    )


def dropout_mult(
    shape: Tuple[int, ...],
    dropout_p: float,
    rng: np.random.Generator,
    dtype: DTypeLike = np.float64,
) -> NDArray:
    """The attention-dropout multiplier ``keep / (1 - dropout_p)`` for weights of ``shape``.

    The draw rule: one uniform ``u = rng.random(shape)`` per weight, in C order; keep where
    ``u >= dropout_p``; kept entries are ``1 / (1 - dropout_p)``, dropped ones 0. Replaying a
    Generator with the same seed replays the mask (pass the result to :func:`sdpa_backward`).
    ``dropout_p == 0`` draws nothing and returns ones.
    """
    p = _check_dropout_p(dropout_p)
    if p == 0.0:
        return np.ones(shape, dtype=dtype)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"rng must be a numpy.random.Generator, got {type(rng).__name__}; "
            f"pass e.g. np.random.default_rng(seed)."
        )
    keep = rng.random(shape) >= p
    return np.where(keep, 1.0 / (1.0 - p), 0.0).astype(dtype, copy=False)


def scaled_dot_product_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    rng: Optional[np.random.Generator] = None,
) -> Tuple[NDArray, NDArray]:
    """Attention with optional attention dropout: ``out = (P * m) @ v``.

    The forward is :func:`sdpa_forward`; with ``dropout_p > 0`` the multiplier ``m`` comes from
    :func:`dropout_mult` (one ``rng.random`` uniform per weight, C order, keep ``u >= p``,
    scale ``1/(1-p)``). ``dropout_p == 0`` draws nothing, so ``rng``'s state is unchanged.

    Args:
        q, k, v, mask, scale: as in :func:`sdpa_forward`.
        dropout_p: probability of dropping each weight, in [0, 1).
        rng: a ``numpy.random.Generator``; required when ``dropout_p > 0``.

    Returns:
        ``(out, weights)``: ``out`` ``(..., Tq, dv)`` and the weights P ``(..., Tq, Tk)``
        *before* dropout (for inspection; gradients flow through ``out`` only).
    """
    p_drop = _check_dropout_p(dropout_p)
    if p_drop > 0.0 and rng is None:
        raise ValueError(
            f"dropout_p = {dropout_p!r} needs rng, a numpy.random.Generator to draw the "
            f"dropout mask from; pass rng=np.random.default_rng(seed) or dropout_p=0.0."
        )
    p, vb, out_dtype = _weights(q, k, v, mask, scale)
    if p_drop > 0.0:
        mult = dropout_mult(p.shape, p_drop, rng, dtype=p.dtype)
        out = (p * mult) @ vb
    else:
        out = p @ vb
    return out.astype(out_dtype, copy=False), p.astype(out_dtype, copy=False)
