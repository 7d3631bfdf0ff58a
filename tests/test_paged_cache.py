"""Tests for attnkit.paged: the paged KV cache bookkeeping and gather_kv."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from attnkit.paged import OutOfPagesError, PagedKVCache, UnknownSequenceError, gather_kv


class Oracle:
    """What the cache should hold: every sequence's appended tokens, concatenated."""

    def __init__(self, hkv, dk, dv, dtype=torch.float32):
        self.hkv, self.dk, self.dv, self.dtype = hkv, dk, dv, dtype
        self.k, self.v = {}, {}

    def tokens(self, T, gen):
        k = torch.randn(T, self.hkv, self.dk, generator=gen).to(self.dtype)
        v = torch.randn(T, self.hkv, self.dv, generator=gen).to(self.dtype)
        return k, v

    def append(self, cache, seq, k, v):
        cache.append(seq, k, v)
        self.k[seq] = torch.cat([self.k.get(seq, k[:0]), k])
        self.v[seq] = torch.cat([self.v.get(seq, v[:0]), v])

    def expected(self, seqs):
        """Dense zero-padded (B, Hkv, Lmax, D) keys and values."""
        L = max((self.k[s].shape[0] if s in self.k else 0 for s in seqs), default=0)
        k = torch.zeros(len(seqs), self.hkv, L, self.dk, dtype=self.dtype)
        v = torch.zeros(len(seqs), self.hkv, L, self.dv, dtype=self.dtype)
        for b, s in enumerate(seqs):
            if s in self.k:
                n = self.k[s].shape[0]
                k[b, :, :n] = self.k[s].transpose(0, 1)
                v[b, :, :n] = self.v[s].transpose(0, 1)
        return k, v


def assert_gather_matches(cache, oracle, seqs):
    k, v = cache.gather(seqs)
    ek, ev = oracle.expected(seqs)
    assert k.shape == ek.shape and v.shape == ev.shape
    assert torch.equal(k, ek) and torch.equal(v, ev)  # pure copies: bitwise equal
    assert k.is_contiguous() and v.is_contiguous()
    table, lens = cache.block_table(seqs)
    k2, v2 = gather_kv(cache.k_pages, cache.v_pages, table, lens)
    assert torch.equal(k2, ek) and torch.equal(v2, ev)


def snapshot(cache):
    return (cache.k_pages.clone(), cache.v_pages.clone(), cache.num_free_pages,
            {s: (cache.seq_len(s), cache.pages_of(s)) for s in cache.seq_ids}, repr(cache))


def assert_unchanged(cache, snap):
    k, v, free, seqs, r = snap
    assert torch.equal(cache.k_pages, k) and torch.equal(cache.v_pages, v)
    assert cache.num_free_pages == free
    assert {s: (cache.seq_len(s), cache.pages_of(s)) for s in cache.seq_ids} == seqs
    assert repr(cache) == r


def test_append_across_page_boundaries_then_gather():
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=3, head_dim=5)
    oracle = Oracle(3, 5, 5)
    cache.allocate("a")
    for T in [1, 3, 5, 9, 2, 4]:  # 1 | 3 (fills page 0) | 5 spans two pages | 9 spans three ...
        oracle.append(cache, "a", *oracle.tokens(T, gen))
        n = oracle.k["a"].shape[0]
        assert cache.seq_len("a") == n
        assert len(cache.pages_of("a")) == -(-n // 4)
        assert cache.num_free_pages == 8 - -(-n // 4)
        assert_gather_matches(cache, oracle, ["a"])
    # Token t sits at (page t // 4, slot t % 4) of the sequence's pages.
    pages = cache.pages_of("a")
    for t in [0, 3, 4, 13, 23]:
        assert torch.equal(cache.k_pages[pages[t // 4], t % 4], oracle.k["a"][t])


def test_interleaved_sequences_on_non_contiguous_pages():
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(num_pages=12, page_size=3, num_kv_heads=2, head_dim=4)
    oracle = Oracle(2, 4, 4)
    for s in ["a", "b", "c"]:
        cache.allocate(s)
    for s, T in [("a", 2), ("b", 4), ("a", 3), ("c", 1), ("b", 2), ("a", 4), ("c", 5)]:
        oracle.append(cache, s, *oracle.tokens(T, gen))
    cache.free("b")
    del oracle.k["b"], oracle.v["b"]
    cache.allocate("d")
    oracle.append(cache, "d", *oracle.tokens(7, gen))  # takes b's pages, then fresh ones
    oracle.append(cache, "a", *oracle.tokens(1, gen))
    for s in ["a", "c", "d"]:
        p = cache.pages_of(s)
        assert p != list(range(p[0], p[0] + len(p))), f"{s} should be scattered: {p}"
    all_pages = sum((cache.pages_of(s) for s in ["a", "c", "d"]), [])
    assert len(all_pages) == len(set(all_pages)) == 12 - cache.num_free_pages
    assert_gather_matches(cache, oracle, ["a", "c", "d"])
    assert_gather_matches(cache, oracle, ["d", "a"])  # any order, any subset
    assert_gather_matches(cache, oracle, ["c", "c"])  # repeated ids are allowed


def test_freed_pages_are_reused():
    gen = torch.Generator().manual_seed(2)
    cache = PagedKVCache(num_pages=6, page_size=2, num_kv_heads=1, head_dim=3)
    oracle = Oracle(1, 3, 3)
    cache.allocate(0)
    cache.allocate(1)
    oracle.append(cache, 0, *oracle.tokens(5, gen))  # 3 pages
    oracle.append(cache, 1, *oracle.tokens(6, gen))  # 3 pages
    assert cache.num_free_pages == 0
    freed = cache.pages_of(0)
    cache.free(0)
    assert cache.num_free_pages == 3 and 0 not in cache
    cache.allocate(2)
    oracle.append(cache, 2, *oracle.tokens(6, gen))
    assert sorted(cache.pages_of(2)) == sorted(freed)
    assert cache.pages_of(2) == freed  # freed pages come back in their old order
    assert cache.num_free_pages == 0
    assert_gather_matches(cache, oracle, [1, 2])
    cache.allocate(0)  # a freed id can be allocated again, empty
    assert cache.seq_len(0) == 0 and cache.pages_of(0) == []


def test_out_of_pages_is_clear_and_leaves_state_unchanged():
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(num_pages=4, page_size=4, num_kv_heads=2, head_dim=2)
    oracle = Oracle(2, 2, 2)
    cache.allocate("a")
    cache.allocate("b")
    oracle.append(cache, "a", *oracle.tokens(6, gen))  # 2 pages, 2 free slots left
    snap = snapshot(cache)
    with pytest.raises(OutOfPagesError, match=r"needs 3 more pages but only 2 of 4 are free") as e:
        cache.append("a", *oracle.tokens(11, gen))
    assert isinstance(e.value, ValueError)
    assert "num_pages >= 5" in str(e.value) and "free finished sequences" in str(e.value)
    assert_unchanged(cache, snap)
    with pytest.raises(OutOfPagesError):
        cache.append("b", *oracle.tokens(9, gen))
    assert_unchanged(cache, snap)
    oracle.append(cache, "a", *oracle.tokens(2, gen))  # still fits in a's last page
    oracle.append(cache, "b", *oracle.tokens(8, gen))  # exactly the two free pages
    assert cache.num_free_pages == 0
    assert_gather_matches(cache, oracle, ["a", "b"])


def test_bad_calls_raise_and_leave_state_unchanged():
    cache = PagedKVCache(num_pages=4, page_size=2, num_kv_heads=2, head_dim=3, v_head_dim=5)
    cache.allocate("a")
    cache.append("a", torch.ones(3, 2, 3), torch.ones(3, 2, 5))
    snap = snapshot(cache)
    k, v = torch.zeros(1, 2, 3), torch.zeros(1, 2, 5)
    for call in [lambda: cache.append("zz", k, v), lambda: cache.free("zz"),
                 lambda: cache.seq_len("zz"), lambda: cache.pages_of("zz"),
                 lambda: cache.block_table(["a", "zz"]), lambda: cache.gather(["zz"])]:
        with pytest.raises(UnknownSequenceError, match=r"unknown sequence 'zz'; call allocate"):
            call()
    with pytest.raises(KeyError):  # UnknownSequenceError is a KeyError
        cache.seq_len("zz")
    with pytest.raises(ValueError, match="'a' is already allocated"):
        cache.allocate("a")
    with pytest.raises(ValueError, match=r"k must have shape \(T, num_kv_heads=2, 3\)"):
        cache.append("a", torch.zeros(1, 3, 3), v)  # wrong number of heads
    with pytest.raises(ValueError, match=r"v must have shape \(T, num_kv_heads=2, 5\)"):
        cache.append("a", k, torch.zeros(1, 2, 3))  # value head dim is 5, not 3
    with pytest.raises(ValueError, match=r"token-major"):
        cache.append("a", torch.zeros(2, 3), v)
    with pytest.raises(ValueError, match="k has 2 tokens but v has 1"):
        cache.append("a", torch.zeros(2, 2, 3), v)
    with pytest.raises(TypeError, match=r"k has dtype torch.float64 .* stores torch.float32"):
        cache.append("a", k.double(), v)
    with pytest.raises(TypeError, match="seq_ids must be a sequence"):
        cache.block_table("a")
    with pytest.raises(TypeError, match="hashable"):
        cache.allocate(["x"])
    assert_unchanged(cache, snap)
    cache.free("a")
    with pytest.raises(UnknownSequenceError):
        cache.free("a")  # freeing twice


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_pages=0), ValueError, "num_pages must be >= 1"),
    (dict(page_size=-1), ValueError, "page_size must be >= 1"),
    (dict(num_kv_heads=2.0), TypeError, "num_kv_heads must be an int"),
    (dict(v_head_dim=0), ValueError, "v_head_dim must be >= 1"),
    (dict(dtype=torch.int32), TypeError, "floating"),
])
def test_constructor_validation(kwargs, exc, match):
    args = {**dict(num_pages=2, page_size=2, num_kv_heads=1, head_dim=4), **kwargs}
    with pytest.raises(exc, match=match):
        PagedKVCache(**args)


def test_block_table_contents():
    cache = PagedKVCache(num_pages=10, page_size=4, num_kv_heads=1, head_dim=2)
    for s in ["x", "y", "z", "empty"]:
        cache.allocate(s)
    tok = torch.zeros(1, 1, 2)
    # Interleave single-token appends so page order differs from sequence order.
    for s in ["x", "y", "x", "x", "x", "x", "z", "y"]:  # x: 5 tokens, y: 2, z: 1
        cache.append(s, tok, tok)
    assert cache.pages_of("x") == [0, 2] and cache.pages_of("y") == [1]
    assert cache.pages_of("z") == [3] and cache.pages_of("empty") == []
    table, lens = cache.block_table(["y", "x", "empty", "z"])
    assert table.dtype == torch.int32 and lens.dtype == torch.int32
    assert table.tolist() == [[1, 0], [0, 2], [0, 0], [3, 0]]  # padded with 0
    assert lens.tolist() == [2, 5, 0, 1]
    table, lens = cache.block_table(["empty"])
    assert table.shape == (1, 0) and lens.tolist() == [0]
    table, lens = cache.block_table([])
    assert table.shape == (0, 0) and lens.shape == (0,)
    k, v = cache.gather(["empty"])
    assert k.shape == (1, 1, 0, 2) and v.shape == (1, 1, 0, 2)


def test_v_head_dim_differs_from_head_dim():
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(num_pages=5, page_size=3, num_kv_heads=2, head_dim=7, v_head_dim=3)
    assert cache.k_pages.shape == (5, 3, 2, 7) and cache.v_pages.shape == (5, 3, 2, 3)
    oracle = Oracle(2, 7, 3)
    cache.allocate("s")
    cache.allocate("t")
    oracle.append(cache, "s", *oracle.tokens(4, gen))
    oracle.append(cache, "t", *oracle.tokens(8, gen))
    oracle.append(cache, "s", *oracle.tokens(2, gen))
    assert_gather_matches(cache, oracle, ["s", "t"])
    k, v = cache.gather(["s", "t"])
    assert k.shape == (2, 2, 8, 7) and v.shape == (2, 2, 8, 3)


def test_bfloat16_is_stored_bitwise():
    gen = torch.Generator().manual_seed(5)
    cache = PagedKVCache(num_pages=6, page_size=4, num_kv_heads=2, head_dim=8,
                         dtype=torch.bfloat16)
    assert cache.k_pages.dtype == torch.bfloat16 and cache.v_pages.dtype == torch.bfloat16
    oracle = Oracle(2, 8, 8, dtype=torch.bfloat16)
    cache.allocate(7)
    oracle.append(cache, 7, *oracle.tokens(9, gen))
    k, v = cache.gather([7])
    assert k.dtype == torch.bfloat16
    assert_gather_matches(cache, oracle, [7])
    with pytest.raises(TypeError, match="bfloat16"):
        cache.append(7, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))


def test_random_workload_matches_oracle():
    rnd = random.Random(6)
    gen = torch.Generator().manual_seed(6)
    cache = PagedKVCache(num_pages=24, page_size=5, num_kv_heads=2, head_dim=3, v_head_dim=4)
    oracle = Oracle(2, 3, 4)
    live, failures = [], 0
    for step in range(120):
        action = rnd.random()
        if action < 0.15 or not live:
            cache.allocate(step)
            live.append(step)
        elif action < 0.3:
            s = live.pop(rnd.randrange(len(live)))
            cache.free(s)
            oracle.k.pop(s, None)
            oracle.v.pop(s, None)
        else:
            s = rnd.choice(live)
            k, v = oracle.tokens(rnd.randint(1, 12), gen)
            try:
                oracle.append(cache, s, k, v)
            except OutOfPagesError:
                failures += 1
                snap = snapshot(cache)
                with pytest.raises(OutOfPagesError):
                    cache.append(s, k, v)
                assert_unchanged(cache, snap)
        used = sum(len(cache.pages_of(s)) for s in live)
        assert used + cache.num_free_pages == 24
        if step % 10 == 0 and live:
            assert_gather_matches(cache, oracle, rnd.sample(live, min(4, len(live))))
    assert failures > 0  # the workload does run out of pages


def test_append_edge_cases():
    cache = PagedKVCache(num_pages=2, page_size=2, num_kv_heads=1, head_dim=1)
    cache.allocate("a")
    cache.append("a", torch.zeros(0, 1, 1), torch.zeros(0, 1, 1))  # no tokens: no pages
    assert cache.seq_len("a") == 0 and cache.num_free_pages == 2
    k = torch.ones(3, 1, 1, requires_grad=True)
    cache.append("a", k * 2, k * 3)
    assert not cache.k_pages.requires_grad and cache.k_pages.grad_fn is None
    assert cache.k_pages.flatten()[:3].tolist() == [2.0, 2.0, 2.0]


def test_gather_kv_validation_and_padding():
    N, P, H, D = 4, 2, 1, 2
    kp = torch.arange(N * P * H * D, dtype=torch.float32).view(N, P, H, D)
    vp = -kp
    table = torch.tensor([[3, -1], [1, 0]], dtype=torch.int32)  # -1 padding is ignored
    lens = torch.tensor([1, 3], dtype=torch.int32)
    k, v = gather_kv(kp, vp, table, lens)
    assert k.shape == (2, 1, 3, 2)
    assert torch.equal(k[0, 0], torch.stack([kp[3, 0, 0], torch.zeros(2), torch.zeros(2)]))
    assert torch.equal(k[1, 0], torch.stack([kp[1, 0, 0], kp[1, 1, 0], kp[0, 0, 0]]))
    assert torch.equal(v, -k)
    k5, _ = gather_kv(kp, vp, table, lens, max_seqlen=5)  # wider padding on request
    assert k5.shape == (2, 1, 5, 2) and torch.equal(k5[..., :3, :], k)
    assert not k5[..., 3:, :].any()
    # NaN garbage in pages past the lengths never leaks into the output.
    kn = kp.clone()
    kn[3, 1] = float("nan")
    kn[2] = float("nan")
    assert torch.equal(gather_kv(kn, vp, table, lens)[0], k)

    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 4 is not a page index"):
        gather_kv(kp, vp, torch.tensor([[3, 0], [1, 4]]), lens)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = -1"):
        gather_kv(kp, vp, torch.tensor([[-1, 0], [1, 0]]), lens)
    with pytest.raises(ValueError, match="seqlens must lie in"):
        gather_kv(kp, vp, table, torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="seqlens must lie in"):
        gather_kv(kp, vp, table, torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="2 rows but seqlens has 3"):
        gather_kv(kp, vp, table, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="max_seqlen=2 is shorter"):
        gather_kv(kp, vp, table, lens, max_seqlen=2)
    with pytest.raises(TypeError, match="integer dtype"):
        gather_kv(kp, vp, table.float(), lens)
    with pytest.raises(ValueError, match="must agree"):
        gather_kv(kp, vp[:, :1], table, lens)
    with pytest.raises(ValueError, match="4-D"):
        gather_kv(kp[0], vp, table, lens)



@pytest.mark.parametrize("table, lens, message", [
    ([[3, 0], [1, 4]], [3, 4], r"block_table\[1, 1\] = 4 is not a page index in \[0, 4\) but "
                               r"sequence 1 \(length 4\) uses it for tokens 2..3"),
    ([[-1, 0], [1, 0]], [1, 1], r"block_table\[0, 0\] = -1 .* tokens 0..0"),
    ([[0, 9], [1, 9]], [2, 2], None),  # column 1 is padding: no sequence uses it
    ([[0, 1], [2, 3]], [5, 1], r"seqlens must lie in \[0, max_pages \* page_size\] = \[0, 4\], "
                               r"got values in \[1, 5\]"),
    ([[0, 1], [2, 3]], [-1, 1], r"got values in \[-1, 1\]"),
])
def test_page_checks_read_the_same_on_the_host_and_in_torch(table, lens, message):
    """The page checks run on numpy arrays for host tensors and on torch tensors elsewhere:
    both forms pass and refuse the same tables with the same words (the torch form is run
    here on CPU tensors, as another device would run it)."""
    from attnkit.kv.pages import _check_rows

    t = torch.tensor(table, dtype=torch.int32)
    n = torch.tensor(lens, dtype=torch.int64)
    forms = {"numpy": (t.numpy(), n.numpy(), np.arange(t.shape[1])),
             "torch": (t, n, torch.arange(t.shape[1]))}
    for form, (tab, ln, cols) in forms.items():
        if message is None:
            assert _check_rows(tab, ln, cols, 4, 2) is None, form
        else:
            with pytest.raises(ValueError, match=message):
                _check_rows(tab, ln, cols, 4, 2)

def test_repr_and_to_string():
    cache = PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=3,
                         dtype=torch.bfloat16)
    cache.allocate("a")
    cache.append("a", torch.zeros(3, 1, 3, dtype=torch.bfloat16),
                 torch.zeros(3, 1, 3, dtype=torch.bfloat16))
    r = repr(cache)
    for part in ["num_pages=4", "page_size=2", "head_dim=3", "v_head_dim=3", "torch.bfloat16",
                 "sequences=1", "tokens=3", "free_pages=2"]:
        assert part in r, part
    s = cache.to_string()
    assert "'a': 3 tokens on pages [0, 1]" in s and "page owners: 0 0 . ." in s
