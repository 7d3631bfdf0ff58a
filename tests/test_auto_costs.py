"""``backend="auto"`` chooses between the flash and fused executors by the measured cost table
(:mod:`attnkit.backends.costs`), deterministically, never for an executor that cannot run the
call, and says why."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import backends, native
from attnkit.backends import costs, flash, fused
from attnkit.bench import costs as cost_bench
from attnkit.spec import build_spec

pytestmark = pytest.mark.skipif(not native.build_info().get("flash", False),
                                reason="the native flash kernel is unavailable")


@pytest.fixture
def restore_table():
    yield
    costs.reload()


@pytest.fixture
def threads():
    """Set torch's thread count for the test (restored after)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def kind(monkeypatch):
    """Pretend the loaded kernels are the ``avx512`` or ``avx2`` build."""
    info = dict(native.build_info())

    def set_kind(name: str) -> None:
        info["flash_bits"] = 512 if name == "avx512" else 256
        monkeypatch.setattr(native, "build_info", lambda: dict(info))
        costs.use(costs.table())  # (clears the cached choices)

    return set_kind


def _qkv(bh=1, lq=4096, lk=None, d=64, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(0)
    shapes = ((1, bh, lq, d), (1, bh, lk or lq, d), (1, bh, lk or lq, d))
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(grad) for s in shapes]


def _synthetic(fused_over_flash):
    """A table for both kinds where fused costs ``fused_over_flash(dtype, mask)`` x flash at
    every point (flash's cost proportional to the work)."""
    points = []
    for dtype in ("float32", "bfloat16", "float16"):
        for mask in ("causal", "dense"):
            for mode, passes in (("forward", 1), ("train", 3)):
                for d in (64, 128):
                    for n in (128, 4096):
                        for bh in ((1, 8) if n < 4096 else (1,)):
                            points.append(dict(bh=bh, lq=n, lk=n, d=d, dtype=dtype, mask=mask,
                                               mode=mode, flash_ms=passes * bh * n * n * d / 1e7,
                                               ratio=fused_over_flash(dtype, mask)))
    return {"version": costs.VERSION,
            "kinds": {k: {"machine": {}, "points": points} for k in ("avx512", "avx2")}}


def test_the_issues_call_runs_flash_on_the_avx2_kind(kind, threads):
    """Causal float32 training, B=1, H=1, L=4096 on an AVX2 CPU: torch's backward runs one
    head on one thread; the packaged table picks flash, on 2 threads and on 16."""
    kind("avx2")
    q, k, v = _qkv(grad=True)
    spec = build_spec(q, k, v, causal=True)
    for n in (2, 16):
        threads(n)
        assert backends.choose(spec) is flash, backends.explain_choice(spec)
        assert "avx2 cost table" in backends.explain_choice(spec)


def test_the_choice_follows_the_table(kind, restore_table):
    """Fused where the table says it is faster (by more than the margin), flash elsewhere."""
    kind("avx512")
    q, k, v = _qkv(bh=8, lq=1024)
    dense, causal = build_spec(q, k, v), build_spec(q, k, v, causal=True)
    costs.use(_synthetic(lambda dtype, mask: 0.5 if mask == "dense" else 2.0))
    assert backends.choose(dense) is fused and backends.choose(causal) is flash
    costs.use(_synthetic(lambda dtype, mask: 2.0 if mask == "dense" else 0.5))
    assert backends.choose(dense) is flash and backends.choose(causal) is fused
    costs.use(_synthetic(lambda dtype, mask: 1 - costs.MARGIN / 2))  # within the margin
    assert backends.choose(dense) is flash and backends.choose(causal) is flash
    kind("avx2")  # the other kind's rows
    costs.use(_synthetic(lambda dtype, mask: 0.5))
    assert backends.choose(dense) is fused
    costs.use({"version": costs.VERSION, "kinds": {}})  # no data for this kind: the order
    assert backends.choose(dense) is flash
    assert "no avx2 data" in backends.explain_choice(dense)


def test_torchs_backward_by_heads_costs_more_with_fewer_heads_than_threads(restore_table):
    """The formula: with the same one-thread costs, fused's backward (split by heads) on 16
    threads is slower for one head than flash's (split by 64 keys), and catches up with 16."""
    costs.use(_synthetic(lambda dtype, mask: 0.8))
    form = dict(kind="avx2", dtype="float32", mask="causal", lq=4096, lk=4096, d=64,
                threads=16)
    one = {ex: costs.cost(ex, bh=1, **form) for ex in ("flash", "fused")}
    many = {ex: costs.cost(ex, bh=16, **form) for ex in ("flash", "fused")}
    assert one["fused"] > 2 * one["flash"], one
    assert many["fused"] < many["flash"], many
    assert costs.cost("flash", bh=1, **dict(form, kind="arm")) is None


def test_the_choice_is_the_same_every_time_and_with_or_without_gradients(threads):
    threads(2)
    for kw in (dict(), dict(causal=True)):
        for bh, n in ((1, 4096), (8, 256), (32, 1024)):
            for dtype in (torch.float32, torch.bfloat16):
                q, k, v = _qkv(bh, n, dtype=dtype)
                qg, kg, vg = _qkv(bh, n, dtype=dtype, grad=True)
                first = backends.choose(build_spec(q, k, v, **kw))
                assert first is not None
                for _ in range(3):
                    assert backends.choose(build_spec(q, k, v, **kw)) is first
                    assert backends.choose(build_spec(qg, kg, vg, **kw)) is first
                costs.reload()
                assert backends.choose(build_spec(q, k, v, **kw)) is first


def test_an_executor_that_cannot_run_the_call_is_never_chosen(kind, restore_table):
    """A table that calls fused faster everywhere still leaves to flash what fused cannot run
    (softcap, dropout, row maxima) and what the table does not cover (windows, ALiBi)."""
    kind("avx2")
    costs.use(_synthetic(lambda dtype, mask: 0.1))
    q, k, v = _qkv(bh=8, lq=256)
    assert backends.choose(build_spec(q, k, v, causal=True)) is fused
    for kw in (dict(softcap=5.0), dict(dropout_p=0.1, seed=0), dict(window=(32, 0)),
               dict(causal=True, alibi_slopes=torch.rand(8))):
        spec = build_spec(q, k, v, **kw)
        assert backends.choose(spec) is flash, (kw, backends.explain_choice(spec))
    spec = build_spec(q, k, v, causal=True, outputs=frozenset({"max_scores"}))
    assert backends.choose(spec) is flash
    q64, k64, v64 = (x.double() for x in (q, k, v))  # flash runs no float64
    assert backends.choose(build_spec(q64, k64, v64)) is fused


def test_explain_choice_says_why(kind):
    kind("avx512")
    q, k, v = _qkv(bh=2, lq=1024)
    text = backends.explain_choice(build_spec(q, k, v, causal=True))
    assert text.startswith("auto picks flash")
    assert "avx512 cost table, float32 causal B*H=2 Lq=1024" in text and "fused" in text
    text = backends.explain_choice(build_spec(q, k, v, softcap=3.0))
    assert "the cost table" not in text  # (fused cannot run it: nothing to compare)


def test_the_packaged_table_covers_both_kinds_and_records_the_machine():
    data = json.loads(costs.TABLE_PATH.read_text())
    assert data["version"] == costs.VERSION
    assert set(data["kinds"]) >= {"avx512", "avx2"}
    for name, entry in data["kinds"].items():
        assert entry["machine"]["threads"] == 1 and entry["machine"]["flags"], name
        assert entry["machine"]["build"]["flash_bits"] == (512 if name == "avx512" else 256)
        seen = {(p["dtype"], p["mask"], p["mode"], p["lq"], p["d"], p["bh"])
                for p in entry["points"]}
        for key in ((dt, m, mode, n, d, 1) for dt in ("float32", "bfloat16")
                    for m in ("causal", "dense") for mode in ("forward", "train")
                    for n in (128, 256, 1024, 4096) for d in (64, 128)):
            assert key in seen, (name, key)
        assert all(p["flash_ms"] > 0 and p["ratio"] > 0 for p in entry["points"])


def test_the_bench_writes_this_kind_and_keeps_the_others(tmp_path, threads):
    out = tmp_path / "costs.json"
    out.write_text(json.dumps({"version": costs.VERSION, "kinds": {"other": {"points": []}}}))
    threads(2)
    entry = cost_bench.run(quick=True, out=out, log=lambda line: None)
    assert torch.get_num_threads() == 2  # (restored after measuring on one thread)
    data = json.loads(out.read_text())
    assert set(data["kinds"]) == {"other", costs.cpu_kind()}
    assert data["kinds"][costs.cpu_kind()] == entry
    assert {p["mode"] for p in entry["points"]} == {"forward", "train"}
    assert entry["machine"]["threads"] == 1


def test_replayed_calls_run_the_executor_the_table_chose(kind, restore_table):
    """attention() remembers a launcher for a call's form; the second call of each form gives
    the bits of the executor the table chose for it (fused for dense here, flash for causal),
    as the first did."""
    from attnkit import api, attention

    kind(costs.cpu_kind())
    costs.use(_synthetic(lambda dtype, mask: 0.5 if mask == "dense" else 2.0))
    api._REPLAYS.clear()
    q, k, v = _qkv(bh=3, lq=200)
    for causal, name in ((False, "fused"), (True, "flash")):
        want = attention(q, k, v, causal=causal, backend=name)
        other = attention(q, k, v, causal=causal, backend="fused" if name == "flash" else "flash")
        assert not torch.equal(want, other)  # (the two executors' bits differ here)
        for _ in range(3):
            assert torch.equal(attention(q, k, v, causal=causal), want), name
    api._REPLAYS.clear()


def test_a_new_table_applies_to_calls_already_replayed(restore_table):
    """costs.use() after a form of call was remembered: the next call of that form runs the
    executor the new table chooses, not the launcher made under the old one (a replay gives
    what the full path gives)."""
    from attnkit import api, attention

    api._REPLAYS.clear()
    q, k, v = _qkv(bh=3, lq=200)
    bits = {name: attention(q, k, v, backend=name) for name in ("fused", "flash")}
    for name, ratio in (("flash", 2.0), ("fused", 0.5), ("flash", 2.0)):
        costs.use(_synthetic(lambda dtype, mask, r=ratio: r))
        for _ in range(3):
            assert torch.equal(attention(q, k, v), bits[name]), name
    api._REPLAYS.clear()
