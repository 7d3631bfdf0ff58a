"""The triton executor: FlashAttention-2 forward and backward as Triton GPU kernels.

The kernels (:mod:`attnkit.backends.triton.kernels`, the only module that imports triton,
loaded on first use) take attnkit's plan as int tables: for each query block the key blocks
that hold work, each tile's kind (empty tiles are not listed; full tiles skip the mask terms;
partial tiles evaluate them) and, where a ``mask_mod`` or a BlockMask cuts a tile, that tile's
visibility evaluated once on the host (:func:`attnkit.plan.tile_visibility`) and stored in a
buffer the kernel reads. Every other term is compiled in as a constexpr branch: causal and
windows with either diagonal, seqlens padding, documents / packed sequences (segments with a
per-row diagonal), ALiBi (per head or per row), softcap, sinks, builtin additive score_mods
(``relative_bias``, ``alibi``, ``head_bias`` and compositions of them: a table over
``kv_idx - q_idx`` built from the builtin's own bias), bool masks and additive bias read with
broadcast strides (with dBias), Philox dropout (the counter layout of :mod:`attnkit.dropout`,
bit for bit) or a given keep mask.

Decoding (few query rows per key/value head) runs the same forward kernel with the ``G`` query
heads of a key/value head stacked into one program and the key blocks split across programs;
their partial max / sum / accumulator are merged by a second kernel. Keys and values may be
read through a paged block table. The backward is a dQ kernel and a dK/dV kernel (which loops
over the query heads of its key/value head and writes dBias); every output element is written
by one program, so it is deterministic.

On CPU tensors the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``, set
before triton is imported) and only when forced (``backend="triton"``): ``backend="auto"``
picks it for CUDA tensors only (``CAPS.auto_devices``).

Under ``torch.compile`` the kernels run inside the ``attnkit::attention`` custom ops
(:mod:`attnkit.ops`), which select this executor as eager mode does. They are not registered
as a ``torch.library.triton_op``: the launches depend on the plan's tile tables, which the host
builds from the call's data (``nonzero``, lengths, lists), and that cannot be traced.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ...engine import plan as plan_mod
from ...terms.mods import info_of
from ...terms.score_terms import safe_lse
from ...terms.spec import AttentionSpec
from ..base import Capabilities, ForwardResult, Grads

CAPS = Capabilities(
    name="triton",
    features=frozenset({
        "window", "mask", "block_mask", "mask_mod", "seqlens_q", "seqlens_kv", "segments",
        "row_offset", "bias", "bias_grad", "alibi", "alibi_rows", "softcap",
        "additive_score_mod", "sinks", "dropout", "dropout_mask", "max_scores", "paged_kv"}),
    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
    devices=frozenset({"cuda", "cpu"}),
    auto_devices=frozenset({"cuda"}),  # CPU tensors (the interpreter) only when forced
    max_head_dim=256,
    why={"score_mod": "the kernels evaluate no Python callable; builtin additive score_mods "
                      "(relative_bias, alibi, head_bias and compositions of them) run",
         "score_mod_grad": "the kernels do not reduce dS per relative distance, which "
                           "learnable score_mod tensors need"},
)

#: Tile sizes (query block, key block) for every kernel, overriding the defaults (tests).
TILES: Optional[Tuple[int, int]] = None
#: Number of key splits of a decoding forward, overriding the default.
SPLITS: Optional[int] = None
#: Decoding layout (query heads of a key/value head stacked in one program) up to this many
#: query rows per key/value head.
DECODE_ROWS = 64
#: Relative distances kinds of builtin additive score_mods the kernels run as a table.
RELATIVE_KINDS = frozenset({"relative_bias", "alibi", "head_bias"})
#: CUDA's limit on the second and third grid dims.
GRID_LIMIT = 65535

_INSTALL = "pip install 'attnkit[triton]'"
_found: Dict[str, bool] = {}


# ---- availability -----------------------------------------------------------------------------


def triton_installed() -> bool:
    """Can ``triton`` be imported (looked up once)?"""
    if "triton" not in _found:
        _found["triton"] = importlib.util.find_spec("triton") is not None
    return _found["triton"]


def load_kernels() -> ModuleType:
    """The kernels module, imported on first use."""
    return importlib.import_module(__name__ + ".kernels")


def interpreting() -> bool:
    """Do the kernels run under Triton's interpreter (CPU tensors)? Both the environment
    variable now and the kernels as they were imported must say so."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1" or not triton_installed():
        return False
    return bool(load_kernels().INTERPRET)


def _relative_parts(structure: Any) -> bool:
    """Is a builtin score_mod's structure a function of (head, kv_idx - q_idx) only?"""
    if not isinstance(structure, dict):
        return False
    kind = structure.get("kind")
    if kind == "compose":
        return all(_relative_parts(p) for p in structure.get("parts", ()))
    return kind in RELATIVE_KINDS


def _pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def extra_reasons(spec: AttentionSpec) -> List[str]:
    """What plain capabilities cannot say: triton installed; CPU tensors only under the
    interpreter; which builtin score_mods; BlockMask block sizes; sizes of the grid and of
    dropout's counter; no backward through pages."""
    if not triton_installed():
        return [f"triton is not installed ({_INSTALL})"]
    reasons = []
    if spec.q.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            reasons.append("triton runs on CUDA GPUs; CPU tensors only under Triton's "
                           "interpreter (TRITON_INTERPRET=1 in the environment before torch is "
                           "imported)")
        elif not load_kernels().INTERPRET:
            reasons.append("TRITON_INTERPRET=1 was set after triton was imported; set it "
                           "before triton is imported (torch imports triton with torch.compile's "
                           "machinery: set it before importing torch or attnkit)")
    if spec.score_mod is not None:
        info = info_of(spec.score_mod)
        if info is not None and info.bias is not None and not _relative_parts(info.structure):
            reasons.append(f"triton runs builtin additive score_mods of kinds "
                           f"{', '.join(sorted(RELATIVE_KINDS))} (and compositions of them); "
                           f"got {info.structure.get('kind')!r}")
    if spec.block_mask is not None:
        bq, bk = spec.block_mask.BLOCK_SIZE
        if not (_pow2(bq) and _pow2(bk) and 16 <= min(bq, bk) and max(bq, bk) <= 256):
            reasons.append(f"triton runs BlockMasks with power-of-two block sizes from 16 to "
                           f"256; got BLOCK_SIZE=({bq}, {bk}): rebuild it with BLOCK_SIZE=128")
    if spec.n * spec.hq > GRID_LIMIT:
        reasons.append(f"triton launches one program row per (batch, head): at most "
                       f"{GRID_LIMIT}; got {spec.n} x {spec.hq}")
    if "dropout" in spec.features() and max(spec.n, spec.hq) > 1 << 16:
        reasons.append("dropout's counter holds batch and head indices below 2**16")
    if spec.paged is not None and torch.is_grad_enabled() and spec.q.requires_grad:
        reasons.append("triton has no backward over paged K/V (the paged front door gathers "
                       "the pages when gradients are needed)")
    return reasons


# ---- the plan ---------------------------------------------------------------------------------


@dataclass
class Tables:
    """One tiling of the score matrix as the kernels read it (on the inputs' device).

    ``kind (nqb, nkb)`` int8: 0 empty, 1 partial, 2 full; ``kv_list (nqb, W)`` / ``kv_cnt``:
    the non-empty key blocks of each query block, ascending; ``q_list`` / ``q_cnt``: the
    transpose; ``slot (nqb, nkb)`` int32: the tile's entry in ``tmask`` (-1: none) and
    ``tmask (T, NB, NH, bq, bk)`` uint8 the pre-evaluated visibility of those tiles."""

    bq: int
    bk: int
    nqb: int
    nkb: int
    kind: Tensor
    kv_list: Tensor
    kv_cnt: Tensor
    max_kv: int
    q_list: Tensor
    q_cnt: Tensor
    slot: Optional[Tensor] = None
    tmask: Optional[Tensor] = None


@dataclass
class TritonPlan:
    """The forward tiling, its layout and the per-call arrays the kernels read; the backward
    tiling is made on the first backward."""

    fwd: Tables
    hg: int  # query heads per forward program (1, or G when decoding)
    splits: int  # key splits of the forward (decoding)
    per_split: int  # key blocks per split
    arrays: Dict[str, Optional[Tensor]] = field(default_factory=dict)
    bwd: Optional[Tables] = None


def _sorted_lists(any_: Tensor) -> Tuple[Tensor, Tensor, int]:
    """Per row, the column indices where ``any_`` is True, ascending (padded with 0)."""
    rows, cols = any_.shape
    cnt = any_.sum(1)
    width = max(1, int(cnt.max()) if rows else 1)
    col = torch.arange(cols).expand(rows, cols)
    key = torch.where(any_, col, col + cols)
    order = torch.sort(key, dim=1).values[:, :width]
    order = torch.where(order < cols, order, torch.zeros_like(order))
    return order.to(torch.int32), cnt.to(torch.int32), int(cnt.max()) if rows else 0


def make_tables(spec: AttentionSpec, bq: int, bk: int) -> Tables:
    """attnkit's plan for (bq, bk) tiles as the kernels' tables."""
    p = plan_mod.make_plan(spec, bq, bk)
    dev = spec.q.device
    any_ = p.any.clone()
    full = torch.ones_like(any_)
    for term_full in p.term_full.values():
        full &= term_full
    kind = torch.where(any_, torch.where(full, 2, 1), 0).to(torch.int8)
    kv_list, kv_cnt, max_kv = _sorted_lists(any_)
    q_list, q_cnt, _ = _sorted_lists(any_.t().contiguous())
    t = Tables(bq=bq, bk=bk, nqb=p.nqb, nkb=p.nkb, kind=kind.to(dev), kv_list=kv_list.to(dev),
               kv_cnt=kv_cnt.to(dev), max_kv=max_kv, q_list=q_list.to(dev),
               q_cnt=q_cnt.to(dev))
    if spec.mask_mod is not None or spec.block_mask is not None:
        _tile_masks(spec, p, t, any_)
    return t


def _tile_masks(spec: AttentionSpec, p: plan_mod.Plan, t: Tables, any_: Tensor) -> None:
    """Evaluate the tiles a mask_mod or BlockMask cuts, once, into ``t.tmask``."""
    slot = torch.full((t.nqb, t.nkb), -1, dtype=torch.int32)
    tiles = []
    for qb, kb in torch.nonzero(any_).tolist():
        if not (p.needs("mask_mod", qb, kb) or p.needs("block_mask", qb, kb)):
            continue
        vis = plan_mod.tile_visibility(spec, p, qb, kb)
        if vis is None:
            continue
        (q0, q1), (k0, k1) = p.q_range(qb), p.k_range(kb)
        vis = vis.reshape((1,) * (4 - vis.dim()) + tuple(vis.shape))
        vis = vis.expand(vis.shape[0], vis.shape[1], q1 - q0, k1 - k0)
        slot[qb, kb] = len(tiles)
        tiles.append(vis)
    nb = max([v.shape[0] for v in tiles], default=1)
    nh = max([v.shape[1] for v in tiles], default=1)
    buf = torch.zeros(max(1, len(tiles)), nb, nh, t.bq, t.bk, dtype=torch.uint8,
                      device=spec.q.device)
    for idx, vis in enumerate(tiles):
        buf[idx, :, :, :vis.shape[2], :vis.shape[3]] = vis.to(torch.uint8)
    t.slot, t.tmask = slot.to(spec.q.device), buf


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _head_block(spec: AttentionSpec) -> int:
    return max(_next_pow2(spec.dqk), _next_pow2(spec.dv), 16)


def _decoding(spec: AttentionSpec) -> bool:
    return spec.block_mask is None and spec.lq * spec.groups <= DECODE_ROWS


def forward_tiles(spec: AttentionSpec) -> Tuple[int, int]:
    """(query block, key block) of the forward: the BlockMask's blocks when there is one."""
    if spec.block_mask is not None:
        return tuple(spec.block_mask.BLOCK_SIZE)
    if _decoding(spec):
        bk = TILES[1] if TILES is not None else (32 if _interp(spec) else
                                                 (64 if _head_block(spec) <= 128 else 32))
        return _next_pow2(spec.lq), bk
    if TILES is not None:
        return TILES
    if _interp(spec):
        return 32, 32
    return (128, 64) if _head_block(spec) <= 128 else (64, 32)


def backward_tiles(spec: AttentionSpec) -> Tuple[int, int]:
    """(query block, key block) of both backward kernels."""
    if spec.block_mask is not None:
        return tuple(spec.block_mask.BLOCK_SIZE)
    if TILES is not None:
        return TILES
    if _interp(spec):
        return 32, 32
    return (32, 64) if _head_block(spec) <= 128 else (32, 32)


def _interp(spec: AttentionSpec) -> bool:
    return spec.q.device.type == "cpu"


def _cfg(spec: AttentionSpec, kernel: str, rows: int) -> Dict[str, int]:
    """num_warps / num_stages of a launch (fixed choices, not tuned on hardware)."""
    if _interp(spec):
        return {}
    big = _head_block(spec) > 128
    if kernel == "fwd":
        if rows <= 64:  # decoding or small query blocks
            return {"num_warps": 4, "num_stages": 2}
        return {"num_warps": 8, "num_stages": 2 if big else 3}
    return {"num_warps": 8, "num_stages": 1 if big else 2}


def _splits(spec: AttentionSpec, t: Tables, programs: int) -> int:
    if SPLITS is not None:
        want = SPLITS
    elif _interp(spec):
        want = 2
    else:
        sms = torch.cuda.get_device_properties(spec.q.device).multi_processor_count
        want = min(64, max(1, -(-2 * sms // max(1, programs))))
    return max(1, min(want, t.max_kv))


def make_plan(spec: AttentionSpec) -> TritonPlan:
    """The forward tables, the decoding layout and split, and the per-call int arrays."""
    bq, bk = forward_tiles(spec)
    t = make_tables(spec, bq, bk)
    hg, splits = 1, 1
    if _decoding(spec):
        hg = spec.groups
        splits = _splits(spec, t, t.nqb * spec.n * spec.hkv)
    per_split = max(1, -(-t.max_kv // splits))
    splits = max(1, -(-t.max_kv // per_split))
    return TritonPlan(fwd=t, hg=hg, splits=splits, per_split=per_split,
                      arrays=_arrays(spec))


def _arrays(spec: AttentionSpec) -> Dict[str, Optional[Tensor]]:
    """Lengths, segment ids, row offsets (int32), ALiBi slopes and the relative table."""

    def i32(x: Optional[Tensor]) -> Optional[Tensor]:
        return None if x is None else x.to(torch.int32).contiguous()

    out: Dict[str, Optional[Tensor]] = {
        "seqlens_q": i32(spec.seqlens_q), "seqlens_kv": i32(spec.seqlens_kv),
        "row_offset": i32(spec.row_offset), "segments_q": i32(spec.segments_q),
        "segments_kv": i32(spec.segments_kv), "slopes": None, "rel": None}
    if spec.alibi_slopes is not None:
        out["slopes"] = spec.alibi_slopes.detach().to(torch.float32).contiguous()
    if spec.score_mod is not None:
        out["rel"] = relative_table(spec)
    return out


def relative_table(spec: AttentionSpec) -> Tensor:
    """A builtin additive score_mod that depends on (h, kv_idx - q_idx) only, as a float32
    table ``(Hq|1, Lq + Lk - 1)`` indexed by ``kv_idx - q_idx + Lq - 1``: the builtin's own
    bias evaluated once per distance."""
    info = info_of(spec.score_mod)
    dev = spec.q.device
    dist = torch.arange(-(spec.lq - 1), spec.lk, device=dev)
    q_idx = (-dist).clamp(min=0).view(1, 1, 1, -1)
    kv_idx = dist.clamp(min=0).view(1, 1, 1, -1)
    b = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=dev)
    h = torch.arange(spec.hq, device=dev).view(1, -1, 1, 1)
    with torch.no_grad():
        tab = info.bias(b, h, q_idx, kv_idx).to(torch.float32)
    tab = tab.reshape((1,) * (4 - tab.dim()) + tuple(tab.shape))
    return tab.expand(1, tab.shape[1], 1, dist.numel())[0, :, 0].contiguous()


# ---- argument lists ---------------------------------------------------------------------------


def _lastdim(x: Tensor) -> Tensor:
    """``x`` with unit stride in its last dim (the kernels read head dims contiguously)."""
    x = x.detach()
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _bstrides(x: Tensor) -> List[int]:
    """Strides of a canonical 4-D mask/bias, 0 on its broadcast (size-1) dims."""
    return [x.stride(d) if x.shape[d] > 1 else 0 for d in range(4)]


def _prec(spec: AttentionSpec) -> str:
    if spec.q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _term_args(spec: AttentionSpec, plan: TritonPlan, t: Tables, dummy: Tensor
               ) -> Tuple[List[Any], Dict[str, Any]]:
    """The score-term arguments shared by the three kernels (SeqQ .. right) and their
    constexpr flags."""
    a = plan.arrays
    args: List[Any] = [a["seqlens_q"] if a["seqlens_q"] is not None else dummy,
                       a["seqlens_kv"] if a["seqlens_kv"] is not None else dummy,
                       a["row_offset"] if a["row_offset"] is not None else dummy]
    if spec.bias is not None:
        bias = spec.bias.detach()
        args += [bias, *_bstrides(bias)]
    else:
        args += [dummy, 0, 0, 0, 0]
    if spec.mask is not None:
        mask = spec.mask.view(torch.uint8)
        args += [mask, *_bstrides(mask)]
    else:
        args += [dummy, 0, 0, 0, 0]
    if t.tmask is not None:
        tm = t.tmask
        nb, nh = tm.shape[1], tm.shape[2]
        args += [tm, tm.stride(0), tm.stride(1) if nb > 1 else 0, tm.stride(2) if nh > 1 else 0]
    else:
        args += [dummy, 0, 0, 0]
    slopes = a["slopes"]
    if slopes is not None:
        args += [slopes, slopes.stride(0) if slopes.shape[0] > 1 else 0, slopes.stride(1),
                 slopes.stride(2) if slopes.dim() == 3 else 0]
    else:
        args += [dummy, 0, 0, 0]
    rel = a["rel"]
    if rel is not None:
        args += [rel, rel.stride(0) if rel.shape[0] > 1 else 0, spec.lq - 1]
    else:
        args += [dummy, 0, 0]
    args += [a["segments_q"] if a["segments_q"] is not None else dummy,
             a["segments_kv"] if a["segments_kv"] is not None else dummy,
             float(spec.softcap or 0.0),
             int(spec.left) if spec.left is not None else 0,
             int(spec.right) if spec.right is not None else 0]
    flags = dict(SOFTCAP=spec.softcap is not None, BIAS=spec.bias is not None,
                 ALIBI=slopes is not None, REL=rel is not None, LEFT=spec.left is not None,
                 RIGHT=spec.right is not None, SEQ_Q=spec.seqlens_q is not None,
                 SEQ_K=spec.seqlens_kv is not None, SEGMENTS=spec.segments_q is not None,
                 MASK=spec.mask is not None, TMASK=t.tmask is not None,
                 ROW_OFF=spec.row_offset is not None, DIAG_BR=spec.diagonal == "bottom_right")
    return args, flags


def _dropout_args(spec: AttentionSpec, dummy: Tensor) -> Tuple[List[Any], Dict[str, Any]]:
    """Keep .. drop_scale and the DROPOUT / KEEP flags."""
    p = spec.dropout_p
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    keep = spec.dropout_mask
    drawn = keep is None and p > 0.0
    args: List[Any] = []
    if keep is not None:
        k8 = keep.view(torch.uint8)
        args += [k8, *_bstrides(k8)]
    else:
        args += [dummy, 0, 0, 0, 0]
    seed = spec.seed if drawn else 0
    threshold = min(math.ceil(p * 2.0 ** 24), 1 << 24) if drawn else 0
    args += [seed & 0xFFFFFFFF, seed >> 32, spec.offset if drawn else 0, threshold, scale]
    return args, dict(DROPOUT=drawn, KEEP=keep is not None)


# ---- forward ----------------------------------------------------------------------------------


def forward(spec: AttentionSpec, plan: TritonPlan) -> ForwardResult:
    """Run the forward kernel (and the merge of its key splits): out in the input dtype,
    LSE and row maxima in float32."""
    kern = load_kernels()
    t = plan.fwd
    dev = spec.q.device
    dummy = torch.zeros(1, dtype=torch.int32, device=dev)
    n, hq, lq, dv = spec.n, spec.hq, spec.lq, spec.dv
    q = _lastdim(spec.q)
    out = torch.empty(n, hq, lq, dv, dtype=spec.q.dtype, device=dev)
    lse = torch.empty(n, hq, lq, dtype=torch.float32, device=dev)
    mx = torch.empty(n, hq, lq, dtype=torch.float32, device=dev)
    if spec.paged is not None:
        pg = spec.paged
        k, v = _lastdim(pg.k_pages), _lastdim(pg.v_pages)
        table = pg.block_table.to(torch.int32).contiguous()
        kstr = [0, k.stride(2), 0]
        vstr = [0, v.stride(2), 0]
        paging = [table, table.stride(0), pg.page_size, k.stride(0), k.stride(1),
                  v.stride(0), v.stride(1)]
    else:
        k, v = _lastdim(spec.k), _lastdim(spec.v)
        kstr = [k.stride(0), k.stride(1), k.stride(2)]
        vstr = [v.stride(0), v.stride(1), v.stride(2)]
        paging = [dummy, 0, 1, 0, 0, 0, 0]
    hg = plan.hg
    n_groups = hq // hg
    block_m = max(16, _next_pow2(hg * t.bq))
    bd, bdv = max(16, _next_pow2(spec.dqk)), max(16, _next_pow2(dv))
    split = plan.splits > 1
    rows = n * n_groups * t.nqb
    if split:
        part_o = torch.empty(rows * plan.splits * block_m * bdv, dtype=torch.float32,
                             device=dev)
        part_ml = torch.empty(rows * plan.splits * 2 * block_m, dtype=torch.float32,
                              device=dev)
    else:
        part_o = part_ml = dummy
    terms, flags = _term_args(spec, plan, t, dummy)
    drop, dflags = _dropout_args(spec, dummy)
    sinks = spec.sinks.detach().contiguous() if spec.sinks is not None else dummy
    qscale = spec.scale / (spec.softcap or 1.0)
    args = [q, k, v, out, lse, mx, part_o, part_ml,
            q.stride(0), q.stride(1), q.stride(2), *kstr, *vstr,
            out.stride(0), out.stride(1), out.stride(2),
            t.kv_list, t.kv_cnt, t.kind, t.slot if t.slot is not None else dummy,
            t.kv_list.stride(0), t.nkb, plan.per_split, plan.splits, *paging,
            *terms, sinks, *drop, qscale, lq, spec.lk, hq, spec.groups, n_groups, t.nqb]
    consts = dict(DQK=spec.dqk, DV=dv, BQ=t.bq, HG=hg, BLOCK_M=block_m, BLOCK_N=t.bk,
                  BLOCK_D=bd, BLOCK_DV=bdv, **flags, **dflags, SINKS=spec.sinks is not None,
                  SPLIT=split, MAXS=True, PAGED=spec.paged is not None,
                  UPCAST=kern.INTERPRET, PREC=_prec(spec))
    kern.attn_fwd((t.nqb, n * n_groups, plan.splits), args, consts,
                  _cfg(spec, "fwd", block_m))
    if split:
        margs = [out, lse, mx, part_o, part_ml, out.stride(0), out.stride(1), out.stride(2),
                 sinks, lq, hq, n_groups, t.nqb, plan.splits]
        kern.attn_merge((t.nqb, n * n_groups, 1), margs,
                        dict(DV=dv, BQ=t.bq, HG=hg, BLOCK_M=block_m, BLOCK_DV=bdv,
                             SINKS=spec.sinks is not None, MAXS=True),
                        {} if _interp(spec) else {"num_warps": 4})
    return ForwardResult(out=out, lse=lse, max_scores=mx)


# ---- backward ---------------------------------------------------------------------------------


def backward(spec: AttentionSpec, plan: TritonPlan, out: Tensor, lse: Tensor, dout: Tensor,
             dlse: Optional[Tensor] = None) -> Grads:
    """dQ and dK/dV (and dBias) kernels; dsinks from the LSE. Gradients in float32."""
    if spec.paged is not None:
        raise NotImplementedError("triton has no backward over paged K/V; gather the pages "
                                  "(attnkit.gather_kv) and call attention() for gradients")
    kern = load_kernels()
    if plan.bwd is None:
        plan.bwd = make_tables(spec, *backward_tiles(spec))
    t = plan.bwd
    dev = spec.q.device
    dummy = torch.zeros(1, dtype=torch.int32, device=dev)
    n, hq, hkv, lq, lk, dqk, dv = spec.n, spec.hq, spec.hkv, spec.lq, spec.lk, spec.dqk, spec.dv
    q, k, v, do = _lastdim(spec.q), _lastdim(spec.k), _lastdim(spec.v), _lastdim(dout)
    delta = (dout.detach().float() * out.detach().float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.detach().float()
    delta = delta.contiguous()
    lse_s = safe_lse(lse.detach().float()).contiguous()
    dq = torch.empty(n, hq, lq, dqk, dtype=torch.float32, device=dev)
    dk = torch.empty(n, hkv, lk, dqk, dtype=torch.float32, device=dev)
    dvv = torch.empty(n, hkv, lk, dv, dtype=torch.float32, device=dev)
    terms, flags = _term_args(spec, plan, t, dummy)
    drop, dflags = _dropout_args(spec, dummy)
    bd, bdv = max(16, _next_pow2(dqk)), max(16, _next_pow2(dv))
    qscale = spec.scale / (spec.softcap or 1.0)
    consts = dict(DQK=dqk, DV=dv, BLOCK_M=t.bq, BLOCK_N=t.bk, BLOCK_D=bd, BLOCK_DV=bdv,
                  **flags, **dflags, UPCAST=kern.INTERPRET, PREC=_prec(spec))
    strides = [q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2)]
    slot = t.slot if t.slot is not None else dummy
    cfg = _cfg(spec, "bwd", t.bq)
    kern.attn_bwd_dq(
        (t.nqb, n * hq, 1),
        [q, k, v, do, lse_s, delta, dq, *strides, t.kv_list, t.kv_cnt, t.kind, slot,
         t.kv_list.stride(0), t.nkb, *terms, *drop, qscale, spec.scale, lq, lk, hq,
         spec.groups], consts, cfg)

    want_db = spec.bias is not None and spec.bias.requires_grad
    db_buf, db_flags = dummy, dict(DBIAS=False, DB_HB=False, DB_Q=True, DB_K=True)
    if want_db:
        bshape = spec.bias.shape
        db_q, db_k, db_hb = bshape[2] == lq, bshape[3] == lk, bshape[1] != hq
        db_buf = torch.zeros(n, hkv if db_hb else hq, lq if db_q else t.nqb,
                             lk if db_k else t.nkb, dtype=torch.float32, device=dev)
        db_flags = dict(DBIAS=True, DB_HB=db_hb, DB_Q=db_q, DB_K=db_k)
    db_str = list(db_buf.stride()) if want_db else [0, 0, 0, 0]
    kern.attn_bwd_dkdv(
        (t.nkb, n * hkv, 1),
        [q, k, v, do, lse_s, delta, dk, dvv, db_buf, *strides, *db_str, t.q_list, t.q_cnt,
         t.kind, slot, t.q_list.stride(0), t.nkb, *terms, *drop, qscale, spec.scale, lq, lk,
         hq, hkv, spec.groups], dict(consts, **db_flags), cfg)

    dbias = None
    if want_db:
        g = db_buf
        if not db_flags["DB_Q"]:
            g = g.sum(2, keepdim=True)
        if not db_flags["DB_K"]:
            g = g.sum(3, keepdim=True)
        if db_flags["DB_HB"]:
            g = g.sum(1, keepdim=True)
        if spec.bias.shape[0] == 1:
            g = g.sum(0, keepdim=True)
        dbias = g
    dsinks = None
    if spec.sinks is not None and spec.sinks.requires_grad:
        from ..tiled import sink_gradient

        dsinks = sink_gradient(spec, lse_s, delta)
    return Grads(dq=dq, dk=dk, dv=dvv, dbias=dbias, dsinks=dsinks,
                 dparams=(None,) * len(spec.score_mod_params))
