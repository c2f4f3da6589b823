"""Small shims over the supported Python versions."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - exercised on Python 3.10 only
    from async_timeout import timeout

__all__ = ["timeout"]
