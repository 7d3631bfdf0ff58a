"""``attention``: the one entry point. Other front doors are thin layers over it."""

from __future__ import annotations

import contextlib
import os
import threading
from types import ModuleType
from typing import Any, Iterator, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .. import backends, native
from ..backends import costs
from ..engine.autograd import _no_autocast, run, unbroadcast, unbroadcast_input
from ..engine.ops import is_compiling
from ..kv.paged import paged_spec
from ..terms.checks import autocast_dtype, autocast_inputs
from ..terms.fp8 import (
    cache_descales,
    check_grad_dtype,
    check_out_dtype,
    check_positive,
    dequantize_query,
    finish_output,
    is_fp8,
)
from ..terms.score_terms import index_grid
from ..terms.spec import (
    AttentionSpec,
    Options,
    PagedKV,
    band,
    build_spec,
    normal_padding,
    signature,
)
from ..terms.spec import build_spec as _build_checked  # (not the name tests count calls of)
from . import compiled
from .errors import torch_compatible


class AuxRequest(NamedTuple):
    """Which auxiliary outputs to return (FlexAttention's ``AuxRequest``, plus the dropout
    keep mask and cuDNN's fp8 amax outputs)."""

    lse: bool = False
    max_scores: bool = False
    dropout_mask: bool = False
    amax_s: bool = False
    amax_o: bool = False


class AuxOutput(NamedTuple):
    """Auxiliary outputs: ``lse`` and ``max_scores`` are ``(*B, Hq, Lq)``; ``dropout_mask``
    is the bool keep mask ``(*B, Hq, Lq, Lk)`` that was used (dense; for debugging).
    ``amax_s`` and ``amax_o`` are 0-d float32 (cuDNN's amax outputs, for the next step's fp8
    scales): the absolute maximum of the softmax weights (before ``p_scale`` quantization and
    dropout) and of the output before ``out_dtype``/``out_scale`` are applied."""

    lse: Optional[Tensor] = None
    max_scores: Optional[Tensor] = None
    dropout_mask: Optional[Tensor] = None
    amax_s: Optional[Tensor] = None
    amax_o: Optional[Tensor] = None


def attention(q: Tensor, k: Tensor, v: Tensor, *, return_lse: bool = False,
              return_aux: Optional[AuxRequest] = None, return_weights: bool = False,
              backend: str = "auto", **options: Any) -> Any:
    """Scaled dot-product attention, ``softmax(scale * q k^T + bias, masked) v``.

    Shapes (read from the right; leading batch dims ``*B`` broadcast between q, k and v)::

        q     (*B, Hq,  Lq, Dqk)        2-D inputs (L, D) are one head
        k     (*B, Hkv, Lk, Dqk)        Hq must be a multiple of Hkv: query head h uses
        v     (*B, Hkv, Lk, Dv)         key/value head h // (Hq // Hkv) (grouped-query)
        out   (*B, Hq,  Lq, Dv)         in the input dtype
        lse   (*B, Hq,  Lq)             float32 (float64 for float64 inputs)

    Scores, in this order: ``s = scale * q.k`` (scale defaults to ``1/sqrt(Dqk)``); softcap
    ``cap * tanh(s / cap)``; ``+ bias``; ALiBi ``- slope[h] * |i' - j|`` (FlashAttention's
    convention); ``score_mod(s, b, h, i, j)``; then every masked pair is set to ``-inf``.
    ``b`` indexes the flattened batch dims, ``h`` the query head; indices are absolute.

    Masks (all combine with AND):

    - ``mask``: a bool tensor broadcastable to ``(*B, Hq, Lq, Lk)`` (True = may attend), a
      ``mask_mod(b, h, q_idx, kv_idx) -> bool`` callable, or a :class:`BlockMask`;
    - ``causal=True``: query i sees keys ``j <= i'``;
    - ``window=(left, right)``: query i sees keys ``i' - left <= j <= i' + right`` (``None`` on
      a side = unbounded);
    - ``seqlens_q`` / ``seqlens_kv`` ``(N,)``: padding; keys at or beyond ``seqlens_kv[b]`` are
      invisible and query rows at or beyond ``seqlens_q[b]`` give 0;
    - ``starts_kv`` ``(N,)``: left padding, the mirror of ``seqlens_kv``: keys before
      ``starts_kv[b]`` are invisible to batch row ``b`` (positions stay absolute: the
      diagonal, windows and ALiBi do not move).

    ``i' = i`` for ``diagonal="top_left"`` and ``i' = i + Lk - Lq`` for ``"bottom_right"``
    (with seqlens, the actual lengths). Lq = 2, Lk = 5, causal::

        top_left:      1 0 0 0 0        bottom_right:   1 1 1 1 0
                       1 1 0 0 0                        1 1 1 1 1

    Left padding, Lq = Lk = 4, causal, ``starts_kv=[2]`` (a row that sees no key gives 0)::

        0 0 0 0
        0 0 0 0
        0 0 1 0
        0 0 1 1

    A row whose keys are all masked gives output 0, lse ``-inf`` and zero gradients. ``bias``
    (float, ``-inf`` allowed) gets a gradient summed back to its own shape; so do ``sinks``
    (``(Hq,)``: one extra logit per head in each row's softmax denominator, with no value) and
    tensors a ``score_mod`` captures. float16/bfloat16 are computed in float32. Under
    ``torch.autocast`` the floating inputs are cast to the autocast dtype first (torch's rule
    for SDPA), so the output has that dtype. ``out`` is contiguous.

    Dropout: ``dropout_p`` drops each weight ``(b, h, i, j)`` when a Philox random keyed by
    ``seed``, ``offset`` and those coordinates is below ``dropout_p``, and scales kept weights
    by ``1 / (1 - dropout_p)`` (``dropout_p=1`` drops every weight: out 0, as torch); the
    backward replays the same mask. ``seed=None`` draws one from torch's default generator.
    ``dropout_mask`` (bool, broadcastable to the scores, True =
    keep) gives the keep mask directly, scaled by ``1 / (1 - dropout_p)``.

    fp8 (cuDNN's scaled FP8 attention; see :mod:`attnkit.fp8`): float8_e4m3fn or float8_e5m2
    q, k, v (all three, one format) stand for ``x8 * descale_x``; ``descale_q``,
    ``descale_k``, ``descale_v`` are required, each a float / 0-d tensor or per (batch, kv
    head) ``(*B, Hkv)`` (q also ``(*B, Hq)``), as :func:`attnkit.quantize_fp8` returns them.
    The inputs are dequantized into ``out_dtype`` (bfloat16 by default, or float32) and every
    mask and score term above applies; a decoding step (up to 16 query rows) over 4-D fp8
    k/v that the decode executor can run reads them in place instead (each batch row one
    page, converted in the kernel's registers). ``out_dtype`` sets the output's dtype (for any
    inputs): a float dtype, or fp8 with ``out_scale`` (``out8 = fp8(out * out_scale)``).
    ``p_scale`` rounds the softmax weights to e4m3 as ``fp8(P * p_scale) / p_scale`` before
    ``P V`` (tiled executor; forward only). fp8 tensors cannot require grad (differentiate
    the dequantized tensor, or use :func:`attention_backward`); descales may.

    Options (keywords; one definition, :class:`attnkit.spec.Options`, shared by every front
    door): ``scale``, ``mask``, ``bias``, ``causal``, ``window``, ``diagonal``, ``score_mod``,
    ``softcap``, ``alibi_slopes`` (``(Hq,)`` or ``(N, Hq)``), ``seqlens_q``, ``seqlens_kv``,
    ``starts_kv``, ``sinks``, ``dropout_p``, ``seed``, ``offset``, ``dropout_mask``,
    ``descale_q``, ``descale_k``, ``descale_v``, ``p_scale``, ``out_dtype``, ``out_scale``, as
    described above. An unknown keyword is a ``TypeError`` listing them.

    Args:
        return_lse: also return the natural-log log-sum-exp of each row's final scores.
        return_aux: an :class:`AuxRequest`; returns ``(out, AuxOutput)`` (``amax_s``: the
            largest softmax weight, ``amax_o``: max |out| before ``out_dtype``, both 0-d
            float32; ``amax_s`` needs the row maxima, which the tiled executor reports).
        return_weights: also return the pre-dropout attention weights ``(*B, Hq, Lq, Lk)``
            as a tensor that does not require grad. This is dense (Lq x Lk): for inspection
            and small problems.
        backend: ``"auto"`` (default), or force an executor (``"triton"`` for CUDA tensors,
            ``"flash"``, ``"decode"``, ``"fused"``, ``"tiled"``; see :mod:`attnkit.backends`
            and the executor guide); a forced
            backend that cannot run the call raises ``NotImplementedError`` with its reasons.

    Returns ``out``; ``(out, lse)`` with ``return_lse``; ``(out, aux)`` with ``return_aux``;
    ``weights`` is appended last with ``return_weights``.
    """
    if return_aux is not None and not isinstance(return_aux, AuxRequest):
        raise TypeError(f"return_aux must be an attnkit.AuxRequest; got "
                        f"{type(return_aux).__name__}")
    key = None
    if not (return_lse or return_weights or return_aux is not None):
        key, padding = _replay_key(q, k, v, options, backend)
        try:
            launch = _lookup(key) if key is not None else None
        except TypeError:  # an unhashable option value (a list for window): not replayed
            key = launch = None
        if launch is not None:
            if CHECK_REPLAYS:
                _check_replay(key, q, k, v, options, backend)
            out = launch(q, k, v, *padding)
            if out is not None:
                return out
            _REPLAYS.pop(key, None)  # the full path explains the refusal (or makes a new one)
    opts = Options.from_kwargs("attention", options)
    q, k, v, bias, sinks = autocast_inputs(q, k, v, opts.bias, opts.sinks)
    if bias is not opts.bias or sinks is not opts.sinks:
        opts = opts.merged(bias=bias, sinks=sinks)
    wanted = frozenset({"max_scores"}) if return_aux is not None and (
        return_aux.max_scores or return_aux.amax_s) else frozenset()
    if is_compiling():
        if compiled.runs_eagerly(opts, return_aux, return_weights):
            return _attention_eagerly(q, k, v, return_lse=return_lse, return_aux=return_aux,
                                      return_weights=return_weights, backend=backend,
                                      **{name: getattr(opts, name) for name in opts.names()})
        out, lse, mx = compiled.attention(q, k, v, opts, wanted, backend)
        return _results(None, out, lse, mx, return_lse, return_aux, False)
    spec = None if return_weights else _fp8_cache_in_place(q, k, v, opts, wanted, backend)
    if spec is None:
        spec = build_spec(q, k, v, opts, outputs=wanted)
    out, lse, mx = _execute(spec, backend)
    if key is not None and key not in _REPLAYS:
        _remember(key, spec, opts, backend, (q, k, v))
    return _results(spec, out, lse, mx, return_lse, return_aux, return_weights)


def fp8_readable_in_place(q: Any, k: Any, v: Any, opts: Options, backend: str) -> bool:
    """What every fp8 cache read in place needs (the contiguous cache here, the packed one in
    :mod:`attnkit.varlen`): the decode executor allowed, q, k, v plain fp8 tensors of one
    format with their descales, and no descale that needs a gradient (its gradient needs the
    dequantized tensors)."""
    if backend not in ("auto", "decode") or not all(
            type(x) is Tensor and is_fp8(x) for x in (q, k, v)):
        return False
    descales = (opts.descale_q, opts.descale_k, opts.descale_v)
    if not q.dtype == k.dtype == v.dtype or any(d is None for d in descales):
        return False
    return not (torch.is_grad_enabled() and any(
        isinstance(d, Tensor) and d.requires_grad for d in descales))


def reads_fp8_for_decoding(executor: Optional[ModuleType]) -> bool:
    """Whether ``executor`` (chosen for an fp8 cache held as tensors, read in place) is one
    for decoding rows, which declares a query-row bound: these caches are read in place for
    decoding steps only; an executor that reads fp8 pages for any query length (the flash
    kernel's prefill chunks over paged caches) leaves longer query blocks here to the
    dequantizing path, as before."""
    return executor is not None and executor.CAPS.max_query_rows is not None


def _fp8_cache_in_place(q: Any, k: Any, v: Any, opts: Options, wanted: frozenset,
                        backend: str) -> Optional[AttentionSpec]:
    """A decoding step over an fp8 K/V cache held as ``(N, Hkv, Lk, D)`` tensors with
    per-tensor or per-(batch row, kv head) descales (FlashAttention-3's layout): the spec of
    the call with K/V read in place, each batch row one page (the decode executor converts
    them in registers), instead of a dequantized copy of the cache. None when the call is not
    of that form (all three 4-D fp8 of one format with their descales, no descale that needs
    a gradient, a few query rows) or the decode executor would not run it: the caller then
    dequantizes, as for any fp8 input."""
    if not fp8_readable_in_place(q, k, v, opts, backend) or any(x.dim() != 4 for x in (q, k, v)):
        return None
    rows = backends.most_query_rows("fp8_kv")
    if ((rows is not None and q.shape[2] > rows)
            or not q.shape[0] == k.shape[0] == v.shape[0] or k.shape[2] != v.shape[2]):
        return None
    out_dtype, _ = check_out_dtype(opts.out_dtype, opts.out_scale)
    hkv, n, lk = k.shape[1], k.shape[0], k.shape[2]
    pages = PagedKV(k.transpose(1, 2), v.transpose(1, 2),
                    torch.arange(n, device=q.device).view(n, 1),
                    cache_descales("k", k, opts.descale_k), cache_descales("v", v, opts.descale_v))
    lengths = opts.seqlens_kv if opts.seqlens_kv is not None else torch.full(
        (n,), lk, dtype=torch.int64, device=q.device)
    spec = paged_spec(dequantize_query(q, opts.descale_q, hkv, out_dtype), pages, opts.merged(
        descale_q=None, descale_k=None, descale_v=None, seqlens_kv=lengths), outputs=wanted)
    return spec if reads_fp8_for_decoding(backends.choose(spec)) else None


# ---- calls that recur: a decoding step, the same shapes again ------------------------------

#: Options a replayed call may carry (tensors only for the padding lengths)
_REPLAY_OPTIONS = frozenset({"scale", "causal", "diagonal", "window", "softcap"})
_REPLAY_TENSORS = frozenset({"seqlens_kv", "starts_kv"})
#: The decode and flash executors' launchers (or None: not replayable) by :func:`_replay_key`
_REPLAYS: dict = {}
#: The normalised form (:func:`attnkit.spec.signature`, the executor) each launcher was made
#: for, by the same keys
_FORMS: dict = {}
#: Check every replayed call against the full path's normalised form (a debugging aid, on in
#: the tests: a launcher serving a call of another form raises ``RuntimeError``);
#: ``ATTNKIT_CHECK_REPLAYS=1`` turns it on
CHECK_REPLAYS = os.environ.get("ATTNKIT_CHECK_REPLAYS", "0") == "1"
_DISABLED = threading.local()


@contextlib.contextmanager
def replays_disabled() -> Iterator[None]:
    """Within the block, this thread's calls take the full path (none is replayed or
    remembered): what a replayed call must equal, for tests and debugging."""
    before = getattr(_DISABLED, "on", False)
    _DISABLED.on = True
    try:
        yield
    finally:
        _DISABLED.on = before


def _lookup(key: tuple) -> Any:
    """The launcher stored for ``key`` (None: none, or not replayable)."""
    return _REPLAYS.get(key)


def _replay_key(q: Any, k: Any, v: Any, options: dict, backend: str
                ) -> Tuple[Optional[tuple], Tuple[Optional[Tensor], Optional[Tensor]]]:
    """The key of a call that an executor can replay, and its padding normalised by
    :func:`attnkit.spec.normal_padding` (``(seqlens_kv, starts_kv)``, what the launcher
    takes). The key has what the call has in common with the next call of its kind: the raw
    keywords, shapes, strides and dtypes (everything but the number of cached keys and the
    cache's strides: the decode launcher takes any, the flash launcher checks them itself),
    and the normalised padding's form (which padding tensors exist once normalised: all-zero
    starts hide no key and are none), so that a launcher serves only calls that normalise
    as the call it was made for did, which native kernels are loaded and which cost table
    chooses (:func:`attnkit.backends.costs.generation`; the executors'
    choice depends on them). The key is None when this call cannot be replayed: a
    tensor subclass, not CPU, not 4-D, batch sizes that broadcast, an option beyond
    :data:`_REPLAY_OPTIONS`, padding the full path would refuse, autocast, a torch.func
    transform or forward-mode AD, torch.compile tracing, or replays disabled. Its last entry
    says which of q, k, v require grad (False: no gradient wanted). (An unhashable option
    value makes the key unhashable: the caller's lookup then says no.)"""
    none = (None, (None, None))
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return none
    if not (q.is_cpu and k.is_cpu and v.is_cpu) or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return none  # (the executors replay CPU calls only)
    ks, vs = k.shape, v.shape
    if not q.shape[0] == ks[0] == vs[0] or is_compiling() or getattr(_DISABLED, "on", False):
        return none
    needs = (q.requires_grad, k.requires_grad, v.requires_grad)
    grad = needs if torch.is_grad_enabled() and any(needs) else False
    items = []
    for name, value in options.items():
        if name in _REPLAY_TENSORS and type(value) is Tensor:
            items.append((name, value.dtype, value.shape, value.device))
        elif name in _REPLAY_OPTIONS and not isinstance(value, Tensor):
            items.append((name, type(value), value))
        else:
            return none
    if autocast_dtype("cpu") is not None or _transformed():
        return none
    state = native._state  # which native kernels the executors have (their choice reads it)
    if "lib" not in state:
        return none  # (not loaded yet: this call loads them)
    padding = (None, None)
    if items and ("seqlens_kv" in options or "starts_kv" in options):
        try:
            _, *padding = normal_padding(None, options.get("seqlens_kv"),
                                         options.get("starts_kv"), q.shape[0], ks[2], ks[2],
                                         q.device)
        except (TypeError, ValueError):  # the full path raises its own error first
            return none
    form = (padding[0] is not None, padding[1] is not None)
    return (q.shape, q.stride(), q.dtype, ks[0], ks[1], ks[3], k.stride(3), k.dtype, vs[0],
            vs[1], vs[3], v.stride(3), v.dtype, backend, torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled(), id(state["lib"]), costs.generation(),
            tuple(items), form, grad), tuple(padding)


def _remember(key: tuple, spec: AttentionSpec, opts: Options, backend: str,
              given: Tuple[Tensor, Tensor, Tensor]) -> None:
    """Store the selected executor's launcher for ``key`` (its ``replay``; None where it has
    none, or does not replay this call), with the normalised form it was made for. The key's
    padding form is the spec's own (both from :func:`attnkit.spec.normal_padding`)."""
    launch = None
    executor = backends.select(spec, backend)
    replay = getattr(executor, "replay", None)
    form = (spec.seqlens_kv is not None, spec.starts_kv is not None)
    if (replay is not None and not spec.squeeze_heads and spec.batch_shape == (spec.n,)
            and form == key[-2] and all(s.shape == x.shape and s.stride() == x.stride()
                                        for s, x in zip((spec.q, spec.k, spec.v), given))):
        launch = replay(spec, band(opts.causal, opts.window), bool(key[-1]))
    if len(_REPLAYS) > 256:  # a few forms recur in decoding; do not grow without bound
        _REPLAYS.clear()
        _FORMS.clear()
    _REPLAYS[key] = launch
    _FORMS[key] = (signature(spec), executor.CAPS.name)


def _check_replay(key: tuple, q: Tensor, k: Tensor, v: Tensor, options: dict,
                  backend: str) -> None:
    """With :data:`CHECK_REPLAYS`: the full path's normalised form of this call against the
    one its launcher was made for."""
    spec = _build_checked(q, k, v, Options.from_kwargs("attention", options))
    got = (signature(spec), backends.select(spec, backend).CAPS.name)
    made = _FORMS.get(key)
    if made is not None and got != made:
        raise RuntimeError(f"attnkit: a replayed call normalises to another form than the "
                           f"call its launcher was made for: {got} != {made}")


#: attention() outside the compiled graph, for what cannot pass through the custom op
_attention_eagerly = compiled.eagerly(attention)


def _results(spec: Optional[AttentionSpec], out: Tensor, lse: Tensor, mx: Tensor,
             return_lse: bool, return_aux: Optional[AuxRequest], return_weights: bool) -> Any:
    """What :func:`attention` returns, from its outputs (``spec`` for the dense extras)."""
    results: Tuple[Any, ...] = (_finish(spec, out),)
    if return_aux is not None:
        results += (AuxOutput(
            lse=lse if return_aux.lse else None,
            max_scores=mx if return_aux.max_scores else None,
            dropout_mask=_dense_keep_mask(spec) if return_aux.dropout_mask else None,
            amax_s=_amax_weights(mx, lse) if return_aux.amax_s else None,
            amax_o=_amax(out) if return_aux.amax_o else None),)
    elif return_lse:
        results += (lse,)
    if return_weights:
        results += (_dense_weights(spec, lse),)
    return results[0] if len(results) == 1 else results


def _finish(spec: Optional[AttentionSpec], out: Tensor) -> Tensor:
    """``out`` in the spec's ``out_dtype`` (fp8: scaled by ``out_scale``)."""
    return out if spec is None else finish_output(out, spec.out_dtype, spec.out_scale)


def _amax(x: Tensor) -> Tensor:
    """max |x| as 0-d float32 (0 for an empty tensor)."""
    x = x.detach()
    return x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)


def _amax_weights(mx: Tensor, lse: Tensor) -> Tensor:
    """The largest softmax weight, ``max exp(row max - lse)`` over rows that see a key."""
    w = torch.exp(mx.detach() - lse.detach())
    return _amax(torch.where(torch.isfinite(lse), w, torch.zeros_like(w)))


def _execute(spec: AttentionSpec, backend: str = "auto") -> Tuple[Tensor, Tensor, Tensor]:
    """Run a spec and restore the user's shapes: (out, lse, max_scores). A call that nothing
    differentiates runs its executor's forward directly, without the autograd node (whose
    argument binding costs more than a decoding step's kernel)."""
    executor = backends.select(spec, backend)
    if spec.is_empty or _needs_graph(spec):
        if spec.p_scale is not None and not spec.is_empty:
            raise NotImplementedError(_P_SCALE_FORWARD_ONLY)
        out, lse, mx = run(spec, executor)
    else:
        res = _forward_only(spec, executor)
        out, lse, mx = res.out.to(spec.q.dtype), res.lse, res.max_scores
    if spec.squeeze_heads or len(spec.batch_shape) != 1:  # (else already the user's shape)
        out = out.reshape(spec.output_shape(spec.dv))
        lse, mx = lse.reshape(spec.lse_shape()), mx.reshape(spec.lse_shape())
    return out, lse, mx


_P_SCALE_FORWARD_ONLY = (
    "p_scale (fp8 softmax weights) is forward only: the rounding of P has no useful gradient "
    "and attnkit does not guess a straight-through one; call with no input that requires "
    "grad (torch.no_grad()), or without p_scale")


def _forward_only(spec: AttentionSpec, executor: Any) -> Any:
    """The executor's forward as the autograd node runs it (grad mode and autocast off), with
    the context managers entered only where they change something."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return _forward_only(spec, executor)
    if autocast_dtype(spec.q.device.type) is not None:
        with _no_autocast(spec):
            return executor.forward(spec, executor.make_plan(spec))
    return executor.forward(spec, executor.make_plan(spec))


def _transformed() -> bool:
    """Whether a torch.func transform or forward-mode AD is active (private torch state; where
    this torch lacks it, assume one is)."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return active is None or active() or getattr(forward_ad, "_current_level", 0) >= 0


def _needs_graph(spec: AttentionSpec) -> bool:
    """Whether the call must run through the autograd node: an input requires grad (with
    grad mode on), or a torch.func transform or forward-mode AD is active (the node says
    what it supports there)."""
    if _transformed():
        return True
    if not torch.is_grad_enabled():
        return False
    return any(x is not None and x.requires_grad for x in (
        spec.q, spec.k, spec.v, spec.bias, spec.sinks, *spec.score_mod_params))


def _dense_keep_mask(spec: AttentionSpec) -> Optional[Tensor]:
    """The keep mask used for dropout, dense (None without dropout)."""
    if spec.dropout_mask is not None:
        keep = spec.dropout_mask.expand(spec.n, spec.hq, spec.lq, spec.lk)
    elif spec.dropout_p >= 1.0:
        keep = torch.zeros((), dtype=torch.bool, device=spec.q.device).expand(
            spec.n, spec.hq, spec.lq, spec.lk)
    elif spec.dropout_p > 0.0:
        from ..terms.dropout import keep_mask

        keep = keep_mask(spec.seed, spec.offset, spec.dropout_p,
                         *index_grid(spec, 0, spec.lq, 0, spec.lk))
        keep = keep.expand(spec.n, spec.hq, spec.lq, spec.lk)
    else:
        return None
    return keep.reshape(spec.output_shape(spec.lk))


def _dense_weights(spec: AttentionSpec, lse: Tensor) -> Tensor:
    """Pre-dropout weights exp(S - lse), dense, without grad."""
    with torch.no_grad(), torch.autocast(spec.q.device.type, enabled=False):
        p = backends.dense_probabilities(spec, lse.detach().reshape(spec.n, spec.hq, spec.lq))
    return p.to(spec.q.dtype).reshape(spec.output_shape(spec.lk))


class Grads(NamedTuple):
    """Gradients from :func:`attention_backward` (None for inputs that were not given)."""

    dq: Tensor
    dk: Tensor
    dv: Tensor
    dbias: Optional[Tensor]
    dsinks: Optional[Tensor]


class GradAmax(NamedTuple):
    """The absolute maxima from :func:`attention_backward` with ``return_amax=True`` (cuDNN's
    amax_dQ, amax_dK, amax_dV, amax_dP), 0-d float32, before any ``scale_d*``: ``dp`` is the
    largest ``|dO_i . v_j|`` over the pairs the call's masks let through (dP before dropout);
    the next step's scales follow from them (:func:`attnkit.fp8.suggested_scale`)."""

    dq: Tensor
    dk: Tensor
    dv: Tensor
    dp: Tensor


def _explicit_spec(q: Tensor, k: Tensor, v: Tensor, options: dict) -> AttentionSpec:
    return build_spec(q, k, v, Options.from_kwargs("attention_forward/backward", options))


def attention_forward(q: Tensor, k: Tensor, v: Tensor, *, backend: str = "auto",
                      **options: Any) -> Tuple[Tensor, Tensor]:
    """Forward only, with statistics (cuDNN style): ``(out, lse)`` without an autograd graph.

    Takes the keywords of :func:`attention`. Pair it with :func:`attention_backward`, passing
    the same inputs, options and the ``out``/``lse`` it returned. ``out`` is in ``out_dtype``
    (fp8 inputs: bfloat16 unless it says otherwise).
    """
    spec = _explicit_spec(q.detach(), k.detach(), v.detach(), options)
    executor = backends.select(spec, backend)
    with torch.no_grad():
        res = executor.forward(spec, executor.make_plan(spec))
    out = res.out.to(spec.q.dtype).reshape(spec.output_shape(spec.dv))
    return _finish(spec, out), res.lse.reshape(spec.lse_shape())


def attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                       *, backend: str = "auto", descale_o: Any = None, descale_do: Any = None,
                       grad_dtype: Optional[torch.dtype] = None, scale_dq: Any = None,
                       scale_dk: Any = None, scale_dv: Any = None, return_amax: bool = False,
                       dp_scale: Any = None, **options: Any) -> Any:
    """Backward from saved statistics: gradients of ``sum(out * dout)`` for q, k, v, bias and
    sinks, each in its input's shape. ``out`` and ``lse`` come from :func:`attention_forward`.

    fp8 q, k, v (with their descales, as in the forward): the gradients are with respect to
    the dequantized inputs ``x8 * descale_x``, in their compute dtype (bfloat16, or
    ``out_dtype`` when that is a float dtype). ``out`` and ``dout`` may be fp8 too, with
    ``descale_o`` and ``descale_do`` (scalars: the real values are ``out8 * descale_o``; dout
    by convention in e5m2).

    cuDNN's FP8 backward outputs: ``grad_dtype`` sets the dtype of dq, dk and dv (a float
    dtype, or fp8 with ``scale_dq``, ``scale_dk``, ``scale_dv``: each gradient is stored as
    ``fp8(grad * scale)``, saturating at the format's largest value); ``return_amax=True``
    returns ``(grads, GradAmax)``, the gradients' absolute maxima before scaling and that of
    dP. ``dp_scale`` (cuDNN's ``scale_dP``, ``descale_dP = 1 / dp_scale``) rounds dP = dO V^T
    to e5m2 as ``fp8(dP * dp_scale) / dp_scale`` inside the backward (the tiled executor;
    ``amax_dp`` is of the unrounded dP)."""
    check_grad_dtype(grad_dtype, {"scale_dq": scale_dq, "scale_dk": scale_dk,
                                  "scale_dv": scale_dv})
    dp_scale = check_positive("dp_scale", dp_scale)
    out = _dequantized("out", out, descale_o)
    dout = _dequantized("dout", dout, descale_do)
    bias, sinks = options.get("bias"), options.get("sinks")
    opts = dict(options)
    if bias is not None:
        opts["bias"] = bias.detach().requires_grad_(True)
    if sinks is not None:
        opts["sinks"] = sinks.detach().requires_grad_(True)
    spec = _explicit_spec(q.detach(), k.detach(), v.detach(), opts)
    executor = (backends.select(spec, backend) if dp_scale is None
                else backends.with_extra("dp_scale", spec, backend))
    if is_fp8(q):  # out and dout in the dtype the executors computed the inputs in
        out, dout = out.to(spec.q.dtype), dout.to(spec.q.dtype)
    canon = (spec.n, spec.hq, spec.lq)
    extra = {} if dp_scale is None else {"dp_scale": dp_scale}
    with torch.no_grad():
        g = executor.backward(spec, executor.make_plan(spec),
                              out.reshape(*canon, spec.dv), lse.reshape(canon),
                              dout.reshape(*canon, spec.dv), **extra)
    dbias = None
    if bias is not None and g.dbias is not None:
        dbias = unbroadcast(g.dbias, spec, bias.shape).to(bias.dtype)
    dsinks = g.dsinks.to(sinks.dtype) if (sinks is not None and g.dsinks is not None) else None
    def dtype_of(x: Tensor) -> torch.dtype:
        return spec.q.dtype if is_fp8(x) else x.dtype

    dq, dk, dv = (unbroadcast_input(gx, spec, x).to(dtype_of(x))
                  for gx, x in ((g.dq, q), (g.dk, k), (g.dv, v)))
    amax = None
    if return_amax:
        amax = GradAmax(dq=_amax(dq), dk=_amax(dk), dv=_amax(dv),
                        dp=backends.dp_amax(spec, dout.reshape(*canon, spec.dv)))
    grads = Grads(dq=finish_output(dq, grad_dtype, scale_dq),
                  dk=finish_output(dk, grad_dtype, scale_dk),
                  dv=finish_output(dv, grad_dtype, scale_dv), dbias=dbias, dsinks=dsinks)
    return (grads, amax) if return_amax else grads


def _dequantized(name: str, x: Tensor, descale: Any) -> Tensor:
    """``out``/``dout`` of :func:`attention_backward` in float32 when fp8 (times its scalar
    descale), else as given; a descale for a tensor that is not fp8 is an error."""
    arg = "descale_o" if name == "out" else "descale_do"
    if not is_fp8(x):
        if descale is not None:
            raise ValueError(f"{arg} is for an fp8 {name}; {name} is {x.dtype}: drop {arg}")
        return x
    if descale is None:
        raise ValueError(f"{name} is {x.dtype}: pass {arg} (the real {name} is {name}8 * "
                         f"{arg}; for out_dtype fp8 outputs that is 1 / out_scale)")
    value = check_positive(arg, descale)
    return x.float() * value


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` with torch's
    semantics: a bool ``attn_mask`` is True where attention may happen, a float one is added to
    the scores; ``is_causal`` is top-left; key/value heads may differ from query heads only with
    ``enable_gqa=True``. Fully masked rows give 0 (torch's safe softmax). Dropout uses attnkit's
    replayable dropout with a seed drawn from torch's default generator. Head dims of 0 are
    torch's too: Dqk = 0 makes every score 0, Dv = 0 gives an empty output.

    Errors: where torch raises ``RuntimeError`` (mixed dtypes, 1-D inputs, shapes that do not
    fit), this raises :class:`attnkit.AttentionTypeError` / :class:`attnkit.AttentionValueError`:
    attnkit's ``TypeError``/``ValueError`` (the same message) that ``except RuntimeError``
    catches too.
    """
    try:
        if (not enable_gqa and query.dim() >= 3 and key.dim() >= 3
                and query.shape[-3] != key.shape[-3]):
            raise ValueError(
                f"query has {query.shape[-3]} heads and key has {key.shape[-3]}; pass "
                f"enable_gqa=True for grouped-query attention (as torch requires)")
        mask = bias = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                mask = attn_mask
            else:
                bias = attn_mask
        return attention(query, key, value, mask=mask, bias=bias, causal=is_causal,
                         scale=scale, dropout_p=dropout_p)
    except (TypeError, ValueError) as err:
        converted = torch_compatible(err)
        if converted is None:
            raise
        raise converted from None


