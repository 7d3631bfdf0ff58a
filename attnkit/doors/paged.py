"""The paged front doors: attention over a :class:`~attnkit.kv.paged.PagedKVCache`
(:func:`paged_attention`) or over raw pages and a block table (:func:`paged_attention_blocks`,
FlashAttention's ``block_table`` style). The cache itself, the gather and the spec of a call
over pages live in :mod:`attnkit.kv`."""

from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import backends, native
from ..backends import costs
from ..engine.ops import is_compiling
from ..kv.paged import PagedKVCache, paged_spec
from ..kv.paged import paged_spec as _spec_checked  # (not the name tests count calls of)
from ..kv.pages import _check_pages, _index_tensor, check_page_descales, gather_kv
from ..terms.checks import autocast_dtype
from ..terms.spec import AttentionSpec, DoorOptions, Options, PagedKV, band, signature
from . import attention as _api
from .attention import _REPLAY_OPTIONS, _execute, _finish, _transformed, attention

__all__ = ["paged_attention", "paged_attention_blocks", "TAKES", "UNSUPPORTED"]

#: Options the paged front doors do not take, and why.
UNSUPPORTED = {
    "seqlens_q": "the queries are the last Lq positions of every sequence",
    "seqlens_kv": "the cache holds every sequence's length",
    "bias": "a bias needs a dense (Lq, Lk) grid; use score_mod",
    "dropout_mask": "a keep mask needs a dense (Lq, Lk) grid; use dropout_p with a seed",
    "descale_q": "fp8 queries are not taken here: pass q in bfloat16/float32 (an fp8 cache "
                 "keeps the key/value descales; see k_descale/v_descale)",
    "descale_k": "the key descales are the pages' (k_descale)",
    "descale_v": "the value descales are the pages' (v_descale)",
}
#: What paged_attention takes: every option but those above (the call's Options go whole into
#: build_spec)
TAKES = DoorOptions.all_but("paged_attention", UNSUPPORTED)


def _check_query_over_pages(q: Tensor, k_descale: Optional[Tensor]) -> None:
    if k_descale is not None and q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q has dtype {q.dtype}; over fp8 pages q must be float32, bfloat16 or "
                        f"float16 (the output has its dtype)")


def paged_attention(q: Tensor, cache: PagedKVCache, seq_ids: Sequence[Hashable], *,
                    return_lse: bool = False, backend: str = "auto", **options: Any) -> Any:
    """Attention of ``q (B, Hq, Lq, Dqk)`` over the cached keys/values of ``seq_ids`` (one
    batch row each). The queries are the last ``Lq`` positions of each sequence, already
    appended (decode: Lq = 1; chunked prefill: Lq > 1), so the default is ``causal=True`` with
    the bottom-right diagonal of each sequence's own length. Output ``(B, Hq, Lq, Dv)``.

    Takes the options of :func:`attnkit.attention` (``window``, ``softcap``, ``alibi_slopes``,
    ``sinks``, ``score_mod``, ``mask``, ``scale``, dropout ...) but those in
    :data:`UNSUPPORTED`. How it runs (``backend="auto"``): the decode executor reads the pages
    in place through the block table (:mod:`attnkit.backends.decode`: the native kernel, or
    page-by-page matmuls without it) when it can run the call (up to 16 query rows, analytic
    masks, no gradients); longer query blocks run on the flash kernel, which reads the pages
    in place as well (:mod:`attnkit.backends.flash`: float32/bfloat16/float16 pages, or fp8
    ones dequantized block by block, its terms, no gradients); everything else gathers the
    pages into contiguous K/V and runs :func:`attnkit.attention` (differentiable).
    ``backend="decode"`` or ``"flash"`` forces that in-place path (``NotImplementedError``
    with the reasons when it cannot run); ``"fused"``/``"tiled"`` gather and force that
    executor."""
    block_table, seqlens = cache.block_table(seq_ids)
    return paged_attention_blocks(q, cache.k_pages, cache.v_pages, block_table, seqlens,
                                  k_descale=cache.k_descale, v_descale=cache.v_descale,
                                  return_lse=return_lse, backend=backend, **options)


def paged_attention_blocks(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Any,
                           seqlens_kv: Any, *, return_lse: bool = False, backend: str = "auto",
                           k_descale: Any = None, v_descale: Any = None,
                           **options: Any) -> Any:
    """:func:`paged_attention` on raw tensors (FlashAttention's ``block_table`` style):
    ``k_pages (num_pages, page_size, Hkv, Dqk)``, ``v_pages``, ``block_table (B, max_pages)``
    and ``seqlens_kv (B,)`` (tensors or lists). fp8 pages need ``k_descale`` and ``v_descale``
    (``(num_pages, Hkv)``, ``(Hkv,)`` or a number; see :mod:`attnkit.pages`); q is then a
    float tensor (float32, bfloat16 or float16) and the output has its dtype."""
    options = {"causal": True, "diagonal": "bottom_right", **options}
    key = None
    if not return_lse:
        key = _replay_key(q, k_pages, v_pages, block_table, seqlens_kv, k_descale, v_descale,
                          options, backend)
        try:
            launch = _REPLAYS.get(key) if key is not None else None
        except TypeError:  # an unhashable option value (a list for window): not replayed
            key = launch = None
        if launch is not None:
            if _api.CHECK_REPLAYS:
                _check_replay(key, q, k_pages, v_pages, block_table, seqlens_kv, k_descale,
                              v_descale, options, backend)
            kd, vd = check_page_descales(k_pages, v_pages, k_descale, v_descale)
            out = launch(q, k_pages, v_pages, block_table, seqlens_kv, kd, vd)
            if out is not None:
                return out
            _REPLAYS.pop(key, None)  # the full path explains the refusal (or makes a new one)
    opts = Options.from_kwargs("paged_attention", options, TAKES)
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, Hq, Lq, Dqk); got "
                         f"{tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__}")
    if q.device.type == "meta":
        raise ValueError("q is on the meta device (shapes without data); attnkit computes on "
                         "real tensors")
    block_table = _index_tensor("block_table", block_table, k_pages, torch.int32)
    seqlens_kv = _index_tensor("seqlens_kv", seqlens_kv, k_pages, torch.int32)
    if is_compiling():
        from . import compiled

        kd, vd = check_page_descales(k_pages, v_pages, k_descale, v_descale)  # (shapes only)
        _check_query_over_pages(q, kd)
        return compiled.paged(q, k_pages, v_pages, block_table, seqlens_kv, opts, return_lse,
                              backend, kd, vd)
    for name, x in (("q", q), ("block_table", block_table), ("seqlens_kv", seqlens_kv)):
        if isinstance(x, Tensor) and isinstance(k_pages, Tensor) and x.device != k_pages.device:
            raise ValueError(f"{name} is on {x.device} but the pages are on {k_pages.device}; "
                             f"move it with {name}.to(k_pages.device)")
    if not isinstance(block_table, Tensor) or block_table.dim() != 2 or (
            block_table.shape[0] != q.shape[0]):
        raise ValueError(f"block_table must be (B, max_pages) with B = {q.shape[0]} (q's batch); "
                         f"got {tuple(getattr(block_table, 'shape', ()))}")
    lens = _check_pages(k_pages, v_pages, block_table, seqlens_kv)
    kd, vd = check_page_descales(k_pages, v_pages, k_descale, v_descale)
    _check_query_over_pages(q, kd)
    if lens.numel() and int(lens.min()) < q.shape[2]:
        raise ValueError(f"every sequence must already hold the {q.shape[2]} query tokens "
                         f"(append them first); shortest has {int(lens.min())}")
    if backend in ("auto", "decode", "flash"):
        # the keys and values stay in their pages: the spec sees zero-stride stand-ins of the
        # gathered shape, so every option is validated as for a dense call (nothing allocated)
        spec = paged_spec(q, PagedKV(k_pages, v_pages, block_table.long(), kd, vd),
                          opts.merged(seqlens_kv=lens))
        if backends.choose(spec, backend) is not None:
            out, lse, _ = _execute(spec, backend)
            out = _finish(spec, out)  # (out_dtype / out_scale, as attention applies them)
            if key is not None and key not in _REPLAYS:
                _remember(key, spec, opts, backend)
            return (out, lse) if return_lse else out
    k, v = gather_kv(k_pages, v_pages, block_table, lens, k_descale=kd, v_descale=vd,
                     dtype=q.dtype if kd is not None else None)
    return attention(q, k, v, return_lse=return_lse, backend=backend,
                     **dict(options, seqlens_kv=lens))


# ---- decoding steps that recur: the same shapes over the same pages ------------------------

#: The decode executor's launchers for paged steps (or None: not replayable), by
#: :func:`_replay_key`, and the normalised form (:func:`attnkit.spec.signature`, the executor)
#: each was made for
_REPLAYS: Dict[tuple, Any] = {}
_FORMS: Dict[tuple, Tuple[Any, str]] = {}


def _replay_key(q: Any, k_pages: Any, v_pages: Any, block_table: Any, seqlens_kv: Any,
                k_descale: Any, v_descale: Any, options: dict, backend: str
                ) -> Optional[tuple]:
    """The key of a paged call that the decode executor can replay: what the call has in
    common with the next decoding step over the same cache (the query's shape, strides and
    dtype; the pages' shapes, strides and dtypes; the block table's rows and dtype and the
    lengths' form, not their contents or the table's width; the descales' form, not their
    values; the raw keywords), and what the executor's choice reads (the threads, the loaded
    kernels, the cost table). None when the call cannot be replayed: a tensor subclass or a
    list, not CPU, an option beyond those :func:`attnkit.attention` replays, a query that
    requires grad, autocast, a torch.func transform or forward-mode AD, torch.compile tracing,
    or replays disabled (:func:`attnkit.replays_disabled`)."""
    xs = (q, k_pages, v_pages, block_table, seqlens_kv)
    if any(type(x) is not Tensor for x in xs):
        return None
    if not all(x.is_cpu for x in xs) or q.dim() != 4 or block_table.dim() != 2:
        return None
    if is_compiling() or getattr(_api._DISABLED, "on", False) or (
            q.requires_grad and torch.is_grad_enabled()):
        return None
    items = []
    for name, value in options.items():
        if name not in _REPLAY_OPTIONS or isinstance(value, Tensor):
            return None
        items.append((name, type(value), value))
    if autocast_dtype("cpu") is not None or _transformed():
        return None
    state = native._state
    if "lib" not in state:
        return None  # (not loaded yet: this call loads them)
    descales = tuple((type(d), d.shape, d.dtype, d.device) if isinstance(d, Tensor) else type(d)
                     for d in (k_descale, v_descale))
    return (q.shape, q.stride(), q.dtype, k_pages.shape, k_pages.stride(), k_pages.dtype,
            v_pages.shape, v_pages.stride(), v_pages.dtype, block_table.shape[0],
            block_table.dtype, seqlens_kv.shape, seqlens_kv.dtype, descales, backend,
            torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
            id(state["lib"]), costs.generation(), tuple(items))


def _remember(key: tuple, spec: AttentionSpec, opts: Options, backend: str) -> None:
    """Store the selected executor's launcher for ``key`` (its ``replay_paged``; None where it
    has none, or does not replay this call), with the normalised form it was made for."""
    executor = backends.select(spec, backend)
    replay = getattr(executor, "replay_paged", None)
    launch = replay(spec, band(opts.causal, opts.window)) if replay is not None else None
    if len(_REPLAYS) > 256:  # a few forms recur in decoding; do not grow without bound
        _REPLAYS.clear()
        _FORMS.clear()
    _REPLAYS[key] = launch
    _FORMS[key] = (signature(spec), executor.CAPS.name)


def _check_replay(key: tuple, q: Tensor, k_pages: Tensor, v_pages: Tensor,
                  block_table: Tensor, seqlens_kv: Tensor, k_descale: Any, v_descale: Any,
                  options: dict, backend: str) -> None:
    """With :data:`attnkit.api.CHECK_REPLAYS`: the full path's normalised form of this call
    against the one its launcher was made for (the full path's checks raise as they would)."""
    opts = Options.from_kwargs("paged_attention", options, TAKES)
    lens = _check_pages(k_pages, v_pages, block_table, seqlens_kv)
    kd, vd = check_page_descales(k_pages, v_pages, k_descale, v_descale)
    spec = _spec_checked(q, PagedKV(k_pages, v_pages, block_table.long(), kd, vd),
                         opts.merged(seqlens_kv=lens))
    got = (signature(spec), backends.select(spec, backend).CAPS.name)
    made = _FORMS.get(key)
    if made is not None and got != made:
        raise RuntimeError(f"attnkit: a replayed paged call normalises to another form than "
                           f"the call its launcher was made for: {got} != {made}")
