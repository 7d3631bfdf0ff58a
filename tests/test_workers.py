"""Work items over the cores, each single-threaded (attnkit.backends.workers), and the tiled
executor on them: the same numbers as one thread and as the float64 oracle."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import attnkit
from attnkit.backends import workers
from attnkit.reference import attention_reference


def test_for_each_runs_every_item_single_threaded_on_several_threads():
    seen, idents = [], set()
    lock = threading.Lock()
    before = torch.get_num_threads()

    def fn(i):
        with lock:
            seen.append((i, torch.get_num_threads(), torch.is_grad_enabled()))
            idents.add(threading.get_ident())
        time.sleep(0.005)  # long enough that every thread gets items

    with torch.no_grad():
        workers.for_each(list(range(40)), fn, threads=2)
    assert sorted(i for i, _, _ in seen) == list(range(40))
    assert all(t == 1 for _, t, _ in seen)  # each item on one thread
    assert not any(g for _, _, g in seen)  # the caller's grad mode
    assert torch.get_num_threads() == before  # the caller's thread count is its own again
    assert threading.get_ident() in idents and len(idents) == 2  # the caller takes items too


def test_for_each_raises_the_first_error_after_every_thread_stopped():
    def fn(i):
        if i == 3:
            raise KeyError("item 3")

    with pytest.raises(KeyError, match="item 3"):
        workers.for_each(list(range(10)), fn, threads=2)


def test_threads_for_stays_serial_where_it_must():
    cpu = torch.device("cpu")
    assert workers.threads_for(100, cpu) == torch.get_num_threads()
    assert workers.threads_for(1, cpu) == 1
    assert workers.threads_for(100, torch.device("meta")) == 1
    torch.use_deterministic_algorithms(True)
    try:
        assert workers.threads_for(100, cpu) == 1  # summation order would vary
    finally:
        torch.use_deterministic_algorithms(False)
    inner = []
    workers.for_each([0, 1], lambda i: inner.append(workers.threads_for(100, cpu)), threads=2)
    assert inner == [1, 1]  # no nesting


@pytest.mark.parametrize("kw", [dict(causal=True, softcap=5.0),
                                dict(causal=True, window=(40, 0), dropout_p=0.2, seed=3),
                                dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))],
                         ids=["softcap", "window-dropout", "alibi"])
def test_tiled_on_two_threads_equals_one_thread_and_the_oracle(kw, monkeypatch, for_each_threads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 300, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 300, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 300, 8, generator=g, dtype=torch.float64, requires_grad=True)
    do = torch.randn(2, 4, 300, 8, generator=g, dtype=torch.float64)
    monkeypatch.setattr(attnkit.plan, "TILE_ELEMENTS", 2048)  # many query tiles
    used = for_each_threads

    def run(n):
        monkeypatch.setattr(workers, "threads_for", lambda items, device: n)
        out = attnkit.attention(q, k, v, backend="tiled", **kw)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    two, one = run(2), run(1)
    assert used[:2] == [2, 2]  # the forward and the backward went wide
    ref_kw = {key: val for key, val in kw.items() if key != "seed"}
    if "dropout_p" not in kw:
        ref = attention_reference(q, k, v, **ref_kw)
        want = (ref, *torch.autograd.grad(ref, (q, k, v), do))
        for a, b in zip(two, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(two, one):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_learnable_bias_backward_stays_on_the_callers_thread(monkeypatch, for_each_threads):
    """dbias is one accumulator: that backward is not spread (and still right)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 200, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    bias = torch.randn(1, 2, 200, 200, generator=g, dtype=torch.float64, requires_grad=True)
    monkeypatch.setattr(attnkit.plan, "TILE_ELEMENTS", 2048)
    calls = for_each_threads
    out = attnkit.attention(q, k, v, bias=bias, backend="tiled")
    got = torch.autograd.grad(out.sum(), (q, k, v, bias))
    ref = attention_reference(q, k, v, bias=bias)
    want = torch.autograd.grad(ref.sum(), (q, k, v, bias))
    assert calls[1:] == [1] and calls[0] == torch.get_num_threads()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_threads():
    """A pool made before fork has no threads in the child (a DataLoader worker): the child
    makes its own instead of queueing work nobody runs."""
    workers.for_each(list(range(8)), lambda i: time.sleep(0.001), threads=2)  # pool exists
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the work finished
        code = 1
        try:
            done = []
            t = threading.Thread(target=lambda: workers.for_each(
                list(range(8)), lambda i: (time.sleep(0.05), done.append(i)), threads=2))
            t.start()
            t.join(20)
            code = 0 if sorted(done) == list(range(8)) and not t.is_alive() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_one_thread_leaves_small_blocks_and_switches_for_large_ones(monkeypatch):
    """Under torch's grain a block's ops run on the caller anyway: no thread-count switch
    (tens of microseconds each); at or over it the block runs single-threaded."""
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with workers.one_thread(workers.TORCH_GRAIN - 1):
        pass
    assert calls == []
    with workers.one_thread(workers.TORCH_GRAIN):
        assert calls == [1]
    assert calls == [1, 2]
    calls.clear()
    with workers.one_thread():  # unknown size: switch
        pass
    assert calls == [1, 2]


@pytest.mark.skipif(not (attnkit.native.available() and attnkit.native.build_info().get("flash")),
                    reason="needs the native flash kernel")
@pytest.mark.parametrize("length", [64, 16384], ids=["small", "large"])
def test_flash_terms_switch_threads_only_for_large_calls(length, monkeypatch):
    """The flash executor's terms (rows' key intervals) are small for short sequences: built
    without a thread-count switch there, with one for long ones; the same output as the
    oracle either way."""
    sizes = []
    real = workers.one_thread
    monkeypatch.setattr(workers, "one_thread",
                        lambda elements=None: (sizes.append(elements), real(elements))[1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, length, 16, generator=g) for _ in range(3))
    out = attnkit.attention(q, k, v, window=(8, 0), backend="flash")
    assert sizes and all(s >= 2 * length for s in sizes)  # rows and key ids
    assert all(s < workers.TORCH_GRAIN for s in sizes) == (length == 64)
    ref = attention_reference(q.double(), k.double(), v.double(), window=(8, 0))
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
