"""The flash kernel's forward over fp8 pages (float8_e4m3fn / float8_e5m2 with a descale per
(page, kv head)), read in place through the block table for query blocks longer than the
decode executor's, against the float64 oracle on the dequantized pages and against the path
that gathers them.

Pages are built with a shuffled block table; every page no sequence uses, every slot past a
sequence's length (and their descales) hold NaN, so a read out of bounds shows as a NaN or a
fallback rather than passing unseen.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import fa_tolerance_ok, spy

import attnkit
from attnkit import backends, native
from attnkit.backends import decode, flash, fused, tiled
from attnkit.doors import paged as paged_doors
from attnkit.kv import paged as kv_paged
from attnkit.kv.pages import gather_kv
from attnkit.reference import attention_reference as ref
from attnkit.spec import Options, PagedKV

pytestmark = pytest.mark.skipif(
    not (native.available() and native.build_info().get("flash")),
    reason="the native flash kernel needs a C compiler and an AVX-512 or AVX2 + FMA CPU")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN_BYTE = 0x7F  # NaN in both formats (e4m3fn: S.1111.111; e5m2: S.11111.11)


def _fp8_pages(lens, page, fmt, hkv=2, d=64, dv=None, seed=0, spare=3):
    """Random fp8 pages ``(P, page, Hkv, D)`` of sequences of lengths ``lens`` in a shuffled
    order with descales ``(P, Hkv)`` that are not powers of two (so the product rounds), a
    block table padded with -1; unused pages, slots past each length and the descales of
    unused pages are NaN."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    used = [-(-int(x) // page) for x in lens]
    total = sum(used) + spare
    order = torch.randperm(total, generator=g)
    kp = torch.full((total, page, hkv, d), NAN_BYTE, dtype=torch.uint8)
    vp = torch.full((total, page, hkv, dv), NAN_BYTE, dtype=torch.uint8)
    kd = torch.full((total, hkv), float("nan"))
    vd = torch.full((total, hkv), float("nan"))
    table = torch.full((len(lens), max(max(used), 1)), -1, dtype=torch.int32)
    top = torch.finfo(fmt).max
    nxt = 0
    for b, length in enumerate(lens):
        for c in range(used[b]):
            pg = int(order[nxt])
            nxt += 1
            table[b, c] = pg
            n = min(page, int(length) - c * page)
            for x, dim in ((kp, d), (vp, dv)):
                vals = (torch.randn(n, hkv, dim, generator=g) * top / 8).clamp(-top, top)
                x[pg, :n] = vals.to(fmt).view(torch.uint8)
            kd[pg] = (torch.rand(hkv, generator=g) + 0.5) * 3.0 / top
            vd[pg] = (torch.rand(hkv, generator=g) + 0.5) * 8.0 / top
    return (kp.view(fmt), vp.view(fmt), kd, vd, table,
            torch.as_tensor(lens, dtype=torch.int32))


def _dequantized(kp, vp, kd, vd, table, lens, dtype=torch.float64):
    return gather_kv(kp, vp, table, lens, k_descale=kd, v_descale=vd, dtype=dtype)


@pytest.fixture
def in_place(monkeypatch):
    """Asserts (after the test) that the flash kernel ran and nothing gathered the pages or
    ran another executor's forward; ``calls`` counts the flash forwards."""
    calls = spy(monkeypatch, flash, "forward")
    gathers = _gather_spies(monkeypatch)
    others = [spy(monkeypatch, mod, "forward") for mod in (fused, tiled)]
    yield calls
    assert calls and not any(gathers) and not any(others)


def _gather_spies(monkeypatch):
    """Lists that record the calls of gather_kv from the paged door and the executors (each
    spy's own list: a sum of them would be a copy, empty for good)."""
    return [spy(monkeypatch, mod, "gather_kv") for mod in (paged_doors, flash, decode)]


def _oracle_check(out, q, kp, vp, kd, vd, table, lens, kw):
    """``out`` against the float64 reference on the dequantized pages: float32 queries to
    float32 accuracy, lower precision by FlashAttention's rule (the plain baseline: q and the
    dequantized K/V rounded to q's dtype, the math in float64)."""
    okw = dict({"causal": True, "diagonal": "bottom_right"}, seqlens_kv=lens.long(), **kw)
    k, v = _dequantized(kp, vp, kd, vd, table, lens)
    want = ref(q.double(), k, v, **okw)
    if q.dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-5)
        return
    plain = ref(*(x.to(q.dtype).double() for x in (q, k, v)), **okw).to(q.dtype)
    ok, err, base = fa_tolerance_ok(out, want, plain)
    assert ok, (err, base)


TERMS = {
    "causal_br": dict(),
    "window": dict(window=(50, 0)),
    "softcap": dict(softcap=3.0),
    "dense_window_both": dict(causal=False, window=(40, 9)),
}


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("name", list(TERMS))
def test_fp8_pages_in_place_match_the_oracle(fmt, dtype, page, name, in_place):
    """GQA (8 query heads over 2), two sequences of different lengths, each query block the
    last 70 tokens of its sequence (causal bottom-right per sequence)."""
    lens = (300, 130)
    kp, vp, kd, vd, table, lens32 = _fp8_pages(lens, page, fmt, seed=page)
    q = torch.randn(2, 8, 70, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = attnkit.paged_attention_blocks(q, kp, vp, table, lens32, k_descale=kd,
                                         v_descale=vd, **TERMS[name])
    assert out.dtype == dtype and not bool(out.isnan().any())
    _oracle_check(out, q, kp, vp, kd, vd, table, lens32, TERMS[name])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 48])
def test_in_place_equals_the_gathered_call_bit_for_bit(fmt, dtype, d, in_place):
    """The kernel rounds each dequantized row to q's dtype as gather_kv does, so its blocks
    are those of the call on the gathered, dequantized K/V: the same bits (with D = 48 the
    bfloat16 call runs in float32 arithmetic, with D = 64 in bfloat16 dot products where the
    CPU has them: both paths dequantize alike). Every byte value but NaN (and e5m2's
    infinities) occurs: zeros of both signs, denormals, the largest values."""
    lens = (200, 77)
    kp, vp, kd, vd, table, lens32 = _fp8_pages(lens, 16, fmt, d=d, seed=5)
    g = torch.Generator().manual_seed(6)
    finite = torch.tensor([b for b in range(256)
                           if torch.isfinite(torch.tensor([b], dtype=torch.uint8).view(fmt)
                                             .float()).all()], dtype=torch.uint8)
    for x in (kp, vp):  # (every slot a sequence uses: a random finite byte)
        raw = x.view(torch.uint8)
        rows = table[table >= 0].long()
        pick = torch.randint(0, finite.numel(), raw[rows].shape, generator=g)
        raw[rows] = finite[pick]
    kd[table[table >= 0].long()] *= 1e-3  # (scores of a few units)
    q = torch.randn(2, 4, 33, d, generator=g).to(dtype)
    out, lse = attnkit.paged_attention_blocks(q, kp, vp, table, lens32, k_descale=kd,
                                              v_descale=vd, return_lse=True, window=(70, 0))
    k, v = _dequantized(kp, vp, kd, vd, table, lens32, dtype=dtype)
    want, wlse = attnkit.attention(q, k, v, return_lse=True, backend="flash",
                                   seqlens_kv=lens32.long(), causal=True,
                                   diagonal="bottom_right", window=(70, 0))
    assert torch.equal(out, want) and torch.equal(lse, wlse)


def test_varlen_mixes_decode_rows_and_a_long_chunk(monkeypatch):
    """One varlen call over fp8 pages: decoding rows run on the decode executor, the long
    chunk on the flash kernel, none gathered; each sequence against the oracle."""
    flash_calls = spy(monkeypatch, flash, "forward")
    decode_calls = spy(monkeypatch, decode, "forward")
    gathers = _gather_spies(monkeypatch)
    for fmt in (E4M3, E5M2):
        lens = (500, 40, 260, 1000)
        rows = (1, 1, 200, 1)
        kp, vp, kd, vd, table, used = _fp8_pages(lens, 64, fmt, seed=7)
        g = torch.Generator().manual_seed(8)
        q = torch.randn(sum(rows), 8, 64, generator=g).bfloat16()
        cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
        kw = dict(window=(300, 0), softcap=20.0)
        with torch.no_grad():
            out = attnkit.varlen_attention(q, kp, vp, cu, None, max(rows), max(lens),
                                           seqused_kv=used, block_table=table, k_descale=kd,
                                           v_descale=vd, **kw)
        for s in range(len(lens)):
            qs = q[cu[s]:cu[s + 1]].transpose(0, 1).unsqueeze(0)  # (1, Hq, rows, D)
            one = slice(s, s + 1)
            _oracle_check(out[cu[s]:cu[s + 1]].transpose(0, 1).unsqueeze(0), qs, kp, vp, kd,
                          vd, table[one], used[one], kw)
    assert len(flash_calls) == 2 and len(decode_calls) == 2 and not any(gathers)


def test_the_executor_choice_over_fp8_pages():
    """flash for a 512-row chunk (and for row counts past the decode executor's limits),
    decode for a few rows (at most 16 rows and 32 per kv head)."""
    kp, vp, kd, vd, table, lens = _fp8_pages((8192,), 256, E4M3, hkv=8, d=128, spare=0)

    def chosen(lq, hq=32):
        q = torch.zeros(1, hq, lq, 128, dtype=torch.bfloat16)
        opts = Options.from_kwargs("paged_attention", {"causal": True,
                                                       "diagonal": "bottom_right"},
                                   paged_doors.TAKES).merged(seqlens_kv=lens.long())
        spec = kv_paged.paged_spec(q, PagedKV(kp, vp, table.long(), kd, vd), opts)
        assert "fp8_kv" in spec.features()
        return backends.choose(spec)

    assert chosen(512) is flash and chosen(17, hq=16) is flash and chosen(16) is flash
    assert all(chosen(lq) is decode for lq in (1, 2, 8))
    assert chosen(16, hq=16) is decode  # (16 rows, 2 query heads a kv head: 32 rows)
    assert "fp8_kv" in flash.CAPS.features and "fp8_kv" not in flash.CAPS.why


def _gathered_path(q, kp, vp, kd, vd, table, lens, **kw):
    k, v = _dequantized(kp, vp, kd, vd, table, lens, dtype=q.dtype)
    return attnkit.attention(q, k, v, seqlens_kv=lens.long(), causal=True,
                             diagonal="bottom_right", **kw)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("where", ["k_byte", "v_byte", "k_descale", "v_descale_inf",
                                   "e5m2_inf"])
def test_a_non_finite_page_is_nan_as_on_the_gathered_path(fmt, where, monkeypatch):
    """A NaN (or an infinity) in an fp8 byte or a descale of a page sequence 1 uses: the kernel
    finds it and the call runs the next executor on the gathered pages, so sequence 1's rows
    are NaN exactly where the gathered path's are, and sequence 0's rows are finite and the
    same; never a finite value in place of the NaN."""
    if where == "e5m2_inf" and fmt != E5M2:
        pytest.skip("e4m3fn has no infinity")
    calls = spy(monkeypatch, flash, "forward")
    fallbacks = [spy(monkeypatch, mod, "forward") for mod in (fused, tiled)]
    lens = (150, 120)
    kp, vp, kd, vd, table, lens32 = _fp8_pages(lens, 16, fmt, seed=9)
    pg = int(table[1, 2])  # sequence 1's tokens 32..47, kv head 1
    if where == "k_byte":
        kp.view(torch.uint8)[pg, 3, 1, 5] = NAN_BYTE
    elif where == "v_byte":
        vp.view(torch.uint8)[pg, 3, 1, 20] = 0xFF  # (NaN, negative sign)
    elif where == "k_descale":
        kd[pg, 1] = float("nan")
    elif where == "v_descale_inf":
        vd[pg, 1] = float("inf")
    else:
        kp.view(torch.uint8)[pg, 3, 1, 5] = 0x7C  # e5m2 +inf
    q = torch.randn(2, 4, 100, 64, generator=torch.Generator().manual_seed(10)).bfloat16()
    out = attnkit.paged_attention_blocks(q, kp, vp, table, lens32, k_descale=kd, v_descale=vd)
    want = _gathered_path(q, kp, vp, kd, vd, table, lens32)
    assert calls and any(fallbacks)  # (the kernel ran, found it, and the next executor ran)
    assert torch.equal(out.isnan(), want.isnan())
    assert bool(out[1, 2:].isnan().any())  # (kv head 1: query heads 2, 3 of sequence 1)
    assert not bool(out[0].isnan().any()) and not bool(out[1, :2].isnan().any())
    torch.testing.assert_close(out.nan_to_num(), want.nan_to_num(), atol=0, rtol=0)


def test_nan_past_a_sequence_and_in_unused_pages_is_never_read(in_place):
    """The helper's pages hold NaN bytes and NaN descales wherever no sequence reads (slots
    past each length, pages and table entries no sequence uses): the call stays in place and
    finite."""
    kp, vp, kd, vd, table, lens32 = _fp8_pages((37, 100), 64, E4M3, seed=11)
    assert bool(kd.isnan().any()) and table.min() == -1
    q = torch.randn(2, 4, 30, 64, generator=torch.Generator().manual_seed(12))
    out = attnkit.paged_attention_blocks(q, kp, vp, table, lens32, k_descale=kd, v_descale=vd)
    assert torch.isfinite(out).all()
    _oracle_check(out, q, kp, vp, kd, vd, table, lens32, {})


def test_flash_pages_refuse_fp8_without_descales():
    kp, vp, kd, vd, table, lens = _fp8_pages((40,), 16, E4M3)
    q = torch.randn(1, 2, 20, 64)
    terms = native.FlashTerms(lo=torch.zeros(1, 20, dtype=torch.int32),
                              hi=torch.full((1, 20), 40, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"pages.k_descale, a float32 CPU tensor \(6, 2\)"):
        native.flash_forward(q, kp, vp, 0.1, terms, native.FlashPages(table, lens))
    with pytest.raises(ValueError, match=r"pages.v_descale.*got \(6,\)"):
        native.flash_forward(q, kp, vp, 0.1, terms,
                             native.FlashPages(table, lens, kd, vd[:, 0]))
    with pytest.raises(ValueError, match="are for fp8 pages; the pages are torch.float32"):
        native.flash_forward(q, kp.float(), vp.float(), 0.1, terms,
                             native.FlashPages(table, lens, kd, vd))
    with pytest.raises(TypeError, match="fp8 pages k and v must share one dtype"):
        native.flash_forward(q, kp, vp.view(torch.uint8).view(E5M2), 0.1, terms,
                             native.FlashPages(table, lens, kd, vd))


def test_the_kernel_refuses_fp8_codes_it_cannot_run():
    """An fp8 code that is no fp8 dtype: AK_BAD_DTYPE; fp8 without pages or descales:
    AK_BAD_LAYOUT (nothing read)."""
    kp, vp, kd, vd, table, lens = _fp8_pages((40,), 16, E4M3)
    q = torch.randn(1, 2, 20, 64)
    terms = native.FlashTerms(lo=torch.zeros(1, 20, dtype=torch.int32),
                              hi=torch.full((1, 20), 40, dtype=torch.int32))
    call = native.flash_prepare(q, kp, vp, 0.1, terms, native.FlashPages(table, lens, kd, vd))
    a = call._args_for(q, kp, vp)
    assert a.fp8 == native._C["AK_E4M3"]
    keep = native._workspace(a, backward=False)
    kt = torch.empty(call._kt)
    vf = torch.empty(call._vf)
    out, lse = torch.empty(1, 2, 20, 64), torch.empty(1, 2, 20)
    a.kt, a.vf, a.out, a.lse = kt.data_ptr(), vf.data_ptr(), out.data_ptr(), lse.data_ptr()
    lib, codes = native._lib(), native.error_codes()
    assert lib.attnkit_flash_forward(ctypes.byref(a)) == 0
    cases = {"AK_BAD_DTYPE": dict(fp8=native._C["AK_F16"]),
             "AK_BAD_LAYOUT": dict(kd=None)}
    for name, change in cases.items():
        b = native._FlashArgs.from_buffer_copy(a)
        for field, value in change.items():
            setattr(b, field, value)
        assert lib.attnkit_flash_forward(ctypes.byref(b)) == codes[name][0], name
    del keep


def test_fp8_caches_held_as_tensors_keep_long_query_blocks_dequantized(monkeypatch):
    """attention() and varlen_attention() over fp8 K/V held as tensors (not pages) read them
    in place only for the decode executor's calls; a longer query block is dequantized as
    before (the flash kernel is not routed there), with the dequantized call's result."""
    paged_flash = []
    original = flash.forward

    def watch(spec, plan):
        paged_flash.append(spec.paged is not None)
        return original(spec, plan)

    monkeypatch.setattr(flash, "forward", watch)
    g = torch.Generator().manual_seed(13)
    qp, kp, vp = (torch.randn(n, h, 64, generator=g) for n, h in ((40, 8), (300, 2), (300, 2)))
    (q8, dq), (k8, dk), (v8, dv) = (attnkit.quantize_fp8(x) for x in (qp, kp, vp))
    cu_q = torch.tensor([0, 20, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 150, 300], dtype=torch.int32)
    out = attnkit.varlen_attention(q8, k8, v8, cu_q, cu_k, 20, 150, descale_q=dq,
                                   descale_k=dk, descale_v=dv, causal=True)
    deq = [(x.float() * d).bfloat16() for x, d in ((q8, dq), (k8, dk), (v8, dv))]
    want = attnkit.varlen_attention(*deq, cu_q, cu_k, 20, 150, causal=True)
    assert torch.equal(out, want)
    q4, k4, v4 = (x.view(1, *x.shape).transpose(1, 2) for x in (q8, k8, v8))
    out = attnkit.attention(q4, k4, v4, descale_q=dq, descale_k=dk, descale_v=dv, causal=True)
    want = attnkit.attention(*(x.view(1, *x.shape).transpose(1, 2) for x in deq), causal=True)
    assert torch.equal(out, want)
    assert not any(paged_flash)
