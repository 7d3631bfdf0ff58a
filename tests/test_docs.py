"""The documentation: its generated parts are current, its examples run, its reference covers
every public name and option, and the README states what the code does.

Every ```python block of README.md, docs/index.md, docs/platforms.md and docs/guides/*.md runs
here, each in a fresh namespace. A block preceded by ``<!-- test: slow -->`` is marked slow
(it imports transformers or compiles a graph); ``<!-- test: continue -->`` runs the block in
the namespace of the block before it (which runs first).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import socket
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import pytest
import torch

import attnkit
from attnkit.spec import Options

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
EXAMPLE_FILES = [README, DOCS / "index.md", DOCS / "platforms.md",
                 *sorted((DOCS / "guides").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- test: (?P<tag>[a-z]+) -->\n)?```python\n(?P<code>.*?)^```",
                   re.S | re.M)


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Example(NamedTuple):
    path: Path
    line: int
    code: str
    tag: Optional[str]
    before: Optional[Example]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _examples() -> List[Example]:
    found = []
    for path in EXAMPLE_FILES:
        text = path.read_text()
        prev = None
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code")) + 1
            ex = Example(path, line, m.group("code"), m.group("tag"),
                         prev if m.group("tag") == "continue" else None)
            found.append(ex)
            prev = ex
    return found


EXAMPLES = _examples()


def _param(ex: Example):
    marks = [pytest.mark.slow] if ex.tag == "slow" else []
    return pytest.param(ex, id=ex.name, marks=marks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(ex: Example, namespace: Dict) -> None:
    if ex.before is not None:
        _run(ex.before, namespace)
    exec(compile(ex.code, ex.name, "exec"), namespace)


@pytest.mark.parametrize("example", [_param(ex) for ex in EXAMPLES])
def test_example_runs(example: Example, monkeypatch, capsys):
    """Each Python example runs as written (small sizes), and what it asserts holds."""
    code = example.code if example.before is None else example.before.code + example.code
    for module in ("transformers", "triton"):
        if re.search(rf"^\s*import {module}\b|^\s*from {module}\b", code, re.M):
            pytest.importorskip(module)
    distributed = "init_process_group" in code
    if distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            pytest.skip("a process group is already initialised in this process")
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())),
                            ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(name, value)
    impl = getattr(torch.nn.attention, "current_flash_attention_impl", None)
    before = impl() if impl is not None else None
    try:
        _run(example, {"__name__": "__docs_example__"})
    finally:
        if impl is not None and impl() != before:
            torch.nn.attention.restore_flash_attention_impl()
        if distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def test_examples_found():
    """The extraction sees the examples (a changed fence style would silently skip them)."""
    names = {ex.path.name for ex in EXAMPLES}
    assert "README.md" in names
    assert sum(ex.path == README for ex in EXAMPLES) >= 8
    doors = ("attnkit.attention(", "flex_attention(", "scaled_dot_product_attention(",
             "varlen_attention(", "paged_attention(", "ring_attention(", "torch.compile(",
             'set_attn_implementation("attnkit")')
    readme_code = "".join(ex.code for ex in EXAMPLES if ex.path == README)
    assert [d for d in doors if d not in readme_code] == []


def test_generated_parts_are_current():
    """The feature x executor table (README, executors guide) and the benchmark pages are what
    scripts/gen_docs.py makes of the executors' capabilities and the data files."""
    stale = _gen_docs().stale()
    assert stale == [], f"not current: {stale}; run: python scripts/gen_docs.py"


def test_executor_table_lists_every_executor_and_feature():
    from attnkit import backends
    from attnkit.spec import FEATURES

    gen = _gen_docs()
    header, rows, _ = gen.executor_rows()
    assert header[1:] == [f"`{n}`" for n in backends.PRIORITY]
    labelled = dict(gen.FEATURE_ROWS)
    unlabelled = sorted(FEATURES - set(labelled))
    assert unlabelled == [], f"features without a label in FEATURE_ROWS: {unlabelled}"
    first = [r[0] for r in rows]
    assert all(labelled[f] in first for f in FEATURES)
    assert {"dtypes", "devices", "head dims", "query rows"} <= set(first)


def test_readme_is_short_and_keeps_its_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert ("pip install torch==2.13.0 && pip install -e '.[bench,test,plot]' && attnkit bench "
            "--suite quick") in text
    assert "\npython -m pytest\n" in text
    assert "mkdocs build --strict" in text


def test_readme_links_resolve():
    """Every relative link of the README names a file of the repository."""
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_api_reference_documents_every_public_name():
    pages = "".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    documented = set(re.findall(r"^::: attnkit\.([A-Za-z_][A-Za-z0-9_]*)\s*$", pages, re.M))
    missing = sorted(set(attnkit.__all__) - documented)
    assert missing == [], f"names of attnkit.__all__ without a '::: attnkit.NAME' entry: {missing}"


def test_api_reference_documents_every_option_once():
    """Each option of attention() (Options, and attention's own keywords) has one row in the
    option tables of docs/api/attention.md."""
    text = (DOCS / "api" / "attention.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    first_cells = [line.split("|")[1] for line in rows]
    own = [name for name, p in inspect.signature(attnkit.attention).parameters.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for name in (*Options.names(), *own):
        hits = [c for c in first_cells if f"`{name}`" in c]
        assert len(hits) == 1, f"option {name!r} has {len(hits)} rows in docs/api/attention.md"


def _environment_variables(folder: Path) -> Dict[str, List[str]]:
    """Variable name -> files of ``folder`` that read it from the environment."""
    pattern = re.compile(r"(?:os\.environ(?:\.get)?\s*[\[(]\s*|os\.getenv\(\s*)"
                         r"[\"']([A-Z][A-Z0-9_]*)[\"']")
    found: Dict[str, List[str]] = {}
    for path in folder.rglob("*.py"):
        for name in pattern.findall(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


#: read from the environment but not a setting (so not listed)
NOT_SETTINGS = {"USERNAME": "names the private temporary folder where os.getuid is missing"}


def test_every_environment_variable_is_documented():
    """Every variable attnkit reads is in the README's table (the benchmark's own in the
    platforms page) and in docs/platforms.md."""
    found = _environment_variables(ROOT / "attnkit")
    assert "ATTNKIT_NATIVE" in found  # the scan works
    readme, platforms = README.read_text(), (DOCS / "platforms.md").read_text()
    for name, files in found.items():
        if name in NOT_SETTINGS:
            continue
        assert f"`{name}" in platforms or f"${name}" in platforms, (
            f"{name} (read in {files}) is not in docs/platforms.md")
        if all(f.startswith("attnkit/bench/") for f in files):
            continue
        assert f"`{name}" in readme or f"${name}" in readme, (
            f"{name} (read in {files}) is not in the README's environment variables")


def test_version_and_changelog_agree():
    """pyproject.toml, attnkit.__version__ and CHANGELOG.md name the same version."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert attnkit.__version__ == version
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(version)}\]", changelog, re.M), (
        f"CHANGELOG.md has no section for {version}")
