"""The paged K/V layout (FlashAttention / vLLM block tables): validation and the gather.

``k_pages (num_pages, page_size, Hkv, Dqk)``, ``v_pages (num_pages, page_size, Hkv, Dv)``,
``block_table (B, max_pages)`` and ``seqlens (B,)``: token ``t`` of sequence ``b`` sits at
``(block_table[b, t // page_size], t % page_size)``. :mod:`attnkit.paged` builds caches and
front doors on this; the decode executor reads pages in place or, without its kernel, gathers.

fp8 pages (float8_e4m3fn / e5m2) come with descales ``k_descale``, ``v_descale`` of shape
``(num_pages, Hkv)``: the real value of ``k_pages[p, t, h]`` is ``k_pages[p, t, h] *
k_descale[p, h]`` (:func:`check_page_descales` also takes one per head or one per tensor).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["gather_kv", "check_page_descales"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_page_descales(k_pages: Tensor, v_pages: Tensor, k_descale: Any,
                        v_descale: Any) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The descales of fp8 pages as float32 ``(num_pages, Hkv)`` (given per (page, kv head),
    per kv head ``(Hkv,)`` or one number), or ``(None, None)`` for pages that are not fp8 (which
    take no descales)."""
    fp8 = [name for name, x in (("k_pages", k_pages), ("v_pages", v_pages)) if x.dtype in _FP8]
    if not fp8:
        for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
            if d is not None:
                raise ValueError(f"{name} is for fp8 pages; the pages are {k_pages.dtype}: drop "
                                 f"{name}")
        return None, None
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"k_pages and v_pages must share one dtype; got {k_pages.dtype} and "
                        f"{v_pages.dtype}")
    num_pages, _, hkv, _ = k_pages.shape
    out = []
    for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
        want = f"({num_pages}, {hkv}) (num_pages, Hkv), ({hkv},) (per kv head) or a float"
        if d is None:
            raise ValueError(f"fp8 pages need {name}: the real values are pages * {name}, "
                             f"{want}; a PagedKVCache with an fp8 dtype keeps them for you")
        if isinstance(d, bool) or not isinstance(d, (int, float, Tensor)):
            raise TypeError(f"{name} must be a float tensor of shape {want}; got "
                            f"{type(d).__name__}")
        d = torch.as_tensor(d, dtype=torch.float32, device=k_pages.device) if not isinstance(
            d, Tensor) else d
        if not d.dtype.is_floating_point or d.dtype in _FP8:
            raise TypeError(f"{name} must be a float32 tensor; got {d.dtype}")
        if d.device != k_pages.device:
            raise ValueError(f"{name} is on {d.device} but the pages are on {k_pages.device}")
        if d.dim() == 0 or tuple(d.shape) == (hkv,):
            d = d.reshape(1, -1).expand(num_pages, hkv)
        elif tuple(d.shape) != (num_pages, hkv):
            raise ValueError(f"{name} has shape {tuple(d.shape)}; expected {want}")
        out.append(d.to(torch.float32).contiguous())
    return out[0], out[1]


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
    # (on the host, as numpy arrays: a decoding step makes this call for every layer, and each
    # of torch's small operations costs several microseconds)
    if device.type == "cpu":
        _check_rows(block_table.numpy(), lens.numpy(), np.arange(width), N, P)
    else:
        _check_rows(block_table, lens, torch.arange(width, device=device), N, P)
    return lens


def _check_rows(table: Any, lens: Any, cols: Any, num_pages: int, page_size: int) -> None:
    """:func:`_check_pages`' checks of the lengths and of the pages they use, on a block table
    ``(B, width)``, int64 lengths ``(B,)`` and ``cols = arange(width)``, all torch tensors or
    all numpy arrays (the same operations and messages either way)."""
    B, width = table.shape
    if B:
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0 or hi > width * page_size:
            raise ValueError(
                f"seqlens must lie in [0, max_pages * page_size] = [0, {width * page_size}], "
                f"got values in [{lo}, {hi}]; the block table has too few columns for these "
                f"lengths")
    used = cols[None, :] < (-(-lens // page_size))[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    if bool(bad.any()):
        rows, columns = bad.nonzero(as_tuple=True) if isinstance(bad, Tensor) else bad.nonzero()
        b, col = int(rows[0]), int(columns[0])
        n = int(lens[b])
        raise ValueError(
            f"block_table[{b}, {col}] = {int(table[b, col])} is not a page index in "
            f"[0, {num_pages}) but sequence {b} (length {n}) uses it for tokens "
            f"{col * page_size}..{min(n, (col + 1) * page_size) - 1}")


def gather_kv(
    k_pages: Tensor,
    v_pages: Tensor,
    block_table: Tensor,
    seqlens: Tensor,
    max_seqlen: Optional[int] = None,
    k_descale: Any = None,
    v_descale: Any = None,
    dtype: Optional[torch.dtype] = None,
) -> Tuple[Tensor, Tensor]:
    """Copy paged keys/values into contiguous, zero-padded per-sequence tensors.

    Args:
        k_pages: ``(num_pages, page_size, Hkv, Dqk)``.
        v_pages: ``(num_pages, page_size, Hkv, Dv)``.
        block_table: integer ``(B, max_pages)``; entries a sequence uses must lie in
            ``[0, num_pages)``, the rest (padding, 0 or -1) are ignored.
        seqlens: integer ``(B,)``, ``0 <= seqlens[b] <= max_pages * page_size``.
        max_seqlen: ``Lmax``; defaults to ``seqlens.max()`` (which synchronises a GPU).
        k_descale, v_descale: for fp8 pages (required there): see
            :func:`check_page_descales`; the gathered values are dequantized.
        dtype: the dtype of the result (default: the pages', float32 for fp8 pages).

    Returns:
        ``k (B, Hkv, Lmax, Dqk)`` and ``v (B, Hkv, Lmax, Dv)``, contiguous, zero past
        ``seqlens[b]``.
    """
    lens = _check_pages(k_pages, v_pages, block_table, seqlens)
    kd, vd = check_page_descales(k_pages, v_pages, k_descale, v_descale)
    if dtype is None:
        dtype = torch.float32 if kd is not None else k_pages.dtype
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
        return (torch.zeros(B, Hkv, L, Dk, dtype=dtype, device=device),
                torch.zeros(B, Hkv, L, Dv, dtype=dtype, device=device))

    slots = torch.where(valid, page * P + t % P, torch.zeros((), dtype=torch.long,
                                                              device=device)).reshape(-1)

    def take(pages: Tensor, D: int, descale: Optional[Tensor]) -> Tensor:
        if descale is not None:  # fp8 (no fp8 index_select: bytes), x8 * descale[page, head]
            x = pages.view(torch.uint8).reshape(N * P, Hkv, D).index_select(0, slots)
            x = x.view(pages.dtype).view(B, L, Hkv, D).float()
            x = x * descale[torch.where(valid, page, 0)][..., None]
        else:
            x = pages.reshape(N * P, Hkv, D).index_select(0, slots).view(B, L, Hkv, D)
        x = x.to(dtype).masked_fill_(~valid[:, :, None, None], 0)
        return x.transpose(1, 2).contiguous()

    return take(k_pages, Dk, kd), take(v_pages, Dv, vd)
