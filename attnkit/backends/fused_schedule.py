"""The fused executor's schedule: which calls of torch's fused kernel a spec needs.

- no mask term and no additive term (or every pair visible): one call on the whole problem;
- plain causal, either diagonal: at most two calls on the whole problem;
- documents / packed sequences (sorted segments, optionally causal): one call per segment
  (documents given per batch row: each row on its own, then one call per segment);
- padded batches (seqlens, starts_kv): each batch row on its true keys and the queries that see
  some of them (:meth:`AttentionSpec.slice_batch`);
- ALiBi with bfloat16 inputs where every visible pair lies at or left of its diagonal: folded
  into extra q.k dims (:func:`attnkit.score_terms.fold_alibi`), then planned as without it;
- otherwise, per query block, the key blocks with work: a short contiguous footprint (a band)
  is one masked call; long runs of *full* blocks go without a mask and the *partial* blocks get
  one call on the gathered keys with an additive mask built from the spec's mask terms;
  additive score terms (bias, ALiBi, additive score_mods) make one masked call over every key
  block with work. Pieces merge by their LSE (:mod:`attnkit.backends.fused` runs them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..engine.plan import MASK_TERMS, Plan, make_plan
from ..terms.score_terms import ADDITIVE_TERMS, alibi_foldable, fold_alibi
from ..terms.spec import AttentionSpec

#: Query (and key) block of the fused schedule.
BLOCK = 256
#: Largest additive-mask tile (elements) one masked call may build.
MASK_ELEMENTS = 1 << 24


def has_additive_terms(spec: AttentionSpec) -> bool:
    return bool(spec.features() & ADDITIVE_TERMS)


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
class Run:
    """Pieces of one geometry, one per query range: piece ``i`` has queries
    ``[q0 + i * step, + qlen)`` and keys ``[k0 + i * step, + klen)`` (both contiguous). One
    batched kernel call runs them; ``shared_mask``: the mask depends only on query-key
    distances (the band, no additive term), so the first piece's mask serves every piece."""

    pieces: List[Piece]
    step: int
    shared_mask: bool

    @property
    def qlen(self) -> int:
        return self.pieces[0].q1 - self.pieces[0].q0

    @property
    def klen(self) -> int:
        keys = self.pieces[0].keys
        return 0 if keys is None else keys[1] - keys[0]


#: Fewest pieces worth a batched call.
MIN_RUN = 3


@dataclass(frozen=True)
class Row:
    """One padded batch row's true extent: queries [q0, q1) against keys [k0, k1)."""

    q0: int
    q1: int
    k0: int
    k1: int


@dataclass
class FusedPlan:
    plan: Plan
    pieces: List[Piece]
    whole: bool  # one call on the whole problem, no mask
    #: padded batches run row by row on their true extent: (b, Row, spec, plan)
    batches: Optional[List[Tuple[int, Row, AttentionSpec, FusedPlan]]] = None
    #: the pieces as kernel calls: a Piece alone, or a Run of pieces batched into one call
    calls: Optional[List[Union[Piece, Run]]] = None
    #: ALiBi folded into q and k (:func:`attnkit.score_terms.fold_alibi`): the spec without
    #: it and that spec's plan, which run instead (the LSE shifted back)
    folded: Optional[Tuple[AttentionSpec, FusedPlan]] = None

    def kernel_calls(self) -> List[Union[Piece, Run]]:
        return self.calls if self.calls is not None else list(self.pieces)


def _splittable(spec: AttentionSpec) -> bool:
    """Padded batches whose rows can run on their true lengths, and documents given per batch
    row (each row then runs its own documents)."""
    f = spec.features()
    return bool(f & {"seqlens_q", "seqlens_kv", "starts_kv", "batch_segments"}) and not f & {
        "block_mask", "segments", "row_offset"}


def _row_extent(spec: AttentionSpec, b: int) -> Row:
    """Row ``b``'s real queries and keys (``seqlens_q``, ``starts_kv``, ``seqlens_kv``); the
    leading queries that see no key (they lie wholly left of the first key, nothing of the band
    reaching it) are left out too: they give 0, as the rows past ``seqlens_q``."""
    q1 = spec.lq if spec.seqlens_q is None else int(spec.seqlens_q[b])
    k1 = spec.lk if spec.seqlens_kv is None else int(spec.seqlens_kv[b])
    k0 = 0 if spec.starts_kv is None else int(spec.starts_kv[b])
    q0 = 0
    if k0 and spec.right is not None:  # query i sees keys j <= i + offset + right
        off = spec.diag_offset()
        off = int(off.reshape(-1)[b]) if isinstance(off, torch.Tensor) else off
        q0 = max(0, min(q1, k0 - off - spec.right))
    return Row(q0, q1, k0, k1)


#: Plans of calls masked by the band alone (causal, windows: tensor-free), by
#: :func:`_band_key`; a training or generation loop asks for the same few again and again
_BAND_PLANS: dict = {}


def _band_key(spec: AttentionSpec) -> Optional[tuple]:
    """What the plan of a band-only call depends on, or None for any other call: the
    lengths, the band and its diagonal offset (an int here), the device. The plan holds no
    tensor of the call's and nothing runs change it, so equal keys can share it."""
    f = spec.features()
    if "window" not in f or f & (MASK_TERMS | ADDITIVE_TERMS) != {"window"}:
        return None
    off = spec.diag_offset()
    if not isinstance(off, int) or spec.row_offset is not None:
        return None
    return (spec.lq, spec.lk, spec.left, spec.right, off, spec.q.device)


def make_fused_plan(spec: AttentionSpec) -> FusedPlan:
    """The calls that run ``spec`` (see the module docstring); band-only plans are made
    once per :func:`_band_key`."""
    key = _band_key(spec)
    if key is None:
        return _make_fused_plan(spec)
    plan = _BAND_PLANS.get(key)
    if plan is None:
        if len(_BAND_PLANS) > 256:  # do not grow without bound
            _BAND_PLANS.clear()
        plan = _BAND_PLANS[key] = _make_fused_plan(spec)
    return plan


def _make_fused_plan(spec: AttentionSpec) -> FusedPlan:
    if _splittable(spec):
        plan = make_plan(spec, bq=BLOCK, bk=BLOCK)  # for a tiled backward, if one is needed
        rows = []
        for b in range(spec.n):
            r = _row_extent(spec, b)
            if r.q1 > r.q0 and r.k1 > r.k0:
                sub = spec.slice_batch(b, r.q1, r.k1, q_start=r.q0, kv_start=r.k0)
                rows.append((b, r, sub, make_fused_plan(sub)))
        return FusedPlan(plan=plan, pieces=[], whole=False, batches=rows)
    if alibi_foldable(spec):  # ALiBi in two extra q.k dims: no mask tile at all
        sub = fold_alibi(spec)
        inner = make_fused_plan(sub)
        return FusedPlan(plan=inner.plan, pieces=[], whole=False, folded=(sub, inner))
    bs = BLOCK
    if spec.block_mask is not None:
        bq, bk = spec.block_mask.BLOCK_SIZE
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
    return FusedPlan(plan=plan, pieces=pieces, whole=False,
                     calls=group_runs(pieces, _translation_invariant(spec, plan)))


def _translation_invariant(spec: AttentionSpec, plan: Plan) -> bool:
    """Visibility depends only on query-key distance (the band alone, one diagonal offset, no
    additive term): pieces shifted by the same step on both sides have the same mask."""
    return (set(plan.term_full) <= {"band"} and not has_additive_terms(spec)
            and spec.row_offset is None and isinstance(spec.diag_offset(), int))


def group_runs(pieces: Sequence[Piece], invariant: bool) -> List[Union[Piece, Run]]:
    """Consecutive pieces of one geometry (same query and key lengths, flags, and the same
    step on both sides, each the only piece of its query rows) as :class:`Run` s of at least
    :data:`MIN_RUN` pieces; the others stay single calls."""
    rows: dict = {}
    for p in pieces:
        rows[(p.q0, p.q1)] = rows.get((p.q0, p.q1), 0) + 1
    calls: List[Union[Piece, Run]] = []
    run: List[Piece] = []

    def fits(prev: Piece, p: Piece, step: Optional[int]) -> bool:
        if p.keys is None or prev.keys is None or rows[(p.q0, p.q1)] != 1:
            return False
        same = (p.q1 - p.q0 == prev.q1 - prev.q0 and p.keys[1] - p.keys[0]
                == prev.keys[1] - prev.keys[0] and p.masked == prev.masked
                and p.causal == prev.causal)
        d = p.q0 - prev.q0
        return same and d > 0 and p.keys[0] - prev.keys[0] == d and (step is None or d == step)

    def flush() -> None:
        if len(run) >= MIN_RUN:
            calls.append(Run(pieces=list(run), step=run[1].q0 - run[0].q0,
                             shared_mask=invariant))
        else:
            calls.extend(run)
        run.clear()

    for p in pieces:
        if run and fits(run[-1], p, run[1].q0 - run[0].q0 if len(run) > 1 else None):
            run.append(p)
            continue
        flush()
        if p.keys is not None and rows[(p.q0, p.q1)] == 1:
            run.append(p)
        else:
            calls.append(p)
    flush()
    return calls


def _unmasked(spec: AttentionSpec) -> bool:
    return not spec.features() & MASK_TERMS


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
    if sq.dim() != 1 or bool((sq.diff() < 0).any()) or bool((sk.diff() < 0).any()):
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
