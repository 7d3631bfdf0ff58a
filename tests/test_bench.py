"""Tests of ``attnkit.bench``: FLOP counting, ratio bookkeeping, JSON schema, a smoke run of
every peer on tiny cases, the memory probe and the CLI. No timing assertions."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import pytest
import torch

from attnkit.bench import add_arguments, run_from_args
from attnkit.bench import main as bench_main
from attnkit.bench import report as rep
from attnkit.bench.accuracy import errors, reference
from attnkit.bench.cases import CATALOG, Case, random_lengths, select
from attnkit.bench.flops import (
    count_dense,
    dense_visibility,
    flops,
    forward_flops,
    padded_rows,
    padded_visibility,
    visible_pairs,
    visible_per_head,
)
from attnkit.bench.limits import Limits
from attnkit.bench.memory import measure_in_child
from attnkit.bench.peers import PEERS, make_call, paged_cache
from attnkit.bench.runner import (
    Settings,
    kv_bandwidth,
    kv_bytes,
    memcpy_gbps,
    run_case,
)
from attnkit.bench.timing import bracketed_ratios, interleave
from attnkit.bench.workloads import make_workload

# --------------------------------------------------------------------------- FLOP counting


def brute_force_visible(case: Case) -> torch.Tensor:
    """(Lq, Lk) visibility written straight from the definitions, pair by pair."""
    lq, lk = case.len_q, case.lk
    off = lk - lq if case.diagonal == "bottom_right" else 0
    doc = []
    for n, length in enumerate(case.doc_lengths()):
        doc += [n] * length
    vis = torch.zeros(lq, lk, dtype=torch.bool)
    for i in range(lq):
        for j in range(lk):
            ok = True
            if case.causal:
                ok = ok and j <= i + off
            if case.window is not None:
                left, right = case.window
                ok = ok and (left is None or j >= i + off - left)
                ok = ok and (right is None or j <= i + off + right)
            if case.documents:
                ok = ok and doc[i] == doc[j]
            if case.prefix:
                ok = j <= i or j < case.prefix
            vis[i, j] = ok
    return vis


MASK_CASES = [
    Case("full", heads_q=3, len_q=37, len_kv=53),
    Case("causal_tl", heads_q=2, len_q=41, causal=True),
    Case("causal_tl_rect", len_q=29, len_kv=47, causal=True),
    Case("causal_br_short_q", len_q=13, len_kv=50, causal=True, diagonal="bottom_right"),
    Case("causal_br_long_q", len_q=50, len_kv=13, causal=True, diagonal="bottom_right"),
    Case("window_causal", len_q=61, causal=True, window=(7, 0)),
    Case("window_two_sided", len_q=45, len_kv=52, window=(5, 3)),
    Case("window_left_only", len_q=40, window=(9, None)),
    Case("window_br", len_q=20, len_kv=57, causal=True, window=(6, 0), diagonal="bottom_right"),
    Case("documents_causal", len_q=77, causal=True, documents=5),
    Case("documents_bidir", len_q=64, documents=3, seed=3),
    Case("documents_window", len_q=70, causal=True, documents=4, window=(5, 0)),
    Case("prefix_lm", len_q=49, prefix=11),
    Case("prefix_lm_past_end", len_q=9, prefix=20),
]


@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: c.name)
def test_visible_pairs_match_dense_count(case: Case) -> None:
    vis = brute_force_visible(case)
    assert torch.equal(dense_visibility(case), vis)
    assert visible_per_head(case) == count_dense(vis)
    assert visible_pairs(case) == case.batch * case.heads_q * count_dense(vis)


def test_flop_formulas() -> None:
    c = Case("c", batch=2, heads_q=4, heads_kv=2, len_q=33, causal=True, d_qk=16)
    vis = count_dense(brute_force_visible(c))
    assert forward_flops(c) == 4 * 2 * 4 * vis * 16
    assert flops(c, "fwd+bwd") == pytest.approx(3.5 * flops(c, "fwd"))
    mla = Case("m", len_q=20, d_qk=192, d_v=128)
    assert forward_flops(mla) == 2 * 8 * 20 * 20 * (192 + 128)
    with pytest.raises(ValueError):
        flops(c, "bwd")


def test_document_lengths_are_seeded_and_cover_the_sequence() -> None:
    c = Case("d", len_q=8192, documents=8)
    lengths = c.doc_lengths()
    assert len(lengths) == 8 and sum(lengths) == 8192 and min(lengths) >= 1
    assert lengths == Case("d2", len_q=8192, documents=8).doc_lengths()


def test_catalog_is_consistent() -> None:
    names = [c.name for c in CATALOG]
    assert len(names) == len(set(names))
    standard = {c.name for c in select("standard")}
    # issue 5's goals
    for name in ("dense_4k", "causal_4k", "window_8k", "document_8k", "alibi_8k",
                 "relbias_8k", "softcap_8k", "small_256", "long_32k"):
        assert name in standard
    assert {c.name for c in select("standard")} <= {c.name for c in select("long")}
    assert select("quick", ["long_32k"])[0].name == "long_32k"
    with pytest.raises(ValueError, match="unknown case"):
        select("quick", ["nope"])
    with pytest.raises(ValueError):
        Case("bad", len_q=10, prefix=3, causal=True)


# --------------------------------------------------------------------------- timing


def test_bracketed_ratios_cancel_drift() -> None:
    # the machine slows down 10% per step; the peer is always 2x the subject
    subject = [1.0 * 1.1 ** (2 * r) for r in range(4)]
    peer = [2.0 * 1.1 ** (2 * r + 1) for r in range(3)]
    assert bracketed_ratios(subject, peer) == pytest.approx([2.0, 2.0, 2.0])
    # the ratio of medians would be off
    assert sorted(peer)[1] / sorted(subject)[1] != pytest.approx(2.0)
    with pytest.raises(ValueError):
        bracketed_ratios([1.0], [1.0, 1.0, 1.0])


class FakeMachine:
    """A clock that advances by each call's cost times a drift that grows every call."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list = []
        self.drift = 1.0

    def clock(self) -> float:
        return self.now

    def fn(self, name: str, cost: float, fail_after: int = -1):
        def call():
            self.calls.append(name)
            if fail_after >= 0 and self.calls.count(name) > fail_after:
                raise RuntimeError(f"{name} broke")
            self.now += cost * self.drift
            self.drift *= 1.01
            return name

        return call


def test_interleave_schedule_and_ratios() -> None:
    m = FakeMachine()
    fns = {"peer": m.fn("peer", 0.9), "attnkit": m.fn("attnkit", 0.3)}
    t = interleave(fns, subject="attnkit", rounds=3, min_sample_s=0.02, clock=m.clock)
    # warm-up: subject first, each once (no calibration call: each takes > 10 x min_sample)
    assert m.calls[:2] == ["attnkit", "peer"]
    assert m.calls[2:] == ["attnkit", "peer"] * 3 + ["attnkit"]
    assert len(t.times["attnkit"]) == 4 and len(t.times["peer"]) == 3
    assert t.ratio("attnkit") == 1.0
    # drift of 1% per call: the bracketed ratio stays within 0.1% of the true 3.0
    assert t.ratio("peer") == pytest.approx(3.0, rel=1e-3)
    assert len(t.ratios("peer")) == 3
    assert t.last == {"attnkit": "attnkit", "peer": "peer"}


def test_interleave_calibrates_small_calls_and_survives_a_failing_peer() -> None:
    m = FakeMachine()
    fns = {"attnkit": m.fn("attnkit", 0.001), "bad": m.fn("bad", 0.01, fail_after=3),
           "ok": m.fn("ok", 0.05)}
    t = interleave(fns, subject="attnkit", rounds=2, min_sample_s=0.02, clock=m.clock)
    assert t.inner["attnkit"] == 20 or t.inner["attnkit"] == 19  # ceil(0.02 / ~0.001)
    assert t.inner["ok"] == 1
    assert isinstance(t.errors["bad"], RuntimeError)
    assert "bad" not in t.last and t.median_s("ok") is not None
    assert len(t.times["ok"]) == 2 and len(t.times["attnkit"]) == 3


def test_interleave_without_subject_or_warmup() -> None:
    m = FakeMachine()
    t = interleave({"a": m.fn("a", 0.1), "b": m.fn("b", 0.1)}, subject=None, rounds=2,
                   warmup=False, clock=m.clock)
    assert m.calls == ["a", "b", "a", "b"]
    assert t.ratio("a") is None and t.first_call_s["a"] == t.times["a"][0]


# --------------------------------------------------------------------------- peers


TINY = {
    "dense": Case("t_dense", batch=2, heads_q=2, len_q=37, len_kv=45, d_qk=16),
    "causal_br": Case("t_br", heads_q=2, len_q=19, len_kv=51, d_qk=16, causal=True,
                      diagonal="bottom_right"),
    "window": Case("t_window", heads_q=2, len_q=64, d_qk=16, causal=True, window=(9, 0)),
    "documents": Case("t_docs", heads_q=2, len_q=70, d_qk=16, causal=True, documents=4),
    "prefix": Case("t_prefix", heads_q=2, len_q=50, d_qk=16, prefix=13),
    "gqa": Case("t_gqa", heads_q=8, heads_kv=2, len_q=40, d_qk=16, causal=True),
    "alibi": Case("t_alibi", heads_q=4, len_q=48, d_qk=16, causal=True, alibi=True),
    "softcap": Case("t_softcap", heads_q=2, len_q=48, d_qk=16, causal=True, softcap=2.0),
    "relbias": Case("t_relbias", heads_q=2, len_q=33, len_kv=41, d_qk=16, causal=True,
                    diagonal="bottom_right", relative_bias=True),
    "d_v": Case("t_dv", heads_q=2, len_q=40, d_qk=24, d_v=16, causal=True),
}
RUN_COMPILED = os.environ.get("ATTNKIT_BENCH_COMPILE") == "1"


def _smoke(peer_name: str, case: Case, pass_: str) -> None:
    peer = PEERS[peer_name]
    if peer.supports(case, pass_):
        pytest.skip(f"{peer_name} cannot run {case.name} {pass_}: {peer.supports(case, pass_)}")
    w = make_workload(case, torch.float32)
    result = make_call(peer, w, pass_)()
    out, grads = result if isinstance(result, tuple) else (result, None)
    assert out.shape == (case.batch, case.heads_q, case.len_q, case.dv)
    ref = reference(w, with_grads=pass_ == "fwd+bwd")
    assert ref.kind == "float64"
    max_err, grad_err = errors(ref, out, grads)
    assert max_err < 1e-4, f"{peer_name} on {case.name}: output error {max_err}"
    if grads is not None:
        assert len(grads) == 3 + case.relative_bias
        assert grad_err is not None and grad_err < 1e-3, f"gradient error {grad_err}"


@pytest.mark.parametrize("feature", list(TINY))
@pytest.mark.parametrize("peer_name", ["attnkit", "sdpa", "flex", "naive"])
def test_peer_smoke_forward(peer_name: str, feature: str) -> None:
    _smoke(peer_name, TINY[feature], "fwd")


@pytest.mark.parametrize("feature", ["documents", "alibi", "relbias", "softcap", "gqa"])
@pytest.mark.parametrize("peer_name", ["attnkit", "sdpa", "naive"])
def test_peer_smoke_backward(peer_name: str, feature: str) -> None:
    _smoke(peer_name, TINY[feature], "fwd+bwd")


@pytest.mark.skipif(not RUN_COMPILED, reason="torch.compile of FlexAttention takes 15-25 s "
                                             "cold; set ATTNKIT_BENCH_COMPILE=1 to run")
def test_flex_compiled_smoke() -> None:
    _smoke("flex_compiled", TINY["documents"], "fwd")


def test_supports_lists_reasons() -> None:
    softcap = TINY["softcap"]
    assert PEERS["sdpa"].supports(softcap, "fwd") == ["cannot express softcap"]
    assert PEERS["flex"].supports(TINY["dense"], "fwd") == []
    assert "no CPU backward" in PEERS["flex_compiled"].supports(TINY["dense"], "fwd+bwd")[0]
    assert PEERS["sdpa"].remarks(TINY["documents"], "fwd") == ["dense bool mask"]
    assert "torch uses its math kernel" in PEERS["sdpa"].remarks(TINY["relbias"], "fwd+bwd")
    # a feature added to the catalog later is refused by every peer, never ignored
    future = Case("future", len_q=16, extra={"sinks": 4})
    for peer in PEERS.values():
        assert "cannot express sinks" in peer.supports(future, "fwd")
    # the workload features: attnkit and sdpa are taught them, flex and naive are not
    dropout = Case("drop", len_q=16, extra={"dropout_p": 0.1})
    for name in ("flex", "naive"):
        assert "cannot express dropout_p" in PEERS[name].supports(dropout, "fwd")
    for name in ("attnkit", "sdpa"):
        assert PEERS[name].supports(dropout, "fwd+bwd") == []


def test_reference_matches_dense_row_slice() -> None:
    """The float32 row-slice reference of large cases agrees with the float64 oracle."""
    from attnkit.bench import accuracy

    case = TINY["relbias"]
    w = make_workload(case, torch.float32)
    full = accuracy._full_reference(w, with_grads=True)
    rows = accuracy._rows_reference(w, with_grads=True)
    n = rows.rows.stop
    assert torch.allclose(rows.out.double(), full.out[:, :, :n], atol=1e-5)
    assert torch.allclose(rows.grads["q"].double(), full.grads["q"][:, :, :n], atol=1e-5)


# --------------------------------------------------------------------------- runner, JSON


def _tiny_settings(**kw) -> Settings:
    base = dict(suite="custom", cases=[], dtypes=["float32"], passes=["fwd", "fwd+bwd"],
                peers=["attnkit", "sdpa", "flex", "flex_compiled", "naive"], repeat=2,
                memory="off", min_sample_s=0.001)
    base.update(kw)
    return Settings(**base)


def test_json_schema_of_a_tiny_run(tmp_path) -> None:
    case = TINY["softcap"]
    settings = _tiny_settings(cases=[case], peers=["attnkit", "sdpa", "flex", "naive"])
    matmul = {"float32": 100.0, "bfloat16": 400.0}
    results = run_case(case, settings, matmul)
    by = {(r.pass_, r.peer): r for r in results}
    assert len(results) == 8
    assert by[("fwd", "sdpa")].status == "unsupported"
    assert by[("fwd+bwd", "flex")].status == "unsupported"
    for key in [("fwd", "attnkit"), ("fwd", "flex"), ("fwd", "naive"), ("fwd+bwd", "attnkit"),
                ("fwd+bwd", "naive")]:
        r = by[key]
        assert r.status == "ok", r.note
        assert r.median_s > 0 and len(r.times_s) == 3 - (r.peer != "attnkit")
        assert r.gflops == pytest.approx(r.flops / r.median_s / 1e9)
        assert r.pct_of_matmul == pytest.approx(r.gflops)  # matmul peak 100 GFLOP/s
        assert r.max_err < 1e-4
    assert by[("fwd", "attnkit")].ratio_vs_attnkit == 1.0
    assert by[("fwd+bwd", "naive")].grad_err < 1e-3
    assert len(by[("fwd", "naive")].ratios) == 2
    doc = rep.build_report(suite="custom", created="now", wall_s=1.0,
                           machine={k: "x" for k in rep.MACHINE_KEYS}, matmul_gflops=matmul,
                           settings=settings.to_json(), cases=[case.describe()],
                           results=results)
    assert rep.validate(doc) == []
    path = str(tmp_path / "bench.json")
    rep.write_json(doc, path)
    back = json.load(open(path))
    assert rep.validate(back) == []
    assert set(back["results"][0]) == set(rep.RESULT_KEYS + rep.OPTIONAL_RESULT_KEYS)
    assert back["cases"][0]["visible_pairs"] == visible_pairs(case)
    bad = dict(back, results=[dict(back["results"][0], status="weird")])
    assert rep.validate(bad)
    again = [rep.Result.from_json(d) for d in back["results"]]
    assert [a.to_json() for a in again] == back["results"]


def test_non_finite_errors_become_null_in_json() -> None:
    r = rep.Result("c", "fwd", "float32", "naive", median_s=1.0, max_err=math.inf)
    d = r.to_json()
    assert d["max_err"] is None and "non-finite" in d["note"]
    json.dumps(d, allow_nan=False)


def test_memory_budget_skips_and_errors_are_marked() -> None:
    case = TINY["dense"]
    settings = _tiny_settings(cases=[case], passes=["fwd"], peers=["attnkit", "flex", "naive"],
                              mem_budget_gib=1e-6)
    results = {r.peer: r for r in run_case(case, settings, {"float32": 1.0})}
    assert results["flex"].status == "skipped" and "OOM-risk" in results["flex"].note
    assert results["naive"].status == "skipped"
    assert results["attnkit"].status == "ok"


def test_peak_memory_child_sees_torch_allocations() -> None:
    # naive materialises 4 x 512 x 2048 float32 scores (16 MiB) several times over
    case = Case("mem", heads_q=4, len_q=512, len_kv=2048, d_qk=16)
    m = measure_in_child(case, torch.float32, "fwd", "naive", timeout_s=120)
    assert m.error is None, m.error
    assert m.peak_mib is not None and m.peak_mib > 16


# --------------------------------------------------------------------------- CLI


def _parse(*argv: str) -> argparse.Namespace:
    return add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


FAKE_LIMITS = Limits(threads=2, fma_float32_gflops=200.0, fma_bits=512,
                     dot_bfloat16_gflops=400.0, copy_gbps=20.0, copy_source="fake", seconds=0.1)


def _fast_peaks(monkeypatch) -> None:
    """torch's matmul at 100 GFLOP/s and :data:`FAKE_LIMITS`, without timing either."""
    from attnkit.bench import limits, runner

    monkeypatch.setattr(runner, "matmul_gflops", lambda dtype, n=2048, reps=5: 100.0)
    monkeypatch.setattr(limits, "_matmul_rate", lambda dtype, n, reps: 100.0)
    monkeypatch.setattr(runner, "measure_limits", lambda: FAKE_LIMITS)


def test_cli_runs_and_writes_json_and_plot(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    path, png = str(tmp_path / "b.json"), str(tmp_path / "b.png")
    args = _parse("--only", "small_256", "--pass", "fwd", "--peers", "sdpa,attnkit",
                  "--repeat", "1", "--no-memory", "--no-malloc-tune", "--json", path,
                  "--plot", png)
    assert run_from_args(args) == 0
    doc = json.load(open(path))
    assert rep.validate(doc) == []
    assert [r["peer"] for r in doc["results"]] == ["attnkit", "sdpa"]
    assert doc["matmul_gflops"]["float32"] > 0 and doc["machine"]["threads"] >= 1
    assert doc["settings"]["malloc"] is None  # --no-malloc-tune: this process is left alone
    assert os.path.getsize(png) > 0
    out = capsys.readouterr().out
    assert "small_256" in out and "ratio vs attnkit" in out


def test_cli_errors(monkeypatch, capsys) -> None:
    assert run_from_args(_parse("--only", "no_such_case")) == 2
    assert run_from_args(_parse("--peers", "nobody")) == 2
    assert run_from_args(_parse("--dtype", "int8")) == 2
    monkeypatch.setattr(rep, "plot_available", lambda: "--plot needs matplotlib")
    assert run_from_args(_parse("--only", "small_256", "--plot", "x.png")) == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert run_from_args(_parse("--list")) == 0


def test_bad_options_are_refused_before_running(tmp_path, capsys) -> None:
    start = time.perf_counter()
    assert run_from_args(_parse("--only", "small_256", "--json",
                                str(tmp_path / "missing" / "b.json"))) == 2
    assert run_from_args(_parse("--only", "small_256", "--plot", str(tmp_path))) == 2
    assert time.perf_counter() - start < 5  # nothing was timed first
    err = capsys.readouterr().err
    assert "does not exist" in err and "is a folder" in err
    for argv in (["--repeat", "0"], ["--mem-budget", "0"], ["--min-sample-ms", "-1"],
                 ["--suite", "huge"]):
        assert bench_main(argv) == 2, argv
        assert argv[0] in capsys.readouterr().err


def test_one_line_per_finished_case_without_a_terminal(tmp_path, monkeypatch) -> None:
    """Piped or in CI: a line per case as it finishes (before the next starts), not only the
    table at the end; the JSON carries the contention record."""
    import io

    from attnkit.bench import runner

    out = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stdout", out)
    seen_at_start = []
    real_run_case = runner.run_case

    def run_case(case, *args, **kw):
        seen_at_start.append(out.getvalue())
        return real_run_case(case, *args, **kw)

    monkeypatch.setattr(runner, "run_case", run_case)
    _fast_peaks(monkeypatch)
    path = str(tmp_path / "b.json")
    args = _parse("--only", "small_256,causal_br_256_1k", "--pass", "fwd", "--peers",
                  "attnkit,naive", "--repeat", "1", "--no-memory", "--no-malloc-tune",
                  "--min-sample-ms", "1", "--json", path)
    assert run_from_args(args) == 0
    text = out.getvalue()
    assert "[1/2] small_256: float32 fwd attnkit " in seen_at_start[1]  # printed as it went
    assert "[2/2] causal_br_256_1k:" not in seen_at_start[1]
    line2 = next(x for x in text.splitlines() if x.startswith("[2/2] causal_br_256_1k:"))
    assert "naive" in line2 and "ms" in line2
    assert text.index("[2/2]") < text.index("attnkit bench, suite quick:")  # before the table
    doc = json.load(open(path))
    assert rep.validate(doc) == []
    load = doc["contention"]
    assert load["threads"] == torch.get_num_threads() and isinstance(load["contended"], bool)
    if load["threads"] >= 2:  # the one-thread matmul was measured for the scaling
        assert load["matmul_float32_1_thread_gflops"] == 100.0 and load["thread_scaling"] == 1.0
        assert load["contended"]  # 1.0x on >= 2 threads
    assert (runner.contention_line(load) is not None) == load["contended"]


def test_contention_is_said_above_the_table(monkeypatch, capsys) -> None:
    from attnkit.bench import runner

    busy = runner.assess_load(cores=2, threads=2, load_avg=0.1, single_gflops=100.0,
                              multi_gflops=105.0, others_cores=0.9)
    monkeypatch.setattr(runner, "assess_load", lambda **kw: busy)
    _fast_peaks(monkeypatch)
    args = _parse("--only", "small_256", "--pass", "fwd", "--peers", "attnkit", "--repeat", "1",
                  "--no-memory", "--no-malloc-tune", "--min-sample-ms", "1")
    assert run_from_args(args) == 0
    out = capsys.readouterr().out
    warning = runner.contention_line(busy)
    assert warning and "\n" not in warning and warning in out
    assert out.index(warning) < out.index("attnkit bench, suite quick:")


def test_assess_load_decides_from_scaling_other_processes_and_load() -> None:
    from attnkit.bench.runner import assess_load, contention_line

    idle = assess_load(cores=2, threads=2, load_avg=0.2, single_gflops=95.0, multi_gflops=180.0,
                       others_cores=0.05)
    assert not idle["contended"] and idle["reasons"] == [] and contention_line(idle) is None
    assert idle["thread_scaling"] == pytest.approx(180 / 95)
    slow = assess_load(cores=2, threads=2, load_avg=None, single_gflops=95.0,
                       multi_gflops=100.0, others_cores=None)
    assert slow["contended"] and "1.1x one thread" in slow["reasons"][0]
    others = assess_load(cores=2, threads=2, load_avg=0.2, single_gflops=None,
                         multi_gflops=None, others_cores=1.1)
    assert others["contended"] and "1.1 of the 2 cores" in others["reasons"][0]
    # cores torch leaves idle may be used by others without competing
    spare = assess_load(cores=8, threads=4, load_avg=1.0, single_gflops=None,
                        multi_gflops=None, others_cores=3.5)
    assert not spare["contended"]
    loaded = assess_load(cores=2, threads=2, load_avg=2.5, single_gflops=None,
                         multi_gflops=None, others_cores=None)  # no /proc: the load average
    assert loaded["contended"] and "load average 2.5" in loaded["reasons"][0]
    lagging = assess_load(cores=2, threads=2, load_avg=2.5, single_gflops=95.0,
                          multi_gflops=180.0, others_cores=0.02)  # a job that just ended
    assert not lagging["contended"] and lagging["load_avg_1m_before"] == 2.5
    one = assess_load(cores=1, threads=1, load_avg=None, single_gflops=None,
                      multi_gflops=50.0, others_cores=0.0)
    assert one["thread_scaling"] is None and not one["contended"]
    line = contention_line(others)
    assert line.startswith("warning:") and "competing" in line and "\n" not in line


def test_cpu_sample_counts_other_processes_and_not_our_children() -> None:
    """A busy process outside this process tree shows up as other processes' CPU; a busy child
    of ours counts as ours."""
    import signal
    import subprocess

    from attnkit.bench.runner import cpu_sample, others_cpu_cores

    if cpu_sample() is None:
        pytest.skip("no /proc: CPU accounting is Linux-only")
    spin = "import time\nt = time.time() + 6\nwhile time.time() < t: pass"
    detached = subprocess.run(["sh", "-c", '"$0" -c "$1" >/dev/null 2>&1 & echo $!',
                               sys.executable, spin], capture_output=True, text=True, timeout=30)
    pid = int(detached.stdout.strip())
    try:
        time.sleep(0.5)
        a = cpu_sample()
        time.sleep(1.0)
        b = cpu_sample()
    finally:
        os.kill(pid, signal.SIGKILL)
    assert others_cpu_cores(a, b) > 0.4
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)
        a = cpu_sample()
        time.sleep(1.0)
        b = cpu_sample()
    finally:
        child.kill()
        child.wait()
    assert (b.ours_s - a.ours_s) / (b.wall - a.wall) > 0.3


def test_bench_main_exits_quietly_on_ctrl_c(monkeypatch, capsys) -> None:
    import attnkit.bench as bench_pkg

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_pkg, "run_from_args", interrupted)
    assert bench_main(["--only", "small_256"]) == 130
    assert capsys.readouterr().err == "attnkit bench: interrupted\n"


# --------------------------------------------------------------------------- workloads beyond
# one dense call: varlen, padded batch, paged decode, dropout, distributed ring attention

TINY_LENS = random_lengths(3, 100, seed=1)
TINY_WORKLOADS = {
    "varlen_16k": Case("t_varlen", batch=3, heads_q=2, len_q=max(TINY_LENS), d_qk=16,
                       causal=True, extra={"seqlens": TINY_LENS, "varlen": True}),
    "padded_batch": Case("t_padded", batch=3, heads_q=2, len_q=40, d_qk=16, causal=True,
                         extra={"seqlens": (40, 25, 7)}),
    "paged_decode": Case("t_paged", batch=3, heads_q=4, heads_kv=2, len_q=1, len_kv=70,
                         d_qk=16, causal=True, diagonal="bottom_right", passes=("fwd",),
                         extra={"page_size": 16}),
    "dropout_4k": Case("t_dropout", heads_q=2, len_q=64, d_qk=16, causal=True,
                       extra={"dropout_p": 0.1}),
}


def test_new_standard_cases_are_in_the_catalog() -> None:
    by = {c.name: c for c in select("standard")}
    for name, tiny in TINY_WORKLOADS.items():
        assert set(by[name].features()) == set(tiny.features()), name
    v = by["varlen_16k"]
    assert sum(v.seqlens()) == 16384 and len(v.seqlens()) == 8 and v.len_q == max(v.seqlens())
    assert v.seqlens() == list(random_lengths(8, 16384, seed=16))  # seeded
    assert by["padded_batch"].seqlens() == [4096, 3000, 2000, 1000]
    p = by["paged_decode"]
    assert (p.batch, p.heads_q, p.hkv, p.len_q, p.lk, p.d_qk) == (8, 32, 8, 1, 8192, 128)
    assert p.dtypes == ("bfloat16",) and p.passes == ("fwd",)
    assert by["dropout_4k"].extra["dropout_p"] == 0.1
    with pytest.raises(ValueError, match="seqlens"):
        Case("bad", batch=2, len_q=10, extra={"seqlens": (10, 11)})


def test_varlen_flops_count_each_sequence_alone() -> None:
    case = TINY_WORKLOADS["varlen_16k"]
    per_seq = sum(n * (n + 1) // 2 for n in TINY_LENS)
    assert visible_pairs(case) == case.heads_q * per_seq
    # the same count from the padded mask, real query rows only
    vis = padded_visibility(case) & padded_rows(case)
    assert count_dense(vis) * case.heads_q == visible_pairs(case)
    assert flops(case, "fwd") == 4.0 * case.heads_q * per_seq * case.d_qk
    big = {c.name: c for c in CATALOG}["varlen_16k"]
    assert visible_pairs(big) == 8 * sum(n * (n + 1) // 2 for n in big.seqlens())
    assert visible_pairs(big) < big.pairs / 2  # padding is not counted


@pytest.mark.parametrize("name", list(TINY_WORKLOADS))
def test_new_cases_smoke(name: str) -> None:
    case = TINY_WORKLOADS[name]
    settings = _tiny_settings(cases=[case], peers=["attnkit", "sdpa", "flex", "naive"],
                              repeat=1)
    results = run_case(case, settings, {"float32": 1.0})
    by = {(r.pass_, r.peer): r for r in results}
    for pass_ in case.passes:
        for peer in ("flex", "naive"):
            assert by[(pass_, peer)].status == "unsupported"
        for peer in ("attnkit", "sdpa"):
            r = by[(pass_, peer)]
            assert r.status == "ok", r.note
            assert r.flops == flops(case, pass_) and r.median_s > 0
            if name == "dropout_4k" and peer == "sdpa":
                assert r.max_err is None and "not compared" in r.note
                continue
            assert r.max_err is not None and r.max_err < 1e-4, (peer, pass_, r.max_err)
            if pass_ == "fwd+bwd":
                assert r.grad_err is not None and r.grad_err < 1e-3
    if name == "paged_decode":
        assert [b["peer"] for b in settings.bandwidth] == ["attnkit", "sdpa"]
        assert "GB/s" in by[("fwd", "attnkit")].note
    else:
        assert settings.bandwidth == []


def test_dropout_is_applied_and_replayable() -> None:
    import attnkit

    case = TINY_WORKLOADS["dropout_4k"]
    w = make_workload(case, torch.float32)
    call = make_call(PEERS["attnkit"], w, "fwd")
    a, b = call(), call()
    assert torch.equal(a, b)  # same seed, same mask
    plain = attnkit.attention(w.q, w.k, w.v, causal=True)
    assert not torch.allclose(a, plain)
    ref = reference(w, with_grads=False)
    assert ref.kind == "dropout-rows" and errors(ref, a)[0] < 1e-5


def test_paged_cache_is_shuffled_and_holds_the_keys() -> None:
    case = TINY_WORKLOADS["paged_decode"]
    w = make_workload(case, torch.float32)
    cache = paged_cache(w)
    pages = [cache.pages_of(b) for b in range(case.batch)]
    assert all(len(p) == 5 for p in pages)  # ceil(70 / 16)
    assert any(p != list(range(p[0], p[0] + len(p))) for p in pages)  # not consecutive
    assert sorted(sum(pages, [])) == list(range(15))
    assert cache.seq_len(0) == 70


def test_paged_bandwidth_bookkeeping() -> None:
    big = {c.name: c for c in CATALOG}["paged_decode"]
    assert kv_bytes(big, torch.bfloat16) == 2 * 8 * 8 * 8192 * 128 * 2  # 256 MiB
    rec = kv_bandwidth(big, torch.bfloat16, "attnkit", median_s=0.01, copy_gbps=20.0)
    assert rec["kv_gbps"] == pytest.approx(2 * 8 * 8 * 8192 * 128 * 2 / 0.01 / 1e9)
    assert rec["ratio_to_memcpy"] == pytest.approx(rec["kv_gbps"] / 20.0)
    assert "bytes copied" in rec["memcpy_definition"]
    assert kv_bandwidth(big, torch.bfloat16, "sdpa", 0.01, None)["ratio_to_memcpy"] is None
    assert memcpy_gbps(mib=8, reps=2) > 0


RUN_DIST = os.environ.get("ATTNKIT_BENCH_DIST") == "1"


def test_distributed_cli_tiny(tmp_path, monkeypatch, capsys) -> None:
    """--distributed end to end at a tiny size (2 spawned ranks; ~6 s, mostly start-up)."""
    from attnkit.bench import distributed

    tiny = distributed.DistSettings(heads=2, d=16, length=256, mem_lengths=(256, 512),
                                    repeat=1, timeout_s=120)
    if not RUN_DIST:
        monkeypatch.setattr(distributed, "default_settings", lambda: tiny)
    path = str(tmp_path / "dist.json")
    assert run_from_args(_parse("--distributed", "--json", path)) == 0
    doc = json.load(open(path))["distributed"]
    assert "errors" not in doc
    assert set(doc["median_s"]) == {"zigzag_causal", "contiguous_full"}
    assert all(len(m) == 2 and min(m) > 0 for m in doc["median_s"].values())
    assert doc["causal_vs_full"] > 0 and doc["balance"]["zigzag_causal"] >= 1.0
    assert set(doc["peak_mib"]) == {str(n) for n in doc["settings"]["mem_lengths"]}
    out = capsys.readouterr().out
    assert "zigzag_causal" in out and "peak memory per rank" in out


def test_distributed_ranks_leave_ctrl_c_to_the_parent() -> None:
    import signal

    from attnkit.bench import distributed

    before = signal.getsignal(signal.SIGINT)
    try:
        distributed._ignore_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_contention_runs_busy_processes_and_stops_them() -> None:
    """--contend's processes each burn CPU while entered and are gone after."""
    from attnkit.bench.contend import Contention

    with Contention(2) as c:
        pids = [p.pid for p in c.procs]
        assert len(pids) == 2 and c.running() == 2
        before = [_cpu_ticks(pid) for pid in pids]
        time.sleep(0.6)
        after = [_cpu_ticks(pid) for pid in pids]
    assert all(b > a for a, b in zip(before, after))  # each one spun
    assert c.procs == [] and not any(os.path.exists(f"/proc/{pid}/stat") and
                                     "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
                                     for pid in pids)
    with pytest.raises(ValueError, match="busy processes"):
        Contention(-1)


def test_bench_contend_says_so_and_records_it(monkeypatch, tmp_path, capsys) -> None:
    """``--contend 1``: one busy process during the cases (started after the matmul peaks),
    named in the title, the line above the table and the JSON."""
    from attnkit.bench import contend
    from attnkit.bench import report as rep

    seen = []
    real_start = contend.Contention.start

    def start(self):
        real_start(self)
        seen.append(self.running())

    monkeypatch.setattr(contend.Contention, "start", start)
    _fast_peaks(monkeypatch)
    path = str(tmp_path / "c.json")
    args = _parse("--only", "small_256", "--pass", "fwd", "--peers", "attnkit", "--repeat", "1",
                  "--no-memory", "--no-malloc-tune", "--min-sample-ms", "1", "--contend", "1",
                  "--json", path)
    assert run_from_args(args) == 0
    out = capsys.readouterr().out
    assert seen == [1]
    assert "contended on purpose (--contend 1): 1 busy process(es)" in out
    assert ", --contend 1" in out
    doc = json.load(open(path))
    assert rep.validate(doc) == []
    assert doc["settings"]["contend"] == 1 and doc["contention"]["contend"] == 1
    with pytest.raises(SystemExit):
        _parse("--contend", "-1")


def test_kv_bytes_counts_one_byte_per_element_for_an_fp8_cache() -> None:
    from attnkit.bench.cases import CATALOG

    fp8 = next(c for c in CATALOG if c.name == "paged_decode_fp8")
    bf16 = next(c for c in CATALOG if c.name == "paged_decode")
    assert kv_bytes(fp8, torch.bfloat16) * 2 == kv_bytes(bf16, torch.bfloat16)


def test_contended_runs_sample_longer_and_take_more_rounds(monkeypatch) -> None:
    """With --contend the defaults are 100 ms samples and at least 5 rounds (a scheduler's
    slices are milliseconds long); explicit options win; a quiet run keeps 20 ms."""
    from attnkit.bench import sampling

    assert sampling(3, 0, None) == (3, 0.02)
    assert sampling(3, 1, None) == (5, 0.1)
    assert sampling(7, 2, None) == (7, 0.1)
    assert sampling(3, 1, 5.0) == (5, 0.005)
    seen = {}

    def fake(settings):
        seen.update(repeat=settings.repeat, default_repeat=settings.default_repeat,
                    min_sample_s=settings.min_sample_s, contend=settings.contend)
        return {}, []

    import attnkit.bench as bench

    monkeypatch.setattr(bench, "_run_with_progress", fake)
    assert run_from_args(_parse("--only", "small_256", "--contend", "1")) == 0
    assert seen == dict(repeat=None, default_repeat=5, min_sample_s=0.1, contend=1)
    assert run_from_args(_parse("--only", "small_256", "--contend", "1", "--repeat", "2",
                                "--min-sample-ms", "30")) == 0
    assert seen == dict(repeat=2, default_repeat=5, min_sample_s=0.03, contend=1)
    assert run_from_args(_parse("--only", "small_256")) == 0
    assert seen["default_repeat"] == 3 and seen["min_sample_s"] == 0.02


# --------------------------------------------------------------------------- limits, budget


def test_the_limits_are_measured_within_their_time_bound() -> None:
    """The native FMA and dot-product rates and the copy bandwidth: positive, of the build's
    vector width, the dot product exactly where the build has AVX512-BF16, and measured in
    about the time asked (generous bound: a busy machine only slows the rates)."""
    from attnkit import native
    from attnkit.bench import limits

    start = time.perf_counter()
    lim = limits.measure(budget_s=0.05)
    took = time.perf_counter() - start
    assert took < 15 and lim.seconds == pytest.approx(took, abs=1.0)
    assert lim.threads == torch.get_num_threads()
    assert lim.copy_gbps > 0 and "MiB" in lim.copy_source
    if not native.available():
        assert lim.fma_float32_gflops is None and "unavailable" in " ".join(lim.notes)
        return
    info = native.build_info()
    assert lim.fma_float32_gflops > 0
    if info.get("flash"):
        assert lim.fma_bits == info["flash_bits"]  # the kernels' width: 512 or 256 (AVX2)
    assert (lim.dot_bfloat16_gflops is not None) == info["bf16_dot"]
    if lim.dot_bfloat16_gflops is None:
        assert any("float32" in n for n in lim.notes)  # bfloat16's limit is the FMA's
    assert lim.compute_gflops("bfloat16") == (lim.dot_bfloat16_gflops
                                              or lim.fma_float32_gflops)
    line = lim.line()
    assert "float32 FMA" in line and "copy" in line
    with pytest.raises(ValueError, match="budget_s"):
        limits.measure(budget_s=0)


def test_the_share_of_the_limits_is_the_roofline() -> None:
    lim = FAKE_LIMITS  # 200 GFLOP/s float32, 400 bfloat16 dot, 20 GB/s copy
    # compute-bound: 100 GFLOP in 1 s = 50% of float32's 200, 25% of bfloat16's 400
    assert lim.share(100e9, 1 << 20, "float32", 1.0) == (pytest.approx(50.0), "compute")
    assert lim.share(100e9, 1 << 20, "bfloat16", 1.0) == (pytest.approx(25.0), "compute")
    # bandwidth-bound (decoding): 10 GB of K/V in 1 s = 50% of a 20 GB/s copy
    assert lim.share(1e9, 10 ** 10, "float32", 1.0) == (pytest.approx(50.0), "copy")
    assert lim.share(1e9, 10 ** 10, "float32", None) == (None, None)
    none = Limits(threads=1)
    assert none.share(1e9, 10, "float32", 1.0) == (None, None)
    without_dot = Limits(threads=1, fma_float32_gflops=200.0)
    assert without_dot.compute_name("bfloat16") == "float32 FMA"
    better = without_dot.better(Limits(threads=1, fma_float32_gflops=150.0, copy_gbps=9.0))
    assert better.fma_float32_gflops == 200.0 and better.copy_gbps == 9.0


def test_the_share_column_is_computed_from_the_limits() -> None:
    from attnkit.bench.runner import fill_shares

    case = TINY["dense"]
    decode = {c.name: c for c in CATALOG}["paged_decode_2k"]
    rows = [rep.Result(case.name, "fwd", "float32", "attnkit", median_s=0.5, flops=50e9,
                       gflops=100.0),
            rep.Result(decode.name, "fwd", "float32", "attnkit", median_s=0.01, flops=1e6,
                       gflops=0.1)]
    fill_shares(rows, [case, decode], FAKE_LIMITS, {"float32": 400.0, "bfloat16": None})
    assert rows[0].pct_of_limit == pytest.approx(50.0) and rows[0].limit == "compute"
    assert rows[0].pct_of_matmul == pytest.approx(25.0)
    want = 100.0 * kv_bytes(decode, torch.float32) / 20e9 / 0.01
    assert rows[1].pct_of_limit == pytest.approx(want) and rows[1].limit == "copy"
    table = rep.table_rows(rows)
    assert table[0][rep.COLUMNS.index("% of limit")] == "50"
    assert table[1][rep.COLUMNS.index("% of limit")].endswith("(copy)")


def test_torch_matmul_is_sized_by_its_rate_and_skips_emulated_bfloat16(monkeypatch) -> None:
    from attnkit.bench import limits

    sizes = []

    def rate(dtype, n, reps):
        sizes.append((dtype, n))
        return 1.0 if dtype == torch.float32 else 500.0  # a slow float32: 1 GFLOP/s

    monkeypatch.setattr(limits, "_matmul_rate", rate)
    monkeypatch.setattr(limits, "native_bf16_matmul", lambda: True)
    mm = limits.torch_matmul(budget_s=1.0)
    # float32: 3 calls at 512^3 (0.8 GFLOP) fit 1 s at 1 GFLOP/s, at 1024^3 not
    assert mm.size == {"float32": 512, "bfloat16": 2048} and not mm.skipped
    assert (torch.float32, 1024) not in sizes
    monkeypatch.setattr(limits, "native_bf16_matmul", lambda: False)  # an AVX2 CPU's torch
    sizes.clear()
    mm = limits.torch_matmul()
    assert mm.gflops["bfloat16"] is None and "emulated" in mm.skipped["bfloat16"]
    assert all(dtype == torch.float32 for dtype, _ in sizes)  # bfloat16 never timed
    assert "bfloat16 not timed" in mm.line()
    # where torch cannot say, a probe under half float32's rate decides
    monkeypatch.setattr(limits, "native_bf16_matmul", lambda: None)
    monkeypatch.setattr(limits, "_matmul_rate",
                        lambda dtype, n, reps: 100.0 if dtype == torch.float32 else 1.0)
    assert "bfloat16" in limits.torch_matmul().skipped
    again = limits.torch_matmul(sizes={"float32": 512})
    assert again.gflops == {"float32": 100.0, "bfloat16": None}


def test_a_deadline_cuts_rounds_and_peers_and_says_so() -> None:
    m = FakeMachine()
    fns = {"attnkit": m.fn("attnkit", 2.0), "slow": m.fn("slow", 3.0), "late": m.fn("late", 1.0)}
    t = interleave(fns, subject="attnkit", rounds=3, clock=m.clock, deadline=4.0,
                   slow_call_s=1.0)
    # the subject's and "slow"'s warm-ups (>= 1 s each) are their first samples; by then the
    # deadline has passed: "late" is left out, no further round, no closing run
    assert m.calls == ["attnkit", "slow"]
    assert len(t.times["attnkit"]) == 1 and len(t.times["slow"]) == 1
    assert "late" not in t.times and "not timed" in t.cut["late"]
    assert "1 of 3 round(s)" in t.cut["slow"] and "1 of 3" in t.cut["attnkit"]
    assert t.ratio("slow") == pytest.approx(1.5, rel=0.05)
    m2 = FakeMachine()
    fns = {"attnkit": m2.fn("attnkit", 0.5), "peer": m2.fn("peer", 0.5)}
    t2 = interleave(fns, subject="attnkit", rounds=3, clock=m2.clock, deadline=1e9)
    assert not t2.cut and len(t2.times["attnkit"]) == 4  # a far deadline changes nothing


def test_the_budget_and_the_limits_reach_the_output_and_the_json(tmp_path, monkeypatch,
                                                                  capsys) -> None:
    _fast_peaks(monkeypatch)
    path = str(tmp_path / "b.json")
    args = _parse("--only", "small_256", "--pass", "fwd", "--peers", "attnkit,naive",
                  "--no-memory", "--no-malloc-tune", "--budget", "0.000001", "--json", path)
    assert run_from_args(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].startswith("limits on 2 thread(s): float32 FMA 200 GFLOP/s (512-bit)")
    assert lines[2].startswith("torch matmul: float32 100 GFLOP/s")
    assert "left out (" in out and "left untimed: small_256: naive fwd" in out
    doc = json.load(open(path))
    assert rep.validate(doc) == []
    assert doc["limits"]["fma_float32_gflops"] == 200.0 and doc["limits"]["copy_gbps"] == 20.0
    assert doc["settings"]["budget_s"] == pytest.approx(1e-6)
    assert doc["matmul"]["size"]["float32"] == 2048
    machine = doc["machine"]
    assert isinstance(machine["cpu_features"], list)
    assert "native_avx512" in machine and "torch_bf16_matmul_native" in machine
    by = {r["peer"]: r for r in doc["results"]}
    assert by["attnkit"]["status"] == "ok" and by["attnkit"]["limit"] == "compute"
    expect = 100.0 * by["attnkit"]["flops"] / 200e9 / by["attnkit"]["median_s"]
    assert by["attnkit"]["pct_of_limit"] == pytest.approx(expect)
    assert by["naive"]["status"] == "skipped" and "--budget" in by["naive"]["note"]
    assert any("naive" in x for x in doc["left_out"])


def test_emulated_bfloat16_leaves_out_the_peers_on_torch_matmul(monkeypatch) -> None:
    from attnkit.bench import limits

    monkeypatch.setattr(limits, "native_bf16_matmul", lambda: False)
    seen = {}
    monkeypatch.setattr("attnkit.bench._run_with_progress",
                        lambda settings: (seen.setdefault("skip", settings.emulated_bf16_skip),
                                          ({}, []))[1])
    assert run_from_args(_parse("--only", "small_256", "--dtype", "bfloat16")) == 0
    assert seen.pop("skip") == ("naive", "flex")
    assert run_from_args(_parse("--only", "small_256", "--dtype", "bfloat16", "--peers",
                                "attnkit,naive")) == 0
    assert seen.pop("skip") == ()  # named peers run
    case = TINY["dense"]
    settings = _tiny_settings(cases=[case], dtypes=["bfloat16"], passes=["fwd"],
                              peers=["attnkit", "naive"], emulated_bf16_skip=("naive",))
    rows = {r.peer: r for r in run_case(case, settings, {})}
    assert rows["naive"].status == "skipped" and "emulated" in rows["naive"].note
    assert rows["attnkit"].status == "ok"


def test_blhd_layout_draws_transposed_views_that_every_peer_runs() -> None:
    case = Case("t_blhd", heads_q=2, len_q=64, d_qk=16, causal=True, layout="blhd")
    w = make_workload(case, torch.float32)
    for x in (w.q, w.k, w.v, w.g):  # (B, L, H, D) memory seen as (B, H, L, D)
        assert x.shape == (1, 2, 64, 16) and x.stride()[1:] == (16, 32, 1)
    settings = _tiny_settings(cases=[case], peers=["attnkit", "sdpa", "naive"], repeat=1)
    results = run_case(case, settings, {"float32": 1.0})
    assert len(results) == 6
    for r in results:
        assert r.status == "ok", r.note
        assert r.max_err is not None and r.max_err < 1e-4, (r.peer, r.pass_, r.max_err)
    assert {c.name: c for c in select("standard")}["causal_4k_blhd"].layout == "blhd"
    with pytest.raises(ValueError, match="layout"):
        Case("bad", layout="lbhd")
