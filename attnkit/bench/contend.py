"""``attnkit bench --contend N``: N busy background processes during the timed runs.

A laptop or a shared server rarely gives a benchmark its cores to itself: a data loader, a
second job or a test run compete for them. ``--contend N`` reproduces that on purpose: N child
processes, each one core of pure compute (a Python loop of integer arithmetic: no memory
traffic, no threads), run from before the first case to after the last, so every peer's timed
runs meet the same competition. Ratios between peers in one such run say who keeps its speed
on a busy machine; compare them with a quiet run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List, Optional

#: The child: spins until killed (or until its parent is gone, so none outlives a crash).
_SPIN = """
import os, sys
parent = int(sys.argv[1])
x = 0
while True:
    for _ in range(2_000_000):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    if os.getppid() != parent:
        break
"""


class Contention:
    """A context manager that runs ``n`` busy processes while it is entered.

    >>> with Contention(1):   # doctest: +SKIP
    ...     time_something()
    """

    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"the number of busy processes must be an int >= 0; got {n!r}")
        self.n = n
        self.procs: List[subprocess.Popen] = []

    def __enter__(self) -> Contention:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the busy processes (and give them a moment to be running)."""
        for _ in range(self.n):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", _SPIN, str(os.getpid())], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if self.procs:
            time.sleep(0.2)

    def running(self) -> int:
        """How many of the busy processes are alive now."""
        return sum(p.poll() is None for p in self.procs)

    def stop(self, timeout: Optional[float] = 5.0) -> None:
        """Stop every busy process (kill where terminate is not enough)."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
