"""``attnkit bench --distributed``: ring attention over local gloo ranks.

``world`` processes (spawned, one CPU thread each, a gloo group over a file store) each hold
``L_global / world`` positions of the same seeded float32 ``q, k, v`` ``(1, H, L, d)`` and run
:func:`attnkit.distributed.ring_attention` forward + backward (the gradient of
``sum(out * g)`` for the local q, k, v). Measured per rank:

* time of one call (median over ``repeat`` calls, each started after a barrier, after one
  warm-up call) for ``zigzag`` causal and ``contiguous`` non-causal at ``lengths[0]``;
* peak memory of one call (resident-set growth, :func:`attnkit.bench.memory.measure_call`,
  measured first, in a fresh worker) for zigzag causal at every ``L_global`` of
  ``mem_lengths``, so its growth with ``L_local`` shows.

Ratios: ``balance`` = slowest rank / fastest rank of one configuration (zigzag is meant to
give the causal ring equal work on every rank), ``causal_vs_full`` = slowest zigzag-causal
rank / slowest contiguous-full rank (causal does half the pairs, so ~0.5 is ideal).
Not part of any suite: it spawns processes and takes a minute or two on 2 cores.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

import torch

CONFIGS = (("zigzag", True), ("contiguous", False))
"""(layout, causal) pairs that are timed."""


@dataclass
class DistSettings:
    """What the distributed run does (defaults: the ``--distributed`` benchmark)."""

    world: int = 2
    heads: int = 8
    d: int = 64
    length: int = 8192
    mem_lengths: Sequence[int] = (8192, 16384)
    repeat: int = 2
    timeout_s: float = 900.0


def default_settings() -> DistSettings:
    """The settings of ``attnkit bench --distributed`` (tests shrink them)."""
    return DistSettings()


def _inputs(length: int, heads: int, d: int) -> tuple:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, heads, length, d, generator=gen) for _ in range(4))


def _local_call(s: DistSettings, rank: int, length: int, layout: str, causal: bool) -> Any:
    from attnkit.distributed import ring_attention, shard_sequence

    q, k, v, g = (shard_sequence(x, s.world, rank, layout) for x in _inputs(length, s.heads,
                                                                             s.d))
    leaves = [x.contiguous().requires_grad_() for x in (q, k, v)]
    g = g.contiguous()

    def call() -> tuple:
        out = ring_attention(*leaves, causal=causal, layout=layout)
        return out.detach(), torch.autograd.grad(out, leaves, g)

    return call


def _ignore_ctrl_c() -> None:
    """In a rank: leave Ctrl-C to the parent (which stops the run and exits quietly; the
    daemonic ranks end with it) instead of printing one traceback per rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker(rank: int, s: DistSettings, tmp: str) -> None:
    import torch.distributed as dist

    from .memory import measure_call

    _ignore_ctrl_c()
    torch.set_num_threads(1)
    res: Dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=s.world, timeout=timedelta(seconds=s.timeout_s))
        # one tiny call first: lazy initialisation is not any length's memory
        _local_call(s, rank, 4 * s.world, "zigzag", True)()
        mem = {}
        for length in s.mem_lengths:
            call = _local_call(s, rank, length, "zigzag", True)
            dist.barrier()
            m = measure_call(call)
            mem[str(length)] = {"peak_mib": m.peak_mib, "method": m.method,
                                "l_local": length // s.world}
            del call
        res["memory"] = mem
        times = {}
        for layout, causal in CONFIGS:
            call = _local_call(s, rank, s.length, layout, causal)
            dist.barrier()
            call()  # warm-up
            ts = []
            for _ in range(s.repeat):
                dist.barrier()
                t0 = time.perf_counter()
                call()
                ts.append(time.perf_counter() - t0)
            times[f"{layout}_{'causal' if causal else 'full'}"] = ts
            del call
        res["times"] = times
    except Exception:
        res["traceback"] = traceback.format_exc()
    finally:
        torch.save(res, f"{tmp}/rank{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(s: Optional[DistSettings] = None) -> Dict[str, Any]:
    """Spawn the ranks, collect and summarise (the ``distributed`` entry of the JSON)."""
    import torch.multiprocessing as mp

    s = s or DistSettings()
    if s.length % (2 * s.world) or any(n % (2 * s.world) for n in s.mem_lengths):
        raise ValueError(f"lengths must be multiples of 2 * world = {2 * s.world} (zigzag)")
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    # children return large freed blocks to the system, so peak RSS sees each call's memory
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_worker, args=(r, s, tmp), daemon=True)
                     for r in range(s.world)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + s.timeout_s
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            ranks = []
            for r in range(s.world):
                path = os.path.join(tmp, f"rank{r}.pt")
                ranks.append(torch.load(path, weights_only=False) if os.path.exists(path)
                             else {"rank": r, "traceback": "no result (hung or killed)"})
    finally:
        if old is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    return summarise(s, ranks)


def summarise(s: DistSettings, ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per-rank medians and the ratios of the module docstring."""
    doc: Dict[str, Any] = {"settings": {**asdict(s), "mem_lengths": list(s.mem_lengths),
                                        "dtype": "float32", "pass": "fwd+bwd",
                                        "threads_per_rank": 1, "backend": "gloo"},
                           "ranks": ranks}
    errors = [f"rank {r['rank']}: {r['traceback']}" for r in ranks if "traceback" in r]
    if errors:
        doc["errors"] = errors
        return doc
    medians: Dict[str, List[float]] = {}
    for name in ranks[0]["times"]:
        medians[name] = [statistics.median(r["times"][name]) for r in ranks]
    doc["median_s"] = medians
    doc["balance"] = {n: max(m) / min(m) for n, m in medians.items()}
    if "zigzag_causal" in medians and "contiguous_full" in medians:
        doc["causal_vs_full"] = max(medians["zigzag_causal"]) / max(medians["contiguous_full"])
    doc["peak_mib"] = {n: [r["memory"][n]["peak_mib"] for r in ranks]
                       for n in ranks[0]["memory"]}
    return doc


def render(doc: Dict[str, Any]) -> str:
    """The small text table printed by ``--distributed``."""
    s = doc["settings"]
    lines = [f"ring attention, {s['world']} gloo ranks x 1 thread, H={s['heads']} "
             f"d={s['d']} float32 fwd+bwd"]
    if "errors" in doc:
        return "\n".join(lines + ["FAILED:"] + doc["errors"])
    ranks = range(s["world"])
    lines.append(f"time per rank at L_global={s['length']} (L_local={s['length'] // s['world']}),"
                 " median s:")
    lines.append(f"  {'config':18s}" + "".join(f"{'rank ' + str(r):>10s}" for r in ranks)
                 + f"{'max/min':>10s}")
    for name, m in doc["median_s"].items():
        lines.append(f"  {name:18s}" + "".join(f"{t:10.3f}" for t in m)
                     + f"{doc['balance'][name]:10.2f}")
    if "causal_vs_full" in doc:
        lines.append(f"  zigzag causal / contiguous full (slowest ranks): "
                     f"{doc['causal_vs_full']:.2f}x")
    lines.append("peak memory per rank of one zigzag causal call, MiB (RSS growth):")
    for n, peaks in doc["peak_mib"].items():
        lines.append(f"  L_global={n:>6s} L_local={int(n) // s['world']:>6d}"
                     + "".join(f"{p:10.1f}" if p is not None else f"{'-':>10s}"
                               for p in peaks))
    return "\n".join(lines)
