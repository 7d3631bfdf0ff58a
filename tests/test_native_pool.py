"""The native kernels' persistent thread pool (attnkit/native/pool.c), judged by the float64
oracle: the same results on any number of threads, ``torch.set_num_threads`` followed call by
call, no OS thread started per call, calls from several Python threads at once, forked
children (also while another thread is inside the pool), small calls on the caller alone, and
arguments refused before any work."""

from __future__ import annotations

import math
import multiprocessing
import os
import threading

import pytest
import torch
from conftest import fa_tolerance_ok, naive_attention, rand

import attnkit
from attnkit import native
from attnkit.reference import attention_reference

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native kernel: {native.unavailable_reason()}")

# Big enough that each of BATCH threads gets AK_DECODE_WORK_PER_THREAD multiply-adds or more
BATCH, HQ, HKV, KEYS, D = 6, 8, 2, 300, 64
SCALE = 1 / math.sqrt(D)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


@pytest.fixture(autouse=True)
def _on_the_pool():
    """The kernels' calls run on the pool here: in use they run on torch's OpenMP team where
    the library shares torch's runtime (test_flash_team.py), and on the pool elsewhere, under
    a busy machine's hold, and in a forked child."""
    lib = native._lib()
    lib.attnkit_team_openmp(0)
    yield
    if native.build_info()["team"] == "openmp":
        lib.attnkit_team_openmp(1)


def _problem(seed, *, batch=BATCH, keys=KEYS, dtype=torch.float32):
    """q (batch, HQ, 1, D) over a contiguous GQA cache with per-row lengths (one full row)."""
    gen = torch.Generator().manual_seed(seed)
    q = rand(batch, HQ, 1, D, gen=gen, dtype=dtype)
    k = rand(batch, HKV, keys, D, gen=gen, dtype=dtype)
    v = rand(batch, HKV, keys, D, gen=gen, dtype=dtype)
    lens = torch.randint(keys // 2, keys + 1, (batch,), generator=gen)
    lens[0] = keys
    return q, k, v, lens


def _decode(q, k, v, lens, threads, **kw):
    return native.dense_decode(q, k, v, SCALE, seqlens=lens, threads=threads, **kw)


def _assert_oracle(out, lse, q, k, v, lens):
    """``out`` within FlashAttention's rule of the float64 oracle (twice the error of the
    same computation in the inputs' dtype), ``lse`` within float32 rounding of it."""
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), seqlens_kv=lens,
                                       scale=SCALE, return_lse=True)
    keep = (torch.arange(k.shape[2]) < lens[:, None])[:, None, None, :]
    plain = naive_attention(q, k, v, mask=keep, scale=SCALE)
    ok, err, base = fa_tolerance_ok(out, ref, plain)
    assert ok, f"max error {err:.2e} against the oracle; the plain dtype computation: {base:.2e}"
    assert (lse.double() - ref_lse).abs().max() < 1e-4


def _delta(before):
    after = native.pool_stats()
    return {key: after[key] - before[key] for key in after}


@pytest.fixture
def torch_threads():
    """Restore torch's thread count after a test that sets it."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@DTYPES
def test_thread_counts_give_one_result_equal_to_the_oracle(dtype):
    """1, 2, 3 threads, more than there are cores, the 64 cap and past it: bit for bit the
    one-thread result (each work item is computed the same wherever it runs), which the oracle
    accepts, on as many threads as were asked for (at most one per work item); a long cache
    split across threads (flash-decoding) the same."""
    problem = _problem(1, dtype=dtype)
    one, one_lse = _decode(*problem, 1)
    assert native.pool_stats()["last_threads"] == 1
    _assert_oracle(one, one_lse, *problem)
    for threads in (2, 3, (os.cpu_count() or 2) + 3, 64, 200):
        out, lse = _decode(*problem, threads)
        assert torch.equal(out, one) and torch.equal(lse, one_lse), threads
        assert native.pool_stats()["last_threads"] == min(threads, BATCH), threads
    assert native.pool_stats()["threads"] >= BATCH - 1

    problem = _problem(2, batch=1, keys=5000, dtype=dtype)
    one, one_lse = _decode(*problem, 1, splits=4)
    _assert_oracle(one, one_lse, *problem)
    for threads in (2, 3, 4):
        out, lse = _decode(*problem, threads, splits=4)
        assert torch.equal(out, one) and torch.equal(lse, one_lse), threads
        assert native.pool_stats()["last_threads"] == threads
        out, lse = _decode(*problem, threads)  # the splits the thread count chooses
        _assert_oracle(out, lse, *problem)


@DTYPES
def test_paged_attention_follows_torch_set_num_threads(dtype, torch_threads):
    """The public front door over a PagedKVCache whose sequences' pages interleave, with
    ``torch.set_num_threads(t)`` before each call: the decode step runs on ``t`` threads
    (read back from the pool), gives the same bits for every ``t`` and matches the oracle."""
    batch, page = 4, 16
    q, k, v, _ = _problem(3, batch=batch, dtype=dtype)
    lens = torch.tensor([KEYS, 263, 201, 290])
    cache = attnkit.PagedKVCache(num_pages=batch * (KEYS // page + 1), page_size=page,
                                 num_kv_heads=HKV, head_dim=D, dtype=dtype)
    for b in range(batch):
        cache.allocate(b)
    for start in range(0, KEYS, page):  # one page of each sequence in turn
        for b in range(batch):
            end = min(start + page, int(lens[b]))
            if end > start:
                cache.append(b, k[b, :, start:end].transpose(0, 1),
                             v[b, :, start:end].transpose(0, 1))
    own = cache.pages_of(1)
    assert own != list(range(own[0], own[0] + len(own)))  # not one contiguous run of pages
    results = []
    for threads in (1, 2, 3, 1, 3, 2):
        torch.set_num_threads(threads)
        with torch.no_grad():
            out = attnkit.paged_attention(q, cache, list(range(batch)), causal=False,
                                          scale=SCALE, backend="decode")
        assert native.pool_stats()["last_threads"] == threads
        results.append(out)
    for out in results[1:]:
        assert torch.equal(out, results[0])
    ref = attention_reference(q.double(), k.double(), v.double(), seqlens_kv=lens, scale=SCALE)
    keep = (torch.arange(KEYS) < lens[:, None])[:, None, None, :]
    ok, err, base = fa_tolerance_ok(results[0], ref, naive_attention(q, k, v, mask=keep,
                                                                      scale=SCALE))
    assert ok, (err, base)


def test_softcap_follows_torch_set_num_threads(torch_threads):
    """The softcap passes on 1, 2, 3 threads (``torch.set_num_threads``, read back from the
    pool): the one-thread values bit for bit (elementwise), within 1e-6 of float64 tanh."""
    gen = torch.Generator().manual_seed(3)
    x = rand(4, 8, 128, 160, gen=gen, dtype=torch.float32) * 4  # 655360 elements
    g = rand(4, 8, 128, 160, gen=gen, dtype=torch.float32)
    results = []
    for threads in (1, 2, 3, 2):
        torch.set_num_threads(threads)
        y = x.clone()
        assert native.softcap_forward_(y, 2.5)
        assert native.pool_stats()["last_threads"] == threads
        dx = native.softcap_backward(g, x, 2.5)
        assert dx is not None and native.pool_stats()["last_threads"] == threads
        results.append((y, dx))
    t = torch.tanh(x.double())
    assert (results[0][0].double() - 2.5 * t).abs().max() < 1e-6
    assert (results[0][1].double() - g.double() * 2.5 * (1 - t ** 2)).abs().max() < 1e-5
    for y, dx in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(dx, results[0][1])


def _tasks():
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="no /proc/self/task here")
def test_no_os_thread_is_started_per_call():
    """Thousands of consecutive calls that each run on 2 threads start no OS thread: the
    process's threads (/proc/self/task, also sampled from another thread while the calls run,
    which sees any thread a call starts and joins) stay the ones the pool had after its first
    call, every result is the one-thread one and no call is lost or mixed with another."""
    problems = [_problem(10 + i, batch=2, keys=260) for i in range(8)]
    want = [_decode(*p, 1) for p in problems]
    _decode(*problems[0], 2)  # the pool's thread exists from here on
    stop, seen = threading.Event(), set()

    def sample():
        while not stop.is_set():
            seen.update(_tasks())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        before, tasks = native.pool_stats(), _tasks()
        calls = 3000
        for i in range(calls):
            out, lse = _decode(*problems[i % 8], 2)
            assert torch.equal(out, want[i % 8][0]) and torch.equal(lse, want[i % 8][1]), i
        after = _tasks()
    finally:
        stop.set()
        sampler.join(timeout=120)
    delta = _delta(before)
    assert delta["calls"] == calls and delta["threads"] == 0
    assert delta["parallel_runs"] + delta["busy_runs"] == calls
    assert after == tasks, f"threads started: {sorted(after - tasks)}"
    assert seen <= tasks, f"threads seen during the calls: {sorted(seen - tasks)}"


def test_tiny_calls_run_on_the_caller():
    """A call too small to repay waking a thread, or with a single work item, runs on the
    calling thread alone: the pool wakes nothing."""
    tiny = _problem(4, batch=2, keys=16)
    single = _problem(5, batch=1, keys=KEYS)
    want = [_decode(*p, 1) for p in (tiny, single)]
    before = native.pool_stats()
    for _ in range(200):
        for p, w in zip((tiny, single), want):
            out, lse = _decode(*p, 8)
            assert torch.equal(out, w[0]) and torch.equal(lse, w[1])
            assert native.pool_stats()["last_threads"] == 1
    delta = _delta(before)
    assert delta["calls"] == 400
    assert delta["parallel_runs"] == 0 and delta["busy_runs"] == 0 and delta["woken"] == 0


def test_a_grown_pool_wakes_only_the_threads_asked_for():
    """After a call on BATCH threads, calls on 2 and 3 wake 1 and 2 pool threads."""
    problem = _problem(6)
    _decode(*problem, BATCH)
    assert native.pool_stats()["threads"] >= BATCH - 1
    for threads in (2, 3):
        before = native.pool_stats()
        _decode(*problem, threads)
        delta = _delta(before)
        assert delta["parallel_runs"] == 1 and delta["woken"] == threads - 1


@pytest.mark.parametrize("callers", [2, 4])
def test_concurrent_calls_from_python_threads(callers):
    """2 or 4 Python threads calling the kernels at once (ctypes releases the GIL), decode on
    2-4 threads each and softcap between: every result is the serial one, which the oracle
    accepts; a call that finds the pool in use runs on its own thread, none is lost."""
    problems = [_problem(20 + i, batch=4, keys=400) for i in range(4)]
    want = [_decode(*p, 1) for p in problems]
    for p, (out, lse) in zip(problems, want):
        _assert_oracle(out, lse, *p)
    gen = torch.Generator().manual_seed(7)
    x = rand(2, 4, 256, 128, gen=gen, dtype=torch.float32) * 3
    want_cap = x.clone()
    native._lib().attnkit_softcap_forward(want_cap.data_ptr(), x.numel(), 2.0, 1)
    errors, barrier, rounds = [], threading.Barrier(callers), 120

    def work(i):
        try:
            barrier.wait()
            for j in range(rounds):
                p = (i + j) % 4
                out, lse = _decode(*problems[p], 2 + j % 3)
                if not (torch.equal(out, want[p][0]) and torch.equal(lse, want[p][1])):
                    errors.append(f"thread {i} call {j}: decode result differs")
                if j % 10 == 0:
                    y = x.clone()
                    native._lib().attnkit_softcap_forward(y.data_ptr(), y.numel(), 2.0, 3)
                    if not torch.equal(y, want_cap):
                        errors.append(f"thread {i} call {j}: softcap result differs")
        except Exception as exc:
            errors.append(repr(exc))

    before = native.pool_stats()
    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(callers)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a call never returned"
    assert not errors, errors[:5]
    delta = _delta(before)
    assert delta["calls"] == callers * (rounds + rounds // 10)
    assert delta["parallel_runs"] + delta["busy_runs"] == delta["calls"]


@pytest.mark.parametrize("callers", [1, 2, 4])
def test_pool_contract_under_concurrent_callers(callers):
    """The pool's own self-check (attnkit_pool_check), from 1, 2 or 4 Python threads at once
    with 1 to 5 workers per call: every worker index of every call ran exactly once and had
    finished when the call returned, and none ran after it."""
    lib, errors = native._lib(), []
    barrier = threading.Barrier(callers)

    def work(i):
        try:
            barrier.wait()
            for n in (2, 3, 1, 5, 2):
                bad = lib.attnkit_pool_check(300, n, 3000 * (1 + i % 2))
                if bad:
                    errors.append(f"thread {i}, {n} workers: {bad} of 300 calls broke it")
        except Exception as exc:
            errors.append(repr(exc))

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(callers)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a call never returned"
    assert not errors, errors[:5]


def _child(conn, problem, want):
    """In a forked child: the pool starts empty and idle; decode on 2 threads."""
    try:
        fresh = native.pool_stats()
        out, lse = _decode(*problem, 2)
        ok = torch.equal(out, want[0]) and torch.equal(lse, want[1])
        stats = native.pool_stats()
        ok = ok and native._lib().attnkit_pool_check(200, 3, 1000) == 0
        conn.send((fresh["threads"], fresh["calls"], stats["last_threads"], ok))
    except Exception as exc:
        conn.send(repr(exc))
    finally:
        conn.close()


def _run_child(ctx, problem, want):
    """Fork a child running _child; its answer, or why there is none."""
    parent_end, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child_end, problem, want))
    proc.start()
    child_end.close()
    got = parent_end.recv() if parent_end.poll(60) else "no answer from the child: it hung"
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert isinstance(got, tuple), got
    assert proc.exitcode == 0
    return got


needs_fork = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                                reason="no fork start method on this platform")


@needs_fork
def test_a_forked_child_starts_its_own_pool():
    """After the parent has used the pool, a child forked with multiprocessing ('fork')
    inherits no pool threads (they do not exist there) and no counts, starts its own and gets
    the oracle's result; the parent's pool still works afterwards."""
    problem = _problem(30)
    want = _decode(*problem, 1)
    _assert_oracle(*want, *problem)
    out, _ = _decode(*problem, 4)
    assert torch.equal(out, want[0])
    assert native.pool_stats()["threads"] >= 3
    ctx = multiprocessing.get_context("fork")
    for _ in range(2):
        fresh_threads, fresh_calls, used, ok = _run_child(ctx, problem, want)
        assert fresh_threads == 0 and fresh_calls == 0 and used == 2 and ok
        out, lse = _decode(*problem, 4)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        assert native.pool_stats()["last_threads"] == 4


@needs_fork
def test_fork_while_another_thread_is_inside_the_pool():
    """Children forked while another Python thread keeps calling the kernels (so the fork
    often lands while that thread holds the pool, its flag or its mutex) decode correctly on
    2 threads of their own, without waiting for a thread they do not have."""
    problem = _problem(31)
    want = _decode(*problem, 1)
    stop, errors = threading.Event(), []

    def hammer():
        while not stop.is_set():
            out, _ = _decode(*problem, 2)
            if not torch.equal(out, want[0]):
                errors.append("the parent's concurrent call differs")

    busy = threading.Thread(target=hammer, daemon=True)
    busy.start()
    try:
        ctx = multiprocessing.get_context("fork")
        for _ in range(6):
            fresh_threads, fresh_calls, used, ok = _run_child(ctx, problem, want)
            assert fresh_threads == 0 and fresh_calls == 0 and used == 2 and ok
    finally:
        stop.set()
        busy.join(timeout=120)
    assert not busy.is_alive(), "the parent's concurrent call never returned"
    assert not errors


def test_bad_arguments_are_refused_before_any_work():
    """The kernel checks what it will read on the calling thread before any work: a page
    index outside the pages, a sequence longer than its block-table row, a negative length
    or start raise ValueError (the process survives) and the pool runs nothing."""
    gen = torch.Generator().manual_seed(8)
    pages, page = 6, 16
    q = rand(2, HQ, 1, D, gen=gen, dtype=torch.float32)
    kp = rand(pages, page, HKV, D, gen=gen, dtype=torch.float32)
    vp = rand(pages, page, HKV, D, gen=gen, dtype=torch.float32)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]])
    lens = torch.tensor([40, 33])
    out, lse = native.paged_decode(q, kp, vp, table, lens, scale=SCALE, causal=False)
    k, v = (x[table].flatten(1, 2).transpose(1, 2) for x in (kp, vp))
    _assert_oracle(out, lse, q, k, v, lens)
    bad = [(torch.tensor([[0, 1, 2], [3, pages, 5]]), lens, None),   # past the last page
           (torch.tensor([[0, -1, 2], [3, 4, 5]]), lens, None),      # negative page index
           (table, torch.tensor([40, 3 * page + 1]), None),          # longer than its row
           (table, torch.tensor([40, -1]), None),                    # negative length
           (table, lens, torch.tensor([0, 16])),                     # starts past the row
           (table, lens, torch.tensor([-1, 0]))]                     # negative start
    for bt, ln, starts in bad:
        before = native.pool_stats()
        with pytest.raises(ValueError, match="refused its arguments"):
            native.paged_decode(q, kp, vp, bt, ln, scale=SCALE, causal=False, starts=starts,
                                threads=2)
        assert _delta(before)["calls"] == 0
    # padding entries past a sequence's pages are never read, so they may hold anything
    padded = torch.tensor([[0, 1, 2], [3, 4, 99]])
    out2, lse2 = native.paged_decode(q, kp, vp, padded, torch.tensor([40, 32]), scale=SCALE,
                                     causal=False)
    assert torch.equal(out2[0], out[0])
