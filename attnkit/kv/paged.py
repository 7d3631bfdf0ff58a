"""A paged key/value cache (FlashAttention / vLLM layout) and the gather that reads it.

Keys and values live in fixed-size pages shared by all sequences; each sequence owns an ordered
list of pages (its row of the block table), so sequences grow without reallocation and freed
pages are reused by any other sequence::

    k_pages (num_pages, page_size, Hkv, Dqk)      v_pages (num_pages, page_size, Hkv, Dv)

    page_size = 4, sequence "a" of 6 tokens on pages [2, 0], "b" of 3 tokens on page [1]:

        page 0: a4 a5 .  .       block_table = [[2, 0],     seqlens = [6, 3]
        page 1: b0 b1 b2 .                      [1, 0]]
        page 2: a0 a1 a2 a3      (row "b" padded with 0)

Token ``t`` of a sequence sits at ``(block_table[b, t // page_size], t % page_size)``.

Shape legend: B sequences in a batch, Hkv key/value heads, Dqk key head dim, Dv value head
dim, Lmax the longest sequence of the batch.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..engine.ops import stand_ins
from ..terms.checks import check_int
from ..terms.fp8 import FP8_DTYPES, cast_fp8, check_positive, suggested_scale
from ..terms.spec import Options, PagedKV, build_spec
from .pages import gather_kv

__all__ = ["PagedKVCache", "gather_kv", "OutOfPagesError", "UnknownSequenceError"]


class OutOfPagesError(ValueError):
    """An append needs more pages than the cache has free; the cache is left unchanged."""


class UnknownSequenceError(KeyError):
    """A sequence id that was never allocated (or was already freed)."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class PagedKVCache:
    """Key/value pages plus the bookkeeping of which sequence owns which page.

    Read it with :func:`paged_attention` (queries ``(B, Hq, Lq, D)`` of some of its
    sequences, by id), :func:`paged_attention_blocks` (its ``k_pages``/``v_pages`` with a
    block table, as FlashAttention takes them) or :func:`attnkit.varlen_attention` with
    ``block_table=`` and ``seqused_kv=`` (packed queries of many sequences: decode rows and
    prefill chunks in one call)::

        cache = PagedKVCache(num_pages=64, page_size=16, num_kv_heads=2, head_dim=64)
        cache.allocate("a")
        cache.append("a", k, v)                    # k, v: (tokens, Hkv, D)
        out = paged_attention(q, cache, ["a"])     # q: (1, Hq, Lq, D)
        cache.free("a")

    Args:
        num_pages: number of pages in the pool.
        page_size: tokens per page.
        num_kv_heads: key/value heads (Hkv).
        head_dim: key head dim (Dqk).
        dtype: floating dtype of the pages; appended tokens must already have it. An fp8
            dtype (``torch.float8_e4m3fn`` / ``float8_e5m2``) makes an fp8 cache: tokens are
            appended in any float dtype and quantized on append (see below).
        device: device of the pages; appended tokens must already be there.
        v_head_dim: value head dim (Dv); defaults to ``head_dim``.
        values_in_keys: the values are the first ``v_head_dim`` dims of each key row (MLA's
            latent cache: one 576-dim latent per token, its first 512 dims the values):
            ``v_pages`` is a view of ``k_pages``, :meth:`append` takes the keys alone, and the
            decode kernel reads each row once. Not for fp8 caches.
        k_descale, v_descale: fp8 only: static descales, one per kv head ``(Hkv,)`` or one
            number (vLLM's calibrated ``k_scale``/``v_scale``); an append whose values do
            not fit ``max(dtype) * descale`` is refused. None (default): per (page, kv head)
            scales chosen on append.

    Attributes:
        k_pages: ``(num_pages, page_size, Hkv, Dqk)`` tensor (zero-initialised).
        v_pages: ``(num_pages, page_size, Hkv, Dv)`` tensor (zero-initialised).
        k_descale, v_descale: fp8 caches: ``(num_pages, Hkv)`` float32, the real value of
            ``k_pages[p, t, h]`` is ``k_pages[p, t, h] * k_descale[p, h]``; None otherwise.

    fp8 with per-page scales: each (page, kv head) keeps the absolute maximum of what it holds
    and cuDNN's suggested scale for it (``max(dtype) / amax`` rounded down to a power of two).
    A token that raises a page's maximum past its scale's range rescales the page (by a power
    of two: exact but for values that become subnormal) before it is written. The decode
    kernel reads fp8 pages directly and converts them in registers, and the flash kernel
    does for longer query blocks.

    Pages come from a free list, most recently freed first; freeing a sequence returns its
    pages without clearing them (readers use ``seqlens`` to know what is valid). The cache
    stores values, not autograd history: appended tensors are detached.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        v_head_dim: Optional[int] = None,
        k_descale: Any = None,
        v_descale: Any = None,
        values_in_keys: bool = False,
    ) -> None:
        self.num_pages = check_int("num_pages", num_pages, 1)
        self.page_size = check_int("page_size", page_size, 1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, 1)
        self.head_dim = check_int("head_dim", head_dim, 1)
        self.v_head_dim = check_int("v_head_dim", head_dim if v_head_dim is None
                                        else v_head_dim, 1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_pages = torch.zeros(num_pages, page_size, num_kv_heads, self.head_dim,
                                   dtype=dtype, device=self.device)
        self.values_in_keys = bool(values_in_keys)
        if self.values_in_keys:
            if self.v_head_dim > self.head_dim:
                raise ValueError(f"values_in_keys=True reads the values from the key rows, so "
                                 f"v_head_dim must be at most head_dim={self.head_dim}; got "
                                 f"v_head_dim={self.v_head_dim}")
            if dtype in FP8_DTYPES:
                raise NotImplementedError(
                    "values_in_keys=True with an fp8 dtype: the keys' and values' per-page "
                    "scales would have to be one; use a bfloat16 or float32 latent cache")
            self.v_pages = self.k_pages[..., :self.v_head_dim]
        else:
            self.v_pages = torch.zeros(num_pages, page_size, num_kv_heads, self.v_head_dim,
                                       dtype=dtype, device=self.device)
        self.k_descale: Optional[Tensor] = None
        self.v_descale: Optional[Tensor] = None
        self._static_scales = k_descale is not None or v_descale is not None
        if dtype in FP8_DTYPES:
            self._init_fp8(k_descale, v_descale)
        elif self._static_scales:
            raise ValueError(f"k_descale and v_descale are for an fp8 cache; dtype is {dtype}: "
                             f"drop them, or pass dtype=torch.float8_e4m3fn")
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() -> lowest first
        self._pages: Dict[Hashable, List[int]] = {}
        self._lens: Dict[Hashable, int] = {}

    def _init_fp8(self, k_descale: Any, v_descale: Any) -> None:
        shape = (self.num_pages, self.num_kv_heads)
        self.k_descale = torch.ones(shape, dtype=torch.float32, device=self.device)
        self.v_descale = torch.ones(shape, dtype=torch.float32, device=self.device)
        #: per (page, kv head): the largest |value| stored there (per-page scales)
        self._amax = {"k": torch.zeros(shape, dtype=torch.float32, device=self.device),
                      "v": torch.zeros(shape, dtype=torch.float32, device=self.device)}
        if not self._static_scales:
            return
        for name, d, store in (("k_descale", k_descale, self.k_descale),
                               ("v_descale", v_descale, self.v_descale)):
            if d is None:
                raise ValueError(f"static fp8 scales need both k_descale and v_descale; "
                                 f"{name} is missing")
            if isinstance(d, Tensor) and d.numel() == self.num_kv_heads and d.dim() == 1:
                values = [check_positive(f"{name}[{h}]", x) for h, x in enumerate(d.tolist())]
                store.copy_(torch.tensor(values, dtype=torch.float32).view(1, -1))
            elif isinstance(d, Tensor) and d.dim() > 0 and d.numel() != 1:
                raise ValueError(f"{name} must be one number or one per kv head "
                                 f"({self.num_kv_heads},); got shape {tuple(d.shape)}")
            else:
                store.fill_(check_positive(name, d))

    # ------------------------------------------------------------------ bookkeeping

    @property
    def num_free_pages(self) -> int:
        """Pages not owned by any sequence."""
        return len(self._free)

    @property
    def seq_ids(self) -> Tuple[Hashable, ...]:
        """Allocated sequence ids, in allocation order."""
        return tuple(self._pages)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._pages

    def _check_known(self, seq_id: Hashable) -> None:
        if seq_id not in self._pages:
            known = ", ".join(repr(s) for s in list(self._pages)[:8])
            more = ", ..." if len(self._pages) > 8 else ""
            raise UnknownSequenceError(
                f"unknown sequence {seq_id!r}; call allocate({seq_id!r}) before appending to or "
                f"reading it (allocated: [{known}{more}])")

    def allocate(self, seq_id: Hashable) -> None:
        """Register an empty sequence; pages are taken only when tokens are appended."""
        try:
            hash(seq_id)
        except TypeError as e:
            raise TypeError(f"seq_id must be hashable, got {type(seq_id).__name__}") from e
        if seq_id in self._pages:
            raise ValueError(
                f"sequence {seq_id!r} is already allocated ({self._lens[seq_id]} tokens); "
                f"append to it, or free({seq_id!r}) it first to start over")
        self._pages[seq_id] = []
        self._lens[seq_id] = 0

    def free(self, seq_id: Hashable) -> None:
        """Forget a sequence and return its pages to the free list (contents are not cleared)."""
        self._check_known(seq_id)
        self._free.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]

    def seq_len(self, seq_id: Hashable) -> int:
        """Number of tokens stored for ``seq_id``."""
        self._check_known(seq_id)
        return self._lens[seq_id]

    def pages_of(self, seq_id: Hashable) -> List[int]:
        """Page indices owned by ``seq_id``, in token order (a copy)."""
        self._check_known(seq_id)
        return list(self._pages[seq_id])

    # ------------------------------------------------------------------ writing

    def _check_tokens(self, name: str, x: Tensor, dim: int) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        want = (self.num_kv_heads, dim)
        if x.dim() != 3 or tuple(x.shape[1:]) != want:
            raise ValueError(
                f"{name} must have shape (T, num_kv_heads={want[0]}, {dim}) (token-major), got "
                f"{tuple(x.shape)}; for a (Hkv, T, D) tensor pass {name}.transpose(0, 1)")
        if self.k_descale is not None:  # fp8: real values in, quantized here
            if not x.dtype.is_floating_point or x.dtype in FP8_DTYPES:
                raise TypeError(
                    f"{name} has dtype {x.dtype}; an fp8 cache takes the real values in a "
                    f"float dtype (bfloat16, float32 ...) and quantizes them on append")
        elif x.dtype != self.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but the cache stores {self.dtype}; convert with "
                f"{name}.to({self.dtype}) or build the cache with dtype={x.dtype}")
        if x.device != self.device:
            raise ValueError(
                f"{name} is on {x.device} but the cache is on {self.device}; move it with "
                f"{name}.to('{self.device}')")

    def append(self, seq_id: Hashable, k: Tensor, v: Optional[Tensor] = None) -> None:
        """Append ``T`` tokens to ``seq_id``, taking pages from the free list as needed.

        Args:
            seq_id: an allocated sequence.
            k: ``(T, Hkv, Dqk)`` keys, token-major, the cache's dtype and device.
            v: ``(T, Hkv, Dv)`` values; None (or ``k[..., :Dv]``) for a cache built with
                ``values_in_keys=True``, whose values are in the keys.

        ``T`` may be anything >= 0 and may span page boundaries. Raises
        :class:`OutOfPagesError` when the free pages do not suffice; nothing changes then.
        """
        self._check_known(seq_id)
        self._check_tokens("k", k, self.head_dim)
        if v is None and not self.values_in_keys:
            raise TypeError("v is required: this cache keeps values of their own (build it "
                            "with values_in_keys=True for values inside the key rows)")
        if v is None:
            v = k[..., :self.v_head_dim]
        self._check_tokens("v", v, self.v_head_dim)
        if self.values_in_keys and not torch.equal(v, k[..., :self.v_head_dim]):
            raise ValueError(f"this cache was built with values_in_keys=True: the values are "
                             f"k[..., :{self.v_head_dim}], and the v given differs; pass v=None")
        T = k.shape[0]
        if v.shape[0] != T:
            raise ValueError(
                f"k has {T} tokens but v has {v.shape[0]}; append keys and values together")
        if T == 0:
            return
        if self.k_descale is not None:
            self._check_fp8_values("k", k, self.k_descale)
            self._check_fp8_values("v", v, self.v_descale)
        P = self.page_size
        length, pages = self._lens[seq_id], self._pages[seq_id]
        need = -(-(length + T) // P) - len(pages)
        if need > len(self._free):
            raise OutOfPagesError(
                f"appending {T} tokens to sequence {seq_id!r} (length {length}, page_size {P}) "
                f"needs {need} more pages but only {len(self._free)} of {self.num_pages} are "
                f"free; free finished sequences or build the cache with more pages "
                f"(num_pages >= {self.num_pages - len(self._free) + need})")
        new_pages = [self._free.pop() for _ in range(need)]
        try:
            table = torch.tensor(pages + new_pages, dtype=torch.int64, device=self.device)
            pos = torch.arange(length, length + T, device=self.device)
            slots = table[pos // P] * P + pos % P
            with torch.no_grad():
                if self.k_descale is not None:
                    tok_pages = table[pos // P]
                    fresh = torch.tensor(new_pages, dtype=torch.int64, device=self.device)
                    self._write_fp8("k", self.k_pages, self.k_descale, k, slots, tok_pages,
                                    fresh)
                    self._write_fp8("v", self.v_pages, self.v_descale, v, slots, tok_pages,
                                    fresh)
                else:
                    self.k_pages.view(-1, self.num_kv_heads, self.head_dim).index_copy_(
                        0, slots, k.detach())
                    if not self.values_in_keys:  # (else written with the keys)
                        self.v_pages.view(-1, self.num_kv_heads, self.v_head_dim).index_copy_(
                            0, slots, v.detach())
        except BaseException:
            self._free.extend(reversed(new_pages))
            raise
        pages.extend(new_pages)
        self._lens[seq_id] = length + T

    def _check_fp8_values(self, name: str, x: Tensor, descale: Tensor) -> None:
        """What an fp8 append refuses before it changes anything: values that are not
        finite, and with static scales values beyond their range."""
        xf = x.detach().float()
        if not bool(torch.isfinite(xf).all()):
            raise ValueError(f"{name} holds inf or NaN; an fp8 cache stores finite values only")
        if self._static_scales:
            amax = xf.abs().amax(dim=(0, 2))  # (Hkv,)
            limit = torch.finfo(self.dtype).max * descale[0]
            if bool((amax > limit).any()):
                h = int((amax > limit).nonzero()[0])
                raise ValueError(
                    f"{name} has |values| up to {float(amax[h]):g} in kv head {h}, beyond what "
                    f"its static descale {float(descale[0, h]):g} can hold "
                    f"({float(limit[h]):g}); use a larger {name}_descale, or per-page scales "
                    f"({name}_descale=None)")

    def _write_fp8(self, name: str, pages: Tensor, descale: Tensor, x: Tensor, slots: Tensor,
                   tok_pages: Tensor, fresh: Tensor) -> None:
        """Quantize tokens ``x (T, Hkv, D)`` into ``pages`` at ``slots`` (``tok_pages`` the page
        of each token, ``fresh`` the pages this append took off the free list)."""
        xf = x.detach().float()
        hkv, d = self.num_kv_heads, pages.shape[-1]
        if not self._static_scales:
            amax = self._amax[name]
            amax[fresh] = 0.0  # (freed pages keep stale values; a new owner starts over)
            descale[fresh] = 1.0
            touched, where = torch.unique(tok_pages, return_inverse=True)
            tok_amax = xf.abs().amax(-1)  # (T, Hkv)
            old = amax[touched]
            new = old.scatter_reduce(0, where[:, None].expand_as(tok_amax), tok_amax, "amax")
            new_d = 1.0 / suggested_scale(new, self.dtype)
            ratio = torch.where(old > 0, descale[touched] / new_d, torch.ones_like(new_d))
            if bool((ratio != 1).any()):  # a page's range grew: rescale what it holds
                held = pages[touched].float() * ratio[:, None, :, None]
                _bytes(pages)[touched] = _bytes(cast_fp8(held, self.dtype))
            descale[touched] = new_d
            amax[touched] = new
        scale = 1.0 / descale[tok_pages]  # (T, Hkv), powers of two per page
        # (torch has no fp8 index_copy: the bytes are copied)
        _bytes(pages).view(-1, hkv, d).index_copy_(
            0, slots, _bytes(cast_fp8(xf * scale[..., None], self.dtype)))

    # ------------------------------------------------------------------ reading

    def block_table(self, seq_ids: Sequence[Hashable]) -> Tuple[Tensor, Tensor]:
        """Block table and lengths of a batch of sequences, on the cache's device.

        Returns:
            block_table: int32 ``(B, max_pages)``, row ``b`` = ``pages_of(seq_ids[b])`` padded
                with 0 (a valid page index, so kernels that read a whole row stay in bounds;
                entries past ``ceil(seqlens[b] / page_size)`` carry no meaning).
            seqlens: int32 ``(B,)``.
        """
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence):
            raise TypeError(
                f"seq_ids must be a sequence of ids (e.g. a list), got {type(seq_ids).__name__}"
                f"; for one sequence pass [seq_id]")
        for s in seq_ids:
            self._check_known(s)
        width = max((len(self._pages[s]) for s in seq_ids), default=0)
        rows = [self._pages[s] + [0] * (width - len(self._pages[s])) for s in seq_ids]
        table = torch.tensor(rows, dtype=torch.int32).reshape(len(seq_ids), width)
        lens = torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32)
        return table.to(self.device), lens.to(self.device)

    def gather(self, seq_ids: Sequence[Hashable],
               dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
        """Contiguous ``k (B, Hkv, Lmax, Dqk)``, ``v (B, Hkv, Lmax, Dv)``; see :func:`gather_kv`
        (an fp8 cache gives the dequantized values, float32 unless ``dtype`` says otherwise)."""
        table, lens = self.block_table(seq_ids)
        max_len = max((self._lens[s] for s in seq_ids), default=0)
        return gather_kv(self.k_pages, self.v_pages, table, lens, max_seqlen=max_len,
                         k_descale=self.k_descale, v_descale=self.v_descale, dtype=dtype)

    # ------------------------------------------------------------------ explaining

    def __repr__(self) -> str:
        tokens = sum(self._lens.values())
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, dtype={self.dtype}{self._scales_repr()}, "
                f"device={self.device}, "
                f"sequences={len(self._pages)}, tokens={tokens}, "
                f"free_pages={self.num_free_pages})")

    def _scales_repr(self) -> str:
        if self.k_descale is None:
            return ""
        return " (static scales)" if self._static_scales else " (per-page scales)"

    def to_string(self) -> str:
        """Multi-line picture: one line per sequence, then which sequence owns each page."""
        lines = [repr(self)]
        owner = ["."] * self.num_pages
        for n, (s, pages) in enumerate(self._pages.items()):
            lines.append(f"  [{n}] {s!r}: {self._lens[s]} tokens on pages {pages}")
            for p in pages:
                owner[p] = str(n) if n < 10 else "#"
        lines.append("  page owners: " + " ".join(owner))
        return "\n".join(lines)


def _bytes(x: Tensor) -> Tensor:
    """An fp8 tensor's storage as uint8 (for the indexing ops torch lacks for fp8)."""
    return x.view(torch.uint8)


def paged_spec(q: Tensor, pages: PagedKV, opts: Options,
               outputs: frozenset = frozenset()) -> Any:
    """The spec of a call over K/V read in place from ``pages`` (``opts`` carrying each
    sequence's length as ``seqlens_kv``): the spec sees zero-stride stand-ins of the gathered
    shape, in q's dtype for fp8 pages, so every option is validated as for a dense call and
    nothing is allocated."""
    k_stub, v_stub = stand_ins(pages.k_pages, pages.v_pages, pages.block_table,
                               dtype=q.dtype if pages.k_descale is not None else None)
    return build_spec(q, k_stub, v_stub, opts, paged=pages, outputs=outputs)


def __getattr__(name: str) -> Any:
    """The paged front doors, which live in :mod:`attnkit.doors.paged` (this module held them
    before 0.2; ``attnkit.paged.paged_attention`` and the like keep working)."""
    if name in _DOORS:
        from ..doors import paged as doors

        return getattr(doors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_DOORS = ("paged_attention", "paged_attention_blocks", "TAKES", "UNSUPPORTED")
