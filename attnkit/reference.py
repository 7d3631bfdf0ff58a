"""The dense float64 oracle: attention written out as plainly as possible.

Every test and the benchmark check attnkit against this. It materialises the full score matrix
(``(*B, Hq, Lq, Lk)`` in float64), so use it on small problems; torch autograd differentiates
it, which gives reference gradients for q, k, v, bias, sinks and tensors a score_mod captures.
It takes the same keywords as :func:`attnkit.attention` and returns float64 results.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

from .mods import call_mask_mod, call_score_mod
from .spec import AttentionSpec, _canonical_4d, build_spec


def visibility(spec: AttentionSpec) -> Tensor:
    """Dense bool (N, Hq, Lq, Lk): which (query, key) pairs may attend, all terms combined."""
    n, hq, lq, lk = spec.n, spec.hq, spec.lq, spec.lk
    dev = spec.q.device
    b = torch.arange(n, device=dev).view(n, 1, 1, 1)
    h = torch.arange(hq, device=dev).view(1, hq, 1, 1)
    i = torch.arange(lq, device=dev).view(1, 1, lq, 1)
    j = torch.arange(lk, device=dev).view(1, 1, 1, lk)
    vis = torch.ones(n, hq, lq, lk, dtype=torch.bool, device=dev)
    ip = spec.aligned_rows()
    if spec.left is not None:
        vis = vis & (j >= ip - spec.left)
    if spec.right is not None:
        vis = vis & (j <= ip + spec.right)
    if spec.mask is not None:
        vis = vis & spec.mask
    if spec.mask_mod is not None:
        vis = vis & call_mask_mod(spec.mask_mod, b, h, i, j)
    if spec.block_mask is not None:
        vis = vis & _block_mask_dense(spec, b, h, i, j)
    if spec.segments_q is not None:
        vis = vis & (spec.segments_q.view(1, 1, lq, 1) == spec.segments_kv.view(1, 1, 1, lk))
    if spec.seqlens_q is not None:
        vis = vis & (i < spec.seqlens_q.view(n, 1, 1, 1))
    if spec.seqlens_kv is not None:
        vis = vis & (j < spec.seqlens_kv.view(n, 1, 1, 1))
    return vis


def _block_mask_dense(spec: AttentionSpec, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    """A BlockMask's meaning: its mask_mod on listed blocks (partial or full), False elsewhere.
    Full blocks are visible without evaluating the mask_mod."""
    bm = spec.block_mask
    bq, bk = bm.BLOCK_SIZE
    kinds = bm.block_kinds()  # (B|1, H|1, nqb, nkb): 0 empty, 1 partial, 2 full
    dense_blocks, full_blocks = kinds > 0, kinds == 2

    def expand(blocks: Tensor) -> Tensor:
        x = blocks.repeat_interleave(bq, dim=-2).repeat_interleave(bk, dim=-1)
        return x[..., : spec.lq, : spec.lk]
    listed, full = expand(dense_blocks), expand(full_blocks)
    mod = call_mask_mod(bm.mask_mod, b, h, i, j) if bm.mask_mod is not None else torch.ones(
        (), dtype=torch.bool)
    return listed & (full | mod)


def scores(spec: AttentionSpec) -> Tensor:
    """Final float64 scores (N, Hq, Lq, Lk) before masking, following the spec's pipeline."""
    n, hq, lq, lk = spec.n, spec.hq, spec.lq, spec.lk
    q = spec.q.double()
    k = spec.k.double().repeat_interleave(spec.groups, dim=1)
    s = spec.scale * (q @ k.transpose(-1, -2))
    if spec.softcap is not None:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    if spec.bias is not None:
        s = s + spec.bias.double()
    dev = q.device
    b = torch.arange(n, device=dev).view(n, 1, 1, 1)
    h = torch.arange(hq, device=dev).view(1, hq, 1, 1)
    i = torch.arange(lq, device=dev).view(1, 1, lq, 1)
    j = torch.arange(lk, device=dev).view(1, 1, 1, lk)
    if spec.alibi_slopes is not None:
        slopes = spec.alibi_rows().double()
        s = s - slopes * (spec.aligned_rows() - j).abs()
    if spec.score_mod is not None:
        s = call_score_mod(spec.score_mod, s, b, h, i, j)
    return s


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, *, return_lse: bool = False,
    return_weights: bool = False, dropout_keep: Optional[Tensor] = None,
    dropout_p: float = 0.0, **options: Any,
) -> Union[Tensor, Tuple[Tensor, ...]]:
    """Dense float64 attention with the semantics of :func:`attnkit.attention`.

    ``dropout_keep`` (bool, broadcastable to the scores, True = keep) applies a given dropout
    keep mask with scaling ``1 / (1 - dropout_p)``. Returns ``out`` (float64), plus ``lse`` when
    ``return_lse`` and the pre-dropout weights when ``return_weights``.
    """
    spec = build_spec(q, k, v, **options)
    s = scores(spec)
    vis = visibility(spec)
    s = s.masked_fill(~vis, float("-inf"))
    if spec.sinks is not None:
        sink = spec.sinks.double().view(1, -1, 1, 1).expand(spec.n, -1, spec.lq, 1)
        s_all = torch.cat([s, sink], dim=-1)
    else:
        s_all = s
    lse = torch.logsumexp(s_all, dim=-1)
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    weights = p
    if dropout_keep is not None:
        keep = _canonical_4d("dropout_keep", dropout_keep, spec.batch_shape, spec.n,
                             (spec.hq, spec.lq, spec.lk))
        p = p * keep.to(p.dtype) * (1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0)
    vv = spec.v.double().repeat_interleave(spec.groups, dim=1)
    out = p @ vv
    out = out.reshape(spec.output_shape(spec.dv))
    results: Tuple[Tensor, ...] = (out,)
    if return_lse:
        results += (lse.reshape(spec.lse_shape()),)
    if return_weights:
        results += (weights.detach().reshape(spec.output_shape(spec.lk)),)
    return results[0] if len(results) == 1 else results
