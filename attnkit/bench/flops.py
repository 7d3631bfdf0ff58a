"""FLOP counting: only visible (unmasked) (query, key) pairs count.

Formulas (ANCHORS.md, the ones every attention benchmark uses)::

    forward   4 * B * Hq * Lq * Lk_visible * d            (d_qk == d_v == d)
              2 * B * Hq * Lq * Lk_visible * (d_qk + d_v)  (in general; the same when equal)
    backward  2.5 * forward, so a ``fwd+bwd`` call counts 3.5 * forward

where ``Lq * Lk_visible`` is the number of visible pairs of one (batch, head). Every mask in
the catalog leaves each query row one contiguous range of visible keys, ``lo[i] <= j <= hi[i]``
(causal and windows bound it by the aligned diagonal, a document by its own start and end,
prefix-LM by ``max(i, prefix - 1)``), so the count is exact and costs O(Lq), even at L = 64k.
:func:`count_dense` counts a dense bool mask instead, for masks that are not ranges and for
checking the analytic count.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Tuple

import numpy as np
import torch

from .cases import Case

BACKWARD_FACTOR = 2.5
"""Backward FLOPs as a multiple of forward FLOPs."""


def row_bounds(case: Case) -> Tuple[np.ndarray, np.ndarray]:
    """Per query row ``i``: the first and last visible key, ``(lo, hi)`` int64 ``(Lq,)``.

    A row with ``hi < lo`` sees nothing.
    """
    lq, lk = case.len_q, case.lk
    i = np.arange(lq, dtype=np.int64)
    ip = i + case.offset  # aligned query position
    lo = np.zeros(lq, dtype=np.int64)
    hi = np.full(lq, lk - 1, dtype=np.int64)
    if case.causal:
        hi = np.minimum(hi, ip)
    if case.window is not None:
        left, right = case.window
        if left is not None:
            lo = np.maximum(lo, ip - left)
        if right is not None:
            hi = np.minimum(hi, ip + right)
    if case.documents:
        lengths = np.asarray(case.doc_lengths(), dtype=np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        doc = np.searchsorted(ends, i, side="right")
        lo = np.maximum(lo, starts[doc])
        hi = np.minimum(hi, ends[doc] - 1)
    if case.prefix:
        hi = np.minimum(np.maximum(i, case.prefix - 1), lk - 1)
    return lo, hi


def visible_per_head(case: Case) -> int:
    """Visible pairs of one (batch, head): ``sum_i (hi[i] - lo[i] + 1)``, rows clipped at 0."""
    lo, hi = row_bounds(case)
    return int(np.maximum(hi - lo + 1, 0).sum())


def visible_pairs(case: Case) -> int:
    """Visible pairs over the whole call: ``B * Hq * visible_per_head``.

    A padded or varlen case (``seqlens``) counts each element's own problem: element ``b``
    is the case at ``Lq = Lk = seqlens[b]`` (causal: ``L_b (L_b + 1) / 2`` pairs), padding
    never counts.
    """
    lens = case.seqlens()
    if lens:
        return case.heads_q * sum(visible_per_head(_element(case, n)) for n in lens)
    return case.batch * case.heads_q * visible_per_head(case)


def _element(case: Case, length: int) -> Case:
    """One element of a padded batch as a case of its own (``batch=1``, length ``length``)."""
    extra = {k: v for k, v in case.extra.items() if k not in ("seqlens", "varlen")}
    return replace(case, name=f"{case.name}[{length}]", batch=1, len_q=length, len_kv=length,
                   extra=extra)


def padded_visibility(case: Case, rows: slice = slice(None)) -> torch.Tensor:
    """Bool ``(B, 1, rows, Lk)``: the case's mask AND ``key < seqlens[b]``.

    Query rows past ``seqlens[b]`` keep the keys of their element visible (no row is empty,
    so no NaN); their output is zeroed instead, as the padded peers do.
    """
    base = dense_visibility(case, rows)
    keys = torch.arange(case.lk).view(1, -1) < torch.tensor(case.seqlens()).view(-1, 1)
    return (base.unsqueeze(0) & keys.unsqueeze(1)).unsqueeze(1)


def padded_rows(case: Case, rows: slice = slice(None)) -> torch.Tensor:
    """Bool ``(B, 1, rows, 1)``: query rows that are real tokens."""
    i = torch.arange(case.len_q)[rows].view(1, -1)
    return (i < torch.tensor(case.seqlens()).view(-1, 1)).view(len(case.seqlens()), 1, -1, 1)


def dense_visibility(case: Case, rows: slice = slice(None)) -> torch.Tensor:
    """Bool ``(rows, Lk)``: the case's mask, built from :func:`row_bounds` (True = visible)."""
    lo, hi = row_bounds(case)
    lo_t = torch.from_numpy(lo[rows]).unsqueeze(1)
    hi_t = torch.from_numpy(hi[rows]).unsqueeze(1)
    j = torch.arange(case.lk, dtype=torch.int64).unsqueeze(0)
    return (j >= lo_t) & (j <= hi_t)


def count_dense(mask: torch.Tensor) -> int:
    """Number of True entries of a bool mask (any shape), counted in chunks."""
    flat = mask.reshape(-1)
    step = 1 << 26
    return int(sum(int(flat[s:s + step].sum()) for s in range(0, flat.numel(), step)))


def forward_flops(case: Case) -> float:
    """Forward FLOPs: ``2 * B * Hq * visible * (d_qk + d_v)`` (``= 4 * ... * d`` when equal)."""
    return 2.0 * visible_pairs(case) * (case.d_qk + case.dv)


def flops(case: Case, pass_: str) -> float:
    """FLOPs of one call of ``pass_``: ``"fwd"``, or ``"fwd+bwd"`` = 3.5 x forward."""
    fwd = forward_flops(case)
    if pass_ == "fwd":
        return fwd
    if pass_ == "fwd+bwd":
        return fwd * (1.0 + BACKWARD_FACTOR)
    raise ValueError(f"pass must be 'fwd' or 'fwd+bwd'; got {pass_!r}")
