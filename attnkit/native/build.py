"""How attnkit's native kernels are built: the sources, the compiler flags, the x86-64 variants
that a wheel carries prebuilt, and the pure function that picks the variant for a CPU.

The loader (:mod:`attnkit.native`) compiles :data:`SOURCES` at first use with ``-march=native``
where no prebuilt variant is used; ``setup.py`` compiles them once per :data:`VARIANTS` entry
when a wheel is built (:func:`build_prebuilt`), into ``attnkit/native/_prebuilt/`` with a
``manifest.json`` that names each library, its variant, its flags and the sources it was built
from. Both use the same flags (:data:`FLAGS`, ``-fopenmp`` where the compiler has OpenMP).

The variants, best first (each needs what the one below it needs, plus its own features; the
needs are ``/proc/cpuinfo`` flag names, the features the compiler may use under its flags)::

    avx512fp16  x86-64-v4 + AVX512-BF16, AVX512-VBMI, AVX512-FP16   Sapphire Rapids and later
    avx512bf16  x86-64-v4 + AVX512-BF16, AVX512-VBMI                Zen 4, Zen 5
    avx512      x86-64-v4 (AVX-512 F, BW, CD, DQ, VL)               Skylake-SP to Ice Lake
    avx2        x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE)   Haswell, Zen 1-3

These are the instruction sets the sources test (``__AVX2__``, ``__FMA__``, ``__F16C__``,
``__AVX512F__``, ``__AVX512BF16__``, ``__AVX512VBMI__``, ``__AVX512FP16__``); AMX is not used.

This module imports only the standard library: ``setup.py`` loads it by path, where torch
(and so attnkit) may not be importable.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

__all__ = ["SOURCES", "HEADERS", "FLAGS", "OPENMP", "LIBS", "Variant", "VARIANTS",
           "PREBUILT_DIR", "MANIFEST", "compiler", "compile_command", "source_digest",
           "cpu_flags", "choose_variant", "no_variant_reason", "parse_variant_names",
           "prebuilt_unsupported_reason", "build_prebuilt"]

HERE = Path(__file__).parent
#: every C file compiled into the one library (``tests/test_packaging.py`` checks that this
#: names every ``.c`` file of this folder) and every header they include
SOURCES = tuple(HERE / name for name in (
    "decode.c", "philox.c", "softcap.c", "terms.c", "flash.c", "pool.c", "peak.c", "abi.c"))
#: attnkit.h: the interface the loader reads (every exported function, shared struct,
#: constant and error code; see its top)
HEADERS = tuple(HERE / name for name in ("attnkit.h", "simd.h", "vecmath.h", "pool.h", "fp8.h"))
#: the flags of every build, prebuilt or built here; the instruction set comes on top
FLAGS = ("-O3", "-std=gnu11", "-fopenmp-simd", "-fPIC", "-shared")
#: the flash kernel may run on torch's OpenMP threads (pool.c's ak_team_run); a build without
#: it (a compiler that lacks OpenMP, a machine without libgomp) runs on attnkit's own pool
OPENMP = ("-fopenmp",)
LIBS = ("-lm", "-lpthread")
#: the folder of the prebuilt libraries inside the installed package, and their list
PREBUILT_DIR = HERE / "_prebuilt"
MANIFEST = "manifest.json"

_X86_64 = ("x86_64", "amd64")
_V3 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3",  # x86-64-v2
                 "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    """One prebuilt build of the kernels: its compiler flags and the CPU features it needs.

    ``needs`` holds ``/proc/cpuinfo`` flag names: every feature the compiler may use under
    ``flags`` (so the library runs on any CPU that reports them all). ``avx512`` says the
    variant uses AVX-512 (``ATTNKIT_NATIVE_AVX512=0`` rules those out)."""

    name: str
    flags: Tuple[str, ...]
    needs: FrozenSet[str]
    avx512: bool
    cpus: str


#: best first: the loader takes the first whose needs this CPU meets
VARIANTS: Tuple[Variant, ...] = (
    Variant("avx512fp16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vbmi", "-mavx512fp16"),
            _V4 | {"avx512_bf16", "avx512vbmi", "avx512_fp16"}, True,
            "Intel Sapphire Rapids and later"),
    Variant("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vbmi"),
            _V4 | {"avx512_bf16", "avx512vbmi"}, True, "AMD Zen 4 and Zen 5"),
    Variant("avx512", ("-march=x86-64-v4",), _V4, True, "Intel Skylake-SP to Ice Lake"),
    Variant("avx2", ("-march=x86-64-v3",), _V3, False, "Intel Haswell and later, AMD Zen 1-3"),
)
_BY_NAME: Dict[str, Variant] = {v.name: v for v in VARIANTS}


def compiler(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The C compiler: ``$CC`` (a name on the ``PATH`` or a file), else the first of ``cc``,
    ``gcc``, ``clang`` on the ``PATH``; None when there is none."""
    env = os.environ if env is None else env
    cc = env.get("CC")
    if cc:
        return shutil.which(cc) or (cc if os.path.isfile(cc) else None)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def compile_command(cc: str, out: str, extra: Iterable[str]) -> List[str]:
    """The one command that compiles every source into the library ``out``: :data:`FLAGS`,
    then ``extra`` (the instruction set, ``-fopenmp``)."""
    return [cc, *FLAGS, *extra, *(str(src) for src in SOURCES), "-o", out, *LIBS]


def source_digest(source: Optional[bytes] = None) -> str:
    """sha256 of the sources and headers (read now, unless ``source`` holds them, joined by
    NUL bytes): what a prebuilt library was built from."""
    if source is None:
        source = b"\0".join(p.read_bytes() for p in SOURCES + HEADERS)
    return hashlib.sha256(source).hexdigest()


def cpu_flags(cpuinfo: Optional[str] = None, keys: Tuple[str, ...] = ("flags",)
              ) -> FrozenSet[str]:
    """The feature flags this CPU reports (``/proc/cpuinfo``'s ``flags`` line, or the first
    line of ``keys``, e.g. ARM's ``Features`` too; or in the text ``cpuinfo`` given); empty
    where there is no such file (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return frozenset(value.split())
    return frozenset()


def choose_variant(flags: Iterable[str], avx512: bool = True,
                   offered: Optional[Iterable[str]] = None,
                   machine: Optional[str] = None) -> Optional[Variant]:
    """The best variant a CPU with these ``/proc/cpuinfo`` ``flags`` runs, or None.

    ``avx512=False`` (``ATTNKIT_NATIVE_AVX512=0``) leaves out the AVX-512 variants;
    ``offered`` limits the choice to these variant names (what a wheel carries);
    ``machine`` is ``platform.machine()`` unless given (every variant is x86-64)::

        choose_variant({"avx2", "fma", ...})                 -> avx2
        choose_variant({... "avx512f", ... "avx512_bf16"})   -> avx512bf16 (Zen 4)
        choose_variant(same, avx512=False)                   -> avx2
        choose_variant(set())                                -> None
    """
    machine = platform.machine() if machine is None else machine
    if machine.lower() not in _X86_64:
        return None
    have = frozenset(flags)
    names = None if offered is None else frozenset(offered)
    for variant in VARIANTS:
        if ((avx512 or not variant.avx512) and (names is None or variant.name in names)
                and variant.needs <= have):
            return variant
    return None


def no_variant_reason(flags: Iterable[str], avx512: bool = True,
                      offered: Optional[Iterable[str]] = None,
                      machine: Optional[str] = None) -> str:
    """Why :func:`choose_variant` found nothing, in words (what the CPU lacks)."""
    machine = platform.machine() if machine is None else machine
    if machine.lower() not in _X86_64:
        return f"the prebuilt kernels are for x86-64 and this machine is {machine or 'unknown'}"
    have = frozenset(flags)
    if not have:
        return "this CPU's features cannot be read (no /proc/cpuinfo flags)"
    names = [v.name for v in VARIANTS if offered is None or v.name in set(offered)]
    if not names:
        return "this install carries no prebuilt variant"
    smallest = _BY_NAME[names[-1]]
    lacks = ", ".join(sorted(smallest.needs - have))
    if not avx512 and all(_BY_NAME[n].avx512 for n in names):
        return (f"ATTNKIT_NATIVE_AVX512=0 rules out every prebuilt variant here "
                f"({', '.join(names)})")
    return f"this CPU lacks {lacks}, which the smallest prebuilt variant ({smallest.name}) needs"


def parse_variant_names(text: str, variable: str = "ATTNKIT_WHEEL_KERNELS"
                        ) -> Tuple[Variant, ...]:
    """The variants a comma-separated list names (``all``: every one; ``none``: none), in
    :data:`VARIANTS` order; ``variable`` names where the text came from, for the error."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if words in (["all"], []):
        return VARIANTS
    if words == ["none"]:
        return ()
    unknown = [w for w in words if w not in _BY_NAME]
    if unknown:
        raise ValueError(
            f"{variable}={text!r} names {', '.join(unknown)}; expected 'all', 'none' or a "
            f"comma-separated list of {', '.join(_BY_NAME)}. Fix the list, or unset "
            f"{variable} to build every variant")
    return tuple(v for v in VARIANTS if v.name in words)


def prebuilt_unsupported_reason(machine: Optional[str] = None,
                                system: Optional[str] = None) -> Optional[str]:
    """None where prebuilt variants can be built (Linux x86-64), else why not."""
    machine = platform.machine() if machine is None else machine
    system = platform.system() if system is None else system
    if machine.lower() not in _X86_64 or system != "Linux":
        return (f"prebuilt kernels are built on Linux x86-64 only, and this is {system} "
                f"{machine}: the kernels build at first use instead")
    return None


def _run(cmd: List[str]) -> Optional[str]:
    """Run one compiler command; None on success, else its complaint."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{' '.join(cmd)} failed to run: {exc}"
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        return f"{' '.join(cmd)} exited with {proc.returncode}: {' | '.join(err[-3:])}"
    return None


def _compiler_version(cc: str) -> str:
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return cc
    lines = proc.stdout.strip().splitlines()
    return lines[0] if lines else cc


def build_prebuilt(out: Path, variants: Iterable[Variant] = VARIANTS, cc: Optional[str] = None,
                   jobs: Optional[int] = None,
                   log: Callable[[str], None] = print) -> List[dict]:
    """Compile the kernels once per variant into ``out`` (emptied first): for each, a library
    with OpenMP (``attnkit_<variant>_openmp.so``, where the compiler has OpenMP) and one
    without (``attnkit_<variant>.so``), and ``manifest.json`` listing them.

    The sources are compiled to objects on ``jobs`` threads (default: every core) and linked;
    the two libraries of a variant share every object but those of the files that use OpenMP
    (``_OPENMP`` or an ``omp`` pragma other than ``simd``: pool.c), which are compiled twice, so
    each library is what :func:`compile_command` builds with the same flags. A variant
    the compiler rejects (an old compiler without ``-mavx512fp16``) is left out and logged.
    Returns the manifest's library entries (empty without a compiler or off Linux x86-64:
    the package then builds its kernels at first use)."""
    variants = tuple(variants)
    why = prebuilt_unsupported_reason()
    cc = cc or compiler()
    if why is None and cc is None:
        why = "no C compiler found (set CC, or install cc/gcc/clang): the kernels build at " \
              "first use instead"
    if out.exists():
        shutil.rmtree(out)
    if why is not None or not variants:
        log(f"attnkit: no prebuilt native kernels ({why or 'none asked for'})")
        return []
    assert cc is not None
    t0 = time.perf_counter()
    out.mkdir(parents=True)
    digest = source_digest()
    uses_openmp = {src for src in SOURCES
                   if re.search(r"_OPENMP|#\s*pragma\s+omp\s+(?!simd\b)", src.read_text())}
    with tempfile.TemporaryDirectory(prefix="attnkit-prebuilt-") as tmp:
        # one job per (variant, source), the OpenMP users also with -fopenmp; the longest first
        work: List[Tuple[Variant, Path, bool, Path]] = []
        for v in variants:
            for src in SOURCES:
                for omp in ((False, True) if src in uses_openmp else (False,)):
                    obj = Path(tmp) / f"{v.name}-{src.stem}{'-omp' if omp else ''}.o"
                    work.append((v, src, omp, obj))
        work.sort(key=lambda w: -w[1].stat().st_size)

        def compile_one(job: Tuple[Variant, Path, bool, Path]) -> Optional[str]:
            v, src, omp, obj = job
            flags = [f for f in FLAGS if f != "-shared"]
            return _run([cc, *flags, *v.flags, *(OPENMP if omp else ()), "-c", str(src),
                         "-o", str(obj)])

        with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as ex:
            errors = dict(zip([(w[0].name, w[1].name, w[2]) for w in work],
                              ex.map(compile_one, work)))
        entries: List[dict] = []
        for v in variants:
            failed = [e for (name, _, omp), e in errors.items()
                      if name == v.name and not omp and e is not None]
            if failed:
                log(f"attnkit: prebuilt variant {v.name} left out: {failed[0]}")
                continue
            for omp in (True, False):
                omp_error = next((e for (name, _, o), e in errors.items()
                                  if name == v.name and o and e is not None), None)
                if omp and omp_error is not None:
                    log(f"attnkit: {v.name} without OpenMP only: {omp_error}")
                    continue
                objs = [str(Path(tmp) / f"{v.name}-{src.stem}"
                            f"{'-omp' if omp and src in uses_openmp else ''}.o")
                        for src in SOURCES]
                name = f"attnkit_{v.name}{'_openmp' if omp else ''}.so"
                extra = (*v.flags, *(OPENMP if omp else ()))
                err = _run([cc, *FLAGS, *extra, *objs, "-o", str(out / name), *LIBS])
                if err is not None:
                    log(f"attnkit: {name} left out: {err}")
                    continue
                entries.append({"file": name, "variant": v.name, "openmp": omp,
                                "flags": " ".join(FLAGS + extra)})
    manifest = {"sources": digest, "compiler": _compiler_version(cc), "libraries": entries}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    built = sorted({e["variant"] for e in entries}, key=[v.name for v in VARIANTS].index)
    log(f"attnkit: prebuilt native kernels {', '.join(built) or 'none'} "
        f"({len(entries)} libraries) in {time.perf_counter() - t0:.0f} s with {cc}")
    return entries
