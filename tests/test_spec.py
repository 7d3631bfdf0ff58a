"""AttentionSpec: the one description executors read. Its features name everything a call
uses; executors refuse what they do not declare; the spec is frozen and canonical."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import rand

import attnkit
from attnkit import backends, masks, score_mods
from attnkit.reference import attention_reference
from attnkit.spec import FEATURES, AttentionSpec, Options, build_spec

Q, K = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 20, 8)

CASES = {
    "plain": ({}, set()),
    "causal": ({"causal": True}, {"window"}),
    "window": ({"window": (3, 1)}, {"window"}),
    "mask": ({"mask": torch.rand(12, 20) > 0.5}, {"mask"}),
    "block_mask": ({"mask": attnkit.create_block_mask(lambda b, h, i, j: (i + j) % 3 > 0, 1,
                                                      1, 12, 20, BLOCK_SIZE=4)},
                   {"block_mask"}),
    "mask_mod": ({"mask": lambda b, h, i, j: (i + j) % 3 > 0}, {"mask_mod"}),
    "builtin_mask": ({"mask": masks.sliding_window(2, 0, "bottom_right", 12, 20)}, {"window"}),
    "documents": ({"mask": masks.document(torch.arange(12) // 5, torch.arange(20) // 7)},
                  {"segments"}),
    "batch_documents": ({"mask": masks.document(torch.arange(24).view(2, 12) // 5,
                                                torch.arange(40).view(2, 20) // 7)},
                        {"batch_segments"}),
    "seqlens": ({"seqlens_q": [12, 5], "seqlens_kv": [20, 3]}, {"seqlens_q", "seqlens_kv"}),
    "starts_kv": ({"starts_kv": [0, 7]}, {"starts_kv"}),
    "bias": ({"bias": torch.randn(12, 20)}, {"bias"}),
    "bias_grad": ({"bias": torch.randn(12, 20, requires_grad=True)}, {"bias", "bias_grad"}),
    "alibi": ({"alibi_slopes": score_mods.alibi_slopes(4)}, {"alibi"}),
    "alibi_rows": ({"alibi_slopes": torch.rand(1, 4, 12)}, {"alibi_rows"}),
    "softcap": ({"softcap": 5.0}, {"softcap"}),
    "score_mod": ({"score_mod": lambda s, b, h, i, j: s * 2}, {"score_mod"}),
    "additive_score_mod": ({"score_mod": score_mods.alibi([0.5] * 4)},
                           {"additive_score_mod"}),
    "score_mod_grad": ({"score_mod": score_mods.relative_bias(torch.randn(41,
                                                                         requires_grad=True))},
                       {"additive_score_mod", "score_mod_grad"}),
    "sinks": ({"sinks": torch.zeros(4)}, {"sinks"}),
    "dropout": ({"dropout_p": 0.1, "seed": 3}, {"dropout"}),
    "dropout_mask": ({"dropout_mask": torch.rand(12, 20) > 0.5, "dropout_p": 0.1},
                     {"dropout_mask"}),
    "p_scale": ({"p_scale": 256.0}, {"p_scale"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_features_name_what_the_call_uses(name):
    kw, want = CASES[name]
    assert build_spec(Q, K, K, **kw).features() == frozenset(want)


def test_every_feature_has_a_name_in_the_vocabulary():
    seen = set().union(*(w for _, w in CASES.values()))
    seen |= {"max_scores", "paged_kv", "fp8_kv", "row_offset"}  # from the front doors
    assert seen == set(FEATURES)


def test_requested_outputs_and_front_door_terms_are_features():
    spec = build_spec(Q, K, K, outputs=frozenset({"max_scores"}))
    assert "max_scores" in spec.features()
    q = torch.randn(10, 2, 8)
    out, aux = attnkit.attention(Q, K, K, return_aux=attnkit.AuxRequest(max_scores=True))
    assert aux.max_scores.shape == (2, 4, 12)  # tiled ran: it declares max_scores
    seg = torch.tensor([0] * 4 + [1] * 6)
    spec = build_spec(q.transpose(0, 1)[None], q.transpose(0, 1)[None],
                      q.transpose(0, 1)[None], segments=(seg, seg), row_offset=seg * 0)
    assert {"segments", "row_offset"} <= spec.features()


def test_a_new_feature_is_refused_by_every_executor(monkeypatch):
    """An executor declares what it runs: a feature it has never heard of is a reason."""
    spec = build_spec(Q, K, K)
    assert backends.select(spec)  # runs today
    plain = AttentionSpec.features
    monkeypatch.setattr(AttentionSpec, "features", lambda self: plain(self) | {"temperature"})
    reasons = backends.explain(spec)
    assert set(reasons) == set(backends.REGISTRY)
    for name, why in reasons.items():
        assert any("temperature" in r for r in why), (name, why)
    with pytest.raises(NotImplementedError, match="no executor can run this call"):
        backends.select(spec)
    with pytest.raises(NotImplementedError, match="tiled does not run temperature"):
        backends.select(spec, "tiled")


def test_the_spec_is_frozen():
    spec = build_spec(Q, K, K, causal=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.left = 3  # type: ignore[misc]


def test_canonical_shapes_keep_broadcast_dims():
    q = torch.randn(3, 1, 4, 12, 8)  # two leading batch dims, one broadcast
    k = torch.randn(1, 5, 2, 20, 8)
    spec = build_spec(q, k, k, bias=torch.randn(20), mask=torch.ones(12, 1, dtype=torch.bool))
    assert spec.q.shape == (15, 4, 12, 8) and spec.k.shape == (15, 2, 20, 8)
    assert spec.batch_shape == (3, 5)
    assert spec.bias.shape == (1, 1, 1, 20)  # nothing of size Lq x Lk made
    assert spec.mask.shape == (1, 1, 12, 1)
    two_d = build_spec(torch.randn(6, 8), torch.randn(7, 8), torch.randn(7, 3))
    assert two_d.squeeze_heads and two_d.q.shape == (1, 1, 6, 8)
    assert two_d.output_shape(3) == (6, 3)


def test_builtin_masks_become_analytic_terms():
    spec = build_spec(Q, K, K, mask=masks.sliding_window(3, 0, "bottom_right", 12, 20))
    assert spec.mask_mod is None and (spec.left, spec.right) == (-5, 8)
    custom = lambda b, h, i, j: j % 2 == 0  # noqa: E731
    spec = build_spec(Q, K, K, mask=masks.and_masks(masks.causal(), custom))
    assert spec.right == 0 and spec.mask_mod is not None  # the custom part stays
    ids = torch.randint(0, 3, (2, 20)).sort(-1).values  # per-batch ids: per-row segments
    spec = build_spec(Q, K, K, mask=masks.document(ids[:, :12], ids))
    assert spec.mask_mod is None and spec.segments_q.shape == (2, 12)
    spec = build_spec(Q, K, K, mask=masks.document(ids[:1, :12], ids[:1]))  # 1 row for 2
    assert spec.segments_q is None and spec.mask_mod is not None


def test_torch_block_masks_become_attnkit_block_masks():
    from torch.nn.attention.flex_attention import create_block_mask

    tbm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 12, 20, device="cpu",
                            BLOCK_SIZE=4)
    spec = build_spec(Q, K, K, mask=tbm)
    assert isinstance(spec.block_mask, attnkit.BlockMask)
    torch.testing.assert_close(attnkit.attention(Q, K, K, mask=tbm),
                               attention_reference(Q, K, K, mask=tbm).float())


def test_slice_batch_is_the_row_as_its_own_call():
    q, k = rand(3, 4, 12, 8), rand(3, 2, 20, 8)
    mod = lambda s, b, h, i, j: s + 0.1 * b  # noqa: E731  (sees the batch index)
    kw = dict(score_mod=mod, alibi_slopes=torch.rand(3, 4, dtype=torch.float64),
              bias=rand(3, 1, 12, 20), causal=True, diagonal="bottom_right")
    spec = build_spec(q, k, k, **kw)
    row = spec.slice_batch(1, 7, 11)
    assert row.q.shape == (1, 4, 7, 8) and row.k.shape == (1, 2, 11, 8)
    assert row.bias.shape == (1, 1, 7, 11) and row.alibi_slopes.shape == (1, 4)
    from attnkit.autograd import run

    out, _, _ = run(row, backends.select(row))
    want = attention_reference(q, k, k, seqlens_q=[12, 7, 12], seqlens_kv=[20, 11, 20], **kw)
    torch.testing.assert_close(out[0], want[1, :, :7])


def test_options_name_every_keyword_once():
    assert set(Options.names()) == {
        "scale", "mask", "bias", "causal", "window", "diagonal", "score_mod", "softcap",
        "alibi_slopes", "seqlens_q", "seqlens_kv", "starts_kv", "sinks", "dropout_p", "seed",
        "offset", "dropout_mask", "descale_q", "descale_k", "descale_v", "p_scale",
        "out_dtype", "out_scale"}
    with pytest.raises(TypeError, match="unexpected keyword argument 'casual'.*causal"):
        attnkit.attention(Q, K, K, casual=True)
    q = torch.randn(6, 2, 8)
    with pytest.raises(NotImplementedError, match="varlen_attention.* does not take mask"):
        attnkit.varlen_attention(q, q, q, [0, 6], [0, 6], mask=torch.ones(6, 6, dtype=bool))
    attnkit.varlen_attention(q, q, q, [0, 6], [0, 6], mask=None)  # the default is fine


def test_paged_attention_takes_the_shared_options():
    """score_mod, mask and sinks reach the paged front door through the shared options."""
    cache = attnkit.PagedKVCache(8, 4, 2, 16, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for sid, n in (("a", 9), ("b", 5)):
        cache.allocate(sid)
        cache.append(sid, torch.randn(n, 2, 16, generator=g, dtype=torch.float64),
                     torch.randn(n, 2, 16, generator=g, dtype=torch.float64))
    q = torch.randn(2, 4, 1, 16, generator=g, dtype=torch.float64)
    k, v = cache.gather(["a", "b"])
    lens = torch.tensor([9, 5])
    sinks = torch.randn(4, dtype=torch.float64)
    mod = lambda s, b, h, i, j: s - 0.1 * (j % 3)  # noqa: E731
    for kw in ({"sinks": sinks}, {"score_mod": mod}, {"mask": lambda b, h, i, j: j % 2 == 0}):
        out = attnkit.paged_attention(q, cache, ["a", "b"], **kw)
        want = attention_reference(q, k, v, seqlens_kv=lens, causal=True,
                                   diagonal="bottom_right", **kw)
        torch.testing.assert_close(out, want)
