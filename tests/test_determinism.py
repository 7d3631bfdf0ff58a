"""Determinism: the same call's backward gives the same bits every time, whatever the timing
of its threads (every CPU executor with a backward; the flash kernel's 512- and 256-bit
builds), and gradients within the float64 oracle's tolerance; every executor honours
``torch.use_deterministic_algorithms(True)``.

A sum whose order follows the threads' timing shows as bits that change from run to run; a
second busy process (``busy_core``) makes the timing vary, so such a sum shows within a few
runs. A kernel that sums in a fixed order gives the same bits under any timing. (The triton
executor runs on CUDA only; each element of its gradients is written by one program.)"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from conftest import fa_tolerance_ok

import attnkit
from attnkit import backends, native, score_mods
from attnkit.reference import attention_reference
from attnkit.spec import build_spec

REPEATS = 10
HEAD_DIM = 64

#: (B, Hq, Hkv, L): one (batch, kv head) row of many key blocks (odd length, grouped-query),
#: many (batch, kv head) rows of a few blocks each (three of the flash backward's key
#: super-blocks: two partial sums of a row add up alike in either order, three need not), and
#: a shorter row for the executors of torch ops (several times slower a call)
SHAPES: Dict[str, Tuple[int, int, int, int]] = {"long": (1, 2, 1, 700),
                                               "many_rows": (6, 4, 2, 555),
                                               "short": (1, 2, 1, 333)}
CASES = ("causal_softcap", "causal", "alibi", "table")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _case(name: str, hq: int, table: Optional[torch.Tensor] = None) -> dict:
    """The keywords of a case (``table``: the relative table, learnable, for "table")."""
    if name == "causal_softcap":
        return dict(causal=True, softcap=10.0)
    if name == "causal":
        return dict(causal=True)
    if name == "alibi":  # (not causal: every key of every row carries the term)
        return dict(alibi_slopes=torch.tensor([2.0 ** (-8 * (h + 1) / hq) for h in range(hq)]))
    if name == "table":
        return dict(causal=True, score_mod=score_mods.relative_bias(table))
    raise ValueError(f"unknown case {name!r}")


def _inputs(shape: str, case: str, dtype: torch.dtype, seed: int = 0):
    """q, k, v (learnable), dout, the case's keywords and its learnable table (or None)."""
    n, hq, hkv, length = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(dtype)

    q = rand(n, hq, length, HEAD_DIM).requires_grad_()
    k = rand(n, hkv, length, HEAD_DIM).requires_grad_()
    v = rand(n, hkv, length, HEAD_DIM).requires_grad_()
    dout = rand(n, hq, length, HEAD_DIM)
    table = None
    if case == "table":  # one row a head, or (many rows) one row for every head
        rows = (hq,) if shape != "many_rows" else ()
        table = (0.5 * torch.randn(*rows, 2 * 96 - 1, generator=g)).requires_grad_()
    return q, k, v, dout, _case(case, hq, table), table


def _skip_unless_runs(executor: str, q, k, v, kw) -> None:
    why = backends.reasons(backends.REGISTRY[executor], build_spec(q, k, v, **kw))
    if why:
        pytest.skip(f"{executor}: " + "; ".join(why))


def _grads(executor: str, q, k, v, dout, kw, table) -> Tuple[torch.Tensor, ...]:
    """One forward and backward: dq, dk, dv (and the table's gradient)."""
    out = attnkit.attention(q, k, v, backend=executor, **kw)
    wrt = (q, k, v) if table is None else (q, k, v, table)
    return tuple(g.detach() for g in torch.autograd.grad(out, wrt, dout))


def repeated(executor: str, shape: str, case: str, dtype: torch.dtype, repeats: int = REPEATS
             ) -> Tuple[Tuple[torch.Tensor, ...], List[str]]:
    """The first run's gradients and, for every later run, which gradients differ from them
    in any bit (``"run 3: dq"``)."""
    q, k, v, dout, kw, table = _inputs(shape, case, dtype)
    first = _grads(executor, q, k, v, dout, kw, table)
    names = ("dq", "dk", "dv", "dtable")
    diffs = []
    for r in range(1, repeats):
        again = _grads(executor, q, k, v, dout, kw, table)
        diffs += [f"run {r}: {names[i]}" for i, (a, b) in enumerate(zip(first, again))
                  if not torch.equal(a, b)]
    return first, diffs


def _plain(q, k, v, kw):
    """The same math done naively in the inputs' dtype (FlashAttention's error baseline)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    lq, lk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if kw.get("softcap") is not None:
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    i, j = torch.arange(lq).view(-1, 1), torch.arange(lk).view(1, -1)
    if kw.get("alibi_slopes") is not None:
        s = s - (kw["alibi_slopes"].view(-1, 1, 1) * (i - j).abs()).to(s.dtype)
    if kw.get("score_mod") is not None:
        s = kw["score_mod"](s, None, torch.arange(q.shape[1]).view(-1, 1, 1), i, j).to(s.dtype)
    if kw.get("causal"):
        s = s.masked_fill(j > i, float("-inf"))
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


def check_oracle(grads, shape: str, case: str, dtype: torch.dtype, executor: str = "flash"
                 ) -> None:
    """``grads`` (of :func:`repeated`) against the float64 reference's: float32 within
    1e-4 of the largest gradient, bfloat16 by FlashAttention's rule (3x the error of the same
    math done naively in bfloat16). The fused executor's bfloat16 dK and dV are left out:
    torch's bfloat16 kernel adds each query block's share into them in bfloat16, so their
    error grows with the row's length (past the rule at 700 keys; test_core judges them on
    short rows)."""
    q, k, v, dout, kw, table = _inputs(shape, case, dtype)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    kw64, wrt = dict(kw), list(x64)
    if table is not None:
        t64 = table.detach().double().requires_grad_()
        kw64["score_mod"], wrt = score_mods.relative_bias(t64), wrt + [t64]
    want = torch.autograd.grad(attention_reference(*x64, **kw64), wrt, dout.double())
    if dtype == torch.float32:
        for name, a, b in zip(("dq", "dk", "dv", "dtable"), grads, want):
            err = (a.double() - b).abs().max().item()
            assert err <= 1e-4 * max(1.0, b.abs().max().item()), (name, err)
        return
    wrt_plain = (q, k, v) if table is None else (q, k, v, table)
    plain = torch.autograd.grad(_plain(q, k, v, kw), wrt_plain, dout)
    for name, a, b, p in zip(("dq", "dk", "dv", "dtable"), grads, want, plain):
        if executor == "fused" and name in ("dk", "dv"):
            continue
        ok, err, base = fa_tolerance_ok(a, b, p, mult=3.0)
        assert ok, (name, err, base)


@pytest.fixture(scope="module")
def busy_core():
    """A second process that keeps a core busy for the module's tests: a call's threads are
    then descheduled at moments that differ from run to run."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _params() -> List:
    """Every (executor, shape, case, dtype): flash on the long row and the many rows, the
    executors of torch ops on the short row."""
    out = []
    for executor in ("flash", "fused", "tiled"):
        for shape in ("long", "many_rows") if executor == "flash" else ("short",):
            for case in CASES:
                for dname, dtype in DTYPES.items():
                    out.append(pytest.param(executor, shape, case, dtype,
                                            id=f"{executor}-{shape}-{case}-{dname}"))
    return out


@pytest.mark.parametrize("executor, shape, case, dtype", _params())
def test_the_backward_gives_the_same_bits_every_run(executor, shape, case, dtype, busy_core,
                                                    two_threads):
    """Ten backwards of one call on two threads, beside a busy process: dq, dk, dv (and a
    learnable table's gradient) bitwise equal to the first run's, which is within the float64
    oracle's tolerance."""
    q, k, v, _, kw, _ = _inputs(shape, case, dtype)
    _skip_unless_runs(executor, q, k, v, kw)
    first, diffs = repeated(executor, shape, case, dtype)
    assert not diffs, diffs
    check_oracle(first, shape, case, dtype, executor)


@pytest.mark.skipif(not (native.available() and native.build_info().get("flash")),
                    reason="the native flash kernel needs a C compiler and an AVX-512 or AVX2 "
                           "+ FMA CPU")
def test_flash_bits_do_not_depend_on_which_thread_ran_the_work(two_threads):
    """Two calls at once, from two Python threads: they share the cores, and the kernel's
    threads (torch's team, attnkit's pool, or the calling thread alone, which then runs every
    work item itself); each gives the bits of the call made alone."""
    want = repeated("flash", "long", "causal_softcap", torch.float32, repeats=1)[0]
    got: List[Tuple[torch.Tensor, ...]] = []
    failed: List[BaseException] = []

    def call() -> None:
        torch.set_num_threads(2)  # (torch's thread count is the calling thread's own)
        try:
            got.append(repeated("flash", "long", "causal_softcap", torch.float32,
                                repeats=1)[0])
        except BaseException as err:  # noqa: BLE001 (re-raised below)
            failed.append(err)

    for _ in range(4):
        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failed, failed
    assert len(got) == 8
    for grads in got:
        assert all(torch.equal(a, b) for a, b in zip(grads, want))


_AVX2_SCRIPT = r"""
import sys
import torch
sys.path.insert(0, {tests!r})
import test_determinism as t
from attnkit import native
assert native.build_info()["flash_bits"] == 256, native.build_info()
torch.set_num_threads(2)
for case, dtype in (("causal_softcap", torch.float32), ("table", torch.float32),
                    ("causal", torch.bfloat16)):
    first, diffs = t.repeated("flash", "long", case, dtype)
    assert not diffs, (case, dtype, diffs)
    t.check_oracle(first, "long", case, dtype)
print("REPEATABLE")
"""


@pytest.mark.skipif(not (native.available() and native.build_info().get("flash")),
                    reason="the native flash kernel needs a C compiler and an AVX-512 or AVX2 "
                           "+ FMA CPU")
def test_the_256_bit_flash_backward_gives_the_same_bits_every_run(busy_core):
    """ATTNKIT_NATIVE_AVX512=0 (the 256-bit build that CPUs without AVX-512 run), in a fresh
    process: ten backwards on two threads, bitwise equal and within the oracle's tolerance."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ATTNKIT_NATIVE_AVX512="0")
    proc = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT.format(tests=tests)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REPEATABLE" in proc.stdout


@pytest.fixture
def deterministic_mode():
    before = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn)


@pytest.mark.parametrize("executor", ["flash", "fused", "tiled"])
def test_every_executor_runs_its_backward_under_deterministic_algorithms(
        executor, two_threads, deterministic_mode):
    """Under torch.use_deterministic_algorithms(True) (which also fills new tensors with
    NaN) each executor runs its backward, repeatably and within the oracle's tolerance; the
    flash kernel gives the bits it gives outside that mode."""
    q, k, v, _, kw, _ = _inputs("short", "causal", torch.float32)
    _skip_unless_runs(executor, q, k, v, kw)
    first, diffs = repeated(executor, "short", "causal", torch.float32, repeats=3)
    assert not diffs, diffs
    check_oracle(first, "short", "causal", torch.float32, executor)
    if executor == "flash":
        torch.use_deterministic_algorithms(False)
        outside = repeated(executor, "short", "causal", torch.float32, repeats=1)[0]
        assert all(torch.equal(a, b) for a, b in zip(first, outside))


def test_decoding_under_deterministic_algorithms(two_threads, deterministic_mode):
    """The decode executor (forward only) under deterministic algorithms: the same bits every
    call, within the oracle's tolerance."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 8, 1, HEAD_DIM, generator=g)
    k = torch.randn(3, 2, 2000, HEAD_DIM, generator=g)
    v = torch.randn(3, 2, 2000, HEAD_DIM, generator=g)
    kw = dict(softcap=20.0)
    _skip_unless_runs("decode", q, k, v, kw)
    first = attnkit.attention(q, k, v, backend="decode", **kw)
    for _ in range(REPEATS - 1):
        assert torch.equal(attnkit.attention(q, k, v, backend="decode", **kw), first)
    want = attention_reference(q.double(), k.double(), v.double(), **kw)
    torch.testing.assert_close(first.double(), want, atol=2e-6, rtol=2e-5)
