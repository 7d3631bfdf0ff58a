"""Merging partial attention states (split-KV, cascade / shared-prefix attention).

Attention over a set of keys can be computed in parts: split the keys into disjoint subsets,
attend to each subset separately, and keep for every query row the output ``o_i`` (normalised
over that subset only) and the natural-log log-sum-exp ``lse_i`` of that row's scores over the
subset. The parts merge exactly into attention over the union::

    lse = log(sum_i exp(lse_i))                   (logaddexp over the parts)
    o   = sum_i exp(lse_i - lse) * o_i

Shape legend::

    o_i    (..., L, Dv)   one partial output per query row
    lse_i  (..., L)       its log-sum-exp of scores (natural log); -inf for a part with no keys

A part whose ``lse_i`` is ``-inf`` (no open key for that row) contributes nothing, whatever its
``o_i`` holds (zeros, garbage, NaN). Where every part's ``lse_i`` is ``-inf`` the merged row is
``o = 0``, ``lse = -inf``, with finite (zero) gradients. Otherwise NaN in an input propagates.

The arithmetic runs in float32, or float64 if an output or lse is float64; ``o`` is returned in
the outputs' dtype and ``lse`` in that compute dtype. Everything is plain torch ops, so it is
differentiable with autograd.
"""

from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

__all__ = ["merge_state", "merge_states"]

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def _stack(name: str, parts: Tensors, same_dtype: bool) -> torch.Tensor:
    """Return ``parts`` stacked along a new dim 0 (a tensor is taken as already stacked).

    With ``same_dtype`` the parts must share a dtype; otherwise they are promoted to one.
    """
    if isinstance(parts, torch.Tensor):
        return parts
    if not isinstance(parts, (list, tuple)):
        raise TypeError(
            f"{name} must be a list of tensors or one tensor stacked along dim 0, "
            f"got {type(parts).__name__}."
        )
    if len(parts) == 0:
        raise ValueError(f"{name} is empty; pass at least one partial state to merge.")
    for i, t in enumerate(parts):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}.")
        if t.shape != parts[0].shape:
            raise ValueError(
                f"{name}[{i}] has shape {tuple(t.shape)} but {name}[0] has "
                f"{tuple(parts[0].shape)}; every partial must have the same shape."
            )
        if same_dtype and t.dtype != parts[0].dtype:
            raise TypeError(
                f"{name}[{i}] has dtype {t.dtype} but {name}[0] has {parts[0].dtype}; "
                f"cast the partials to one dtype."
            )
    dtype = parts[0].dtype
    for t in parts:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.stack([t.to(dtype) for t in parts], dim=0)


def _check_floating(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{name} has dtype {t.dtype}; merging needs floating-point tensors.")


def _check_stacked(o: torch.Tensor, lse: torch.Tensor, o_name: str, lse_name: str) -> None:
    """Check stacked ``o`` (N, ..., L, Dv) against stacked ``lse`` (N, ..., L)."""
    _check_floating(o_name, o)
    _check_floating(lse_name, lse)
    if o.dim() < 3:
        raise ValueError(
            f"{o_name} stacked must have at least 3 dims (N, ..., L, Dv), got shape "
            f"{tuple(o.shape)}. Each partial output is (..., L, Dv)."
        )
    if tuple(lse.shape) != tuple(o.shape[:-1]):
        raise ValueError(
            f"{lse_name} has shape {tuple(lse.shape)} but must be {tuple(o.shape[:-1])}: the "
            f"shape of {o_name} {tuple(o.shape)} without its last (Dv) dim, one log-sum-exp "
            f"per query row."
        )


def _merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The merge over dim 0, safe for ``-inf`` parts in both forward and backward."""
    wide = o.dtype == torch.float64 or lse.dtype == torch.float64
    ct = torch.float64 if wide else torch.float32
    lse_c = lse.to(ct)
    # The shift only needs to be a constant: detaching it keeps the gradient exact (it cancels
    # mathematically) and keeps amax's tie handling out of autograd.
    top = lse_c.detach().amax(dim=0)
    empty = top == float("-inf")  # every part has no keys for this row
    top = torch.where(empty, torch.zeros_like(top), top)
    w = torch.exp(lse_c - top)  # exp(-inf) = 0 for empty parts; the top part gives 1
    total = w.sum(dim=0)
    total = torch.where(empty, torch.ones_like(total), total)  # no log(0), no 0/0
    lse_out = torch.where(empty, torch.full_like(total, float("-inf")), top + torch.log(total))
    part_empty = (lse_c == float("-inf")).unsqueeze(-1)
    o_c = torch.where(part_empty, torch.zeros((), dtype=ct, device=o.device), o.to(ct))
    o_out = ((w / total).unsqueeze(-1) * o_c).sum(dim=0)
    return o_out.to(o.dtype), lse_out


def merge_states(outputs: Tensors, lses: Tensors) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial attention states into the attention over all their keys.

    Args:
        outputs: a list of N tensors ``(..., L, Dv)``, or one tensor ``(N, ..., L, Dv)``
            stacked along dim 0. Each is attention normalised over its own key subset.
        lses: matching log-sum-exps (natural log) of each part's row scores: a list of N
            tensors ``(..., L)`` or one ``(N, ..., L)`` tensor. ``-inf`` marks a row that saw
            no keys in that part.

    Returns:
        ``(o, lse)``: ``o`` ``(..., L, Dv)`` in the outputs' dtype and ``lse`` ``(..., L)`` in
        float32 (float64 if an input is float64). Rows where every part is ``-inf`` give
        ``o = 0`` and ``lse = -inf``.

    Example: cascade attention over a shared prefix. Many requests share a prompt prefix, so
    its keys are attended once per query block and merged with each request's own suffix::

        >>> import torch
        >>> from attnkit.merge import merge_states
        >>> def partial(q, k, v):  # dense attention over one key subset, with its lse
        ...     s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        ...     return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)
        >>> g = torch.Generator().manual_seed(0)
        >>> q = torch.randn(4, 8, generator=g, dtype=torch.float64)         # 4 query rows
        >>> k_prefix, v_prefix = torch.randn(2, 16, 8, generator=g, dtype=torch.float64)
        >>> k_suffix, v_suffix = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
        >>> o_pre, lse_pre = partial(q, k_prefix, v_prefix)   # shared: computed once
        >>> o_suf, lse_suf = partial(q, k_suffix, v_suffix)   # per request
        >>> o, lse = merge_states([o_pre, o_suf], [lse_pre, lse_suf])
        >>> o_full, lse_full = partial(q, torch.cat([k_prefix, k_suffix]),
        ...                            torch.cat([v_prefix, v_suffix]))
        >>> torch.allclose(o, o_full) and torch.allclose(lse, lse_full)
        True

    Raises:
        TypeError: non-tensor or non-floating inputs, partials of different dtypes.
        ValueError: an empty list, partials of different shapes, lses whose shape is not the
            outputs' shape without the last dim, or a different number of outputs and lses.
    """
    o = _stack("outputs", outputs, same_dtype=True)
    lse = _stack("lses", lses, same_dtype=False)
    if o.dim() >= 1 and lse.dim() >= 1 and o.shape[0] != lse.shape[0]:
        raise ValueError(
            f"outputs has {o.shape[0]} partial states but lses has {lse.shape[0]} (dim 0); "
            f"pass one lse per output."
        )
    if o.dim() >= 1 and o.shape[0] == 0:
        raise ValueError("outputs is empty; pass at least one partial state to merge.")
    _check_stacked(o, lse, "outputs", "lses")
    return _merge_stacked(o, lse)


def merge_state(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states (attention over two disjoint key subsets).

    ``lse = logaddexp(lse1, lse2)`` and ``o = exp(lse1 - lse) * o1 + exp(lse2 - lse) * o2``,
    computed safely (see :func:`merge_states`, which this is the N = 2 case of).

    Args:
        o1, o2: partial outputs ``(..., L, Dv)``, same shape and dtype.
        lse1, lse2: their log-sum-exps ``(..., L)``; ``-inf`` where a part saw no keys.

    Returns:
        ``(o, lse)`` as in :func:`merge_states`.
    """
    for name, t in (("o1", o1), ("lse1", lse1), ("o2", o2), ("lse2", lse2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        _check_floating(name, t)
    if o1.shape != o2.shape:
        raise ValueError(
            f"o1 has shape {tuple(o1.shape)} but o2 has {tuple(o2.shape)}; the two partial "
            f"outputs must have the same shape (..., L, Dv)."
        )
    if o1.dtype != o2.dtype:
        raise TypeError(f"o1 has dtype {o1.dtype} but o2 has {o2.dtype}; cast them to one dtype.")
    if o1.dim() < 2:
        raise ValueError(f"o1 must have at least 2 dims (..., L, Dv), got shape {tuple(o1.shape)}.")
    for name, t in (("lse1", lse1), ("lse2", lse2)):
        if tuple(t.shape) != tuple(o1.shape[:-1]):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but must be {tuple(o1.shape[:-1])}: the "
                f"outputs' shape {tuple(o1.shape)} without the last (Dv) dim."
            )
    lse_dtype = torch.promote_types(lse1.dtype, lse2.dtype)
    lse = torch.stack([lse1.to(lse_dtype), lse2.to(lse_dtype)])
    return _merge_stacked(torch.stack([o1, o2]), lse)
