#!/usr/bin/env python
"""GPU check of attnkit's triton executor, prepared for one NVIDIA H200.

Written without a GPU: it has run only as ``--dry-run`` (CPU tensors under Triton's
interpreter, tiny sizes), so its first real run is also the first time the kernels meet
hardware. Sections, in this order, each case skipped (and recorded so) once ``--budget``
seconds have passed; the JSON (``--out``) is rewritten after every case, so a run that is
cut short still leaves what it measured:

1. ``correctness``: bfloat16 and float16 over the feature grid (causal with either diagonal,
   windows, padding, documents, ALiBi, softcap, sinks, relative bias, bool mask, bias with
   its gradient, a lambda mask_mod, a BlockMask, GQA, d_qk != d_v, dropout), forward and
   backward, against the tiled executor in float32 on the same GPU, by FlashAttention's rule
   ``max|out - ref| <= 2 max|plain - ref| + 1e-5`` (3x for gradients), ``plain`` the naive
   computation in the input dtype;
2. ``determinism``: 20 backward passes (causal, GQA, bias gradient), compared bitwise;
3. ``decode``: split keys and paged K/V against the tiled executor;
4. ``speed``: forward and forward+backward median times (``triton.testing.do_bench``) at
   L = 4k, 8k, 16k (B=2, H=16, d=128, bfloat16; decode: B=16, 32 query and 8 kv heads, one
   query row) for dense, causal, window, document, ALiBi, softcap and decode, against torch
   SDPA's flash and cuDNN kernels (the cases SDPA has natively) and FlashAttention
   (``flash_attn``, where installed); then compiled FlexAttention at 8k for causal,
   document and softcap (last: each compiles for tens of seconds). attnkit is timed through
   ``attnkit.attention`` (planning included) and, forward, through its kernels with the plan
   made once (``kernels_ms``). Every peer's ``ratio`` is its time over attnkit's (above 1:
   attnkit is faster).

The default budget (400 s) keeps the run under 8 minutes on one H200: every case compiles
its kernels on first use (a few seconds each), so the grid is every feature once in bfloat16
at d=128 and a few cases in float16 and at d=64 and d_qk=192/d_v=128.

Usage::

    python scripts/gpu_check.py --out gpu_check.json            # on the GPU machine
    python scripts/gpu_check.py --dry-run --out /tmp/dry.json   # this script itself, on CPU

Exit status 1 when a correctness, determinism or decode case fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

SECTIONS = ("correctness", "determinism", "decode", "speed")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Sections: " + ", ".join(SECTIONS) + ". See the module docstring for what "
               "each measures.")
    p.add_argument("--out", default="gpu_check.json", help="JSON results (default %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU tensors under Triton's interpreter at tiny sizes (re-executes "
                        "itself with TRITON_INTERPRET=1): checks the script, not the GPU")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated sections to run (default: all)")
    p.add_argument("--budget", type=float, default=400.0,
                   help="seconds after which remaining cases are skipped (default %(default)s)")
    p.add_argument("--lengths", default=None,
                   help="comma-separated sequence lengths of the speed section (default "
                        "4096,8192,16384; dry run 64)")
    p.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    p.add_argument("--repeats", type=int, default=None,
                   help="backward passes of the determinism section (default 20; dry run 3)")
    args = p.parse_args(argv)
    bad = set(args.sections.split(",")) - set(SECTIONS)
    if bad:
        p.error(f"--sections: unknown {', '.join(sorted(bad))}; choose from {', '.join(SECTIONS)}")
    return args


# ---- the run's record --------------------------------------------------------------------------


class Run:
    """Results, the clock and the budget; the JSON is rewritten after every case."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        self.args, self.device, self.t0 = args, device, time.time()
        self.data: Dict[str, Any] = {"env": {}, **{s: [] for s in SECTIONS}}
        self.failed: List[str] = []

    def over(self) -> bool:
        return time.time() - self.t0 > self.args.budget

    def case(self, section: str, name: str, fn: Callable[[], Dict[str, Any]]) -> None:
        rec: Dict[str, Any] = {"case": name}
        if self.over():
            rec["skipped"] = f"budget of {self.args.budget:.0f} s spent"
        else:
            t = time.time()
            try:
                rec.update(fn())
            except Exception as exc:  # record and go on: one broken case must not end the run
                rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                rec["traceback"] = traceback.format_exc()[-4000:]
                rec["ok"] = False if section != "speed" else None
            rec["seconds"] = round(time.time() - t, 2)
        if rec.get("ok") is False:
            self.failed.append(f"{section}/{name}")
        self.data[section].append(rec)
        status = ("skipped" if "skipped" in rec else "ERROR " + rec["error"][:200]
                  if "error" in rec else "ok" if rec.get("ok", True) else "FAILED")
        print(f"[{time.time() - self.t0:6.1f} s] {section}/{name}: {status} "
              f"{_brief(rec)}", flush=True)
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.time() - self.t0, 1)
        self.data["failed"] = self.failed
        with open(self.args.out, "w") as f:
            json.dump(self.data, f, indent=1, default=str)


def _brief(rec: Dict[str, Any]) -> str:
    keys = [k for k in ("err", "base", "ms", "ratio") if k in rec]
    parts = []
    for k in keys:
        v = rec[k]
        parts.append(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}")
    if "grads" in rec:
        parts.append("grads " + " ".join(f"{n}={g['err']:.2g}/{g['base']:.2g}"
                                          for n, g in rec["grads"].items()))
    if "peers" in rec:
        parts.append(" ".join(f"{n}={p.get('ms', p.get('skipped', p.get('error', '?')))}"
                              if not isinstance(p.get("ms"), float) else f"{n}={p['ms']:.3f}ms"
                              for n, p in rec["peers"].items()))
    return " ".join(parts)


# ---- correctness -------------------------------------------------------------------------------


def _inputs(torch, shape, dtype, device, seed):
    n, hq, hkv, lq, lk, dqk, dv = shape
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_(True)

    return r(n, hq, lq, dqk), r(n, hkv, lk, dqk), r(n, hkv, lk, dv)


def feature_grid(torch, attnkit, shape, device) -> Dict[str, Dict[str, Any]]:
    """The correctness cases: keywords of attnkit.attention, sized for ``shape``."""
    from attnkit import masks, score_mods

    n, hq, hkv, lq, lk, _, _ = shape
    g = torch.Generator(device="cpu").manual_seed(1)

    def t(x):
        return x.to(device)

    docs = [lk // 4, lk // 2, lk - lk // 4 - lk // 2]
    return {
        "dense": {},
        "causal_top_left": dict(causal=True),
        "causal_bottom_right": dict(causal=True, diagonal="bottom_right"),
        "window_causal_bottom_right": dict(causal=True, diagonal="bottom_right",
                                           window=(lk // 4, 0)),
        "window_two_sided": dict(window=(lk // 8, lk // 16)),
        "seqlens": dict(seqlens_q=t(torch.tensor([lq, lq // 3] * (n // 2) + [lq] * (n % 2))),
                        seqlens_kv=t(torch.tensor([lk, lk // 2] * (n // 2) + [lk] * (n % 2))),
                        causal=True, diagonal="bottom_right"),
        "documents": dict(mask=masks.and_masks(masks.document_from_lengths(docs),
                                               masks.causal())) if lq == lk else
        dict(mask=masks.document_from_lengths(docs)),
        "alibi": dict(alibi_slopes=t(score_mods.alibi_slopes(hq)), causal=True),
        "softcap": dict(softcap=30.0, causal=True),
        "sinks": dict(sinks=t(torch.randn(hq, generator=g)).requires_grad_(True)),
        "relative_bias": dict(score_mod=score_mods.relative_bias(
            t(torch.randn(hq, lq + lk - 1, generator=g)))),
        "bool_mask": dict(mask=t(torch.rand(1, 1, lq, lk, generator=g) > 0.2)),
        "bias_grad": dict(bias=t(torch.randn(hq, lq, lk, generator=g)).requires_grad_(True)),
        "lambda_mask_mod": dict(mask=lambda b, h, i, j: ((i + 3 * j + h) % 7 != 0)),
        "block_mask": dict(mask=attnkit.create_block_mask(
            lambda b, h, i, j: (j <= i + 64) & ((i // 5 + j) % 3 != 1), 1, 1, lq, lk,
            device=device, BLOCK_SIZE=min(128, max(16, 1 << (lq // 2).bit_length() - 1)))),
        # (no causal: at the dry run's sizes a row seeing one key is all output rounding)
        "dropout": dict(dropout_p=0.1, seed=1234, window=(lk // 2, lk // 2)),
    }


def plain_attention(torch, q, k, v, kw, attnkit):
    """The same call done naively in the inputs' dtype: scale * q k^T and the softcap in that
    dtype, every other score term as a dense additive tile (bias and sinks as their own
    leaves, so they get gradients), every mask term as a dense mask, dropout as a dense keep
    multiplier. FlashAttention's error baseline."""
    from attnkit import reference as oracle

    dtype = q.dtype
    f64 = {n: (x.detach().double() if torch.is_tensor(x) and x.is_floating_point() else x)
           for n, x in kw.items() if n not in ("bias", "sinks", "dropout_p", "seed", "offset")}
    qd, kd, vd = (x.detach().double() for x in (q, k, v))
    s, vis = oracle.scores(qd, kd, vd, **f64)
    s0, _ = oracle.scores(qd, kd, vd, softcap=kw.get("softcap"))
    grp = q.shape[-3] // k.shape[-3]
    kk, vv = k.repeat_interleave(grp, -3), v.repeat_interleave(grp, -3)
    raw = (q @ kk.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if kw.get("softcap") is not None:
        raw = kw["softcap"] * torch.tanh(raw / kw["softcap"])
    sc = raw + (s - s0).to(dtype)
    if kw.get("bias") is not None:
        sc = sc + kw["bias"].to(dtype)
    sc = sc.masked_fill(~vis, float("-inf"))
    if kw.get("sinks") is not None:
        sink = kw["sinks"].to(dtype).view(1, -1, 1, 1).expand(*sc.shape[:-1], 1)
        p = torch.softmax(torch.cat([sc, sink], -1).float(), -1)[..., :-1]
    else:
        p = torch.softmax(sc.float(), -1)
    p = p.nan_to_num(0.0).to(dtype)
    if kw.get("dropout_p", 0.0) > 0.0:
        n, h, lq, lk = p.shape
        dev = p.device
        keep = attnkit.dropout.keep_mask(
            kw["seed"], kw.get("offset", 0), kw["dropout_p"],
            torch.arange(n, device=dev).view(-1, 1, 1, 1),
            torch.arange(h, device=dev).view(1, -1, 1, 1),
            torch.arange(lq, device=dev).view(1, 1, -1, 1),
            torch.arange(lk, device=dev).view(1, 1, 1, -1))
        p = p * keep.to(dtype) * (1.0 / (1.0 - kw["dropout_p"]))
    return p @ vv


def _leaves(q, k, v, kw) -> Dict[str, Any]:
    out = {"q": q, "k": k, "v": v}
    for name in ("bias", "sinks"):
        x = kw.get(name)
        if x is not None and x.requires_grad:
            out[name] = x
    return out


def _as(kw: Dict[str, Any], dtype) -> Dict[str, Any]:
    """``kw`` with float tensors cast to ``dtype`` as new leaves (requires_grad kept)."""
    import torch

    return {n: (x.detach().to(dtype).requires_grad_(x.requires_grad)
                if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in kw.items()}


def _maxdiff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def correctness_case(torch, attnkit, shape, dtype, kw, device) -> Dict[str, Any]:
    q, k, v = _inputs(torch, shape, dtype, device, seed=0)
    kw_lo = _as(kw, torch.float32)  # bias and sinks stay float32 (as a model keeps them)
    out = attnkit.attention(q, k, v, backend="triton", **kw_lo)
    q32, k32, v32 = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    kw32 = _as(kw, torch.float32)
    ref = attnkit.attention(q32, k32, v32, backend="tiled", **kw32)
    kw_p = _as(kw, torch.float32)
    plain = plain_attention(torch, q, k, v, kw_p, attnkit)
    err, base = _maxdiff(out, ref), _maxdiff(plain, ref)
    rec: Dict[str, Any] = {"dtype": str(dtype).replace("torch.", ""), "err": err, "base": base,
                           "ok": err <= 2 * base + 1e-5, "grads": {}}
    g = torch.Generator(device="cpu").manual_seed(2)
    dout = torch.randn(out.shape, generator=g).to(device)
    lv, lr, lp = _leaves(q, k, v, kw_lo), _leaves(q32, k32, v32, kw32), _leaves(q, k, v, kw_p)
    got = torch.autograd.grad(out, list(lv.values()), dout.to(dtype))
    want = torch.autograd.grad(ref, list(lr.values()), dout)
    base_g = torch.autograd.grad(plain, list(lp.values()), dout.to(dtype))
    for name, a, b, c in zip(lv, got, want, base_g):
        e, bb = _maxdiff(a, b), _maxdiff(c, b)
        rec["grads"][name] = {"err": e, "base": bb, "ok": e <= 3 * bb + 1e-5}
        rec["ok"] = rec["ok"] and rec["grads"][name]["ok"]
    return rec


def section_correctness(run: Run, torch, attnkit, device, dry: bool) -> None:
    shapes = ({"d128": (1, 2, 1, 40, 50, 16, 16)} if dry else
              {"d128": (2, 8, 2, 1000, 1100, 128, 128), "d64": (2, 8, 2, 777, 777, 64, 64),
               "dqk192_dv128": (1, 8, 1, 600, 900, 192, 128)})
    dtypes = [torch.bfloat16] if dry else [torch.bfloat16, torch.float16]
    for dtype in dtypes:
        for label, shape in shapes.items():
            grid = feature_grid(torch, attnkit, shape, device)
            # each case compiles its own kernels (seconds each): every feature once in
            # bfloat16 at d=128, a few cases for the other dtype and head dims
            if label != "d128":
                grid = {n: grid[n] for n in ("causal_bottom_right", "bias_grad")}
            elif dtype != torch.bfloat16:
                grid = {n: grid[n] for n in ("dense", "causal_top_left", "bias_grad")}
            for name, kw in grid.items():
                run.case("correctness", f"{str(dtype)[6:]}/{label}/{name}",
                         lambda kw=kw, shape=shape, dtype=dtype: correctness_case(
                             torch, attnkit, shape, dtype, kw, device))


# ---- determinism -------------------------------------------------------------------------------


def section_determinism(run: Run, torch, attnkit, device, dry: bool) -> None:
    repeats = run.args.repeats or (3 if dry else 20)
    shape = (1, 2, 1, 40, 50, 16, 16) if dry else (2, 16, 4, 2048, 2048, 128, 128)

    def once():
        q, k, v = _inputs(torch, shape, torch.bfloat16, device, seed=3)
        g = torch.Generator(device="cpu").manual_seed(4)
        bias = torch.randn(shape[1], shape[3], shape[4], generator=g).to(device)
        bias.requires_grad_(True)
        dout = torch.randn(shape[0], shape[1], shape[3], shape[6], generator=g).to(
            device, torch.bfloat16)
        first = None
        for _ in range(repeats):
            out = attnkit.attention(q, k, v, backend="triton", causal=True, bias=bias)
            grads = torch.autograd.grad(out, (q, k, v, bias), dout)
            res = (out.detach(), *grads)
            if first is None:
                first = res
            elif not all(torch.equal(a, b) for a, b in zip(first, res)):
                return {"ok": False, "repeats": repeats,
                        "differs": [n for n, a, b in zip(("out", "dq", "dk", "dv", "dbias"),
                                                         first, res) if not torch.equal(a, b)]}
        return {"ok": True, "repeats": repeats}

    run.case("determinism", "causal_gqa_bias_grad_bf16", once)


# ---- decode ------------------------------------------------------------------------------------


def section_decode(run: Run, torch, attnkit, device, dry: bool) -> None:
    from attnkit.backends import triton as tx
    from attnkit.terms.spec import PagedKV, build_spec

    n, hq, hkv, lk, d, page = (2, 8, 2, 150, 32, 16) if dry else (8, 32, 8, 8192, 128, 64)

    def case(lq: int, paged: bool):
        g = torch.Generator(device="cpu").manual_seed(5)
        lens = torch.randint(lk // 2, lk + 1, (n,), generator=g)
        lens[0] = lk
        q = torch.randn(n, hq, lq, d, generator=g).to(device, torch.bfloat16)
        kw = dict(causal=True, diagonal="bottom_right", seqlens_kv=lens.to(device),
                  softcap=30.0 if lq > 1 else None)
        width = -(-lk // page)
        if paged:
            pages = n * width
            kp = torch.randn(pages, page, hkv, d, generator=g).to(device, torch.bfloat16)
            vp = torch.randn(pages, page, hkv, d, generator=g).to(device, torch.bfloat16)
            table = torch.randperm(pages, generator=g).view(n, width).to(device)
            k, v = attnkit.gather_kv(kp, vp, table, lens.to(device))
            stub = kp.new_zeros(()).expand(n, hkv, width * page, d)
            spec = build_spec(q, stub, stub, paged=PagedKV(kp, vp, table.long()), **kw)
            plan = tx.make_plan(spec)
            out = tx.forward(spec, plan).out
        else:
            k = torch.randn(n, hkv, lk, d, generator=g).to(device, torch.bfloat16)
            v = torch.randn(n, hkv, lk, d, generator=g).to(device, torch.bfloat16)
            plan = tx.make_plan(build_spec(q, k, v, **kw))
            out = attnkit.attention(q, k, v, backend="triton", **kw)
        ref = attnkit.attention(q.float(), k.float(), v.float(), backend="tiled", **kw)
        plain = plain_attention(torch, q, k, v, kw, attnkit)
        err, base = _maxdiff(out, ref), _maxdiff(plain, ref)
        return {"err": err, "base": base, "ok": err <= 2 * base + 1e-5, "splits": plan.splits,
                "heads_per_program": plan.hg}

    for lq in (1, 4):
        for paged in (False, True):
            run.case("decode", f"lq{lq}_{'paged' if paged else 'contiguous'}",
                     lambda lq=lq, paged=paged: case(lq, paged))


# ---- speed -------------------------------------------------------------------------------------


def _timer(torch, dry: bool):
    if dry:
        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return bench
    from triton.testing import do_bench

    def bench(fn):
        return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))
    return bench


def _visible_pairs(case: str, lq: int, lk: int, window: int, docs: List[int]) -> float:
    if case in ("dense", "decode"):
        return float(lq * lk)
    if case in ("causal", "alibi", "softcap"):
        return lq * (lq + 1) / 2.0
    if case == "window":
        return float(sum(min(i + 1, window + 1) for i in range(lq)))
    if case == "document":
        return float(sum(x * (x + 1) // 2 for x in docs))
    raise ValueError(case)


class Speed:
    """What every speed case shares: the timer, the peers available, the device."""

    def __init__(self, run: Run, torch, attnkit, device: str, dry: bool) -> None:
        import importlib.util

        self.torch, self.attnkit, self.device, self.dry = torch, attnkit, device, dry
        self.bench = _timer(torch, dry)
        self.have_fa = not dry and importlib.util.find_spec("flash_attn") is not None
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.sdpa_kernel: Any = sdpa_kernel
            self.backends: Any = SDPBackend
        except Exception:
            self.sdpa_kernel = None
        self.flex = None
        if not run.args.no_flex and not dry:
            try:
                from torch.nn.attention.flex_attention import flex_attention

                self.flex = torch.compile(flex_attention, dynamic=False)
            except Exception:
                self.flex = None
        run.data["env"]["peers"] = {"flash_attn": self.have_fa,
                                    "sdpa_kernel": self.sdpa_kernel is not None,
                                    "flex_compiled": self.flex is not None}


CASES = ("dense", "causal", "window", "document", "alibi", "softcap", "decode")


def section_speed(run: Run, torch, attnkit, device, dry: bool) -> None:
    lengths = ([int(x) for x in run.args.lengths.split(",")] if run.args.lengths else
               ([64] if dry else [4096, 8192, 16384]))
    sp = Speed(run, torch, attnkit, device, dry)
    for L in lengths:
        for case in CASES:
            for passes in (("fwd",) if case == "decode" else ("fwd", "fwd+bwd")):
                run.case("speed", f"{case}_{L}_{passes}",
                         lambda L=L, case=case, passes=passes: speed_case(
                             sp, case, passes, L, ("sdpa", "flash_attn")))
    # last, as each case compiles for tens of seconds: compiled FlexAttention at one length
    flex_len = 8192 if 8192 in lengths and not dry else lengths[len(lengths) // 2]
    for case in ("causal", "document", "softcap"):
        for passes in ("fwd", "fwd+bwd"):
            run.case("speed", f"flex_{case}_{flex_len}_{passes}",
                     lambda case=case, passes=passes: speed_case(
                         sp, case, passes, flex_len, ("flex_compiled",)))


def speed_case(sp: Speed, case: str, passes: str, L: int, peers: Tuple[str, ...]
               ) -> Dict[str, Any]:
    torch, attnkit, device, dry = sp.torch, sp.attnkit, sp.device, sp.dry
    from attnkit import masks, score_mods
    from attnkit.backends import triton as tx
    from attnkit.terms.spec import build_spec

    F = torch.nn.functional
    bf = torch.bfloat16
    b, h, d = (1, 2, 16) if dry else (2, 16, 128)
    window = max(1, L // 16) if dry else 1024
    nd = 8
    docs = [L // nd] * (nd - 1) + [L - (L // nd) * (nd - 1)]
    g = torch.Generator(device="cpu").manual_seed(6)
    train = passes == "fwd+bwd"
    if case == "decode":
        bq, hq, hkv, lq = (2, 4, 2, 1) if dry else (16, 32, 8, 1)
    else:
        bq, hq, hkv, lq = b, h, h, L
    q = torch.randn(bq, hq, lq, d, generator=g).to(device, bf).requires_grad_(train)
    k = torch.randn(bq, hkv, L, d, generator=g).to(device, bf).requires_grad_(train)
    v = torch.randn(bq, hkv, L, d, generator=g).to(device, bf).requires_grad_(train)
    dout = torch.randn(bq, hq, lq, d, generator=g).to(device, bf)
    slopes = score_mods.alibi_slopes(hq).to(device)
    kw: Dict[str, Any] = {
        "dense": {}, "causal": dict(causal=True),
        "window": dict(causal=True, window=(window, 0)),
        "document": dict(mask=masks.and_masks(masks.document_from_lengths(docs),
                                              masks.causal())),
        "alibi": dict(causal=True, alibi_slopes=slopes),
        "softcap": dict(causal=True, softcap=30.0),
        "decode": dict(causal=True, diagonal="bottom_right"),
    }[case]

    def timed(fwd: Callable[[], Any], leaves: Tuple[Any, ...] = (q, k, v),
              grad_out: Any = dout) -> float:
        if not train:
            with torch.no_grad():
                return sp.bench(fwd)

        def step():
            out = fwd()
            torch.autograd.grad(out, leaves, grad_out.reshape(out.shape))
        return sp.bench(step)

    rec: Dict[str, Any] = {"L": L, "pass": passes, "B": bq, "Hq": hq, "Hkv": hkv, "d": d,
                           "peers": {}}
    pairs = _visible_pairs(case, lq, L, window, docs) * bq * hq
    flops = 4.0 * pairs * d * (3.5 if train else 1.0)  # backward: 2.5x the forward
    ms = timed(lambda: attnkit.attention(q, k, v, backend="triton", **kw))
    rec["ms"] = ms
    rec["tflops"] = flops / ms / 1e9
    if case == "decode":
        rec["kv_gbps"] = 2.0 * bq * hkv * L * d * 2 / ms / 1e6
    if not train:  # the kernels alone, the plan made once
        spec = build_spec(q, k, v, **kw)
        plan = tx.make_plan(spec)
        with torch.no_grad():
            rec["kernels_ms"] = sp.bench(lambda: tx.forward(spec, plan))

    def peer(name: str, fn: Optional[Callable[[], Any]], why: str = "", **timing: Any) -> None:
        if fn is None:
            rec["peers"][name] = {"skipped": why}
            return
        try:
            t = timed(fn, **timing)
            rec["peers"][name] = {"ms": t, "ratio": t / ms}
        except Exception as exc:
            rec["peers"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    native = case in ("dense", "causal", "decode")
    gqa = dict(enable_gqa=True) if hkv != hq else {}
    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        if "sdpa" not in peers:
            break
        if not native or sp.sdpa_kernel is None:
            peer(name, None, "no native form of this case in SDPA")
        elif dry:  # on CPU: whatever SDPA picks
            peer(name, lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=case == "causal", **gqa))
        else:
            def sdpa(backend=backend):
                with sp.sdpa_kernel(getattr(sp.backends, backend)):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal",
                                                          **gqa)
            peer(name, sdpa)

    if "flash_attn" not in peers:
        pass
    elif sp.have_fa:
        import flash_attn

        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(train)
                      for x in (q, k, v))
        # every batch row holds the same documents: packed, they are docs * B sequences
        cu = torch.tensor([0, *torch.tensor(docs * bq).cumsum(0).tolist()], device=device,
                          dtype=torch.int32)

        def fa():
            if case == "decode":
                return flash_attn.flash_attn_with_kvcache(qt, kt, vt, causal=True)
            if case == "document":
                flat = [x.reshape(-1, x.shape[2], x.shape[3]) for x in (qt, kt, vt)]
                return flash_attn.flash_attn_varlen_func(*flat, cu, cu, max(docs), max(docs),
                                                         causal=True)
            extra: Dict[str, Any] = {}
            if case == "window":
                extra["window_size"] = (window, 0)
            if case == "alibi":
                extra["alibi_slopes"] = slopes.float()
            if case == "softcap":
                extra["softcap"] = 30.0
            return flash_attn.flash_attn_func(qt, kt, vt, causal=case != "dense", **extra)

        peer("flash_attn", fa, leaves=(qt, kt, vt))
    else:
        peer("flash_attn", None, "dry run" if dry else "flash_attn not installed")

    if "flex_compiled" not in peers:
        pass
    elif sp.flex is not None and case != "decode":
        from torch.nn.attention.flex_attention import create_block_mask

        seg = torch.repeat_interleave(torch.arange(len(docs), device=device),
                                      torch.tensor(docs, device=device))

        def mask_mod(b_, h_, i, j):
            m = j <= i
            if case == "window":
                m = m & (i - j <= window)
            if case == "document":
                m = m & (seg[i] == seg[j])
            return m

        score_mod = None
        if case == "alibi":
            def score_mod(s, b_, h_, i, j):
                return s - slopes[h_] * (i - j).abs()
        elif case == "softcap":
            def score_mod(s, b_, h_, i, j):
                return 30.0 * torch.tanh(s / 30.0)
        bm = None if case == "dense" else create_block_mask(mask_mod, None, None, L, L,
                                                            device=device)
        peer("flex_compiled", lambda: sp.flex(q, k, v, score_mod=score_mod, block_mask=bm))
    else:
        peer("flex_compiled", None, "dry run" if dry else "torch has no FlexAttention")
    return rec


# ---- main --------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter must be on before triton is imported (torch imports it)
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__),
                                   *(sys.argv[1:] if argv is None else argv)], env)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    import triton

    import attnkit
    from attnkit.backends import triton as tx

    if args.dry_run:
        device = "cpu"
        tx.TILES = (32, 32)
    elif not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or use --dry-run", file=sys.stderr)
        return 2
    else:
        device = "cuda"
    run = Run(args, device)
    env = run.data["env"]
    env.update(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               attnkit=attnkit.__version__, dry_run=args.dry_run, device=device)
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=p.total_memory / 2 ** 30,
                   cuda=torch.version.cuda)
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except Exception:
        env["flash_attn"] = None
    print(json.dumps(env), flush=True)
    torch.manual_seed(0)
    wanted = args.sections.split(",")
    sections: Dict[str, Callable[..., None]] = {
        "correctness": section_correctness, "determinism": section_determinism,
        "decode": section_decode, "speed": section_speed}
    for name in SECTIONS:
        if name in wanted:
            sections[name](run, torch, attnkit, device, args.dry_run)
    run.save()
    print(f"done in {time.time() - run.t0:.0f} s; {len(run.failed)} failed"
          + (": " + ", ".join(run.failed) if run.failed else "") + f"; results in {args.out}")
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
