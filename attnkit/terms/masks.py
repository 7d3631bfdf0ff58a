"""Mask mods: which (query, key) pairs may attend, as tiny pure functions.

A mask_mod has the FlexAttention signature ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``
(True = visible). attnkit calls it on broadcastable int64 index tensors holding absolute
positions::

    b       (nb, 1, 1, 1)    batch index
    h       (1, nh, 1, 1)    query-head index
    q_idx   (1, 1, bq, 1)    query position
    kv_idx  (1, 1, 1, bk)    key/value position

and the result must broadcast to ``(nb, nh, bq, bk)``. Every builtin here is written with
plain tensor ops and indexing, so it also works under torch's own ``create_block_mask`` /
``create_mask`` (which call it through ``torch.vmap`` on 0-d tensors).

Pictures below use ``Lq`` query rows (top to bottom) and ``Lk`` key columns (left to right),
``1`` = visible::

    causal(), Lq = Lk = 4        causal("bottom_right", 2, 5)   sliding_window(1), Lq = Lk = 5
    1 0 0 0                      1 1 1 1 0                      1 0 0 0 0
    1 1 0 0                      1 1 1 1 1                      1 1 0 0 0
    1 1 1 0                                                     0 1 1 0 0
    1 1 1 1                                                     0 0 1 1 0
                                                                0 0 0 1 1

    prefix_lm(2), L = 5          chunked(2), L = 5              document_from_lengths([2, 3])
    1 1 0 0 0                    1 0 0 0 0                      1 1 0 0 0
    1 1 0 0 0                    1 1 0 0 0                      1 1 0 0 0
    1 1 1 0 0                    0 0 1 0 0                      0 0 1 1 1
    1 1 1 1 0                    0 0 1 1 0                      0 0 1 1 1
    1 1 1 1 1                    0 0 0 0 1                      0 0 1 1 1

    dilated_sliding_window(2, 2), L = 5
    1 0 0 0 0
    0 1 0 0 0
    1 0 1 0 0
    0 1 0 1 0
    0 0 1 0 1

Structure hints
---------------
Every builtin mask is an :class:`attnkit.mods.Builtin` that carries a structure, a plain dict
that lets a planner see the pattern without evaluating the mask. Read it through
:func:`structure_of`, which returns it only for genuine builtins (a ``functools.wraps`` wrapper
is a plain function, evaluated as written). Builtins pickle and ``torch.save`` by their factory
and arguments. Formats (``None`` = unbounded where noted):

* ``{"kind": "full"}`` -- :func:`noop_mask`.
* ``{"kind": "causal", "diagonal": "top_left"|"bottom_right", "offset": o, "q_len": Lq|None,
  "kv_len": Lk|None, "band": (None, o)}`` -- visible iff ``kv_idx <= q_idx + o``;
  ``o = Lk - Lq`` for bottom_right, else 0.
* ``{"kind": "window", "left": l|None, "right": r|None, "diagonal": ..., "offset": o,
  "q_len": ..., "kv_len": ..., "band": (lo, hi)}`` -- visible iff
  ``q_idx + o - l <= kv_idx <= q_idx + o + r``.
* ``"band": (lo, hi)`` (causal and window) -- the same rule as ``lo <= kv_idx - q_idx <= hi``
  with ``lo = o - l`` and ``hi = o + r`` (``None`` = unbounded side).
* ``{"kind": "prefix_lm", "prefix_len": P}`` -- visible iff ``kv_idx <= q_idx or kv_idx < P``.
* ``{"kind": "document", "doc_ids_q": Tensor, "doc_ids_kv": Tensor}`` -- ids of shape ``(L,)``
  or ``(B, L)``; :func:`document_from_lengths` adds ``"lengths": Tensor``.
* ``{"kind": "padding", "seqlens_q": Tensor (B,), "seqlens_kv": Tensor (B,)}``.
* ``{"kind": "chunked", "chunk_size": C}``.
* ``{"kind": "dilated_window", "window": W, "dilation": D}``.
* ``{"kind": "and"|"or", "parts": [dict|None, ...]}`` and ``{"kind": "not", "part": dict|None}``
  -- ``None`` stands for a part that is not a builtin.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from .checks import check_int, tensor_argument
from .mods import Builtin, ModInfo, info_of

__all__ = [
    "MaskMod",
    "and_masks",
    "causal",
    "chunked",
    "dilated_sliding_window",
    "document",
    "document_from_lengths",
    "noop_mask",
    "not_mask",
    "or_masks",
    "padding",
    "prefix_lm",
    "sliding_window",
    "structure_of",
]

MaskMod = Callable[..., Tensor]
"""``mask_mod(b, h, q_idx, kv_idx) -> bool Tensor`` (True = the pair is visible)."""

Diagonal = str  # "top_left" | "bottom_right"


# --------------------------------------------------------------------------- validation


def _check_diagonal(
    diagonal: str, q_len: Any, kv_len: Any
) -> tuple[int, Optional[int], Optional[int]]:
    """Validate the alignment arguments; return (offset, q_len, kv_len)."""
    if diagonal not in ("top_left", "bottom_right"):
        raise ValueError(
            f"diagonal must be 'top_left' or 'bottom_right', got {diagonal!r}. Use "
            "'bottom_right' to align the last query with the last key (KV-cache decoding).")
    q_len = check_int("q_len", q_len, 0, allow_none=True)
    kv_len = check_int("kv_len", kv_len, 0, allow_none=True)
    if diagonal == "top_left":
        return 0, q_len, kv_len
    if q_len is None or kv_len is None:
        raise ValueError(
            f"diagonal='bottom_right' needs q_len and kv_len (got q_len={q_len}, "
            f"kv_len={kv_len}); pass the query and key/value sequence lengths, e.g. "
            "causal('bottom_right', q_len=1, kv_len=4096).")
    return kv_len - q_len, q_len, kv_len


def _check_callables(fn_name: str, mods: Sequence[Any]) -> None:
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(
                f"{fn_name}: argument {i} must be a mask_mod callable "
                f"(b, h, q_idx, kv_idx) -> bool tensor, got {type(mod).__name__}.")


def _as_index_tensor(name: str, value: Any, dims: tuple[int, ...]) -> Tensor:
    """Turn a list or integer tensor into an int64 tensor with one of ``dims`` dimensions."""
    return tensor_argument(name, value, dims, "int")


# --------------------------------------------------------------------------- helpers


def _register(mod: Callable[..., Tensor], name: str, structure: dict,
              factory: Callable[..., Any], *args: Any) -> MaskMod:
    """A builtin mask: ``mod`` named ``name``, described by ``structure``, pickled as
    ``factory(*args)``."""
    return Builtin(mod, name, ModInfo(structure=structure), factory, args,
                   module=__name__)


def structure_of(mod: Callable[..., Any]) -> Optional[dict]:
    """Return the structure dict of a builtin mask_mod, or None.

    None for any callable not made by this module (including wrappers made with
    ``functools.wraps``). See the module docstring for the formats.
    """
    info = info_of(mod)
    if info is None or "kind" not in info.structure:
        return None
    return info.structure  # type: ignore[return-value]


def _to_device(t: Tensor, like: Tensor) -> Tensor:
    return t if t.device == like.device else t.to(like.device)


def _all_true(q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    # Broadcast shape by hand: torch.broadcast_shapes imports torch._refs (about a second).
    qs, ks = tuple(q_idx.shape), tuple(kv_idx.shape)
    n = max(len(qs), len(ks))
    qs, ks = (1,) * (n - len(qs)) + qs, (1,) * (n - len(ks)) + ks
    shape = tuple(k if q == 1 else q for q, k in zip(qs, ks))
    return torch.ones(shape, dtype=torch.bool, device=q_idx.device)


def _band(q_idx: Tensor, kv_idx: Tensor, lo: Optional[int], hi: Optional[int]) -> Tensor:
    """Visible iff ``lo <= kv_idx - q_idx <= hi`` (None = unbounded side)."""
    if lo is None and hi is None:
        return _all_true(q_idx, kv_idx)
    if lo is None:
        return kv_idx <= q_idx + hi
    if hi is None:
        return kv_idx >= q_idx + lo
    return (kv_idx >= q_idx + lo) & (kv_idx <= q_idx + hi)


# --------------------------------------------------------------------------- builtins


def _noop(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Mask that hides nothing: all True, shaped like ``q_idx`` and ``kv_idx`` broadcast."""
    return _all_true(q_idx, kv_idx)


noop_mask: MaskMod = Builtin(_noop, "noop_mask", ModInfo(structure={"kind": "full"}),
                             module=__name__)


def causal(
    diagonal: Diagonal = "top_left",
    q_len: Optional[int] = None,
    kv_len: Optional[int] = None,
) -> MaskMod:
    """Causal mask: key ``kv_idx`` is visible from query ``q_idx`` iff ``kv_idx <= q_idx + o``.

    ``o = 0`` for ``diagonal="top_left"`` (query 0 sees key 0) and ``o = kv_len - q_len`` for
    ``"bottom_right"`` (the last query sees every key; FlashAttention's convention, used when
    the queries are the newest ``q_len`` tokens of a ``kv_len`` cache)::

        top_left, Lq = 2, Lk = 5:   1 0 0 0 0      bottom_right, Lq = 2, Lk = 5:   1 1 1 1 0
                                    1 1 0 0 0                                      1 1 1 1 1

    ``q_len``/``kv_len`` are required for bottom_right and ignored for top_left. With
    bottom_right and ``q_len > kv_len`` the first ``q_len - kv_len`` rows see nothing.
    """
    offset, q_len, kv_len = _check_diagonal(diagonal, q_len, kv_len)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx + offset

    name = "causal" if diagonal == "top_left" else f"causal_bottom_right_{q_len}_{kv_len}"
    structure = {"kind": "causal", "diagonal": diagonal, "offset": offset, "q_len": q_len,
                 "kv_len": kv_len, "band": (None, offset)}
    return _register(mask, name, structure, causal, diagonal, q_len, kv_len)


def sliding_window(
    left: Optional[int],
    right: Optional[int] = 0,
    diagonal: Diagonal = "top_left",
    q_len: Optional[int] = None,
    kv_len: Optional[int] = None,
) -> MaskMod:
    """Local attention: visible iff ``q' - left <= kv_idx <= q' + right``.

    ``q' = q_idx + o`` is the aligned query position (``o`` as in :func:`causal`). ``None`` for
    a side means unbounded, so ``sliding_window(None, 0)`` is causal and
    ``sliding_window(None, None)`` hides nothing. This is FlashAttention's
    ``window_size=(left, right)`` (which spells unbounded as -1) with ``diagonal="bottom_right"``::

        sliding_window(2, 0), L = 5:   1 0 0 0 0      sliding_window(1, 1), L = 5:   1 1 0 0 0
                                       1 1 0 0 0                                     1 1 1 0 0
                                       1 1 1 0 0                                     0 1 1 1 0
                                       0 1 1 1 0                                     0 0 1 1 1
                                       0 0 1 1 1                                     0 0 0 1 1
    """
    fix = "Use None for an unbounded side."
    left = check_int("left", left, 0, allow_none=True, fix=fix)
    right = check_int("right", right, 0, allow_none=True, fix=fix)
    offset, q_len, kv_len = _check_diagonal(diagonal, q_len, kv_len)
    lo = None if left is None else offset - left
    hi = None if right is None else offset + right

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return _band(q_idx, kv_idx, lo, hi)

    name = f"sliding_window_{'none' if left is None else left}_{'none' if right is None else right}"
    if diagonal == "bottom_right":
        name += f"_bottom_right_{q_len}_{kv_len}"
    structure = {"kind": "window", "left": left, "right": right, "diagonal": diagonal,
                 "offset": offset, "q_len": q_len, "kv_len": kv_len, "band": (lo, hi)}
    return _register(mask, name, structure, sliding_window, left, right, diagonal, q_len,
                     kv_len)


def prefix_lm(prefix_len: int) -> MaskMod:
    """Prefix-LM: causal, plus every query sees the first ``prefix_len`` keys.

    Visible iff ``kv_idx <= q_idx or kv_idx < prefix_len`` (bidirectional over the prefix)::

        prefix_lm(2), L = 4:   1 1 0 0
                               1 1 0 0
                               1 1 1 0
                               1 1 1 1
    """
    prefix_len = check_int("prefix_len", prefix_len, 0)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < prefix_len)

    return _register(mask, f"prefix_lm_{prefix_len}",
                     {"kind": "prefix_lm", "prefix_len": prefix_len}, prefix_lm, prefix_len)


def document(doc_ids_q: Tensor, doc_ids_kv: Optional[Tensor] = None) -> MaskMod:
    """Packed sequences: visible iff the query and the key belong to the same document.

    ``doc_ids_q[i]`` is the document id of query position ``i`` (1-D ``(Lq,)``, shared by the
    whole batch) or ``doc_ids_q[b, i]`` (2-D ``(B, Lq)``, one row per batch element).
    ``doc_ids_kv`` defaults to ``doc_ids_q`` (self-attention). Combine with :func:`causal`
    through :func:`and_masks` for causal packing::

        ids = [0, 0, 1, 1, 1]:   1 1 0 0 0
                                 1 1 0 0 0
                                 0 0 1 1 1
                                 0 0 1 1 1
                                 0 0 1 1 1
    """
    ids_q = _as_index_tensor("doc_ids_q", doc_ids_q, (1, 2))
    ids_kv = ids_q if doc_ids_kv is None else _as_index_tensor("doc_ids_kv", doc_ids_kv, (1, 2))
    if ids_q.dim() != ids_kv.dim():
        raise ValueError(
            f"doc_ids_q is {ids_q.dim()}-D and doc_ids_kv is {ids_kv.dim()}-D; pass both as "
            "(L,) or both as (B, L).")
    if ids_q.dim() == 2 and ids_q.shape[0] != ids_kv.shape[0]:
        raise ValueError(
            f"doc_ids_q has batch size {ids_q.shape[0]} and doc_ids_kv has {ids_kv.shape[0]}; "
            "2-D document ids need one row per batch element in both.")
    batched = ids_q.dim() == 2

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        iq = _to_device(ids_q, q_idx)
        ik = _to_device(ids_kv, kv_idx)
        if batched:
            return iq[b, q_idx] == ik[b, kv_idx]
        return iq[q_idx] == ik[kv_idx]

    lq, lk = ids_q.shape[-1], ids_kv.shape[-1]
    name = f"document_{lq}" if doc_ids_kv is None else f"document_{lq}_{lk}"
    if batched:
        name += f"_B{ids_q.shape[0]}"
    return _register(mask, name, {"kind": "document", "doc_ids_q": ids_q, "doc_ids_kv": ids_kv},
                     document, ids_q, None if doc_ids_kv is None else ids_kv)


def document_from_lengths(lengths: Union[Sequence[int], Tensor]) -> MaskMod:
    """:func:`document` mask for documents of the given lengths packed back to back.

    ``document_from_lengths([2, 3])`` gives ids ``[0, 0, 1, 1, 1]`` (total length 5).
    """
    lengths_t = _as_index_tensor("lengths", lengths, (1,))
    if bool((lengths_t < 0).any()):
        raise ValueError(
            f"lengths must be non-negative, got {lengths_t.tolist()}; drop or zero the "
            "negative entries.")
    ids = torch.repeat_interleave(
        torch.arange(lengths_t.numel(), dtype=torch.int64, device=lengths_t.device), lengths_t)
    structure = dict(structure_of(document(ids)), lengths=lengths_t)
    name = f"document_from_lengths_{lengths_t.numel()}docs_{ids.numel()}"
    return _register(document(ids)._fn, name, structure, document_from_lengths, lengths_t)


def padding(seqlens_q: Union[Sequence[int], Tensor],
            seqlens_kv: Union[Sequence[int], Tensor]) -> MaskMod:
    """Right padding: visible iff ``q_idx < seqlens_q[b] and kv_idx < seqlens_kv[b]``.

    ``seqlens_q`` and ``seqlens_kv`` are ``(B,)`` integer tensors (or lists) of the real
    lengths of each batch element. Query rows past ``seqlens_q[b]`` see nothing (attnkit
    returns 0 for such rows).
    """
    sq = _as_index_tensor("seqlens_q", seqlens_q, (1,))
    sk = _as_index_tensor("seqlens_kv", seqlens_kv, (1,))
    if sq.shape != sk.shape:
        raise ValueError(
            f"seqlens_q has shape {tuple(sq.shape)} and seqlens_kv has {tuple(sk.shape)}; "
            "both must be (B,), one length per batch element.")
    if bool((sq < 0).any()) or bool((sk < 0).any()):
        raise ValueError("seqlens_q and seqlens_kv must be non-negative.")

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx < _to_device(sq, b)[b]) & (kv_idx < _to_device(sk, b)[b])

    return _register(mask, f"padding_B{sq.numel()}",
                     {"kind": "padding", "seqlens_q": sq, "seqlens_kv": sk}, padding, sq, sk)


def chunked(chunk_size: int) -> MaskMod:
    """Chunked causal attention (Llama-4 style local chunks).

    Visible iff ``q_idx // chunk_size == kv_idx // chunk_size and kv_idx <= q_idx``::

        chunked(2), L = 4:   1 0 0 0
                             1 1 0 0
                             0 0 1 0
                             0 0 1 1
    """
    chunk_size = check_int("chunk_size", chunk_size, 1)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx // chunk_size == kv_idx // chunk_size) & (kv_idx <= q_idx)

    return _register(mask, f"chunked_{chunk_size}",
                     {"kind": "chunked", "chunk_size": chunk_size}, chunked, chunk_size)


def dilated_sliding_window(window: int, dilation: int) -> MaskMod:
    """Causal dilated window: every ``dilation``-th key, ``window`` keys in all.

    With ``d = q_idx - kv_idx``: visible iff ``d >= 0``, ``d % dilation == 0`` and
    ``d // dilation < window``. ``dilation=1`` is ``sliding_window(window - 1, 0)``::

        dilated_sliding_window(2, 2), L = 5:   1 0 0 0 0
                                               0 1 0 0 0
                                               1 0 1 0 0
                                               0 1 0 1 0
                                               0 0 1 0 1
    """
    window = check_int("window", window, 1, fix="A window of w keeps w keys (the query's own "
                        "position included).")
    dilation = check_int("dilation", dilation, 1, fix="dilation=1 means no gaps.")
    reach = window * dilation

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = q_idx - kv_idx
        return (d >= 0) & (d < reach) & (d % dilation == 0)

    return _register(mask, f"dilated_sliding_window_{window}_{dilation}",
                     {"kind": "dilated_window", "window": window, "dilation": dilation},
                     dilated_sliding_window, window, dilation)


# --------------------------------------------------------------------------- algebra


def and_masks(*mods: MaskMod) -> MaskMod:
    """Intersection: visible iff every mod says visible. No mods: all visible."""
    _check_callables("and_masks", mods)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if not mods:
            return _all_true(q_idx, kv_idx)
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            out = out & mod(b, h, q_idx, kv_idx)
        return out

    name = "and(" + ",".join(getattr(m, "__name__", type(m).__name__) for m in mods) + ")"
    return _register(mask, name, {"kind": "and", "parts": [structure_of(m) for m in mods]},
                     and_masks, *mods)


def or_masks(*mods: MaskMod) -> MaskMod:
    """Union: visible iff any mod says visible. No mods: nothing visible."""
    _check_callables("or_masks", mods)

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if not mods:
            return ~_all_true(q_idx, kv_idx)
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            out = out | mod(b, h, q_idx, kv_idx)
        return out

    name = "or(" + ",".join(getattr(m, "__name__", type(m).__name__) for m in mods) + ")"
    return _register(mask, name, {"kind": "or", "parts": [structure_of(m) for m in mods]},
                     or_masks, *mods)


def not_mask(mod: MaskMod) -> MaskMod:
    """Complement: visible iff ``mod`` says hidden."""
    _check_callables("not_mask", (mod,))

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ~mod(b, h, q_idx, kv_idx)

    name = f"not({getattr(mod, '__name__', type(mod).__name__)})"
    return _register(mask, name, {"kind": "not", "part": structure_of(mod)}, not_mask, mod)
