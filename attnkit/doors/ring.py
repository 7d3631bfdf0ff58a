"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds a shard of the sequence (``L_local`` positions of q, k and v). K/V shards travel
around the ring of ranks with point-to-point send/recv, overlapped with the compute of the
block already at hand; every rank attends its queries to each visiting shard and merges the
partial results by their log-sum-exp (:func:`attnkit.merge.merge_state`). The backward is a
second ring pass: dK/dV accumulate in buffers that travel with K/V and arrive back at their
owner after ``world_size`` hops. One autograd node per rank, so ``loss.backward()`` on every
rank gives each rank the gradients of its own shard.

Layouts (``world_size = 2``, a sequence of 8 positions)::

    contiguous   rank 0: 0 1 2 3          rank r holds [r * L_local, (r + 1) * L_local)
                 rank 1: 4 5 6 7

    zigzag       rank 0: 0 1 | 6 7        the sequence is cut into 2 * world_size chunks;
                 rank 1: 2 3 | 4 5        rank r holds chunks r and 2 * world_size - 1 - r

Causal work per (query shard, key shard) pair, ``world_size = 2`` (``#`` full block, ``\\``
diagonal block, ``.`` skipped)::

    contiguous       keys  r0 r1        zigzag           keys  c0 c1 c2 c3
    rank 0 queries   r0     \\  .        rank 0 queries   c0     \\  .  .  .
    rank 1 queries   r1     #  \\        rank 1 queries   c1     #  \\  .  .
                                        rank 1 queries   c2     #  #  \\  .
    rank 0: 1 diagonal block            rank 0 queries   c3     #  #  #  \\
    rank 1: 1 full + 1 diagonal         each rank: 3 full + 2 diagonal chunk blocks

Every position-based option (causal, window, ALiBi, ``score_mod``, ``mask``) sees global
positions, so the gathered result equals :func:`attnkit.attention` on the full sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..kv.merge import merge_state
from ..terms.checks import check_window, compute_dtype_of
from ..terms.fp8 import check_out_dtype, finish_output
from ..terms.mods import find_captured_tensors, remap
from ..terms.score_mods import alibi, compose
from ..terms.spec import DoorOptions, Options
from .attention import attention_backward, attention_forward

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence"]

LAYOUTS = ("contiguous", "zigzag")
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- layouts


def _check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    return layout


def _num_chunks(world_size: int, layout: str) -> int:
    return world_size if layout == "contiguous" else 2 * world_size


def _chunks(layout: str, world_size: int, rank: int, length: int) -> List[Tuple[int, int, int]]:
    """The contiguous runs of rank ``rank``'s shard: ``(local start, global start, length)``."""
    if layout == "contiguous":
        return [(0, rank * length, length)]
    c = length // 2
    return [(0, rank * c, c), (c, (2 * world_size - 1 - rank) * c, c)]


def _check_int(name: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < lo or (hi is not None and value >= hi):
        rng = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {rng}; got {value}")
    return value


def shard_sequence(x: Tensor, world_size: int, rank: int, layout: str = "contiguous", *,
                   dim: int = -2) -> Tensor:
    """This rank's shard of a full sequence ``x`` along ``dim`` (default -2, the sequence dim
    of ``(*B, H, L, D)``; pass ``dim=-1`` for an lse ``(*B, H, L)``).

    ``"contiguous"`` gives positions ``[rank * L / W, (rank + 1) * L / W)`` (a view);
    ``"zigzag"`` cuts the sequence into ``2 W`` chunks and returns chunks ``rank`` and
    ``2 W - 1 - rank`` concatenated (a copy). ``L`` must divide evenly into those chunks.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    world_size = _check_int("world_size", world_size, 1)
    rank = _check_int("rank", rank, 0, world_size)
    layout = _check_layout(layout)
    length = x.shape[dim]
    parts = _num_chunks(world_size, layout)
    if length % parts:
        nxt = -(-length // parts) * parts
        raise ValueError(
            f"x has length {length} along dim {dim}, which does not split into {parts} equal "
            f"chunks ({world_size} ranks, layout={layout!r}); pad the sequence to a multiple of "
            f"{parts} (the next one is {nxt}) or mask the padding")
    local = length // world_size
    pieces = [x.narrow(dim, start, n)
              for _, start, n in _chunks(layout, world_size, rank, local)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def unshard_sequence(shards: Sequence[Tensor], layout: str = "contiguous", *,
                     dim: int = -2) -> Tensor:
    """The full sequence from every rank's shard (``shards[r]`` from rank ``r``): the inverse
    of :func:`shard_sequence`. Gather the shards first, e.g. with ``dist.all_gather``."""
    if isinstance(shards, Tensor) or not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError("shards must be a non-empty list of tensors, one per rank in rank order")
    for r, s in enumerate(shards):
        if not isinstance(s, Tensor):
            raise TypeError(f"shards[{r}] must be a torch.Tensor; got {type(s).__name__}")
        if s.shape != shards[0].shape:
            raise ValueError(
                f"shards[{r}] has shape {tuple(s.shape)} but shards[0] has "
                f"{tuple(shards[0].shape)}; every rank's shard must have the same shape")
    layout = _check_layout(layout)
    local = shards[0].shape[dim]
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    if local % 2:
        raise ValueError(
            f"layout='zigzag' shards hold two equal chunks, so their length along dim {dim} "
            f"must be even; got {local}")
    half = local // 2
    fronts = [s.narrow(dim, 0, half) for s in shards]  # chunks 0 .. W-1
    backs = [s.narrow(dim, half, half) for s in reversed(shards)]  # chunks W .. 2W-1
    return torch.cat(fronts + backs, dim=dim)


# --------------------------------------------------------------------------- block plans


@dataclass(frozen=True)
class _Block:
    """One attention call of a ring step: this rank's query rows ``[q0, q1)`` against the
    visiting shard's keys ``[k0, k1)``, with a top-left ``window`` (None = no mask) and the
    global positions of row ``q0`` and key ``k0``."""

    q0: int
    q1: int
    k0: int
    k1: int
    window: Optional[Tuple[Optional[int], Optional[int]]]
    q_pos: int
    k_pos: int


def _plan_pair(q_start: int, q_len: int, k_start: int, k_len: int, lo: Optional[int],
               hi: Optional[int]) -> Optional[_Block]:
    """The visible part of a query chunk (global positions ``q_start + i``) against a key chunk
    (``k_start + j``) under the band ``lo <= j_glob - i_glob <= hi`` (None = unbounded).

    Returns None when nothing is visible. Otherwise rows and keys are trimmed to those that
    see something, which also moves the band to contain the diagonal, so it is a top-left
    ``window=(left, right)`` with both sides >= 0; a side that clips nothing is dropped.
    In chunk-local indices (``i``, ``j``) the band is ``lo - c <= j - i <= hi - c`` with
    ``c = k_start - q_start``.
    """
    c = k_start - q_start
    lo_l = None if lo is None else lo - c
    hi_l = None if hi is None else hi - c
    q0, q1, k0, k1 = 0, q_len, 0, k_len
    if hi_l is not None:  # row i sees j <= i + hi_l
        q0, k1 = max(q0, -hi_l), min(k1, q_len + hi_l)
    if lo_l is not None:  # row i sees j >= i + lo_l
        k0, q1 = max(k0, lo_l), min(q1, k_len - lo_l)
    if q0 >= q1 or k0 >= k1:
        return None
    shift = k0 - q0  # band on the trimmed block: lo_l - shift <= j' - i' <= hi_l - shift
    left = None if lo_l is None or lo_l - shift <= -(q1 - q0 - 1) else shift - lo_l
    right = None if hi_l is None or hi_l - shift >= k1 - k0 - 1 else hi_l - shift
    window = None if left is None and right is None else (left, right)
    return _Block(q0, q1, k0, k1, window, q_start + q0, k_start + k0)


def _coalesce(blocks: List[_Block]) -> List[_Block]:
    """Merge unmasked blocks that tile a larger rectangle (one call instead of several). Only
    valid when no option depends on positions."""
    blocks = list(blocks)
    merged = True
    while merged:
        merged = False
        for a in range(len(blocks)):
            for b in range(len(blocks)):
                x, y = blocks[a], blocks[b]
                if a == b or x.window is not None or y.window is not None:
                    continue
                if (x.q0, x.q1) == (y.q0, y.q1) and x.k1 == y.k0:
                    new = _Block(x.q0, x.q1, x.k0, y.k1, None, x.q_pos, x.k_pos)
                elif (x.k0, x.k1) == (y.k0, y.k1) and x.q1 == y.q0:
                    new = _Block(x.q0, y.q1, x.k0, x.k1, None, x.q_pos, x.k_pos)
                else:
                    continue
                blocks = [blk for i, blk in enumerate(blocks) if i not in (a, b)] + [new]
                merged = True
                break
            if merged:
                break
    return blocks


# --------------------------------------------------------------------------- options


@dataclass
class _Config:
    """The validated options of one ring_attention call."""

    group: Any
    layout: str
    lo: Optional[int]  # band on j_glob - i_glob (causal, window)
    hi: Optional[int]
    scale: Optional[float]
    softcap: Optional[float]
    score_mod: Optional[Callable[..., Tensor]]  # ALiBi and the user's mod, global positions
    mask_mod: Optional[Callable[..., Tensor]]
    backend: str
    plans: List[List[Tuple[_Block, dict]]] = field(default_factory=list)

    @property
    def positional(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None


def _at_positions(fn: Callable[..., Tensor], q_pos: int, k_pos: int, kind: str):
    """``fn`` called with global positions: local index + the block's start position."""

    def shift(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor):
        return b, h, q_idx + q_pos, kv_idx + k_pos

    return remap(fn, shift, score=kind == "score", suffix=f"at_q{q_pos}_k{k_pos}")


def _block_options(cfg: _Config, blk: _Block) -> dict:
    opts: dict = {"scale": cfg.scale, "softcap": cfg.softcap, "window": blk.window,
                  "backend": cfg.backend}
    if cfg.score_mod is not None:
        opts["score_mod"] = _at_positions(cfg.score_mod, blk.q_pos, blk.k_pos, "score")
    if cfg.mask_mod is not None:
        opts["mask"] = _at_positions(cfg.mask_mod, blk.q_pos, blk.k_pos, "mask")
    return opts


def _step_work(cfg: _Config, world_size: int, rank: int, src: int,
               length: int) -> List[Tuple[_Block, dict]]:
    """The calls of one ring step: this rank's queries against rank ``src``'s keys."""
    blocks = []
    for ql, qg, qn in _chunks(cfg.layout, world_size, rank, length):
        for kl, kg, kn in _chunks(cfg.layout, world_size, src, length):
            blk = _plan_pair(qg, qn, kg, kn, cfg.lo, cfg.hi)
            if blk is not None:
                blocks.append(_Block(blk.q0 + ql, blk.q1 + ql, blk.k0 + kl, blk.k1 + kl,
                                     blk.window, blk.q_pos, blk.k_pos))
    if not cfg.positional:
        blocks = _coalesce(blocks)
    return [(blk, _block_options(cfg, blk)) for blk in blocks]


def _build_config(q: Tensor, group: Any, causal: Any, scale: Any, layout: Any, window: Any,
                  alibi_slopes: Any, softcap: Any, score_mod: Any, mask: Any,
                  backend: str) -> _Config:
    layout = _check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    left, right = check_window(window)
    lo = None if left is None else -left
    hi = right
    if causal:
        hi = 0 if hi is None else min(hi, 0)
    mods = []
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes).detach()
        hq = q.shape[-3] if q.dim() >= 3 else 1
        if slopes.shape != (hq,):
            raise ValueError(f"alibi_slopes must have shape ({hq},) (one slope per query head) "
                             f"for ring_attention; got {tuple(slopes.shape)}")
        mods.append(alibi(slopes.to(device=q.device, dtype=compute_dtype_of(q.dtype))))
    if score_mod is not None:
        if not callable(score_mod):
            raise TypeError(f"score_mod must be a callable (score, b, h, q_idx, kv_idx) -> "
                            f"score; got {type(score_mod).__name__}")
        if torch.is_grad_enabled() and find_captured_tensors(score_mod):
            raise NotImplementedError(
                "score_mod captures tensors that require grad; ring_attention does not return "
                "gradients for them. Detach them, or use attnkit.attention on one process")
        mods.append(score_mod)
    if mask is not None and (isinstance(mask, Tensor) or not callable(mask)
                             or hasattr(mask, "kv_num_blocks")):
        raise TypeError(
            f"mask must be a mask_mod callable (b, h, q_idx, kv_idx) -> bool, which "
            f"ring_attention calls with global positions; got {type(mask).__name__}. Bool "
            f"tensors and BlockMasks describe one local shape and are not supported")
    return _Config(group=group, layout=layout, lo=lo, hi=hi, scale=scale, softcap=softcap,
                   score_mod=(mods[0] if len(mods) == 1 else compose(*mods)) if mods else None,
                   mask_mod=mask, backend=backend)


# --------------------------------------------------------------------------- the ring


class _Transfer:
    """Sends in flight to the next rank and receives from the previous one."""

    def __init__(self, works: list, sent: List[Tensor], received: List[Tensor]):
        self.works, self.sent, self.received = works, sent, received

    def wait(self) -> List[Tensor]:
        for w in self.works:
            w.wait()
        return self.received


class _Ring:
    """This rank's place in the ring of ``group``."""

    def __init__(self, group: Any):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ring_attention needs an initialised process group: call "
                "torch.distributed.init_process_group (e.g. under torchrun) first")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("group does not contain this process; call ring_attention only on "
                             "the ranks of group")
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def _global(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def shift(self, tensors: List[Tensor]) -> _Transfer:
        """Start sending ``tensors`` to the next rank and receiving their like from the
        previous one; ``wait()`` returns the received tensors."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        return _Transfer(dist.batch_isend_irecv(ops), sent, received)


def _describe(x: Tensor) -> List[int]:
    s = tuple(x.shape)
    if len(s) < 3:
        s = (1,) * (3 - len(s)) + s
    lead = 1
    for d in s[:-3]:
        lead *= d
    return [x.dim(), lead, *s[-3:]]


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., L_local, D); got shape "
                             f"{tuple(x.shape)}")


def _check_shards(ring: _Ring, q: Tensor, k: Tensor, v: Tensor, layout: str) -> None:
    """Check that every rank holds shards of one shape and dtype (one small all_gather, so
    every rank raises the same error instead of hanging in the ring)."""
    code = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1
    desc = torch.tensor([*_describe(q), *_describe(k), *_describe(v), code],
                        dtype=torch.int64, device=q.device)
    rows = [desc]
    if ring.size > 1:
        rows = [torch.empty_like(desc) for _ in range(ring.size)]
        dist.all_gather(rows, desc, group=ring.group)
    table = [r.tolist() for r in rows]
    if any(row != table[0] for row in table):
        lines = "; ".join(f"rank {r}: q {tuple(row[1:5])}, k {tuple(row[6:10])}, "
                          f"v {tuple(row[11:15])}, dtype "
                          f"{_DTYPES[row[15]] if row[15] >= 0 else 'other'}"
                          for r, row in enumerate(table))
        raise ValueError(
            f"ring_attention needs shards of the same shape and dtype on every rank (shown "
            f"as (batch, heads, L_local, dim)): {lines}. Split the sequence with "
            f"attnkit.distributed.shard_sequence")
    lq, lk = q.shape[-2], k.shape[-2]
    if lq != lk:
        raise ValueError(
            f"q has L_local={lq} and k has {lk} (dim -2); ring attention is self-attention "
            f"over one sharded sequence, so q, k and v must hold the same positions")
    if layout == "zigzag" and lq % 2:
        raise ValueError(
            f"layout='zigzag' holds two equal chunks per rank, so L_local must be even; got "
            f"L_local={lq}. Pad the sequence to a multiple of 2 * world_size = {2 * ring.size}")


def _output_shapes(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    if q.dim() == 2:
        return (q.shape[0], v.shape[-1]), (q.shape[0],)
    batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    rows = (*batch, q.shape[-3], q.shape[-2])
    return (*rows, v.shape[-1]), rows


def _ring_forward(ring: _Ring, cfg: _Config, q: Tensor, k: Tensor,
                  v: Tensor) -> Tuple[Tensor, Tensor]:
    """Forward pass; records each step's calls in ``cfg.plans`` for the backward."""
    cd = compute_dtype_of(q.dtype)
    out_shape, lse_shape = _output_shapes(q, k, v)
    out = torch.zeros(out_shape, dtype=cd, device=q.device)
    lse = torch.full(lse_shape, float("-inf"), dtype=cd, device=q.device)
    qc, length = q.to(cd), q.shape[-2]
    k_cur, v_cur = k.contiguous(), v.contiguous()
    cfg.plans = []
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        transfer = ring.shift([k_cur, v_cur]) if step + 1 < ring.size else None
        work = _step_work(cfg, ring.size, ring.rank, src, length)
        for blk, opts in work:
            nq, nk = blk.q1 - blk.q0, blk.k1 - blk.k0
            o, l = attention_forward(qc.narrow(-2, blk.q0, nq),
                                     k_cur.narrow(-2, blk.k0, nk).to(cd),
                                     v_cur.narrow(-2, blk.k0, nk).to(cd), **opts)
            rows = slice(blk.q0, blk.q1)
            out[..., rows, :], lse[..., rows] = merge_state(out[..., rows, :], lse[..., rows],
                                                            o, l)
        cfg.plans.append(work)
        if transfer is not None:
            k_cur, v_cur = transfer.wait()
    return out, lse


def _ring_backward(ring: _Ring, cfg: _Config, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                   lse: Tensor, dout: Tensor,
                   dlse: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """Second ring pass with the final ``out``/``lse``; dK/dV travel with K/V."""
    cd = out.dtype
    qc, dout_c = q.to(cd), dout.to(cd)
    if dlse is not None:
        # The backward uses D = rowsum(dout * out) - dlse. Append a column with out = 1,
        # dout = -dlse and v = 0: it changes D by -dlse and nothing else.
        out = torch.cat([out, torch.ones_like(out[..., :1])], dim=-1)
        dout_c = torch.cat([dout_c, -dlse.to(cd).unsqueeze(-1)], dim=-1)
    dq = torch.zeros(q.shape, dtype=cd, device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    incoming: Optional[_Transfer] = None
    gk = gv = None
    for step, work in enumerate(cfg.plans):
        transfer = ring.shift([k_cur, v_cur]) if step + 1 < ring.size else None
        gk = gv = None  # gradients of the visiting shard's k and v
        for blk, opts in work:
            nq, nk = blk.q1 - blk.q0, blk.k1 - blk.k0
            vb = v_cur.narrow(-2, blk.k0, nk).to(cd)
            if dlse is not None:
                vb = torch.cat([vb, torch.zeros_like(vb[..., :1])], dim=-1)
            g = attention_backward(qc.narrow(-2, blk.q0, nq), k_cur.narrow(-2, blk.k0, nk).to(cd),
                                   vb, out.narrow(-2, blk.q0, nq), lse.narrow(-1, blk.q0, nq),
                                   dout_c.narrow(-2, blk.q0, nq), **opts)
            if gk is None or gv is None:
                gk = torch.zeros(k.shape, dtype=cd, device=k.device)
                gv = torch.zeros(v.shape, dtype=cd, device=v.device)
            dq.narrow(-2, blk.q0, nq).add_(g.dq)
            gk.narrow(-2, blk.k0, nk).add_(g.dk)
            gv.narrow(-2, blk.k0, nk).add_(g.dv[..., :v.shape[-1]])
        if incoming is not None:  # what the previous ranks accumulated for this shard
            dk_in, dv_in = incoming.wait()
            gk = dk_in if gk is None else gk.add_(dk_in)
            gv = dv_in if gv is None else gv.add_(dv_in)
        if gk is None or gv is None:
            gk = torch.zeros(k.shape, dtype=cd, device=k.device)
            gv = torch.zeros(v.shape, dtype=cd, device=v.device)
        if ring.size > 1:  # on the last step this goes home to the owner
            incoming = ring.shift([gk, gv])
        if transfer is not None:
            k_cur, v_cur = transfer.wait()
    if incoming is not None:
        gk, gv = incoming.wait()
    return dq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)  # type: ignore[union-attr]


class _RingAttention(torch.autograd.Function):
    """One autograd node per rank: inputs this rank's q, k, v shards; outputs out and lse."""

    @staticmethod
    def forward(ctx, ring: _Ring, cfg: _Config, q: Tensor, k: Tensor, v: Tensor):
        out, lse = _ring_forward(ring, cfg, q, k, v)
        ctx.ring, ctx.cfg = ring, cfg
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype), lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None and not bool(dlse.any()):
            dlse = None
        dq, dk, dv = _ring_backward(ctx.ring, ctx.cfg, q, k, v, out, lse, dout, dlse)
        return None, None, dq, dk, dv


#: Options ring_attention does not take, and why.
UNSUPPORTED = {
    "bias": "a bias describes one local (Lq, Lk) grid; use score_mod with global positions",
    "diagonal": "positions are global: the diagonal is top-left",
    "seqlens_q": "pad the global sequence instead", "seqlens_kv": "pad the global sequence "
    "instead", "starts_kv": "pad the global sequence instead",
    "sinks": "not yet carried around the ring", "dropout_p": "not yet replayed "
    "around the ring", "seed": "no dropout", "offset": "no dropout",
    "dropout_mask": "a keep mask describes one local grid",
    "p_scale": "the softmax weights are rounded to fp8 after normalising by the whole row, "
               "which each block's partial softmax does not know; run attnkit.attention",
    "descale_q": "fp8 shards are not carried around the ring: dequantize them first "
                 "(q8.float() * descale_q)",
    "descale_k": "fp8 shards are not carried around the ring: dequantize them first",
    "descale_v": "fp8 shards are not carried around the ring: dequantize them first",
}
#: What ring_attention takes (an allow-list: each block's call is rebuilt from these)
TAKES = DoorOptions("ring_attention", frozenset({
    "scale", "causal", "window", "alibi_slopes", "softcap", "score_mod", "mask", "out_dtype",
    "out_scale"}), UNSUPPORTED)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: Any = None,
                   layout: str = "contiguous", return_lse: bool = False,
                   backend: str = "auto", **options: Any) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a sequence sharded across the ranks of ``group`` (ring attention).

    Call it on every rank of ``group`` (default: the default process group) with that rank's
    shard; ``shard_sequence`` / ``unshard_sequence`` convert between full sequences and shards.
    Shapes (the same on every rank; ``L_local`` = positions per rank)::

        q     (*B, Hq,  L_local, Dqk)      Hq a multiple of Hkv (grouped-query attention)
        k     (*B, Hkv, L_local, Dqk)
        v     (*B, Hkv, L_local, Dv)
        out   (*B, Hq,  L_local, Dv)       in the input dtype
        lse   (*B, Hq,  L_local)           float32 (float64 for float64 inputs)

    Gathered with ``unshard_sequence``, ``out`` and ``lse`` equal
    ``attnkit.attention(q_full, k_full, v_full, ...)`` with the same options, and gradients
    flow through one autograd node per rank: every rank must run the backward (it is a second
    ring pass), e.g. ``loss.backward()`` on each rank.

    Takes the options in :data:`TAKES` (an allow-list; the others are refused with the
    reasons in :data:`UNSUPPORTED`).

    Args:
        layout: ``"contiguous"`` (rank r holds positions ``[r * L_local, (r + 1) * L_local)``)
            or ``"zigzag"`` (the sequence is cut into ``2 * world_size`` chunks and rank r holds
            chunks ``r`` and ``2 * world_size - 1 - r``, which balances causal work; L_local
            must be even). See the module docstring for pictures.
        causal, window, alibi_slopes (``(Hq,)``), softcap, scale: as in
            :func:`attnkit.attention`, with global positions (top-left diagonal).
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score``, called with global positions;
            applied after ALiBi. Tensors it captures get no gradient.
        mask: a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` called with global positions (e.g.
            documents); prefer ``causal`` and ``window``, which skip whole blocks.
        out_dtype, out_scale: the output's dtype (and an fp8 output's scale), as in
            :func:`attnkit.attention`.
        return_lse: also return ``lse``; its gradient is supported.
        backend: the executor for each block, as in :func:`attnkit.attention`.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: shards differ in shape or dtype between ranks, q and k hold different
            lengths, an odd L_local with ``layout="zigzag"``, invalid options.
    """
    opts = Options.from_kwargs("ring_attention", options, TAKES)
    out_dtype, out_scale = check_out_dtype(opts.out_dtype, opts.out_scale)
    _check_tensors(q, k, v)
    cfg = _build_config(q, group, opts.causal, opts.scale, layout, opts.window,
                        opts.alibi_slopes, opts.softcap, opts.score_mod, opts.mask, backend)
    ring = _Ring(group)
    _check_shards(ring, q, k, v, cfg.layout)
    out, lse = _RingAttention.apply(ring, cfg, q, k, v)
    out = finish_output(out, out_dtype, out_scale)
    return (out, lse) if return_lse else out
