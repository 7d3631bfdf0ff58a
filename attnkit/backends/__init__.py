"""Executor registry.

Each executor module declares ``CAPS`` (:class:`~attnkit.backends.base.Capabilities`: the spec
features, dtypes, devices and sizes it runs), ``make_plan``, ``forward`` and ``backward``, and
optionally ``extra_reasons(spec)`` and ``auto_defers(spec)`` (True: it can run the call, but
``auto`` should try the next executor first, which the measured cost table,
:mod:`attnkit.backends.costs`, says runs it faster on this kind of CPU; forcing it still
runs it) and ``replay(spec, bounds, grad)`` (a launcher for later calls of the same form,
which :func:`attnkit.attention` remembers; see the decode and flash executors). Selection walks
:data:`PRIORITY`; a forced backend that
cannot run a spec raises one ``NotImplementedError`` listing its reasons, never a silent
fallback. Adding an executor is its module and one line in :data:`REGISTRY`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, List, Optional

from torch import Tensor

from ..terms.spec import AttentionSpec
from . import costs, decode, flash, fused, tiled, triton
from .base import not_supported_reasons

#: Executors by name, in the order ``backend="auto"`` tries them.
REGISTRY: Dict[str, ModuleType] = {mod.CAPS.name: mod for mod in (triton, decode, flash, fused,
                                                                  tiled)}
PRIORITY: List[str] = list(REGISTRY)
BACKENDS = ("auto", *PRIORITY)


def reasons(executor: ModuleType, spec: AttentionSpec) -> List[str]:
    """Why ``executor`` cannot run ``spec`` (empty when it can)."""
    return not_supported_reasons(executor, spec)


def choose(spec: AttentionSpec, backend: str = "auto") -> Optional[ModuleType]:
    """The executor for ``spec``, or None when none can run it (``backend`` forces one: a
    forced executor that cannot run the spec raises ``NotImplementedError`` with its
    reasons)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend != "auto":
        mod = REGISTRY[backend]
        why = reasons(mod, spec)
        if why:
            raise NotImplementedError(f"backend={backend!r} cannot run this call: "
                                      + "; ".join(why) + ". Use backend='auto' to let attnkit "
                                      "choose.")
        return mod
    device = spec.q.device.type
    deferred = None  # an executor that ran the call but let a later one go first
    for name in PRIORITY:
        auto_devices = REGISTRY[name].CAPS.auto_devices
        if auto_devices is not None and device not in auto_devices:
            continue
        if not reasons(REGISTRY[name], spec):
            defers = getattr(REGISTRY[name], "auto_defers", None)
            if deferred is None and defers is not None and defers(spec):
                deferred = REGISTRY[name]
                continue
            return REGISTRY[name]
    return deferred


def select(spec: AttentionSpec, backend: str = "auto") -> ModuleType:
    """Pick the executor for ``spec``; ``backend`` forces one (see :data:`BACKENDS`)."""
    mod = choose(spec, backend)
    if mod is None:
        raise NotImplementedError("no executor can run this call: " + "; ".join(
            f"{name}: {', '.join(why)}" for name, why in explain(spec).items()))
    return mod


def with_extra(extra: str, spec: AttentionSpec, backend: str = "auto") -> ModuleType:
    """The executor for ``spec`` that runs ``extra`` (one of the
    :attr:`~attnkit.backends.base.Capabilities.extras`, e.g. ``"dp_scale"``): the first
    executor that declares it and can run the spec, or the forced one, which must declare it
    (``NotImplementedError`` with the executors that do otherwise)."""
    having = [name for name in PRIORITY if extra in REGISTRY[name].CAPS.extras]
    if backend != "auto" and backend in REGISTRY and backend not in having:
        raise NotImplementedError(f"backend={backend!r} does not run {extra}; "
                                  f"{' or '.join(having) or 'no executor'} does: pass "
                                  f"backend='auto' (or one of them)")
    for name in having if backend == "auto" else [backend]:
        if not reasons(REGISTRY[name], spec):
            return REGISTRY[name]
    return select(spec, having[0] if backend == "auto" and having else backend)


def most_query_rows(feature: str) -> Optional[int]:
    """The most query rows any executor that runs ``feature`` takes (None: no bound, or no
    executor runs it): a cheap test before a spec is built for it."""
    bounds = [REGISTRY[name].CAPS.max_query_rows for name in PRIORITY
              if feature in REGISTRY[name].CAPS.features]
    return None if not bounds or None in bounds else max(b for b in bounds if b is not None)


def dense_probabilities(spec: AttentionSpec, lse: Tensor) -> Tensor:
    """The pre-dropout softmax weights ``exp(S - lse)`` of ``spec``, dense ``(N, Hq, Lq,
    Lk)`` (for ``return_weights``)."""
    return tiled.dense_probabilities(spec, lse)


def dp_amax(spec: AttentionSpec, dout: Tensor) -> Tensor:
    """max ``|dO_i . v_j|`` over the pairs ``spec``'s masks let through (cuDNN's amax_dP)."""
    return tiled.dp_amax(spec, dout)


def explain(spec: AttentionSpec) -> Dict[str, List[str]]:
    """Each executor's reasons for not running ``spec`` (empty list = it can)."""
    return {name: reasons(REGISTRY[name], spec) for name in PRIORITY}


def explain_choice(spec: AttentionSpec) -> str:
    """Which executor ``backend="auto"`` picks for ``spec`` and why, in words: each executor
    tried before it with its reasons (or the cost table's figures where it ran the call but
    left it to a faster one), and for the flash / fused choice the cost table's figures."""
    chosen = choose(spec)
    lines = [f"auto picks {chosen.CAPS.name if chosen is not None else 'no executor'}"]
    device = spec.q.device.type
    for name in PRIORITY:
        mod = REGISTRY[name]
        if mod is chosen:
            if name == "flash" and not reasons(fused, spec) and costs.call_form(spec):
                lines.append(f"flash: chosen over fused: {costs.prefer(spec)[1]}")
            break
        auto_devices = mod.CAPS.auto_devices
        if auto_devices is not None and device not in auto_devices:
            lines.append(f"{name}: only when forced on {device}")
            continue
        why = reasons(mod, spec)
        if why:
            lines.append(f"{name}: " + "; ".join(why))
        else:
            detail = costs.prefer(spec)[1] if name == "flash" else "faster executor next"
            lines.append(f"{name}: runs it, but leaves it to the next: {detail}")
    return "\n".join(lines)
