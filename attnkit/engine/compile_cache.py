"""torch's compile cache under ``ATEN_CPU_CAPABILITY``: a folder of its own per capability.

torch's compile cache (``TORCHINDUCTOR_CACHE_DIR``; by default one folder for all of a user's
processes) does not tell a graph compiled under one ``ATEN_CPU_CAPABILITY`` from the same graph
compiled under another. With torch 2.13 on an AVX-512 machine, a graph compiled under ``avx2``
and then reused without it crashed the process (heap corruption), and the reverse returned
NaN. Standing in for an AVX2 CPU this way is how the docs' AVX2 benchmark pages and cost rows
are measured. So importing this module, the first thing :mod:`attnkit` imports (before torch's
compiler, which reads the variable when it is imported, and sets it), calls
:func:`own_compile_cache`: where the capability is set and no cache folder is, the folder
becomes ``<temp dir>/attnkit-inductor-<capability>-<user id>``. A folder the user set stands;
so does one torch set because its compiler was imported before attnkit.

Standard library only: it runs before torch is imported.
"""

from __future__ import annotations

import os
import tempfile
from typing import MutableMapping, Optional


def own_compile_cache(environ: MutableMapping[str, str]) -> Optional[str]:
    """Point ``TORCHINDUCTOR_CACHE_DIR`` in ``environ`` at a folder of the process's
    ``ATEN_CPU_CAPABILITY`` (see the module docstring); returns that folder, or None where
    ``environ`` was left alone (no capability, or a cache folder already set)."""
    capability = environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not capability or environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    user = os.getuid() if hasattr(os, "getuid") else environ.get("USERNAME", "user")
    safe = "".join(c if c.isalnum() else "_" for c in capability)
    folder = os.path.join(tempfile.gettempdir(), f"attnkit-inductor-{safe}-{user}")
    environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


own_compile_cache(os.environ)
