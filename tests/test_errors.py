"""Every misuse raises ValueError/TypeError naming the argument, expected and given."""

from __future__ import annotations

import pytest
import torch

import attnkit

q4 = torch.randn(1, 4, 6, 8)
k4 = torch.randn(1, 2, 7, 8)
v4 = torch.randn(1, 2, 7, 5)


@pytest.mark.parametrize("args,kwargs,exc,words", [
    ((torch.randn(8), k4, v4), {}, ValueError, ["q", "at least 2 dims"]),
    ((q4, torch.randn(1, 2, 7, 9), v4), {}, ValueError, ["head dim", "8", "9"]),
    ((q4, k4, torch.randn(1, 2, 6, 5)), {}, ValueError, ["length", "7", "6"]),
    ((torch.randn(1, 3, 6, 8), k4, v4), {}, ValueError, ["3 heads", "multiple"]),
    ((torch.randn(2, 4, 6, 8), torch.randn(3, 2, 7, 8), torch.randn(3, 2, 7, 5)), {},
     ValueError, ["broadcast", "(2,)", "(3,)"]),
    ((q4, k4, v4), {"mask": torch.zeros(6, 7)}, TypeError, ["mask", "bool", "bias="]),
    ((q4, k4, v4), {"mask": torch.ones(5, 7, dtype=torch.bool)}, ValueError,
     ["mask", "(5, 7)", "broadcast"]),
    ((q4, k4, v4), {"bias": torch.zeros(3, 6, 7)}, ValueError, ["bias", "broadcast"]),
    ((q4, k4, v4), {"bias": torch.ones(6, 7, dtype=torch.bool)}, TypeError, ["bias", "mask="]),
    ((q4, k4, v4), {"scale": float("inf")}, ValueError, ["scale", "finite", "inf"]),
    ((q4, k4, v4), {"scale": "x"}, TypeError, ["scale", "str"]),
    ((q4, k4, v4), {"window": (-1, 0)}, ValueError, ["window", "left", ">= 0", "-1"]),
    ((q4, k4, v4), {"window": (3, -2)}, ValueError, ["window", "right", "-2"]),
    ((q4, k4, v4), {"window": 3}, TypeError, ["window", "pair"]),
    ((q4, k4, v4), {"diagonal": "top-left"}, ValueError, ["diagonal", "bottom_right",
                                                          "top-left"]),
    ((q4, k4.double(), v4), {}, TypeError, ["dtype", "float32", "float64"]),
    ((q4.int(), k4.int(), v4.int()), {}, TypeError, ["q", "int32", "floating"]),
    ((q4, k4, v4), {"backend": "cuda"}, ValueError, ["backend", "cuda"]),
])
def test_errors(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        attnkit.attention(*args, **kwargs)
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)


def test_mixed_devices_rejected():
    meta = torch.randn(1, 2, 7, 8, device="meta")
    with pytest.raises(ValueError, match="one device"):
        attnkit.attention(q4, meta, v4)


def test_forced_backend_that_cannot_run_says_why():
    with pytest.raises(NotImplementedError) as info:
        attnkit.attention(q4, k4, v4, softcap=5.0, backend="fused")
    assert "fused" in str(info.value) and "softcap" in str(info.value)
