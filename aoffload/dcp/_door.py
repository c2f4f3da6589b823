"""The door: how DCP's PROCESS-mode daemon reaches the trainer's engine.

In ``PROCESS`` mode DCP pickles the ``StorageWriter`` into a daemon process of its own,
which runs ``write_data`` and ``finish`` there. The engine (its writer process, its
commits, ``latest``, the remote tier) stays the trainer's: the writer pickles the
address of its engine's door, and the daemon makes the same calls through it that the
writer makes in the trainer in ``THREAD`` mode. Nothing starts a writer in the daemon.

The door is a Unix socket in the abstract namespace (no file to clean up), opened the
first time a writer bound to the engine is pickled, closed with the engine. Every
connection proves it holds the door's random key first (``multiprocessing``'s HMAC
challenge, both ways), before anything is unpickled; the key travels only inside DCP's
own pipe to its daemon. One thread accepts; each connection is served on a thread of
its own, one call at a time. In the daemon, one connection per door is kept for its
life (DCP's daemon lives as long as the trainer).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from .._errors import AoffloadError, CheckpointError

__all__ = ["Door", "DoorAddress", "call"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DoorAddress:
    """Where a door listens (an abstract socket name) and the key it asks for."""

    name: str
    key: bytes

    def __repr__(self) -> str:  # never the key
        return f"DoorAddress({self.name[1:]!r})"


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if the other side can unpickle it as it is, else a CheckpointError saying it."""
    if isinstance(exc, AoffloadError | OSError | ValueError | TypeError | RuntimeError):
        return exc
    return CheckpointError(f"{type(exc).__name__}: {exc}")


class Door:
    """A door into this process: ``serve(request)`` answers each call, on the door's threads."""

    def __init__(self, serve: Callable[[Any], Any]) -> None:
        self.address = DoorAddress(
            f"\0aoffload-dcp-{os.getpid()}-{secrets.token_hex(8)}", secrets.token_bytes(32)
        )
        self._serve = serve
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(self.address.name)
        self._socket.listen()
        threading.Thread(target=self._accept, name="aoffload-dcp-door", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                peer, _ = self._socket.accept()
            except OSError:
                return  # closed (shutdown wakes the accept)
            with self._lock:
                if self._closed:
                    peer.close()
                    return
                self._open.add(peer)
            thread = threading.Thread(
                target=self._connection, args=(peer,), name="aoffload-dcp-door-call", daemon=True
            )
            thread.start()

    def _connection(self, peer: socket.socket) -> None:
        connection = Connection(os.dup(peer.fileno()))
        try:
            deliver_challenge(connection, self.address.key)
            answer_challenge(connection, self.address.key)
            while True:
                request = connection.recv()
                try:
                    reply: tuple[bool, Any] = (True, self._serve(request))
                except BaseException as exc:  # noqa: BLE001 - sent back to the caller
                    reply = (False, _portable(exc))
                connection.send(reply)
        except (EOFError, OSError) as exc:
            logger.debug("a DCP door connection ended: %s", exc)
        except Exception:  # a peer without the key, or a malformed call
            logger.warning("a connection to the DCP door was refused", exc_info=True)
        finally:
            connection.close()
            with self._lock:
                self._open.discard(peer)
            peer.close()

    def close(self) -> None:
        """Stop accepting, end every connection (their callers see it closed). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._open)
        for sock in (self._socket, *peers):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked on them
        self._socket.close()


_clients: dict[str, tuple[threading.Lock, Connection]] = {}
_clients_lock = threading.Lock()


def _connect(address: DoorAddress) -> tuple[threading.Lock, Connection]:
    with _clients_lock:
        found = _clients.get(address.name)
        if found is not None:
            return found
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address.name)
        except OSError as exc:
            sock.close()
            raise CheckpointError(
                f"cannot reach the trainer's checkpoint engine ({exc.strerror}): it closed, "
                "or this process is not on its host"
            ) from exc
        connection = Connection(sock.detach())
        try:
            answer_challenge(connection, address.key)
            deliver_challenge(connection, address.key)
        except BaseException:
            connection.close()
            raise
        found = _clients[address.name] = (threading.Lock(), connection)
        return found


def call(address: DoorAddress, request: Any) -> Any:
    """Send ``request`` through the door at ``address`` and return the answer (blocking);
    raise what the engine raised."""
    lock, connection = _connect(address)
    with lock:
        try:
            connection.send(request)
            ok, answer = connection.recv()
        except (EOFError, OSError) as exc:
            with _clients_lock:
                _clients.pop(address.name, None)
            connection.close()
            raise CheckpointError(
                "the trainer's checkpoint engine closed while DCP's process was saving"
            ) from exc
    if not ok:
        raise answer
    return answer
