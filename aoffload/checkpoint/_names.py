"""The checkpoint package's public names, imported on first use (PEP 562).

``aoffload.checkpoint`` hands them on from here, so that the command line, which reads
the format (``format/``), never imports torch.
"""

from __future__ import annotations

import sys

from .._lazy import exports

__all__ = ["__dir__", "__getattr__"]

_PACKAGE = __name__.rpartition(".")[0]

__getattr__, __dir__ = exports(
    _PACKAGE,
    vars(sys.modules[_PACKAGE]),
    {
        **dict.fromkeys(
            ("CheckpointEngine", "CommitResult", "PreemptionNotice", "Staged"), "._engine"
        ),
        **dict.fromkeys(("load_checkpoint", "load_metadata"), "._api"),
    },
)
