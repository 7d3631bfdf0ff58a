"""Executor on torch's fused CPU flash kernel (filled in by the planner work; see tiled.py)."""

from __future__ import annotations

from typing import List

from ..spec import AttentionSpec

NAME = "fused"


def not_supported_reasons(spec: AttentionSpec) -> List[str]:
    return ["the fused CPU executor is not built yet"]
