"""Inputs of one (case, dtype) and the dense pieces the dense peers and the checks share.

Every peer gets the very same ``q, k, v`` (seeded float32 draws, rounded to the dtype), the
same ``g`` (the fixed gradient of the output for ``fwd+bwd``), the same ALiBi slopes and the
same relative-bias table. The dense helpers here spell the case out in full ``(Lq, Lk)``
tensors: the naive peer runs on them, torch SDPA gets its masks and biases from them, and the
row-slice reference for large cases is built with them (see :mod:`attnkit.bench.accuracy`).

Score pipeline, the same as :func:`attnkit.attention` (``i' = i + offset``, the aligned row)::

    s = scale * q_i . k_j
    s = cap * tanh(s / cap)                    softcap
    s = s - slope[h] * |i' - j|                ALiBi
    s = s + table[h, j - i + M - 1]            relative bias, M = max(Lq, Lk)
    s = -inf where (i, j) is not visible
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from .cases import Case
from .flops import dense_visibility

DTYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16, "float64": torch.float64}


def dtype_of(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32`` (also ``"bf16"``, ``"fp32"``)."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


def standard_alibi_slopes(heads: int) -> Tensor:
    """``2 ** (-8 * (h + 1) / H)``, float32 ``(H,)`` (the standard slopes for H a power of 2)."""
    h = torch.arange(1, heads + 1, dtype=torch.float64)
    return torch.pow(2.0, -8.0 * h / heads).to(torch.float32)


@dataclass
class Workload:
    """The inputs of one (case, dtype); ``cache`` keeps prepared masks shared by peers."""

    case: Case
    dtype: torch.dtype
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    slopes: Optional[Tensor] = None
    table: Optional[Tensor] = None
    cache: Dict[str, Any] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """``1 / sqrt(d_qk)``."""
        return 1.0 / math.sqrt(self.case.d_qk)

    def cached(self, key: str, build: Any) -> Any:
        """``cache[key]``, built by ``build()`` on first use."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def visible(self) -> Tensor:
        """Dense bool ``(Lq, Lk)`` mask of the case (cached)."""
        return self.cached("visible", lambda: dense_visibility(self.case))

    def release(self) -> None:
        """Drop cached masks (they can be large)."""
        self.cache.clear()


def make_workload(case: Case, dtype: torch.dtype) -> Workload:
    """Seeded inputs for ``case`` in ``dtype``."""
    gen = torch.Generator().manual_seed(case.seed)

    def draw(*shape: int, std: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def rows(b: int, h: int, length: int, d: int) -> Tensor:
        if case.layout == "blhd":
            return draw(b, length, h, d).transpose(1, 2)
        return draw(b, h, length, d)

    b, hq, hkv = case.batch, case.heads_q, case.hkv
    q = rows(b, hq, case.len_q, case.d_qk)
    k = rows(b, hkv, case.lk, case.d_qk)
    v = rows(b, hkv, case.lk, case.dv)
    g = rows(b, hq, case.len_q, case.dv)
    slopes = standard_alibi_slopes(hq) if case.alibi else None
    table = None
    if case.relative_bias:
        table = torch.randn(hq, 2 * case.max_distance - 1, generator=gen) * 0.5
    return Workload(case, dtype, q, k, v, g, slopes=slopes, table=table)


def _positions(case: Case, rows: slice) -> tuple:
    i = torch.arange(case.len_q, dtype=torch.int64)[rows].view(-1, 1)
    j = torch.arange(case.lk, dtype=torch.int64).view(1, -1)
    return i, j


def alibi_bias(case: Case, slopes: Tensor, rows: slice = slice(None)) -> Tensor:
    """float32 ``(Hq, rows, Lk)``: ``-slope[h] * |i + offset - j|``."""
    i, j = _positions(case, rows)
    dist = (i + case.offset - j).abs().to(torch.float32)
    return -slopes.to(torch.float32).view(-1, 1, 1) * dist


def relative_index(case: Case, rows: slice = slice(None)) -> Tensor:
    """int64 ``(rows, Lk)``: ``clamp(j - i, -(M-1), M-1) + M - 1``, the table column of a pair."""
    i, j = _positions(case, rows)
    m = case.max_distance
    return (j - i).clamp(-(m - 1), m - 1) + (m - 1)


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    visible: Tensor,
    softcap: Optional[float] = None,
    bias: Optional[Tensor] = None,
    table: Optional[Tensor] = None,
    table_index: Optional[Tensor] = None,
) -> Tensor:
    """Textbook attention: materialise the scores, in the dtype of ``q``.

    ``visible`` is bool broadcastable to ``(B, Hq, Lq, Lk)``; ``bias`` an additive float
    tensor broadcastable to it (ALiBi); ``table[:, table_index]`` an additive ``(Hq, Lq, Lk)``
    relative bias computed here (so it gets a gradient). Fully masked rows give NaN, as
    textbook attention does (no case in the catalog has one).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    if table is not None and table_index is not None:
        s = s + table[:, table_index].to(s.dtype)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v
