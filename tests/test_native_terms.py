"""The native ALiBi tile (attnkit/native/terms.c) against the torch ops it replaces in
:func:`attnkit.score_terms.alibi_term`: the same bits in every dtype, with broadcast batch
rows, per-row slopes, gathered key positions and visibility; what it does not take falls back."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import native, score_mods
from attnkit.reference import attention_reference

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native kernel unavailable: {native.unavailable_reason()}")


def _torch_tile(ip, j, slopes, vis, dtype):
    """alibi_term's torch ops, verbatim."""
    dist = (ip - j.view(1, 1, 1, -1)).abs_().to(dtype)
    if vis is not None:
        dist = torch.where(vis, dist, torch.full((), float("inf"), dtype=dtype))
    return dist * slopes.to(dtype).neg()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["broadcast", "per_row", "gathered"])
def test_alibi_tile_is_the_torch_ops_bit_for_bit(dtype, case):
    """Positions far enough apart that bfloat16 rounds the distances, 37 keys (a 16-lane
    tail), visibility with holes: the tile equals the torch ops' bit for bit, -inf exactly
    where hidden."""
    g = torch.Generator().manual_seed(7)
    rows, heads, keys = 5, 3, 37
    n = 1 if case == "broadcast" else 2
    ip = (torch.arange(rows).view(1, 1, rows, 1) + torch.tensor([900, 3000])[:n].view(n, 1, 1, 1))
    if case == "gathered":
        j = torch.randperm(4000, generator=g)[:keys].sort().values
    else:
        j = torch.arange(850, 850 + keys)
    slopes = score_mods.alibi_slopes(heads).view(1, heads, 1, 1)
    if case == "per_row":
        slopes = torch.rand(n, heads, rows, 1, generator=g) + 0.01
    if dtype == torch.float16:
        slopes = slopes / 8  # (|products| below float16's largest)
    vis = torch.rand(n, 1, rows, keys, generator=g) > 0.3
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for v in (vis, None):
        want = _torch_tile(ip, j, slopes, v, dtype)
        got = native.alibi_tile(ip, j, slopes, v, dtype)
        assert got is not None and got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got.view(bits), want.view(bits))
        hidden = (~vis).expand_as(got) if v is not None else torch.zeros_like(got, dtype=torch.bool)
        assert torch.equal(got == float("-inf"), hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("band", [(None, 0), (7, 0), (20, -3), (None, None)])
def test_alibi_tile_band_columns_are_the_visibility_tile(dtype, band):
    """A band on contiguous keys given as each row's visible columns [a, e) (unclipped: the
    kernel clips them to the keys; rows that see nothing) is the tile of the same band's bool
    visibility, bit for bit; also with slopes so small that the products are subnormal
    (bfloat16's conversion instruction flushes those: that tile rounds the other way)."""
    left, right = band
    rows, heads, keys = 7, 3, 53
    ip = torch.tensor([-30, -5, 0, 10, 30, 52, 80]).view(1, 1, rows, 1) + 100
    j = torch.arange(100, 100 + keys)
    c = ip - 100  # the rows' positions in columns of j
    a = c - left if left is not None else torch.full_like(c, -(1 << 40))
    e = c + right + 1 if right is not None else torch.full_like(c, 1 << 40)
    vis = (torch.arange(keys) >= a) & (torch.arange(keys) < e)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    small = [4e-38] if dtype == torch.bfloat16 else []  # (each slope still > 0 in bfloat16)
    for scale in [1.0 / 8 if dtype == torch.float16 else 1.0] + small:
        slopes = score_mods.alibi_slopes(heads).view(1, heads, 1, 1) * scale
        want = _torch_tile(ip, j, slopes, vis, dtype)
        got = native.alibi_tile(ip, j, slopes, None, dtype, cols=(a, e))
        assert got is not None and torch.equal(got.view(bits), want.view(bits))
        both = native.alibi_tile(ip, j, slopes, torch.rand(1, 1, rows, keys) > 0.5, dtype,
                                 cols=(a, e))
        assert torch.equal(both == float("-inf"), (both == float("-inf")) | ~vis)


def test_alibi_tile_declines_what_it_does_not_take():
    """Slopes that need a gradient, float64 slopes with a 16-bit tile, positions at 2^24 and
    beyond, a per-head visibility: None (the caller runs the torch ops)."""
    ip = torch.arange(4).view(1, 1, 4, 1)
    j = torch.arange(8)
    s = score_mods.alibi_slopes(2).view(1, 2, 1, 1)
    assert native.alibi_tile(ip, j, s, None, torch.bfloat16) is not None
    with torch.enable_grad():
        assert native.alibi_tile(ip, j, s.clone().requires_grad_(True), None, torch.float32) is None
    assert native.alibi_tile(ip, j, s.double(), None, torch.bfloat16) is None
    assert native.alibi_tile(ip + (1 << 24), j, s, None, torch.float32) is None
    assert native.alibi_tile(ip, j, s, torch.ones(1, 2, 4, 8, dtype=torch.bool),
                             torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_attention_is_unchanged_by_the_native_tile(dtype, monkeypatch):
    """attention() with ALiBi (causal, and a window) gives the same bits with the native tile
    as with the torch ops, and the oracle's result (bfloat16 calls like these are folded
    into q and k instead: here they take the tiles)."""
    from attnkit.backends import fused_schedule

    monkeypatch.setattr(fused_schedule, "alibi_foldable", lambda spec: False)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 32, generator=g).to(dtype) for _ in range(3))
    sl = score_mods.alibi_slopes(4)
    tiles = []
    real = native.alibi_tile

    def counted(*a, **kw):
        tile = real(*a, **kw)
        tiles.append(tile is not None)
        return tile

    for kw in (dict(causal=True), dict(causal=True, window=(64, 0))):
        tiles.clear()
        with monkeypatch.context() as m:
            m.setattr(native, "alibi_tile", counted)
            fast = attnkit.attention(q, k, v, alibi_slopes=sl, backend="fused", **kw)
        assert tiles and all(tiles)  # (the native tile built every one)
        with monkeypatch.context() as m:
            m.setattr(native, "alibi_tile", lambda *a, **k: None)
            slow = attnkit.attention(q, k, v, alibi_slopes=sl, backend="fused", **kw)
        assert torch.equal(fast, slow)
        ref = attention_reference(q.double(), k.double(), v.double(), alibi_slopes=sl, **kw)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        assert (fast.double() - ref).abs().max().item() < tol
