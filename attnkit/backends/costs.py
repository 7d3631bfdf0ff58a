"""What ``backend="auto"`` chooses between the flash and fused executors by: their measured
costs on this kind of CPU, as data.

The flash executor (attnkit's kernel) and the fused one (torch's) both run dense and plain
causal calls, and give different bits, so ``auto`` must pick one the same way every time for
a given call on a given machine and build: it never times anything during a call. It reads
:data:`TABLE_PATH` (``costs.json``), which :mod:`attnkit.bench.costs` measured and
wrote, per CPU kind (:func:`cpu_kind`: ``avx512`` or ``avx2``, the width the native kernels
were built for): for each executor, float32 and bfloat16, dense and causal, the forward alone
and forward + backward, at sequence lengths 128 to 4096 and head dims 64 and 128, the
milliseconds of one call on **one thread** for 1 and 8 batch rows x heads (a per-call cost
and a per-head one).

The cost of a call on ``T = torch.get_num_threads()`` threads is then a formula (:func:`cost`):
the per-call part plus the per-head part x ``B*H``, the latter interpolated between the
measured lengths and head dims (log-log; beyond them it grows as ``L^2`` and ``d``) and
divided among the threads as the executor splits its work (:data:`PARALLEL`): the flash
kernel by 64 query rows (forward) and 64 keys (backward) of each head, torch's kernel by
blocks of query rows of each head (forward) but by heads only (backward), so that a backward
with fewer batch rows x heads than threads runs on fewer threads. :func:`prefer` compares the
two executors' forward + backward costs (the choice cannot depend on the grad mode: a call
gives the same bits with and without gradients) and picks the fused executor only where it is
cheaper by more than :data:`MARGIN`. Anything the table does not cover (another CPU kind, no
table, float16, other terms than causal) keeps the registry's order: flash.

The choice is a pure function of the call's shapes, dtype and mask, the thread count and the
loaded build (the replay caches of :mod:`attnkit.api` key on all of them).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import pathlib
from typing import Dict, List, Optional, Tuple

import torch

from .. import native

VERSION = 1
#: the packaged table (``python -m attnkit.bench.costs`` re-measures this machine's kind)
TABLE_PATH = pathlib.Path(__file__).with_name("costs.json")
#: the fused executor is chosen only where its cost is below (1 - MARGIN) x flash's
MARGIN = 0.1
#: how each executor divides one call's work among threads, per pass: ``("rows", m)``: items
#: of ``m`` query rows of each head; ``("keys", m)``: of ``m`` keys of each head;
#: ``("torch_rows", ((at_least, m), ...))``: query blocks of ``m`` rows for the first
#: ``at_least <= Lq`` (torch's CPU flash forward); ``("heads", 0)``: one item a head
PARALLEL: Dict[str, Dict[str, Tuple[str, object]]] = {
    "flash": {"forward": ("rows", 64), "backward": ("keys", 64)},
    "fused": {"forward": ("torch_rows", ((768, 256), (192, 64), (0, 32))),
              "backward": ("heads", 0)},
}
_TABLE: dict = {}
_LOADED = [False]  # (whether _TABLE holds a table: the packaged one is read at first use)
_GENERATION = [0]  # (bumped by every use(): what replay keys hold of the table)


def cpu_kind() -> Optional[str]:
    """This machine's kind in the table: ``"avx512"`` or ``"avx2"`` (the native kernels'
    width), or None where the flash kernel is not available."""
    info = native.build_info()
    if not info.get("flash"):
        return None
    return "avx512" if info.get("flash_bits", 0) >= 512 else "avx2"


def reload() -> None:
    """Read the packaged table again (after :mod:`attnkit.bench.costs` wrote it)."""
    use(json.loads(TABLE_PATH.read_text()) if TABLE_PATH.exists() else {})


def use(data: dict) -> None:
    """Choose by ``data`` (a table of :data:`TABLE_PATH`'s form) from now on, e.g. one
    measured on another machine; :func:`reload` goes back to the packaged one. (Set it before
    the calls or between them: the launchers :func:`attnkit.attention` keeps for forms of
    call are keyed on :func:`generation`, so the next call of each form chooses again.)"""
    data = dict(data)  # (it may be the table itself)
    _TABLE.clear()
    _TABLE.update(data)
    _LOADED[0] = True
    _GENERATION[0] += 1
    _nodes.cache_clear()
    _decide.cache_clear()


def generation() -> int:
    """How many tables :func:`use` has set in this process: a cache of choices keys on it."""
    return _GENERATION[0]


def table() -> dict:
    """The cost table (``{"version", "kinds": {kind: {"machine", "points", ...}}}``)."""
    if not _LOADED[0]:
        reload()
    return _TABLE


# ---- the formula ---------------------------------------------------------------------------

Key = Tuple[str, str, str, str, str]  # kind, executor, mode, dtype, mask


@functools.lru_cache(maxsize=256)
def _nodes(key: Key) -> Dict[Tuple[int, int], Tuple[float, float]]:
    """Per measured (head dim, length): the one-thread cost's per-call and per-head parts in
    ms, from the points at 1 and 8 batch rows x heads (at one only: no per-call part)."""
    kind, executor, mode, dtype, mask = key
    entry = table().get("kinds", {}).get(kind)
    if entry is None:
        return {}
    by: Dict[Tuple[int, int], Dict[int, float]] = {}
    for p in entry["points"]:
        if (p["mode"], p["dtype"], p["mask"]) == (mode, dtype, mask) and p["lq"] == p["lk"]:
            # fused's cost is flash's times the median of the same-run ratios (steadier on a
            # busy machine than the two medians apart)
            ms = p["flash_ms"] * (p["ratio"] if executor == "fused" else 1.0)
            by.setdefault((p["d"], p["lq"]), {})[p["bh"]] = ms
    nodes = {}
    for node, at in by.items():
        lo, hi = min(at), max(at)
        if lo == hi:
            nodes[node] = (0.0, at[lo] / lo)
            continue
        per_head = max((at[hi] - at[lo]) / (hi - lo), 0.0)
        per_call = max(at[lo] - lo * per_head, 0.0)
        nodes[node] = (per_call, (at[lo] - per_call) / lo)
    return nodes


def _interp(xs: List[float], ys: List[float], x: float, power: float) -> float:
    """``y(x)`` log-log through the points, growing as ``x**power`` beyond them."""
    if x <= xs[0]:
        return ys[0] * (x / xs[0]) ** power
    if x >= xs[-1]:
        return ys[-1] * (x / xs[-1]) ** power
    i = bisect.bisect_right(xs, x) - 1
    t = math.log(x / xs[i]) / math.log(xs[i + 1] / xs[i])
    lo, hi = max(ys[i], 1e-12), max(ys[i + 1], 1e-12)
    return lo * (hi / lo) ** t


def _one_thread(key: Key, length: float, d: int) -> Optional[Tuple[float, float]]:
    """The per-call and per-head one-thread cost (ms) at ``length`` (sqrt(Lq Lk)) and head
    dim ``d``, interpolated between the measured nodes; None without data."""
    nodes = _nodes(key)
    if not nodes:
        return None
    dims = sorted({dd for dd, _ in nodes})
    at_dim = []
    for dd in dims:
        lengths = sorted(n for d2, n in nodes if d2 == dd)
        calls = [nodes[dd, n][0] for n in lengths]
        heads = [nodes[dd, n][1] for n in lengths]
        call = calls[min(bisect.bisect_left(lengths, length), len(lengths) - 1)]
        at_dim.append((call, _interp(lengths, heads, length, 2.0)))
    call = at_dim[min(bisect.bisect_left(dims, d), len(dims) - 1)][0]
    return call, _interp(dims, [h for _, h in at_dim], d, 1.0)


def _items(rule: Tuple[str, object], bh: int, lq: int, lk: int) -> int:
    kind, m = rule
    if kind == "rows":
        return bh * -(-lq // m)
    if kind == "keys":
        return bh * -(-lk // m)
    if kind == "torch_rows":
        block = next(b for at_least, b in m if lq >= at_least)
        return bh * -(-lq // min(block, lq))
    return bh


def _share(items: int, threads: int) -> float:
    """The part of a pass's one-thread time the slowest thread runs: ceil(items / T) of the
    items (items of one size)."""
    return -(-items // threads) / items if items > 0 else 1.0


def cost(executor: str, kind: str, dtype: str, mask: str, bh: int, lq: int, lk: int, d: int,
         threads: int, mode: str = "train") -> Optional[float]:
    """The modelled milliseconds of one call of ``executor`` (``"flash"`` or ``"fused"``) on
    ``threads`` threads: ``mode`` ``"forward"`` or ``"train"`` (forward + backward); None
    where the table has no data for it."""
    length = math.sqrt(lq * lk)
    fwd = _one_thread((kind, executor, "forward", dtype, mask), length, d)
    if fwd is None:
        return None
    split = PARALLEL[executor]
    total = fwd[0] + bh * fwd[1] * _share(_items(split["forward"], bh, lq, lk), threads)
    if mode == "forward":
        return total
    train = _one_thread((kind, executor, "train", dtype, mask), length, d)
    if train is None:
        return None
    call, head = max(train[0] - fwd[0], 0.0), max(train[1] - fwd[1], 0.0)
    return total + call + bh * head * _share(_items(split["backward"], bh, lq, lk), threads)


# ---- the choice ----------------------------------------------------------------------------


def call_form(spec) -> Optional[Tuple[str, str, int, int, int, int]]:
    """What the table knows a call by: (dtype, mask, B*H, Lq, Lk, head dim), or None where
    it does not cover the call (a dtype it has no data for, terms beyond plain causal)."""
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16",
             torch.float16: "float16"}.get(spec.q.dtype)
    if dtype is None:
        return None
    terms = spec.features() - set(spec.outputs)
    plain_causal = spec.left is None and spec.right in (None, 0) and spec.diagonal == "top_left"
    if not terms:
        mask = "dense"
    elif terms == {"window"} and plain_causal:
        mask = "causal"
    else:
        return None
    return dtype, mask, spec.n * spec.hq, spec.lq, spec.lk, max(spec.dqk, spec.dv)


@functools.lru_cache(maxsize=4096)
def _decide(kind: str, form: Tuple[str, str, int, int, int, int], threads: int
            ) -> Tuple[str, Optional[float], Optional[float]]:
    dtype, mask, bh, lq, lk, d = form
    flash = cost("flash", kind, dtype, mask, bh, lq, lk, d, threads)
    fused = cost("fused", kind, dtype, mask, bh, lq, lk, d, threads)
    if flash is None or fused is None:
        return "flash", flash, fused
    return ("fused" if fused < (1.0 - MARGIN) * flash else "flash"), flash, fused


def prefer(spec) -> Tuple[str, str]:
    """Which of ``"flash"`` and ``"fused"`` the table says runs ``spec`` faster (the caller
    has checked that both can run it), and why, in words."""
    kind = cpu_kind()
    form = call_form(spec)
    if kind is None or form is None:
        return "flash", ("the cost table covers float32 and bfloat16 dense and plain causal "
                         "calls only: the registry's order")
    threads = torch.get_num_threads()
    name, flash, fused = _decide(kind, form, threads)
    if flash is None or fused is None:
        return "flash", f"the cost table has no {kind} data for this call: the registry's order"
    dtype, mask, bh, lq, lk, d = form
    return name, (f"{kind} cost table, {dtype} {mask} B*H={bh} Lq={lq} Lk={lk} d={d} on "
                  f"{threads} threads: forward + backward flash {flash:.3g} ms, fused "
                  f"{fused:.3g} ms (fused only where below {1 - MARGIN:g} x flash)")
