"""Inputs that once gave a plausible wrong answer (or dropped a gradient) without a word.

Each test compares with the float64 oracle, with torch where torch expresses the case, or
checks for the one clear error that replaces the wrong answer.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import fa_tolerance_ok, rand

import attnkit
from attnkit import score_mods
from attnkit.reference import attention_reference

bias_module = pytest.importorskip("torch.nn.attention.bias")


# ---- torch's CausalBias ------------------------------------------------------------------


@pytest.mark.parametrize("lq,lk", [(4, 6), (6, 4), (128, 128), (33, 70)])
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_causal_bias_as_attn_mask_matches_torch(lq, lk, variant):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (lq, lk, lk))
    make = getattr(bias_module, f"causal_{variant}")
    with pytest.warns(UserWarning) if (variant == "lower_right" and lq > lk) else _nullwarn():
        cb = make(lq, lk)
    out = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=cb)
    assert type(out) is torch.Tensor
    diagonal = "top_left" if variant == "upper_left" else "bottom_right"
    ref = attention_reference(q, k, v, causal=True, diagonal=diagonal)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if not (variant == "lower_right" and lq > lk):  # torch gives NaN rows there, attnkit 0
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=cb),
                                   atol=1e-5, rtol=1e-5)
    # the same object through attention(bias=...) and attention(mask=...)
    for key in ("bias", "mask"):
        torch.testing.assert_close(attnkit.attention(q, k, v, **{key: cb}).double(), ref,
                                   atol=1e-5, rtol=1e-5)


class _nullwarn:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_causal_bias_gradients_match_reference():
    q, k, v = (rand(1, 2, n, 8, requires_grad=True) for n in (5, 9, 9))
    cb = bias_module.causal_lower_right(5, 9)
    out = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=cb)
    ref = attention_reference(q, k, v, causal=True, diagonal="bottom_right")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    rgrads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_causal_bias_with_is_causal_raises_like_torch():
    q = k = v = torch.randn(1, 2, 4, 8)
    cb = bias_module.causal_upper_left(4, 4)
    with pytest.raises(ValueError, match="causal"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=cb, is_causal=True)
    with pytest.raises(ValueError, match="CausalBias.*causal=True"):
        attnkit.scaled_dot_product_attention(q, k, v, attn_mask=cb, is_causal=True)
    with pytest.raises(ValueError, match="CausalBias.*causal=True"):
        attnkit.attention(q, k, v, bias=cb, causal=True)


def test_causal_bias_of_other_lengths_is_refused():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"CausalBias.*\(4, 6\).*\(4, 4\)"):
        attnkit.scaled_dot_product_attention(q, k, v, attn_mask=bias_module.causal_upper_left(4, 6))


class _Odd(torch.Tensor):
    """A tensor subclass attnkit knows nothing about."""


@pytest.mark.parametrize("key", ["bias", "mask"])
def test_unknown_tensor_subclass_is_refused(key):
    q = k = v = torch.randn(1, 2, 4, 8)
    x = torch.zeros(4, 4) if key == "bias" else torch.ones(4, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match=rf"{key}.*_Odd.*subclass"):
        attnkit.attention(q, k, v, **{key: x.as_subclass(_Odd)})


def test_parameter_bias_is_accepted():
    q = k = v = rand(1, 2, 4, 8)
    p = torch.nn.Parameter(rand(4, 4))
    out = attnkit.attention(q, k, v, bias=p)
    out.sum().backward()
    ref = attention_reference(q, k, v, bias=p.detach())
    torch.testing.assert_close(out, ref)
    assert p.grad is not None


# ---- a functools.wraps wrapper around a builtin score mod --------------------------------


def _wrapped_alibi(h):
    base = score_mods.alibi(score_mods.alibi_slopes(h))

    @functools.wraps(base)
    def doubled(score, b, h, q_idx, kv_idx):  # changes what the builtin does
        return 2.0 * base(score, b, h, q_idx, kv_idx)

    return base, doubled


@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_wraps_wrapper_around_builtin_score_mod_runs_as_written(backend):
    base, doubled = _wrapped_alibi(4)
    assert score_mods.describe(doubled) is None and score_mods.describe(base) is not None
    q, k, v = (rand(2, 4, n, 16, requires_grad=True) for n in (37, 50, 50))
    out = attnkit.attention(q, k, v, score_mod=doubled, causal=True, backend=backend)
    ref = attention_reference(q, k, v, score_mod=doubled, causal=True)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    plain = attention_reference(q, k, v, score_mod=base, causal=True)
    assert (out - plain).abs().max() > 1e-2  # the wrapper's change is not dropped
    g = torch.autograd.grad(out.sum(), (q, k, v))
    rg = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, rg):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    with pytest.raises(NotImplementedError, match="not additive"):
        attnkit.attention(q, k, v, score_mod=doubled, backend="fused")


def test_wraps_wrapper_through_flex_and_varlen():
    base, doubled = _wrapped_alibi(2)
    q, k, v = (rand(1, 2, 24, 8) for _ in range(3))
    torch.testing.assert_close(attnkit.flex_attention(q, k, v, score_mod=doubled),
                               attention_reference(q, k, v, score_mod=doubled))
    cu = torch.tensor([0, 10, 24])
    out = attnkit.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                   v[0].transpose(0, 1), cu, cu, score_mod=doubled)
    for s0, s1 in ((0, 10), (10, 24)):
        ref = attention_reference(q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1],
                                  score_mod=doubled)
        torch.testing.assert_close(out[s0:s1].transpose(0, 1), ref[0])


# ---- tensors a score_mod reads from module globals get their gradient ----------------------

S_REL = 12
GLOBAL_TABLE = torch.randn(2 * S_REL - 1, dtype=torch.float64, requires_grad=True)
holder = types.ModuleType("holder")  # a module whose attribute the mod reads
holder.table = torch.randn(2 * S_REL - 1, dtype=torch.float64, requires_grad=True)


def relbias_global(score, b, h, q_idx, kv_idx):  # torch's FlexAttention docs' example
    return score + GLOBAL_TABLE[q_idx - kv_idx + S_REL - 1]


def _lookup(q_idx, kv_idx):
    return holder.table[q_idx - kv_idx + S_REL - 1]


def relbias_module_attr(score, b, h, q_idx, kv_idx):  # through a helper and a module attribute
    return score + _lookup(q_idx, kv_idx)


class Scaler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, 1.5], dtype=torch.float64))

    def mod(self, score, b, h, q_idx, kv_idx):
        return score * self.w[h]


class HeadScale:  # a callable object
    def __init__(self):
        self.w = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score * self.w[h]


def _default_arg_mod():
    t = torch.randn(2 * S_REL - 1, dtype=torch.float64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx, table=t):
        return score + table[q_idx - kv_idx + S_REL - 1]
    return mod, t


def _cases():
    scaler, call = Scaler(), HeadScale()
    mod, t = _default_arg_mod()
    return {"global": (relbias_global, GLOBAL_TABLE),
            "module_attr": (relbias_module_attr, holder.table),
            "bound_method": (scaler.mod, scaler.w),
            "callable_object": (call, call.w),
            "default_arg": (mod, t)}


@pytest.mark.parametrize("case", ["global", "module_attr", "bound_method", "callable_object",
                                  "default_arg"])
@pytest.mark.parametrize("door", ["attention", "tiled", "flex"])
def test_score_mod_tensors_outside_closures_get_gradients(case, door):
    mod, table = _cases()[case]
    q, k, v = (rand(1, 2, S_REL, 8, requires_grad=True) for _ in range(3))
    if door == "flex":
        out = attnkit.flex_attention(q, k, v, score_mod=mod)
    else:
        out = attnkit.attention(q, k, v, score_mod=mod, causal=True,
                                backend="tiled" if door == "tiled" else "auto")
    table.grad = None
    (out * out).sum().backward()
    got = table.grad.clone()
    table.grad = None
    ref = attention_reference(q, k, v, score_mod=mod, causal=door != "flex")
    (want,) = torch.autograd.grad((ref * ref).sum(), (table,))
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


class Hidden:
    table = torch.randn(2 * S_REL - 1, dtype=torch.float64, requires_grad=True)  # class attr


def hidden_mod(score, b, h, q_idx, kv_idx):
    return score + Hidden.table[q_idx - kv_idx + S_REL - 1]


def test_score_mod_tensor_that_cannot_be_reached_is_an_error():
    q, k, v = (rand(1, 2, S_REL, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"hidden_mod.*requires grad.*\(23,\).*closure"):
        attnkit.attention(q, k, v, score_mod=hidden_mod)
    with torch.no_grad():  # no gradient wanted: no complaint
        attnkit.attention(q, k, v, score_mod=hidden_mod)
    detached = Hidden.table.detach()
    out = attnkit.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + detached[i - j + 11])
    assert out.shape == q.shape


def test_score_mod_closure_over_a_non_leaf_reaches_its_leaf():
    w = torch.randn(2 * S_REL - 1, dtype=torch.float64, requires_grad=True)

    def make():
        table = w * 2.0  # not a leaf: its gradient flows on to w

        def mod(score, b, h, q_idx, kv_idx):
            return score + table[q_idx - kv_idx + S_REL - 1]
        return mod

    q, k, v = (rand(1, 2, S_REL, 8) for _ in range(3))
    (g,) = torch.autograd.grad(attnkit.attention(q, k, v, score_mod=make()).sum(), (w,))
    (want,) = torch.autograd.grad(attention_reference(q, k, v, score_mod=make()).sum(), (w,))
    torch.testing.assert_close(g, want)


# ---- bfloat16 on the tiled executor: float32 scores, P and dP ------------------------------


def _rmse(x, ref):
    return (x.double() - ref).pow(2).mean().sqrt().item()


@pytest.mark.parametrize("kw", [{}, {"causal": True}])
def test_bf16_tiled_error_within_torch_sdpa_rule(kw):
    """torch's own bf16 test rule: output and gradient RMSE against float64 within 1.2x of
    torch SDPA's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(2, 4, 256, 64, generator=g, dtype=torch.float64)
    qr, kr, vr = (t.requires_grad_() for t in (q.clone(), k.clone(), v.clone()))
    ref = attention_reference(qr, kr, vr, **kw)
    rgrads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    sdpa = F.scaled_dot_product_attention(qb, kb, vb, is_causal=bool(kw))
    sgrads = torch.autograd.grad(sdpa, (qb, kb, vb), dout.bfloat16())
    for backend in ("tiled", "fused"):
        out = attnkit.attention(qb, kb, vb, backend=backend, **kw)
        grads = torch.autograd.grad(out, (qb, kb, vb), dout.bfloat16())
        assert _rmse(out, ref) <= 1.2 * _rmse(sdpa, ref), backend
        for a, s, r in zip(grads, sgrads, rgrads):
            assert _rmse(a, r) <= 1.2 * _rmse(s, r), backend


def test_bf16_tiled_gradient_is_zero_where_the_math_says_zero():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g).bfloat16().requires_grad_()
               for _ in range(3))
    out = attnkit.attention(q, k, v, causal=True, backend="tiled")
    (dq,) = torch.autograd.grad(out, (q,), torch.randn_like(out))
    assert dq[:, :, 0].float().abs().max() <= 1e-5  # row 0 sees one key: dS = 0 exactly
    q1, k1, v1 = (torch.randn(1, 1, n, 32, generator=g).bfloat16() for n in (7, 1, 1))
    bias = torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16, requires_grad=True)
    out = attnkit.attention(q1, k1, v1, bias=bias, backend="tiled")
    (db,) = torch.autograd.grad(out, (bias,), torch.randn_like(out))
    assert db.float().abs().max() <= 1e-5  # one key: the softmax is constant 1


@pytest.mark.parametrize("learnable", ["bias", "score_mod"])
def test_bf16_learnable_bias_gradients_keep_the_forward_softmax(learnable):
    """auto runs the forward on the fused kernel and the backward on tiled: the backward's P
    must be computed as the forward's (float32 scores), or dv loses digits with large
    scores."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 128, 64, generator=g, dtype=torch.float64) * s
               for s in (6.0, 6.0, 1.0))
    b64 = torch.randn(1, 4, 128, 128, generator=g, dtype=torch.float64)
    dout = torch.randn(1, 4, 128, 64, generator=g, dtype=torch.float64)

    def run(dtype, fn):
        qq, kk, vv, bb = (t.to(dtype).requires_grad_() for t in (q, k, v, b64))
        if learnable == "bias":
            out = fn(qq, kk, vv, bias=bb)
        else:
            out = fn(qq, kk, vv, score_mod=lambda s_, b, h, i, j: s_ + bb[b, h, i, j])
        return (out, *torch.autograd.grad(out, (qq, kk, vv, bb), dout.to(dtype)))

    ref = run(torch.float64, attention_reference)
    got = run(torch.bfloat16, attnkit.attention)

    def plain(qq, kk, vv, bias=None, score_mod=None):  # the naive bf16 computation
        s = (qq @ kk.transpose(-1, -2)) / 8.0
        s = s + bias if bias is not None else score_mod(s, *_idx(s))
        return torch.softmax(s.float(), -1).bfloat16() @ vv

    base = run(torch.bfloat16, plain)
    for i, (a, r, p) in enumerate(zip(got, ref, base)):
        ok, err, berr = fa_tolerance_ok(a, r, p, mult=2.0 if i == 0 else 3.0)
        assert ok, (i, err, berr)


def _idx(s):
    n, h, lq, lk = s.shape
    return (torch.arange(n).view(-1, 1, 1, 1), torch.arange(h).view(1, -1, 1, 1),
            torch.arange(lq).view(1, 1, -1, 1), torch.arange(lk).view(1, 1, 1, -1))


# ---- padding is invisible on every executor, NaN in it included --------------------------


@pytest.mark.parametrize("backend", ["auto", "fused", "tiled"])
@pytest.mark.parametrize("where", ["k", "v", "q", "all"])
def test_nan_in_padding_never_reaches_real_rows(backend, where):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 4, n, 16, generator=g, dtype=torch.float64) for n in (40, 50, 50))
    sq, sk = torch.tensor([40, 17, 33]), torch.tensor([50, 21, 9])
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*clean, seqlens_q=sq, seqlens_kv=sk, causal=True,
                              diagonal="bottom_right")
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    rgrads = torch.autograd.grad(ref, clean, dout)
    dirty = [t.clone() for t in (q, k, v)]
    for name, t, lens in (("q", dirty[0], sq), ("k", dirty[1], sk), ("v", dirty[2], sk)):
        if where in (name, "all"):
            for b, n in enumerate(lens.tolist()):
                t[b, :, n:] = float("nan")
    dirty = [t.requires_grad_() for t in dirty]
    out = attnkit.attention(*dirty, seqlens_q=sq, seqlens_kv=sk, causal=True,
                            diagonal="bottom_right", backend=backend)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for a, b in zip(torch.autograd.grad(out, dirty, dout), rgrads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


# ---- NaN and inf in q/k/v propagate like the math --------------------------------------------


def _poison(q, k, v, case):
    q, k, v = q.clone(), k.clone(), v.clone()
    if case == "nan_q_row":
        q[0, 1, q.shape[2] // 2] = float("nan")
    elif case == "inf_q":
        q[0, 0, 0, 3] = float("inf")
    elif case == "nan_k_row":
        k[0, 0, k.shape[2] // 2] = float("nan")
    elif case == "inf_k":
        k[0, 0, k.shape[2] // 3, 0] = float("inf")
    elif case == "neg_inf_k":
        k[0, 1, 1] = float("-inf")
    elif case == "nan_v":  # key 0: every row sees it, with or without the causal mask (a NaN
        # value under a mask other than padding may or may not reach the rows that do not see it)
        v[0, 0, 0, 1] = float("nan")
    return q, k, v


@pytest.mark.parametrize("backend", ["auto", "fused", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq,lk", [(1, 300), (3, 40), (8, 8), (64, 64), (70, 200)])
@pytest.mark.parametrize("case", ["nan_q_row", "inf_q", "nan_k_row", "inf_k", "neg_inf_k",
                                  "nan_v"])
def test_nonfinite_inputs_propagate_like_the_math(backend, dtype, lq, lk, case):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, n, 32, generator=g).to(dtype) for n in (lq, lk, lk))
    q, k, v = _poison(q, k, v, case)
    for kw in ({}, {"causal": True, "diagonal": "bottom_right"}):
        # the float64 math on the same values (torch's math SDPA where there is no mask; a
        # masked pair is absent, so a NaN score there does not reach the row)
        want = attention_reference(q, k, v, **kw)
        if not kw:
            torch.testing.assert_close(want, F.scaled_dot_product_attention(
                q.double(), k.double(), v.double()), equal_nan=True)
        out = attnkit.attention(q, k, v, backend=backend, **kw)
        assert torch.equal(torch.isnan(out), torch.isnan(want)), (kw, torch.isnan(out).sum(),
                                                                  torch.isnan(want).sum())
        fin = ~torch.isnan(want)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.double()[fin], want[fin], atol=tol, rtol=tol)


# ---- double backward: right, or one clear error ---------------------------------------------


def _double_backward_case(name, g):
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for n in (5, 6, 6))
    extra, kw = [], {}
    if name == "causal_bias":
        b = torch.randn(1, 2, 5, 6, generator=g, dtype=torch.float64)
        extra, kw = [b], {"causal": True, "diagonal": "bottom_right"}
    elif name == "sinks":
        s = torch.randn(2, generator=g, dtype=torch.float64)
        extra, kw = [s], {}
    elif name == "dropout_mask":
        kw = {"dropout_mask": torch.rand(1, 2, 5, 6, generator=g) > 0.3, "dropout_p": 0.3}
    elif name == "dropout_seed":
        kw = {"dropout_p": 0.25, "seed": 7}
    elif name == "softcap":
        kw = {"softcap": 1.5}
    elif name == "alibi_window":
        kw = {"alibi_slopes": torch.tensor([0.5, 0.25], dtype=torch.float64), "window": (2, 1)}
    elif name == "gqa_padding":
        k, v = k[:, :1], v[:, :1]
        kw = {"seqlens_kv": torch.tensor([4]), "causal": True}
    elif name == "score_mod":
        t = torch.randn(11, generator=g, dtype=torch.float64)
        extra = [t]
    return q, k, v, extra, kw


def _bind(name, extra, kw):
    if name == "causal_bias":
        return lambda *xs: dict(kw, bias=xs[0])
    if name == "sinks":
        return lambda *xs: dict(kw, sinks=xs[0])
    if name == "score_mod":
        return lambda *xs: dict(kw, score_mod=lambda s, b, h, i, j: s * 0.7 + torch.tanh(
            s) * xs[0][i - j + 5])
    return lambda *xs: kw


DOUBLE = ["plain", "causal_bias", "sinks", "dropout_mask", "dropout_seed", "softcap",
          "alibi_window", "gqa_padding", "score_mod"]


@pytest.mark.parametrize("name", DOUBLE)
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_double_backward_matches_autograd_through_the_reference(name, backend):
    g = torch.Generator().manual_seed(11)
    q, k, v, extra, kw = _double_backward_case(name, g)
    inputs = [t.requires_grad_() for t in (q, k, v, *extra)]
    opts = _bind(name, extra, kw)

    def f(fn, *xs):
        out = fn(*xs[:3], **opts(*xs[3:]))
        return (out * out.detach().sin()).sum()

    # d/dx of (grad . w): the second derivative along w, both ways
    w = [torch.randn_like(t) for t in inputs]

    def hvp(fn):
        grads = torch.autograd.grad(f(fn, *inputs), inputs, create_graph=True)
        dot = sum((a * b).sum() for a, b in zip(grads, w))
        return torch.autograd.grad(dot, inputs, allow_unused=True)

    def reference(*a, **o):
        if "dropout_p" in o:  # the oracle takes the keep mask itself
            keep = o.pop("dropout_mask", None)
            if keep is None:
                _, aux = attnkit.attention(*a, return_aux=attnkit.AuxRequest(dropout_mask=True),
                                           **o)
                keep = aux.dropout_mask
            o.pop("seed", None)
            o["dropout_keep"] = keep
        return attention_reference(*a, **o)

    got = hvp(lambda *a, **o: attnkit.attention(*a, backend=backend, **o))
    want = hvp(reference)
    for a, b in zip(got, want):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-7)


def test_double_backward_softcap_float32():
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g, requires_grad=True) for _ in range(3))
    out = attnkit.attention(q, k, v, softcap=2.0, causal=True)
    (gq,) = torch.autograd.grad(out.pow(2).sum(), (q,), create_graph=True)
    (hq,) = torch.autograd.grad(gq.sum(), (q,))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, softcap=2.0, causal=True)
    (rq,) = torch.autograd.grad(ref.pow(2).sum(), (q64,), create_graph=True)
    (rh,) = torch.autograd.grad(rq.sum(), (q64,))
    torch.testing.assert_close(hq.double(), rh, atol=2e-4, rtol=2e-3)
