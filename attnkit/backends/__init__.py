"""Executor registry.

Each executor module declares ``CAPS`` (:class:`~attnkit.backends.base.Capabilities`: the spec
features, dtypes, devices and sizes it runs), ``make_plan``, ``forward`` and ``backward``, and
optionally ``extra_reasons(spec)`` and ``auto_defers(spec)`` (True: it can run the call, but
``auto`` should try the next executor first, which this build runs faster; forcing it still
runs it) and ``replay(spec, bounds, grad)`` (a launcher for later calls of the same form,
which :func:`attnkit.attention` remembers; see the decode and flash executors). Selection walks
:data:`PRIORITY`; a forced backend that
cannot run a spec raises one ``NotImplementedError`` listing its reasons, never a silent
fallback. Adding an executor is its module and one line in :data:`REGISTRY`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, List, Optional

from ..spec import AttentionSpec
from . import decode, flash, fused, tiled, triton
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


def explain(spec: AttentionSpec) -> Dict[str, List[str]]:
    """Each executor's reasons for not running ``spec`` (empty list = it can)."""
    return {name: reasons(REGISTRY[name], spec) for name in PRIORITY}
