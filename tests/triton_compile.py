"""Compile the triton executor's kernels for an NVIDIA target on a machine without a GPU.

Run as a script (``python tests/triton_compile.py [arch ...]``, default 90 = H100/H200) in a
process *without* ``TRITON_INTERPRET``: the executor's forward and backward run on CPU tensors
with the kernel launchers replaced by a recorder, and every recorded launch is compiled by
Triton's NVIDIA backend (``triton.compile`` down to a cubin, which needs no driver). Prints one
line per kernel and exits 1 when one fails to compile. tests/test_triton.py runs it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Tuple

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("run without TRITON_INTERPRET=1: the interpreter's kernels do not compile")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attnkit.backends import triton as tx  # noqa: E402
from attnkit.spec import PagedKV, build_spec  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8"}

Launch = Tuple[str, List[Any], Dict[str, Any], Dict[str, int]]

#: Shared memory one block may use (opt-in maximum), bytes, by compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def record(run) -> List[Launch]:
    """The launches ``run()`` makes, without running them."""
    kern = tx.load_kernels()
    calls: List[Launch] = []
    names = ("attn_fwd", "attn_merge", "attn_bwd_dq", "attn_bwd_dkdv")
    saved = {name: getattr(kern, name) for name in names}

    def recorder(name):
        def launch(grid, args, flags, cfg):
            calls.append((name, list(args), dict(flags), dict(cfg)))
        return launch

    try:
        for name in names:
            setattr(kern, name, recorder(name))
        run()
    finally:
        for name, fn in saved.items():
            setattr(kern, name, fn)
    return calls


def compile_launch(launch: Launch, arch: int) -> Any:
    """Compile one recorded launch for ``sm_{arch}``."""
    name, args, flags, cfg = launch
    fn = getattr(tx.load_kernels(), "_" + name)
    positional = [n for n in fn.arg_names if n not in flags]
    if len(positional) != len(args):
        raise TypeError(f"{name}: {len(args)} arguments for {len(positional)} parameters")
    sig: Dict[str, str] = {}
    consts: Dict[Tuple[int, ...], Any] = {}
    for pname, a in zip(positional, args):
        if isinstance(a, torch.Tensor):
            sig[pname] = "*" + _TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[pname] = "i1"
        elif isinstance(a, int):
            sig[pname] = "i32" if -2**31 <= a < 2**31 else "i64"
        elif isinstance(a, float):
            sig[pname] = "fp32"
        else:
            raise TypeError(f"{name}: argument {pname} is {type(a).__name__}")
    for pname, value in flags.items():
        sig[pname] = "constexpr"
        consts[(fn.arg_names.index(pname),)] = value
    opts = {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 2)}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32), options=opts)
    limit = SHARED_LIMIT.get(arch)
    if limit is not None and compiled.metadata.shared > limit:
        raise RuntimeError(f"{name} needs {compiled.metadata.shared} B of shared memory; "
                           f"sm_{arch} gives a block at most {limit} B (the launch would fail "
                           f"with 'out of resources')")
    return compiled


def cases() -> List[Tuple[str, Any]]:
    """Calls that together switch on every constexpr branch of the four kernels."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    n, hq, hkv, lq, lk, d = 2, 4, 2, 200, 256, 128
    q, k, v = r(n, hq, lq, d), r(n, hkv, lk, d), r(n, hkv, lk, d)
    bias = r(1, 1, lq, lk, dtype=torch.float32).requires_grad_(True)
    full = dict(causal=True, window=(100, 3), diagonal="bottom_right", softcap=20.0,
                alibi_slopes=torch.rand(hq, generator=g), bias=bias,
                sinks=torch.randn(hq, generator=g), dropout_p=0.1, seed=2**40 + 3, offset=5,
                seqlens_q=torch.tensor([200, 150]), seqlens_kv=torch.tensor([256, 100]),
                mask=lambda b, h, i, j: (i - j + b) % 7 != 3)
    keep = torch.rand(n, hq, lq, lk, generator=g) > 0.2
    seg = torch.arange(lk) // 60

    def fwd_bwd(spec) -> None:
        plan = tx.make_plan(spec)
        tx.forward(spec, plan)
        if spec.paged is None:
            out = torch.zeros(spec.n, spec.hq, spec.lq, spec.dv, dtype=spec.q.dtype)
            lse = torch.zeros(spec.n, spec.hq, spec.lq)
            tx.backward(spec, plan, out, lse, out, lse)

    def paged() -> None:
        pages, page = 8, 64
        kp, vp = r(pages, page, hkv, d), r(pages, page, hkv, d)
        table = torch.arange(pages).view(n, pages // n)
        stub = kp.new_zeros(()).expand(n, hkv, pages // n * page, d)
        spec = build_spec(r(n, hq, 1, d), stub, stub, causal=True, diagonal="bottom_right",
                          seqlens_kv=torch.tensor([200, 37]), softcap=30.0,
                          sinks=torch.randn(hq, generator=g), alibi_slopes=torch.rand(hq),
                          paged=PagedKV(kp, vp, table))
        tx.forward(spec, tx.make_plan(spec))

    def wide(dtype, dim, **kw):  # the other tile sizes and input dtypes
        qq, kk, vv = r(1, 2, 100, dim, dtype=dtype), r(1, 1, 130, dim, dtype=dtype), r(
            1, 1, 130, dim, dtype=dtype)
        fwd_bwd(build_spec(qq, kk, vv, **kw))

    mod = __import__("attnkit").score_mods.relative_bias(torch.randn(hq, 33, generator=g))
    return [
        ("float32, head dim 64, causal", lambda: wide(torch.float32, 64, causal=True)),
        ("float16, head dim 256, window, bias gradient", lambda: wide(
            torch.float16, 256, window=(40, 40),
            bias=r(100, 130, dtype=torch.float32).requires_grad_(True))),
        ("every term", lambda: fwd_bwd(build_spec(q, k, v, **full))),
        ("documents, row offsets, bool mask, keep mask, relative table", lambda: fwd_bwd(
            build_spec(q[:1], k[:1], v[:1], segments=(seg[:lq], seg),
                       row_offset=torch.arange(lq) % 3, dropout_p=0.2, dropout_mask=keep[:1],
                       mask=torch.rand(lq, lk, generator=g) > 0.1, score_mod=mod))),
        ("paged decode, split keys", paged),
    ]


def main(archs: List[int]) -> int:
    # the GPU's tiles, launch settings and key splits, though the tensors are on the CPU
    tx._interp = lambda spec: False
    tx.SPLITS = 4
    failed = 0
    for label, run in cases():
        launches = record(run)
        for launch in launches:
            for arch in archs:
                t0 = time.time()
                try:
                    c = compile_launch(launch, arch)
                except Exception as exc:  # report every failure, then exit 1
                    failed += 1
                    print(f"FAIL {label}: {launch[0]} sm_{arch}: {type(exc).__name__}: "
                          f"{str(exc)[:2000]}")
                    continue
                print(f"ok   {label}: {launch[0]} sm_{arch} ({time.time() - t0:.1f} s, "
                      f"{c.metadata.shared} B shared)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
