"""The executors' fallbacks and extras are data: each executor names the executors it hands
work to, in order, and what for; the code outside ``attnkit/backends`` names no executor."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import attnkit
from attnkit import backends
from attnkit.reference import attention_reference

PACKAGE = pathlib.Path(attnkit.__file__).parent


def test_every_fallback_names_a_later_executor_that_runs_what_the_first_runs():
    for name, mod in backends.REGISTRY.items():
        caps = mod.CAPS
        assert name not in caps.fallback
        assert bool(caps.fallback) == bool(caps.fallback_for), name
        for other in caps.fallback:
            assert other in backends.REGISTRY, (name, other)
        if caps.fallback:  # the last one runs every feature the executor runs (a paged
            # call is handed on with its pages gathered into dense K/V)
            last = backends.REGISTRY[caps.fallback[-1]].CAPS
            dense = caps.features - {"paged_kv", "fp8_kv"}
            assert dense <= last.features, (name, dense - last.features)


def test_extras_name_executors_that_exist():
    have = {x for mod in backends.REGISTRY.values() for x in mod.CAPS.extras}
    assert have == {"dp_scale", "differentiable_backward"}


def test_no_module_outside_the_backends_names_an_executor():
    pattern = re.compile(r"REGISTRY\[|backends\.tiled|from \.+backends\.(tiled|fused|flash|"
                         r"decode)|from \.+backends import (tiled|fused|flash|decode)|"
                         r"\"tiled\" if|PRIORITY\[")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("backends", "bench"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_a_forced_backend_without_dp_scale_is_refused_with_who_runs_it():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    out, lse = attnkit.attention_forward(q, k, v)
    dout = torch.randn(out.shape, generator=g)
    with pytest.raises(NotImplementedError, match="does not run dp_scale; tiled does"):
        attnkit.attention_backward(q, k, v, out, lse, dout, backend="fused", dp_scale=8.0)
    auto = attnkit.attention_backward(q, k, v, out, lse, dout, dp_scale=64.0)
    forced = attnkit.attention_backward(q, k, v, out, lse, dout, dp_scale=64.0, backend="tiled")
    exact = attnkit.attention_backward(q, k, v, out, lse, dout)
    assert torch.equal(auto.dq, forced.dq) and torch.equal(auto.dk, forced.dk)
    assert not torch.equal(auto.dq, exact.dq)  # (dP was rounded: the option did something)


def test_create_graph_runs_the_differentiable_backward():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 11, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 11, 16, generator=g, dtype=torch.float64, requires_grad=True)
    (dq,) = torch.autograd.grad(attnkit.attention(q, k, v, causal=True).square().sum(), q,
                                create_graph=True)
    (dq_ref,) = torch.autograd.grad(
        attention_reference(q, k, v, causal=True).square().sum(), q, create_graph=True)
    torch.testing.assert_close(dq, dq_ref)
    (ddk,) = torch.autograd.grad(dq.sum(), k)
    (ddk_ref,) = torch.autograd.grad(dq_ref.sum(), k)
    torch.testing.assert_close(ddk, ddk_ref)
