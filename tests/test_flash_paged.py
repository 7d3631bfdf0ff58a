"""The flash kernel's forward over paged K/V (read in place through the block table), its row
maxima (``AuxRequest(max_scores=True)``) and the MLA head dims, against the float64 oracle.

Pages are built from contiguous K/V with a shuffled block table; every page no sequence uses,
every slot past a sequence's length and every table entry past its pages hold NaN or -1, so a
read out of bounds shows as a NaN (or a fallback) rather than passing unseen.
"""

from __future__ import annotations

import pytest
import torch
from conftest import check_oracle, fa_tolerance_ok, rand, spy

import attnkit
from attnkit import backends, native, paged
from attnkit.backends import flash, fused, tiled
from attnkit.doors import paged as paged_doors
from attnkit.reference import attention_reference as ref
from attnkit.reference import scores as ref_scores
from attnkit.spec import PagedKV, build_spec

pytestmark = pytest.mark.skipif(
    not (native.available() and native.build_info().get("flash")),
    reason="the native flash kernel needs a C compiler and an AVX-512 or AVX2 + FMA CPU")

SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.3, 0.2, 0.1, 0.05])


def _to_pages(k, v, lens, page, seed=0, spare=3):
    """``k (N, Hkv, L, D)`` and ``v`` as pages ``(P, page, Hkv, D)`` in a shuffled order, with
    ``spare`` unused pages; unused pages, slots past each length and table padding are NaN
    (pages) and -1 (table)."""
    n, hkv, _, d = k.shape
    dv = v.shape[-1]
    used = [-(-int(x) // page) for x in lens]
    width = max(max(used), 1)
    total = sum(used) + spare
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    kp = torch.full((total, page, hkv, d), float("nan"), dtype=k.dtype)
    vp = torch.full((total, page, hkv, dv), float("nan"), dtype=v.dtype)
    table = torch.full((n, width), -1, dtype=torch.int32)
    nxt = 0
    for b in range(n):
        for c in range(used[b]):
            pg = int(order[nxt])
            nxt += 1
            table[b, c] = pg
            j0, j1 = c * page, min((c + 1) * page, int(lens[b]))
            kp[pg, :j1 - j0] = k[b, :, j0:j1].transpose(0, 1)
            vp[pg, :j1 - j0] = v[b, :, j0:j1].transpose(0, 1)
    return kp, vp, table, torch.as_tensor(lens, dtype=torch.int32)


def _inputs(n=2, hq=8, hkv=2, lq=70, lens=(300, 130), d=64, dv=None, dtype=torch.float32,
            seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    lk = max(lens)
    q = rand(n, hq, lq, d, dtype=dtype, gen=g)
    k = rand(n, hkv, lk, d, dtype=dtype, gen=g)
    v = rand(n, hkv, lk, dv, dtype=dtype, gen=g)
    for b, length in enumerate(lens):  # (the oracle's keys: zero past each length)
        k[b, :, length:] = 0
        v[b, :, length:] = 0
    return q, k, v, torch.tensor(lens)


@pytest.fixture
def flash_in_place(monkeypatch):
    """Asserts (after the test) that every paged call ran on the flash kernel with no
    gather: ``calls`` counts its forwards."""
    calls = spy(monkeypatch, flash, "forward")
    # (each spy's own list: a sum of them would be a copy, empty whatever runs)
    gathers = [spy(monkeypatch, mod, "gather_kv") for mod in (paged_doors, flash)]
    others = [spy(monkeypatch, mod, "forward") for mod in (fused, tiled)]
    yield calls
    assert calls and not any(gathers) and not any(others)


def _paged_call(q, kp, vp, table, lens, **kw):
    return attnkit.paged_attention_blocks(q, kp, vp, table, lens, return_lse=True, **kw)


TERMS = {
    "causal_br": dict(),  # (the paged default: causal, bottom-right)
    "dense": dict(causal=False),
    "window": dict(window=(50, 0)),
    "window_both": dict(causal=False, window=(40, 9)),
    "softcap": dict(softcap=3.0),
    "alibi": dict(alibi_slopes=SLOPES),
    "sinks": dict(sinks=torch.linspace(-1.0, 2.0, 8)),
    "scale": dict(scale=0.05, window=(100, 0)),
}


def _oracle_kw(kw):
    return dict({"causal": True, "diagonal": "bottom_right"}, **kw)


@pytest.mark.parametrize("name", list(TERMS))
@pytest.mark.parametrize("page", [16, 64, 100])
def test_paged_forward_matches_the_oracle(name, page, flash_in_place):
    q, k, v, lens = _inputs()
    kp, vp, table, lens32 = _to_pages(k, v, lens, page, seed=page)
    kw = TERMS[name]
    out, lse = _paged_call(q, kp, vp, table, lens32, **kw)
    okw = dict(_oracle_kw(kw), seqlens_kv=lens)
    check_oracle(out, q, k, v, okw, torch.float32)
    _, rl = ref(q.double(), k.double(), v.double(), return_lse=True, **okw)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin].double() - rl[fin]).abs().max().item() < 2e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [32, 256, 50])
def test_half_precision_pages_keep_flash_attentions_rule(dtype, page, flash_in_place):
    q, k, v, lens = _inputs(hq=8, hkv=1, lq=90, lens=(520, 91), d=64, dtype=dtype)
    kp, vp, table, lens32 = _to_pages(k, v, lens, page, seed=1)
    for kw in (dict(), dict(window=(64, 0)), dict(softcap=4.0, alibi_slopes=SLOPES)):
        out, _ = _paged_call(q, kp, vp, table, lens32, **kw)
        check_oracle(out, q, k, v, dict(_oracle_kw(kw), seqlens_kv=lens), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 48, 64])
def test_paged_equals_the_contiguous_call_bit_for_bit(dtype, page, flash_in_place):
    """The kernel packs the blocks from the pages that it packs from the gathered K/V; the
    rest of the forward is the same, so the results are the same bits."""
    q, k, v, lens = _inputs(hq=4, hkv=2, lq=33, lens=(200, 64), d=64, dtype=dtype)
    kp, vp, table, lens32 = _to_pages(k, v, lens, page, seed=2)
    out, lse = _paged_call(q, kp, vp, table, lens32, window=(70, 0))
    want, wlse = attnkit.attention(q, k, v, return_lse=True, backend="flash", seqlens_kv=lens,
                                   causal=True, diagonal="bottom_right", window=(70, 0))
    assert torch.equal(out, want) and torch.equal(lse, wlse)


def test_gqa_shapes_and_long_chunks_run_in_place(flash_in_place):
    """Odd lengths, one kv head for eight query heads, a chunk longer than a page, lengths
    that end on and off block and page edges."""
    for shape in (dict(n=3, hq=8, hkv=1, lq=113, lens=(203, 113, 256), d=32),
                  dict(n=1, hq=4, hkv=4, lq=17, lens=(1000,), d=48, dv=16),
                  dict(n=2, hq=6, hkv=3, lq=65, lens=(129, 65), d=16)):
        q, k, v, lens = _inputs(**shape)
        for page in (37, 128):
            kp, vp, table, lens32 = _to_pages(k, v, lens, page)
            out, _ = _paged_call(q, kp, vp, table, lens32)
            check_oracle(out, q, k, v, dict(_oracle_kw({}), seqlens_kv=lens), torch.float32)


def test_the_paged_spec_chooses_flash_and_explains_what_it_refuses():
    q, k, v, lens = _inputs(lq=40)
    kp, vp, table, lens32 = _to_pages(k, v, lens, 64)
    spec = paged.paged_spec(q, PagedKV(kp, vp, table.long()), _paged_options(lens))
    assert backends.choose(spec) is flash
    q.requires_grad_()
    spec = paged.paged_spec(q, PagedKV(kp, vp, table.long()), _paged_options(lens))
    why = " ".join(backends.explain(spec)["flash"])
    assert "no backward over paged K/V" in why and backends.choose(spec) is None
    fp8 = PagedKV(kp.to(torch.float8_e4m3fn), vp.to(torch.float8_e4m3fn), table.long(),
                  torch.ones(kp.shape[0], 2), torch.ones(kp.shape[0], 2))
    with torch.no_grad():  # (fp8 pages: read in place as well, forward only)
        spec = paged.paged_spec(q, fp8, _paged_options(lens))
        assert "fp8_kv" in spec.features() and backends.choose(spec) is flash
    assert "no backward over paged K/V" in " ".join(backends.explain(spec)["flash"])


def _paged_options(lens):
    from attnkit.spec import Options

    opts = Options.from_kwargs("paged_attention", {"causal": True, "diagonal": "bottom_right"},
                               paged_doors.TAKES)
    return opts.merged(seqlens_kv=lens)


def test_gradients_gather_the_pages_and_stay_right(monkeypatch):
    gathers = spy(monkeypatch, paged_doors, "gather_kv")  # (where the doors look it up)
    q, k, v, lens = _inputs(lq=40)
    kp, vp, table, lens32 = _to_pages(k, v, lens, 64)
    q.requires_grad_()
    out = attnkit.paged_attention_blocks(q, kp, vp, table, lens32)
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert gathers
    qd = q.detach().double().requires_grad_()
    r = ref(qd, k.double(), v.double(), seqlens_kv=lens, **_oracle_kw({}))
    (want,) = torch.autograd.grad(r.sum(), qd)
    assert (dq.double() - want).abs().max().item() < 2e-5


def test_a_non_finite_key_in_a_page_runs_the_next_executor_on_the_gathered_pages():
    q, k, v, lens = _inputs(lq=40)
    k[1, 0, 100, 3] = float("nan")  # (a key row 1 sees)
    kp, vp, table, lens32 = _to_pages(k, v, lens, 64)
    out, _ = _paged_call(q, kp, vp, table, lens32)
    want = ref(q.double(), k.double(), v.double(), seqlens_kv=lens, **_oracle_kw({}))
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.isnan(out[1]).any()
    fin = ~torch.isnan(want)
    assert (out.double()[fin] - want[fin]).abs().max().item() < 2e-5


def test_varlen_over_pages_runs_a_long_chunk_in_place(monkeypatch):
    """Decoding rows (the decode executor) and a 150-row chunk (flash) in one call."""
    kernel = spy(monkeypatch, flash, "forward")
    gathers = spy(monkeypatch, paged_doors, "gather_kv")  # (where the doors look it up)
    g = torch.Generator().manual_seed(3)
    rows, used, page = [1, 150, 1], [300, 400, 77], 32
    hq, hkv, d = 4, 2, 32
    f32 = torch.float32
    ks = [rand(hkv, n, d, gen=g, dtype=f32) for n in used]
    vs = [rand(hkv, n, d, gen=g, dtype=f32) for n in used]
    q = rand(sum(rows), hq, d, gen=g, dtype=f32)
    kfull = torch.zeros(3, hkv, max(used), d)
    vfull = torch.zeros(3, hkv, max(used), d)
    for s in range(3):
        kfull[s, :, :used[s]], vfull[s, :, :used[s]] = ks[s], vs[s]
    kp, vp, table, lens32 = _to_pages(kfull, vfull, used, page)
    cu = torch.tensor([0, 1, 151, 152], dtype=torch.int32)
    with torch.no_grad():
        out = attnkit.varlen_attention(q, kp, vp, cu, None, seqused_kv=lens32,
                                       block_table=table, window=(100, 0))
    assert len(kernel) == 1 and not gathers
    for s in range(3):
        qs = q[cu[s]:cu[s + 1]].transpose(0, 1).double()
        r = ref(qs, ks[s].double(), vs[s].double(), causal=True, diagonal="bottom_right",
                window=(100, 0))
        assert (out[cu[s]:cu[s + 1]].transpose(0, 1).double() - r).abs().max().item() < 2e-5


def test_the_wrapper_checks_the_block_table():
    q, k, v, lens = _inputs(lq=8)
    kp, vp, table, lens32 = _to_pages(k, v, lens, 64)
    t = native.FlashTerms(lo=torch.zeros(1, 8, dtype=torch.int32),
                          hi=torch.full((1, 8), 300, dtype=torch.int32))
    bad = table.clone()
    bad[1, 1] = kp.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]"):
        native.flash_forward(q, kp, vp, 0.1, t, native.FlashPages(bad, lens32))
    with pytest.raises(ValueError, match="lengths must lie in"):
        native.flash_forward(q, kp, vp, 0.1, t, native.FlashPages(table, lens32 + 100))
    with pytest.raises(ValueError, match="block_table must be an integer tensor"):
        native.flash_forward(q, kp, vp, 0.1, t, native.FlashPages(table[:1], lens32))
    call = native.flash_prepare(q, kp, vp, 0.1, t, native.FlashPages(table, lens32))
    with pytest.raises(ValueError, match="gather the pages"):
        call.backward_args(q, kp, vp)


# ---- row maxima ---------------------------------------------------------------------------

MAXIMA = {
    "dense": dict(),
    "causal": dict(causal=True),
    "causal_br": dict(causal=True, diagonal="bottom_right"),
    "window": dict(window=(30, 5)),
    "scale_negative": dict(scale=-0.3),
    "softcap": dict(softcap=2.0, causal=True),
    "alibi": dict(alibi_slopes=SLOPES[:4], window=(60, 0)),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 8.0, 0.0])),
    "seqlens": dict(seqlens_q=torch.tensor([100, 150]), seqlens_kv=torch.tensor([150, 0])),
    "dropout": dict(dropout_p=0.3, seed=1, causal=True),
}


def _max_oracle(q, k, v, kw):
    s, vis = ref_scores(q.double(), k.double(), v.double(), **kw)
    return s.masked_fill(~vis, float("-inf")).amax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MAXIMA))
def test_max_scores_are_the_rows_largest_final_scores(name, dtype, monkeypatch):
    kernel = spy(monkeypatch, native.FlashForward, "run")
    kw = MAXIMA[name]
    g = torch.Generator().manual_seed(4)
    q, k, v = (rand(2, 4, 150, 64, dtype=dtype, gen=g), rand(2, 2, 150, 64, dtype=dtype, gen=g),
               rand(2, 2, 150, 64, dtype=dtype, gen=g))
    request = attnkit.AuxRequest(lse=True, max_scores=True)
    spec = build_spec(q, k, v, outputs=frozenset({"max_scores"}), **kw)
    assert backends.choose(spec) is flash, backends.explain(spec)["flash"]
    _, aux = attnkit.attention(q, k, v, return_aux=request, **kw)
    assert kernel and aux.max_scores.dtype == torch.float32
    want = _max_oracle(q, k, v, kw)
    assert torch.equal(torch.isneginf(aux.max_scores), torch.isneginf(want))
    fin = torch.isfinite(want)
    assert (aux.max_scores[fin].double() - want[fin]).abs().max().item() < 2e-5
    assert bool((aux.lse[fin] >= aux.max_scores[fin] - 1e-5).all())
    _, tiled_aux = attnkit.attention(q, k, v, return_aux=request, backend="tiled", **kw)
    torch.testing.assert_close(aux.max_scores, tiled_aux.max_scores.float(), atol=2e-5,
                               rtol=0)


def test_max_scores_with_gradients_and_over_pages():
    """The executor's maxima on a paged spec (the paged front doors return no aux outputs),
    and with gradients through the autograd node."""
    q, k, v, lens = _inputs(lq=50)
    kp, vp, table, lens32 = _to_pages(k, v, lens, 64)
    okw = dict(_oracle_kw({"softcap": 5.0}), seqlens_kv=lens)
    opts = _paged_options(lens).merged(softcap=5.0)
    spec = paged.paged_spec(q, PagedKV(kp, vp, table.long()), opts,
                            outputs=frozenset({"max_scores"}))
    assert backends.choose(spec) is flash
    res = flash.forward(spec, flash.make_plan(spec))
    want = _max_oracle(q, k, v, okw)
    assert (res.max_scores.double() - want).abs().max().item() < 2e-5
    qg = q.clone().requires_grad_()
    out, aux = attnkit.attention(qg, k, v, return_aux=attnkit.AuxRequest(max_scores=True),
                                 **okw)
    (dq,) = torch.autograd.grad(out.sum(), qg)
    assert (aux.max_scores.double() - want).abs().max().item() < 2e-5 and dq.isfinite().all()


def test_without_the_request_no_maxima_are_written(monkeypatch):
    seen = []
    real = native.FlashForward.run

    def run(self, q, k, v, max_scores=None):
        seen.append(max_scores)
        return real(self, q, k, v, max_scores)

    monkeypatch.setattr(native.FlashForward, "run", run)
    q, k, v = (torch.randn(1, 2, 70, 32) for _ in range(3))
    attnkit.attention(q, k, v, causal=True, backend="flash")
    assert seen == [None]


# ---- MLA head dims ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_prefill_dims_192_128_forward_and_backward_on_flash(dtype, monkeypatch):
    """DeepSeek's non-absorbed prefill: Dqk = 192 (128 + 64 rope dims), Dv = 128."""
    kernel = spy(monkeypatch, native.FlashForward, "run")
    kernel_bwd = spy(monkeypatch, native, "flash_backward")
    others = [spy(monkeypatch, tiled, "backward"), spy(monkeypatch, fused, "forward")]
    g = torch.Generator().manual_seed(6)
    q = rand(1, 4, 130, 192, dtype=dtype, gen=g, requires_grad=True)
    k = rand(1, 4, 130, 192, dtype=dtype, gen=g, requires_grad=True)
    v = rand(1, 4, 130, 128, dtype=dtype, gen=g, requires_grad=True)
    kw = dict(causal=True, scale=192 ** -0.5)
    spec = build_spec(q, k, v, **kw)  # (the 256-bit build leaves plain float32 to fused)
    assert backends.choose(spec) is (fused if flash.auto_defers(spec) else flash)
    w = torch.randn(1, 4, 130, 128)
    out = attnkit.attention(q, k, v, backend="flash", **kw)
    got = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    assert kernel and kernel_bwd and not any(others)
    dbl = [x.detach().double().requires_grad_() for x in (q, k, v)]
    r = ref(*dbl, **kw)
    want = torch.autograd.grad((r * w.double()).sum(), dbl)
    if dtype == torch.float32:
        assert (out.double() - r).abs().max().item() < 2e-5
        for a, b in zip(got, want):
            assert (a.double() - b).abs().max().item() < 2e-5 * max(1.0, b.abs().max().item())
        return
    low = [x.detach().requires_grad_() for x in (q, k, v)]  # the plain bfloat16 computation
    plain = torch.softmax((low[0] @ low[1].transpose(-1, -2)) * kw["scale"] + torch.full(
        (130, 130), float("-inf")).triu(1).to(dtype), -1) @ low[2]
    plain_g = torch.autograd.grad((plain.float() * w).sum(), low)
    ok, err, base = fa_tolerance_ok(out, r, plain)
    assert ok, (err, base)
    for a, b, c in zip(got, plain_g, want):
        ok, err, base = fa_tolerance_ok(a, c, b, mult=3.0)
        assert ok, (err, base)


@pytest.mark.parametrize("lq", [1, 2, 64])
def test_mla_absorbed_dims_576_512_run_right_on_another_executor(lq):
    """One latent kv head of 576 dims whose first 512 are the values (v a view into k): past
    the flash kernel's 256, so decoding rows (up to 32 query rows per kv head: 16 heads times
    2 rows) go to the decode executor and longer query blocks to the fused one."""
    g = torch.Generator().manual_seed(7)
    q = rand(2, 16, lq, 576, dtype=torch.bfloat16, gen=g)
    ckv = rand(2, 1, 300, 576, dtype=torch.bfloat16, gen=g)
    v = ckv[..., :512]
    kw = dict(causal=True, diagonal="bottom_right", scale=192 ** -0.5)
    spec = build_spec(q, ckv, v, **kw)
    assert "flash runs head dims up to 256" in " ".join(backends.explain(spec)["flash"])
    chosen = backends.choose(spec)
    assert chosen is (backends.REGISTRY["decode"] if lq * 16 <= 32 else fused), chosen
    out = attnkit.attention(q, ckv, v, **kw)
    check_oracle(out, q, ckv, v, kw, torch.bfloat16)
