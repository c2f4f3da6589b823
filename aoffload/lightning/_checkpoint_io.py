"""Lightning's ``CheckpointIO`` backed by aoffload's checkpoint engine.

Lightning calls ``save_checkpoint(checkpoint, path)`` synchronously from its training
loop, which runs no event loop, so :class:`AsyncCheckpointIO` drives
:class:`aoffload.CheckpointEngine` through its synchronous face from Lightning's thread (as
the DeepSpeed adapter does): no event loop anywhere, no thread running one.

The files live in an aoffload checkpoint directory next to them, ``<dir>/.aoffload/``:
one tag per save, named after the file, holding it under its own name::

    <dir>/.aoffload/<tag>/epoch=0-step=10.ckpt     a plain torch.save file, in the manifest
    <dir>/epoch=0-step=10.ckpt -> .aoffload/<tag>/epoch=0-step=10.ckpt

The link at ``path`` is created (atomically, by ``os.replace``) only once the tag is
durable and published, so whatever ``path`` holds is complete: the previous checkpoint,
the new one, or nothing, never half a file. ``torch.load(path)`` reads it without
aoffload. A save to a path that already links to a checkpoint (``last.ckpt``, saved again
and again) removes that checkpoint once the new one is linked; a checkpoint Lightning
removes (``save_top_k``) goes once the checkpoints saved before are durable. So the folder
holds what Lightning keeps, plus the saves in flight. ``aoffload ls <dir>`` lists them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from .. import (
    AoffloadError,
    CheckpointEngine,
    CheckpointError,
    CorruptCheckpointError,
    Handle,
    load_checkpoint,
    load_metadata,
)

__all__ = ["AsyncCheckpointIO"]

logger = logging.getLogger(__name__)

Unloadable = Literal["warn", "error", "ignore"]

STORE = ".aoffload"
"""The aoffload checkpoint directory next to the checkpoints, holding their files."""
_LINK_SUFFIX = ".aoffload-link"


def _local(path: object) -> Path:
    text = os.fspath(path)  # type: ignore[call-overload]
    if "://" in str(text):
        raise CheckpointError(
            f"{text}: aoffload.lightning.AsyncCheckpointIO writes local paths only"
        )
    return Path(os.path.abspath(text))


def _link(path: Path, target: Path, durable: bool) -> None:
    """Make ``path`` a symbolic link to ``target`` atomically (a temporary, then replace)."""
    temporary = path.with_name(f".{path.name}{_LINK_SUFFIX}")
    temporary.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, path.parent), temporary)
    os.replace(temporary, path)
    if durable:
        _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Store:
    """One ``<dir>/.aoffload`` and its engine: the saves and removals in flight there."""

    def __init__(self, parent: Path, options: dict[str, Any]) -> None:
        self.parent = parent
        self.root = parent / STORE
        self.durable = bool(options["durable"])
        self.engine = CheckpointEngine(self.root, **options)
        self.engine.start()
        self.pending: dict[Path, str] = {}  # path -> the tag it will link to
        self.work: list[concurrent.futures.Future[Any]] = []

    def tag_for(self, name: str) -> str:
        """A tag for a new save of file ``name``: the name, made unique."""
        taken = {*self.engine.pending(), *self.engine.tags()}
        tag, n = name, 0
        while tag in taken:
            n += 1
            tag = f"{name}~{n}"
        return tag

    def tag_of(self, path: Path) -> str | None:
        """The tag ``path`` is (or will be) this store's link to, or ``None``."""
        if path in self.pending:
            return self.pending[path]
        if not path.is_symlink():
            return None
        target = Path(os.path.normpath(path.parent / os.readlink(path)))
        if target.parent.parent == self.root and target.name == path.name:
            return target.parent.name
        return None

    def track(self, future: concurrent.futures.Future[Any]) -> None:
        self.work = [f for f in self.work if not f.done() or f.exception() is not None]
        self.work.append(future)

    def failure(self) -> BaseException | None:
        """The first failure of the work in flight (forgotten once returned)."""
        for future in self.work:
            if future.done() and future.exception() is not None:
                self.work.remove(future)
                return future.exception()
        return None

    def wait(self, timeout: float) -> None:
        """Block until every save and removal in flight has ended (at most ``timeout`` s)."""
        _, late = concurrent.futures.wait(self.work, timeout=timeout)
        if late:
            raise CheckpointError(
                f"waited {timeout} s for the checkpoints in flight in {self.parent} to become "
                "durable; they are still being written"
            )


class AsyncCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` that saves in the background, from an exact snapshot.

    ``Trainer(plugins=[AsyncCheckpointIO()])``. ``save_checkpoint`` copies every tensor of
    the checkpoint into staging memory on aoffload's threads (GIL-free, in parallel; CUDA
    tensors through pinned memory) and returns once the copy is complete: Lightning's next
    optimizer step cannot change what is saved. Serialising, writing, fsyncing and
    publishing then run in aoffload's writer process and commit thread while training
    goes on. ``path`` becomes a link to the durable file only once it is complete (see
    the module's documentation), so a crash never leaves a half-written checkpoint where
    Lightning looks. ``load_checkpoint`` verifies the file against its manifest (size and
    xxh3-64) before loading it; ``remove_checkpoint`` (``ModelCheckpoint``'s
    ``save_top_k``) deletes a checkpoint only after the checkpoints saved before the call
    are durable, and keeps it if one of them failed. A save to a path that already holds
    one of its checkpoints (``save_last``'s ``last.ckpt``) removes the older checkpoint
    once the new one is durable and linked: the disk holds what Lightning keeps plus the
    saves in flight.

    Each directory gets its aoffload directory ``<dir>/.aoffload`` (``aoffload ls <dir>``
    lists it) and a writer process, started on its first save; ``teardown()`` (Lightning
    calls it when ``fit`` ends) waits until everything is durable and stops them. A failed
    background save raises from the next call. The options go to
    :class:`aoffload.CheckpointEngine`; ``commit_timeout`` bounds how long a load waits for
    saves in flight. Lightning's own retention (``save_top_k``) decides what is kept, so
    there is no ``keep_last``.
    """

    def __init__(
        self,
        *,
        max_pending: int = 1,
        durable: bool = True,
        start_timeout: float = 60.0,
        close_timeout: float = 30.0,
        commit_timeout: float = 300.0,
        unloadable: Unloadable = "warn",
    ) -> None:
        super().__init__()
        self._options: dict[str, Any] = {
            "max_pending": max_pending,
            "durable": durable,
            "start_timeout": start_timeout,
            "close_timeout": close_timeout,
            "unloadable": unloadable,
        }
        self._timeout = commit_timeout
        self._stores: dict[Path, _Store] = {}

    @property
    def pid(self) -> int | None:
        """The process id of the first running writer (one per directory), else ``None``."""
        for store in self._stores.values():
            if store.engine.pid is not None:
                return store.engine.pid
        return None

    # -- helpers ---------------------------------------------------------------------------

    def _store(self, parent: Path) -> _Store:
        store = self._stores.get(parent)
        if store is None:
            store = self._stores[parent] = _Store(parent, self._options)
            logger.debug("checkpoint writer started for %s (pid %s)", parent, store.engine.pid)
        return store

    def _raise_failed(self) -> None:
        for store in self._stores.values():
            error = store.failure()
            if error is not None:
                raise error

    def _commit(self, store: _Store, path: Path, tag: str, checkpoint: dict[str, Any]) -> None:
        metadata = {"lightning_path": path.name}
        for key in ("epoch", "global_step"):
            if isinstance(checkpoint.get(key), int):
                metadata[key] = checkpoint[key]
        replaced = store.tag_of(path)  # what `path` links to now (or will): superseded
        commit = store.engine.commit(tag, metadata=metadata)
        linked: concurrent.futures.Future[None] = concurrent.futures.Future()
        linked.set_running_or_notify_cancel()
        store.pending[path] = tag

        def link(done: Handle[Any]) -> None:  # the commit thread
            try:
                error = done.exception()
                if error is None:
                    target = store.root / tag / path.name
                    _link(path, target, store.durable)
                    if replaced is not None and replaced != tag:
                        # the superseded checkpoint goes once this one is linked; `linked`
                        # ends with its removal (the commit thread runs it next)
                        removal = store.engine.remove(replaced)
                        removal.add_done_callback(lambda gone: _settle(linked, gone))
                        return
            except BaseException as exc:  # noqa: BLE001 - raised by the plugin's next call
                error = exc
            finally:
                if store.pending.get(path) == tag:
                    del store.pending[path]
            if error is None:
                linked.set_result(None)
            else:
                linked.set_exception(error)

        store.track(linked)
        commit.add_done_callback(link)  # the failure is raised by this plugin, not the engine

    # -- Lightning's CheckpointIO interface ----------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        """Snapshot ``checkpoint`` for ``path``; return once copied, durable in the background.

        Returns when every tensor is copied into staging memory (the fence: training may
        modify them from then on); the file is written, fsynced and published, and
        ``path`` linked to it, in the background; the checkpoint ``path`` linked to before
        is then removed. Raises the failure of an earlier save,
        :class:`InvalidStateError` for what cannot be saved.
        """
        if storage_options is not None:
            raise TypeError(
                "AsyncCheckpointIO.save_checkpoint() takes no storage_options; "
                "Trainer.save_checkpoint(..., storage_options=...) is not supported"
            )
        self._raise_failed()
        path = _local(path)
        store = self._store(path.parent)
        tag = store.tag_for(path.name)
        staged = store.engine.stage(checkpoint, path.name, tag=tag)
        started = time.perf_counter()
        staged.result()  # the fence: the exact snapshot, nothing modified since stage()
        logger.debug("%s staged in %.3f s", path, time.perf_counter() - started)
        self._commit(store, path, tag, checkpoint)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load ``path``, verified against its manifest, once the saves in flight are durable.

        ``weights_only=None`` (Lightning's default) and ``True`` load with
        ``torch.load(weights_only=True)``; ``False`` is the caller's opt-in for a file it
        trusts. A file this plugin did not write (no link into an aoffload directory) is
        loaded as Lightning's ``TorchCheckpointIO`` loads it, without verification.
        Raises ``FileNotFoundError`` when ``path`` does not exist,
        :class:`CorruptCheckpointError` naming the file on a mismatch.
        """
        self._raise_failed()
        path = _local(path)
        store = self._stores.get(path.parent)
        if store is not None:
            store.wait(self._timeout)
            self._raise_failed()
        target = Path(os.path.realpath(path))
        root = target.parent.parent
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        tag, safe = target.parent.name, weights_only is not False
        if root.name != STORE or not _committed(root, tag):
            loaded: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=safe)
            return loaded
        owner = self._stores.get(root.parent)
        if owner is not None:  # its writer loads a file with a large pickle
            load = owner.engine.load(
                target.name, tag=tag, map_location=map_location, weights_only=safe
            )
        else:
            load = load_checkpoint(
                root, target.name, tag, map_location=map_location, weights_only=safe
            )
        state: dict[str, Any] = load.result()
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Delete ``path``'s checkpoint once the checkpoints saved before are durable.

        The link at ``path`` goes first, then the tag it names, on the engine's commit
        thread after the saves in flight; if one of them failed, both are kept. A path
        this plugin did not write is removed at once, as Lightning's ``TorchCheckpointIO``
        does.
        """
        self._raise_failed()
        path = _local(path)
        store = self._stores.get(path.parent)
        tag = store.tag_of(path) if store is not None else None
        if tag is None and path.is_symlink():
            target = Path(os.path.normpath(path.parent / os.readlink(path)))
            if target.parent.parent == path.parent / STORE:  # a link of an earlier run
                store = self._store(path.parent)
                tag = store.tag_of(path)
        if store is None or tag is None:
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
            return

        def unlink(store: _Store = store, tag: str = tag) -> None:  # the commit thread
            if store.tag_of(path) == tag and path.is_symlink():
                path.unlink()
                if store.durable:
                    _fsync_directory(path.parent)

        removal: concurrent.futures.Future[bool] = concurrent.futures.Future()
        removal.set_running_or_notify_cancel()
        store.engine.remove(tag, before=unlink).add_done_callback(
            lambda done: _settle(removal, done)
        )
        store.track(removal)

    def teardown(self) -> None:
        """Wait until every save is durable and linked, then stop the writers.

        Raises the first failure of a background save that was not raised before.
        """
        stores, self._stores = list(self._stores.values()), {}
        failures: list[BaseException] = []
        for store in stores:
            try:
                concurrent.futures.wait(store.work)
                error = store.failure()
                if error is not None:
                    failures.append(error)
            finally:
                try:
                    store.engine.close()
                except AoffloadError as exc:
                    failures.append(exc)
        if failures:
            raise failures[0]


def _committed(root: Path, tag: str) -> bool:
    """Whether ``tag`` is a committed checkpoint of ``root`` (its manifest is read)."""
    try:
        load_metadata(root, tag).result()
    except CorruptCheckpointError:
        return True  # committed, damaged: the load says how
    except CheckpointError:
        return False
    return True


def _settle(future: concurrent.futures.Future[Any], done: Handle[Any]) -> None:
    """Give ``future`` the outcome of ``done`` (which has ended)."""
    error = done.exception()
    if error is None:
        future.set_result(done.result())
    else:
        future.set_exception(error)
