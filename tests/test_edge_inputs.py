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


# ---- score_mod / mask_mod results are checked ----------------------------------------------


@pytest.mark.parametrize("mod,exc,words", [
    (lambda s, b, h, i, j: None, TypeError, ["score_mod", "<lambda>", "NoneType"]),
    (lambda s, b, h, i, j: s > 0, TypeError, ["score_mod", "bool", "mask="]),
    (lambda s, b, h, i, j: (i - j), TypeError, ["score_mod", "int64"]),
    (lambda s, b, h, i, j: s[..., 0], ValueError, ["score_mod", "shape", "elementwise"]),
    (lambda s, b, h, i, j: s.sum(-1), ValueError, ["score_mod", "shape"]),
])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_bad_score_mod_results_are_one_clear_error(mod, exc, words, backend):
    q, k, v = (rand(2, 2, 9, 8) for _ in range(3))
    for fn in (lambda: attnkit.attention(q, k, v, score_mod=mod, backend=backend),
               lambda: attention_reference(q, k, v, score_mod=mod)):
        with pytest.raises(exc) as info:
            fn()
        for w in words:
            assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("mod,exc,words", [
    (lambda b, h, i, j: None, TypeError, ["mask_mod", "NoneType", "bool"]),
    (lambda b, h, i, j: (i >= j).float(), TypeError, ["mask_mod", "float32", "bias="]),
    (lambda b, h, i, j: (i >= j)[..., 0], ValueError, ["mask_mod", "shape"]),
    (lambda b, h, i, j: torch.ones(3, 3, 3, 3, 3, dtype=torch.bool), ValueError,
     ["mask_mod", "shape"]),
])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_bad_mask_mod_results_are_one_clear_error(mod, exc, words, backend):
    q, k, v = (rand(2, 2, 9, 8) for _ in range(3))
    for fn in (lambda: attnkit.attention(q, k, v, mask=mod, backend=backend),
               lambda: attention_reference(q, k, v, mask=mod)):
        with pytest.raises(exc) as info:
            fn()
        for w in words:
            assert w in str(info.value), (w, str(info.value))


def test_score_mod_results_that_broadcast_are_elementwise():
    """A result computed from the indices alone (shape (1, 1, bq, bk)) is broadcast over
    batch and heads, as the elementwise definition says."""
    q, k, v = (rand(2, 3, 11, 8) for _ in range(3))
    table = rand(11, 11)
    mod = lambda s, b, h, i, j: s + table[i, j]  # noqa: E731
    torch.testing.assert_close(attnkit.attention(q, k, v, score_mod=mod),
                               attention_reference(q, k, v, bias=table))


@pytest.mark.parametrize("backend", ["auto", "tiled"])
@pytest.mark.parametrize("which", ["constant", "table"])
def test_score_mod_that_ignores_the_score_has_a_backward(backend, which):
    q, k, v = (rand(2, 2, 9, 8, requires_grad=True) for _ in range(3))
    table = rand(9, 9, requires_grad=True)
    if which == "constant":
        mod = lambda s, b, h, i, j: torch.full_like(s, 0.5)  # noqa: E731
        inputs = (q, k, v)
    else:
        mod = lambda s, b, h, i, j: table[i, j].expand_as(s)  # noqa: E731
        inputs = (q, k, v, table)
    out = attnkit.attention(q, k, v, score_mod=mod, backend=backend)
    ref = attention_reference(q, k, v, score_mod=mod)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, dout, allow_unused=True)
    rgrads = torch.autograd.grad(ref, inputs, dout, allow_unused=True)
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a if a is not None else torch.zeros_like(b),
                                   b if b is not None else torch.zeros_like(a))
