"""``flex_attention``: torch FlexAttention's interface, with a backward and no compile step."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Set, Tuple

from torch import Tensor

from .attention import AuxOutput, AuxRequest, attention
from .errors import torch_compatible

#: The values of torch's ``kernel_options["BACKEND"]`` (``torch.nn.attention.flex_attention``).
TORCH_BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")
#: Those attnkit runs, as its ``backend``: ``"AUTO"`` lets attnkit choose, ``"TRITON"`` forces
#: attnkit's Triton executor. torch's FlashAttention (CuTe DSL) and Triton flex-decoding
#: kernels have no counterpart here.
_BACKEND_OF = {"AUTO": "auto", "TRITON": "triton"}
#: torch's ``kernel_options`` keys that only tune its GPU kernels (tile sizes, warps, pipeline
#: stages, TMA, where the backward scatters dQ, ROCm's knobs), also with torch's ``fwd_`` /
#: ``bwd_`` prefixes: they change how torch's kernel runs, not what it computes. attnkit has
#: no such kernel; it warns once per key that they change nothing.
TUNING_KEYS = frozenset({
    "num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
    "BLOCK_N2", "WRITE_DQ", "FORCE_USE_FLEX_ATTENTION", "USE_TMA", "SPLIT_KV",
    "num_consumer_groups", "kpack", "matrix_instr_nonkdim", "waves_per_eu"})
#: Keys accepted without a word: promises about the inputs that let torch's kernel skip work
#: (``ROWS_GUARANTEED_SAFE``: every row sees a key; ``BLOCKS_ARE_CONTIGUOUS``) and
#: ``PRESCALE_QK`` (torch scales q before q.k, faster and slightly less exact). attnkit
#: handles fully masked rows and any block order anyway, and keeps its exact scaling, so its
#: result is the one torch computes without them.
ACCEPTED_KEYS = frozenset({"PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS"})
#: Keys flex_attention sets itself from its arguments (torch refuses them as well), with the
#: argument that asks for the same thing.
_SET_BY_FLEX = {"OUTPUT_LOGSUMEXP": "return_aux=AuxRequest(lse=True)",
                "OUTPUT_MAX": "return_aux=AuxRequest(max_scores=True)"}
#: The tuning keys already warned about (each once per process).
_WARNED: Set[str] = set()


def flex_attention(query: Tensor, key: Tensor, value: Tensor,
                   score_mod: Optional[Callable[..., Tensor]] = None, block_mask: Any = None,
                   scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: Optional[dict] = None, *,
                   return_aux: Any = None) -> Any:
    """FlexAttention with torch's semantics: ``score_mod(score, b, h, q_idx, kv_idx)`` on the
    scaled scores, ``block_mask`` from :func:`attnkit.create_block_mask` (or torch's own
    BlockMask), GQA only with ``enable_gqa=True``.

    Shapes: query ``(B, Hq, L, E)``, key ``(B, Hkv, S, E)``, value ``(B, Hkv, S, Ev)`` -> out
    ``(B, Hq, L, Ev)``; lse and max_scores ``(B, Hq, L)``. ``return_aux=AuxRequest(lse=True,
    max_scores=True)`` returns ``(out, AuxOutput)``; ``max_scores`` is each row's largest final
    score (after score_mod, masked entries excluded; ``-inf`` for a fully masked row).
    Unlike torch on CPU, this runs eagerly without materialising the scores and has a backward.
    The output is laid out as torch lays out its own: in the query's stride order, the head
    dim innermost (a query viewed from a ``(B, L, H, E)`` buffer gives a ``(B, L, H, Ev)``
    buffer; :func:`attnkit.attention` returns a contiguous output).

    ``kernel_options`` (torch's keys, and attnkit's own ``"backend"``):

    - ``"BACKEND"``: ``"AUTO"`` (attnkit chooses) or ``"TRITON"`` (attnkit's Triton executor,
      forced: an error says why where it cannot run the call, never a fallback).
      ``"FLASH"`` and ``"TRITON_DECODE"`` (torch's FlashAttention and flex-decoding kernels)
      have no counterpart here and are an error; any other value is an error, as in torch.
      ``BACKEND`` with ``FORCE_USE_FLEX_ATTENTION`` is an error, as in torch.
    - ``"backend"``: one of attnkit's executors (``"auto"``, ``"fused"``, ``"tiled"``, ...;
      see :mod:`attnkit.backends`), forced as in :func:`attnkit.attention`.
    - GPU tuning keys (:data:`TUNING_KEYS`: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
      ``num_stages``, ..., also with ``fwd_``/``bwd_`` prefixes) change how torch's kernel
      runs, not its result: attnkit has none to tune, ignores them and warns once per key.
    - ``PRESCALE_QK``, ``ROWS_GUARANTEED_SAFE``, ``BLOCKS_ARE_CONTIGUOUS``
      (:data:`ACCEPTED_KEYS`) are accepted quietly: the result is the exact one either way.
    - ``OUTPUT_LOGSUMEXP`` and ``OUTPUT_MAX`` are flex_attention's own (torch refuses them
      too): ask with ``return_aux`` instead. Any other key is a ``ValueError`` listing these.

    Errors: where torch raises ``RuntimeError`` this raises
    :class:`attnkit.AttentionValueError` / :class:`attnkit.AttentionTypeError`, attnkit's
    ``ValueError``/``TypeError`` that ``except RuntimeError`` catches too.
    """
    try:
        return _flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                               return_lse, kernel_options, return_aux)
    except (TypeError, ValueError) as err:
        converted = torch_compatible(err)
        if converted is None:
            raise
        raise converted from None


def _flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Any, block_mask: Any,
                    scale: Optional[float], enable_gqa: bool, return_lse: bool,
                    kernel_options: Any, return_aux: Any) -> Any:
    """:func:`flex_attention`, raising attnkit's plain error classes."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"flex_attention takes 4-D (B, H, L, E) inputs; got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}")
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"query has {query.shape[1]} heads and key has {key.shape[1]}; pass "
                         f"enable_gqa=True for grouped-query attention")
    backend, forced_by = _kernel_backend(kernel_options)
    if block_mask is not None and not hasattr(block_mask, "kv_blocks_for"):
        from ..terms.block_mask import BlockMask

        block_mask = BlockMask.from_torch(block_mask)
    request = None
    if return_aux is not None:
        request = AuxRequest(lse=bool(getattr(return_aux, "lse", False)),
                             max_scores=bool(getattr(return_aux, "max_scores", False)))
    elif return_lse:
        request = AuxRequest(lse=True)
    try:
        if request is None:
            return _like_query(attention(query, key, value, scale=scale, mask=block_mask,
                                         score_mod=score_mod, backend=backend), query)
        out, aux = attention(query, key, value, scale=scale, mask=block_mask,
                             score_mod=score_mod, return_aux=request, backend=backend)
    except NotImplementedError as err:
        if forced_by is None:
            raise
        raise NotImplementedError(f"{forced_by} forces attnkit's {backend!r} executor: {err} "
                                  f"(here: pass BACKEND='AUTO', or leave it out)") from None
    out = _like_query(out, query)
    if return_aux is None:
        return out, aux.lse
    return out, AuxOutput(lse=aux.lse, max_scores=aux.max_scores)


def _kernel_backend(kernel_options: Any) -> Tuple[str, Optional[str]]:
    """The attnkit backend that ``kernel_options`` ask for, and the option that forced it
    (for the error where it cannot run the call; None when none did); refuses the keys and
    values attnkit cannot honour and warns once about the GPU tuning keys."""
    if kernel_options is None:
        return "auto", None
    if not isinstance(kernel_options, Mapping):
        raise TypeError(f"kernel_options must be a dict or None; got "
                        f"{type(kernel_options).__name__}")
    tuning = []
    for name in kernel_options:
        base = name[4:] if isinstance(name, str) and name[:4] in ("fwd_", "bwd_") else name
        if name in _SET_BY_FLEX:
            raise ValueError(f"kernel_options[{name!r}] is set by flex_attention itself "
                             f"(torch refuses it too); ask with {_SET_BY_FLEX[name]} instead")
        if base in TUNING_KEYS:
            tuning.append(name)
        elif base not in ACCEPTED_KEYS and name not in ("BACKEND", "backend"):
            valid = sorted(TUNING_KEYS | ACCEPTED_KEYS | {"BACKEND", "backend"})
            raise ValueError(f"kernel_options has the unknown key {name!r}; the keys are "
                             f"{', '.join(valid)} (GPU tuning keys also with a 'fwd_' or "
                             f"'bwd_' prefix): see flex_attention's docstring")
    if "BACKEND" in kernel_options and kernel_options.get("FORCE_USE_FLEX_ATTENTION", False):
        raise ValueError("kernel_options: BACKEND cannot be combined with the legacy "
                         "FORCE_USE_FLEX_ATTENTION (as in torch); drop "
                         "FORCE_USE_FLEX_ATTENTION and keep only BACKEND")
    fresh = [name for name in tuning if name not in _WARNED]
    if fresh:
        _WARNED.update(fresh)
        warnings.warn(f"flex_attention: kernel_options {', '.join(map(repr, fresh))} tune "
                      f"torch's GPU kernels; attnkit has no such kernel to tune, so they change "
                      f"nothing here and are ignored (said once per key)", UserWarning,
                      stacklevel=4)
    own = kernel_options.get("backend", "auto")
    if "BACKEND" not in kernel_options:
        return own, None
    given = kernel_options["BACKEND"]
    if given not in TORCH_BACKENDS:
        raise ValueError(f"kernel_options['BACKEND'] must be one of {TORCH_BACKENDS}; got "
                         f"{given!r}")
    if given not in _BACKEND_OF:
        raise ValueError(f"kernel_options['BACKEND']={given!r} asks for a torch kernel attnkit "
                         f"does not have (torch's FlashAttention and flex-decoding kernels); "
                         f"pass 'AUTO' or leave BACKEND out (attnkit chooses), or force one "
                         f"of attnkit's executors with kernel_options={{'backend': ...}}")
    backend = _BACKEND_OF[given]
    if backend == "auto":
        return own, None
    if own not in ("auto", backend):
        raise ValueError(f"kernel_options['BACKEND']={given!r} (attnkit's {backend!r}) and "
                         f"kernel_options['backend']={own!r} disagree; give one of them")
    return backend, f"kernel_options['BACKEND']={given!r}"


def _like_query(out: Tensor, query: Tensor) -> Tensor:
    """``out`` laid out as torch's FlexAttention lays out its output (``_permute_strides``):
    dims filled in the query's stride order (innermost first; equal strides keep the inner dim
    inner), moved so that the head dim is innermost if that order would not make it so. A
    ``(B, L, H, E)`` buffer viewed as ``(B, H, L, E)`` gives an output of that layout too."""
    outer_first = sorted(range(4), key=lambda d: (-query.stride(d), d))
    fill = outer_first[::-1]
    strides = _strides_filled(out.shape, fill)
    if strides[3] != 1:
        fill = [3] + [d for d in fill if d != 3]
        strides = _strides_filled(out.shape, fill)
    if tuple(out.stride()) == strides:
        return out
    laid_out = out.new_empty_strided(out.shape, strides)
    return laid_out.copy_(out)


def _strides_filled(shape: Tuple[int, ...], fill: List[int]) -> Tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dims are filled in order ``fill``
    (innermost first)."""
    strides, step = [0] * len(shape), 1
    for d in fill:
        strides[d] = step
        step *= shape[d]
    return tuple(strides)
