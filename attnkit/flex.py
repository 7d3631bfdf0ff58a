"""``flex_attention``: torch FlexAttention's interface, with a backward and no compile step."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor

from .api import AuxOutput, AuxRequest, attention


def flex_attention(query: Tensor, key: Tensor, value: Tensor,
                   score_mod: Optional[Callable[..., Tensor]] = None, block_mask: Any = None,
                   scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: Optional[dict] = None, *,
                   return_aux: Any = None) -> Any:
    """FlexAttention with torch's semantics: ``score_mod(score, b, h, q_idx, kv_idx)`` on the
    scaled scores, ``block_mask`` from :func:`attnkit.create_block_mask` (or torch's own
    BlockMask), GQA only with ``enable_gqa=True``.

    Shapes: query ``(B, Hq, L, E)``, key ``(B, Hkv, S, E)``, value ``(B, Hkv, S, Ev)`` -> out
    ``(B, Hq, L, Ev)``; lse and max_scores ``(B, Hq, L)``. ``return_aux=AuxRequest(lse=True,
    max_scores=True)`` returns ``(out, AuxOutput)``; ``max_scores`` is each row's largest final
    score (after score_mod, masked entries excluded; ``-inf`` for a fully masked row).
    ``kernel_options`` may hold ``{"backend": "auto" | "fused" | "tiled"}``; other keys are
    accepted for compatibility and ignored (there is nothing to tune or compile).
    Unlike torch on CPU, this runs eagerly without materialising the scores and has a backward.
    The output is laid out in the query's stride order, as torch's (:func:`attnkit.attention`
    returns a contiguous output).
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"flex_attention takes 4-D (B, H, L, E) inputs; got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}")
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"query has {query.shape[1]} heads and key has {key.shape[1]}; pass "
                         f"enable_gqa=True for grouped-query attention")
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None; got "
                        f"{type(kernel_options).__name__}")
    backend = (kernel_options or {}).get("backend", "auto")
    if block_mask is not None and not hasattr(block_mask, "kv_blocks_for"):
        from .block_mask import BlockMask

        block_mask = BlockMask.from_torch(block_mask)
    request = None
    if return_aux is not None:
        request = AuxRequest(lse=bool(getattr(return_aux, "lse", False)),
                             max_scores=bool(getattr(return_aux, "max_scores", False)))
    elif return_lse:
        request = AuxRequest(lse=True)
    if request is None:
        return _like_query(attention(query, key, value, scale=scale, mask=block_mask,
                                     score_mod=score_mod, backend=backend), query)
    out, aux = attention(query, key, value, scale=scale, mask=block_mask, score_mod=score_mod,
                         return_aux=request, backend=backend)
    out = _like_query(out, query)
    if return_aux is None:
        return out, aux.lse
    return out, AuxOutput(lse=aux.lse, max_scores=aux.max_scores)


def _like_query(out: Tensor, query: Tensor) -> Tensor:
    """``out`` laid out in ``query``'s stride order, as torch's FlexAttention returns it (a
    ``(B, L, H, E)`` buffer viewed as ``(B, H, L, E)`` gives an output of that layout too)."""
    if query.is_contiguous():
        return out
    order = sorted(range(4), key=lambda d: (-query.stride(d), d))  # outermost first
    inverse = sorted(range(4), key=lambda d: order[d])
    return out.permute(order).contiguous().permute(inverse)
