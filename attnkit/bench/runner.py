"""Run a list of cases against the peers and collect :class:`~attnkit.bench.report.Result` s.

For each case and dtype the inputs are made once; for each pass every peer that can run it is
prepared (masks built, nothing timed), then all are timed together, interleaved
(:mod:`attnkit.bench.timing`); then errors are checked against the reference
(:mod:`attnkit.bench.accuracy`) and, where asked, peak memory is measured in child processes
(:mod:`attnkit.bench.memory`). A peer that cannot express a case, would exceed the memory
budget, or fails, gets a row that says so; nothing stops the run.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .accuracy import Reference, errors, reference
from .cases import Case
from .flops import flops
from .memory import measure_in_child
from .peers import PEERS, SUBJECT, make_call
from .report import Result
from .timing import interleave
from .workloads import dtype_name, dtype_of, make_workload

GIB = float(1 << 30)


@dataclass
class Settings:
    """What to run. ``repeat=None`` uses ``default_repeat``, capped by each case's ``repeat``."""

    suite: str
    cases: List[Case]
    dtypes: List[str]
    passes: List[str]
    peers: List[str]
    repeat: Optional[int] = None
    default_repeat: int = 3
    memory: str = "auto"  # auto: cases marked memory=True; all; off
    mem_budget_gib: float = 6.0
    min_sample_s: float = 0.02
    only: List[str] = field(default_factory=list)
    tune_malloc: bool = True
    malloc: Optional[Dict[str, int]] = None  # what tune_malloc() applied
    bandwidth: List[Dict[str, Any]] = field(default_factory=list)  # paged cases, see kv_bandwidth

    def rounds(self, case: Case) -> int:
        """Timed rounds for ``case``."""
        if self.repeat is not None:
            return self.repeat
        return min(self.default_repeat, case.repeat or self.default_repeat)

    def measure_memory(self, case: Case) -> bool:
        """Whether peak memory is measured for ``case``."""
        return self.memory == "all" or (self.memory == "auto" and case.memory)

    def to_json(self) -> Dict[str, Any]:
        """The ``settings`` entry of the report."""
        return {"dtypes": self.dtypes, "passes": self.passes, "peers": self.peers,
                "repeat": self.repeat, "default_repeat": self.default_repeat,
                "memory": self.memory, "mem_budget_gib": self.mem_budget_gib,
                "min_sample_s": self.min_sample_s, "only": self.only,
                "malloc": self.malloc}


# --------------------------------------------------------------------------- machine


def cpu_model() -> str:
    """CPU model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> Dict[str, Any]:
    """The ``machine`` entry of the report."""
    try:
        import attnkit

        version = getattr(attnkit, "__version__", "unknown")
    except ImportError:
        version = "unavailable"
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "torch": torch.__version__, "python": sys.version.split()[0],
            "platform": platform.platform(), "attnkit": version}


def matmul_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of an ``n x n`` matmul in ``dtype`` on this machine, now (best of ``reps``)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    a @ b  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / min(times) / 1e9


def memcpy_gbps(mib: int = 512, reps: int = 5) -> float:
    """Copy bandwidth of this machine, now: ``bytes copied / s`` of ``dst.copy_(src)`` on a
    ``mib`` MiB tensor, best of ``reps``, in GB/s (1e9 bytes).

    Each byte is read once and written once, so the memory traffic is twice this figure.
    """
    n = (mib << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: fault the pages in
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return n * 4 / best / 1e9


def kv_bytes(case: Case, dtype: torch.dtype) -> int:
    """Bytes of K and V one decode call must read: ``B * Hkv * Lk * (d_qk + d_v) * elem``
    (``2 * B * Hkv * L * d * elem`` when ``d_qk == d_v``)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return case.batch * case.hkv * case.lk * (case.d_qk + case.dv) * elem


def kv_bandwidth(case: Case, dtype: torch.dtype, peer: str, median_s: float,
                 copy_gbps: Optional[float]) -> Dict[str, Any]:
    """The bandwidth record of one paged-decode row: K/V GB/s and its ratio to memcpy."""
    nbytes = kv_bytes(case, dtype)
    gbps = nbytes / median_s / 1e9
    return {"case": case.name, "dtype": dtype_name(dtype), "peer": peer, "kv_bytes": nbytes,
            "median_s": median_s, "kv_gbps": gbps, "memcpy_gbps": copy_gbps,
            "memcpy_definition": "bytes copied / s by dst.copy_(src), 512 MiB float32 "
                                 "(traffic read+write = 2x)",
            "ratio_to_memcpy": gbps / copy_gbps if copy_gbps else None}


# Fixed glibc malloc thresholds for the timing process (see tune_malloc).
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def tune_malloc() -> Optional[Dict[str, int]]:
    """Fix glibc's mmap and trim thresholds in this process; None where that is impossible.

    With glibc's default dynamic thresholds, the first calls of a kernel that allocates and
    frees many large blocks can be far slower than later ones (measured on a 2-core VM: torch
    SDPA's CPU backward at L = 8192 took 15 s for three calls, then 0.18 s). Fixed thresholds
    (blocks below 32 MiB from the heap, up to 1 GiB of freed memory kept) remove that
    transient for every peer alike; the steady state is what is timed either way.
    ``--no-malloc-tune`` leaves the allocator alone.
    """
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return None
    if mallopt is None:
        return None
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_mmap_threshold, ctypes.c_int(MMAP_THRESHOLD))
    ok &= mallopt(m_trim_threshold, ctypes.c_int(TRIM_THRESHOLD))
    if not ok:
        return None
    return {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}


# --------------------------------------------------------------------------- run


Step = Callable[[str], None]


def _fill_timing(r: Result, t: Any, peer_name: str, matmul: Dict[str, float]) -> None:
    r.times_s = list(t.times.get(peer_name, []))
    r.median_s = t.median_s(peer_name)
    r.ratios = t.ratios(peer_name)
    r.ratio_vs_attnkit = t.ratio(peer_name)
    if r.median_s:
        r.gflops = r.flops / r.median_s / 1e9
        peak = matmul.get(r.dtype)
        if peak:
            r.pct_of_matmul = 100.0 * r.gflops / peak


def _fill_errors(r: Result, ref: Reference, last: Any) -> None:
    if last is None:
        return
    if ref.kind == "dropout-rows" and r.peer != SUBJECT:
        r.add_note("err: not compared (its own random dropout mask)")
        return
    out, grads = (last if isinstance(last, tuple) else (last, None))
    r.max_err, r.grad_err = errors(ref, out, grads)
    r.reference = ref.label


def _prepare(case: Case, pass_: str, w: Any, settings: Settings, step: Optional[Step],
             ) -> Tuple[Dict[str, Result], Dict[str, Callable[[], Any]]]:
    """A result row per peer, and the timed callable of each peer that can run."""
    rows: Dict[str, Result] = {}
    fns: Dict[str, Callable[[], Any]] = {}
    for name in settings.peers:
        peer = PEERS[name]
        r = rows[name] = Result(case.name, pass_, dtype_name(w.dtype), name,
                                flops=flops(case, pass_))
        reasons = peer.supports(case, pass_)
        need = peer.extra_bytes(case, pass_, w.dtype)
        if case.peers is not None and name not in case.peers:
            r.status = "skipped"
            r.add_note(f"case runs {', '.join(case.peers)} only")
        elif reasons:
            r.status = "unsupported"
            r.add_note("; ".join(reasons))
        elif need > settings.mem_budget_gib * GIB:
            r.status = "skipped"
            r.add_note(f"OOM-risk: needs ~{need / GIB:.1f} GiB > budget "
                       f"{settings.mem_budget_gib:g} GiB (--mem-budget)")
        else:
            for remark in peer.remarks(case, pass_):
                r.add_note(remark)
            try:
                if step:
                    step(f"{case.name} {r.dtype} {pass_}: preparing {name}")
                fns[name] = make_call(peer, w, pass_)
            except Exception as err:
                r.status = "error"
                r.add_note(f"prepare failed: {type(err).__name__}: {_short(err)}")
    return rows, fns


def _measure_memory(case: Case, pass_: str, dtype: Any, rows: Dict[str, Result],
                    step: Optional[Step]) -> None:
    for name, r in rows.items():
        if r.status != "ok":
            continue
        if step:
            step(f"{case.name} {r.dtype} {pass_}: peak memory of {name} (child process)")
        m = measure_in_child(case, dtype, pass_, name)
        r.peak_mib = m.peak_mib
        if m.error:
            r.add_note(f"memory: {m.error}")
        elif m.method != "rss-reset":
            r.add_note(f"memory: {m.method} (lower bound)")


def run_case(case: Case, settings: Settings, matmul: Dict[str, float],
             step: Optional[Step] = None, advance: Optional[Callable[[], None]] = None,
             ) -> List[Result]:
    """Every (dtype, pass, peer) result of one case."""
    results: List[Result] = []
    passes = [p for p in settings.passes if p in case.passes]
    for name in settings.dtypes:
        if case.dtypes is not None and name not in case.dtypes:
            for pass_ in passes:
                r = Result(case.name, pass_, name, SUBJECT, status="skipped",
                           flops=flops(case, pass_))
                r.add_note(f"case runs in {', '.join(case.dtypes)} only")
                results.append(r)
                if advance:
                    advance()
            continue
        results += _run_dtype(case, dtype_of(name), passes, settings, matmul, step, advance)
        gc.collect()
    return results


def _run_dtype(case: Case, dtype: torch.dtype, passes: List[str], settings: Settings,
               matmul: Dict[str, float], step: Optional[Step],
               advance: Optional[Callable[[], None]]) -> List[Result]:
    w = make_workload(case, dtype)
    ref: Optional[Reference] = None
    ref_error: Optional[str] = None
    results: List[Result] = []
    for pass_ in passes:
        label = f"{case.name} {dtype_name(dtype)} {pass_}"
        rows, fns = _prepare(case, pass_, w, settings, step)
        subject = SUBJECT if SUBJECT in fns else None
        t = interleave(fns, subject=subject, rounds=settings.rounds(case), warmup=case.warmup,
                       min_sample_s=settings.min_sample_s,
                       max_rounds={n: PEERS[n].max_rounds for n in fns if PEERS[n].max_rounds},
                       on_step=(lambda n, label=label: step(f"{label}: {n}")) if step else None)
        if ref is None and ref_error is None and t.last:
            if step:
                step(f"{label}: reference")
            try:
                ref = reference(w, with_grads="fwd+bwd" in passes)
            except Exception as err:  # errors stay unknown; say why
                ref_error = f"reference failed: {type(err).__name__}: {_short(err)}"
        for name in fns:
            r = rows[name]
            if name in t.errors:
                r.status = "error"
                r.add_note(f"{type(t.errors[name]).__name__}: {_short(t.errors[name])}")
            _fill_timing(r, t, name, matmul)
            if ref is not None:
                _fill_errors(r, ref, t.last.get(name))
            elif ref_error:
                r.add_note(ref_error)
            if PEERS[name].compiled and name in t.first_call_s and r.median_s:
                r.compile_s = max(0.0, t.first_call_s[name] - r.median_s)
                r.add_note(f"compile {r.compile_s:.1f} s")
        if subject is None and SUBJECT in settings.peers:
            for r in rows.values():
                if r.status == "ok":
                    r.add_note("no ratio: attnkit did not run")
        if "page_size" in case.extra:
            _fill_bandwidth(case, dtype, rows, settings, step)
        t.last.clear()
        gc.collect()
        if settings.measure_memory(case):
            _measure_memory(case, pass_, dtype, rows, step)
        results.extend(rows.values())
        if advance:
            advance()
    w.release()
    return results


def _fill_bandwidth(case: Case, dtype: torch.dtype, rows: Dict[str, Result],
                    settings: Settings, step: Optional[Step]) -> None:
    """K/V bytes read per second of every timed row, against memcpy measured now."""
    if step:
        step(f"{case.name}: memcpy bandwidth (512 MiB)")
    copy = memcpy_gbps()
    for name, r in rows.items():
        if r.status != "ok" or not r.median_s:
            continue
        rec = kv_bandwidth(case, dtype, name, r.median_s, copy)
        settings.bandwidth.append(rec)
        r.add_note(f"K/V read {rec['kv_gbps']:.1f} GB/s = {rec['ratio_to_memcpy']:.2f}x "
                   f"memcpy ({copy:.1f} GB/s copied)")


def _short(err: BaseException, n: int = 160) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def count_steps(settings: Settings) -> int:
    """Progress units: one per (case, dtype, pass)."""
    n = 0
    for case in settings.cases:
        n += len(settings.dtypes) * len([p for p in settings.passes if p in case.passes])
    return n


def run(settings: Settings, *, step: Optional[Step] = None,
        advance: Optional[Callable[[], None]] = None) -> Tuple[Dict[str, float], List[Result]]:
    """Measure the matmul peaks, then run every case: ``(matmul_gflops, results)``."""
    if settings.tune_malloc:
        settings.malloc = tune_malloc()
    if step:
        step("matmul peak (2048^3, float32 and bfloat16)")
    names = ("float32", "bfloat16")
    matmul = {name: matmul_gflops(dtype_of(name)) for name in names}
    results: List[Result] = []
    for case in settings.cases:
        results.extend(run_case(case, settings, matmul, step=step, advance=advance))
    if step:
        step("matmul peak again (the peak is the better of the two)")
    again = {name: matmul_gflops(dtype_of(name)) for name in names}
    if any(again[n] > matmul[n] for n in names):
        matmul = {n: max(matmul[n], again[n]) for n in names}
        for r in results:
            if r.gflops is not None and matmul.get(r.dtype):
                r.pct_of_matmul = 100.0 * r.gflops / matmul[r.dtype]
    return matmul, results


def summary_lines(results: Sequence[Result]) -> List[str]:
    """Geometric-mean ratio per peer over the cases where both ran (for the caption)."""
    by_peer: Dict[str, List[float]] = {}
    for r in results:
        if r.peer != SUBJECT and r.ratio_vs_attnkit:
            by_peer.setdefault(r.peer, []).append(r.ratio_vs_attnkit)
    lines = []
    for peer, rs in by_peer.items():
        gm = math.exp(sum(math.log(x) for x in rs) / len(rs))
        lines.append(f"{peer}: geometric-mean time ratio vs attnkit {gm:.2f}x over {len(rs)} rows")
    return lines
