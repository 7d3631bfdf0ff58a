"""The ``attnkit check`` accuracy grid: every row within its dtype's limit against the oracle,
the decode rows on whichever path this machine has, and the command's exit status."""

from __future__ import annotations

import pytest

from attnkit import cli, native


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


def test_check_command_exit_status(capsys):
    assert cli.main(["check", "--dtype", "float32"]) == 0
    shown = capsys.readouterr().out
    assert "paged decode" in shown and "native decode kernel" in shown
    assert cli.main(["check", "--dtype", "float8"]) == 2
