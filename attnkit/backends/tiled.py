"""The tiled executor: FlashAttention-2 forward and backward written with torch ops.

It runs every score term, mask term and option of the spec (not paged K/V), and alone the
fp8 softmax weights of ``p_scale``: a second pass over the tiles recomputes ``P = exp(S -
lse)`` with the final lse, rounds it to fp8 (cuDNN's quantized S) and forms ``P V``.

The forward walks query tiles and, for each, the key tiles that the plan says hold work,
keeping an online softmax (running max ``m``, sum ``l`` and unnormalised output). It never
holds more than one score tile per step. The backward recomputes each probability tile from
the saved log-sum-exp, ``P = exp(S - lse)``, and forms ``dS = P * (dP - D)`` with
``D = rowsum(dO * O) - dlse``.

Layout inside a tile: queries of the G = Hq / Hkv heads that share a key/value head are stacked,
``(N, Hkv, G * bq, D)``, so one matmul per tile serves grouped-query attention without copying
keys; the score tile is viewed as ``(N, Hq, bq, bk)`` to apply masks and score terms.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..engine.plan import MASK_TERMS, Plan, make_plan, tile_visibility  # make_plan: its plan
from ..terms.fp8 import quantize_dp, quantize_probabilities
from ..terms.mods import call_score_mod, from_recipe, info_of
from ..terms.score_terms import (
    TERMS,
    apply_score_mod,
    apply_terms,
    dropout_tile,
    index_grid,
    safe_lse,
    slice_tile,
    softcap_grad,
)
from ..terms.spec import AttentionSpec
from . import workers
from .base import Capabilities, ForwardResult, Grads

CAPS = Capabilities(
    name="tiled",
    features=TERMS | MASK_TERMS | {"sinks", "dropout", "dropout_mask", "max_scores",
                                   "p_scale"},
    dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16}),
    devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
    empty_head_dims=True,
    extras=frozenset({"dp_scale", "differentiable_backward"}),
)


class _Tiles:
    """Shared per-call state of the forward and the backward.

    Everything is computed in the compute dtype (float32 for half-precision inputs, as
    FlashAttention's float32 accumulators and torch's CPU math do): scores, P, dP and dS stay
    float32 through every matmul, so the backward's P matches the forward's LSE (whichever
    executor computed it), exact zeros of the math stay zero, and bfloat16 errors stay at
    the level of one final rounding. (torch's CPU bfloat16 matmul rounds its output to
    bfloat16; no CPU kernel takes bfloat16 operands with a float32 result.)
    """

    def __init__(self, spec: AttentionSpec, plan: Plan):
        self.spec, self.plan = spec, plan
        cd = spec.compute_dtype
        self.cd = cd
        self.q = _without_padding(spec.q.to(cd), spec.seqlens_q)
        self.k = _without_padding(spec.k.to(cd), spec.seqlens_kv, spec.starts_kv)
        self.v = _without_padding(spec.v.to(cd), spec.seqlens_kv, spec.starts_kv)
        self.n, self.hq, self.hkv, self.g = spec.n, spec.hq, spec.hkv, spec.groups
        self.q_scale = spec.scale / (spec.softcap or 1.0)

    def q_tile(self, q0: int, q1: int) -> Tensor:
        """Scaled query tile in the grouped layout (N, Hkv, G * bq, D), compute dtype. With a
        softcap the scale includes 1 / cap, so the score tile is ready for tanh."""
        qt = self.q[:, :, q0:q1] * self.q_scale
        return qt.reshape(self.n, self.hkv, self.g * (q1 - q0), qt.shape[-1])

    def rows(self, x: Tensor, q0: int, q1: int) -> Tensor:
        """(N, Hq, Lq, ...) -> the tile's rows in grouped layout (N, Hkv, G * bq, ...)."""
        t = x[:, :, q0:q1]
        return t.reshape(self.n, self.hkv, self.g * (q1 - q0), *t.shape[3:])

    def key_tiles(self, qb: int, kbs: List[int]
                  ) -> Iterator[Tuple[int, int, int, Optional[Tensor]]]:
        """Query tile ``qb``'s key tiles with a visible pair: ``(kb, k0, k1, visibility)``
        (visibility None when every pair is visible)."""
        for kb in kbs:
            vis = tile_visibility(self.spec, self.plan, qb, kb)
            if vis is not None and not bool(vis.any()):
                continue
            k0, k1 = self.plan.k_range(kb)
            yield kb, k0, k1, vis

    @staticmethod
    def mm_out(a: Tensor, b: Tensor) -> Tensor:
        """a @ b in the compute dtype."""
        return torch.matmul(a, b)

    def scores(self, qt: Tensor, kb: int, q0: int, q1: int, vis: Optional[Tensor],
               keep: bool = False):
        """Final score tile (N, Hq, bq, bk), masked pairs at -inf. With ``keep`` (backward)
        also the raw scaled scores and the pre-score_mod scores, for the chain rule."""
        spec = self.spec
        k0, k1 = self.plan.k_range(kb)
        s = self.mm_out(qt, self.k[:, :, k0:k1].transpose(-1, -2))
        s = s.view(self.n, self.hq, q1 - q0, k1 - k0)
        raw = s
        s = apply_terms(spec, s, q0, q1, k0, k1, inplace=not keep)
        pre_mod = s
        if spec.score_mod is not None:
            s = apply_score_mod(spec, s, q0, q1, k0, k1)
        own = not keep and spec.score_mod is None  # s is a fresh tile nobody else holds
        if vis is not None:
            s = s.masked_fill_(~vis, float("-inf")) if own else s.masked_fill(~vis, float("-inf"))
            own = True
        return s, raw, pre_mod, own


def _without_padding(x: Tensor, seqlens: Optional[Tensor],
                     starts: Optional[Tensor] = None) -> Tensor:
    """``x (N, H, L, D)`` with the rows at or beyond ``seqlens[b]`` (and before ``starts[b]``)
    zeroed: padding is invisible, so whatever it holds (NaN included) must not reach a product
    (0 * NaN)."""
    if seqlens is not None and bool((seqlens >= x.shape[2]).all()):
        seqlens = None
    if seqlens is None and starts is None:
        return x
    pos = torch.arange(x.shape[2], device=x.device).view(1, -1)
    pad = torch.zeros((), dtype=torch.bool, device=x.device)
    if seqlens is not None:
        pad = pad | (pos >= seqlens.view(-1, 1))
    if starts is not None:
        pad = pad | (pos < starts.view(-1, 1))
    return x.masked_fill(pad[:, None, :, None], 0)


def forward(spec: AttentionSpec, plan: Plan) -> ForwardResult:
    """Online-softmax forward over the plan's tiles."""
    t = _Tiles(spec, plan)
    n, hq, lq, dv = spec.n, spec.hq, spec.lq, spec.dv
    cd = t.cd
    out = torch.zeros(n, hq, lq, dv, dtype=cd, device=spec.q.device)
    lse = torch.full((n, hq, lq), float("-inf"), dtype=cd, device=spec.q.device)
    mx = torch.full((n, hq, lq), float("-inf"), dtype=cd, device=spec.q.device)
    neg_inf = float("-inf")

    def query_tile(qb: int) -> None:
        q0, q1 = plan.q_range(qb)
        rows = t.g * (q1 - q0)
        kbs = plan.key_blocks(qb)
        m = torch.full((n, t.hkv, rows, 1), neg_inf, dtype=cd, device=spec.q.device)
        l = torch.zeros((n, t.hkv, rows, 1), dtype=cd, device=spec.q.device)
        acc = torch.zeros((n, t.hkv, rows, dv), dtype=cd, device=spec.q.device)
        if kbs:
            qt = t.q_tile(q0, q1)
        for kb, k0, k1, vis in t.key_tiles(qb, kbs):
            s, _, _, own = t.scores(qt, kb, q0, q1, vis)
            s = s.reshape(n, t.hkv, rows, k1 - k0)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(m_new == neg_inf, torch.zeros_like(m_new), m_new)
            p = s.sub_(m_safe).exp_() if own else torch.exp(s - m_safe)
            alpha = torch.exp(m - m_safe)
            l = l.mul_(alpha).add_(p.sum(-1, keepdim=True))
            drop = dropout_tile(spec, q0, q1, k0, k1, cd)
            if drop is not None:
                p = p.view(n, hq, q1 - q0, k1 - k0).mul_(drop).view(n, t.hkv, rows, k1 - k0)
            acc = acc.mul_(alpha).add_(t.mm_out(p, t.v[:, :, k0:k1]))
            m = m_new
        m_safe = torch.where(m == neg_inf, torch.zeros_like(m), m)
        row_lse = m_safe + torch.log(l)  # -inf where l == 0
        if spec.sinks is not None:
            sink = spec.sinks.to(cd).view(1, hq, 1).expand(n, hq, q1 - q0)
            row_lse = torch.logaddexp(row_lse.view(n, hq, q1 - q0), sink).view_as(row_lse)
        finite = torch.isfinite(row_lse)
        scale_out = torch.where(finite, torch.exp(m_safe - torch.where(
            finite, row_lse, torch.zeros_like(row_lse))), torch.zeros_like(row_lse))
        o = acc * scale_out
        out[:, :, q0:q1] = o.view(n, hq, q1 - q0, dv)
        lse[:, :, q0:q1] = row_lse.view(n, hq, q1 - q0)
        mx[:, :, q0:q1] = m.view(n, hq, q1 - q0)

    _each_query_tile(spec, plan, query_tile)
    if spec.p_scale is not None:
        out = _quantized_p_output(t, lse)
    return ForwardResult(out=out, lse=lse, max_scores=mx)


def _each_query_tile(spec: AttentionSpec, plan: Plan, fn, threads: Optional[int] = None
                     ) -> None:
    """``fn(qb)`` for every query tile: spread over the cores, each tile single-threaded
    (:func:`attnkit.backends.workers.for_each`), unless autograd records the ops (a
    differentiable backward) or the tiles are too few to share."""
    tiles = list(range(plan.nqb))
    if threads is None:
        threads = workers.item_threads(len(tiles), spec.q.device)
    workers.for_each(tiles, fn, threads=threads)


def _quantized_p_output(t: _Tiles, lse: Tensor) -> Tensor:
    """``out = sum_j fp8(P_ij * p_scale) / p_scale * v_j`` with the normalised weights ``P =
    exp(S - lse)`` (dropout, if any, applied to the rounded weights)."""
    spec, plan, cd = t.spec, t.plan, t.cd
    n, hq, dv = spec.n, spec.hq, spec.dv
    out = torch.zeros(n, hq, spec.lq, dv, dtype=cd, device=spec.q.device)
    lse_safe = safe_lse(lse)

    def query_tile(qb: int) -> None:
        q0, q1 = plan.q_range(qb)
        kbs = plan.key_blocks(qb)
        if not kbs:
            return
        rows = t.g * (q1 - q0)
        qt = t.q_tile(q0, q1)
        acc = torch.zeros((n, t.hkv, rows, dv), dtype=cd, device=spec.q.device)
        for kb, k0, k1, vis in t.key_tiles(qb, kbs):
            s, _, _, _ = t.scores(qt, kb, q0, q1, vis)
            p = quantize_probabilities(torch.exp(s - lse_safe[:, :, q0:q1, None]),
                                       spec.p_scale)
            drop = dropout_tile(spec, q0, q1, k0, k1, cd)
            if drop is not None:
                p = p * drop
            acc += t.mm_out(p.reshape(n, t.hkv, rows, k1 - k0), t.v[:, :, k0:k1])
        out[:, :, q0:q1] = acc.view(n, hq, q1 - q0, dv)

    _each_query_tile(spec, plan, query_tile)
    return out


def backward(spec: AttentionSpec, plan: Plan, out: Tensor, lse: Tensor, dout: Tensor,
             dlse: Optional[Tensor] = None, dp_scale: Optional[float] = None) -> Grads:
    """FlashAttention-2 backward: recompute P per tile from ``lse``; gradients in compute
    dtype (cast by the caller). ``dp_scale``: dP = dO V^T rounded to e5m2 as
    ``fp8(dP * dp_scale) / dp_scale`` before dS (cuDNN's quantized dP)."""
    if spec.p_scale is not None:
        raise NotImplementedError(
            "p_scale (fp8 softmax weights) is forward only: the rounding of P has no useful "
            "gradient and attnkit does not guess a straight-through one; run the backward "
            "without p_scale")
    t = _Tiles(spec, plan)
    cd = t.cd
    n, hq, hkv, lq, dv = spec.n, spec.hq, spec.hkv, spec.lq, spec.dv
    dev = spec.q.device
    out_c, dout_c = out.to(cd), dout.to(cd)
    delta = (dout_c * out_c).sum(-1)  # (N, Hq, Lq)
    if dlse is not None:
        delta = delta - dlse.to(cd)
    lse_safe = safe_lse(lse.to(cd))
    dq = torch.zeros(n, hq, lq, spec.q.shape[-1], dtype=cd, device=dev)
    dk = torch.zeros(n, hkv, spec.lk, spec.k.shape[-1], dtype=cd, device=dev)
    dvv = torch.zeros(n, hkv, spec.lk, dv, dtype=cd, device=dev)
    dbias = torch.zeros(spec.bias.shape, dtype=cd, device=dev) if (
        spec.bias is not None and spec.bias.requires_grad) else None
    params = spec.score_mod_params
    dparams: List[Optional[Tensor]] = [None] * len(params)
    # dk and dv gather every query tile's share. Spread over threads, the tiles go in chunks
    # (chunk c: tiles c, c + C, c + 2C ..., in that order), each chunk adding into its own
    # pair (chunk 0 into dk, dvv), summed in chunk order at the end: the same bits whichever
    # thread ran which chunk. dbias and score_mod parameters have one accumulator: serial.
    threads = 1 if (dbias is not None or params) else workers.item_threads(plan.nqb, dev)
    chunks = min(plan.nqb, 2 * threads) if threads > 1 else 1

    def query_tile(qb: int, acc: Tuple[Tensor, ...]) -> None:
        dk, dvv = acc
        q0, q1 = plan.q_range(qb)
        rows = t.g * (q1 - q0)
        kbs = plan.key_blocks(qb)
        if not kbs:
            return
        qt = t.q_tile(q0, q1)
        do_t = t.rows(dout_c, q0, q1)
        lse_t = t.rows(lse_safe, q0, q1).unsqueeze(-1)
        delta_t = t.rows(delta, q0, q1).unsqueeze(-1)
        dq_acc = torch.zeros(qt.shape, dtype=cd, device=dev)
        for kb, k0, k1, vis in t.key_tiles(qb, kbs):
            s, raw, pre_mod, _ = t.scores(qt, kb, q0, q1, vis, keep=True)
            p = torch.exp(s.reshape(n, hkv, rows, k1 - k0) - lse_t)
            vt = t.v[:, :, k0:k1]
            dp = t.mm_out(do_t, vt.transpose(-1, -2))
            if dp_scale is not None:
                dp = quantize_dp(dp, dp_scale)
            drop = dropout_tile(spec, q0, q1, k0, k1, cd)
            if drop is not None:
                shape4 = (n, hq, q1 - q0, k1 - k0)
                p_drop = (p.view(shape4) * drop).view_as(p)
                dp = (dp.view(shape4) * drop).view_as(dp)
            else:
                p_drop = p
            dvv[:, :, k0:k1] += t.mm_out(p_drop.transpose(-1, -2), do_t)
            ds = (p * (dp - delta_t)).view(n, hq, q1 - q0, k1 - k0)
            ds = _score_backward(spec, ds, raw, pre_mod, q0, q1, k0, k1, dbias, dparams)
            ds = ds.reshape(n, hkv, rows, k1 - k0)
            dq_acc += t.mm_out(ds, t.k[:, :, k0:k1])
            dk[:, :, k0:k1] += t.mm_out(ds.transpose(-1, -2), qt)
        dq[:, :, q0:q1] = (dq_acc * t.q_scale).view(n, hq, q1 - q0, -1)

    workers.for_each_into(list(range(plan.nqb)), query_tile, (dk, dvv), threads, chunks)
    dsinks = None
    if spec.sinks is not None and spec.sinks.requires_grad:
        dsinks = sink_gradient(spec, lse_safe, delta)
    return Grads(dq=dq, dk=dk, dv=dvv, dbias=dbias, dsinks=dsinks, dparams=tuple(dparams))


def sink_gradient(spec: AttentionSpec, lse_safe: Tensor, delta: Tensor) -> Tensor:
    """d loss / d sink_h = -sum over rows of exp(sink_h - lse) * delta, where
    delta = rowsum(dout * out) - dlse and lse_safe is +inf for rows without keys."""
    cd = spec.compute_dtype
    p_sink = torch.exp(spec.sinks.to(cd).view(1, -1, 1) - lse_safe.to(cd))
    return -(p_sink * delta).sum(dim=(0, 2))


def _score_backward(spec: AttentionSpec, ds: Tensor, raw: Tensor, pre_mod: Tensor,
                    q0: int, q1: int, k0: int, k1: int, dbias: Optional[Tensor],
                    dparams: List[Optional[Tensor]]) -> Tensor:
    """Chain dS (w.r.t. the final scores) back through score_mod, bias and softcap to the
    scaled scores; accumulate dbias and the gradients of tensors the score_mod captured."""
    graph = torch.is_grad_enabled()  # the caller differentiates this backward again
    if spec.score_mod is not None:
        params = spec.score_mod_params
        with torch.enable_grad():
            # on a differentiable backward, keep pre_mod's own graph (to q and k)
            x = pre_mod if graph and pre_mod.requires_grad else (
                pre_mod.detach().requires_grad_(True))
            y = apply_score_mod(spec, x, q0, q1, k0, k1)
            if y.requires_grad:
                grads = torch.autograd.grad(y, (x, *params), ds, allow_unused=True,
                                            create_graph=graph)
            elif torch.is_grad_enabled() and x.requires_grad and y.grad_fn is None and (
                    _recipe_vjp_applies(spec)):  # no autograd here (inside a custom op)
                grads = _recipe_vjp(spec, pre_mod, ds, q0, q1, k0, k1)
            else:  # the mod ignores the score and every tensor it reads is constant
                grads = (None,) * (1 + len(params))
        # a mod that ignores the score (a constant or a table lookup) passes no gradient on
        ds = grads[0] if grads[0] is not None else torch.zeros_like(ds)
        for idx, g in enumerate(grads[1:]):
            if g is not None:
                dparams[idx] = g if dparams[idx] is None else dparams[idx] + g
    if dbias is not None:
        _accumulate_broadcast(dbias, ds, q0, q1, k0, k1)
    if spec.softcap is not None:  # raw is scale * q.k / cap: d(cap * tanh(raw)) / d raw
        ds = softcap_grad(ds, raw, spec.softcap)
    return ds


def _recipe_vjp_applies(spec: AttentionSpec) -> bool:
    """The score_mod is a builtin whose learnable tensors are its recipe's own."""
    recipe = getattr(spec.score_mod, "recipe", None) if info_of(spec.score_mod) else None
    return recipe is not None and all(
        any(p is t for t in recipe[1]) for p in spec.score_mod_params)


def _recipe_vjp(spec: AttentionSpec, pre_mod: Tensor, ds: Tensor, q0: int, q1: int, k0: int,
                k1: int) -> Tuple[Optional[Tensor], ...]:
    """The chain rule through a builtin score_mod with ``torch.func.vjp``: the mod is rebuilt
    from its recipe on the tensors being differentiated (custom ops run without autograd, but
    functorch's transforms still work there)."""
    tree, tensors = spec.score_mod.recipe
    where = [next(i for i, t in enumerate(tensors) if t is p) for p in spec.score_mod_params]

    def fn(x: Tensor, *ps: Tensor) -> Tensor:
        ts = list(tensors)
        for i, p in zip(where, ps):
            ts[i] = p
        mod = from_recipe(tree, ts)
        return call_score_mod(mod, x, *index_grid(spec, q0, q1, k0, k1))

    _, vjp = torch.func.vjp(fn, pre_mod.detach(), *(tensors[i].detach() for i in where))
    return vjp(ds)


def _accumulate_broadcast(acc: Tensor, g: Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
    """acc[tile] += g summed over the dims where acc broadcasts (size 1)."""
    dims = [d for d in range(4) if acc.shape[d] == 1 and g.shape[d] != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    slice_tile(acc, q0, q1, k0, k1).add_(g)


def dp_amax(spec: AttentionSpec, dout: Tensor) -> Tensor:
    """max |dP| = max |dO_i . v_j| over the pairs (i, j) that the call's masks let through
    (dP before dropout; cuDNN's amax_dP), 0-d float32, tile by tile: ``dout`` (N, Hq, Lq,
    Dv). 0 where no pair is visible."""
    plan = make_plan(spec)
    t = _Tiles(spec, plan)
    n, hkv = spec.n, spec.hkv
    dout_c = dout.to(t.cd)
    best = torch.zeros((), dtype=torch.float32, device=spec.q.device)
    for qb in range(plan.nqb):
        q0, q1 = plan.q_range(qb)
        kbs = plan.key_blocks(qb)
        if not kbs:
            continue
        rows = t.g * (q1 - q0)
        qt, do_t = t.q_tile(q0, q1), t.rows(dout_c, q0, q1)
        for kb, k0, k1, vis in t.key_tiles(qb, kbs):
            s, _, _, _ = t.scores(qt, kb, q0, q1, vis)
            seen = s.reshape(n, hkv, rows, k1 - k0) != float("-inf")
            dp = t.mm_out(do_t, t.v[:, :, k0:k1].transpose(-1, -2)).abs()
            best = torch.maximum(best, torch.where(seen, dp, torch.zeros_like(dp)).amax().float())
    return best


def dense_probabilities(spec: AttentionSpec, lse: Tensor) -> Tensor:
    """Dense pre-dropout weights exp(S - lse), (N, Hq, Lq, Lk) in compute dtype."""
    plan = make_plan(spec)
    t = _Tiles(spec, plan)
    p = torch.zeros(spec.n, spec.hq, spec.lq, spec.lk, dtype=t.cd, device=spec.q.device)
    lse_safe = safe_lse(lse.to(t.cd))
    for qb in range(plan.nqb):
        q0, q1 = plan.q_range(qb)
        kbs = plan.key_blocks(qb)
        if not kbs:
            continue
        qt = t.q_tile(q0, q1)
        for kb in kbs:
            k0, k1 = plan.k_range(kb)
            vis = tile_visibility(spec, plan, qb, kb)
            s, _, _, _ = t.scores(qt, kb, q0, q1, vis)
            p[:, :, q0:q1, k0:k1] = torch.exp(s - lse_safe[:, :, q0:q1, None])
    return p
