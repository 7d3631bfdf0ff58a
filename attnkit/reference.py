"""The dense float64 oracle: attention written out as plainly as possible.

Every test, ``attnkit check`` and the benchmark's error column compare attnkit against this.
It reads the raw keywords of :func:`attnkit.attention` itself (it shares no code with the
spec, the planner or the executors, so a mistake there cannot hide here), materialises the
full score matrix ``(*B, Hq, Lq, Lk)`` in float64 (small problems only) and is differentiated
by torch autograd, which gives reference gradients for q, k, v, bias, sinks and the tensors a
score_mod reads.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from .terms.mods import call_mask_mod, call_score_mod


def _flat(x: Tensor, batch: Tuple[int, ...], n: int) -> Tensor:
    """(..., A, B, C) broadcast to (*batch, A, B, C) and flattened to (n, A, B, C)."""
    x = x.expand(*batch, *x.shape[-3:]) if x.dim() >= 3 else x.expand(*batch, 1, *x.shape)
    return x.reshape(n, *x.shape[-3:])


def _scores_shaped(x: Tensor, batch: Tuple[int, ...], n: int, full: Tuple[int, ...]) -> Tensor:
    """A mask, bias or keep mask broadcast to the scores: (n, Hq, Lq, Lk)."""
    return x.expand(*batch, *full).reshape(n, *full)


def _per_row(x: Optional[Any], default: int, n: int) -> Tensor:
    """Per-batch-row lengths (n, 1, 1, 1)."""
    if x is None:
        return torch.full((n, 1, 1, 1), default, dtype=torch.int64)
    return torch.as_tensor(x).reshape(n, 1, 1, 1).long()


def _visible(mask: Any, b: Tensor, h: Tensor, i: Tensor, j: Tensor,
             full: Tuple[int, ...], batch: Tuple[int, ...], n: int) -> Tensor:
    """Which pairs a ``mask=`` keeps: a bool tensor, a BlockMask (every pair of a full block,
    its mask_mod on a partial one, nothing elsewhere) or a mask_mod."""
    if isinstance(mask, Tensor):
        return _scores_shaped(mask, batch, n, full)
    if hasattr(mask, "kv_num_blocks"):  # a BlockMask (attnkit's or torch's)
        from .terms.block_mask import BlockMask

        bm = mask if isinstance(mask, BlockMask) else BlockMask.from_torch(mask)
        bq, bk = bm.BLOCK_SIZE
        kinds = bm.block_kinds()  # (B|1, H|1, nqb, nkb): 0 empty, 1 partial, 2 full
        kinds = kinds.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :full[1], :full[2]]
        inside = call_mask_mod(bm.mask_mod, b, h, i, j) if bm.mask_mod is not None else (
            torch.tensor(True))
        return (kinds == 2) | ((kinds == 1) & inside)
    return call_mask_mod(mask, b, h, i, j)


class _Call:
    """One call's inputs in float64, flattened to (n, heads, L, D), with the index grids."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, seqlens_q: Any, seqlens_kv: Any,
                 diagonal: str):
        self.two_d = q.dim() == 2
        if self.two_d:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        self.batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
        n = self.n = math.prod(self.batch)
        q, k, v = (_flat(x, self.batch, n).double() for x in (q, k, v))
        hq, lq, self.d = q.shape[1:]
        lk = k.shape[2]
        groups = hq // k.shape[1] if k.shape[1] else 1  # GQA: query head h uses kv head h // G
        self.q, self.k, self.v = q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        self.full = (hq, lq, lk)
        self.b = torch.arange(n).view(n, 1, 1, 1)
        self.h = torch.arange(hq).view(1, hq, 1, 1)
        self.i = torch.arange(lq).view(1, 1, lq, 1)
        self.j = torch.arange(lk).view(1, 1, 1, lk)
        self.len_q, self.len_k = _per_row(seqlens_q, lq, n), _per_row(seqlens_kv, lk, n)
        # the aligned query position i': bottom-right puts the last query at the last key
        self.ip = self.i + (self.len_k - self.len_q) if diagonal == "bottom_right" else self.i

    def shaped(self, x: Tensor) -> Tensor:
        return _scores_shaped(x, self.batch, self.n, self.full)


def _scores(c: _Call, scale: Optional[float], bias: Optional[Tensor], score_mod: Any,
            softcap: Optional[float], alibi_slopes: Any) -> Tensor:
    """scale * q.k, then softcap, bias, ALiBi and score_mod, in that order."""
    scale = (1.0 / math.sqrt(c.d) if c.d else 1.0) if scale is None else float(scale)
    s = scale * (c.q @ c.k.transpose(-1, -2))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + c.shaped(bias.double())
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes).double()
        hq, lq, _ = c.full
        slopes = slopes.view(-1, hq, lq, 1) if slopes.dim() == 3 else slopes.view(-1, hq, 1, 1)
        s = s - slopes * (c.ip - c.j).abs()
    if score_mod is not None:
        s = call_score_mod(score_mod, s, c.b, c.h, c.i, c.j)  # (checks what the mod returns)
    return s


def _visibility(c: _Call, mask: Any, causal: bool, window: Any, starts_kv: Any) -> Tensor:
    """Every mask term ANDed: causal, window, ``mask``, padding (lengths and key starts)."""
    vis = torch.ones(c.n, *c.full, dtype=torch.bool)
    if causal:
        vis &= c.j <= c.ip
    left, right = window if window is not None else (None, None)
    if left is not None:
        vis &= c.j >= c.ip - left
    if right is not None:
        vis &= c.j <= c.ip + right
    if mask is not None:
        vis &= _visible(mask, c.b, c.h, c.i, c.j, c.full, c.batch, c.n)
    if starts_kv is not None:  # left padding: row b's keys before starts_kv[b] are hidden
        vis &= c.j >= _per_row(starts_kv, 0, c.n)
    return vis & (c.i < c.len_q) & (c.j < c.len_k)


def scores(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None, mask: Any = None,
           bias: Optional[Tensor] = None, causal: bool = False, window: Any = None,
           diagonal: str = "top_left", score_mod: Any = None, softcap: Optional[float] = None,
           alibi_slopes: Any = None, seqlens_q: Any = None, seqlens_kv: Any = None,
           starts_kv: Any = None, **_: Any) -> Tuple[Tensor, Tensor]:
    """The final float64 scores before masking and the visibility, both ``(N, Hq, Lq, Lk)``
    (N the flattened batch), for :func:`attention`'s keywords (others are ignored)."""
    c = _Call(q, k, v, seqlens_q, seqlens_kv, diagonal)
    return (_scores(c, scale, bias, score_mod, softcap, alibi_slopes),
            _visibility(c, mask, causal, window, starts_kv))


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None, mask: Any = None,
    bias: Optional[Tensor] = None, causal: bool = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None, diagonal: str = "top_left",
    score_mod: Optional[Callable[..., Tensor]] = None, softcap: Optional[float] = None,
    alibi_slopes: Any = None, seqlens_q: Any = None, seqlens_kv: Any = None,
    starts_kv: Any = None, sinks: Optional[Tensor] = None, dropout_p: float = 0.0,
    seed: Optional[int] = None, offset: int = 0, dropout_mask: Optional[Tensor] = None,
    dropout_keep: Optional[Tensor] = None, return_lse: bool = False,
    return_weights: bool = False, p_scale: Optional[float] = None,
) -> Union[Tensor, Tuple[Tensor, ...]]:
    """Dense float64 attention with the semantics of :func:`attnkit.attention` (same keywords).

    Dropout needs its keep mask: ``dropout_keep`` (or ``dropout_mask``, bool, True = keep), or
    ``seed``/``offset`` to replay attnkit's Philox mask. ``p_scale`` rounds the weights to
    float8_e4m3fn as ``fp8(p * p_scale) / p_scale`` (saturating at 448) before dropout and
    ``P V``. The inputs are real numbers: pass fp8 ones dequantized (``x8.double() *
    descale``). Returns ``out`` (float64), plus
    ``lse`` with ``return_lse`` and the pre-dropout weights with ``return_weights``.
    """
    c = _Call(q, k, v, seqlens_q, seqlens_kv, diagonal)
    s = _scores(c, scale, bias, score_mod, softcap, alibi_slopes)
    s = s.masked_fill(~_visibility(c, mask, causal, window, starts_kv), float("-inf"))
    n, (hq, lq, lk) = c.n, c.full
    s_all = s
    if sinks is not None:  # one extra logit per head, with no value
        s_all = torch.cat([s, sinks.double().view(1, hq, 1, 1).expand(n, hq, lq, 1)], -1)
    lse = torch.logsumexp(s_all, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    weights = p
    if p_scale is not None:
        top = torch.finfo(torch.float8_e4m3fn).max
        p = (p * p_scale).clamp(max=top).to(torch.float8_e4m3fn).double() / p_scale
    keep = dropout_keep if dropout_keep is not None else dropout_mask
    if keep is None and dropout_p > 0.0:
        if seed is None:
            raise ValueError("attention_reference needs the dropout keep mask: pass "
                             "dropout_keep=, or the seed (and offset) of the call to replay")
        from .terms.dropout import keep_mask

        keep = (keep_mask(seed, offset, dropout_p, c.b, c.h, c.i, c.j) if dropout_p < 1.0
                else torch.zeros((), dtype=torch.bool))
    if keep is not None:
        p = p * c.shaped(keep).double() * (1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0)
    out = p @ c.v

    shape = (lq,) if c.two_d else (*c.batch, hq, lq)
    results: Tuple[Tensor, ...] = (out.reshape(*shape, c.v.shape[-1]),)
    if return_lse:
        results += (lse.reshape(shape),)
    if return_weights:
        results += (weights.detach().reshape(*shape, lk),)
    return results[0] if len(results) == 1 else results
