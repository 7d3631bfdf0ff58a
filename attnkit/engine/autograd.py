"""The one autograd node: forward and hand-written backward of every attention call."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import replace
from types import ModuleType
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .. import backends
from ..terms.checks import autocast_dtype
from ..terms.spec import AttentionSpec


class _AttentionFunction(torch.autograd.Function):
    """Inputs: q, k, v, bias, sinks and the tensors a score_mod captures. Outputs: out (input
    dtype), lse and max_scores (compute dtype). lse is differentiable; max_scores is not.

    ``forward`` runs on the tensors it is given (so ``torch.func.grad`` / ``vjp`` see their
    own unwrapped inputs), ``setup_context`` saves what the backward needs, ``vmap`` loops."""

    @staticmethod
    def forward(spec: AttentionSpec, plan: Any, executor: ModuleType, q: Tensor,
                k: Tensor, v: Tensor, bias: Optional[Tensor], sinks: Optional[Tensor],
                *params: Tensor):
        spec = replace(spec, q=q, k=k, v=v, bias=bias, sinks=sinks, score_mod_params=params)
        res = executor.forward(spec, plan)
        return res.out.to(q.dtype), res.lse, res.max_scores

    @staticmethod
    def setup_context(ctx, inputs, output):
        spec, plan, executor, q, k, v, bias, sinks, *params = inputs
        out, lse, mx = output
        ctx.spec, ctx.plan, ctx.executor = spec, plan, executor
        ctx.save_for_backward(q, k, v, bias, sinks, out, lse, *params)
        ctx.mark_non_differentiable(mx)
        ctx.set_materialize_grads(False)  # (an unused lse gets no zeros to test)

    @staticmethod
    def vmap(info: Any, in_dims: Tuple[Optional[int], ...], spec: AttentionSpec, plan: Any,
             executor: ModuleType, *tensors: Optional[Tensor]):
        """``torch.func.vmap`` of the forward: one call per batch entry (the plan does not
        depend on q, k, v), stacked along dim 0."""
        dims = in_dims[3:]
        outs = []
        for i in range(info.batch_size):
            sliced = [t if (t is None or d is None) else t.select(d, i)
                      for t, d in zip(tensors, dims)]
            outs.append(_AttentionFunction.apply(spec, plan, executor, *sliced))
        return tuple(torch.stack(parts) for parts in zip(*outs)), (0, 0, 0)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            "attnkit attention has no forward-mode derivative (torch.func.jvp, jacfwd, "
            "hessian); use reverse mode: torch.func.grad, vjp, or torch.autograd")

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Optional[Tensor], _dmax: Optional[Tensor]):
        if _is_batched(dout) or _is_batched(dlse):
            raise NotImplementedError(
                "attnkit attention's backward cannot run under torch.func.vmap (jacrev, "
                "vmap(grad(f)), vmap over a vjp): loop over the batch instead, or use "
                "torch.func.grad / vjp, or torch.autograd")
        q, k, v, bias, sinks, out, lse, *params = ctx.saved_tensors
        spec = replace(ctx.spec, q=q, k=k, v=v, bias=bias, sinks=sinks,
                       score_mod_params=tuple(params))
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None and not bool(dlse.any()):
            dlse = None
        executor, plan = ctx.executor, ctx.plan
        if torch.is_grad_enabled() and "differentiable_backward" not in executor.CAPS.extras:
            # create_graph=True: an executor whose backward is written in differentiable
            # torch ops (the kernels' backwards have no derivative); same math, same result
            executor = backends.with_extra("differentiable_backward", spec)
            plan = executor.make_plan(spec)
        with _no_autocast(spec):
            g = executor.backward(spec, plan, out, lse, dout, dlse)
        need = ctx.needs_input_grad
        dbias = g.dbias.to(bias.dtype) if (g.dbias is not None and need[6]) else None
        dsinks = g.dsinks.to(sinks.dtype) if (g.dsinks is not None and need[7]) else None
        dparams = tuple(
            (dp.to(p.dtype) if dp is not None else None) if need[8 + idx] else None
            for idx, (dp, p) in enumerate(zip(g.dparams, params)))
        return (None, None, None,
                g.dq.to(q.dtype) if need[3] else None,
                g.dk.to(k.dtype) if need[4] else None,
                g.dv.to(v.dtype) if need[5] else None,
                dbias, dsinks, *dparams)


# torch's apply binds its arguments to forward's signature on every call (for
# setup_context); the signature, computed once, spares it the inspection each time
_AttentionFunction.forward.__signature__ = inspect.signature(_AttentionFunction.forward)


def _no_autocast(spec: AttentionSpec) -> Any:
    """Executors compute in the dtypes they choose: autocast (already applied to the inputs
    by the front door) is switched off around them."""
    device = spec.q.device.type
    if autocast_dtype(device) is None:
        return contextlib.nullcontext()
    return torch.autocast(device, enabled=False)


def _is_batched(x: Optional[Tensor]) -> bool:
    """Is ``x`` batched by torch.func.vmap at any of its functorch levels? (private API,
    used where it exists; without it the backward's own shape error is what is seen)"""
    ft = getattr(torch._C, "_functorch", None)
    batched = getattr(ft, "is_batchedtensor", None)
    wrapped = getattr(ft, "is_functorch_wrapped_tensor", None)
    unwrap = getattr(ft, "get_unwrapped", None)
    if x is None or batched is None or wrapped is None or unwrap is None:
        return False
    for _ in range(64):  # each functorch level wraps once
        if batched(x):
            return True
        if not wrapped(x):
            return False
        x = unwrap(x)
    return False


def run(spec: AttentionSpec, executor: ModuleType,
        plan: Optional[Any] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Run ``spec`` on ``executor`` through the autograd node; canonical shapes out."""
    if spec.is_empty:
        return _empty(spec)
    plan = plan if plan is not None else executor.make_plan(spec)
    with _no_autocast(spec):
        return _AttentionFunction.apply(spec, plan, executor, spec.q, spec.k, spec.v,
                                        spec.bias, spec.sinks, *spec.score_mod_params)


def _empty(spec: AttentionSpec) -> Tuple[Tensor, Tensor, Tensor]:
    """No output element (no batch rows, heads or queries): empty results that still hang
    off every input that requires grad, so a backward gives them zero gradients."""
    inputs = (spec.q, spec.k, spec.v, spec.bias, spec.sinks, *spec.score_mod_params)
    out = spec.q.new_zeros(spec.n, spec.hq, spec.lq, spec.dv)
    for x in inputs:
        if x is not None and x.requires_grad:
            out = out + x.sum().to(out.dtype) * 0
    lse = torch.full((spec.n, spec.hq, spec.lq), float("-inf"), dtype=spec.compute_dtype,
                     device=spec.q.device)
    return out, lse, lse.clone()


def unbroadcast_input(g: Tensor, spec: AttentionSpec, x: Tensor) -> Tensor:
    """A canonical q/k/v gradient back to the input's (broadcast) shape."""
    if spec.squeeze_heads:
        return g.reshape(x.shape)
    g = g.reshape(*spec.batch_shape, *g.shape[1:])
    return g.sum_to_size(x.shape)


def unbroadcast(g: Tensor, spec: AttentionSpec, shape: torch.Size) -> Tensor:
    """Canonical 4-D mask-like gradient (n|1, ...) back to the user's bias shape."""
    lead = spec.batch_shape if g.shape[0] != 1 else (1,) * len(spec.batch_shape)
    g = g.reshape(*lead, *g.shape[1:])
    while g.dim() > len(shape):
        g = g.sum(0)
    return g.sum_to_size(shape)
