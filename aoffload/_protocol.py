"""Wire messages between the trainer and a worker process.

Pure data, cheap to import: every message is a frozen dataclass, every operation a
member of an :class:`enum.Enum`. Each service (the checkpoint writer, the optimizer)
defines its own operation enum and payload dataclasses next to its worker code; the
bridge only knows :class:`Control`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Control(enum.Enum):
    """Operations every worker understands, whatever its service."""

    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class Request:
    """Trainer -> worker: run ``op`` with ``payload``; the reply carries the same ``id``."""

    id: int
    op: enum.Enum
    payload: object = None


@dataclass(frozen=True, slots=True)
class Reply:
    """Worker -> trainer: ``op`` of request ``id`` returned ``value``."""

    id: int
    value: object = None


@dataclass(frozen=True, slots=True)
class Failure:
    """Worker -> trainer: request ``id`` raised; the worker goes on serving."""

    id: int
    remote_type: str
    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class Ready:
    """Worker -> trainer, once, first: the service is constructed and serving."""

    pid: int


@dataclass(frozen=True, slots=True)
class StartupFailed:
    """Worker -> trainer, once, instead of :class:`Ready`: the service could not start."""

    remote_type: str
    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class LogEvent:
    """Worker -> trainer: a log record, re-emitted on the trainer's logger of the same name."""

    name: str
    level: int
    message: str


Incoming = Reply | Failure | Ready | StartupFailed | LogEvent
