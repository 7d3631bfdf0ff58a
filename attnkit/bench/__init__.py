"""``attnkit bench``: attnkit against torch SDPA, FlexAttention (eager and compiled) and a naive
dense baseline, on the same inputs in the same run.

Usage (``python -m attnkit.bench`` takes the same options)::

    attnkit bench [--suite quick|standard|long|compile] [--dtype float32,bfloat16] [--contend N]
                  [--pass fwd,fwd+bwd] [--only NAME,...] [--peers NAME,...] [--json PATH]
                  [--plot PATH] [--repeat N] [--budget SECONDS]
                  [--memory | --no-memory] [--mem-budget GIB] [--min-sample-ms MS]
                  [--no-malloc-tune] [--list]
    attnkit bench --distributed [--json PATH]

Suites (see :mod:`attnkit.bench.cases`): ``quick`` (under 2 minutes on 2 cores, whatever the
CPU: its cases share a time budget, ``--budget``; float32, no compiled FlexAttention: its
compile takes ~16-25 s per case; add it with ``--peers``),
``standard`` (the suite of the benchmark pages' figures, docs/benchmarks; float32 and bfloat16,
every peer), ``long`` (``standard`` plus 32k-64k contexts), ``compile`` (the attention call
inside ``torch.compile(fullgraph=True)``: attnkit, torch SDPA and FlexAttention compiled, with
their compile times).

First the machine's physical limits are measured (:mod:`attnkit.bench.limits`, about a
second: the float32 multiply-add rate of every thread, the ``vdpbf16ps`` rate on CPUs with
AVX512-BF16, the copy bandwidth), and torch's matmul, time-bounded (not at all where its
bfloat16 matmul is emulated); the first line says what they are. Per case, pass, dtype and
peer: median time over interleaved rounds, the peer/attnkit ratio taken round by round,
effective GFLOP/s over visible pairs, their roofline share of the limits ("% of limit": of
the compute rate, or for decoding of the copy bandwidth) and of torch's matmul, peak memory
of the call (fresh child process; cases marked for it, or all with
``--memory``), max error against a reference, and a note for anything not run. The JSON
schema is in :mod:`attnkit.bench.report`. When stdout is not a terminal (``| tee``, CI) one
line per finished case is printed as the run goes, instead of the progress bar. When another
process competes for the cores (:func:`attnkit.bench.runner.assess_load`) a line above the
table says so, and the JSON's ``contention`` entry holds the measurements. ``--contend N``
starts N busy processes of its own for the duration of every case (:mod:`attnkit.bench.contend`),
so the same table can be read on a machine made busy on purpose. ``--budget S`` bounds the
time the cases take (quick: :data:`QUICK_BUDGET_S` by default; 0: no bound): each case gets a
share by its size, rounds stop and slow peers are left out when its share is spent, and the
lines under the table say what was left out and why. Where torch's bfloat16 matmul is
emulated, the naive and eager FlexAttention peers are left out in bfloat16 unless named in
``--peers``.

Layout: ``cases`` (catalog as data), ``peers`` (one adapter per implementation),
``workloads`` (inputs, dense spell-outs), ``flops``, ``timing``, ``accuracy``, ``memory``,
``report`` (table, JSON, plot), ``runner``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["DESCRIPTION", "QUICK_TIME", "QUICK_BUDGET_S", "SUITE_DEFAULTS", "add_arguments",
           "main", "run_from_args"]

QUICK_TIME = "under 2 minutes on 2 cores"
"""How long ``--suite quick`` takes on a 2-core machine, whatever its CPU (its time budget)."""

QUICK_BUDGET_S = 90.0
"""Seconds the quick suite's cases may take (``--budget``); start-up and the limits add ~10."""

DESCRIPTION = (
    "Benchmark attnkit against torch SDPA, FlexAttention (eager and compiled) and a naive "
    "dense baseline, on the same inputs in the same run: median time, the peer/attnkit time "
    "ratio, GFLOP/s and their share of this machine's physical limits (measured first: FMA, "
    "bfloat16 dot, copy bandwidth) and of torch's matmul, peak memory and the error "
    f"against a reference. Suites: quick ({QUICK_TIME}), standard (the benchmark pages' "
    "figures), long (standard plus 32k-64k contexts), compile (attnkit, SDPA and "
    "FlexAttention inside torch.compile).")
"""The ``--help`` description (plain text)."""

SUITE_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "quick": {"dtypes": ["float32"], "peers": ["attnkit", "sdpa", "flex", "naive"],
              "repeat": 3, "budget_s": QUICK_BUDGET_S},
    "standard": {"dtypes": ["float32", "bfloat16"],
                 "peers": ["attnkit", "sdpa", "flex", "flex_compiled", "naive"], "repeat": 3},
    "long": {"dtypes": ["float32", "bfloat16"],
             "peers": ["attnkit", "sdpa", "flex", "flex_compiled", "naive"], "repeat": 2},
    "compile": {"dtypes": ["float32", "bfloat16"],
                "peers": ["attnkit", "attnkit_compiled", "sdpa_compiled", "flex_compiled"],
                "repeat": 3},
}
"""Defaults each suite gives to options left unset."""


#: a sample's least length on a quiet machine, and with --contend: a busy machine's
#: scheduler hands the cores out in slices of a few milliseconds, so a short sample measures
#: whether a busy process happened to hold a core then, not the speed that survives it
QUIET_SAMPLE_MS = 20.0
CONTENDED_SAMPLE_MS = 100.0
#: the least default rounds with --contend (their per-round ratios vary more)
CONTENDED_REPEAT = 5


def sampling(suite_repeat: int, contend: int, min_sample_ms: Optional[float]
             ) -> Tuple[int, float]:
    """The default rounds per case and the least sample length (seconds) for a run with
    ``contend`` busy processes; an explicit ``--min-sample-ms`` wins (``--repeat`` is applied
    by the runner over these defaults)."""
    rounds = max(suite_repeat, CONTENDED_REPEAT) if contend else suite_repeat
    if min_sample_ms is None:
        min_sample_ms = CONTENDED_SAMPLE_MS if contend else QUIET_SAMPLE_MS
    return rounds, min_sample_ms / 1e3


def _csv(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _number(minimum: float, strict: bool) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value > minimum if strict else value >= minimum) or value == float("inf"):
            raise argparse.ArgumentTypeError(
                f"expected a number {'>' if strict else '>='} {minimum:g}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser`` (the ``attnkit bench`` subcommand calls this)."""
    parser.add_argument("--suite", choices=tuple(SUITE_DEFAULTS), default="quick",
                        help=f"quick: {QUICK_TIME}, small shapes (default); standard: the "
                             "benchmark pages' figures (~20 min); long: standard plus 32k-64k "
                             "contexts; compile: attention inside torch.compile")
    parser.add_argument("--dtype", dest="dtypes", type=_csv, default=None, metavar="LIST",
                        help="comma-separated dtypes, e.g. float32,bfloat16 "
                             "(default: quick float32, others both)")
    parser.add_argument("--pass", dest="passes", type=_csv, default=None, metavar="LIST",
                        help="comma-separated passes: fwd, fwd+bwd (default: both)")
    parser.add_argument("--only", type=_csv, default=None, metavar="NAMES",
                        help="run only these cases (any case of the catalog; see --list)")
    parser.add_argument("--peers", type=_csv, default=None, metavar="NAMES",
                        help="peers to run: attnkit, sdpa, flex, flex_compiled, naive, "
                             "attnkit_compiled, sdpa_compiled (default: the suite's; quick "
                             "leaves out flex_compiled, compile runs the compiled ones)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="write every figure and the machine info to PATH")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="draw time per case per peer to PATH (needs matplotlib)")
    parser.add_argument("--repeat", type=_positive_int, default=None, metavar="N",
                        help="timed rounds per case (default: quick 3, standard 3, long 2, at "
                             f"least {CONTENDED_REPEAT} with --contend; "
                             "slow cases cap it unless given here)")
    mem = parser.add_mutually_exclusive_group()
    mem.add_argument("--memory", dest="memory", action="store_const", const="all",
                     default="auto", help="measure peak memory for every case (a child "
                                          "process per measurement; default: only the cases "
                                          "marked for it)")
    mem.add_argument("--no-memory", dest="memory", action="store_const", const="off",
                     help="measure no peak memory")
    parser.add_argument("--mem-budget", dest="mem_budget_gib", type=_number(0, True),
                        default=6.0,
                        metavar="GIB", help="skip a peer whose estimated extra memory exceeds "
                                            "this (default 6 GiB)")
    parser.add_argument("--min-sample-ms", type=_number(0, False), default=None, metavar="MS",
                        help="repeat small calls inside one sample to last at least this long "
                             f"(default {QUIET_SAMPLE_MS:g}; {CONTENDED_SAMPLE_MS:g} with "
                             "--contend)")
    parser.add_argument("--no-malloc-tune", dest="tune_malloc", action="store_false",
                        help="leave glibc's malloc thresholds at their defaults (by default "
                             "they are fixed, which removes a slow-first-calls transient)")
    parser.add_argument("--contend", type=_count, default=0, metavar="N",
                        help="run N busy background processes (each one core of pure "
                             "compute) during every case, to see which speed survives a busy "
                             "machine (default 0: none; the matmul peaks are measured "
                             "without them)")
    parser.add_argument("--budget", dest="budget_s", type=_number(0, False), default=None,
                        metavar="SECONDS",
                        help="bound the time the cases take: each gets a share by its size; "
                             "rounds stop and slow peers are left out (saying so) when it is "
                             f"spent (default: quick {QUICK_BUDGET_S:g}, others none; 0: no "
                             "bound)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--distributed", action="store_true",
                        help="instead of a suite: ring attention on 2 local gloo ranks (1 thread "
                             "each), L=8192 fwd+bwd, zigzag causal vs contiguous full, and peak "
                             "memory per rank at L=8192 and 16384 (~2 min on 2 cores); --json "
                             "writes it under a \"distributed\" key")
    return parser


def _error(msg: str) -> int:
    print(f"attnkit bench: error: {msg}", file=sys.stderr)
    return 2


def missing_extra() -> Optional[str]:
    """None when the ``bench`` extra (rich: tables and progress) is installed, else the message
    that says what to install."""
    if importlib.util.find_spec("rich") is not None:
        return None
    return ("the benchmark needs the 'bench' extra (rich, for its tables and progress): "
            "pip install 'attnkit[bench]' (from a checkout: pip install -e '.[bench]')")


def _list_cases() -> int:
    from .cases import CATALOG
    from .flops import visible_pairs

    for c in CATALOG:
        frac = visible_pairs(c) / c.pairs
        feats = ",".join(sorted(c.features())) or "-"
        print(f"{c.name:18s} {'/'.join(c.suites):15s} {c.shape_str():28s} "
              f"visible {frac:6.1%}  {feats}")
    return 0


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; returns the exit code.

    0 on success (peers that cannot run a case are marked, not failures), 1 when attnkit
    itself raised on some case, 2 on bad options.
    """
    if getattr(args, "list", False):
        return _list_cases()
    missing = missing_extra()
    if missing:
        return _error(missing)
    if getattr(args, "distributed", False):
        return _run_distributed(args)
    from .cases import PASSES, select
    from .peers import PEERS, SUBJECT
    from .report import plot_available
    from .workloads import dtype_name, dtype_of

    defaults = SUITE_DEFAULTS[args.suite]
    try:
        cases = select(args.suite, args.only)
    except ValueError as err:
        return _error(str(err))
    try:
        dtypes = [dtype_name(dtype_of(d)) for d in (args.dtypes or defaults["dtypes"])]
    except ValueError as err:
        return _error(str(err))
    passes = args.passes or list(PASSES)
    bad = [p for p in passes if p not in PASSES]
    if bad:
        return _error(f"unknown pass(es) {bad}; use {', '.join(PASSES)}")
    peers = args.peers or list(defaults["peers"])
    bad = [p for p in peers if p not in PEERS]
    if bad:
        return _error(f"unknown peer(s) {bad}; use {', '.join(PEERS)}")
    peers = [p for p in PEERS if p in peers]  # subject first, catalog order
    if args.repeat is not None and args.repeat < 1:
        return _error(f"--repeat must be >= 1, got {args.repeat}")
    if not args.mem_budget_gib > 0:
        return _error(f"--mem-budget must be > 0 GiB, got {args.mem_budget_gib}")
    if args.min_sample_ms is not None and not args.min_sample_ms >= 0:
        return _error(f"--min-sample-ms must be >= 0, got {args.min_sample_ms}")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        problem = _unwritable(path)
        if problem:
            return _error(f"{option} {path}: {problem}")
    if args.plot:
        missing = plot_available()
        if missing:
            return _error(missing)

    from .limits import native_bf16_matmul
    from .runner import Settings

    contend = getattr(args, "contend", 0)
    default_repeat, min_sample_s = sampling(defaults["repeat"], contend, args.min_sample_ms)
    budget = getattr(args, "budget_s", None)
    budget = defaults.get("budget_s") if budget is None else (budget or None)
    # peers whose dense bfloat16 products run on torch's matmul (emulated on CPUs without
    # native bfloat16: minutes a call); SDPA's CPU kernel converts to float32 and stays
    emulated = (args.peers is None and "bfloat16" in dtypes and native_bf16_matmul() is False)
    settings = Settings(
        suite=args.suite, cases=cases, dtypes=dtypes, passes=passes, peers=peers,
        repeat=args.repeat, default_repeat=default_repeat, memory=args.memory,
        mem_budget_gib=args.mem_budget_gib, min_sample_s=min_sample_s,
        only=list(args.only or []), tune_malloc=getattr(args, "tune_malloc", True),
        contend=contend, budget_s=budget,
        emulated_bf16_skip=tuple(p for p in ("naive", "flex") if p in peers) if emulated else ())
    doc, results = _run_with_progress(settings)
    if args.json:
        from .report import write_json

        write_json(doc, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from .report import plot

        plot(results, args.plot, title=f"attnkit bench, suite {args.suite}")
        print(f"wrote {args.plot}")
    failed = [r for r in results if r.peer == SUBJECT and r.status == "error"]
    return 1 if failed else 0


def _unwritable(path: Optional[str]) -> Optional[str]:
    """Why the run could not write ``path`` at its end (None when it can, or no path)."""
    if not path:
        return None
    if os.path.isdir(path):
        return "is a folder; give a file name"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist; create it or choose another path"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is not writable; choose another path"
    return None


def _run_distributed(args: argparse.Namespace) -> int:
    """``--distributed``: the ring-attention benchmark (:mod:`attnkit.bench.distributed`)."""
    from . import distributed, runner

    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    start = time.perf_counter()
    problem = _unwritable(args.json)
    if problem:
        return _error(f"--json {args.json}: {problem}")
    doc = distributed.run_distributed(distributed.default_settings())
    print(distributed.render(doc))
    if args.json:
        from .report import write_json

        write_json({"created": created, "wall_s": time.perf_counter() - start,
                    "machine": runner.machine_info(), "distributed": doc}, args.json)
        print(f"wrote {args.json}")
    return 1 if "errors" in doc else 0


def _run_with_progress(settings: Any) -> tuple:
    """Run ``settings`` with a progress bar on a terminal, else one printed line per case."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import runner
    from .report import build_report, progress_line, render_table

    start = time.perf_counter()
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = not sys.stdout.isatty()  # a pipe, a file, CI: no live display, a line per case
    total = len(settings.cases)
    finished = []

    def case_done(case: Any, results: list) -> None:
        finished.append(case)
        if lines:
            print(progress_line(len(finished), total, case, results,
                                time.perf_counter() - start), flush=True)

    if lines:
        budget = (f"; time budget {settings.budget_s:g} s for the cases (--budget)"
                  if settings.budget_s else "")
        print(f"attnkit bench: suite {settings.suite}, {total} case(s), "
              f"{', '.join(settings.dtypes)}, {', '.join(settings.passes)}, peers "
              f"{', '.join(settings.peers)}; one line per finished case{budget}", flush=True)
    err_console = Console(stderr=True)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err_console,
                  transient=False, disable=lines) as progress:

        def limits_done(limits: Any, mm: Any) -> None:
            for text in (limits.line(), mm.line()):
                if lines:
                    print(text, flush=True)
                else:
                    progress.console.print(text, markup=False, highlight=False)

        task = progress.add_task("starting", total=runner.count_steps(settings))
        matmul, results = runner.run(
            settings,
            step=lambda text: progress.update(task, description=text),
            advance=lambda: progress.advance(task), case_done=case_done,
            limits_done=limits_done)
        progress.update(task, description="done")
    wall = time.perf_counter() - start
    machine = runner.machine_info()
    doc = build_report(
        suite=settings.suite, created=created, wall_s=wall, machine=machine,
        matmul_gflops=matmul, settings=settings.to_json(),
        cases=[c.describe() for c in settings.cases], results=results,
        contention=settings.load,
        limits=settings.limits.to_json() if settings.limits is not None else None,
        matmul=({"size": settings.matmul.size, "skipped": settings.matmul.skipped,
                 "seconds": settings.matmul.seconds} if settings.matmul is not None else None),
        left_out=settings.left_out)
    if settings.bandwidth:
        doc["bandwidth"] = settings.bandwidth
    title = (f"attnkit bench, suite {settings.suite}: {machine['cpu']}, "
             f"{machine['threads']} threads, torch {machine['torch']}"
             + (f", --contend {settings.contend}" if settings.contend else ""))
    single = (settings.load or {}).get("matmul_float32_1_thread_gflops")
    mm = settings.matmul
    torch_mm = ", ".join(
        [f"{name} {g:.0f} GFLOP/s at {mm.size[name]}^3" for name, g in matmul.items() if g]
        + [f"{name} not timed (emulated)" for name in (mm.skipped if mm else {})])
    caption = "\n".join([
        (settings.limits.line() if settings.limits is not None else "limits: not measured")
        + " (the better of before and after the cases)",
        f"torch matmul this run: {torch_mm}"
        + (f" (float32 {single:.0f} on 1 thread)" if single else "") + f"; wall {wall:.0f} s",
        "% of limit: the roofline share, max(FLOPs / compute limit, K/V bytes / copy "
        "bandwidth) / time; the compute limit is the float32 FMA rate (bfloat16: the "
        "vdpbf16ps rate where the CPU has it); (copy): decoding, bound by memory; a pure "
        "read can pass 100% of a copy",
        "ratio = peer time / attnkit time, median of per-round ratios (each peer run "
        "bracketed by attnkit runs); > 1 means attnkit is faster",
        "GFLOP/s count visible pairs only: fwd 2*B*H*Lq*Lk_vis*(dqk+dv), fwd+bwd 3.5x fwd",
        "max err: output / gradients vs the float64 reference (small cases) or a float32 "
        "dense run of the first 256 query rows (large cases)",
        "peak MiB: resident-set growth of one call in a fresh process (- = not measured; "
        "--memory measures every case)",
        *runner.summary_lines(results),
    ])
    warning = runner.contention_line(settings.load)
    if warning:
        print(warning, flush=True)
    render_table(results, title=title, caption=caption)
    left = runner.left_out_lines(settings)
    if left:
        print("left out (the JSON's left_out lists each one):", flush=True)
        for line in left:
            print(f"  {line}", flush=True)
    return doc, results


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m attnkit.bench``: the exit code (2 for bad options, 130 on Ctrl-C)."""
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench", description=DESCRIPTION)
    add_arguments(parser)
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help or a bad option: argparse has said so
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        return run_from_args(args)
    except KeyboardInterrupt:
        print("attnkit bench: interrupted", file=sys.stderr)
        return 130
