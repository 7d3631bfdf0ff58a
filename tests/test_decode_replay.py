"""Decoding steps replayed: a call the decode executor ran is remembered by its form (query
shape/strides/dtype, options, key/value heads and dims), and the next steps of a decoding loop
(one more cached key each) run straight on the native kernel. Each replayed step must equal
the float64 oracle and the full path; everything a replay cannot vouch for (gradients,
autocast, transforms, another thread count, a kernel refusal, an unloaded kernel) takes the
full path."""

from __future__ import annotations

import pytest
import torch
from conftest import check_oracle, rand

import attnkit
from attnkit import api, native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernel unavailable")


def _cache(dtype, lk, gen, b=2, hkv=2, d=64, transposed=False):
    """k, v (B, Hkv, Lk, D); ``transposed``: a view of a token-major (B, Lk, Hkv, D) buffer."""
    if transposed:
        k = rand(b, lk, hkv, d, gen=gen, dtype=dtype).transpose(1, 2)
        v = rand(b, lk, hkv, d, gen=gen, dtype=dtype).transpose(1, 2)
        return k, v
    return rand(b, hkv, lk, d, gen=gen, dtype=dtype), rand(b, hkv, lk, d, gen=gen, dtype=dtype)


STEPS = [
    dict(causal=True, diagonal="bottom_right"),
    dict(window=(6, 0), diagonal="bottom_right"),  # clamped at the first (short) steps
    dict(causal=True, diagonal="bottom_right", softcap=5.0, scale=0.3),
    dict(causal=True, diagonal="top_left"),
    dict(),
]


@pytest.mark.parametrize("kw", STEPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoding_loop_is_replayed_and_every_step_matches_the_oracle(kw, dtype,
                                                                       specs_built):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for step, lk in enumerate(range(3, 20)):
            q = rand(2, 8, 1, 64, gen=g, dtype=dtype)
            k, v = _cache(dtype, lk, g, transposed=step % 2 == 1)  # strides change too
            out = attnkit.attention(q, k, v, **kw)
            assert out.dtype == dtype and out.shape == (2, 8, 1, 64) and out.is_contiguous()
            check_oracle(out, q, k, v, kw, dtype)
    assert len(specs_built) == 1  # the first step only


@pytest.mark.parametrize("pad", ["seqlens_kv", "starts_kv"])
def test_padded_steps_are_replayed_with_their_lengths(pad, specs_built):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lk in range(5, 15):
            q = rand(2, 8, 2, 64, gen=g, dtype=torch.float32)
            k, v = _cache(torch.float32, lk, g)
            lengths = torch.tensor([lk, lk - 3]) if pad == "seqlens_kv" else torch.tensor([0, 3])
            kw = {"causal": True, "diagonal": "bottom_right", pad: lengths}
            check_oracle(attnkit.attention(q, k, v, **kw), q, k, v, kw, torch.float32)
    assert len(specs_built) == 1


def test_replayed_steps_equal_the_full_path_bit_for_bit(monkeypatch):
    g = torch.Generator().manual_seed(2)
    monkeypatch.setattr(api, "_REPLAYS", {})
    q = rand(2, 8, 1, 64, gen=g, dtype=torch.float32)
    with torch.no_grad():
        for lk in (40, 41, 42):
            k, v = _cache(torch.float32, lk, g)
            kw = dict(window=(16, 0), diagonal="bottom_right")
            replayed = attnkit.attention(q, k, v, **kw)
            full = attnkit.attention(q, k, v, return_lse=True, **kw)[0]  # (never replayed)
            assert torch.equal(replayed, full)


def test_what_a_replay_cannot_vouch_for_takes_the_full_path(specs_built):
    g = torch.Generator().manual_seed(3)
    q = rand(2, 8, 1, 64, gen=g, dtype=torch.float32)
    k, v = _cache(torch.float32, 30, g)
    with torch.no_grad():
        attnkit.attention(q, k, v, causal=True)
    assert len(specs_built) == 1
    qg = q.clone().requires_grad_(True)
    out = attnkit.attention(qg, k, v, causal=True)  # gradients wanted
    out.sum().backward()
    assert qg.grad is not None and len(specs_built) == 2
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert attnkit.attention(q, k, v, causal=True).dtype == torch.bfloat16
    assert len(specs_built) == 3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)  # (OMP_NUM_THREADS=1 runs: 2)
        with torch.no_grad():
            one = attnkit.attention(q, k, v, causal=True)  # another thread count: its own form
        assert len(specs_built) == 4
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        torch.testing.assert_close(one, attnkit.attention(q, k, v, causal=True))
        attnkit.attention(q, k, v, causal=True, window=[4, 0])  # unhashable: never remembered
        attnkit.attention(q, k, v, causal=True, window=[4, 0])
        assert len(specs_built) == 6
        attnkit.attention(q, k, v, causal=True, seqlens_kv=[30, 20])  # not tensors
        attnkit.attention(q, k, v, causal=True, seqlens_kv=[30, 20])
        assert len(specs_built) == 8
        torch.func.vmap(lambda x: attnkit.attention(x, k, v, causal=True))(q[None])
        assert len(specs_built) == 9


def test_bad_lengths_on_a_replayed_form_raise_the_full_paths_error(specs_built):
    g = torch.Generator().manual_seed(4)
    q = rand(2, 8, 1, 64, gen=g, dtype=torch.float32)
    k, v = _cache(torch.float32, 30, g)
    kw = dict(causal=True, diagonal="bottom_right")
    with torch.no_grad():
        attnkit.attention(q, k, v, **kw, starts_kv=torch.tensor([0, 4]))
        attnkit.attention(q, k, v, **kw, starts_kv=torch.tensor([1, 5]))
        assert len(specs_built) == 1
        for bad in ([0, 31], [-1, 0]):
            with pytest.raises(ValueError, match="starts_kv"):
                attnkit.attention(q, k, v, **kw, starts_kv=torch.tensor(bad))
        attnkit.attention(q, k, v, **kw, seqlens_kv=torch.tensor([30, 3]))
        with pytest.raises(ValueError, match="seqlens_kv"):
            attnkit.attention(q, k, v, **kw, seqlens_kv=torch.tensor([31, 3]))
        with pytest.raises(ValueError):  # K and V of different lengths
            attnkit.attention(q, k, v[:, :, :29], **kw)


def test_a_reloaded_kernel_is_not_called_through_a_stale_launcher(specs_built, fresh_native):
    g = torch.Generator().manual_seed(5)
    q = rand(2, 8, 1, 64, gen=g, dtype=torch.float32)
    k, v = _cache(torch.float32, 30, g)
    with torch.no_grad():
        first = attnkit.attention(q, k, v, causal=True)
        fresh_native.setenv("ATTNKIT_NATIVE", "0")
        native._reset()
        without = attnkit.attention(q, k, v, causal=True)  # the torch path, not the old kernel
        assert not native.available() and len(specs_built) == 2
        torch.testing.assert_close(without, first, atol=2e-6, rtol=2e-5)
        attnkit.attention(q, k, v, causal=True)
        assert len(specs_built) == 3  # no launcher without the kernel
