"""The score terms, written once: every executor that applies them calls these.

Between the scaled scores ``s = scale * q.k`` and the masks, a call may add (in this order)
a softcap, an additive bias, ALiBi and a score_mod. :func:`apply_terms` applies them to a score
tile (the tiled executor, the decode fallback); :func:`additive_tile` builds the sum of the
additive ones as one tile (the fused executor passes it to the kernel as its additive mask).
Index grids, the safe LSE and the dropout multiplier live here too, so nothing of them is
written twice.

:data:`TERMS` and :data:`ADDITIVE_TERMS` are the spec features these functions handle; the
executors that use them declare those sets, so a new term added here is supported by them and
refused by the others.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .mods import call_score_mod, info_of
from .spec import AttentionSpec

#: Spec features :func:`apply_terms` handles.
TERMS = frozenset({"bias", "bias_grad", "alibi", "alibi_rows", "softcap", "score_mod",
                   "additive_score_mod", "score_mod_grad"})
#: Spec features :func:`additive_tile` handles (the gradients of learnable ones need dS,
#: which an executor that uses this tile in a kernel obtains elsewhere).
ADDITIVE_TERMS = frozenset({"bias", "bias_grad", "alibi", "alibi_rows", "additive_score_mod",
                            "score_mod_grad"})


def index_grid(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcastable int64 ``b (N,1,1,1)``, ``h (1,Hq,1,1)``, ``q_idx (1,1,rows,1)``,
    ``kv_idx (1,1,1,keys)`` of queries [q0, q1) and keys [k0, k1)."""
    dev = spec.q.device
    return (torch.arange(spec.n, device=dev).view(-1, 1, 1, 1),
            torch.arange(spec.hq, device=dev).view(1, -1, 1, 1),
            torch.arange(q0, q1, device=dev).view(1, 1, -1, 1),
            torch.arange(k0, k1, device=dev).view(1, 1, 1, -1))


def safe_lse(lse: Tensor) -> Tensor:
    """``lse`` with ``-inf`` (rows that see no key) as ``+inf``, so ``exp(s - lse)`` is 0."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


def slice_tile(x: Tensor, q0: int, q1: int, k0: int, k1: int) -> Tensor:
    """Slice a canonical 4-D mask/bias (dims 1 or full) to one tile, keeping broadcast dims."""
    qs = slice(q0, q1) if x.shape[2] > 1 else slice(None)
    ks = slice(k0, k1) if x.shape[3] > 1 else slice(None)
    return x[:, :, qs, ks]


def alibi_term(spec: AttentionSpec, q0: int, q1: int, j: Tensor, dtype: torch.dtype,
               where: Optional[Tensor] = None,
               cols: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
    """ALiBi ``-slope * |i' - j|`` for query rows [q0, q1) and key positions ``j``:
    ``(N|1, Hq, rows, keys)``. With ``where`` (visibility) or ``cols`` (each row's visible
    columns ``[a, e)`` of ``j``, shaped as the rows' positions), hidden pairs get ``-inf``
    through the head-independent distance (``inf * -slope``; every slope must be > 0). On
    the CPU the native kernel writes the same tile in one pass
    (:func:`attnkit.native.alibi_tile`)."""
    ip, slopes = spec.aligned_rows(q0, q1), spec.alibi_rows(q0, q1)
    if spec.q.device.type == "cpu" and (where is None or where.shape[1] == 1):
        from .. import native

        tile = native.alibi_tile(ip, j, slopes, where, dtype, cols=cols)
        if tile is not None:
            return tile
    if cols is not None:
        c = torch.arange(j.shape[0], device=j.device)
        seen = (c >= cols[0]) & (c < cols[1])
        where = seen if where is None else where & seen
    dist = (ip - j.view(1, 1, 1, -1)).abs_().to(dtype)
    if where is not None:
        dist = torch.where(where, dist, torch.full((), float("inf"), dtype=dtype,
                                                   device=dist.device))
    return dist * slopes.to(dtype).neg()


#: ALiBi folded into the queries and keys (:func:`fold_alibi`) only while the largest
#: ``slope * Lk`` (or ``slope * |i'|``) stays at most this: the kernel's scores then carry
#: ``slope * i'`` (up to this), whose float32 rounding (2^-11 here) is what the fold costs in
#: the logits.
FOLD_ALIBI_LIMIT = 4096.0


def alibi_foldable(spec: AttentionSpec) -> bool:
    """ALiBi that :func:`fold_alibi` can move into the queries and keys: bfloat16 q/k on
    the CPU, per-head slopes without a gradient, every visible pair at or left of its
    diagonal (a band with ``right <= 0``: then ``-slope * |i' - j| = slope * j - slope * i'``),
    no other score term or sink, contiguous K (no pages), fewer than 2^24 keys, a positive
    scale with ``slope / scale * Lk`` finite, and the largest ``slope * Lk`` (``Lk`` or the
    largest ``|i'|``, whichever is more) at most :data:`FOLD_ALIBI_LIMIT`."""
    sl = spec.alibi_slopes
    if (sl is None or sl.dim() != 2 or sl.requires_grad or spec.q.dtype != torch.bfloat16
            or spec.k.dtype != torch.bfloat16 or spec.q.device.type != "cpu"):
        return False
    if (spec.bias is not None or spec.score_mod is not None or spec.softcap is not None
            or spec.sinks is not None or spec.paged is not None or spec.right is None
            or spec.right > 0 or spec.lk >= 1 << 24 or spec.lk == 0):
        return False
    # the farthest position in the scores: a key, or a row's i' (queries past the keys)
    far = max(spec.lk, int(spec.aligned_rows().abs().max()) + 1 if spec.lq else 0)
    if not spec.scale > 0 or not math.isfinite(float(sl.abs().max()) / spec.scale * far):
        return False  # (a zero scale makes slope / scale infinite; with a negative one the
        # folded call came back NaN from the fused kernel: not investigated, not folded)
    return float(sl.abs().max()) * far <= FOLD_ALIBI_LIMIT


def _bf16_parts(x: Tensor, n: int) -> list:
    """``x`` (float32) as ``n`` bfloat16 values whose sum is ``x`` to about 8 * n bits."""
    parts, rest = [], x.float()
    for _ in range(n):
        p = rest.to(torch.bfloat16)
        parts.append(p)
        rest = rest - p.float()
    return parts


def fold_alibi(spec: AttentionSpec) -> AttentionSpec:
    """A spec without ALiBi whose scores are the ALiBi scores plus ``slope * i'`` per row (a
    constant of the row: the softmax is the same, the LSE is :func:`alibi_row_shift` more):
    extra head dims with ``q`` holding ``slope / scale`` in three bfloat16 parts and ``k``
    the key position ``j`` in two or three exact bfloat16 parts (8 bits each), one dim per
    pair of parts, so their products (exact in float32) sum to ``slope * j / scale``; then
    zeros to a multiple of 16 dims. Requires :func:`alibi_foldable`."""
    import dataclasses

    n, hq, lq, d = spec.q.shape
    hk, lk = spec.k.shape[1], spec.k.shape[2]
    j = torch.arange(lk, device=spec.k.device)
    jp = ([(j >> 16) << 16, ((j >> 8) & 0xFF) << 8, j & 0xFF] if lk > 1 << 16
          else [(j >> 8) << 8, j & 0xFF])
    sp = _bf16_parts(spec.alibi_slopes.detach() / spec.scale, 3)  # (N|1, Hq) each
    qx = torch.stack([a for a in sp for _ in jp], -1)  # (N|1, Hq, E)
    kx = torch.stack([b.to(torch.bfloat16) for _ in sp for b in jp], -1)  # (Lk, E)
    extra = qx.shape[-1]
    pad = -(d + extra) % 16
    z = spec.q.new_zeros(())
    q2 = torch.cat([spec.q, qx[:, :, None].expand(n, hq, lq, extra),
                    z.expand(n, hq, lq, pad)], -1)
    k2 = torch.cat([spec.k, kx.expand(spec.k.shape[0], hk, lk, extra),
                    z.expand(spec.k.shape[0], hk, lk, pad)], -1)
    return dataclasses.replace(spec, q=q2, k=k2, alibi_slopes=None)


def alibi_row_shift(spec: AttentionSpec) -> Tensor:
    """``slope * i'`` per row, ``(N|1, Hq, Lq)`` in the compute dtype: what the scores of
    :func:`fold_alibi` carry beyond the ALiBi scores (their LSE is this much more)."""
    ip = spec.aligned_rows().reshape(-1, 1, spec.lq).to(torch.float64)
    return (spec.alibi_slopes.detach().to(torch.float64).unsqueeze(-1) * ip).to(
        spec.compute_dtype)


def softcap_(s: Tensor, cap: float, inplace: bool) -> Tensor:
    """``cap * tanh(s)`` of a tile already divided by the cap: in place and in one native pass
    where it can, in differentiable torch ops when the caller differentiates this."""
    if torch.is_grad_enabled() and s.requires_grad:
        return torch.tanh(s) * cap
    from .. import native

    if not inplace:
        s = s.clone()
    if not native.softcap_forward_(s, cap):
        s.tanh_().mul_(cap)
    return s


def softcap_grad(ds: Tensor, raw: Tensor, cap: float) -> Tensor:
    """The gradient through ``cap * tanh(raw)``: ``ds * cap * (1 - tanh(raw)^2)``."""
    if not torch.is_grad_enabled():
        from .. import native

        fast = native.softcap_backward(ds, raw, cap)
        if fast is not None:
            return fast
    th = torch.tanh(raw)
    return ds * (1.0 - th * th) * cap


def apply_terms(spec: AttentionSpec, s: Tensor, q0: int, q1: int, k0: int, k1: int,
                inplace: bool) -> Tensor:
    """Softcap, bias and ALiBi on a score tile ``(N, Hq, rows, keys)`` of queries [q0, q1)
    and keys [k0, k1) (the score_mod is :func:`apply_score_mod`). A softcapped tile arrives
    divided by the cap. With ``inplace`` the tile is overwritten."""
    if spec.softcap is not None:
        s = softcap_(s, spec.softcap, inplace)
        inplace = True
    if spec.bias is not None:
        b = slice_tile(spec.bias, q0, q1, k0, k1)
        s = s.add_(b) if inplace and b.dtype == s.dtype else s + b.to(s.dtype)
        inplace = True
    if spec.alibi_slopes is not None:
        term = alibi_term(spec, q0, q1, torch.arange(k0, k1, device=s.device), s.dtype)
        s = s.add_(term) if inplace and term.shape == s.shape else s + term
    return s


def apply_score_mod(spec: AttentionSpec, s: Tensor, q0: int, q1: int, k0: int,
                    k1: int) -> Tensor:
    """The spec's score_mod on a score tile of queries [q0, q1) and keys [k0, k1)."""
    return call_score_mod(spec.score_mod, s, *index_grid(spec, q0, q1, k0, k1))


def relative_bias_tile(table: Tensor, m: int, q0: int, q1: int, k0: int, k1: int,
                       dtype: torch.dtype) -> Tensor:
    """``table[h, clamp(j - i) + m - 1]`` for rows [q0, q1) and keys [k0, k1) without a 2-D
    gather: the tile is Toeplitz, so look up the rows + keys - 1 distances it holds once and
    read them as overlapping windows (``unfold``), so that row r starts at distance
    k0 - (q0 + r). Returns ``(1, H|1, rows, keys)``."""
    rows, width = q1 - q0, k1 - k0
    t = table.detach().to(dtype).reshape(-1, table.shape[-1])
    dist = torch.arange(k0 - (q1 - 1), k1 - q0, device=t.device)  # j - i, smallest first
    seq = t[:, dist.clamp_(-(m - 1), m - 1).add_(m - 1)]  # (H|1, rows + keys - 1)
    last_first = torch.arange(rows - 1, -1, -1, device=t.device)
    # window s holds distances lo + s ..; row r is window rows - 1 - r (one row-major copy)
    return seq.unfold(1, width, 1).index_select(1, last_first).unsqueeze(0)


def additive_tile(spec: AttentionSpec, q0: int, q1: int, j: Tensor,
                  keys: Optional[Tuple[int, int]], dtype: torch.dtype
                  ) -> Tuple[Optional[Tensor], bool]:
    """Sum of the additive score terms (bias, ALiBi, an additive builtin score_mod) for query
    rows [q0, q1) and key positions ``j`` (the contiguous range ``keys`` when not None), and
    whether that tensor was made here (so it may be written in place; a bias slice may be the
    caller's own tensor)."""
    tile: Optional[Tensor] = None
    fresh = False
    if spec.bias is not None:
        b = spec.bias.detach()
        b = b[:, :, q0:q1] if b.shape[2] > 1 else b
        if b.shape[3] > 1:
            b = b[..., keys[0]:keys[1]] if keys is not None else b.index_select(3, j)
        tile = b.to(dtype)
    if spec.alibi_slopes is not None:
        term = alibi_term(spec, q0, q1, j, dtype)
        tile, fresh = (term if tile is None else tile + term), True
    if spec.score_mod is not None:
        info = info_of(spec.score_mod)
        if info.structure.get("kind") == "relative_bias" and keys is not None:
            term = relative_bias_tile(info.structure["table"], info.structure["max_distance"],
                                      q0, q1, *keys, dtype)
            tile, fresh = (term, True) if tile is None else (tile + term, True)
        else:
            bh, hh, i, _ = index_grid(spec, q0, q1, 0, 0)
            with torch.no_grad():
                term = info.bias(bh, hh, i, j.view(1, 1, 1, -1)).to(dtype)
            tile, fresh = (term, False) if tile is None else (tile + term, True)
    return tile, fresh


def dropout_tile(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int,
                 dtype: torch.dtype) -> Optional[Tensor]:
    """Dropout multiplier tile keep / (1 - p), or None without dropout."""
    if spec.dropout_p >= 1.0:  # every weight dropped
        return torch.zeros((1, 1, 1, 1), dtype=dtype, device=spec.q.device)
    if spec.dropout_mask is not None:
        keep = slice_tile(spec.dropout_mask, q0, q1, k0, k1)
    elif spec.dropout_p > 0.0:
        from .dropout import keep_mask

        keep = keep_mask(spec.seed, spec.offset, spec.dropout_p,
                         *index_grid(spec, q0, q1, k0, k1))
    else:
        return None
    return keep.to(dtype) * (1.0 / (1.0 - spec.dropout_p))


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tuple[Tensor, Tensor]:
    """A result computed without sinks, with them: one extra logit per head joins each row's
    softmax denominator (``lse`` becomes ``logaddexp(lse, sink)``, ``out`` is scaled down)."""
    sink = sinks.detach().to(lse.dtype).view(1, -1, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total).nan_to_num(0.0).unsqueeze(-1), total
