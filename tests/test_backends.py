"""Executor selection: the fused CPU kernel really runs where it can, the tiled executor runs
where it must, and the fallback (fused kernel missing) gives the same answer. (attnkit's own
flash kernel comes before the fused one where it runs: tests/test_flash.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import rand, spy

import attnkit
from attnkit import backends
from attnkit.backends import fused, tiled
from attnkit.score_terms import relative_bias_tile
from attnkit.spec import build_spec


@pytest.mark.skipif(fused.FWD_OP is None, reason="this torch has no fused CPU flash kernel")
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(8, 0), causal=True),
                                dict(mask=attnkit.masks.document_from_lengths([20, 30, 14])),
                                dict(alibi_slopes=torch.rand(4))], ids=str)
def test_fused_kernel_runs_forward_and_backward(kw, monkeypatch):
    fwd = spy(monkeypatch, fused, "FWD_OP")
    bwd = spy(monkeypatch, fused, "BWD_OP")
    tiled_fwd = spy(monkeypatch, tiled, "forward")
    q = rand(1, 4, 64, 16, dtype=torch.float32, requires_grad=True)
    out = attnkit.attention(q, q, q, backend="fused", **kw)
    out.sum().backward()
    assert fwd and bwd and not tiled_fwd


def test_tiled_runs_what_the_kernel_cannot():
    q = torch.randn(1, 2, 40, 4)
    for kw in (dict(softcap=3.0), dict(dropout_p=0.2, seed=1),
               dict(score_mod=attnkit.score_mods.softcap(2.0))):
        spec = build_spec(q, q, q, **kw)
        assert backends.select(spec) is tiled
        assert backends.reasons(fused, spec)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(5, 2)),
                                dict(causal=True, diagonal="bottom_right"),
                                dict(bias=torch.randn(4, 37, 53))], ids=str)
def test_fallback_without_the_kernel_gives_the_same_answer(kw, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = rand(2, 4, 37, 16, dtype=torch.float32, gen=g, requires_grad=True)
    k = rand(2, 2, 53, 16, dtype=torch.float32, gen=g, requires_grad=True)
    v = rand(2, 2, 53, 16, dtype=torch.float32, gen=g, requires_grad=True)
    # (without attnkit's own flash kernel, which would otherwise run these first)
    monkeypatch.setattr(backends, "PRIORITY", [n for n in backends.PRIORITY if n != "flash"])
    out = attnkit.attention(q, k, v, **kw)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    monkeypatch.setattr(fused, "FWD_OP", None)
    monkeypatch.setattr(fused, "BWD_OP", None)
    spec = build_spec(q, k, v, **kw)
    assert backends.select(spec) is tiled
    assert "no fused CPU flash kernel" in " ".join(backends.reasons(fused, spec))
    out2 = attnkit.attention(q, k, v, **kw)
    grads2 = torch.autograd.grad(out2.sum(), (q, k, v))
    assert torch.allclose(out, out2, atol=1e-5)
    for a, b in zip(grads, grads2):
        assert torch.allclose(a, b, atol=1e-4)
    with pytest.raises(NotImplementedError, match="fused"):
        attnkit.attention(q, k, v, backend="fused", **kw)


def test_version_guard_refuses_old_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.1.0")
    assert fused._load_ops() == (None, None)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert fused._load_ops()[0] is not None


def test_explain_lists_every_executor():
    spec = build_spec(torch.randn(4, 8), torch.randn(5, 8), torch.randn(5, 8), softcap=1.0)
    reasons = backends.explain(spec)
    assert reasons["tiled"] == [] and any("softcap" in r for r in reasons["fused"])


@pytest.mark.parametrize("kw", [
    dict(mask=lambda b, h, i, j: (j % (b + 2)) != 1),
    dict(score_mod=attnkit.score_mods.head_bias(torch.tensor([0.1, -0.2, 0.3, 0.0],
                                                             dtype=torch.float64)),
         causal=True, diagonal="bottom_right"),
    dict(alibi_slopes=torch.rand(3, 4, dtype=torch.float64), causal=True),
], ids=["batch_mask_mod", "score_mod_bottom_right", "per_batch_alibi"])
def test_padded_batch_rows_run_on_their_true_lengths(kw, backend):
    """The fused executor runs each padded batch row alone (b index preserved for mods)."""
    g = torch.Generator().manual_seed(3)
    q = rand(3, 4, 20, 8, gen=g, requires_grad=True)
    k = rand(3, 2, 25, 8, gen=g, requires_grad=True)
    lens = dict(seqlens_q=torch.tensor([20, 7, 0]), seqlens_kv=torch.tensor([25, 3, 9]))
    out, lse = attnkit.attention(q, k, k, backend=backend, return_lse=True, **lens, **kw)
    ref, ref_lse = attnkit.attention_reference(q, k, k, return_lse=True, **lens, **kw)
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k)), torch.autograd.grad(ref.sum(), (q, k))):
        assert torch.allclose(a, b, atol=1e-12)


def test_decode_rows_run_on_the_decode_executor(monkeypatch):
    fwd = spy(monkeypatch, fused, "FWD_OP")
    g = torch.Generator().manual_seed(4)
    q, k = rand(2, 8, 1, 16, gen=g), rand(2, 2, 40, 16, gen=g)
    assert backends.select(build_spec(q, k, k)).CAPS.name == "decode"
    out, lse = attnkit.attention(q, k, k, return_lse=True)
    ref, ref_lse = attnkit.attention_reference(q, k, k, return_lse=True)
    assert not fwd
    assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_decode_fast_path_matches_the_general_path(dtype, fresh_native):
    """Without the native kernel, half-precision decoding reads the pages with matmuls."""
    from conftest import fa_tolerance_ok, naive_attention

    from attnkit import paged
    from attnkit.backends import decode

    fresh_native.setenv("ATTNKIT_NATIVE", "0")
    calls = spy(fresh_native, decode, "_decode_on_pages")
    g = torch.Generator().manual_seed(5)
    cache = paged.PagedKVCache(12, 4, 2, 8, dtype=dtype)
    lengths = {"a": 9, "b": 4, "c": 13}
    kv = {}
    for sid in lengths:
        cache.allocate(sid)
    for step in range(13):  # interleaved appends: pages are not contiguous
        for sid, n in lengths.items():
            if step < n:
                k1 = torch.randn(1, 2, 8, generator=g).to(dtype)
                v1 = torch.randn(1, 2, 8, generator=g).to(dtype)
                cache.append(sid, k1, v1)
                kv.setdefault(sid, []).append((k1, v1))
    q = torch.randn(3, 6, 1, 8, generator=g).to(dtype)
    out, lse = paged.paged_attention(q, cache, list(lengths), return_lse=True)
    assert calls, "the decode fast path did not run"
    for b, sid in enumerate(lengths):
        k = torch.cat([a for a, _ in kv[sid]]).transpose(0, 1)
        v = torch.cat([c for _, c in kv[sid]]).transpose(0, 1)
        ref, ref_lse = attnkit.attention_reference(q[b].double(), k.double(), v.double(),
                                                   return_lse=True)
        plain = naive_attention(q[b], k, v)
        ok, err, base = fa_tolerance_ok(out[b], ref, plain)
        assert ok, (err, base)
        assert torch.allclose(lse[b].double(), ref_lse, atol=1e-2)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(3, 1)),
                                dict(seqlens_kv=torch.tensor([9, 4]), causal=True,
                                     diagonal="bottom_right")], ids=str)
def test_lse_gradient_stays_on_the_fused_kernel(kw, monkeypatch):
    """dlse rides in an extra head column of the fused backward (no tiled fallback)."""
    tiled_bwd = spy(monkeypatch, tiled, "backward")
    g = torch.Generator().manual_seed(6)
    q = rand(2, 4, 9, 8, gen=g, requires_grad=True)
    k = rand(2, 2, 9, 8, gen=g, requires_grad=True)
    v = rand(2, 2, 9, 6, gen=g, requires_grad=True)
    sinks = rand(4, gen=g, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: attnkit.attention(q, k, v, sinks=s, return_lse=True,
                                             backend="fused", **kw), (q, k, v, sinks))
    assert not tiled_bwd


@pytest.mark.parametrize("slopes", [[0.5, 0.25, 0.125, 0.0625], [0.5, 0.0, -0.25, 0.1]],
                         ids=["positive", "zero_and_negative"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(5, 2)),
                                dict(causal=True, seqlens_kv=torch.tensor([40, 9]),
                                     diagonal="bottom_right")], ids=["causal", "window", "padded"])
def test_fused_alibi_masks_match_the_oracle(slopes, kw, small_tiles):
    """Positive slopes take the fused distance path (-inf as inf * -slope); a zero or negative
    slope takes the general fill. Both agree with the oracle, forward and gradients."""
    g = torch.Generator().manual_seed(6)
    q = rand(2, 4, 40, 8, gen=g, requires_grad=True)
    k = rand(2, 2, 40, 8, gen=g, requires_grad=True)
    v = rand(2, 2, 40, 8, gen=g, requires_grad=True)
    al = torch.tensor(slopes, dtype=torch.float64)
    out, lse = attnkit.attention(q, k, v, alibi_slopes=al, backend="fused", return_lse=True,
                                 **kw)
    ref, ref_lse = attnkit.attention_reference(q, k, v, alibi_slopes=al, return_lse=True, **kw)
    assert torch.allclose(out, ref, atol=1e-12)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)),
                    torch.autograd.grad(ref.sum(), (q, k, v))):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("per_head", [True, False], ids=["per_head", "shared"])
@pytest.mark.parametrize("m", [3, 40, 500], ids=["clamped", "partly", "wide"])
def test_relative_bias_tile_equals_the_gather(per_head, m):
    """The fused executor's Toeplitz tile (unfold, rows last-first) is the table gather,
    including distances clamped at both ends."""
    g = torch.Generator().manual_seed(7)
    table = torch.randn(4, 2 * m - 1, generator=g) if per_head else torch.randn(2 * m - 1,
                                                                                generator=g)
    for q0, q1, k0, k1 in [(0, 1, 0, 1), (10, 30, 5, 70), (64, 128, 0, 128), (0, 50, 49, 50)]:
        tile = relative_bias_tile(table, m, q0, q1, k0, k1, torch.float64)
        i = torch.arange(q0, q1).view(-1, 1)
        j = torch.arange(k0, k1).view(1, -1)
        idx = (j - i).clamp(-(m - 1), m - 1) + (m - 1)
        want = table[:, idx] if per_head else table[idx].unsqueeze(0)
        assert tile.is_contiguous() and torch.equal(tile[0], want.double())
