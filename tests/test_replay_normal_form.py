"""The replay of recurring calls keys on the *normalised* call: a launcher serves a call only
where build_spec would have decided what it decided for the call it was made for, so a
replayed result is the full path's result by construction. A differential fuzz compares every
call of random sequences whose forms recur (while key lengths, strides, padding contents, grad
mode and threads change) bit for bit with the full path and with the float64 reference."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import check_oracle

import attnkit
from attnkit import api
from attnkit.reference import attention_reference


def _full(q, k, v, kw):
    """The full path's result: the replay switched off for this call."""
    with api.replays_disabled():
        return attnkit.attention(q, k, v, **kw)


def test_all_zero_starts_do_not_make_a_launcher_for_real_starts():
    # all-zero starts_kv normalises to "no starts"; the launcher made for that call must not
    # serve a later call whose starts hide keys (top-left causal: the decode kernel cannot
    # shift the diagonal back, the full path runs the torch fallback)
    api._REPLAYS.clear()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 64, generator=g)
    k, v = torch.randn(2, 1, 12, 64, generator=g), torch.randn(2, 1, 12, 64, generator=g)
    attnkit.attention(q, k, v, causal=True, starts_kv=torch.tensor([0, 0]))
    st = torch.tensor([3, 0])
    out = attnkit.attention(q, k, v, causal=True, starts_kv=st)
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True, starts_kv=st)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    assert torch.equal(out, _full(q, k, v, dict(causal=True, starts_kv=st)))
    assert out[0, 0, 0].abs().max() == 0  # row 0 sees no key: keys 0-2 hidden, causal j <= 0


def test_the_replay_key_holds_the_normalised_padding():
    # the same raw keywords with padding of other contents are other normalised calls
    api._REPLAYS.clear()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 64, generator=g)
    k, v = torch.randn(2, 2, 20, 64, generator=g), torch.randn(2, 2, 20, 64, generator=g)
    for starts in ([0, 0], [0, 0], [5, 0], [0, 0], [19, 2], [20, 0]):
        st = torch.tensor(starts)
        for kw in (dict(starts_kv=st), dict(starts_kv=st, causal=True, diagonal="bottom_right"),
                   dict(starts_kv=st, causal=True)):
            out = attnkit.attention(q, k, v, **kw)
            assert torch.equal(out, _full(q, k, v, kw)), (starts, kw)
            ref = attention_reference(q.double(), k.double(), v.double(), **kw)
            torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)


def test_a_bad_padding_tensor_on_a_replayed_form_raises_the_full_paths_error():
    api._REPLAYS.clear()
    q = torch.randn(2, 2, 1, 16)
    k, v = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    for _ in range(2):
        attnkit.attention(q, k, v, seqlens_kv=torch.tensor([8, 3]))
    for bad in (torch.tensor([9, 3]), torch.tensor([-1, 3])):
        with pytest.raises(ValueError, match="seqlens_kv must lie in"):
            attnkit.attention(q, k, v, seqlens_kv=bad)
    with pytest.raises(ValueError, match="starts_kv must lie in"):
        attnkit.attention(q, k, v, starts_kv=torch.tensor([9, 0]))


# ---- the differential fuzz -------------------------------------------------------------------

#: Forms that recur: (Lq, Hq, Hkv, d, options without padding, padding kinds)
FORMS = [
    (1, 4, 2, 64, dict(), ("seqlens_kv", "starts_kv", None)),
    (1, 4, 2, 64, dict(causal=True), ("starts_kv", "seqlens_kv", None)),
    (2, 4, 1, 64, dict(causal=True, diagonal="bottom_right"), ("starts_kv", "seqlens_kv", None)),
    (3, 2, 2, 32, dict(window=(5, 0), softcap=3.0), ("seqlens_kv", None)),
    (1, 8, 2, 128, dict(causal=True, scale=0.1), (None, "starts_kv")),
    (40, 4, 2, 64, dict(), (None,)),
    (40, 4, 2, 64, dict(causal=True), (None,)),
    (33, 2, 1, 64, dict(causal=True, diagonal="bottom_right", softcap=5.0), (None,)),
    (24, 4, 4, 32, dict(window=(9, 3)), (None,)),
]


def _padding(rng: random.Random, kind, n: int, lk: int):
    if kind is None:
        return {}
    if kind == "seqlens_kv":
        lengths = [rng.choice([lk, lk, rng.randint(0, lk)]) for _ in range(n)]
        return {"seqlens_kv": torch.tensor(lengths)}
    starts = [rng.choice([0, 0, rng.randint(0, lk)]) for _ in range(n)]
    return {"starts_kv": torch.tensor(starts)}


def _inputs(rng: random.Random, g: torch.Generator, form, dtype):
    lq, hq, hkv, d, _, _ = form
    n = 2
    lk = rng.choice([lq, lq + 7, 64, 100]) if lq > 1 else rng.randint(1, 90)
    q = torch.randn(n, hq, lq, d, generator=g).to(dtype)
    how = rng.choice(["contiguous", "cache", "token_major"])
    if how == "contiguous":
        k = torch.randn(n, hkv, lk, d, generator=g).to(dtype)
        v = torch.randn(n, hkv, lk, d, generator=g).to(dtype)
    elif how == "cache":  # a slice of a longer cache: other strides
        k = torch.randn(n, hkv, lk + 13, d, generator=g).to(dtype)[:, :, :lk]
        v = torch.randn(n, hkv, lk + 13, d, generator=g).to(dtype)[:, :, :lk]
    else:  # (N, L, H, D) storage
        k = torch.randn(n, lk, hkv, d, generator=g).to(dtype).transpose(1, 2)
        v = torch.randn(n, lk, hkv, d, generator=g).to(dtype).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("seed", range(3))
def test_replayed_calls_give_the_full_paths_bits(seed, monkeypatch):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(api, "_REPLAYS", {})
    served = []
    real_get = api._lookup

    def counting(key):
        launch = real_get(key)
        if launch is not None:
            served.append(key)
        return launch

    monkeypatch.setattr(api, "_lookup", counting)
    threads = torch.get_num_threads()
    try:
        for _ in range(70):
            form = rng.choice(FORMS)
            dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])
            torch.set_num_threads(rng.choice([1, 2]))
            q, k, v = _inputs(rng, g, form, dtype)
            kw = dict(form[4], **_padding(rng, rng.choice(form[5]), q.shape[0], k.shape[2]))
            grad = form[0] > 1 and rng.random() < 0.3
            if grad:
                q.requires_grad_(True)
            out = attnkit.attention(q, k, v, **kw)
            full = _full(q, k, v, kw)
            assert torch.equal(out, full), (form, kw)
            check_oracle(out.detach(), q.detach(), k, v, kw, dtype)
            if grad:
                (dq,) = torch.autograd.grad(out.float().sum(), q)
                (dq_full,) = torch.autograd.grad(full.float().sum(), q)
                assert torch.equal(dq, dq_full), (form, kw)
    finally:
        torch.set_num_threads(threads)
    assert len(served) >= 15  # the replay did serve calls (else this test checks nothing)
