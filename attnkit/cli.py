"""The ``attnkit`` command: ``check`` (accuracy grid against the oracle), ``bench``, ``demo``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}

DESCRIPTION = (
    "attnkit: scaled dot-product attention for PyTorch. 'attnkit check' compares every feature "
    "and dtype with the float64 oracle, 'attnkit bench' measures speed, memory and accuracy "
    "against torch's own attention, 'attnkit demo' runs the check and then the quick "
    "benchmark.")
"""The ``--help`` description (plain text)."""

NATIVE_SLOWDOWN = ("decoding over a KV cache runs in torch ops instead, up to ~16x slower "
                   "(measured on 2 cores: paged decode B=4, 2k tokens, float32 5.1 -> 81 ms; "
                   "B=8, 8k tokens, bfloat16 28 -> 82 ms; contiguous-cache decode B=8, 8k "
                   "tokens, bfloat16 30 -> 221 ms); and training and prefill lose the flash "
                   "kernel, 1.7-2.7x slower on torch's fused kernel or the tiled executor")
"""What losing the native kernels costs, for the warning of ``attnkit check``."""


class Feature(NamedTuple):
    """One row family of the accuracy grid: keyword builder ``(hq, lq, lk) -> dict`` and the
    query/key lengths it runs at."""

    build: Callable[[int, int, int], dict]
    lq: int = 77
    lk: int = 77


def _features() -> Dict[str, Feature]:
    """Feature name -> :class:`Feature` for the accuracy grid. The bottom-right rows use
    ``Lq != Lk`` (with ``Lq == Lk`` both diagonals are the same mask)."""
    from .terms import masks, score_mods

    def doc(hq, lq, lk):
        ids = torch.arange(lk) * 3 // lk
        return {"mask": masks.document(ids[:lq] if lq <= lk else ids, ids)} if lq == lk else {}

    bottom_right = {"causal": True, "diagonal": "bottom_right"}
    return {
        "dense": Feature(lambda hq, lq, lk: {}),
        "causal": Feature(lambda hq, lq, lk: {"causal": True}),
        # chunked prefill: the last Lq of Lk positions
        "causal bottom-right": Feature(lambda hq, lq, lk: dict(bottom_right), 45, 77),
        # more queries than keys: the first Lq - Lk rows see nothing (out 0, lse -inf)
        "causal bottom-right, Lq > Lk": Feature(lambda hq, lq, lk: dict(bottom_right), 77, 45),
        "sliding window": Feature(lambda hq, lq, lk: {"window": (16, 0), "causal": True}),
        "sliding window bottom-right": Feature(
            lambda hq, lq, lk: {"window": (16, 0), **bottom_right}, 45, 77),
        "bool mask": Feature(lambda hq, lq, lk: {"mask": torch.rand(lq, lk) > 0.3}),
        "bias": Feature(lambda hq, lq, lk: {"bias": torch.randn(hq, lq, lk)}),
        "alibi": Feature(lambda hq, lq, lk: {"alibi_slopes": score_mods.alibi_slopes(hq),
                                             "causal": True}),
        "softcap": Feature(lambda hq, lq, lk: {"softcap": 5.0}),
        "document mask_mod": Feature(doc),
        "padding": Feature(lambda hq, lq, lk: {"seqlens_q": torch.tensor([lq, lq // 2]),
                                               "seqlens_kv": torch.tensor([lk // 3, lk])}),
    }


def run_check(dtypes: Sequence[str], backends: Sequence[str], seed: int = 0) -> List[dict]:
    """Max |attnkit - float64 oracle| for out, lse and gradients over a feature grid."""
    from .doors.attention import attention
    from .reference import attention_reference

    rows = []
    n, hq, hkv, d = 2, 4, 2, 32
    for name, (build, lq, lk) in _features().items():
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
                row = {"feature": name, "dtype": dname, "backend": backend,
                       "shape": f"{lq} x {lk}"}
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
    from .doors.attention import attention
    from .doors.paged import paged_attention_blocks
    from .kv.paged import gather_kv
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
        shape = f"1 x {'/'.join(str(x) for x in lens.tolist())}"
        row = {"feature": f"paged decode ({where})", "dtype": dname, "backend": "auto",
               "shape": shape,
               "out": (out.double() - ro).abs().max().item(),
               "lse": (lse.double() - rl).abs().max().item(), "grad": None, "status": "ok"}
        rows.append(row)
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = attention(qg, kg, vg, seqlens_kv=lens, causal=True,
                             diagonal="bottom_right", return_lse=True)
        grads = torch.autograd.grad(out, (qg, kg, vg), dout.to(dtype))
        rows.append({"feature": f"padded decode ({where})", "dtype": dname, "backend": "auto",
                     "shape": shape,
                     "out": (out.double() - ro).abs().max().item(),
                     "lse": (lse.double() - rl).abs().max().item(),
                     "grad": max((a.double() - b).abs().max().item()
                                 for a, b in zip(grads, rgrads)), "status": "ok"})
    return rows


def _choices(option: str, known: Sequence[str]) -> Callable[[str], List[str]]:
    """argparse type: a comma-separated list of names out of ``known``."""

    def parse(text: str) -> List[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError(
                f"no names given; use one or more of {', '.join(known)}, comma-separated")
        bad = [x for x in items if x not in known]
        if bad:
            raise argparse.ArgumentTypeError(
                f"{', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not among "
                f"{', '.join(known)}; e.g. {option} {','.join(known[:2])}")
        return items

    parse.__name__ = option.lstrip("-")  # argparse names the type in some messages
    return parse


def native_warning() -> Optional[str]:
    """The warning ``attnkit check`` prints when the native kernels are unavailable, else None."""
    from . import native

    if native.available():
        return None
    return (f"warning: attnkit's native kernels are unavailable: "
            f"{native.unavailable_reason()}; {NATIVE_SLOWDOWN}. The decode rows above ran on "
            f"that torch path.")


def _cmd_check(args: argparse.Namespace) -> int:
    from . import native

    dtypes, backends = list(args.dtype), list(args.backend)
    t0 = time.perf_counter()
    rows = run_check(dtypes, backends) + run_decode_check(dtypes)
    title = f"attnkit check: max |attnkit - float64 oracle| ({time.perf_counter() - t0:.1f} s)"
    columns = ("feature", "Lq x Lk", "dtype", "backend", "out", "lse", "grad q/k/v", "status")
    cells, bad = [], 0
    for r in rows:
        if r["status"] != "ok":
            cells.append((r["feature"], r["shape"], r["dtype"], r["backend"], "-", "-", "-",
                          r["status"]))
            continue
        limit = {"float64": 1e-10, "float32": 1e-4}.get(r["dtype"], 5e-2)
        grad = r["grad"]  # None: this row has no backward
        ok = max(r["out"], r["lse"]) <= limit and (grad is None or grad <= 20 * limit)
        bad += not ok
        cells.append((r["feature"], r["shape"], r["dtype"], r["backend"], f"{r['out']:.2e}",
                      f"{r['lse']:.2e}", "-" if grad is None else f"{grad:.2e}",
                      "ok" if ok else "LARGE"))
    _print_table(title, columns, cells, right=("out", "lse", "grad q/k/v"))
    print(native.describe())
    warning = native_warning()
    if warning:
        print(warning, file=sys.stderr)
    return 1 if bad else 0


def _print_table(title: str, columns: Sequence[str], rows: List[Sequence[str]], *,
                 right: Sequence[str] = ()) -> None:
    """A table on stdout: rich's where the ``bench`` extra is installed, else aligned text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print(title)
        for row in (columns, *rows):
            print("  ".join(x.rjust(w) if c in right else x.ljust(w)
                            for x, w, c in zip(row, widths, columns)).rstrip())
        return
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right" if col in right else "left")
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # a pipe or file: do not fold the table into 80 columns
        console = Console(width=160)
    console.print(table)


def _cmd_demo(args: argparse.Namespace) -> int:
    """A short tour: one accuracy check, then the quick benchmark (skipped, saying why, when the
    check found errors over their limit)."""
    from . import bench

    code = _cmd_check(argparse.Namespace(dtype=["float32", "bfloat16"], backend=["auto"]))
    if code != 0:
        print("attnkit demo: skipping the quick benchmark: the accuracy check above has rows "
              "over their limit (LARGE), and timing wrong results says nothing. Run "
              "'attnkit bench --suite quick' to time it anyway.", file=sys.stderr)
        return code
    print(f"attnkit demo: the check passed; now the quick benchmark ({bench.QUICK_TIME})",
          flush=True)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run_from_args(parser.parse_args(["--suite", "quick"]))


def _version() -> str:
    from . import __version__

    return f"attnkit {__version__} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    """The ``attnkit`` argument parser (plain-text help)."""
    from . import bench
    from .backends import BACKENDS

    parser = argparse.ArgumentParser(prog="attnkit", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check_help = "compare attnkit with the float64 oracle on a grid of features and dtypes"
    p_check = sub.add_parser(
        "check", help=check_help,
        description=check_help + "; exits 1 when a row is over its dtype's limit")
    p_check.add_argument("--dtype", default="float64,float32,bfloat16",
                         type=_choices("--dtype", list(DTYPES)),
                         help=f"comma-separated dtypes ({', '.join(DTYPES)}; default "
                              "float64,float32,bfloat16)")
    p_check.add_argument("--backend", default="auto,tiled",
                         type=_choices("--backend", list(BACKENDS)),
                         help=f"comma-separated executors ({', '.join(BACKENDS)}; default "
                              "auto,tiled)")
    p_check.set_defaults(func=lambda args: _cmd_check(args))
    p_bench = sub.add_parser("bench", help="speed, memory and accuracy against the peers",
                             description=bench.DESCRIPTION)
    bench.add_arguments(p_bench)
    p_bench.set_defaults(func=lambda args: bench.run_from_args(args))
    demo_help = (f"accuracy check, then the quick benchmark ({bench.QUICK_TIME}); the "
                 "benchmark is skipped, saying so, when the check fails")
    p_demo = sub.add_parser("demo", help="accuracy check, then the quick benchmark",
                            description=demo_help)
    p_demo.set_defaults(func=lambda args: _cmd_demo(args))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``attnkit`` command; returns the exit code: 0 ok, 1 a failed check
    or benchmark, 2 a bad argument (a one-line message, no traceback), 130 on Ctrl-C."""
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version or a bad argument: argparse has said so
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
