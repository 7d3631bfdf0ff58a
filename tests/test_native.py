"""The native decode kernel (attnkit/native) against the float64 oracle, its flash-decoding
splits, its build/cache/disable paths, and the fallbacks when it cannot run."""

from __future__ import annotations

import math
import os
import random
import tempfile
import warnings

import pytest
import torch
from conftest import fa_tolerance_ok, naive_attention, rand, spy

import attnkit
from attnkit import native
from attnkit.paged import gather_kv, paged_attention_blocks
from attnkit.reference import attention_reference, scores

needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native kernel: {native.unavailable_reason()}")


def _paged_problem(gen, *, batch=3, hq=8, hkv=2, lq=1, d=32, dv=32, page=8, dtype=torch.float32,
                   lengths=None):
    """Sequences on shuffled pages (one spare page, -1 padding past each row's pages)."""
    lens = torch.tensor(lengths) if lengths is not None else torch.randint(
        max(lq, 1), 7 * page, (batch,), generator=gen)
    batch = lens.numel()
    width = int(-(-int(lens.max()) // page)) + 1
    num_pages = batch * width + 1
    kp = rand(num_pages, page, hkv, d, gen=gen, dtype=dtype)
    vp = rand(num_pages, page, hkv, dv, gen=gen, dtype=dtype)
    table = torch.randperm(num_pages, generator=gen)[: batch * width].view(batch, width)
    for b in range(batch):  # padding entries past a sequence's pages are ignored
        table[b, -(-int(lens[b]) // page):] = -1
    q = rand(batch, hq, lq, d, gen=gen, dtype=dtype)
    return q, kp, vp, table.to(torch.int32), lens


def _oracle(q, kp, vp, table, lens, **kw):
    """Float64 reference on the gathered cache, and the same-dtype 'plain' baseline."""
    opts = {"causal": True, "diagonal": "bottom_right", **kw}
    k, v = gather_kv(kp, vp, table, lens)
    ref, ref_lse = attention_reference(q, k, v, seqlens_kv=lens, return_lse=True, **opts)
    if q.dtype == torch.float32:
        return ref, ref_lse, None
    # plain: the same score pipeline and softmax, rounded to the inputs' dtype at each step
    s, vis = scores(q, k, v, seqlens_kv=lens, **opts)
    s = s.to(q.dtype).float().masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(q.dtype)
    plain = p @ v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return ref, ref_lse, plain


def _check(out, lse, ref, ref_lse, plain, lse_atol=2e-5):
    """The native kernel's LSE is float32 math on the given inputs (2e-5); the torch page
    path rounds its scores to the inputs' dtype (lse_atol=1e-2 for half precision)."""
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin].double(), ref_lse[fin], atol=lse_atol, rtol=0)
    if plain is None:
        assert (out.double() - ref).abs().max() < 2e-6
    else:
        ok, err, base = fa_tolerance_ok(out, ref, plain)
        assert ok, (err, base)


OPTIONS = {
    "causal": dict(),
    "full": dict(causal=False),
    "window": dict(window=(5, 0)),
    "window_two_sided": dict(causal=False, window=(4, 2)),
    "top_left": dict(diagonal="top_left"),
    "softcap": dict(softcap=3.0),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03, 0.02, 0.01, 0.3])),
    "alibi_per_batch": dict(alibi_slopes=torch.linspace(0.01, 0.6, 24).view(3, 8)),
    "scale_and_all": dict(scale=0.3, softcap=4.0, window=(9, 0),
                          alibi_slopes=torch.linspace(0.05, 0.4, 8)),
}


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("lq", [1, 3], ids=["decode", "lq3"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_native_matches_the_oracle(name, lq, dtype):
    if dtype == torch.float16 and not native.build_info().get("f16"):
        pytest.skip("compiler without _Float16")
    gen = torch.Generator().manual_seed(10 * list(OPTIONS).index(name) + lq)
    q, kp, vp, table, lens = _paged_problem(gen, lq=lq, dtype=dtype, lengths=[lq, 17, 40])
    kw = OPTIONS[name]
    out, lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True,
                                      backend="decode", **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    _check(out, lse, *_oracle(q, kp, vp, table, lens, **kw))


def _band(lens, lq, lk, left, right, causal=False, diagonal="top_left"):
    """(B, 1, Lq, Lk) bool: key j visible to row i iff i' - left <= j <= i' + right and
    j < lens[b] (None: unbounded; causal caps right at 0), i' the aligned row position."""
    if causal:
        right = 0 if right is None else min(right, 0)
    vis = torch.zeros(len(lens), 1, lq, lk, dtype=torch.bool)
    for b, n in enumerate(int(x) for x in lens):
        for i in range(lq):
            ip = i + n - lq if diagonal == "bottom_right" else i
            lo = 0 if left is None else max(0, ip - left)  # Python ints: exact at any size
            hi = n if right is None else min(n, ip + right + 1)
            if lo < hi:
                vis[b, 0, i, lo:hi] = True
    return vis


def _band_oracle(q, kp, vp, table, lens, scale, **band):
    """The float64 oracle on the gathered cache with the band as a boolean mask."""
    k, v = gather_kv(kp, vp, table, lens)
    vis = _band(lens, q.shape[2], k.shape[2], **band)
    return attention_reference(q, k, v, mask=vis, scale=scale, return_lse=True)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lens", [None, [300, 290, 200]], ids=["full", "seqlens"])
def test_decode_with_a_window_mask_before_the_diagonal(lens, dtype, monkeypatch):
    """A bottom-right sliding-window mask on a decoding step becomes window bounds that are
    negative for the row (keys 283..299 of 300 for a top-left row 0): the kernel keeps them as
    bounds, like the tiled executor and the oracle; a sequence too short for the window sees
    nothing."""
    calls = spy(monkeypatch, native, "paged_decode")
    gen = torch.Generator().manual_seed(37)
    q = rand(3, 8, 1, 64, gen=gen, dtype=dtype)
    k = rand(3, 2, 300, 64, gen=gen, dtype=dtype)
    v = rand(3, 2, 300, 64, gen=gen, dtype=dtype)
    kw = dict(mask=attnkit.masks.sliding_window(16, 0, "bottom_right", q_len=1, kv_len=300))
    if lens is not None:
        kw["seqlens_kv"] = torch.tensor(lens)
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    if lens is not None:
        assert calls  # padded decoding rows run in the kernel with the window's bounds
    tiled, tiled_lse = attnkit.attention(q, k, v, return_lse=True, backend="tiled", **kw)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kw)
    vis = scores(q, k, v, **kw)[1]
    assert vis.sum(-1).max() == 17 and vis[:, :, :, :283].sum() == 0
    plain = None if dtype == torch.float32 else naive_attention(q, k, v, mask=vis)
    # the kernel's LSE is float32 math; torch's kernels round half-precision scores
    torch_lse_atol = 2e-5 if dtype == torch.float32 else 1e-2
    _check(out, lse, ref, ref_lse, plain, lse_atol=2e-5 if calls else torch_lse_atol)
    _check(tiled, tiled_lse, ref, ref_lse, plain, lse_atol=torch_lse_atol)
    if dtype == torch.float32:
        assert (out - tiled).abs().max() < 1e-6


@needs_native
@pytest.mark.parametrize("lq", [1, 3], ids=["decode", "lq3"])
@pytest.mark.parametrize("kw", [
    dict(window=(16, 0)),
    dict(window=(16, 4), causal=False),
    dict(window=(2, None), causal=False, diagonal="top_left"),
    dict(window=(0, 20), causal=False, diagonal="top_left"),
    dict(window=(2 ** 62, 2 ** 62), causal=False),
    dict(window=(2 ** 62, 0)),
], ids=["last16", "two_sided", "top_left_left", "top_left_right", "huge", "huge_causal"])
def test_paged_windows_match_tiled_and_the_oracle(kw, lq):
    """paged_attention_blocks with a window over 300 cached keys: the kernel on the pages,
    the tiled executor on the gathered cache and the oracle agree (bounds up to 2**62)."""
    gen = torch.Generator().manual_seed(38 + lq)
    q, kp, vp, table, lens = _paged_problem(gen, lq=lq, lengths=[300, 290, 17], d=64, dv=32)
    out, lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True,
                                      backend="decode", **kw)
    tiled, tiled_lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True,
                                              backend="tiled", **kw)
    ref, ref_lse, _ = _oracle(q, kp, vp, table, lens, **kw)
    _check(out, lse, ref, ref_lse, None)
    _check(tiled, tiled_lse, ref, ref_lse, None)
    assert (out - tiled).abs().max() < 1e-6


@needs_native
@pytest.mark.parametrize("band", [
    dict(left=-283, right=299),                 # the absorbed bottom-right window, top-left
    dict(left=-5, right=10),
    dict(left=3, right=-2),                     # before the diagonal
    dict(left=-10, right=-5, causal=True),      # causal keeps the tighter right bound
    dict(left=-4, right=None),
    dict(left=None, right=-3, diagonal="bottom_right"),
    dict(left=4, right=7, causal=True, diagonal="bottom_right"),
    dict(left=-(2 ** 62), right=2 ** 62),       # sees nothing
    dict(left=2 ** 62, right=-(2 ** 62)),       # sees nothing
    dict(left=2 ** 62, right=2 ** 62),          # sees everything
    dict(left=-(2 ** 80), right=2 ** 80, diagonal="bottom_right"),
    dict(left=2 ** 80, right=None, causal=True, diagonal="bottom_right"),
])
def test_kernel_window_bounds_of_any_sign(band):
    """native.paged_decode's window bounds as they are: negative ones shift the window off
    the diagonal, huge ones clamp without overflow, None is unbounded."""
    gen = torch.Generator().manual_seed(39)
    q, kp, vp, table, lens = _paged_problem(gen, lq=3, lengths=[300, 290, 17, 3], d=32,
                                            dv=16)
    opts = dict(causal=band.get("causal", False), diagonal=band.get("diagonal", "top_left"))
    for splits in (1, 3):
        out, lse = native.paged_decode(q, kp, vp, table, lens, scale=0.25, splits=splits,
                                       window=(band["left"], band["right"]), **opts)
        ref, ref_lse = _band_oracle(q, kp, vp, table, lens, 0.25, left=band["left"],
                                    right=band["right"], **opts)
        _check(out, lse, ref, ref_lse, None)


@needs_native
def test_random_window_bounds_match_the_oracle():
    """Many (left, right) pairs, negative, None and huge, on random problems (rows, diagonal,
    causal, splits), against the oracle with the band as a mask."""
    rng = random.Random(40)
    gen = torch.Generator().manual_seed(40)

    def bound():
        kind = rng.random()
        if kind < 0.15:
            return None
        if kind < 0.25:
            return rng.choice([-1, 1]) * rng.choice([2 ** 62, 2 ** 63 - 1, 2 ** 90])
        return rng.randint(-70, 70)

    for trial in range(150):
        lq = rng.randint(1, 4)
        lens = [rng.randint(lq, 90) for _ in range(rng.randint(1, 3))]
        q, kp, vp, table, lens_t = _paged_problem(gen, lq=lq, lengths=lens, hq=4, hkv=2,
                                                  d=16, dv=16, page=rng.choice([4, 16, 128]))
        left, right = bound(), bound()
        opts = dict(causal=rng.random() < 0.3,
                    diagonal=rng.choice(["top_left", "bottom_right"]))
        out, lse = native.paged_decode(q, kp, vp, table, lens_t, scale=0.3,
                                       splits=rng.randint(1, 4), window=(left, right), **opts)
        ref, ref_lse = _band_oracle(q, kp, vp, table, lens_t, 0.3, left=left, right=right,
                                    **opts)
        try:
            _check(out, lse, ref, ref_lse, None)
        except AssertionError as exc:
            raise AssertionError(f"trial {trial}: lens={lens}, lq={lq}, window=({left}, "
                                 f"{right}), {opts}") from exc


@needs_native
@pytest.mark.parametrize("shape", [
    dict(hq=4, hkv=4, d=16, dv=48),     # MHA, Dv != Dqk
    dict(hq=6, hkv=1, d=64, dv=16),     # MQA: 6 rows per kv head
    dict(hq=10, hkv=2, d=32, dv=32),    # 5 rows per kv head (a group of 4 and a single)
    dict(hq=16, hkv=2, d=128, dv=128, page=16),
    dict(hq=8, hkv=2, d=48, dv=32, dtype=torch.bfloat16),   # bf16 without the 32-wide dots
    dict(hq=8, hkv=2, d=64, dv=64, dtype=torch.bfloat16),   # bf16 dot products if the CPU has
], ids=["mha_dv48", "mqa", "g5", "g8_d128", "bf16_d48", "bf16_d64"])
def test_native_head_layouts(shape):
    gen = torch.Generator().manual_seed(21)
    q, kp, vp, table, lens = _paged_problem(gen, lq=2, **shape)
    out, lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True,
                                      backend="decode")
    _check(out, lse, *_oracle(q, kp, vp, table, lens))


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_flash_decoding_splits_agree(threads):
    """Any key split across any number of threads merges to the unsplit result; splits that
    hold no key of a short sequence (lse -inf) drop out of the merge."""
    gen = torch.Generator().manual_seed(22)
    q, kp, vp, table, lens = _paged_problem(gen, lq=1, lengths=[1, 9, 70, 33], page=4)
    ref, ref_lse, _ = _oracle(q, kp, vp, table, lens)
    scale = 1 / math.sqrt(q.shape[-1])
    for splits in (1, 2, 3, 5, 18):
        out, lse = native.paged_decode(q, kp, vp, table, lens, scale=scale,
                                       splits=splits, threads=threads)
        _check(out, lse, ref, ref_lse, None)


@needs_native
def test_packed_sequences_with_start_offsets():
    """Sequences packed in one long page, addressed by start offsets that cross no page
    boundary but do cross the kernel's 64-token chunks, with any key split."""
    gen = torch.Generator().manual_seed(34)
    total, starts, lens = 700, torch.tensor([0, 13, 300, 699]), torch.tensor([13, 287, 399, 1])
    k = rand(1, total, 2, 32, gen=gen, dtype=torch.float32)
    v = rand(1, total, 2, 16, gen=gen, dtype=torch.float32)
    q = rand(4, 8, 1, 32, gen=gen, dtype=torch.float32)
    table = torch.zeros(4, 1, dtype=torch.int64)
    for splits in (1, 2, 5):
        out, lse = native.paged_decode(q, k, v, table, lens, scale=0.2, causal=False,
                                       starts=starts, splits=splits)
        for b in range(4):
            ks = slice(int(starts[b]), int(starts[b] + lens[b]))
            ref, ref_lse = attention_reference(q[b:b + 1].double(),
                                               k[:, ks].transpose(1, 2).double(),
                                               v[:, ks].transpose(1, 2).double(), scale=0.2,
                                               return_lse=True)
            _check(out[b:b + 1], lse[b:b + 1], ref, ref_lse, None)


def test_split_choice():
    assert native._splits(batch=8, keys=8192, threads=2) == 1
    assert native._splits(batch=1, keys=8192, threads=2) == 2
    assert native._splits(batch=1, keys=8192, threads=16) == 8  # splits of >= 1024 keys
    assert native._splits(batch=1, keys=900, threads=8) == 1    # too short to split
    assert native._splits(batch=3, keys=4096, threads=1) == 1


@needs_native
def test_auto_runs_native_on_the_pages_and_gathers_for_gradients(monkeypatch):
    calls = spy(monkeypatch, native, "paged_decode")
    gen = torch.Generator().manual_seed(23)
    q, kp, vp, table, lens = _paged_problem(gen, lq=1)
    out = paged_attention_blocks(q, kp, vp, table, lens)
    assert len(calls) == 1
    ref, _, _ = _oracle(q, kp, vp, table, lens)
    assert (out.double() - ref).abs().max() < 2e-6
    # inputs that need a gradient take the differentiable gather path (whose decode executor
    # still runs its forward in the kernel, on the gathered K/V)
    q.requires_grad_(True)
    out = paged_attention_blocks(q, kp, vp, table, lens)
    assert len(calls) == 2 and out.requires_grad
    (dq,) = torch.autograd.grad(out.sum(), q)
    k, v = gather_kv(kp, vp, table, lens)
    qd = q.detach().double().requires_grad_(True)
    r = attention_reference(qd, k.double(), v.double(), seqlens_kv=lens, causal=True,
                            diagonal="bottom_right")
    (rq,) = torch.autograd.grad(r.sum(), qd)
    assert (dq.double() - rq).abs().max() < 1e-5


def test_forced_decode_says_why_not():
    """backend="decode" runs the decode executor: the kernel where it can, its torch
    fallback where the kernel cannot (float64, head dims not multiples of 16), and a clear
    reason where the executor cannot run at all."""
    gen = torch.Generator().manual_seed(24)
    for kw in (dict(dtype=torch.float64), dict(d=24, dv=24)):
        q, kp, vp, table, lens = _paged_problem(gen, **kw)
        assert native.decode_reasons(q, kp, vp)  # (float64 / multiples of 16)
        out, lse = paged_attention_blocks(q, kp, vp, table, lens, backend="decode",
                                          return_lse=True)
        _check(out, lse, *_oracle(q, kp, vp, table, lens), lse_atol=1e-5)
    q, kp, vp, table, lens = _paged_problem(gen, d=24, dv=24)
    assert "multiples of 16; got Dqk=24" in " ".join(native.decode_reasons(q, kp, vp))
    q, kp, vp, table, lens = _paged_problem(gen, lq=native.MAX_QUERY_ROWS + 1)
    with pytest.raises(NotImplementedError, match="decoding"):
        paged_attention_blocks(q, kp, vp, table, lens, backend="decode")
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="no backward"):
        paged_attention_blocks(q, kp, vp, table, lens, backend="decode")


@needs_native
def test_bad_inputs_are_caught_before_the_kernel():
    gen = torch.Generator().manual_seed(25)
    q, kp, vp, table, lens = _paged_problem(gen, lengths=[5, 20])
    bad = table.clone()
    bad[1, 0] = kp.shape[0]  # past the pool: must be a clear error, never a wild read
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = .* is not a page index"):
        paged_attention_blocks(q, kp, vp, bad, lens, backend="decode")
    with pytest.raises(ValueError, match="seqlens must lie in"):
        paged_attention_blocks(q, kp, vp, table, torch.tensor([5, 10_000]), backend="decode")
    with pytest.raises(ValueError, match="window"):
        paged_attention_blocks(q, kp, vp, table, lens, backend="decode", window=(-1, 0))
    with pytest.raises(ValueError, match="softcap"):
        paged_attention_blocks(q, kp, vp, table, lens, backend="decode", softcap=-2.0)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        paged_attention_blocks(q, kp, vp, table, lens, backend="decode",
                               alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="number of query heads must be a multiple"):
        paged_attention_blocks(q[:, :7], kp, vp, table, lens, backend="decode")
    # strided (non-contiguous) pages are read through their strides
    wide_k = torch.zeros(*kp.shape[:3], 2 * kp.shape[3])
    wide_k[..., ::2] = kp
    kv_strided = wide_k[..., ::2]
    assert "unit-stride" in " ".join(native.decode_reasons(q, kv_strided, vp))
    torch.testing.assert_close(  # (the decode executor's torch fallback reads them)
        paged_attention_blocks(q, kv_strided, vp, table, lens, backend="decode"),
        paged_attention_blocks(q, kp, vp, table, lens, backend="decode"))
    heads_first = kp.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    out = paged_attention_blocks(q, heads_first, vp, table, lens, backend="decode")
    assert torch.equal(out, paged_attention_blocks(q, kp, vp, table, lens, backend="decode"))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kw", [dict(), dict(seqlens_kv=torch.tensor([40, 7]))],
                         ids=["full", "padded"])
def test_dense_decode_runs_native_with_gradients(kw, dtype, monkeypatch):
    """attention() on a contiguous (maybe right-padded) cache: the fused executor's decode rows
    run in the kernel (each batch row's keys as one strided page) and its backward starts from
    the kernel's output and LSE."""
    calls = spy(monkeypatch, native, "paged_decode")
    gen = torch.Generator().manual_seed(30)
    q = rand(2, 8, 1, 32, gen=gen, dtype=dtype, requires_grad=True)
    k = rand(2, 2, 40, 32, gen=gen, dtype=dtype, requires_grad=True)
    v = rand(2, 2, 40, 16, gen=gen, dtype=dtype, requires_grad=True)
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    assert len(calls) == 1  # padded rows too: one call, each row on its own length
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref, ref_lse = attention_reference(qd, kd, vd, return_lse=True, **kw)
    grads = torch.autograd.grad((out.float() * torch.linspace(-1, 1, 16)).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * torch.linspace(-1, 1, 16).double()).sum(),
                                    (qd, kd, vd))
    if dtype == torch.float32:
        _check(out, lse, ref, ref_lse, None)
        for a, b in zip(grads, ref_grads):
            assert (a.double() - b).abs().max() < 1e-5
    else:  # FlashAttention's rule against textbook bf16 attention (3x for gradients)
        assert (lse.double() - ref_lse).abs().max() < 2e-5
        qp, kp, vp = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        vis = None
        if kw:
            vis = torch.arange(40).view(1, 1, 1, 40) < kw["seqlens_kv"].view(2, 1, 1, 1)
        plain = naive_attention(qp, kp, vp, mask=vis)
        plain_grads = torch.autograd.grad((plain.float() * torch.linspace(-1, 1, 16)).sum(),
                                          (qp, kp, vp))
        ok, err, base = fa_tolerance_ok(out, ref, plain)
        assert ok, (err, base)
        for a, b, c in zip(grads, ref_grads, plain_grads):
            ok, err, base = fa_tolerance_ok(a, b, c, mult=3.0)
            assert ok, (err, base)


@needs_native
@pytest.mark.parametrize("kw", [
    dict(causal=True, diagonal="bottom_right", window=(3, 0)),
    dict(causal=True, diagonal="top_left", alibi_slopes=torch.linspace(0.1, 0.8, 8)),
    dict(sinks=torch.linspace(-1.0, 1.0, 8)),
], ids=["window_br", "alibi_tl", "sinks"])
def test_padded_decode_options_run_native(kw, monkeypatch):
    calls = spy(monkeypatch, native, "paged_decode")
    gen = torch.Generator().manual_seed(33)
    q = rand(3, 8, 2, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    k = rand(3, 2, 30, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    v = rand(3, 2, 30, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    lens = torch.tensor([30, 9, 2])
    out, lse = attnkit.attention(q, k, v, seqlens_kv=lens, return_lse=True, **kw)
    assert len(calls) == 1
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref_kw = {key: (val.double() if key == "sinks" else val) for key, val in kw.items()}
    ref, ref_lse = attention_reference(qd, kd, vd, seqlens_kv=lens, return_lse=True, **ref_kw)
    _check(out, lse, ref, ref_lse, None)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for g, r in zip(grads, torch.autograd.grad(ref.sum(), (qd, kd, vd))):
        assert (g.double() - r).abs().max() < 1e-5


@needs_native
@pytest.mark.parametrize("lq", [1, 2], ids=["decode", "two_rows"])
def test_varlen_decoding_rows_run_native_with_gradients(lq, monkeypatch):
    """Packed sequences with new rows (continuous batching): one or two decoding rows each
    run as one kernel call over the packed K/V, causal within each sequence."""
    calls = spy(monkeypatch, native, "paged_decode")
    gen = torch.Generator().manual_seed(32)
    lens_k = [5, 40, 1 + lq, 77]
    cu_q = torch.tensor([0, lq, 2 * lq, 3 * lq, 4 * lq], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 45, 46 + lq, 123 + lq], dtype=torch.int32)
    q = rand(4 * lq, 8, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    k = rand(int(cu_k[-1]), 2, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    v = rand(int(cu_k[-1]), 2, 16, gen=gen, dtype=torch.float32, requires_grad=True)
    out = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True, diagonal="bottom_right")
    assert len(calls) == 1  # one kernel call for all sequences
    w = torch.linspace(-1, 1, 16)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    for b in range(4):
        qs, ks = slice(b * lq, (b + 1) * lq), slice(int(cu_k[b]), int(cu_k[b + 1]))
        assert ks.stop - ks.start == lens_k[b]
        qd, kd, vd = (x[s].detach().double().transpose(0, 1).requires_grad_(True)
                      for x, s in ((q, qs), (k, ks), (v, ks)))
        ref = attention_reference(qd, kd, vd, causal=True, diagonal="bottom_right")
        assert (out[qs].double() - ref.transpose(0, 1)).abs().max() < 2e-6
        rg = torch.autograd.grad((ref.transpose(0, 1) * w.double()).sum(), (qd, kd, vd))
        for g, r, s in zip(grads, rg, (qs, ks, ks)):
            assert (g[s].double() - r.transpose(0, 1)).abs().max() < 1e-5


@needs_native
def test_the_cache_and_paged_attention_use_native(monkeypatch):
    """The PagedKVCache front door, with pages that interleave between sequences."""
    calls = spy(monkeypatch, native, "paged_decode")
    gen = torch.Generator().manual_seed(26)
    cache = attnkit.PagedKVCache(16, 4, 2, 16, dtype=torch.bfloat16)
    lengths = {"a": 11, "b": 3, "c": 14}
    for sid in lengths:
        cache.allocate(sid)
    for step in range(14):
        for sid, n in lengths.items():
            if step < n:
                cache.append(sid, rand(1, 2, 16, gen=gen, dtype=torch.bfloat16),
                             rand(1, 2, 16, gen=gen, dtype=torch.bfloat16))
    q = rand(3, 4, 1, 16, gen=gen, dtype=torch.bfloat16)
    out, lse = attnkit.paged_attention(q, cache, list(lengths), return_lse=True)
    assert len(calls) == 1
    table, lens = cache.block_table(list(lengths))
    _check(out, lse, *_oracle(q, cache.k_pages, cache.v_pages, table, lens))


def test_disabled_native_falls_back(fresh_native):
    fresh_native.setenv("ATTNKIT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # chosen by the user: no warning
        assert not native.available()
    assert "ATTNKIT_NATIVE=0" in native.unavailable_reason()
    assert "unavailable" in native.describe()
    gen = torch.Generator().manual_seed(27)
    q, kp, vp, table, lens = _paged_problem(gen, lq=1, dtype=torch.bfloat16)
    assert "ATTNKIT_NATIVE=0" in " ".join(native.decode_reasons(q, kp, vp))
    for backend in ("decode", "auto"):  # the decode executor's torch path
        out, lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True,
                                          backend=backend)
        _check(out, lse, *_oracle(q, kp, vp, table, lens), lse_atol=1e-2)


def _one_warning(record) -> str:
    """The single NativeKernelWarning among the recorded warnings, as text."""
    ours = [w for w in record if issubclass(w.category, native.NativeKernelWarning)]
    assert len(ours) == 1, [str(w.message) for w in record]
    assert issubclass(ours[0].category, RuntimeWarning)
    assert ours[0].filename == __file__  # points at the caller, not at attnkit's insides
    return str(ours[0].message)


def test_missing_or_failing_compiler_is_a_reason_not_a_crash(fresh_native, tmp_path):
    fresh_native.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    fresh_native.setenv("CC", str(tmp_path / "no-such-compiler"))
    gen = torch.Generator().manual_seed(28)
    q, kp, vp, table, lens = _paged_problem(gen, lq=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = paged_attention_blocks(q, kp, vp, table, lens)  # on the torch path
        out = paged_attention_blocks(q, kp, vp, table, lens)
        assert not native.available()
    message = _one_warning(record)  # one, however often the kernels are asked for
    assert "no C compiler" in native.unavailable_reason()
    assert native.unavailable_reason() in message
    assert "slower" in message and "paged" in message and "ATTNKIT_NATIVE=0" in message
    assert (out.double() - _oracle(q, kp, vp, table, lens)[0]).abs().max() < 2e-6
    native._reset()
    fake = tmp_path / "failing-cc"
    fake.write_text("#!/bin/sh\necho 'error: this compiler always fails' >&2\nexit 3\n")
    fake.chmod(0o755)
    fresh_native.setenv("CC", str(fake))
    with pytest.warns(native.NativeKernelWarning, match="always fails.*slower"):
        assert not native.available()
    reason = native.unavailable_reason()
    assert "building the native decode kernel failed" in reason and "always fails" in reason
    out = paged_attention_blocks(q, kp, vp, table, lens)  # still answers, on the torch path
    assert (out.double() - _oracle(q, kp, vp, table, lens)[0]).abs().max() < 2e-6


def _unwritable(tmp_path, name):
    """A folder path nobody can create or write in (root writes anywhere: under a file)."""
    if os.geteuid() == 0:
        blocker = tmp_path / f"{name}-not-a-folder"
        blocker.write_text("")
        return blocker / "attnkit"
    locked = tmp_path / name
    locked.mkdir(mode=0o500)
    return locked


@needs_native
def test_unwritable_cache_folder_falls_back_to_a_temporary_folder(fresh_native, tmp_path):
    fresh_native.setenv("ATTNKIT_CACHE_DIR", str(_unwritable(tmp_path, "locked")))
    fresh_native.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernels work: nothing to warn about
        assert native.available(), native.unavailable_reason()
    info = native.build_info()
    folder = tmp_path / "tmp" / f"attnkit-{os.getuid()}"
    assert info["folder"] == str(folder) and info["path"].startswith(str(folder))
    assert "locked" in info["cache_folder_unusable"]
    assert str(folder) in native.describe()
    assert oct(folder.stat().st_mode & 0o777) == oct(0o700)
    gen = torch.Generator().manual_seed(41)
    q, kp, vp, table, lens = _paged_problem(gen, lq=1)
    out, lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True, backend="decode")
    _check(out, lse, *_oracle(q, kp, vp, table, lens))
    native._reset()  # the next process finds it there
    assert native.available() and native.build_info()["cached"]
    assert native.build_info()["path"] == info["path"]


def test_no_writable_folder_is_a_reason_and_a_warning(fresh_native, tmp_path):
    fresh_native.setenv("ATTNKIT_CACHE_DIR", str(_unwritable(tmp_path, "locked")))
    fresh_native.setattr(tempfile, "tempdir", str(_unwritable(tmp_path, "tmp")))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert not native.available()
    reason = native.unavailable_reason()
    assert "cache folder" in reason and "temporary folder" in reason
    assert reason in _one_warning(record)


def test_a_temporary_folder_others_can_write_is_not_used(fresh_native, tmp_path):
    """A library in a shared temporary folder that another user could have put there is
    neither loaded nor built on."""
    fresh_native.setenv("ATTNKIT_CACHE_DIR", str(_unwritable(tmp_path, "locked")))
    fresh_native.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"attnkit-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.warns(native.NativeKernelWarning, match="others may write"):
        assert not native.available()
    assert list(shared.iterdir()) == []


@needs_native
def test_build_retries_without_march_native(fresh_native, tmp_path):
    """A compiler that rejects -march=native still gets a (portable) kernel."""
    real = native._compiler()
    picky = tmp_path / "picky-cc"
    picky.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -march=native ] && exit 1; done\n'
                     f'exec {real} "$@"\n')
    picky.chmod(0o755)
    fresh_native.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "cache"))
    fresh_native.setenv("CC", str(picky))
    assert native.available(), native.unavailable_reason()
    assert "-march=native" not in native.build_info()["flags"]
    gen = torch.Generator().manual_seed(31)
    q, kp, vp, table, lens = _paged_problem(gen, lq=2, dtype=torch.bfloat16)
    out, lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True, backend="decode")
    _check(out, lse, *_oracle(q, kp, vp, table, lens))


@needs_native
def test_build_is_cached_per_source_and_cpu(fresh_native, tmp_path):
    fresh_native.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    assert native.available()
    first = native.build_info()
    assert not first["cached"] and first["build_s"] > 0
    assert first["path"].startswith(str(tmp_path))
    native._reset()
    assert native.available()
    second = native.build_info()
    assert second["cached"] and second["path"] == first["path"]
    assert list(tmp_path.iterdir()) == [tmp_path / first["path"].rsplit("/", 1)[1]]


@needs_native
def test_softcap_passes_agree_with_torch_and_the_oracle(fresh_native):
    """The tiled executor's softcap in the native pass and in torch ops (ATTNKIT_NATIVE=0):
    forward and gradients against the float64 oracle, and the two paths against each other."""
    gen = torch.Generator().manual_seed(35)
    x = rand(3, 4, 37, 53, gen=gen, dtype=torch.float32) * 4
    y = x.clone()
    assert native.softcap_forward_(y, 2.5)
    assert (y.double() - 2.5 * torch.tanh(x.double())).abs().max() < 1e-6
    g = rand(3, 4, 37, 53, gen=gen, dtype=torch.float32)
    want = g.double() * 2.5 * (1 - torch.tanh(x.double()) ** 2)
    assert (native.softcap_backward(g, x, 2.5).double() - want).abs().max() < 1e-5
    assert native.softcap_backward(g, x.double(), 2.5) is None  # not float32: torch path
    assert not native.softcap_forward_(x.transpose(2, 3), 2.5)    # not contiguous

    q = rand(2, 4, 70, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    k = rand(2, 2, 90, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    v = rand(2, 2, 90, 16, gen=gen, dtype=torch.float32, requires_grad=True)
    kw = dict(softcap=3.0, causal=True, diagonal="bottom_right")
    results = []
    for setting in ("1", "0"):
        fresh_native.setenv("ATTNKIT_NATIVE", setting)
        native._reset()
        out = attnkit.attention(q, k, v, **kw)
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = attention_reference(qd, kd, vd, **kw)
    refs = (ref, *torch.autograd.grad(ref.sum(), (qd, kd, vd)))
    for fast, slow, r in zip(*results, refs):
        assert (fast.double() - r).abs().max() < 1e-5
        assert (slow.double() - r).abs().max() < 1e-5
        assert (fast - slow).abs().max() < 1e-5


@needs_native
@pytest.mark.parametrize("kw", [
    dict(window=(100, 0), causal=True, diagonal="bottom_right"),
    dict(mask=((torch.arange(150) < 60) | (torch.arange(150) >= 100)).expand(4, 150)),
    dict(causal=True, diagonal="bottom_right", alibi_slopes=torch.linspace(0.1, 0.9, 8)),
], ids=["window", "bool_mask", "alibi"])
def test_few_rows_with_masks_mix_native_and_fused_pieces(kw, small_tiles, monkeypatch):
    """A few query rows over many keys with a mask: analytic masks (a window, ALiBi) run in
    the decode executor's native kernel, a bool mask on torch's masked kernel (fused, pieces
    merged by LSE); forward and gradients against the oracle in float32, on both."""
    calls = spy(monkeypatch, native, "paged_decode")
    gen = torch.Generator().manual_seed(36)
    q = rand(2, 8, 4, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    k = rand(2, 2, 150, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    v = rand(2, 2, 150, 32, gen=gen, dtype=torch.float32, requires_grad=True)
    qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref, ref_lse = attention_reference(qd, kd, vd, return_lse=True, **kw)
    rgrads = torch.autograd.grad(ref.sum(), (qd, kd, vd))
    for backend in ("auto", "fused"):
        calls.clear()
        out, lse = attnkit.attention(q, k, v, return_lse=True, backend=backend, **kw)
        assert bool(calls) == (backend == "auto" and "mask" not in kw)
        _check(out, lse, ref, ref_lse, None)
        for g, r in zip(torch.autograd.grad(out.sum(), (q, k, v)), rgrads):
            assert (g.double() - r).abs().max() < 1e-5


@needs_native
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["q_f32", "q_bf16"])
def test_every_fp8_byte_reaches_the_sums_exactly(fmt, qdtype, monkeypatch):
    """Every fp8 byte through the kernel's page loads (each build converts 16 or more a time in
    registers), as torch converts it. A sequence of one key gives that key weight 1, so the
    output is its value row: all 256 bytes, NaN and inf included, element for element. With a
    one-hot query row (scale 1) the LSE of one key is its score: each finite key byte."""
    every = torch.arange(256, dtype=torch.uint8).view(fmt)
    finite = every[every.float().isfinite()]
    d = 16 * -(-finite.numel() // 16)  # the finite bytes, zero-padded to whole blocks of 16
    kp = torch.zeros(1, 1, 1, d, dtype=fmt)
    kp[0, 0, 0, : finite.numel()] = finite
    vp = every.view(1, 1, 1, 256)
    q = torch.eye(d)[: finite.numel()].view(-1, 1, 1, d).to(qdtype)  # (B, Hq=1, Lq=1, d)
    table = torch.zeros(q.shape[0], 1, dtype=torch.int32)
    lens = torch.ones(q.shape[0], dtype=torch.int32)
    calls = spy(monkeypatch, native, "paged_decode")
    out, lse = paged_attention_blocks(q, kp, vp, table, lens, return_lse=True, scale=1.0,
                                      k_descale=1.0, v_descale=1.0, backend="decode")
    assert calls == ["paged_decode"]  # the kernel read the pages
    want = every.float().expand(q.shape[0], 256)
    got = out.float().view(q.shape[0], 256)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])
    assert torch.equal(lse.view(-1), finite.float())
