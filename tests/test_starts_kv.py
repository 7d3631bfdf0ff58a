"""Left padding as structure: ``starts_kv`` (per-row key start offsets, the mirror of
``seqlens_kv``) against the float64 oracle (which reads the raw keyword itself) on every
executor, with gradients, in low precision by FlashAttention's rule, in the planner, the
decode kernel, the paged and compiled paths, and its argument errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_plan_follows, fa_tolerance_ok, rand, spy

import attnkit
from attnkit import backends, native, score_mods
from attnkit.backends import decode, fused, tiled
from attnkit.plan import make_plan
from attnkit.reference import attention_reference as ref
from attnkit.reference import scores
from attnkit.spec import build_spec

N, HQ, HKV, LQ, LK, D = 3, 4, 2, 37, 53, 16
STARTS = [0, 5, 40]

# (options, whether rows may see no key); the third row's start 40 lies past its
# seqlens_kv 30 in "padded_both": that row sees nothing
CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal_br": dict(causal=True, diagonal="bottom_right"),
    "window": dict(window=(5, 3)),
    "window_br": dict(window=(6, 0), diagonal="bottom_right"),
    "padded_both": dict(causal=True, diagonal="bottom_right", seqlens_kv=[53, 48, 30],
                        seqlens_q=[37, 20, 37]),
    "alibi_causal": dict(causal=True, alibi_slopes=score_mods.alibi_slopes(HQ)),
    "alibi_br": dict(causal=True, diagonal="bottom_right",
                     alibi_slopes=score_mods.alibi_slopes(HQ)),
    "softcap_window": dict(window=(9, 0), softcap=3.0),
}


def _inputs(dtype=torch.float64, lq=LQ, lk=LK, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = rand(N, HQ, lq, D, gen=g, dtype=dtype, requires_grad=grad)
    k = rand(N, HKV, lk, D, gen=g, dtype=dtype, requires_grad=grad)
    v = rand(N, HKV, lk, D, gen=g, dtype=dtype, requires_grad=grad)
    return q, k, v


def _with_tensors(kw):
    return {key: torch.tensor(val) if isinstance(val, list) else val for key, val in kw.items()}


def _compare(out, lse, r, rl, atol):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert (lse[fin].double() - rl[fin]).abs().max() <= atol
    assert (out.double() - r).abs().max() <= atol


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_float64_forward_and_gradients_match_the_oracle(name, with_sinks, tiles, backend,
                                                        request):
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    kw = _with_tensors(CASES[name])
    if backend == "fused" and "softcap" in kw:
        pytest.skip("the fused executor runs no softcap")
    q, k, v = _inputs()
    starts = torch.tensor(STARTS)
    if with_sinks:
        kw["sinks"] = torch.linspace(-1, 1, HQ, dtype=torch.float64).requires_grad_(True)
    out, lse = attnkit.attention(q, k, v, starts_kv=starts, return_lse=True, backend=backend,
                                 **kw)
    r, rl = ref(q, k, v, starts_kv=starts, return_lse=True, **kw)
    _compare(out, lse, r, rl, 1e-12)
    # every row's keys before its start are invisible: the reference sees the same
    assert bool((scores(q, k, v, starts_kv=starts, **kw)[1][2, :, :, :40] == 0).all())
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    wrt = (q, k, v) + ((kw["sinks"],) if with_sinks else ())
    got = torch.autograd.grad((out * dout).sum() + lse.nan_to_num(0, 0, 0).sum(), wrt)
    want = torch.autograd.grad((r * dout).sum() + rl.nan_to_num(0, 0, 0).sum(), wrt)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-10
    # the keys before each row's start get no gradient
    assert bool((got[1][1, :, :5] == 0).all() and (got[2][2, :, :40] == 0).all())


def test_nan_in_hidden_keys_never_reaches_a_row(backend):
    """Keys before the start hold NaN: a row that does not see them is finite (0 * NaN
    would leak through a product that included them)."""
    q, k, v = _inputs(grad=False)
    k, v = k.clone(), v.clone()
    k[1, :, :5] = float("nan")
    v[2, :, :40] = float("nan")
    starts = torch.tensor(STARTS)
    out = attnkit.attention(q, k, v, starts_kv=starts, causal=True, backend=backend)
    r = ref(q, k.nan_to_num(0.0), v.nan_to_num(0.0), starts_kv=starts, causal=True)
    assert torch.isfinite(out).all()
    assert (out - r).abs().max() <= 1e-12


def _plain(q, k, v, vis, *, scale=None, softcap=None, alibi=None, sinks=None):
    """Attention written plainly in the inputs' dtype (FlashAttention's baseline), over the
    oracle's visibility ``vis``; the softmax in float32 as the naive helper of conftest."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        s = s + alibi.to(s.dtype)
    s = s.float().masked_fill(~vis, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., :vis.shape[-1]].to(q.dtype)
    return p @ v


def _alibi_dense(slopes, lq, lk, diagonal):
    i = torch.arange(lq).view(1, 1, -1, 1)
    j = torch.arange(lk).view(1, 1, 1, -1)
    ip = i + (lk - lq) if diagonal == "bottom_right" else i
    return -slopes.view(1, -1, 1, 1).double() * (ip - j).abs()


LOW = {
    "prefill_causal": dict(lq=64, lk=64, kw=dict(causal=True)),
    "prefill_window_sinks": dict(lq=64, lk=64, kw=dict(window=(11, 0), sinks=True)),
    "decode_br_alibi": dict(lq=1, lk=300, kw=dict(causal=True, diagonal="bottom_right",
                                                  alibi=True)),
    "decode_br_window_softcap": dict(lq=4, lk=300, kw=dict(window=(90, 0),
                                                           diagonal="bottom_right",
                                                           softcap=4.0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(LOW))
def test_low_precision_within_flash_rule_with_gradients(case, dtype):
    c = LOW[case]
    lq, lk = c["lq"], c["lk"]
    kw = dict(c["kw"])
    q, k, v = (x.detach().mul(2).to(dtype).requires_grad_(True)
               for x in _inputs(lq=lq, lk=lk, seed=4))
    starts = torch.tensor([0, 17, lk // 2]) if lq == lk else torch.tensor([0, 170, 250])
    extra = {}
    if kw.pop("alibi", False):
        extra["alibi_slopes"] = score_mods.alibi_slopes(HQ)
    if kw.pop("sinks", False):
        extra["sinks"] = torch.linspace(-1, 1, HQ).to(dtype)
    kw.update(extra)
    out = attnkit.attention(q, k, v, starts_kv=starts, **kw)
    assert out.dtype == dtype
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    r = ref(q64, k64, v64, starts_kv=starts, **kw)
    vis = scores(q64, k64, v64, starts_kv=starts, **kw)[1]
    qp, kp, vp = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    alibi = None
    if "alibi_slopes" in kw:
        alibi = _alibi_dense(kw["alibi_slopes"], lq, lk, kw.get("diagonal", "top_left"))
    plain = _plain(qp, kp, vp, vis, softcap=kw.get("softcap"), alibi=alibi,
                   sinks=kw.get("sinks"))
    ok, err, base = fa_tolerance_ok(out, r, plain)
    assert ok, (err, base)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(r, (q64, k64, v64), dout.double())
    base_g = torch.autograd.grad(plain, (qp, kp, vp), dout)
    for a, b, c_ in zip(got, want, base_g):
        ok, err, base = fa_tolerance_ok(a, b, c_, mult=3.0)
        assert ok, (err, base)


# ---- the planner ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["plain", "causal", "causal_br", "padded_both", "window"])
@pytest.mark.parametrize("tiles", [(8, 8), (16, 4), (64, 64)])
def test_the_plan_skips_blocks_before_every_start_and_its_tiles_are_right(name, tiles):
    kw = _with_tensors(CASES[name])
    q, k, v = _inputs(grad=False)
    starts = torch.tensor([24, 9, 40])
    spec = build_spec(q, k, v, starts_kv=starts, **kw)
    assert "starts_kv" in spec.features()
    vis = scores(q, k, v, starts_kv=starts, **kw)[1]
    plan = make_plan(spec, bq=tiles[0], bk=tiles[1])
    for kb in range(plan.nkb):
        if plan.k_range(kb)[1] <= 9:  # before every row's start: no work at all
            assert not bool(plan.any[:, kb].any()), kb
    assert_plan_follows(spec, plan, vis)


def test_zero_starts_are_no_term_and_the_feature_is_declared_by_the_executors():
    q, k, v = _inputs(grad=False)
    assert "starts_kv" not in build_spec(q, k, v, starts_kv=[0, 0, 0]).features()
    spec = build_spec(q[:, :, :1], k, v, starts_kv=[0, 3, 0], causal=True,
                      diagonal="bottom_right")
    assert "starts_kv" in spec.features()
    for name in ("decode", "flash", "fused", "tiled"):
        assert "starts_kv" in backends.REGISTRY[name].CAPS.features
        if name != "flash":  # (flash runs float32 and lower; these inputs are float64)
            assert not backends.reasons(backends.REGISTRY[name], spec), name

    class Bare:  # an executor that does not declare the feature refuses it by itself
        CAPS = backends.base.Capabilities(
            name="bare", features=tiled.CAPS.features - {"starts_kv"},
            dtypes=tiled.CAPS.dtypes, devices=tiled.CAPS.devices)

    assert any("starts_kv" in why for why in backends.reasons(Bare, spec))


def test_fused_runs_each_row_on_its_real_keys_and_queries(monkeypatch):
    """Top-left causal left padding (a prefill): row b runs queries and keys [start, L) as a
    plain causal problem, no mask, nothing before the start."""
    shapes = []
    real = fused.FWD_OP

    def record(q, k, v, *args, **kw):
        shapes.append((q.shape[2], k.shape[2], kw.get("attn_mask") is None))
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(fused, "FWD_OP", record)
    q, k, v = _inputs(lq=LK, lk=LK, grad=False)
    starts = torch.tensor(STARTS)
    out = attnkit.attention(q, k, v, starts_kv=starts, causal=True, backend="fused")
    assert (out - ref(q, k, v, starts_kv=starts, causal=True)).abs().max() <= 1e-12
    assert sorted(shapes) == sorted((LK - s, LK - s, True) for s in STARTS)


# ---- decoding --------------------------------------------------------------------------------

needs_native = pytest.mark.skipif(not native.available(), reason="native kernel unavailable")

DECODE = {
    "causal_br": dict(causal=True, diagonal="bottom_right"),
    "window_br": dict(window=(40, 0), diagonal="bottom_right"),
    "alibi_br_sinks": dict(causal=True, diagonal="bottom_right",
                           alibi_slopes=score_mods.alibi_slopes(HQ), sinks=True),
    "softcap_padded": dict(causal=True, diagonal="bottom_right", softcap=5.0,
                           seqlens_kv=[257, 200, 100]),
    "no_mask": dict(),
}


@needs_native
@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(DECODE))
def test_decode_kernel_reads_each_row_from_its_start(name, dtype, lq, monkeypatch):
    kw = _with_tensors(DECODE[name])
    if kw.pop("sinks", False):
        kw["sinks"] = torch.linspace(-1, 1, HQ).to(dtype)
    q, k, v = _inputs(dtype, lq=lq, lk=257, seed=5, grad=False)
    k, v = k.clone(), v.clone()
    starts = torch.tensor([0, 60, 150])
    k[1, :, :60] = float("nan")  # hidden: must never be read into a row
    calls = spy(monkeypatch, native, "paged_decode")
    fallback = spy(monkeypatch, tiled, "forward")
    out, lse = attnkit.attention(q, k, v, starts_kv=starts, return_lse=True, backend="decode",
                                 **kw)
    assert calls and not fallback  # the kernel ran, on every row at once
    k[1, :, :60] = 0
    r, rl = ref(q.double(), k.double(), v.double(), starts_kv=starts, return_lse=True, **kw)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    _compare(out, lse, r, rl, tol)


def test_decode_top_left_band_runs_the_torch_path_exactly(monkeypatch):
    """A top-left diagonal with left padding would move in the kernel's coordinates (it counts
    positions from each row's first key): the decode executor runs its torch path instead."""
    q, k, v = _inputs(torch.float32, lq=4, lk=64, grad=False)
    starts = torch.tensor([0, 2, 3])
    calls = spy(monkeypatch, native, "paged_decode")
    out = attnkit.attention(q, k, v, starts_kv=starts, causal=True, backend="decode")
    assert not calls
    r = ref(q.double(), k.double(), v.double(), starts_kv=starts, causal=True)
    assert (out.double() - r).abs().max() <= 2e-6


def test_decode_torch_fallback_without_the_kernel(monkeypatch):
    monkeypatch.setattr(decode, "_kernel_kv", lambda spec: None)
    q, k, v = _inputs(torch.float32, lq=1, lk=100, grad=False)
    starts = torch.tensor([0, 30, 99])
    kw = dict(causal=True, diagonal="bottom_right", window=(50, 0))
    out = attnkit.attention(q, k, v, starts_kv=starts, backend="decode", **kw)
    r = ref(q.double(), k.double(), v.double(), starts_kv=starts, **kw)
    assert (out.double() - r).abs().max() <= 2e-6


def test_decode_with_gradients_uses_the_tiled_backward():
    q, k, v = _inputs(torch.float64, lq=2, lk=80)
    starts = torch.tensor([10, 0, 70])
    kw = dict(causal=True, diagonal="bottom_right")
    out = attnkit.attention(q, k, v, starts_kv=starts, backend="decode", **kw)
    r = ref(q, k, v, starts_kv=starts, **kw)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(r.sum(), (q, k, v))
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_cache_with_key_starts(dtype):
    g = torch.Generator().manual_seed(3)
    page, pages, hkv = 16, 12, 2
    k_pages = torch.randn(pages, page, hkv, D, generator=g).to(dtype)
    v_pages = torch.randn(pages, page, hkv, D, generator=g).to(dtype)
    table = torch.tensor([[3, 1, 4, 7], [0, 5, 2, 9], [8, 6, 10, 11]], dtype=torch.int32)
    lens = torch.tensor([50, 64, 20], dtype=torch.int32)
    starts = torch.tensor([0, 33, 19])
    q = torch.randn(N, HQ, 1, D, generator=g).to(dtype)
    out = attnkit.paged_attention_blocks(q, k_pages, v_pages, table, lens, causal=True,
                                         diagonal="bottom_right", starts_kv=starts)
    k, v = attnkit.gather_kv(k_pages, v_pages, table, lens)
    r = ref(q.double(), k.double(), v.double(), causal=True, diagonal="bottom_right",
            seqlens_kv=lens, starts_kv=starts)
    assert (out.double() - r).abs().max() <= (2e-5 if dtype == torch.float32 else 2e-2)


# ---- the compiled path ---------------------------------------------------------------------


def test_compiled_attention_carries_the_key_starts():
    torch._dynamo.reset()
    q, k, v = (x.detach().float().requires_grad_(True) for x in _inputs(lq=24, lk=24))
    starts = torch.tensor([0, 5, 20])

    def fn(q, k, v, starts):
        return attnkit.attention(q, k, v, causal=True, starts_kv=starts)

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, starts)
    want = fn(q, k, v, starts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g_got = torch.autograd.grad(got.sum(), (q, k, v))
    g_want = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---- argument errors -------------------------------------------------------------------------


@pytest.mark.parametrize("bad,err,match", [
    ([0, 1], ValueError, r"starts_kv must be an integer tensor of shape \(3,\).*got shape"),
    (torch.zeros(3, 1, dtype=torch.long), ValueError, r"starts_kv .*shape \(3,\)"),
    (torch.zeros(3), TypeError, r"starts_kv .*dtype torch.float32.*\.long\(\)"),
    (torch.zeros(3, dtype=torch.bool), TypeError, r"starts_kv .*dtype torch.bool"),
    ([0, -1, 2], ValueError, r"starts_kv must lie in \[0, 53\].*min -1"),
    ([0, 54, 2], ValueError, r"starts_kv must lie in \[0, 53\].*max 54"),
    ("abc", TypeError, r"starts_kv must be an integer tensor"),
])
def test_bad_starts_are_clear_errors(bad, err, match):
    q, k, v = _inputs(grad=False)
    with pytest.raises(err, match=match):
        attnkit.attention(q, k, v, starts_kv=bad)


def test_starts_as_a_list_and_on_the_wrong_device():
    q, k, v = _inputs(grad=False)
    out = attnkit.attention(q, k, v, starts_kv=STARTS)
    assert torch.equal(out, attnkit.attention(q, k, v, starts_kv=torch.tensor(STARTS)))
    with pytest.raises(ValueError, match="starts_kv is on meta"):
        attnkit.attention(q, k, v, starts_kv=torch.zeros(3, dtype=torch.long, device="meta"))


def test_varlen_refuses_key_starts():
    q = torch.randn(10, 2, 8)
    with pytest.raises(NotImplementedError, match="starts_kv"):
        attnkit.varlen_attention(q, q, q, [0, 4, 10], [0, 4, 10], starts_kv=[1])
