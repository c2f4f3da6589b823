"""Snapshot-consistent, crash-safe checkpoints for synchronous and asyncio trainers:
:class:`CheckpointEngine`.

The engine is a face on :class:`~.core.engine.EngineCore`, whose threads and writer process
do all the work: the caller only learns that it is finished. Every call that waits returns a
:class:`~aoffload.Handle`: an asyncio trainer awaits it, a synchronous one calls
``.result()``. ``stage()`` returns with the snapshot copy under way (its
:class:`~._staged.Staged` is the fence). ``commit()`` and ``commit_soon()`` hand the commit
to the commit thread at once: the files become durable, the manifest, the tag and ``latest``
are published, and old tags retired, while the caller's thread is busy in a training step.
The options make an :class:`~._options.EngineOptions`, from which the assembler
(:mod:`._assemble`) builds the core and its roles. See ``format/`` for the on-disk protocol.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import InvalidStateError
from .._runtime.handle import Handle
from .._runtime.resource import Resource
from . import _running
from ._assemble import PreemptionNotice, assemble, signal_set
from ._faces import Faces
from ._options import EngineOptions
from ._staged import Staged
from .core.load import MapLocation
from .core.loadable import Unloadable
from .core.result import CommitResult

if TYPE_CHECKING:
    from ..dcp._face import DcpFace

__all__ = ["CheckpointEngine", "CommitResult", "PreemptionNotice", "Staged"]


class CheckpointEngine(Resource):
    """Snapshot-consistent checkpoints written in the background by a spawned writer process.

    One object, two faces. A synchronous trainer uses ``with CheckpointEngine(directory) as
    engine:`` (or ``start()`` / ``close()``) and calls ``.result()`` on what a call returns;
    an asyncio trainer uses ``async with`` (or ``astart()`` / ``aclose()``) and awaits the
    same :class:`~aoffload.Handle`. See :meth:`stage`, :meth:`save`, :meth:`commit`,
    :meth:`commit_soon` and :meth:`load`. ``keep_last`` keeps that many newest committed
    tags (``None``: all). ``max_pending`` bounds the checkpoints staged but not yet durable.
    ``writer=False`` makes a replica that writes nothing. ``durable=False`` skips fsync
    (tests, scratch runs). Tags are ordered by commit: each manifest records a sequence
    number one above the highest found in ``directory``.

    ``commit_timeout`` bounds how long ``close()`` waits for the commits requested
    (``commit()``, ``commit_soon()``) to end. ``distributed=True`` makes one checkpoint of
    every rank of a ``torch.distributed`` job (see ``ranks/``): ``start()`` and
    ``commit()`` are collectives, each rank saves its own files, and ``commit_timeout``
    also bounds the wait for a rank whose writer never reports (a blocked event loop
    never counts: reports come from a thread).

    ``staging_bytes`` caps this engine's shared staging memory (per rank, every checkpoint
    in flight together). A larger state streams through the cap chunk by chunk, exactly;
    its fence returns when the last chunk is copied, after about ``(state - cap) / disk
    write rate``. The default (``None``): a quarter of RAM, at most half of ``/dev/shm``'s
    free space, shared by the node's ranks; see ``docs/checkpoints.md``.

    ``unloadable`` says what to do with a staged value that the default
    ``load(weights_only=True)`` could not read back (``np.random.get_state()``, a
    ``collections.deque``, an instance of your own class): ``"warn"`` (the default) warns
    at the fence, naming the file and the key; ``"error"`` fails that staging with
    :class:`InvalidStateError` (the tag stays usable); ``"ignore"`` skips the check.

    ``remote=URL`` (any fsspec URL: ``s3://bucket/run``, ``gs://``, ``file://``) adds a
    remote tier, reached with ``storage_options`` (passed to fsspec unchanged, never
    logged): each tag durable in ``directory`` is then uploaded by an uploader process (see
    :meth:`uploaded`); ``upload_timeout`` bounds the close's wait for uploads in flight,
    ``upload_backoff`` is the first retry's delay (four retries, doubling, at most 8 s), and
    ``early_uploads=True`` starts each file's upload once it is durable instead of after its
    ``commit()`` (see ``docs/remote.md``). On an empty ``directory``, ``latest()``,
    ``tags()`` and ``load()`` see the remote tier. With ``distributed=True`` every rank may
    use its own node-local ``directory``: no shared filesystem is needed.
    """

    _what = "this CheckpointEngine"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        max_pending: int = 1,
        writer: bool = True,
        durable: bool = True,
        start_timeout: float = 60.0,
        close_timeout: float = 30.0,
        direct_io: bool = True,
        distributed: bool = False,
        commit_timeout: float = 300.0,
        unloadable: Unloadable = "warn",
        remote: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        upload_timeout: float = 600.0,
        early_uploads: bool = False,
        upload_backoff: float = 0.5,
        staging_bytes: int | None = None,
    ) -> None:
        options = EngineOptions(
            directory=Path(directory),
            keep_last=keep_last,
            max_pending=max_pending,
            writer=writer,
            durable=durable,
            start_timeout=start_timeout,
            close_timeout=close_timeout,
            direct_io=direct_io,
            distributed=distributed,
            commit_timeout=commit_timeout,
            unloadable=unloadable,
            remote=remote,
            storage_options=storage_options,
            upload_timeout=upload_timeout,
            early_uploads=early_uploads,
            upload_backoff=upload_backoff,
            staging_bytes=staging_bytes,
        )
        parts = assemble(options)
        self._core = parts.core
        self._remote = remote
        self._notices = parts.notice
        self._notice: PreemptionNotice | None = None
        self._faces = Faces(self)
        super().__init__()

    # -- introspection -----------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._core.directory

    @property
    def pid(self) -> int | None:
        """The writer's process id while it runs, else ``None`` (always for a replica)."""
        return self._core.pid

    def latest(self) -> str | None:
        """The newest committed tag (what ``latest`` names), or ``None``."""
        return self._core.catalog.latest

    def tags(self) -> list[str]:
        """Committed tags, oldest first (by commit order), as of start and own commits."""
        return self._core.catalog.tags

    def pending(self) -> list[str]:
        """The tags in flight, oldest first: staged into, or being committed (those take no
        more files), and not yet published nor discarded."""
        return self._core.tags.open_tags()

    @property
    def dcp(self) -> DcpFace:
        """This engine's face for ``torch.distributed.checkpoint``: ``async_save``,
        ``save`` and ``load`` of a DCP state dict under a tag (see ``aoffload.dcp``)."""
        face: DcpFace = self._faces.dcp()
        return face

    # -- lifecycle ----------------------------------------------------------------------

    def _open(self) -> None:
        """Scan the directory (cleaning a crash's leftovers) and start the writer."""
        self._core.start()
        _running.add(self)

    def _failing(self, exc: BaseException) -> None:
        """An exception leaving the block marks this rank failed for its peers."""
        self._core.failing(exc)

    def _close(self) -> None:
        """Finish the commits requested, stop the writer, release staging memory.

        Waits for every commit requested with :meth:`commit` or :meth:`commit_soon`, at
        most ``commit_timeout`` seconds. Tags saved but never committed are discarded,
        each logged at WARNING naming it. Raises the failure of a background commit
        nobody saw.
        """
        _running.discard(self)
        self._uninstall_notice()
        if self._notice is not None:
            self._notice.close()
        try:
            self._faces.close()
        finally:
            self._core.close()

    def _uninstall_notice(self) -> None:
        if self._notice is not None:
            self._notice.uninstall()  # on the caller's thread: the main thread restores them

    async def aclose(self) -> None:
        """Finish the commits requested, stop the writer, release staging memory (awaited).

        The close runs on a thread of its own; a preemption notice's signal handlers are
        restored first, here, on the loop's thread. Idempotent.
        """
        self._uninstall_notice()
        await super().aclose()

    def check_running(self) -> None:
        """Raise why the engine cannot save or commit now (closed, or its writer died)."""
        super().check_running()
        self._core.check_running()

    # -- save ---------------------------------------------------------------------------

    def stage(self, state: object, name: str, *, tag: str) -> Staged:
        """Start snapshotting ``state`` as file ``name`` of checkpoint ``tag``; return at once.

        Not a coroutine: it validates ``name`` and ``tag``, records every tensor's version
        counter, and hands the copy to the engine's threads, which start at once. ``await``
        the returned :class:`Staged` before you modify ``state``: until it resolves its
        tensors are being copied (a tensor modified in place since this call fails the
        staging with :class:`CheckpointError` naming its key; nothing torn is written).
        Several calls with one ``tag`` form one checkpoint. The file is written in the
        background; write errors surface from :meth:`commit`. While ``max_pending``
        checkpoints are staged and not yet durable, the copy waits for room while one of
        them is being committed; when none is, this raises :class:`CheckpointError` at
        once. Raises :class:`InvalidStateError` for a bad name or tag here, and from
        ``await`` naming the key for bad input; :class:`WorkerDiedError` if the writer
        died; the failure of a background commit nobody saw.
        """
        self.check_running()
        job = self._core.stage(state, name, tag)
        return Staged(job, self._core, name, tag)

    def save(self, state: object, name: str, *, tag: str) -> Staged:
        """Snapshot ``state`` as file ``name`` of checkpoint ``tag``: the same as :meth:`stage`.

        Named for the caller who waits at once: when ``await engine.save(...)`` (or
        ``engine.save(...).result()``) returns, every tensor has been copied into staging
        memory, and the caller may mutate or free it.
        """
        return self.stage(state, name, tag=tag)

    # -- commit -------------------------------------------------------------------------

    def commit(
        self,
        tag: str | None = None,
        *,
        latest: bool = True,
        metadata: Mapping[str, Any] | None = None,
    ) -> Handle[CommitResult]:
        """Make checkpoint ``tag`` durable and publish it (and ``latest``); see ``format/``.

        The commit starts when this is called and runs on the engine's commit thread,
        whatever the caller does next; the returned :class:`~aoffload.Handle` waits for
        it (``await`` it, or ``.result()``). ``tag=None`` commits the single open tag;
        ``latest=False`` publishes the tag without moving ``latest``. ``metadata`` (a
        mapping of JSON values: the step, a loss, the data position; at most 64 KiB) is
        stored in the tag's manifest, as the mapping is at this call; :meth:`metadata`,
        :func:`aoffload.load_metadata` and ``aoffload ls`` read it back. It first waits for
        the tag's staging. Cancelling the wait abandons the wait only: the commit goes on,
        a later ``commit(tag)`` returns its result, and a failure nobody sees is raised by
        the engine's next call. Raises :class:`InvalidStateError` when nothing was saved
        under ``tag``, :class:`CheckpointError` naming the file when a staging or a write
        failed (the tag is discarded, ``latest`` unchanged), :class:`WorkerDiedError` if
        the writer died. With ``distributed=True`` every rank calls it with the same tags
        in the same order; a rank that saved nothing under ``tag`` takes part with no
        files, and a failure on any rank raises on every rank (:class:`CheckpointError`
        naming it). Every rank should pass the same ``metadata``: rank 0's is stored, and
        a difference is logged at WARNING (by rank 0, naming the ranks and keys, and by
        each rank that differs). Raises :class:`InvalidStateError` here, at the call, for
        metadata that JSON cannot hold (naming the key) or that is too large.
        """
        self.check_running()
        return self._owned(self._core.commit(tag, latest, metadata))

    def _owned(self, future: concurrent.futures.Future[CommitResult]) -> Handle[CommitResult]:
        """A handle on a commit or an upload that the engine owns: its failure, once raised
        to a caller, is not raised again by the engine's next call."""
        tags = self._core.tags
        return Handle(
            future, seen=lambda _: tags.commit_seen(future), claim=lambda: tags.commit_seen(future)
        )

    def commit_soon(
        self, tag: str | None = None, *, metadata: Mapping[str, Any] | None = None
    ) -> None:
        """Commit ``tag`` in the background; the engine owns the commit. Returns at once.

        Use it where the trainer does not await the commit: it runs on the commit thread
        whether or not the event loop turns; a later :meth:`stage` waits for room
        (``max_pending``) while it runs; its failure is raised from the engine's next
        :meth:`stage`, :meth:`save`, :meth:`commit` or ``aclose()``; ``commit(tag)``
        returns its result. ``metadata`` is stored as with :meth:`commit`. Raises what
        :meth:`commit` raises before it starts.
        """
        self.check_running()
        self._core.commit(tag, True, metadata)

    def metadata(self, tag: str | None = None) -> dict[str, Any]:
        """The metadata committed with ``tag`` (default: the tag ``latest`` names).

        A copy, read from what the engine knows (the manifests found at start and its own
        commits), so it returns at once. ``{}`` for a tag committed without metadata.
        Raises :class:`CheckpointError` when ``tag`` is not committed (or nothing is).
        """
        return self._core.metadata(tag)

    def uploaded(self, tag: str | None = None) -> Handle[CommitResult]:
        """A handle that resolves once checkpoint ``tag`` is published in the remote tier,
        to its :class:`CommitResult`.

        ``tag=None`` is this engine's newest commit. A tag is published remotely once every
        file, then its manifest, then ``latest`` are uploaded (with several ranks: every
        rank's files, then rank 0's one manifest). Awaiting is optional: the engine owns
        every upload, and a failure nobody awaited is raised by its next call, as a failed
        :meth:`commit_soon` is. Raises :class:`CheckpointError` saying why the upload
        failed (retried with backoff first; with several ranks, naming the rank), the
        commit's own error if the commit failed, :class:`InvalidStateError` for a tag this
        engine did not commit that the remote tier does not hold, or without ``remote=``.
        Cancelling the wait abandons the wait only.
        """
        self.check_running()
        return self._owned(self._core.uploaded(tag))

    def remove(self, tag: str, *, before: Callable[[], None] | None = None) -> Handle[bool]:
        """Delete committed checkpoint ``tag`` once the commits requested before this call
        have ended; a :class:`~aoffload.Handle` of whether it was deleted.

        The deletion runs on the engine's commit thread, after those commits: a checkpoint
        is deleted only once the newer ones are durable. If one of them failed, ``tag`` is
        kept (logged at WARNING) and the handle gives ``False``; likewise when ``tag`` is
        not committed. Where ``latest`` names ``tag``, it first moves (atomically) to the
        newest other tag. ``before()``, if given, runs on the commit thread once the
        deletion is decided, just before it (to remove what refers to the tag first: a
        link to one of its files). Raises :class:`InvalidStateError` for a bad tag.
        """
        self.check_running()
        return Handle(self._core.remove(tag, before))

    # -- preemption ---------------------------------------------------------------------

    def preemption(self, signals: Iterable[int] = (signal.SIGTERM,)) -> PreemptionNotice:
        """Listen for preemption ``signals``; the :class:`PreemptionNotice` that tells when to save.

        ``if await notice.reached(step):`` save, commit and stop. A signal on any rank makes
        ``reached(step)`` True on every rank at the same step, the first every rank can still
        reach; without one it costs a lock and no collective. The handlers take effect while
        the loop is blocked in a synchronous step (they run on the main thread: call this
        there), only take note, and are restored when the engine closes; a second signal is
        handed to the handler that was installed before (so it still interrupts or kills).
        ``signals=(signal.SIGUSR1,)`` for SLURM's ``--signal``; ``signals=()`` installs none
        (give notice with :meth:`PreemptionNotice.request`). Calling it again returns the
        same notice. aoffload's workers ignore these signals and keep serving until the
        engine closes, so the final checkpoint lands.
        """
        self.check_running()
        if self._notice is not None:
            if self._notice.signals != signal_set(signals):
                raise InvalidStateError(
                    f"this engine's preemption notice listens for {self._notice.signals}; "
                    "it cannot listen for other signals"
                )
            return self._notice
        notice = self._notices(signals)
        notice.start()
        self._notice = notice
        return notice

    # -- load ---------------------------------------------------------------------------

    def load(
        self,
        name: str,
        *,
        tag: str | None = None,
        map_location: MapLocation = "cpu",
        verify: bool = True,
        weights_only: bool = True,
    ) -> Handle[Any]:
        """Load file ``name`` of committed checkpoint ``tag`` (default: the newest); a
        :class:`~aoffload.Handle` of the loaded object (``await`` it, or ``.result()``).

        Reads your own writes: the load first waits for the commits requested before
        this call (:meth:`commit`, :meth:`commit_soon`; of ``tag`` only, when given), so
        right after ``commit_soon(tag)`` the newest is ``tag`` (or, where that commit
        failed, the tag before it; the failure is raised by the engine's next call).

        Verified against the manifest (``CorruptCheckpointError`` naming the file on a
        mismatch), loaded with ``weights_only=True`` on the engine's load thread.
        ``weights_only=False`` is your explicit opt-in, as with ``torch.load``, for a file
        **you trust** that holds other objects (a numpy RNG state, a ``deque``):
        unpickling it can run arbitrary code. A value that the default load cannot read
        back is flagged when it is staged (see ``unloadable``). With a remote tier, a file
        that is not in ``directory`` is downloaded by the uploader, verified against the
        remote manifest and cached in ``directory/.remote-cache``.
        """
        Resource.check_running(self)
        return Handle(self._core.load(name, tag, map_location, verify, weights_only))
