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
from .contend import Contention
from .flops import flops
from .limits import Limits, MatmulPeaks, cpu_features, native_bf16_matmul, torch_matmul
from .limits import copy_gbps as native_copy_gbps
from .limits import measure as measure_limits
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
    load: Optional[Dict[str, Any]] = None  # what run() measured of competing load (assess_load)
    contend: int = 0  # busy background processes during the cases (--contend)
    #: seconds the cases may take in all (None: no bound); each case gets a share by its size
    budget_s: Optional[float] = None
    #: peers left out in bfloat16 where torch's bfloat16 matmul is emulated (their dense
    #: bfloat16 products would take minutes); empty when the user named the peers
    emulated_bf16_skip: Tuple[str, ...] = ()
    limits: Optional[Limits] = None  # what run() measured (the better of before and after)
    matmul: Optional[MatmulPeaks] = None  # torch's matmul as run() timed it
    #: what the run left out and why, one line each (the JSON; :func:`left_out_lines` sums
    #: them up under the table)
    left_out: List[str] = field(default_factory=list)
    #: what the time budget cut: (case, dtype, pass, peer or None, "rounds"|"timing"|"memory")
    cuts: List[Tuple[str, str, str, Optional[str], str]] = field(default_factory=list)

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
                "malloc": self.malloc, "contend": self.contend, "budget_s": self.budget_s,
                "emulated_bf16_skip": list(self.emulated_bf16_skip)}


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


#: the native build's facts recorded with every run (``attnkit.native.build_info()``)
NATIVE_KEYS = ("flash", "flash_bits", "flash_bf16", "bf16_dot", "f16", "h16", "fp8_dot", "team",
               "flags")


def machine_info() -> Dict[str, Any]:
    """The ``machine`` entry of the report: the CPU, its features that decide which kernels
    run (``cpu_features``), the native build (``native``; empty without it), whether torch's
    bfloat16 matmul is native, torch and the platform."""
    try:
        import attnkit

        version = getattr(attnkit, "__version__", "unknown")
    except ImportError:
        version = "unavailable"
    try:
        from attnkit import native

        info = native.build_info() if native.available() else {}
    except ImportError:
        info = {}
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "torch": torch.__version__, "python": sys.version.split()[0],
            "platform": platform.platform(), "attnkit": version,
            "cpu_features": cpu_features(),
            "native": {k: info[k] for k in NATIVE_KEYS if k in info},
            "native_avx512": os.environ.get("ATTNKIT_NATIVE_AVX512", "1"),
            "torch_bf16_matmul_native": native_bf16_matmul()}


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


MEMCPY_DEFINITION = ("bytes copied / s by memcpy on every thread (attnkit's native peak "
                     "kernel; torch's copy_ without it), 256 MiB buffers, best of the copies "
                     "of a quarter second (traffic read+write = 2x)")


def memcpy_gbps(mib: int = 256, reps: int = 2) -> float:
    """Copy bandwidth of this machine, now: ``bytes copied / s`` between two ``mib`` MiB
    buffers, in GB/s (1e9 bytes): :func:`attnkit.bench.limits.copy_gbps`, the best of the
    copies of a quarter of a second, at least ``reps`` (:data:`MEMCPY_DEFINITION`).

    Each byte is read once and written once, so the memory traffic is twice this figure.
    """
    return native_copy_gbps(mib=mib, least=reps)[0]


def kv_bytes(case: Case, dtype: torch.dtype) -> int:
    """Bytes of K and V one decode call must read: ``B * Hkv * Lk * (d_qk + d_v) * elem``
    (``2 * B * Hkv * L * d * elem`` when ``d_qk == d_v``; one byte per element for an fp8
    cache, whatever the case's dtype)."""
    elem = 1 if case.extra.get("fp8") else torch.empty((), dtype=dtype).element_size()
    return case.batch * case.hkv * case.lk * (case.d_qk + case.dv) * elem


def kv_bandwidth(case: Case, dtype: torch.dtype, peer: str, median_s: float,
                 copy_gbps: Optional[float]) -> Dict[str, Any]:
    """The bandwidth record of one paged-decode row: K/V GB/s and its ratio to memcpy."""
    nbytes = kv_bytes(case, dtype)
    gbps = nbytes / median_s / 1e9
    return {"case": case.name, "dtype": dtype_name(dtype), "peer": peer, "kv_bytes": nbytes,
            "median_s": median_s, "kv_gbps": gbps, "memcpy_gbps": copy_gbps,
            "memcpy_definition": MEMCPY_DEFINITION,
            "ratio_to_memcpy": gbps / copy_gbps if copy_gbps else None}


# --------------------------------------------------------------------------- competing load


@dataclass
class CpuSample:
    """CPU seconds used so far: by the whole machine (``busy_s``, steal time included) and by
    this process with its children and living descendants (``ours_s``); Linux only."""

    wall: float
    busy_s: float
    ours_s: float


def usable_cpus() -> List[int]:
    """The CPUs this process may run on (its affinity), else ``range(os.cpu_count())``."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _proc_stat_times(pid: str) -> Optional[Tuple[int, List[int]]]:
    """``(ppid, [utime, stime, cutime, cstime])`` in clock ticks from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), [int(x) for x in fields[11:15]]


def cpu_sample() -> Optional[CpuSample]:
    """A :class:`CpuSample` now, or None where ``/proc`` is missing (not Linux)."""
    try:
        tick = float(os.sysconf("SC_CLK_TCK"))
        mine = {f"cpu{i}" for i in usable_cpus()}
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *ticks = line.split()
                if name in mine:  # the CPUs this process may run on, not the whole host
                    # user nice system idle iowait irq softirq steal (guest is inside user)
                    busy += sum(int(ticks[i]) for i in (0, 1, 2, 5, 6, 7) if i < len(ticks))
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except (OSError, ValueError, AttributeError):
        return None
    me = str(os.getpid())
    table = {p: t for p in pids if (t := _proc_stat_times(p)) is not None}
    if me not in table:
        return None
    children: Dict[int, List[str]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    ours, todo = 0, [me]
    while todo:  # this process and every living descendant (e.g. compile workers)
        p = todo.pop()
        ours += sum(table[p][1])
        todo += children.get(int(p), [])
    return CpuSample(time.perf_counter(), busy / tick, ours / tick)


def others_cpu_cores(start: Optional[CpuSample], end: Optional[CpuSample]) -> Optional[float]:
    """Cores' worth of CPU that other processes (and the hypervisor's steal) used between two
    samples: ``(machine busy - ours) / wall``; None without samples."""
    if start is None or end is None or end.wall <= start.wall:
        return None
    other = (end.busy_s - start.busy_s) - (end.ours_s - start.ours_s)
    return max(0.0, other / (end.wall - start.wall))


CONTENDED_SCALING = 0.6
"""Matmul on ``threads`` threads below this fraction of ``threads`` x one thread's speed means
the threads did not each get a core."""
CONTENDED_OTHERS = 0.25
"""Other processes using more than this fraction of the cores torch's threads need (beyond the
cores torch leaves idle) means they competed with the timed runs."""


def assess_load(*, cores: Optional[int], threads: int, load_avg: Optional[float],
                single_gflops: Optional[float], multi_gflops: Optional[float],
                others_cores: Optional[float], contend: int = 0) -> Dict[str, Any]:
    """The ``contention`` entry of the report: the measurements, ``contended`` and the reasons.

    Contended when (a) float32 matmul on ``threads`` threads ran below
    :data:`CONTENDED_SCALING` of ``threads`` x its one-thread speed (measured back to back
    before the timed runs), or (b) other processes used more than :data:`CONTENDED_OTHERS`
    of the ``threads`` cores during the run, or (c) only where (b) cannot be measured (no
    ``/proc``), the 1-minute load average before the run was at least the number of cores.
    The load average is otherwise only reported: it lags by a minute, so a job that ended just
    before the run would raise it without competing. ``contend``: the busy processes the run
    started itself (``--contend``); their CPU counts as competition like any other's.
    """
    reasons: List[str] = []
    scaling = None
    if single_gflops and multi_gflops and threads >= 2:
        scaling = multi_gflops / single_gflops
        if scaling < CONTENDED_SCALING * threads:
            reasons.append(f"float32 matmul on {threads} threads ran {scaling:.1f}x one "
                           f"thread's speed (expected ~{threads}x)")
    if others_cores is not None:
        spare = max(0, (cores or threads) - threads)
        if others_cores - spare > CONTENDED_OTHERS * threads:
            reasons.append(f"other processes used {others_cores:.1f} of the {cores} cores "
                           f"during the run")
    if others_cores is None and load_avg is not None and cores and load_avg >= cores:
        reasons.append(f"load average {load_avg:.1f} on {cores} cores before the run")
    return {"cores": cores, "threads": threads, "load_avg_1m_before": load_avg,
            "matmul_float32_1_thread_gflops": single_gflops,
            "matmul_float32_gflops": multi_gflops, "thread_scaling": scaling,
            "others_cpu_cores": others_cores, "contended": bool(reasons), "reasons": reasons,
            "contend": contend}


def contention_line(load: Optional[Dict[str, Any]]) -> Optional[str]:
    """The one line printed above the table when the run was contended, else None."""
    if load and load.get("contend"):
        others = "; other load: " + "; ".join(load["reasons"]) if load["reasons"] else ""
        return (f"contended on purpose (--contend {load['contend']}): {load['contend']} busy "
                f"process(es) ran during every case{others}. Compare the ratios with a quiet "
                f"run's")
    if not load or not load.get("contended"):
        return None
    return ("warning: another process was competing for the cores: "
            + "; ".join(load["reasons"])
            + ". Timings and matmul peaks are below this machine's usual; rerun on an idle "
              "machine for comparable figures")


def _single_thread_gflops(n: int = 2048) -> Optional[float]:
    threads = torch.get_num_threads()
    if threads < 2:
        return None
    torch.set_num_threads(1)
    try:
        return matmul_gflops(torch.float32, n=n, reps=2)
    finally:
        torch.set_num_threads(threads)


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


def _fill_timing(r: Result, t: Any, peer_name: str, matmul: Dict[str, Optional[float]]
                 ) -> None:
    r.times_s = list(t.times.get(peer_name, []))
    r.median_s = t.median_s(peer_name)
    r.ratios = t.ratios(peer_name)
    r.ratio_vs_attnkit = t.ratio(peer_name)
    if r.median_s:
        r.gflops = r.flops / r.median_s / 1e9
        peak = matmul.get(r.dtype)
        if peak:
            r.pct_of_matmul = 100.0 * r.gflops / peak


def fill_shares(results: Sequence[Result], cases: Sequence[Case], limits: Optional[Limits],
                matmul: Dict[str, Optional[float]]) -> None:
    """Each timed row's share of the limits (``pct_of_limit``, the roofline of
    :meth:`Limits.share` over its FLOPs and its K/V bytes; ``limit`` says which bound) and of
    torch's matmul (``pct_of_matmul``, where that was timed)."""
    by_name = {c.name: c for c in cases}
    for r in results:
        if r.gflops is None or not r.median_s:
            continue
        peak = matmul.get(r.dtype)
        r.pct_of_matmul = 100.0 * r.gflops / peak if peak else None
        case = by_name.get(r.case)
        if limits is not None and case is not None:
            r.pct_of_limit, r.limit = limits.share(r.flops, kv_bytes(case, dtype_of(r.dtype)),
                                                   r.dtype, r.median_s)


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
        elif w.dtype == torch.bfloat16 and name in settings.emulated_bf16_skip:
            r.status = "skipped"
            r.add_note("torch's bfloat16 matmul is emulated on this CPU (about 1 GFLOP/s): "
                       "this peer's dense bfloat16 products would take minutes; name it in "
                       "--peers to run it anyway")
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
                    step: Optional[Step], clock: Optional[_GroupClock] = None) -> None:
    for name, r in rows.items():
        if r.status != "ok":
            continue
        if clock is not None and clock.spent() and name != SUBJECT:
            r.add_note("peak memory not measured: the time budget's share for this case was "
                       "spent")
            continue
        if step:
            step(f"{case.name} {r.dtype} {pass_}: peak memory of {name} (child process)")
        m = measure_in_child(case, dtype, pass_, name)
        r.peak_mib = m.peak_mib
        if m.error:
            r.add_note(f"memory: {m.error}")
        elif m.method != "rss-reset":
            r.add_note(f"memory: {m.method} (lower bound)")


def run_case(case: Case, settings: Settings, matmul: Dict[str, Optional[float]],
             step: Optional[Step] = None, advance: Optional[Callable[[], None]] = None,
             deadline: Optional[float] = None) -> List[Result]:
    """Every (dtype, pass, peer) result of one case; ``deadline`` (a ``time.perf_counter()``
    time) bounds its timing (:func:`attnkit.bench.timing.interleave`), shared out over its
    (dtype, pass) groups as they come by :data:`PASS_COST`, and its memory measurements."""
    results: List[Result] = []
    passes = [p for p in settings.passes if p in case.passes]
    runs = [name for name in settings.dtypes if case.dtypes is None or name in case.dtypes]
    clock = _GroupClock(deadline, [PASS_COST[p] for _ in runs for p in passes])
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
        results += _run_dtype(case, dtype_of(name), passes, settings, matmul, step, advance,
                              clock)
        gc.collect()
    return results


#: what a pass costs beside the forward (the peers' backward is 2-2.5 forwards)
PASS_COST = {"fwd": 1.0, "fwd+bwd": 3.5}


class _GroupClock:
    """A case's deadline shared out over its (dtype, pass) groups as they come, by their
    ``weights``: each group may use its weight's part of the time left (what one leaves,
    the next may use)."""

    def __init__(self, deadline: Optional[float], weights: List[float]) -> None:
        self.deadline, self.weights = deadline, list(weights) or [1.0]
        self.share_s = 0.0 if deadline is None else max(0.0, deadline - time.perf_counter())

    def next(self) -> Optional[float]:
        """The deadline of the next group."""
        if self.deadline is None:
            return None
        now = time.perf_counter()
        part = self.weights[0] / sum(self.weights)
        if len(self.weights) > 1:
            self.weights.pop(0)
        return now + max(0.0, self.deadline - now) * part

    def spent(self) -> bool:
        """Whether the case's deadline has passed."""
        return self.deadline is not None and time.perf_counter() > self.deadline


def _run_dtype(case: Case, dtype: torch.dtype, passes: List[str], settings: Settings,
               matmul: Dict[str, Optional[float]], step: Optional[Step],
               advance: Optional[Callable[[], None]],
               clock: Optional[_GroupClock] = None) -> List[Result]:
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
                       on_step=(lambda n, label=label: step(f"{label}: {n}")) if step else None,
                       deadline=clock.next() if clock is not None else None)
        for name, why in t.cut.items():
            rows[name].add_note(f"{why} (--budget {settings.budget_s:g} s: "
                                f"{clock.share_s if clock else 0.0:.1f} s for this case)")
            if name not in t.times:
                rows[name].status = "skipped"
            settings.left_out.append(f"{case.name} {dtype_name(dtype)} {pass_} {name}: {why}")
            settings.cuts.append((case.name, dtype_name(dtype), pass_, name,
                                  "timing" if name not in t.times else "rounds"))
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
            if clock is not None and clock.spent():
                why = "peak memory not measured: the time budget's share for this case was spent"
                for r in rows.values():
                    if r.status == "ok":
                        r.add_note(f"{why} (--budget {settings.budget_s:g} s)")
                settings.left_out.append(f"{case.name} {dtype_name(dtype)} {pass_}: {why}")
                settings.cuts.append((case.name, dtype_name(dtype), pass_, None, "memory"))
            else:
                _measure_memory(case, pass_, dtype, rows, step, clock)
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


CaseDone = Callable[[Case, List[Result]], None]


def case_weights(settings: Settings) -> List[float]:
    """Each case's weight in the time budget: the square root of its dense work (all
    ``B * Hq * Lq * Lk`` pairs, which the dense peers compute whatever the mask), over the
    passes and dtypes it runs, and at least half the mean weight: big cases get more time,
    small ones enough for their fixed costs."""
    weights = []
    for case in settings.cases:
        dense = case.pairs * (case.d_qk + case.dv) * 2.0
        total = sum(PASS_COST[p] * dense for p in settings.passes if p in case.passes)
        runs = sum(1 for d in settings.dtypes if case.dtypes is None or d in case.dtypes)
        weights.append(math.sqrt(max(total * runs, 1e6)))
    floor = 0.5 * sum(weights) / max(1, len(weights))  # fixed costs: preparing, references
    return [max(w, floor) for w in weights]


def _deadlines(settings: Settings) -> Callable[[int], Optional[float]]:
    """``deadline(i)``: the ``perf_counter`` time case ``i`` should end by, its share (by
    :func:`case_weights`) of what is left of the budget when it starts; None without one."""
    if not settings.budget_s:
        return lambda i: None
    start = time.perf_counter()
    weights = case_weights(settings)

    def deadline(i: int) -> float:
        now = time.perf_counter()
        left = max(0.0, settings.budget_s - (now - start))
        return now + left * weights[i] / sum(weights[i:])

    return deadline


def peaks(step: Optional[Step] = None, sizes: Optional[Dict[str, int]] = None
          ) -> Tuple[Limits, MatmulPeaks]:
    """The limits and torch's matmul, measured now (time-bounded: see
    :mod:`attnkit.bench.limits`); ``sizes`` times torch's matmul again at those sizes."""
    if step:
        step("limits: float32 FMA, bfloat16 dot, copy bandwidth (native, ~1 s)")
    lim = measure_limits()
    if step:
        step("torch matmul (time-bounded)")
    return lim, torch_matmul(sizes=sizes)


def run(settings: Settings, *, step: Optional[Step] = None,
        advance: Optional[Callable[[], None]] = None, case_done: Optional[CaseDone] = None,
        limits_done: Optional[Callable[[Limits, MatmulPeaks], None]] = None,
        ) -> Tuple[Dict[str, Optional[float]], List[Result]]:
    """Measure the limits and torch's matmul, then run every case: ``(matmul_gflops,
    results)`` (None for a dtype whose matmul was not timed: emulated).

    ``limits_done(limits, matmul)`` is called once they are measured, ``case_done(case,
    its_results)`` as each case finishes. ``settings.limits`` and ``settings.matmul`` receive
    the better of the measurements before and after the cases, ``settings.load``
    :func:`assess_load`'s record of competing load (load average before, matmul thread
    scaling, other processes' CPU over the run), ``settings.left_out`` what the time budget
    and the CPU left out.
    """
    if settings.tune_malloc:
        settings.malloc = tune_malloc()
    try:
        load_avg: Optional[float] = os.getloadavg()[0]
    except (OSError, AttributeError):
        load_avg = None
    start = cpu_sample()
    limits, mm = peaks(step)
    for name, why in mm.skipped.items():
        settings.left_out.append(f"torch matmul {name}: {why}")
    if limits_done:
        limits_done(limits, mm)
    if step:
        step("matmul float32 on one thread (thread scaling)")
    single = _single_thread_gflops(mm.size.get("float32", 2048))
    first_f32 = mm.gflops.get("float32")
    matmul = dict(mm.gflops)
    results: List[Result] = []
    deadline = _deadlines(settings)
    with Contention(settings.contend):  # (the limits and matmul peaks are measured without it)
        for i, case in enumerate(settings.cases):
            done = run_case(case, settings, matmul, step=step, advance=advance,
                            deadline=deadline(i))
            fill_shares(done, [case], limits, matmul)
            results.extend(done)
            if case_done:
                case_done(case, done)
    if step:
        step("limits and matmul again (each the better of the two)")
    again, mm_again = peaks(sizes=mm.size)
    settings.load = assess_load(cores=len(usable_cpus()), threads=torch.get_num_threads(),
                                load_avg=load_avg, single_gflops=single,
                                multi_gflops=first_f32, others_cores=others_cpu_cores(
                                    start, cpu_sample()), contend=settings.contend)
    settings.limits = limits.better(again)
    for name, g in mm_again.gflops.items():
        if g is not None and (matmul.get(name) is None or g > matmul[name]):
            matmul[name] = g
    mm.gflops, mm.seconds = dict(matmul), mm.seconds + mm_again.seconds
    settings.matmul = mm
    fill_shares(results, settings.cases, settings.limits, matmul)
    return matmul, results


def left_out_lines(settings: Settings) -> List[str]:
    """What the run left out, summed up for the lines under the table: the time budget's
    cuts (peers not timed, by case; rows with fewer rounds; memory not measured) and every
    other entry of ``settings.left_out`` (torch's emulated matmul ...) as it is."""
    lines = []
    if settings.cuts:
        untimed: Dict[str, List[str]] = {}
        for case, dtype, pass_, peer, kind in settings.cuts:
            if kind == "timing":
                which = f"{dtype} {pass_}" if len(settings.dtypes) > 1 else pass_
                untimed.setdefault(case, []).append(f"{peer} {which}")
        rounds = sum(1 for c in settings.cuts if c[4] == "rounds")
        memory = sorted({f"{c[0]} {c[2]}" for c in settings.cuts if c[4] == "memory"})
        head = f"the time budget (--budget {settings.budget_s:g} s; 0 for none)"
        if untimed:
            lines.append(f"{head} left untimed: " + "; ".join(
                f"{case}: {', '.join(what)}" for case, what in untimed.items()))
        if rounds:
            lines.append(f"{head} cut the rounds of {rounds} row(s) (see their notes)")
        if memory:
            lines.append(f"{head} left the peak memory of {', '.join(memory)} unmeasured")
    cut = {f"{c[0]} {c[1]} {c[2]}" for c in settings.cuts}
    lines += [x for x in settings.left_out if not any(x.startswith(k + " ") or
                                                     x.startswith(k + ":") for k in cut)]
    return lines


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
