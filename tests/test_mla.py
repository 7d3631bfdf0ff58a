"""MLA's shared latent cache (DeepSeek-style multi-head latent attention, absorbed form): one
latent kv head of 576 dims whose first 512 are the values, ``attention(q, ckv, ckv[..., :512])``
and its paged forms, against the float64 oracle; the decode kernel reads each cached row once
when the values are a view into the keys (and only then), with the same output as the call
with the values as a separate copy."""

from __future__ import annotations

import pytest
import torch
from conftest import fa_tolerance_ok, naive_attention

import attnkit
from attnkit import backends, native
from attnkit.reference import attention_reference
from attnkit.spec import build_spec

DQK, DV = 576, 512
KW = dict(causal=True, diagonal="bottom_right")

needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason=f"native kernel: {native.unavailable_reason()}")


def _visible(lq, lens, lk):
    """(B, 1, Lq, Lk) bottom-right causal visibility over each row's first lens[b] keys."""
    j = torch.arange(lk)
    i = torch.arange(lq).view(lq, 1)
    rows = [(j < n) & (j <= i + n - lq) for n in lens.tolist()]
    return torch.stack(rows).unsqueeze(1)


def _check(out, q, k, v, lens, dtype, scale=None):
    """``out`` against the float64 oracle: float32 to 2e-6 / 2e-5, bfloat16 by FlashAttention's
    rule against the same computation in torch bfloat16 (error at most 2x its error + 1e-5)."""
    ref = attention_reference(q.double(), k.double(), v.double(), seqlens_kv=lens, scale=scale,
                              **KW)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
        return
    mask = _visible(q.shape[2], lens, k.shape[2])
    plain = naive_attention(q, k, v, mask=mask, scale=scale)
    ok, err, base = fa_tolerance_ok(out, ref, plain)
    assert ok, (err, base)


def _latent(b, hq, lq, lk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, DQK, generator=g).to(dtype)
    ckv = torch.randn(b, 1, lk, DQK, generator=g).to(dtype)
    return q, ckv


def _shared_calls():
    return native.decode_counts()["shared_rows"]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,lq", [(16, 1), (16, 3), (128, 1), (128, 2)])
def test_contiguous_latent_cache_read_once_against_the_oracle(hq, lq, dtype):
    q, ckv = _latent(3, hq, lq, 150, dtype)
    v = ckv[..., :DV]
    lens = torch.tensor([150, 77, lq])  # right padding, one row with only its own keys
    before = _shared_calls()
    with torch.no_grad():
        out = attnkit.attention(q, ckv, v, seqlens_kv=lens, **KW)
    assert _shared_calls() == before + 1  # the decode kernel, reading the latent rows once
    assert out.shape == (3, hq, lq, DV) and out.dtype == dtype
    _check(out, q, ckv, v, lens, dtype)
    with torch.no_grad():
        copy = attnkit.attention(q, ckv, v.contiguous(), seqlens_kv=lens, **KW)
    assert _shared_calls() == before + 1  # (a separate copy is read as separate rows)
    assert torch.equal(out, copy)  # the read-once path keeps the general loops' arithmetic


@pytest.mark.parametrize("hq,lq", [(16, 1), (16, 2), (16, 4), (128, 1), (128, 3)])
def test_latent_decoding_picks_the_decode_executor(hq, lq):
    """Past the flash kernel's head dims the decode kernel takes any number of rows per kv
    head (the fused executor's matmuls were 20-40x slower there); at Dqk=128 the 32-row cap
    still sends many rows to the matmul executors."""
    q, ckv = _latent(2, hq, lq, 40, torch.bfloat16)
    spec = build_spec(q, ckv, ckv[..., :DV], **KW)
    assert backends.choose(spec) is backends.REGISTRY["decode"]
    q, k = q[..., :128], ckv[..., :128]
    chosen = backends.choose(build_spec(q, k, k, **KW))
    assert (chosen is backends.REGISTRY["decode"]) == (hq * lq <= 32), chosen


def _pages(ckv, lens, page, dtype, seed=1):
    """The latent rows of ``ckv (B, 1, L, D)`` in shuffled pages ``(num_pages, page, 1, D)``
    (page padding filled with NaN, which no row may read) and their block table."""
    b, _, lk, d = ckv.shape
    per = -(-lk // page)
    perm = torch.randperm(b * per, generator=torch.Generator().manual_seed(seed))
    pages = torch.full((b * per + 1, page, 1, d), float("nan")).to(dtype)
    table = perm.view(b, per)
    for s in range(b):
        n = int(lens[s])
        for c in range(-(-n // page)):
            rows = ckv[s, 0, c * page:min(n, (c + 1) * page)]
            pages[table[s, c], :rows.shape[0], 0] = rows.to(dtype)
    return pages, table


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,lq,page", [(16, 1, 64), (16, 4, 16), (128, 1, 256), (128, 2, 64)])
def test_paged_latent_cache_read_once_against_the_oracle(hq, lq, page, dtype):
    q, ckv = _latent(3, hq, lq, 300, dtype, seed=2)
    lens = torch.tensor([300, 65, 130])
    k_pages, table = _pages(ckv, lens, page, dtype)
    v_pages = k_pages[..., :DV]
    before = _shared_calls()
    with torch.no_grad():
        out = attnkit.paged_attention_blocks(q, k_pages, v_pages, table, lens, **KW)
    assert _shared_calls() == before + 1
    _check(out, q, ckv, ckv[..., :DV], lens, dtype)
    with torch.no_grad():
        copy = attnkit.paged_attention_blocks(q, k_pages, v_pages.contiguous(), table, lens,
                                              **KW)
    assert _shared_calls() == before + 1 and torch.equal(out, copy)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_varlen_over_latent_pages_mixes_decoding_and_speculative_rows(dtype):
    """Packed query rows (1, 3 and 2 rows: speculative decoding) over the paged latent cache
    through ``varlen_attention(block_table=, seqused_kv=)``, each sequence's rows the last of
    its keys."""
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([200, 70, 129])  # (1, 3 and 2 query rows: cu below)
    ckv = torch.randn(3, 1, 200, DQK, generator=g).to(dtype)
    k_pages, table = _pages(ckv, lens, 64, dtype)
    cu = torch.tensor([0, 1, 4, 6])
    q = torch.randn(6, 16, DQK, generator=g).to(dtype)
    before = _shared_calls()
    with torch.no_grad():
        out = attnkit.varlen_attention(q, k_pages, k_pages[..., :DV], cu, None, 3, 200,
                                       seqused_kv=lens, block_table=table)
    assert _shared_calls() > before  # (read once)
    assert out.shape == (6, 16, DV)
    for s in range(3):
        qs = q[int(cu[s]):int(cu[s + 1])].transpose(0, 1).unsqueeze(0)
        n = lens[s:s + 1]
        _check(out[int(cu[s]):int(cu[s + 1])].transpose(0, 1).unsqueeze(0), qs,
               ckv[s:s + 1], ckv[s:s + 1, ..., :DV], n, dtype)


@needs_kernel
@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no fp8 dtypes")
def test_fp8_latent_pages_read_once_with_their_descales():
    """fp8 latent pages with one descale per (page, head) for keys and values alike, the values
    a view into the key pages: read once too, against the oracle over the dequantized pages."""
    g = torch.Generator().manual_seed(4)
    lens = torch.tensor([190, 64])
    ckv = torch.randn(2, 1, 190, DQK, generator=g)
    k32, table = _pages(ckv, lens, 64, torch.float32)
    k32 = k32.nan_to_num(0.0)
    descale = torch.rand(k32.shape[0], 1, generator=g) * 0.5 + 0.25
    k8 = (k32 / descale.view(-1, 1, 1, 1)).to(torch.float8_e4m3fn)
    deq = k8.float() * descale.view(-1, 1, 1, 1)
    q = torch.randn(2, 16, 2, DQK, generator=g).bfloat16()
    before = _shared_calls()
    with torch.no_grad():
        out = attnkit.paged_attention_blocks(q, k8, k8[..., :DV], table, lens,
                                             k_descale=descale, v_descale=descale, **KW)
        copy = attnkit.paged_attention_blocks(q, k8, k8[..., :DV].contiguous(), table, lens,
                                              k_descale=descale, v_descale=descale, **KW)
    assert _shared_calls() == before + 1 and torch.equal(out, copy)
    dense = torch.stack([deq[table[s]].reshape(-1, 1, DQK)[:190].transpose(0, 1)
                         for s in range(2)])  # (2, 1, 190, 576)
    ref = attention_reference(q.double(), dense.double(), dense[..., :DV].double(),
                              seqlens_kv=lens, **KW)
    plain = attention_reference(q.double(), dense.bfloat16().double(),
                                dense[..., :DV].bfloat16().double(), seqlens_kv=lens,
                                **KW).bfloat16()
    ok, err, base = fa_tolerance_ok(out, ref, plain)
    assert ok, (err, base)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_only_values_inside_the_key_rows_take_the_read_once_path(dtype):
    """Each value view is read where it lies: inside the key rows at any offset (read once),
    or past them, or with other strides (read as separate rows); every form gives the output
    of its own contiguous copy, bit for bit."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 16, 2, DQK, generator=g).to(dtype)
    big = torch.randn(2, 1, 2 * 96, 640, generator=g).to(dtype)
    ckv = big[:, :, :96, :DQK]  # key rows of 576 in rows of 640
    lens = torch.tensor([96, 50])
    forms = {  # value view -> read once
        "first 512": (ckv[..., :DV], True),
        "last 512 (offset 64)": (ckv[..., 64:DQK], True),
        "past the key rows (offset 100: 612 > 576)": (big[:, :, :96, 100:612], False),
        "every other token (other strides)": (big[:, :, ::2, :DV], False),
        "another tensor": (torch.randn(2, 1, 96, DV, generator=g).to(dtype), False),
    }
    for name, (v, once) in forms.items():
        before = _shared_calls()
        with torch.no_grad():
            out = attnkit.attention(q, ckv, v, seqlens_kv=lens, **KW)
        assert _shared_calls() == before + once, name
        with torch.no_grad():
            copy = attnkit.attention(q, ckv, v.contiguous(), seqlens_kv=lens, **KW)
        assert torch.equal(out, copy), name
        _check(out, q, ckv, v, lens, dtype)


@needs_kernel
def test_the_kernel_refuses_a_false_claim_of_shared_rows(monkeypatch):
    """The kernel checks the claim itself (check_args): values that do not lie inside the key
    rows with the keys' strides are refused, never read as if they did."""
    q, ckv = _latent(2, 16, 1, 64, torch.bfloat16)
    monkeypatch.setattr(native, "_shared_rows", lambda *args: True)
    with pytest.raises(ValueError, match="refused its arguments"):
        native.dense_decode(q, ckv, ckv[..., :DV].contiguous(), DQK ** -0.5)


@needs_kernel
def test_the_read_once_path_can_be_turned_off_for_timings(monkeypatch):
    q, ckv = _latent(2, 16, 1, 64, torch.bfloat16)
    on = native.dense_decode(q, ckv, ckv[..., :DV], DQK ** -0.5)
    monkeypatch.setitem(native._SHARED_ROWS, "enabled", False)
    before = _shared_calls()
    off = native.dense_decode(q, ckv, ckv[..., :DV], DQK ** -0.5)
    assert _shared_calls() == before
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,lq,d,dv", [(10, 2, 1, 192, 128), (8, 2, 2, 256, 256),
                                            (6, 1, 3, 144, 64)])
def test_wide_heads_through_the_score_tiles_against_the_oracle(hq, hkv, lq, d, dv, dtype):
    """The decode kernel's 4-row x 4-key score tiles run every head dim past 128, shared rows or
    not: groups of 4 rows and the rows past them (5, 8 and 18 rows a kv head), the keys past
    the last group of 4 (lengths not multiples of 4), two kv heads."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, hq, lq, d, generator=g).to(dtype)
    k = torch.randn(3, hkv, 203, d, generator=g).to(dtype)
    v = torch.randn(3, hkv, 203, dv, generator=g).to(dtype)
    lens = torch.tensor([203, 130, 7])
    with torch.no_grad():
        out = attnkit.attention(q, k, v, seqlens_kv=lens, backend="decode", **KW)
    ref = attention_reference(q.double(), k.double(), v.double(), seqlens_kv=lens, **KW)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
        return
    plain = naive_attention(q, k, v, mask=_visible(lq, lens, 203))
    ok, err, base = fa_tolerance_ok(out, ref, plain)
    assert ok, (err, base)


@needs_kernel
@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no fp8 dtypes")
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("d,dv,hkv,lq", [(128, 64, 2, 1), (64, 64, 1, 2)])
def test_fp8_value_views_of_narrow_heads_give_the_copys_output(fmt, d, dv, hkv, lq):
    """Shared rows on the fp8 loops of narrow heads (the float16 arithmetic of e4m3 and the
    table conversions, which ask for no value rows of their own then): the copy's output."""
    g = torch.Generator().manual_seed(7)
    pages = torch.randn(12, 16, hkv, d, generator=g).to(getattr(torch, fmt))
    descale = torch.rand(12, hkv, generator=g) + 0.5
    q = torch.randn(2, 8, lq, d, generator=g).bfloat16()
    table = torch.tensor([[3, 1, 4, 0, 7, 8], [9, 2, 6, 5, 10, 11]])
    lens = torch.tensor([90, 37])
    kw = dict(k_descale=descale, v_descale=descale, **KW)
    before = _shared_calls()
    with torch.no_grad():
        out = attnkit.paged_attention_blocks(q, pages, pages[..., :dv], table, lens, **kw)
        copy = attnkit.paged_attention_blocks(q, pages, pages[..., :dv].clone(), table, lens,
                                              **kw)  # (v = k whole: its own copy)
    assert _shared_calls() == before + 1 and torch.equal(out, copy)


def test_a_paged_cache_can_hold_one_latent_per_token():
    """``PagedKVCache(values_in_keys=True)``: MLA's latent cache, the values the first Dv
    dims of each key row (one tensor; ``v_pages`` a view of ``k_pages``), appended once,
    read by paged_attention as attention(q, ckv, ckv[..., :Dv]) and equal to the oracle."""
    g = torch.Generator().manual_seed(7)
    cache = attnkit.PagedKVCache(8, 16, 1, 576, dtype=torch.float32, v_head_dim=512,
                                 values_in_keys=True)
    assert cache.v_pages.data_ptr() == cache.k_pages.data_ptr()
    assert cache.v_pages.shape == (8, 16, 1, 512)
    lens = {"a": 37, "b": 5}
    latents = {s: torch.randn(n, 1, 576, generator=g) for s, n in lens.items()}
    for s, ckv in latents.items():
        cache.allocate(s)
        cache.append(s, ckv[:20], None)
        cache.append(s, ckv[20:])  # v may be left out
    q = torch.randn(2, 16, 1, 576, generator=g)
    before = native.decode_counts()["shared_rows"] if native.available() else 0
    out = attnkit.paged_attention(q, cache, ["a", "b"], scale=576 ** -0.5)
    if native.available():  # the decode kernel read the latent rows once
        assert native.decode_counts()["shared_rows"] > before
    for i, ckv in enumerate(latents.values()):
        k = ckv.transpose(0, 1)[None].double()
        ref = attnkit.attention_reference(q[i:i + 1].double(), k, k[..., :512],
                                          scale=576 ** -0.5, causal=True,
                                          diagonal="bottom_right")
        assert (out[i:i + 1].double() - ref).abs().max() < 1e-5
    with pytest.raises(ValueError, match="values_in_keys"):
        cache.append("a", latents["a"][:1], latents["a"][:1, :, :512] + 1)
    with pytest.raises(ValueError, match="v_head_dim"):
        attnkit.PagedKVCache(8, 16, 1, 576, v_head_dim=640, values_in_keys=True)
    with pytest.raises(NotImplementedError, match="fp8"):
        attnkit.PagedKVCache(8, 16, 1, 576, v_head_dim=512, values_in_keys=True,
                             dtype=torch.float8_e4m3fn)
    plain = attnkit.PagedKVCache(8, 16, 1, 64)
    plain.allocate("x")
    with pytest.raises(TypeError, match="v is required"):
        plain.append("x", torch.zeros(1, 1, 64), None)
