"""A griffe extension for the API reference: jaxcoll's docstrings use a few reST habits
(``:func:`~jaxcoll.x.y``` roles, ``.. warning::`` blocks, a paragraph ending in ``::`` before a
code block), which Markdown would print literally. Roles become code spans (``~`` keeps the
last name, as Sphinx shows it), ``.. warning::`` becomes a ``Warning:`` section (rendered as an
admonition) and a closing ``::`` becomes ``:``. The docstrings themselves stay as written.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_DIRECTIVE = re.compile(r"^(\s*)\.\. (warning|note|tip|important|caution|danger)::\s*$", re.M)
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def markdown_of(text: str) -> str:
    """``text`` with reST roles as code spans, directives as sections and a line-closing
    ``::`` as ``:``."""
    text = _ROLE.sub(_role, text)
    text = _DIRECTIVE.sub(lambda m: f"{m.group(1)}{m.group(2).capitalize()}:", text)
    return re.sub(r"(?<=\S)::$", ":", text, flags=re.M)


class RstRoles(griffe.Extension):
    """Rewrite each docstring once, when griffe loads its object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_of(obj.docstring.value)
