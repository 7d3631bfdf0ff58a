"""BlockMask: which (query block, key block) tiles of a mask_mod need work.

A drop-in for ``torch.nn.attention.flex_attention.BlockMask`` / ``create_block_mask``: same
fields, same int32 index layout and ordering, same classification, so the two can be
compared field by field. Shape legend::

    B, H         batch and head dims of the mask (1 = broadcast over that dim)
    NQ = ceil(Q_LEN / BLOCK_SIZE[0])      query-block rows
    NK = ceil(KV_LEN / BLOCK_SIZE[1])     key-block columns

    kv_num_blocks       (B, H, NQ)       int32  partial blocks per query-block row
    kv_indices          (B, H, NQ, NK)   int32  their column ids first (ascending), then the
                                                other columns (ascending) as padding
    full_kv_num_blocks  (B, H, NQ)       int32  the same for full blocks (or None)
    full_kv_indices     (B, H, NQ, NK)   int32
    q_num_blocks, q_indices, full_q_*    the transpose: (B, H, NK) and (B, H, NK, NQ)

Each tile is classified from the mask_mod: no visible pair -> skipped (in no list); every
pair visible -> full (``full_kv_*``, the executor may skip calling the mask_mod); otherwise
partial (``kv_*``). Positions past ``Q_LEN``/``KV_LEN`` count as hidden, exactly as in torch,
so a tile cut by the sequence end is never full::

    causal, Q_LEN = 300, KV_LEN = 517, BLOCK_SIZE = 128 (F full, P partial, . skipped)

            kv 0-127  128-255  256-383  384-511  512-516
    q 0-127     P        .        .        .        .
    q 128-255   F        P        .        .        .
    q 256-299   P        P        P        .        .

:func:`create_block_mask` never materialises ``Q_LEN x KV_LEN``: builtin band-shaped masks
(causal, sliding windows and ``and_masks`` of them, prefix-LM) are classified analytically from
their structure hint, any other mask_mod is evaluated a chunk of block rows at a time
(about 16M positions per call) and reduced to per-tile any/all.

For executors: :meth:`BlockMask.kv_blocks_for` gives the partial and full key blocks of one
(batch, head, query block); :meth:`BlockMask.block_kinds` gives the whole
``(B, H, NQ, NK)`` table of :data:`BLOCK_EMPTY` / :data:`BLOCK_PARTIAL` / :data:`BLOCK_FULL`.
"""

from __future__ import annotations

import inspect
import itertools
import math
import numbers
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from .checks import check_int
from .masks import MaskMod, noop_mask, structure_of

__all__ = [
    "BLOCK_EMPTY",
    "BLOCK_FULL",
    "BLOCK_PARTIAL",
    "BlockMask",
    "create_block_mask",
]

BLOCK_EMPTY = 0
"""Value in :meth:`BlockMask.block_kinds` for a tile with no visible pair (skip it)."""
BLOCK_PARTIAL = 1
"""Value in :meth:`BlockMask.block_kinds` for a tile that needs the mask_mod applied."""
BLOCK_FULL = 2
"""Value in :meth:`BlockMask.block_kinds` for a tile whose pairs are all visible."""

_DEFAULT_BLOCK_SIZE = 128
# Positions evaluated per mask_mod call when classifying by evaluation (bool bytes; a
# mask_mod's int64 temporaries are 8x that).
_CHUNK_ELEMENTS = 1 << 24
# 8 bools packed into one int64, all True.
_ALL_TRUE_WORD = int.from_bytes(b"\x01" * 8, "little")

BlockSizeArg = Union[int, Tuple[int, int]]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- validation


def _normalize_block_size(block_size: Any) -> tuple[int, int]:
    fix = "Pass an int (e.g. 128) or a (Q_BLOCK_SIZE, KV_BLOCK_SIZE) tuple."
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"BLOCK_SIZE must have 2 entries, got {block_size!r}. {fix}")
        return (check_int("BLOCK_SIZE[0]", block_size[0], 1, fix=fix),
                check_int("BLOCK_SIZE[1]", block_size[1], 1, fix=fix))
    size = check_int("BLOCK_SIZE", block_size, 1, fix=fix)
    return (size, size)


def _check_mask_mod(mask_mod: Any) -> None:
    if not callable(mask_mod):
        raise TypeError(
            f"mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool tensor, got "
            f"{type(mask_mod).__name__}.")
    try:
        params = inspect.signature(mask_mod).parameters.values()
    except (TypeError, ValueError):
        return
    required = [p for p in params
                if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) == 5:
        raise TypeError(
            f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!r} takes 5 arguments, like a "
            "score_mod (score, b, h, q_idx, kv_idx); create_block_mask needs a mask_mod "
            "(b, h, q_idx, kv_idx) -> bool. Pass the score_mod to attention() instead.")


# --------------------------------------------------------------------------- ordered layout


def _ordered_to_dense(num_blocks: Tensor, indices: Tensor, num_cols: int) -> Tensor:
    """(…, R) counts + (…, R, C) column ids -> bool (…, R, num_cols)."""
    cols = torch.arange(indices.shape[-1], device=indices.device)
    valid = cols < num_blocks.unsqueeze(-1).to(torch.int64)
    # Invalid entries write to an extra column that is dropped afterwards.
    target = torch.where(valid, indices.to(torch.int64), num_cols)
    dense = torch.zeros(*indices.shape[:-1], num_cols + 1, dtype=torch.bool,
                        device=indices.device)
    dense.scatter_(-1, target, True)
    return dense[..., :num_cols]


def _dense_to_ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """bool (…, R, C) -> int32 counts (…, R) and int32 ids (…, R, C).

    The ids list the True columns ascending, then the False columns ascending (torch's
    stable descending argsort of the 0/1 matrix).
    """
    num = dense.sum(dim=-1, dtype=torch.int32)
    order = torch.sort((~dense).to(torch.int8), dim=-1, stable=True).indices
    return num.contiguous(), order.to(torch.int32).contiguous()


def _transpose_ordered(num_blocks: Tensor, indices: Tensor,
                       num_cols: int) -> tuple[Tensor, Tensor]:
    dense = _ordered_to_dense(num_blocks, indices, num_cols)
    return _dense_to_ordered(dense.transpose(-2, -1))


# --------------------------------------------------------------------------- BlockMask


def _sliced_mask_mod_error(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    raise RuntimeError(
        "This BlockMask was indexed along the query-block dimension, so its mask_mod no "
        "longer matches the positions; rebuild it with create_block_mask for the new shape.")


class _RemappedMaskMod:
    """mask_mod seen through a batch/head selection: new index i means old index map[i].

    A class rather than a closure so that a sliced BlockMask pickles whenever the original
    mask_mod does."""

    def __init__(self, mask_mod: MaskMod, b_map: Tensor, h_map: Tensor) -> None:
        self.mask_mod = mask_mod
        self.b_map = b_map
        self.h_map = h_map
        self.__name__ = getattr(mask_mod, "__name__", "mask_mod")

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.mask_mod(self.b_map.to(b.device)[b], self.h_map.to(h.device)[h], q_idx,
                             kv_idx)

    def __repr__(self) -> str:
        return (f"{self.__name__} (batch {self.b_map.tolist()}, heads {self.h_map.tolist()} "
                f"of the original)")


class BlockMask:
    """Block-sparse description of a mask (torch FlexAttention's format; see module doc).

    With torch's own FlexAttention: torch's ``flex_attention`` (eager or under
    ``torch.compile``) accepts this BlockMask as it is and gives the same result as with
    :meth:`to_torch`; it reads the fields below and :meth:`as_tuple`, which returns the tuple
    of the equivalent torch BlockMask in the running torch's layout. Torch APIs that need a
    real ``torch.nn.attention.flex_attention.BlockMask`` (``isinstance`` checks, its other
    methods) take ``block_mask.to_torch()``, which shares the tensors;
    :meth:`from_torch` goes the other way.

    Pickling and ``torch.save`` (load with ``weights_only=False``) keep every field when the
    mask_mod pickles (a module-level function); so do masks selected with ``bm[...]``.

    Attributes:
        seq_lengths: ``(Q_LEN, KV_LEN)``.
        kv_num_blocks, kv_indices: partial tiles per query-block row, ``(B, H, NQ)`` and
            ``(B, H, NQ, NK)`` int32.
        full_kv_num_blocks, full_kv_indices: full tiles, same shapes, or None.
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: the transposed lists
            (per key-block column), used by backward passes, or None.
        BLOCK_SIZE: ``(Q_BLOCK_SIZE, KV_BLOCK_SIZE)``.
        mask_mod: the mask_mod applied inside partial tiles.
    """

    _TENSOR_ATTRS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")

    def __init__(
        self,
        seq_lengths: tuple[int, int],
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Optional[Tensor],
        full_kv_indices: Optional[Tensor],
        q_num_blocks: Optional[Tensor],
        q_indices: Optional[Tensor],
        full_q_num_blocks: Optional[Tensor],
        full_q_indices: Optional[Tensor],
        BLOCK_SIZE: tuple[int, int] = (_DEFAULT_BLOCK_SIZE, _DEFAULT_BLOCK_SIZE),
        mask_mod: MaskMod = noop_mask,
    ) -> None:
        _check_kv_pair("kv_num_blocks", kv_num_blocks, "kv_indices", kv_indices)
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError(
                "full_kv_num_blocks and full_kv_indices must be given together or both None.")
        if full_kv_num_blocks is not None:
            _check_kv_pair("full_kv_num_blocks", full_kv_num_blocks,
                           "full_kv_indices", full_kv_indices)
        if (full_q_num_blocks is None) != (full_q_indices is None):
            raise ValueError(
                "full_q_num_blocks and full_q_indices must be given together or both None.")
        self.seq_lengths = (int(seq_lengths[0]), int(seq_lengths[1]))
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        self.BLOCK_SIZE = _normalize_block_size(BLOCK_SIZE)
        self.mask_mod = mask_mod

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Optional[Tensor] = None,
        full_kv_indices: Optional[Tensor] = None,
        BLOCK_SIZE: BlockSizeArg = _DEFAULT_BLOCK_SIZE,
        mask_mod: Optional[MaskMod] = None,
        seq_lengths: Optional[tuple[int, int]] = None,
        compute_q_blocks: bool = True,
    ) -> BlockMask:
        """Build a BlockMask from the per-query-block-row key lists (the q lists are derived).

        ``kv_num_blocks`` is ``(*batch, NQ)`` and ``kv_indices`` ``(*batch, NQ, C)``; entries
        of a row past its count are ignored. ``seq_lengths`` defaults to
        ``(NQ * BLOCK_SIZE[0], C * BLOCK_SIZE[1])``; ``mask_mod`` to :func:`noop_mask`.
        """
        _check_kv_pair("kv_num_blocks", kv_num_blocks, "kv_indices", kv_indices)
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError(
                "full_kv_num_blocks and full_kv_indices must be given together or both None.")
        block_size = _normalize_block_size(BLOCK_SIZE)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * block_size[0],
                           kv_indices.shape[-1] * block_size[1])
        # Columns of the transposed lists: at least the key blocks the lengths need (torch
        # uses kv_indices.shape[-1], which is the same number whenever it works).
        num_cols = max(kv_indices.shape[-1], _cdiv(int(seq_lengths[1]), block_size[1]))
        q_num = q_idx = full_q_num = full_q_idx = None
        if compute_q_blocks:
            q_num, q_idx = _transpose_ordered(kv_num_blocks, kv_indices, num_cols)
            if full_kv_num_blocks is not None:
                _check_kv_pair("full_kv_num_blocks", full_kv_num_blocks,
                               "full_kv_indices", full_kv_indices)
                full_q_num, full_q_idx = _transpose_ordered(
                    full_kv_num_blocks, full_kv_indices, num_cols)  # type: ignore[arg-type]
        return cls(
            seq_lengths=(int(seq_lengths[0]), int(seq_lengths[1])),
            kv_num_blocks=kv_num_blocks,
            kv_indices=kv_indices,
            full_kv_num_blocks=full_kv_num_blocks,
            full_kv_indices=full_kv_indices,
            q_num_blocks=q_num,
            q_indices=q_idx,
            full_q_num_blocks=full_q_num,
            full_q_indices=full_q_idx,
            BLOCK_SIZE=block_size,
            mask_mod=mask_mod if mask_mod is not None else noop_mask,
        )

    # ----------------------------------------------------------------- description

    @property
    def shape(self) -> tuple[int, ...]:
        """``(*batch_dims, Q_LEN, KV_LEN)``, normally ``(B, H, Q_LEN, KV_LEN)``."""
        return tuple(self.kv_indices.shape[:-2]) + self.seq_lengths

    def numel(self) -> int:
        """Number of (query, key) positions the mask covers, ignoring sparsity."""
        return math.prod(self.shape)

    def sparsity(self) -> float:
        """Percentage of positions inside tiles that are skipped (not computed).

        Equal to torch's value when the lengths are multiples of the block size; for a
        ragged last block attnkit counts only in-range positions of each computed tile
        (torch counts whole tiles, which can give a negative sparsity).
        """
        total = self.numel()
        if total == 0:
            return 0.0
        computed = (self.block_kinds() != BLOCK_EMPTY).to(torch.float64)
        bq, bk = self.BLOCK_SIZE
        nq, nk = computed.shape[-2:]
        rows = (self.seq_lengths[0] - torch.arange(nq, dtype=torch.float64) * bq).clamp(0, bq)
        cols = (self.seq_lengths[1] - torch.arange(nk, dtype=torch.float64) * bk).clamp(0, bk)
        area = rows.to(computed.device)[:, None] * cols.to(computed.device)[None, :]
        return 100.0 * (1.0 - float((computed * area).sum()) / total)

    def to_dense(self) -> Tensor:
        """int32 ``(B, H, NQ, NK)``: 1 where a tile is computed (partial or full), else 0.

        Same dtype and shape as torch's ``BlockMask.to_dense``.
        """
        return (self.block_kinds() != BLOCK_EMPTY).to(torch.int32)

    def block_kinds(self) -> Tensor:
        """int8 ``(B, H, NQ, NK)`` table of BLOCK_EMPTY (0), BLOCK_PARTIAL (1), BLOCK_FULL (2)."""
        num_cols = self.kv_indices.shape[-1]
        kinds = _ordered_to_dense(self.kv_num_blocks, self.kv_indices,
                                  num_cols).to(torch.int8)
        if self.full_kv_num_blocks is not None:
            full = _ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices,  # type: ignore[arg-type]
                                     num_cols)
            kinds = kinds.masked_fill(full, BLOCK_FULL)
        return kinds

    def kv_blocks_for(self, b: int, h: int, q_block: int) -> tuple[Tensor, Tensor]:
        """Key-block ids to visit for one (batch, head, query block).

        Returns ``(partial, full)``: int64 1-D tensors of key-block ids, ascending; partial
        tiles need the mask_mod, full ones do not (``full`` is empty when the mask keeps no
        full lists). A batch or head dim of size 1 broadcasts (any ``b``/``h`` reads row 0).
        """
        num, idx = _lead3(self.kv_num_blocks), _lead4(self.kv_indices)
        bi, hi, qi = self._locate(num, b, h, q_block)
        partial = idx[bi, hi, qi, : int(num[bi, hi, qi])].to(torch.int64)
        if self.full_kv_num_blocks is None:
            full = torch.empty(0, dtype=torch.int64, device=partial.device)
        else:
            fnum, fidx = _lead3(self.full_kv_num_blocks), _lead4(self.full_kv_indices)  # type: ignore[arg-type]
            full = fidx[bi, hi, qi, : int(fnum[bi, hi, qi])].to(torch.int64)
        return partial, full

    @staticmethod
    def _locate(num: Tensor, b: int, h: int, q_block: int) -> tuple[int, int, int]:
        out = []
        for name, value, size in (("b", b, num.shape[0]), ("h", h, num.shape[1]),
                                  ("q_block", q_block, num.shape[2])):
            value = check_int(name, value, 0)
            if size == 1 and name != "q_block":
                value = 0
            elif value >= size:
                raise IndexError(f"{name}={value} is out of range for size {size}.")
            out.append(value)
        return out[0], out[1], out[2]

    def to_string(self, grid_size: Union[int, tuple[int, int]] = (20, 20),
                  limit: int = 4) -> str:
        """ASCII picture of the computed tiles, one per (batch, head), like torch's.

        Each character pair summarises a group of tiles: ``██`` all computed, ``░░`` some,
        blank none. ``grid_size=-1`` draws one pair per tile (can be large); at most
        ``limit`` pictures are drawn.
        """
        dense = self.to_dense()
        *batch_dims, num_rows, num_cols = dense.shape
        if grid_size == -1:
            max_rows, max_cols = num_rows, num_cols
        elif isinstance(grid_size, int):
            max_rows = max_cols = grid_size
        else:
            max_rows, max_cols = grid_size
        row_step = max(1, _cdiv(num_rows, max(max_rows, 1)))
        col_step = max(1, _cdiv(num_cols, max(max_cols, 1)))

        def picture(batch_idx: tuple[int, ...]) -> str:
            grid = dense[batch_idx].to(torch.float64)
            lines = [f"{batch_idx}"]
            for r in range(0, num_rows, row_step):
                line = ""
                for c in range(0, num_cols, col_step):
                    frac = grid[r: r + row_step, c: c + col_step].mean().item()
                    line += ("█" if frac == 1 else " " if frac == 0 else "░") * 2
                lines.append(line)
            return "\n".join(lines) + "\n"

        parts = []
        for i, batch_idx in enumerate(itertools.product(*(range(n) for n in batch_dims))):
            if i == limit:
                parts += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                          "You can also index (BlockMask[batch, head]) to choose a specific "
                          "batch or head"]
                break
            parts.append(picture(batch_idx))
        return "\n".join(parts)

    def __str__(self) -> str:
        return (f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n"
                f"{self.to_string().strip()}\n)")

    def __repr__(self) -> str:
        def shape(t: Optional[Tensor]) -> Any:
            return None if t is None else t.shape

        name = getattr(self.mask_mod, "__name__", self.mask_mod)
        return (
            "BlockMask(\n"
            f"    kv_num_blocks={shape(self.kv_num_blocks)},\n"
            f"    kv_indices={shape(self.kv_indices)},\n"
            f"    full_kv_num_blocks={shape(self.full_kv_num_blocks)},\n"
            f"    full_kv_indices={shape(self.full_kv_indices)},\n"
            f"    q_num_blocks={shape(self.q_num_blocks)},\n"
            f"    q_indices={shape(self.q_indices)},\n"
            f"    full_q_num_blocks={shape(self.full_q_num_blocks)},\n"
            f"    full_q_indices={shape(self.full_q_indices)},\n"
            f"    BLOCK_SIZE={self.BLOCK_SIZE},\n"
            f"    shape={self.shape},\n"
            f"    sparsity={self.sparsity():.2f}%,\n"
            f"    mask_mod={name}\n"
            ")")

    # ----------------------------------------------------------------- transforms

    def to(self, device: Union[torch.device, str]) -> BlockMask:
        """A new BlockMask with every tensor on ``device`` (the original is unchanged)."""
        moved = {a: (None if getattr(self, a) is None else getattr(self, a).to(device))
                 for a in self._TENSOR_ATTRS}
        return BlockMask(seq_lengths=self.seq_lengths, BLOCK_SIZE=self.BLOCK_SIZE,
                         mask_mod=self.mask_mod, **moved)

    def to_torch(self) -> Any:
        """The same mask as a ``torch.nn.attention.flex_attention.BlockMask`` (shares tensors).

        For torch APIs that need torch's own class (torch's ``flex_attention`` also takes this
        BlockMask directly). Needs a torch with FlexAttention (2.5+).
        """
        try:
            from torch.nn.attention import flex_attention as flex
        except ImportError as exc:
            raise NotImplementedError(
                f"BlockMask.to_torch needs torch's FlexAttention (torch >= 2.5); this is torch "
                f"{torch.__version__}. Upgrade torch, or use attnkit.flex_attention.") from exc
        fields = {a: getattr(self, a) for a in self._TENSOR_ATTRS}
        mask_mod = self.mask_mod
        if mask_mod is _sliced_mask_mod_error:  # torch's own stub, which torch recognises
            mask_mod = getattr(flex, "_sliced_mask_mod_error", mask_mod)
        try:
            return flex.BlockMask(seq_lengths=self.seq_lengths, BLOCK_SIZE=self.BLOCK_SIZE,
                                  mask_mod=mask_mod, **fields)
        except TypeError:  # torch < 2.6: no seq_lengths
            return flex.BlockMask(BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=mask_mod, **fields)

    def as_tuple(self, flatten: bool = True) -> Tuple[Any, ...]:
        """The fields as torch's ``BlockMask.as_tuple`` lays them out for this torch version
        (what torch's ``flex_attention`` reads): ``self.to_torch().as_tuple(flatten)``."""
        return self.to_torch().as_tuple(flatten)

    @classmethod
    def from_torch(cls, block_mask: Any) -> BlockMask:
        """Wrap a torch FlexAttention ``BlockMask`` (shares tensors)."""
        fields = {a: getattr(block_mask, a) for a in cls._TENSOR_ATTRS}
        nq, nk = block_mask.kv_indices.shape[-2:]
        bq, bk = block_mask.BLOCK_SIZE
        seq_lengths = getattr(block_mask, "seq_lengths", (nq * bq, nk * bk))
        mask_mod = block_mask.mask_mod
        try:
            from torch.nn.attention import flex_attention as flex

            if mask_mod is getattr(flex, "_sliced_mask_mod_error", None):
                mask_mod = _sliced_mask_mod_error
        except ImportError:
            pass
        return cls(seq_lengths=seq_lengths, BLOCK_SIZE=(bq, bk), mask_mod=mask_mod, **fields)

    def __getitem__(self, index: Any) -> BlockMask:
        """Select batch / head / query-block entries (torch semantics: dims are kept).

        ``bm[1]``, ``bm[0, 2]``, ``bm[:, 0:4]``, ``bm[0, 1, torch.tensor([3])]``. An int keeps
        its dim (size 1); the selected tensors are made contiguous. The mask_mod is remapped
        so that the new batch/head index ``i`` means the selected original one; after
        selecting query blocks it raises if called.
        """
        if self.kv_num_blocks.dim() != 3:
            raise IndexError(
                f"indexing needs a (B, H, NQ) BlockMask, this one has kv_num_blocks of shape "
                f"{tuple(self.kv_num_blocks.shape)}.")
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"a BlockMask takes at most 3 indices (b, h, q_block), got "
                             f"{len(index)}.")
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        sizes = self.kv_num_blocks.shape
        norm = []
        for i, n in zip(padded, sizes):
            if isinstance(i, numbers.Integral) and not isinstance(i, bool):
                i = int(i)
                if not -n <= i < n:
                    raise IndexError(f"index {i} is out of range for a dim of size {n}.")
                i = slice(i % n, i % n + 1)
            norm.append(i)
        idx = tuple(norm)
        full_num = full_idx = None
        if self.full_kv_num_blocks is not None:
            full_num = self.full_kv_num_blocks[idx].contiguous()
            full_idx = self.full_kv_indices[idx].contiguous()  # type: ignore[index]
        if isinstance(idx[2], slice) and idx[2] == slice(None):
            device = self.kv_num_blocks.device
            b_map = torch.arange(sizes[0], device=device)[idx[0]]
            h_map = torch.arange(sizes[1], device=device)[idx[1]]
            mask_mod = _RemappedMaskMod(self.mask_mod, b_map, h_map)
        else:
            mask_mod = _sliced_mask_mod_error
        return BlockMask.from_kv_blocks(
            self.kv_num_blocks[idx].contiguous(), self.kv_indices[idx].contiguous(),
            full_num, full_idx,
            BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=self.seq_lengths,
            compute_q_blocks=self.q_indices is not None)


def _check_kv_pair(num_name: str, num: Any, idx_name: str, idx: Any) -> None:
    for name, t in ((num_name, num), (idx_name, idx)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}.")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor (int32), got {t.dtype}.")
    if idx.dim() < 2:
        raise ValueError(
            f"{idx_name} must have at least 2 dims (..., NQ, NK), got shape "
            f"{tuple(idx.shape)}.")
    if tuple(num.shape) != tuple(idx.shape[:-1]):
        raise ValueError(
            f"{num_name} has shape {tuple(num.shape)} but {idx_name} has "
            f"{tuple(idx.shape)}; the counts must be {idx_name}.shape[:-1] = "
            f"{tuple(idx.shape[:-1])}.")


def _lead3(t: Tensor) -> Tensor:
    if t.dim() > 3:
        raise ValueError(f"expected at most (B, H, NQ) counts, got shape {tuple(t.shape)}.")
    while t.dim() < 3:
        t = t.unsqueeze(0)
    return t


def _lead4(t: Tensor) -> Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


# --------------------------------------------------------------------------- classification


def _band_of(structure: Optional[dict]) -> Optional[tuple[Optional[int], Optional[int]]]:
    """``(lo, hi)`` with visible iff lo <= kv - q <= hi, or None when not a band."""
    if structure is None:
        return None
    kind = structure.get("kind")
    if kind == "full":
        return (None, None)
    if kind in ("causal", "window"):
        return structure["band"]
    if kind == "and":
        lo: Optional[int] = None
        hi: Optional[int] = None
        for part in structure["parts"]:
            band = _band_of(part)
            if band is None:
                return None
            if band[0] is not None:
                lo = band[0] if lo is None else max(lo, band[0])
            if band[1] is not None:
                hi = band[1] if hi is None else min(hi, band[1])
        return (lo, hi)
    return None


def _tile_bounds(length: int, block: int, device: torch.device
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """First and last in-range position of each tile, and whether the tile is complete."""
    first = torch.arange(_cdiv(length, block), dtype=torch.int64, device=device) * block
    last = torch.clamp(first + block, max=length) - 1
    return first, last, first + block <= length


def _classify_by_structure(structure: Optional[dict], q_len: int, kv_len: int,
                           block: tuple[int, int], device: torch.device
                           ) -> Optional[tuple[Tensor, Tensor]]:
    """Analytic (any, full) per tile for band and prefix-LM masks; None for other masks."""
    if structure is None:
        return None
    q0, q1, q_complete = _tile_bounds(q_len, block[0], device)
    k0, k1, k_complete = _tile_bounds(kv_len, block[1], device)
    q0, q1, q_complete = q0[:, None], q1[:, None], q_complete[:, None]
    k0, k1, k_complete = k0[None, :], k1[None, :], k_complete[None, :]
    complete = q_complete & k_complete
    # kv - q over a tile covers every integer in [k0 - q1, k1 - q0].
    d_min, d_max = k0 - q1, k1 - q0
    band = _band_of(structure)
    if band is not None:
        lo, hi = band
        any_ = torch.ones_like(complete)
        full = complete.clone()
        if lo is not None:
            any_ &= d_max >= lo
            full &= d_min >= lo
        if hi is not None:
            any_ &= d_min <= hi
            full &= d_max <= hi
        if lo is not None and hi is not None and lo > hi:
            any_.zero_()
            full.zero_()
    elif structure.get("kind") == "prefix_lm":
        prefix = structure["prefix_len"]
        any_ = (d_min <= 0) | (k0 < prefix)
        full = complete & ((k1 < prefix) | (q0 >= k1))
    else:
        return None
    return any_[None, None], full[None, None]


def _widen(acc: Tensor, b: int, h: int) -> Tensor:
    if acc.shape[0] == b and acc.shape[1] == h:
        return acc
    return acc.expand(b, h, *acc.shape[2:]).clone()


def _classify_by_evaluation(mask_mod: MaskMod, B: int, H: int, q_len: int, kv_len: int,
                            block: tuple[int, int], device: torch.device
                            ) -> tuple[Tensor, Tensor]:
    """(any, full) per tile by calling mask_mod on chunks of whole tiles."""
    bq, bk = block
    nq, nk = _cdiv(q_len, bq), _cdiv(kv_len, bk)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)

    def call(q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        out = mask_mod(b, h, q_pos.view(1, 1, -1, 1), kv_pos.view(1, 1, 1, -1))
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            got = out.dtype if isinstance(out, Tensor) else type(out).__name__
            raise TypeError(
                f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!r} returned {got}; a "
                "mask_mod must return a bool tensor (True = visible). Compare instead of "
                "returning a score, e.g. `q_idx >= kv_idx`.")
        full_shape = (B, H, q_pos.numel(), kv_pos.numel())
        if out.dim() > 4 or any(o not in (1, f) for o, f in zip(reversed(out.shape),
                                                                 reversed(full_shape))):
            raise ValueError(
                f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!r} returned shape "
                f"{tuple(out.shape)}, which does not broadcast to (B, H, q, kv) = "
                f"{full_shape}; build the result from b, h, q_idx and kv_idx by broadcasting.")
        return out

    # Probe which of b / h the mask depends on, to size the chunks.
    probe = call(torch.zeros(1, dtype=torch.int64, device=device),
                 torch.zeros(1, dtype=torch.int64, device=device))
    pb = B if probe.dim() == 4 and probe.shape[0] == B else 1
    ph = H if probe.dim() >= 3 and probe.shape[-3] == H else 1
    tile = pb * ph * bq * bk
    cols_per_chunk = max(1, min(nk, _CHUNK_ELEMENTS // tile))
    rows_per_chunk = max(1, min(nq, _CHUNK_ELEMENTS // (tile * cols_per_chunk)))

    any_acc = torch.zeros(pb, ph, nq, nk, dtype=torch.bool, device=device)
    full_acc = torch.zeros(pb, ph, nq, nk, dtype=torch.bool, device=device)
    for r0 in range(0, nq, rows_per_chunk):
        r1 = min(nq, r0 + rows_per_chunk)
        q_pos = torch.arange(r0 * bq, r1 * bq, dtype=torch.int64, device=device)
        for c0 in range(0, nk, cols_per_chunk):
            c1 = min(nk, c0 + cols_per_chunk)
            kv_pos = torch.arange(c0 * bk, c1 * bk, dtype=torch.int64, device=device)
            # Never show the mask_mod a position past the end (it may index a tensor of
            # that length); evaluate clamped positions and hide the padding afterwards.
            ragged = r1 * bq > q_len or c1 * bk > kv_len
            out = call(q_pos.clamp(max=q_len - 1), kv_pos.clamp(max=kv_len - 1))
            if ragged:
                out = out & ((q_pos < q_len)[:, None] & (kv_pos < kv_len)[None, :])
            ob = B if out.dim() == 4 and out.shape[0] == B else 1
            oh = H if out.dim() >= 3 and out.shape[-3] == H else 1
            out = out.expand(ob, oh, q_pos.numel(), kv_pos.numel()).contiguous()
            any_t, all_t = _reduce_tiles(out, bq, bk)
            if (ob, oh) != tuple(any_acc.shape[:2]):
                nb, nh = max(ob, any_acc.shape[0]), max(oh, any_acc.shape[1])
                any_acc, full_acc = _widen(any_acc, nb, nh), _widen(full_acc, nb, nh)
            any_acc[:, :, r0:r1, c0:c1] = any_t
            full_acc[:, :, r0:r1, c0:c1] = all_t
    return any_acc, full_acc


def _reduce_tiles(out: Tensor, bq: int, bk: int) -> tuple[Tensor, Tensor]:
    """bool (b, h, R*bq, C*bk) contiguous -> per-tile any and all, (b, h, R, C).

    Reduces over the bq rows of each tile first (min and max in one pass), then over the
    bk columns of the much smaller result.
    """
    b, h, rows, cols = out.shape
    r, c = rows // bq, cols // bk
    if bk % 8 == 0 and out.storage_offset() % 8 == 0:
        # 8 bools as one int64 word (bytes 0/1, so the word is >= 0): a word is nonzero iff
        # one bool is set and equals _ALL_TRUE_WORD (its largest value) iff all are.
        words = out.view(torch.int64).view(b, h, r, bq, cols // 8)
        low, high = torch.aminmax(words, dim=3)
        any_ = (high != 0).view(b, h, r, c, bk // 8).any(dim=-1)
        all_ = (low == _ALL_TRUE_WORD).view(b, h, r, c, bk // 8).all(dim=-1)
    else:
        low, high = torch.aminmax(out.view(torch.uint8).view(b, h, r, bq, cols), dim=3)
        any_ = (high != 0).view(b, h, r, c, bk).any(dim=-1)
        all_ = (low != 0).view(b, h, r, c, bk).all(dim=-1)
    return any_, all_


def create_block_mask(
    mask_mod: MaskMod,
    B: Optional[int],
    H: Optional[int],
    Q_LEN: int,
    KV_LEN: int,
    device: Union[str, torch.device] = "cpu",
    BLOCK_SIZE: BlockSizeArg = _DEFAULT_BLOCK_SIZE,
    separate_full_blocks: bool = True,
) -> BlockMask:
    """Classify every ``BLOCK_SIZE`` tile of ``mask_mod`` and return a :class:`BlockMask`.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool tensor``, True = visible.
        B, H: batch size and query heads; None or 1 gives a dim of size 1 that broadcasts.
        Q_LEN, KV_LEN: sequence lengths (need not be multiples of the block size).
        device: where the mask is evaluated and the result lives.
        BLOCK_SIZE: int, or ``(Q_BLOCK_SIZE, KV_BLOCK_SIZE)``.
        separate_full_blocks: if False, full tiles are listed as partial and the ``full_*``
            fields are None (as in torch).

    Returns the same fields, dtypes and ordering as torch's ``create_block_mask``. Memory
    stays bounded: builtin band masks (causal, windows, prefix-LM) are classified
    analytically, other masks are evaluated about 16M positions per call.
    """
    _check_mask_mod(mask_mod)
    B = 1 if B is None else check_int("B", B, 1, fix="Use None or 1 to broadcast over the batch.")
    H = 1 if H is None else check_int("H", H, 1, fix="Use None or 1 to broadcast over heads.")
    q_len = check_int("Q_LEN", Q_LEN, 0)
    kv_len = check_int("KV_LEN", KV_LEN, 0)
    block = _normalize_block_size(BLOCK_SIZE)
    device = torch.device(device)
    nq, nk = _cdiv(q_len, block[0]), _cdiv(kv_len, block[1])

    if nq == 0 or nk == 0:
        any_ = torch.zeros(1, 1, nq, nk, dtype=torch.bool, device=device)
        full = any_
    else:
        found = _classify_by_structure(structure_of(mask_mod), q_len, kv_len, block, device)
        if found is None:
            found = _classify_by_evaluation(mask_mod, B, H, q_len, kv_len, block, device)
        any_, full = found

    if separate_full_blocks:
        partial = any_ & ~full
    else:
        partial = any_
    # Order on the (possibly broadcast) tables, then expand to (B, H) as torch lays it out.
    kv_num, kv_idx = _dense_to_ordered(partial)
    q_num, q_idx = _dense_to_ordered(partial.transpose(-2, -1))
    fields = [kv_num, kv_idx, q_num, q_idx]
    if separate_full_blocks:
        fields += [*_dense_to_ordered(full), *_dense_to_ordered(full.transpose(-2, -1))]
    fields = [t.expand(B, H, *t.shape[2:]).contiguous() for t in fields]
    if separate_full_blocks:
        kv_num, kv_idx, q_num, q_idx, fkv_num, fkv_idx, fq_num, fq_idx = fields
    else:
        kv_num, kv_idx, q_num, q_idx = fields
        fkv_num = fkv_idx = fq_num = fq_idx = None
    return BlockMask(
        seq_lengths=(q_len, kv_len),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=fkv_num,
        full_kv_indices=fkv_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=fq_num,
        full_q_indices=fq_idx,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
    )

