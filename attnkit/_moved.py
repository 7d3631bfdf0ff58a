"""The import paths of the flat layout (attnkit 0.1), kept working.

attnkit 0.2 groups its modules into subpackages (:mod:`attnkit.doors`, :mod:`attnkit.terms`,
:mod:`attnkit.kv`, :mod:`attnkit.engine`). Each old path names the *same module object* as
its new one (``attnkit.masks is attnkit.terms.masks``), so ``import attnkit.api``,
``from attnkit.spec import Options``, ``monkeypatch.setattr("attnkit.api.X", ...)`` and
pickles of builtin mods made by 0.1 all keep working.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

#: old module name (under ``attnkit.``) -> where it lives now
MOVED = {
    "api": "doors.attention",
    "compiled": "doors.compiled",
    "distributed": "doors.ring",
    "errors": "doors.errors",
    "flex": "doors.flex",
    "varlen": "doors.varlen",
    "varlen_pages": "doors.varlen_pages",
    "autograd": "engine.autograd",
    "ops": "engine.ops",
    "plan": "engine.plan",
    "merge": "kv.merge",
    "paged": "kv.paged",
    "pages": "kv.pages",
    "block_mask": "terms.block_mask",
    "checks": "terms.checks",
    "dropout": "terms.dropout",
    "fp8": "terms.fp8",
    "masks": "terms.masks",
    "mods": "terms.mods",
    "score_mods": "terms.score_mods",
    "score_terms": "terms.score_terms",
    "spec": "terms.spec",
}


def install(package: ModuleType) -> None:
    """Make every old path an alias of its module: an entry in ``sys.modules`` and an
    attribute of the package (what ``from attnkit import api`` reads)."""
    for old, new in MOVED.items():
        module = importlib.import_module(f"{package.__name__}.{new}")
        sys.modules.setdefault(f"{package.__name__}.{old}", module)
        if not hasattr(package, old):
            setattr(package, old, module)
