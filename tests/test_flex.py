"""``attnkit.flex_attention`` against torch's own eager ``flex_attention`` (forward: output and
LSE, every spelling of the LSE request), GQA, torch BlockMasks passed to attnkit, and what torch
cannot do on CPU: the backward and max_scores, checked against the float64 reference."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import rand
from torch.nn.attention import flex_attention as tflex

import attnkit
from attnkit import masks as M
from attnkit import score_mods as S
from attnkit.reference import attention_reference as ref
from attnkit.reference import scores as ref_scores

B, H, E = 2, 4, 32


def torch_flex(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        return tflex.flex_attention(*args, **kwargs)


def grids(b, h, lq, lk):
    return (torch.arange(b).view(b, 1, 1, 1), torch.arange(h).view(1, h, 1, 1),
            torch.arange(lq).view(1, 1, lq, 1), torch.arange(lk).view(1, 1, 1, lk))


def dense(mod, b, h, lq, lk):
    return mod(*grids(b, h, lq, lk)).expand(b, h, lq, lk)


def inputs(lq, lk, hkv=H, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return (rand(B, H, lq, E, gen=g, dtype=dtype, requires_grad=requires_grad),
            rand(B, hkv, lk, E, gen=g, dtype=dtype, requires_grad=requires_grad),
            rand(B, hkv, lk, E, gen=g, dtype=dtype, requires_grad=requires_grad))


def _case(name, lq, lk):
    """(mask_mod or None, score_mod or None, extra kwargs)"""
    g = torch.Generator().manual_seed(1)
    return {
        "no_mods": (None, None, {}),
        "causal": (M.causal(), None, {}),
        "causal_bottom_right": (M.causal("bottom_right", lq, lk), None, {"scale": 0.3}),
        "sliding_window": (M.sliding_window(40, 8), None, {}),
        "document": (M.document_from_lengths([60, 45, 72]), None, {}),
        "prefix_lm": (M.prefix_lm(50), None, {}),
        "alibi": (M.causal("bottom_right", lq, lk), S.alibi(S.alibi_slopes(H), lk - lq), {}),
        "softcap": (None, S.softcap(4.0), {"scale": 1.0}),
        "relative_bias": (M.sliding_window(None, 20),
                          S.relative_bias(rand(H, 61, gen=g, dtype=torch.float32)), {}),
    }[name]


CASES = ["no_mods", "causal", "causal_bottom_right", "sliding_window", "document", "prefix_lm",
         "alibi", "softcap", "relative_bias"]


def _lengths(name):
    return (150, 200) if name in ("causal_bottom_right", "alibi") else (177, 177)


@pytest.mark.parametrize("name", CASES)
def test_matches_torch_flex_attention(name):
    lq, lk = _lengths(name)
    mask_mod, score_mod, kw = _case(name, lq, lk)
    q, k, v = inputs(lq, lk)
    theirs_bm = ours_bm = None
    if mask_mod is not None:
        theirs_bm = tflex.create_block_mask(mask_mod, None, None, lq, lk, device="cpu")
        ours_bm = attnkit.create_block_mask(mask_mod, None, None, lq, lk)
    want, want_aux = torch_flex(q, k, v, score_mod=score_mod, block_mask=theirs_bm,
                                return_aux=tflex.AuxRequest(lse=True), **kw)
    want_lse = want_aux.lse

    out = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=ours_bm, **kw)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)

    out2, lse = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=ours_bm,
                                       return_lse=True, **kw)
    assert torch.equal(out2, out)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=0)

    for request in (attnkit.AuxRequest(lse=True), tflex.AuxRequest(lse=True)):
        out3, aux = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=ours_bm,
                                           return_aux=request, **kw)
        assert torch.equal(out3, out)
        assert aux.max_scores is None
        torch.testing.assert_close(aux.lse, want_lse, atol=1e-5, rtol=0)

    # and both agree with the float64 reference
    mask = None if mask_mod is None else dense(mask_mod, B, H, lq, lk)
    r, rl = ref(q, k, v, mask=mask, score_mod=score_mod, return_lse=True, **kw)
    torch.testing.assert_close(out.double(), r, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), rl, atol=1e-5, rtol=0)


def test_gqa_needs_enable_gqa():
    q, k, v = inputs(130, 130, hkv=2, seed=2)
    bm = tflex.create_block_mask(M.causal(), None, None, 130, 130, device="cpu")
    want, want_lse = torch_flex(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    ours_bm = attnkit.create_block_mask(M.causal(), None, None, 130, 130)
    out, lse = attnkit.flex_attention(q, k, v, block_mask=ours_bm, enable_gqa=True,
                                      return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        attnkit.flex_attention(q, k, v, block_mask=ours_bm)


def test_accepts_torch_block_mask():
    mod = M.and_masks(M.causal(), M.document_from_lengths([70, 41, 89]))
    per_head = tflex.create_block_mask(  # a (B, H) torch BlockMask with per-head windows
        lambda b, h, q, k: (q - k <= 16 * (h + 1) + 8 * b) & (k <= q), B, H, 200, 200,
        device="cpu", BLOCK_SIZE=64)
    for theirs_bm, mask_mod in ((tflex.create_block_mask(mod, None, None, 200, 200,
                                                         device="cpu"), mod),
                                (per_head, per_head.mask_mod)):
        assert isinstance(theirs_bm, tflex.BlockMask)
        q, k, v = inputs(200, 200, seed=3)
        want, want_aux = torch_flex(q, k, v, block_mask=theirs_bm,
                                    return_aux=tflex.AuxRequest(lse=True))
        out, aux = attnkit.flex_attention(q, k, v, block_mask=theirs_bm,
                                          return_aux=tflex.AuxRequest(lse=True))
        torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(aux.lse, want_aux.lse, atol=1e-5, rtol=0)
        r = ref(q, k, v, mask=dense(mask_mod, B, H, 200, 200))
        torch.testing.assert_close(out.double(), r, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["fused", "tiled"])
def test_backward_matches_reference(backend):
    """Gradients of q, k, v and of a learnable relative-bias table (torch's eager CPU
    flex_attention has no backward)."""
    g = torch.Generator().manual_seed(4)
    lq, lk = 45, 70
    q, k, v = inputs(lq, lk, hkv=2, dtype=torch.float64, seed=4, requires_grad=True)
    table = rand(H, 31, gen=g, requires_grad=True)
    score_mod = S.relative_bias(table)
    mod = M.and_masks(M.causal("bottom_right", lq, lk), M.document_from_lengths([30, 40]))
    bm = attnkit.create_block_mask(mod, None, None, lq, lk, BLOCK_SIZE=16)
    out, lse = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                      enable_gqa=True, return_lse=True,
                                      kernel_options={"backend": backend})
    r, rl = ref(q, k, v, score_mod=score_mod, mask=dense(mod, B, H, lq, lk), return_lse=True)
    assert torch.allclose(out, r, atol=1e-10, rtol=0)
    assert torch.allclose(lse, rl, atol=1e-10, rtol=0)
    dout = rand(*out.shape, gen=g)
    dlse = rand(*lse.shape, gen=g)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v, table))
    want = torch.autograd.grad((r * dout).sum() + (rl * dlse).sum(), (q, k, v, table))
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-10, rtol=0), (a - b).abs().max().item()


@pytest.mark.parametrize("request_type", ["attnkit", "torch"])
def test_max_scores_match_reference(request_type):
    lq, lk = 60, 90
    q, k, v = inputs(lq, lk, dtype=torch.float64, seed=5)
    mod = M.and_masks(M.sliding_window(6, 3), M.padding([lq, 40], [lk, lk]))
    score_mod = S.compose(S.head_bias(torch.tensor([0.5, -1.0, 2.0, 0.0])), S.softcap(2.5))
    bm = attnkit.create_block_mask(mod, B, None, lq, lk, BLOCK_SIZE=32)
    aux_cls = attnkit.AuxRequest if request_type == "attnkit" else tflex.AuxRequest
    out, aux = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                      return_aux=aux_cls(lse=True, max_scores=True))
    s, vis = ref_scores(q, k, v, mask=dense(mod, B, H, lq, lk), score_mod=score_mod)
    want = s.masked_fill(~vis, float("-inf")).amax(-1)
    assert torch.isneginf(want).any()  # the padded rows of batch 1
    assert torch.equal(torch.isneginf(aux.max_scores), torch.isneginf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(aux.max_scores[fin], want[fin], atol=1e-12, rtol=0)
    assert torch.all(out[1, :, 40:] == 0) and torch.all(torch.isneginf(aux.lse[1, :, 40:]))


def test_kernel_options_backend_is_forced_not_fallen_back():
    q, k, v = inputs(40, 40, dtype=torch.float64, seed=6)
    with pytest.raises(NotImplementedError, match="backend='fused'"):
        attnkit.flex_attention(q, k, v, score_mod=S.softcap(3.0),
                               kernel_options={"backend": "fused"})
    tiled = attnkit.flex_attention(q, k, v, score_mod=S.softcap(3.0),
                                   kernel_options={"backend": "tiled", "BLOCK_M": 64})
    auto = attnkit.flex_attention(q, k, v, score_mod=S.softcap(3.0))
    assert torch.allclose(tiled, auto, atol=1e-12, rtol=0)
    assert torch.allclose(tiled, ref(q, k, v, score_mod=S.softcap(3.0)), atol=1e-10, rtol=0)
