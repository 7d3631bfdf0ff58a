"""attnkit as the CPU implementation behind torch's own varlen entry point.

``torch.nn.attention.varlen.varlen_attn`` (torch 2.10+) calls ``aten::_flash_attention_forward``
and ``aten::_flash_attention_backward``, which have no CPU kernel: on CPU tensors it raises
``NotImplementedError``. torch lets an implementation provider register CPU (or CUDA) kernels
for those ops through its flash-attention implementation registry; attnkit registers itself
there under the name ``"attnkit"`` when this module is imported (``import attnkit`` does it),
and, as torch asks of providers, does not activate itself. Activate it with::

    from torch.nn.attention import activate_flash_attention_impl
    activate_flash_attention_impl("attnkit")      # or attnkit.integrations.torch_varlen.activate()
    out = torch.nn.attention.varlen.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k)

After that, ``varlen_attn`` (and ``varlen_attn_out``) run on CPU through attnkit's custom ops,
forward and backward (torch's own autograd node for ``varlen_attn`` calls the backward op, which
runs attnkit's backward from the saved output and log-sum-exp), and compile like any custom op.
What the ops' arguments become: ``is_causal`` -> ``causal=True`` with the bottom-right diagonal
(FlashAttention's alignment when the query and key lengths differ), ``window_size_left/right``
(-1 = unbounded) -> ``window``, ``scale``, ``alibi_slopes``, ``seqused_k`` (the first
``seqused_k[i]`` keys of sequence i; forward only, as in torch), ``block_table`` (paged K/V of
shape ``(pages, page_size, Hkv, D)``; forward only), ``dropout_p`` (the seed is drawn from
torch's generator and returned as ``rng_state``; the backward replays it). ``num_splits`` is
accepted and ignored (attnkit's results do not depend on a split count).
``return_debug_mask=True`` is refused. Only CPU tensors are registered; CUDA keeps torch's own
kernels.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..doors.varlen import pack_varlen
from ..engine import ops
from ..terms.spec import Options

__all__ = ["NAME", "activate", "available", "register"]

#: The name attnkit registers under in torch's flash-attention implementation registry.
NAME = "attnkit"


def available() -> bool:
    """Whether this torch has the implementation registry (torch 2.10+)."""
    attn = getattr(torch.nn, "attention", None)
    return attn is not None and hasattr(attn, "register_flash_attention_impl")


def register() -> bool:
    """Add ``"attnkit"`` to torch's flash-attention implementations (not activated); False on a
    torch without the registry."""
    if not available():
        return False
    torch.nn.attention.register_flash_attention_impl(NAME, register_fn=_register_kernels)
    return True


def activate() -> None:
    """``torch.nn.attention.activate_flash_attention_impl("attnkit")``."""
    if not register():
        raise NotImplementedError(
            f"torch {torch.__version__} has no flash-attention implementation registry "
            f"(torch.nn.attention.register_flash_attention_impl, torch 2.10+); call "
            f"attnkit.varlen_attention directly")
    torch.nn.attention.activate_flash_attention_impl(NAME)


class _Handle:
    """What the registry keeps while attnkit is active; ``remove()`` unregisters the kernels."""

    def __init__(self, library: Any) -> None:
        self.library: Any = library

    def remove(self) -> None:
        library, self.library = self.library, None
        if library is not None:
            library._destroy()


def _register_kernels() -> _Handle:
    lib = torch.library.Library("aten", "IMPL", "CPU")
    lib.impl("_flash_attention_forward", _forward, "CPU")
    lib.impl("_flash_attention_backward", _backward, "CPU")
    if hasattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace"):
        lib.impl("_flash_attention_forward_no_dropout_inplace", _forward_inplace, "CPU")
    return _Handle(lib)


# ---- from the aten arguments to attnkit's ---------------------------------------------------


def _options(is_causal: bool, dropout_p: float, scale: Optional[float],
             window_size_left: Optional[int], window_size_right: Optional[int],
             alibi_slopes: Optional[Tensor], seed: Optional[int]) -> Options:
    left = None if window_size_left is None or window_size_left < 0 else int(window_size_left)
    right = None if window_size_right is None or window_size_right < 0 else int(
        window_size_right)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    window = None if left is None and right is None else (left, right)
    if window is not None and is_causal and left is None:
        window = None  # plain causal
    return Options(scale=scale, causal=bool(is_causal), window=window, diagonal="bottom_right",
                   alibi_slopes=alibi_slopes, dropout_p=float(dropout_p),
                   seed=seed if dropout_p > 0 else None)


def _used_keys(key: Tensor, value: Tensor, cu_k: Optional[Tensor], seqused_k: Optional[Tensor],
               block_table: Optional[Tensor], nseq: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Packed ``(T, Hkv, D)`` keys and values of what each sequence uses, and their
    cu_seqlens: the keys themselves when all are used, else gathered (``seqused_k``, pages)."""
    if block_table is not None:
        if seqused_k is None:
            raise ValueError("block_table needs seqused_k (the number of tokens each sequence "
                             "holds in its pages)")
        if key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"with block_table, key and value are pages (num_pages, "
                             f"page_size, Hkv, D); got {tuple(key.shape)} and "
                             f"{tuple(value.shape)}")
        lens = seqused_k.long()
        seg, pos = _positions(lens, nseq)
        page = key.shape[1]
        rows = block_table.long()[seg, torch.div(pos, page, rounding_mode="floor")]
        return key[rows, pos % page], value[rows, pos % page], _cumulative(lens)
    if cu_k is None:
        raise ValueError("cum_seq_k is required without a block_table")
    if seqused_k is None:
        return key, value, cu_k
    lens = seqused_k.long()
    full = cu_k.long().diff()
    if bool((lens > full).any()) or bool((lens < 0).any()):
        raise ValueError(f"seqused_k must be within each sequence's key count "
                         f"{full.tolist()}; got {lens.tolist()}")
    seg, pos = _positions(lens, nseq)
    idx = cu_k.long()[:-1][seg] + pos
    return key[idx], value[idx], _cumulative(lens)


def _positions(lens: Tensor, nseq: int) -> Tuple[Tensor, Tensor]:
    """For each used token: its sequence and its position in it."""
    seg = torch.repeat_interleave(torch.arange(nseq, device=lens.device), lens)
    starts = lens.cumsum(0) - lens
    return seg, torch.arange(seg.numel(), device=lens.device) - starts[seg]


def _cumulative(lens: Tensor) -> Tensor:
    return torch.cat([lens.new_zeros(1), lens.cumsum(0)])


def _seed_of(rng_state: Optional[Tensor]) -> int:
    return int(rng_state.to(torch.int64)[0]) if rng_state is not None and (
        rng_state.numel()) else 0


def _rng_state(seed: int, device: torch.device) -> Tensor:
    return torch.tensor([seed, 0], dtype=torch.uint64, device=device)


def _pack(query: Tensor, key: Tensor, value: Tensor, cu_q: Optional[Tensor],
          cu_k: Optional[Tensor], opts: Options, seqused_k: Optional[Tensor] = None,
          block_table: Optional[Tensor] = None) -> Tuple[ops.Packed, Tensor, Tensor, Tensor,
                                                        Optional[Tensor]]:
    """The call as op arguments: varlen when ``cu_q`` is given (q ``(Tq, H, D)``), else dense
    (q ``(B, Lq, H, D)``); also the key index used (None when all keys are used)."""
    if cu_q is not None:
        k_used, v_used, cu_used = _used_keys(key, value, cu_k, seqused_k, block_table,
                                             cu_q.numel() - 1)
        p, qt, kt, vt = pack_varlen(query, k_used, v_used, cu_q, cu_used, opts, "auto")
        return p, qt, kt, vt, None
    if block_table is not None:
        raise NotImplementedError("a block_table without cum_seq_q is not supported; pass "
                                  "cum_seq_q (one entry per sequence) to read paged keys")
    opts = opts.merged(seqlens_kv=seqused_k)
    qt, kt, vt = (x.transpose(1, 2) for x in (query, key, value))
    return ops.pack("attention", qt, kt, vt, opts, backend="auto"), qt, kt, vt, None


def _config(p: ops.Packed) -> str:
    return ops._to_json(p.config)


# ---- the kernels -----------------------------------------------------------------------------


def _forward(query: Tensor, key: Tensor, value: Tensor, cum_seq_q: Optional[Tensor],
             cum_seq_k: Optional[Tensor], max_q: int, max_k: int, dropout_p: float,
             is_causal: bool, return_debug_mask: bool, *, scale: Optional[float] = None,
             window_size_left: Optional[int] = None, window_size_right: Optional[int] = None,
             seqused_k: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
             block_table: Optional[Tensor] = None, num_splits: Optional[int] = None
             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``aten::_flash_attention_forward`` on CPU."""
    if return_debug_mask:
        raise NotImplementedError("attnkit's flash-attention kernels do not return a debug "
                                  "mask; call with return_debug_mask=False")
    seed = int(torch.randint(0, 2 ** 62, ())) if dropout_p > 0 else 0
    opts = _options(is_causal, dropout_p, scale, window_size_left, window_size_right,
                    alibi_slopes, seed)
    if block_table is not None and cum_seq_q is not None and dropout_p == 0:
        # packed queries over a paged cache: read in place, as attnkit.varlen_attention does
        from ..doors.varlen_pages import varlen_over_pages

        if seqused_k is None:
            raise ValueError("block_table needs seqused_k (the number of tokens each sequence "
                             "holds in its pages)")
        kw = {name: getattr(opts, name) for name in ("scale", "causal", "window", "diagonal",
                                                     "alibi_slopes")}
        with torch.no_grad():
            out, lse = varlen_over_pages(query, key, value, cum_seq_q, seqused_k, block_table,
                                         max_q, max_k, kw, return_lse=True)
        empty = query.new_empty(0)
        return out, lse, _rng_state(seed, query.device), empty, empty
    p, qt, kt, vt, _ = _pack(query, key, value, cum_seq_q, cum_seq_k, opts, seqused_k,
                             block_table)
    out, lse, _ = ops.attention_op(qt, kt, vt, p.grad_tensors, p.tensors, _config(p))
    if cum_seq_q is not None:
        out, lse = out[0].transpose(0, 1).contiguous(), lse[0]
    else:
        out = out.transpose(1, 2).contiguous()
    empty = query.new_empty(0)
    return out, lse, _rng_state(seed, query.device), empty, empty


def _forward_inplace(out: Tensor, query: Tensor, key: Tensor, value: Tensor, *args: Any,
                     **kwargs: Any) -> Tensor:
    """``aten::_flash_attention_forward_no_dropout_inplace`` on CPU: the output into ``out``,
    the log-sum-exp returned."""
    res, lse, *_ = _forward(query, key, value, *args, **kwargs)
    out.copy_(res)
    return lse


def _backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
              logsumexp: Tensor, cum_seq_q: Optional[Tensor], cum_seq_k: Optional[Tensor],
              max_q: int, max_k: int, dropout_p: float, is_causal: bool, rng_state: Tensor,
              unused: Tensor, *, scale: Optional[float] = None,
              window_size_left: Optional[int] = None, window_size_right: Optional[int] = None
              ) -> Tuple[Tensor, Tensor, Tensor]:
    """``aten::_flash_attention_backward`` on CPU: attnkit's backward from the saved output and
    log-sum-exp (the dropout seed replayed from ``rng_state``)."""
    opts = _options(is_causal, dropout_p, scale, window_size_left, window_size_right, None,
                    _seed_of(rng_state))
    p, qt, kt, vt, _ = _pack(query, key, value, cum_seq_q, cum_seq_k, opts)
    if cum_seq_q is not None:
        out4, dout4 = (x.transpose(0, 1).unsqueeze(0) for x in (out, grad_out))
        lse4 = logsumexp.unsqueeze(0)
    else:
        out4, dout4 = out.transpose(1, 2), grad_out.transpose(1, 2)
        lse4 = logsumexp
    dq, dk, dv, *_ = ops.attention_backward_op(qt, kt, vt, p.grad_tensors, p.tensors,
                                               _config(p), out4.contiguous(), lse4.contiguous(),
                                               dout4.contiguous(), None)
    if cum_seq_q is not None:
        return tuple(g[0].transpose(0, 1).contiguous() for g in (dq, dk, dv))  # type: ignore
    return tuple(g.transpose(1, 2).contiguous() for g in (dq, dk, dv))  # type: ignore
