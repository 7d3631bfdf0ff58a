"""The decode kernel's P V in bfloat16 dot products (``native.DECODE_BF16_PV``, builds with
AVX512-BF16): with bfloat16 queries and pages the softmax weights are rounded to bfloat16 and
multiplied into the values two keys a step by vdpbf16ps, the sums in float32. Against the
float64 oracle by FlashAttention's rule (MLA's shared latent rows and an ordinary GQA decode,
odd key counts, contiguous and paged); the switch off keeps the float32 P V; the bits repeat
from run to run and over thread counts."""

from __future__ import annotations

import pytest
import torch
from conftest import fa_tolerance_ok, naive_attention

from attnkit import native
from attnkit.reference import attention_reference

KW = dict(causal=True, diagonal="bottom_right")

needs_dp = pytest.mark.skipif(
    not native.available() or not native.build_info().get("bf16_dot"),
    reason="the bfloat16 dot products need the native kernel built with AVX512-BF16")

# (Hq, Hkv, D, Dv, shared): MLA's latent cache (the values the keys' first 512 dims) and GQA;
# gqa96: three rows a kv head (the one-row loop) and 32 value dims a pass (Dv % 64 != 0)
SHAPES = {"mla": (16, 1, 576, 512, True), "gqa": (8, 2, 128, 128, False),
          "gqa96": (6, 2, 96, 96, False)}


@pytest.fixture
def pv_switch():
    before = native.DECODE_BF16_PV
    yield
    native.DECODE_BF16_PV = before


def _problem(shape, lq, lens, seed=0):
    hq, hkv, d, dv, shared = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    lk = max(lens)
    q = torch.randn(len(lens), hq, lq, d, generator=g).bfloat16()
    k = torch.randn(len(lens), hkv, lk, d, generator=g).bfloat16()
    v = k[..., :dv] if shared else torch.randn(len(lens), hkv, lk, dv, generator=g).bfloat16()
    return q, k, v, torch.tensor(lens)


def _oracle(q, k, v, lens):
    """float64 oracle and the same computation in torch bfloat16, row by row of the batch."""
    ref, plain = [], []
    for b, n in enumerate(lens.tolist()):
        qb, kb, vb = q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n]
        ref.append(attention_reference(qb.double(), kb.double(), vb.double(), **KW)[0])
        lq = qb.shape[2]
        vis = torch.arange(n) <= torch.arange(lq).view(lq, 1) + n - lq
        plain.append(naive_attention(qb, kb, vb, mask=vis)[0])
    return torch.stack(ref), torch.stack(plain)


def _pages(x, lens, page, seed=1):
    """``x (B, Hkv, L, D)`` in shuffled pages ``(num_pages, page, Hkv, D)`` (padding NaN, which
    no row may read) and the block table."""
    b, hkv, lk, d = x.shape
    per = -(-lk // page)
    perm = torch.randperm(b * per, generator=torch.Generator().manual_seed(seed))
    pages = torch.full((b * per, page, hkv, d), float("nan"), dtype=x.dtype)
    table = perm.view(b, per)
    for s in range(b):
        n = int(lens[s])
        for c in range(-(-n // page)):
            rows = x[s, :, c * page:min(n, (c + 1) * page)].transpose(0, 1)
            pages[table[s, c], :rows.shape[0]] = rows
    return pages, table


def _run(q, k, v, lens, layout, **options):
    scale = q.shape[-1] ** -0.5
    if layout == "contiguous":
        return native.dense_decode(q, k, v, scale, seqlens=lens, **KW, **options)[0]
    kp, table = _pages(k, lens, 16)
    vp = kp[..., :v.shape[-1]] if v.data_ptr() == k.data_ptr() else _pages(v, lens, 16)[0]
    return native.paged_decode(q, kp, vp, table, lens, scale=scale, **KW, **options)[0]


@needs_dp
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("lq", [1, 2])
@pytest.mark.parametrize("lens", [[1], [7], [33], [33, 7, 1, 130]], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_pv_against_the_oracle(shape, lens, lq, layout, pv_switch):
    lens = [max(n, lq) for n in lens]
    q, k, v, lens = _problem(shape, lq, lens)
    ref, plain = _oracle(q, k, v, lens)
    native.DECODE_BF16_PV = True
    with torch.no_grad():
        out = _run(q, k, v, lens, layout)
    ok, err, base = fa_tolerance_ok(out, ref, plain)
    assert ok, (err, base)
    ok, err, base = fa_tolerance_ok(out.bfloat16(), ref, plain)
    assert ok, (err, base)


@needs_dp
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_switch_off_keeps_float32_pv(shape, layout, pv_switch):
    """Off: P V in float32 (float32 accuracy on the bfloat16 inputs); on: P rounded to bfloat16,
    a different result within FlashAttention's rule."""
    q, k, v, lens = _problem(shape, 2, [200, 33, 7], seed=3)
    ref, plain = _oracle(q, k, v, lens)
    with torch.no_grad():
        native.DECODE_BF16_PV = False
        off = _run(q, k, v, lens, layout)
        native.DECODE_BF16_PV = True
        on = _run(q, k, v, lens, layout)
    torch.testing.assert_close(off.double(), ref, atol=2e-6, rtol=2e-5)
    assert not torch.equal(on, off)
    ok, err, base = fa_tolerance_ok(on, ref, plain)
    assert ok, (err, base)


@needs_dp
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_pv_bits_repeat_over_runs_and_threads(shape, layout, pv_switch):
    q, k, v, lens = _problem(shape, 1, [300, 65, 7], seed=4)
    native.DECODE_BF16_PV = True
    with torch.no_grad():
        first = _run(q, k, v, lens, layout, splits=3, threads=2)
        for threads in (2, 1, 2):
            assert torch.equal(_run(q, k, v, lens, layout, splits=3, threads=threads), first)
        one = _run(q, k, v, lens, layout, splits=1, threads=1)
        assert torch.equal(_run(q, k, v, lens, layout, splits=1, threads=2), one)
