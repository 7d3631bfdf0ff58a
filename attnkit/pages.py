"""The paged K/V layout (FlashAttention / vLLM block tables): validation and the gather.

``k_pages (num_pages, page_size, Hkv, Dqk)``, ``v_pages (num_pages, page_size, Hkv, Dv)``,
``block_table (B, max_pages)`` and ``seqlens (B,)``: token ``t`` of sequence ``b`` sits at
``(block_table[b, t // page_size], t % page_size)``. :mod:`attnkit.paged` builds caches and
front doors on this; the decode executor reads pages in place or, without its kernel, gathers.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["gather_kv"]


def _index_tensor(name: str, x: Any, pages: Any, dtype: torch.dtype) -> Any:
    """A block table or lengths given as a list, as a tensor on the pages' device (tensors
    are returned as they are; :func:`_check_pages` checks them)."""
    if isinstance(x, Tensor) or not isinstance(pages, Tensor):
        return x
    try:
        return torch.as_tensor(x, dtype=dtype, device=pages.device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name} must be an integer tensor or a (nested) list of ints; got "
                        f"{type(x).__name__}") from err


def _check_pages(k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                 seqlens: Tensor) -> Tensor:
    """Validate paged K/V, a block table and lengths; return the lengths as int64. Every page
    a sequence uses (the first ``ceil(seqlens[b] / page_size)`` entries of its row) must be a
    page index; the rest of the row is padding and ignored."""
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor (num_pages, page_size, Hkv, D), got "
                f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    N, P, Hkv = k_pages.shape[:3]
    if P == 0:
        raise ValueError("k_pages has page_size 0 (dim 1); pages must hold at least one token")
    if tuple(v_pages.shape[:3]) != (N, P, Hkv):
        raise ValueError(
            f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} must agree in "
            f"(num_pages, page_size, Hkv)")
    device = k_pages.device
    for name, x, nd in (("block_table", block_table, 2), ("seqlens", seqlens, 1)):
        if not isinstance(x, Tensor) or x.dim() != nd:
            raise ValueError(f"{name} must be a {nd}-D integer tensor, got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype (int32), got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but the pages are on {device}")
    if v_pages.device != device:
        raise ValueError(f"v_pages is on {v_pages.device} but k_pages is on {device}")
    B, width = block_table.shape
    if seqlens.shape[0] != B:
        raise ValueError(
            f"block_table has {B} rows but seqlens has {seqlens.shape[0]} entries; "
            f"one length per sequence")
    lens = seqlens.long()
    if B:
        lo, hi = (int(t) for t in torch.aminmax(lens))
        if lo < 0 or hi > width * P:
            raise ValueError(
                f"seqlens must lie in [0, max_pages * page_size] = [0, {width * P}], got values "
                f"in [{lo}, {hi}]; the block table has too few columns for these lengths")
    used = torch.arange(width, device=device) < (-(-lens // P))[:, None]
    bad = used & ((block_table < 0) | (block_table >= N))
    if bool(bad.any()):
        b, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {col}] = {int(block_table[b, col])} is not a page index in "
            f"[0, {N}) but sequence {b} (length {int(lens[b])}) uses it for tokens "
            f"{col * P}..{min(int(lens[b]), (col + 1) * P) - 1}")
    return lens


def gather_kv(
    k_pages: Tensor,
    v_pages: Tensor,
    block_table: Tensor,
    seqlens: Tensor,
    max_seqlen: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Copy paged keys/values into contiguous, zero-padded per-sequence tensors.

    Args:
        k_pages: ``(num_pages, page_size, Hkv, Dqk)``.
        v_pages: ``(num_pages, page_size, Hkv, Dv)``.
        block_table: integer ``(B, max_pages)``; entries a sequence uses must lie in
            ``[0, num_pages)``, the rest (padding, 0 or -1) are ignored.
        seqlens: integer ``(B,)``, ``0 <= seqlens[b] <= max_pages * page_size``.
        max_seqlen: ``Lmax``; defaults to ``seqlens.max()`` (which synchronises a GPU).

    Returns:
        ``k (B, Hkv, Lmax, Dqk)`` and ``v (B, Hkv, Lmax, Dv)``, contiguous, zero past
        ``seqlens[b]``.
    """
    lens = _check_pages(k_pages, v_pages, block_table, seqlens)
    N, P, Hkv, Dk = k_pages.shape
    Dv = v_pages.shape[3]
    device = k_pages.device
    B, width = block_table.shape
    longest = int(lens.max()) if B else 0
    if max_seqlen is None:
        max_seqlen = longest
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be an int or None, got {type(max_seqlen).__name__}")
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest sequence "
                         f"({longest}); pass max_seqlen >= seqlens.max() or None")
    L = max_seqlen
    t = torch.arange(L, device=device)
    valid = t < lens[:, None]  # (B, L)
    page = block_table.long()[:, torch.clamp(t // P, max=max(width - 1, 0))] if width else \
        torch.zeros(B, L, dtype=torch.long, device=device)
    if N * P == 0:  # nothing to read (so every length is 0)
        return (torch.zeros(B, Hkv, L, Dk, dtype=k_pages.dtype, device=device),
                torch.zeros(B, Hkv, L, Dv, dtype=v_pages.dtype, device=device))

    slots = torch.where(valid, page * P + t % P, torch.zeros((), dtype=torch.long,
                                                              device=device)).reshape(-1)

    def take(pages: Tensor, D: int) -> Tensor:
        x = pages.reshape(N * P, Hkv, D).index_select(0, slots).view(B, L, Hkv, D)
        x.masked_fill_(~valid[:, :, None, None], 0)
        return x.transpose(1, 2).contiguous()

    return take(k_pages, Dk), take(v_pages, Dv)
