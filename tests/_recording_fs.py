"""An fsspec filesystem that records the order of its writes (tests/test_remote_order.py).

``recording:///abs/path`` is a local directory. Each write appends ``start PATH`` before it
begins and ``end PATH`` once it is whole (``PATH=TEXT`` for ``latest``, which names a tag) to
the journal file given as the ``journal`` storage option, with ``O_APPEND``: the lines of
every process and thread writing the remote tier come out in the order the writes happened.
It is registered under the ``fsspec.specs`` entry point by a distribution the test writes
into a folder on the ranks' ``sys.path``, so the engines' uploader processes find it as
they would any fsspec backend.
"""

from __future__ import annotations

import os
from typing import Any

from fsspec.implementations.local import LocalFileSystem

__all__ = ["RecordingFileSystem", "read_journal"]


class RecordingFileSystem(LocalFileSystem):  # type: ignore[misc]
    protocol = ("recording",)

    def __init__(self, journal: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.journal = journal

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        if path.startswith("recording://"):
            path = path[len("recording://") :]
        return super()._strip_protocol(path)

    def _note(self, event: str, path: str) -> None:
        fd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"{event} {path}\n".encode())
        finally:
            os.close(fd)

    def put_file(self, lpath: Any, rpath: Any, **kwargs: Any) -> None:
        path = self._strip_protocol(rpath)
        self._note("start", path)
        super().put_file(lpath, rpath, **kwargs)
        self._note("end", path)

    def pipe_file(self, path: Any, value: bytes, **kwargs: Any) -> None:
        shown = self._strip_protocol(path)
        if shown.endswith("/latest"):
            shown += "=" + value.decode().strip()
        self._note("start", shown)
        super().pipe_file(path, value, **kwargs)
        self._note("end", shown)


def read_journal(path: str) -> list[tuple[str, str]]:
    """The journal's ``(event, path)`` lines, in the order they were written."""
    with open(path) as journal:
        return [(line.split(" ", 1)[0], line.rstrip("\n").split(" ", 1)[1]) for line in journal]
