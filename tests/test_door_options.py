"""Front doors cannot drop an option: for every name of ``Options`` and every front door, the
door gives what ``attention()`` gives for the same call, or refuses the option with its reason
(never a silent other answer). torch.compile (``fullgraph=True``) carries every option."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import fa_tolerance_ok, naive_attention

import attnkit
from attnkit import masks, ops, score_mods
from attnkit.distributed import ring_attention
from attnkit.reference import attention_reference
from attnkit.spec import DoorOptions, Options

N, H, HKV, L, D = 1, 4, 2, 24, 32


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(N, H, L, D, generator=g).to(dtype)
    k = torch.randn(N, HKV, L, D, generator=g).to(dtype)
    v = torch.randn(N, HKV, L, D, generator=g).to(dtype)
    return q, k, v


def _sample(name: str):
    """A call that sets option ``name`` (with what it needs), and its inputs."""
    g = torch.Generator().manual_seed(1)
    q, k, v = _inputs()
    kw = {
        "scale": dict(scale=0.3),
        "mask": dict(mask=torch.rand(L, L, generator=g) > 0.3),
        "bias": dict(bias=torch.randn(H, L, L, generator=g)),
        "causal": dict(causal=True),
        "window": dict(window=(3, 1)),
        "diagonal": dict(causal=True, diagonal="bottom_right"),
        "score_mod": dict(score_mod=score_mods.head_bias([0.5, -1.0, 0.25, 2.0])),
        "softcap": dict(softcap=2.0, scale=1.0),
        "alibi_slopes": dict(alibi_slopes=score_mods.alibi_slopes(H)),
        "seqlens_q": dict(seqlens_q=torch.tensor([L - 3])),
        "seqlens_kv": dict(seqlens_kv=torch.tensor([L - 5])),
        "starts_kv": dict(starts_kv=torch.tensor([3])),
        "sinks": dict(sinks=torch.randn(H, generator=g)),
        "dropout_p": dict(dropout_p=0.3, seed=7),
        "seed": dict(seed=7),
        "offset": dict(dropout_p=0.3, seed=7, offset=5),
        "dropout_mask": dict(dropout_mask=torch.rand(H, L, L, generator=g) > 0.2),
        "p_scale": dict(p_scale=16.0),
        "out_dtype": dict(out_dtype=torch.bfloat16),
        "out_scale": dict(out_dtype=torch.float8_e4m3fn, out_scale=4.0),
    }.get(name)
    if name.startswith("descale_"):
        (q, dq), (k, dk), (v, dv) = (attnkit.quantize_fp8(x) for x in (q, k, v))
        kw = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    return kw, (q, k, v)


def test_every_option_has_a_sample():
    for name in Options.names():
        kw, _ = _sample(name)
        assert kw is not None and name in kw, name


def _same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-5)


def _refused(err: Exception, kw: dict) -> bool:
    return isinstance(err, (NotImplementedError, TypeError)) and any(
        name in str(err) for name in kw)


# ---- the doors ---------------------------------------------------------------------------------


def _compiled(q, k, v, kw):
    torch._dynamo.reset()
    return torch.compile(lambda q, k, v: attnkit.attention(q, k, v, **kw), fullgraph=True,
                         backend="eager")(q, k, v)


def _varlen(q, k, v, kw):
    cu = torch.tensor([0, L])
    out = attnkit.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                   v[0].transpose(0, 1), cu, cu, L, L, **kw)
    return out.transpose(0, 1).unsqueeze(0)


def _paged(q, k, v, kw):
    page = 8
    k_pages = k[0].transpose(0, 1).reshape(L // page, page, HKV, D)
    v_pages = v[0].transpose(0, 1).reshape(L // page, page, HKV, D)
    table = torch.arange(L // page).view(1, -1)
    return attnkit.paged_attention_blocks(q, k_pages, v_pages, table, torch.tensor([L]), **kw)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("ring1") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ring(q, k, v, kw):
    return ring_attention(q, k, v, **kw)


DOORS = {"compiled": (_compiled, {}), "varlen_attention": (_varlen, {}),
         "paged_attention": (_paged, dict(causal=True, diagonal="bottom_right")),
         "ring_attention": (_ring, {})}


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("name", Options.names())
def test_a_door_gives_attentions_result_or_refuses_the_option(door, name, one_rank):
    kw, (q, k, v) = _sample(name)
    fn, defaults = DOORS[door]
    with torch.no_grad():
        want = attnkit.attention(q, k, v, **{**defaults, **kw})
        try:
            got = fn(q, k, v, kw)
        except Exception as err:  # noqa: BLE001 (what it raised is the point)
            assert _refused(err, kw), f"{door} failed on {name} with {err!r}"
            assert door != "compiled", f"torch.compile does not carry {name}: {err}"
            return
    _same(got, want)


def test_ring_attention_refuses_exactly_what_it_does_not_take(one_rank):
    from attnkit import distributed

    q, k, v = _inputs()
    for name in distributed.TAKES.refused:
        kw, (q, k, v) = _sample(name)
        with pytest.raises(NotImplementedError, match=f"does not take {name}"):
            ring_attention(q, k, v, **{name: kw[name]})
    assert "out_dtype" in distributed.TAKES.takes and "p_scale" not in distributed.TAKES.takes


def test_the_ring_carries_out_dtype(one_rank):
    # before: bf16 inputs with out_dtype=float32 gave bf16, p_scale was ignored
    q, k, v = _inputs(torch.bfloat16)
    out = ring_attention(q, k, v, causal=True, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True)
    plain = naive_attention(q, k, v, causal=True)
    ok, err, bound = fa_tolerance_ok(out, ref, plain)
    assert ok, (err, bound)
    with pytest.raises(NotImplementedError, match="p_scale"):
        ring_attention(q, k, v, causal=True, p_scale=448.0)


def test_every_option_has_a_carrier_through_the_compiled_op():
    assert set(ops.CARRY) == set(Options.names())


def test_an_option_without_a_carrier_is_refused_by_pack(monkeypatch):
    q, k, v = _inputs()
    monkeypatch.delitem(ops.CARRY, "softcap")
    ops.pack("attention", q, k, v, Options(), backend="auto")  # (default: nothing to carry)
    with pytest.raises(NotImplementedError, match="softcap"):
        ops.pack("attention", q, k, v, Options(softcap=3.0), backend="auto")


def test_door_options_are_checked_against_the_option_names():
    with pytest.raises(ValueError, match="do not exist"):
        DoorOptions("door", frozenset({"softcapp"}))
    door = DoorOptions("door", frozenset({"causal"}), {"softcap": "no tanh here"})
    assert door.refused == frozenset(Options.names()) - {"causal"}
    with pytest.raises(NotImplementedError, match="no tanh here"):
        Options.from_kwargs("door", {"softcap": 2.0}, door)
    with pytest.raises(NotImplementedError, match="does not carry window"):
        Options.from_kwargs("door", {"window": (1, 1)}, door)
    Options.from_kwargs("door", {"causal": True, "window": None}, door)  # defaults pass


def test_a_mask_mod_goes_through_every_door(one_rank):
    q, k, v = _inputs()
    kw = dict(mask=masks.sliding_window(4, 0))
    want = attnkit.attention(q, k, v, **kw)
    _same(_compiled(q, k, v, kw), want)
    _same(_ring(q, k, v, kw), want)
