"""Training features against their oracles: replayable dropout, attention sinks, the torch
SDPA drop-in, the explicit forward/backward pair and returned attention weights.

Dropout is checked through the keep mask the executor really applied: with ``v`` the identity
the forward output *is* the dropped weight matrix, and with ``dout`` the identity the
gradient of ``v`` is its transpose, so both passes' masks can be read off and compared bitwise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import fa_tolerance_ok, naive_attention, rand

import attnkit
from attnkit import AuxRequest
from attnkit.dropout import draw_seed
from attnkit.reference import attention_reference as ref

# ---- dropout -------------------------------------------------------------------------------


def _qkv(n=2, hq=4, hkv=2, lq=6, lk=9, d=5, dv=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (rand(n, hq, lq, d, gen=g, dtype=dtype, requires_grad=True),
            rand(n, hkv, lk, d, gen=g, dtype=dtype, requires_grad=True),
            rand(n, hkv, lk, dv, gen=g, dtype=dtype, requires_grad=True),
            rand(n, hq, lq, dv, gen=g, dtype=dtype))


def _masks_used(q, k, p, seed, **kw):
    """(forward keep mask, backward keep mask) the tiled executor applied (needs Hq == Hkv)."""
    lq, lk = q.shape[-2], k.shape[-2]
    eye_v = torch.eye(lk, dtype=q.dtype).expand(*k.shape[:-1], lk)
    out = attnkit.attention(q.detach(), k.detach(), eye_v, dropout_p=p, seed=seed,
                            backend="tiled", **kw)
    v = torch.zeros(*k.shape[:-1], lq, dtype=q.dtype, requires_grad=True)
    out_v = attnkit.attention(q.detach(), k.detach(), v, dropout_p=p, seed=seed,
                              backend="tiled", **kw)
    (dv,) = torch.autograd.grad(out_v, v, torch.eye(lq, dtype=q.dtype).expand(out_v.shape))
    return out != 0, dv.transpose(-1, -2) != 0


def test_dropout_gradcheck_through_replayed_mask(small_tiles):
    g = torch.Generator().manual_seed(1)
    q = rand(1, 2, 5, 3, gen=g, requires_grad=True)
    k = rand(1, 1, 7, 3, gen=g, requires_grad=True)
    v = rand(1, 1, 7, 2, gen=g, requires_grad=True)
    sinks = rand(2, gen=g, requires_grad=True)

    def fn(q, k, v, sinks):
        return attnkit.attention(q, k, v, sinks=sinks, causal=True, diagonal="bottom_right",
                                 dropout_p=0.4, seed=1234, return_lse=True)

    _, aux = attnkit.attention(q, k, v, dropout_p=0.4, seed=1234,
                               return_aux=AuxRequest(dropout_mask=True))
    assert not aux.dropout_mask.all() and aux.dropout_mask.any()  # something is dropped
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


DROPOUT_CASES = {
    "plain": dict(),
    "causal_bottom_right": dict(causal=True, diagonal="bottom_right"),
    "window_bias": dict(window=(2, 1), bias=True),
    "seqlens": dict(seqlens_q=torch.tensor([6, 2]), seqlens_kv=torch.tensor([9, 4])),
}


@pytest.mark.parametrize("case", list(DROPOUT_CASES))
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_dropout_equals_reference_with_the_same_keep_mask(case, tiles, request):
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    kw = dict(DROPOUT_CASES[case])
    q, k, v, dout = _qkv(seed=2)
    inputs = [q, k, v]
    if kw.pop("bias", False):
        kw["bias"] = rand(4, 1, 9, gen=torch.Generator().manual_seed(3), requires_grad=True)
        inputs.append(kw["bias"])
    out, aux = attnkit.attention(q, k, v, dropout_p=0.3, seed=77, offset=5,
                                 return_aux=AuxRequest(lse=True, dropout_mask=True), **kw)
    keep = aux.dropout_mask
    assert keep.shape == (2, 4, 6, 9) and keep.dtype == torch.bool
    assert 0.5 < keep.float().mean() < 0.9
    r, rl = ref(q, k, v, dropout_p=0.3, dropout_keep=keep, return_lse=True, **kw)
    assert torch.allclose(out, r, atol=1e-12)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(aux.lse))
    assert torch.allclose(aux.lse[fin], rl[fin], atol=1e-12)  # lse is pre-dropout
    ga = torch.autograd.grad(out, inputs, dout)
    gr = torch.autograd.grad(r, inputs, dout)
    for a, b in zip(ga, gr):
        assert torch.allclose(a, b, atol=1e-12)
    # and it really dropped something: without the mask the result differs
    assert not torch.allclose(out, ref(q, k, v, **kw), atol=1e-3)


def test_dropout_forward_and_backward_apply_the_reported_mask(small_tiles):
    q, k, _, _ = _qkv(hq=3, hkv=3, lq=7, lk=10, seed=4)
    for kw in (dict(), dict(causal=True)):
        fwd, bwd = _masks_used(q, k, 0.35, seed=9, **kw)
        _, aux = attnkit.attention(q, k, k, dropout_p=0.35, seed=9,
                                   return_aux=AuxRequest(dropout_mask=True), **kw)
        vis = torch.ones(7, 10, dtype=torch.bool)
        if kw:
            vis = vis.tril()
        assert torch.equal(fwd, aux.dropout_mask & vis)
        assert torch.equal(bwd, aux.dropout_mask & vis)


def test_keep_masks_bitwise_equal_across_tilings_runs_and_backends(request):
    q, k, _, _ = _qkv(n=2, hq=2, hkv=2, lq=19, lk=35, seed=5)
    default = _masks_used(q, k, 0.25, seed=2**40 + 3, causal=True)
    again = _masks_used(q, k, 0.25, seed=2**40 + 3, causal=True)
    request.getfixturevalue("small_tiles")  # from here on: many 16-wide tiles
    small = _masks_used(q, k, 0.25, seed=2**40 + 3, causal=True)
    for a, b, c in zip(default, again, small):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(default[0], default[1])
    other_offset = attnkit.attention(q, k, k, dropout_p=0.25, seed=2**40 + 3, offset=1,
                                     return_aux=AuxRequest(dropout_mask=True))[1]
    other_seed = attnkit.attention(q, k, k, dropout_p=0.25, seed=2**40 + 4,
                                   return_aux=AuxRequest(dropout_mask=True))[1]
    first = attnkit.attention(q, k, k, dropout_p=0.25, seed=2**40 + 3,
                              return_aux=AuxRequest(dropout_mask=True))[1]
    assert not torch.equal(first.dropout_mask, other_offset.dropout_mask)
    assert not torch.equal(first.dropout_mask, other_seed.dropout_mask)
    # the fused executor refuses dropout instead of ignoring it, and says why
    with pytest.raises(NotImplementedError, match="fused.*dropout"):
        attnkit.attention(q, k, k, dropout_p=0.25, seed=1, backend="fused")
    with pytest.raises(NotImplementedError, match="fused.*dropout"):
        attnkit.attention(q, k, k, dropout_p=0.25, backend="fused",
                          dropout_mask=torch.ones(19, 35, dtype=torch.bool))


def test_kept_fraction_of_a_large_matrix():
    g = torch.Generator().manual_seed(6)
    q, k = rand(1, 4, 128, 8, gen=g), rand(1, 4, 256, 8, gen=g)
    for p in (0.1, 0.5):
        fwd, _ = _masks_used(q[..., :16, :], k[..., :32, :], p, seed=21)
        _, aux = attnkit.attention(q, k, k, dropout_p=p, seed=21,
                                   return_aux=AuxRequest(dropout_mask=True))
        assert torch.equal(fwd, aux.dropout_mask[..., :16, :32])  # same counters, any size
        kept = aux.dropout_mask.double().mean().item()  # 131072 weights
        assert abs(kept - (1 - p)) < 0.01 * (1 - p), kept


def test_dropout_p_zero_draws_nothing(backend):
    q, k, v, _ = _qkv(seed=7)
    before = torch.random.get_rng_state()
    out = attnkit.attention(q, k, v, dropout_p=0.0, backend=backend)
    out_aux, aux = attnkit.attention(q, k, v, dropout_p=0.0, backend=backend,
                                     return_aux=AuxRequest(dropout_mask=True))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert aux.dropout_mask is None
    assert torch.equal(out, attnkit.attention(q, k, v, backend=backend))
    assert torch.equal(out_aux, out)
    attnkit.attention(q, k, v, dropout_p=0.1)  # the check above can fail: this one draws
    assert not torch.equal(torch.random.get_rng_state(), before)


def test_seed_none_draws_from_torch_generator():
    q, k, v, _ = _qkv(seed=8)
    torch.manual_seed(123)
    a = attnkit.attention(q, k, v, dropout_p=0.5)
    b_unseeded = attnkit.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(123)
    b = attnkit.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, b_unseeded)
    torch.manual_seed(123)
    seed = draw_seed()  # what attnkit drew
    assert torch.equal(a, attnkit.attention(q, k, v, dropout_p=0.5, seed=seed))


@pytest.mark.parametrize("shape", [(6, 9), (2, 1, 6, 9), (2, 4, 6, 9)], ids=str)
def test_user_dropout_mask_equals_reference(shape):
    q, k, v, dout = _qkv(seed=9)
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(10)) > 0.4
    out = attnkit.attention(q, k, v, dropout_p=0.4, dropout_mask=keep, causal=True)
    r = ref(q, k, v, dropout_p=0.4, dropout_keep=keep, causal=True)
    assert torch.allclose(out, r, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(r, (q, k, v), dout)):
        assert torch.allclose(a, b, atol=1e-12)
    # seed plays no part when the mask is given
    assert torch.equal(out, attnkit.attention(q, k, v, dropout_p=0.4, dropout_mask=keep,
                                              causal=True, seed=5))


def test_reference_takes_the_aux_keep_mask_with_two_batch_dims():
    g = torch.Generator().manual_seed(11)
    q, k, v = rand(2, 3, 2, 5, 4, gen=g), rand(2, 3, 2, 6, 4, gen=g), rand(2, 3, 2, 6, 3, gen=g)
    out, aux = attnkit.attention(q, k, v, dropout_p=0.4, seed=3,
                                 return_aux=AuxRequest(dropout_mask=True))
    assert aux.dropout_mask.shape == (2, 3, 2, 5, 6)
    r = ref(q, k, v, dropout_p=0.4, dropout_keep=aux.dropout_mask)
    assert torch.allclose(out, r, atol=1e-12)


@pytest.mark.parametrize("p,exc", [(-0.1, ValueError), (1.5, ValueError),
                                   (float("nan"), ValueError), ("0.5", TypeError),
                                   (True, TypeError)], ids=str)
def test_dropout_p_outside_unit_interval_errors(p, exc):
    q, k, v, _ = _qkv(seed=12)
    with pytest.raises(exc, match=r"dropout_p .*\[0, 1\]"):
        attnkit.attention(q, k, v, dropout_p=p)
    with pytest.raises(exc, match="dropout_p"):
        attnkit.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=True)


# ---- sinks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("with_lse_grad", [False, True], ids=["out_grad", "out_and_lse_grad"])
def test_sinks_match_reference_with_a_fully_masked_row(with_lse_grad, small_tiles, backend):
    q, k, v, dout = _qkv(lq=7, lk=11, seed=13)
    g = torch.Generator().manual_seed(14)
    sinks = rand(4, gen=g, requires_grad=True)
    dlse = rand(2, 4, 7, gen=g)
    mask = torch.ones(7, 11, dtype=torch.bool)
    mask[3] = False  # row 3 sees no key: only the sink is left
    kw = dict(sinks=sinks, mask=mask, causal=True, diagonal="bottom_right")
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend=backend, **kw)
    r, rl = ref(q, k, v, return_lse=True, **kw)
    assert torch.allclose(out, r, atol=1e-12)
    assert torch.allclose(lse, rl, atol=1e-12)
    assert torch.all(out[:, :, 3] == 0)
    assert torch.allclose(lse[:, :, 3], sinks.detach().expand(2, 4), atol=0)
    # a sink only adds to the denominator: out shrinks by exp(lse_without - lse)
    o0, l0 = attnkit.attention(q, k, v, mask=mask, causal=True, diagonal="bottom_right",
                               return_lse=True)
    live = torch.isfinite(l0)
    assert torch.allclose(out[live], (o0 * torch.exp(l0 - lse).unsqueeze(-1))[live],
                          atol=1e-12)

    def loss(o, lse):
        return (o * dout).sum() + ((lse * dlse).sum() if with_lse_grad else 0)

    ga = torch.autograd.grad(loss(out, lse), (q, k, v, sinks))
    gr = torch.autograd.grad(loss(r, rl), (q, k, v, sinks))
    for name, a, b in zip(("q", "k", "v", "sinks"), ga, gr):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-12), name
    assert ga[3].abs().min() > 0


# ---- the torch SDPA drop-in ----------------------------------------------------------------

SDPA_CASES = {
    "plain": dict(),
    "bool_mask": dict(mask="bool"),
    "bool_mask_2d": dict(mask="bool2d"),
    "float_mask": dict(mask="float"),
    "is_causal": dict(causal=True),
    "is_causal_lq_lt_lk": dict(causal=True, lq=5),
    "is_causal_lq_gt_lk": dict(causal=True, lq=17),
    "scale": dict(scale=0.21),
    "gqa": dict(gqa=True),
    "gqa_causal_scale": dict(gqa=True, causal=True, scale=0.4),
    "gqa_bool_mask": dict(gqa=True, mask="bool"),
    "gqa_float_mask_scale": dict(gqa=True, mask="float", scale=0.3),
    "dropout_zero": dict(dropout=True, mask="bool"),
}


def _sdpa_inputs(case, dtype):
    g = torch.Generator().manual_seed(15)
    lq, lk = case.get("lq", 13), 13
    hkv = 2 if case.get("gqa") else 4
    q = rand(2, 4, lq, 16, gen=g, dtype=dtype, requires_grad=True)
    k = rand(2, hkv, lk, 16, gen=g, dtype=dtype, requires_grad=True)
    v = rand(2, hkv, lk, 8, gen=g, dtype=dtype, requires_grad=True)
    dout = rand(2, 4, lq, 8, gen=g, dtype=dtype)
    mask = None
    if case.get("mask") in ("bool", "bool2d"):
        shape = (2, 1, lq, lk) if case["mask"] == "bool" else (lq, lk)
        mask = torch.rand(shape, generator=g) > 0.4
        mask[..., 0] = True  # torch gives NaN for rows with no key; keep every row alive
    elif case.get("mask") == "float":
        mask = rand(1, 4, lq, lk, gen=g, dtype=dtype)
    kwargs = dict(attn_mask=mask, is_causal=case.get("causal", False),
                  scale=case.get("scale"), enable_gqa=bool(case.get("gqa")))
    if case.get("dropout"):
        kwargs["dropout_p"] = 0.0
    return q, k, v, dout, kwargs


@pytest.mark.parametrize("name", list(SDPA_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sdpa_drop_in_matches_torch(name, dtype):
    case = SDPA_CASES[name]
    q, k, v, dout, kwargs = _sdpa_inputs(case, dtype)
    ours = attnkit.scaled_dot_product_attention(q, k, v, **kwargs)
    assert ours.dtype == dtype and ours.shape == dout.shape
    g_ours = torch.autograd.grad(ours, (q, k, v), dout)
    if dtype == torch.float32:
        theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
        g_theirs = torch.autograd.grad(theirs, (q, k, v), dout)
        assert torch.allclose(ours, theirs, atol=2e-6, rtol=1e-5)
        for a, b in zip(g_ours, g_theirs):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
        return
    # bfloat16: judged against the float64 oracle with FlashAttention's rule
    mask = kwargs["attn_mask"]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    is_bool = mask is not None and mask.dtype == torch.bool
    r = ref(q64, k64, v64, mask=mask if is_bool else None,
            bias=None if mask is None or is_bool else mask.double(),
            causal=kwargs["is_causal"], scale=kwargs["scale"])
    g_ref = torch.autograd.grad(r, (q64, k64, v64), dout.double())
    qp, kp, vp = (t.detach().requires_grad_() for t in (q, k, v))
    plain = naive_attention(qp, kp, vp, mask=mask if is_bool else None,
                            bias=None if is_bool else mask, scale=kwargs["scale"],
                            causal=kwargs["is_causal"])
    g_plain = torch.autograd.grad(plain, (qp, kp, vp), dout)
    ok, err, base = fa_tolerance_ok(ours, r, plain)
    assert ok, (err, base)
    for n, a, gr, gp in zip("qkv", g_ours, g_ref, g_plain):
        ok, err, base = fa_tolerance_ok(a, gr, gp, mult=3.0)
        assert ok, (n, err, base)


def test_sdpa_drop_in_needs_enable_gqa_for_fewer_kv_heads():
    q, k, v, _, _ = _sdpa_inputs(dict(gqa=True), torch.float32)
    with pytest.raises(ValueError, match="4 heads .* 2.*enable_gqa=True"):
        attnkit.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError):  # torch refuses too: same contract
        F.scaled_dot_product_attention(q, k, v)


def test_sdpa_drop_in_dropout_follows_torch_seed():
    q, k, v, _, _ = _sdpa_inputs(dict(), torch.float64)
    torch.manual_seed(0)
    a = attnkit.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(0)
    b = attnkit.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.allclose(a, attnkit.scaled_dot_product_attention(q, k, v), atol=1e-3)


class _TinySelfAttention(torch.nn.Module):
    """A transformer-style block that calls F.scaled_dot_product_attention itself."""

    def __init__(self, dim=16, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


def test_monkeypatched_sdpa_runs_a_module(monkeypatch):
    torch.manual_seed(16)
    block = _TinySelfAttention()
    x = torch.randn(2, 11, 16)
    mask = torch.rand(11, 11) > 0.3
    mask.fill_diagonal_(True)
    expected = []
    for m in (None, mask):
        y = block(x, m)
        expected.append((y, torch.autograd.grad(y.square().sum(), list(block.parameters()))))
    calls = []
    real = attnkit.api.attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(attnkit.api, "attention", spy)
    monkeypatch.setattr(F, "scaled_dot_product_attention", attnkit.scaled_dot_product_attention)
    for m, (y_ref, g_ref) in zip((None, mask), expected):
        y = block(x, m)
        grads = torch.autograd.grad(y.square().sum(), list(block.parameters()))
        assert torch.allclose(y, y_ref, atol=1e-5)
        for a, b in zip(grads, g_ref):
            assert torch.allclose(a, b, atol=1e-4)
    assert [c["causal"] for c in calls] == [True, False]  # attnkit ran, with torch's flags
    assert calls[1]["mask"] is mask


# ---- attention_forward / attention_backward ------------------------------------------------

FB_CASES = {
    "plain": dict(),
    "bias_broadcast_sinks": dict(bias=(4, 1, 9), sinks=True, causal=True,
                                 diagonal="bottom_right"),
    "bias_batch_broadcast": dict(bias=(1, 9), window=(2, 3)),
    "mask_seqlens": dict(mask=True, seqlens_kv=torch.tensor([9, 5])),
}


@pytest.mark.parametrize("case", list(FB_CASES))
def test_forward_backward_pair_equals_autograd(case, backend):
    kw = dict(FB_CASES[case])
    g = torch.Generator().manual_seed(17)
    q = rand(2, 4, 6, 5, gen=g, requires_grad=True)
    k = rand(2, 2, 9, 5, gen=g, requires_grad=True)
    v = rand(1, 2, 9, 3, gen=g, requires_grad=True)  # broadcast over the batch
    dout = rand(2, 4, 6, 3, gen=g)
    inputs = [q, k, v]
    if "bias" in kw:
        kw["bias"] = rand(*kw["bias"], gen=g, requires_grad=True)
        inputs.append(kw["bias"])
    if kw.pop("sinks", False):
        kw["sinks"] = rand(4, gen=g, requires_grad=True)
        inputs.append(kw["sinks"])
    if kw.get("mask") is True:
        kw["mask"] = torch.rand(2, 1, 6, 9, generator=g) > 0.3
    out, lse = attnkit.attention_forward(q, k, v, backend=backend, **kw)
    assert not out.requires_grad and not lse.requires_grad
    o, l = attnkit.attention(q, k, v, return_lse=True, backend=backend, **kw)
    assert torch.allclose(out, o, atol=1e-12)
    fin = torch.isfinite(l)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.allclose(lse[fin], l[fin], atol=1e-12)
    grads = attnkit.attention_backward(q, k, v, out, lse, dout, backend=backend, **kw)
    assert isinstance(grads, attnkit.Grads)
    expected = torch.autograd.grad(o, inputs, dout)
    got = [grads.dq, grads.dk, grads.dv]
    if "bias" in kw:
        got.append(grads.dbias)
    else:
        assert grads.dbias is None
    if "sinks" in kw:
        got.append(grads.dsinks)
    else:
        assert grads.dsinks is None
    for x, a, b in zip(inputs, got, expected):
        assert a.shape == x.shape
        assert torch.allclose(a, b, atol=1e-12)


def test_forward_backward_pair_replays_dropout():
    q, k, v, dout = _qkv(seed=18)
    kw = dict(dropout_p=0.3, seed=99, causal=True)
    out, lse = attnkit.attention_forward(q, k, v, **kw)
    o = attnkit.attention(q, k, v, **kw)
    assert torch.allclose(out, o, atol=1e-12)
    grads = attnkit.attention_backward(q, k, v, out, lse, dout, **kw)
    for a, b in zip(grads[:3], torch.autograd.grad(o, (q, k, v), dout)):
        assert torch.allclose(a, b, atol=1e-12)


def test_forward_backward_pair_rejects_return_options():
    q, k, v, _ = _qkv(seed=19)
    with pytest.raises(TypeError, match="attention_forward.*return_lse"):
        attnkit.attention_forward(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="return_weights"):
        attnkit.attention_backward(q, k, v, q, q[..., 0], q, return_weights=True)


# ---- return_weights ------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, diagonal="bottom_right", mask=True),
                                dict(window=(1, 2), scale=0.7, bias=True)],
                         ids=["plain", "causal_masked_row", "window_bias"])
def test_return_weights_equal_reference_and_need_no_grad(kw, small_tiles, backend):
    kw = dict(kw)
    q, k, v, _ = _qkv(seed=20)
    if kw.pop("mask", False):
        mask = torch.ones(6, 9, dtype=torch.bool)
        mask[4] = False
        kw["mask"] = mask
    if kw.pop("bias", False):
        kw["bias"] = rand(4, 6, 9, gen=torch.Generator().manual_seed(21), requires_grad=True)
    out, lse, w = attnkit.attention(q, k, v, return_lse=True, return_weights=True,
                                    backend=backend, **kw)
    _, rw = ref(q, k, v, return_weights=True, **kw)
    assert w.shape == (2, 4, 6, 9) and w.dtype == q.dtype
    assert not w.requires_grad and w.grad_fn is None
    assert out.requires_grad
    assert torch.allclose(w, rw, atol=1e-12)
    if "mask" in kw:
        assert torch.all(w[:, :, 4] == 0)
    live = torch.isfinite(lse)
    assert torch.allclose(w.sum(-1)[live], torch.ones_like(lse)[live], atol=1e-12)
    # out is the weights times v (grouped-query heads share v)
    assert torch.allclose(out, w @ v.repeat_interleave(2, dim=1), atol=1e-12)


def test_return_weights_are_pre_dropout():
    q, k, v, _ = _qkv(seed=22)
    out, aux, w = attnkit.attention(q, k, v, dropout_p=0.5, seed=4, return_weights=True,
                                    return_aux=AuxRequest(dropout_mask=True))
    assert torch.allclose(w, ref(q, k, v, return_weights=True)[1], atol=1e-12)
    dropped = w * aux.dropout_mask / 0.5
    assert torch.allclose(out, dropped @ v.repeat_interleave(2, dim=1), atol=1e-12)
    assert math.isclose(w.sum(-1).mean().item(), 1.0, abs_tol=1e-12)
