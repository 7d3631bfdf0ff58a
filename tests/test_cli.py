"""The ``attnkit`` command: the accuracy grid (every row within its dtype's limit against the
oracle, bottom-right rows that really differ from top-left), the decode rows on whichever path
this machine has, the native-kernel warning, clean errors for bad arguments, --version, help
text, Ctrl-C and ``demo``."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import attnkit
from attnkit import bench, cli, native


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_decode_rows_are_accurate(dtype):
    rows = cli.run_decode_check([dtype])
    assert [r["feature"].split(" (")[0] for r in rows] == ["paged decode", "padded decode"]
    where = "native" if native.available() and dtype != "float64" else "torch"
    limit = {"float64": 1e-10, "float32": 1e-5}.get(dtype, 2e-2)
    for r in rows:
        assert r["feature"].endswith(f"({where})")
        assert r["status"] == "ok" and r["out"] < limit and r["lse"] < max(limit, 1e-5)
    assert rows[0]["grad"] is None  # the paged front door has no backward row
    assert rows[1]["grad"] < (1e-9 if dtype == "float64" else 0.1)


def test_check_grid_rows_are_accurate():
    rows = cli.run_check(["float32"], ["auto"])
    assert {r["feature"] for r in rows} == set(cli._features())
    for r in rows:
        assert r["status"] == "ok", r
        assert max(r["out"], r["lse"]) < 1e-4 and r["grad"] < 2e-3, r
    shapes = {r["feature"]: r["shape"] for r in rows}
    for name, feature in cli._features().items():
        assert shapes[name] == f"{feature.lq} x {feature.lk}"
        if "bottom-right" in name:
            assert feature.lq != feature.lk, name  # else the diagonals coincide


def test_bottom_right_rows_catch_a_top_left_diagonal(monkeypatch):
    """An attention that ignored ``diagonal`` would pass a grid with Lq == Lk; this one fails."""
    import attnkit.api

    real = attnkit.api.attention

    def top_left_only(*args, **kw):
        kw.pop("diagonal", None)
        return real(*args, **kw)

    monkeypatch.setattr(attnkit.api, "attention", top_left_only)
    rows = cli.run_check(["float64"], ["auto"])
    for r in rows:
        if "bottom-right" in r["feature"]:
            assert r["out"] > 1e-3, r
        else:
            assert r["out"] < 1e-10, r


def test_check_command_exit_status(capsys):
    assert cli.main(["check", "--dtype", "float32"]) == 0
    shown = capsys.readouterr().out
    assert "paged decode" in shown and "native kernels" in shown
    assert "45 x 77" in shown  # the bottom-right rows' shape is shown
    assert cli.main(["check", "--dtype", "float8"]) == 2


def test_check_warns_when_native_kernels_are_unavailable(monkeypatch, capsys):
    reason = f"no C compiler found (checked at {time.time()})"
    monkeypatch.setattr(cli, "run_check", lambda dtypes, backends: [])
    if native.available():
        assert cli.native_warning() is None
        assert cli.main(["check", "--dtype", "float32"]) == 0
        assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "unavailable_reason", lambda: reason)
    monkeypatch.setattr(native, "describe", lambda: f"native kernels: unavailable ({reason})")
    assert cli.main(["check", "--dtype", "float32"]) == 0  # still a passing check
    captured = capsys.readouterr()
    assert "(torch)" in captured.out  # the decode rows ran on the torch path
    err = " ".join(captured.err.split())
    assert "warning" in err and reason in err and "slower" in err


@pytest.mark.parametrize("argv,words", [
    (["check", "--backend", "nope"],
     ["--backend", "'nope'", "auto, triton, decode, flash, fused, tiled"]),
    (["check", "--backend", "auto,tiledd"], ["--backend", "'tiledd'"]),
    (["check", "--dtype", "foo"], ["--dtype", "'foo'", "float32"]),
    (["check", "--dtype", ","], ["--dtype", "no names"]),
    (["check", "--dtypes", "float32"], ["unrecognized", "--dtypes"]),
    (["bench", "--repeat", "0"], ["--repeat", ">= 1"]),
    (["bench", "--repeat", "two"], ["--repeat", "'two'"]),
    (["bench", "--mem-budget", "-1"], ["--mem-budget", "> 0"]),
    (["bench", "--min-sample-ms", "nan"], ["--min-sample-ms", "'nan'"]),
    (["bench", "--suite", "huge"], ["--suite", "'huge'"]),
    (["bench", "--only", "no_such_case"], ["no_such_case"]),
    (["bench", "--json", "/no/such/folder/b.json"], ["--json", "does not exist"]),
    (["frobnicate"], ["'frobnicate'"]),
    ([], ["required", "COMMAND"]),
])
def test_bad_arguments_are_clean_errors(argv, words, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "error" in captured.err
    for w in words:
        assert w in captured.err, (w, captured.err)


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert f"attnkit {attnkit.__version__}" in out and torch.__version__ in out


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["bench", "--help"],
                                  ["demo", "--help"]])
def test_help_text_is_plain(argv, capsys):
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: attnkit")
    assert not re.search(r"``|:(func|mod|class|meth|data|attr):`", text), text
    if argv[0] in ("bench", "demo"):
        assert " ".join(bench.QUICK_TIME.split()) in " ".join(text.split())


def test_bench_module_help_is_plain(capsys):
    assert bench.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m attnkit.bench")
    assert not re.search(r"``|:(func|mod|class|meth|data|attr):`", text), text


def test_ctrl_c_exits_quietly(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_check", interrupted)
    monkeypatch.setattr(bench, "run_from_args", interrupted)
    assert cli.main(["check"]) == 130
    assert capsys.readouterr().err == "attnkit: interrupted\n"
    assert cli.main(["bench"]) == 130
    assert bench.main([]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_ctrl_c_during_a_benchmark_run(tmp_path):
    """A real SIGINT in the middle of ``attnkit bench``: exit 130, one line, no traceback."""
    code = "import sys; from attnkit.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "bench", "--only", "causal_1k", "--repeat", "50",
         "--no-memory", "--peers", "attnkit,naive"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        # as from a terminal, even where this process was started with Ctrl-C ignored (a
        # background job): the child would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.readline()  # printed once the run has started (stdout is a pipe)
        assert first.startswith("attnkit bench"), first
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().endswith("interrupted"), err


def test_demo_says_when_it_skips_the_benchmark(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(bench, "run_from_args", lambda args: ran.append(args.suite) or 0)
    monkeypatch.setattr(cli, "_cmd_check", lambda args: 1)
    assert cli.main(["demo"]) == 1
    assert ran == []
    err = " ".join(capsys.readouterr().err.split())
    assert "skipping the quick benchmark" in err and "LARGE" in err
    monkeypatch.setattr(cli, "_cmd_check", lambda args: 0)
    assert cli.main(["demo"]) == 0
    assert ran == ["quick"]
    assert "quick benchmark" in capsys.readouterr().out
