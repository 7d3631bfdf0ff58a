"""Packed queries of many sequences over a paged KV cache: the call a serving engine makes
every step (FlashAttention's ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q,
seqused_k=, block_table=)``), through :func:`attnkit.varlen_attention`.

Sequence ``s`` holds query tokens ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of the packed q and
``seqused_kv[s]`` cached tokens in the pages its block-table row lists; its queries are the
last of those tokens (already appended), so the default mask is causal with each sequence's
bottom-right diagonal. Decoding rows (one query) and prefill chunks (hundreds) mix freely::

    packed q     | s0: 1 row | s1: 1 row | s2: 5 rows (a chunk) | s3: 1 row |
    seqused_kv   |   812     |   40      |   5 (its first chunk) |   3000    |

Sequences are run in groups of equally many query rows, each group one paged call
(:func:`attnkit.paged_attention_blocks`): the decode executor reads the pages in place for
up to its query-row limit, an executor that reads pages runs longer chunks, and the pages are
gathered into contiguous K/V only where none does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..kv.pages import _index_tensor
from ..terms.checks import check_cu
from ..terms.fp8 import check_out_dtype
from ..terms.spec import DoorOptions, Options

#: What varlen_attention takes over a paged cache: forward only (serving), and the options
#: the paged calls carry per sequence
TAKES = DoorOptions("varlen_attention over pages", frozenset({
    "scale", "causal", "window", "diagonal", "softcap", "alibi_slopes", "sinks", "out_dtype"}),
    {"mask": "packed positions over pages are not one (Lq, Lk) grid; use causal/window",
     "bias": "packed positions over pages are not one (Lq, Lk) grid",
     "score_mod": "not carried over pages yet; use alibi_slopes/softcap, or gather the pages",
     "seqlens_q": "cu_seqlens_q gives every sequence's query count",
     "seqlens_kv": "seqused_kv gives every sequence's cached length",
     "starts_kv": "seqused_kv gives every sequence's cached length",
     "dropout_p": "serving runs no dropout", "seed": "serving runs no dropout",
     "offset": "serving runs no dropout", "dropout_mask": "serving runs no dropout",
     "descale_q": "q is float32/bfloat16/float16 over fp8 pages (the pages' descales are "
                  "k_descale/v_descale)",
     "descale_k": "pass the pages' descales as k_descale", "descale_v": "pass the pages' "
     "descales as v_descale", "p_scale": "forward of the tiled executor only",
     "out_scale": "fp8 outputs are not produced over pages"})


def varlen_over_pages(q: Tensor, k_pages: Tensor, v_pages: Tensor, cu_seqlens_q: Any,
                      seqused_kv: Any, block_table: Any, max_seqlen_q: Optional[int],
                      max_seqlen_kv: Optional[int], options: dict, *,
                      k_descale: Any = None, v_descale: Any = None, return_lse: bool = False,
                      backend: str = "auto") -> Any:
    """:func:`attnkit.varlen_attention` with ``block_table``: q ``(Tq, Hq, Dqk)`` packed,
    pages ``(num_pages, page_size, Hkv, D)``, ``block_table (S, max_pages)``, ``seqused_kv
    (S,)``; out ``(Tq, Hq, Dv)`` (and lse ``(Hq, Tq)``). Forward only."""
    from .paged import paged_attention_blocks

    options = {"causal": True, "diagonal": "bottom_right", **options}
    opts = Options.from_kwargs("varlen_attention", options, TAKES)
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError(f"q must be 3-D (total_tokens, Hq, Dqk) over a paged cache; got "
                         f"{tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__}")
    if torch.is_grad_enabled() and (q.requires_grad or any(
            isinstance(x, Tensor) and x.requires_grad for x in (k_pages, v_pages, opts.sinks))):
        raise NotImplementedError("varlen_attention over a paged cache is forward only (the "
                                  "pages hold values, not autograd history); call it under "
                                  "torch.no_grad(), or gather the pages (attnkit.gather_kv) "
                                  "and call varlen_attention on packed K/V")
    cu_q = check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    nseq = cu_q.numel() - 1
    table = _index_tensor("block_table", block_table, k_pages, torch.int32)
    used = _index_tensor("seqused_kv", seqused_kv, k_pages, torch.int32)
    if not isinstance(table, Tensor) or table.dim() != 2 or table.shape[0] != nseq:
        raise ValueError(f"block_table must be (num_seqs, max_pages) with num_seqs = {nseq} "
                         f"(cu_seqlens_q's); got {tuple(getattr(table, 'shape', ()))}")
    if not isinstance(used, Tensor) or tuple(used.shape) != (nseq,):
        raise ValueError(f"seqused_kv must be ({nseq},) (each sequence's cached tokens, its "
                         f"queries included); got {tuple(getattr(used, 'shape', ()))}")
    rows = cu_q.diff()
    _check_max("max_seqlen_q", max_seqlen_q, rows)
    _check_max("max_seqlen_kv", max_seqlen_kv, used)
    slopes = opts.alibi_slopes
    if slopes is not None:
        slopes = torch.as_tensor(slopes, dtype=torch.float32, device=q.device)
    kw = {name: getattr(opts, name) for name in TAKES.takes if name != "alibi_slopes"}
    hq, dv = q.shape[1], v_pages.shape[-1]
    out_dtype, _ = check_out_dtype(opts.out_dtype, None)
    out = q.new_zeros((q.shape[0], hq, dv), dtype=q.dtype if out_dtype is None else out_dtype)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    counts = rows.tolist()
    for r in sorted(set(counts) - {0}):
        seqs = torch.tensor([s for s, c in enumerate(counts) if c == r], device=q.device)
        tokens = (cu_q[:-1][seqs].unsqueeze(1) + torch.arange(r, device=q.device)).reshape(-1)
        qg = q[tokens].view(len(seqs), r, hq, -1).transpose(1, 2)  # (B_g, Hq, r, Dqk)
        group_slopes = slopes[seqs] if slopes is not None and slopes.dim() == 2 else slopes
        o, lg = paged_attention_blocks(qg, k_pages, v_pages, table[seqs], used[seqs],
                                       k_descale=k_descale, v_descale=v_descale,
                                       return_lse=True, backend=backend,
                                       alibi_slopes=group_slopes, **kw)
        out[tokens] = o.transpose(1, 2).reshape(-1, hq, dv)
        lse[:, tokens] = lg.transpose(0, 1).reshape(hq, -1).float()
    return (out, lse) if return_lse else out


def _check_max(name: str, limit: Optional[int], lengths: Tensor) -> None:
    if limit is not None and lengths.numel() and int(lengths.max()) > limit:
        raise ValueError(f"{name}={limit} but a sequence has length {int(lengths.max())}")
