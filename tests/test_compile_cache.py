"""torch's compile cache under ATEN_CPU_CAPABILITY (attnkit.engine.compile_cache): torch 2.13
reuses a graph compiled under another capability (a crashed process or NaN on an AVX-512
machine), so a process run under one gets a cache folder of its own."""

from __future__ import annotations

import os
import subprocess
import sys

from attnkit.engine.compile_cache import own_compile_cache


def test_a_capability_gets_a_folder_of_its_own() -> None:
    env = {"ATEN_CPU_CAPABILITY": " AVX2"}
    folder = own_compile_cache(env)
    assert folder is not None and env["TORCHINDUCTOR_CACHE_DIR"] == folder
    assert os.path.isabs(folder) and "avx2" in os.path.basename(folder)
    assert own_compile_cache({"ATEN_CPU_CAPABILITY": "avx2"}) == folder
    assert own_compile_cache({"ATEN_CPU_CAPABILITY": "default"}) not in (None, folder)


def test_a_folder_already_chosen_stands_and_no_capability_changes_nothing() -> None:
    chosen = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/somewhere"}
    assert own_compile_cache(chosen) is None and chosen["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere"
    for env in ({}, {"ATEN_CPU_CAPABILITY": " "}):
        assert own_compile_cache(env) is None and "TORCHINDUCTOR_CACHE_DIR" not in env


def _cache_after_import(capability: str | None) -> str:
    """TORCHINDUCTOR_CACHE_DIR in a fresh process after ``import attnkit`` and torch's
    compiler (which sets it to its default when it is still unset)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    code = "import os, attnkit, torch._dynamo; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_importing_attnkit_sets_it_before_torch_compiles() -> None:
    ours = _cache_after_import("avx2")
    assert ours == own_compile_cache({"ATEN_CPU_CAPABILITY": "avx2"})
    assert _cache_after_import(None) != ours  # torch's own default otherwise
