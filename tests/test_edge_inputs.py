"""Valid or near-valid inputs that once crashed or gave an unclear error, and objects that must
survive pickling: each is now a result (checked against the oracle or torch) or one clear
error naming the argument."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from conftest import rand

import attnkit
from attnkit import masks, score_mods
from attnkit.reference import attention_reference

# ---- builtin mods pickle and torch.save --------------------------------------------------

_TABLE = torch.randn(3, 9, dtype=torch.float64)
BUILTIN_MASKS = {
    "causal": lambda: masks.causal(),
    "causal_br": lambda: masks.causal("bottom_right", 20, 33),
    "window": lambda: masks.sliding_window(4, 2),
    "prefix": lambda: masks.prefix_lm(5),
    "document": lambda: masks.document_from_lengths([10, 13, 10]),
    "document2d": lambda: masks.document(torch.randint(0, 3, (2, 20)).sort(-1).values,
                                         torch.randint(0, 3, (2, 33)).sort(-1).values),
    "padding": lambda: masks.padding([20, 7], [33, 12]),
    "chunked": lambda: masks.chunked(6),
    "dilated": lambda: masks.dilated_sliding_window(3, 2),
    "noop": lambda: masks.noop_mask,
    "algebra": lambda: masks.or_masks(masks.and_masks(masks.causal(), masks.chunked(8)),
                                      masks.not_mask(masks.prefix_lm(3))),
}
BUILTIN_SCORE_MODS = {
    "alibi": lambda: score_mods.alibi(score_mods.alibi_slopes(3), offset=13),
    "softcap": lambda: score_mods.softcap(2.5),
    "relative_bias": lambda: score_mods.relative_bias(_TABLE),
    "head_bias": lambda: score_mods.head_bias([0.5, -1.0, 2.0]),
    "compose": lambda: score_mods.compose(score_mods.alibi([1.0, 0.5, 0.25]),
                                          score_mods.softcap(3.0)),
}


def _roundtrips(obj):
    yield pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    yield torch.load(buf, weights_only=False)


@pytest.mark.parametrize("name", list(BUILTIN_MASKS))
def test_builtin_masks_pickle(name):
    mod = BUILTIN_MASKS[name]()
    q, k, v = (rand(2, 3, n, 8) for n in (20, 33, 33))
    want = attention_reference(q, k, v, mask=mod)
    for back in _roundtrips(mod):
        assert back.__name__ == mod.__name__
        assert (masks.structure_of(back) is None) == (masks.structure_of(mod) is None)
        torch.testing.assert_close(attnkit.attention(q, k, v, mask=back), want)


@pytest.mark.parametrize("name", list(BUILTIN_SCORE_MODS))
def test_builtin_score_mods_pickle(name):
    mod = BUILTIN_SCORE_MODS[name]()
    q, k, v = (rand(2, 3, n, 8) for n in (20, 33, 33))
    want = attention_reference(q, k, v, score_mod=mod)
    for back in _roundtrips(mod):
        assert back.__name__ == mod.__name__
        assert (score_mods.describe(back).bias is None) == (score_mods.describe(mod).bias is None)
        torch.testing.assert_close(attnkit.attention(q, k, v, score_mod=back), want)


def test_block_mask_of_builtin_pickles():
    bm = attnkit.create_block_mask(masks.and_masks(masks.causal(), masks.sliding_window(9)),
                                   1, 1, 40, 40, BLOCK_SIZE=8)
    for back in _roundtrips(bm):
        assert torch.equal(back.to_dense(), bm.to_dense())
        q, k, v = (rand(1, 2, 40, 8) for _ in range(3))
        torch.testing.assert_close(attnkit.attention(q, k, v, mask=back),
                                   attnkit.attention(q, k, v, mask=bm))


# ---- score_mod / mask_mod results are checked ----------------------------------------------


@pytest.mark.parametrize("mod,exc,words", [
    (lambda s, b, h, i, j: None, TypeError, ["score_mod", "<lambda>", "NoneType"]),
    (lambda s, b, h, i, j: s > 0, TypeError, ["score_mod", "bool", "mask="]),
    (lambda s, b, h, i, j: (i - j), TypeError, ["score_mod", "int64"]),
    (lambda s, b, h, i, j: s[..., 0], ValueError, ["score_mod", "shape", "elementwise"]),
    (lambda s, b, h, i, j: s.sum(-1), ValueError, ["score_mod", "shape"]),
])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_bad_score_mod_results_are_one_clear_error(mod, exc, words, backend):
    q, k, v = (rand(2, 2, 9, 8) for _ in range(3))
    for fn in (lambda: attnkit.attention(q, k, v, score_mod=mod, backend=backend),
               lambda: attention_reference(q, k, v, score_mod=mod)):
        with pytest.raises(exc) as info:
            fn()
        for w in words:
            assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("mod,exc,words", [
    (lambda b, h, i, j: None, TypeError, ["mask_mod", "NoneType", "bool"]),
    (lambda b, h, i, j: (i >= j).float(), TypeError, ["mask_mod", "float32", "bias="]),
    (lambda b, h, i, j: (i >= j)[..., 0], ValueError, ["mask_mod", "shape"]),
    (lambda b, h, i, j: torch.ones(3, 3, 3, 3, 3, dtype=torch.bool), ValueError,
     ["mask_mod", "shape"]),
])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_bad_mask_mod_results_are_one_clear_error(mod, exc, words, backend):
    q, k, v = (rand(2, 2, 9, 8) for _ in range(3))
    for fn in (lambda: attnkit.attention(q, k, v, mask=mod, backend=backend),
               lambda: attention_reference(q, k, v, mask=mod)):
        with pytest.raises(exc) as info:
            fn()
        for w in words:
            assert w in str(info.value), (w, str(info.value))


def test_score_mod_results_that_broadcast_are_elementwise():
    """A result computed from the indices alone (shape (1, 1, bq, bk)) is broadcast over
    batch and heads, as the elementwise definition says."""
    q, k, v = (rand(2, 3, 11, 8) for _ in range(3))
    table = rand(11, 11)
    mod = lambda s, b, h, i, j: s + table[i, j]  # noqa: E731
    torch.testing.assert_close(attnkit.attention(q, k, v, score_mod=mod),
                               attention_reference(q, k, v, bias=table))


@pytest.mark.parametrize("backend", ["auto", "tiled"])
@pytest.mark.parametrize("which", ["constant", "table"])
def test_score_mod_that_ignores_the_score_has_a_backward(backend, which):
    q, k, v = (rand(2, 2, 9, 8, requires_grad=True) for _ in range(3))
    table = rand(9, 9, requires_grad=True)
    if which == "constant":
        mod = lambda s, b, h, i, j: torch.full_like(s, 0.5)  # noqa: E731
        inputs = (q, k, v)
    else:
        mod = lambda s, b, h, i, j: table[i, j].expand_as(s)  # noqa: E731
        inputs = (q, k, v, table)
    out = attnkit.attention(q, k, v, score_mod=mod, backend=backend)
    ref = attention_reference(q, k, v, score_mod=mod)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, dout, allow_unused=True)
    rgrads = torch.autograd.grad(ref, inputs, dout, allow_unused=True)
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a if a is not None else torch.zeros_like(b),
                                   b if b is not None else torch.zeros_like(a))


# ---- empty shapes ------------------------------------------------------------------------

import torch.nn.functional as F  # noqa: E402


@pytest.mark.parametrize("shapes", [
    ((0, 2, 5, 8), (0, 2, 7, 8), (0, 2, 7, 8)),      # empty batch
    ((0, 5, 8), (0, 7, 8), (0, 7, 8)),               # 3-D with no heads (torch: no batch)
    ((2, 0, 5, 8), (2, 0, 7, 8), (2, 0, 7, 8)),      # no heads
    ((2, 3, 0, 8), (2, 3, 7, 8), (2, 3, 7, 8)),      # no queries
    ((2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, 0)),      # head dim 0
    ((2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, 4)),      # Dqk 0: every score is 0
    ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 0)),      # Dv 0
])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_empty_shapes_match_torch(shapes, backend):
    q, k, v = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes)
    want = F.scaled_dot_product_attention(q, k, v)
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend=backend)
    assert out.shape == want.shape and lse.shape == want.shape[:-1]
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out, attention_reference(q, k, v))
    g = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    wg = torch.autograd.grad(want.sum(), (q, k, v), allow_unused=True)
    for a, b, x in zip(g, wg, (q, k, v)):
        z = torch.zeros_like(x)
        torch.testing.assert_close(a if a is not None else z, b if b is not None else z)
    for fn in (attnkit.scaled_dot_product_attention, attnkit.flex_attention):
        if q.dim() == 4 or fn is attnkit.scaled_dot_product_attention:
            torch.testing.assert_close(fn(q, k, v), want)


def test_zero_kv_heads_for_some_query_heads_is_a_clear_error():
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 0, 7, 8)
    with pytest.raises(ValueError, match="k has 0 heads.*q has 4"):
        attnkit.attention(q, k, k)


# ---- softcap the compute dtype cannot hold --------------------------------------------------


@pytest.mark.parametrize("cap", [1e300, 1e-300, 1e30, 1e-30])
def test_softcap_float32_cannot_represent_is_refused(cap):
    q = k = v = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match=r"softcap.*float32.*None"):
        attnkit.attention(q, k, v, softcap=cap)
    q64 = q.double()
    torch.testing.assert_close(attnkit.attention(q64, q64, q64, softcap=cap),  # float64: fine
                               attention_reference(q64, q64, q64, softcap=cap))


@pytest.mark.parametrize("cap", [1e17, 1e-17, 1e-3, 1e6])
@pytest.mark.parametrize("lq", [1, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_softcaps_float32_holds_are_computed(cap, lq, dtype):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g).to(dtype) for n in (lq, 40, 40))
    out = attnkit.attention(q, k, v, softcap=cap, causal=True, diagonal="bottom_right")
    ref = attention_reference(q, k, v, softcap=cap, causal=True, diagonal="bottom_right")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# ---- arguments on the wrong device, overflowing windows, lists ------------------------------


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("kwargs,words", [
    ({"sinks": _meta(2)}, ["sinks", "meta", "cpu"]),
    ({"alibi_slopes": _meta(2)}, ["alibi_slopes", "meta"]),
    ({"seqlens_kv": _meta(1, dtype=torch.int64)}, ["seqlens_kv", "meta"]),
    ({"seqlens_q": _meta(1, dtype=torch.int64)}, ["seqlens_q", "meta"]),
    ({"dropout_mask": _meta(6, 6, dtype=torch.bool), "dropout_p": 0.5}, ["dropout_mask",
                                                                          "meta"]),
    ({"mask": _meta(6, 6, dtype=torch.bool)}, ["mask", "meta"]),
    ({"bias": _meta(6, 6)}, ["bias", "meta"]),
    ({"alibi_slopes": "abc"}, ["alibi_slopes", "str"]),
])
def test_arguments_on_the_wrong_device_or_of_the_wrong_kind(kwargs, words):
    q = k = v = torch.randn(1, 2, 6, 8)
    with pytest.raises((ValueError, TypeError)) as info:
        attnkit.attention(q, k, v, **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_meta_qkv_is_a_clear_error():
    with pytest.raises(ValueError, match="q.*meta.*real"):
        attnkit.attention(_meta(1, 2, 6, 8), _meta(1, 2, 6, 8), _meta(1, 2, 6, 8))


def test_varlen_and_paged_arguments_on_the_wrong_device():
    q = torch.randn(6, 2, 16)
    cu = torch.tensor([0, 6])
    with pytest.raises(ValueError, match="cu_seqlens_q.*meta"):
        attnkit.varlen_attention(q, q, q, _meta(2, dtype=torch.int64), cu)
    cache = attnkit.PagedKVCache(4, 4, 2, 16)
    cache.allocate("a")
    cache.append("a", torch.randn(3, 2, 16), torch.randn(3, 2, 16))
    with pytest.raises(ValueError, match="q.*meta"):
        attnkit.paged_attention(_meta(1, 2, 1, 16), cache, ["a"])
    table, lens = cache.block_table(["a"])
    with pytest.raises(ValueError, match="seqlens_kv.*meta"):
        attnkit.paged_attention_blocks(torch.randn(1, 2, 1, 16), cache.k_pages, cache.v_pages,
                                       table, _meta(1, dtype=torch.int32))


@pytest.mark.parametrize("window", [(2 ** 70, 0), (3, 2 ** 70), (2 ** 70, 2 ** 70)])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_huge_windows_are_unbounded_in_effect(window, backend):
    q, k, v = (rand(2, 2, n, 8) for n in (9, 13, 13))
    out = attnkit.attention(q, k, v, window=window, diagonal="bottom_right", backend=backend)
    same = tuple(None if w == 2 ** 70 else w for w in window)
    torch.testing.assert_close(out, attention_reference(q, k, v, window=same,
                                                        diagonal="bottom_right"))
    mask = masks.sliding_window(2 ** 70, 0, "bottom_right", 9, 13)
    torch.testing.assert_close(attnkit.attention(q, k, v, mask=mask, backend=backend),
                               attention_reference(q, k, v, causal=True,
                                                   diagonal="bottom_right"))


def test_lists_where_a_tensor_is_obvious():
    q = torch.randn(6, 2, 16)
    out = attnkit.varlen_attention(q, q, q, [0, 2, 6], [0, 2, 6])
    torch.testing.assert_close(out, attnkit.varlen_attention(q, q, q, torch.tensor([0, 2, 6]),
                                                             torch.tensor([0, 2, 6])))
    cache = attnkit.PagedKVCache(4, 4, 2, 16)
    cache.allocate("a")
    cache.append("a", torch.randn(5, 2, 16), torch.randn(5, 2, 16))
    table, lens = cache.block_table(["a"])
    qq = torch.randn(1, 2, 1, 16)
    want = attnkit.paged_attention_blocks(qq, cache.k_pages, cache.v_pages, table, lens)
    got = attnkit.paged_attention_blocks(qq, cache.k_pages, cache.v_pages, table.tolist(),
                                         lens.tolist())
    torch.testing.assert_close(got, want)


# ---- document lengths that do not cover the sequence ---------------------------------------


@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_document_lengths_must_cover_the_sequence(backend):
    q = k = v = torch.randn(1, 2, 64, 8)
    with pytest.raises(ValueError, match=r"sum to 40.*64 positions"):
        attnkit.attention(q, k, v, mask=masks.document_from_lengths([20, 20]), backend=backend)
    with pytest.raises(ValueError, match=r"document.*40.*64"):
        attnkit.attention(q, k, v, mask=masks.document(torch.arange(40) // 20), backend=backend)


# ---- varlen with per-sequence ALiBi slopes ---------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_varlen_takes_per_sequence_alibi_slopes(backend):
    g = torch.Generator().manual_seed(6)
    lens = [5, 9, 1, 7]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    t = int(cu[-1])
    q, k, v = (torch.randn(t, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    slopes = torch.rand(len(lens), 4, generator=g, dtype=torch.float64)
    out = attnkit.varlen_attention(q, k, v, cu, cu, causal=True, alibi_slopes=slopes,
                                   backend=backend)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref = attention_reference(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                  v[a:b].transpose(0, 1), causal=True, alibi_slopes=slopes[s])
        torch.testing.assert_close(out[a:b].transpose(0, 1), ref)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


# ---- scales, dropout_p = 1 ----------------------------------------------------------------


@pytest.mark.parametrize("scale", [-0.125, -1.0, 0.0, 2.5])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_any_finite_scale_matches_torch_and_the_oracle(scale, backend):
    """float32 forward against torch's fused kernel (torch's math path, which it takes for
    float64 or with gradients, computes sqrt(scale) and gives NaN for a negative one);
    float64 forward and gradients against the oracle."""
    q, k, v = (rand(2, 2, n, 16, dtype=torch.float32) for n in (11, 17, 17))
    with torch.no_grad():
        torch.testing.assert_close(attnkit.attention(q, k, v, scale=scale, backend=backend),
                                   F.scaled_dot_product_attention(q, k, v, scale=scale),
                                   atol=2e-5, rtol=2e-5)
    q, k, v = (rand(2, 2, n, 16, requires_grad=True) for n in (11, 17, 17))
    for kw in ({}, {"causal": True}):
        out = attnkit.attention(q, k, v, scale=scale, backend=backend, **kw)
        want = attention_reference(q, k, v, scale=scale, **kw)
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
        for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)),
                        torch.autograd.grad(want.sum(), (q, k, v))):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("scale", [float("inf"), float("nan")])
def test_non_finite_scale_is_refused(scale):
    q = k = v = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="scale.*finite"):
        attnkit.attention(q, k, v, scale=scale)


def test_dropout_p_one_drops_everything_like_torch():
    q, k, v = (rand(2, 2, 6, 8, requires_grad=True) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    assert want.abs().max() == 0
    out = attnkit.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    torch.testing.assert_close(out, want)
    out2 = attnkit.attention(q, k, v, dropout_p=1.0, seed=3)
    torch.testing.assert_close(out2, want)
    for g in torch.autograd.grad(out2.sum(), (q, k, v)):
        assert torch.equal(g, torch.zeros_like(g))


# ---- torch.func ------------------------------------------------------------------------------


def test_torch_func_grad_and_vjp_match_autograd():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.randn(17, generator=g, dtype=torch.float64)

    def f(q, k, v, t):
        return attnkit.attention(q, k, v, causal=True,
                                 score_mod=lambda s, b, h, i, j: s + t[i - j + 8]).pow(2).sum()

    got = torch.func.grad(f, argnums=(0, 1, 2, 3))(q, k, v, table)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, table)]
    want = torch.autograd.grad(f(*leaves), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    out, vjp = torch.func.vjp(lambda q: attnkit.attention(q, k, v), q)
    dout = torch.randn_like(out)
    qq = q.clone().requires_grad_()
    (want_q,) = torch.autograd.grad(attnkit.attention(qq, k, v), (qq,), dout)
    torch.testing.assert_close(vjp(dout)[0], want_q)


def test_torch_func_vmap_of_the_forward():
    q, k, v = (rand(3, 2, 9, 8) for _ in range(3))
    out = torch.func.vmap(lambda a, b, c: attnkit.attention(a, b, c, causal=True))(q, k, v)
    torch.testing.assert_close(out, attention_reference(q, k, v, causal=True))


@pytest.mark.parametrize("transform", ["jacrev", "vmap_grad", "jvp", "jacfwd"])
def test_unsupported_torch_func_transforms_are_one_clear_error(transform):
    q, k, v = (rand(2, 2, 5, 8) for _ in range(3))
    fn = lambda q: attnkit.attention(q, k, v)  # noqa: E731
    run = {"jacrev": lambda: torch.func.jacrev(fn)(q),
           "vmap_grad": lambda: torch.func.vmap(torch.func.grad(lambda x: fn(x).sum()))(q),
           "jvp": lambda: torch.func.jvp(fn, (q,), (q,)),
           "jacfwd": lambda: torch.func.jacfwd(fn)(q)}[transform]
    with pytest.raises(NotImplementedError, match="attnkit attention"):
        run()


# ---- torch.autocast --------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"softcap": 5.0},
                                {"bias": "float"}, {"mask": "bool"}])
def test_autocast_follows_torch_sdpa(kw):
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 33, 16, generator=g, requires_grad=True) for _ in range(3))
    kw = dict(kw)
    if kw.get("bias") == "float":
        kw["bias"] = torch.randn(33, 33, generator=g)
    if kw.get("mask") == "bool":
        kw["mask"] = torch.rand(33, 33, generator=g) > 0.3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attnkit.attention(q, k, v, **kw)
        if "softcap" not in kw:
            want_dtype = F.scaled_dot_product_attention(
                q, k, v, attn_mask=kw.get("bias", kw.get("mask")),
                is_causal=kw.get("causal", False)).dtype
            assert out.dtype == want_dtype == torch.bfloat16
    assert out.dtype == torch.bfloat16
    cast = {key: (val.bfloat16() if isinstance(val, torch.Tensor) and val.is_floating_point()
                  else val) for key, val in kw.items()}
    same = attnkit.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **cast)
    torch.testing.assert_close(out, same, atol=0, rtol=0)  # the same computation, bit for bit
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_autocast_in_varlen():
    q = torch.randn(10, 2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attnkit.varlen_attention(q, q, q, [0, 4, 10], [0, 4, 10], causal=True)
    assert out.dtype == torch.bfloat16
    b = q.bfloat16()
    torch.testing.assert_close(out, attnkit.varlen_attention(b, b, b, [0, 4, 10], [0, 4, 10],
                                                             causal=True), atol=0, rtol=0)


def test_autocast_dtype_without_device_argument(monkeypatch):
    """torch < 2.4 had no device argument: the fallback reads the CPU getters."""
    from attnkit import checks as spec_module

    def old_is_enabled(*args):
        if args:
            raise TypeError("is_autocast_enabled() takes 0 positional arguments")
        return False

    monkeypatch.setattr(torch, "is_autocast_enabled", old_is_enabled)
    monkeypatch.delattr(torch, "get_autocast_dtype")
    monkeypatch.setattr(torch, "get_autocast_cpu_dtype", lambda: torch.bfloat16)
    monkeypatch.setattr(torch, "is_autocast_cpu_enabled", lambda: True)
    assert spec_module.autocast_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(torch, "is_autocast_cpu_enabled", lambda: False)
    assert spec_module.autocast_dtype("cpu") is None


# ---- flex_attention's output layout ---------------------------------------------------------


@pytest.mark.parametrize("perm", [(0, 2, 1, 3), (1, 0, 2, 3), (2, 1, 0, 3)])
def test_flex_output_follows_the_query_stride_order(perm):
    import warnings

    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    shape = (2, 3, 16, 8)
    base = torch.randn(*[shape[p] for p in perm])
    q = base.permute(*[perm.index(d) for d in range(4)])  # (2, 3, 16, 8), permuted strides
    assert q.shape == shape and not q.is_contiguous()
    k, v = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = torch_flex(q, k, v)
    out = attnkit.flex_attention(q, k, v)
    assert out.stride() == want.stride(), (out.stride(), want.stride())
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert attnkit.attention(q, k, v).is_contiguous()
