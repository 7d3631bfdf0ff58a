"""The plan: which tiles hold work and which mask terms a tile needs, checked against the
dense visibility of the float64 oracle (which computes it from the raw keywords)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_plan_follows

import attnkit
from attnkit import masks
from attnkit.plan import choose_tiles, make_plan
from attnkit.reference import scores
from attnkit.spec import build_spec

N, HQ, HKV, LQ, LK, D = 2, 4, 2, 37, 53, 8


def _docs(n, length):
    return (torch.arange(length) * n // length)


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "causal_br": {"causal": True, "diagonal": "bottom_right"},
    "window": {"window": (5, 3)},
    "window_br_padded": {"window": (6, 0), "diagonal": "bottom_right",
                         "seqlens_q": [LQ, 20], "seqlens_kv": [40, LK]},
    "negative_band": {"mask": masks.sliding_window(4, 0, "bottom_right", 1, 30)},
    "documents": {"mask": masks.document(_docs(3, LQ), _docs(3, LK))},
    "documents_causal": {"mask": masks.and_masks(masks.document(_docs(4, LQ), _docs(4, LK)),
                                                 masks.causal())},
    "bool_mask": {"mask": torch.rand(N, 1, LQ, LK, generator=torch.Generator().manual_seed(1))
                  > 0.7},
    "mask_mod": {"mask": lambda b, h, i, j: ((i + 2 * j + h) % 7 < 3) & (j <= i + 5 * b)},
    "block_mask": {"mask": attnkit.create_block_mask(
        lambda b, h, i, j: (i // 5) == (j // 7), N, None, LQ, LK, BLOCK_SIZE=(8, 16))},
    "padding_mask_mod": {"mask": masks.and_masks(masks.padding([30, 11], [LK, 7]),
                                                 lambda b, h, i, j: j != 3)},
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(N, HQ, LQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(N, HKV, LK, D, generator=g, dtype=torch.float64)
    return q, k


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tiles", [(8, 16), (16, 8), (64, 64)])
def test_the_plan_never_skips_work_and_its_tiles_are_right(name, tiles):
    kw = CASES[name]
    if "negative_band" in name:  # a decode-shaped call
        q, k = _inputs()
        q, k = q[:, :, :1], k[:, :, :30]
    else:
        q, k = _inputs()
    spec = build_spec(q, k, k, **kw)
    vis = scores(q, k, k, **kw)[1]  # (N, Hq, Lq, Lk), dense, from the raw keywords
    bq, bk = tiles if spec.block_mask is None else choose_tiles(spec)
    assert_plan_follows(spec, make_plan(spec, bq=bq, bk=bk), vis)


def test_tiles_follow_the_block_mask_and_the_budget():
    q, k = _inputs()
    bm = CASES["block_mask"]["mask"]
    assert choose_tiles(build_spec(q, k, k, mask=bm)) == (8, 16)
    spec = build_spec(q, k, k)
    bq, bk = choose_tiles(spec, budget=4096)
    assert N * HQ * bq * bk <= 4096 and bk == LK
    assert choose_tiles(build_spec(q, k, k, window=(3, 0)))[0] <= 256


def test_empty_sequences_plan_nothing():
    q, k = _inputs()
    plan = make_plan(build_spec(q, k[:, :, :0], k[:, :, :0]))
    assert not bool(plan.any.any())
