"""A griffe extension for the API reference: the docstrings' Sphinx roles as Markdown.

aoffload's docstrings use reStructuredText's cross-reference roles (``:class:`~aoffload.X```).
Each becomes an mkdocs-autorefs link where its target is a documented public name, and inline
code (the target's last part) where it is not (a private module, a relative target), so that
``mkdocs build --strict`` has no unresolved reference.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`<>]+?)`")
_LITERAL_BLOCK = re.compile(r"::\n", re.MULTILINE)

_PUBLIC_MODULES = (
    "aoffload",
    "aoffload.dcp",
    "aoffload.deepspeed",
    "aoffload.lightning",
    "aoffload.testing",
)


def _documented() -> set[str]:
    """The top-level names the reference documents: each public module's ``__all__``."""
    names: set[str] = set()
    for module in _PUBLIC_MODULES:
        try:
            exported = importlib.import_module(module).__all__
        except ImportError:  # an optional extra that is not installed
            continue
        names.update(f"{module}.{name}" for name in exported)
    return names


class SphinxRoles(griffe.Extension):
    """Rewrites ``:role:`target``` in every docstring before it is rendered."""

    def __init__(self) -> None:
        super().__init__()
        self._documented = _documented()

    def _target(self, path: str) -> str | None:
        """The identifier to link to, or ``None`` when ``path`` is not documented."""
        if path.startswith("."):
            return None
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in self._documented:
                rest = parts[cut:]
                if any(part.startswith("_") for part in rest) or len(rest) > 1:
                    return None
                return path
        return None

    def _replace(self, match: re.Match[str]) -> str:
        short, path = match.group(1) == "~", match.group(2).strip()
        title = path.rsplit(".", 1)[-1] if short or path.startswith(".") else path.lstrip(".")
        if path.endswith("()"):
            path = path[:-2]
        target = self._target(path)
        return f"[`{title}`][{target}]" if target else f"`{title}`"

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring (if any)."""
        docstring = getattr(obj, "docstring", None)
        if docstring is None:
            return
        value = _ROLE.sub(self._replace, docstring.value)
        docstring.value = _LITERAL_BLOCK.sub(":\n", value)
