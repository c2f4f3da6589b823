"""A commit of one process, on the engine's commit thread, and its pieces.

:func:`commit_local` is the whole commit of a single-process engine as one blocking
function: wait until every file of the tag is written, fsync the tree, publish through
the catalog (:meth:`~.catalog.Catalog.publish`: manifest last, rename, ``latest``), retire
old tags. The ranks' commit (``ranks/``) reuses :func:`written` and :func:`discard`.
Nothing here waits for the event loop: a commit completes while the loop is blocked.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..._errors import CheckpointError, InvalidStateError, RemoteError
from ..format import layout, write
from ..writer.calls import FileRecord, SyncTree
from .result import CommitResult, committed
from .roles import Published

if TYPE_CHECKING:
    from ..._runtime.core import WorkerCore
    from .catalog import Catalog
    from .tags import OpenTag

__all__ = ["commit_local", "discard", "written"]


def written(
    writer: WorkerCore | None, open_tag: OpenTag, latest: str | None
) -> dict[str, FileRecord]:
    """Block until every file of ``open_tag`` is written, then fsync its directory tree.

    Raises :class:`CheckpointError` naming the first file whose staging or write failed,
    :class:`WorkerDiedError` if the writer died. A tag without files returns at once.
    """
    open_tag.raise_failures()
    records: dict[str, FileRecord] = {}
    for name, job in list(open_tag.files.items()):
        try:
            records[name] = job.written.result()
        except RemoteError as exc:
            raise CheckpointError(
                f"could not write {name!r} of checkpoint {open_tag.tag!r} to "
                f"{open_tag.tmpdir / name}: {exc.remote_message}; the checkpoint is "
                f"discarded, {layout.LATEST!r} still names {latest!r}"
            ) from exc
        except CheckpointError as exc:  # its staging failed (a tensor mutated, bad input)
            raise CheckpointError(
                f"file {name!r} of checkpoint {open_tag.tag!r} could not be staged ({exc}); "
                "the checkpoint is discarded"
            ) from exc
    if records and writer is not None:
        writer.request(SyncTree(str(open_tag.tmpdir)))
    return records


def discard(open_tag: OpenTag, *also: concurrent.futures.Future[Any]) -> None:
    """Remove the directory of a tag that failed, once its writes in flight (and ``also``)
    have ended: a write that ends later would recreate it, and reads its staging slot."""
    pending = [job.written for job in open_tag.files.values()] + list(also)
    concurrent.futures.wait(pending)
    write.remove_tree(open_tag.tmpdir)


def commit_local(
    open_tag: OpenTag,
    writer: WorkerCore | None,
    catalog: Catalog,
    started: float,
    latest: bool,
    number: int,
) -> Published:
    """Commit the tag of a single-process engine: wait for its files, publish, retire.

    Runs on the commit thread. A tag that fails is removed (:func:`discard`) before the
    error is raised. ``number`` counts this engine's commits.
    """
    try:
        open_tag.raise_failures()
        if not open_tag.files:
            raise InvalidStateError(
                f"nothing was saved under tag {open_tag.tag!r}; nothing to commit"
            )
        records = written(writer, open_tag, catalog.latest)
        entries = {n: layout.FileEntry(r.nbytes, r.xxh3_64) for n, r in records.items()}
        published: dict[str, layout.FileEntry] = {}

        def result(files: Mapping[str, layout.FileEntry]) -> CommitResult:
            published.update(files)
            sizes = {name: entry.bytes for name, entry in files.items()}
            return committed(
                catalog.directory, open_tag, records, started, sizes, open_tag.metadata
            )

        done = catalog.publish(
            open_tag.tmpdir, open_tag.tag, entries, result, open_tag.metadata, latest=latest
        )
    except BaseException:
        discard(open_tag)
        raise
    return Published(done, number, published)
