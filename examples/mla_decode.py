"""An MLA decoding step (DeepSeek's absorbed form: one latent kv head of 576 dims, the values its
first 512) with the values as a view into the latent cache, against the same call with the
values as a separate copy and against the view read as separate rows (the kernel before its
read-once path).

    python examples/mla_decode.py [--batch 8] [--context 8192] [--heads 16 128]
                                  [--page 0 64] [--rounds 15] [--dtype bfloat16]
                                  [--float32-pv]

``--page 0`` is the contiguous cache ``attention(q, ckv, ckv[..., :512])``; a page size runs
``paged_attention_blocks(q, pages, pages[..., :512], ...)`` over shuffled pages. The three
variants alternate, round after round, in one process (a shared machine's load then falls on
all three alike); printed: the median wall and CPU (process) milliseconds per step, and the
median over rounds of each round's ratio to the copy. ``--float32-pv`` adds the view and the
copy with ``P V`` in float32 arithmetic (``native.DECODE_BF16_PV = False``; by default bfloat16
calls on an AVX512-BF16 build run it in bfloat16 dot products), each compared with that copy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

import attnkit
from attnkit import native

DQK, DV = 576, 512


def _timed(fn: Callable[[], object]) -> Tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def _variants(batch: int, context: int, hq: int, page: int,
              dtype: torch.dtype) -> Dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, hq, 1, DQK, generator=g).to(dtype)
    kw = dict(causal=True, diagonal="bottom_right")
    if page == 0:
        ckv = torch.randn(batch, 1, context, DQK, generator=g).to(dtype)
        view, copy = ckv[..., :DV], ckv[..., :DV].contiguous()

        def call(v):
            return lambda: attnkit.attention(q, ckv, v, **kw)
    else:
        per = -(-context // page)
        pages = torch.randn(batch * per, page, 1, DQK, generator=g).to(dtype)
        table = torch.randperm(batch * per, generator=g).view(batch, per)
        lens = torch.full((batch,), context, dtype=torch.int64)
        view, copy = pages[..., :DV], pages[..., :DV].contiguous()

        def call(v):
            return lambda: attnkit.paged_attention_blocks(q, pages, v, table, lens, **kw)

    def before() -> object:
        native._SHARED_ROWS["enabled"] = False
        try:
            return call(view)()
        finally:
            native._SHARED_ROWS["enabled"] = True

    return {"view": call(view), "copy": call(copy), "view, read as separate rows": before}


def _float32_pv(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        native.DECODE_BF16_PV = False
        try:
            return fn()
        finally:
            native.DECODE_BF16_PV = True

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--page", type=int, nargs="+", default=[0, 64])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--float32-pv", action="store_true",
                    help="also the view and the copy with P V in float32 arithmetic")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"{native.describe()}; torch threads {torch.get_num_threads()}")
    for hq in args.heads:
        for page in args.page:
            fns = _variants(args.batch, args.context, hq, page, dtype)
            if args.float32_pv:
                fns["view, float32 P V"] = _float32_pv(fns["view"])
                fns["copy, float32 P V"] = _float32_pv(fns["copy"])
            outs = {name: fn() for name, fn in fns.items()}  # (warm-up, and a check)
            for name, out in outs.items():
                same = "copy, float32 P V" if name.endswith("float32 P V") else "copy"
                if not torch.equal(out, outs[same]):
                    raise SystemExit(f"{name} differs from the {same}")
            times: Dict[str, List[Tuple[float, float]]] = {name: [] for name in fns}
            with torch.no_grad():
                for _ in range(args.rounds):
                    for name, fn in fns.items():
                        times[name].append(_timed(fn))
            where = "contiguous" if page == 0 else f"pages of {page}"
            print(f"B={args.batch} context={args.context} Hq={hq} Hkv=1 {DQK}/{DV} "
                  f"{args.dtype}, {where}:")
            for name, ts in times.items():
                wall = statistics.median(t[0] for t in ts) * 1e3
                cpu = statistics.median(t[1] for t in ts) * 1e3
                rw = statistics.median(a[0] / b[0] for a, b in zip(ts, times["copy"]))
                rc = statistics.median(a[1] / b[1] for a, b in zip(ts, times["copy"]))
                print(f"  {name:28s} wall {wall:8.2f} ms ({rw:.3f}x copy)  "
                      f"cpu {cpu:8.2f} ms ({rc:.3f}x copy)")


if __name__ == "__main__":
    main()
