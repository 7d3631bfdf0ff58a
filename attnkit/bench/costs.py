"""Measure the flash and fused executors for the cost table that ``backend="auto"`` reads
(:mod:`attnkit.backends.costs`), on this machine and this build of the kernels.

``python -m attnkit.bench.costs`` times both executors over a grid of shapes (batch x
heads, sequence length, head dim, float32, bfloat16 and float16, dense and causal, the forward alone
and forward + backward), the two alternating call by call in one process so that each
point's ratio is a same-run one, and writes the medians into the table under this machine's
kind (:func:`attnkit.backends.costs.cpu_kind`: ``avx512`` or ``avx2``, the kernels' width),
keeping the other kinds' entries. Run it once per build: ``ATTNKIT_NATIVE_AVX512=0`` builds
the AVX2 kernels, and ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` makes torch use
AVX2 as well (together: a stand-in for an AVX2-only CPU). ``--quick`` measures a few points
only (a check that the script runs); ``--out`` writes elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from .. import native
from ..backends import costs

#: the grid, measured on one thread (the table's costs are one thread's; the parallel split of
#: each executor's work, :data:`attnkit.backends.costs.PARALLEL`, gives the time on more):
#: batch x heads (one batch row of that many heads) 1 and 8 (a per-call cost and a per-head
#: one) where the sequences are short, 1 where a call is long anyway
BH = (1, 8)
LENGTHS = (128, 256, 1024, 4096)
LONG = 4096
HEAD_DIMS = (64, 128)
DTYPES = ("float32", "bfloat16", "float16")
MASKS = ("causal", "dense")
MODES = ("forward", "train")


def grid(quick: bool = False) -> Iterator[dict]:
    """The points to measure, smallest first."""
    if quick:
        for bh in BH:
            yield dict(bh=bh, lq=256, lk=256, d=64, dtype="float32", mask="causal")
        return
    for n in LENGTHS:
        for d in HEAD_DIMS:
            for bh in BH if n < LONG else BH[:1]:
                for dtype in DTYPES:
                    for mask in MASKS:
                        yield dict(bh=bh, lq=n, lk=n, d=d, dtype=dtype, mask=mask)


def _call(point: dict, mode: str, backend: str, inputs: Sequence[torch.Tensor],
          dout: torch.Tensor) -> float:
    import attnkit

    q, k, v = inputs
    causal = point["mask"] == "causal"
    t0 = time.perf_counter()
    if mode == "forward":
        with torch.no_grad():
            attnkit.attention(q, k, v, causal=causal, backend=backend)
    else:
        out = attnkit.attention(q, k, v, causal=causal, backend=backend)
        out.backward(dout)
    return time.perf_counter() - t0


def measure_point(point: dict, mode: str, budget_s: float = 1.0, min_rounds: int = 5,
                  max_rounds: int = 15) -> dict:
    """Both executors at one point, alternating (flash then fused, then the other way round)
    for at least ``min_rounds`` rounds and until ``budget_s`` is spent; the medians in
    milliseconds and the median of the rounds' ratios fused / flash."""
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, point["dtype"])
    grad = mode == "train"
    q = torch.randn(1, point["bh"], point["lq"], point["d"], generator=g).to(dt)
    k = torch.randn(1, point["bh"], point["lk"], point["d"], generator=g).to(dt)
    v = torch.randn(1, point["bh"], point["lk"], point["d"], generator=g).to(dt)
    inputs = [x.requires_grad_(grad) for x in (q, k, v)]
    dout = torch.randn(q.shape, generator=g).to(dt)
    names = ("flash", "fused")
    for name in names:  # warm-up: kernels loaded, plans and replays made
        _call(point, mode, name, inputs, dout)
    times: Dict[str, List[float]] = {name: [] for name in names}
    ratios: List[float] = []
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (rounds < max_rounds
                                  and time.perf_counter() - start < budget_s):
        order = names if rounds % 2 == 0 else names[::-1]
        got = {name: _call(point, mode, name, inputs, dout) for name in order}
        for name in names:
            times[name].append(got[name])
        ratios.append(got["fused"] / got["flash"])
        rounds += 1
    return dict(point, mode=mode, flash_ms=round(1e3 * statistics.median(times["flash"]), 4),
                fused_ms=round(1e3 * statistics.median(times["fused"]), 4),
                ratio=round(statistics.median(ratios), 4), rounds=rounds)


def machine() -> dict:
    """What the figures were measured on: the CPU, its flags that matter here, torch's
    capability, the thread count and the kernels' build."""
    from ..native.build import cpu_flags

    model = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx")))
    info = native.build_info()
    return dict(cpu=model or platform.processor(), flags=flags, torch=torch.__version__,
                torch_capability=torch.backends.cpu.get_cpu_capability(),
                cores=os.cpu_count(), threads=torch.get_num_threads(),
                load=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                build={key: info.get(key) for key in ("variant", "flash_bits", "flash_bf16")})


def run(quick: bool = False, out: Optional[pathlib.Path] = None, log=print) -> dict:
    """Measure the grid and write this kind's entry into the table at ``out`` (default: the
    packaged table); returns the entry."""
    kind = costs.cpu_kind()
    if kind is None:
        raise SystemExit("the native flash kernel is not available here: nothing to measure")
    points = []
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for point in grid(quick):
            for mode in MODES:
                got = measure_point(point, mode)
                points.append(got)
                log(f"{kind} {point['dtype']:8s} {point['mask']:6s} {mode:7s} "
                    f"bh={point['bh']:<3d} L={point['lq']:<5d} d={point['d']:<3d} "
                    f"flash {got['flash_ms']:9.2f} ms fused {got['fused_ms']:9.2f} ms "
                    f"ratio {got['ratio']:.3f} [{time.perf_counter() - start:.0f} s]")
        about = machine()
    finally:
        torch.set_num_threads(threads)
    entry = dict(machine=about, measured=time.strftime("%Y-%m-%d", time.gmtime()),
                 seconds=round(time.perf_counter() - start), points=points)
    path = pathlib.Path(out) if out is not None else costs.TABLE_PATH
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault("version", costs.VERSION)
    table.setdefault("kinds", {})[kind] = entry
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    costs.reload()
    return entry


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench.costs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few points only")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help=f"the table to update (default: {costs.TABLE_PATH})")
    args = parser.parse_args(argv)
    run(args.quick, args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
