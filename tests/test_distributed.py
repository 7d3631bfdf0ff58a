"""Ring attention across processes, against single-process attention on the full sequence.

One spawn per world size (2 and 4 gloo processes on localhost, one CPU thread each) runs every
case; each worker returns its shards of out, lse and the gradients, and the parent gathers
them with ``unshard_sequence`` and compares with ``attnkit.attention`` on the full sequence:
float64 tightly, float32 by FlashAttention's rule against single-process float32 attention.
"""

from __future__ import annotations

import itertools
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import fa_tolerance_ok

import attnkit
from attnkit.distributed import (
    _plan_pair,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from attnkit.score_mods import alibi_slopes

#: Wall-clock bound for one spawn, a guard against hangs. Process start-up dominates (each
#: worker imports torch): 4 workers take ~15 s on 2 idle cores, ~30 s on 2 busy ones.
SPAWN_TIMEOUT_S = 120


def _position_score_mod(score, b, h, q_idx, kv_idx):
    """A non-additive, asymmetric positional score_mod: wrong positions change the result."""
    return score * (1.0 + 0.01 * ((3 * q_idx + kv_idx) % 5)) - 0.02 * h


def _document_mask(b, h, q_idx, kv_idx):
    """Documents of 7 positions (boundaries fall inside shards)."""
    return (q_idx // 7) == (kv_idx // 7)


# name -> case. l_local: positions per rank. Every case runs on 2 and 4 ranks.
CASES = {
    "f64_causal_contiguous_gqa": dict(dtype="float64", causal=True, layout="contiguous",
                                      l_local=5, hq=4, hkv=2, dlse=True),
    "f64_causal_zigzag_gqa": dict(dtype="float64", causal=True, layout="zigzag", l_local=6,
                                  hq=4, hkv=2),
    "f64_full_contiguous": dict(dtype="float64", causal=False, layout="contiguous", l_local=5,
                                hq=2, hkv=2, dlse=True),
    "f64_full_zigzag_gqa": dict(dtype="float64", causal=False, layout="zigzag", l_local=6,
                                hq=4, hkv=2, dlse=True),
    "f32_causal_zigzag_gqa": dict(dtype="float32", causal=True, layout="zigzag", l_local=6,
                                  hq=4, hkv=2),
    "f32_full_contiguous_gqa": dict(dtype="float32", causal=False, layout="contiguous",
                                    l_local=5, hq=4, hkv=2, dlse=True),
    "f64_causal_window_alibi_zigzag": dict(dtype="float64", causal=True, layout="zigzag",
                                           l_local=6, hq=4, hkv=2, window=(5, None),
                                           alibi=True, dlse=True),
    "f64_window_softcap_contiguous": dict(dtype="float64", causal=False, layout="contiguous",
                                          l_local=5, hq=4, hkv=1, window=(4, 3), softcap=2.0),
    "f32_window_alibi_contiguous": dict(dtype="float32", causal=False, layout="contiguous",
                                        l_local=5, hq=4, hkv=2, window=(2, 6), alibi=True),
    "f64_causal_score_mod_documents_zigzag": dict(dtype="float64", causal=True,
                                                  layout="zigzag", l_local=6, hq=2, hkv=1,
                                                  score_mod=True, mask=True, dlse=True),
}

# Extra runs that use a process subgroup: (world size, case, group ranks, run as)
SUBGROUP_RUNS = {
    "one_rank_groups": (2, "f64_causal_window_alibi_zigzag"),  # every rank alone: world 1
    "ranks_1_3": (4, "f64_causal_zigzag_gqa"),  # a 2-rank ring of global ranks 1 and 3
}


def _options(case: dict) -> dict:
    """attnkit.attention keywords of a case (the same for the ring and the reference)."""
    opts: dict = {"causal": case["causal"]}
    if case.get("window"):
        opts["window"] = case["window"]
    if case.get("alibi"):
        opts["alibi_slopes"] = alibi_slopes(case["hq"])
    if case.get("softcap"):
        opts["softcap"] = case["softcap"]
    if case.get("score_mod"):
        opts["score_mod"] = _position_score_mod
    if case.get("mask"):
        opts["mask"] = _document_mask
    return opts


def _inputs(case: dict, world_size: int, seed: int = 0):
    """Full-sequence q, k, v, dout, dlse of a case (identical in every process)."""
    g = torch.Generator().manual_seed(seed)
    length, b, d, dv = case["l_local"] * world_size, 2, 8, 6
    dtype = getattr(torch, case["dtype"])

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q, k, v = rnd(b, case["hq"], length, d), rnd(b, case["hkv"], length, d), \
        rnd(b, case["hkv"], length, dv)
    dout = rnd(b, case["hq"], length, dv)
    dlse = rnd(b, case["hq"], length) if case.get("dlse") else None
    return q, k, v, dout, dlse


def _loss(out, lse, dout, dlse):
    loss = (out * dout).sum()
    return loss + (lse * dlse).sum() if dlse is not None else loss


def _run_case(case: dict, world_size: int, rank: int, group=None) -> dict:
    """This rank's shards of out, lse, dq, dk, dv for one case."""
    layout = case["layout"]
    q, k, v, dout, dlse = _inputs(case, world_size)
    qs, ks, vs = (shard_sequence(t, world_size, rank, layout).clone().requires_grad_(True)
                  for t in (q, k, v))
    out, lse = ring_attention(qs, ks, vs, group=group, layout=layout, return_lse=True,
                              **_options(case))
    dlse_s = None if dlse is None else shard_sequence(dlse, world_size, rank, layout, dim=-1)
    _loss(out, lse, shard_sequence(dout, world_size, rank, layout), dlse_s).backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": qs.grad, "dk": ks.grad,
            "dv": vs.grad}


def _expect_error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _error_cases(world_size: int, rank: int) -> dict:
    """Messages of the calls that must be rejected (the same on every rank, no hang)."""
    x = torch.randn(1, 2, 4 + 2 * rank, 8)  # rank-dependent length: uneven shards
    y = torch.randn(1, 2, 3, 8)
    return {
        "uneven": _expect_error(lambda: ring_attention(x, x, x, causal=True)),
        "zigzag_odd": _expect_error(lambda: ring_attention(y, y, y, layout="zigzag")),
        "q_k_lengths": _expect_error(
            lambda: ring_attention(torch.randn(1, 2, 4, 8), y, y)),
    }


def _worker(rank: int, world_size: int, tmp: str) -> None:
    torch.set_num_threads(1)
    results: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        for name, case in CASES.items():
            results[name] = _run_case(case, world_size, rank)
        results["errors"] = _error_cases(world_size, rank)
        for name, (ws, case_name) in SUBGROUP_RUNS.items():
            if ws != world_size:
                continue
            if name == "one_rank_groups":
                groups = [dist.new_group([r]) for r in range(world_size)]
                results[name] = _run_case(CASES[case_name], 1, 0, group=groups[rank])
            else:
                group = dist.new_group([1, 3])
                if rank in (1, 3):
                    results[name] = _run_case(CASES[case_name], 2, rank // 2, group=group)
    except Exception:  # report to the parent instead of dying silently
        results = {"traceback": traceback.format_exc()}
    finally:
        torch.save(results, f"{tmp}/rank{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world_size: int, tmp: Path) -> list:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world_size, str(tmp)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    results = []
    for r in range(world_size):
        path = tmp / f"rank{r}.pt"
        results.append(torch.load(path, weights_only=True) if path.exists() else {})
    for r, res in enumerate(results):
        if "traceback" in res:
            pytest.fail(f"rank {r} of {world_size} failed:\n{res['traceback']}")
    if hung:
        pytest.fail(f"ranks {hung} of {world_size} did not finish within {SPAWN_TIMEOUT_S} s")
    return results


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    """``ring_results(world_size)``: every rank's results, spawned once per world size."""
    cache: dict = {}

    def get(world_size: int) -> list:
        if world_size not in cache:
            cache[world_size] = _spawn(world_size, tmp_path_factory.mktemp(f"ring{world_size}"))
        return cache[world_size]

    return get


def _reference(case: dict, world_size: int, dtype: torch.dtype) -> dict:
    """Single-process attention on the full sequence: the dense oracle for float64,
    ``attnkit.attention`` for float32 (the same-dtype baseline)."""
    q, k, v, dout, dlse = _inputs(case, world_size)
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    fn = attnkit.attention_reference if dtype == torch.float64 else attnkit.attention
    out, lse = fn(q, k, v, return_lse=True, **_options(case))
    dq, dk, dv = torch.autograd.grad(_loss(out, lse, dout.to(dtype), dlse), (q, k, v))
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def _compare(case: dict, world_size: int, shards: list) -> None:
    layout = case["layout"]
    got = {key: unshard_sequence([s[key] for s in shards], layout,
                                 dim=-1 if key == "lse" else -2)
           for key in ("out", "lse", "dq", "dk", "dv")}
    ref = _reference(case, world_size, torch.float64)
    if case["dtype"] == "float64":
        for key in got:
            assert got[key].dtype == torch.float64, key
            torch.testing.assert_close(got[key], ref[key], rtol=1e-10, atol=1e-10,
                                       msg=lambda m, key=key: f"{key}: {m}")
        return
    plain = _reference(case, world_size, torch.float32)  # single-process float32 attention
    for key in got:
        assert got[key].dtype == torch.float32, key
        ok, err, base = fa_tolerance_ok(got[key], ref[key], plain[key],
                                        mult=2.0 if key in ("out", "lse") else 3.0)
        assert ok, f"{key}: ring error {err:.3g}, single-process float32 error {base:.3g}"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_ring_matches_single_process(ring_results, world_size, name):
    shards = [res[name] for res in ring_results(world_size)]
    _compare(CASES[name], world_size, shards)


def test_ring_of_one_rank_is_local_attention(ring_results):
    world_size, case_name = SUBGROUP_RUNS["one_rank_groups"]
    for res in ring_results(world_size):  # every rank ran alone in its own group
        _compare(CASES[case_name], 1, [res["one_rank_groups"]])


def test_ring_on_a_subgroup(ring_results):
    world_size, case_name = SUBGROUP_RUNS["ranks_1_3"]
    results = ring_results(world_size)
    assert "ranks_1_3" not in results[0] and "ranks_1_3" not in results[2]
    _compare(CASES[case_name], 2, [results[1]["ranks_1_3"], results[3]["ranks_1_3"]])


def test_bad_shards_raise_on_every_rank(ring_results):
    errors = [res["errors"] for res in ring_results(2)]
    for e in errors:
        assert e["uneven"].startswith("ValueError") and "same shape" in e["uneven"], e
        assert "rank 0: q (1, 2, 4, 8)" in e["uneven"] and "rank 1: q (1, 2, 6, 8)" in e["uneven"]
        assert e["zigzag_odd"].startswith("ValueError") and "L_local must be even" in \
            e["zigzag_odd"], e
        assert e["q_k_lengths"].startswith("ValueError") and "same positions" in \
            e["q_k_lengths"], e


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world_size):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [shard_sequence(x, world_size, r, layout) for r in range(world_size)]
    assert all(s.shape == (2, 24 // world_size, 3) for s in shards)
    assert torch.equal(unshard_sequence(shards, layout), x)
    lse_like = x[..., 0]
    assert torch.equal(unshard_sequence(
        [shard_sequence(lse_like, world_size, r, layout, dim=-1) for r in range(world_size)],
        layout, dim=-1), lse_like)


def test_zigzag_layout_picture():
    pos = torch.arange(8).view(8, 1)
    assert shard_sequence(pos, 2, 0, "zigzag").flatten().tolist() == [0, 1, 6, 7]
    assert shard_sequence(pos, 2, 1, "zigzag").flatten().tolist() == [2, 3, 4, 5]
    assert shard_sequence(pos, 2, 1, "contiguous").flatten().tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout,length,world_size,parts", [
    ("contiguous", 10, 4, 4), ("zigzag", 12, 4, 8), ("zigzag", 6, 2, 4)])
def test_uneven_lengths_rejected(layout, length, world_size, parts):
    with pytest.raises(ValueError, match=rf"length {length} .* into {parts} equal chunks"):
        shard_sequence(torch.zeros(1, length, 4), world_size, 0, layout)


def test_shard_argument_errors():
    x = torch.zeros(8, 2)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_sequence(x, 2, 0, "striped")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        shard_sequence(x, 2, 2)
    with pytest.raises(ValueError, match="same shape"):
        unshard_sequence([x[:4], x[:2]])
    with pytest.raises(ValueError, match="must be even"):
        unshard_sequence([x[:3], x[:3]], "zigzag")


def test_ring_attention_needs_a_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(x, x, x)
    with pytest.raises(TypeError, match="mask must be a mask_mod"):
        ring_attention(x, x, x, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(x, x, x, layout="striped")
    with pytest.raises(ValueError, match="window left size must be >= 0"):
        ring_attention(x, x, x, window=(-1, 0))


def test_block_plan_matches_dense_band():
    """Every (query chunk, key chunk, band) gives exactly the dense global band, through a
    trimmed block and a non-negative top-left window."""
    bands = [(lo, hi) for lo in (None, -6, -3, -1, 0, 2) for hi in (None, -2, 0, 1, 4, 7)
             if lo is None or hi is None or lo <= hi]
    for qs, qn, ks, kn in itertools.product((0, 3, 9), (1, 3, 4), (0, 3, 9), (1, 3, 5)):
        i = torch.arange(qs, qs + qn).view(-1, 1)
        j = torch.arange(ks, ks + kn).view(1, -1)
        for lo, hi in bands:
            want = torch.ones(qn, kn, dtype=torch.bool)
            if lo is not None:
                want &= j - i >= lo
            if hi is not None:
                want &= j - i <= hi
            got = torch.zeros(qn, kn, dtype=torch.bool)
            blk = _plan_pair(qs, qn, ks, kn, lo, hi)
            if blk is not None:
                assert (blk.q_pos, blk.k_pos) == (qs + blk.q0, ks + blk.k0)
                left, right = blk.window or (None, None)
                assert (left is None or left >= 0) and (right is None or right >= 0)
                ii = torch.arange(blk.q1 - blk.q0).view(-1, 1)
                jj = torch.arange(blk.k1 - blk.k0).view(1, -1)
                vis = torch.ones(ii.shape[0], jj.shape[1], dtype=torch.bool)
                if left is not None:
                    vis &= jj >= ii - left
                if right is not None:
                    vis &= jj <= ii + right
                got[blk.q0:blk.q1, blk.k0:blk.k1] = vis
            assert torch.equal(got, want), (qs, qn, ks, kn, lo, hi, blk)


def test_ring_attention_refuses_starts_kv_instead_of_ignoring_it():
    from attnkit import distributed

    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(NotImplementedError, match="starts_kv"):
        distributed.ring_attention(q, q, q, starts_kv=torch.tensor([2]))
