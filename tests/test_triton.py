"""The triton executor (``backend="triton"``) against the float64 oracle and the tiled executor.

Where the kernels run: there is no GPU here, so the cases that launch kernels run under
Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors through numpy, about 10 ms per
inner-loop tile), at tiny shapes with 32 x 32 tiles that still cross tile boundaries. The
interpreter takes effect only when the variable is set before triton is imported, and torch
imports triton as soon as torch.compile's machinery loads (importing attnkit does), so it
cannot be switched on inside a running test session without affecting other test files.
Instead, the cases marked ``@interpreted`` run in one child ``pytest`` process started with the
variable set, on exactly the node ids this session selected (``-k`` works); each case here then
reports the child's outcome for its own node id, failure text included (the child's run time
shows up on the first of them). ``TRITON_INTERPRET=1 python -m pytest tests/test_triton.py``
runs them directly. The compile check (``tests/triton_compile.py``: every launch compiled for
sm_90 by Triton's NVIDIA backend, no driver needed) runs in a subprocess without the variable.
Everything skips when triton is not installed.
"""

from __future__ import annotations

import atexit
import functools
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

pytest.importorskip("triton")

from conftest import fa_tolerance_ok, naive_attention  # noqa: E402

import attnkit  # noqa: E402
from attnkit import AuxRequest, backends, masks, score_mods  # noqa: E402
from attnkit import reference as oracle  # noqa: E402
from attnkit.backends import triton as tx  # noqa: E402
from attnkit.spec import PagedKV, build_spec  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
ROOT = Path(__file__).resolve().parents[1]
_CHILD: Dict[str, Tuple[str, str]] = {}  # test name -> (outcome, text) from the child run
_SELECTED: List[str] = []  # node ids of the @interpreted cases this session runs
_COMPILE_SELECTED: List[str] = []  # the compile check's, when this session runs it


# ---- running the interpreted cases in a child process ----------------------------------------


def interpreted(fn):
    """Mark a case that launches kernels: it runs in the child process (see the module
    docstring); here it reports the child's outcome."""
    if INTERPRETED:
        fn.interpreted = True
        return fn

    @functools.wraps(fn)  # pytest reads the parameters through __wrapped__
    def report(**_: Any) -> None:
        nodeid = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
        outcome, text = _child_outcome(nodeid)
        if outcome == "skipped":
            pytest.skip(text)
        if outcome != "passed":
            pytest.fail(f"in the TRITON_INTERPRET=1 child: {text}", pytrace=False)

    report.interpreted = True
    return report


@pytest.fixture(autouse=True)
def _interpreter_session(request, monkeypatch):
    """Parent: note the selected @interpreted node ids once. Child: the interpreter's tiles
    (32 x 32, several per axis at these sizes) and default splits for every case."""
    if INTERPRETED:
        monkeypatch.setattr(tx, "TILES", (32, 32))
        monkeypatch.setattr(tx, "SPLITS", None)
    elif not _SELECTED:
        items = request.session.items
        _SELECTED.extend(item.nodeid for item in items
                         if getattr(getattr(item, "obj", None), "interpreted", False))
        _COMPILE_SELECTED.extend(item.nodeid for item in items
                                 if item.name == "test_every_launch_compiles_for_sm90")


def _child_outcome(nodeid: str) -> Tuple[str, str]:
    name = nodeid.split("::", 1)[1]
    if not _CHILD:
        _run_child()
    return _CHILD.get(name, ("failed", "the child did not report this case"))


def _run_child() -> None:
    xml = ROOT / ".pytest-triton-child.xml"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [
                   str(Path(attnkit.__file__).resolve().parents[1]),
                   os.environ.get("PYTHONPATH")])))
    env.pop("PYTEST_CURRENT_TEST", None)
    if _COMPILE_SELECTED:
        _compile_check.start()  # alongside the child: one process per core
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
           "junit_family=xunit2", f"--junitxml={xml}", *_SELECTED]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        tail = (proc.stdout + proc.stderr)[-4000:]
        cases = ET.parse(xml).getroot().iter("testcase") if xml.exists() else []
        for case in cases:
            outcome, text = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, text = "failed", (child.text or child.get("message", ""))[-6000:]
                elif child.tag == "skipped":
                    outcome, text = "skipped", child.get("message", "")
            _CHILD[case.get("name")] = (outcome, text)
        if not _CHILD:
            _CHILD["<none>"] = ("failed", tail)
            for nodeid in _SELECTED:
                _CHILD[nodeid.split("::", 1)[1]] = ("failed", f"child run failed:\n{tail}")
    finally:
        if xml.exists():
            xml.unlink()


class _Background:
    """tests/triton_compile.py in a subprocess without TRITON_INTERPRET, started once."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.skip: Optional[str] = None

    def start(self) -> None:
        if self.proc is not None or self.skip is not None:
            return
        env = dict(os.environ, PYTHONPATH=str(Path(attnkit.__file__).resolve().parents[1]))
        env.pop("TRITON_INTERPRET", None)
        try:
            import triton.backends.nvidia.compiler  # noqa: F401
        except Exception as exc:  # a triton build without the NVIDIA backend
            self.skip = f"triton has no NVIDIA backend here: {exc}"
            return
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "triton_compile.py"), "90"], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        atexit.register(self.proc.kill)  # an interrupted session leaves no compiler behind

    def result(self) -> Tuple[Any, str]:
        self.start()
        if self.skip is not None:
            return "skip", self.skip
        try:
            text, _ = self.proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            text, _ = self.proc.communicate()
            return "timeout", text
        return self.proc.returncode, text


_compile_check = _Background()


# ---- helpers ----------------------------------------------------------------------------------

F64 = torch.float64


def _qkv(n=1, hq=2, hkv=1, lq=45, lk=70, dqk=16, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)

    return r(n, hq, lq, dqk), r(n, hkv, lk, dqk), r(n, hkv, lk, dv or dqk)


def _double(kw: Dict[str, Any]) -> Dict[str, Any]:
    """The oracle's copy of a call's keywords: float tensors in float64, leaves of their own."""
    out = {}
    for name, x in kw.items():
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.detach().double().requires_grad_(x.requires_grad)
        out[name] = x
    return out


def _leaves(q, k, v, kw) -> List[torch.Tensor]:
    return [q, k, v] + [kw[n] for n in ("bias", "sinks") if n in kw and kw[n].requires_grad]


def _grads(out, leaves, seed=1):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)
    return torch.autograd.grad(out, leaves, dout, allow_unused=True)


def _max_scores(q, k, v, kw) -> torch.Tensor:
    s, vis = oracle.scores(q, k, v, **kw)
    return s.masked_fill(~vis, float("-inf")).amax(-1).reshape(q.shape[:-1])


def _close(name, got, want, atol, rtol=1e-4):
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{name}: {m}")


def check(q, k, v, *, grad=True, atol=2e-5, **kw):
    """float32 triton vs the float64 oracle (out, lse, row maxima, every gradient) and vs the
    tiled executor (the same, at float32 rounding)."""
    aux = AuxRequest(lse=True, max_scores=True)
    out, a = attnkit.attention(q, k, v, backend="triton", return_aux=aux, **kw)
    t_out, t_a = attnkit.attention(q, k, v, backend="tiled", return_aux=aux, **kw)
    dkw = _double(kw)
    dq, dk, dv = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref, ref_lse = attnkit.attention_reference(dq, dk, dv, return_lse=True, **dkw)
    _close("out", out, ref, atol)
    _close("lse", a.lse, ref_lse, atol)
    _close("max_scores", a.max_scores, _max_scores(dq, dk, dv, dkw), atol)
    _close("out vs tiled", out, t_out, atol)
    _close("max_scores vs tiled", a.max_scores, t_a.max_scores, atol)
    if not grad:
        return out
    leaves, d_leaves = _leaves(q, k, v, kw), _leaves(dq, dk, dv, dkw)
    got = _grads(out, leaves)
    want = _grads(ref, d_leaves)
    tiled = _grads(t_out, leaves)
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in ("bias", "sinks")
                                  if n in kw and kw[n].requires_grad]
    for name, g1, g2, g3 in zip(names, got, want, tiled):
        _close(name, g1, g2, 10 * atol)
        _close(name + " vs tiled", g1, g3, 10 * atol)
    return out


# ---- registry and capabilities (no kernels run) -----------------------------------------------


def test_triton_is_registered_first_and_named_in_the_backend_list():
    assert list(backends.REGISTRY)[0] == "triton" and backends.REGISTRY["triton"] is tx
    assert backends.BACKENDS == ("auto", "triton", "decode", "flash", "fused", "tiled")


def test_auto_never_picks_triton_for_cpu_tensors(monkeypatch):
    """Even where the interpreter could run the kernels, auto keeps CPU tensors on the CPU
    executors (the interpreter is for tests and forced calls)."""
    monkeypatch.setattr(tx, "extra_reasons", lambda spec: [], raising=False)
    q, k, v = _qkv()
    spec = build_spec(q, k, v, causal=True)
    assert tx.CAPS.auto_devices == frozenset({"cuda"})
    assert backends.select(spec).CAPS.name != "triton"


def test_cpu_tensors_are_refused_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv()
    spec = build_spec(q, k, v, causal=True)
    assert backends.select(spec).CAPS.name != "triton"
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        attnkit.attention(q, k, v, backend="triton")


def test_an_interpreter_switched_on_too_late_is_a_reason(monkeypatch):
    """TRITON_INTERPRET=1 set after triton was imported: triton's own library is compiled
    code, so interpreted kernels would fail inside; the executor says what to do instead."""
    if INTERPRETED:
        pytest.skip("this process was started under the interpreter")
    name = tx.__name__ + ".kernels"
    saved = sys.modules.pop(name, None), getattr(tx, "kernels", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:  # the kernels are imported again under the variable, and dropped afterwards
        q, k, v = _qkv()
        with pytest.raises(NotImplementedError, match="before triton is imported"):
            attnkit.attention(q, k, v, backend="triton")
        assert not tx.interpreting()
    finally:
        sys.modules.pop(name, None)
        if saved[0] is not None:
            sys.modules[name], tx.kernels = saved
        elif hasattr(tx, "kernels"):
            del tx.kernels


def test_what_the_kernels_cannot_run_is_a_reason(monkeypatch):
    q, k, v = _qkv()
    why = backends.explain(build_spec(q, k, v, score_mod=lambda s, b, h, i, j: s * 2))
    assert any("score_mod" in r for r in why["triton"])
    bm = attnkit.create_block_mask(lambda b, h, i, j: i >= j, 1, 1, 45, 70, BLOCK_SIZE=24)
    assert any("BLOCK_SIZE" in r for r in backends.explain(build_spec(q, k, v, mask=bm))["triton"])
    monkeypatch.setattr(tx, "triton_installed", lambda: False)
    assert any("not installed" in r for r in backends.explain(build_spec(q, k, v))["triton"])


def test_attnkit_imports_and_runs_without_triton():
    """Where triton cannot be imported, attnkit imports, the executor says why it cannot run
    and auto runs another; the kernels module (the only one that imports triton) is never
    loaded by the import."""
    code = ("import sys\n"
            "sys.modules['triton'] = None\n"
            "import attnkit, torch\n"
            "from attnkit import backends\n"
            "assert 'attnkit.backends.triton.kernels' not in sys.modules\n"
            "q = torch.randn(4, 8)\n"
            "print(backends.explain(attnkit.spec.build_spec(q, q, q))['triton'])\n"
            "print(attnkit.attention(q, q, q).shape)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(attnkit.__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "triton is not installed" in proc.stdout, proc.stdout
    assert "torch.Size([4, 8])" in proc.stdout, proc.stdout


# ---- forward and backward against the oracle (interpreted) ------------------------------------

g0 = torch.Generator().manual_seed(7)

FEATURES = {
    "dense_gqa_dqk_ne_dv": (dict(lq=37, lk=70, dqk=24, dv=16), {}),
    "causal_top_left": (dict(lq=70, lk=50), dict(causal=True)),
    "causal_bottom_right": (dict(lq=40, lk=70), dict(causal=True, diagonal="bottom_right")),
    "causal_bottom_right_empty_rows": (dict(lq=70, lk=40),
                                       dict(causal=True, diagonal="bottom_right")),
    "window": (dict(lq=60, lk=60), dict(window=(9, 4))),
    "window_causal_bottom_right": (dict(lq=40, lk=75), dict(causal=True, window=(20, 0),
                                                            diagonal="bottom_right")),
    "seqlens": (dict(n=2, lq=40, lk=50), dict(seqlens_q=torch.tensor([33, 0]),
                                              seqlens_kv=torch.tensor([50, 9]), causal=True,
                                              diagonal="bottom_right")),
    "documents": (dict(lq=64, lk=64), dict(mask=masks.and_masks(
        masks.document_from_lengths([20, 30, 14]), masks.causal()))),
    "alibi": (dict(), dict(alibi_slopes=score_mods.alibi_slopes(2), causal=True)),
    "alibi_per_batch": (dict(n=2), dict(alibi_slopes=torch.rand(2, 2, generator=g0))),
    "softcap": (dict(), dict(softcap=2.0, causal=True, diagonal="bottom_right")),
    "sinks": (dict(), dict(sinks=torch.randn(2, generator=g0).requires_grad_(True),
                                      window=(12, 12))),
    "relative_bias": (dict(lq=50, lk=50), dict(score_mod=score_mods.relative_bias(
        torch.randn(2, 99, generator=g0)))),
    "alibi_and_head_bias_mods": (dict(), dict(score_mod=score_mods.compose(
        score_mods.alibi([0.25, 0.5]), score_mods.head_bias([0.3, -0.7])), causal=True)),
    "bool_mask_broadcast": (dict(n=2), dict(mask=torch.rand(2, 1, 45, 70, generator=g0) > 0.3)),
    "key_mask_and_bias": (dict(), dict(mask=torch.arange(70) % 9 != 4,
                                       bias=torch.randn(2, 1, 70, generator=g0))),
    "prefix_lm": (dict(lq=64, lk=64), dict(mask=masks.prefix_lm(21))),
    "chunked_or_dilated": (dict(lq=64, lk=64), dict(mask=masks.or_masks(
        masks.chunked(24), masks.dilated_sliding_window(8, 3)))),
    "lambda_mask_mod": (dict(n=2, lq=40, lk=66), dict(
        mask=lambda b, h, i, j: ((i + 2 * j + h + b) % 5 != 0) & (j <= i + 30))),
    "block_mask": (dict(lq=64, lk=96), dict(mask=attnkit.create_block_mask(
        lambda b, h, i, j: (j <= i + 32) & ((i // 7 + j) % 4 != 1), 1, 1, 64, 96,
        BLOCK_SIZE=32))),
    "block_mask_full_blocks": (dict(lq=96, lk=96), dict(mask=attnkit.create_block_mask(
        masks.causal(), 1, 2, 96, 96, BLOCK_SIZE=(32, 64)))),
}


@pytest.mark.parametrize("case", list(FEATURES))
@interpreted
def test_forward_backward_match_the_oracle(case):
    shape, kw = FEATURES[case]
    q, k, v = _qkv(**shape)
    check(q, k, v, **kw)


BIAS_SHAPES = {
    "full": (2, 2, 40, 50),  # (N, Hq, Lq, Lk)
    "shared_by_batch_and_heads": (40, 50),  # summed over the G heads in the kernel
    "per_head_keys": (2, 1, 50),  # summed over query blocks
    "per_query": (40, 1),  # summed over key blocks and heads
}


@pytest.mark.parametrize("shape", list(BIAS_SHAPES))
@interpreted
def test_bias_gradient_with_broadcast_strides(shape):
    q, k, v = _qkv(n=2, lq=40, lk=50)
    bias = torch.randn(BIAS_SHAPES[shape], generator=torch.Generator().manual_seed(3))
    check(q, k, v, bias=bias.requires_grad_(True), causal=shape == "full")


def _plain(q, k, v, kw):
    """The same call done naively in the inputs' dtype: every score term as a dense bias,
    every mask term as a dense mask (FlashAttention's error baseline)."""
    d = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
         for n, x in kw.items()}
    s, vis = oracle.scores(q.double(), k.double(), v.double(), **d)
    s0, _ = oracle.scores(q.double(), k.double(), v.double())
    return naive_attention(q, k, v, bias=(s - s0).to(q.dtype), mask=vis)


LOW = {
    "gqa_dqk_ne_dv": (dict(lq=40, lk=70, dqk=32, dv=16), {}),
    "causal_bottom_right_alibi_window": (dict(lq=40, lk=70), dict(
        causal=True, diagonal="bottom_right", window=(30, 0),
        alibi_slopes=score_mods.alibi_slopes(2))),
    "bias_and_mask": (dict(), dict(bias=torch.randn(2, 45, 70, generator=g0),
                                      mask=torch.rand(45, 70, generator=g0) > 0.2)),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", list(LOW))
@interpreted
def test_low_precision_within_flash_attentions_rule(case, dtype):
    """max|out - ref| <= 2 max|plain - ref| + 1e-5 (3x for gradients), plain = the naive
    computation in the same dtype; the oracle runs on the same rounded inputs."""
    shape, kw = LOW[case]
    q, k, v = _qkv(dtype=dtype, **shape)
    out = attnkit.attention(q, k, v, backend="triton", **kw)
    assert out.dtype == dtype
    dq, dk, dv = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref = attnkit.attention_reference(dq, dk, dv, **_double(kw))
    plain = _plain(q, k, v, kw)
    ok, err, base = fa_tolerance_ok(out, ref, plain)
    assert ok, f"out: {err:.2e} vs plain {base:.2e}"
    for name, a, b, c in zip("qkv", _grads(out, [q, k, v]), _grads(ref, [dq, dk, dv]),
                             _grads(plain, [q, k, v])):
        ok, err, base = fa_tolerance_ok(a, b, c, mult=3.0)
        assert ok, f"d{name}: {err:.2e} vs plain {base:.2e}"


# ---- decoding, paged K/V, varlen ---------------------------------------------------------------


DECODE = {
    "one_row_split": (1, 3, dict(causal=True, diagonal="bottom_right")),
    "padded_softcap_alibi_sinks": (1, 2, dict(
        seqlens_kv=torch.tensor([150, 33]), causal=True, diagonal="bottom_right", softcap=3.0,
        alibi_slopes=score_mods.alibi_slopes(8), sinks=torch.randn(8, generator=g0))),
    "three_rows_per_head_window": (3, 4, dict(causal=True, diagonal="bottom_right",
                                              window=(100, 0))),
    "no_split": (2, 1, dict()),
}


@pytest.mark.parametrize("case", list(DECODE))
@interpreted
def test_decode_split_keys(case, monkeypatch):
    """Few query rows per key/value head: the G heads of a kv head stacked in one program,
    keys split across programs and merged by the second kernel."""
    lq, splits, kw = DECODE[case]
    monkeypatch.setattr(tx, "SPLITS", splits)
    q, k, v = _qkv(n=2, hq=8, hkv=2, lq=lq, lk=150, dqk=32)
    spec = build_spec(q, k, v, **kw)
    plan = tx.make_plan(spec)
    assert plan.hg == 4 and plan.splits == splits
    check(q, k, v, grad=False, **kw)


@interpreted
def test_paged_kv_through_the_block_table():
    g = torch.Generator().manual_seed(5)
    n, hq, hkv, page, d, pages = 3, 4, 2, 16, 32, 16
    lens = torch.tensor([70, 5, 33])
    table = torch.randperm(pages, generator=g)[:n * 5].view(n, 5)
    kp, vp = (torch.randn(pages, page, hkv, d, generator=g) for _ in range(2))
    for lq in (1, 2):
        q = torch.randn(n, hq, lq, d, generator=g)
        k, v = attnkit.gather_kv(kp, vp, table, lens)
        kw = dict(causal=True, diagonal="bottom_right", seqlens_kv=lens, softcap=5.0)
        stub = kp.new_zeros(()).expand(n, hkv, 5 * page, d)
        spec = build_spec(q, stub, stub, paged=PagedKV(kp, vp, table.long()), **kw)
        assert backends.select(spec, "triton") is tx and "paged_kv" in spec.features()
        res = tx.forward(spec, tx.make_plan(spec))
        ref, ref_lse = attnkit.attention_reference(q.double(), k.double(), v.double(),
                                                   return_lse=True, **kw)
        _close("paged out", res.out, ref, 2e-5)
        _close("paged lse", res.lse, ref_lse, 2e-5)


@interpreted
def test_varlen_packed_sequences():
    g = torch.Generator().manual_seed(6)
    cu_q, cu_k = torch.tensor([0, 20, 20, 57, 64]), torch.tensor([0, 31, 40, 80, 80])
    q = torch.randn(64, 4, 16, generator=g).requires_grad_(True)
    k = torch.randn(80, 2, 16, generator=g).requires_grad_(True)
    v = torch.randn(80, 2, 16, generator=g).requires_grad_(True)
    kw = dict(causal=True, diagonal="bottom_right", alibi_slopes=torch.rand(4, 4, generator=g))
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, backend="triton", return_lse=True,
                                        **kw)
    t_out, t_lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, backend="tiled",
                                            return_lse=True, **kw)
    _close("varlen out vs tiled", out, t_out, 2e-5)
    _close("varlen lse vs tiled", lse, t_lse, 2e-5)
    for s in range(4):  # each sequence alone against the oracle
        a, b, c, e = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if b == a:
            continue
        ref = attnkit.attention_reference(
            q[a:b].detach().transpose(0, 1).double(), k[c:e].detach().transpose(0, 1).double(),
            v[c:e].detach().transpose(0, 1).double(), causal=True, diagonal="bottom_right",
            alibi_slopes=kw["alibi_slopes"][s])
        _close(f"varlen sequence {s}", out[a:b].transpose(0, 1), ref, 2e-5)
    for name, a, b in zip("qkv", _grads(out, [q, k, v]), _grads(t_out, [q, k, v])):
        _close(f"varlen d{name} vs tiled", a, b, 2e-4)


# ---- dropout, determinism, torch.compile ------------------------------------------------------


@interpreted
def test_dropout_keep_mask_is_bit_identical_to_attnkit_dropout():
    """With V = identity the output is the dropped weight matrix itself, so its zeros are the
    kernel's keep mask: it must equal attnkit.dropout.keep_mask for the same seed, offset and
    (b, h, i, j), with a seed above 2**32 and batch and head indices in the counter."""
    n, hq, lq, lk, p, seed, offset = 2, 3, 33, 70, 0.3, 2 ** 40 + 7, 3  # lk > 64: every word
    q = torch.randn(n, hq, lq, 16, generator=torch.Generator().manual_seed(8))
    k = torch.randn(n, hq, lk, 16, generator=torch.Generator().manual_seed(9))
    eye = torch.eye(lk).expand(n, hq, lk, lk)
    out = attnkit.attention(q, k, eye, backend="triton", dropout_p=p, seed=seed, offset=offset)
    b, h, i, j = (torch.arange(x).view(*([1] * a), x, *([1] * (3 - a)))
                  for a, x in enumerate((n, hq, lq, lk)))
    keep = attnkit.dropout.keep_mask(seed, offset, p, b, h, i, j)
    assert torch.equal(out != 0, keep)
    assert 0.2 < 1 - keep.float().mean().item() < 0.4


@interpreted
def test_dropout_forward_backward_replay_the_same_mask():
    q, k, v = _qkv()
    check(q, k, v, dropout_p=0.25, seed=1234, offset=2, causal=True)
    keep = torch.rand(2, 45, 70, generator=torch.Generator().manual_seed(2)) > 0.3
    check(q, k, v, dropout_p=0.3, dropout_mask=keep)


@interpreted
def test_backward_is_bitwise_deterministic():
    q, k, v = _qkv()
    bias = torch.randn(45, 70, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    runs = []
    for _ in range(2):
        out = attnkit.attention(q, k, v, backend="triton", bias=bias, causal=True)
        runs.append(_grads(out, [q, k, v, bias]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@interpreted
def test_torch_compile_runs_the_kernels_inside_the_attention_op():
    q, k, v = _qkv()

    def f(q, k, v):
        return attnkit.attention(q, k, v, causal=True, softcap=4.0, backend="triton")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    ref = f(q, k, v)
    _close("compiled out", out, ref, 1e-6)
    for name, a, b in zip("qkv", _grads(out, [q, k, v]), _grads(ref, [q, k, v])):
        _close(f"compiled d{name}", a, b, 1e-6)


def test_the_gpu_check_script_explains_itself_without_torch():
    """scripts/gpu_check.py (the prepared H200 check) parses its options before importing
    torch or triton, so --help works anywhere."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--dry-run" in proc.stdout and "correctness" in proc.stdout


def test_the_kernels_tables_follow_the_oracles_visibility():
    """Tile kinds (0 empty, 1 partial, 2 full) and the key / query lists the kernels walk,
    against the oracle's visibility; the relative table against the builtin's own bias."""
    q, k, v = _qkv(n=2, lq=70, lk=90)
    kw = dict(causal=True, window=(40, 0), diagonal="bottom_right",
              seqlens_kv=torch.tensor([90, 61]))
    t = tx.make_tables(build_spec(q, k, v, **kw), 32, 32)
    vis = oracle.scores(q, k, v, **kw)[1].any(1)  # (N, Lq, Lk): a tile runs for all (b, h)
    for qb in range(3):
        for kb in range(3):
            tile = vis[:, qb * 32:(qb + 1) * 32, kb * 32:(kb + 1) * 32]
            kind = 0 if not tile.any() else (2 if tile.all() else 1)
            assert t.kind[qb, kb] == kind, (qb, kb)
        listed = torch.nonzero(t.kind[qb]).flatten().tolist()
        assert t.kv_list[qb, :t.kv_cnt[qb]].tolist() == listed
    for kb in range(3):
        assert t.q_list[kb, :t.q_cnt[kb]].tolist() == torch.nonzero(t.kind[:, kb]).flatten(
        ).tolist()
    mod = score_mods.alibi([0.5, 1.0])
    table = tx.relative_table(build_spec(q, k, v, score_mod=mod))  # index j - i + Lq - 1
    i, j = torch.tensor(5), torch.tensor(8)
    assert table[1, 8 - 5 + 69].item() == pytest.approx(
        mod(torch.zeros(()), 0, torch.tensor(1), i, j).item())


def test_every_launch_compiles_for_sm90():
    """tests/triton_compile.py: the kernels of every constexpr branch compile to cubins for
    sm_90 with the GPU tile sizes and launch settings, within its shared memory (no driver
    needed). Started next to the interpreted child when both run (two processes, two cores)."""
    rc, text = _compile_check.result()
    if rc == "skip":
        pytest.skip(text)
    if rc != 0 and "FAIL" not in text and "ptxas" in text.lower():
        pytest.skip(f"no ptxas to assemble with: {text[-300:]}")
    assert rc == 0, text[-6000:]
    assert text.count("ok ") >= 10, text
