"""The wheel's build step: the native kernels, prebuilt for the x86-64 levels that matter.

Everything else about the package is in pyproject.toml. ``build_py`` compiles
attnkit/native's sources once per variant of ``attnkit/native/build.py`` (AVX2, AVX-512,
AVX-512 with BF16 and VBMI, and with FP16 too) into ``attnkit/native/_prebuilt/`` of the
build; at run time the loader takes the best variant the CPU reports. Off Linux x86-64 or
without a C compiler it builds none, and the wheel is the pure-Python one (the kernels then
build at first use). ``ATTNKIT_WHEEL_KERNELS`` chooses the variants: ``all`` (the default),
``none``, or a comma-separated list such as ``avx2,avx512bf16``. An editable install builds
none (its kernels build at first use from the sources being edited).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _native_build():
    """attnkit/native/build.py, loaded by path: importing attnkit would import torch, which a
    wheel's build environment need not have."""
    path = HERE / "attnkit" / "native" / "build.py"
    spec = importlib.util.spec_from_file_location("_attnkit_native_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    """build_py, then the prebuilt native kernels into the build's attnkit/native/_prebuilt."""

    def run(self) -> None:
        super().run()
        self.prebuilt: list = []
        if self.editable_mode:
            return
        native = _native_build()
        variants = native.parse_variant_names(os.environ.get("ATTNKIT_WHEEL_KERNELS", "all"))
        out = Path(self.build_lib) / "attnkit" / "native" / "_prebuilt"
        self.prebuilt = native.build_prebuilt(out, variants, log=self.announce_info)

    def announce_info(self, message: str) -> None:
        self.announce(message, level=logging.INFO)


class PlatformWheel(bdist_wheel):
    """A wheel with prebuilt kernels is tagged for its platform (``py3-none-linux_x86_64``:
    the libraries are loaded with ctypes and do not depend on the Python version); without
    them it is the pure ``py3-none-any`` one."""

    def run(self) -> None:
        if not self.skip_build:
            self.run_command("build")  # first, to know whether kernels were built
        if getattr(self.get_finalized_command("build_py"), "prebuilt", []):
            self.root_is_pure = False
            # and install puts the package at the wheel's root (platlib), as for an extension
            self.distribution.has_ext_modules = lambda: True
        super().run()

    def get_tag(self) -> tuple:
        impl, abi, plat = super().get_tag()
        return ("py3", "none", plat) if not self.root_is_pure else (impl, abi, plat)


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
