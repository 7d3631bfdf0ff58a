"""The package layout: modules grouped by what they hold, every 0.1 import path still working
(as the same module object), and the benchmark's dependencies behind the ``bench`` extra."""

from __future__ import annotations

import argparse
import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import attnkit
from attnkit import _moved, bench, cli

PACKAGE = Path(attnkit.__file__).parent


def test_the_top_level_holds_only_the_entry_points_and_the_plain_statements_of_the_math():
    flat = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert flat == ["__init__", "_moved", "cli", "numpy", "reference"], flat
    for sub in ("doors", "terms", "kv", "engine", "backends", "native", "integrations", "bench"):
        init = PACKAGE / sub / "__init__.py"
        assert init.is_file(), sub
        assert importlib.import_module(f"attnkit.{sub}").__doc__, f"attnkit.{sub} says nothing"


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_every_old_path_is_the_same_module(old, new):
    moved = importlib.import_module(f"attnkit.{new}")
    assert importlib.import_module(f"attnkit.{old}") is moved
    assert getattr(attnkit, old) is moved
    assert not (PACKAGE / f"{old}.py").exists()  # one file per module, no copies


def test_old_paths_import_in_a_fresh_interpreter():
    """``import attnkit.spec`` and ``from attnkit.api import ...`` as the first import."""
    code = ("import attnkit.spec, attnkit.terms.spec as s; assert attnkit.spec is s\n"
            "from attnkit.api import attention\n"
            "from attnkit.paged import PagedKVCache, paged_attention, TAKES\n"
            "import attnkit.doors.paged as d; assert paged_attention is d.paged_attention\n"
            "assert TAKES is d.TAKES\n"
            "from attnkit.masks import causal\n"
            "import attnkit; assert attention is attnkit.attention\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_storage_and_terms_never_import_the_front_doors():
    """The layers import downwards: doors -> kv, terms, engine. A module of attnkit.kv or
    attnkit.terms imports nothing from attnkit.doors, at its top or inside a function, but
    for kv.paged's module ``__getattr__`` that keeps 0.1's ``attnkit.paged.paged_attention``
    (the doors' old home) working."""
    import ast

    for sub in ("kv", "terms"):
        for path in sorted((PACKAGE / sub).glob("*.py")):
            tree = ast.parse(path.read_text())
            shim = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef)
                    and f.name == "__getattr__" for n in ast.walk(f)}
            for node in ast.walk(tree):
                if id(node) in shim or not isinstance(node, ast.ImportFrom):
                    continue
                where = "." * node.level + (node.module or "")
                assert "doors" not in where and "api" not in where, (path.name, where)


def test_a_builtin_pickled_under_the_old_module_name_loads():
    """Builtin mods pickle by module and factory name; 0.1 wrote ``attnkit.masks``."""
    from attnkit.terms import mods

    m = attnkit.masks.sliding_window(3)
    data = pickle.dumps(m, protocol=0)  # text opcodes: the module name can be edited
    assert b"attnkit.terms.masks" in data
    old = data.replace(b"attnkit.terms.masks", b"attnkit.masks")
    assert old != data
    again = pickle.loads(old)
    assert mods.info_of(again) == mods.info_of(m)


def _without_rich(monkeypatch):
    for name in ("rich", "rich.console", "rich.table", "rich.progress"):
        monkeypatch.setitem(sys.modules, name, None)


def test_bench_without_the_extra_says_what_to_install(monkeypatch, capsys):
    _without_rich(monkeypatch)
    assert cli.main(["bench", "--suite", "quick"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'attnkit[bench]'" in err
    assert bench.main(["--suite", "quick"]) == 2
    assert cli.main(["bench", "--list"]) == 0  # listing the cases needs nothing


def test_bench_with_the_extra_needs_nothing_more():
    assert bench.missing_extra() is None  # the test extra installs rich


def test_check_prints_a_plain_table_without_the_extra(monkeypatch, capsys):
    _without_rich(monkeypatch)
    row = {"feature": "causal", "shape": "7 x 9", "dtype": "float32", "backend": "auto",
           "out": 1e-7, "lse": 2e-7, "grad": 3e-6, "status": "ok"}
    bad = dict(row, feature="window", out=1.0)
    monkeypatch.setattr(cli, "run_check", lambda dtypes, backends: [row, bad])
    monkeypatch.setattr(cli, "run_decode_check", lambda dtypes: [])
    code = cli._cmd_check(argparse.Namespace(dtype=["float32"], backend=["auto"]))
    out = capsys.readouterr().out.splitlines()
    assert code == 1  # the window row is over its limit
    assert out[0].startswith("attnkit check:")
    assert out[1].split() == ["feature", "Lq", "x", "Lk", "dtype", "backend", "out", "lse",
                              "grad", "q/k/v", "status"]
    assert out[2].split()[-1] == "ok" and out[3].split()[-1] == "LARGE"
    assert "1.00e-07" in out[2] and "1.00e+00" in out[3]


def test_the_paged_cache_names_the_calls_that_read_it():
    doc = attnkit.PagedKVCache.__doc__
    for name in ("paged_attention", "paged_attention_blocks", "varlen_attention"):
        assert name in doc, name


def test_attention_names_every_executor_it_can_be_forced_to():
    from attnkit.backends import BACKENDS

    doc = attnkit.attention.__doc__
    for name in BACKENDS:
        assert f'"{name}"' in doc, name


def test_a_token_major_query_is_called_so():
    """(B, L, H, D) where (B, H, L, D) is expected: the message says the layout is wrong."""
    import torch

    cache = attnkit.PagedKVCache(8, 16, 2, 64)
    cache.allocate("a")
    cache.append("a", torch.randn(10, 2, 64), torch.randn(10, 2, 64))
    q = torch.randn(1, 1, 4, 64)  # one token, 4 heads, token-major
    with pytest.raises(ValueError, match=r"q\.transpose\(-3, -2\)") as err:
        attnkit.paged_attention(q, cache, ["a"])
    assert "(batch, heads, L, d)" in str(err.value)
    with pytest.raises(ValueError, match=r"q has 3 heads and k has 2"):  # no such guess
        attnkit.attention(torch.randn(1, 3, 5, 8), torch.randn(1, 2, 5, 8),
                          torch.randn(1, 2, 5, 8))
