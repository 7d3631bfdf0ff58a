"""``attn_implementation="attnkit"`` for Hugging Face transformers (5.x).

Importing this module registers attnkit with transformers (:func:`register`), after which any
model that dispatches through ``AttentionInterface`` runs on attnkit::

    import attnkit.integrations.transformers  # noqa: F401  (registers "attnkit")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")

Two functions are registered under the same name:

- :func:`attnkit_mask` in ``AttentionMaskInterface``. transformers' ``create_causal_mask``,
  ``create_sliding_window_causal_mask``, ``create_bidirectional_mask`` (and the other
  ``create_*_mask`` functions) call it once per forward with the batch size, the query and key
  lengths and offsets, the mask pattern (``mask_function``) and the 2-D padding mask. It returns
  a :class:`MaskDescription`, a compact description (a band of diagonals, the padding as lengths
  or a ``(B, Lk)`` key mask, packed-sequence ids), not an ``Lq x Lk`` tensor. Only a pattern it
  does not recognise (a model's own ``or_mask_function``, chunked attention, blockwise overlays)
  is built densely, by transformers' own ``sdpa_mask``, so it is always right.
- :func:`attnkit_attention_forward` in ``AttentionInterface``: the attention call each layer
  makes, ``(module, query, key, value, attention_mask, scaling, dropout, **kwargs)`` with query
  ``(B, Hq, Lq, D)`` and key/value ``(B, Hkv, Lk, D)`` (grouped-query attention is native, no
  repeat); it returns the output ``(B, Lq, Hq, D)`` contiguous and the attention weights (only
  when ``output_attentions`` is requested, else None).

Registering both matters: transformers hands an attention implementation that has no mask
function ``attention_mask=None`` (``_preprocess_mask_arguments`` exits early for names missing
from ``AttentionMaskInterface``), so a padded batch would silently attend to its padding.

What each transformers pattern becomes (see :meth:`MaskDescription.lowered` for the exact
options of a call):

===================================== =======================================================
transformers                          attnkit
===================================== =======================================================
causal, no cache / DynamicCache        ``causal=True`` (``diagonal="bottom_right"`` when
                                       Lq < Lk: cached decoding and chunked prefill)
sliding window (Mistral, Gemma 2/3,    ``window=(sliding_window - 1, 0)`` with the same
Qwen, Phi-3, gpt-oss)                  diagonal; a sliding cache's key offset is folded in
bidirectional (BERT, ModernBERT)       no mask; ModernBERT's local layers ``window=(w, w)``
StaticCache (keys past the seen        the unused tail of the cache is cut off, then as above
tokens)
right padding                          ``seqlens_kv`` (the real lengths)
left padding                           ``starts_kv`` (each row's first real key)
padding on both sides                  ``starts_kv`` and ``seqlens_kv`` (one span per row)
any other padding                      a ``(B, 1, 1, Lk)`` bool key mask
packed sequences (``position_ids``     ``mask=attnkit.masks.document(ids)``, the ids per batch
restarts)                              row where rows differ (absorbed as segments, no dense
                                       mask)
packed inputs (``cu_seq_lens_q/k``)    :func:`attnkit.varlen_attention`
softcap (Gemma 2)                      ``softcap``
``s_aux`` sinks (gpt-oss)              ``sinks`` (with their gradient)
``position_bias`` (T5)                 ``bias`` (with its gradient)
dropout while training                 ``dropout_p`` (attnkit draws the Philox seed from
                                       torch's generator; the backward replays it)
``output_attentions``                  ``return_weights=True``
a 4-D bool / float mask given by the   ``mask`` / ``bias`` as given
user
an unrecognised ``mask_function``      transformers' dense bool mask
===================================== =======================================================

Padded query rows keep transformers' semantics: a padded query still attends to the real keys
it may see (as in "sdpa" and "eager"), so attnkit does not pass ``seqlens_q`` and the logits
match at every position. A query row that sees no key at all (left padding in a causal model)
gives 0, as "sdpa" does ("eager" gives the mean of V there).

Continuous batching (``generate_batch`` / ``PagedAttentionCache``) cannot reach attnkit, and
its pages cannot reach :func:`attnkit.paged_attention_blocks`, for reasons inside transformers
(checked in 5.24, ``generation/continuous_batching``), none of which this module can change:

1. ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` accepts only ``"paged|eager"``,
   ``"sdpa"`` or a name containing ``"flash"`` and raises ``ValueError`` for every other
   registered implementation. A name containing ``"flash"`` would make transformers treat
   attnkit as FlashAttention everywhere (``is_flash_attention_requested``: no attention masks
   built, FlashAttention keywords), which is why :func:`register` refuses such names.
2. The pages themselves reach an attention function only on the "decode fast path"
   (``block_table`` with the ``k_cache``/``v_cache`` page views), which
   ``ensure_decode_fast_path_is_available`` turns on only for FlashAttention 2/3 on CUDA (or
   FlashAttention 2 on XPU), after importing that implementation's ``flash_attn_with_kvcache``.
   Everywhere else, the CPU included, ``PagedAttentionCache.update`` writes the new tokens and
   gathers every request's keys with ``index_select`` (``read_index``): the attention function
   receives contiguous packed K/V, not pages.
3. On that fast path the kernel is expected to write the new tokens into the pages itself
   (``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=...)``), which
   :func:`attnkit.paged_attention_blocks` (a reader of that page layout) does not do.

What does reach this function, were transformers to allow the name, is the gathered packed
form (query ``(1, Hq, T, D)``, keys gathered per request, ``cu_seq_lens_q/k``), which it runs as
:func:`attnkit.varlen_attention` with a bottom-right diagonal per request (tested); a call
with a ``block_table`` raises ``NotImplementedError`` rather than attend to pages without the
new tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

import attnkit
from attnkit import masks as _masks

try:
    import transformers
    from transformers import AttentionInterface
    from transformers import masking_utils as _mu
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as _err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "attnkit.integrations.transformers needs transformers>=5; install it with "
        "pip install 'attnkit[transformers]'") from _err

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover
    raise ImportError(
        f"attnkit.integrations.transformers needs transformers>=5; found "
        f"{transformers.__version__}. Upgrade with pip install 'attnkit[transformers]'")

__all__ = ["NAME", "MaskDescription", "attnkit_attention_forward", "attnkit_mask", "register"]

#: The ``attn_implementation`` name registered on import.
NAME = "attnkit"

#: Names transformers gives a meaning of its own; :func:`register` refuses them.
_RESERVED = ("eager", "sdpa", "flex_attention")


# ---- the description the mask function returns ----------------------------------------------


@dataclass(frozen=True)
class Lowered:
    """How one :class:`MaskDescription` runs: one :func:`attnkit.attention` call that reads
    keys ``kv_start:kv_stop`` (the others are hidden from every query: a static cache's unused
    tail, keys that slid out of a window); ``options`` are the attnkit keywords that carry the
    mask on those keys."""

    kv_start: int
    kv_stop: int
    options: Dict[str, Any]


@dataclass
class MaskDescription:
    """The mask of one ``create_*_mask`` call, described instead of materialised.

    Query ``i`` (``0 <= i < q_length``) may see key ``j`` (``0 <= j < kv_length``) iff

    - ``lo <= j - i <= hi`` (the band; ``None`` = unbounded side; causal is ``hi = q_offset -
      kv_offset``, a sliding window adds ``lo``), and
    - ``keys[b, j]`` (padding; ``None`` = no padding), and
    - ``documents[b, i] == documents[b, j]`` (packed sequences; ``None`` = one sequence),

    unless ``dense`` (a ``(B, 1, Lq, Lk)`` bool tensor from transformers' ``sdpa_mask``) is set,
    which then says it all (``reason`` says why). ``padding`` classifies ``keys``: ``"right"``
    (``seqlens``), ``"left"`` (``starts``), ``"both"`` (``starts`` and ``seqlens``: one span per
    row), ``"keys"`` (anything else) or None; ``kv_used`` is the
    number of leading keys any query may see (a ``StaticCache``'s unused tail is cut off).
    """

    batch_size: int
    q_length: int
    kv_length: int
    lo: Optional[int] = None
    hi: Optional[int] = None
    keys: Optional[Tensor] = None
    padding: Optional[str] = None
    seqlens: Optional[Tensor] = None
    starts: Optional[Tensor] = None
    kv_used: int = 0
    documents: Optional[Tensor] = None
    dense: Optional[Tensor] = None
    reason: str = ""
    _cache: Dict[Any, Lowered] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.kv_used:
            self.kv_used = self.kv_length

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """The shape the dense mask would have, ``(B, 1, Lq, Lk)``."""
        return (self.batch_size, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        """4, as the dense mask: ``generate`` prepares masks ahead for compileable caches and the
        model then hands them to ``create_*_mask`` again, which reads ``ndim``; the mask
        function passes a description it is given through unchanged."""
        return 4

    def __repr__(self) -> str:
        if self.dense is not None:
            return f"MaskDescription(shape={self.shape}, dense: {self.reason})"
        parts = [f"shape={self.shape}", f"band=({self.lo}, {self.hi})"]
        if self.padding is not None:
            parts.append(f"padding={self.padding}")
        if self.kv_used != self.kv_length:
            parts.append(f"kv_used={self.kv_used}")
        if self.documents is not None:
            parts.append("documents")
        return "MaskDescription(" + ", ".join(parts) + ")"

    def to_dense(self) -> Tensor:
        """The ``(B, 1, Lq, Lk)`` bool mask this describes (True = may attend), for checks and
        for the calls that need it."""
        if self.dense is not None:
            return self.dense
        ref = self.keys if self.keys is not None else self.documents
        device = ref.device if ref is not None else torch.device("cpu")
        i = torch.arange(self.q_length, device=device).view(1, 1, -1, 1)
        j = torch.arange(self.kv_length, device=device).view(1, 1, 1, -1)
        vis = torch.ones(1, 1, self.q_length, self.kv_length, dtype=torch.bool, device=device)
        if self.lo is not None:
            vis = vis & (j - i >= self.lo)
        if self.hi is not None:
            vis = vis & (j - i <= self.hi)
        if self.keys is not None:
            full = torch.zeros(self.batch_size, self.kv_length, dtype=torch.bool, device=device)
            full[:, :self.keys.shape[1]] = self.keys
            vis = vis & full.view(self.batch_size, 1, 1, -1)
        elif self.kv_used < self.kv_length:
            vis = vis & (j < self.kv_used)
        if self.documents is not None:
            d = self.documents
            vis = vis & (d[:, None, :, None] == d[:, None, None, :])
        return vis.expand(self.batch_size, 1, self.q_length, self.kv_length)

    def lowered(self) -> Lowered:
        """The attnkit call this mask becomes (computed once, shared by every layer)."""
        key = "lowered"
        if key not in self._cache:
            self._cache[key] = _lower(self)
        return self._cache[key]


# ---- recognising transformers' mask functions ------------------------------------------------


@dataclass(frozen=True)
class _Pattern:
    """A recognised ``mask_function``: visible iff ``lo <= kv_idx - q_idx <= hi`` (absolute
    positions) and, with ``documents``, within one packed sequence. ``remapped``: the band was
    evaluated on ``position_ids``, which is the same thing within a packed sequence only."""

    lo: Optional[int] = None
    hi: Optional[int] = None
    documents: Optional[Tensor] = None
    remapped: bool = False


def _closure(fn: Callable) -> Dict[str, Any]:
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except (TypeError, ValueError):
        return {}


def _int(x: Any) -> Optional[int]:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, Tensor) and x.numel() == 1 and not x.dtype.is_floating_point:
        return int(x)
    return None


def _intersect(a: _Pattern, b: _Pattern) -> Optional[_Pattern]:
    if a.documents is not None and b.documents is not None and a.documents is not b.documents:
        return None
    lo = a.lo if b.lo is None else (b.lo if a.lo is None else max(a.lo, b.lo))
    hi = a.hi if b.hi is None else (b.hi if a.hi is None else min(a.hi, b.hi))
    docs = a.documents if a.documents is not None else b.documents
    return _Pattern(lo, hi, docs, a.remapped or b.remapped)


def _recognise(fn: Any) -> Optional[_Pattern]:
    """The pattern of one of transformers' own mask functions (and of ANDs of them), or None."""
    if fn is _mu.causal_mask_function:
        return _Pattern(None, 0)
    if fn is _mu.bidirectional_mask_function:
        return _Pattern()
    if not callable(fn) or getattr(fn, "__module__", None) != _mu.__name__:
        return None
    qual = getattr(fn, "__qualname__", "")
    cells = _closure(fn)
    if qual == "and_masks.<locals>.and_mask":
        parts = cells.get("mask_functions")
        if not isinstance(parts, tuple):
            return None
        acc: Optional[_Pattern] = _Pattern()
        for part in parts:
            p = _recognise(part)
            if p is None or acc is None:
                return None
            acc = _intersect(acc, p)
        return acc
    if qual == "sliding_window_overlay.<locals>.inner_mask":
        sw = _int(cells.get("sliding_window"))  # kv_idx > q_idx - sw
        return None if sw is None else _Pattern(1 - sw, None)
    if qual == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
        sw = _int(cells.get("sliding_window"))  # |q_idx - kv_idx| <= sw
        return None if sw is None else _Pattern(-sw, sw)
    if qual == "packed_sequence_mask_function.<locals>.inner_mask":
        ids = cells.get("packed_sequence_mask")
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            return None
        return _Pattern(documents=ids)
    if qual == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        inner = _recognise(cells.get("mask_function"))
        if inner is None or inner.documents is not None:
            return None
        return _Pattern(inner.lo, inner.hi, None, True)
    return None


def _codes(fn: Any, depth: int = 0) -> Optional[tuple]:
    """The code objects of ``fn`` and of the mask functions it closes over (what a recognised
    mask function is made of; transformers makes new closures of the same code every call),
    or None where one has none."""
    code = getattr(fn, "__code__", None)
    if code is None or depth > 8:
        return None
    cells = _closure(fn)
    parts = cells.get("mask_functions", ())
    inner = cells.get("mask_function")
    nested = tuple(parts) + ((inner,) if callable(inner) else ())
    sub = tuple(_codes(part, depth + 1) for part in nested)
    return None if any(x is None for x in sub) else (code, sub)


#: _probe_agrees' verdicts by (mask function code, pattern): a transformers version's helpers
#: mean one thing in a process, so each form is probed once, not at every decoding step
_PROBED: Dict[tuple, bool] = {}


def _probe_agrees(fn: Callable, pattern: _Pattern, batch: int, lq: int, lk: int, q_off: int,
                  kv_off: int, device: Any) -> bool:
    """Evaluate ``fn`` on a few rows and on the columns around the band's edges and compare
    with ``pattern``: a guard against a transformers version whose helpers changed meaning.
    The verdict is kept for the function's form (its code objects and the pattern's band)."""
    codes = _codes(fn)
    key = None if codes is None else (codes, pattern.lo, pattern.hi,
                                      pattern.documents is None, pattern.remapped)
    if key is not None and key in _PROBED:
        return _PROBED[key]
    agrees = _probe(fn, pattern, batch, lq, lk, q_off, kv_off, device)
    if key is not None:
        if len(_PROBED) > 256:
            _PROBED.clear()
        _PROBED[key] = agrees
    return agrees


def _probe(fn: Callable, pattern: _Pattern, batch: int, lq: int, lk: int, q_off: int,
           kv_off: int, device: Any) -> bool:
    d = q_off - kv_off
    rows = sorted({r for r in (0, 1, lq // 2, lq - 2, lq - 1) if 0 <= r < lq})
    cols = {0, 1, lk // 2, lk - 2, lk - 1}
    for r in rows:
        for edge in (pattern.lo, pattern.hi):
            if edge is not None:
                cols.update(r + edge + d + t for t in (-1, 0, 1))
    cols_l = sorted(c for c in cols if 0 <= c < lk)
    if not rows or not cols_l:
        return True
    r_t = torch.tensor(rows, device=device)
    c_t = torch.tensor(cols_l, device=device)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    try:
        got = fn(b, h, r_t.view(1, 1, -1, 1) + q_off, c_t.view(1, 1, 1, -1) + kv_off)
        got = torch.as_tensor(got, device=device).to(torch.bool).expand(
            batch, 1, len(rows), len(cols_l))
    except Exception:  # noqa: BLE001 - any failure means: do not trust the pattern
        return False
    diff = c_t.view(1, 1, 1, -1) - r_t.view(1, 1, -1, 1) - d
    want = torch.ones_like(got)
    if pattern.lo is not None:
        want = want & (diff >= pattern.lo)
    if pattern.hi is not None:
        want = want & (diff <= pattern.hi)
    if pattern.documents is not None:
        ids = pattern.documents.to(device)
        if ids.shape[0] != batch:
            ids = ids.expand(batch, -1)
        want = want & (ids[:, None, rows, None] == ids[:, None, None, cols_l])
    return bool(torch.equal(got, want))


# ---- padding -----------------------------------------------------------------------------------


def _key_padding(attention_mask: Optional[Tensor], batch: int, kv_length: int,
                 kv_offset: int) -> Optional[Tensor]:
    """``keys[b, j]``: may key ``j`` (0-based in this call) be seen, from the 2-D padding mask
    over absolute positions (shorter masks are padded with False, as transformers does)."""
    if attention_mask is None:
        return None
    m = attention_mask.to(torch.bool)
    if m.dim() != 2:
        raise ValueError(f"attention_mask must be the 2-D (batch, positions) padding mask here; "
                         f"got shape {tuple(m.shape)}")
    need = kv_offset + kv_length
    if m.shape[-1] < need:
        m = torch.nn.functional.pad(m, (0, need - m.shape[-1]), value=False)
    m = m[:, kv_offset:need]
    if m.shape[0] != batch:
        m = m.expand(batch, -1)
    return m


def _classify_keys(keys: Optional[Tensor], kv_length: int) -> Dict[str, Any]:
    """Right padding (lengths), left padding (starts), both (one span of real keys per row:
    starts and ends) or a general key mask; the unused tail that no row sees is cut off
    (``kv_used``)."""
    if keys is None or bool(keys.all()):
        return {"keys": None, "padding": None, "kv_used": kv_length}
    seen = keys.any(0).nonzero()
    kv_used = max(int(seen[-1]) + 1 if seen.numel() else 1, 1)
    keys = keys[:, :kv_used]
    if bool(keys.all()):
        return {"keys": None, "padding": None, "kv_used": kv_used}
    lengths = keys.sum(-1)
    ar = torch.arange(kv_used, device=keys.device)
    out: Dict[str, Any] = {"keys": keys, "kv_used": kv_used}
    if torch.equal(keys, ar < lengths[:, None]):
        out.update(padding="right", seqlens=lengths)
    elif torch.equal(keys, ar >= (kv_used - lengths)[:, None]):
        out.update(padding="left", starts=kv_used - lengths)
    else:
        first = keys.to(torch.uint8).argmax(-1)  # each row's first real key (0 for none)
        ends = first + lengths
        if torch.equal(keys, (ar >= first[:, None]) & (ar < ends[:, None])):
            out.update(padding="both", starts=first, seqlens=ends)  # one span per row
        else:
            out.update(padding="keys")
    return out


# ---- the mask function ----------------------------------------------------------------------


def attnkit_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                 kv_offset: Any = 0, mask_function: Callable = _mu.causal_mask_function,
                 attention_mask: Optional[Tensor] = None, use_vmap: bool = False,
                 device: Any = "cpu", **kwargs: Any) -> MaskDescription:
    """The mask function registered in ``AttentionMaskInterface`` for ``"attnkit"``.

    Takes what transformers' ``create_*_mask`` functions pass every mask function
    (``batch_size``, ``q_length``, ``kv_length``, ``q_offset``, ``kv_offset``, ``mask_function``,
    the 2-D ``attention_mask`` padding mask, ``use_vmap``, ``device``; the rest, such as
    ``local_size``, ``allow_is_causal_skip``, ``dtype`` and ``config``, is not needed) and returns a
    :class:`MaskDescription`. Never returns None: every call carries its padding.
    """
    if isinstance(attention_mask, MaskDescription):  # prepared ahead by generate
        return attention_mask
    q_off, kv_off = int(q_offset), int(kv_offset)
    keys = _key_padding(attention_mask, batch_size, kv_length, kv_off)
    pattern = _recognise(mask_function)
    why = "" if pattern is not None else "mask_function not recognised"
    if pattern is not None and pattern.remapped and pattern.documents is None:
        pattern, why = None, "positions remapped without packed sequences"
    if pattern is not None and pattern.documents is not None and (
            q_off or kv_off or q_length != kv_length
            or tuple(pattern.documents.shape[-1:]) != (q_length,) or keys is not None):
        pattern, why = None, "packed sequences with a cache or padding"
    if pattern is not None and not _probe_agrees(mask_function, pattern, batch_size, q_length,
                                                 kv_length, q_off, kv_off, device):
        pattern, why = None, "mask_function disagrees with its recognised pattern"
    if pattern is None:
        dense = _mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                              q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                              attention_mask=attention_mask, allow_is_causal_skip=False,
                              allow_is_bidirectional_skip=False, use_vmap=use_vmap,
                              device=device)
        return MaskDescription(batch_size, q_length, kv_length, dense=dense, reason=why)
    d = q_off - kv_off  # absolute kv - q = local j - i - d
    docs = pattern.documents
    if docs is not None and docs.shape[0] != batch_size:
        docs = docs.expand(batch_size, -1)
    return MaskDescription(
        batch_size, q_length, kv_length,
        lo=None if pattern.lo is None else pattern.lo + d,
        hi=None if pattern.hi is None else pattern.hi + d,
        documents=docs, **_classify_keys(keys, kv_length))


# ---- from a description to attnkit's options ----------------------------------------------------


def _window(left: Optional[int], right: Optional[int], diagonal: str) -> Dict[str, Any]:
    opts: Dict[str, Any] = ({"causal": True} if left is None and right == 0
                            else {"window": (left, right)})
    if diagonal != "top_left":
        opts["diagonal"] = diagonal
    return opts


def _band_options(lo: Optional[int], hi: Optional[int], lq: int, lk: int,
                  bottom_right: bool) -> Optional[Dict[str, Any]]:
    """attnkit options for ``lo <= j - i <= hi`` on an (lq, lk) grid, or None when attnkit's
    windows (sides >= 0 around the top-left or bottom-right diagonal) cannot say it."""
    if hi is not None and hi >= lk - 1:
        hi = None  # j - i <= lk - 1 always
    if lo is not None and lo <= -(lq - 1):
        lo = None
    if lo is None and hi is None:
        return {}
    if lo is not None and hi is not None and lo > hi:
        return None
    if bottom_right and lq != lk:
        o = lk - lq
        left = None if lo is None else o - lo
        right = None if hi is None else hi - o
        if (left is None or left >= 0) and (right is None or right >= 0):
            return _window(left, right, "bottom_right")
    if (lo is None or lo <= 0) and (hi is None or hi >= 0):
        return _window(None if lo is None else -lo, hi, "top_left")
    return None


def _dense(desc: MaskDescription) -> Lowered:
    return Lowered(0, desc.kv_length, {"mask": desc.to_dense()})


def _on_keys(desc: MaskDescription, start: int, stop: int,
             bottom_right: bool) -> Optional[Lowered]:
    """The options for keys ``start:stop`` (band shifted by ``start``), or None."""
    keys = None if desc.keys is None else desc.keys[:, start:stop]
    cls = _classify_keys(keys, stop - start)
    stop = start + cls["kv_used"]
    lo = None if desc.lo is None else desc.lo - start
    hi = None if desc.hi is None else desc.hi - start
    # (with real lengths, attnkit's bottom-right diagonal would move to each row's end)
    band = _band_options(lo, hi, desc.q_length, stop - start,
                         bottom_right=bottom_right and cls["padding"] not in ("right", "both"))
    if band is None:
        return None
    opts = dict(band)
    if cls["padding"] == "right":
        opts["seqlens_kv"] = cls["seqlens"]
    elif cls["padding"] == "left":
        opts["starts_kv"] = cls["starts"]  # the planner skips the padded key blocks
    elif cls["padding"] == "both":
        opts.update(starts_kv=cls["starts"], seqlens_kv=cls["seqlens"])
    elif cls["padding"] == "keys":
        opts["mask"] = cls["keys"][:, None, None, :]
    return Lowered(start, stop, opts)


def _lower(desc: MaskDescription) -> Lowered:
    if desc.dense is not None:
        return Lowered(0, desc.kv_length, {"mask": desc.dense})
    lq, lk = desc.q_length, desc.kv_used
    if desc.documents is not None:  # (no cache, no padding: Lq == Lk, offsets 0)
        band = _band_options(desc.lo, desc.hi, lq, lk, bottom_right=False)
        if band is None or desc.padding is not None:
            return _dense(desc)
        ids = desc.documents  # (B, L): one row of ids per batch row, unless they all agree
        if bool((ids == ids[:1]).all()):
            ids = ids[0]
        return Lowered(0, lk, {"mask": _masks.document(ids), **band})
    stop = lk if desc.hi is None else max(1, min(lk, lq + desc.hi))  # keys past the band
    low = _on_keys(desc, 0, stop, bottom_right=True)
    if low is None and desc.lo is not None and 0 < desc.lo < stop:
        # keys before the band's first diagonal are seen by no query: drop them, and the band
        # starts at the top-left diagonal (right padding then stays lengths)
        low = _on_keys(desc, desc.lo, stop, bottom_right=False)
    return _dense(desc) if low is None else low


# ---- the attention function -------------------------------------------------------------------


def _describe_plain(module: Any, batch: int, lq: int, lk: int, kwargs: Dict[str, Any],
                    keys: Optional[Tensor] = None) -> MaskDescription:
    """A description from the module alone (no mask from transformers' mask functions): causal
    per ``is_causal`` (the keyword, else ``module.is_causal``) with the bottom-right diagonal
    (queries are the newest tokens), ``sliding_window`` as the module passes it (FlashAttention's
    convention: ``sliding_window - 1`` keys on each side)."""
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False) if causal is None else causal)
    lo: Optional[int] = None
    hi: Optional[int] = (lk - lq) if causal else None
    sw = _int(kwargs.get("sliding_window"))
    if sw is not None and sw > 0:
        lo = (lk - lq) - (sw - 1)
        if not causal:
            hi = (lk - lq) + (sw - 1)
    return MaskDescription(batch, lq, lk, lo=lo, hi=hi, **_classify_keys(keys, lk))


def _from_cu_seqlens(query: Tensor, key: Tensor,
                     kwargs: Dict[str, Any]) -> Optional[Tuple[Tensor, Tensor]]:
    """``cu_seq_lens_q`` / ``cu_seq_lens_k`` (a flattening collator or continuous batching) when
    they describe this call's batch-1 packed query and keys."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if not (isinstance(cu_q, Tensor) and isinstance(cu_k, Tensor)) or query.shape[0] != 1:
        return None
    if int(cu_q[-1]) != query.shape[2] or int(cu_k[-1]) != key.shape[2]:
        return None
    return cu_q.to(torch.int64), cu_k.to(torch.int64)


def _plain(desc: MaskDescription) -> bool:
    """No padding, documents or dense mask: only a band, which packed inputs' own boundaries
    (``cu_seq_lens_*``) refine."""
    return desc.dense is None and desc.documents is None and desc.padding is None


def _cu_band(module: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Per-sequence options for packed inputs given by ``cu_seq_lens_q/k``: causal per
    ``is_causal`` with each sequence's bottom-right diagonal (its queries are its newest tokens),
    and ``sliding_window`` in FlashAttention's convention (``sliding_window - 1`` keys a side)."""
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False) if causal is None else causal)
    sw = _int(kwargs.get("sliding_window"))
    if sw is not None and sw > 0:
        return {"window": (sw - 1, 0 if causal else sw - 1), "diagonal": "bottom_right"}
    return {"causal": True, "diagonal": "bottom_right"} if causal else {}


def _wants_weights(module: Any, kwargs: Dict[str, Any]) -> bool:
    flag = kwargs.get("output_attentions")
    if flag is None:
        flag = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(flag)


def _varlen(query: Tensor, key: Tensor, value: Tensor, cu_q: Tensor, cu_k: Tensor,
            options: Dict[str, Any], common: Dict[str, Any]) -> Tensor:
    """Packed attention over the flattened batch; returns ``(B, Lq, Hq, Dv)``."""
    b, hq, lq, _ = query.shape
    q = query.transpose(1, 2).reshape(b * lq, hq, -1)
    k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[-1])
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[-1])
    out = attnkit.varlen_attention(q, k, v, cu_q, cu_k, **options, **common)
    return out.reshape(b, lq, hq, -1)


def attnkit_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                              attention_mask: Any, scaling: Optional[float] = None,
                              dropout: float = 0.0,
                              **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """The attention function registered in ``AttentionInterface`` for ``"attnkit"``.

    ``query (B, Hq, Lq, D)``, ``key``/``value (B, Hkv, Lk, D)``; ``attention_mask`` is what
    :func:`attnkit_mask` returned (a :class:`MaskDescription`), or what a caller passed
    directly: a 4-D bool mask (True = may attend), a 4-D float mask (added to the scores, as in
    "sdpa"), a 2-D ``(B, Lk)`` padding mask, or None (causal per ``module.is_causal``). Keywords
    read: ``softcap``, ``s_aux`` (sinks), ``position_bias`` (T5), ``sliding_window`` and
    ``is_causal`` (only without a description), ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (packed
    batch-1 inputs), ``output_attentions``; others are ignored. ``dropout`` is the attention
    dropout probability (transformers passes 0 outside training).

    Returns ``(out, weights)``: ``out (B, Lq, Hq, D)`` contiguous, ``weights (B, Hq, Lq, Lk)``
    (before dropout) when attention weights are requested, else None.
    """
    if kwargs.get("block_table") is not None:
        raise NotImplementedError(
            "attnkit got transformers' paged decode (block_table with k_cache/v_cache): that path "
            "expects the kernel to write the new tokens into the pages, which "
            "attnkit.paged_attention_blocks does not do; run continuous batching without the "
            "block table (the index path, which attnkit runs as varlen_attention)")
    b, hq, lq, _ = query.shape
    lk = key.shape[2]
    weights_wanted = _wants_weights(module, kwargs)
    common: Dict[str, Any] = {"scale": scaling}
    if kwargs.get("softcap") is not None:
        common["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        common["sinks"] = kwargs["s_aux"]
    if dropout:
        common["dropout_p"] = float(dropout)
    bias = kwargs.get("position_bias")

    mask = attention_mask
    desc: Optional[MaskDescription] = None
    extra: Dict[str, Any] = {}
    cu = _from_cu_seqlens(query, key, kwargs)
    if cu is not None and bias is None and not weights_wanted and (
            mask is None or (isinstance(mask, MaskDescription) and _plain(mask))):
        out = _varlen(query, key, value, cu[0], cu[1], _cu_band(module, kwargs), common)
        return out.contiguous(), None
    if isinstance(mask, MaskDescription):
        desc = mask
    elif mask is None:
        desc = _describe_plain(module, b, lq, lk, kwargs)
    elif isinstance(mask, Tensor) and mask.dim() == 2:
        desc = _describe_plain(module, b, lq, lk, kwargs, keys=_key_padding(mask, b, lk, 0))
    elif isinstance(mask, Tensor) and mask.dim() == 4:
        mask = mask[..., :lk]
        if mask.dtype == torch.bool:
            extra["mask"] = mask
        else:
            bias = mask if bias is None else bias + mask
    elif mask is not None and hasattr(mask, "kv_num_blocks"):  # a BlockMask
        extra["mask"] = mask
    else:
        raise TypeError(
            f"attention_mask must be what attnkit's mask function returns (MaskDescription), a "
            f"2-D or 4-D tensor or None; got {type(mask).__name__}. Load the model with "
            f"attn_implementation='{NAME}' after importing attnkit.integrations.transformers")

    kv_start, kv_stop = 0, lk
    if desc is not None:
        if (desc.q_length, desc.kv_length) != (lq, lk):
            if desc.q_length == lq and desc.kv_length > lk:  # cut, as "flex_attention" does
                extra["mask"] = desc.to_dense()[..., :lk]
                desc = None
            else:
                raise ValueError(
                    f"the attention mask was built for {desc.q_length} queries and "
                    f"{desc.kv_length} keys but the layer has {lq} queries and {lk} keys; the "
                    f"model's cache and mask sizes disagree")
    if desc is not None and cu is not None and _plain(desc) and lq == lk and torch.equal(*cu):
        ids = torch.repeat_interleave(torch.arange(cu[0].numel() - 1, device=query.device),
                                      cu[0].diff()).view(1, -1)
        desc = MaskDescription(1, lq, lk, lo=desc.lo, hi=desc.hi, documents=ids)
    if desc is not None:
        low = desc.lowered()
        kv_start, kv_stop = low.kv_start, low.kv_stop
        if (kv_start, kv_stop) != (0, lk):
            key, value = key[:, :, kv_start:kv_stop], value[:, :, kv_start:kv_stop]
            if bias is not None and bias.shape[-1] == lk:
                bias = bias[..., kv_start:kv_stop]
        extra.update(low.options)
    if bias is not None:
        extra["bias"] = bias
    res = attnkit.attention(query, key, value, return_weights=weights_wanted, **extra, **common)
    out, weights = (res if weights_wanted else (res, None))
    if weights is not None and (kv_start, kv_stop) != (0, lk):
        weights = torch.nn.functional.pad(weights, (kv_start, lk - kv_stop))
    return out.transpose(1, 2).contiguous(), weights


# ---- registration ---------------------------------------------------------------------------


def register(name: str = NAME) -> str:
    """Register attnkit with transformers as ``attn_implementation=name``: the attention
    function in ``AttentionInterface`` and the mask function in ``AttentionMaskInterface`` (both
    are needed: without a mask function transformers drops the padding mask). Idempotent;
    returns ``name``. Importing this module calls ``register()``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str; got {name!r}")
    if name in _RESERVED or "flash" in name or name.startswith("paged|"):
        raise ValueError(
            f"name {name!r} is one transformers gives a meaning of its own (eager, sdpa, "
            f"flex_attention, names containing 'flash', 'paged|...'); pick another, e.g. "
            f"{NAME!r}")
    AttentionInterface.register(name, attnkit_attention_forward)
    AttentionMaskInterface.register(name, attnkit_mask)
    return name


register()
