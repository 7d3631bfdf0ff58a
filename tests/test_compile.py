"""attnkit inside compiled graphs: the custom ops pass ``torch.library.opcheck``, a Llama-style
block compiles to one graph (forward and backward) with the eager results, dynamic shapes do
not recompile per length, what cannot compile says why, and torch's own ``varlen_attn`` runs on
CPU through attnkit."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing as dynamo_testing
import torch.nn.attention.varlen  # noqa: F401 (torch.nn.attention.varlen.varlen_attn)

import attnkit
from attnkit import compiled, masks, native, ops, score_mods
from attnkit.integrations import torch_varlen
from attnkit.reference import attention_reference
from attnkit.spec import Options
from attnkit.varlen import pack_varlen

L = 24


def _qkv(b=2, hq=4, hkv=2, lq=L, lk=L, dqk=8, dv=8, dtype=torch.float32, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, dqk, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, dqk, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, dv, generator=g).to(dtype)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _learnable(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.3).requires_grad_(True)


# ---- torch.library.opcheck on a grid of options --------------------------------------------


OP_CASES = {
    "dense": dict(),
    "causal": dict(causal=True),
    "causal_bottom_right": dict(causal=True, diagonal="bottom_right", lk=L + 8),
    "window": dict(window=(5, 2)),
    "softcap": dict(causal=True, softcap=5.0),
    "alibi": dict(causal=True, alibi_slopes=score_mods.alibi_slopes(4)),
    "sinks": dict(causal=True, sinks=_learnable(4)),
    "bias_grad": dict(bias=_learnable(L, L)),
    "bool_mask": dict(mask=torch.rand(2, 1, L, L, generator=torch.Generator().manual_seed(3))
                      > 0.3),
    "mqa_dv": dict(hkv=1, dv=12, causal=True),
    "seqlens": dict(causal=True, seqlens_q=torch.tensor([10, L]), seqlens_kv=torch.tensor([10, L])),
    "document": dict(mask=masks.and_masks(masks.document_from_lengths([9, 15]), masks.causal())),
    "block_mask": dict(mask=attnkit.create_block_mask(masks.causal(), None, None, L, L,
                                                       BLOCK_SIZE=8)),
    "relative_bias": dict(score_mod=score_mods.relative_bias(_learnable(2 * L - 1, seed=4))),
    "dropout": dict(dropout_p=0.25, seed=7),
    "bf16": dict(causal=True, dtype=torch.bfloat16),
    "max_scores": dict(causal=True, outputs=("max_scores",)),
}


def _op_args(case):
    kw = dict(case)
    shape = {n: kw.pop(n) for n in ("hkv", "dv", "lk", "dtype") if n in kw}
    outputs = kw.pop("outputs", ())
    q, k, v = _qkv(**shape)
    p = ops.pack("attention", q, k, v, Options(**kw), backend="auto", outputs=outputs)
    grads = [i for i, t in enumerate(p.grad_tensors) if t.requires_grad]
    if grads:
        p.config["grads"] = grads
    return (q, k, v, p.grad_tensors, p.tensors, ops._to_json(p.config))


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_attention_op_passes_opcheck(name):
    args = _op_args(OP_CASES[name])
    torch.library.opcheck(torch.ops.attnkit.attention.default, args)


# (not relative_bias: below autograd a builtin score_mod's table gradient comes from
# torch.func.vjp, whose wrapper tensors opcheck's dispatch modes cannot inspect; that gradient
# under torch.compile is checked against eager in the Llama-block tests)
@pytest.mark.parametrize("name", ["causal", "bias_grad", "sinks", "dropout"])
def test_attention_backward_op_passes_opcheck(name):
    q, k, v, gt, tensors, config = _op_args(OP_CASES[name])
    with torch.no_grad():
        out, lse, _ = torch.ops.attnkit.attention(q, k, v, gt, tensors, config)
    dout = torch.randn_like(out)
    # the backward op is not itself differentiated through (a double backward runs the
    # differentiable torch-op backward instead): its inputs need no grad
    q, k, v = (x.detach() for x in (q, k, v))
    gt = [t.detach() for t in gt]
    torch.library.opcheck(torch.ops.attnkit.attention_backward.default,
                          (q, k, v, gt, tensors, config, out, lse, dout, None))


def test_varlen_and_paged_ops_pass_opcheck():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 14, 17])
    q, k, v = (torch.randn(17, h, 8, generator=g).requires_grad_(True) for h in (4, 2, 2))
    p, qt, kt, vt = pack_varlen(q, k, v, cu, cu, Options(causal=True), "auto")
    torch.library.opcheck(torch.ops.attnkit.attention.default,
                          (qt, kt, vt, p.grad_tensors, p.tensors, ops._to_json(p.config)))
    k_pages, v_pages = torch.randn(6, 4, 2, 16, generator=g), torch.randn(6, 4, 2, 16, generator=g)
    table = torch.tensor([[3, 1, 4], [0, 5, 2]], dtype=torch.int32)
    lens = torch.tensor([9, 12], dtype=torch.int32)
    qd = torch.randn(2, 4, 1, 16, generator=g)
    k_stub, v_stub = ops.stand_ins(k_pages, v_pages, table)
    p = ops.pack("paged", qd, k_stub, v_stub, Options(causal=True, diagonal="bottom_right"),
                 backend="decode", extra={"k_pages": k_pages, "v_pages": v_pages,
                                          "block_table": table})
    p.slots["seqlens_kv"] = lens
    torch.library.opcheck(torch.ops.attnkit.attention.default,
                          (qd, k_stub, v_stub, p.grad_tensors, p.tensors,
                           ops._to_json(p.config)))
    k8, v8 = k_pages.to(torch.float8_e4m3fn), v_pages.to(torch.float8_e4m3fn)  # fp8 pages
    k_stub, v_stub = ops.stand_ins(k8, v8, table, dtype=qd.dtype)
    p = ops.pack("paged", qd, k_stub, v_stub, Options(causal=True, diagonal="bottom_right"),
                 backend="decode", extra={"k_pages": k8, "v_pages": v8, "block_table": table,
                                          "k_descale": torch.full((6, 2), 0.5),
                                          "v_descale": torch.full((6, 2), 2.0)})
    p.slots["seqlens_kv"] = lens
    # (test_schema multiplies the tensor arguments, which torch cannot do in fp8)
    torch.library.opcheck(torch.ops.attnkit.attention.default,
                          (qd, k_stub, v_stub, p.grad_tensors, p.tensors,
                           ops._to_json(p.config)),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


# ---- a Llama-style block under torch.compile(fullgraph=True) --------------------------------


class Block(torch.nn.Module):
    """RMSNorm, QKV projection, rotary embedding, attention, output projection."""

    def __init__(self, d=32, h=4, hkv=2, attend=None, **opts):
        super().__init__()
        self.h, self.hkv, self.dh = h, hkv, d // h
        self.norm = torch.nn.RMSNorm(d)
        self.qkv = torch.nn.Linear(d, (h + 2 * hkv) * self.dh, bias=False)
        self.o = torch.nn.Linear(h * self.dh, d, bias=False)
        self.attend = attend or (lambda q, k, v: attnkit.attention(q, k, v, **opts))
        for i, t in enumerate(x for x in opts.values() if isinstance(x, torch.nn.Parameter)):
            self.register_parameter(f"extra{i}", t)

    @staticmethod
    def rope(x):
        half = x.shape[-1] // 2
        pos = torch.arange(x.shape[-2], dtype=x.dtype)
        ang = pos[:, None] / (10000 ** (torch.arange(half, dtype=x.dtype) / half))[None]
        c, s = ang.cos(), ang.sin()
        return torch.cat([x[..., :half] * c - x[..., half:] * s,
                          x[..., :half] * s + x[..., half:] * c], -1)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(self.norm(x)).view(b, n, self.h + 2 * self.hkv, self.dh).transpose(1, 2)
        q, k, v = qkv.split([self.h, self.hkv, self.hkv], dim=1)
        a = self.attend(self.rope(q), self.rope(k), v)
        return x + self.o(a.transpose(1, 2).reshape(b, n, -1))


def _varlen_attend(q, k, v):
    cu = torch.tensor([0, 20, 48])  # two batch rows of 24 packed as sequences of 20 and 28
    pack = [x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]) for x in (q, k, v)]
    out = attnkit.varlen_attention(*pack, cu, cu, causal=True)
    return out.view(q.shape[0], q.shape[2], q.shape[1], -1).transpose(1, 2)


def _flex_attend(q, k, v):
    return attnkit.flex_attention(q, k, v, score_mod=score_mods.softcap(8.0),
                                  block_mask=attnkit.create_block_mask(
                                      masks.causal(), None, None, L, L, BLOCK_SIZE=8),
                                  enable_gqa=True)


def _sdpa_attend(q, k, v):
    return attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


BLOCK_CASES = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(6, 0)),
    "softcap": dict(causal=True, softcap=4.0),
    "alibi": dict(causal=True, alibi_slopes=score_mods.alibi_slopes(4)),
    "sinks": dict(causal=True, sinks=torch.nn.Parameter(torch.zeros(4))),
    "bias_grad": dict(bias=torch.nn.Parameter(torch.randn(L, L) * 0.1)),
    "seqlens": dict(causal=True, seqlens_q=torch.tensor([14, L]), seqlens_kv=torch.tensor([14, L])),
    "document": dict(mask=masks.and_masks(masks.document_from_lengths([10, 14]), masks.causal())),
    "block_mask": dict(mask=attnkit.create_block_mask(masks.causal(), None, None, L, L,
                                                       BLOCK_SIZE=8)),
    "block_mask_lambda": dict(mask=attnkit.create_block_mask(
        lambda b, h, i, j: (i >= j) & (i - j < 9), None, None, L, L, BLOCK_SIZE=8)),
    "mask_lambda": dict(mask=lambda b, h, i, j: (i >= j) & ((i + j) % 3 != 1)),
    "relative_bias": dict(score_mod=score_mods.relative_bias(
        torch.nn.Parameter(torch.randn(2 * L - 1) * 0.1))),
    "dropout": dict(causal=True, dropout_p=0.2, seed=3),
    "varlen": dict(attend=_varlen_attend),
    "flex": dict(attend=_flex_attend),
    "sdpa": dict(attend=_sdpa_attend),
}


def _compiled_and_eager(block, x, **compile_kwargs):
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(block, backend=counter, **compile_kwargs)
    y = fn(x)
    y.square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad(set_to_none=True)
    ye = block(x)
    ye.square().sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    return counter, y, ye, got, want


@pytest.mark.parametrize("name", sorted(BLOCK_CASES))
def test_llama_block_compiles_to_one_graph_with_the_eager_results(name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(**BLOCK_CASES[name])
    x = torch.randn(2, L, 32, requires_grad=True)
    counter, y, ye, got, want = _compiled_and_eager(block, x, fullgraph=True)
    assert counter.frame_count == 1
    assert sum(1 for node in _graph_nodes(counter) if "attnkit" in str(node.target)) >= 1
    torch.testing.assert_close(y, ye, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _graph_nodes(counter):
    return [n for gm in getattr(counter, "graphs", []) for n in gm.graph.nodes]


def test_paged_decode_compiles_to_one_graph():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    k_pages, v_pages = torch.randn(6, 4, 2, 16, generator=g), torch.randn(6, 4, 2, 16, generator=g)
    table = torch.tensor([[3, 1, 4], [0, 5, 2]], dtype=torch.int32)
    lens = torch.tensor([9, 12], dtype=torch.int32)
    q = torch.randn(2, 4, 1, 16, generator=g)

    def step(q, k_pages, v_pages):
        return attnkit.paged_attention_blocks(q, k_pages, v_pages, table, lens, causal=True,
                                              diagonal="bottom_right")

    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    got = torch.compile(step, backend=counter, fullgraph=True)(q, k_pages, v_pages)
    assert counter.frame_count == 1
    torch.testing.assert_close(got, step(q, k_pages, v_pages), rtol=0, atol=0)
    k, v = attnkit.gather_kv(k_pages, v_pages, table, lens)
    for b in range(2):
        n = int(lens[b])
        ref = attention_reference(q[b:b + 1].double(), k[b:b + 1, :, :n].double(),
                                  v[b:b + 1, :, :n].double(), causal=True,
                                  diagonal="bottom_right")
        torch.testing.assert_close(got[b:b + 1].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.available(), reason="native kernel unavailable")
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_paged_decode_compiles_to_one_graph(fmt, kernel_pages):
    """fp8 pages with their (page, kv head) descales inside torch.compile: one graph, the
    kernel reads the fp8 pages (no gathered copy), the eager result bit for bit."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    cache = attnkit.PagedKVCache(8, 4, 2, 16, dtype=fmt)
    for sid, n in (("a", 9), ("b", 14)):
        cache.allocate(sid)
        cache.append(sid, torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g))
    table, lens = cache.block_table(["a", "b"])
    q = torch.randn(2, 4, 1, 16, generator=g).bfloat16()
    pages_seen = kernel_pages
    def step(q, k_pages, v_pages, k_descale, v_descale):
        return attnkit.paged_attention_blocks(q, k_pages, v_pages, table, lens,
                                              k_descale=k_descale, v_descale=v_descale)

    args = (q, cache.k_pages, cache.v_pages, cache.k_descale, cache.v_descale)
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    got = torch.compile(step, backend=counter, fullgraph=True)(*args)
    assert counter.frame_count == 1 and got.dtype == torch.bfloat16
    assert pages_seen and set(pages_seen) == {fmt}
    torch.testing.assert_close(got, step(*args), rtol=0, atol=0)
    k, v = cache.gather(["a", "b"], dtype=torch.float64)
    ref = attention_reference(q.double(), k, v, seqlens_kv=lens, causal=True,
                              diagonal="bottom_right")
    torch.testing.assert_close(got.double(), ref, rtol=0.02, atol=0.02)


def test_inductor_compiles_the_block():
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(causal=True, window=(6, 0))
    x = torch.randn(2, L, 32)
    torch.testing.assert_close(torch.compile(block, fullgraph=True)(x), block(x), rtol=1e-5,
                               atol=1e-5)


def test_dynamic_shapes_compile_once_for_two_lengths():
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(causal=True, window=(6, 0))
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    for n in (24, 40):
        x = torch.randn(2, n, 32, requires_grad=True)
        y = fn(x)
        y.sum().backward()
        torch.testing.assert_close(y, block(x), rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2  # at most one recompile
    assert counter.frame_count == 1


def test_a_score_mod_that_is_not_a_builtin_breaks_the_graph_with_its_reason():
    q, k, v = _qkv(grad=False)

    def fn(q, k, v):
        return attnkit.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + 0.01 * (i - j))

    torch._dynamo.reset()
    with pytest.raises(Exception, match="attnkit: a score_mod that is not an attnkit builtin"):
        torch.compile(fn, backend="eager", fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="eager")(q, k, v)  # without fullgraph: runs eagerly
    torch.testing.assert_close(got, fn(q, k, v), rtol=0, atol=0)


def test_double_backward_through_the_op_matches_eager():
    q, k, v = _qkv(b=1, grad=True)
    bias = _learnable(L, L)
    p = ops.pack("attention", q, k, v, Options(causal=True, bias=bias), backend="auto")
    out, _, _ = ops.call(p, q, k, v)
    eager = attnkit.attention(q, k, v, causal=True, bias=bias)
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    w = torch.randn_like(out)
    first = torch.autograd.grad((out * w).sum(), (q, k, bias), create_graph=True)
    first_e = torch.autograd.grad((eager * w).sum(), (q, k, bias), create_graph=True)
    second = torch.autograd.grad(sum(g.square().sum() for g in first), (q, v, bias))
    second_e = torch.autograd.grad(sum(g.square().sum() for g in first_e), (q, v, bias))
    for a, b in zip(second, second_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---- torch.nn.attention.varlen.varlen_attn on CPU --------------------------------------------


needs_registry = pytest.mark.skipif(not torch_varlen.available(),
                                    reason="torch has no flash-attention implementation registry")


@pytest.fixture
def active_varlen():
    torch.nn.attention.activate_flash_attention_impl("attnkit")
    yield torch.nn.attention.varlen.varlen_attn
    torch.nn.attention.restore_flash_attention_impl()


def _packed(lens_q, lens_k, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32)
          for x in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1]


def _oracle_varlen(q, k, v, cu_q, cu_k, used=None, **kw):
    outs = []
    for s in range(cu_q.numel() - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)[None]
        end = cu_k[s + 1] if used is None else cu_k[s] + used[s]
        ks, vs = (x[cu_k[s]:end].transpose(0, 1)[None] for x in (k, v))
        outs.append(attention_reference(qs, ks, vs, **kw)[0].transpose(0, 1))
    return torch.cat(outs)


@needs_registry
def test_attnkit_is_registered_but_not_active():
    assert "attnkit" in torch.nn.attention.list_flash_attention_impls()
    assert torch.nn.attention.current_flash_attention_impl() != "attnkit"
    q, k, v, cu_q, cu_k = _packed([3, 5], [3, 5], hkv=4)
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.nn.attention.varlen.varlen_attn(q.float(), k.float(), v.float(), cu_q, cu_k, 5, 5)


@needs_registry
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0), (2, 1)])
def test_torch_varlen_attn_forward_and_backward_match_the_oracle(active_varlen, window):
    lens_q, lens_k = [5, 1, 9], [7, 6, 9]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k)
    qf, kf, vf = (x.float().requires_grad_(True) for x in (q, k, v))
    out = active_varlen(qf, kf, vf, cu_q, cu_k, 9, 9, window_size=window, enable_gqa=True,
                        scale=0.4)
    left, right = (None if w < 0 else w for w in window)
    kw = dict(scale=0.4, diagonal="bottom_right")
    if (left, right) != (None, None):
        kw["window"] = (left, right)
    qd, kd, vd = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = _oracle_varlen(qd, kd, vd, cu_q, cu_k, **kw)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w.float()).sum(), (qf, kf, vf))
    want = torch.autograd.grad((ref * w).sum(), (qd, kd, vd))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


@needs_registry
def test_torch_varlen_attn_with_seqused_k_and_a_block_table(active_varlen):
    lens = [6, 11]
    q, k, v, cu_q, cu_k = _packed([1, 1], [8, 12], seed=3)
    used = torch.tensor(lens, dtype=torch.int32)
    out = active_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, 1, 12, seqused_k=used,
                        enable_gqa=True)
    ref = _oracle_varlen(q, k, v, cu_q, cu_k, used=lens)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # the same keys in shuffled pages of 4 tokens
    page = 4
    pages_k = torch.zeros(8, page, 2, 8, dtype=torch.float64)
    pages_v = torch.zeros_like(pages_k)
    table = torch.tensor([[5, 2, 0], [7, 1, 3]], dtype=torch.int32)
    for s in range(2):
        for t in range(lens[s]):
            pages_k[table[s, t // page], t % page] = k[cu_k[s] + t]
            pages_v[table[s, t // page], t % page] = v[cu_k[s] + t]
    out = active_varlen(q.float(), pages_k.float(), pages_v.float(), cu_q, None, 1, 12,
                        seqused_k=used, block_table=table, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@needs_registry
def test_flash_attention_ops_on_cpu_replay_dropout_and_run_dense(active_varlen):
    q, k, v, cu_q, cu_k = _packed([5, 9], [5, 9], hkv=4)
    qf, kf, vf = (x.float() for x in (q, k, v))
    out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
        qf, kf, vf, cu_q, cu_k, 9, 9, 0.3, True, False)
    seed = int(rng.to(torch.int64)[0])
    qa, ka, va = (x.clone().requires_grad_(True) for x in (qf, kf, vf))
    want = attnkit.varlen_attention(qa, ka, va, cu_q, cu_k, causal=True,
                                    diagonal="bottom_right", dropout_p=0.3, seed=seed)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    dout = torch.randn_like(out)
    got = torch.ops.aten._flash_attention_backward(dout, qf, kf, vf, out, lse, cu_q, cu_k, 9, 9,
                                                   0.3, True, rng, qf.new_empty(0))
    ref = torch.autograd.grad(want, (qa, ka, va), dout)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # dense (no cu_seqlens): (B, L, H, D) in and out, lse (B, H, L)
    qb, kb, vb = (x.view(2, 7, 4, 8) for x in (qf, kf, vf))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(qb, kb, vb, None, None, 7, 7, 0.0,
                                                           True, False)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (qb, kb, vb)), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert lse.shape == (2, 4, 7)


@needs_registry
def test_torch_varlen_attn_compiles_through_attnkit(active_varlen):
    q, k, v, cu_q, cu_k = _packed([5, 9], [5, 9])
    qf, kf, vf = (x.float().requires_grad_(True) for x in (q, k, v))

    def fn(q, k, v):
        return active_varlen(q, k, v, cu_q, cu_k, 9, 9, window_size=(-1, 0), enable_gqa=True)

    torch._dynamo.reset()
    counter = dynamo_testing.CompileCounterWithBackend("aot_eager")
    got = torch.compile(fn, backend=counter, fullgraph=True)(qf, kf, vf)
    assert counter.frame_count == 1
    torch.testing.assert_close(got, fn(qf, kf, vf), rtol=0, atol=0)
    got.sum().backward()
    assert qf.grad is not None and math.isfinite(float(qf.grad.abs().sum()))


def test_the_dense_mask_of_a_lambda_equals_its_pairs():
    q, k, _ = _qkv(grad=False)
    fn = lambda b, h, i, j: (i >= j) & ((i + j) % 3 != 1)  # noqa: E731
    got = compiled.dense_mask(fn, q, k)
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None]
    want = (i >= j) & ((i + j) % 3 != 1)
    assert torch.equal(got.reshape(L, L) if got.numel() == L * L else got[0, 0], want)


def test_the_compile_suite_peers_give_the_eager_results():
    from attnkit.bench import cases, peers, workloads

    assert {"compiled_dense_4k", "compiled_window_4k"} <= {c.name for c in
                                                            cases.select("compile")}
    case = cases.Case("tiny_window", heads_q=2, len_q=64, causal=True, window=(16, 0),
                      suites=("compile",))
    w = workloads.make_workload(case, torch.float32)
    want = peers.make_call(peers.PEERS["attnkit"], w, "fwd+bwd")()
    for name in ("attnkit_compiled", "sdpa_compiled"):
        assert peers.PEERS[name].compiled
        out, grads = peers.make_call(peers.PEERS[name], w, "fwd+bwd")()
        torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, want[1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_inductor_backward_with_inputs_in_another_stride_order():
    """q, k, v as (B, L, H, D) tensors viewed (B, H, L, D): the gradients the backward op
    returns have the layout its fake kernel says (inductor checks)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, h, 8, generator=g).transpose(1, 2).requires_grad_(True)
               for h in (4, 2, 2))

    def fn(q, k, v):
        return attnkit.attention(q, k, v, causal=True)

    out = torch.compile(fn, fullgraph=True)(q, k, v)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(fn(q, k, v).square().sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_graphs_are_keyed_by_the_ops_revision(monkeypatch):
    """torch's on-disk caches key a graph by its code, not by a custom op's fake kernel: the
    config every op call carries names the ops' revision (a hash of their source), so a graph
    cached by another attnkit (other fake kernels) is never served to this one."""
    torch._dynamo.reset()
    q, k, v = _qkv(grad=False)
    seen = []

    def spy(q, k, v, grad_tensors, tensors, config):
        seen.append(config)
        return attention_op(q, k, v, grad_tensors, tensors, config)

    attention_op = ops.attention_op
    monkeypatch.setattr(ops, "attention_op", spy)
    compiled.attention(q, k, v, Options(causal=True), frozenset(), "auto")
    assert seen and f'"rev":"{ops.OP_REVISION}"' in seen[0]
    assert ops.OP_REVISION.startswith(attnkit.__version__ + "+")
    # the revision follows the source of the ops (the fake kernels live there)
    assert ops.revision("a") != ops.revision("b") and ops.revision("a") == ops.revision("a")


def test_compiled_backward_drops_an_all_zero_lse_gradient(monkeypatch):
    """A compiled graph hands the backward op a materialised zero gradient for the unused lse
    output; the op drops it as the eager node does (the fused backward would otherwise carry
    it in an extra head column: d=65 instead of 64, a slower kernel), and keeps a real one."""
    from attnkit.backends import fused

    seen = []
    real = fused.backward

    def spy(spec, plan, out, lse, dout, dlse=None):
        seen.append(dlse is None)
        return real(spec, plan, out, lse, dout, dlse)

    monkeypatch.setattr(fused, "backward", spy)
    torch._dynamo.reset()
    q, k, v = _qkv()
    torch.compile(lambda q, k, v: attnkit.attention(q, k, v, causal=True, backend="fused"),
                  fullgraph=True)(q, k, v).sum().backward()
    assert seen == [True]

    def with_lse(q, k, v):
        out, aux = attnkit.attention(q, k, v, causal=True, backend="fused",
                                     return_aux=attnkit.AuxRequest(lse=True))
        return out.sum() + aux.lse.square().sum()

    torch._dynamo.reset()
    q, k, v = _qkv()
    torch.compile(with_lse, fullgraph=True)(q, k, v).backward()
    got = [x.grad for x in (q, k, v)]
    q2, k2, v2 = _qkv()
    with_lse(q2, k2, v2).backward()
    assert seen == [True, False, False]  # compiled, then eager: a real lse gradient kept
    for a, b in zip(got, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
