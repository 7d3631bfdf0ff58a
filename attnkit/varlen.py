"""Packed variable-length sequences (FlashAttention's ``cu_seqlens`` layout)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .api import _execute
from .checks import autocast_inputs
from .mods import remap
from .ops import is_compiling
from .spec import Options, build_spec


def _check_cu(name: str, cu: Any, total: int, device: torch.device) -> Tensor:
    if isinstance(cu, (list, tuple)):
        try:
            cu = torch.as_tensor(cu, device=device)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{name} must be an int32/int64 tensor or a list of ints") from err
        if cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32/int64 tensor or a list of ints; got a "
                            f"list of {cu.dtype} values")
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be an int32/int64 tensor or a list of ints; got "
                        f"{type(cu).__name__}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}; move it with "
                         f"{name}.to(q.device)")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64; got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D prefix sums with a leading 0; got shape "
                         f"{tuple(cu.shape)}")
    cu = cu.to(device=device, dtype=torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start with 0; got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (lengths >= 0); got {cu.tolist()}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name} ends at {int(cu[-1])} but the packed tensor holds {total} "
                         f"tokens; the last entry must equal the total length")
    return cu


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


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Any, cu_seqlens_kv: Any,
                     max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                     *, return_lse: bool = False, backend: str = "auto",
                     **options: Any) -> Any:
    """Attention over packed sequences: sequence s holds query tokens
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key tokens ``cu_seqlens_kv[s]:cu_seqlens_kv[s+1]``
    and attends only within itself.

    Shapes: q ``(Tq, Hq, Dqk)``, k ``(Tk, Hkv, Dqk)``, v ``(Tk, Hkv, Dv)`` -> out
    ``(Tq, Hq, Dv)``; lse ``(Hq, Tq)`` (FlashAttention's layout). ``causal``, ``window``,
    ``diagonal`` (bottom-right uses each sequence's own lengths), ALiBi, softcap and GQA apply
    per sequence; a ``score_mod`` sees ``b`` = the sequence index and positions *within* the
    sequence. ``alibi_slopes`` is ``(Hq,)`` or per sequence ``(num_seqs, Hq)`` (FlashAttention's
    layout). ``sinks`` and dropout (``dropout_p``, ``seed``) apply to every packed row. The
    other options of :func:`attnkit.attention` but those in :data:`UNSUPPORTED` apply too.
    Zero-length sequences are allowed; no work is spent across sequences beyond the tiles that
    straddle a boundary. ``max_seqlen_*`` are accepted for compatibility and checked.
    """
    opts = Options.from_kwargs("varlen_attention", options, UNSUPPORTED)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim); got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    q, k, v = autocast_inputs(q, k, v)
    if is_compiling():
        from . import compiled

        return compiled.varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, opts, return_lse, backend)
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    cu_k = _check_cu("cu_seqlens_kv", cu_seqlens_kv, k.shape[0], q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q describes {cu_q.numel() - 1} sequences and "
                         f"cu_seqlens_kv {cu_k.numel() - 1}; they must agree")
    len_q, len_k = cu_q.diff(), cu_k.diff()
    for name, lim, lens in (("max_seqlen_q", max_seqlen_q, len_q),
                            ("max_seqlen_kv", max_seqlen_kv, len_k)):
        if lim is not None and lens.numel() and int(lens.max()) > lim:
            raise ValueError(f"{name}={lim} but a sequence has length {int(lens.max())}")
    nseq = len_q.numel()
    seg_q = torch.repeat_interleave(torch.arange(nseq, device=q.device), len_q)
    seg_k = torch.repeat_interleave(torch.arange(nseq, device=q.device), len_k)
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
    spec = build_spec(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                      v.transpose(0, 1).unsqueeze(0),
                      opts.merged(score_mod=mod, alibi_slopes=slopes, diagonal="top_left"),
                      segments=(seg_q, seg_k), row_offset=shift[seg_q])
    out, lse, _ = _execute(spec, backend)
    out = out[0].transpose(0, 1)
    return (out, lse[0]) if return_lse else out


def _local_score_mod(score_mod: Callable, seg_q: Tensor, seg_k: Tensor, cu_q: Tensor,
                     cu_k: Tensor) -> Callable:
    """Wrap a score_mod so it sees (sequence, head, local q position, local kv position)."""

    def local(b, h, q_idx, kv_idx):
        s = seg_q[q_idx]
        return s, h, q_idx - cu_q[s], kv_idx - cu_k[seg_k[kv_idx]]

    return remap(score_mod, local, score=True, suffix="varlen", factory=_local_score_mod,
                 args=(score_mod, seg_q, seg_k, cu_q, cu_k))
