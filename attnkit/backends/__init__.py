"""Executor registry.

Each executor module declares ``NAME``, ``not_supported_reasons(spec) -> list[str]``,
``forward(spec, plan)`` and ``backward(spec, plan, out, lse, dout, dlse)``. Selection walks
:data:`PRIORITY`; a forced backend that cannot run a spec raises one ``NotImplementedError``
listing its reasons, never a silent fallback.
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, List

from ..spec import AttentionSpec
from . import fused, tiled

REGISTRY: Dict[str, ModuleType] = {tiled.NAME: tiled, fused.NAME: fused}
PRIORITY: List[str] = [fused.NAME, tiled.NAME]
BACKENDS = ("auto", *PRIORITY)


def select(spec: AttentionSpec, backend: str = "auto") -> ModuleType:
    """Pick the executor for ``spec``; ``backend`` forces one ("fused" or "tiled")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend != "auto":
        mod = REGISTRY[backend]
        reasons = mod.not_supported_reasons(spec)
        if reasons:
            raise NotImplementedError(
                f"backend={backend!r} cannot run this call: " + "; ".join(reasons)
                + ". Use backend='auto' to let attnkit choose.")
        return mod
    for name in PRIORITY:
        mod = REGISTRY[name]
        if not mod.not_supported_reasons(spec):
            return mod
    raise NotImplementedError("no executor can run this call: " + "; ".join(
        f"{n}: {', '.join(REGISTRY[n].not_supported_reasons(spec))}" for n in PRIORITY))


def explain(spec: AttentionSpec) -> Dict[str, List[str]]:
    """Each executor's reasons for not running ``spec`` (empty list = it can)."""
    return {name: REGISTRY[name].not_supported_reasons(spec) for name in PRIORITY}
