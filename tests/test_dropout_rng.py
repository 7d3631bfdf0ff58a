"""Tests for attnkit.dropout: Philox-4x32-10 counters for replayable attention dropout."""

from __future__ import annotations

import math
import random

import pytest
import torch

from attnkit import dropout as D
from attnkit import native
from attnkit.dropout import draw_seed, dropout_multiplier, keep_mask, philox_uniform

MASK = 0xFFFFFFFF


def philox4x32_ref(ctr, key, rounds=10):
    """Plain-Python Philox-4x32 (Random123's philox4x32_R), short enough to check by eye."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c3 ^ k1) & MASK, \
            p0 & MASK
    return c0, c1, c2, c3


def uniform_ref(seed, offset, b, h, i, j):
    """The documented layout: key column j takes word (j // 16) % 4 of the call with counter
    (16 * (j // 64) + j % 16, i, h + b * 2**16, offset) and key (seed lo, seed hi)."""
    words = philox4x32_ref((16 * (j // 64) + j % 16, i, h + (b << 16), offset),
                           (seed & MASK, seed >> 32))
    return (words[(j // 16) % 4] >> 8) * 2.0**-24


def test_a_philox_call_serves_four_keys_and_every_key_has_its_own_word():
    # Keys 64 q + 16 w + n (n < 16) share the call of counter 16 q + n and take its word w, so
    # no two keys of a row share a word and every word of every call is used.
    used = {}
    for j in range(1024):
        used.setdefault((16 * (j // 64) + j % 16, (j // 16) % 4), []).append(j)
    assert all(len(js) == 1 for js in used.values())
    assert sorted(used) == [(c, w) for c in range(256) for w in range(4)]
    seed, offset = 0x0123456789ABCDEF, 3
    u = philox_uniform(seed, offset, 1, 2, 5, torch.arange(128))
    call = philox4x32_ref((16 + 7, 5, 2 + (1 << 16), offset), (seed & MASK, seed >> 32))
    assert [u[64 + 16 * w + 7].item() for w in range(4)] == [(x >> 8) * 2.0**-24 for x in call]


def grid(B, H, Lq, Lk, i0=0, j0=0):
    """Broadcastable (b, h, i, j) index tensors of a (B, H, Lq, Lk) grid."""
    return (torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1),
            torch.arange(i0, i0 + Lq).view(1, 1, -1, 1),
            torch.arange(j0, j0 + Lk).view(1, 1, 1, -1))


@pytest.fixture(params=["native", "wrapping_mul", "split_mul"])
def mul_path(request, fresh_native):
    """Run a test through the native kernel and both 32x32->64 multiply implementations of
    the torch-op path (the native kernel is switched off for those)."""
    if request.param == "native":
        if not native.available():
            pytest.skip(f"native kernel: {native.unavailable_reason()}")
    else:
        fresh_native.setenv("ATTNKIT_NATIVE", "0")
        fresh_native.setattr(D, "_WRAPPING_MUL", {"cpu": request.param == "wrapping_mul"})
    return request.param


def test_reference_reproduces_random123_known_answers():
    # Known-answer vectors of Philox-4x32-10 from Random123's kat_vectors.
    assert philox4x32_ref((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32_ref((MASK,) * 4, (MASK, MASK)) == (
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32_ref((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
                          (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_wrapping_multiply_self_check_on_cpu():
    D._WRAPPING_MUL.pop("cpu", None)
    assert D._wrapping_mul_ok(torch.device("cpu")) is True  # torch CPU int64 mul wraps


def test_matches_python_reference(mul_path):
    rng = random.Random(1234)
    n = 300
    coords = [(rng.randrange(2**16), rng.randrange(2**16), rng.randrange(2**32),
               rng.randrange(2**32)) for _ in range(n - 4)]
    coords += [(0, 0, 0, 0), (2**16 - 1, 2**16 - 1, 2**32 - 1, 2**32 - 1), (1, 0, 0, 0),
               (0, 1, 0, 0)]
    b, h, i, j = (torch.tensor(c, dtype=torch.int64) for c in zip(*coords))
    for seed, offset in [(0, 0), (2**64 - 1, 2**32 - 1), (0x0123456789ABCDEF, 77)]:
        got = philox_uniform(seed, offset, b, h, i, j)
        want = torch.tensor([uniform_ref(seed, offset, *c) for c in coords], dtype=torch.float32)
        assert got.dtype == torch.float32
        assert torch.equal(got, want), (seed, offset)


def test_broadcast_grid_matches_reference(mul_path):
    seed, offset = 987654321987654321, 5
    u = philox_uniform(seed, offset, *grid(2, 3, 5, 7, i0=1000, j0=2**31))
    assert u.shape == (2, 3, 5, 7)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 6), (1, 0, 3, 2), (0, 2, 1, 5)]:
        assert u[b, h, i, j].item() == uniform_ref(seed, offset, b, h, 1000 + i, 2**31 + j)


def test_int_and_zero_dim_indices():
    seed = 42
    u = philox_uniform(seed, 3, 1, 2, torch.tensor(5), torch.arange(4))
    assert u.shape == (4,)
    assert u.tolist() == [uniform_ref(seed, 3, 1, 2, 5, j) for j in range(4)]
    assert philox_uniform(seed, 3, 1, 2, 5, 6).shape == ()
    assert philox_uniform(seed, 3, 0, 0, torch.arange(0).view(-1, 1), torch.arange(9)).shape == (
        0, 9)


def test_bitwise_independent_of_tiling(mul_path, monkeypatch):
    seed, offset = draw_seed(), 11
    H, Lq, Lk = 8, 300, 500
    h = torch.arange(H).view(-1, 1, 1)
    i = torch.arange(Lq).view(1, -1, 1)
    j = torch.arange(Lk).view(1, 1, -1)
    full = philox_uniform(seed, offset, 3, h, i, j)
    tiled = torch.full_like(full, float("nan"))
    for h0 in range(0, H, 3):
        for i0 in range(0, Lq, 37):
            for j0 in range(0, Lk, 61):
                tiled[h0:h0 + 3, i0:i0 + 37, j0:j0 + 61] = philox_uniform(
                    seed, offset, 3, h[h0:h0 + 3], i[:, i0:i0 + 37], j[..., j0:j0 + 61])
    assert torch.equal(full, tiled)
    # A different internal chunking, full-size index tensors and a flat layout agree too.
    monkeypatch.setattr(D, "_CPU_CHUNK", 1001)
    hb, ib, jb = torch.broadcast_tensors(h, i, j)
    assert torch.equal(philox_uniform(seed, offset, 3, hb, ib, jb), full)
    flat = philox_uniform(seed, offset, 3, hb.flatten(), ib.flatten(), jb.flatten())
    assert torch.equal(flat.view(H, Lq, Lk), full)


def test_deterministic_and_sensitive_to_every_input():
    b, h, i, j = grid(2, 2, 64, 64)
    base = philox_uniform(7, 0, b, h, i, j)
    assert torch.equal(base, philox_uniform(7, 0, b, h, i, j))
    variants = {
        "seed": philox_uniform(8, 0, b, h, i, j),
        "seed high word": philox_uniform(7 + 2**32, 0, b, h, i, j),
        "offset": philox_uniform(7, 1, b, h, i, j),
    }
    for name, other in variants.items():
        assert (other == base).float().mean() < 0.01, name
    # Every (b, h) slice, every row and every column is its own stream (no aliasing of words,
    # e.g. b and h swapped, or offset 1 equal to batch 1).
    flat = base.reshape(4, -1)
    for x in range(4):
        for y in range(x + 1, 4):
            assert (flat[x] == flat[y]).float().mean() < 0.01
    assert (base[..., 1:, :] == base[..., :-1, :]).float().mean() < 0.01
    assert (base[..., 1:] == base[..., :-1]).float().mean() < 0.01
    b1 = philox_uniform(7, 0, 1, 0, i, j)
    off1 = philox_uniform(7, 1, 0, 0, i, j)
    assert (b1 == off1).float().mean() < 0.01


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction(p):
    keep = keep_mask(draw_seed(), 0, p, 0, 0, torch.arange(2048).view(-1, 1), torch.arange(2048))
    assert keep.dtype == torch.bool and keep.shape == (2048, 2048)
    assert keep.float().mean().item() == pytest.approx(1 - p, rel=0.01)


def test_uniform_statistics():
    torch.manual_seed(0)
    u = philox_uniform(draw_seed(), 0, 0, torch.arange(4).view(-1, 1, 1),
                       torch.arange(256).view(-1, 1), torch.arange(1024)).double()
    n = u.numel()
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    assert torch.equal(u * 2**24, torch.round(u * 2**24))  # on the 2**-24 grid
    assert abs(u.mean().item() - 0.5) < 5 / math.sqrt(12 * n)
    assert abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.histc(u, bins=32, min=0.0, max=1.0)
    chi2 = ((counts - n / 32) ** 2 / (n / 32)).sum().item()
    assert chi2 < 80  # 31 degrees of freedom: P(chi2 > 80) < 1e-5

    def corr(a, b):
        return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()

    assert abs(corr(u[..., 1:], u[..., :-1])) < 0.01  # neighbouring key columns
    assert abs(corr(u[:, 1:], u[:, :-1])) < 0.01  # neighbouring query rows
    assert abs(corr(u[1:], u[:-1])) < 0.01  # neighbouring heads


def test_keep_mask_is_exact_uniform_threshold():
    b, h, i, j = grid(1, 2, 100, 100)
    u = philox_uniform(99, 4, b, h, i, j).double()
    on_grid = u.flatten()[17].item()  # a p that some uniform equals exactly: that weight is kept
    for p in [0.25, 0.3, on_grid, math.nextafter(on_grid, 1.0)]:
        keep = keep_mask(99, 4, p, b, h, i, j)
        assert torch.equal(keep, u >= p), p
    assert keep_mask(99, 4, on_grid, b, h, i, j).flatten()[17]
    assert not keep_mask(99, 4, math.nextafter(on_grid, 1.0), b, h, i, j).flatten()[17]


def test_p_zero_keeps_everything():
    b, h, i, j = grid(2, 3, 17, 29)
    assert keep_mask(1, 0, 0.0, b, h, i, j).all()
    m = dropout_multiplier(1, 0, 0.0, b, h, i, j)
    assert m.shape == (2, 3, 17, 29) and torch.equal(m, torch.ones_like(m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dropout_multiplier(dtype):
    b, h, i, j = grid(2, 2, 33, 47)
    p = 0.3
    m = dropout_multiplier(5, 2, p, b, h, i, j, dtype=dtype)
    keep = keep_mask(5, 2, p, b, h, i, j)
    assert m.dtype == dtype
    assert torch.equal(m, torch.where(keep, torch.tensor(1 / (1 - p), dtype=dtype),
                                      torch.tensor(0.0, dtype=dtype)))
    assert set(m.unique().tolist()) == {0.0, torch.tensor(1 / (1 - p), dtype=dtype).item()}


def test_draw_seed_follows_manual_seed():
    torch.manual_seed(123)
    a = [draw_seed() for _ in range(3)]
    torch.manual_seed(123)
    assert [draw_seed() for _ in range(3)] == a
    assert len(set(a)) == 3 and all(isinstance(s, int) and 0 <= s < 2**63 for s in a)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert draw_seed(g1) == draw_seed(g2)
    with pytest.raises(TypeError, match="generator"):
        draw_seed(5)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_bad_dropout_p(p):
    with pytest.raises(ValueError, match="dropout_p"):
        keep_mask(1, 0, p, 0, 0, 0, torch.arange(3))
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_multiplier(1, 0, p, 0, 0, 0, torch.arange(3))


def test_bad_seed_offset_and_indices():
    j = torch.arange(3)
    with pytest.raises(ValueError, match="seed"):
        philox_uniform(-1, 0, 0, 0, 0, j)
    with pytest.raises(ValueError, match="seed"):
        philox_uniform(2**64, 0, 0, 0, 0, j)
    with pytest.raises(TypeError, match="seed"):
        philox_uniform(1.0, 0, 0, 0, 0, j)
    with pytest.raises(ValueError, match="offset"):
        philox_uniform(1, 2**32, 0, 0, 0, j)
    with pytest.raises(TypeError, match="integer dtype"):
        philox_uniform(1, 0, 0, 0, 0, j.float())
    with pytest.raises(ValueError, match=r"h indices must lie in \[0, 2\*\*16\)"):
        philox_uniform(1, 0, 0, torch.tensor([2**16]), 0, j)
    with pytest.raises(ValueError, match="b indices"):
        philox_uniform(1, 0, torch.tensor([-1]), 0, 0, j)
    with pytest.raises(ValueError, match="j indices"):
        philox_uniform(1, 0, 0, 0, 0, torch.tensor([2**32]))
    with pytest.raises(ValueError, match="broadcast"):
        philox_uniform(1, 0, 0, 0, torch.arange(4), j)
    with pytest.raises(TypeError, match="dtype"):
        dropout_multiplier(1, 0, 0.5, 0, 0, 0, j, dtype=torch.int32)


@pytest.mark.skipif(not native.available(), reason="native kernel unavailable")
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_native_and_torch_paths_agree_bit_for_bit(p, fresh_native):
    """Masks and uniforms over a 4-D grid with broadcast, strided and transposed index tensors,
    a row length that is not a multiple of the kernel's block, 64-bit seeds."""
    b = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(1, 4).view(1, 3, 1, 1)
    i = torch.arange(5, 70).view(1, 1, 65, 1)
    j = torch.arange(0, 2 * 301, 2).view(1, 1, 1, 301)
    jt = torch.arange(999, 999 - 301, -1).view(1, 1, 301, 1)
    cases = [lambda s, o: keep_mask(s, o, p, b, h, i, j),
             lambda s, o: philox_uniform(s, o, b, h, i, j),
             lambda s, o: keep_mask(s, o, p, b, h, i.view(1, 1, 1, 65), jt),
             lambda s, o: keep_mask(s, o, p, 1, 2, torch.arange(7).view(7, 1),
                                    torch.arange(18).view(1, 18)[:, ::2])]
    seeds = [(0, 0), (2**64 - 1, 2**32 - 1), (0x0123456789ABCDEF, 77)]
    fast = [f(s, o) for s, o in seeds for f in cases]
    fresh_native.setenv("ATTNKIT_NATIVE", "0")
    native._reset()
    slow = [f(s, o) for s, o in seeds for f in cases]
    for a, c in zip(fast, slow):
        assert a.dtype == c.dtype and torch.equal(a, c)
