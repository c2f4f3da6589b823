"""Ranks without a shared filesystem: every rank uploads its own files of a tag.

With ``distributed=True`` and ``remote=``, each rank may keep its checkpoint directory on
its own node (the ranks' commit then leaves an *away* rank's files on its node:
``ranks/commit.py``); the remote tier makes the checkpoint whole. :class:`RankUploads` is
the tier's :class:`~.tier.Spread`: the upload of one tag across the ranks, on each rank's
upload thread, with ``Keys.upload(run, n)`` for commit ``n``:

Each rank uploads the files it holds (:attr:`~..core.roles.Published.files`), then posts
an :class:`~..meet.reports.Uploaded` report and counts itself; the last report sets
``outcome`` to *uploaded*, and a rank whose upload failed sets it to its
:class:`~..meet.reports.Failure` instead (the first verdict wins). Rank 0 waits for
``outcome`` (bounded by ``upload_timeout``; the ranks that did not report are named), then
writes one remote manifest covering every rank's files, then ``latest``, and sets
``result``; every rank waits for ``result``, acknowledges it, and resolves its
``uploaded(tag)``. A failure on any rank fails ``uploaded()`` on every rank, naming it,
and nothing is published remotely.

The waits block the upload thread on a store connection of its own, never the event loop.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..._errors import CheckpointError, first_line
from ..format import layout, read
from ..meet.keys import Keys
from ..meet.rendezvous import get, missing, wait_acks
from ..meet.reports import UPLOADED, Answer, Failure, Uploaded, encode, verdict

if TYPE_CHECKING:
    from ..core.roles import Published
    from ..meet.rendezvous import Rendezvous
    from .early import EarlyFiles
    from .tier import RemoteTier

__all__ = ["RankUploads"]

logger = logging.getLogger(__name__)

_ACK_SECONDS = 10.0


class RankUploads:
    """This rank's part in the uploads of a distributed engine with a remote tier."""

    def __init__(self, rendezvous: Rendezvous) -> None:
        self._meet = rendezvous
        self._store: Any = None  # the upload thread's own connection

    def upload(
        self, tier: RemoteTier, tag: str, published: Published, latest: bool, early: EarlyFiles
    ) -> None:
        """Upload this rank's files of ``tag``; rank 0 publishes once every rank has.

        Raises :class:`CheckpointError` on every rank when any rank's upload failed.
        """
        meet, own = self._meet, published.files
        keys = Keys.upload(meet.run, published.number)
        if self._store is None:
            self._store = meet.connect()
        store = self._store
        local = tier.directory / tag
        files = tuple((str(local / name), name, entry.bytes) for name, entry in own.items())
        mine: BaseException | None = None
        try:
            tier.put_files(tag, files, early)
        except BaseException as exc:  # noqa: BLE001 - every rank learns it, then it is raised
            mine = exc
            store.compare_set(keys.outcome, "", encode(Failure(meet.rank, first_line(exc))))
        else:
            store.set(keys.report(meet.rank), encode(Uploaded(dict(own))))
            if int(store.add(keys.count, 1)) == meet.world:
                store.compare_set(keys.outcome, "", UPLOADED)
        try:
            if meet.rank == 0:
                try:
                    self._publish(store, keys, tag, latest, tier)
                except BaseException:
                    if mine is None:
                        tier.discard(tag, tuple(own))
                    raise
            else:
                answer = Answer.decode(get(store, keys.result, tier.timeout + _ACK_SECONDS))
                store.set(keys.ack(meet.rank), "1")
                if not answer.ok and mine is None:
                    tier.discard(tag, tuple(own))  # never published: leave nothing behind
                    raise CheckpointError(answer.error)
        except dist.DistError as exc:
            raise CheckpointError(
                f"lost the commit store on rank 0 while the ranks uploaded ({first_line(exc)})"
            ) from exc
        if mine is not None:
            raise mine

    def _publish(self, store: Any, keys: Keys, tag: str, latest: bool, tier: RemoteTier) -> None:
        """Rank 0: wait for every rank's upload; publish one manifest, then ``latest``."""
        world = self._meet.world
        nothing = f"nothing was published in {tier.url}"
        try:
            outcome = get(store, keys.outcome, tier.timeout)
        except dist.DistStoreError:
            late = missing(store, keys, world)
            why = (
                f"rank(s) {late} did not finish their upload within upload_timeout={tier.timeout} s"
            )
            store.compare_set(keys.outcome, "", encode(Failure(late[0] if late else -1, why)))
            outcome = bytes(store.get(keys.outcome)).decode()
        try:
            failure = verdict(outcome, UPLOADED)
            if failure is not None:
                raise CheckpointError(
                    f"the upload failed on rank {failure.rank}: {failure.error}; {nothing}"
                )
            files: dict[str, Any] = {}
            values = store.multi_get([keys.report(r) for r in range(world)])
            for value in values:
                for name, entry in Uploaded.decode(bytes(value).decode()).files.items():
                    if name in files:
                        raise CheckpointError(f"file {name!r} was uploaded by two ranks; {nothing}")
                    files[name] = {"bytes": entry.bytes, "xxh3_64": entry.xxh3_64}
            manifest = read.read_manifest(tier.directory / tag / layout.MANIFEST)
            manifest["files"] = files
            tier.publish(tag, manifest, json.dumps(manifest, indent=1), latest)
        except BaseException as exc:
            store.set(keys.result, encode(Answer(False, error=first_line(exc))))
            self._acks(store, keys)
            raise
        store.set(keys.result, encode(Answer(True)))
        self._acks(store, keys)

    def _acks(self, store: Any, keys: Keys) -> None:
        """Rank 0: wait (briefly) until every rank has read the result; drop the keys."""
        world = self._meet.world
        try:
            wait_acks(store, keys, world, _ACK_SECONDS)
        except dist.DistError as exc:
            logger.warning("not every rank acknowledged an upload (%s)", first_line(exc))
        for key in keys.spent(world):
            store.delete_key(key)
