"""The core op against its oracles: the seed's worked example, the float64 reference,
torch's SDPA, gradcheck, and the properties of section 4 of the course chapter."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import fa_tolerance_ok, naive_attention, rand

import attnkit
from attnkit.reference import attention_reference as ref

# ---- the worked example (001_..., section 3) ------------------------------------------------


def _hand_inputs():
    q = torch.tensor([[2.0, 0, 0, 0]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [2, 0, 0, 0]], dtype=torch.float64,
                     requires_grad=True)
    v = torch.tensor([[1.0, 0], [0, 1], [1, 1]], dtype=torch.float64, requires_grad=True)
    return q, k, v


def test_hand_example_forward():
    q, k, v = _hand_inputs()
    out, lse = attnkit.attention(q, k, v, return_lse=True)
    assert torch.allclose(out, torch.tensor([[0.909969, 0.755272]], dtype=torch.float64),
                          atol=1e-6)
    assert abs(lse.item() - math.log(1 + math.e + math.e ** 2)) < 1e-12
    p = torch.exp(torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64) - lse)
    assert torch.allclose(p, torch.tensor([0.244728, 0.090031, 0.665241],
                                          dtype=torch.float64), atol=1e-6)


def test_hand_example_backward():
    q, k, v = _hand_inputs()
    out = attnkit.attention(q, k, v)
    out.backward(torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    f64 = dict(dtype=torch.float64)
    assert torch.allclose(v.grad, torch.tensor([[0.244728, 0], [0.090031, 0], [0.665241, 0]],
                                               **f64), atol=1e-6)
    assert torch.allclose(q.grad, torch.tensor([[0.070909, -0.040963, 0, 0]], **f64), atol=1e-6)
    assert torch.allclose(k.grad, torch.tensor([[0.022033, 0, 0, 0], [-0.081925, 0, 0, 0],
                                                [0.059892, 0, 0, 0]], **f64), atol=1e-6)


# ---- against the float64 reference ---------------------------------------------------------

CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, diagonal="bottom_right"),
    dict(window=(5, 3)),
    dict(window=(4, 0), diagonal="bottom_right"),
    dict(window=(None, 2)),
    dict(scale=0.3),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
                         or "dense")
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_matches_reference(kw, tiles, backend, request):
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    g = torch.Generator().manual_seed(1)
    q = rand(2, 4, 37, 16, gen=g)
    k = rand(2, 2, 53, 16, gen=g)
    v = rand(2, 2, 53, 8, gen=g)
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend=backend, **kw)
    r, rl = ref(q, k, v, return_lse=True, **kw)
    assert torch.allclose(out, r, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    fin = torch.isfinite(rl)
    assert torch.allclose(lse[fin], rl[fin], atol=1e-12)


@pytest.mark.parametrize("kw", [
    dict(mask=True),
    dict(bias=True),
    dict(mask=True, bias=True, causal=True),
    dict(causal=True, diagonal="bottom_right"),
    dict(window=(3, 1)),
    dict(window=(2, 0), diagonal="bottom_right", bias=True),
], ids=str)
def test_gradcheck_float64(kw, small_tiles, backend):
    g = torch.Generator().manual_seed(2)
    n, hq, hkv, lq, lk = 2, 2, 1, 5, 7
    q = rand(n, hq, lq, 4, gen=g, requires_grad=True)
    k = rand(n, hkv, lk, 4, gen=g, requires_grad=True)
    v = rand(n, hkv, lk, 3, gen=g, requires_grad=True)
    opts = {key: val for key, val in kw.items() if key not in ("mask", "bias")}
    inputs = [q, k, v]
    if kw.get("mask"):
        m = torch.rand(n, 1, lq, lk, generator=g) > 0.3
        m[:, :, :, 0] = True
        opts["mask"] = m
    if kw.get("bias"):
        inputs.append(rand(1, hq, lq, lk, gen=g, requires_grad=True))

    def fn(q, k, v, *bias):
        return attnkit.attention(q, k, v, bias=bias[0] if bias else None, backend=backend,
                                 **opts)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=backend == "fused")


def test_gradients_match_reference_with_broadcast_bias(backend):
    g = torch.Generator().manual_seed(3)
    q = rand(3, 2, 11, 8, gen=g, requires_grad=True)
    k = rand(3, 2, 13, 8, gen=g, requires_grad=True)
    v = rand(1, 2, 13, 4, gen=g, requires_grad=True)  # broadcast batch
    bias = rand(2, 1, 13, gen=g, requires_grad=True)  # (H, 1, Lk)
    dout = rand(3, 2, 11, 4, gen=g)
    grads = []
    for fn in (partial(attnkit.attention, backend=backend), ref):
        out = fn(q, k, v, bias=bias, causal=True, diagonal="bottom_right")
        grads.append(torch.autograd.grad(out, (q, k, v, bias), dout))
    for a, b in zip(*grads):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-12)


def test_lse_gradient_flows():
    g = torch.Generator().manual_seed(4)
    q = rand(1, 2, 5, 4, gen=g, requires_grad=True)
    k = rand(1, 2, 7, 4, gen=g, requires_grad=True)
    v = rand(1, 2, 7, 3, gen=g, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attnkit.attention(q, k, v, causal=True, return_lse=True), (q, k, v))


# ---- properties ----------------------------------------------------------------------------


def test_key_permutation_equivariance():
    g = torch.Generator().manual_seed(5)
    q, k, v = rand(2, 7, 8, gen=g), rand(2, 9, 8, gen=g), rand(2, 9, 5, gen=g)
    perm = torch.randperm(9, generator=g)
    a = attnkit.attention(q, k, v)
    b = attnkit.attention(q, k[:, perm], v[:, perm])
    assert torch.allclose(a, b, atol=1e-12)


def test_queries_are_independent():
    g = torch.Generator().manual_seed(6)
    q, k, v = rand(1, 2, 9, 8, gen=g), rand(1, 2, 9, 8, gen=g), rand(1, 2, 9, 5, gen=g)
    full = attnkit.attention(q, k, v)
    perm = torch.randperm(9, generator=g)
    assert torch.allclose(attnkit.attention(q[:, :, perm], k, v), full[:, :, perm], atol=1e-12)
    assert torch.allclose(attnkit.attention(q[:, :, 4:5], k, v), full[:, :, 4:5], atol=1e-12)


def test_batched_equals_per_item_with_gradients():
    g = torch.Generator().manual_seed(7)
    q = rand(2, 3, 6, 4, gen=g, requires_grad=True)
    k = rand(2, 3, 8, 4, gen=g, requires_grad=True)
    v = rand(2, 3, 8, 5, gen=g, requires_grad=True)
    dout = rand(2, 3, 6, 5, gen=g)
    out = attnkit.attention(q, k, v, causal=True, diagonal="bottom_right")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(2):
        for h in range(3):
            qi = q[b, h].detach().requires_grad_()
            ki = k[b, h].detach().requires_grad_()
            vi = v[b, h].detach().requires_grad_()
            o = attnkit.attention(qi, ki, vi, causal=True, diagonal="bottom_right")
            assert torch.allclose(o, out[b, h], atol=1e-12)
            gi = torch.autograd.grad(o, (qi, ki, vi), dout[b, h])
            assert torch.allclose(gi[0], dq[b, h], atol=1e-12)
            assert torch.allclose(gi[1], dk[b, h], atol=1e-12)
            assert torch.allclose(gi[2], dv[b, h], atol=1e-12)


def test_gqa_equals_repeat_interleave():
    g = torch.Generator().manual_seed(8)
    q, k, v = rand(2, 8, 10, 4, gen=g), rand(2, 2, 12, 4, gen=g), rand(2, 2, 12, 6, gen=g)
    a = attnkit.attention(q, k, v, causal=True)
    b = attnkit.attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1),
                          causal=True)
    assert torch.allclose(a, b, atol=1e-12)


def test_masked_keys_get_no_weight_or_gradient():
    g = torch.Generator().manual_seed(9)
    q = rand(1, 1, 5, 4, gen=g, requires_grad=True)
    k = rand(1, 1, 6, 4, gen=g, requires_grad=True)
    v = rand(1, 1, 6, 3, gen=g, requires_grad=True)
    mask = torch.ones(6, dtype=torch.bool)
    mask[[1, 4]] = False
    out = attnkit.attention(q, k, v, mask=mask)
    out.sum().backward()
    assert torch.all(k.grad[0, 0, [1, 4]] == 0)
    assert torch.all(v.grad[0, 0, [1, 4]] == 0)
    # weights: the blocked keys' values do not matter at all
    v2 = v.detach().clone()
    v2[0, 0, [1, 4]] = 1e6
    assert torch.allclose(attnkit.attention(q.detach(), k.detach(), v2, mask=mask),
                          out.detach(), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fully_masked_row_gives_zeros(dtype, backend):
    g = torch.Generator().manual_seed(10)
    q = rand(1, 2, 4, 8, gen=g, dtype=dtype, requires_grad=True)
    k = rand(1, 2, 5, 8, gen=g, dtype=dtype, requires_grad=True)
    v = rand(1, 2, 5, 3, gen=g, dtype=dtype, requires_grad=True)
    bias = torch.zeros(4, 5, dtype=dtype, requires_grad=True)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    out, lse = attnkit.attention(q, k, v, mask=mask, bias=bias, return_lse=True,
                                 backend=backend)
    assert torch.all(out[:, :, 2] == 0)
    assert torch.all(torch.isneginf(lse[:, :, 2]))
    assert torch.isfinite(out).all()
    (out.float().sum() + 0 * lse[torch.isfinite(lse)].sum()).backward()
    for t in (q, k, v, bias):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :, 2] == 0)
    assert torch.all(bias.grad[2] == 0)


def test_bias_minus_inf_masks_like_mask():
    g = torch.Generator().manual_seed(11)
    q, k, v = rand(1, 1, 4, 4, gen=g), rand(1, 1, 6, 4, gen=g), rand(1, 1, 6, 2, gen=g)
    mask = torch.rand(4, 6, generator=g) > 0.4
    mask[:, 0] = True
    bias = torch.zeros(4, 6, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    assert torch.allclose(attnkit.attention(q, k, v, bias=bias),
                          attnkit.attention(q, k, v, mask=mask), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_scores_do_not_overflow(dtype):
    q = torch.tensor([[100.0, 0.0]], dtype=dtype)
    k = torch.tensor([[100.0, 0.0], [99.0, 0.0], [-100.0, 0.0]], dtype=dtype)
    v = torch.tensor([[1.0], [2.0], [3.0]], dtype=dtype)
    out, lse = attnkit.attention(q, k, v, scale=1.0, return_lse=True)  # scores 1e4, 9.9e3
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert out.item() == pytest.approx(1.0, abs=1e-3)
    assert lse.item() == pytest.approx(1e4, rel=1e-3)


def test_default_scale_is_inverse_sqrt_d():
    g = torch.Generator().manual_seed(12)
    q, k, v = rand(1, 3, 16, gen=g), rand(1, 5, 16, gen=g), rand(1, 5, 2, gen=g)
    assert torch.allclose(attnkit.attention(q, k, v), attnkit.attention(q, k, v, scale=0.25),
                          atol=0)
    assert not torch.allclose(attnkit.attention(q, k, v),
                              attnkit.attention(q, k, v, scale=1 / 16), atol=1e-6)


def test_deterministic_bitwise(small_tiles, backend):
    g = torch.Generator().manual_seed(13)
    q = rand(2, 4, 33, 8, gen=g, dtype=torch.float32, requires_grad=True)
    k = rand(2, 2, 41, 8, gen=g, dtype=torch.float32, requires_grad=True)
    v = rand(2, 2, 41, 8, gen=g, dtype=torch.float32, requires_grad=True)
    runs = []
    for _ in range(2):
        out = attnkit.attention(q, k, v, causal=True, window=(9, 0), backend=backend)
        runs.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_two_dim_and_multi_batch_shapes():
    g = torch.Generator().manual_seed(14)
    q = rand(2, 3, 4, 5, 8, gen=g)  # (*B=(2,3), H=4, L=5, D=8)
    k = rand(3, 4, 7, 8, gen=g)  # broadcasts over the first batch dim
    v = rand(1, 3, 4, 7, 6, gen=g)
    out = attnkit.attention(q, k, v)
    assert out.shape == (2, 3, 4, 5, 6)
    assert torch.allclose(out, ref(q, k, v), atol=1e-12)
    assert attnkit.attention(q[0, 0, 0], k[0, 0], v[0, 0, 0]).shape == (5, 6)


def test_float16_and_bfloat16_keep_dtype_and_lse_is_float32():
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.randn(1, 2, 8, 16).to(dtype)
        out, lse = attnkit.attention(q, q, q, return_lse=True)
        assert out.dtype == dtype and lse.dtype == torch.float32
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    assert attnkit.attention(q, q, q, return_lse=True)[1].dtype == torch.float64


# ---- torch SDPA where it expresses the case ------------------------------------------------

SDPA_CASES = [
    dict(name="plain"),
    dict(name="bool_mask", mask="bool"),
    dict(name="float_mask", mask="float"),
    dict(name="is_causal", causal=True),
    dict(name="gqa", gqa=True),
    dict(name="scale", scale=0.17),
    dict(name="odd", lq=113, lk=203, d=59),
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: c["name"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_sdpa(case, dtype, backend):
    g = torch.Generator().manual_seed(15)
    lq, lk, d = case.get("lq", 64), case.get("lk", 80), case.get("d", 32)
    hkv = 2 if case.get("gqa") else 4
    causal = case.get("causal", False)
    if causal:
        lk = lq
    q = rand(2, 4, lq, d, gen=g, dtype=dtype, requires_grad=True)
    k = rand(2, hkv, lk, d, gen=g, dtype=dtype, requires_grad=True)
    v = rand(2, hkv, lk, d, gen=g, dtype=dtype, requires_grad=True)
    dout = rand(2, 4, lq, d, gen=g, dtype=dtype)
    mask = bias = None
    if case.get("mask") == "bool":
        mask = torch.rand(2, 1, lq, lk, generator=g) > 0.3
    elif case.get("mask") == "float":
        bias = rand(1, 4, lq, lk, gen=g, dtype=dtype)
    scale = case.get("scale")
    ours = attnkit.attention(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale,
                             backend=backend)
    theirs = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask if mask is not None else bias, is_causal=causal, scale=scale,
        enable_gqa=hkv != 4)
    g_ours = torch.autograd.grad(ours, (q, k, v), dout)
    g_theirs = torch.autograd.grad(theirs, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r = ref(q64, k64, v64, mask=mask, bias=None if bias is None else bias.double(),
            causal=causal, scale=scale)
    g_ref = torch.autograd.grad(r, (q64, k64, v64), dout.double())
    qp, kp, vp = (t.detach().requires_grad_() for t in (q, k, v))
    plain = naive_attention(qp, kp, vp, mask=mask, bias=bias, scale=scale, causal=causal)
    g_plain = torch.autograd.grad(plain, (qp, kp, vp), dout)
    if dtype == torch.float32:
        assert torch.allclose(ours, theirs, atol=2e-5, rtol=1e-4)
        for a, b in zip(g_ours, g_theirs):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)
    ok, err, base = fa_tolerance_ok(ours, r, plain)
    assert ok, (err, base)
    for a, gr, gp in zip(g_ours, g_ref, g_plain):
        ok, err, base = fa_tolerance_ok(a, gr, gp, mult=3.0)
        assert ok, (err, base)
