"""The no-gradient path: a call that nothing differentiates runs its executor's forward
without the autograd node (bit for bit the node's result); a call that needs the graph (an
input requires grad, torch.func, forward-mode AD) still gets the node; the spec built in one
step equals the dataclass's own constructor."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import rand

import attnkit
from attnkit import autograd as ak_autograd
from attnkit import spec as ak_spec
from attnkit.backends import decode


def _decode_inputs(dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(0)
    q = rand(2, 8, 1, 64, gen=g, dtype=dtype, requires_grad=grad)
    k = rand(2, 2, 257, 64, gen=g, dtype=dtype, requires_grad=grad)
    v = rand(2, 2, 257, 64, gen=g, dtype=dtype, requires_grad=grad)
    return q, k, v


def _node_calls(monkeypatch):
    calls = []
    real = ak_autograd._AttentionFunction.apply

    def apply(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(ak_autograd._AttentionFunction, "apply", apply)
    return calls


KW = [dict(causal=True), dict(causal=True, diagonal="bottom_right", seqlens_kv=[257, 100]),
      dict(window=(64, 0), diagonal="bottom_right", starts_kv=[0, 30])]


@pytest.mark.parametrize("kw", KW)
@pytest.mark.parametrize("lq", [1, 40])  # the decode executor, then the fused one
def test_no_grad_calls_skip_the_node_with_the_same_result(kw, lq, monkeypatch):
    q, k, v = _decode_inputs()
    q = torch.cat([q] * lq, 2)[:, :, :lq] + torch.arange(lq).view(1, 1, -1, 1) * 0.01
    with torch.no_grad():
        calls = _node_calls(monkeypatch)
        fast, fast_lse = attnkit.attention(q, k, v, return_lse=True, **kw)
        assert not calls
    monkeypatch.undo()
    qg = q.clone().requires_grad_(True)  # the same call through the node
    calls = _node_calls(monkeypatch)
    slow, slow_lse = attnkit.attention(qg, k, v, return_lse=True, **kw)
    assert calls
    assert torch.equal(fast, slow.detach()) and torch.equal(fast_lse, slow_lse.detach())
    assert fast.is_contiguous() and fast.shape == slow.shape and not fast.requires_grad


def test_grad_mode_without_learnable_inputs_skips_the_node(monkeypatch):
    q, k, v = _decode_inputs()
    calls = _node_calls(monkeypatch)
    out = attnkit.attention(q, k, v, causal=True)
    assert not calls and out.grad_fn is None
    sinks = torch.zeros(8, requires_grad=True)  # a learnable option needs the node
    out = attnkit.attention(q, k, v, causal=True, sinks=sinks)
    assert calls and out.grad_fn is not None
    out.sum().backward()
    assert sinks.grad is not None


def test_transforms_still_get_the_node(monkeypatch):
    q, k, v = _decode_inputs(torch.float64)
    calls = _node_calls(monkeypatch)
    grad = torch.func.grad(lambda x: attnkit.attention(x, k, v, causal=True).sum())(q)
    assert calls and grad.shape == q.shape
    calls.clear()
    batched = torch.func.vmap(lambda x: attnkit.attention(x, k, v, causal=True))(
        torch.stack([q, q * 2]))
    assert calls and batched.shape == (2, *q.shape)
    import torch.autograd.forward_ad as fwAD

    calls.clear()
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
            attnkit.attention(dual, k, v, causal=True)
    assert calls


def test_squeezed_and_broadcast_batches_keep_their_shapes():
    g = torch.Generator().manual_seed(1)
    q2, k2 = rand(3, 16, gen=g), rand(9, 16, gen=g)
    with torch.no_grad():
        assert attnkit.attention(q2, k2, k2).shape == (3, 16)
        q = rand(2, 3, 4, 5, 16, gen=g)
        k = rand(1, 3, 2, 9, 16, gen=g)
        out, lse = attnkit.attention(q, k, k, return_lse=True)
    assert out.shape == (2, 3, 4, 5, 16) and lse.shape == (2, 3, 4, 5)
    want = attnkit.attention_reference(q, k, k)
    assert (out - want).abs().max() < 1e-12


def test_the_spec_built_in_one_step_equals_the_constructor():
    q, k, v = _decode_inputs()
    spec = ak_spec.build_spec(q, k, v, causal=True, starts_kv=[0, 3], softcap=5.0)
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    assert dataclasses.replace(spec) == spec == ak_spec.AttentionSpec(**values)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.q = q


def test_decode_tables_follow_the_batch_and_length():
    """The decode executor keeps its per-shape block tables and lengths; calls of other
    shapes get their own."""
    for n, lk in ((2, 257), (3, 40), (2, 41), (2, 257)):
        g = torch.Generator().manual_seed(n * lk)
        q, k = rand(n, 4, 1, 32, gen=g), rand(n, 2, lk, 32, gen=g)
        with torch.no_grad():
            out = attnkit.attention(q, k, k, causal=True, diagonal="bottom_right",
                                    backend="decode")
        ref = attnkit.attention_reference(q.double(), k.double(), k.double(), causal=True,
                                          diagonal="bottom_right")
        assert (out.double() - ref).abs().max() < 1e-5, (n, lk)
    assert all(t.shape == (key[0], 1) for key, t in decode._ROW_TABLES.items())
