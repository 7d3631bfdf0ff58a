"""What every executor shares: its result types, the protocol it implements and the
capabilities it declares as data.

An executor is a module with ``CAPS`` (a :class:`Capabilities`), ``make_plan(spec)``,
``forward(spec, plan) -> ForwardResult`` and ``backward(spec, plan, out, lse, dout, dlse) ->
Grads``, and optionally ``extra_reasons(spec)`` for conditions that are not plain data (a torch
version, a kernel that could not be built). :func:`not_supported_reasons` compares a spec with
the capabilities: every feature the spec uses that the executor does not declare is a reason,
so a feature added to the spec later is refused until an executor says it runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, FrozenSet, List, Mapping, Optional, Protocol, Tuple

import torch
from torch import Tensor

from ..terms.spec import AttentionSpec


@dataclass
class ForwardResult:
    out: Tensor  # (N, Hq, Lq, Dv) compute dtype (or the input dtype)
    lse: Tensor  # (N, Hq, Lq) compute dtype
    max_scores: Tensor  # (N, Hq, Lq) compute dtype, -inf for rows with no visible key


@dataclass
class Grads:
    dq: Tensor
    dk: Tensor
    dv: Tensor
    dbias: Optional[Tensor]
    dsinks: Optional[Tensor]
    dparams: Tuple[Optional[Tensor], ...]


@dataclass(frozen=True)
class Capabilities:
    """What an executor runs, as data."""

    name: str
    features: FrozenSet[str]
    dtypes: FrozenSet[torch.dtype]
    devices: FrozenSet[str]
    max_head_dim: Optional[int] = None
    head_dim_multiple: int = 1
    #: runs Dqk = 0 (an empty q.k: every score 0 before the score terms) and Dv = 0 (an
    #: empty output); an executor that does not say so is never given them
    empty_head_dims: bool = False
    max_query_rows: Optional[int] = None  # Lq
    max_rows_per_kv_head: Optional[int] = None  # Lq * Hq / Hkv
    #: the largest head dim max_rows_per_kv_head holds for (None: every head dim)
    max_rows_head_dim: Optional[int] = None
    #: the devices ``backend="auto"`` picks it for (None: all of ``devices``); the others
    #: only when it is forced
    auto_devices: Optional[FrozenSet[str]] = None
    #: why a feature is not supported, for the error (feature -> reason)
    why: Mapping[str, str] = field(default_factory=dict)
    #: what it runs beyond the spec's features: ``"dp_scale"`` (dP rounded to fp8 inside the
    #: backward, :func:`attnkit.attention_backward`), ``"differentiable_backward"`` (its
    #: backward is torch ops that are themselves differentiable: ``create_graph=True``)
    extras: FrozenSet[str] = frozenset()
    #: the executors it hands a call's remaining work to, in order (the first that runs the
    #: spec), and for what (``fallback_for``): explicit data, not the registry's order
    fallback: Tuple[str, ...] = ()
    fallback_for: str = ""


class Executor(Protocol):
    CAPS: Capabilities

    def make_plan(self, spec: AttentionSpec) -> Any: ...

    def forward(self, spec: AttentionSpec, plan: Any) -> ForwardResult: ...

    def backward(self, spec: AttentionSpec, plan: Any, out: Tensor, lse: Tensor, dout: Tensor,
                 dlse: Optional[Tensor] = None) -> Grads: ...


def not_supported_reasons(executor: Any, spec: AttentionSpec) -> List[str]:
    """Why ``executor`` cannot run ``spec`` (empty when it can): its capabilities against the
    spec's features, dtype, device and sizes, then its own ``extra_reasons``."""
    caps: Capabilities = executor.CAPS
    reasons = []
    for feature in sorted(spec.features() - caps.features):
        why = caps.why.get(feature)
        reasons.append(f"{caps.name} does not run {feature}" + (f" ({why})" if why else ""))
    if spec.q.dtype not in caps.dtypes:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in caps.dtypes))
        reasons.append(f"{caps.name} runs {names}; got {str(spec.q.dtype).replace('torch.', '')}")
    if spec.q.device.type not in caps.devices:
        reasons.append(f"{caps.name} runs on {', '.join(sorted(caps.devices))}; inputs are on "
                       f"{spec.q.device}")
    dims = (spec.dqk, spec.dv)
    if not caps.empty_head_dims and 0 in dims:
        reasons.append(f"{caps.name} needs head dims of at least 1; got Dqk={spec.dqk}, "
                       f"Dv={spec.dv}")
    if caps.max_head_dim is not None and max(dims) > caps.max_head_dim:
        reasons.append(f"{caps.name} runs head dims up to {caps.max_head_dim}; got Dqk="
                       f"{spec.dqk}, Dv={spec.dv}")
    if caps.head_dim_multiple > 1 and any(x % caps.head_dim_multiple for x in dims):
        reasons.append(f"{caps.name} needs head dims that are multiples of "
                       f"{caps.head_dim_multiple}; got Dqk={spec.dqk}, Dv={spec.dv}")
    if caps.max_query_rows is not None and spec.lq > caps.max_query_rows:
        reasons.append(f"{caps.name} is for decoding (Lq <= {caps.max_query_rows}); Lq="
                       f"{spec.lq} is matmul work")
    if (caps.max_rows_per_kv_head is not None
            and spec.lq * spec.groups > caps.max_rows_per_kv_head
            and (caps.max_rows_head_dim is None or max(dims) <= caps.max_rows_head_dim)):
        reasons.append(f"{caps.name} runs up to {caps.max_rows_per_kv_head} query rows per "
                       f"key/value head; got {spec.lq * spec.groups}")
    extra: Optional[Callable[[AttentionSpec], List[str]]] = getattr(executor, "extra_reasons",
                                                                    None)
    if extra is not None:
        reasons += extra(spec)
    return reasons
