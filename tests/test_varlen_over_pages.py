"""varlen_attention over a paged cache: packed queries of many sequences (decoding rows and
prefill chunks mixed) against their pages, each sequence's queries the last of its cached
tokens (bottom-right causal by default), checked per sequence against the float64 oracle."""

from __future__ import annotations

import pytest
import torch
from conftest import fa_tolerance_ok

import attnkit
from attnkit.reference import attention_reference

HQ, HKV, D, PAGE = 8, 2, 64, 16


def _cache(g, used, dtype, fp8=False):
    cache = attnkit.PagedKVCache(num_pages=64, page_size=PAGE, num_kv_heads=HKV, head_dim=D,
                                 dtype=torch.float8_e4m3fn if fp8 else dtype)
    keys = []
    for s, n in enumerate(used):
        cache.allocate(s)
        k = torch.randn(n, HKV, D, generator=g).to(dtype)
        v = torch.randn(n, HKV, D, generator=g).to(dtype)
        cache.append(s, k, v)
        keys.append((k, v))
    return cache, keys


def _reference(q, keys, cu, used, cache, kw):
    """Each sequence alone, over its cached tokens as the cache holds them."""
    outs = []
    for s in range(len(used)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        if rows.stop == rows.start:
            continue
        k, v = cache.gather([s])
        qs = q[rows].transpose(0, 1).unsqueeze(0).double()
        o = attention_reference(qs, k.double(), v.double(), causal=True,
                                diagonal="bottom_right",
                                **{n: (x[s:s + 1] if n == "alibi_slopes" and x.dim() == 2
                                       else x) for n, x in kw.items()})
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


CASES = [dict(), dict(window=(20, 0)), dict(softcap=3.0, scale=0.5),
         dict(alibi_slopes=attnkit.score_mods.alibi_slopes(HQ)), dict(sinks=None)]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(kw) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_decode_rows_and_prefill_chunks_in_one_call(kw, dtype):
    g = torch.Generator().manual_seed(0)
    rows = [1, 1, 37, 0, 5, 1, 20]  # (0: a sequence with nothing to compute this step)
    used = [40, 1, 37, 9, 130, 300, 50]
    cache, _ = _cache(g, used, dtype)
    if "sinks" in kw:
        kw = dict(sinks=torch.randn(HQ, generator=g))
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    q = torch.randn(int(cu[-1]), HQ, D, generator=g).to(dtype)
    table, lens = cache.block_table(list(range(len(used))))
    with torch.no_grad():
        out, lse = attnkit.varlen_attention(q, cache.k_pages, cache.v_pages, cu, None,
                                            max(rows), max(used), seqused_kv=lens,
                                            block_table=table, return_lse=True, **kw)
    assert out.shape == (q.shape[0], HQ, D) and out.dtype == dtype and lse.shape == (HQ, q.shape[0])
    ref = _reference(q, None, cu, used, cache, kw)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    else:
        plain = _reference(q.float().to(dtype), None, cu, used, cache, kw).to(dtype)
        ok, err, bound = fa_tolerance_ok(out, ref, plain, mult=3.0)
        assert ok, (err, bound)
    assert torch.isfinite(lse).all()


def test_fp8_pages_are_read_with_their_descales():
    g = torch.Generator().manual_seed(1)
    used = [33, 3, 200]  # (query rows 1, 3, 1: cu below)
    cache, _ = _cache(g, used, torch.float32, fp8=True)
    cu = torch.tensor([0, 1, 4, 5])
    q = torch.randn(5, HQ, D, generator=g)
    table, lens = cache.block_table([0, 1, 2])
    with torch.no_grad():
        out = attnkit.varlen_attention(q, cache.k_pages, cache.v_pages, cu, None,
                                       seqused_kv=lens, block_table=table,
                                       k_descale=cache.k_descale, v_descale=cache.v_descale)
    ref = _reference(q, None, cu, used, cache, {})  # (gather dequantizes the pages)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_the_paged_form_refuses_what_it_cannot_carry():
    g = torch.Generator().manual_seed(2)
    cache, _ = _cache(g, [4], torch.float32)
    table, lens = cache.block_table([0])
    q = torch.randn(1, HQ, D, generator=g)
    cu = torch.tensor([0, 1])
    args = (q, cache.k_pages, cache.v_pages, cu, None)
    with pytest.raises(NotImplementedError, match="does not take dropout_p"):
        attnkit.varlen_attention(*args, seqused_kv=lens, block_table=table, dropout_p=0.1)
    with pytest.raises(ValueError, match="needs seqused_kv"):
        attnkit.varlen_attention(*args, block_table=table)
    with pytest.raises(NotImplementedError, match="forward only"):
        attnkit.varlen_attention(q.requires_grad_(), *args[1:], seqused_kv=lens,
                                 block_table=table)
    with pytest.raises(NotImplementedError, match="seqused_kv is for a paged cache"):
        attnkit.varlen_attention(q.detach(), q.detach(), q.detach(), cu, cu, seqused_kv=lens)
