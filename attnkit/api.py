"""``attention``: the one entry point. Other front doors are thin layers over it."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

from torch import Tensor

from . import backends
from .autograd import run
from .spec import AttentionSpec, build_spec


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    mask: Any = None,
    bias: Optional[Tensor] = None,
    causal: bool = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    diagonal: str = "top_left",
    score_mod: Optional[Callable[..., Tensor]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    seqlens_q: Optional[Tensor] = None,
    seqlens_kv: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Scaled dot-product attention, ``softmax(scale * q k^T + bias, masked) v``.

    Shapes (read from the right; leading batch dims ``*B`` broadcast between q, k and v)::

        q     (*B, Hq,  Lq, Dqk)        2-D inputs (L, D) are one head
        k     (*B, Hkv, Lk, Dqk)        Hq must be a multiple of Hkv: query head h uses
        v     (*B, Hkv, Lk, Dv)         key/value head h // (Hq // Hkv) (grouped-query)
        out   (*B, Hq,  Lq, Dv)         in the input dtype
        lse   (*B, Hq,  Lq)             float32 (float64 for float64 inputs)

    Scores, in this order: ``s = scale * q.k`` (scale defaults to ``1/sqrt(Dqk)``); softcap
    ``cap * tanh(s / cap)``; ``+ bias``; ALiBi ``- slope[h] * |i' - j|``; ``score_mod(s, b, h,
    i, j)``; then every masked pair is set to ``-inf``.

    Masks (all combine with AND):

    - ``mask``: a bool tensor broadcastable to ``(*B, Hq, Lq, Lk)`` (True = may attend), a
      ``mask_mod(b, h, q_idx, kv_idx) -> bool`` callable, or a :class:`BlockMask`;
    - ``causal=True``: query i sees keys ``j <= i'``;
    - ``window=(left, right)``: query i sees keys ``i' - left <= j <= i' + right`` (``None`` on
      a side = unbounded);
    - ``seqlens_q`` / ``seqlens_kv`` ``(N,)``: padding; keys at or beyond ``seqlens_kv[b]`` are
      invisible and query rows at or beyond ``seqlens_q[b]`` give 0.

    ``i' = i`` for ``diagonal="top_left"`` and ``i' = i + Lk - Lq`` for ``"bottom_right"``
    (with seqlens, the actual lengths). Lq = 2, Lk = 5, causal::

        top_left:      1 0 0 0 0        bottom_right:   1 1 1 1 0
                       1 1 0 0 0                        1 1 1 1 1

    A row whose keys are all masked gives output 0, lse ``-inf`` and zero gradients. ``bias``
    (float, ``-inf`` allowed) gets a gradient summed back to its own shape; so do ``sinks``
    (``(Hq,)`` extra logits in each row's denominator) and tensors a ``score_mod`` captures.
    float16/bfloat16 inputs are computed in float32; float64 in float64.

    Args:
        backend: ``"auto"`` (default), or force ``"fused"`` / ``"tiled"``; a forced backend
            that cannot run the call raises ``NotImplementedError`` with its reasons.
        return_lse: also return the natural-log log-sum-exp of each row's final scores.
    """
    spec = build_spec(q, k, v, scale=scale, mask=mask, bias=bias, causal=causal, window=window,
                      diagonal=diagonal, score_mod=score_mod, softcap=softcap,
                      alibi_slopes=alibi_slopes, seqlens_q=seqlens_q, seqlens_kv=seqlens_kv,
                      sinks=sinks)
    out, lse, _ = _execute(spec, backend)
    if return_lse:
        return out, lse
    return out


def _execute(spec: AttentionSpec, backend: str = "auto") -> Tuple[Tensor, Tensor, Tensor]:
    """Run a spec and restore the user's shapes: (out, lse, max_scores)."""
    executor = backends.select(spec, backend)
    out, lse, mx = run(spec, executor)
    return (out.reshape(spec.output_shape(spec.dv)), lse.reshape(spec.lse_shape()),
            mx.reshape(spec.lse_shape()))
