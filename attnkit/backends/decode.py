"""The decode executor: a few query rows per sequence over a long key/value cache.

Decoding reads every cached key and value once per generated token, so it is bound by memory
bandwidth: the native kernel (:mod:`attnkit.native`, ``decode.c``) reads K/V in place, front
to back, once, and keeps the softmax in float32. This executor runs it on every form a decode
step takes:

- a contiguous cache ``k (N, Hkv, Lk, D)`` (each batch row read as one long page), with
  right padding (``seqlens_kv``, each row on its own length) and left padding (``starts_kv``:
  the kernel reads each row from its first real key), causal with either diagonal, windows,
  ALiBi, softcap and sinks;
- packed sequences (varlen, continuous batching): every sequence's keys read in place from
  the packed K/V, in one call;
- a paged cache (``spec.paged``: pages, block table and lengths), read through the block
  table with no gather; fp8 pages (with their per-(page, kv head) descales) are converted in
  the kernel's registers, with no dequantized copy;
- MLA's shared latent cache (one latent kv head of 576 dims whose first 512 are the values:
  ``v = k[..., :512]``, contiguous or paged): values whose rows lie inside the key rows are read
  once, with the keys (:func:`attnkit.native.decode_counts` counts such calls), and any number
  of query rows per kv head runs here past head dims of 256.

Where the kernel cannot run (no compiler, ``ATTNKIT_NATIVE=0``, head dims not multiples of 16,
float64), the same computation runs in torch ops: the tiled executor's forward, and for a paged
cache the page-by-page matmuls of :func:`_decode_on_pages` (or a gather). The backward is the
tiled executor's, from this forward's output and LSE (a paged cache has none: the paged front
door gathers the pages when gradients are needed).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import native
from ..kv.pages import gather_kv
from ..terms.score_terms import fold_sinks
from ..terms.spec import AttentionSpec
from . import tiled
from .base import Capabilities, ForwardResult, Grads

CAPS = Capabilities(
    name="decode",
    features=frozenset({"window", "seqlens_kv", "starts_kv", "alibi", "softcap", "sinks",
                        "paged_kv", "fp8_kv", "segments", "row_offset"}),
    dtypes=frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16}),
    devices=frozenset({"cpu"}),
    max_query_rows=native.MAX_QUERY_ROWS,
    max_rows_per_kv_head=32,
    # past the flash kernel's head dims (MLA's 576/512 latent head, 16-128 query heads) the
    # fused executor's matmuls were 20-40x slower than this kernel at 16-128 rows a kv head
    max_rows_head_dim=256,
    why={"seqlens_q": "decoding rows are all real queries",
         "score_mod": "the kernel evaluates no callable",
         "mask": "the kernel takes analytic masks only", "mask_mod": "the kernel evaluates no "
         "callable", "block_mask": "the kernel takes analytic masks only",
         "bias": "the kernel takes no bias tensor", "dropout": "decoding has no dropout",
         "max_scores": "the kernel does not report row maxima",
         "p_scale": "the kernel keeps no probability tile to quantize"},
    fallback=("tiled",),
    fallback_for="the forward without the native kernel (a paged cache with its pages "
                 "gathered), and every backward (from this forward's out and lse)",
)


def extra_reasons(spec: AttentionSpec) -> List[str]:
    """Packed sequences only in their decoding form; a paged cache only without gradients."""
    reasons = []
    if spec.segments_q is not None and _packed_rows(spec) is None:
        reasons.append("decode runs packed sequences (varlen) with the same number of query "
                       "rows per sequence, all aligned alike; not document masks")
    if spec.paged is not None and torch.is_grad_enabled() and spec.q.requires_grad:
        reasons.append("decode has no backward over paged K/V (the paged front door gathers "
                       "the pages when gradients are needed)")
    return reasons


def make_plan(spec: AttentionSpec) -> None:
    """Nothing to plan: one kernel call reads every key."""
    return None


def forward(spec: AttentionSpec, plan: None) -> ForwardResult:
    """One native kernel call (or the torch fallback); float32/float64 out and LSE."""
    kv = _kernel_kv(spec)
    out_lse = _native(spec, *kv) if kv is not None else None
    if out_lse is None:
        return _fallback(spec)
    out, lse = out_lse
    if out.dtype != spec.compute_dtype:
        out, lse = out.to(spec.compute_dtype), lse.to(spec.compute_dtype)
    if spec.sinks is not None:
        out, lse = fold_sinks(out, lse, spec.sinks)
    return ForwardResult(out=out, lse=lse, max_scores=_no_max(lse))


def backward(spec: AttentionSpec, plan: None, out: Tensor, lse: Tensor, dout: Tensor,
             dlse: Optional[Tensor] = None) -> Grads:
    """The tiled executor's backward from this forward's out and LSE (exact: P is
    recomputed from the LSE)."""
    return tiled.backward(spec, tiled.make_plan(spec), out, lse, dout, dlse)


_NAN: Dict[Tuple[torch.dtype, torch.device], Tensor] = {}


def _no_max(lse: Tensor) -> Tensor:
    """NaN row maxima (the kernel does not compute them): one shared NaN, expanded."""
    key = (lse.dtype, lse.device)
    nan = _NAN.get(key)
    if nan is None:
        nan = _NAN[key] = torch.full((), float("nan"), dtype=lse.dtype, device=lse.device)
    return nan.expand(lse.shape)


# ---- the native kernel ---------------------------------------------------------------------


def _kernel_kv(spec: AttentionSpec) -> Optional[Tuple[Tensor, Tensor]]:
    """K and V token-major, as the kernel reads them (the pages, or each batch row of a
    contiguous cache as one page), when the kernel can run the call; else None."""
    if spec.q.dtype == torch.float64:
        return None
    kd = vd = None
    if spec.paged is not None:
        k, v = spec.paged.k_pages, spec.paged.v_pages
        kd, vd = spec.paged.k_descale, spec.paged.v_descale
    else:
        k, v = _data(spec.k).transpose(1, 2), _data(spec.v).transpose(1, 2)
    why = native.decode_reasons(_data(spec.q), k, v, grad_ok=True, k_descale=kd, v_descale=vd)
    return None if why else (k, v)


def _data(x: Tensor) -> Tensor:
    """``x`` without its autograd history (the kernel reads data only)."""
    return x.detach() if x.requires_grad else x


def _terms(spec: AttentionSpec) -> dict:
    return {"causal": False, "diagonal": spec.diagonal, "window": (spec.left, spec.right),
            "softcap": spec.softcap, "alibi_slopes": spec.alibi_slopes}


#: Block tables that read batch row b of a contiguous cache as page b, by (rows, device).
_ROW_TABLES: Dict[Tuple[int, torch.device], Tensor] = {}
#: Full lengths (every row Lk keys), by (rows, Lk, device).
_FULL_LENGTHS: Dict[Tuple[int, int, torch.device], Tensor] = {}


def _cached(cache: dict, key: tuple, make: Callable[[], Tensor]) -> Tensor:
    x = cache.get(key)
    if x is None:
        if len(cache) > 64:  # a few shapes recur in decoding; do not grow without bound
            cache.clear()
        x = cache[key] = make()
    return x


def _native(spec: AttentionSpec, k: Tensor, v: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """The kernel on token-major ``k``/``v`` (see :func:`_kernel_kv`), or None when this call
    is not in a form it reads."""
    q = _data(spec.q)
    if spec.segments_q is not None:
        return None if spec.starts_kv is not None else _native_packed(spec, k, v)
    rows = _key_rows(spec)
    if rows is None:
        return None
    lengths, starts = rows
    descales = {}
    if spec.paged is not None:
        table = spec.paged.block_table
        descales = {"k_descale": spec.paged.k_descale, "v_descale": spec.paged.v_descale}
    else:  # each batch row read as one page of Lk tokens (a strided view, no copy)
        n, dev = spec.n, q.device
        table = _cached(_ROW_TABLES, (n, dev),
                        lambda: torch.arange(n, dtype=torch.int64, device=dev).view(n, 1))
        if lengths is None:
            lengths = _cached(_FULL_LENGTHS, (n, spec.lk, dev),
                              lambda: torch.full((n,), spec.lk, dtype=torch.int64, device=dev))
    return native.paged_decode(q, k, v, table, lengths, scale=spec.scale, starts=starts,
                               **_terms(spec), **descales)


#: What :func:`replay` runs: analytic masks on a contiguous cache with one kind of padding.
_REPLAYED = frozenset({"window", "softcap", "seqlens_kv", "starts_kv"})

#: ``launch(q, k, v, seqlens_kv, starts_kv)``: see :func:`replay`
Launch = Callable[[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]], Optional[Tensor]]


def replay(spec: AttentionSpec, bounds: Tuple[Optional[int], Optional[int]],
           grad: bool = False) -> Optional[Launch]:
    """A launcher for the calls of a decoding loop that follow this one: the same query
    (shape, strides, dtype), options and key/value heads, dims and dtypes, with any number of
    cached keys in any strides. ``launch(q, k, v, seqlens_kv, starts_kv)`` (4-D tensors, as
    the user passed them) runs the native kernel as :func:`forward` would and returns the
    output in q's dtype, without a spec, a selection or the kernel's per-call checks in
    Python; it returns None (take the full path) when the kernel was unloaded, K and V
    disagree in length or have none, or the kernel refuses the lengths (the full path then
    explains them). ``bounds`` are the window's unclamped bounds (:func:`attnkit.spec.band`):
    the spec's are clamped to its own cache length. None here when the call is not of that
    form: a contiguous cache with at most one of right (``seqlens_kv``) and left
    (``starts_kv``) padding, causal / window / softcap, no ALiBi, sinks or packed sequences,
    the kernel able to run it, and no gradient wanted (``grad``)."""
    if (grad or spec.features() - _REPLAYED or spec.is_empty
            or (spec.seqlens_kv is not None and spec.starts_kv is not None)
            or _kernel_kv(spec) is None or _key_rows(spec) is None):
        return None
    terms = dict(_terms(spec), window=bounds)
    del terms["alibi_slopes"]  # (None: not replayed)
    call = native.DecodeCall(spec.q, spec.k.dtype, scale=spec.scale, **terms)
    n = spec.n
    table = torch.arange(n, dtype=torch.int64).view(n, 1)
    lib = call.lib

    def launch(q: Tensor, k: Tensor, v: Tensor, seqlens_kv: Optional[Tensor],
               starts_kv: Optional[Tensor]) -> Optional[Tensor]:
        lk = k.shape[2]
        if native._state.get("lib") is not lib or lk != v.shape[2] or lk == 0:
            return None
        starts = None
        if seqlens_kv is not None:
            lengths = seqlens_kv
        elif starts_kv is not None:  # (normalised: int64, each in [0, Lk], not all 0)
            starts = starts_kv
            lengths = lk - starts
        else:
            lengths = _cached(_FULL_LENGTHS, (n, lk, q.device),
                              lambda: torch.full((n,), lk, dtype=torch.int64))
        try:
            out, _ = call.run(q, k, v, table, lengths, lk, starts=starts, want_lse=False,
                              heads_first=True)
        except ValueError:
            return None
        return out if out.dtype == q.dtype else out.to(q.dtype)

    return launch


def _key_rows(spec: AttentionSpec) -> Optional[Tuple[Optional[Tensor], Optional[Tensor]]]:
    """Each row's keys for the kernel, ``(lengths, starts)``: the kernel reads row b's keys
    from ``starts[b]`` for ``lengths[b]`` keys and counts positions from its first key. With
    left padding that moves a top-left diagonal, which the kernel cannot shift back: None
    then (the torch path runs). A bottom-right diagonal ends at the last key either way."""
    if spec.starts_kv is None:
        return spec.seqlens_kv, None
    if spec.diagonal == "top_left" and (spec.has_band or spec.alibi_slopes is not None):
        return None
    ends = spec.seqlens_kv if spec.seqlens_kv is not None else torch.full_like(
        spec.starts_kv, spec.lk)
    return (ends - spec.starts_kv).clamp_(min=0), spec.starts_kv


def _packed_rows(spec: AttentionSpec) -> Optional[Tuple[Tensor, Tensor, Tensor, int, str]]:
    """Packed sequences in their decoding form: sorted segments, the same number of query
    rows per sequence, every sequence aligned the same way (its queries the first or the last
    positions of its keys). Returns ``(query rows, key starts, key lengths, rows per sequence,
    diagonal)`` or None."""
    if spec.row_offset is None or spec.n != 1:
        return None
    sq, sk = spec.segments_q, spec.segments_kv
    if sq.numel() == 0 or bool((sq.diff() < 0).any()) or bool((sk.diff() < 0).any()):
        return None
    ids, counts = torch.unique_consecutive(sq, return_counts=True)
    rows = int(counts[0])
    if bool((counts != rows).any()):
        return None
    # every sequence that has queries, with or without keys (a sequence with no keys gives
    # zero rows: the kernel reads no key for it)
    nseg = max(int(sk.max()) + 1 if sk.numel() else 0, int(ids.max()) + 1)
    k_counts = torch.bincount(sk, minlength=nseg)
    k_starts = torch.cumsum(k_counts, 0) - k_counts
    starts, lens = k_starts[ids], k_counts[ids]
    first_row = torch.arange(0, sq.numel(), rows, device=sq.device)
    local = first_row + spec.row_offset[first_row] - starts  # aligned position of row 0
    if not bool(local.any()):
        diagonal = "top_left"
    elif torch.equal(local, lens - rows):
        diagonal = "bottom_right"
    else:
        return None
    return torch.arange(sq.numel(), device=sq.device), starts, lens, rows, diagonal


def _native_packed(spec: AttentionSpec, k: Tensor, v: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """All packed sequences in one kernel call, each sequence's keys read in place (positions
    within the sequence, as the spec's per-row alignment says); ``k``/``v`` token-major."""
    found = _packed_rows(spec)
    if found is None:
        return None
    idx, starts, lens, rows, diagonal = found
    q = spec.q.detach()
    nseq = lens.numel()
    qb = q[0].index_select(1, idx).view(spec.hq, nseq, rows, -1).transpose(0, 1)
    table = torch.zeros(nseq, 1, dtype=torch.int64)
    o, l = native.paged_decode(qb, k, v, table, lens,
                               scale=spec.scale, starts=starts,
                               **dict(_terms(spec), diagonal=diagonal))
    out = torch.zeros(1, spec.hq, spec.lq, spec.dv, dtype=o.dtype, device=q.device)
    lse = torch.full((1, spec.hq, spec.lq), float("-inf"), dtype=l.dtype, device=q.device)
    out[0].index_copy_(1, idx, o.transpose(0, 1).reshape(spec.hq, -1, spec.dv))
    lse[0].index_copy_(1, idx, l.transpose(0, 1).reshape(spec.hq, -1))
    return out, lse


# ---- torch fallback --------------------------------------------------------------------------


def _fallback(spec: AttentionSpec) -> ForwardResult:
    if spec.paged is not None:
        if _pages_fast_path_applies(spec):
            out, lse = _decode_on_pages(spec)
            return ForwardResult(out=out, lse=lse, max_scores=_no_max(lse))
        p = spec.paged
        k, v = gather_kv(p.k_pages, p.v_pages, p.block_table, spec.seqlens_kv,
                         max_seqlen=spec.lk, k_descale=p.k_descale, v_descale=p.v_descale,
                         dtype=spec.q.dtype if p.k_descale is not None else None)
        spec = replace(spec, k=k, v=v, paged=None)
    return tiled.forward(spec, tiled.make_plan(spec))


def _pages_fast_path_applies(spec: AttentionSpec) -> bool:
    """One new token per sequence that sees all its keys, half precision."""
    sees_all = spec.right is None or (spec.right >= 0 and spec.diagonal == "bottom_right")
    return (spec.lq == 1 and spec.q.dtype in (torch.bfloat16, torch.float16)
            and spec.paged.k_pages.dtype == spec.q.dtype and sees_all and spec.left is None
            and spec.starts_kv is None
            and spec.softcap is None and spec.alibi_slopes is None and spec.sinks is None)


def _decode_on_pages(spec: AttentionSpec) -> Tuple[Tensor, Tensor]:
    """Decoding straight from the pages: each page is read in place as a strided batch of
    heads (Hkv, tokens, D) for one batched matmul with the grouped queries (no gather, no copy
    of K or V); scores and softmax in float32; the output accumulates page by page from P^T V.
    Half-precision matmuls, as the inputs are."""
    q, p = spec.q, spec.paged
    k_pages, v_pages, block_table, seqlens = p.k_pages, p.v_pages, p.block_table, spec.seqlens_kv
    bsz, hq, _, d = q.shape
    _, page, hkv, _ = k_pages.shape
    dv = v_pages.shape[3]
    g = hq // hkv
    scale = spec.scale
    out = torch.zeros(bsz, hq, 1, dv, dtype=torch.float32, device=q.device)
    lse = torch.full((bsz, hq, 1), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(bsz):
        length = int(seqlens[b])
        if length == 0:
            continue
        pages = block_table[b, : -(-length // page)].tolist()
        qh = (q[b, :, 0].float() * scale).to(q.dtype).view(hkv, g, d).transpose(1, 2)
        # per page, heads as a strided batch: (Hkv, page, D) @ (Hkv, D, G), no copy of K
        s = torch.cat([torch.bmm(k_pages[pg].permute(1, 0, 2), qh) for pg in pages], dim=1)
        s = s[:, :length].float()  # (Hkv, L, G)
        m = s.amax(1, keepdim=True)
        e = torch.exp(s - m)
        total = e.sum(1, keepdim=True)
        lse[b, :, 0] = (m + torch.log(total)).view(hq)
        pt = (e / total).to(q.dtype).transpose(1, 2)  # (Hkv, G, L)
        o = torch.zeros(hkv, g, dv, dtype=torch.float32, device=q.device)
        for idx, pg in enumerate(pages):
            lo, hi = idx * page, min(length, (idx + 1) * page)
            o += torch.bmm(pt[:, :, lo:hi], v_pages[pg, : hi - lo].permute(1, 0, 2)).float()
        out[b, :, 0] = o.reshape(hq, dv)
    return out, lse


#: What :func:`replay_paged` runs: analytic masks over pages, fp8 ones included.
_REPLAYED_PAGED = frozenset({"window", "softcap", "seqlens_kv", "paged_kv", "fp8_kv"})

#: ``launch(q, k_pages, v_pages, block_table, seqlens_kv, k_descale, v_descale)``: see
#: :func:`replay_paged`
PagedLaunch = Callable[..., Optional[Tensor]]


def replay_paged(spec: AttentionSpec, bounds: Tuple[Optional[int], Optional[int]]
                 ) -> Optional[PagedLaunch]:
    """A launcher for the paged decoding steps that follow this one
    (:func:`attnkit.paged_attention_blocks`): the same query (shape, strides, dtype), options
    and pages (shapes, strides, dtype), with any block table, lengths and descales.
    ``launch(q, k_pages, v_pages, block_table, seqlens_kv, k_descale, v_descale)`` (the
    descales as checked and laid out by :func:`attnkit.kv.pages.check_page_descales`, None
    for pages that are not fp8) runs the native kernel as :func:`forward` would and returns
    the output in q's dtype, without a spec, a selection or the block table's checks in
    Python (the kernel checks every page a sequence uses and every length before it starts);
    it returns None (take the full path, which explains the refusal) when the kernel was
    unloaded, a sequence holds fewer keys than the query block, or the kernel refuses the
    table or the lengths. ``bounds`` are the window's unclamped bounds
    (:func:`attnkit.spec.band`). None here when the call is not of that form: causal /
    window / softcap, no ALiBi or sinks, the kernel able to run it."""
    if (spec.paged is None or spec.is_empty or spec.features() - _REPLAYED_PAGED
            or spec.starts_kv is not None or _kernel_kv(spec) is None):
        return None
    terms = dict(_terms(spec), window=bounds)
    del terms["alibi_slopes"]  # (None: not replayed)
    call = native.DecodeCall(spec.q, spec.paged.k_pages.dtype, scale=spec.scale, **terms)
    lib, rows = call.lib, spec.lq

    def launch(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
               seqlens_kv: Tensor, k_descale: Optional[Tensor],
               v_descale: Optional[Tensor]) -> Optional[Tensor]:
        if native._state.get("lib") is not lib or int(seqlens_kv.min()) < rows:
            return None
        try:
            out, _ = call.run(q, k_pages, v_pages, block_table, seqlens_kv,
                              max(1, int(seqlens_kv.max())), want_lse=False,
                              k_descale=k_descale, v_descale=v_descale)
        except ValueError:
            return None
        return out if out.dtype == q.dtype else out.to(q.dtype)

    return launch
