"""The ``attnkit`` command: ``check`` (accuracy grid against the oracle), ``bench``, ``demo``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def _features() -> Dict[str, Callable[[int, int, int], dict]]:
    """Feature name -> keyword builder (hq, lq, lk) for the accuracy grid."""
    from . import masks, score_mods

    def doc(hq, lq, lk):
        ids = torch.arange(lk) * 3 // lk
        return {"mask": masks.document(ids[:lq] if lq <= lk else ids, ids)} if lq == lk else {}

    return {
        "dense": lambda hq, lq, lk: {},
        "causal": lambda hq, lq, lk: {"causal": True},
        "causal bottom-right": lambda hq, lq, lk: {"causal": True, "diagonal": "bottom_right"},
        "sliding window": lambda hq, lq, lk: {"window": (16, 0), "causal": True},
        "bool mask": lambda hq, lq, lk: {"mask": torch.rand(lq, lk) > 0.3},
        "bias": lambda hq, lq, lk: {"bias": torch.randn(hq, lq, lk)},
        "alibi": lambda hq, lq, lk: {"alibi_slopes": score_mods.alibi_slopes(hq),
                                     "causal": True},
        "softcap": lambda hq, lq, lk: {"softcap": 5.0},
        "document mask_mod": doc,
        "padding": lambda hq, lq, lk: {"seqlens_q": torch.tensor([lq, lq // 2]),
                                       "seqlens_kv": torch.tensor([lk // 3, lk])},
    }


def run_check(dtypes: Sequence[str], backends: Sequence[str], seed: int = 0) -> List[dict]:
    """Max |attnkit - float64 oracle| for out, lse and gradients over a feature grid."""
    from .api import attention
    from .reference import attention_reference

    rows = []
    n, hq, hkv, lq, lk, d = 2, 4, 2, 77, 77, 32
    for name, build in _features().items():
        for dname in dtypes:
            dtype = DTYPES[dname]
            for backend in backends:
                torch.manual_seed(seed)
                q64 = torch.randn(n, hq, lq, d, dtype=torch.float64)
                k64 = torch.randn(n, hkv, lk, d, dtype=torch.float64)
                v64 = torch.randn(n, hkv, lk, d, dtype=torch.float64)
                dout = torch.randn(n, hq, lq, d, dtype=torch.float64)
                kw = build(hq, lq, lk)
                q, k, v = (t.to(dtype).requires_grad_() for t in (q64, k64, v64))
                row = {"feature": name, "dtype": dname, "backend": backend}
                try:
                    out, lse = attention(q, k, v, return_lse=True, backend=backend, **kw)
                except NotImplementedError as exc:
                    row["status"] = f"not supported: {exc}"
                    rows.append(row)
                    continue
                grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
                qr, kr, vr = (t.detach().to(dtype).double().requires_grad_() for t in (q, k, v))
                ref_kw = {key: (val.double() if key == "bias" else val)
                          for key, val in kw.items()}
                ro, rl = attention_reference(qr, kr, vr, return_lse=True, **ref_kw)
                rgrads = torch.autograd.grad(ro, (qr, kr, vr), dout)
                fin = torch.isfinite(rl)
                row.update(
                    out=(out.double() - ro).abs().max().item(),
                    lse=(lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0,
                    grad=max((a.double() - b).abs().max().item() for a, b in zip(grads, rgrads)),
                    status="ok")
                rows.append(row)
    return rows


def run_decode_check(dtypes: Sequence[str], seed: int = 0) -> List[dict]:
    """Decoding rows against the oracle: one new token per sequence over a shuffled paged cache
    (``paged_attention``: out and lse) and over a contiguous cache (``attention``: out, lse and
    the gradients, which start from the decode forward's out and lse). On CPU both run in the
    native decode kernel when it is built (see ``attnkit.native``), else in torch ops."""
    from . import native
    from .api import attention
    from .paged import gather_kv, paged_attention_blocks
    from .reference import attention_reference

    rows = []
    n, hq, hkv, page, d = 3, 8, 2, 16, 64
    for dname in dtypes:
        dtype = DTYPES[dname]
        where = "native" if native.available() and dtype != torch.float64 else "torch"
        g = torch.Generator().manual_seed(seed)
        lens = torch.tensor([1, 45, 96])
        table = torch.randperm(n * 6, generator=g).view(n, 6)
        k_pages = torch.randn(n * 6, page, hkv, d, generator=g, dtype=torch.float64)
        v_pages = torch.randn(n * 6, page, hkv, d, generator=g, dtype=torch.float64)
        q64 = torch.randn(n, hq, 1, d, generator=g, dtype=torch.float64)
        dout = torch.randn(n, hq, 1, d, generator=g, dtype=torch.float64)
        kp, vp, q = (t.to(dtype) for t in (k_pages, v_pages, q64))
        k, v = gather_kv(kp, vp, table, lens)
        kr, vr, qr = (t.double().requires_grad_() for t in (k, v, q))
        ro, rl = attention_reference(qr, kr, vr, seqlens_kv=lens, causal=True,
                                     diagonal="bottom_right", return_lse=True)
        rgrads = torch.autograd.grad(ro, (qr, kr, vr), dout)
        out, lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True)
        row = {"feature": f"paged decode ({where})", "dtype": dname, "backend": "auto",
               "out": (out.double() - ro).abs().max().item(),
               "lse": (lse.double() - rl).abs().max().item(), "grad": None, "status": "ok"}
        rows.append(row)
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = attention(qg, kg, vg, seqlens_kv=lens, causal=True,
                             diagonal="bottom_right", return_lse=True)
        grads = torch.autograd.grad(out, (qg, kg, vg), dout.to(dtype))
        rows.append({"feature": f"padded decode ({where})", "dtype": dname, "backend": "auto",
                     "out": (out.double() - ro).abs().max().item(),
                     "lse": (lse.double() - rl).abs().max().item(),
                     "grad": max((a.double() - b).abs().max().item()
                                 for a, b in zip(grads, rgrads)), "status": "ok"})
    return rows


def _cmd_check(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    dtypes = [s.strip() for s in args.dtype.split(",") if s.strip()]
    for dname in dtypes:
        if dname not in DTYPES:
            print(f"attnkit check: --dtype {dname!r} is not one of {sorted(DTYPES)}",
                  file=sys.stderr)
            return 2
    backends = [s.strip() for s in args.backend.split(",") if s.strip()]
    t0 = time.perf_counter()
    rows = run_check(dtypes, backends) + run_decode_check(dtypes)
    table = Table(title=f"attnkit check: max |attnkit - float64 oracle| "
                        f"({time.perf_counter() - t0:.1f} s)")
    for col in ("feature", "dtype", "backend", "out", "lse", "grad q/k/v", "status"):
        table.add_column(col, justify="right" if col in ("out", "lse", "grad q/k/v") else "left")
    bad = 0
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["feature"], r["dtype"], r["backend"], "-", "-", "-", r["status"])
            continue
        limit = {"float64": 1e-10, "float32": 1e-4}.get(r["dtype"], 5e-2)
        grad = r["grad"]  # None: this row has no backward
        ok = max(r["out"], r["lse"]) <= limit and (grad is None or grad <= 20 * limit)
        bad += not ok
        table.add_row(r["feature"], r["dtype"], r["backend"], f"{r['out']:.2e}",
                      f"{r['lse']:.2e}", "-" if grad is None else f"{grad:.2e}",
                      "ok" if ok else "LARGE")
    console = Console()
    console.print(table)
    from . import native

    console.print(native.describe())
    return 1 if bad else 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """A short tour: one accuracy check, then the quick benchmark."""
    code = _cmd_check(argparse.Namespace(dtype="float32,bfloat16", backend="auto"))
    from . import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return code or bench.run_from_args(parser.parse_args(["--suite", "quick"]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``attnkit`` command."""
    parser = argparse.ArgumentParser(prog="attnkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check", help="compare attnkit with the float64 oracle on a "
                                           "grid of features and dtypes")
    p_check.add_argument("--dtype", default="float64,float32,bfloat16",
                         help="comma-separated dtypes (float64, float32, bfloat16, float16)")
    p_check.add_argument("--backend", default="auto,tiled",
                         help="comma-separated executors: auto, fused, tiled")
    p_check.set_defaults(func=_cmd_check)
    p_bench = sub.add_parser("bench", help="speed, memory and accuracy against the peers")
    from . import bench

    bench.add_arguments(p_bench)
    p_bench.set_defaults(func=bench.run_from_args)
    p_demo = sub.add_parser("demo", help="accuracy check, then the quick benchmark")
    p_demo.set_defaults(func=_cmd_demo)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
