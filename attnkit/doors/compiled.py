"""The front doors as torch.compile traces them: everything a call needs goes into the custom
ops of :mod:`attnkit.ops` (one opaque call in the graph; validation, planning and the executor
run inside, on real tensors), in code that reads no tensor data.

What cannot be passed to an op becomes something that can, here, in traceable torch code: a
mask_mod that is not an attnkit builtin is evaluated into a dense bool mask (and a BlockMask
with such a mask_mod into the same mask, from its blocks); a score_mod that is not a builtin,
``return_weights`` and the dense dropout mask cannot, so those calls run eagerly, outside the
graph, with a graph break that says why (``fullgraph=True`` reports it as its error).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from ..engine import ops
from ..terms.mods import call_mask_mod


def _disable(reason: str) -> Callable[[Callable], Callable]:
    """``torch.compiler.disable`` with a reason where torch takes one (2.7+)."""
    def wrap(fn: Callable) -> Callable:
        try:
            return torch.compiler.disable(fn, reason=reason)
        except TypeError:  # older torch: no reason
            return torch.compiler.disable(fn)
    return wrap


def _is_builtin(mod: Any) -> bool:
    return getattr(mod, "recipe", None) is not None


EAGER_REASON = ("attnkit: a score_mod that is not an attnkit builtin (attnkit.score_mods), "
                "return_weights, AuxRequest(dropout_mask=True, amax_s=True or amax_o=True) "
                "or an fp8 descale that requires grad runs eagerly, outside the compiled "
                "graph: a Python callable, a dense (Lq x Lk) result or a gradient through "
                "the dequantized inputs cannot pass through a custom op")


def eagerly(fn: Callable) -> Callable:
    """``fn`` run outside the compiled graph (one graph break with :data:`EAGER_REASON`)."""
    return _disable(EAGER_REASON)(fn)


def runs_eagerly(opts: Any, return_aux: Any, return_weights: bool) -> bool:
    """Whether an attention call needs what cannot pass through the custom op: a dense
    result, a score_mod that is not a builtin, or a descale that needs a gradient (which
    flows through the dequantized inputs, outside any op)."""
    learnable = torch.is_grad_enabled() and any(
        isinstance(getattr(opts, name), Tensor) and getattr(opts, name).requires_grad
        for name in ("descale_q", "descale_k", "descale_v"))
    return bool(return_weights or learnable or (return_aux is not None and (
        return_aux.dropout_mask or return_aux.amax_s or return_aux.amax_o))
                or (opts.score_mod is not None and not _is_builtin(opts.score_mod)))


def _index_grid(q: Tensor, k: Tensor) -> Tuple[Tuple[int, ...], Tensor, Tensor, Tensor, Tensor]:
    if q.dim() == 2:
        batch: Tuple[int, ...] = ()
        hq = 1
    else:
        batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3]))
        hq = q.shape[-3]
    n = math.prod(batch) if batch else 1
    dev = q.device
    return (batch, torch.arange(n, device=dev).view(-1, 1, 1, 1),
            torch.arange(hq, device=dev).view(1, -1, 1, 1),
            torch.arange(q.shape[-2], device=dev).view(1, 1, -1, 1),
            torch.arange(k.shape[-2], device=dev).view(1, 1, 1, -1))


def _shaped(vis: Tensor, batch: Tuple[int, ...], two_d: bool) -> Tensor:
    """A (N|1, Hq|1, Lq, Lk) visibility as a mask broadcastable to the call's scores."""
    if two_d:
        return vis[0, 0]
    if vis.shape[0] == 1:
        return vis.reshape((1,) * len(batch) + tuple(vis.shape[1:]))
    return vis.reshape(*batch, *vis.shape[1:])


def dense_mask(mask: Any, q: Tensor, k: Tensor) -> Tensor:
    """A mask_mod, or a BlockMask whose mask_mod is not a builtin, evaluated densely (the
    pairs it keeps), in torch ops that torch.compile traces."""
    batch, b, h, i, j = _index_grid(q, k)
    if hasattr(mask, "kv_num_blocks"):
        bq, bk = mask.BLOCK_SIZE
        kinds = mask.block_kinds()  # (B|1, H|1, NQ, NK): 0 empty, 1 partial, 2 full
        kinds = kinds.repeat_interleave(bq, -2).repeat_interleave(bk, -1)
        kinds = kinds[..., : q.shape[-2], : k.shape[-2]]
        inside = call_mask_mod(mask.mask_mod, b, h, i, j) if mask.mask_mod is not None else (
            torch.ones((), dtype=torch.bool, device=q.device))
        vis = (kinds == 2) | ((kinds == 1) & inside)
    else:
        vis = call_mask_mod(mask, b, h, i, j)
    return _shaped(vis, batch, q.dim() == 2)


def _mask_for_op(mask: Any, q: Tensor, k: Tensor) -> Any:
    if mask is None or isinstance(mask, Tensor):
        return mask
    if hasattr(mask, "kv_num_blocks"):
        from ..terms.block_mask import BlockMask

        bm = mask if isinstance(mask, BlockMask) else BlockMask.from_torch(mask)
        return bm if bm.mask_mod is None or _is_builtin(bm.mask_mod) else dense_mask(bm, q, k)
    return mask if _is_builtin(mask) else dense_mask(mask, q, k)


def attention(q: Tensor, k: Tensor, v: Tensor, opts: Any, wanted: frozenset, backend: str
              ) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`attnkit.attention`'s ``(out, lse, max_scores)`` under torch.compile (a call
    :func:`runs_eagerly` does not send outside the graph)."""
    from ..terms.fp8 import finish_output

    if opts.p_scale is not None and torch.is_grad_enabled() and any(
            isinstance(x, Tensor) and x.requires_grad for x in (q, k, v, opts.bias, opts.sinks)):
        from .attention import _P_SCALE_FORWARD_ONLY

        raise NotImplementedError(_P_SCALE_FORWARD_ONLY)
    opts = opts.merged(mask=_mask_for_op(opts.mask, q, k))
    p = ops.pack("attention", q, k, v, opts, backend=backend, outputs=sorted(wanted))
    out, lse, mx = ops.call(p, q, k, v)
    return finish_output(out, opts.out_dtype, opts.out_scale), lse, mx


def paged(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seqlens_kv: Tensor,
          opts: Any, return_lse: bool, backend: str, k_descale: Optional[Tensor] = None,
          v_descale: Optional[Tensor] = None) -> Any:
    """:func:`attnkit.paged_attention_blocks` under torch.compile: the pages are read in place
    by the decode executor inside the op (a paged call that needs gradients or more than the
    decode executor runs is refused there, with its reasons); fp8 pages come with their
    ``(num_pages, Hkv)`` descales and are computed in q's dtype."""
    k_stub, v_stub = ops.stand_ins(k_pages, v_pages, block_table,
                                   dtype=q.dtype if k_descale is not None else None)
    p = ops.pack("paged", q, k_stub, v_stub, opts,
                 backend="decode" if backend == "auto" else backend,
                 extra={"k_pages": k_pages, "v_pages": v_pages, "block_table": block_table,
                        "k_descale": k_descale, "v_descale": v_descale})
    p.slots["seqlens_kv"] = seqlens_kv
    out, lse, _ = ops.call(p, q, k_stub, v_stub)
    return (out, lse) if return_lse else out
