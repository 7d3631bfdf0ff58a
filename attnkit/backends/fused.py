"""Executor on torch's fused CPU flash kernel, driven by attnkit's plan.

torch (>= 2.2) ships ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``
twin: a fused, multithreaded FlashAttention for CPU that returns the log-sum-exp and takes an
additive mask. attnkit uses it as a kernel: :mod:`attnkit.backends.fused_schedule` decides the
calls (whole problem, causal halves, one per document or padded row, or per query block with
additive mask tiles), this module runs them and merges the pieces by their LSE.

The backward calls the fused backward once per forward piece with the *final* output and LSE
of the whole row, which is exact (P = exp(S - lse_row) for the piece's keys), and accumulates
dq, dk, dv; an LSE gradient rides in an extra head column. Learnable bias or score_mod tensors
need dS itself, which the fused kernel does not expose: those backwards run on the tiled
executor (same math, same result). The gradients are the same bits on every run at one
thread count (``tests/test_determinism.py``, grouped-query calls included), so
``torch.use_deterministic_algorithms(True)`` needs no other path: torch's kernel splits its
work by (batch, head), each part on one thread, and the pieces' shares are added in schedule
order (items whose keys overlap: per chunk, the chunks summed in order,
:func:`attnkit.backends.workers.for_each_into`).

This is a private torch API, so it is used only behind a version check; where it is missing,
:func:`extra_reasons` says so and the tiled executor runs.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..engine.plan import ANALYTIC_TERMS, MASK_TERMS, Plan, range_visibility, tile_visibility
from ..kv.merge import merge_state
from ..terms.checks import compute_dtype_of
from ..terms.score_terms import (
    ADDITIVE_TERMS,
    additive_tile,
    alibi_row_shift,
    alibi_term,
    fold_sinks,
    safe_lse,
)
from ..terms.spec import AttentionSpec
from . import tiled, workers
from .base import Capabilities, ForwardResult, Grads
from .fused_schedule import BLOCK, FusedPlan, Piece, Run, make_fused_plan  # noqa: F401 (BLOCK)

CAPS = Capabilities(
    name="fused",
    features=ADDITIVE_TERMS | MASK_TERMS | {"sinks"},
    dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16}),
    devices=frozenset({"cpu"}),
    empty_head_dims=True,
    why={"softcap": "not additive; the kernel takes only an additive mask",
         "score_mod": "not additive (not an additive builtin); the kernel takes only an "
                      "additive mask",
         "dropout": "torch's fused CPU kernel has no dropout",
         "dropout_mask": "torch's fused CPU kernel has no dropout",
         "max_scores": "the kernel does not report row maxima",
         "p_scale": "the kernel never holds the softmax weights, so it cannot quantize them"},
    fallback=("tiled",),
    fallback_for="backwards that need dS itself (a bias or score_mod gradient, sinks)",
)


def _torch_version() -> Tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return (0, 0)


def _load_ops() -> Tuple[Optional[Callable], Optional[Callable]]:
    if _torch_version() < (2, 2):
        return None, None
    aten = torch.ops.aten
    try:
        fwd = aten._scaled_dot_product_flash_attention_for_cpu
        bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
    except (AttributeError, RuntimeError):
        return None, None
    return fwd, bwd


FWD_OP, BWD_OP = _load_ops()


def extra_reasons(spec: AttentionSpec) -> List[str]:
    """The kernel must exist in this torch."""
    if FWD_OP is None or BWD_OP is None:
        return [f"torch {torch.__version__} has no fused CPU flash kernel "
                f"(aten::_scaled_dot_product_flash_attention_for_cpu, torch >= 2.2)"]
    return []


make_plan = make_fused_plan


# ---- tensors of one piece ------------------------------------------------------------------


class _Inputs:
    def __init__(self, spec: AttentionSpec, extra: int = 0):
        d, dv = spec.q.shape[-1], spec.dv
        self.width = max(d, dv) + extra
        self.q = _pad(spec.q, self.width)
        self.k = _pad(spec.k, self.width)
        self.v = _pad(spec.v, self.width)

    def keys(self, fplan: FusedPlan, piece: Piece, x: Tensor) -> Tensor:
        """The piece's keys (or values) of ``x``: a slice, or gathered blocks."""
        if piece.keys is not None:
            return x[:, :, piece.keys[0]:piece.keys[1]]
        return x.index_select(2, _key_index(fplan.plan, piece, x.device))


def _pad(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _key_index(plan: Plan, piece: Piece, device: torch.device) -> Tensor:
    return torch.cat([torch.arange(*plan.k_range(kb), device=device) for kb in piece.kbs])


def _piece_mask(spec: AttentionSpec, fplan: FusedPlan, piece: Piece, dtype: torch.dtype
                ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Additive mask (N|1, Hq|1, bq, keys) for one piece (None when nothing is masked), and
    the rows that see some key (None when every row does). Built on the calling thread alone
    (a tile's few elementwise ops, each a parallel region otherwise)."""
    with workers.one_thread():
        return _piece_mask_tile(spec, fplan, piece, dtype)


def _piece_mask_tile(spec: AttentionSpec, fplan: FusedPlan, piece: Piece, dtype: torch.dtype
                     ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    plan = fplan.plan
    dev = spec.q.device
    j = (torch.arange(*piece.keys, device=dev) if piece.keys is not None
         else _key_index(plan, piece, dev))
    if _alibi_only(spec) and piece.keys is not None and _piece_terms(plan, piece) == ["band"]:
        # a band on contiguous keys: each row's visible columns, no bool tile
        a, e = _band_columns(spec, piece)
        return alibi_term(spec, piece.q0, piece.q1, j, dtype, cols=(a, e)), (e > a)[..., 0]
    vis = _piece_visibility(spec, plan, piece)
    if vis is not None and _alibi_only(spec) and vis.shape[1] == 1:
        # -inf through the head-independent distances: inf * -slope, no per-head fill
        return alibi_term(spec, piece.q0, piece.q1, j, dtype, where=vis), vis.any(-1)
    add, fresh = additive_tile(spec, piece.q0, piece.q1, j, piece.keys, dtype)
    if add is None and vis is None:
        return None, None
    if add is None:
        zero = torch.zeros((), dtype=dtype, device=dev)
        mask = torch.where(vis, zero, torch.full((), float("-inf"), dtype=dtype, device=dev))
    elif vis is not None:  # in place when the tile is ours (not a view of the user's bias)
        fill = add.masked_fill_ if fresh and add.shape == torch.broadcast_shapes(
            add.shape, vis.shape) else add.masked_fill
        mask = fill(~vis, float("-inf"))
    else:
        mask = add
    if spec.bias is not None or spec.score_mod is not None:
        seen = mask.amax(-1) > float("-inf")  # a bias may hold -inf
    else:
        seen = vis.any(-1) if vis is not None else None
    return mask, seen


def _alibi_only(spec: AttentionSpec) -> bool:
    """ALiBi is the only additive term and every slope is > 0 (so inf * -slope = -inf)."""
    return (spec.alibi_slopes is not None and spec.bias is None and spec.score_mod is None
            and bool((spec.alibi_slopes > 0).all()))


def _piece_terms(plan: Plan, piece: Piece) -> Optional[List[str]]:
    """The analytic terms some tile of a piece on contiguous keys needs, or None when the
    piece's visibility needs more (mask_mod, BlockMask, gathered blocks)."""
    if piece.keys is None or {"mask_mod", "block_mask"} & set(plan.term_full):
        return None
    return [t for t in ANALYTIC_TERMS if any(plan.needs(t, piece.qb, kb) for kb in piece.kbs)]


def _band_columns(spec: AttentionSpec, piece: Piece) -> Tuple[Tensor, Tensor]:
    """The band on a piece's contiguous keys as each row's visible columns ``[a, e)``
    (int64, shaped as :meth:`AttentionSpec.aligned_rows`, ``0 <= a``, ``e <= keys``; a row
    with ``e <= a`` sees none): key ``j`` is visible iff ``i' - left <= j <= i' + right``."""
    k0, k1 = piece.keys
    ip = spec.aligned_rows(piece.q0, piece.q1) - k0
    a = (ip - spec.left).clamp_(min=0) if spec.left is not None else torch.zeros_like(ip)
    e = ((ip + spec.right + 1).clamp_(max=k1 - k0) if spec.right is not None
         else torch.full_like(ip, k1 - k0))
    return a, e


def _piece_visibility(spec: AttentionSpec, plan: Plan, piece: Piece) -> Optional[Tensor]:
    """Visibility over a piece's keys: the analytic terms at once on a contiguous range,
    otherwise (mask_mod, BlockMask, gathered blocks) block by block."""
    dev = spec.q.device
    terms = _piece_terms(plan, piece)
    if terms is not None:
        return range_visibility(spec, piece.q0, piece.q1, *piece.keys, terms)
    parts = [tile_visibility(spec, plan, piece.qb, kb) for kb in piece.kbs]
    if all(v is None for v in parts):
        return None
    widths = [plan.k_range(kb)[1] - plan.k_range(kb)[0] for kb in piece.kbs]
    lead = torch.broadcast_shapes(*[v.shape[:3] for v in parts if v is not None])
    ones = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev)
    return torch.cat([(v if v is not None else ones).expand(*lead, w)
                      for v, w in zip(parts, widths)], dim=3)


def _mask_dtype(spec: AttentionSpec) -> torch.dtype:
    return compute_dtype_of(spec.q.dtype)


# ---- forward and backward ------------------------------------------------------------------


def forward(spec: AttentionSpec, fplan: FusedPlan) -> ForwardResult:
    """Run the schedule; merge pieces by LSE. Returns compute-dtype output, LSE, max scores."""
    cd = spec.compute_dtype
    n, hq, lq, dv = spec.n, spec.hq, spec.lq, spec.dv
    if fplan.folded is not None:  # the scores carry slope * i' more: so does the LSE
        r = forward(*fplan.folded)
        lse = r.lse - alibi_row_shift(spec)
        return ForwardResult(out=r.out, lse=lse, max_scores=_no_max(lse))
    if fplan.batches is not None:
        out = torch.zeros(n, hq, lq, dv, dtype=cd, device=spec.q.device)
        lse = torch.full((n, hq, lq), float("-inf"), dtype=cd, device=spec.q.device)
        for b, row, sub, sub_plan in fplan.batches:
            r = forward(sub, sub_plan)
            out[b:b + 1, :, row.q0:row.q1] = r.out
            lse[b:b + 1, :, row.q0:row.q1] = r.lse
        return _result(spec, out, lse)
    inp = _Inputs(spec)
    if fplan.whole:
        out, lse = FWD_OP(inp.q, inp.k, inp.v, 0.0, False, scale=spec.scale)
        out, lse = out[..., :dv], lse.to(cd)
        return _result(spec, out, lse)
    md = _mask_dtype(spec)
    calls = fplan.kernel_calls()
    if len(calls) == 1 and isinstance(calls[0], Piece) and (calls[0].q0, calls[0].q1) == (0, lq):
        out, lse = _piece_forward(spec, fplan, calls[0], inp, md)  # no copy
        return _result(spec, out, lse)
    groups = _row_groups(calls)
    # rows whose pieces merge (or get sinks folded in) accumulate in the compute dtype; where
    # every row has one piece the kernel's output is final, so it stays in the input dtype
    # (two full-size conversions fewer for bfloat16)
    merges = spec.sinks is not None or any(len(g) > 1 for g in groups.values())
    out = torch.empty(n, hq, lq, dv, dtype=cd if merges else spec.q.dtype, device=spec.q.device)
    lse = torch.empty(n, hq, lq, dtype=cd, device=spec.q.device)
    started = set()
    for run in (c for c in calls if isinstance(c, Run)):  # each one call on every thread
        o, l = _run_forward(spec, fplan, run, inp, md)
        _blocks(out, run, run.qlen).copy_(o)
        _blocks(lse, run, run.qlen).copy_(l)
        started.update((p.q0, p.q1) for p in run.pieces)
    started.update(groups)

    def rows(key: Tuple[int, int]) -> None:  # one query range: its pieces merged in order
        o = l = None
        for piece in groups[key]:
            o_p, l_p = _piece_forward(spec, fplan, piece, inp, md)
            o, l = (o_p, l_p) if o is None else merge_state(o.to(cd), l, o_p.to(cd), l_p)
        out[:, :, key[0]:key[1]] = o
        lse[:, :, key[0]:key[1]] = l

    workers.for_each(list(groups), rows, threads=_threads(spec, list(groups)))
    for a, b in _gaps(started, lq):  # rows that no piece touched see no key
        out[:, :, a:b] = 0
        lse[:, :, a:b] = float("-inf")
    return _result(spec, out, lse)


# ---- a run of pieces as one kernel call -----------------------------------------------------


def _blocks(x: Tensor, run: Run, length: int, keys: bool = False, start: Optional[int] = None,
            step: Optional[int] = None, count: Optional[int] = None) -> Tensor:
    """``x`` (N, H, L[, D]) as a (count, N*H, length[, D]) strided view whose entry ``i``
    holds rows ``[start + i * step, + length)`` (default: the run's query or key rows). The
    batch and head dimensions merge into one (``x`` is made contiguous where they cannot)."""
    first = run.pieces[0]
    start = (first.keys[0] if keys else first.q0) if start is None else start
    step = run.step if step is None else step
    count = len(run.pieces) if count is None else count
    n, h = x.shape[0], x.shape[1]
    if x.stride(-1) != 1 or (n > 1 and h > 1 and x.stride(0) != h * x.stride(1)):
        x = x.contiguous()
    merged = x.stride(1) if n == 1 or h > 1 else x.stride(0)
    row = x.stride(2)
    size = (count, n * h, length) + tuple(x.shape[3:])
    stride = (step * row, merged, row) + tuple(x.stride()[3:])
    return x.as_strided(size, stride, x.storage_offset() + start * row)


def _heads_merged(x: Tensor, spec: AttentionSpec) -> Tensor:
    """(N|1, H|1, ...) as (1, N*H|1, ...) (expanded where it was per batch or per head)."""
    if x.shape[0] == 1 and x.shape[1] == 1:
        return x
    full = x.expand(spec.n, spec.hq, *x.shape[2:])
    return full.reshape(1, spec.n * spec.hq, *x.shape[2:])


def _run_mask(spec: AttentionSpec, fplan: FusedPlan, run: Run, dtype: torch.dtype
              ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The run's additive mask (count|1, N*H|1, qlen, klen) and the rows that see a key."""
    if not run.pieces[0].masked:
        return None, None
    if run.shared_mask:
        mask, seen = _piece_mask(spec, fplan, run.pieces[0], dtype)
        return (None if mask is None else _heads_merged(mask, spec),
                None if seen is None else _heads_merged(seen, spec))
    masks, seens = zip(*(_piece_mask(spec, fplan, p, dtype) for p in run.pieces))
    shape = (run.qlen, run.klen)
    mask = torch.cat([_heads_merged(m, spec).expand(1, spec.n * spec.hq, *shape)
                      if m is not None else
                      torch.zeros(1, spec.n * spec.hq, *shape, dtype=dtype,
                                  device=spec.q.device) for m in masks])
    seen = None
    if any(s is not None for s in seens):
        seen = torch.cat([_heads_merged(s, spec).expand(1, spec.n * spec.hq, run.qlen)
                          if s is not None else
                          torch.ones(1, spec.n * spec.hq, run.qlen, dtype=torch.bool,
                                     device=spec.q.device) for s in seens])
    return mask, seen


def _run_forward(spec: AttentionSpec, fplan: FusedPlan, run: Run, inp: _Inputs,
                 md: torch.dtype) -> Tuple[Tensor, Tensor]:
    """One kernel call for the run's pieces: (count, N*H, qlen, dv) output and LSE."""
    mask, seen = _run_mask(spec, fplan, run, md)
    count = len(run.pieces)
    if mask is not None:
        mask = mask.expand(count, *mask.shape[1:])
    o, l = FWD_OP(_blocks(inp.q, run, run.qlen), _blocks(inp.k, run, run.klen, keys=True),
                  _blocks(inp.v, run, run.klen, keys=True), 0.0, run.pieces[0].causal,
                  attn_mask=mask, scale=spec.scale)
    o, l = o[..., :spec.dv], l.to(spec.compute_dtype)
    if seen is not None:
        l = torch.where(seen.expand_as(l), l, torch.full_like(l, float("-inf")))
    return o, l


def _run_backward(spec: AttentionSpec, fplan: FusedPlan, run: Run, inp: _Inputs,
                  md: torch.dtype, saved: Tuple[Tensor, Tensor, Tensor],
                  grads: Tuple[Tensor, Tensor, Tensor]) -> None:
    """One backward kernel call for the run's pieces, accumulated into ``grads`` (dq, dk,
    dv: contiguous). Overlapping key ranges are added in ``ceil(klen / step)`` interleaved
    passes, each over disjoint rows."""
    dout_p, out_p, lse_k = saved
    dq, dk, dvv = grads
    cd, count = spec.compute_dtype, len(run.pieces)
    mask = _run_mask(spec, fplan, run, md)[0]
    if mask is not None:
        mask = mask.expand(count, *mask.shape[1:])
    gq, gk, gv = BWD_OP(_blocks(dout_p, run, run.qlen), _blocks(inp.q, run, run.qlen),
                        _blocks(inp.k, run, run.klen, keys=True),
                        _blocks(inp.v, run, run.klen, keys=True), _blocks(out_p, run, run.qlen),
                        _blocks(lse_k, run, run.qlen), 0.0, run.pieces[0].causal,
                        attn_mask=mask, scale=spec.scale)
    _blocks(dq, run, run.qlen).add_(gq.to(cd))
    every = -(-run.klen // run.step)
    k0 = run.pieces[0].keys[0]
    for r in range(min(every, count)):
        part = slice(r, None, every)
        c = len(range(r, count, every))
        for acc, g in ((dk, gk), (dvv, gv)):
            _blocks(acc, run, run.klen, start=k0 + r * run.step, step=run.step * every,
                    count=c).add_(g[part].to(cd))


def _piece_forward(spec: AttentionSpec, fplan: FusedPlan, piece: Piece, inp: _Inputs,
                   md: torch.dtype) -> Tuple[Tensor, Tensor]:
    """One piece's kernel call: its rows' output (N, Hq, rows, dv) and LSE."""
    qs = slice(piece.q0, piece.q1)
    kp, vp = inp.keys(fplan, piece, inp.k), inp.keys(fplan, piece, inp.v)
    mask = seen = None
    if piece.masked:
        mask, seen = _piece_mask(spec, fplan, piece, md)
    o, l = FWD_OP(inp.q[:, :, qs], kp, vp, 0.0, piece.causal, attn_mask=mask,
                  scale=spec.scale)
    o, l = o[..., :spec.dv], l.to(spec.compute_dtype)
    if seen is not None:
        l = torch.where(seen.expand_as(l), l, torch.full_like(l, float("-inf")))
    return o, l


def _row_groups(calls: List[object]) -> Dict[Tuple[int, int], List[Piece]]:
    """The pieces outside runs by query range, in schedule order (one work item each)."""
    groups: Dict[Tuple[int, int], List[Piece]] = {}
    for c in calls:
        if isinstance(c, Piece):
            groups.setdefault((c.q0, c.q1), []).append(c)
    return groups


def _overlapping(intervals: List[Tuple[int, int]]) -> bool:
    """Whether two of the half-open intervals share a point."""
    end = None
    for a, b in sorted(intervals):
        if end is not None and a < end:
            return True
        end = b if end is None else max(end, b)
    return False


def _disjoint_keys(fplan: FusedPlan, groups: List[List[Piece]]) -> bool:
    """No key row is read by two work items (documents): their dk/dv rows are their own."""
    spans: List[Tuple[int, int]] = []
    for pieces in groups:
        rows = sorted(p.keys if p.keys is not None else fplan.plan.k_range(kb)
                      for p in pieces for kb in ((None,) if p.keys is not None else p.kbs))
        merged: List[List[int]] = []
        for a, b in rows:  # one item's rows as disjoint intervals
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        spans.extend((a, b) for a, b in merged)
    return not _overlapping(spans)


def _threads(spec: AttentionSpec, rows: List[Tuple[int, int]]) -> int:
    """Threads for work items on these query ranges (each then one kernel call on one
    thread): :func:`workers.item_threads`, and one if two items' rows overlap (they would
    write the same output and dq rows)."""
    if _overlapping(rows):
        return 1
    return workers.item_threads(len(rows), spec.q.device)


def _gaps(ranges: set, length: int) -> List[Tuple[int, int]]:
    """Intervals of [0, length) covered by none of ``ranges``."""
    gaps, pos = [], 0
    for a, b in sorted(ranges):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < length:
        gaps.append((pos, length))
    return gaps


def _result(spec: AttentionSpec, out: Tensor, lse: Tensor) -> ForwardResult:
    """The forward's result: NaN where the math gives NaN, sinks folded into out/LSE, no max
    scores (the kernel has none)."""
    out, lse = _propagate_nonfinite(spec, out, lse)
    if spec.sinks is not None:
        out, lse = fold_sinks(out, lse, spec.sinks)
    return ForwardResult(out=out, lse=lse, max_scores=_no_max(lse))


def _propagate_nonfinite(spec: AttentionSpec, out: Tensor, lse: Tensor
                         ) -> Tuple[Tensor, Tensor]:
    """torch's fused kernel hides some NaN: a row with a +inf score (which is inf - inf in the
    softmax) comes back with lse +inf and a finite output, and on short key ranges a NaN query
    row comes back as 0. Give those rows NaN, as the math does. A row with no visible key
    stays 0 (lse -inf), whatever its query holds."""
    plus = torch.isposinf(lse)
    if bool(plus.any()):
        out = out.masked_fill(plus.unsqueeze(-1), float("nan"))
    if math.isfinite(float(spec.q.sum())):  # cheap: a single NaN/inf makes the sum non-finite
        return out, lse
    bad = torch.isnan(spec.q).any(-1) & ~torch.isneginf(lse)
    if bool(bad.any()):
        out = out.masked_fill(bad.unsqueeze(-1), float("nan"))
        lse = lse.masked_fill(bad & ~plus, float("nan"))
    return out, lse


def _no_max(lse: Tensor) -> Tensor:
    # The fused kernel does not report row maxima (a call that asks for them is refused:
    # "max_scores" is not in CAPS). NaN marks "not computed" rather than a wrong number.
    return torch.full((), float("nan"), dtype=lse.dtype, device=lse.device).expand(lse.shape)


def backward(spec: AttentionSpec, fplan: FusedPlan, out: Tensor, lse: Tensor, dout: Tensor,
             dlse: Optional[Tensor] = None) -> Grads:
    """Fused backward per forward piece with the row's final out and LSE. An LSE gradient
    rides in an extra head column (out = 1, dout = -dlse, v = 0), so the kernel's
    D = rowsum(dout * out) becomes D - dlse; learnable additive terms need dS itself and go to
    the tiled backward."""
    needs_ds = (spec.bias is not None and spec.bias.requires_grad) or bool(spec.score_mod_params)
    if needs_ds:
        return tiled.backward(spec, fplan.plan, out, lse, dout, dlse)
    cd = spec.compute_dtype
    if fplan.folded is not None:
        sub, inner = fplan.folded
        g = backward(sub, inner, out, lse + alibi_row_shift(spec), dout, dlse)
        d = spec.q.shape[-1]
        return Grads(dq=g.dq[..., :d], dk=g.dk[..., :d], dv=g.dv, dbias=None, dsinks=None,
                     dparams=())
    if fplan.batches is not None:
        return _batched_backward(spec, fplan, out, lse, dout, dlse)
    inp = _Inputs(spec, extra=0 if dlse is None else 1)
    dv_w = spec.dv
    lse_k = safe_lse(lse.to(compute_dtype_of(spec.q.dtype)))
    out_p = _pad(out, inp.width)
    dout_p = _pad(dout.to(out.dtype), inp.width)
    if dlse is not None:
        out_p[..., -1] = 1.0
        dout_p[..., -1] = -dlse.to(dout_p.dtype)
    md = _mask_dtype(spec)
    calls = fplan.kernel_calls()
    if fplan.whole:
        dq, dk, dvv = BWD_OP(dout_p, inp.q, inp.k, inp.v, out_p, lse_k, 0.0, False,
                             scale=spec.scale)
    elif len(calls) == 1 and _covers_all(spec, calls[0]):  # plain causal: no accumulators
        piece = calls[0]
        mask = _piece_mask(spec, fplan, piece, md)[0] if piece.masked else None
        dq, dk, dvv = BWD_OP(dout_p, inp.q, inp.k, inp.v, out_p, lse_k, 0.0, piece.causal,
                             attn_mask=mask, scale=spec.scale)
        calls = []
    else:
        dq = torch.zeros(inp.q.shape, dtype=cd, device=spec.q.device)
        dk = torch.zeros(inp.k.shape, dtype=cd, device=spec.q.device)
        dvv = torch.zeros(inp.v.shape, dtype=cd, device=spec.q.device)
    for run in (c for c in calls if isinstance(c, Run)):
        _run_backward(spec, fplan, run, inp, md, (dout_p, out_p, lse_k), (dq, dk, dvv))
    groups = list(_row_groups(calls).values())
    threads = _threads(spec, [(p[0].q0, p[0].q1) for p in groups])
    # dq rows are each item's own; dk and dv rows are shared where items' keys overlap: then
    # the items go in chunks with their own accumulators (workers.for_each_into)
    chunks = 1
    if threads > 1 and not _disjoint_keys(fplan, groups):
        chunks = min(len(groups), threads if dk.numel() > 1 << 24 else 2 * threads)

    def item(pieces: List[Piece], acc: Tuple[Tensor, ...]) -> None:
        for piece in pieces:
            qs = slice(piece.q0, piece.q1)
            kp, vp = inp.keys(fplan, piece, inp.k), inp.keys(fplan, piece, inp.v)
            mask = _piece_mask(spec, fplan, piece, md)[0] if piece.masked else None
            gq, gk, gv = BWD_OP(dout_p[:, :, qs], inp.q[:, :, qs], kp, vp, out_p[:, :, qs],
                                lse_k[:, :, qs], 0.0, piece.causal, attn_mask=mask,
                                scale=spec.scale)
            dq[:, :, qs] += gq.to(cd)
            if piece.keys is not None:
                acc[0][:, :, piece.keys[0]:piece.keys[1]] += gk.to(cd)
                acc[1][:, :, piece.keys[0]:piece.keys[1]] += gv.to(cd)
            else:
                idx = _key_index(fplan.plan, piece, spec.q.device)
                acc[0].index_add_(2, idx, gk.to(cd))
                acc[1].index_add_(2, idx, gv.to(cd))

    workers.for_each_into(groups, item, (dk, dvv), threads, chunks)
    d = spec.q.shape[-1]
    dsinks = None
    if spec.sinks is not None and spec.sinks.requires_grad:
        dsinks = _sink_grad(spec, out, lse_k.to(cd), dout, dlse)
    return Grads(dq=dq[..., :d], dk=dk[..., :d], dv=dvv[..., :dv_w], dbias=None,
                       dsinks=dsinks, dparams=())


def _covers_all(spec: AttentionSpec, piece: object) -> bool:
    """One piece on every query and every key (its gradients are the whole gradients)."""
    return (isinstance(piece, Piece) and piece.q0 == 0 and piece.q1 == spec.lq
            and piece.keys == (0, spec.lk))


def _sink_grad(spec: AttentionSpec, out: Tensor, lse_k: Tensor, dout: Tensor,
               dlse: Optional[Tensor]) -> Tensor:
    cd = spec.compute_dtype
    delta = (dout.to(cd) * out.to(cd)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(cd)
    return tiled.sink_gradient(spec, lse_k, delta)


def _batched_backward(spec: AttentionSpec, fplan: FusedPlan, out: Tensor, lse: Tensor,
                      dout: Tensor, dlse: Optional[Tensor]) -> Grads:
    cd = spec.compute_dtype
    dq = torch.zeros(spec.q.shape, dtype=cd, device=spec.q.device)
    dk = torch.zeros(spec.k.shape, dtype=cd, device=spec.q.device)
    dvv = torch.zeros(spec.v.shape, dtype=cd, device=spec.q.device)
    for b, row, sub, sub_plan in fplan.batches or []:
        qs, ks = slice(row.q0, row.q1), slice(row.k0, row.k1)
        g = backward(sub, sub_plan, out[b:b + 1, :, qs], lse[b:b + 1, :, qs],
                     dout[b:b + 1, :, qs], None if dlse is None else dlse[b:b + 1, :, qs])
        dq[b:b + 1, :, qs] = g.dq
        dk[b:b + 1, :, ks] = g.dk
        dvv[b:b + 1, :, ks] = g.dv
    dsinks = None
    if spec.sinks is not None and spec.sinks.requires_grad:
        lse_k = safe_lse(lse.to(cd))
        dsinks = _sink_grad(spec, out, lse_k, dout, dlse)
    return Grads(dq=dq, dk=dk, dv=dvv, dbias=None, dsinks=dsinks, dparams=())
