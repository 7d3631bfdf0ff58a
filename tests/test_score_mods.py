"""Score mods against explicit formulas; bias/softcap metadata, gradients, names, errors."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import score_mods as S


def idx(B, H, Lq, Lk):
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(Lq).view(1, 1, Lq, 1), torch.arange(Lk).view(1, 1, 1, Lk))


def scores(B, H, Lq, Lk, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, Lq, Lk, generator=g, dtype=torch.float64).to(dtype)


def paper_slopes(n):
    """ALiBi reference implementation (ofirpress/attention_with_linear_biases), verbatim logic."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("H", [1, 2, 8, 16, 32])
def test_alibi_slopes_power_of_two(H):
    got = S.alibi_slopes(H)
    assert got.dtype == torch.float32 and got.shape == (H,)
    want = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)], dtype=torch.float32)
    assert torch.equal(got, want)


@pytest.mark.parametrize("H", [3, 5, 6, 12, 24, 40])
def test_alibi_slopes_interpolated(H):
    got = S.alibi_slopes(H)
    want = torch.tensor(paper_slopes(H), dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert len(set(got.tolist())) == H  # no duplicated slopes


def test_alibi_slopes_known_values():
    assert S.alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    # 12 heads: the 8-head slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    extra = S.alibi_slopes(12)[8:].double()
    torch.testing.assert_close(extra, torch.tensor([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5],
                                                   dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("offset", [0, 3, -2])
def test_alibi_formula(offset):
    slopes = torch.tensor([0.5, 0.25, 0.125])
    mod = S.alibi(slopes, offset=offset)
    s = scores(2, 3, 4, 7)
    got = mod(s, *idx(2, 3, 4, 7))
    want = s.clone()
    for h in range(3):
        for i in range(4):
            for j in range(7):
                want[:, h, i, j] -= slopes[h] * abs(i + offset - j)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_alibi_on_causal_visible_part_is_flash_attention_bias():
    """Visible part of bottom-right causal: bias = slope * (j - (i + sk - sq))."""
    sq, sk = 3, 8
    slopes = S.alibi_slopes(4)
    mod = S.alibi(slopes, offset=sk - sq)
    bias = mod(torch.zeros(1, 4, sq, sk), *idx(1, 4, sq, sk))
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    visible = j <= i + sk - sq
    want = slopes.view(4, 1, 1) * (j - (i + sk - sq))
    assert torch.equal(bias[0][:, visible], want[:, visible].float())
    assert (bias[0][:, ~visible] < 0).all()  # |.| makes the hidden part negative too


def test_softcap():
    mod = S.softcap(30)
    s = scores(1, 2, 3, 4, dtype=torch.float64) * 100
    assert torch.equal(mod(s, *idx(1, 2, 3, 4)), 30.0 * torch.tanh(s / 30.0))
    assert S.describe(mod).cap == 30.0 and isinstance(S.describe(mod).cap, float)
    assert S.describe(mod).bias is None
    assert mod(s, *idx(1, 2, 3, 4)).abs().max() < 30.0


def test_relative_bias_1d_clamps():
    M = 3
    table = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])  # distances -2..2
    mod = S.relative_bias(table)
    out = mod(torch.zeros(1, 1, 5, 6), *idx(1, 1, 5, 6))[0, 0]
    for i in range(5):
        for j in range(6):
            d = max(-(M - 1), min(M - 1, j - i))
            assert out[i, j] == table[d + M - 1]


def test_relative_bias_per_head():
    table = torch.arange(2 * 7, dtype=torch.float32).view(2, 7)  # H = 2, M = 4
    out = S.relative_bias(table)(torch.zeros(1, 2, 4, 9), *idx(1, 2, 4, 9))[0]
    for h in range(2):
        for i in range(4):
            for j in range(9):
                assert out[h, i, j] == table[h, max(-3, min(3, j - i)) + 3]


def test_relative_bias_gradients_flow_to_table():
    table = torch.zeros(7, dtype=torch.float64, requires_grad=True)  # M = 4
    mod = S.relative_bias(table)
    upstream = scores(1, 1, 5, 6, dtype=torch.float64, seed=3)
    out = mod(torch.zeros(1, 1, 5, 6, dtype=torch.float64), *idx(1, 1, 5, 6))
    (out * upstream).sum().backward()
    want = torch.zeros(7, dtype=torch.float64)
    for i in range(5):
        for j in range(6):
            want[max(-3, min(3, j - i)) + 3] += upstream[0, 0, i, j]
    torch.testing.assert_close(table.grad, want)


def test_relative_bias_gradcheck_2d():
    table = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    b, h, q, k = idx(1, 2, 3, 4)

    def f(t, s):
        return S.relative_bias(t)(s, b, h, q, k)

    s = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (table, s))


def test_head_bias():
    values = torch.tensor([1.0, -2.0, 0.5])
    s = scores(2, 3, 2, 2)
    got = S.head_bias(values)(s, *idx(2, 3, 2, 2))
    assert torch.equal(got, s + values.view(1, 3, 1, 1))


ADDITIVE = [
    S.alibi(S.alibi_slopes(3)),
    S.alibi(S.alibi_slopes(3), offset=4),
    S.relative_bias(torch.randn(9)),
    S.relative_bias(torch.randn(3, 5)),
    S.head_bias(torch.randn(3)),
    S.compose(S.alibi(S.alibi_slopes(3)), S.head_bias(torch.randn(3))),
]


@pytest.mark.parametrize("mod", ADDITIVE, ids=lambda m: m.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bias_consistency(mod, dtype):
    s = scores(2, 3, 6, 10, dtype=dtype)
    ix = idx(2, 3, 6, 10)
    out = mod(s, *ix)
    assert out.dtype == dtype
    assert torch.equal(out, s + S.describe(mod).bias(*ix).to(dtype))
    assert S.describe(mod).bias(*ix).abs().sum() > 0  # the bias is not trivially zero


def test_compose_order_and_additivity():
    a, c = S.alibi(S.alibi_slopes(2)), S.softcap(2.0)
    s = scores(1, 2, 4, 4) * 5
    ix = idx(1, 2, 4, 4)
    torch.testing.assert_close(S.compose(a, c)(s, *ix), c(a(s, *ix), *ix))
    torch.testing.assert_close(S.compose(c, a)(s, *ix), a(c(s, *ix), *ix))
    assert not torch.allclose(S.compose(a, c)(s, *ix), S.compose(c, a)(s, *ix))
    assert S.describe(S.compose(a, c)).bias is None
    hb = S.head_bias(torch.tensor([1.0, 2.0]))
    both = S.compose(a, hb)
    torch.testing.assert_close(both(s, *ix), hb(a(s, *ix), *ix))
    assert S.describe(both).structure["parts"][0]["kind"] == "alibi"


def test_runs_under_torch_flex_attention():
    """The closures also work through torch's vmap-based flex_attention (eager, CPU)."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from attnkit import masks as M

    H, sq, sk = 4, 24, 40
    mod = S.compose(S.alibi(S.alibi_slopes(H), offset=sk - sq),
                    S.relative_bias(torch.randn(H, 9, dtype=torch.float64)),
                    S.head_bias(torch.randn(H)), S.softcap(4.0))
    mask = M.causal("bottom_right", sq, sk)
    bm = create_block_mask(mask, 1, 1, sq, sk, device="cpu", BLOCK_SIZE=16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, sq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, H, sk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        out = flex_attention(q, k, v, score_mod=mod, block_mask=bm)
    ix = idx(1, H, sq, sk)
    s = mod((q @ k.transpose(-1, -2)) / 8 ** 0.5, *ix)
    s = s.masked_fill(~mask(*ix), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def test_names():
    assert S.softcap(30).__name__ == "softcap_30.0"
    assert S.alibi(S.alibi_slopes(8)).__name__ == "alibi_8"
    assert S.alibi([0.5], offset=3).__name__ == "alibi_1_offset3"
    assert S.relative_bias(torch.zeros(9)).__name__ == "relative_bias_5"
    assert S.relative_bias(torch.zeros(4, 3)).__name__ == "relative_bias_2_h4"
    assert S.head_bias([1.0, 2.0]).__name__ == "head_bias_2"
    assert (S.compose(S.alibi([1.0]), S.softcap(5)).__name__
            == "compose(alibi_1,softcap_5.0)")


def test_structures():
    st = S.describe(S.alibi(S.alibi_slopes(4), offset=2)).structure
    assert st["kind"] == "alibi" and st["offset"] == 2 and st["slopes"].shape == (4,)
    assert S.describe(S.softcap(3)).structure == {"kind": "softcap", "cap": 3.0}
    assert S.describe(S.relative_bias(torch.zeros(5))).structure["max_distance"] == 3


@pytest.mark.parametrize("call,exc,words", [
    (lambda: S.alibi_slopes(0), ValueError, ["num_heads", ">= 1"]),
    (lambda: S.alibi_slopes(2.0), TypeError, ["num_heads"]),
    (lambda: S.alibi(torch.tensor([1, 2])), TypeError, ["slopes", "floating"]),
    (lambda: S.alibi(torch.ones(2, 2)), ValueError, ["slopes", "1-D"]),
    (lambda: S.alibi([0.5], offset=1.5), TypeError, ["offset"]),
    (lambda: S.softcap(0), ValueError, ["cap", "positive", "leave"]),
    (lambda: S.softcap(float("inf")), ValueError, ["cap"]),
    (lambda: S.softcap("30"), TypeError, ["cap"]),
    (lambda: S.relative_bias(torch.zeros(4)), ValueError, ["odd", "2 * max_distance - 1"]),
    (lambda: S.relative_bias([0.0, 1.0, 2.0]), TypeError, ["table", "tensor"]),
    (lambda: S.relative_bias(torch.zeros(2, 2, 3)), ValueError, ["table", "1-D or 2-D"]),
    (lambda: S.head_bias(torch.zeros(2, 2)), ValueError, ["values"]),
    (lambda: S.compose(), ValueError, ["at least one"]),
    (lambda: S.compose(S.softcap(1), 3), TypeError, ["compose", "argument 1"]),
])
def test_errors(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value)
