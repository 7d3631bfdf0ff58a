"""The fused executor's batched runs: a sliding window's interior blocks (the same query and
key lengths, advancing by one step) run as one kernel call over strided views; forward and
backward equal the float64 oracle and the piece-by-piece schedule."""

from __future__ import annotations

import pytest
import torch
from conftest import spy

import attnkit
from attnkit.backends import fused, fused_schedule
from attnkit.backends.fused_schedule import Piece, Run, group_runs
from attnkit.reference import attention_reference
from attnkit.spec import build_spec


def _grads(q, k, v, do, **kw):
    out = attnkit.attention(q, k, v, backend="fused", **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _inputs(n, hq, hkv, lq, lk=None, d=16, dv=12, layout="bhld", seed=0):
    g = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk

    def make(h, length, width):
        if layout == "blhd":  # (B, L, H, D) memory viewed as (B, H, L, D)
            return torch.randn(n, length, h, width, generator=g, dtype=torch.float64
                               ).transpose(1, 2)
        return torch.randn(n, h, length, width, generator=g, dtype=torch.float64)

    q, k, v = make(hq, lq, d), make(hkv, lk, d), make(hkv, lk, dv)
    do = torch.randn(n, hq, lq, dv, generator=g, dtype=torch.float64)
    return [x.requires_grad_(True) for x in (q, k, v)] + [do]


CASES = [
    dict(n=1, hq=4, hkv=4, lq=2048, kw=dict(causal=True, window=(300, 0))),
    dict(n=2, hq=4, hkv=2, lq=2048, kw=dict(causal=True, window=(512, 0))),  # GQA
    dict(n=2, hq=4, hkv=1, lq=1800, kw=dict(causal=True, window=(256, 10))),  # ragged end
    dict(n=2, hq=4, hkv=2, lq=2048, kw=dict(causal=True, window=(512, 0)), layout="blhd"),
    dict(n=1, hq=2, hkv=2, lq=2048, kw=dict(window=(100, 100))),  # not causal
    dict(n=1, hq=2, hkv=2, lq=1024, lk=2048, kw=dict(causal=True, window=(200, 0),
                                                     diagonal="bottom_right")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['n']}x{c['hq']}/{c['hkv']}x"
                         f"{c['lq']}-{c['kw'].get('window')}-{c.get('layout', 'bhld')}")
def test_runs_match_the_oracle_and_the_piece_by_piece_schedule(case, monkeypatch):
    q, k, v, do = _inputs(case["n"], case["hq"], case["hkv"], case["lq"], case.get("lk"),
                          layout=case.get("layout", "bhld"))
    kw = case["kw"]
    spec = build_spec(q, k, v, **kw)
    calls = fused_schedule.make_fused_plan(spec).kernel_calls()
    assert any(isinstance(c, Run) for c in calls), calls  # the case does exercise a run
    ref = attention_reference(q, k, v, **kw)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), do))
    got = _grads(q, k, v, do, **kw)
    monkeypatch.setattr(fused_schedule, "MIN_RUN", 10 ** 9)  # every piece its own call
    loop = _grads(q, k, v, do, **kw)
    for a, b, c in zip(got, want, loop):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_a_window_runs_in_few_kernel_calls(monkeypatch):
    """L=4096, window 512, blocks of 256: 16 query blocks, 3 kernel calls forward and 3
    backward (the first two blocks have shorter footprints; the other 14 are one run)."""
    q, k, v, do = _inputs(1, 2, 2, 4096, d=8, dv=8)
    fwd = spy(monkeypatch, fused, "FWD_OP")
    bwd = spy(monkeypatch, fused, "BWD_OP")
    _grads(q, k, v, do, causal=True, window=(512, 0))
    assert len(fwd) == 3 and len(bwd) == 3


def test_runs_with_a_mask_per_piece(monkeypatch):
    """A window AND a bool mask: the mask differs from block to block, so the run stacks one
    mask per piece (no shared tile); still the oracle's numbers."""
    q, k, v, do = _inputs(1, 2, 2, 2048)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2048, 2048, generator=g) > 0.3
    kw = dict(causal=True, window=(400, 0), mask=mask)
    spec = build_spec(q, k, v, **kw)
    runs = [c for c in fused_schedule.make_fused_plan(spec).kernel_calls() if isinstance(c, Run)]
    if not runs:
        pytest.skip("this schedule has no run for a mask tensor")
    assert not runs[0].shared_mask
    ref = attention_reference(q, k, v, **kw)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), do))
    for a, b in zip(_grads(q, k, v, do, **kw), want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _p(q0, q1, k0, k1, masked=True, causal=False):
    return Piece(qb=q0 // 256, q0=q0, q1=q1, keys=(k0, k1), kbs=(), masked=masked,
                 causal=causal)


def test_group_runs_takes_only_equal_steps_of_one_geometry():
    a = [_p(0, 256, 0, 256), _p(256, 512, 0, 512)]  # growing footprints: single calls
    band = [_p(q, q + 256, q - 512, q + 256) for q in range(512, 2048, 256)]
    calls = group_runs(a + band, invariant=True)
    assert calls[:2] == a and isinstance(calls[2], Run) and len(calls) == 3
    assert calls[2].pieces == band and calls[2].step == 256 and calls[2].shared_mask
    assert (calls[2].qlen, calls[2].klen) == (256, 768)
    # a step that changes, a query range with two pieces, or too short a run: no run
    uneven = band[:3] + [_p(1536, 1792, 1024, 1792)]
    assert all(not isinstance(c, Run) for c in group_runs(uneven[1:3] + uneven[3:], True))
    shared_rows = band + [_p(band[-1].q0, band[-1].q1, 0, 256, masked=False)]
    calls = group_runs(shared_rows, invariant=False)
    assert isinstance(calls[0], Run) and band[-1] not in calls[0].pieces
    assert not calls[0].shared_mask
    assert group_runs(band[:2], True) == band[:2]


def test_disjoint_keys_sees_any_shared_key_row():
    from attnkit.backends.fused import _disjoint_keys

    docs = [[_p(0, 300, 0, 300)], [_p(300, 700, 300, 700)], [_p(700, 800, 700, 800)]]
    assert _disjoint_keys(None, docs)
    # item 0 reads [0, 1000) in one piece; item 1's [500, 600) lies inside it, not next to it
    nested = [[_p(0, 256, 0, 1000), _p(0, 256, 1200, 1300)], [_p(256, 512, 500, 600)]]
    assert not _disjoint_keys(None, nested)
    band = [[_p(q, q + 256, max(0, q - 256), q + 256)] for q in range(0, 1024, 256)]
    assert not _disjoint_keys(None, band)


@pytest.mark.parametrize("kw", [dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25])),
                                dict(causal=True, segments=torch.repeat_interleave(
                                    torch.arange(6), torch.tensor([100, 400, 50, 300, 250,
                                                                   100])))],
                         ids=["alibi-per-block", "documents"])
def test_pieces_on_threads_match_one_thread_and_the_oracle(kw, monkeypatch, for_each_threads):
    """Per-block pieces (overlapping keys: chunked dk/dv) and documents (disjoint keys) on
    two threads, each piece single-threaded: the oracle's numbers, and the same bits as one
    thread forward (each piece is the same call either way)."""

    q, k, v, do = _inputs(1, 2, 2, 1200)
    seg = kw.pop("segments", None)
    call_kw = dict(kw, **({} if seg is None else {"mask": attnkit.masks.document(seg)}))
    monkeypatch.setattr(fused_schedule, "BLOCK", 128)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (also where the run has one: OMP_NUM_THREADS=1)
    try:
        got = _grads(q, k, v, do, **call_kw)
    finally:
        torch.set_num_threads(threads)
    assert 2 in for_each_threads, for_each_threads  # the pieces did go over two threads
    ref_kw = dict(kw)
    if seg is not None:
        ref_kw["mask"] = (seg[:, None] == seg[None, :])
    ref = attention_reference(q, k, v, **ref_kw)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), do))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_items_with_overlapping_rows_stay_on_one_thread():
    """Two work items on overlapping query rows would write the same output and dq rows from
    two threads: such a schedule runs on one thread (disjoint rows may spread)."""
    from attnkit.backends.fused import _threads

    q, k, v, _ = _inputs(1, 2, 2, 64)
    spec = build_spec(q.detach(), k.detach(), v.detach())
    with torch.no_grad():
        assert _threads(spec, [(0, 256), (128, 384), (384, 512), (512, 640)]) == 1
        assert _threads(spec, [(0, 128), (128, 256), (256, 384), (384, 512)]) == min(
            2, torch.get_num_threads())


def test_band_only_plans_are_made_once_per_band_and_length():
    """A call masked by the band alone (causal, windows) reuses the plan of an earlier call
    with the same lengths, band and diagonal; any other band, length, diagonal or mask term
    gets its own plan, and every result is the oracle's (the cache cannot hand one call
    another's plan)."""
    fused_schedule._BAND_PLANS.clear()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 600, 32, generator=g) for _ in range(3))
    cases = [dict(causal=True), dict(window=(100, 0)), dict(window=(100, 5)),
             dict(causal=True, diagonal="bottom_right"), dict(window=(100, 0))]
    plans = []
    for kw in cases + [dict(causal=True)]:
        plans.append(fused.make_plan(build_spec(q, k, v, attnkit.spec.Options(**kw))))
        out = attnkit.attention(q, k, v, backend="fused", **kw)
        ref = attention_reference(q.double(), k.double(), v.double(), **kw)
        assert (out.double() - ref).abs().max().item() < 1e-5, kw
    assert plans[1] is plans[4] and plans[0] is plans[5]  # the same band again
    assert plans[3] is plans[0]  # bottom-right causal at Lq == Lk: the same offset, 0
    assert len({id(p) for p in plans[:3]}) == 3
    short = fused.make_plan(build_spec(q[:, :, :300], k, v, attnkit.spec.Options(causal=True)))
    assert short is not plans[0]
    lens = torch.tensor([500])
    padded = fused.make_plan(build_spec(q, k, v, attnkit.spec.Options(causal=True,
                                                                      seqlens_kv=lens)))
    assert padded is not plans[0] and fused_schedule._band_key(
        build_spec(q, k, v, attnkit.spec.Options(causal=True, seqlens_kv=lens))) is None
