"""Executor on attnkit's own CPU flash kernel (``attnkit/native/flash.c``).

The forward walks key blocks of 64 with the online softmax and evaluates the analytic terms in
registers: causal with either diagonal, windows, key and query padding, left padding and row
offsets become one visible key interval per row (computed here, in int32); documents are a
narrower interval when their ids ascend (packed sequences) and a segment-id test otherwise;
ALiBi, softcap, a relative-position table and sinks are score terms. Nothing of size
``Lq x Lk`` is written, and one call is one parallel region (two: the keys are first packed
into transposed float32 blocks). The row maxima (``AuxRequest(max_scores=True)``) come from
the online softmax's running maxima, in natural units.

A paged call (``spec.paged``: pages, block table and lengths; a prefill chunk too long for
the decode executor) reads the pages in place: the packing pass finds each key through the
block table (any page size), so no gathered copy is made and the result is the contiguous
call's, bit for bit. Forward only: with gradients wanted the paged front door gathers. fp8
pages (e4m3, e5m2, a descale per (page, kv head)) are read in place too: the packing pass
dequantizes each block in registers into q's dtype (what :func:`attnkit.gather_kv` would
hold), so the result is the call's on the gathered, dequantized pages, bit for bit; the
decode executor keeps the calls it takes (up to 16 query rows, 32 per kv head).

The backward is FlashAttention-2's, native as well: items of up to four key blocks (in
parallel) walk the query blocks that see them, recompute the weights from the forward's
log-sum-exp, and accumulate dK and dV in L1 and dQ in one of ``torch.get_num_threads()``
buffers; a learnable relative table's gradient is summed along the diagonals in the same
pass. Which sums go into which buffer, and in what order, follows from the shapes and the
thread count alone (not from which thread ran what, or when), so a call's gradients are the
same bits on every run at one thread count, with or without
``torch.use_deterministic_algorithms(True)``. Other learnable tensors take the next
executor's backward (the tiled one, which holds dS), called with this forward's output and
log-sum-exp: the same math, since the backward depends on the forward only through ``out``
and ``lse``.

bfloat16 inputs (head dim a multiple of 32, a CPU with AVX512-BF16) compute ``q.k`` and
``P V`` in bfloat16 dot products (float32 sums; P rounded to bfloat16 as torch's bfloat16
kernels round it), twice float32's multiply-adds an instruction, and so do the backward's
five products (also Dv a multiple of 32; P and dS rounded to bfloat16 for them);
``native.FLASH_BF16_DOT = False`` keeps float32 arithmetic for them.

A CPU with AVX2, FMA and F16C but no AVX-512 runs the same kernel on 256-bit registers
(``native.build_info()["flash_bits"] == 256``). :func:`auto_defers` leaves a dense or plain
causal call to the fused executor where the measured cost table says torch's kernel is faster
on this kind of CPU (:mod:`attnkit.backends.costs`).

A call of the same form as one before it (shapes, strides, dtypes, causal / window /
softcap) is replayed from :func:`replay`'s launcher, which holds the kernel call prepared once
(:class:`attnkit.native.FlashForward`); every backward reuses its forward's prepared call.

Inputs with a NaN or an infinity run the next executor's forward as well, which gives such
rows the NaN (and +inf log-sum-exp) the float64 reference gives.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor

from .. import native
from ..kv.pages import gather_kv
from ..terms.masks import structure_of
from ..terms.mods import info_of
from ..terms.spec import AttentionSpec
from . import workers
from .base import Capabilities, ForwardResult, Grads, not_supported_reasons

CAPS = Capabilities(
    name="flash",
    features=frozenset({"window", "mask_mod", "block_mask", "seqlens_q", "seqlens_kv",
                        "starts_kv", "segments", "batch_segments", "row_offset", "alibi",
                        "softcap", "sinks", "additive_score_mod", "score_mod_grad", "dropout",
                        "paged_kv", "fp8_kv", "max_scores"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    devices=frozenset({"cpu"}),
    max_head_dim=256,
    head_dim_multiple=16,
    why={"mask": "a mask tensor is not an analytic term",
         "bias": "a bias tensor is read by the fused and tiled executors",
         "bias_grad": "a bias tensor is read by the fused and tiled executors",
         "alibi_rows": "per-row ALiBi slopes are not a kernel term",
         "score_mod": "a score_mod is Python; the kernel evaluates only analytic terms",
         "dropout_mask": "a keep-mask tensor is read by the tiled executor",
         "p_scale": "the kernel does not quantize the softmax weights"},
    fallback=("fused", "tiled"),
    fallback_for="the forward of a call with a non-finite input (a paged one's on its "
                 "gathered pages), and the gradients of "
                 "learnable tensors other than a relative_bias table (from this forward's "
                 "out and lse)",
)

#: additive score_mod builtins the kernel evaluates (by their structure's kind)
_TABLES = ("relative_bias",)


def _table_of(spec: AttentionSpec) -> Optional[Tensor]:
    """The relative-position table of a relative_bias score_mod, else None."""
    info = info_of(spec.score_mod) if spec.score_mod is not None else None
    st = getattr(info, "structure", None) if info is not None else None
    if not isinstance(st, dict) or st.get("kind") not in _TABLES:
        return None
    return st.get("table")


def extra_reasons(spec: AttentionSpec) -> List[str]:
    """The kernel must be built for this CPU; score_mods only as the builtin tables; a paged
    cache only without gradients."""
    why = []
    if not native.build_info().get("flash", False):
        reason = native.unavailable_reason()
        why.append("the native flash kernel is unavailable (" + (
            reason or "this CPU has neither AVX-512 nor AVX2 with FMA and F16C, or the build "
            "did not target it") + ")")
    if (spec.mask_mod is not None or spec.block_mask is not None) and (
            mask_intervals(spec) is None):
        why.append("flash runs a mask_mod (or a BlockMask) only as a builtin whose rows see one "
                   "key interval (causal, window, prefix_lm, chunked, padding, documents with "
                   "ascending ids, and_masks of those), with blocks that agree with it")
    if spec.score_mod is not None and _table_of(spec) is None:
        why.append("flash evaluates only the relative_bias score_mod builtin")
    if spec.q.dtype != spec.k.dtype or spec.v.dtype != spec.q.dtype:
        why.append("flash needs q, k and v in one dtype")
    if "dropout" in spec.features() and (spec.dropout_p >= 1.0 or max(spec.n, spec.hq) > 2**16):
        why.append("flash runs dropout with 0 < p < 1 and at most 65536 batch rows and heads")
    if spec.paged is not None and _wants_grad(spec):
        why.append("flash has no backward over paged K/V (the paged front door gathers the "
                   "pages when gradients are needed)")
    return why


def _wants_grad(spec: AttentionSpec) -> bool:
    """Whether autograd would record this call: grad mode on and an input requiring grad."""
    if not torch.is_grad_enabled():
        return False
    p = spec.paged
    tensors = (spec.q, spec.sinks, *spec.score_mod_params,
               *((p.k_pages, p.v_pages) if p is not None else (spec.k, spec.v)))
    return any(x is not None and x.requires_grad for x in tensors)


def auto_defers(spec: AttentionSpec) -> bool:
    """A dense or plain causal call is left to the fused executor where that executor can run
    it and the measured cost table (`attnkit/backends/costs.json`, per CPU kind, batch rows x
    heads against the thread count) says torch's kernel is faster. The choice never depends on
    the grad mode (forward + backward costs decide, :mod:`attnkit.backends.costs`), so a call
    gives the same bits with and without gradients."""
    from . import REGISTRY, costs

    if costs.call_form(spec) is None or not_supported_reasons(REGISTRY["fused"], spec):
        return False
    return costs.prefer(spec)[0] == "fused"


@dataclass
class FlashPlan:
    """No tiles to plan: the kernel skips blocks itself. Holds the executor whose backward
    (and non-finite forward) this one uses, and its plan, made when first needed."""

    spec: AttentionSpec
    _next: Optional[Tuple[ModuleType, Any]] = field(default=None, repr=False)
    #: the forward's prepared kernel call (its terms and checked argument block), which the
    #: backward reuses, and what it was made from (:func:`_source`): a plan that runs more
    #: than once (torch.func.vmap's slices) reuses it only for the same tensors
    call: Optional[native.FlashForward] = field(default=None, repr=False)
    source: Tuple[Any, ...] = field(default=(), repr=False)

    def next(self) -> Tuple[ModuleType, Any]:
        if self._next is None:
            from . import REGISTRY

            for name in CAPS.fallback:
                mod = REGISTRY[name]
                auto = mod.CAPS.auto_devices
                if auto is not None and self.spec.q.device.type not in auto:
                    continue
                if not not_supported_reasons(mod, self.spec):
                    self._next = (mod, mod.make_plan(self.spec))
                    break
            else:  # (the tiled executor runs every spec flash runs)
                raise NotImplementedError("flash: no executor can run this call's backward")
        return self._next


def make_plan(spec: AttentionSpec) -> FlashPlan:
    return FlashPlan(spec)


def _per_batch(x: Optional[Tensor], n: int, default: int) -> Tensor:
    if x is None:
        return torch.full((1, 1), default, dtype=torch.int64)
    return x.to(torch.int64).reshape(n, 1)


def aligned_positions(spec: AttentionSpec) -> Tensor:
    """The aligned position ``i'`` of every row, ``(N|1, Lq)`` int64."""
    return spec.aligned_rows().to(torch.int64).reshape(-1, spec.lq)


def bounds(spec: AttentionSpec) -> Tuple[Tensor, Tensor]:
    """Per row the visible key interval ``[lo, hi)``, ``(N|1, Lq)`` int64 (int32, clamped,
    when every row sees every key): causal/window
    relative to the aligned position ``i'``, then key padding, left padding and query
    padding (a call with none of them: every row sees every key)."""
    n, lq, lk = spec.n, spec.lq, spec.lk
    if not spec.has_band and spec.seqlens_kv is None and spec.starts_kv is None and (
            spec.seqlens_q is None):
        return (torch.zeros((1, lq), dtype=torch.int32),
                torch.full((1, lq), min(lk, 2**31 - 1), dtype=torch.int32))
    ip = aligned_positions(spec)
    lo = torch.zeros_like(ip)
    hi = torch.full_like(ip, lk)
    if spec.left is not None:
        lo = torch.maximum(lo, ip - spec.left)
    if spec.right is not None:
        hi = torch.minimum(hi, ip + spec.right + 1)
    if spec.seqlens_kv is not None:
        hi = torch.minimum(hi, _per_batch(spec.seqlens_kv, n, lk))
    if spec.starts_kv is not None:
        lo = torch.maximum(lo, _per_batch(spec.starts_kv, n, 0))
    if spec.seqlens_q is not None:
        rows = torch.arange(lq).view(1, lq)
        hi = torch.where(rows < _per_batch(spec.seqlens_q, n, lq), hi, 0)
    lo, hi = torch.broadcast_tensors(lo, hi)
    return lo, hi


def _segments(spec: AttentionSpec, lo: Tensor, hi: Tensor
              ) -> Tuple[Tensor, Tensor, Optional[Tuple[Tensor, Tensor]]]:
    """Documents: ascending ids narrow each row's interval to its own document's keys (then
    no id test is needed); other ids also go to the kernel for the per-pair test."""
    sq, sk = spec.segments_q, spec.segments_kv
    runs = _ascending_runs(sq, sk)
    if runs is not None:
        return torch.maximum(lo, runs[0]), torch.minimum(hi, runs[1]), None
    sq2 = sq.view(1, -1) if sq.dim() == 1 else sq
    sk2 = sk.view(1, -1) if sk.dim() == 1 else sk
    pad = torch.full((sk2.shape[0], native.FLASH_BLOCK), -1, dtype=sk2.dtype)
    return lo, hi, (sq2, torch.cat([sk2, pad], 1))


def _rel_index(spec: AttentionSpec, table: Tensor) -> Tuple[Tensor, int]:
    """Which table entry ``ext[:, j - i + base]`` holds, for every query row and every key of
    a visited block (distances clamped as the builtin clamps), and ``base``."""
    m = (table.shape[-1] + 1) // 2
    lq, nkb = spec.lq, -(-spec.lk // native.FLASH_BLOCK)
    base = lq - 1
    return torch.arange(-base, nkb * native.FLASH_BLOCK).clamp(-(m - 1), m - 1) + (m - 1), base


def _rel_table(spec: AttentionSpec, table: Tensor) -> Tuple[Tensor, int]:
    """The relative table expanded so that ``ext[h, j - i + base]`` is the term."""
    idx, base = _rel_index(spec, table)
    t = table.detach().to(torch.float32)
    t = t.view(1, -1) if t.dim() == 1 else t
    return t[:, idx], base


#: a row's visible keys as ``[lo, hi)`` from its index ``i (1, Lq)`` and the key count, by
#: structure kind (None for a kind whose rows do not see one interval)
Interval = Callable[[Tensor, int, int], Optional[Tuple[Tensor, Tensor]]]


def _band(st: dict) -> Interval:
    b_lo, b_hi = st["band"]  # visible iff b_lo <= j - i <= b_hi

    def rows(i: Tensor, n: int, lk: int) -> Tuple[Tensor, Tensor]:
        lo = i + b_lo if b_lo is not None else torch.zeros_like(i)
        hi = i + b_hi + 1 if b_hi is not None else torch.full_like(i, lk)
        return lo, hi
    return rows


def _prefix(st: dict) -> Interval:
    p = int(st["prefix_len"])
    return lambda i, n, lk: (torch.zeros_like(i), torch.clamp(i + 1, min=p))


def _chunked(st: dict) -> Interval:
    c = int(st["chunk_size"])
    return lambda i, n, lk: (i // c * c, i + 1)


def _padding(st: dict) -> Optional[Interval]:
    sq, sk = st.get("seqlens_q"), st.get("seqlens_kv")

    def rows(i: Tensor, n: int, lk: int) -> Optional[Tuple[Tensor, Tensor]]:
        if any(x is not None and x.numel() not in (1, n) for x in (sq, sk)):
            return None
        hi = torch.full_like(i, lk) if sk is None else sk.to(torch.int64).reshape(-1, 1).expand(
            -1, i.shape[1])
        if sq is not None:
            hi = torch.where(i < sq.to(torch.int64).reshape(-1, 1), hi, 0)
        return torch.zeros_like(hi), hi
    return rows


def _ascending_runs(ids_q: Tensor, ids_kv: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """Each query's keys of its own segment as ``[first, end)``, ``(N|1, Lq)``, when the key
    ids ascend (packed documents); None otherwise."""
    sq = (ids_q.view(1, -1) if ids_q.dim() == 1 else ids_q).to(torch.int64).contiguous()
    sk = (ids_kv.view(1, -1) if ids_kv.dim() == 1 else ids_kv).to(torch.int64).contiguous()
    if sk.shape[1] > 1 and not bool((sk[:, 1:] >= sk[:, :-1]).all()):
        return None
    if sq.shape[0] != sk.shape[0]:
        sq, sk = (x.expand(max(sq.shape[0], sk.shape[0]), -1).contiguous() for x in (sq, sk))
    return (torch.searchsorted(sk, sq, right=False), torch.searchsorted(sk, sq, right=True))


def _document(st: dict) -> Interval:
    def rows(i: Tensor, n: int, lk: int) -> Optional[Tuple[Tensor, Tensor]]:
        ids_q, ids_kv = st["doc_ids_q"][..., :i.shape[1]], st["doc_ids_kv"][..., :lk]
        if ids_q.dim() == 2 and ids_q.shape[0] not in (1, n):
            return None
        return _ascending_runs(ids_q, ids_kv)
    return rows


def _interval_of(st: Optional[dict]) -> Optional[Interval]:
    """A builtin mask's structure as per-row key intervals, or None."""
    if not isinstance(st, dict):
        return None
    kind = st.get("kind")
    if kind == "full":
        return lambda i, n, lk: (torch.zeros_like(i), torch.full_like(i, lk))
    if kind in ("causal", "window") and "band" in st:
        return _band(st)
    if kind == "prefix_lm":
        return _prefix(st)
    if kind == "chunked":
        return _chunked(st)
    if kind == "padding":
        return _padding(st)
    if kind == "document":
        return _document(st)
    if kind == "and":
        parts = [_interval_of(p) for p in st.get("parts", ())]
        if not parts or any(p is None for p in parts):
            return None

        def rows(i: Tensor, n: int, lk: int) -> Optional[Tuple[Tensor, Tensor]]:
            lo, hi = torch.zeros_like(i), torch.full_like(i, lk)
            for part in parts:
                r = part(i, n, lk)
                if r is None:
                    return None
                lo, hi = torch.maximum(lo, r[0]), torch.minimum(hi, r[1])
            return lo, hi
        return rows
    return None


def mask_intervals(spec: AttentionSpec) -> Optional[Tuple[Tensor, Tensor]]:
    """The ``mask_mod`` or BlockMask as per-row key intervals ``(N|1, Lq)``, or None when it
    is not a builtin of that form, or (a BlockMask) its blocks disagree with its mask_mod: a
    block listed full must be full under the mask_mod and a block not listed must be empty
    (a listed partial block may be anything)."""
    bm = spec.block_mask
    mod = spec.mask_mod if bm is None else bm.mask_mod
    rows = _interval_of(structure_of(mod))
    r = None if rows is None else rows(torch.arange(spec.lq).view(1, -1), spec.n, spec.lk)
    if r is None or bm is None:
        return r
    lo, hi = torch.broadcast_tensors(*r)
    key = (spec.n, spec.lq, spec.lk, id(bm.mask_mod))
    agrees = bm.__dict__.setdefault("_flash_agrees", {})  # (checked once per mask and shape)
    if key not in agrees:
        with workers.one_thread():
            agrees[key] = _blocks_agree(bm, lo, hi, spec.lq, spec.lk)
    return (lo, hi) if agrees[key] else None


def _blocks_agree(bm: Any, lo: Tensor, hi: Tensor, lq: int, lk: int) -> bool:
    """Whether every block ``bm`` lists full is full under the intervals and every block it
    does not list is empty."""
    bq, bk = bm.BLOCK_SIZE
    kinds = bm.block_kinds()  # (B|1, H|1, NQ, NK)
    nqb, nkb = kinds.shape[-2:]
    k0 = torch.arange(nkb) * bk
    k1 = torch.clamp(k0 + bk, max=lk)
    lo3, hi3 = lo.unsqueeze(-1), hi.unsqueeze(-1)  # (N|1, Lq, 1)
    sees = (lo3 < k1) & (hi3 > k0) & (lo3 < hi3)  # row sees some key of the block
    whole = (lo3 <= k0) & (hi3 >= k1)
    pad = nqb * bq - lq
    if pad > 0:  # rows past Lq: they see nothing and never make a block less full
        sees = torch.nn.functional.pad(sees, (0, 0, 0, pad), value=False)
        whole = torch.nn.functional.pad(whole, (0, 0, 0, pad), value=True)
    any_ = sees[:, :nqb * bq].reshape(sees.shape[0], nqb, bq, nkb).any(2).unsqueeze(1)
    full = whole[:, :nqb * bq].reshape(whole.shape[0], nqb, bq, nkb).all(2).unsqueeze(1)
    return not (bool(((kinds == 2) & ~full).any()) or bool(((kinds == 0) & any_).any()))


def _terms_elements(spec: AttentionSpec) -> int:
    """A bound on the elements of any tensor :func:`terms` builds: rows ``(N|1, Lq)``, key
    ids ``(N|1, Lk + FLASH_BLOCK)``, the relative table ``(Hq|1, <= Lq + Lk + FLASH_BLOCK)``."""
    return max(spec.n, spec.hq) * (spec.lq + spec.lk + 2 * native.FLASH_BLOCK)


def terms(spec: AttentionSpec) -> Optional[native.FlashTerms]:
    """The kernel's terms for ``spec`` (None: a mask structure the kernel cannot take after
    all, such as ids for another batch size)."""
    lo, hi = bounds(spec)
    if spec.mask_mod is not None or spec.block_mask is not None:
        r = mask_intervals(spec)
        if r is None:
            return None
        lo, hi = torch.maximum(lo, r[0]), torch.minimum(hi, r[1])
    segments = None
    if spec.segments_q is not None:
        lo, hi, segments = _segments(spec, lo, hi)
    lim = torch.iinfo(torch.int32)
    lo, hi = (x if x.dtype == torch.int32 else x.clamp(lim.min, lim.max).to(torch.int32)
              for x in (lo, hi))
    t = native.FlashTerms(lo=lo, hi=hi, segments=segments, softcap=spec.softcap or 0.0,
                          sinks=spec.sinks)
    if "dropout" in spec.features():
        t.dropout = (spec.dropout_p, spec.seed, spec.offset)
    if spec.alibi_slopes is not None:
        t.alibi, t.ipos = spec.alibi_slopes.reshape(-1, spec.hq), aligned_positions(spec)
    table = _table_of(spec)
    if table is not None:
        t.rel, t.rel_base = _rel_table(spec, table)
    return t


def _source(spec: AttentionSpec) -> Tuple[Any, ...]:
    """The tensors a prepared call's terms and pointers come from, besides the spec's other
    fields (which a plan shares): inputs (pages and block table), sinks and score_mod
    tensors, by storage."""
    p = spec.paged
    paged = () if p is None else (p.k_pages, p.v_pages, p.block_table, p.k_descale,
                                  p.v_descale)
    return tuple(None if x is None else (x.data_ptr(), x.shape, x.stride())
                 for x in (spec.q, spec.k, spec.v, spec.sinks, *spec.score_mod_params, *paged))


def _pages(spec: AttentionSpec) -> Optional[native.FlashPages]:
    """The block table and lengths of a paged call (the kernel reads the pages in place)."""
    p = spec.paged
    return None if p is None else native.FlashPages(p.block_table, spec.seqlens_kv,
                                                    p.k_descale, p.v_descale)


def _kernel_inputs(spec: AttentionSpec) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k and v as the kernel reads them, with unit stride along the head dim (one copy
    where one is needed): for a paged call the pages themselves (the spec's k and v are
    stand-ins)."""
    if spec.paged is None:
        return native._unit_stride(spec.q, spec.k, spec.v)
    return native._unit_stride(spec.q, spec.paged.k_pages, spec.paged.v_pages)


def _gathered(spec: AttentionSpec) -> AttentionSpec:
    """A paged call on contiguous K/V gathered from its pages (for the next executor); fp8
    pages dequantized into q's dtype."""
    p = spec.paged
    fp8 = p.k_descale is not None
    k, v = gather_kv(p.k_pages, p.v_pages, p.block_table, spec.seqlens_kv, max_seqlen=spec.lk,
                     k_descale=p.k_descale, v_descale=p.v_descale,
                     dtype=spec.q.dtype if fp8 else None)
    return replace(spec, k=k, v=v, paged=None)


def _prepared(spec: AttentionSpec, plan: FlashPlan) -> Optional[native.FlashForward]:
    """The plan's prepared call where it was made from this spec's tensors, else None."""
    call = plan.call
    return call if call is not None and plan.source == _source(spec) else None


def _prepare(spec: AttentionSpec, plan: FlashPlan, q: Tensor, k: Tensor, v: Tensor
             ) -> Optional[native.FlashForward]:
    """The plan's prepared call for ``spec`` (made and kept on the plan where it has none for
    these tensors; ``q, k, v``: :func:`_kernel_inputs`), or None: no kernel, or terms it
    cannot take."""
    source = _source(spec)
    if plan.call is not None and plan.source == source:
        return plan.call
    with workers.one_thread(_terms_elements(spec)):  # (small ops: no parallel region each)
        t = terms(spec)
    call = None if t is None else native.flash_prepare(q, k, v, spec.scale, t, _pages(spec))
    if call is not None:
        plan.call, plan.source = call, source
    return call


def forward(spec: AttentionSpec, plan: FlashPlan) -> ForwardResult:
    """The native forward (the next executor's for non-finite inputs, on K/V gathered from
    the pages of a paged call). ``out`` comes in the inputs' dtype; ``max_scores`` from the
    kernel where the spec asks for them (else NaN: not computed). The kernel call it prepares
    stays on the plan for the backward."""
    q, k, v = _kernel_inputs(spec)
    call = _prepare(spec, plan, q, k, v)
    want_max = "max_scores" in spec.outputs
    mx = torch.empty(spec.n, spec.hq, spec.lq, dtype=torch.float32) if want_max else None
    res = None
    if call is not None:
        try:
            res = call.run(q, k, v, max_scores=mx)
        except native.FlashNonFinite:
            res = None
    if res is None:  # (non-finite inputs; or a kernel that went away after selection)
        if spec.paged is not None:
            spec = _gathered(spec)
            plan = FlashPlan(spec)
        mod, p = plan.next()
        return mod.forward(spec, p)
    out, lse = res
    if mx is None:
        mx = torch.full((), float("nan"), dtype=lse.dtype).expand(lse.shape)
    return ForwardResult(out=out, lse=lse, max_scores=mx)


#: the features a replayed call may have: its terms follow from the shapes alone
_REPLAYED = frozenset({"window", "softcap"})

Launch = Callable[[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]], Optional[Tensor]]


def replay(spec: AttentionSpec, bounds: Tuple[Optional[int], Optional[int]] = (None, None),
           grad: bool = False) -> Optional[Launch]:
    """A launcher for the calls that follow this one with the same form: q, k and v of the
    same shapes, strides and dtypes (the caller's key holds the options, the dtypes and
    whether gradients are wanted; ``bounds`` and ``grad``, the replay protocol's other
    arguments, are not needed here). ``launch(q, k, v, seqlens_kv, starts_kv)`` runs the kernel
    as :func:`forward` would, with the terms and the kernel's argument block made here once,
    and returns ``out`` in q's dtype: straight from the kernel, or where an input requires
    grad (with grad mode on) through the autograd node with a plan that holds that call (its
    backward reuses it too). It returns None (take the full path) for other shapes or
    strides, padding tensors, a kernel that was unloaded, or a non-finite input (the full
    path then runs the next executor). None here when the call is not of that form: terms
    beyond causal, windows and softcap, an empty call, or inputs without unit stride along
    the head dim. The launcher holds none of this call's tensors."""
    if (spec.features() - _REPLAYED or spec.is_empty or not native.build_info().get("flash")
            or any(x.stride(-1) != 1 for x in (spec.q, spec.k, spec.v))):
        return None
    call = _prepare(spec, FlashPlan(spec), spec.q, spec.k, spec.v)
    if call is None:
        return None
    template = replace(spec, q=None, k=None, v=None)  # (this call's tensors are not kept)
    this = sys.modules[__name__]

    def launch(q: Tensor, k: Tensor, v: Tensor, seqlens_kv: Optional[Tensor],
               starts_kv: Optional[Tensor]) -> Optional[Tensor]:
        if seqlens_kv is not None or starts_kv is not None or not call.fits(q, k, v):
            return None
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                        or v.requires_grad):
            from ..engine.autograd import run

            s = replace(template, q=q, k=k, v=v)
            plan = FlashPlan(s, call=call, source=_source(s))
            out, _, _ = run(s, this, plan)
            return out
        try:
            return call.run(q, k, v)[0]
        except native.FlashNonFinite:
            return None

    return launch


def _grad_dtype(spec: AttentionSpec) -> Optional[torch.dtype]:
    """The dtype the kernel writes dQ, dK and dV in: the inputs' own for bfloat16 and float16
    (each gradient then is what the caller would get from the float32 sums by one rounding,
    without a conversion op of its own after the kernel), where no input was broadcast over
    the batch (whose gradient the caller sums over it, better in float32); else None
    (float32)."""
    dt = spec.q.dtype
    if dt not in (torch.bfloat16, torch.float16) or len(spec.batch_shape) > 1:
        return None
    if spec.n > 1 and any(x.stride(0) == 0 for x in (spec.q, spec.k, spec.v)):
        return None
    return dt


def backward(spec: AttentionSpec, plan: FlashPlan, out: Tensor, lse: Tensor, dout: Tensor,
             dlse: Optional[Tensor] = None) -> Grads:
    """The native backward (with a learnable relative table's gradient too); the next
    executor's (from this forward's ``out`` and ``lse``) for other learnable tensors and for
    non-finite inputs."""
    t = None
    table = _table_of(spec)
    table_grad = bool(spec.score_mod_params)
    call = _prepared(spec, plan)
    if not table_grad or (table is not None and len(spec.score_mod_params) == 1
                          and spec.score_mod_params[0] is table):
        if call is not None:
            t = call.terms
        else:
            with workers.one_thread(_terms_elements(spec)):
                t = terms(spec)
    if t is not None:
        try:
            res = native.flash_backward(spec.q, spec.k, spec.v, spec.scale, t, dout, out, lse,
                                        dlse, table_grad=table_grad,
                                        grad_dtype=_grad_dtype(spec), prepared=call)
        except native.FlashNonFinite:
            res = None
        if res is not None:
            dq, dk, dv, drel, delta = res
            dparams: Tuple[Optional[Tensor], ...] = ()
            if table_grad:  # each expanded entry back onto the table entry it was read from
                idx, _ = _rel_index(spec, table)
                dt = torch.zeros(drel.shape[0], table.shape[-1], dtype=torch.float32)
                dparams = (dt.index_add_(1, idx, drel).reshape(table.shape),)
            dsinks = None
            if spec.sinks is not None:
                p_sink = torch.exp(spec.sinks.detach().to(torch.float32).view(1, -1, 1)
                                   - lse.to(torch.float32))
                dsinks = -(p_sink * delta).sum((0, 2))
            return Grads(dq=dq, dk=dk, dv=dv, dbias=None, dsinks=dsinks, dparams=dparams)
    mod, p = plan.next()
    return mod.backward(spec, p, out, lse, dout, dlse)
