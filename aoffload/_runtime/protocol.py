"""Typed calls between the trainer and a worker process.

Pure data, cheap to import, no torch. A request is an instance of a :class:`Call`
subclass, and the subclass names its result type: ``class WriteRecords(Call[FileRecord])``.
The bridge's :meth:`~aoffload._runtime.bridge.Bridge.call` therefore returns a
``Future[FileRecord]`` for a ``WriteRecords``, and the worker's service dispatches on the
request's type (:class:`~aoffload._runtime.serve.Service`). There is no operation enum:
the message type *is* the operation.

On the wire every message travels inside an envelope (:class:`Request`, :class:`Reply`,
:class:`Failure`, ...) that carries the request id.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

__all__ = [
    "Call",
    "Failure",
    "Incoming",
    "LogEvent",
    "Ready",
    "Reply",
    "Request",
    "Shutdown",
    "StartupFailed",
    "Wire",
]

R = TypeVar("R")

_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(kind: type) -> tuple[str, ...]:
    names = _FIELDS.get(kind)
    if names is None:
        if not dataclasses.is_dataclass(kind):
            raise TypeError(f"{kind.__qualname__} is a Wire message but not a dataclass")
        names = _FIELDS[kind] = tuple(field.name for field in dataclasses.fields(kind))
    return names


class Wire:
    """Base of wire messages (dataclasses): pickled as the class and its field values.

    A frozen dataclass otherwise pickles its state as a dict and unpickles it through a
    generated ``__setstate__`` that sets each field in turn; on the optimizer's per-step
    path this form takes 25-40% off each message's cost at both ends. The field list
    comes from :func:`dataclasses.fields`, so a subclass loses nothing whether or not it
    is slotted.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        kind = type(self)
        return (kind, tuple([getattr(self, name) for name in _fields(kind)]))


class Call(Wire, Generic[R]):
    """A request whose reply is an ``R``; subclass it as a frozen dataclass.

    ``plain = True`` on a subclass says that its fields are plain Python values (never a
    tensor or anything else that travels by handle): it is then pickled without
    multiprocessing's reducers, which costs a per-call copy of their dispatch table.
    """

    __slots__ = ()
    plain: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class Shutdown(Call[None]):
    """Stop serving after the requests already sent (every service understands it)."""


@dataclass(frozen=True, slots=True)
class Request(Wire):
    """Trainer -> worker: run ``call``; the reply carries the same ``id``."""

    id: int
    call: Call[Any]


@dataclass(frozen=True, slots=True)
class Reply(Wire):
    """Worker -> trainer: request ``id`` returned ``value``."""

    id: int
    value: object = None


@dataclass(frozen=True, slots=True)
class Failure(Wire):
    """Worker -> trainer: request ``id`` raised; the worker goes on serving."""

    id: int
    remote_type: str
    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class Ready(Wire):
    """Worker -> trainer, once, first: the service is constructed and serving."""

    pid: int


@dataclass(frozen=True, slots=True)
class StartupFailed(Wire):
    """Worker -> trainer, once, instead of :class:`Ready`: the service could not start."""

    remote_type: str
    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class LogEvent(Wire):
    """Worker -> trainer: a log record, re-emitted on the trainer's logger of the same name."""

    name: str
    level: int
    message: str


Incoming = Reply | Failure | Ready | StartupFailed | LogEvent
