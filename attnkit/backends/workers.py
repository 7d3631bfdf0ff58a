"""Independent work items spread over the cores, each item single-threaded.

An executor that walks many small pieces (the tiled executor's query tiles) with torch ops
runs one parallel region per op: every op's end waits for all of torch's threads, so when
the OS deschedules one of them (another process wants the core) every op waits for it, and
the call's time grows with the number of ops. :func:`for_each` instead hands whole items to
``torch.get_num_threads()`` threads (the caller's and a persistent pool's), each running its
items' ops on one thread (torch's thread count is per thread: setting it in a worker leaves
the caller's alone) and taking the next item when it is done: a descheduled thread delays only
its own item while the others go on. The workers run with the caller's grad and inference
mode (both are per thread in torch).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

_pools: Dict[int, ThreadPoolExecutor] = {}
_pools_pid = os.getpid()
_lock = threading.Lock()
_local = threading.local()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The persistent pool of ``workers`` threads of this process (a forked child, such as a
    DataLoader worker, inherits the pools but not their threads: it makes its own)."""
    global _pools_pid
    with _lock:
        if _pools_pid != os.getpid():
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.get(workers)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnkit")
            _pools[workers] = pool
        return pool


if hasattr(os, "register_at_fork"):  # the lock may have been held by a thread that is gone
    os.register_at_fork(after_in_child=lambda: globals().update(_lock=threading.Lock()))


#: torch's ``at::internal::GRAIN_SIZE``: an operator over fewer elements than this runs on
#: the calling thread (no parallel region) whatever the thread count
TORCH_GRAIN = 32768


@contextlib.contextmanager
def one_thread(elements: Optional[int] = None) -> Iterator[None]:
    """torch ops on the calling thread alone inside the block (small elementwise work such as
    a mask tile: split across threads it costs a parallel region each, which a busy machine
    makes slow, for little work).

    ``elements``: the most elements any op in the block touches, when the caller knows it;
    under :data:`TORCH_GRAIN` torch keeps such ops on the calling thread anyway, and the
    block runs as it is (switching torch's thread count costs tens of microseconds in a
    call of about a millisecond)."""
    before = torch.get_num_threads()
    if before == 1 or (elements is not None and elements < TORCH_GRAIN):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def threads_for(items: int, device: torch.device) -> int:
    """How many threads :func:`for_each` would use for ``items`` items on ``device``: torch's
    thread count on CPU (at most one per item), 1 elsewhere, inside a worker, or when torch
    is asked for deterministic algorithms (the workers' accumulators are summed in whichever
    order they finish)."""
    if (device.type != "cpu" or getattr(_local, "inside", False)
            or torch.are_deterministic_algorithms_enabled()):
        return 1
    return max(1, min(torch.get_num_threads(), items))


def item_threads(items: int, device: torch.device) -> int:
    """Threads for ``items`` work items of an executor: :func:`threads_for` with at least two
    items per thread, one while autograd records the ops (a differentiable backward)."""
    if torch.is_grad_enabled():
        return 1
    return threads_for(items // 2, device)


def for_each_into(items: Sequence[T], fn: Callable[[T, Tuple[Tensor, ...]], None],
                  acc: Tuple[Tensor, ...], threads: int, chunks: int) -> None:
    """``fn(item, accumulators)`` for every item, where items add into shared accumulators
    (a backward's dk and dv). With ``chunks`` > 1 the items go in chunks (chunk c: items c,
    c + chunks, ..., in that order), each adding into its own zeroed copy of ``acc`` (chunk 0
    into ``acc`` itself), summed into ``acc`` in chunk order at the end: the same bits
    whichever thread ran which chunk. ``chunks == 1``: every item adds into ``acc`` directly
    (for items that never touch the same elements, or one thread)."""
    if chunks <= 1:
        for_each(items, lambda item: fn(item, acc), threads=threads)
        return
    copies = [acc] + [tuple(torch.zeros_like(x) for x in acc) for _ in range(chunks - 1)]

    def chunk(c: int) -> None:
        for i in range(c, len(items), chunks):
            fn(items[i], copies[c])

    for_each(list(range(chunks)), chunk, threads=threads)
    for copy in copies[1:]:
        for total, part in zip(acc, copy):
            total += part


def for_each(items: Sequence[T], fn: Callable[[T], None], threads: Optional[int] = None
             ) -> None:
    """``fn(item)`` for every item, on ``threads`` threads (default :func:`threads_for` on
    CPU), each running torch ops on one thread; items are taken in order as threads free up.
    The first exception raised by ``fn`` is raised here once every thread has stopped."""
    n = len(items)
    threads = threads_for(n, torch.device("cpu")) if threads is None else max(1, threads)
    if threads <= 1 or n <= 1:
        for item in items:
            fn(item)
        return
    nxt = iter(range(n))
    take = threading.Lock()
    failed = []
    grad = torch.is_grad_enabled()  # thread-local state, as the caller has it
    inference = torch.is_inference_mode_enabled()

    def work() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        _local.inside = True
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                _take_items()
        finally:
            _local.inside = False
            torch.set_num_threads(before)

    def _take_items() -> None:
        while not failed:
            with take:
                i = next(nxt, None)
            if i is None:
                return
            try:
                fn(items[i])
            except BaseException as err:  # noqa: BLE001 (re-raised by the caller)
                failed.append(err)
                return

    futures = [_pool(threads - 1).submit(work) for _ in range(threads - 1)]
    work()
    for f in futures:
        f.result()
    if failed:
        raise failed[0]
