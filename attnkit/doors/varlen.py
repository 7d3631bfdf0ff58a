"""Packed variable-length sequences (FlashAttention's ``cu_seqlens`` layout)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from .. import backends
from ..engine import ops
from ..engine.ops import is_compiling
from ..kv.paged import paged_spec
from ..terms.checks import autocast_inputs, check_cu
from ..terms.fp8 import cache_descales, check_out_dtype, dequantize_query, finish_output
from ..terms.mods import remap
from ..terms.spec import (
    _DEFAULT_OPTIONS,
    AttentionSpec,
    DoorOptions,
    Options,
    PagedKV,
    _is_default,
    build_spec,
)
from .attention import _execute, fp8_readable_in_place, reads_fp8_for_decoding

#: Options varlen_attention does not take, and why.
UNSUPPORTED = {
    "mask": "packed positions are not one (Lq, Lk) grid; use score_mod (it sees positions "
            "within each sequence) or one call per sequence",
    "bias": "packed positions are not one (Lq, Lk) grid; use score_mod",
    "seqlens_q": "cu_seqlens_q gives every sequence's length",
    "seqlens_kv": "cu_seqlens_kv gives every sequence's length",
    "starts_kv": "cu_seqlens_kv gives where every sequence's keys start",
    "dropout_mask": "packed positions are not one (Lq, Lk) grid; use dropout_p with a seed",
}
#: What varlen_attention takes: every option but those above (the call's Options go whole into
#: build_spec)
TAKES = DoorOptions.all_but("varlen_attention", UNSUPPORTED)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Any, cu_seqlens_kv: Any,
                     max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                     *, return_lse: bool = False, backend: str = "auto",
                     seqused_kv: Any = None, block_table: Any = None, k_descale: Any = None,
                     v_descale: Any = None, **options: Any) -> Any:
    """Attention over packed sequences: sequence s holds query tokens
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key tokens ``cu_seqlens_kv[s]:cu_seqlens_kv[s+1]``
    and attends only within itself.

    Shapes: q ``(Tq, Hq, Dqk)``, k ``(Tk, Hkv, Dqk)``, v ``(Tk, Hkv, Dv)`` -> out
    ``(Tq, Hq, Dv)``; lse ``(Hq, Tq)`` (FlashAttention's layout). ``causal``, ``window``,
    ``diagonal`` (bottom-right uses each sequence's own lengths), ALiBi, softcap and GQA apply
    per sequence; a ``score_mod`` sees ``b`` = the sequence index and positions *within* the
    sequence. ``alibi_slopes`` is ``(Hq,)`` or per sequence ``(num_seqs, Hq)`` (FlashAttention's
    layout). ``sinks`` (``(Hq,)``, with their gradient) apply to every packed row; dropout
    (``dropout_p``, ``seed``, ``offset``) keeps weight ``(0, h, i, j)`` by the packed query
    and key positions ``i``, ``j`` (replayable, the backward replays it). The other options of
    :func:`attnkit.attention` but those in :data:`UNSUPPORTED` apply too.
    Zero-length sequences are allowed; no work is spent across sequences beyond the tiles that
    straddle a boundary. ``max_seqlen_*`` are accepted for compatibility and checked.

    Over a paged KV cache (a serving engine's step; FlashAttention's ``seqused_k`` and
    ``block_table``): ``k`` and ``v`` are pages ``(num_pages, page_size, Hkv, D)``,
    ``cu_seqlens_kv`` is None, ``block_table (num_seqs, max_pages)`` lists each sequence's
    pages and ``seqused_kv (num_seqs,)`` how many tokens it holds there, its queries the last
    of them (append them first); the default is then ``causal=True`` with each sequence's
    bottom-right diagonal. Decoding rows and prefill chunks mix freely in one call; fp8 pages
    take ``k_descale``/``v_descale`` as :func:`attnkit.paged_attention_blocks` does. Forward
    only; the options are those of :data:`attnkit.varlen_pages.TAKES` (see
    :mod:`attnkit.varlen_pages`).
    """
    if block_table is not None:
        from .varlen_pages import varlen_over_pages

        if cu_seqlens_kv is not None:
            raise ValueError("with block_table, pass cu_seqlens_kv=None: seqused_kv gives each "
                             "sequence's cached length")
        if seqused_kv is None:
            raise ValueError("block_table needs seqused_kv (the number of tokens each sequence "
                             "holds in its pages, its queries included)")
        return varlen_over_pages(q, k, v, cu_seqlens_q, seqused_kv, block_table, max_seqlen_q,
                                 max_seqlen_kv, options, k_descale=k_descale,
                                 v_descale=v_descale, return_lse=return_lse, backend=backend)
    for name, x in (("seqused_kv", seqused_kv), ("k_descale", k_descale),
                    ("v_descale", v_descale)):
        if x is not None:
            raise NotImplementedError(f"{name} is for a paged cache: pass block_table (and "
                                      f"k/v as pages), or drop {name}")
    opts = Options.from_kwargs("varlen_attention", options, TAKES)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim); got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    q, k, v = autocast_inputs(q, k, v)
    if is_compiling():  # checked inside the op
        p, qt, kt, vt = pack_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, opts, backend)
        out, lse, _ = ops.call(p, qt, kt, vt)
    else:
        cu_q = check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
        cu_k = check_cu("cu_seqlens_kv", cu_seqlens_kv, k.shape[0], q.device)
        if cu_q.numel() != cu_k.numel():
            raise ValueError(f"cu_seqlens_q describes {cu_q.numel() - 1} sequences and "
                             f"cu_seqlens_kv {cu_k.numel() - 1}; they must agree")
        for name, lim, lens in (("max_seqlen_q", max_seqlen_q, cu_q.diff()),
                                ("max_seqlen_kv", max_seqlen_kv, cu_k.diff())):
            if lim is not None and lens.numel() and int(lens.max()) > lim:
                raise ValueError(f"{name}={lim} but a sequence has length {int(lens.max())}")
        found = _fp8_packed_in_place(q, k, v, cu_q, cu_k, opts, backend)
        if found is not None:  # fp8 K/V read in place: (sequences, Hq, rows, Dv) out
            spec, rows = found
            out, lse, _ = _execute(spec, backend)
            out = out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)
            out = finish_output(out, opts.out_dtype, opts.out_scale)
            lse = lse.permute(1, 0, 2).reshape(q.shape[1], q.shape[0])
            return (out, lse) if return_lse else out
        qt, kt, vt, opts, seg_q, seg_k, row_offset = _layout(q, k, v, cu_q, cu_k, opts)
        spec = build_spec(qt, kt, vt, opts, segments=(seg_q, seg_k), row_offset=row_offset)
        out, lse, _ = _execute(spec, backend)
    out = finish_output(out[0].transpose(0, 1), opts.out_dtype, opts.out_scale)
    return (out, lse[0]) if return_lse else out


#: Options an fp8 packed call may carry and still read its K/V in place
_IN_PLACE_OPTIONS = frozenset({"scale", "causal", "diagonal", "window", "softcap", "out_dtype",
                               "descale_q", "descale_k", "descale_v"})


def _fp8_packed_in_place(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
                         opts: Options, backend: str) -> Optional[Tuple[AttentionSpec, int]]:
    """Decoding over an fp8 packed cache: the spec of the call with K/V read in place
    (the packed keys as one page of ``Tk`` tokens, sequence s's keys from ``cu_seqlens_kv[s]``
    on, per-tensor or per-kv-head descales as the page's), each sequence a batch row of its
    (equally many, at most the decode executor's) query rows; and that number of rows. None
    when the call is not of that form or the decode executor would not run it: the caller
    then dequantizes, as for any fp8 input."""
    if not fp8_readable_in_place(q, k, v, opts, backend) or any(
            not _is_default(getattr(opts, name), getattr(_DEFAULT_OPTIONS, name))
            for name in Options.names() if name not in _IN_PLACE_OPTIONS):
        return None
    if (opts.causal or opts.window is not None) and opts.diagonal != "bottom_right":
        # the read in place places a top-left diagonal at absolute key positions (as for
        # left padding), not at each sequence's first key: varlen's meaning needs the copy
        return None
    nseq = cu_q.numel() - 1
    counts = cu_q.diff()
    if nseq < 1 or q.shape[0] % nseq:
        return None
    rows = q.shape[0] // nseq
    most = backends.most_query_rows("fp8_kv")
    if (most is not None and rows > most) or bool((counts != rows).any()):
        return None
    out_dtype, _ = check_out_dtype(opts.out_dtype, None)
    hkv = k.shape[1]
    kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # (1, Hkv, Tk, D)
    qd = dequantize_query(q.transpose(0, 1).unsqueeze(0), opts.descale_q, hkv, out_dtype)
    qb = qd[0].view(q.shape[1], nseq, rows, -1).transpose(0, 1)  # (sequences, Hq, rows, D)
    table = torch.zeros(nseq, 1, dtype=torch.int64, device=q.device)
    pages = PagedKV(k.unsqueeze(0), v.unsqueeze(0), table, cache_descales("k", kt, opts.descale_k),
                    cache_descales("v", vt, opts.descale_v))
    spec = paged_spec(qb, pages, opts.merged(descale_q=None, descale_k=None, descale_v=None,
                                             seqlens_kv=cu_k[1:], starts_kv=cu_k[:-1]))
    return (spec, rows) if reads_fp8_for_decoding(backends.choose(spec)) else None


def _layout(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, opts: Options
            ) -> Tuple[Tensor, Tensor, Tensor, Options, Tensor, Tensor, Tensor]:
    """A packed call as one (1, H, T, D) problem: the views, the options re-expressed on them
    (score_mod on local positions, ALiBi per row, the diagonal as row offsets), each token's
    sequence and each query row's diagonal offset. Shape-only torch ops (torch.compile traces
    them)."""
    len_q, len_k = cu_q.diff(), cu_k.diff()
    nseq = len_q.shape[0]
    seg_q = torch.repeat_interleave(torch.arange(nseq, device=q.device), len_q,
                                    output_size=q.shape[0])
    seg_k = torch.repeat_interleave(torch.arange(nseq, device=q.device), len_k,
                                    output_size=k.shape[0])
    shift = cu_k[:-1] - cu_q[:-1]  # query position -> aligned key position of its sequence
    if opts.diagonal == "bottom_right":
        shift = shift + len_k - len_q
    elif opts.diagonal != "top_left":
        raise ValueError(f"diagonal must be 'top_left' or 'bottom_right'; got {opts.diagonal!r}")
    mod = _local_score_mod(opts.score_mod, seg_q, seg_k, cu_q, cu_k) if opts.score_mod else None
    slopes, hq = opts.alibi_slopes, q.shape[1]
    if isinstance(slopes, Tensor) and slopes.dim() == 2 and nseq > 1 and tuple(
            slopes.shape) == (nseq, hq):  # per (sequence, head): each row its sequence's
        slopes = slopes[seg_q].transpose(0, 1).unsqueeze(0)  # (1, Hq, Tq)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return (qt, kt, vt, opts.merged(score_mod=mod, alibi_slopes=slopes, diagonal="top_left"),
            seg_q, seg_k, shift[seg_q])


def pack_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Any, cu_k: Any, opts: Options,
                backend: str) -> Tuple[ops.Packed, Tensor, Tensor, Tensor]:
    """A varlen call (q, k, v packed ``(T, H, D)``) as custom-op arguments and the
    ``(1, H, T, D)`` views the op takes, reading no tensor data (the op checks ``cu_q`` and
    ``cu_k``)."""
    cu_q, cu_k = (torch.as_tensor(c, device=q.device).to(torch.int64) for c in (cu_q, cu_k))
    qt, kt, vt, opts, seg_q, seg_k, row_offset = _layout(q, k, v, cu_q, cu_k, opts)
    p = ops.pack("varlen", qt, kt, vt, opts, backend=backend,
                 extra={"segments_q": seg_q, "segments_kv": seg_k, "row_offset": row_offset,
                        "cu_seqlens_q": cu_q, "cu_seqlens_kv": cu_k})
    return p, qt, kt, vt


def _local_score_mod(score_mod: Callable, seg_q: Tensor, seg_k: Tensor, cu_q: Tensor,
                     cu_k: Tensor) -> Callable:
    """Wrap a score_mod so it sees (sequence, head, local q position, local kv position)."""

    def local(b, h, q_idx, kv_idx):
        s = seg_q[q_idx]
        return s, h, q_idx - cu_q[s], kv_idx - cu_k[seg_k[kv_idx]]

    return remap(score_mod, local, score=True, suffix="varlen", factory=_local_score_mod,
                 args=(score_mod, seg_q, seg_k, cu_q, cu_k))
