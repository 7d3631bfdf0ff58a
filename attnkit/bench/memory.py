"""Peak memory of one call, measured in a fresh child process.

torch's CPU allocations do not go through Python, so tracemalloc cannot see them; the resident
set can. Each (case, dtype, pass, peer) runs in its own child (``python -m
attnkit.bench.memory``, payload pickled on stdin, one JSON line back on stdout), which:

1. builds the inputs and prepares the peer (masks; for a compiled peer, compiles it with one
   call first);
2. resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)
   and reads the current RSS as the baseline;
3. makes one call and reads ``VmHWM`` (peak RSS): ``peak = VmHWM - baseline``.

So the figure is the growth of the resident set during the call (output included, inputs
excluded). Where the counter cannot be reset, the baseline is the peak so far (which includes
building the inputs), so the figure is a lower bound; ``method`` says which was used. glibc is
told to return large blocks to the system (``MALLOC_MMAP_THRESHOLD_``), so memory freed while
preparing is not silently reused by the call.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional

MIB = 1 << 20
CHILD_TIMEOUT_S = 1800


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> Optional[int]:
    """Current resident set size (Linux), or None."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> Optional[int]:
    """Peak resident set size since start or the last reset, or None."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return None


def reset_peak() -> bool:
    """Reset the peak-RSS counter of this process; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class MemoryResult:
    """Outcome of one child measurement."""

    peak_mib: Optional[float]
    method: str
    error: Optional[str] = None


def measure_call(call: Any, warm: bool = False) -> MemoryResult:
    """Peak RSS growth of ``call()`` in this process (see the module docstring)."""
    if warm:
        call()
    gc.collect()
    if reset_peak():
        base, method = rss_bytes(), "rss-reset"
    else:
        base, method = peak_rss_bytes(), "peak-delta"
    result = call()
    peak = peak_rss_bytes()
    del result
    if base is None or peak is None:
        return MemoryResult(None, "unavailable", "no RSS counters on this platform")
    return MemoryResult(max(0, peak - base) / MIB, method)


def _child_main() -> int:
    payload = pickle.loads(sys.stdin.buffer.read())
    import torch  # noqa: F401  (imported before measuring, like everything else)

    from .peers import PEERS, make_call
    from .workloads import make_workload

    try:
        w = make_workload(payload["case"], payload["dtype"])
        peer = PEERS[payload["peer"]]
        call = make_call(peer, w, payload["pass"])
        res = measure_call(call, warm=peer.compiled)
        out: Dict[str, Any] = {"peak_mib": res.peak_mib, "method": res.method,
                               "error": res.error}
    except Exception as err:  # reported to the parent, which marks the figure
        out = {"peak_mib": None, "method": "failed", "error": f"{type(err).__name__}: {err}"}
    sys.stdout.write("\n" + json.dumps(out) + "\n")
    return 0


def measure_in_child(case: Any, dtype: Any, pass_: str, peer: str,
                     timeout_s: float = CHILD_TIMEOUT_S) -> MemoryResult:
    """Run one measurement in a fresh ``python -m attnkit.bench.memory`` child."""
    payload = pickle.dumps({"case": case, "dtype": dtype, "pass": pass_, "peer": peer})
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 20))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run([sys.executable, "-m", "attnkit.bench.memory"], input=payload,
                              capture_output=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return MemoryResult(None, "failed", f"memory child timed out after {timeout_s:.0f} s")
    if proc.returncode != 0:
        why = "killed (out of memory?)" if proc.returncode in (-9, 137) else \
            f"exit code {proc.returncode}"
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:]
        return MemoryResult(None, "failed", f"memory child {why}" + (f": {tail[0]}" if tail
                                                                      else ""))
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.startswith("{")]
    if not lines:
        return MemoryResult(None, "failed", "memory child printed no result")
    data = json.loads(lines[-1])
    return MemoryResult(data["peak_mib"], data["method"], data["error"])


if __name__ == "__main__":
    sys.exit(_child_main())
