"""Error checks, so that a fast wrong answer is visible next to its time.

* Small cases (``B*Hq*Lq*Lk <= FULL_REFERENCE_MAX_PAIRS``): the float64 oracle
  :func:`attnkit.attention_reference`, fed float64 copies of the inputs and the same keywords
  attnkit gets. ``max_err`` = max |out - ref| over the whole output; ``grad_err`` = max over
  the gradients of q, k, v (and the relative-bias table) of max |grad - ref grad|.
* Large cases: a float32 dense computation (:func:`attnkit.bench.workloads.dense_attention`)
  of the first ``REFERENCE_ROWS`` query rows only, which costs ``rows/Lq`` of the full one.
  ``max_err`` compares those output rows, ``grad_err`` the same rows of dq (row i of dq depends
  only on row i of the output gradient, so the slice is exact; dk and dv are not checked).

* Padded / varlen cases (``seqlens``): the same, with padding keys invisible and padding
  query rows 0 (what every peer returns for them).
* Dropout cases: peers draw different random masks, so outputs are not compared across
  peers. attnkit alone is checked: its keep mask (``return_aux=AuxRequest(dropout_mask=True)``,
  the same seed as the timed call) is fed to the float64 oracle
  (``attention_reference(..., dropout_keep=mask, dropout_p=p)``) for the first
  ``REFERENCE_ROWS`` query rows (output and dq). Other peers get no error figure.

Errors are absolute, in float64, of outputs in the run's dtype; bf16 results are expected
around 1e-2, float32 around 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .flops import dense_visibility, padded_rows, padded_visibility
from .workloads import Workload, alibi_bias, dense_attention, relative_index

FULL_REFERENCE_MAX_PAIRS = 1 << 23
REFERENCE_ROWS = 256
GRAD_NAMES = ("q", "k", "v", "table")


@dataclass
class Reference:
    """Reference output (and gradients) of one workload."""

    kind: str  # "float64" or "float32-rows"
    rows: slice
    out: Tensor
    grads: Optional[Dict[str, Tensor]] = None

    @property
    def label(self) -> str:
        """Short description for notes and the JSON."""
        if self.kind == "float64":
            return "vs float64 reference"
        if self.kind == "dropout-rows":
            return f"vs float64 reference with attnkit's keep mask, first {self.rows.stop} rows"
        return f"vs float32 dense, first {self.rows.stop} rows"


def reference(w: Workload, with_grads: bool) -> Reference:
    """The reference for ``w``: float64 oracle when small, float32 row slice when large."""
    if "dropout_p" in w.case.extra:
        return _dropout_reference(w, with_grads)
    if w.case.pairs <= FULL_REFERENCE_MAX_PAIRS:
        return _full_reference(w, with_grads)
    return _rows_reference(w, with_grads)


def _full_reference(w: Workload, with_grads: bool) -> Reference:
    from attnkit import attention_reference

    from .peers import attnkit_kwargs

    leaves = [x.detach().double().requires_grad_(with_grads) for x in (w.q, w.k, w.v)]
    table = None
    if w.table is not None:
        table = w.table.detach().double().requires_grad_(with_grads)
        leaves.append(table)
    slopes = w.slopes.double() if w.slopes is not None else None
    with torch.set_grad_enabled(with_grads):
        out = attention_reference(leaves[0], leaves[1], leaves[2],
                                  **attnkit_kwargs(w, table, slopes=slopes))
        grads = None
        if with_grads:
            gs = torch.autograd.grad(out, leaves, w.g.double())
            grads = dict(zip(GRAD_NAMES, (g.detach() for g in gs)))
    return Reference("float64", slice(None), out.detach(), grads)


def _dropout_reference(w: Workload, with_grads: bool) -> Reference:
    """attnkit's own keep mask through the float64 oracle, first ``REFERENCE_ROWS`` rows."""
    import attnkit
    from attnkit import attention_reference

    from .peers import attnkit_kwargs

    c = w.case
    p = float(c.extra["dropout_p"])
    kw = attnkit_kwargs(w, w.table)
    with torch.no_grad():
        _, aux = attnkit.attention(w.q, w.k, w.v, dropout_p=p, seed=c.seed,
                                   return_aux=attnkit.AuxRequest(dropout_mask=True), **kw)
    rows = slice(0, min(REFERENCE_ROWS, c.len_q))
    keep = aux.dropout_mask[:, :, rows]
    del aux
    q = w.q[:, :, rows].double().requires_grad_(with_grads)
    with torch.set_grad_enabled(with_grads):
        out = attention_reference(q, w.k.double(), w.v.double(), dropout_keep=keep,
                                  dropout_p=p, **kw)
        grads = None
        if with_grads:
            (dq,) = torch.autograd.grad(out, [q], w.g[:, :, rows].double())
            grads = {"q": dq.detach()}
    return Reference("dropout-rows", rows, out.detach(), grads)


def _rows_reference(w: Workload, with_grads: bool) -> Reference:
    c = w.case
    rows = slice(0, min(REFERENCE_ROWS, c.len_q))
    q = w.q[:, :, rows].float().requires_grad_(with_grads)
    bias = alibi_bias(c, w.slopes, rows) if c.alibi else None
    index = relative_index(c, rows) if c.relative_bias else None
    padded = bool(c.seqlens())
    vis = padded_visibility(c, rows) if padded else dense_visibility(c, rows)
    with torch.set_grad_enabled(with_grads):
        out = dense_attention(q, w.k.float(), w.v.float(), scale=w.scale,
                              visible=vis, softcap=c.softcap, bias=bias,
                              table=w.table, table_index=index)
        if padded:
            out = out.masked_fill(~padded_rows(c, rows), 0.0)
        grads = None
        if with_grads:
            (dq,) = torch.autograd.grad(out, [q], w.g[:, :, rows].float())
            grads = {"q": dq.detach()}
    return Reference("float32-rows", rows, out.detach(), grads)


def _max_abs(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def errors(ref: Reference, out: Tensor,
           grads: Optional[Sequence[Tensor]] = None) -> Tuple[float, Optional[float]]:
    """``(max_err, grad_err)`` of a peer's output (and gradients, in ``GRAD_NAMES`` order).

    Non-finite values give ``inf``.
    """
    out_rows = out[:, :, ref.rows]
    max_err = _max_abs(out_rows, ref.out) if bool(torch.isfinite(out_rows).all()) else float("inf")
    grad_err = None
    if grads is not None and ref.grads is not None:
        worst = 0.0
        for name, g in zip(GRAD_NAMES, grads):
            if name not in ref.grads or g is None:
                continue
            g = g[:, :, ref.rows] if name == "q" else g
            if not bool(torch.isfinite(g).all()):
                worst = float("inf")
                break
            worst = max(worst, _max_abs(g, ref.grads[name]))
        grad_err = worst
    return max_err, grad_err
