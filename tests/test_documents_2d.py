"""Documents per batch row (2-D ids ``(B, L)``) absorbed analytically like 1-D ones: the
spec holds them as per-row segments (no mask_mod), the planner skips the tiles across
documents, the fused executor runs each row's documents as unmasked calls; checked against the
float64 oracle, which evaluates the mask_mod itself. And varlen's sinks and dropout against
per-sequence oracle calls."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_plan_follows, rand

import attnkit
from attnkit import masks, score_mods
from attnkit.backends import fused
from attnkit.dropout import keep_mask
from attnkit.plan import make_plan
from attnkit.reference import attention_reference as ref
from attnkit.reference import scores
from attnkit.spec import build_spec

N, HQ, HKV, L, D = 3, 4, 2, 45, 8


def _ids():
    """Three rows of documents of different lengths (ids sorted within a row)."""
    rows = [[12, 20, 13], [45], [5, 5, 30, 5]]
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))
                        for r in rows])


def _inputs(seed=0, grad=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [rand(N, h, L, D, gen=g, dtype=dtype, requires_grad=grad) for h in (HQ, HKV, HKV)]


CASES = {
    "documents": lambda ids: dict(mask=masks.document(ids)),
    "documents_causal": lambda ids: dict(mask=masks.and_masks(masks.document(ids),
                                                              masks.causal())),
    "documents_window_alibi": lambda ids: dict(
        mask=masks.and_masks(masks.document(ids), masks.sliding_window(6, 0)),
        alibi_slopes=score_mods.alibi_slopes(HQ)),
    "documents_left_padded": lambda ids: dict(
        mask=masks.and_masks(masks.document(ids), masks.causal()),
        starts_kv=torch.tensor([3, 0, 10])),
    "unsorted_ids": lambda ids: dict(mask=masks.document(ids.flip(-1))),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_two_d_documents_match_the_oracle_with_gradients(name, tiles, backend, request):
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    kw = CASES[name](_ids())
    q, k, v = _inputs()
    spec = build_spec(q, k, v, **kw)
    assert spec.mask_mod is None and "batch_segments" in spec.features()
    assert spec.segments_q.shape == (N, L)
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend=backend, **kw)
    r, rl = ref(q, k, v, return_lse=True, **kw)
    assert (out - r).abs().max() <= 1e-12
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    got = torch.autograd.grad((out * r.detach()).sum(), (q, k, v))
    want = torch.autograd.grad((r * r.detach()).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-10


@pytest.mark.parametrize("name", ["documents", "documents_causal", "documents_left_padded"])
@pytest.mark.parametrize("tiles", [(8, 8), (16, 4), (64, 64)])
def test_the_plan_skips_tiles_across_documents(name, tiles):
    kw = CASES[name](_ids())
    q, k, v = _inputs(grad=False)
    spec = build_spec(q, k, v, **kw)
    vis = scores(q, k, v, **kw)[1]
    assert_plan_follows(spec, make_plan(spec, bq=tiles[0], bk=tiles[1]), vis)
    if tiles == (8, 8) and name == "documents":  # rows 0 and 2: queries 0..7 and keys
        two = build_spec(q[[0, 2]], k[[0, 2]], v[[0, 2]], mask=masks.document(_ids()[[0, 2]]))
        assert not bool(make_plan(two, bq=8, bk=8).any[0, 4])  # 32..39 share no document


def test_fused_runs_every_rows_documents_as_unmasked_calls(monkeypatch):
    calls = []
    real = fused.FWD_OP

    def record(q, k, v, *args, **kw):
        calls.append((q.shape[2], k.shape[2], kw.get("attn_mask") is None, args[1]))
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(fused, "FWD_OP", record)
    q, k, v = _inputs(grad=False)
    kw = CASES["documents_causal"](_ids())
    out = attnkit.attention(q, k, v, backend="fused", **kw)
    assert (out - ref(q, k, v, **kw)).abs().max() <= 1e-12
    # one causal call per document: 3 + 1 + 4 documents, no additive mask anywhere
    assert sorted((a, b) for a, b, _, _ in calls) == sorted(
        (n, n) for n in (12, 20, 13, 45, 5, 5, 30, 5))
    assert all(unmasked and causal for _, _, unmasked, causal in calls)


def test_ids_that_do_not_cover_the_batch_stay_a_mask_mod():
    q, k, v = _inputs(grad=False)
    ids = _ids()
    short = masks.document(ids[:, :40])  # fewer positions than L: the size check says so
    with pytest.raises(ValueError, match="document mask has ids for 40"):
        build_spec(q, k, v, mask=short)
    longer = masks.document(torch.cat([ids, ids[:, :5]], 1))  # reads the first L ids
    spec = build_spec(q, k, v, mask=longer)
    assert spec.mask_mod is not None and spec.segments_q is None
    out = attnkit.attention(q, k, v, mask=longer)
    assert (out - ref(q, k, v, mask=longer)).abs().max() <= 1e-12


# ---- varlen: sinks and dropout ---------------------------------------------------------------

LENS_Q, LENS_K = [5, 0, 9, 1], [7, 3, 9, 12]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = rand(sum(LENS_Q), HQ, D, gen=g, requires_grad=True)
    k = rand(sum(LENS_K), HKV, D, gen=g, requires_grad=True)
    v = rand(sum(LENS_K), HKV, D, gen=g, requires_grad=True)
    return q, k, v


def _per_sequence(q, k, v, keep=None, **kw):
    """The oracle on each sequence alone; ``keep (1, Hq, Tq, Tk)`` is sliced per sequence."""
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    outs = []
    for s in range(len(LENS_Q)):
        a, b, c, e = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        extra = {} if keep is None else {"dropout_keep": keep[0, :, a:b, c:e]}
        o = ref(q[a:b].transpose(0, 1), k[c:e].transpose(0, 1), v[c:e].transpose(0, 1),
                **kw, **extra)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_varlen_sinks_with_their_gradient(backend):
    q, k, v = _packed()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    kw = dict(causal=True, diagonal="bottom_right", sinks=sinks)
    out = attnkit.varlen_attention(q, k, v, _cu(LENS_Q), _cu(LENS_K), backend=backend, **kw)
    want = _per_sequence(q, k, v, **kw)
    assert (out - want).abs().max() <= 1e-12
    got = torch.autograd.grad(out.sum(), (q, k, v, sinks))
    exp = torch.autograd.grad(want.sum(), (q, k, v, sinks))
    for a, b in zip(got, exp):
        assert (a - b).abs().max() <= 1e-10


def test_varlen_dropout_replays_at_packed_positions():
    """Dropout keys each weight by (0, h, packed query, packed key): replayable from the
    seed and offset, the same in the backward."""
    q, k, v = _packed(1)
    kw = dict(causal=True, dropout_p=0.3, seed=1234, offset=7)
    out = attnkit.varlen_attention(q, k, v, _cu(LENS_Q), _cu(LENS_K), **kw)
    again = attnkit.varlen_attention(q, k, v, _cu(LENS_Q), _cu(LENS_K), **kw)
    assert torch.equal(out, again)
    tq, tk = sum(LENS_Q), sum(LENS_K)
    keep = keep_mask(1234, 7, 0.3, torch.zeros(1, 1, 1, 1, dtype=torch.long),
                     torch.arange(HQ).view(1, -1, 1, 1), torch.arange(tq).view(1, 1, -1, 1),
                     torch.arange(tk).view(1, 1, 1, -1))
    want = _per_sequence(q, k, v, keep=keep, causal=True, dropout_p=0.3)
    assert (out - want).abs().max() <= 1e-12
    got = torch.autograd.grad(out.sum(), (q, k, v))
    exp = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(got, exp):
        assert (a - b).abs().max() <= 1e-10
    other = attnkit.varlen_attention(q, k, v, _cu(LENS_Q), _cu(LENS_K), **dict(kw, seed=5))
    assert not torch.equal(out, other)
