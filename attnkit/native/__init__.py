"""attnkit's native kernels, in C: decoding over a (paged) KV cache, Philox dropout, softcap.

Decoding reads every cached key and value once per generated token, so it is bound by memory
bandwidth; torch's matmuls with a handful of query rows per head reach about half of what the
memory can deliver and a paged cache adds one call per page. ``decode.c`` reads the pages in
place, front to back, dots each key row with all the query rows of its kv head and keeps the
online softmax in float32 (see the comment at its top). Long contexts with few sequences are
split across threads by key range (flash-decoding) and the partial states merged by
log-sum-exp with :func:`attnkit.merge.merge_states`. fp8 pages (e4m3 / e5m2, with per-(page,
kv head) descales) are converted in registers; with bfloat16 queries on a CPU with
AVX512-FP16 (``build_info()["h16"]``), e4m3 pages are computed in float16 products and short
float16 sums, twice float32's multiply-adds a cycle (errors about 1e-3 of the output's
largest value: within FlashAttention's rule against the same computation in bfloat16, and
below the bfloat16 output's own rounding); float32 queries keep float32 arithmetic.
:func:`fp8_dequantize` is the same conversion as one pass over an fp8 q/k/v tensor (torch's
fp8 casts run one element at a time).

``philox.c`` is the counter-based generator of :mod:`attnkit.dropout`, bit for bit, about 20
times faster than the same rounds in torch integer ops. ``softcap.c`` is the tiled executor's
``cap * tanh`` pass and its gradient, one sweep each (``simd.h``: the shared exp/tanh).
``peak.c`` measures what the cores and the memory can do at most (multiply-adds, the
bfloat16 dot product, a copy), the limits :mod:`attnkit.bench.limits` reports.
Decoding and softcap share one thread pool (``pool.c``): threads started on the first call
that wants them and parked between calls (no thread is started per call); each call runs on
at most ``torch.get_num_threads()`` threads, read at that call, and on the caller alone when
it is too small to repay waking a thread. A call from a second Python thread while the pool
is busy runs on its own thread; a forked child starts a pool of its own. See
:func:`pool_stats`.

All are one library, loaded with :mod:`ctypes` (calls release the GIL) on first use. A wheel
carries it prebuilt for four x86-64 levels (:mod:`attnkit.native.build`: AVX2, AVX-512,
AVX-512 with BF16 and VBMI, and with FP16 too), and the loader takes the best one whose
instructions this CPU reports. Otherwise (a source install, another CPU, or
``ATTNKIT_NATIVE_BUILD=native``: tuned for this CPU) it is built on first use with
``-march=native`` by the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) into a
cache folder (``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit`` or
``~/.cache/attnkit``; where that cannot be written, a private ``attnkit-<uid>`` folder in the
temporary directory), keyed by the sources, the compiler, the flags and this CPU.
:func:`build_info` and :func:`describe` say which. Without either, or with
``ATTNKIT_NATIVE=0``, :func:`available` is False, :func:`unavailable_reason` says why and
attnkit runs the same computations in torch ops instead; unless ``ATTNKIT_NATIVE=0`` chose
that, one :class:`NativeKernelWarning` says why and what it costs. ``ATTNKIT_NATIVE_AVX512=0``
loads the AVX2 variant, or builds for this CPU without its AVX-512 instructions (the AVX2
paths a CPU without AVX-512 takes; the flash kernel then runs on 256-bit registers,
``build_info()["flash_bits"]``).

The interface between this module and the C sources is declared once, in ``attnkit.h``: every
exported function, the flash kernel's argument structs, the constants (:data:`FLASH_BLOCK`,
:data:`MAX_QUERY_ROWS`, ...) and the error codes with their messages. The bindings are made
from its prototypes and the constants read from it at import; at load the library's report of
its own constants, struct layouts and error table is compared with it and with this module's
ctypes structs, and any difference makes :func:`available` False, :func:`unavailable_reason`
naming it (expected against found). Every nonzero return of a kernel is a code of that table;
:func:`kernel_error` turns it into its exception and message.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import platform
import re
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor

from . import build as _build

__all__ = ["available", "unavailable_reason", "build_info", "decode_reasons", "paged_decode",
           "dense_decode", "DecodeCall", "fp8_dequantize", "philox_fill", "softcap_forward_",
           "softcap_backward", "alibi_tile", "flash_forward", "flash_backward", "FlashTerms",
           "FlashForward", "FlashPages", "flash_prepare", "FlashNonFinite", "FLASH_BLOCK",
           "pool_stats", "decode_counts", "MAX_QUERY_ROWS", "NativeKernelWarning",
           "kernel_error", "error_codes"]

_HERE = Path(__file__).parent
# the sources, headers and flags: one list in build.py, which setup.py reads for the wheel
_SOURCES, _HEADERS, _FLAGS = _build.SOURCES, _build.HEADERS, _build.FLAGS
#: the kernels' interface, declared once: every exported function, shared struct, constant and
#: error code (read below; see the format at its top)
_HEADER = _HERE / "attnkit.h"


# ---- the interface: attnkit.h ------------------------------------------------------------
#
# The functions' ctypes bindings are generated from attnkit.h's prototypes, not checked against
# a copy here: every C source includes the header, so the compiler holds each definition to its
# prototype, and bindings made from the same text cannot disagree with it (a caller passing the
# wrong number of arguments meets ctypes' TypeError at the call). The shared structs are checked
# rather than generated: Python fills their fields by attribute name, and a ctypes Structure
# takes any attribute name without complaint, so the classes below spell out the fields this
# code writes and the load proves they are the header's, in order, of its types, at the offsets
# and sizes the compiler gave them (attnkit_abi_field). Constants and error codes are read from
# the header and compared with the library's own tables (attnkit_abi_constant,
# attnkit_error_name/message), which also refuses a library built from another header.


@dataclass(frozen=True)
class _Prototype:
    """One exported function of attnkit.h: its C return and parameter types (normalised:
    ``const char *``, ``int64_t``...)."""

    name: str
    restype: str
    argtypes: Tuple[str, ...]


@dataclass(frozen=True)
class _Interface:
    """What attnkit.h declares: constants (name -> value), error codes (value -> (name,
    message)), struct fields (struct -> [(C type, field, array count or None)]) and
    functions (name -> :class:`_Prototype`), each in the header's order."""

    constants: Dict[str, int]
    errors: Dict[int, Tuple[str, str]]
    structs: Dict[str, List[Tuple[str, str, Optional[int]]]]
    functions: Dict[str, _Prototype]


class _HeaderError(ValueError):
    """attnkit.h holds something its restricted format does not allow."""


_SCALARS: Dict[str, Any] = {
    "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
    "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16, "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64, "float": ctypes.c_float, "double": ctypes.c_double}
_C_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _c_type(text: str) -> str:
    """A C type as written, normalised: one space between words, `` *`` for each pointer."""
    return re.sub(r"\s*\*", " *", " ".join(text.split())).strip()


def _ctype_of(c_type: str, where: str, result: bool = False) -> Any:
    """The ctypes type of a C type of attnkit.h's vocabulary (see its top); ``result``: a
    return type (``void``: None, ``const char *``: a C string)."""
    if c_type.endswith("*"):
        return ctypes.c_char_p if result and c_type == "const char *" else ctypes.c_void_p
    if result and c_type == "void":
        return None
    if c_type not in _SCALARS:
        raise _HeaderError(
            f"attnkit.h: {where} has type {c_type!r}; the loader reads "
            f"{', '.join(_SCALARS)}, pointers{' and void' if result else ''}. Use one of "
            f"those (or extend _SCALARS in attnkit/native/__init__.py)")
    return _SCALARS[c_type]


def _x_items(body: str, pattern: str, what: str) -> List[Tuple[str, ...]]:
    """The items of an X-macro list's body, each matched by ``pattern``; anything else in the
    body is an error naming ``what``."""
    items, rest = [], body
    for m in re.finditer(pattern, body):
        items.append(m.groups())
        rest = rest.replace(m.group(0), " ", 1)
    if rest.strip():
        raise _HeaderError(f"attnkit.h: {what} holds {' '.join(rest.split())[:80]!r}, which is "
                           f"no item of the form its comment gives")
    return items


def _parse_header(text: str) -> _Interface:
    """Read attnkit.h's text (its restricted format: see the header's top). Raises
    :class:`_HeaderError` naming what it cannot read."""
    code = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    if "//" in code:
        raise _HeaderError("attnkit.h: use /* */ comments only (the loader reads no //)")
    code = code.replace("\\\n", " ")
    directives = [line.strip() for line in code.splitlines() if line.lstrip().startswith("#")]
    body = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("#"))
    lists: Dict[str, str] = {}
    structs: Dict[str, List[Tuple[str, str, Optional[int]]]] = {}
    for d in directives:
        m = re.match(r"#\s*define\s+(AK_CONSTANTS|AK_ERRORS)\(X\)(.*)$", d)
        if m:
            lists[m.group(1)] = m.group(2)
            continue
        m = re.match(r"#\s*define\s+AK_FIELDS_(\w+)\(F,\s*A\)(.*)$", d)
        if m:
            fields = []
            for kind, args in _x_items(m.group(2), r"\b([FA])\(([^()]*)\)",
                                       f"AK_FIELDS_{m.group(1)}"):
                parts = [p.strip() for p in args.split(",")]
                if (len(parts) != (2 if kind == "F" else 3) or not re.fullmatch(r"\w+", parts[1])
                        or (kind == "A" and not parts[2].isdigit())):
                    raise _HeaderError(f"attnkit.h: struct {m.group(1)} has {kind}({args}); "
                                       f"expected F(type, field) or A(type, field, count)")
                c_type = _c_type(parts[0])
                _ctype_of(c_type, f"{m.group(1)}.{parts[1]}")
                fields.append((c_type, parts[1], int(parts[2]) if kind == "A" else None))
            structs[m.group(1)] = fields
    table = r'X\(\s*(\w+)\s*,\s*(-?\d+)\s*,\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\)'
    for name in ("AK_CONSTANTS", "AK_ERRORS"):
        if name not in lists:
            raise _HeaderError(f"attnkit.h: no '#define {name}(X)' list")
    constants: Dict[str, int] = {}
    for name, value, _ in _x_items(lists["AK_CONSTANTS"], table, "AK_CONSTANTS"):
        if name in constants:
            raise _HeaderError(f"attnkit.h: constant {name} is defined twice")
        constants[name] = int(value)
    errors: Dict[int, Tuple[str, str]] = {}
    for name, value, message in _x_items(lists["AK_ERRORS"], table, "AK_ERRORS"):
        code_ = int(value)
        if code_ <= 0 or code_ in errors:
            raise _HeaderError(f"attnkit.h: error {name} = {code_}; codes must be positive and "
                               f"distinct (0 is AK_OK)")
        errors[code_] = (name, "".join(_C_STRING.findall(message)))
    functions: Dict[str, _Prototype] = {}
    for decl in body.split(";"):
        if "attnkit_" not in decl:
            continue
        decl = " ".join(decl.split())
        m = re.fullmatch(
            r"(?P<ret>[A-Za-z_][\w ]*?[ *]+)(?P<name>attnkit_\w+) ?\((?P<args>[^()]*)\)", decl)
        if m is None:
            raise _HeaderError(f"attnkit.h: cannot read the declaration {decl[:100]!r}; expected "
                               f"'RET attnkit_NAME(TYPE name, ...);'")
        name, ret = m.group("name"), _c_type(m.group("ret"))
        _ctype_of(ret, f"{name}'s return", result=True)
        args: List[str] = []
        params = m.group("args").strip()
        for i, param in enumerate([] if params == "void" else params.split(",")):
            pm = re.fullmatch(r"(.*?[ *])(\w+)", param.strip())
            if pm is None or not pm.group(1).strip():
                raise _HeaderError(f"attnkit.h: {name}'s parameter {i + 1} {param.strip()!r} is "
                                   f"not 'TYPE name'")
            args.append(_c_type(pm.group(1)))
            _ctype_of(args[-1], f"{name}'s parameter {pm.group(2)}")
        if name in functions:
            raise _HeaderError(f"attnkit.h: {name} is declared twice")
        functions[name] = _Prototype(name, ret, tuple(args))
    return _Interface(constants, errors, structs, functions)


def _read_interface() -> _Interface:
    try:
        return _parse_header(_HEADER.read_text())
    except OSError as exc:
        raise ImportError(f"attnkit.native: cannot read the kernels' interface {_HEADER}: {exc} "
                          f"(a broken install: reinstall attnkit)") from exc


_INTERFACE = _read_interface()


def _constant(name: str) -> int:
    """attnkit.h's constant ``name`` (AK_CONSTANTS), which this module reads."""
    if name not in _INTERFACE.constants:
        raise _HeaderError(f"attnkit.h: AK_CONSTANTS lacks {name}, which attnkit.native reads; "
                           f"add it there (the kernels' interface is declared only there)")
    return _INTERFACE.constants[name]


_C = {name: _constant(name) for name in (
    "AK_ABI", "AK_MAX_QUERY_ROWS", "AK_F32", "AK_BF16", "AK_F16", "AK_E4M3", "AK_E5M2",
    "AK_FLASH_BLOCK", "AK_FLASH_MAX_DIM", "AK_POOL_MAX", "AK_POOL_STATS")}
_ABI = _C["AK_ABI"]
#: Lq limit of the decode kernel: longer query blocks are matmul work for the torch executors
MAX_QUERY_ROWS = _C["AK_MAX_QUERY_ROWS"]
_DTYPES = {torch.float32: _C["AK_F32"], torch.bfloat16: _C["AK_BF16"],
           torch.float16: _C["AK_F16"]}
#: fp8 pages, read with per-(page, kv head) descales and converted in registers
_FP8 = {torch.float8_e4m3fn: _C["AK_E4M3"], torch.float8_e5m2: _C["AK_E5M2"]}

_lock = threading.Lock()
_state: dict = {}  # "lib", "reason", "info" once loading was tried

#: What running without the kernels costs: examples/decode_paths.py's decoding step (B=8,
#: ~8k-token contexts, Hq=32, Hkv=8, d=128) against ATTNKIT_NATIVE=0, best of 7 runs on a
#: 2-core AVX-512 CPU.
#: Training and prefill without the flash kernel: the figures of issue 36 (the flash executor
#: against torch's fused kernel and the tiled executor, which `auto` runs without it).
SLOWDOWN = ("decoding runs in torch ops instead: about 3x slower over a paged cache, 2.5x over "
            "packed (varlen) sequences and 5x over a padded cache in bfloat16, and 16x over a "
            "paged cache in float32; and training and prefill lose the flash kernel: 1.7-2.7x "
            "slower on torch's fused kernel or the tiled executor")


class NativeKernelWarning(RuntimeWarning):
    """The native kernels could not be built or loaded, so attnkit runs their work in torch
    ops (the same results, slower). Issued once, when the kernels are first needed; set
    ``ATTNKIT_NATIVE=0`` to choose the torch ops without it."""


def _disabled() -> bool:
    return os.environ.get("ATTNKIT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _avx512_allowed() -> bool:
    return os.environ.get("ATTNKIT_NATIVE_AVX512", "1").strip().lower() not in (
        "0", "false", "no", "off")


def _cache_dir() -> Path:
    env = os.environ.get("ATTNKIT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnkit"


def _temp_dir() -> Path:
    """The fallback folder: one per user in the temporary directory."""
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"attnkit-{user}"


def _private(folder: Path) -> Optional[str]:
    """None when ``folder`` in the shared temporary directory is a folder of this user that
    nobody else can write (so a library found there is one this user built), else why not."""
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"cannot inspect {folder}: {exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return f"{folder} belongs to another user or others may write in it"
    return None


def _writable(folder: Path, private: bool) -> Optional[str]:
    """None when a library can be built in ``folder`` (created if needed), else why not."""
    try:
        folder.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {folder}: {exc}"
    if private and _private(folder) is not None:
        return _private(folder)
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
    except OSError as exc:
        return f"cannot write in {folder}: {exc}"
    os.close(fd)
    os.unlink(probe)
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    parts = [platform.machine(), platform.system()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features", "model name", "CPU part") and key not in parts:
                    parts += [key, line.strip()]
    except OSError:
        pass
    return "\n".join(parts)


def _compiler() -> Optional[str]:
    return _build.compiler()


def _compile(cc: str, out: Path, extra: Tuple[str, ...]) -> Optional[str]:
    """Compile decode.c into ``out``; None on success, else the compiler's complaint."""
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except OSError as exc:
        return f"cannot write in the kernel cache folder {out.parent}: {exc}"
    os.close(fd)
    cmd = _build.compile_command(cc, tmp, extra)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        os.unlink(tmp)
        return f"{' '.join(cmd)} failed to run: {exc}"
    if proc.returncode != 0:
        os.unlink(tmp)
        err = (proc.stderr or proc.stdout).strip().splitlines()
        return f"{' '.join(cmd)} exited with {proc.returncode}: {' | '.join(err[-3:])}"
    try:
        os.replace(tmp, out)  # atomic: a concurrent builder sees no file or the whole new one
    except OSError as exc:
        os.unlink(tmp)
        return f"cannot write {out}: {exc}"
    return None


#: ATTNKIT_NATIVE_BUILD: where the kernels come from (see _libraries)
_BUILD_MODES = {"prebuilt": "load the variant this package carries for this CPU, else compile "
                            "at first use (the default)",
                "native": "compile for this CPU with -march=native at first use, into the "
                          "kernel cache folder"}


def _build_mode() -> str:
    given = os.environ.get("ATTNKIT_NATIVE_BUILD", "")
    mode = given.strip().lower() or "prebuilt"
    if mode not in _BUILD_MODES:
        raise ValueError(
            f"ATTNKIT_NATIVE_BUILD={given!r}; expected one of "
            + "; ".join(f"{k!r} ({v})" for k, v in _BUILD_MODES.items())
            + ". Fix it, or unset it for the default")
    return mode


def _prebuilt(source: bytes) -> Tuple[List[Tuple[Path, dict]], str]:
    """The prebuilt libraries of the best variant this CPU runs (build.choose_variant), with
    OpenMP first; or none, and why."""
    folder = _build.PREBUILT_DIR
    try:
        manifest = json.loads((folder / _build.MANIFEST).read_text())
    except FileNotFoundError:
        return [], "this install carries no prebuilt kernels (a source install)"
    except (OSError, ValueError) as exc:
        return [], f"cannot read the prebuilt kernels' list: {exc}"
    if manifest.get("sources") != _build.source_digest(source):
        return [], f"the prebuilt kernels in {folder} were built from other sources than these"
    libraries = manifest.get("libraries", [])
    offered = [e["variant"] for e in libraries]
    flags, avx512 = _build.cpu_flags(), _avx512_allowed()
    variant = _build.choose_variant(flags, avx512=avx512, offered=offered)
    if variant is None:
        return [], "no prebuilt variant fits: " + _build.no_variant_reason(flags, avx512, offered)
    mine = sorted((e for e in libraries if e["variant"] == variant.name),
                  key=lambda e: not e["openmp"])
    return [(folder / e["file"], e) for e in mine], ""


def _libraries(source: bytes, info: dict) -> Iterator[Union[Path, str]]:
    """The libraries to load, best first, each described in ``info`` when it is yielded; a
    str says why nothing further can be tried.

    By default (``ATTNKIT_NATIVE_BUILD=prebuilt``) the best prebuilt variant for this CPU
    (``ATTNKIT_NATIVE_AVX512=0``: the AVX2 one), with OpenMP and then without it (a process
    without libgomp), then a library built here for this CPU; ``ATTNKIT_NATIVE_BUILD=native``
    skips the prebuilt ones. Prebuilt wins by default: no compiler and no build in the first
    call, and the same code paths, which the sources choose by the instruction sets that the
    best variant has; -march=native adds only the compiler's tuning for this CPU model."""
    why = "ATTNKIT_NATIVE_BUILD=native rules out the prebuilt ones (unset it to load them)"
    if _build_mode() == "prebuilt":
        found, why = _prebuilt(source)
        for path, entry in found:
            info.update(origin="prebuilt", variant=entry["variant"], path=str(path),
                        folder=str(path.parent), flags=entry["flags"], cached=False,
                        openmp=entry["openmp"])
            yield path
        if found:  # none of them loads
            why = f"the prebuilt kernels do not load ({info.get('prebuilt_error')})"
        info.clear()
    info["prebuilt_unused"] = why
    cc = _compiler()
    if cc is None:
        yield ("no C compiler found (set CC, or install cc/gcc/clang) to build the native "
               f"kernels; {why}")
        return
    info.update(compiler=cc, origin="built here", variant="native")
    yield from _built_here(cc, source, info)


def _built_here(cc: str, source: bytes, info: dict) -> Iterator[Union[Path, str]]:
    """Libraries built for this CPU (or found built before) in the kernel cache folder: with
    -march=native and OpenMP, without OpenMP, without -march=native; then why none was."""
    cache, temp = _cache_dir(), _temp_dir()
    folders = [cache] if temp == cache else [cache, temp]
    unusable: dict = {}  # folder -> why no library can be built in it
    # ATTNKIT_NATIVE_AVX512=0: this CPU's instructions short of AVX-512 (the kernels' AVX2
    # paths; what a CPU without AVX-512 runs, and its tests on one that has it)
    native = ("-march=native",) + (() if _avx512_allowed() else ("-mno-avx512f",))
    # -fopenmp: the kernels may run on torch's OpenMP threads (pool.c's ak_team_run);
    # without it (a compiler that lacks OpenMP), on attnkit's own pool
    for extra in (native + ("-fopenmp",), native, ()):
        key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(_FLAGS + extra).encode(),
                                         _cpu_signature().encode()])).hexdigest()[:16]
        name = f"attnkit_decode_{key}.so"
        # built before, in the cache folder or (one this user owns) in the temporary one
        path = next((f / name for f in folders
                     if (f / name).is_file() and (f == cache or _private(f) is None)), None)
        cached = path is not None
        if path is None:
            for folder in folders:
                if folder not in unusable:
                    why = _writable(folder, private=folder != cache)
                    if why is None:
                        path = folder / name
                        break
                    unusable[folder] = why
            else:
                where = "; nor in the temporary folder: " if len(folders) > 1 else ""
                yield ("cannot build the native kernels in the kernel cache folder: "
                       + where.join(unusable[f] for f in folders))
                return
        info.update(path=str(path), folder=str(path.parent), flags=" ".join(_FLAGS + extra),
                    cached=cached)
        if path.parent != cache:
            info["cache_folder_unusable"] = unusable.get(cache, f"{cache} holds no library")
        if not cached:
            t0 = time.perf_counter()
            err = _compile(cc, path, extra)
            info["build_s"] = time.perf_counter() - t0
            if err is not None:
                info["error"] = err
                continue  # retry without -march=native (a compiler that lacks it)
        yield path
    yield f"building the native decode kernel failed: {info.get('error')}"


def _load() -> Tuple[Optional[Any], Optional[str], dict]:
    if _disabled():
        return None, "disabled by ATTNKIT_NATIVE=0", {}
    try:
        source = b"\0".join(src.read_bytes() for src in _SOURCES + _HEADERS)
    except OSError as exc:
        return None, f"cannot read the kernel sources: {exc}", {}
    info: dict = {}
    for path in _libraries(source, info):
        if isinstance(path, str):  # why nothing (further) can be loaded
            return None, path, info
        try:
            cdll = ctypes.CDLL(str(path))
        except OSError as exc:
            if info.get("origin") == "prebuilt":  # the next one (without OpenMP), say
                info["prebuilt_error"] = f"cannot load {path}: {exc}"
                continue
            return None, f"cannot load {path}: {exc}", info
        lib, why = _interface(str(path), cdll)
        if lib is None:
            return None, why, info
        info["f16"] = bool(lib.attnkit_native_has_f16())
        info["bf16_dot"] = bool(lib.attnkit_native_has_dpbf16())
        info["fp8_dot"] = bool(lib.attnkit_native_has_fp8dot())
        info["h16"] = bool(lib.attnkit_native_has_h16())
        info["flash_bits"] = int(lib.attnkit_flash_available())  # 512, 256 (AVX2) or 0
        info["flash"] = info["flash_bits"] > 0
        info["flash_bf16"] = bool(lib.attnkit_flash_has_bf16dot())
        info["team"] = _choose_team(lib)
        return lib, None, info
    return None, "no native library to load", info  # not reached: _libraries ends with why


def _interface(path: str, cdll: ctypes.CDLL) -> Tuple[Optional[_Kernels], Optional[str]]:
    """The library at ``path`` bound as attnkit.h declares it, or None and why not: another
    ABI version (checked first: an older library may lack the rest), a declared function it
    does not export, or any difference :func:`_check_interface` finds."""
    try:
        abi = cdll.attnkit_native_abi
    except AttributeError:
        return None, f"{path} is no attnkit kernel library (no attnkit_native_abi)"
    abi.restype, abi.argtypes = ctypes.c_int, []
    if abi() != _ABI:
        return None, f"{path} has kernel ABI {abi()}, expected {_ABI} (attnkit.h's AK_ABI)"
    lib, problems = _bind(path, cdll, _INTERFACE)
    if lib is not None:
        problems = _check_interface(_INTERFACE, *_library_tables(lib))
    if problems:
        return None, (f"{path} does not match the interface attnkit.h declares: "
                      + "; ".join(problems[:4])
                      + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""))
    return lib, None


def _openmp_runtimes() -> Optional[set]:
    """The OpenMP runtime files mapped into this process (libgomp, libiomp, libomp), or None
    where that cannot be read (no /proc)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return {line.split()[-1] for line in maps.splitlines()
            if "/lib" in line and any(f"/{name}" in line for name in (
                "libgomp", "libiomp", "libomp"))}


def _choose_team(lib: Any) -> str:
    """Where the kernels' parallel regions run: ``"openmp"``, torch's own OpenMP
    threads, when the library was built with OpenMP, torch's parallel backend is OpenMP and
    the process holds one OpenMP runtime (so the library's is torch's: on Linux the loader
    gives both the already loaded ``libgomp.so.1``); else ``"pool"``, attnkit's own threads.
    ``ATTNKIT_NATIVE_TEAM=pool`` forces the pool."""
    if os.environ.get("ATTNKIT_NATIVE_TEAM", "").strip().lower() == "pool":
        lib.attnkit_team_openmp(0)
        return "pool"
    runtimes = _openmp_runtimes()
    if (not runtimes or len(runtimes) != 1
            or "parallel backend: OpenMP" not in torch.__config__.parallel_info()):
        lib.attnkit_team_openmp(0)
        return "pool"
    return "openmp" if lib.attnkit_team_openmp(1) else "pool"


def _lib() -> Optional[Any]:
    failed = None
    with _lock:
        if not _state:
            lib, reason, info = _load()
            _state.update(lib=lib, reason=reason, info=info)
            if lib is None and not _disabled():
                failed = reason
    if failed is not None:
        _warn(f"attnkit's native kernels are unavailable ({failed}); {SLOWDOWN}. Set "
              f"ATTNKIT_NATIVE=0 to run without them and without this warning.")
    return _state["lib"]


def _warn(message: str) -> None:
    """Warn at the first caller outside attnkit and torch (whose autograd functions run
    attnkit's forward): the user's line that needed the kernels."""
    inside = tuple(str(Path(mod.__file__).resolve().parent) + os.sep
                   for mod in (sys.modules[__name__.split(".")[0]], torch))
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, NativeKernelWarning, stacklevel=level)


def available() -> bool:
    """Whether the native kernel is built (building it now if needed) and loadable."""
    return _lib() is not None


def unavailable_reason() -> Optional[str]:
    """Why the native kernel cannot be used, or None when it can."""
    _lib()
    return _state["reason"]


def build_info() -> dict:
    """Where the loaded library came from and what it can do.

    ``origin`` is ``"prebuilt"`` (``variant``: the prebuilt variant, see
    :mod:`attnkit.native.build`) or ``"built here"`` (``variant`` ``"native"``; ``compiler``,
    ``cached``: found in the cache folder, else ``build_s`` seconds; ``prebuilt_unused``: why
    no prebuilt variant was loaded; ``cache_folder_unusable``: why the folder is the
    temporary one); ``flags``, ``path``, ``folder``; then the kernels' capabilities
    (``flash_bits``, ``flash_bf16``, ``bf16_dot``, ``fp8_dot``, ``h16``, ``f16``, ``team``)."""
    _lib()
    return dict(_state["info"])


def _reset() -> None:
    """Forget the loaded kernel so the next call rebuilds/reloads it (tests)."""
    with _lock:
        _state.clear()


def decode_reasons(q: Tensor, k_pages: Tensor, v_pages: Tensor, grad_ok: bool = False,
                   k_descale: Optional[Tensor] = None,
                   v_descale: Optional[Tensor] = None) -> List[str]:
    """Why :func:`paged_decode` cannot run this call (empty when it can). The kernel has no
    backward: ``grad_ok`` says the caller differentiates by other means (the fused executor
    runs torch's backward from the kernel's output and LSE). fp8 pages need ``k_descale``
    and ``v_descale`` ``(num_pages, Hkv)`` and q in float32, bfloat16 or float16."""
    reasons = []
    if _lib() is None:
        reasons.append(f"native kernel unavailable: {_state['reason']}")
    if any(x.device.type != "cpu" for x in (q, k_pages, v_pages)):
        reasons.append("native kernel runs on CPU tensors only")
    if k_pages.dtype in _FP8:
        want = tuple(k_pages.shape[:1]) + tuple(k_pages.shape[2:3])
        if v_pages.dtype != k_pages.dtype or q.dtype not in _DTYPES:
            reasons.append(f"native kernel reads fp8 pages of one format with float32, "
                           f"bfloat16 or float16 queries; got q {q.dtype}, k_pages "
                           f"{k_pages.dtype}, v_pages {v_pages.dtype}")
        if any(d is None or tuple(d.shape) != want or d.device.type != "cpu"
               for d in (k_descale, v_descale)):
            reasons.append(f"native kernel needs k_descale and v_descale of shape {want} "
                           f"(num_pages, Hkv) for fp8 pages")
        if _state.get("info", {}).get("f16") is False:
            reasons.append("native kernel was built by a compiler without _Float16 support "
                           "(its fp8 conversion goes through float16)")
    elif (k_pages.dtype not in _DTYPES or v_pages.dtype != k_pages.dtype
          or q.dtype != k_pages.dtype):
        reasons.append(f"native kernel needs q, k_pages and v_pages of one dtype among float32, "
                       f"bfloat16, float16 (or fp8 pages); got {q.dtype}, {k_pages.dtype}, "
                       f"{v_pages.dtype}")
    elif k_pages.dtype == torch.float16 and _state.get("info", {}).get("f16") is False:
        reasons.append("native kernel was built by a compiler without _Float16 support")
    if q.shape[-1] % 16 or v_pages.shape[-1] % 16:
        reasons.append(f"native kernel needs head dims that are multiples of 16; got "
                       f"Dqk={q.shape[-1]}, Dv={v_pages.shape[-1]}")
    if q.shape[-1] == 0 or v_pages.shape[-1] == 0 or k_pages.dim() < 2 or k_pages.shape[1] == 0:
        reasons.append(f"native kernel reads head dims >= 16 from pages of at least one "
                       f"token; got Dqk={q.shape[-1]}, Dv={v_pages.shape[-1]}, pages "
                       f"{tuple(k_pages.shape)}")
    if q.shape[2] > MAX_QUERY_ROWS:
        reasons.append(f"native kernel is for decoding (Lq <= {MAX_QUERY_ROWS}); Lq={q.shape[2]} "
                       f"is matmul work")
    if (not grad_ok and torch.is_grad_enabled()
            and any(x.requires_grad for x in (q, k_pages, v_pages))):
        reasons.append("native kernel has no backward; inputs require grad")
    if any(x.stride(-1) != 1 or min(x.stride()) < 0 for x in (k_pages, v_pages)):
        reasons.append("native kernel needs pages with a unit-stride last dim")
    if q.shape[0] == 0 or q.shape[2] == 0:
        reasons.append("nothing to compute (empty batch or no query rows)")
    return reasons


def _splits(batch: int, keys: int, threads: int) -> int:
    """Key splits per sequence (flash-decoding): enough work items to give every thread one,
    each split at least 1024 keys long so the merge stays cheap."""
    if threads <= 1 or batch >= threads:
        return 1
    want = -(-threads // max(batch, 1))
    return max(1, min(want, keys // 1024))


_INT_ARGS: Dict[Tuple[int, ...], Tensor] = {}


def _int64_args(values: Tuple[int, ...]) -> Tensor:
    """``values`` as a contiguous int64 CPU tensor the kernel reads (never writes), cached."""
    t = _INT_ARGS.get(values)
    if t is None:
        if len(_INT_ARGS) > 256:  # shapes recur in decoding; do not grow without bound
            _INT_ARGS.clear()
        t = _INT_ARGS[values] = torch.tensor(values, dtype=torch.int64)
    return t


def _plain(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` as a contiguous tensor of ``dtype`` (itself when it already is one)."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


_BOUND = 2 ** 62  # window bounds clamp here: every key position and |i'| lie far below it


def _bound(x: Optional[int]) -> int:
    """A window bound as the kernel's int64 (0 for None, which the flag marks unbounded);
    beyond +-2**62 every bound means the same as +-2**62."""
    return 0 if x is None else max(-_BOUND, min(_BOUND, int(x)))


def paged_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                 seqlens: Tensor, *, scale: float, causal: bool = True,
                 diagonal: str = "bottom_right",
                 window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                 softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                 splits: Optional[int] = None, threads: Optional[int] = None,
                 starts: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
                 v_descale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Attention of ``q (B, Hq, Lq, D)`` over paged keys/values, in the native kernel.

    The caller has validated the shapes and the block table (every page a sequence uses lies
    in ``[0, num_pages)``, ``Lq <= seqlens[b] <= max_pages * page_size``) and checked
    :func:`decode_reasons`. Query row ``i`` of sequence ``b`` sits at position
    ``i' = i + seqlens[b] - Lq`` (bottom_right) or ``i' = i`` (top_left) for ``causal``,
    ``window`` and ALiBi. ``window = (left, right)`` keeps key ``j`` iff
    ``i' - left <= j <= i' + right``; either bound may be any int, negative ones included (a
    window that lies wholly before or after the diagonal), and None leaves that side
    unbounded; ``causal`` caps ``right`` at 0. ``alibi_slopes`` is ``(Hq,)``, ``(1, Hq)`` or
    ``(B, Hq)``. ``splits`` (key ranges per sequence, merged by LSE) and ``threads`` default
    to :func:`_splits` and ``torch.get_num_threads()``. ``starts (B,)`` shifts where each
    sequence begins in its block-table row (packed sequences in one long page). fp8 pages
    (float8_e4m3fn / e5m2) hold ``x8`` with the real value ``x8 * k_descale[page, head]``
    (``v_descale`` likewise, both ``(num_pages, Hkv)``); the kernel converts them in
    registers, with no dequantized copy. Returns
    ``out (B, Hq, Lq, Dv)`` and ``lse (B, Hq, Lq)``, both float32. A row with a NaN or +inf
    score among the keys it sees gives NaN out and LSE; a row that sees no key (or only -inf
    scores) gives 0 and ``-inf``; keys a row does not see never reach it, whatever they hold.
    """
    if _lib() is None:
        raise NotImplementedError(f"native kernel unavailable: {_state['reason']}")
    keys = max(1, int(seqlens.max())) if q.shape[0] else 1  # the longest sequence
    call = DecodeCall(q, k_pages.dtype, scale=scale, causal=causal, diagonal=diagonal,
                      window=window, softcap=softcap, splits=splits, threads=threads)
    return call.run(q, k_pages, v_pages, block_table, seqlens, keys, starts=starts,
                    alibi_slopes=alibi_slopes, k_descale=k_descale, v_descale=v_descale)


#: what the decode kernel's AK_BAD_ARGS means for its caller
_DECODE_REFUSED = ("the native decode kernel checks for a page index outside [0, num_pages) "
                   "among the pages a sequence uses, a sequence longer than its block-table "
                   "row or than the keys the call was given, and impossible dims; the callers' "
                   "checks (attnkit.pages) explain such input")


#: The decode kernel's read-once path for values that are a view into the keys (MLA's latent
#: cache, ``v = k[..., :512]``): ``enabled`` (on; off reads them as separate rows, for A/B
#: timings), and how many kernel calls ran (``calls``) and took it (``shared_rows``).
_SHARED_ROWS = {"enabled": True, "calls": 0, "shared_rows": 0}


def decode_counts() -> Dict[str, int]:
    """How many decode kernel calls ran in this process (``calls``) and how many of them read
    the values from inside the key rows (``shared_rows``: MLA's latent cache read once)."""
    return {"calls": _SHARED_ROWS["calls"], "shared_rows": _SHARED_ROWS["shared_rows"]}


def _shared_rows(k: Tensor, v: Tensor, ks: Tuple[int, ...], vs: Tuple[int, ...]) -> bool:
    """Whether every value row lies inside its key row (``ks``/``vs``: the page, token and
    head strides the kernel gets): one dtype and layout, the same strides, and ``v``'s data
    ``off`` elements into ``k``'s rows with ``off + Dv <= Dk``, as for ``v = k[..., :Dv]``
    (MLA) or ``k[..., off:off + Dv]``. The kernel checks the same and refuses a call that
    claims it falsely."""
    if (not _SHARED_ROWS["enabled"] or v.dtype != k.dtype or v.shape[:-1] != k.shape[:-1]
            or tuple(ks[:3]) != tuple(vs[:3])):
        return False
    off, rem = divmod(v.data_ptr() - k.data_ptr(), k.element_size())
    return rem == 0 and 0 <= off <= k.shape[-1] - v.shape[-1]

#: decode with bfloat16 q and pages where the vdpbf16ps dot products apply (``bf16_dot``):
#: P V in bfloat16 dot products too, P rounded to bfloat16 as torch's bfloat16 kernels (and
#: the flash kernel under FLASH_BF16_DOT) round it; False: P V in float32 arithmetic. Read at
#: every call.
DECODE_BF16_PV = True


class DecodeCall:
    """What stays the same from one :func:`paged_decode` call to the next in a decoding loop,
    worked out once: the query's dtype and head dim, the pages' dtype, the scale, the mask
    and score terms, the threads. :meth:`run` takes the tensors; a decoding loop prepares one
    and runs it every step (see :func:`attnkit.backends.decode.replay`)."""

    __slots__ = ("lib", "scale", "splits", "threads", "bf16_dot", "h16", "fp8", "code",
                 "flags", "softcap")

    def __init__(self, q: Tensor, kv_dtype: torch.dtype, *, scale: float, causal: bool = True,
                 diagonal: str = "bottom_right",
                 window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                 softcap: Optional[float] = None, splits: Optional[int] = None,
                 threads: Optional[int] = None) -> None:
        self.lib = _lib()
        if self.lib is None:
            raise NotImplementedError(f"native kernel unavailable: {_state['reason']}")
        self.threads = torch.get_num_threads() if threads is None else max(1, int(threads))
        self.splits = None if splits is None else int(splits)
        self.scale = float(scale)
        # bfloat16 queries as given, for the vdpbf16ps dot products (exact products, scale
        # after)
        # (fp8 pages too where the kernel converts them by table: fp8_dot)
        info = _state["info"]
        dot_pages = kv_dtype == torch.bfloat16 or (kv_dtype in _FP8 and info.get("fp8_dot"))
        self.bf16_dot = (q.dtype == torch.bfloat16 and bool(dot_pages)
                         and q.shape[-1] % 32 == 0 and bool(info.get("bf16_dot")))
        self.fp8 = kv_dtype in _FP8
        # e4m3 pages in float16 arithmetic where the CPU has AVX512-FP16, for bfloat16
        # queries (whose output is rounded to 8 bits anyway; decode.c says which calls
        # qualify and what it costs in accuracy)
        self.h16 = (kv_dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16
                    and q.shape[-1] % 32 == 0 and bool(info.get("h16")))
        self.code = _FP8[kv_dtype] if self.fp8 else _DTYPES[kv_dtype]
        left, right = (None, None) if window is None else window
        self.flags = (int(causal), int(diagonal == "bottom_right"), left is not None,
                      _bound(left), right is not None, _bound(right))
        self.softcap = float(softcap) if softcap is not None else 0.0

    def run(self, q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
            seqlens: Tensor, keys: int, *, starts: Optional[Tensor] = None,
            alibi_slopes: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
            v_descale: Optional[Tensor] = None, want_lse: bool = True,
            heads_first: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """``out (B, Hq, Lq, Dv)`` and ``lse (B, Hq, Lq)``, float32, for sequences of at most
        ``keys`` keys (which sets the key splits; a longer one is refused: ValueError); lse
        is None with ``want_lse=False`` (when the key splits do not need it either).
        ``heads_first``: the pages are given as ``(num_pages, Hkv, page_size, D)`` (a
        contiguous cache ``(N, Hkv, Lk, D)``, each batch row one page) rather than token-major.
        See :func:`paged_decode` for the rest."""
        bsz, hq, lq, d = q.shape
        ks, vs = k_pages.stride(), v_pages.stride()
        if heads_first:
            num_pages, hkv, page_size, _ = k_pages.shape
            ks, vs = (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1])
        else:
            num_pages, page_size, hkv, _ = k_pages.shape
        dv = v_pages.shape[3]
        keys = max(1, keys)
        splits = _splits(bsz, keys, self.threads) if self.splits is None else self.splits
        splits = max(1, min(splits, keys))
        per_split = -(-keys // splits)
        if splits > 1:
            per_split = -(-per_split // 64) * 64  # whole kernel chunks
        splits = max(1, -(-keys // per_split))
        if q.stride(-1) != 1:
            q = q.contiguous()  # (the kernel reads q in place, scaling and converting rows)
        kd = vd = None
        if self.fp8:
            if k_descale is None or v_descale is None:
                raise ValueError("fp8 pages need k_descale and v_descale (num_pages, Hkv)")
            kd = _plain(k_descale.detach(), torch.float32)
            vd = _plain(v_descale.detach(), torch.float32)
            if tuple(kd.shape) != (num_pages, hkv) or tuple(vd.shape) != (num_pages, hkv):
                raise ValueError(f"k_descale and v_descale must have shape ({num_pages}, "
                                 f"{hkv}) (num_pages, Hkv); got {tuple(kd.shape)} and "
                                 f"{tuple(vd.shape)}")
        bt = _plain(block_table, torch.int64)
        lens = _plain(seqlens, torch.int64)
        first = None if starts is None else _plain(starts, torch.int64)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes.detach().to(torch.float32).reshape(-1, hq).expand(bsz, hq)
            slopes = slopes.contiguous()
        # the kernel's integer arguments (K and V strides, dims, q's strides) in one cached
        # int64 tensor: the same shapes recur from layer to layer and step to step in decoding
        base = _int64_args(tuple(ks[:3]) + tuple(vs[:3])
                           + (bsz, hq, hkv, lq, d, dv, page_size, num_pages)
                           + tuple(q.stride()[:3])).data_ptr()
        out = (torch.empty(bsz, hq, lq, dv, dtype=torch.float32) if splits == 1
               else torch.empty(splits, bsz, hq, lq, dv, dtype=torch.float32))
        lse = (torch.empty(splits, bsz, hq, lq, dtype=torch.float32)
               if want_lse or splits > 1 else None)
        shared = _shared_rows(k_pages, v_pages, ks, vs)  # MLA: the value rows read once
        # P V in bfloat16 dot products too (P rounded to bfloat16): read at every call
        pv = int(DECODE_BF16_PV and self.bf16_dot and k_pages.dtype == torch.bfloat16
                 and v_pages.dtype == torch.bfloat16 and dv % 32 == 0)
        _SHARED_ROWS["calls"] += 1
        _SHARED_ROWS["shared_rows"] += shared
        rc = self.lib.attnkit_decode(
            q.data_ptr(), _DTYPES[q.dtype],
            int(self.bf16_dot) | 2 * int(self.h16) | 4 * shared | 8 * pv,
            self.scale,
            k_pages.data_ptr(), v_pages.data_ptr(), kd.data_ptr() if kd is not None else None,
            vd.data_ptr() if vd is not None else None, base, base + 3 * 8,
            bt.data_ptr(), bt.shape[1], lens.data_ptr(),
            first.data_ptr() if first is not None else None, base + 6 * 8, splits,
            per_split, self.code, *self.flags, self.softcap,
            slopes.data_ptr() if slopes is not None else None, out.data_ptr(),
            lse.data_ptr() if lse is not None else None, self.threads)
        if rc != 0:  # AK_BAD_ARGS: ValueError, AK_NO_MEMORY: MemoryError
            raise kernel_error(rc, "attnkit_decode", _DECODE_REFUSED)
        if splits == 1:  # (out is (B, Hq, Lq, Dv) already)
            return out, None if lse is None else lse[0]
        from ..kv.merge import merge_states

        return merge_states(out, lse)


def fp8_dequantize(x: Tensor, descale: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
    """``x8 * descale`` for an fp8 tensor ``x (..., L, D)`` (contiguous, CPU) with one float32
    descale per ``(..., )`` slab (``descale`` of shape ``x.shape[:-2]``, or 0-d), into float32
    or bfloat16, in one vectorised pass (torch's fp8 casts run one element at a time). None
    when the kernel is unavailable or the call does not qualify (the caller uses torch)."""
    lib = _lib()
    if (lib is None or x.dtype not in _FP8 or dtype not in (torch.float32, torch.bfloat16)
            or x.device.type != "cpu" or not x.is_contiguous() or x.dim() < 2
            or _state.get("info", {}).get("f16") is False):
        return None
    slabs = 1
    for size in x.shape[:-2]:
        slabs *= size
    d = descale.detach().to(torch.float32)
    d = (d.expand(x.shape[:-2]) if d.dim() == 0 else d).contiguous().reshape(-1)
    if d.numel() != slabs:
        return None
    out = torch.empty(x.shape, dtype=dtype)
    rc = lib.attnkit_fp8_dequantize(x.data_ptr(), slabs, x.shape[-1] * x.shape[-2],
                                    d.data_ptr(), _FP8[x.dtype], int(dtype == torch.bfloat16),
                                    out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None  # (AK_BAD_ARGS: the caller's torch ops)


def dense_decode(q: Tensor, k: Tensor, v: Tensor, scale: float,
                 seqlens: Optional[Tensor] = None, **options: Any) -> Tuple[Tensor, Tensor]:
    """Attention of ``q (N, Hq, Lq, D)`` over contiguous-cache ``k (N, Hkv, Lk, D)`` and
    ``v``: each batch row's keys are read as one page of ``Lk`` tokens (a strided view, no
    copy), the first ``seqlens[b]`` of them (all by default). ``options`` are
    :func:`paged_decode`'s (default: no mask). Returns float32 ``out`` and ``lse``; the
    caller checked :func:`decode_reasons` on ``(q, k, v)``."""
    n, _, lk, _ = k.shape
    table = torch.arange(n, dtype=torch.int64).view(n, 1)
    if seqlens is None:
        seqlens = torch.full((n,), lk, dtype=torch.int64)
    options.setdefault("causal", False)
    return paged_decode(q, k.transpose(1, 2), v.transpose(1, 2), table, seqlens, scale=scale,
                        **options)


def philox_fill(c0: Tensor, c1: Tensor, c2: Tensor, seed: int, offset: int, out: Tensor,
                threshold: Optional[int] = None) -> bool:
    """Philox-4x32-10 words over ``out``'s grid, the same bits as :mod:`attnkit.dropout`'s
    torch ops: ``out`` (bool) gets ``(word >> 8) >= threshold``, or ``out`` (float32,
    ``threshold=None``) gets ``(word >> 8) * 2**-24``. ``c0`` (the key columns ``j``, from
    which the kernel works out each call's counter and word), ``c1, c2`` are int64 index
    words (validated by the caller) that broadcast to ``out``'s shape (at most
    4-D, contiguous, CPU). Returns False, doing nothing, when the kernel is unavailable."""
    lib = _lib()
    if lib is None:
        return False
    shape = tuple(out.shape)
    pad = (1,) * (4 - len(shape))
    words, strides = [], []
    for x in (c0, c1, c2):
        x = x.reshape((1,) * (len(shape) - x.dim()) + tuple(x.shape)).expand(shape)
        x = x.reshape(pad + shape) if x.dim() < 4 else x
        words.append(x)
        strides.append(torch.tensor(x.stride(), dtype=torch.int64))
    dims = torch.tensor(pad + shape, dtype=torch.int64)
    lib.attnkit_philox(words[0].data_ptr(), strides[0].data_ptr(), words[1].data_ptr(),
                       strides[1].data_ptr(), words[2].data_ptr(), strides[2].data_ptr(),
                       dims.data_ptr(), offset, seed, 0 if threshold is not None else 1,
                       threshold or 0, out.data_ptr())
    return True


def _plain_f32(*xs: Tensor) -> bool:
    return all(x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
               for x in xs)


def alibi_tile(ip: Tensor, j: Tensor, slopes: Tensor, vis: Optional[Tensor],
               dtype: torch.dtype, cols: Optional[Tuple[Tensor, Tensor]] = None
               ) -> Optional[Tensor]:
    """ALiBi's additive tile ``-slope * |i' - j|`` in ``dtype`` (``-inf`` where ``vis`` is
    False, and outside ``cols``), ``(N, H, rows, keys)``, in one pass and bit for bit what
    :func:`attnkit.score_terms.alibi_term` builds in torch ops (each value rounded as torch's
    casts and multiply round it): ``ip (N|1, 1, rows, 1)`` the aligned query positions,
    ``j (keys,)`` the key positions, ``slopes (N|1, H, rows|1, 1)`` (float32 or ``dtype``),
    ``vis (N|1, 1, rows, keys)`` bool or None, ``cols`` None or two int64 tensors shaped as
    ``ip``: row ``r`` sees columns ``cols[0][r] <= c < cols[1][r]`` (a band on contiguous
    keys, without a bool tile). None when the kernel is unavailable or the call does not
    qualify (slopes that need a gradient, other shapes or devices): the caller uses torch."""
    lib = _lib()
    if lib is None or dtype not in _DTYPES or slopes.dtype not in (torch.float32, dtype):
        return None
    if any(x.device.type != "cpu" for x in (ip, j, slopes)) or (
            slopes.requires_grad and torch.is_grad_enabled()):
        return None
    if (ip.dim() != 4 or ip.shape[1] != 1 or ip.shape[3] != 1 or j.dim() != 1
            or slopes.dim() != 4 or slopes.shape[3] != 1 or ip.dtype != torch.int64):
        return None
    rows, keys, heads, s_r = ip.shape[2], j.shape[0], slopes.shape[1], slopes.shape[2]
    v_n = 1
    if vis is not None:
        if (vis.device.type != "cpu" or vis.dtype != torch.bool or vis.dim() != 4
                or vis.shape[1] != 1 or tuple(vis.shape[2:]) != (rows, keys)):
            return None
        v_n = vis.shape[0]
    n = max(ip.shape[0], slopes.shape[0], v_n)
    if s_r not in (1, rows) or any(m not in (1, n) for m in (ip.shape[0], slopes.shape[0], v_n)):
        return None
    ipc = ip.reshape(ip.shape[0], rows).contiguous()
    bounds = None
    if cols is not None:
        if any(c.shape != ip.shape or c.dtype != torch.int64 or c.device.type != "cpu"
               for c in cols):
            return None
        bounds = [c.reshape(ip.shape[0], rows).contiguous() for c in cols]
    jc = j.to(torch.int64).contiguous()
    sc = slopes.detach().to(torch.float32).reshape(slopes.shape[0], heads, s_r).contiguous()
    vc = None if vis is None else vis.reshape(v_n, rows, keys).contiguous()
    out = torch.empty(n, heads, rows, keys, dtype=dtype)
    scratch = torch.empty(2 * keys, dtype=torch.float32)  # key positions, a row's distances
    rc = lib.attnkit_alibi_tile(out.data_ptr(), _DTYPES[dtype], n, heads, rows, keys,
                                ipc.data_ptr(), ipc.shape[0], jc.data_ptr(), sc.data_ptr(),
                                sc.shape[0], s_r, None if vc is None else vc.data_ptr(), v_n,
                                None if bounds is None else bounds[0].data_ptr(),
                                None if bounds is None else bounds[1].data_ptr(),
                                scratch.data_ptr())
    return out if rc == 0 else None  # (AK_BAD_ARGS: the caller's torch ops)


def softcap_forward_(x: Tensor, cap: float) -> bool:
    """``x <- cap * tanh(x)`` in place (float32, contiguous, CPU), one pass; False (nothing
    done) when the kernel is unavailable or ``x`` does not qualify."""
    lib = _lib()
    if lib is None or not _plain_f32(x):
        return False
    lib.attnkit_softcap_forward(x.data_ptr(), x.numel(), float(cap), torch.get_num_threads())
    return True


def softcap_backward(ds: Tensor, raw: Tensor, cap: float) -> Optional[Tensor]:
    """``ds * cap * (1 - tanh(raw)**2)``, the gradient through ``cap * tanh(raw)``, in one
    pass; None when the kernel is unavailable or the tensors do not qualify."""
    lib = _lib()
    if lib is None or ds.shape != raw.shape or not _plain_f32(ds, raw):
        return None
    out = torch.empty_like(ds)
    lib.attnkit_softcap_backward(ds.data_ptr(), raw.data_ptr(), out.data_ptr(), ds.numel(),
                                 float(cap), torch.get_num_threads())
    return out


_POOL_STATS = ("threads", "calls", "parallel_runs", "busy_runs", "woken", "caller_extra",
               "last_threads", "team_late", "team_held")


#: keys per block of the flash kernel (attnkit.h's AK_FLASH_BLOCK): key segment ids and
#: relative-position tables must reach this far past the last key
FLASH_BLOCK = _C["AK_FLASH_BLOCK"]
_FLASH_MAX_DIM = _C["AK_FLASH_MAX_DIM"]
#: bfloat16 inputs: q.k and P V in bfloat16 dot products (AVX512-BF16, D a multiple of 32),
#: P rounded to bfloat16 as torch's bfloat16 kernels round it; False: float32 arithmetic
FLASH_BF16_DOT = True
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _FlashArgs(ctypes.Structure):
    """ak_flash_args of attnkit.h, field for field (checked at load: _check_struct)."""

    _fields_ = [("q", _P), ("k", _P), ("v", _P), ("dtype", _I32), ("N", _I64), ("Hq", _I64),
                ("Hkv", _I64), ("Lq", _I64), ("Lk", _I64), ("d", _I64), ("dv", _I64),
                ("qs", _I64 * 3), ("ks", _I64 * 3), ("vs", _I64 * 3), ("scale", _F32),
                ("lo", _P), ("hi", _P), ("bounds_bstride", _I64), ("qseg", _P), ("kseg", _P),
                ("qseg_bstride", _I64), ("kseg_bstride", _I64), ("softcap", _F32),
                ("alibi", _P), ("alibi_bstride", _I64), ("ipos", _P), ("ipos_bstride", _I64),
                ("rel", _P), ("rel_hstride", _I64), ("rel_base", _I64), ("sinks", _P),
                ("kt", _P), ("vf", _P), ("out", _P), ("lse", _P), ("ws", _P),
                ("threads", _I32), ("bf16dot", _I32), ("out_dtype", _I32), ("bad", _P),
                ("dropout", _I32), ("drop_threshold", ctypes.c_uint32),
                ("drop_offset", ctypes.c_uint32), ("drop_seed", ctypes.c_uint64),
                ("drop_scale", _F32), ("table", _P), ("table_w", _I64), ("page", _I64),
                ("kv_len", _P), ("mx", _P), ("fp8", _I32), ("kd", _P), ("vd", _P)]


class _FlashGrads(ctypes.Structure):
    """ak_flash_grads of attnkit.h, field for field (checked at load: _check_struct)."""

    _fields_ = [("dout", _P), ("out", _P), ("dout_dtype", _I32), ("out_dtype", _I32),
                ("lse", _P), ("dlse", _P), ("delta", _P), ("dq", _P), ("dk", _P), ("dv", _P),
                ("drel", _P), ("drel_wstride", _I64), ("grad_dtype", _I32), ("dq_out", _P)]


class FlashNonFinite(ArithmeticError):
    """An input of a flash kernel call holds a NaN or an infinity (the kernel's result would
    not carry them as the math does): the caller runs another path."""


# ---- the interface at load: the library against attnkit.h, attnkit.h against this module --

#: the shared structs of attnkit.h and the classes that mirror them
_STRUCTS = {"ak_flash_args": _FlashArgs, "ak_flash_grads": _FlashGrads}


def _describe_ctype(t: Any) -> str:
    """A ctypes type as its C meaning: ``int64``, ``uint32``, ``float32``, ``pointer``,
    ``int64[3]``."""
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return f"{_describe_ctype(t._type_)}[{t._length_}]"
    if t in (ctypes.c_void_p, ctypes.c_char_p) or (
            isinstance(t, type) and issubclass(t, ctypes._Pointer)):
        return "pointer"
    if t is ctypes.c_float:
        return "float32"
    if t is ctypes.c_double:
        return "float64"
    code = getattr(t, "_type_", None)
    if isinstance(code, str) and code in "bBhHiIlLqQ":
        return f"{'int' if code.islower() else 'uint'}{8 * ctypes.sizeof(t)}"
    return getattr(t, "__name__", repr(t))


def _describe_c(c_type: str, count: Optional[int]) -> str:
    """A C type of attnkit.h as :func:`_describe_ctype` describes its ctypes type."""
    one = "pointer" if c_type.endswith("*") else _describe_ctype(_SCALARS[c_type])
    return one if count is None else f"{one}[{count}]"


def _check_struct(name: str, cls: Any, fields: List[Tuple[str, str, Optional[int]]],
                  layout: Optional[Dict[str, Tuple[int, int]]] = None) -> List[str]:
    """How the ctypes Structure ``cls`` differs from attnkit.h's struct ``name`` (its
    ``fields``: C type, field, array count) and, with ``layout`` (``"name"`` and
    ``"name.field"`` -> (offset, size), what the library reports), from the compiler's layout:
    every field in order, its type, offset and size, and the whole size. Empty when they
    agree."""
    ours = [(f[0], f[1]) for f in cls._fields_]
    problems = []
    for i in range(max(len(ours), len(fields))):
        theirs = fields[i] if i < len(fields) else None
        mine = ours[i] if i < len(ours) else None
        if theirs is None:
            problems.append(f"{cls.__name__} has field {mine[0]!r} (number {i + 1}), which "
                            f"attnkit.h's {name} lacks")
        elif mine is None:
            problems.append(f"attnkit.h's {name} has field {theirs[1]!r} (number {i + 1}, "
                            f"{theirs[0]}), which {cls.__name__} lacks")
        elif mine[0] != theirs[1]:
            problems.append(f"field number {i + 1} of {name} is {theirs[1]!r} in attnkit.h but "
                            f"{mine[0]!r} in {cls.__name__}")
        elif _describe_c(theirs[0], theirs[2]) != _describe_ctype(mine[1]):
            problems.append(f"{name}.{theirs[1]} is {theirs[0]}"
                            f"{'' if theirs[2] is None else f'[{theirs[2]}]'} "
                            f"({_describe_c(theirs[0], theirs[2])}) in attnkit.h but "
                            f"{_describe_ctype(mine[1])} in {cls.__name__}")
        if problems:  # (after the first difference the rest are shifted: one is enough)
            return problems
    if layout is None:
        return problems
    entries = [(name, 0, ctypes.sizeof(cls))] + [
        (f"{name}.{f}", getattr(cls, f).offset, getattr(cls, f).size) for f, _ in ours]
    for key, offset, size in entries:
        if key not in layout:
            problems.append(f"the library reports no {key} (it was built from another "
                            f"attnkit.h)")
            continue
        c_offset, c_size = layout[key]
        if key == name and c_size != size:
            problems.append(f"{name} has {c_size} bytes in the library but {size} in "
                            f"{cls.__name__}")
        elif key != name and (c_offset, c_size) != (offset, size):
            problems.append(f"{key} lies at offset {c_offset}, {c_size} bytes, in the library "
                            f"but at offset {offset}, {size} bytes, in {cls.__name__}")
    known = {e[0] for e in entries}
    extra = sorted(k for k in layout if k.split(".")[0] == name and k not in known)
    problems += [f"the library reports {k}, which attnkit.h's {name} lacks" for k in extra]
    return problems


def _library_tables(lib: Any) -> Tuple[Dict[str, int], Dict[str, Tuple[int, int]],
                                       Dict[int, Tuple[Optional[str], Optional[str]]]]:
    """The library's own view of the interface: its constants, its structs' layouts and, for
    every code of attnkit.h's table, the name and message it gives."""
    value, offset, size = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
    constants: Dict[str, int] = {}
    for i in range(10_000):
        name = lib.attnkit_abi_constant(i, ctypes.byref(value))
        if name is None:
            break
        constants[name.decode()] = value.value
    layout: Dict[str, Tuple[int, int]] = {}
    for i in range(10_000):
        name = lib.attnkit_abi_field(i, ctypes.byref(offset), ctypes.byref(size))
        if name is None:
            break
        layout[name.decode()] = (offset.value, size.value)
    errors = {}
    for code in _INTERFACE.errors:
        n, m = lib.attnkit_error_name(code), lib.attnkit_error_message(code)
        errors[code] = (None if n is None else n.decode(), None if m is None else m.decode())
    return constants, layout, errors


def _check_interface(spec: _Interface, constants: Dict[str, int],
                     layout: Dict[str, Tuple[int, int]],
                     errors: Dict[int, Tuple[Optional[str], Optional[str]]]) -> List[str]:
    """How the library (its ``constants``, struct ``layout`` and ``errors``, as
    :func:`_library_tables` reads them) and this module differ from attnkit.h's ``spec``:
    each constant's value, each struct against its ctypes class, each error code's name and
    message, and the Python tables sized by the header. Empty when everything agrees."""
    problems = []
    for name, value in spec.constants.items():
        if name not in constants:
            problems.append(f"constant {name}: attnkit.h says {value}, the library has none")
        elif constants[name] != value:
            problems.append(f"constant {name}: attnkit.h says {value}, the library was built "
                            f"with {constants[name]}")
    problems += [f"constant {name}: the library has {constants[name]}, attnkit.h has none"
                 for name in constants if name not in spec.constants]
    for name in sorted(set(spec.structs) | set(_STRUCTS)):
        if name not in _STRUCTS:
            problems.append(f"attnkit.h declares struct {name}, which attnkit.native has no "
                            f"ctypes class for (add it to _STRUCTS)")
        elif name not in spec.structs:
            problems.append(f"attnkit.native's {_STRUCTS[name].__name__} mirrors struct {name}, "
                            f"which attnkit.h does not declare (AK_FIELDS_{name})")
        else:
            problems += _check_struct(name, _STRUCTS[name], spec.structs[name], layout)
    for code, (name, message) in spec.errors.items():
        if errors.get(code) != (name, message):
            found = errors.get(code, (None, None))
            problems.append(f"error code {code}: attnkit.h has {name} ({message!r}), the library "
                            f"{found[0]} ({found[1]!r})")
    unknown = sorted(set(_ERROR_TYPES) - {n for n, _ in spec.errors.values()})
    if unknown:
        problems.append(f"attnkit.native raises its own exception for {', '.join(unknown)}, "
                        f"which attnkit.h's AK_ERRORS does not list")
    if len(_POOL_STATS) != spec.constants.get("AK_POOL_STATS"):
        problems.append(f"constant AK_POOL_STATS: attnkit.h says "
                        f"{spec.constants.get('AK_POOL_STATS')}, attnkit.native names "
                        f"{len(_POOL_STATS)} counters (_POOL_STATS)")
    return problems


class _Kernels:
    """The loaded library's functions, one attribute each, bound as attnkit.h declares them
    (argtypes, restype); nothing else: a function the header does not declare is no
    attribute (AttributeError) rather than an unchecked ctypes default."""

    def __init__(self, path: str, cdll: ctypes.CDLL) -> None:
        self.path = path
        self.cdll = cdll


def _bind(path: str, cdll: ctypes.CDLL, spec: _Interface
          ) -> Tuple[Optional[_Kernels], List[str]]:
    """Every function attnkit.h declares, from ``cdll``, with its argtypes and restype; or
    what the library lacks."""
    lib, missing = _Kernels(path, cdll), []
    for name, proto in spec.functions.items():
        try:
            fn = getattr(cdll, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = _ctype_of(proto.restype, name, result=True)
        fn.argtypes = [_ctype_of(t, name) for t in proto.argtypes]
        setattr(lib, name, fn)
    if missing:
        return None, [f"attnkit.h declares {', '.join(missing)}, which {path} does not export "
                      f"(it was built from other sources)"]
    return lib, []


#: the Python exception of an error code (by its name in attnkit.h); RuntimeError for others
_ERROR_TYPES: Dict[str, type] = {"AK_NONFINITE": FlashNonFinite, "AK_BAD_ARGS": ValueError,
                                 "AK_NO_MEMORY": MemoryError}


def kernel_error(code: int, function: str, detail: str = "") -> Exception:
    """The exception for the nonzero return ``code`` of the native ``function`` (its name in
    attnkit.h, e.g. ``"attnkit_flash_forward"``), from attnkit.h's error table (the one place
    a code becomes an exception): :class:`FlashNonFinite` for ``AK_NONFINITE``, ValueError
    for ``AK_BAD_ARGS``, MemoryError for ``AK_NO_MEMORY``, RuntimeError for the others, with a
    message naming the function, the code's name and value, its message and ``detail`` (the
    caller's context). A code the table lacks gives a RuntimeError that says so."""
    entry = _INTERFACE.errors.get(int(code))
    if entry is None:
        return RuntimeError(
            f"{function} returned {code}, which attnkit.h's error table (AK_ERRORS) does not "
            f"name: the library and attnkit.h differ; rebuild the kernels (remove the kernel "
            f"cache folder) or reinstall attnkit")
    name, message = entry
    text = f"{function}: {message} ({name} = {code})"
    return _ERROR_TYPES.get(name, RuntimeError)(f"{text}; {detail}" if detail else text)


def error_codes() -> Dict[str, Tuple[int, str]]:
    """attnkit.h's error table: each code's name -> (value, message)."""
    return {name: (code, message) for code, (name, message) in _INTERFACE.errors.items()}


def _rows_i32(x: Optional[Tensor], n: int, length: int, name: str) -> Tuple[Optional[Tensor], int]:
    """``x`` (N|1, length) as contiguous int32 and its batch stride (0 when shared)."""
    if x is None:
        return None, 0
    if x.dim() != 2 or x.shape[0] not in (1, n) or x.shape[1] != length:
        raise ValueError(f"flash_forward: {name} must be (N or 1, {length}); got "
                         f"{tuple(x.shape)}")
    x = x.to(torch.int32).contiguous()
    return x, (length if x.shape[0] == n and n > 1 else 0)


@dataclass
class FlashTerms:
    """What the flash kernel evaluates besides ``q k^T``, for :func:`flash_forward` and
    :func:`flash_backward`.

    Row ``i`` of batch row ``b`` sees keys ``lo[b, i] <= j < hi[b, i]`` (``lo``/``hi`` are
    ``(N|1, Lq)``) and, with ``segments = (ids_q (N|1, Lq), ids_kv (N|1, Lk + FLASH_BLOCK))``,
    only keys of its own segment. Score terms: ``softcap`` (> 0: ``cap * tanh(s / cap)``),
    ALiBi ``alibi (N|1, Hq)`` slopes with ``ipos (N|1, Lq)`` the aligned row positions
    (``-slope * |ipos - j|``), a relative table ``rel (Hq|1, T)`` read at ``j - i + rel_base``
    (every visited key block must index inside it: ``T >= rel_base + nkb * FLASH_BLOCK`` and
    ``rel_base >= Lq - 1``), ``sinks (Hq,)`` one extra logit per head (forward only: its
    gradient is the caller's). ``dropout = (p, seed, offset)``: weights dropped after the
    softmax's sum, kept ones scaled by ``1 / (1 - p)``."""

    lo: Tensor
    hi: Tensor
    segments: Optional[Tuple[Tensor, Tensor]] = None
    softcap: float = 0.0
    alibi: Optional[Tensor] = None
    ipos: Optional[Tensor] = None
    rel: Optional[Tensor] = None
    rel_base: int = 0
    sinks: Optional[Tensor] = None
    #: dropout: ``(p, seed, offset)`` with ``0 < p < 1``, the keep decisions of
    #: :func:`attnkit.dropout.keep_mask` for (batch row, query head, row, key)
    dropout: Optional[Tuple[float, int, int]] = None


@dataclass
class FlashPages:
    """Keys and values read in place from pages through a block table (the flash forward
    only; FlashAttention's ``block_table`` layout): the ``k`` and ``v`` of the call are then the
    pages ``(P, page, Hkv, D)`` and ``(P, page, Hkv, Dv)``, ``block_table (N, W)`` lists batch
    row b's pages in order (key j in slot ``j % page`` of page ``block_table[b, j // page]``)
    and ``lengths (N,)`` its keys, at most ``W * page``. The call's ``Lk`` is ``W * page`` (the
    gathered shape: the terms are made for it); entries past a row's pages are never read.

    fp8 pages (float8_e4m3fn / float8_e5m2) take ``k_descale`` and ``v_descale``, float32
    ``(P, Hkv)``: the real value of ``k[p, t, h]`` is ``k[p, t, h] * k_descale[p, h]``. The
    kernel dequantizes them as it packs each block, into q's dtype (what
    :func:`attnkit.gather_kv` with ``dtype=q.dtype`` gives), so the result is that of the
    call on the gathered pages."""

    block_table: Tensor
    lengths: Tensor
    k_descale: Optional[Tensor] = None
    v_descale: Optional[Tensor] = None


def _page_descales(pages: FlashPages, k: Tensor, v: Tensor) -> List[Tensor]:
    """The descales of fp8 pages ``k``, ``v`` (one fp8 dtype) as float32 ``(P, Hkv)``
    contiguous tensors (the given ones where they are already so: the kernel reads them at
    each call), checked; ``[]`` for pages that are not fp8, which take none."""
    if k.dtype not in _FP8:
        if pages.k_descale is not None or pages.v_descale is not None:
            raise ValueError(f"flash: pages.k_descale/v_descale are for fp8 pages; the pages "
                             f"are {k.dtype}: drop them")
        return []
    if v.dtype != k.dtype:
        raise TypeError(f"flash: fp8 pages k and v must share one dtype; got {k.dtype} and "
                        f"{v.dtype}")
    want = (k.shape[0], k.shape[2])
    out = []
    for name, d in (("k_descale", pages.k_descale), ("v_descale", pages.v_descale)):
        if not isinstance(d, Tensor) or tuple(d.shape) != want or d.device.type != "cpu" or (
                not d.dtype.is_floating_point or d.dtype in _FP8):
            raise ValueError(f"flash: fp8 pages need pages.{name}, a float32 CPU tensor "
                             f"{want} (num_pages, Hkv); got "
                             f"{tuple(d.shape) if isinstance(d, Tensor) else type(d).__name__}")
        out.append(d.detach().to(torch.float32).contiguous())
    return out


def _page_table(pages: FlashPages, n: int, num_pages: int, page: int) -> Tuple[Tensor, Tensor]:
    """The block table and lengths as contiguous int64, checked: the kernel reads memory
    through every entry a row's length uses."""
    table, lens = pages.block_table, pages.lengths
    for name, x, shape in (("block_table", table, f"({n}, W)"), ("lengths", lens, f"({n},)")):
        if not isinstance(x, Tensor) or x.dtype.is_floating_point or x.dtype == torch.bool or (
                x.dim() != (2 if name == "block_table" else 1) or x.shape[0] != n):
            raise ValueError(f"flash: pages.{name} must be an integer tensor {shape} (one row "
                             f"per batch row of q); got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    width = table.shape[1]
    table, lens = table.to(torch.int64).contiguous(), lens.to(torch.int64).contiguous()
    if n and (int(lens.min()) < 0 or int(lens.max()) > width * page):
        raise ValueError(f"flash: pages.lengths must lie in [0, W * page] = [0, {width * page}]; "
                         f"got values in [{int(lens.min())}, {int(lens.max())}] (a longer row "
                         f"needs more block_table columns)")
    used = torch.arange(width) < (-(-lens // page)).view(-1, 1)
    wrong = used & ((table < 0) | (table >= num_pages))
    if bool(wrong.any()):
        b, c = (int(i) for i in wrong.nonzero()[0])
        raise ValueError(f"flash: pages.block_table[{b}, {c}] = {int(table[b, c])} is not a page "
                         f"index in [0, {num_pages}) but row {b}'s {int(lens[b])} keys use it; "
                         f"list the row's pages there")
    return table, lens


def _kv_form(n: int, d: int, k: Tensor, v: Tensor, pages: Optional[FlashPages]
             ) -> Tuple[int, int, int]:
    """``(Hkv, Lk, Dv)`` of k and v, checked against q's batch rows ``n`` and head dim ``d``:
    ``(N, Hkv, Lk, D)`` and ``(N, Hkv, Lk, Dv)``, or with ``pages`` the pages ``(P, page, Hkv,
    D)`` and ``(P, page, Hkv, Dv)`` (``Lk = W * page``)."""
    fits = k.dim() == 4 and v.dim() == 4 and v.shape[:3] == k.shape[:3] and k.shape[3] == d
    if pages is None:
        if not fits or k.shape[0] != n:
            raise ValueError(f"flash: shapes k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                             f"(N, Hkv, Lk, D), (N, Hkv, Lk, Dv) with q's N = {n}, D = {d}")
        return k.shape[1], k.shape[2], v.shape[3]
    if not fits:
        raise ValueError(f"flash: pages k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         f"(P, page, Hkv, D), (P, page, Hkv, Dv) with q's D = {d}")
    return k.shape[2], pages.block_table.shape[-1] * k.shape[1], v.shape[3]


def _flash_args(q: Tensor, k: Tensor, v: Tensor, scale: float, t: FlashTerms, backward: bool,
                pages: Optional[FlashPages] = None) -> Tuple[_FlashArgs, List[Any]]:
    """The kernel's argument block for these inputs and terms (validated), and the tensors it
    points into: ``q, k, v`` (unit stride along the head dim; copies where they were not)
    first, then the terms' (kept alive by the caller until the call returns). The workspace
    is the caller's (:func:`_workspace`). ``pages``: k and v are pages read through its block
    table (the forward only)."""
    dtype = _DTYPES.get(q.dtype)
    fp8 = pages is not None and k.dtype in _FP8
    if dtype is None or (not fp8 and (k.dtype != q.dtype or v.dtype != q.dtype)):
        raise TypeError(f"flash: q, k and v must share one dtype of float32, bfloat16 "
                        f"or float16 (or k and v be fp8 pages); got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if q.dim() != 4:
        raise ValueError(f"flash: q must be (N, Hq, Lq, D); got {tuple(q.shape)}")
    n, hq, lq, d = q.shape
    hkv, lk, dv = _kv_form(n, d, k, v, pages)
    if hkv == 0 or hq % hkv:
        raise ValueError(f"flash: q has {hq} heads and k {hkv}; Hq must be a multiple of Hkv "
                         f"(grouped-query attention)")
    if pages is not None and backward:
        raise ValueError("flash: the backward reads contiguous K/V; gather the pages first "
                         "(attnkit.gather_kv)")
    if d % 16 or dv % 16 or not 0 < max(d, dv) <= _FLASH_MAX_DIM or min(d, dv) <= 0:
        raise ValueError(f"flash: head dims must be multiples of 16 up to "
                         f"{_FLASH_MAX_DIM}; got D={d}, Dv={dv}")
    if any(x.device.type != "cpu" for x in (q, k, v)):
        raise ValueError("flash runs on CPU tensors")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    threads = max(1, min(torch.get_num_threads(), _C["AK_POOL_MAX"]))
    table = lens = None
    if pages is not None:
        table, lens = _page_table(pages, n, k.shape[0], k.shape[1])
    nkb = -(-lk // FLASH_BLOCK)
    lo32, lo_bs = _rows_i32(t.lo, n, lq, "lo")
    hi32, _ = _rows_i32(t.hi, n, lq, "hi")
    if lo32.shape[0] != hi32.shape[0]:  # (one batch stride for both)
        lo32, hi32 = (x.expand(n, lq).contiguous() for x in (lo32, hi32))
        lo_bs = lq
    keep: List[Any] = [q, k, v, lo32, hi32]
    a = _FlashArgs(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dtype=dtype, N=n, Hq=hq,
                   Hkv=hkv, Lq=lq, Lk=lk, d=d, dv=dv, scale=float(scale), lo=lo32.data_ptr(),
                   hi=hi32.data_ptr(), bounds_bstride=lo_bs, softcap=float(t.softcap),
                   threads=threads)
    a.qs[:] = [q.stride(0), q.stride(1), q.stride(2)]
    for name, x in (("ks", k), ("vs", v)):  # (batch row | page, head, key | slot)
        dims = (0, 1, 2) if pages is None else (0, 2, 1)
        getattr(a, name)[:] = [x.stride(i) for i in dims]
    if table is not None:
        a.table, a.table_w, a.page, a.kv_len = (table.data_ptr(), table.shape[1], k.shape[1],
                                                lens.data_ptr())
        keep += [table, lens]
        descales = _page_descales(pages, k, v)
        if descales:
            a.fp8, a.kd, a.vd = _FP8[k.dtype], descales[0].data_ptr(), descales[1].data_ptr()
            keep += descales
    if t.segments is not None:
        sq, sq_bs = _rows_i32(t.segments[0], n, lq, "segments[0]")
        sk, sk_bs = _rows_i32(t.segments[1], n, lk + FLASH_BLOCK, "segments[1]")
        a.qseg, a.kseg = sq.data_ptr(), sk.data_ptr()
        a.qseg_bstride, a.kseg_bstride = sq_bs, sk_bs
        keep += [sq, sk]
    if t.alibi is not None:
        if t.ipos is None:
            raise ValueError("flash: alibi needs ipos, the aligned row positions")
        if t.alibi.dim() != 2 or t.alibi.shape[0] not in (1, n) or t.alibi.shape[1] != hq:
            raise ValueError(f"flash: alibi must be (N or 1, {hq}); got "
                             f"{tuple(t.alibi.shape)}")
        sl = (t.alibi.detach().to(torch.float32) * _LOG2E).contiguous()
        ip, ip_bs = _rows_i32(t.ipos, n, lq, "ipos")
        a.alibi, a.alibi_bstride = sl.data_ptr(), (hq if sl.shape[0] == n and n > 1 else 0)
        a.ipos, a.ipos_bstride = ip.data_ptr(), ip_bs
        keep += [sl, ip]
    if t.rel is not None:
        rel, base = t.rel, t.rel_base
        if (rel.dim() != 2 or rel.shape[0] not in (1, hq) or base < lq - 1
                or rel.shape[1] < base + nkb * FLASH_BLOCK):
            raise ValueError(f"flash: rel must be (Hq or 1, >= rel_base + "
                             f"{nkb * FLASH_BLOCK}) with rel_base >= Lq - 1 = {lq - 1}; got "
                             f"{tuple(rel.shape)}, rel_base={base}")
        rt = (rel.detach().to(torch.float32) * _LOG2E).contiguous()
        a.rel, a.rel_hstride = rt.data_ptr(), (rt.shape[1] if rt.shape[0] > 1 else 0)
        a.rel_base = base
        keep.append(rt)
    if t.dropout is not None:
        p, seed, offset = t.dropout
        if not 0.0 < p < 1.0 or not 0 <= seed < 2**64 or not 0 <= offset < 2**32 or (
                n > 2**16 or hq > 2**16):
            raise ValueError(f"flash: dropout needs 0 < p < 1, a 64-bit seed, a 32-bit offset "
                             f"and at most 65536 batch rows and heads; got p={p}, seed={seed}, "
                             f"offset={offset}, N={n}, Hq={hq}")
        a.dropout, a.drop_seed, a.drop_offset = 1, seed, offset
        a.drop_threshold = math.ceil(p * 2.0**24)
        a.drop_scale = 1.0 / (1.0 - p)
    if t.sinks is not None and not backward:
        sk_t = t.sinks.detach().to(torch.float32).reshape(-1).contiguous()
        if sk_t.numel() != hq:
            raise ValueError(f"flash: sinks must have {hq} entries; got {sk_t.numel()}")
        a.sinks = sk_t.data_ptr()
        keep.append(sk_t)
    return a, keep


def _flash_ready() -> bool:
    return _lib() is not None and bool(_state["info"].get("flash"))


def _workspace(a: _FlashArgs, backward: bool) -> List[Tensor]:
    """The per-thread workspace and the non-finite flag of one kernel call, pointed to by
    ``a`` (fresh for every call: concurrent calls of one form must not share them)."""
    ws = torch.empty(a.threads * _lib().attnkit_flash_workspace(int(backward)),
                     dtype=torch.float32)
    bad = torch.zeros(1, dtype=torch.int32)
    a.ws, a.bad = ws.data_ptr(), bad.data_ptr()
    return [ws, bad]


class FlashForward:
    """:func:`flash_forward` prepared for one form of call: the shapes, strides and dtypes of
    ``q, k, v`` and the terms, checked and packed once. :meth:`run` takes tensors of that form
    (:meth:`fits` says whether they are) and only allocates and launches, which is what a
    call that recurs (the same shapes, step after step) needs. It holds the terms' tensors
    (and with ``pages`` the block table, lengths and fp8 descales), never the inputs."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, scale: float, terms: FlashTerms,
                 pages: Optional[FlashPages] = None):
        a, keep = _flash_args(q, k, v, scale, terms, backward=False, pages=pages)
        self.lib = _lib()
        self.terms = terms
        self.pages = pages
        self.form = tuple((x.shape, x.stride()) for x in keep[:3])
        self.dtype = q.dtype
        self.kv_dtype = k.dtype
        self._keep = keep[3:]
        self._args = a  # a template: every call fills in its own pointers on a copy
        nkb = -(-a.Lk // FLASH_BLOCK)
        self._kt = a.N * a.Hkv * nkb * a.d * FLASH_BLOCK
        # values are read in place only as float32 rows dv apart (from pages they are always
        # packed: a block of them is no one strided run; a transposed view's rows, read in
        # place, left P V waiting on memory)
        plain = q.dtype == torch.float32 and pages is None and v.stride(2) == a.dv
        self._vf = 0 if plain else a.N * a.Hkv * a.Lk * a.dv
        self._bf16 = (q.dtype == torch.bfloat16 and a.d % 32 == 0
                      and bool(_state["info"].get("flash_bf16")))

    def fits(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether ``q, k, v`` are CPU tensors of this call's dtype, shapes and strides and
        the kernel library is still the one it was prepared for."""
        dt, kvt = self.dtype, self.kv_dtype
        return (_state.get("lib") is self.lib and q.dtype == dt and k.dtype == kvt
                and v.dtype == kvt and q.is_cpu and k.is_cpu and v.is_cpu
                and (q.shape, q.stride()) == self.form[0]
                and (k.shape, k.stride()) == self.form[1]
                and (v.shape, v.stride()) == self.form[2])

    def backward_args(self, q: Tensor, k: Tensor, v: Tensor) -> _FlashArgs:
        """The argument block of :func:`flash_backward` for tensors that :meth:`fits` (the
        backward reads no sinks: their gradient is the caller's)."""
        if self.pages is not None:
            raise ValueError("flash_backward: the backward reads contiguous K/V; gather the "
                             "pages first (attnkit.gather_kv)")
        a = self._args_for(q, k, v)
        a.sinks = None
        return a

    def _args_for(self, q: Tensor, k: Tensor, v: Tensor) -> _FlashArgs:
        """A copy of the argument block, pointing at ``q, k, v``."""
        a = _FlashArgs.from_buffer_copy(self._args)
        a.q, a.k, a.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        return a

    def run(self, q: Tensor, k: Tensor, v: Tensor, max_scores: Optional[Tensor] = None
            ) -> Tuple[Tensor, Tensor]:
        """``(out, lse)`` for tensors that :meth:`fits`; raises :class:`FlashNonFinite` when
        an input is not finite. ``max_scores``: a contiguous float32 ``(N, Hq, Lq)`` tensor
        that gets each row's largest score (after every term, natural units; -inf for a row
        that sees no key)."""
        a = self._args_for(q, k, v)
        n, hq, lq, lk, dv = a.N, a.Hq, a.Lq, a.Lk, a.dv
        if max_scores is not None:
            if (tuple(max_scores.shape) != (n, hq, lq) or max_scores.dtype != torch.float32
                    or not max_scores.is_contiguous() or not max_scores.is_cpu):
                raise ValueError(f"flash_forward: max_scores must be a contiguous float32 CPU "
                                 f"tensor {(n, hq, lq)}; got {tuple(max_scores.shape)} "
                                 f"{max_scores.dtype}")
            a.mx = max_scores.data_ptr()
        out = torch.empty(n, hq, lq, dv, dtype=self.dtype)
        lse = torch.empty(n, hq, lq, dtype=torch.float32)
        if n * hq * lq == 0:
            return out, lse
        if lk == 0:
            if max_scores is not None:
                max_scores.fill_(float("-inf"))
            return out.zero_(), lse.fill_(float("-inf"))
        keep = _workspace(a, backward=False)
        kt = torch.empty(self._kt, dtype=torch.float32)
        vf = torch.empty(self._vf, dtype=torch.float32) if self._vf else None
        a.kt, a.vf = kt.data_ptr(), (None if vf is None else vf.data_ptr())
        a.bf16dot = int(FLASH_BF16_DOT and self._bf16)
        a.out, a.lse, a.out_dtype = out.data_ptr(), lse.data_ptr(), _DTYPES[self.dtype]
        rc = self.lib.attnkit_flash_forward(ctypes.byref(a))
        del keep, kt, vf
        if rc != 0:  # AK_NONFINITE: FlashNonFinite (q, k or v holds a NaN or an infinity)
            raise kernel_error(rc, "attnkit_flash_forward")
        return out, lse


def flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, terms: FlashTerms,
                  pages: Optional[FlashPages] = None, max_scores: Optional[Tensor] = None
                  ) -> Optional[Tuple[Tensor, Tensor]]:
    """FlashAttention forward in float32 arithmetic with ``terms`` (:class:`FlashTerms`)
    evaluated in registers (``flash.c``): returns ``out (N, Hq, Lq, Dv)`` and the natural-log
    ``lse (N, Hq, Lq)``, float32, or None when the kernel is unavailable (no compiler, or a
    CPU without AVX-512).

    ``q (N, Hq, Lq, D)``, ``k (N, Hkv, Lk, D)``, ``v (N, Hkv, Lk, Dv)``: one dtype of float32,
    bfloat16 or float16, unit stride along the head dim, D and Dv multiples of 16 up to 256,
    Hq a multiple of Hkv. ``out`` comes in q's dtype. A row that sees no key (and has no sink)
    gets out 0 and lse -inf. Raises :class:`FlashNonFinite` when an input is not finite.
    ``pages`` (:class:`FlashPages`): k and v are pages read in place through its block table;
    ``max_scores``: see :meth:`FlashForward.run`."""
    q, k, v = _unit_stride(q, k, v)
    call = flash_prepare(q, k, v, scale, terms, pages)
    return None if call is None else call.run(q, k, v, max_scores)


def _unit_stride(*xs: Tensor) -> Tuple[Tensor, ...]:
    """4-D tensors with unit stride along the head dim (copies where it is not)."""
    return tuple(x if x.dim() != 4 or x.stride(-1) == 1 else x.contiguous() for x in xs)


def flash_prepare(q: Tensor, k: Tensor, v: Tensor, scale: float, terms: FlashTerms,
                  pages: Optional[FlashPages] = None) -> Optional[FlashForward]:
    """:func:`flash_forward`'s call for the form of ``q, k, v`` (checked as it checks them),
    to run on tensors of that form (their unit-stride versions: ``x.contiguous()`` where the
    head dim's stride is not 1), or None when the kernel is unavailable. With ``pages``, k and
    v are the pages (:class:`FlashPages`)."""
    if not _flash_ready():
        return None
    return FlashForward(*_unit_stride(q, k, v), scale, terms, pages)


def flash_backward(q: Tensor, k: Tensor, v: Tensor, scale: float, terms: FlashTerms,
                   dout: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor] = None,
                   table_grad: bool = False, grad_dtype: Optional[torch.dtype] = None,
                   prepared: Optional[FlashForward] = None
                   ) -> Optional[Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Tensor]]:
    """The gradients of :func:`flash_forward`'s output: ``dq, dk, dv`` (float32, or ``grad_dtype``
    (bfloat16, float16) written so by the kernel, rounded once from its float32 sums; shaped as
    q, k, v) for ``dout (N, Hq, Lq, Dv)``, from the forward's ``out`` and ``lse (N, Hq, Lq)``
    (and ``dlse``, the lse's gradient); the scores' softcap, ALiBi and relative terms as in the
    forward. Also returns, with ``table_grad``, the gradient of the expanded relative table
    ``terms.rel`` (same shape; the sums over the distances each table entry was clamped to are
    the table's gradient), else None; and ``delta = rowsum(dout * out) - dlse``, with which a
    sink's gradient is ``-sum exp(sink - lse) * delta``. ``prepared``: the forward's call
    (:func:`flash_prepare`) for these tensors and ``terms``, whose checked argument block it
    reuses where q, k, v still fit it. None when the kernel is unavailable; raises
    :class:`FlashNonFinite` when an input is not finite."""
    if not _flash_ready():
        return None
    if table_grad and terms.rel is None:
        raise ValueError("flash_backward: table_grad needs terms.rel")
    if prepared is not None and prepared.terms is terms and prepared.fits(q, k, v):
        a, keep = prepared.backward_args(q, k, v), []
    else:
        a, keep = _flash_args(q, k, v, scale, terms, backward=True)
    keep += _workspace(a, backward=True)
    n, hq, lq, lk, d, dv = a.N, a.Hq, a.Lq, a.Lk, a.d, a.dv
    shape = (n, hq, lq)
    if (tuple(dout.shape) != (*shape, dv) or tuple(out.shape) != (*shape, dv)
            or tuple(lse.shape) != shape or (dlse is not None and tuple(dlse.shape) != shape)):
        raise ValueError(f"flash_backward: dout and out must be {(*shape, dv)}, lse and dlse "
                         f"{shape}; got {tuple(dout.shape)}, {tuple(out.shape)}, "
                         f"{tuple(lse.shape)}, {None if dlse is None else tuple(dlse.shape)}")
    if grad_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"flash_backward: grad_dtype must be None, float32, bfloat16 or "
                        f"float16; got {grad_dtype}")
    gd = torch.float32 if grad_dtype is None else grad_dtype
    dq = torch.empty(a.threads, n, hq, lq, d, dtype=torch.float32)
    dk = torch.empty(n, a.Hkv, lk, d, dtype=gd)
    dvv = torch.empty(n, a.Hkv, lk, dv, dtype=gd)
    # dQ's own storage unless the one buffer is all there is (a view of threads buffers would
    # keep them all alive as long as the gradient)
    own_dq = gd != torch.float32 or a.threads > 1
    dq_out = torch.empty(n, hq, lq, d, dtype=gd) if own_dq else dq[0]
    delta = torch.empty(shape, dtype=torch.float32)
    drel = None
    if table_grad:  # one sum per kernel unit (dQ buffer, batch row, kv head), added up in order
        rows = hq // a.Hkv if terms.rel.shape[0] > 1 else 1  # the unit's heads' rows, or one
        drel = torch.zeros(a.threads, n, a.Hkv, rows, terms.rel.shape[1], dtype=torch.float32)

    def table_grad_sum() -> Optional[Tensor]:
        if drel is None:
            return None
        total = drel.sum((0, 1))  # (Hkv, rows, length)
        return (total.reshape(terms.rel.shape) if terms.rel.shape[0] > 1
                else total.sum(0))

    if n * hq * lq == 0 or lk == 0:
        return dq_out.zero_(), dk.zero_(), dvv.zero_(), table_grad_sum(), delta.zero_()

    def plain(x: Tensor) -> Tensor:
        x = x.detach()
        return (x if x.dtype in _DTYPES else x.to(torch.float32)).contiguous()

    do_c, out_c = plain(dout), plain(out)
    lse32 = lse.detach().to(torch.float32).contiguous()
    dlse32 = None if dlse is None else dlse.detach().to(torch.float32).contiguous()
    g = _FlashGrads(dout=do_c.data_ptr(), out=out_c.data_ptr(), dout_dtype=_DTYPES[do_c.dtype],
                    out_dtype=_DTYPES[out_c.dtype], lse=lse32.data_ptr(),
                    dlse=None if dlse32 is None else dlse32.data_ptr(), delta=delta.data_ptr(),
                    dq=dq.data_ptr(), dk=dk.data_ptr(), dv=dvv.data_ptr(),
                    grad_dtype=_DTYPES[gd],  # (written so by the kernel: no conversion op)
                    dq_out=dq_out.data_ptr() if own_dq else None)
    if drel is not None:
        g.drel, g.drel_wstride = drel.data_ptr(), drel[0, 0, 0].numel()
    a.bf16dot = int(FLASH_BF16_DOT and q.dtype == torch.bfloat16 and do_c.dtype == torch.bfloat16
                    and d % 32 == 0 and dv % 32 == 0 and bool(_state["info"].get("flash_bf16")))
    rc = _lib().attnkit_flash_backward(ctypes.byref(a), ctypes.byref(g))
    del keep
    if rc != 0:  # AK_NONFINITE: FlashNonFinite (q, k or v holds a NaN or an infinity)
        raise kernel_error(rc, "attnkit_flash_backward")
    return dq_out, dk, dvv, table_grad_sum(), delta


_LOG2E = 1.4426950408889634


def pool_stats() -> dict:
    """The native thread pool's counters in this process (decoding and softcap calls
    together): ``threads``, the pool's size (threads started, never stopped: it grows to the
    most a call has asked for, at most 63 besides the caller, and restarts empty in a forked
    child); ``calls``, kernel calls; ``parallel_runs``, calls that woke pool threads;
    ``busy_runs``, calls that found the pool in use by another thread and ran on their own
    thread; ``woken``, pool threads woken, all calls together; ``caller_extra``, work shares a
    caller ran because no pool thread had taken them yet; ``last_threads``, the threads the
    latest call ran on, the caller included (at most ``torch.get_num_threads()`` then, 1 for
    a call too small to repay waking a thread); ``team_late``, kernel calls on torch's OpenMP
    team one of whose threads started late (a busy machine: the calls of the next 200 ms run
    on the pool, whose caller never waits for a thread that has not started), and
    ``team_held``, the calls that ran on the pool for that reason. Empty when the kernels are
    unavailable."""
    lib = _lib()
    if lib is None:
        return {}
    buf = (ctypes.c_int64 * len(_POOL_STATS))()
    lib.attnkit_pool_stats(buf)
    return dict(zip(_POOL_STATS, buf))


def _team_tune(late_ns: int = -1, hold_ns: int = -1) -> None:
    """For tests: a kernel call on torch's OpenMP team one of whose threads starts more than
    ``late_ns`` after the call (< 0: every call) sends the calls of the next ``hold_ns`` to
    the pool; both -1 restore the defaults (1 ms, 200 ms). Ends any hold in force."""
    lib = _lib()
    if lib is not None:
        lib.attnkit_team_tune(int(late_ns), int(hold_ns))


def describe() -> str:
    """A one-line status for ``attnkit check`` and the benchmark notes."""
    if not available():
        return f"native kernels: unavailable ({unavailable_reason()})"
    info = build_info()
    if info.get("origin") == "prebuilt":
        return f"native kernels: prebuilt {info.get('variant')} ({info.get('flags')})"
    how = "cached" if info.get("cached") else f"built in {info.get('build_s', 0.0):.1f} s"
    where = ""
    if "cache_folder_unusable" in info:
        where = f"; in {info['folder']}: {info['cache_folder_unusable']}"
    return f"native kernels: built here, {how} ({info.get('flags')}){where}"
