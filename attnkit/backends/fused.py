"""Executor on torch's fused CPU flash kernel, driven by the plan.

torch (>= 2.2) ships ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``
twin: a fused, multithreaded FlashAttention for CPU that returns the log-sum-exp and takes an
additive mask. attnkit uses it as a kernel and does the planning itself:

- no mask term and no additive term (or every pair visible): one call on the whole problem
  (torch's own speed); decoding rows (few queries per key/value head) use two matmuls;
- plain causal, either diagonal: at most two calls on the whole problem;
- documents / packed sequences (sorted segments, optionally causal): one call per segment;
- padded batches (seqlens): each batch row on its true lengths;
- otherwise, per query block, the key blocks with work: a short contiguous footprint (a band)
  is one masked call; long runs of *full* blocks go without a mask and the *partial* blocks get
  one call on the gathered keys with an additive mask built from the spec's mask terms;
  additive score terms (bias, ALiBi, additive score_mods) make one masked call over every key
  block with work. Pieces merge by their LSE.
- backward calls the fused backward once per forward piece with the *final* output and LSE of
  the whole row, which is exact (P = exp(S - lse_row) for the piece's keys), and accumulates
  dq, dk, dv; an LSE gradient rides in an extra head column. Learnable bias or score_mod
  tensors need dS itself, which the fused kernel does not expose: those backwards run on the
  tiled executor (same math, same result).

This is a private torch API, so it is used only behind a version check; where it is missing
``not_supported_reasons`` says so and the tiled executor runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..merge import merge_state
from ..mods import info_of, remap
from ..plan import ANALYTIC_TERMS, Plan, make_plan, range_visibility, tile_visibility
from ..spec import AttentionSpec
from . import tiled

NAME = "fused"

#: Query (and key) block of the fused schedule.
BLOCK = 256
#: Largest additive-mask tile (elements) one masked call may build.
MASK_ELEMENTS = 1 << 24


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


def is_additive(score_mod: Optional[Callable]) -> bool:
    info = info_of(score_mod)
    return score_mod is None or (info is not None and info.bias is not None)


def has_additive_terms(spec: AttentionSpec) -> bool:
    return spec.bias is not None or spec.alibi_slopes is not None or spec.score_mod is not None


def not_supported_reasons(spec: AttentionSpec) -> List[str]:
    """Why the fused kernel cannot run ``spec`` (empty when it can)."""
    reasons = []
    if FWD_OP is None or BWD_OP is None:
        reasons.append(f"torch {torch.__version__} has no fused CPU flash kernel "
                       f"(aten::_scaled_dot_product_flash_attention_for_cpu, torch >= 2.2)")
    if spec.q.device.type != "cpu":
        reasons.append(f"inputs are on {spec.q.device}; the fused kernel runs on the CPU")
    if spec.softcap is not None:
        reasons.append("softcap is not additive; the fused kernel takes only an additive mask")
    if not is_additive(spec.score_mod):
        reasons.append("the score_mod is not additive (not an additive builtin); the fused kernel "
                       "takes only an additive mask")
    if spec.dropout_p > 0.0 or spec.dropout_mask is not None:
        reasons.append("dropout: torch's fused CPU kernel has no dropout")
    return reasons


# ---- schedule ------------------------------------------------------------------------------


@dataclass
class Piece:
    """One fused call: query rows [q0, q1) against a set of keys."""

    qb: int
    q0: int
    q1: int
    keys: Optional[Tuple[int, int]]  # contiguous key range, or None with ``kbs`` gathered
    kbs: Tuple[int, ...]  # key blocks (for masks and gathering)
    masked: bool  # needs an additive mask built from the spec
    causal: bool  # lone diagonal block: is_causal=True, no mask


@dataclass
class FusedPlan:
    plan: Plan
    pieces: List[Piece]
    whole: bool  # one call on the whole problem, no mask
    #: padded batches run row by row on their true lengths: (b, len_q, len_kv, spec, plan)
    batches: Optional[List[Tuple[int, int, int, AttentionSpec, FusedPlan]]] = None


def _splittable(spec: AttentionSpec) -> bool:
    return ((spec.seqlens_q is not None or spec.seqlens_kv is not None)
            and spec.block_mask is None and spec.segments_q is None and spec.row_offset is None)


def _shift_batch(mod: Optional[Callable], b0: int, score: bool) -> Optional[Callable]:
    """A mod that sees batch index b0 + b (a batch row run on its own keeps its index)."""
    if mod is None:
        return None
    return remap(mod, lambda b, h, i, j: (b + b0, h, i, j), score=score, suffix=f"b{b0}",
                 keep_structure=score)


def _batch_row_spec(spec: AttentionSpec, b: int, sq: int, sk: int) -> AttentionSpec:
    """Batch row ``b`` cut to its true lengths: padding becomes plain shape."""

    def cut(x: Optional[Tensor]) -> Optional[Tensor]:
        if x is None:
            return None
        x = x[b:b + 1] if x.shape[0] > 1 else x
        x = x[:, :, :sq] if x.shape[2] > 1 else x
        return x[:, :, :, :sk] if x.shape[3] > 1 else x

    slopes = spec.alibi_slopes
    if slopes is not None and slopes.shape[0] > 1:
        slopes = slopes[b:b + 1]
    return replace(spec, q=spec.q[b:b + 1, :, :sq], k=spec.k[b:b + 1, :, :sk],
                   v=spec.v[b:b + 1, :, :sk], batch_shape=(1,), mask=cut(spec.mask),
                   bias=cut(spec.bias), alibi_slopes=slopes, seqlens_q=None, seqlens_kv=None,
                   mask_mod=_shift_batch(spec.mask_mod, b, score=False),
                   score_mod=_shift_batch(spec.score_mod, b, score=True), sinks=None)


def make_fused_plan(spec: AttentionSpec) -> FusedPlan:
    if _splittable(spec):
        plan = make_plan(spec, bq=BLOCK, bk=BLOCK)  # for a tiled backward, if one is needed
        rows = []
        for b in range(spec.n):
            sq = spec.lq if spec.seqlens_q is None else int(spec.seqlens_q[b])
            sk = spec.lk if spec.seqlens_kv is None else int(spec.seqlens_kv[b])
            if sq and sk:
                sub = _batch_row_spec(spec, b, sq, sk)
                rows.append((b, sq, sk, sub, make_fused_plan(sub)))
        return FusedPlan(plan=plan, pieces=[], whole=False, batches=rows)
    bs = BLOCK
    if spec.block_mask is not None:
        b = spec.block_mask.BLOCK_SIZE
        bq, bk = (b, b) if isinstance(b, int) else (int(b[0]), int(b[1]))
    else:
        bq = bk = bs
        if has_additive_terms(spec):  # keep the additive-mask tile bounded
            rows = spec.n * spec.hq * max(spec.lk, 1)
            bq = max(16, min(bs, MASK_ELEMENTS // rows))
    if _unmasked(spec) and not has_additive_terms(spec) and spec.lq > 0 and spec.lk > 0:
        plan = Plan(bq=spec.lq, bk=spec.lk, lq=spec.lq, lk=spec.lk,
                    any=torch.ones(1, 1, dtype=torch.bool))  # one tile, nothing to plan
        return FusedPlan(plan=plan, pieces=[], whole=True)
    plan = make_plan(spec, bq=bq, bk=bk)
    if (not has_additive_terms(spec) and bool(plan.any.all())
            and all(bool(f.all()) for f in plan.term_full.values())):
        return FusedPlan(plan=plan, pieces=[], whole=True)  # every pair turned out visible
    pieces = _whole_causal(spec, plan)
    if pieces is None:
        pieces = _segment_pieces(spec, plan)
    if pieces is not None:
        return FusedPlan(plan=plan, pieces=pieces, whole=False)
    pieces: List[Piece] = []
    additive = has_additive_terms(spec)
    for qb in range(plan.nqb):
        q0, q1 = plan.q_range(qb)
        kbs = plan.key_blocks(qb)
        if not kbs:
            continue
        if additive:
            pieces.append(_piece(plan, qb, kbs, masked=True))
            continue
        full = [kb for kb in kbs if _tile_full(plan, qb, kb)]
        partial = [kb for kb in kbs if not _tile_full(plan, qb, kb)]
        if partial and len(full) <= len(partial) and kbs[-1] - kbs[0] == len(kbs) - 1:
            # a short contiguous footprint (a band): one masked call beats split + merge
            pieces.append(_piece(plan, qb, kbs, masked=True))
            continue
        for run in _runs(full):
            pieces.append(_piece(plan, qb, run, masked=False))
        if partial:
            causal = (len(partial) == 1 and _is_causal_diagonal(spec, plan, qb, partial[0]))
            pieces.append(_piece(plan, qb, partial, masked=not causal, causal=causal))
    return FusedPlan(plan=plan, pieces=pieces, whole=False)


def _unmasked(spec: AttentionSpec) -> bool:
    return (not spec.has_band and spec.mask is None and spec.block_mask is None
            and spec.mask_mod is None and spec.seqlens_q is None and spec.seqlens_kv is None
            and spec.segments_q is None)


def _whole_causal(spec: AttentionSpec, plan: Plan) -> Optional[List[Piece]]:
    """Plain causal (either diagonal, aligned so that the last query sees the last key): at
    most two calls on the whole problem, the keys every row sees and the causal square."""
    if (set(plan.term_full) != {"band"} or has_additive_terms(spec) or spec.left is not None
            or spec.right != 0 or spec.row_offset is not None):
        return None
    off = spec.diag_offset()
    if not isinstance(off, int) or off + spec.lq != spec.lk or spec.lq == 0 or spec.lk == 0:
        return None
    return _causal_pieces(0, spec.lq, 0, spec.lk, off)


def _causal_pieces(q0: int, q1: int, k0: int, k1: int, delta: int) -> List[Piece]:
    """Queries [q0, q1) against keys [k0, k1) where local query i sees local keys
    j <= i + delta, with delta + (q1 - q0) == k1 - k0: keys every row sees, then a causal
    square."""
    pieces = []
    if delta > 0:
        pieces.append(Piece(qb=-1, q0=q0, q1=q1, keys=(k0, k0 + delta), kbs=(), masked=False,
                            causal=False))
    pieces.append(Piece(qb=-1, q0=q0 + max(0, -delta), q1=q1, keys=(k0 + max(delta, 0), k1),
                        kbs=(), masked=False, causal=True))
    return pieces


def _segment_pieces(spec: AttentionSpec, plan: Plan) -> Optional[List[Piece]]:
    """Documents / packed sequences (sorted segment ids), optionally causal: one unmasked call
    per segment (two with a bottom-right offset), so no work crosses a segment boundary."""
    terms = set(plan.term_full)
    if "segments" not in terms or not terms <= {"segments", "band"} or has_additive_terms(spec):
        return None
    band = "band" in terms
    if band and (spec.left is not None or spec.right != 0):
        return None
    sq, sk = spec.segments_q, spec.segments_kv
    if bool((sq.diff() < 0).any()) or bool((sk.diff() < 0).any()):
        return None
    ip = spec.aligned_rows().reshape(-1, spec.lq) if band else None
    if ip is not None and ip.shape[0] != 1:
        return None
    kvals, kcounts = torch.unique_consecutive(sk, return_counts=True)
    kstart = torch.cumsum(kcounts, 0) - kcounts
    kranges = {int(v): (int(a), int(a + c)) for v, a, c in zip(kvals, kstart, kcounts)}
    qvals, qcounts = torch.unique_consecutive(sq, return_counts=True)
    pieces: List[Piece] = []
    q0 = 0
    for val, cnt in zip(qvals.tolist(), qcounts.tolist()):
        q1 = q0 + cnt
        keys = kranges.get(val)
        if keys is None:
            q0 = q1
            continue
        k0, k1 = keys
        if not band:
            pieces.append(Piece(qb=-1, q0=q0, q1=q1, keys=(k0, k1), kbs=(), masked=False,
                                causal=False))
        else:
            first, last = int(ip[0, q0]), int(ip[0, q1 - 1])
            delta = first - k0
            if last - first != q1 - 1 - q0:  # the diagonal is not one line in this segment
                return None
            if delta >= k1 - k0 - 1:
                pieces.append(Piece(qb=-1, q0=q0, q1=q1, keys=(k0, k1), kbs=(), masked=False,
                                    causal=False))
            elif delta + (q1 - q0) == k1 - k0:
                pieces.extend(_causal_pieces(q0, q1, k0, k1, delta))
            else:
                return None
        q0 = q1
    return pieces


def _tile_full(plan: Plan, qb: int, kb: int) -> bool:
    return all(bool(f[qb, kb]) for f in plan.term_full.values())


def _runs(kbs: List[int]) -> List[List[int]]:
    runs: List[List[int]] = []
    for kb in kbs:
        if runs and runs[-1][-1] == kb - 1:
            runs[-1].append(kb)
        else:
            runs.append([kb])
    return runs


def _piece(plan: Plan, qb: int, kbs: List[int], masked: bool, causal: bool = False) -> Piece:
    q0, q1 = plan.q_range(qb)
    contiguous = all(b - a == 1 for a, b in zip(kbs, kbs[1:]))
    keys = (plan.k_range(kbs[0])[0], plan.k_range(kbs[-1])[1]) if contiguous else None
    return Piece(qb=qb, q0=q0, q1=q1, keys=keys, kbs=tuple(kbs), masked=masked, causal=causal)


def _is_causal_diagonal(spec: AttentionSpec, plan: Plan, qb: int, kb: int) -> bool:
    """The tile's visibility is exactly top-left causal within the tile (band term only)."""
    if set(plan.term_full) != {"band"} or spec.right != 0 or spec.row_offset is not None:
        return False
    off = spec.diag_offset()
    if not isinstance(off, int):
        return False
    q0, q1 = plan.q_range(qb)
    k0, k1 = plan.k_range(kb)
    if q0 + off != k0 or q1 - q0 != k1 - k0:
        return False
    return spec.left is None or spec.left >= (q1 - q0 - 1)


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
    the rows that see some key (None when every row does)."""
    plan = fplan.plan
    dev = spec.q.device
    j = (torch.arange(*piece.keys, device=dev) if piece.keys is not None
         else _key_index(plan, piece, dev))
    vis = _piece_visibility(spec, plan, piece)
    if vis is not None and _alibi_only(spec) and vis.shape[1] == 1:
        # -inf through the head-independent distances: inf * -slope, no per-head fill
        dist = (spec.aligned_rows(piece.q0, piece.q1) - j.view(1, 1, 1, -1)).abs_().to(dtype)
        dist = torch.where(vis, dist, torch.full((), float("inf"), dtype=dtype, device=dev))
        return dist * spec.alibi_rows(piece.q0, piece.q1).to(dtype).neg(), vis.any(-1)
    add, fresh = _additive(spec, piece.q0, piece.q1, j, piece.keys, dtype)
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


def _piece_visibility(spec: AttentionSpec, plan: Plan, piece: Piece) -> Optional[Tensor]:
    """Visibility over a piece's keys: the analytic terms at once on a contiguous range,
    otherwise (mask_mod, BlockMask, gathered blocks) block by block."""
    dev = spec.q.device
    if piece.keys is not None and not ({"mask_mod", "block_mask"} & set(plan.term_full)):
        terms = [t for t in ANALYTIC_TERMS
                 if any(plan.needs(t, piece.qb, kb) for kb in piece.kbs)]
        return range_visibility(spec, piece.q0, piece.q1, *piece.keys, terms)
    parts = [tile_visibility(spec, plan, piece.qb, kb) for kb in piece.kbs]
    if all(v is None for v in parts):
        return None
    widths = [plan.k_range(kb)[1] - plan.k_range(kb)[0] for kb in piece.kbs]
    lead = torch.broadcast_shapes(*[v.shape[:3] for v in parts if v is not None])
    ones = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev)
    return torch.cat([(v if v is not None else ones).expand(*lead, w)
                      for v, w in zip(parts, widths)], dim=3)


def _additive(spec: AttentionSpec, q0: int, q1: int, j: Tensor,
              keys: Optional[Tuple[int, int]], dtype: torch.dtype
              ) -> Tuple[Optional[Tensor], bool]:
    """Sum of the additive score terms for query rows [q0, q1) and key positions ``j`` (the
    contiguous range ``keys`` when not None), and whether that tensor was made here (so it
    may be written in place; a bias slice may be the caller's own tensor)."""
    tile: Optional[Tensor] = None
    fresh = False
    dev = spec.q.device
    i = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
    jj = j.view(1, 1, 1, -1)
    if spec.bias is not None:
        b = spec.bias.detach()
        b = b[:, :, q0:q1] if b.shape[2] > 1 else b
        if b.shape[3] > 1:
            b = b[..., keys[0]:keys[1]] if keys is not None else b.index_select(3, j)
        tile = b.to(dtype)
    if spec.alibi_slopes is not None:
        dist = (spec.aligned_rows(q0, q1) - jj).abs_().to(dtype)
        term = dist * spec.alibi_rows(q0, q1).to(dtype).neg()
        tile, fresh = (term if tile is None else tile + term), True
    if spec.score_mod is not None:
        info = info_of(spec.score_mod)
        structure = info.structure
        if structure.get("kind") == "relative_bias" and keys is not None:
            term = _relative_bias_tile(structure["table"], structure["max_distance"], q0, q1,
                                       *keys, dtype)
            tile, fresh = (term, True) if tile is None else (tile + term, True)
        else:
            bh = torch.arange(spec.n, device=dev).view(-1, 1, 1, 1)
            hh = torch.arange(spec.hq, device=dev).view(1, -1, 1, 1)
            with torch.no_grad():
                term = info.bias(bh, hh, i, jj).to(dtype)
            tile, fresh = (term, False) if tile is None else (tile + term, True)
    return tile, fresh


def _relative_bias_tile(table: Tensor, m: int, q0: int, q1: int, k0: int, k1: int,
                        dtype: torch.dtype) -> Tensor:
    """``table[h, clamp(j - i) + m - 1]`` for rows [q0, q1) and keys [k0, k1) without a 2-D
    gather: the tile is Toeplitz, so look up the rows + keys - 1 distances it holds once and
    read them as overlapping windows (``unfold``), flipped so that row r starts at
    distance k0 - (q0 + r). Returns ``(1, H|1, rows, keys)``."""
    rows, width = q1 - q0, k1 - k0
    t = table.detach().to(dtype).reshape(-1, table.shape[-1])
    dist = torch.arange(k0 - (q1 - 1), k1 - q0, device=t.device)  # j - i, smallest first
    seq = t[:, dist.clamp_(-(m - 1), m - 1).add_(m - 1)]  # (H|1, rows + keys - 1)
    last_first = torch.arange(rows - 1, -1, -1, device=t.device)
    # window s holds distances lo + s ..; row r is window rows - 1 - r (one row-major copy)
    return seq.unfold(1, width, 1).index_select(1, last_first).unsqueeze(0)


def _mask_dtype(spec: AttentionSpec) -> torch.dtype:
    return torch.float64 if spec.q.dtype == torch.float64 else torch.float32


# ---- forward and backward ------------------------------------------------------------------


def forward(spec: AttentionSpec, fplan: FusedPlan) -> tiled.ForwardResult:
    """Run the schedule; merge pieces by LSE. Returns compute-dtype output, LSE, max scores."""
    cd = spec.compute_dtype
    n, hq, lq, dv = spec.n, spec.hq, spec.lq, spec.dv
    if fplan.batches is not None:
        decoded = _native_padded(spec)
        if decoded is not None:  # decoding over a padded cache: one kernel call, all rows
            return _result(spec, decoded[0].to(cd), decoded[1].to(cd))
        out = torch.zeros(n, hq, lq, dv, dtype=cd, device=spec.q.device)
        lse = torch.full((n, hq, lq), float("-inf"), dtype=cd, device=spec.q.device)
        for b, sq, _, sub, sub_plan in fplan.batches:
            r = forward(sub, sub_plan)
            out[b:b + 1, :, :sq] = r.out
            lse[b:b + 1, :, :sq] = r.lse
        return _result(spec, out, lse)
    if fplan.whole and spec.lq * spec.groups <= SMALL_Q:
        return _result(spec, *_small_q_forward(spec))
    decoded = _native_packed(spec, fplan.pieces)
    if decoded is not None:  # one decoding piece per packed sequence: one kernel call
        return _result(spec, *decoded)
    inp = _Inputs(spec)
    if fplan.whole:
        out, lse = FWD_OP(inp.q, inp.k, inp.v, 0.0, False, scale=spec.scale)
        out, lse = out[..., :dv], lse.to(cd)
        return _result(spec, out, lse)
    md = _mask_dtype(spec)
    out = lse = None
    started = set()
    for piece in fplan.pieces:
        qs = slice(piece.q0, piece.q1)
        decoded = seen = None
        if (not piece.masked and not piece.causal and piece.keys is not None
                and (piece.q1 - piece.q0) * spec.groups <= SMALL_Q):
            k0, k1 = piece.keys  # e.g. one decoding row per packed sequence
            decoded = _native_rows(spec.q[:, :, qs], spec.k[:, :, k0:k1], spec.v[:, :, k0:k1],
                                   spec.scale)
        if decoded is not None:
            o, l = (x.to(cd) for x in decoded)
        else:
            kp, vp = inp.keys(fplan, piece, inp.k), inp.keys(fplan, piece, inp.v)
            mask = None
            if piece.masked:
                mask, seen = _piece_mask(spec, fplan, piece, md)
            o, l = FWD_OP(inp.q[:, :, qs], kp, vp, 0.0, piece.causal, attn_mask=mask,
                          scale=spec.scale)
            o, l = o[..., :dv], l.to(cd)
        if seen is not None:
            l = torch.where(seen.expand_as(l), l, torch.full_like(l, float("-inf")))
        if out is None and piece.q0 == 0 and piece.q1 == lq and len(fplan.pieces) == 1:
            out, lse = o, l  # one piece covers everything: no copy
            started.add((0, lq))
            break
        if out is None:
            out = torch.empty(n, hq, lq, dv, dtype=cd, device=spec.q.device)
            lse = torch.empty(n, hq, lq, dtype=cd, device=spec.q.device)
        if (piece.q0, piece.q1) in started:
            o_m, l_m = merge_state(out[:, :, qs], lse[:, :, qs], o.to(cd), l)
            out[:, :, qs], lse[:, :, qs] = o_m, l_m
        else:
            started.add((piece.q0, piece.q1))
            out[:, :, qs] = o
            lse[:, :, qs] = l
    if out is None:
        out = torch.empty(n, hq, lq, dv, dtype=cd, device=spec.q.device)
        lse = torch.empty(n, hq, lq, dtype=cd, device=spec.q.device)
    for a, b in _gaps(started, lq):  # rows that no piece touched see no key
        out[:, :, a:b] = 0
        lse[:, :, a:b] = float("-inf")
    return _result(spec, out, lse)


#: Query rows per key/value head up to which an unmasked call runs as two matmuls (decoding).
SMALL_Q = 32


def _small_q_forward(spec: AttentionSpec) -> Tuple[Tensor, Tensor]:
    """Decoding (few query rows): the native decode kernel where it runs (one pass over K and
    V, float32 math), else scores, softmax and output as plain matmuls (the flash kernel is
    built for long query blocks)."""
    cd = spec.compute_dtype  # scores in float32 like the kernel (bf16 scores lose digits)
    decoded = _native_rows(spec.q, spec.k, spec.v, spec.scale)
    if decoded is not None:
        return decoded[0].to(cd), decoded[1].to(cd)
    n, hq, lq, _ = spec.q.shape
    rows = spec.groups * lq
    qg = (spec.q.to(cd) * spec.scale).reshape(n, spec.hkv, rows, -1)
    s = torch.matmul(qg, spec.k.to(cd).transpose(-1, -2))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s.sub_(lse))
    out = torch.matmul(p, spec.v.to(cd))
    return out.reshape(n, hq, lq, -1), lse.reshape(n, hq, lq)


def _native_inputs(q: Tensor, k: Tensor, v: Tensor) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """Detached ``q, k, v`` when the native decode kernel can run them (its forward's out and
    LSE are all the fused backward needs), else None."""
    if q.dtype == torch.float64:
        return None
    from .. import native

    q, k, v = q.detach(), k.detach(), v.detach()
    return None if native.decode_reasons(q, k, v, grad_ok=True) else (q, k, v)


def _native_rows(q: Tensor, k: Tensor, v: Tensor, scale: float
                 ) -> Optional[Tuple[Tensor, Tensor]]:
    """Unmasked attention of a few query rows in the native decode kernel (float32 out and
    LSE), or None where it cannot run."""
    inputs = _native_inputs(q, k, v)
    if inputs is None:
        return None
    from .. import native

    return native.dense_decode(*inputs, scale)


def _native_padded(spec: AttentionSpec) -> Optional[Tuple[Tensor, Tensor]]:
    """Decoding rows over a right-padded cache (``seqlens_kv``, maybe causal/window/ALiBi) in
    one native kernel call, which takes each row's own length; None where it cannot run."""
    if (spec.seqlens_kv is None or spec.seqlens_q is not None
            or spec.lq * spec.groups > SMALL_Q or spec.mask is not None
            or spec.block_mask is not None or spec.mask_mod is not None
            or spec.segments_q is not None or spec.bias is not None
            or spec.score_mod is not None or spec.row_offset is not None):
        return None
    inputs = _native_inputs(spec.q, spec.k, spec.v)
    if inputs is None:
        return None
    from .. import native

    return native.dense_decode(*inputs, spec.scale, seqlens=spec.seqlens_kv,
                               diagonal=spec.diagonal, window=(spec.left, spec.right),
                               alibi_slopes=spec.alibi_slopes)


def _native_packed(spec: AttentionSpec, pieces: List[Piece]) -> Optional[Tuple[Tensor, Tensor]]:
    """Packed sequences with the same few query rows each, every row seeing its sequence's
    keys (decoding with continuous batching): all of them in one native kernel call, each
    sequence's keys read in place from the packed K/V. None where this does not apply."""
    if not pieces or spec.n != 1:
        return None
    rows = pieces[0].q1 - pieces[0].q0
    if rows * spec.groups > SMALL_Q or any(
            p.masked or p.causal or p.keys is None or p.q1 - p.q0 != rows for p in pieces):
        return None
    q0s = [p.q0 for p in pieces]
    if len(set(q0s)) != len(q0s):
        return None  # a row in several pieces: they merge, the piece loop does that
    inputs = _native_inputs(spec.q, spec.k, spec.v)
    if inputs is None:
        return None
    from .. import native

    q, k, v = inputs
    dev, cd = q.device, spec.compute_dtype
    idx = torch.cat([torch.arange(p.q0, p.q1, device=dev) for p in pieces])
    qb = q[0].index_select(1, idx).view(spec.hq, len(pieces), rows, -1).transpose(0, 1)
    starts = torch.tensor([p.keys[0] for p in pieces], dtype=torch.int64)
    lens = torch.tensor([p.keys[1] - p.keys[0] for p in pieces], dtype=torch.int64)
    table = torch.zeros(len(pieces), 1, dtype=torch.int64)
    o, l = native.paged_decode(qb, k.transpose(1, 2), v.transpose(1, 2), table, lens,
                               scale=spec.scale, causal=False, starts=starts)
    out = torch.zeros(1, spec.hq, spec.lq, spec.dv, dtype=cd, device=dev)
    lse = torch.full((1, spec.hq, spec.lq), float("-inf"), dtype=cd, device=dev)
    out[0].index_copy_(1, idx, o.transpose(0, 1).reshape(spec.hq, -1, spec.dv).to(cd))
    lse[0].index_copy_(1, idx, l.transpose(0, 1).reshape(spec.hq, -1).to(cd))
    return out, lse


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


def _result(spec: AttentionSpec, out: Tensor, lse: Tensor) -> tiled.ForwardResult:
    """The forward's result: NaN where the math gives NaN, sinks folded into out/LSE, no max
    scores (the kernel has none)."""
    out, lse = _propagate_nonfinite(spec, out, lse)
    if spec.sinks is not None:
        out, lse = _add_sinks(spec, out, lse)
    return tiled.ForwardResult(out=out, lse=lse, max_scores=_no_max(lse))


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
    # The fused kernel does not report row maxima; callers that ask for them use the tiled
    # executor (see api). NaN marks "not computed" rather than a wrong number.
    return torch.full((), float("nan"), dtype=lse.dtype, device=lse.device).expand(lse.shape)


def _add_sinks(spec: AttentionSpec, out: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor]:
    sink = spec.sinks.detach().to(lse.dtype).view(1, -1, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total).nan_to_num(0.0).unsqueeze(-1), total


def backward(spec: AttentionSpec, fplan: FusedPlan, out: Tensor, lse: Tensor, dout: Tensor,
             dlse: Optional[Tensor] = None) -> tiled.Grads:
    """Fused backward per forward piece with the row's final out and LSE. An LSE gradient
    rides in an extra head column (out = 1, dout = -dlse, v = 0), so the kernel's
    D = rowsum(dout * out) becomes D - dlse; learnable additive terms need dS itself and go to
    the tiled backward."""
    needs_ds = (spec.bias is not None and spec.bias.requires_grad) or bool(spec.score_mod_params)
    if needs_ds:
        return tiled.backward(spec, fplan.plan, out, lse, dout, dlse)
    cd = spec.compute_dtype
    if fplan.batches is not None:
        return _batched_backward(spec, fplan, out, lse, dout, dlse)
    inp = _Inputs(spec, extra=0 if dlse is None else 1)
    dv_w = spec.dv
    lse_c = lse.to(torch.float64 if spec.q.dtype == torch.float64 else torch.float32)
    lse_k = torch.where(torch.isneginf(lse_c), torch.full_like(lse_c, float("inf")), lse_c)
    out_p = _pad(out, inp.width)
    dout_p = _pad(dout.to(out.dtype), inp.width)
    if dlse is not None:
        out_p[..., -1] = 1.0
        dout_p[..., -1] = -dlse.to(dout_p.dtype)
    md = _mask_dtype(spec)
    if fplan.whole:
        dq, dk, dvv = BWD_OP(dout_p, inp.q, inp.k, inp.v, out_p, lse_k, 0.0, False,
                             scale=spec.scale)
    else:
        dq = torch.zeros(inp.q.shape, dtype=cd, device=spec.q.device)
        dk = torch.zeros(inp.k.shape, dtype=cd, device=spec.q.device)
        dvv = torch.zeros(inp.v.shape, dtype=cd, device=spec.q.device)
    for piece in fplan.pieces:
        qs = slice(piece.q0, piece.q1)
        kp, vp = inp.keys(fplan, piece, inp.k), inp.keys(fplan, piece, inp.v)
        mask = _piece_mask(spec, fplan, piece, md)[0] if piece.masked else None
        gq, gk, gv = BWD_OP(dout_p[:, :, qs], inp.q[:, :, qs], kp, vp, out_p[:, :, qs],
                            lse_k[:, :, qs], 0.0, piece.causal, attn_mask=mask,
                            scale=spec.scale)
        dq[:, :, qs] += gq.to(cd)
        if piece.keys is not None:
            dk[:, :, piece.keys[0]:piece.keys[1]] += gk.to(cd)
            dvv[:, :, piece.keys[0]:piece.keys[1]] += gv.to(cd)
        else:
            idx = _key_index(fplan.plan, piece, spec.q.device)
            dk.index_add_(2, idx, gk.to(cd))
            dvv.index_add_(2, idx, gv.to(cd))
    d = spec.q.shape[-1]
    dsinks = None
    if spec.sinks is not None and spec.sinks.requires_grad:
        dsinks = _sink_grad(spec, out, lse_k.to(cd), dout, dlse)
    return tiled.Grads(dq=dq[..., :d], dk=dk[..., :d], dv=dvv[..., :dv_w], dbias=None,
                       dsinks=dsinks, dparams=())


def _sink_grad(spec: AttentionSpec, out: Tensor, lse_k: Tensor, dout: Tensor,
               dlse: Optional[Tensor]) -> Tensor:
    cd = spec.compute_dtype
    delta = (dout.to(cd) * out.to(cd)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(cd)
    return tiled.sink_gradient(spec, lse_k, delta)


def _batched_backward(spec: AttentionSpec, fplan: FusedPlan, out: Tensor, lse: Tensor,
                      dout: Tensor, dlse: Optional[Tensor]) -> tiled.Grads:
    cd = spec.compute_dtype
    dq = torch.zeros(spec.q.shape, dtype=cd, device=spec.q.device)
    dk = torch.zeros(spec.k.shape, dtype=cd, device=spec.q.device)
    dvv = torch.zeros(spec.v.shape, dtype=cd, device=spec.q.device)
    for b, sq, sk, sub, sub_plan in fplan.batches or []:
        g = backward(sub, sub_plan, out[b:b + 1, :, :sq], lse[b:b + 1, :, :sq],
                     dout[b:b + 1, :, :sq], None if dlse is None else dlse[b:b + 1, :, :sq])
        dq[b:b + 1, :, :sq] = g.dq
        dk[b:b + 1, :, :sk] = g.dk
        dvv[b:b + 1, :, :sk] = g.dv
    dsinks = None
    if spec.sinks is not None and spec.sinks.requires_grad:
        lse_c = lse.to(cd)
        lse_k = torch.where(torch.isneginf(lse_c), torch.full_like(lse_c, float("inf")), lse_c)
        dsinks = _sink_grad(spec, out, lse_k, dout, dlse)
    return tiled.Grads(dq=dq, dk=dk, dv=dvv, dbias=None, dsinks=dsinks, dparams=())


def make_executor_plan(spec: AttentionSpec) -> FusedPlan:
    return make_fused_plan(spec)
