"""What a built wheel and sdist ship (every file the native build reads, the license), that the
native kernels build from an unpacked wheel, and the package surface a fresh interpreter sees.

The builds run on a copy of the tree (no build/ output in the checkout), without build isolation
(the installed setuptools), a few seconds each."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from attnkit import native

ROOT = Path(__file__).resolve().parents[1]
NATIVE_DIR = ROOT / "attnkit" / "native"
# What attnkit/native/__init__.py compiles and hashes: every one must be in the package.
BUILD_FILES = sorted(f"attnkit/native/{p.name}" for p in native._SOURCES + native._HEADERS)


def _setuptools_or_skip() -> None:
    setuptools = pytest.importorskip("setuptools", reason="building a wheel needs setuptools")
    major = int(re.match(r"\d+", setuptools.__version__).group())  # type: ignore[union-attr]
    if major < 77:  # pyproject.toml's build requirement (SPDX license, license-files)
        pytest.skip(f"setuptools {setuptools.__version__} < 77 cannot build this project")


def _copy_tree(dst: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".ruff_cache", ".benchmarks", "*.so")
    shutil.copytree(ROOT, dst, ignore=ignore)
    return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    _setuptools_or_skip()
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_tree(tmp / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (built,) = (tmp / "dist").glob("attnkit-*.whl")
    return built


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    _setuptools_or_skip()
    tmp = tmp_path_factory.mktemp("sdist")
    src = _copy_tree(tmp / "src")
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp / "dist")], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return tmp / "dist" / proc.stdout.strip().splitlines()[-1]


def test_build_lists_cover_the_native_sources() -> None:
    """_SOURCES and _HEADERS name every C file of attnkit/native and every local #include."""
    on_disk = sorted(f"attnkit/native/{p.name}" for p in NATIVE_DIR.iterdir()
                     if p.suffix in (".c", ".h"))
    assert on_disk == BUILD_FILES
    headers = {p.name for p in native._HEADERS}
    for src in native._SOURCES + native._HEADERS:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', src.read_text(), re.M):
            assert name in headers, f"{src.name} includes {name}, which _HEADERS lacks"


def test_wheel_ships_every_native_build_file_and_the_license(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in BUILD_FILES if f not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "License-Expression: Apache-2.0" in text


def test_sdist_ships_every_native_build_file_and_the_license(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = [f for f in BUILD_FILES if f not in names]
    assert not missing, f"{sdist.name} lacks {missing}"
    assert "LICENSE" in names


def test_native_kernels_build_from_the_unpacked_wheel(wheel: Path, tmp_path: Path) -> None:
    """Outside the checkout, with an empty kernel cache, the wheel's own files compile."""
    if not (os.environ.get("CC") or any(shutil.which(c) for c in ("cc", "gcc", "clang"))):
        pytest.skip("no C compiler: the native kernels cannot be built here")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "ATTNKIT_NATIVE"}
    env.update(PYTHONPATH=str(site), ATTNKIT_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import attnkit, attnkit.native as n; print(attnkit.__file__); "
            "print(n.available()); print(n.unavailable_reason())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, ok, reason = proc.stdout.strip().splitlines()[-3:]
    assert Path(where).resolve().is_relative_to(site.resolve()), where
    assert ok == "True", reason


def test_fresh_interpreter_sees_numpy_submodule_and_out_of_pages_error() -> None:
    """``import attnkit`` alone makes ``attnkit.numpy`` (the README's front door) reachable."""
    code = ("import sys, attnkit; assert 'attnkit.numpy' in sys.modules; "
            "print(attnkit.numpy.sdpa_forward.__name__); "
            "from attnkit.paged import OutOfPagesError; "
            "print(attnkit.OutOfPagesError is OutOfPagesError, "
            "'OutOfPagesError' in attnkit.__all__, 'numpy' in attnkit.__all__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["sdpa_forward", "True", "True", "True"]
