"""Results: the record of one measurement, the rich table, the JSON file and the plot.

JSON schema (``"schema": "attnkit.bench/1"``); every figure is also in the table::

    {
      "schema": "attnkit.bench/1",
      "suite": "quick" | "standard" | "long" | "custom",
      "created": "2026-11-29T11:30:00+00:00",        # UTC, ISO 8601
      "wall_s": 61.2,                                # whole run
      "machine": {"cpu": str, "threads": int, "cores": int|null, "torch": str,
                  "python": str, "platform": str, "attnkit": str,
                  "cpu_features": [str],             # the /proc/cpuinfo flags that matter
                  "native": {"flash": bool, "flash_bits": int, "flash_bf16": bool, ...,
                             "flags": str},          # attnkit.native.build_info(); {} without
                  "native_avx512": str,              # $ATTNKIT_NATIVE_AVX512 ("1" default)
                  "torch_bf16_matmul_native": bool|null},
      "limits": {                                    # the physical limits (bench.limits)
          "threads": int, "fma_float32_gflops": float|null, "fma_bits": int|null,
          "dot_bfloat16_gflops": float|null,         # vdpbf16ps; null without AVX512-BF16
          "copy_gbps": float|null, "copy_source": str, "copy_mib": int,
          "seconds": float,                          # measuring them took (before + after)
          "notes": [str], "definitions": {str: str}} | null,
      "matmul_gflops": {"float32": float|null, "bfloat16": float|null},  # torch, same run
      "matmul": {"size": {dtype: int},               # n of the n^3 product timed
                 "skipped": {dtype: str},            # not timed, and why (emulated)
                 "seconds": float} | null,
      "left_out": [str],                             # what the CPU and --budget left out
      "settings": {"dtypes": [str], "passes": [str], "peers": [str], "repeat": int|null,
                   "default_repeat": int, "memory": "auto"|"all"|"off",
                   "mem_budget_gib": float, "min_sample_s": float, "only": [str],
                   "malloc": {"mmap_threshold": int, "trim_threshold": int}|null,
                   "contend": int,                   # --contend: busy processes started
                   "budget_s": float|null,           # --budget: the cases' time bound
                   "emulated_bf16_skip": [str]},     # peers left out in emulated bfloat16
      "contention": {                                # competing load (runner.assess_load)
          "cores": int|null, "threads": int, "load_avg_1m_before": float|null,
          "matmul_float32_1_thread_gflops": float|null, "matmul_float32_gflops": float|null,
          "thread_scaling": float|null,              # threads' matmul / one thread's
          "others_cpu_cores": float|null,            # other processes' CPU during the run
          "contended": bool, "reasons": [str],       # the line above the table says so
          "contend": int                             # of which --contend started this many
      } | null,
      "cases": [ {name, batch, heads_q, heads_kv, len_q, len_kv, d_qk, d_v, causal, diagonal,
                  window, documents, prefix, alibi, softcap, relative_bias, extra, features,
                  visible_pairs, visible_fraction, note} ],
      "results": [ {
          "case": str, "pass": "fwd"|"fwd+bwd", "dtype": str, "peer": str,
          "status": "ok" | "unsupported" | "skipped" | "error",
          "median_s": float|null,          # median seconds per call
          "times_s": [float],              # every timed sample (seconds per call), in order
          "ratio_vs_attnkit": float|null,  # median of per-round peer/attnkit ratios; 1 for attnkit
          "ratios": [float],               # the per-round ratios
          "gflops": float|null,            # visible-pair FLOPs / median_s / 1e9
          "pct_of_matmul": float|null,     # gflops / matmul_gflops[dtype] * 100
          "pct_of_limit": float|null,      # roofline share of the limits (bench.limits)
          "limit": "compute"|"copy"|null,  # which limit bounds this row
          "peak_mib": float|null,          # RSS growth of one call (fresh child); null = not run
          "max_err": float|null,           # max |out - ref|  (see attnkit.bench.accuracy)
          "grad_err": float|null,          # max |grad - ref grad| (fwd+bwd only)
          "reference": str|null,           # what max_err is measured against
          "compile_s": float|null,         # compiled peers: first call minus median call
                                           # (small when torch's compile caches are warm)
          "flops": float,                  # FLOPs of one call
          "note": str                      # why unsupported/skipped, errors, remarks
      } ]
    }

Non-finite numbers (an output holding NaN or inf) are written as ``null`` with the reason in
``note``, so the file is strict JSON.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

SCHEMA = "attnkit.bench/1"

RESULT_KEYS = ("case", "pass", "dtype", "peer", "status", "median_s", "times_s",
               "ratio_vs_attnkit", "ratios", "gflops", "pct_of_matmul", "peak_mib", "max_err",
               "grad_err", "reference", "compile_s", "flops", "note")
#: result keys files written before the limits existed lack (written by every run now)
OPTIONAL_RESULT_KEYS = ("pct_of_limit", "limit")
TOP_KEYS = ("schema", "suite", "created", "wall_s", "machine", "matmul_gflops", "settings",
            "cases", "results")
MACHINE_KEYS = ("cpu", "threads", "cores", "torch", "python", "platform", "attnkit")
STATUSES = ("ok", "unsupported", "skipped", "error")


@dataclass
class Result:
    """One (case, pass, dtype, peer) measurement; the ``results`` entries of the JSON."""

    case: str
    pass_: str
    dtype: str
    peer: str
    status: str = "ok"
    median_s: Optional[float] = None
    times_s: List[float] = field(default_factory=list)
    ratio_vs_attnkit: Optional[float] = None
    ratios: List[float] = field(default_factory=list)
    gflops: Optional[float] = None
    pct_of_matmul: Optional[float] = None
    pct_of_limit: Optional[float] = None
    limit: Optional[str] = None
    peak_mib: Optional[float] = None
    max_err: Optional[float] = None
    grad_err: Optional[float] = None
    reference: Optional[str] = None
    compile_s: Optional[float] = None
    flops: float = 0.0
    note: str = ""

    def add_note(self, text: str) -> None:
        """Append ``text`` to the note."""
        self.note = f"{self.note}; {text}" if self.note else text

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> Result:
        """Rebuild a result from its JSON record (e.g. to re-plot a saved run)."""
        fields = {k: v for k, v in d.items()
                  if k in RESULT_KEYS + OPTIONAL_RESULT_KEYS and k != "pass"}
        return cls(pass_=d["pass"], **fields)

    def to_json(self) -> Dict[str, Any]:
        """The JSON record (``pass_`` spelled ``pass``; non-finite numbers as null)."""
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        out = {k: _finite(d[k]) for k in RESULT_KEYS + OPTIONAL_RESULT_KEYS}
        for k in ("max_err", "grad_err"):
            v = d[k]
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = None
                if "non-finite" not in self.note:
                    out["note"] = (self.note + "; " if self.note else "") + \
                        "non-finite output (NaN/inf)"
        return out


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def build_report(*, suite: str, created: str, wall_s: float, machine: Dict[str, Any],
                 matmul_gflops: Dict[str, Optional[float]], settings: Dict[str, Any],
                 cases: Sequence[Dict[str, Any]], results: Sequence[Result],
                 contention: Optional[Dict[str, Any]] = None,
                 limits: Optional[Dict[str, Any]] = None,
                 matmul: Optional[Dict[str, Any]] = None,
                 left_out: Sequence[str] = ()) -> Dict[str, Any]:
    """Assemble the JSON document (module docstring)."""
    return {"schema": SCHEMA, "suite": suite, "created": created, "wall_s": wall_s,
            "machine": machine, "limits": limits, "matmul_gflops": matmul_gflops,
            "matmul": matmul, "left_out": list(left_out), "settings": settings,
            "contention": contention, "cases": list(cases),
            "results": [r.to_json() for r in results]}


def validate(doc: Dict[str, Any]) -> List[str]:
    """Problems with a report document against the schema (empty list = valid)."""
    problems = []
    missing = [k for k in TOP_KEYS if k not in doc]
    if missing:
        problems.append(f"missing top-level keys {missing}")
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    machine = doc.get("machine", {})
    problems += [f"machine lacks {k!r}" for k in MACHINE_KEYS if k not in machine]
    load = doc.get("contention")  # optional: files written before it existed lack it
    if load is not None and not (isinstance(load, dict) and isinstance(load.get("contended"), bool)
                                 and isinstance(load.get("reasons"), list)):
        problems.append("contention must be null or have a bool 'contended' and a list "
                        "'reasons'")
    mm = doc.get("matmul_gflops", {})
    problems += [f"matmul_gflops lacks {k!r}" for k in ("float32", "bfloat16") if k not in mm]
    lim = doc.get("limits")  # optional: files written before the limits existed lack it
    if lim is not None and not (isinstance(lim, dict) and "fma_float32_gflops" in lim
                                and "copy_gbps" in lim):
        problems.append("limits must be null or have 'fma_float32_gflops' and 'copy_gbps'")
    for i, r in enumerate(doc.get("results", [])):
        lack = [k for k in RESULT_KEYS if k not in r]
        if lack:
            problems.append(f"results[{i}] lacks {lack}")
        extra = [k for k in r if k not in RESULT_KEYS + OPTIONAL_RESULT_KEYS]
        if extra:
            problems.append(f"results[{i}] has unknown keys {extra}")
        if r.get("status") not in STATUSES:
            problems.append(f"results[{i}] has status {r.get('status')!r}")
        if r.get("status") == "ok" and not isinstance(r.get("median_s"), (int, float)):
            problems.append(f"results[{i}] is ok but has no median_s")
    return problems


def write_json(doc: Dict[str, Any], path: str) -> None:
    """Write strict JSON atomically (``path.tmp`` then rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- table


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 10 else f"{ms:.1f} ms"


def progress_line(index: int, total: int, case: Any, results: Sequence[Result],
                  elapsed_s: float) -> str:
    """One line for a finished case (printed as the run goes when stdout is not a terminal):
    attnkit's median per dtype and pass with its share of the limits (``pct_of_limit``),
    and each peer's time ratio against it."""
    groups: Dict[tuple, List[Result]] = {}
    for r in results:
        groups.setdefault((r.dtype, r.pass_), []).append(r)
    parts = []
    for (dtype, pass_), rs in groups.items():
        subject = next((r for r in rs if r.peer == "attnkit"), None)
        if subject is None:
            text = "attnkit not run"
        elif subject.status == "ok" and subject.median_s is not None:
            text = f"attnkit {_fmt_ms(subject.median_s)}"
            if subject.pct_of_limit is not None:
                text += f" = {subject.pct_of_limit:.0f}% of the {subject.limit or 'compute'} limit"
        else:
            text = f"attnkit {subject.status}"
        peers = [f"{r.peer} {r.ratio_vs_attnkit:.2f}x" for r in rs
                 if r.peer != "attnkit" and r.ratio_vs_attnkit is not None]
        parts.append(f"{dtype} {pass_} {text}" + (f" ({', '.join(peers)})" if peers else ""))
    name = getattr(case, "name", str(case))
    return (f"[{index}/{total}] {name}: " + ("; ".join(parts) or "nothing run")
            + f" [{elapsed_s:.0f} s]")


def _fmt(v: Optional[float], spec: str, dash: str = "-") -> str:
    if v is None:
        return dash
    if isinstance(v, float) and not math.isfinite(v):
        return "nan/inf"
    return format(v, spec)


def _fmt_ratio(r: Result) -> str:
    if r.ratio_vs_attnkit is None:
        return "-"
    return "1" if r.peer == "attnkit" else f"{r.ratio_vs_attnkit:.2f}x"


def table_rows(results: Sequence[Result]) -> List[List[str]]:
    """Rows of the results table as strings (shared by the rich table and plain output)."""
    rows = []
    for r in results:
        rows.append([
            r.case, r.pass_, r.dtype, r.peer,
            _fmt(None if r.median_s is None else r.median_s * 1e3,
                 ".3g" if (r.median_s or 0) < 0.01 else ".1f"),
            _fmt_ratio(r),
            _fmt(r.gflops, ".1f"),
            _fmt_limit(r),
            _fmt(r.pct_of_matmul, ".0f"),
            _fmt(r.peak_mib, ".0f"),
            _fmt_err(r),
            r.note,
        ])
    return rows


def _fmt_limit(r: Result) -> str:
    s = _fmt(r.pct_of_limit, ".0f")
    return s + " (copy)" if r.limit == "copy" and r.pct_of_limit is not None else s


def _fmt_err(r: Result) -> str:
    s = _fmt(r.max_err, ".1e")
    if r.grad_err is not None:
        s += f" / {_fmt(r.grad_err, '.1e')}"
    return s


COLUMNS = ("case", "pass", "dtype", "peer", "median ms", "ratio vs attnkit", "GFLOP/s",
           "% of limit", "% of matmul", "peak MiB", "max err (out / grad)", "note")


def render_table(results: Sequence[Result], *, title: str, caption: str,
                 console: Any = None) -> None:
    """Print the results as a rich table (plain text if rich is missing)."""
    rows = table_rows(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(COLUMNS))
        for row in rows:
            print(" | ".join(row))
        print(caption)
        return
    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or file: do not fold the table into 80 columns
            console = Console(width=200)
    table = Table(title=title, caption=caption, caption_justify="left", show_lines=False)
    for i, col in enumerate(COLUMNS):
        right = 4 <= i <= 10
        table.add_column(col, justify="right" if right else "left",
                         overflow="fold", max_width=48 if col == "note" else None)
    prev = None
    for r, row in zip(results, rows):
        group = (r.case, r.pass_, r.dtype)
        if prev is not None and group != prev:
            table.add_section()
        prev = group
        style = "bold" if r.peer == "attnkit" else ("dim" if r.status != "ok" else None)
        table.add_row(*row, style=style)
    console.print(table)


# --------------------------------------------------------------------------- plot


def plot_available() -> Optional[str]:
    """None when matplotlib can be imported, else the message to show."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, an optional extra: pip install 'attnkit[plot]' "
                "(or pip install matplotlib)")
    return None


def plot(results: Sequence[Result], path: str, title: str = "attnkit bench") -> None:
    """Grouped bars: median time per case, one bar per peer, one panel per (pass, dtype).

    A peer that did not run a case (unsupported, skipped, failed) gets an ``x`` at the foot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: Dict[tuple, List[Result]] = {}
    for r in results:
        panels.setdefault((r.pass_, r.dtype), []).append(r)
    peers: List[str] = []
    for r in results:
        if r.peer not in peers:
            peers.append(r.peer)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * max(1, len(panels))),
                             squeeze=False)
    width = 0.8 / max(1, len(peers))
    for ax, ((pass_, dtype), rs) in zip(axes[:, 0], panels.items()):
        cases: List[str] = []
        for r in rs:
            if r.case not in cases:
                cases.append(r.case)
        missing = []
        for pi, peer in enumerate(peers):
            xs, ys = [], []
            for ci, case in enumerate(cases):
                x = ci + (pi - (len(peers) - 1) / 2) * width
                for r in rs:
                    if r.case == case and r.peer == peer:
                        if r.median_s is not None:
                            xs.append(x)
                            ys.append(r.median_s * 1e3)
                        else:
                            missing.append(x)
            ax.bar(xs, ys, width=width, label=peer, color=f"C{pi}")
        ax.set_yscale("log")
        for x in missing:  # not run: unsupported, skipped or failed (see the table)
            ax.annotate("x", (x, 0), xycoords=("data", "axes fraction"), ha="center",
                        va="bottom", fontsize=8, color="0.4")
        ax.set_ylabel("median ms (log)")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{pass_}, {dtype}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=8, ncol=len(peers))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
