"""The plan: which (query block, key block) tiles hold work, and which mask terms a tile needs.

Each mask term (band = causal/window, a bool mask tensor, padding = seqlens and starts_kv, a
BlockMask, a mask_mod) reports per tile whether *some* pair may be visible (``any``) and whether
*every* pair is visible (``full``), aggregated over the batch and heads (a tile runs for all of
them at once).
A tile is skipped when some term says it is empty; a term is not evaluated on a tile it calls
full. A BlockMask's partial/full classification is used as it is (its mask_mod is called only on
tiles that some (batch, head) lists as partial).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..terms.mods import call_mask_mod
from ..terms.score_terms import index_grid, slice_tile
from ..terms.spec import AttentionSpec

#: Spec features the planner classifies tiles by and :func:`tile_visibility` evaluates.
MASK_TERMS = frozenset({"window", "mask", "block_mask", "mask_mod", "seqlens_q", "seqlens_kv",
                        "starts_kv", "segments", "batch_segments", "row_offset"})
#: Score-tile budget (elements of N * Hq * bq * bk) for the tiled executor.
TILE_ELEMENTS = 1 << 21
#: Largest key tile of the tiled executor.
MAX_KEY_TILE = 512


@dataclass
class Plan:
    """Tile grid and per-tile work for one call."""

    bq: int
    bk: int
    lq: int
    lk: int
    any: Tensor  # (nqb, nkb) bool: the tile may hold a visible pair
    term_full: Dict[str, Tensor] = field(default_factory=dict)  # term -> (nqb, nkb) bool
    vis_cache: Dict[Tuple[int, int], Tensor] = field(default_factory=dict)  # mask_mod tiles
    #: BlockMask blocks per (batch * head, qb, kb): (listed = partial or full, full)
    block_tiles: Optional[Tuple[Tensor, Tensor]] = None
    _rows: Optional[List[List[int]]] = None

    @property
    def nqb(self) -> int:
        return self.any.shape[0]

    @property
    def nkb(self) -> int:
        return self.any.shape[1]

    def q_range(self, qb: int) -> Tuple[int, int]:
        return qb * self.bq, min(self.lq, (qb + 1) * self.bq)

    def k_range(self, kb: int) -> Tuple[int, int]:
        return kb * self.bk, min(self.lk, (kb + 1) * self.bk)

    def key_blocks(self, qb: int) -> List[int]:
        """Key blocks of query block ``qb`` that hold work, in ascending order."""
        if self._rows is None:
            self._rows = [torch.nonzero(row).flatten().tolist() for row in self.any]
        return self._rows[qb]

    def needs(self, term: str, qb: int, kb: int) -> bool:
        """Must ``term`` be evaluated on this tile (it is not full there)?"""
        full = self.term_full.get(term)
        return full is not None and not bool(full[qb, kb])


def choose_tiles(spec: AttentionSpec, budget: Optional[int] = None) -> Tuple[int, int]:
    """Tile sizes: a BlockMask's own blocks; otherwise key tiles of up to 512 and query tiles
    that keep one score tile within ``budget`` elements."""
    if spec.block_mask is not None:
        return spec.block_mask.BLOCK_SIZE  # (always a pair: attnkit's BlockMask normalises it)
    budget = TILE_ELEMENTS if budget is None else budget
    lq, lk = max(spec.lq, 1), max(spec.lk, 1)
    bk = min(lk, MAX_KEY_TILE)
    rows = max(1, spec.n * spec.hq)
    bq = max(1, budget // (rows * bk))
    if spec.has_band:  # smaller query tiles skip more of a band
        bq = min(bq, 256)
    return min(lq, bq), bk


def _block_starts(length: int, block: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    nb = max(1, math.ceil(length / block))
    start = torch.arange(nb, device=device) * block
    end = torch.clamp(start + block, max=length)
    return start, end


def _row_min_max(x: Tensor, block: int) -> Tuple[Tensor, Tensor]:
    """Per-block min and max of the last dim of ``x`` (..., L) -> (..., nblocks)."""
    length = x.shape[-1]
    pad = (-length) % block
    lo = torch.nn.functional.pad(x, (0, pad), value=int(x.max()) if pad else 0)
    hi = torch.nn.functional.pad(x, (0, pad), value=int(x.min()) if pad else 0)
    lo = lo.view(*x.shape[:-1], -1, block).amin(-1)
    hi = hi.view(*x.shape[:-1], -1, block).amax(-1)
    return lo, hi


def _band_status(spec: AttentionSpec, bq: int, ks: Tensor, ke: Tensor):
    ip = spec.aligned_rows().reshape(-1, spec.lq)  # (N|1, Lq)
    ip_min, ip_max = _row_min_max(ip, bq)  # (N|1, nqb)
    # d = j - i' over a tile lies in [dmin, dmax]; visible when -left <= d <= right
    dmin = ks.view(1, 1, -1) - ip_max.unsqueeze(-1)
    dmax = ke.view(1, 1, -1) - 1 - ip_min.unsqueeze(-1)
    any_ = torch.ones_like(dmin, dtype=torch.bool)
    full = torch.ones_like(dmin, dtype=torch.bool)
    if spec.left is not None:
        any_ &= dmax >= -spec.left
        full &= dmin >= -spec.left
    if spec.right is not None:
        any_ &= dmin <= spec.right
        full &= dmax <= spec.right
    return any_.any(0), full.all(0)


def _segment_status(spec: AttentionSpec, bq: int, bk: int):
    """Segments (ids shared by the batch, or one row of ids per batch row): a tile may hold a
    visible pair where its query and key id ranges overlap, and is full where one id covers
    both (in every batch row)."""
    qmin, qmax = _row_min_max(spec.segments_q.reshape(-1, spec.lq), bq)  # (N|1, nqb)
    kmin, kmax = _row_min_max(spec.segments_kv.reshape(-1, spec.lk), bk)  # (N|1, nkb)
    qmin, qmax = qmin.unsqueeze(-1), qmax.unsqueeze(-1)
    kmin, kmax = kmin.unsqueeze(-2), kmax.unsqueeze(-2)
    any_ = (qmin <= kmax) & (kmin <= qmax)
    full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
    return any_.any(0), full.all(0)


def _seqlens_status(spec: AttentionSpec, qs: Tensor, qe: Tensor, ks: Tensor, ke: Tensor):
    """Padding: row b's queries [0, seqlens_q[b]) and keys [starts_kv[b], seqlens_kv[b])."""
    n = spec.n
    sq = spec.seqlens_q if spec.seqlens_q is not None else torch.full(
        (n,), spec.lq, device=qs.device)
    sk = spec.seqlens_kv if spec.seqlens_kv is not None else torch.full(
        (n,), spec.lk, device=qs.device)
    sq, sk = sq.view(-1, 1, 1), sk.view(-1, 1, 1)
    any_ = (qs.view(1, -1, 1) < sq) & (ks.view(1, 1, -1) < sk)
    full = (qe.view(1, -1, 1) <= sq) & (ke.view(1, 1, -1) <= sk)
    if spec.starts_kv is not None:  # blocks wholly before a row's start are empty for it
        st = spec.starts_kv.view(-1, 1, 1)
        any_ = any_ & (ke.view(1, 1, -1) > st)
        full = full & (ks.view(1, 1, -1) >= st)
    return any_.any(0), full.all(0)


def _block_reduce(x: Tensor, bq: int, bk: int, fill: bool, op: str) -> Tensor:
    """Reduce a (Lq', Lk') bool matrix by (bq, bk) blocks with any/all; a dim of size 1 is
    broadcast (its status is the same for every block)."""
    lq, lk = x.shape
    pq = (-lq) % bq if lq > 1 else 0
    pk = (-lk) % bk if lk > 1 else 0
    if pq or pk:
        x = torch.nn.functional.pad(x, (0, pk, 0, pq), value=fill)
    rq = bq if lq > 1 else 1
    rk = bk if lk > 1 else 1
    x = x.view(x.shape[0] // rq, rq, x.shape[1] // rk, rk)
    return x.any(3).any(1) if op == "any" else x.all(3).all(1)


def _mask_status(spec: AttentionSpec, bq: int, bk: int, nqb: int, nkb: int):
    m = spec.mask
    flat_any = m.flatten(0, 1).any(0)
    flat_all = m.flatten(0, 1).all(0)
    any_ = _block_reduce(flat_any, bq, bk, False, "any").expand(nqb, nkb)
    full = _block_reduce(flat_all, bq, bk, True, "all").expand(nqb, nkb)
    return any_, full


def _block_mask_status(spec: AttentionSpec, nqb: int, nkb: int):
    kinds = spec.block_mask.block_kinds().flatten(0, 1)[:, :nqb, :nkb]  # (B|1 * H|1, nqb, nkb)
    listed, full = kinds > 0, kinds == 2  # 0 empty, 1 partial, 2 full
    return listed.any(0), full.all(0), listed, full


def make_plan(spec: AttentionSpec, bq: Optional[int] = None, bk: Optional[int] = None) -> Plan:
    """Build the tile plan for ``spec`` (tile sizes from :func:`choose_tiles` unless given)."""
    if bq is None or bk is None:
        bq0, bk0 = choose_tiles(spec)
        bq, bk = bq or bq0, bk or bk0
    dev = spec.q.device
    qs, qe = _block_starts(spec.lq, bq, dev)
    ks, ke = _block_starts(spec.lk, bk, dev)
    nqb, nkb = qs.numel(), ks.numel()
    any_ = torch.ones(nqb, nkb, dtype=torch.bool, device=dev)
    term_full: Dict[str, Tensor] = {}
    block_tiles = None
    if spec.lq == 0 or spec.lk == 0:  # nothing to attend: every tile is empty
        any_.zero_()
        return Plan(bq=bq, bk=bk, lq=spec.lq, lk=spec.lk, any=any_.cpu())
    if spec.has_band:
        a, f = _band_status(spec, bq, ks, ke)
        any_ &= a
        term_full["band"] = f
    if (spec.seqlens_q is not None or spec.seqlens_kv is not None
            or spec.starts_kv is not None):
        a, f = _seqlens_status(spec, qs, qe, ks, ke)
        any_ &= a
        term_full["seqlens"] = f
    if spec.segments_q is not None:
        a, f = _segment_status(spec, bq, bk)
        any_ &= a
        term_full["segments"] = f
    if spec.mask is not None:
        a, f = _mask_status(spec, bq, bk, nqb, nkb)
        any_ &= a
        term_full["mask"] = f
    if spec.block_mask is not None:
        a, f, listed, full = _block_mask_status(spec, nqb, nkb)
        any_ &= a
        term_full["block_mask"] = f
        block_tiles = (listed.cpu(), full.cpu())
    cache: Dict[Tuple[int, int], Tensor] = {}
    if spec.mask_mod is not None:
        a, f = _mask_mod_status(spec, bq, bk, nqb, nkb, any_, cache)
        any_ &= a
        term_full["mask_mod"] = f
    return Plan(bq=bq, bk=bk, lq=spec.lq, lk=spec.lk, any=any_.cpu(),
                term_full={k: v.cpu() for k, v in term_full.items()}, vis_cache=cache,
                block_tiles=block_tiles)


#: Bytes of partial mask_mod tiles a plan keeps (beyond that they are evaluated again).
VIS_CACHE_BYTES = 1 << 28


def _mask_mod_status(spec: AttentionSpec, bq: int, bk: int, nqb: int, nkb: int,
                     live: Tensor, cache: Dict[Tuple[int, int], Tensor]):
    """Evaluate the mask_mod once per query block row (only on key blocks other terms leave
    alive) to classify tiles; keep the partial tiles for the executor."""
    any_ = torch.zeros(nqb, nkb, dtype=torch.bool)
    full = torch.zeros(nqb, nkb, dtype=torch.bool)
    used = 0
    for qb in range(nqb):
        kbs = torch.nonzero(live[qb]).flatten().tolist()
        if not kbs:
            continue
        q0, q1 = qb * bq, min(spec.lq, (qb + 1) * bq)
        k_lo, k_hi = kbs[0] * bk, min(spec.lk, (kbs[-1] + 1) * bk)
        row = call_mask_mod(spec.mask_mod, *index_grid(spec, q0, q1, k_lo, k_hi))
        row = row.expand(*row.shape[:-2], q1 - q0, k_hi - k_lo)  # results may broadcast
        for kb in kbs:
            c0, c1 = kb * bk - k_lo, min(spec.lk, (kb + 1) * bk) - k_lo
            tile = row[..., c0:c1]
            a, f = bool(tile.any()), bool(tile.all())
            any_[qb, kb], full[qb, kb] = a, f
            if a and not f and used < VIS_CACHE_BYTES:
                tile = tile.clone()
                cache[(qb, kb)] = tile
                used += tile.numel()
    return any_, full


ANALYTIC_TERMS = ("band", "seqlens", "segments", "mask")


def range_visibility(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int,
                     terms: Sequence[str]) -> Optional[Tensor]:
    """The analytic terms (band, padding: seqlens and starts_kv, segments, mask tensor) among
    ``terms`` on queries [q0, q1) and keys [k0, k1): bool broadcastable to
    (N, Hq, q1-q0, k1-k0), or None."""
    vis: Optional[Tensor] = None

    def both(x: Tensor) -> None:
        nonlocal vis
        vis = x if vis is None else vis & x

    _, _, i, j = index_grid(spec, q0, q1, k0, k1)
    if "band" in terms:
        ip = spec.aligned_rows(q0, q1)
        if spec.left is not None:
            both(j >= ip - spec.left)
        if spec.right is not None:
            both(j <= ip + spec.right)
    if "seqlens" in terms:
        if spec.seqlens_q is not None:
            both(i < spec.seqlens_q.view(-1, 1, 1, 1))
        if spec.seqlens_kv is not None:
            both(j < spec.seqlens_kv.view(-1, 1, 1, 1))
        if spec.starts_kv is not None:
            both(j >= spec.starts_kv.view(-1, 1, 1, 1))
    if "segments" in terms:  # (ids (L,) shared by the batch, or (N, L))
        both(spec.segments_q[..., q0:q1].reshape(-1, 1, q1 - q0, 1)
             == spec.segments_kv[..., k0:k1].reshape(-1, 1, 1, k1 - k0))
    if "mask" in terms:
        both(slice_tile(spec.mask, q0, q1, k0, k1))
    return vis


def tile_visibility(spec: AttentionSpec, plan: Plan, qb: int, kb: int) -> Optional[Tensor]:
    """Bool tile broadcastable to (N, Hq, bq, bk), or None when every pair is visible."""
    q0, q1 = plan.q_range(qb)
    k0, k1 = plan.k_range(kb)
    dev = spec.q.device
    vis = range_visibility(spec, q0, q1, k0, k1,
                           [t for t in ANALYTIC_TERMS if plan.needs(t, qb, kb)])

    def both(x: Tensor) -> None:
        nonlocal vis
        vis = x if vis is None else vis & x

    b, h, i, j = index_grid(spec, q0, q1, k0, k1)
    if plan.needs("block_mask", qb, kb):
        listed = plan.block_tiles[0][:, qb, kb].to(dev)
        full = plan.block_tiles[1][:, qb, kb].to(dev)
        nb, nh = spec.block_mask.kv_num_blocks.shape[:2]
        listed = listed.view(nb, nh, 1, 1)
        full = full.view(nb, nh, 1, 1)
        if bool((listed & ~full).any()):
            both(listed & (full | call_mask_mod(spec.block_mask.mask_mod, b, h, i, j)))
        else:
            both(listed)
    if plan.needs("mask_mod", qb, kb):
        cached = plan.vis_cache.get((qb, kb))
        if cached is None:
            cached = call_mask_mod(spec.mask_mod, b, h, i, j)
        both(cached)
    return vis
