"""Interleaved timing and pair-by-pair ratios.

Schedule for a subject ``a`` (attnkit) and peers ``p1 .. pn``, ``R`` rounds::

    warm-up:   a p1 .. pn            (one call each; the first call of a compiled peer is
                                      its compile time)
    round 0:   a p1 .. pn
    round 1:   a p1 .. pn
    ...
    closing:   a

Every peer sample is bracketed by two subject samples, so the ratio of round ``r`` is
``t_p[r] / sqrt(t_a[r] * t_a[r + 1])``: a machine that drifts (turbo, another process, thermal)
slows both sides of the ratio alike and cancels out. The reported ratio is the median of the
per-round ratios, not the ratio of the medians. Ratios are ``peer / attnkit``: above 1 means
attnkit is faster.

A sample is the mean of ``inner`` back-to-back calls, with ``inner`` chosen in the warm-up so
that a sample lasts at least ``min_sample_s`` (small calls are shorter than timer and
scheduling noise).

With a ``deadline`` (a time budget, :class:`attnkit.bench.runner.Settings`), a warm-up call of
at least ``slow_call_s`` is that callable's first sample (one-time costs are small beside such
a call), a peer whose warm-up would start after the deadline is left out, and rounds stop
when the next would end after it (every callable that ran keeps at least one sample); the
closing subject run is skipped then too, and the last ratio pairs with its own round's
subject sample. ``Timings.cut`` says what was left out.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

Clock = Callable[[], float]


def median(xs: Sequence[float]) -> Optional[float]:
    """Median, or None for an empty sequence."""
    return statistics.median(xs) if xs else None


def bracketed_ratios(subject: Sequence[float], peer: Sequence[float]) -> List[float]:
    """Per-round ratios ``peer[r] / sqrt(subject[r] * subject[r + 1])``.

    ``subject`` has one more sample than ``peer`` (the closing run). With exactly as many
    samples, the last round is paired with its own subject sample only.
    """
    if len(subject) not in (len(peer), len(peer) + 1):
        raise ValueError(
            f"subject has {len(subject)} samples and peer {len(peer)}; expected the subject "
            "to have as many or one more (the closing run)")
    out = []
    for r, t in enumerate(peer):
        before = subject[r]
        after = subject[r + 1] if r + 1 < len(subject) else before
        out.append(t / math.sqrt(before * after))
    return out


@dataclass
class Timings:
    """What :func:`interleave` measured. Times are seconds per call."""

    times: Dict[str, List[float]] = field(default_factory=dict)
    first_call_s: Dict[str, float] = field(default_factory=dict)
    inner: Dict[str, int] = field(default_factory=dict)
    errors: Dict[str, BaseException] = field(default_factory=dict)
    last: Dict[str, Any] = field(default_factory=dict)
    subject: Optional[str] = None
    #: what the deadline left out, by callable: rounds not run, or the whole timing
    cut: Dict[str, str] = field(default_factory=dict)

    def median_s(self, name: str) -> Optional[float]:
        """Median seconds per call of ``name``."""
        return median(self.times.get(name, []))

    def ratios(self, name: str) -> List[float]:
        """Per-round ``name / subject`` ratios (empty if either side failed)."""
        if self.subject is None or name == self.subject:
            return []
        subj, peer = self.times.get(self.subject, []), self.times.get(name, [])
        if len(subj) > len(peer):
            return bracketed_ratios(subj[: len(peer) + 1], peer)
        m = len(subj)  # the subject failed part-way: pair what both sides have
        return bracketed_ratios(subj[:m], peer[:m])

    def ratio(self, name: str) -> Optional[float]:
        """Median of :meth:`ratios`; 1.0 for the subject itself; None when unknown."""
        if name == self.subject:
            return 1.0 if self.times.get(name) else None
        return median(self.ratios(name))


def _sample(fn: Callable[[], Any], inner: int, clock: Clock) -> tuple:
    start = clock()
    result = None
    for _ in range(inner):
        result = fn()
    return (clock() - start) / inner, result


def interleave(
    fns: Dict[str, Callable[[], Any]],
    *,
    subject: Optional[str],
    rounds: int,
    warmup: bool = True,
    min_sample_s: float = 0.02,
    max_inner: int = 100,
    clock: Clock = time.perf_counter,
    on_step: Optional[Callable[[str], None]] = None,
    max_rounds: Optional[Dict[str, int]] = None,
    deadline: Optional[float] = None,
    slow_call_s: float = 1.0,
) -> Timings:
    """Time ``fns`` round-robin, subject first, with a closing subject run (module docstring).

    A callable that raises is dropped from later rounds and its exception kept in
    ``Timings.errors``; the others carry on. ``Timings.last[name]`` is the result of the last
    call (used for the error check). ``on_step(name)`` is called before each sample.
    ``max_rounds[name]`` caps the rounds of a peer (it sits out the later ones).
    ``deadline`` (a ``clock()`` time) bounds the timing as the module docstring says.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    if subject is not None and subject not in fns:
        raise ValueError(f"subject {subject!r} is not one of {list(fns)}")
    order = ([subject] if subject is not None else []) + [n for n in fns if n != subject]
    t = Timings(subject=subject)
    alive = list(order)

    def run(name: str, inner: int) -> Optional[float]:
        if on_step is not None:
            on_step(name)
        try:
            dt, res = _sample(fns[name], inner, clock)
        except Exception as err:  # a peer failing must not stop the others
            t.errors[name] = err
            alive.remove(name)
            t.last.pop(name, None)
            return None
        t.last[name] = res
        return dt

    caps = max_rounds or {}
    counted = set()  # (with a deadline) the warm-up call was the first sample
    for name in list(alive):
        t.inner[name] = 1
        if deadline is not None and name != subject and clock() > deadline:
            alive.remove(name)
            t.cut[name] = "not timed: the time budget's share for this case was spent"
            continue
        if warmup:
            first = run(name, 1)
            if first is None:
                continue
            t.first_call_s[name] = first
            if deadline is not None and first >= slow_call_s:
                t.times[name] = [first]
                counted.add(name)
                continue
            probe = first
            if first < 10 * min_sample_s:  # a cheap call: calibrate on a second, warm one
                probe = run(name, 1)
                if probe is None:
                    continue
            want = math.ceil(min_sample_s / max(probe, 1e-9))
            t.inner[name] = int(min(max_inner, max(1, want)))
        t.times[name] = []

    def cost(name: str) -> float:  # seconds one sample of name takes, as last measured
        ts = t.times.get(name) or [t.first_call_s.get(name, 0.0)]
        return ts[-1] * t.inner[name]

    stopped = None
    for r in range(rounds):
        due = [n for n in order if n in alive and (n == subject or r < caps.get(n, rounds))
               and not (r == 0 and n in counted)]
        if deadline is not None and r >= 1 and clock() + sum(map(cost, due)) > deadline:
            stopped = r
            break
        for name in due:
            dt = run(name, t.inner[name])
            if dt is not None:
                t.times[name].append(dt)
    closing = subject is not None and subject in alive and len(order) > 1
    if closing and deadline is not None and clock() + cost(subject) > deadline:
        closing = False
        stopped = rounds if stopped is None else stopped
    if closing:
        dt = run(subject, t.inner[subject])
        if dt is not None:
            t.times[subject].append(dt)
    if stopped is not None:
        for name in alive:
            want = rounds if name == subject else min(rounds, caps.get(name, rounds))
            got = len(t.times.get(name, []))
            if got < want:
                t.cut[name] = (f"{got} of {want} round(s): the time budget's share for this "
                               f"case was spent")
    if not warmup:
        for name, ts in t.times.items():
            if ts:
                t.first_call_s.setdefault(name, ts[0])
    return t
