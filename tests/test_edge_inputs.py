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
