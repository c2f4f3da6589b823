"""A package's public names imported on first use (PEP 562).

Each package re-exports its public names from its ``__init__`` but imports them only when
one is first read, so that what needs none of them starts fast: the ``aoffload`` command
(no torch), a writer process (no trainer side), an optimizer worker (only its service).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["exports"]


def exports(
    package: str, namespace: dict[str, Any], names: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose ``names`` map each lazily
    imported name to the module (relative to ``package``) that defines it; a name read
    once is stored in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
