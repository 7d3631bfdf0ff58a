"""Paged decoding steps replayed: a paged call the decode executor ran is remembered by its
form (query shape/strides/dtype, options, the pages' shapes/strides/dtypes, the block table's
rows), and the next steps over the same cache run straight on the native kernel, whose own
checks of the block table and the lengths replace the front door's. Each replayed step must
give the full path's bits (and the float64 oracle); a table or lengths the full path refuses
are refused with the full path's words; what a replay cannot vouch for takes the full path."""

from __future__ import annotations

import pytest
import torch
from conftest import check_oracle, rand, spy

import attnkit
from attnkit import native
from attnkit.doors import paged as paged_door
from attnkit.doors.attention import replays_disabled

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernel unavailable")

OPTIONS = [dict(), dict(window=(7, 0)), dict(softcap=2.0, scale=0.3)]


@pytest.fixture
def paged_specs(monkeypatch):
    """How many paged calls built a spec (the full path); the replay cache starts empty and
    the native kernels loaded."""
    native.available()
    monkeypatch.setattr(paged_door, "_REPLAYS", {})
    monkeypatch.setattr(paged_door, "_FORMS", {})
    return spy(monkeypatch, paged_door, "paged_spec")


def _grow(cache, seqs, gen, dtype, step):
    """Append 1-4 tokens to each sequence (a different count per sequence and step, so that
    their pages interleave in the pool)."""
    hkv, d = cache.k_pages.shape[2], cache.k_pages.shape[3]
    for i, s in enumerate(seqs):
        n = 1 + (step * (i + 2)) % 4
        cache.append(s, rand(n, hkv, d, gen=gen, dtype=dtype), rand(n, hkv, d, gen=gen,
                                                                    dtype=dtype))


@pytest.mark.parametrize("kw", OPTIONS, ids=str)
@pytest.mark.parametrize("dtype, lq", [(torch.float32, 1), (torch.bfloat16, 1),
                                       (torch.float32, 3)])
def test_replayed_paged_steps_give_the_full_paths_bits(kw, dtype, lq, paged_specs):
    g = torch.Generator().manual_seed(0)
    cache = attnkit.PagedKVCache(96, 8, 2, 32, dtype)
    seqs = ["a", "b", "c"]
    for s in seqs:
        cache.allocate(s)
        cache.append(s, rand(5, 2, 32, gen=g, dtype=dtype), rand(5, 2, 32, gen=g, dtype=dtype))
    with torch.no_grad():
        for step in range(12):
            _grow(cache, seqs, g, dtype, step)
            q = rand(3, 8, lq, 32, gen=g, dtype=dtype)
            out = attnkit.paged_attention(q, cache, seqs, **kw)
            with replays_disabled():
                full = attnkit.paged_attention(q, cache, seqs, **kw)
            assert torch.equal(out, full), step
            k, v = cache.gather(seqs)
            lens = torch.tensor([cache.seq_len(s) for s in seqs])
            check_oracle(out, q, k, v, dict(kw, causal=True, diagonal="bottom_right",
                                            seqlens_kv=lens), dtype)
    # the first step's call and every step's full-path twin built a spec; the replayed ones
    # did not
    assert len(paged_specs) == 1 + 12
    assert [launch is not None for launch in paged_door._REPLAYS.values()] == [True]


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_replayed_steps_over_fp8_pages_give_the_full_paths_bits(fmt, paged_specs):
    """An fp8 cache whose per-(page, kv head) descales change as its pages fill: the descales'
    values are read at every replayed step, as the full path reads them."""
    g = torch.Generator().manual_seed(2)
    cache = attnkit.PagedKVCache(64, 8, 2, 32, fmt)
    seqs = ["a", "b"]
    for s in seqs:
        cache.allocate(s)
    with torch.no_grad():
        for step in range(10):
            for i, s in enumerate(seqs):
                n = 1 + (step + i) % 3
                cache.append(s, rand(n, 2, 32, gen=g, dtype=torch.float32) * (1 + step),
                             rand(n, 2, 32, gen=g, dtype=torch.float32) * (1 + step))
            q = rand(2, 8, 1, 32, gen=g, dtype=torch.bfloat16)
            out = attnkit.paged_attention(q, cache, seqs)
            with replays_disabled():
                full = attnkit.paged_attention(q, cache, seqs)
            assert torch.equal(out, full), step
        # per kv head and scalar descales, given by hand to the raw front door
        table, lens = cache.block_table(seqs)
        for kd, vd in ((torch.tensor([0.5, 2.0]), 0.25), (3.0, torch.tensor([1.0, 0.125]))):
            for _ in range(2):
                out = attnkit.paged_attention_blocks(q, cache.k_pages, cache.v_pages, table,
                                                     lens, k_descale=kd, v_descale=vd)
                with replays_disabled():
                    full = attnkit.paged_attention_blocks(q, cache.k_pages, cache.v_pages,
                                                          table, lens, k_descale=kd,
                                                          v_descale=vd)
                assert torch.equal(out, full)
    # the first step, each step's full-path twin, and the first call of each descale form
    assert len(paged_specs) == 1 + 10 + 2 + 4
    assert all(launch is not None for launch in paged_door._REPLAYS.values())


def _one_step(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    k_pages, v_pages = (rand(10, 4, 2, 16, gen=g, dtype=dtype) for _ in range(2))
    table = torch.tensor([[3, 1, 7], [0, 9, 2]], dtype=torch.int32)
    lens = torch.tensor([11, 9], dtype=torch.int32)
    q = rand(2, 4, 1, 16, gen=g, dtype=dtype)
    return q, k_pages, v_pages, table, lens


@pytest.mark.parametrize("table, lens", [
    ([[3, 1, 10], [0, 9, 2]], [11, 9]),   # a used page past the pool
    ([[3, -1, 7], [0, 9, 2]], [11, 9]),   # a negative page
    ([[3, 1, 7], [0, 9, 2]], [13, 9]),    # longer than the table's row
    ([[3, 1, 7], [0, 9, 2]], [0, 9]),     # shorter than the query block
    ([[3, 1, 7], [0, 9, 2]], [-2, 9]),
])
def test_a_replayed_call_refuses_what_the_full_path_refuses_in_its_words(table, lens,
                                                                        paged_specs):
    q, k_pages, v_pages, good_table, good_lens = _one_step()
    with torch.no_grad():
        attnkit.paged_attention_blocks(q, k_pages, v_pages, good_table, good_lens)
        assert attnkit.paged_attention_blocks(q, k_pages, v_pages, good_table, good_lens
                                              ) is not None
        assert len(paged_specs) == 1  # (the second call was replayed)
        bad = torch.tensor(table, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        with replays_disabled(), pytest.raises(ValueError) as full:
            attnkit.paged_attention_blocks(q, k_pages, v_pages, *bad)
        with pytest.raises(ValueError) as replayed:
            attnkit.paged_attention_blocks(q, k_pages, v_pages, *bad)
    assert str(replayed.value) == str(full.value)


def test_a_bad_index_in_a_rows_padding_is_never_read_on_either_path(paged_specs):
    q, k_pages, v_pages, table, _ = _one_step()
    lens = torch.tensor([11, 8], dtype=torch.int32)
    with torch.no_grad():
        first = attnkit.paged_attention_blocks(q, k_pages, v_pages, table, lens)
        padded = table.clone()
        padded[1, 2] = 99  # row 1 holds 8 keys: its third page is padding
        k_pages[2] = float("nan")  # (the page that entry named before)
        again = attnkit.paged_attention_blocks(q, k_pages, v_pages, padded, lens)
        with replays_disabled():
            full = attnkit.paged_attention_blocks(q, k_pages, v_pages, padded, lens)
    assert torch.equal(again, full) and torch.equal(again, first)
    assert len(paged_specs) == 2  # the first call and the full-path twin


@pytest.mark.parametrize("what", ["lse", "alibi", "grad", "lists", "threads"])
def test_what_a_replay_cannot_vouch_for_takes_the_full_path(what, paged_specs):
    q, k_pages, v_pages, table, lens = _one_step()
    kw: dict = {}
    if what == "lse":
        kw["return_lse"] = True
    elif what == "alibi":
        kw["alibi_slopes"] = torch.rand(4)
    elif what == "grad":
        q = q.requires_grad_()
    elif what == "lists":
        table, lens = table.tolist(), lens.tolist()
    old = torch.get_num_threads()
    try:
        for i in range(3):
            if what == "threads":
                torch.set_num_threads(1 + i % 2)
            res = attnkit.paged_attention_blocks(q, k_pages, v_pages, table, lens, **kw)
            with replays_disabled():
                full = attnkit.paged_attention_blocks(q, k_pages, v_pages, table, lens, **kw)
            for a, b in zip(res if what == "lse" else (res,), full if what == "lse" else (full,)):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(old)
    # every call built its spec: none was replayed (with another thread count each step is
    # its own form: the third call replays the first)
    assert len(paged_specs) == (5 if what == "threads" else 6)
