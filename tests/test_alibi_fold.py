"""ALiBi folded into extra q.k dims (score_terms.fold_alibi): bfloat16 calls whose visible
pairs all lie at or left of the diagonal run torch's fused kernel with no mask tile. Their
output, LSE and gradients against the float64 oracle by FlashAttention's rule, with the
tile path (the same call with the fold turned off) as the plain computation; which calls
fold and which do not."""

from __future__ import annotations

import pytest
import torch
from conftest import fa_tolerance_ok

import attnkit
from attnkit import score_mods
from attnkit.backends import fused, fused_schedule
from attnkit.reference import attention_reference
from attnkit.score_terms import FOLD_ALIBI_LIMIT, alibi_foldable, fold_alibi
from attnkit.spec import build_spec

pytestmark = pytest.mark.skipif(fused.FWD_OP is None, reason="torch has no fused CPU kernel")


def _run(q, k, v, kw, fold, monkeypatch):
    """out, lse and the gradients of attention(**kw), with the fold on or off."""
    with monkeypatch.context() as m:
        if not fold:
            m.setattr(fused_schedule, "alibi_foldable", lambda spec: False)
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        out, lse = attnkit.attention(qq, kk, vv, return_lse=True, backend="fused", **kw)
        g = torch.Generator().manual_seed(5)
        out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return out, lse, qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("case", ["causal", "bottom_right", "window_gqa", "batch_slopes"])
def test_folded_alibi_is_within_flash_rule_of_the_oracle(case, monkeypatch):
    """Causal (top-left, and bottom-right with more keys than queries), a window with GQA,
    slopes per batch row: out, LSE, dq, dk, dv within FlashAttention's rule of the float64
    oracle, the tile path's error being the plain one; the fold was taken."""
    g = torch.Generator().manual_seed(11)
    n, hq, hk, lq, lk, d = 2, 4, 4, 300, 300, 32
    kw = dict(causal=True, alibi_slopes=score_mods.alibi_slopes(hq))
    if case == "bottom_right":
        lk, kw["diagonal"] = 345, "bottom_right"
    if case == "window_gqa":
        hk, kw["window"] = 2, (70, 0)
    if case == "batch_slopes":
        kw["alibi_slopes"] = torch.rand(n, hq, generator=g) * 0.5 + 0.05
    q = torch.randn(n, hq, lq, d, generator=g).bfloat16()
    k, v = (torch.randn(n, hk, lk, d, generator=g).bfloat16() for _ in range(2))
    assert alibi_foldable(build_spec(q, k, v, **kw))
    folded = _run(q, k, v, kw, True, monkeypatch)
    tiles = _run(q, k, v, kw, False, monkeypatch)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, lse = attention_reference(qd, kd, vd, return_lse=True, **kw)
    ref.backward(torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
                 .bfloat16().double())
    for got, plain, want in zip(folded, tiles, (ref, lse, qd.grad, kd.grad, vd.grad)):
        ok, err, base = fa_tolerance_ok(got, want, plain)
        assert ok, (case, err, base)
    assert not torch.equal(folded[0], tiles[0])  # (two different computations)


def test_fold_adds_dims_whose_products_sum_to_slope_times_position():
    """The extra dims: q holds slope / scale in bfloat16 parts, k the key position in exact
    parts; their dot product is slope * j / scale to float32 precision, the rest is zero,
    and the width is a multiple of 16."""
    q, k, v = (torch.randn(1, 3, 70, 40).bfloat16() for _ in range(3))
    sl = torch.tensor([0.5, 0.3, 0.011])
    spec = build_spec(q, k, v, causal=True, alibi_slopes=sl, scale=0.3)
    sub = fold_alibi(spec)
    assert sub.alibi_slopes is None and sub.q.shape[-1] % 16 == 0
    assert torch.equal(sub.q[..., :40], q) and torch.equal(sub.k[..., :40], k)
    dot = sub.q[..., 40:].double() @ sub.k[..., 40:].double().transpose(-1, -2)  # (1, 3, 70, 70)
    want = (sl.double().view(1, 3, 1, 1) / 0.3) * torch.arange(70).double()
    assert ((dot - want.expand_as(dot)).abs() <= want.abs() * 2 ** -22 + 1e-9).all()


def test_calls_that_do_not_fold():
    """float32, a window reaching right of the diagonal, slopes that need a gradient, slopes
    times keys (or times the rows' positions, queries past the keys) past the limit, sinks, a
    bias: the fold is not taken."""
    q, k, v = (torch.randn(1, 2, 64, 16).bfloat16() for _ in range(3))
    sl = score_mods.alibi_slopes(2)
    assert alibi_foldable(build_spec(q, k, v, causal=True, alibi_slopes=sl))
    big = torch.full((2,), 2 * FOLD_ALIBI_LIMIT / 64)
    late = torch.full((2,), FOLD_ALIBI_LIMIT / 64)  # slope * Lk at the limit, * i' past it
    q_long = torch.randn(1, 2, 256, 16).bfloat16()
    for spec in (build_spec(q.float(), k.float(), v.float(), causal=True, alibi_slopes=sl),
                 build_spec(q, k, v, window=(8, 4), alibi_slopes=sl),
                 build_spec(q, k, v, alibi_slopes=sl),
                 build_spec(q, k, v, causal=True, alibi_slopes=sl.clone().requires_grad_()),
                 build_spec(q, k, v, causal=True, alibi_slopes=big),
                 build_spec(q_long, k, v, causal=True, alibi_slopes=late),
                 build_spec(q, k, v, causal=True, alibi_slopes=sl, sinks=torch.zeros(2)),
                 build_spec(q, k, v, causal=True, alibi_slopes=sl,
                            bias=torch.zeros(1, 2, 64, 64))):
        assert not alibi_foldable(spec)
        assert fused_schedule.make_fused_plan(spec).folded is None


@pytest.mark.parametrize("scale", [0.0, -0.5, 1e-30])
def test_scales_the_fold_cannot_hold_keep_the_tiles(scale):
    """A zero or negative scale does not fold (slope / scale would be infinite, or the
    kernel's scores of the other sign); a tiny positive one folds: each result stays the
    oracle's within bfloat16's error, never NaN."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g).bfloat16() for _ in range(3))
    sl = torch.tensor([0.5, 0.25])
    spec = build_spec(q, k, v, causal=True, alibi_slopes=sl, scale=scale)
    assert alibi_foldable(spec) == (scale > 0)
    out = attnkit.attention(q, k, v, causal=True, alibi_slopes=sl, scale=scale, backend="fused")
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True, alibi_slopes=sl,
                              scale=scale)
    assert (out.double() - ref).abs().max().item() < 3e-2
