"""Score mods: changes to the scaled score ``q.k * scale`` before the softmax.

A score_mod has the FlexAttention signature
``score_mod(score, b, h, q_idx, kv_idx) -> score`` and is called on a score tile with
broadcastable int64 index tensors (``b (nb,1,1,1)``, ``h (1,nh,1,1)``, ``q_idx (1,1,bq,1)``,
``kv_idx (1,1,1,bk)``; positions are absolute). The result keeps ``score``'s dtype.

Every factory returns a named builtin (``alibi_8``, ``softcap_30.0`` ...; an
:class:`attnkit.mods.Builtin`, picklable) whose description, read with :func:`describe`, lets an
executor avoid calling it element by element:

* ``describe(mod).bias = fn(b, h, q_idx, kv_idx) -> Tensor`` on additive mods, with
  ``mod(score, b, h, q, k) == score + fn(b, h, q, k).to(score.dtype)``; an executor can build
  additive bias tiles from it (and its gradient, for learnable tables).
* ``describe(mod).cap = cap`` on :func:`softcap`.
* ``describe(mod).structure = {"kind": ..., params}``: ``{"kind": "alibi", "slopes": Tensor
  (H,), "offset": int}``, ``{"kind": "softcap", "cap": float}``, ``{"kind": "relative_bias",
  "table": Tensor, "max_distance": M}``, ``{"kind": "head_bias", "values": Tensor (H,)}``,
  ``{"kind": "compose", "parts": [dict|None, ...]}``.

The description is trusted only on genuine builtins: a ``functools.wraps`` wrapper around one
is a plain function, and :func:`describe` returns None for it.

FlashAttention's ALiBi on a causal mask, ``Lq = 3``, ``Lk = 3``, slope ``s``; the bias added
to the score (``.`` = masked)::

     0   .   .
    -s   0   .
    -2s -s   0
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from .checks import tensor_argument
from .mods import Builtin, ModInfo, info_of

__all__ = [
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "compose",
    "describe",
    "head_bias",
    "relative_bias",
    "softcap",
]

ScoreMod = Callable[..., Tensor]
"""``score_mod(score, b, h, q_idx, kv_idx) -> Tensor`` (same shape as the broadcast inputs)."""

BiasFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _to_device(t: Tensor, like: Tensor) -> Tensor:
    return t if t.device == like.device else t.to(like.device)


def _float_tensor(name: str, value: Any, dims: tuple[int, ...]) -> Tensor:
    return tensor_argument(name, value, dims, "float")


def describe(mod: Any) -> Optional[ModInfo]:
    """The description of a builtin score mod (its structure, additive bias, softcap), or None
    for any other callable, ``functools.wraps`` wrappers included."""
    return info_of(mod)


def _additive(bias: BiasFn, name: str, structure: dict, factory: Callable[..., Any],
              *args: Any) -> ScoreMod:
    """Build ``score + bias(...)``, named, described as additive, pickled as
    ``factory(*args)``."""

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + bias(b, h, q_idx, kv_idx).to(score.dtype)

    return Builtin(mod, name, ModInfo(structure=structure, bias=bias), factory, args,
                   module=__name__)


# --------------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int) -> Tensor:
    """Standard ALiBi slopes, float32 ``(num_heads,)``.

    For ``H`` a power of two: ``slope[h] = 2 ** (-8 * (h + 1) / H)``. Otherwise (ALiBi paper,
    FlashAttention, HF): the slopes of the closest smaller power of two ``n``, followed by the
    first ``H - n`` odd-position slopes of ``2n`` heads (``2 ** (-8 * (2k + 1) / (2n))``).
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral):
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}.")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}.")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(n)
    if n < num_heads:
        slopes += power_of_two(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float64).to(torch.float32)


def alibi(slopes: Union[Tensor, Sequence[float]], offset: int = 0) -> ScoreMod:
    """ALiBi: ``score - slopes[h] * |q_idx + offset - kv_idx|`` (FlashAttention's convention).

    ``offset`` aligns the queries (``offset = Lk - Lq`` for bottom-right alignment, as with
    ``causal("bottom_right", ...)``). On the visible part of the matching causal mask this is
    ``score + slopes[h] * (kv_idx - (q_idx + offset))``. ``slopes`` is ``(H,)``, e.g. from
    :func:`alibi_slopes`; it may require grad.
    """
    slopes_t = _float_tensor("slopes", slopes, (1,))
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}.")
    offset = int(offset)

    def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return -_to_device(slopes_t, h)[h] * (q_idx + offset - kv_idx).abs()

    name = f"alibi_{slopes_t.numel()}" + (f"_offset{offset}" if offset else "")
    return _additive(bias, name, {"kind": "alibi", "slopes": slopes_t, "offset": offset},
                     alibi, slopes_t, offset)


# --------------------------------------------------------------------------- others


def softcap(cap: float) -> ScoreMod:
    """Soft capping (Gemma 2, Grok): ``cap * tanh(score / cap)``; keeps scores in (-cap, cap).

    Described with ``cap`` (:func:`describe`) so executors can fuse it (and its derivative
    ``1 - tanh^2``) instead of calling the closure.
    """
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real):
        raise TypeError(f"cap must be a positive float, got {type(cap).__name__}.")
    cap = float(cap)
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(
            f"cap must be a positive finite float, got {cap}; to turn capping off, leave "
            "the score_mod out instead of passing 0 or inf.")

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return Builtin(mod, f"softcap_{cap}", ModInfo(structure={"kind": "softcap", "cap": cap},
                                                  cap=cap), softcap, (cap,), module=__name__)


def relative_bias(table: Tensor) -> ScoreMod:
    """Learnable relative-position bias (T5-style, without buckets).

    ``table`` has ``2M - 1`` entries for relative distances ``-(M-1) .. M-1`` (``M`` = max
    distance); distance ``kv_idx - q_idx`` is clamped to that range, so::

        score + table[clamp(kv_idx - q_idx, -(M-1), M-1) + (M-1)]

    A 2-D ``table`` of shape ``(H, 2M - 1)`` gives one row per head (indexed by ``h``).
    Gradients flow into ``table`` through the indexing.
    """
    if not isinstance(table, Tensor):
        raise TypeError(f"table must be a tensor, got {type(table).__name__}.")
    table = _float_tensor("table", table, (1, 2))
    size = table.shape[-1]
    if size % 2 == 0:
        raise ValueError(
            f"table's last dimension must be odd (2 * max_distance - 1), got {size}; for "
            f"max distance M use size 2M - 1 (e.g. {size + 1} or {size - 1}).")
    m = (size + 1) // 2
    per_head = table.dim() == 2

    def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        t = _to_device(table, q_idx)
        idx = (kv_idx - q_idx).clamp(-(m - 1), m - 1) + (m - 1)
        return t[h, idx] if per_head else t[idx]

    name = f"relative_bias_{m}" + (f"_h{table.shape[0]}" if per_head else "")
    return _additive(bias, name, {"kind": "relative_bias", "table": table, "max_distance": m},
                     relative_bias, table)


def head_bias(values: Union[Tensor, Sequence[float]]) -> ScoreMod:
    """Constant per-head bias: ``score + values[h]`` (``values`` is ``(H,)``)."""
    values_t = _float_tensor("values", values, (1,))

    def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return _to_device(values_t, h)[h]

    return _additive(bias, f"head_bias_{values_t.numel()}",
                     {"kind": "head_bias", "values": values_t}, head_bias, values_t)


def compose(*mods: ScoreMod) -> ScoreMod:
    """Apply score mods left to right: ``compose(f, g)(s, ...) == g(f(s, ...), ...)``.

    If every part is an additive builtin the result is additive too: it computes
    ``score + sum of the parts' biases`` in one step (equal to the chained application up to
    float rounding) and is described by that sum. Put :func:`softcap` last to cap the biased
    score.
    """
    if not mods:
        raise ValueError("compose needs at least one score_mod.")
    for i, m in enumerate(mods):
        if not callable(m):
            raise TypeError(
                f"compose: argument {i} must be a score_mod callable "
                f"(score, b, h, q_idx, kv_idx) -> Tensor, got {type(m).__name__}.")

    name = "compose(" + ",".join(getattr(m, "__name__", type(m).__name__) for m in mods) + ")"
    infos = [info_of(m) for m in mods]
    structure = {"kind": "compose",
                 "parts": [None if i is None else i.structure for i in infos]}
    biases: list[Optional[BiasFn]] = [None if i is None else i.bias for i in infos]
    if all(bf is not None for bf in biases):
        # All additive: one bias (the sum), so mod == score + bias holds exactly.
        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            out = biases[0](b, h, q_idx, kv_idx)  # type: ignore[misc]
            for bf in biases[1:]:
                out = out + bf(b, h, q_idx, kv_idx)  # type: ignore[misc]
            return out

        return _additive(bias, name, structure, compose, *mods)

    def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        for m in mods:
            score = m(score, b, h, q_idx, kv_idx)
        return score

    return Builtin(mod, name, ModInfo(structure=structure), compose, mods, module=__name__)
