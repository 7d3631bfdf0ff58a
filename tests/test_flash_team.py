"""Where the flash kernel's parallel regions run (pool.c's ak_team_run): on torch's own OpenMP
threads when the library shares torch's OpenMP runtime, else on attnkit's pool
(``ATTNKIT_NATIVE_TEAM=pool`` forces it). Either way: the oracle's result, the same forward
bits, every worker index once (a forked child, several Python threads at once, and a
thread count torch changes between calls)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch
from conftest import fa_tolerance_ok, naive_attention, rand

import attnkit
from attnkit import native
from attnkit.reference import attention_reference as ref

pytestmark = pytest.mark.skipif(not native.build_info().get("flash", False),
                                reason="the native flash kernel is unavailable")
needs_fork = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                                reason="no fork start method on this platform")


def _inputs(seed=0, lq=200, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(rand(2, 4, lq, 64, gen=g, dtype=dtype) for _ in range(3))


def _flash(q, k, v, threads=2):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return attnkit.attention(q, k, v, causal=True, backend="flash")
    finally:
        torch.set_num_threads(old)


def _check_oracle(out, q, k, v):
    r = ref(q.double(), k.double(), v.double(), causal=True)
    plain = naive_attention(q, k, v, mask=torch.ones(q.shape[2], q.shape[2],
                                                     dtype=torch.bool).tril())
    ok, err, base = fa_tolerance_ok(out, r, plain)
    assert ok, (err, base)


def _decode_call():
    """A GQA decoding step big enough for two threads (the decode kernel)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 8, 1, 64, generator=g)
    k, v = (torch.randn(4, 2, 1024, 64, generator=g) for _ in range(2))
    calls = native.decode_counts()["calls"]
    out = attnkit.attention(q, k, v, causal=True, diagonal="bottom_right", backend="decode")
    assert native.decode_counts()["calls"] == calls + 1
    r = ref(q.double(), k.double(), v.double())
    assert (out.double() - r).abs().max() < 1e-5


def _softcap_call():
    """The softcap pass over 2**20 scores (the native tanh, two threads)."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(2))
    y = x.clone()
    assert native.softcap_forward_(y, 2.5)
    torch.testing.assert_close(y, 2.5 * torch.tanh(x), rtol=1e-6, atol=1e-6)


def _flash_call():
    q, k, v = _inputs()
    _check_oracle(attnkit.attention(q, k, v, causal=True, backend="flash"), q, k, v)


@pytest.mark.parametrize("kernel", [_flash_call, _decode_call, _softcap_call],
                         ids=["flash", "decode", "softcap"])
def test_the_team_is_torchs_openmp_runtime_or_the_pool(kernel):
    """'openmp' only where the process holds one OpenMP runtime (the library's is torch's)
    and torch's parallel backend is OpenMP; every kernel's call (flash, decode, softcap) then
    runs on as many threads as torch uses, on torch's threads (which torch's operators have
    just used and which spin a while: a pool thread woken then waits for their cores)."""
    team = native.build_info()["team"]
    assert team in ("openmp", "pool")
    if team == "openmp":
        runtimes = native._openmp_runtimes()
        assert runtimes is not None and len(runtimes) == 1, runtimes
        assert "parallel backend: OpenMP" in torch.__config__.parallel_info()
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    native._team_tune(late_ns=10**12, hold_ns=0)  # (a busy test machine: stay on the team)
    try:
        before = native.pool_stats()
        kernel()
        woken = native.pool_stats()["woken"] - before["woken"]
    finally:
        native._team_tune()
        torch.set_num_threads(old)
    assert native.pool_stats()["last_threads"] == 2
    # on the team no pool thread is woken; on the pool each of the call's regions wakes one
    assert (woken == 0) if team == "openmp" else (woken > 0), (team, woken)


_POOL_SCRIPT = r"""
import sys, torch, attnkit
from attnkit import native
assert native.build_info()["team"] == "pool", native.build_info()
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.rand(2, 4, 200, 64, generator=g) - 0.5 for _ in range(3))
for x in (q, k, v):
    x.requires_grad_()
out = attnkit.attention(q, k, v, causal=True, backend="flash")
grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
torch.save([out.detach(), *grads], sys.argv[1])
"""


def test_the_pool_gives_the_same_forward_bits_as_the_team(tmp_path):
    """ATTNKIT_NATIVE_TEAM=pool (a fresh process) against this process: the same forward
    bits (each query block is one worker's, whoever runs it) and gradients within float32
    rounding (dQ's per-worker sums may add in another order)."""
    path = tmp_path / "pool.pt"
    env = dict(os.environ, ATTNKIT_NATIVE_TEAM="pool")
    proc = subprocess.run([sys.executable, "-c", _POOL_SCRIPT, str(path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = torch.load(path)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.rand(2, 4, 200, 64, generator=g) - 0.5 for _ in range(3))
    for x in (q, k, v):
        x.requires_grad_()
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = attnkit.attention(q, k, v, causal=True, backend="flash")
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(out.detach(), theirs[0])
    for a, b in zip(grads, theirs[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(native.build_info().get("team") != "openmp",
                    reason="the library does not run on torch's OpenMP team here")
def test_a_late_team_thread_sends_the_next_calls_to_the_pool():
    """A team thread that starts late (here: any delay counts) marks the machine busy: the
    following calls run on the pool (which wakes its threads and never waits for one that
    has not started), with the same forward bits, until the hold ends; then the team again."""
    q, k, v = _inputs(2)
    want = _flash(q, k, v, threads=1)
    native._team_tune(late_ns=-1, hold_ns=60 * 10**9)
    try:
        s0 = native.pool_stats()
        first = _flash(q, k, v, threads=2)  # its one region on the team, found late
        s1 = native.pool_stats()
        held = _flash(q, k, v, threads=2)   # within the hold: its region on the pool
        s2 = native.pool_stats()
        native._team_tune(late_ns=10**12, hold_ns=0)  # the hold ended, nothing counts late
        after = _flash(q, k, v, threads=2)
        s3 = native.pool_stats()
    finally:
        native._team_tune()
    assert torch.equal(first, want) and torch.equal(held, want) and torch.equal(after, want)
    # the forward is one region (the query blocks, which pack the key blocks as they need them)
    assert s1["team_late"] - s0["team_late"] == 1 and s1["team_held"] == s0["team_held"]
    assert s2["team_held"] - s1["team_held"] == 1 and s2["team_late"] == s1["team_late"]
    assert s2["woken"] - s1["woken"] == 1 and s2["last_threads"] == 2
    assert s3["team_held"] == s2["team_held"] and s3["woken"] == s2["woken"]


def test_thread_counts_and_concurrent_callers_give_the_same_bits():
    """One thread, two threads, then three Python threads calling at once (one holds the
    team, the others run alone meanwhile): the same output each time."""
    q, k, v = _inputs(1)
    want = _flash(q, k, v, threads=1)
    _check_oracle(want, q, k, v)
    assert torch.equal(_flash(q, k, v, threads=2), want)
    errors = []

    def caller():
        for _ in range(4):
            out = attnkit.attention(q, k, v, causal=True, backend="flash")
            if not torch.equal(out, want):
                errors.append("a concurrent call differs")

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a concurrent call never returned"
    assert not errors


def _child(conn, q, k, v):
    # (bytes, not the tensor: sending a tensor copies it into shared memory with a torch op
    # that, this large, runs on OpenMP's team, which a forked child of a parent that used
    # it cannot run; torch's own ops share that limit, see the README)
    out = _flash(q, k, v, threads=2)
    conn.send((out.numpy().tobytes(), native.pool_stats()["last_threads"]))
    conn.close()


@needs_fork
def test_a_forked_child_runs_the_kernel_after_the_parent_used_the_team():
    """A child forked after the parent's calls (OpenMP's threads do not exist there: the
    child runs on a pool of its own) gets the parent's bits on 2 threads and returns."""
    q, k, v = _inputs(2)
    want = _flash(q, k, v, threads=2)
    ctx = multiprocessing.get_context("fork")
    for _ in range(2):
        here, there = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(there, q, k, v))
        proc.start()
        assert here.poll(300), "the forked child did not answer"
        out, used = here.recv()
        proc.join(timeout=60)
        assert proc.exitcode == 0
        assert out == want.numpy().tobytes() and used == 2
    assert torch.equal(_flash(q, k, v, threads=2), want)
