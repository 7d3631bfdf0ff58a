"""Front-door fixes: packed sequences with no keys, head dims of 0, flex_attention's output
layout, torch-compatible error classes and flex_attention's ``kernel_options``.

Every case has an oracle: the float64 reference (:func:`attnkit.attention_reference`, per
sequence for packed calls) or torch's own function where torch expresses the case.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import rand

import attnkit
from attnkit import flex as flex_module
from attnkit.reference import attention_reference as ref

try:
    from torch.nn.attention.flex_attention import AuxRequest as TorchAuxRequest
    from torch.nn.attention.flex_attention import flex_attention as torch_flex
except ImportError:  # a torch without FlexAttention
    torch_flex = TorchAuxRequest = None

needs_torch_flex = pytest.mark.skipif(torch_flex is None, reason="torch has no flex_attention")


def _torch_flex(*args, **kwargs):
    """torch's eager flex_attention (it warns that it runs unfused without torch.compile)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch_flex(*args, **kwargs)


# ---- 1. packed sequences with queries but no keys ------------------------------------------


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)


def _per_sequence_reference(q, k, v, lens_q, lens_k, **kw):
    """The float64 reference on each sequence on its own, packed like varlen's results:
    out (Tq, Hq, Dv), lse (Hq, Tq)."""
    cu_q, cu_k = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    outs, lses = [], []
    for s in range(len(lens_q)):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)
        ks = k[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        vs = v[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        o, lse = ref(qs, ks, vs, return_lse=True, **kw)
        outs.append(o.transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["auto", "decode", "tiled"])
def test_varlen_query_with_no_keys_gives_a_zero_row(dtype, backend):
    """One query row, zero keys (cu_seqlens_kv = [0, 0]): a row that sees no key gives 0 and
    lse -inf, as the reference says (this raised IndexError in the decode executor's check)."""
    g = torch.Generator().manual_seed(0)
    q = rand(1, 2, 16, gen=g, dtype=dtype)
    k, v = rand(0, 2, 16, gen=g, dtype=dtype), rand(0, 2, 16, gen=g, dtype=dtype)
    out, lse = attnkit.varlen_attention(q, k, v, [0, 1], [0, 0], return_lse=True,
                                        backend=backend)
    r, rl = _per_sequence_reference(q, k, v, [1], [0])
    assert out.shape == (1, 2, 16) and out.dtype == dtype and lse.shape == (2, 1)
    assert torch.equal(out, r.to(dtype)) and torch.all(out == 0)
    assert torch.all(torch.isneginf(lse)) and torch.all(torch.isneginf(rl))


# Sequences with queries and no keys, with keys and no queries, with both; the second set has
# one query row per sequence that has any (the decoding form the decode executor reads), the
# third ends on a sequence with queries and no keys.
_MIXED = {
    "mixed": ([2, 0, 3, 1, 0], [0, 4, 0, 5, 3]),
    "decoding_form": ([1, 0, 1, 1, 1], [0, 3, 5, 0, 2]),
    "decoding_form_last_without_keys": ([1, 1, 0, 1], [3, 2, 4, 0]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(_MIXED))
@pytest.mark.parametrize("kw", [dict(), dict(causal=True, diagonal="bottom_right")],
                         ids=["dense", "causal_bottom_right"])
def test_varlen_sequences_without_keys_or_queries_forward_and_backward(case, kw, dtype):
    lens_q, lens_k = _MIXED[case]
    g = torch.Generator().manual_seed(1)
    q = rand(sum(lens_q), 4, 16, gen=g, dtype=dtype, requires_grad=True)
    k = rand(sum(lens_k), 2, 16, gen=g, dtype=dtype, requires_grad=True)
    v = rand(sum(lens_k), 2, 16, gen=g, dtype=dtype, requires_grad=True)
    dout = rand(sum(lens_q), 4, 16, gen=g, dtype=dtype)
    out, lse = attnkit.varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), return_lse=True,
                                        **kw)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    r, rl = _per_sequence_reference(q64, k64, v64, lens_q, lens_k, **kw)
    atol = 1e-12 if dtype == torch.float64 else 2e-5
    assert out.shape == r.shape and torch.allclose(out.double(), r, atol=atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert torch.allclose(lse[fin].double(), rl[fin], atol=atol)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(r, (q64, k64, v64), dout.double())
    for name, a, b in zip("qkv", got, want):
        assert torch.allclose(a.double(), b, atol=10 * atol), name


# ---- 2. head dims of 0 ----------------------------------------------------------------------


_SDPA_OPTIONS = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "float_mask": dict(attn_mask="float"),
    "bool_mask": dict(attn_mask="bool"),
}


@pytest.mark.parametrize("dims", [(0, 0), (0, 3), (5, 0)], ids=["dqk0_dv0", "dqk0", "dv0"])
@pytest.mark.parametrize("option", list(_SDPA_OPTIONS))
def test_zero_head_dims_match_torch_sdpa(dims, option):
    """torch: an empty q.k makes every score 0 (Dqk = 0: the mean of v over the visible keys);
    Dv = 0 gives an empty output of shape (..., Lq, 0)."""
    dqk, dv = dims
    g = torch.Generator().manual_seed(2)
    q, k = rand(2, 4, 8, dqk, gen=g, dtype=torch.float32), rand(2, 4, 8, dqk, gen=g,
                                                               dtype=torch.float32)
    v = rand(2, 4, 8, dv, gen=g, dtype=torch.float32)
    kw = dict(_SDPA_OPTIONS[option])
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = rand(8, 8, gen=g, dtype=torch.float32)
    elif kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(8, 8, generator=g) > 0.3
        kw["attn_mask"][:, 0] = True  # every row sees a key (torch's math path gives NaN else)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    got = attnkit.scaled_dot_product_attention(q, k, v, **kw)
    assert got.shape == want.shape == (2, 4, 8, dv)
    assert torch.allclose(got, want, atol=1e-6)


_ZERO_DIM_OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window_bottom_right": dict(window=(2, 1), diagonal="bottom_right"),
    "bias": dict(bias="bias"),
    "alibi_softcap": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
                          softcap=3.0),
    "sinks": dict(sinks="sinks"),
    "seqlens": dict(seqlens_q=[5, 3], seqlens_kv=[7, 0]),
}


@pytest.mark.parametrize("dims", [(0, 0), (0, 5), (8, 0)], ids=["dqk0_dv0", "dqk0", "dv0"])
@pytest.mark.parametrize("option", list(_ZERO_DIM_OPTIONS))
@pytest.mark.parametrize("lq", [3, 5])
def test_zero_head_dims_attention_forward_and_backward(dims, option, lq):
    """attnkit.attention with Dqk = 0 and/or Dv = 0 against the float64 reference: out, lse
    and the gradients of q, k, v, bias and sinks (few query rows: the decoding case)."""
    dqk, dv = dims
    g = torch.Generator().manual_seed(3)
    q = rand(2, 4, lq, dqk, gen=g, requires_grad=True)
    k = rand(2, 2, 7, dqk, gen=g, requires_grad=True)
    v = rand(2, 2, 7, dv, gen=g, requires_grad=True)
    kw = dict(_ZERO_DIM_OPTIONS[option])
    if kw.get("bias") == "bias":
        kw["bias"] = rand(4, lq, 7, gen=g, requires_grad=True)
    if kw.get("sinks") == "sinks":
        kw["sinks"] = rand(4, gen=g, requires_grad=True)
    if "seqlens_q" in kw:
        kw["seqlens_q"] = [min(lq, n) for n in kw["seqlens_q"]]
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    r, rl = ref(q, k, v, return_lse=True, **kw)
    assert out.shape == r.shape == (2, 4, lq, dv)
    assert torch.allclose(out, r, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert torch.allclose(lse[fin], rl[fin], atol=1e-12)
    dout = rand(*out.shape, gen=g)
    dlse = rand(*lse.shape, gen=g)
    leaves = [x for x in (q, k, v, kw.get("bias"), kw.get("sinks"))
              if isinstance(x, torch.Tensor) and x.requires_grad]
    got = torch.autograd.grad((out * dout).sum() + (lse[fin] * dlse[fin]).sum(), leaves,
                              allow_unused=True)
    want = torch.autograd.grad((r * dout).sum() + (rl[fin] * dlse[fin]).sum(), leaves,
                               allow_unused=True)
    for a, b in zip(got, want):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_head_dims_low_precision_decoding_shapes(dtype):
    """The shapes of the report: (2, 4, 8, 0) in float32 (a few query rows picked the decode
    kernel, which refused D = 0 with an internal message)."""
    q = torch.randn(2, 4, 8, 0, dtype=dtype)
    out = attnkit.attention(q, q, q)
    assert out.shape == (2, 4, 8, 0) and out.dtype == dtype
    v = torch.randn(2, 4, 8, 16, dtype=dtype)
    out = attnkit.attention(q, q, v, causal=True)
    want = F.scaled_dot_product_attention(q.float(), q.float(), v.float(), is_causal=True)
    assert torch.allclose(out.float(), want, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("backend", ["decode", "flash"])
def test_zero_head_dims_refused_by_executors_that_do_not_run_them(backend):
    """An executor that does not declare empty head dims refuses them by name, so a forced
    one says why instead of failing inside its kernel."""
    q = torch.randn(2, 4, 8, 0)
    with pytest.raises(NotImplementedError, match="head dim") as info:
        attnkit.attention(q, q, q, backend=backend)
    assert "Dqk=0" in str(info.value)


# ---- 3. flex_attention's output in the query's stride order ---------------------------------


def _layouts(shape, perms):
    """The query ``shape`` stored in each order of its dims in ``perms`` (outermost first),
    expanded along Lq, and as a slice of a wider (B, L, H, E') buffer."""
    for perm in perms:
        inverse = [perm.index(i) for i in range(4)]
        yield f"perm{perm}", torch.randn(*[shape[p] for p in perm]).permute(inverse)
    b, h, lq, e = shape
    yield "expanded", torch.randn(b, h, 1, e).expand(b, h, lq, e)
    yield "sliced", torch.randn(b, lq, h, e + 3)[..., :e].permute(0, 2, 1, 3)


_ALL_ORDERS = list(itertools.permutations(range(4)))
# (torch's eager flex takes about 0.3 s for each new layout: every order for the plain
# shape; for the shapes with a size-1 dim, the orders that put it at each place)
_SOME_ORDERS = [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3), (2, 3, 0, 1), (3, 2, 1, 0)]


@needs_torch_flex
@pytest.mark.parametrize("shape,perms", [((2, 3, 5, 4), _ALL_ORDERS),
                                         ((1, 3, 5, 4), _SOME_ORDERS),
                                         ((2, 3, 5, 1), _SOME_ORDERS)],
                         ids=["plain", "batch1", "head_dim1"])
def test_flex_output_strides_follow_the_query_like_torch(shape, perms):
    """torch lays out flex_attention's output in the query's stride order, with the head dim
    innermost (``_permute_strides`` in torch's FlexAttention): e.g. a query viewed from a
    contiguous (B, L, H, E) buffer gives a (B, L, H, E) output."""
    k, v = torch.randn(shape), torch.randn(shape[:3] + (6,))
    for name, q in _layouts(shape, perms):
        assert q.shape == shape
        want = _torch_flex(q, k, v)
        got = attnkit.flex_attention(q, k, v)
        assert got.stride() == want.stride(), (name, q.stride(), got.stride(), want.stride())
        assert torch.allclose(got, want, atol=1e-5), name
        if name in ("perm(0, 2, 1, 3)", "expanded"):  # the same layout with return_aux
            got, aux = attnkit.flex_attention(q, k, v,
                                              return_aux=attnkit.AuxRequest(lse=True))
            want, want_aux = _torch_flex(q, k, v, return_aux=TorchAuxRequest(lse=True))
            assert got.stride() == want.stride(), name
            assert aux.lse.stride() == want_aux.lse.stride(), name


def test_flex_output_in_query_layout_keeps_its_gradient():
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64, requires_grad=True)
    q = x.permute(0, 2, 1, 3)
    k, v = (torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    out = attnkit.flex_attention(q, k, v)
    assert out.stride() == (144, 8, 24, 1)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, k, v), dout)
    want = torch.autograd.grad(ref(q, k, v), (x, k, v), dout)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)


# ---- 4. errors that torch-written code catches as RuntimeError -----------------------------


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# (torch's drop-in raises RuntimeError for each; attnkit's error class before the fix)
_SDPA_BAD = {
    "mixed_dtypes": ((_r(2, 3, 4, 8), _r(2, 3, 5, 8, dtype=torch.float64), _r(2, 3, 5, 8)),
                     {}, TypeError),
    "half_and_float": ((_r(2, 3, 4, 8).half(), _r(2, 3, 5, 8), _r(2, 3, 5, 8)), {}, TypeError),
    "one_dim": ((_r(8), _r(8), _r(8)), {}, ValueError),
    "zero_dim": ((torch.tensor(1.0), torch.tensor(1.0), torch.tensor(1.0)), {}, ValueError),
    "head_dims_differ": ((_r(2, 3, 4, 8), _r(2, 3, 5, 7), _r(2, 3, 5, 8)), {}, ValueError),
    "batch_mismatch": ((_r(2, 3, 4, 8), _r(3, 3, 5, 8), _r(3, 3, 5, 8)), {}, ValueError),
    "heads_without_gqa": ((_r(2, 4, 4, 8), _r(2, 2, 5, 8), _r(2, 2, 5, 8)), {}, ValueError),
    "gqa_ratio": ((_r(2, 3, 4, 8), _r(2, 2, 5, 8), _r(2, 2, 5, 8)), {"enable_gqa": True},
                  ValueError),
    "integer_inputs": ((torch.ones(2, 3, 4, 8, dtype=torch.int64),) * 3, {}, TypeError),
    "mask_shape": ((_r(2, 3, 4, 8), _r(2, 3, 5, 8), _r(2, 3, 5, 8)),
                   {"attn_mask": torch.ones(3, 5, dtype=torch.bool)}, ValueError),
    "mask_integer": ((_r(2, 3, 4, 8), _r(2, 3, 5, 8), _r(2, 3, 5, 8)),
                     {"attn_mask": torch.ones(4, 5, dtype=torch.int64)}, TypeError),
    "dropout_above_one": ((_r(2, 3, 4, 8), _r(2, 3, 5, 8), _r(2, 3, 5, 8)),
                          {"dropout_p": 2.0}, ValueError),
}


@pytest.mark.parametrize("case", list(_SDPA_BAD))
def test_sdpa_drop_in_errors_are_caught_as_runtime_errors_like_torch(case):
    args, kwargs, original = _SDPA_BAD[case]
    with pytest.raises(RuntimeError):  # the oracle: torch's own function
        F.scaled_dot_product_attention(*args, **kwargs)
    with pytest.raises(RuntimeError) as info:  # what `except RuntimeError` sees
        attnkit.scaled_dot_product_attention(*args, **kwargs)
    assert isinstance(info.value, original), type(info.value)  # still the attnkit class
    assert isinstance(info.value, (attnkit.AttentionTypeError, attnkit.AttentionValueError))
    assert str(info.value)  # the message is kept


# (torch's flex raises RuntimeError for the first two, ValueError for the others)
_FLEX_BAD = {
    "value_length_differs": ((_r(2, 3, 4, 8), _r(2, 3, 5, 8), _r(2, 3, 6, 8)), {},
                             ValueError, RuntimeError),
    "value_heads_differ": ((_r(2, 4, 4, 8), _r(2, 2, 5, 8), _r(2, 4, 5, 8)),
                           {"enable_gqa": True}, ValueError, RuntimeError),
    "head_dims_differ": ((_r(2, 3, 4, 8), _r(2, 3, 5, 7), _r(2, 3, 5, 8)), {}, ValueError,
                         ValueError),
    "heads_without_gqa": ((_r(2, 4, 4, 8), _r(2, 2, 5, 8), _r(2, 2, 5, 8)), {}, ValueError,
                          ValueError),
    "gqa_ratio": ((_r(2, 3, 4, 8), _r(2, 2, 5, 8), _r(2, 2, 5, 8)), {"enable_gqa": True},
                  ValueError, ValueError),
}


@needs_torch_flex
@pytest.mark.parametrize("case", list(_FLEX_BAD))
def test_flex_errors_are_caught_like_torch(case):
    args, kwargs, original, torch_class = _FLEX_BAD[case]
    with pytest.raises(torch_class):
        _torch_flex(*args, **kwargs)
    with pytest.raises(torch_class) as info:
        attnkit.flex_attention(*args, **kwargs)
    assert isinstance(info.value, original) and isinstance(info.value, RuntimeError)


def test_error_classes_are_public_and_both_kinds():
    for name, base in (("AttentionTypeError", TypeError), ("AttentionValueError", ValueError)):
        cls = getattr(attnkit, name)
        assert name in attnkit.__all__ and cls.__doc__
        assert issubclass(cls, base) and issubclass(cls, RuntimeError)


def test_errors_from_the_drop_in_keep_their_traceback():
    q = torch.randn(2, 3, 4, 8)
    with pytest.raises(attnkit.AttentionTypeError) as info:
        attnkit.scaled_dot_product_attention(q, q.double(), q)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    frames = [entry.name for entry in info.traceback]
    assert "scaled_dot_product_attention" in frames and len(frames) > 2  # where it was raised


# ---- 5. flex_attention's kernel_options ------------------------------------------------------


def _flex_inputs(seed=5):
    g = torch.Generator().manual_seed(seed)
    return (rand(1, 2, 9, 8, gen=g, dtype=torch.float32) for _ in range(3))


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which tuning keys flex_attention already warned about."""
    monkeypatch.setattr(flex_module, "_WARNED", set())


@needs_torch_flex
@pytest.mark.parametrize("options", [{"BLOCK_M": 64, "BLOCK_N": 32}, {"num_warps": 4},
                                     {"num_stages": 2, "fwd_BLOCK_M": 32, "bwd_BLOCK_M1": 16},
                                     {"USE_TMA": True, "WRITE_DQ": False, "waves_per_eu": 2}],
                         ids=["blocks", "warps", "prefixed", "gpu_flags"])
def test_flex_kernel_tuning_keys_warn_once_and_change_nothing(options, fresh_warnings):
    q, k, v = _flex_inputs()
    want = _torch_flex(q, k, v, kernel_options=options)  # torch: accepted, same result
    with pytest.warns(UserWarning, match="tune") as record:
        got = attnkit.flex_attention(q, k, v, kernel_options=options)
    text = " ".join(str(w.message) for w in record)
    assert all(key in text for key in options)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got, attnkit.flex_attention(q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the same keys again stay quiet
        attnkit.flex_attention(q, k, v, kernel_options=options)


@needs_torch_flex
@pytest.mark.parametrize("options", [{"PRESCALE_QK": True}, {"ROWS_GUARANTEED_SAFE": True},
                                     {"BLOCKS_ARE_CONTIGUOUS": True}, {"BACKEND": "AUTO"},
                                     {"backend": "tiled"}])
def test_flex_kernel_options_that_are_honoured_quietly(options, fresh_warnings):
    q, k, v = _flex_inputs()
    want = _torch_flex(q, k, v, kernel_options={
        key: val for key, val in options.items() if key != "backend"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = attnkit.flex_attention(q, k, v, kernel_options=options)
    assert torch.allclose(got, want, atol=1e-6)


@needs_torch_flex
def test_flex_kernel_backend_value_torch_does_not_know_is_refused_like_torch():
    q, k, v = _flex_inputs()
    with pytest.raises(ValueError, match="BACKEND"):
        _torch_flex(q, k, v, kernel_options={"BACKEND": "bogus"})
    with pytest.raises(ValueError) as info:
        attnkit.flex_attention(q, k, v, kernel_options={"BACKEND": "bogus"})
    msg = str(info.value)
    assert all(w in msg for w in ("BACKEND", "bogus", "AUTO", "TRITON", "FLASH"))


@pytest.mark.parametrize("value", ["FLASH", "TRITON_DECODE"])
def test_flex_kernel_backends_attnkit_does_not_have_are_refused(value):
    q, k, v = _flex_inputs()
    with pytest.raises(ValueError) as info:
        attnkit.flex_attention(q, k, v, kernel_options={"BACKEND": value})
    msg = str(info.value)
    assert all(w in msg for w in ("BACKEND", value, "AUTO", "backend"))


def test_flex_kernel_backend_triton_forces_attnkit_triton_executor(monkeypatch):
    """``BACKEND="TRITON"`` is attnkit's Triton executor, forced: where it cannot run the call
    the error names the key and says why (never a silent fallback)."""
    seen = []
    real = flex_module.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_module, "attention", spy)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _flex_inputs()
    with pytest.raises(NotImplementedError) as info:
        attnkit.flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON"})
    assert seen == ["triton"]
    msg = str(info.value)
    assert all(w in msg for w in ("BACKEND", "TRITON", "triton", "AUTO"))


@needs_torch_flex
def test_flex_kernel_backend_with_force_flex_is_refused_like_torch(fresh_warnings):
    q, k, v = _flex_inputs()
    options = {"BACKEND": "AUTO", "FORCE_USE_FLEX_ATTENTION": True}
    with pytest.raises(RuntimeError):
        _torch_flex(q, k, v, kernel_options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not warned about first
        with pytest.raises(RuntimeError, match="FORCE_USE_FLEX_ATTENTION") as info:
            attnkit.flex_attention(q, k, v, kernel_options=options)
    assert isinstance(info.value, ValueError)


@needs_torch_flex
@pytest.mark.parametrize("key,fix", [("OUTPUT_LOGSUMEXP", "lse=True"),
                                     ("OUTPUT_MAX", "max_scores=True")])
def test_flex_kernel_options_set_by_flex_itself_are_refused_like_torch(key, fix):
    q, k, v = _flex_inputs()
    with pytest.raises(AssertionError, match=key):  # torch: "must not be in kernel_options"
        _torch_flex(q, k, v, kernel_options={key: True})
    with pytest.raises(ValueError) as info:
        attnkit.flex_attention(q, k, v, kernel_options={key: True})
    assert key in str(info.value) and fix in str(info.value)


@pytest.mark.parametrize("options", [{"FOO": 1}, {"block_m": 64}, {"SM_SCALE": 0.5},
                                     {"fwd_BACKEND": "AUTO"}])
def test_flex_unknown_kernel_options_are_refused_with_the_valid_ones(options):
    q, k, v = _flex_inputs()
    with pytest.raises(ValueError) as info:
        attnkit.flex_attention(q, k, v, kernel_options=options)
    msg = str(info.value)
    (key,) = options
    assert all(w in msg for w in (repr(key), "BACKEND", "BLOCK_M", "PRESCALE_QK", "backend"))


def test_flex_backend_keys_that_disagree_are_refused():
    q, k, v = _flex_inputs()
    with pytest.raises(ValueError, match="BACKEND"):
        attnkit.flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON",
                                                        "backend": "tiled"})


def test_flex_documents_its_kernel_options():
    doc = attnkit.flex_attention.__doc__
    for word in ("BACKEND", "BLOCK_M", "num_warps", "PRESCALE_QK", "ROWS_GUARANTEED_SAFE",
                 "OUTPUT_LOGSUMEXP", "warn"):
        assert word in doc, word


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decoding_step_over_an_empty_cache_gives_zero_rows(dtype):
    """A few query rows over Lk = 0 keys in the decode executor's form: zero rows, lse -inf
    (the native kernel refused a cache of no tokens instead of saying so before the call)."""
    q = torch.randn(2, 4, 1, 16, dtype=dtype)
    k = torch.randn(2, 4, 0, 16, dtype=dtype)
    for backend in ("auto", "decode"):
        out, lse = attnkit.attention(q, k, k, return_lse=True, backend=backend)
        r, rl = ref(q, k, k, return_lse=True)
        assert torch.equal(out, r.to(dtype)) and torch.all(out == 0)
        assert torch.all(torch.isneginf(lse)) and torch.all(torch.isneginf(rl))
