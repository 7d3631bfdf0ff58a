"""A griffe extension for the docs site: attnkit's docstrings use reST's ``:func:`name```
roles and ``::`` before literal blocks; mkdocstrings renders docstrings as Markdown, so the
roles become code spans and a line's closing ``::`` a single colon (the indented block after
it is a code block in Markdown as well). Loaded by mkdocs.yml (mkdocstrings' ``extensions``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc|obj|const):`(~?)([^`]+)`")
_LITERAL = re.compile(r"(\S)::$", re.M)


def _role(match: re.Match) -> str:
    name = match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if match.group(1) else name}`"


def markdown_of(text: str) -> str:
    """``text`` with reST roles as code spans and closing ``::`` as ``:``."""
    return _LITERAL.sub(r"\1:", _ROLE.sub(_role, text))


class RestRoles(griffe.Extension):
    """Rewrite each docstring as it is loaded."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_of(obj.docstring.value)
