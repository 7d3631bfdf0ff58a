"""The physical limits of this machine, measured now, and torch's matmul, time-bounded.

Every case's share is taken of what the cores and the memory can do at most, not of another
library's speed (torch's GEMM, which attnkit's kernels can outrun):

* ``fma_float32_gflops``: float32 multiply-add throughput, every thread running independent
  accumulators on full vector registers (``attnkit/native/peak.c``; the AVX-512 or AVX2
  build, as the kernels are built). The limit of float32 and float16 calls. Each thread's
  rate is taken over its own CPU time, so a busy machine (another process on a core) does
  not lower it; a core running alone may turbo a little higher than with all busy.
* ``dot_bfloat16_gflops``: the ``vdpbf16ps`` rate on a CPU with AVX512-BF16, the limit of
  bfloat16 calls there (the flash kernel's bfloat16 dot products); elsewhere None, and
  bfloat16 computes in float32, so the FMA rate is its limit.
* ``copy_gbps``: bytes copied per second by ``memcpy`` of a buffer larger than the caches,
  one share per thread (the read and write traffic is twice this): the limit of decoding,
  which reads every cached key and value once. A pure read can exceed it.

A case's share is its roofline (:meth:`Limits.share`): the time the limit allows for its
FLOPs or for its K/V bytes, whichever is longer, over its median time.

Each limit is timed for about a quarter of a second (:data:`LIMIT_BUDGET_S`), so all of them
take a second or two. Without the native kernels (no C compiler, ``ATTNKIT_NATIVE=0``) the
compute limits are unknown (None, with the reason) and the copy falls back to torch's
``copy_``.

torch's matmul (:func:`torch_matmul`, the "% of matmul" column) is timed at the largest of
512^3, 1024^3, 2048^3 whose calls fit :data:`MATMUL_BUDGET_S` by the rate at the size
below (from a 256^3 probe up), and not at all in bfloat16 where torch's bfloat16 matmul is
emulated (:func:`native_bf16_matmul`; where torch cannot say, a probe below half float32's
rate): on CPUs without AVX-512 or AMX it runs about 1 GFLOP/s (a 2048^3 product: 17 s), and
a share of an emulated rate says nothing.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = ["Limits", "measure", "copy_gbps", "cpu_features", "torch_matmul", "MatmulPeaks",
           "LIMIT_BUDGET_S", "MATMUL_BUDGET_S", "COPY_MIB"]

LIMIT_BUDGET_S = 0.25
"""Seconds each limit is timed for (its calibration not included: a few milliseconds)."""
MATMUL_BUDGET_S = 1.0
"""The most seconds torch's matmul is timed for, per dtype, at the size chosen."""
COPY_MIB = 256
"""Each copy buffer's size: larger than the last-level cache a core sees on current x86."""

#: the CPU features that decide which kernels run (``/proc/cpuinfo`` flag names)
FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512dq",
            "avx512cd", "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2",
            "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq", "avx512_bf16", "avx512_fp16",
            "avx512_vp2intersect", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")

#: bfloat16 bits of the dot-product operand (about 0.001: the sums stay finite for hours)
_DOT_OPERAND = 0x3A83


def cpu_features() -> List[str]:
    """This CPU's flags among :data:`FEATURES` (``/proc/cpuinfo``); empty where unreadable."""
    from ..native.build import cpu_flags

    have = cpu_flags(keys=("flags", "Features"))
    return [x for x in FEATURES if x in have]


@dataclass
class Limits:
    """What :func:`measure` found (rates over ``threads`` threads; None: not measured, with
    the reason in ``notes``)."""

    threads: int
    fma_float32_gflops: Optional[float] = None
    fma_bits: Optional[int] = None
    dot_bfloat16_gflops: Optional[float] = None
    copy_gbps: Optional[float] = None
    copy_source: str = "none"
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)

    def compute_gflops(self, dtype: str) -> Optional[float]:
        """The compute limit of a call in ``dtype`` (a dtype name such as ``"bfloat16"``)."""
        if dtype == "bfloat16" and self.dot_bfloat16_gflops:
            return self.dot_bfloat16_gflops
        return self.fma_float32_gflops

    def compute_name(self, dtype: str) -> str:
        """What :meth:`compute_gflops` of ``dtype`` is."""
        if dtype == "bfloat16" and self.dot_bfloat16_gflops:
            return "bfloat16 dot (vdpbf16ps)"
        return "float32 FMA"

    def share(self, flops: float, nbytes: int, dtype: str, median_s: Optional[float]
              ) -> Tuple[Optional[float], Optional[str]]:
        """``(percent, which)``: the roofline share of a call of ``flops`` FLOPs reading at
        least ``nbytes`` bytes (its K and V) in ``median_s``: the longer of the times the
        compute limit and the copy bandwidth allow, over ``median_s``; ``which`` is
        ``"compute"`` or ``"copy"``. ``(None, None)`` without a time or a compute limit."""
        peak = self.compute_gflops(dtype)
        if not median_s or median_s <= 0 or not peak:  # (no roofline without both sides)
            return None, None
        t_compute = flops / (peak * 1e9)
        t_copy = nbytes / (self.copy_gbps * 1e9) if self.copy_gbps and nbytes else 0.0
        if t_copy > t_compute:
            return 100.0 * t_copy / median_s, "copy"
        return 100.0 * t_compute / median_s, "compute"

    def better(self, other: Limits) -> Limits:
        """Each limit the higher of the two measurements (a limit is a maximum; a lower
        figure measured one time means something else held a core or the memory then)."""

        def hi(a: Optional[float], b: Optional[float]) -> Optional[float]:
            return a if b is None else b if a is None else max(a, b)

        notes = self.notes + [n for n in other.notes if n not in self.notes]
        return Limits(threads=self.threads,
                      fma_float32_gflops=hi(self.fma_float32_gflops, other.fma_float32_gflops),
                      fma_bits=self.fma_bits or other.fma_bits,
                      dot_bfloat16_gflops=hi(self.dot_bfloat16_gflops,
                                             other.dot_bfloat16_gflops),
                      copy_gbps=hi(self.copy_gbps, other.copy_gbps),
                      copy_source=self.copy_source, seconds=self.seconds + other.seconds,
                      notes=notes)

    def line(self) -> str:
        """One line for the output: each limit and how it was measured."""
        parts = []
        if self.fma_float32_gflops:
            parts.append(f"float32 FMA {self.fma_float32_gflops:.0f} GFLOP/s "
                         f"({self.fma_bits}-bit)")
        if self.dot_bfloat16_gflops:
            parts.append(f"bfloat16 dot (vdpbf16ps) {self.dot_bfloat16_gflops:.0f} GFLOP/s")
        if self.copy_gbps:
            parts.append(f"copy {self.copy_gbps:.1f} GB/s ({self.copy_source})")
        text = ", ".join(parts) or "none measured"
        notes = f"; {'; '.join(self.notes)}" if self.notes else ""
        return (f"limits on {self.threads} thread(s): {text} [{self.seconds:.1f} s]{notes}")

    def to_json(self) -> Dict[str, Any]:
        """The ``limits`` entry of the report."""
        return {"threads": self.threads, "fma_float32_gflops": self.fma_float32_gflops,
                "fma_bits": self.fma_bits, "dot_bfloat16_gflops": self.dot_bfloat16_gflops,
                "copy_gbps": self.copy_gbps, "copy_source": self.copy_source,
                "copy_mib": COPY_MIB, "seconds": self.seconds, "notes": list(self.notes),
                "definitions": {
                    "fma_float32_gflops": "float32 multiply-adds on every thread, 12 "
                                          "independent vector accumulators, 2 FLOPs each; "
                                          "the sum of the threads' rates over their CPU time",
                    "dot_bfloat16_gflops": "vdpbf16ps on every thread, 4 FLOPs per float32 "
                                           "lane, as fma_float32_gflops; null where the CPU "
                                           "or build lacks it",
                    "copy_gbps": "bytes copied / s by memcpy, one share per thread (traffic "
                                 "read+write = 2x)",
                    "pct_of_limit": "roofline: max(flops / compute limit, K/V bytes / copy) "
                                    "/ median_s"}}


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _lib() -> Any:
    from .. import native

    return native._lib() if native.available() else None


def _rate(run: Callable[[int], float], budget_s: float, samples: int = 3) -> float:
    """Best rate ``run(n)`` returns, with ``n`` calibrated (by the wall time of the calls)
    so that ``samples`` calls fill ``budget_s``."""
    n, dt = 1 << 12, 0.0
    while True:  # calibrate: a call long enough to time (a few milliseconds)
        t0 = time.perf_counter()
        best = run(n)
        dt = time.perf_counter() - t0
        if dt >= 0.004 or n >= 1 << 40:
            break
        n *= 4
    n = max(1, int(n * budget_s / samples / dt))
    for _ in range(samples):
        best = max(best, run(n))
    return best


def _kernel_rate(kernel: Callable[..., float], threads: int, budget_s: float) -> float:
    """FLOP/s of a peak kernel (``kernel(n, threads, cpu_s)`` returns one worker's FLOPs and
    writes each worker's thread CPU seconds to ``cpu_s``): the sum over the workers of their
    FLOPs over their CPU seconds, so that time a thread spent scheduled out (another
    process on its core) does not lower the limit."""
    cpu = (ctypes.c_double * threads)()

    def run(n: int) -> float:
        work = kernel(n, threads, cpu)
        return sum(work / max(c, 1e-9) for c in cpu)

    return _rate(run, budget_s)


def copy_gbps(mib: int = COPY_MIB, budget_s: float = LIMIT_BUDGET_S,
              threads: Optional[int] = None, least: int = 2) -> Tuple[float, str]:
    """``(GB/s, how)``: bytes copied per second between two ``mib`` MiB buffers, best of the
    copies that fit ``budget_s`` (at least ``least``, at most 20, after one that faults the
    pages in): memcpy on ``threads`` threads (default torch's) with the native kernels, else
    torch's ``copy_``."""
    if mib < 1:
        raise ValueError(f"mib must be >= 1 (the buffers' size in MiB); got {mib}")
    if least < 1:
        raise ValueError(f"least must be >= 1 (the fewest copies timed); got {least}")
    threads = threads or torch.get_num_threads()
    n = (mib << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    lib = _lib()
    if lib is not None:
        def copy() -> None:
            lib.attnkit_peak_copy(dst.data_ptr(), src.data_ptr(), n * 4, threads)
        how = f"memcpy on {threads} thread(s), {mib} MiB"
    else:
        def copy() -> None:
            dst.copy_(src)
        how = f"torch copy_, {mib} MiB (native kernels unavailable)"
    copy()  # faults the destination's pages in
    best, spent, count = math.inf, 0.0, 0
    while count < least or (spent < budget_s and count < 20):
        t0 = time.perf_counter()
        copy()
        dt = time.perf_counter() - t0
        best, spent, count = min(best, dt), spent + dt, count + 1
    return n * 4 / best / 1e9, how


def measure(budget_s: float = LIMIT_BUDGET_S, threads: Optional[int] = None,
            copy: bool = True) -> Limits:
    """This machine's limits now (module docstring), each timed for about ``budget_s``, on
    ``threads`` threads (default ``torch.get_num_threads()``, as the kernels run);
    ``copy=False`` leaves the copy bandwidth out."""
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0 seconds; got {budget_s}")
    threads = threads or torch.get_num_threads()
    # (one thread per CPU at most: the kernels' threads on fewer CPUs share them, and each
    # one's CPU-time rate would count a core twice)
    threads = max(1, min(threads, _usable_cpus()))
    t0 = time.perf_counter()
    lim = Limits(threads=threads)
    lib = _lib()
    if lib is None:
        from .. import native

        lim.notes.append(f"compute limits not measured: the native kernels are unavailable "
                         f"({native.unavailable_reason()})")
    else:
        lim.fma_bits = int(lib.attnkit_peak_bits())
        lim.fma_float32_gflops = _kernel_rate(
            lambda n, t, cpu: lib.attnkit_peak_fma(n, t, 0.999, 0.001, cpu), threads,
            budget_s) / 1e9
        probe = (ctypes.c_double * 1)()
        if lib.attnkit_peak_dpbf16(1, 1, _DOT_OPERAND, probe) > 0:
            lim.dot_bfloat16_gflops = _kernel_rate(
                lambda n, t, cpu: lib.attnkit_peak_dpbf16(n, t, _DOT_OPERAND, cpu), threads,
                budget_s) / 1e9
        else:
            lim.notes.append("no bfloat16 dot-product instruction in this build (AVX512-BF16): "
                             "bfloat16 computes in float32, the FMA rate is its limit")
        if {"amx_bf16", "amx_tile"} <= set(cpu_features()):
            lim.notes.append("AMX tiles not measured (no kernel uses them yet)")
    if copy:
        lim.copy_gbps, lim.copy_source = copy_gbps(budget_s=budget_s, threads=threads)
    lim.seconds = time.perf_counter() - t0
    return lim


# --------------------------------------------------------------------------- torch's matmul


@dataclass
class MatmulPeaks:
    """torch's matmul per dtype name: GFLOP/s (None: not timed), the size timed, and why
    a dtype was left out."""

    gflops: Dict[str, Optional[float]] = field(default_factory=dict)
    size: Dict[str, int] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        """One line for the output."""
        parts = [f"{name} {g:.0f} GFLOP/s at {self.size[name]}^3"
                 for name, g in self.gflops.items() if g]
        parts += [f"{name} not timed: {why}" for name, why in self.skipped.items()]
        return f"torch matmul: {'; '.join(parts)} [{self.seconds:.1f} s]"


def _matmul_rate(dtype: torch.dtype, n: int, reps: int) -> float:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    a @ b  # warm-up
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e9


PROBE_N = 256
PROBE_REPS = 5
SIZES = (512, 1024, 2048)
MATMUL_REPS = 2


def native_bf16_matmul() -> Optional[bool]:
    """Whether torch runs bfloat16 matmuls on native instructions here (oneDNN's bfloat16
    kernels: AVX-512 or AMX), else they are emulated; None where this torch cannot say
    (the private check ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` is missing or
    fails): the probe's rate decides then."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


def torch_matmul(dtypes: Tuple[str, ...] = ("float32", "bfloat16"),
                 budget_s: float = MATMUL_BUDGET_S,
                 sizes: Optional[Dict[str, int]] = None) -> MatmulPeaks:
    """torch's matmul GFLOP/s per dtype (module docstring): a :data:`PROBE_N` ^3 probe,
    then each of :data:`SIZES` in turn while a warm-up and :data:`MATMUL_REPS` calls at it
    fit ``budget_s`` by the rate at the size before; the rate at the largest size reached.
    bfloat16 is not timed (emulated), with the reason, where :func:`native_bf16_matmul`
    says False; where it cannot say, a dtype after the first whose probe runs below half the
    first's rate is not. ``sizes`` (from an earlier call's ``size``) times those
    sizes again without probing; dtypes absent from it are not timed."""
    from .workloads import dtype_of

    t0 = time.perf_counter()
    out = MatmulPeaks()
    if sizes is not None:
        for name in dtypes:
            if name in sizes:
                out.size[name] = sizes[name]
                out.gflops[name] = _matmul_rate(dtype_of(name), sizes[name], MATMUL_REPS)
            else:
                out.gflops[name] = None
        out.seconds = time.perf_counter() - t0
        return out
    first: Optional[float] = None
    native = native_bf16_matmul()
    for name in dtypes:
        if name == "bfloat16" and native is False:
            out.gflops[name] = None
            out.skipped[name] = ("torch's bfloat16 matmul is emulated on this CPU (oneDNN "
                                 "has no bfloat16 kernel for it: no AVX-512 or AMX), about "
                                 f"1 GFLOP/s; a {SIZES[-1]}^3 product would take minutes")
            continue
        rate = _matmul_rate(dtype_of(name), PROBE_N, PROBE_REPS)
        if first is not None and native is None and rate < 0.5 * first:
            out.gflops[name] = None
            out.skipped[name] = (
                f"{rate:.1f} GFLOP/s at {PROBE_N}^3, under half {dtypes[0]}'s "
                f"{first:.0f} (emulated: this CPU has no native {name} matmul); a "
                f"{SIZES[-1]}^3 product would take {2 * SIZES[-1] ** 3 / rate / 1e9:.0f} s")
            continue
        first = rate if first is None else first
        n = PROBE_N
        for size in SIZES:
            if (MATMUL_REPS + 1) * 2 * size ** 3 / (rate * 1e9) > budget_s:
                break
            n, rate = size, _matmul_rate(dtype_of(name), size, MATMUL_REPS)
        out.size[name], out.gflops[name] = n, rate
    out.seconds = time.perf_counter() - t0
    return out
