"""An engine's faces made on demand (:class:`Faces`: its DCP face, closed with it).

Apart from :mod:`._running`, which ``aoffload.dcp`` imports to find an engine: the face is
built by ``aoffload.dcp``, so only this module imports it, and no import runs in a circle.
"""

from __future__ import annotations

import threading
from typing import Any

from ._running import Running

__all__ = ["Faces"]


class Faces:
    """The faces of one engine made on first use (``engine.dcp``), closed before it."""

    def __init__(self, engine: Running) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._dcp: Any = None

    def dcp(self) -> Any:
        """The engine's DCP face (``aoffload.dcp``'s ``DcpFace``), made on first use."""
        with self._lock:
            if self._dcp is None:
                from ..dcp._face import DcpFace  # torch.distributed.checkpoint: on demand

                self._dcp = DcpFace(self._engine)  # type: ignore[arg-type]
            return self._dcp

    def close(self) -> None:
        """Close the faces made (before the engine's core closes)."""
        with self._lock:
            face = self._dcp
        if face is not None:
            face.close()
