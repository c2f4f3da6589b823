"""The options of a :class:`~aoffload.CheckpointEngine`: one frozen dataclass, validated once.

:class:`EngineOptions` is what the engine's keyword arguments make; the assembler
(:mod:`._assemble`) reads it to choose and build the engine's parts. Every check of an
option is here, made once, when the options are made; the options that only a role uses
(the remote tier's) are checked when that role is asked for (``remote=``,
``distributed=True``), ``upload_backoff`` by the uploader's configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core.loadable import UNLOADABLE, Unloadable
from .core.staging import MIN_STAGING
from .format.layout import is_url

__all__ = ["EngineOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    """Everything :class:`~aoffload.CheckpointEngine` takes (see there for each option)."""

    directory: Path
    keep_last: int | None = None
    max_pending: int = 1
    writer: bool = True
    durable: bool = True
    start_timeout: float = 60.0
    close_timeout: float = 30.0
    direct_io: bool = True
    distributed: bool = False
    commit_timeout: float = 300.0
    unloadable: Unloadable = "warn"
    remote: str | None = None
    storage_options: Mapping[str, Any] | None = None
    upload_timeout: float = 600.0
    early_uploads: bool = False
    upload_backoff: float = 0.5  # checked by the uploader's config (remote/worker/calls.py)
    staging_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.unloadable not in UNLOADABLE:
            raise ValueError(
                f"unloadable must be 'warn', 'error' or 'ignore', not {self.unloadable!r}"
            )
        keep_last, max_pending = self.keep_last, self.max_pending
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, not {keep_last!r}")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, not {max_pending!r}")
        staging = self.staging_bytes
        if staging is not None and (
            not isinstance(staging, int) or isinstance(staging, bool) or staging < MIN_STAGING
        ):
            raise ValueError(
                f"staging_bytes must be None (the default cap) or an int >= {MIN_STAGING} "
                f"(1 MiB), not {staging!r}"
            )
        if not self.commit_timeout > 0:
            raise ValueError(f"commit_timeout must be > 0 seconds, not {self.commit_timeout!r}")
        if self.remote is not None:
            self._check_remote()

    def _check_remote(self) -> None:
        if not is_url(self.remote):
            raise ValueError(
                f"remote must be an fsspec URL such as 's3://bucket/run', not {self.remote!r}"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError("storage_options must be a mapping (fsspec's options for the URL)")
        if not self.upload_timeout > 0:
            raise ValueError(f"upload_timeout must be > 0 seconds, not {self.upload_timeout!r}")
