"""Ranks without a shared filesystem: ``distributed=True`` with ``remote=``.

Without a remote tier, rank 0 renames every rank's files into the tag (:mod:`._distributed`),
which needs one filesystem. With one, each rank may keep its checkpoint directory on its own
node. :class:`SpreadRanks` is the same commit protocol with two changes, and the upload
protocol on top:

- **commit.** Rank 0 gathers the files of the ranks that share its directory (it sees their
  temporary directory) as before, and publishes the tag locally with those files. A rank
  whose directory rank 0 cannot see is *away*: once rank 0 has published, it publishes its
  own files in its own directory, under the same tag and sequence (a local manifest of the
  files on that node). ``commit()`` returns on every rank once every rank's files are durable
  on its node and the tag is published there.
- **upload** (on each rank's upload thread, keys ``aoffload/<run>/<n>/up/...``). Each rank
  uploads its own files, then reports them (``report/<rank>``: names, sizes, xxh3-64) and
  counts itself; the last report sets ``outcome`` to *uploaded*, and a rank whose upload
  failed sets it to its failure instead (the first verdict wins). Rank 0 waits for
  ``outcome`` (bounded by ``upload_timeout``; the ranks that did not report are named),
  then writes one remote manifest covering every rank's files, then ``latest``, and sets
  ``result``; every rank waits for ``result``, acknowledges it, and resolves its
  ``uploaded(tag)``. A failure on any rank fails ``uploaded()`` on every rank, naming it,
  and nothing is published remotely.

The waits block the upload thread on a store connection of its own, never the event loop.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..._errors import CheckpointError
from ..core.commit import Catalog, CommitResult, committed
from ..core.tags import OpenTag
from ..format import layout, read
from ..ranks.commit import Ranks, Resolve
from ..ranks.rendezvous import Keys, first_line
from ..writer.calls import FileRecord

if TYPE_CHECKING:
    from .early import EarlyFiles
    from .tier import RemoteTier

__all__ = ["SpreadRanks"]

logger = logging.getLogger(__name__)

_UPLOADED = "uploaded"
_ACK_SECONDS = 10.0


class _UpKeys:
    """The store keys of the upload of commit ``n``."""

    def __init__(self, run: str, n: int) -> None:
        self.prefix = f"aoffload/{run}/{n}/up/"
        self.outcome = self.prefix + "outcome"
        self.count = self.prefix + "count"
        self.result = self.prefix + "result"

    def report(self, rank: int) -> str:
        return f"{self.prefix}report/{rank}"

    def ack(self, rank: int) -> str:
        return f"{self.prefix}ack/{rank}"


def _entries(records: Mapping[str, FileRecord]) -> dict[str, layout.FileEntry]:
    return {name: layout.FileEntry(r.nbytes, r.xxh3_64) for name, r in records.items()}


class SpreadRanks(Ranks):
    """This rank's part in the commits and uploads of a distributed engine with a remote tier."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._numbers: dict[str, int] = {}
        self._own: dict[str, dict[str, layout.FileEntry]] = {}
        """Per committed tag, the files this rank uploads (its own, and what it adopted)."""
        self._store: Any = None  # the upload thread's own connection

    def start(self) -> layout.Scan:
        """Join the other ranks (a collective); this rank's directory may be its own."""
        self._directory.mkdir(parents=True, exist_ok=True)
        return super().start()

    # -- commit -------------------------------------------------------------------------

    def commit(
        self,
        open_tag: OpenTag,
        writer: Any,
        catalog: Catalog,
        started: float,
        latest: bool,
        resolve: Resolve,
    ) -> None:
        """As :meth:`Ranks.commit`; remembers which commit of the run the tag was."""
        self._numbers[open_tag.tag] = self._next
        try:
            super().commit(open_tag, writer, catalog, started, latest, resolve)
        finally:
            if open_tag.tag not in self._own:
                self._numbers.pop(open_tag.tag, None)

    def _away(self, reports: list[dict[str, Any]]) -> list[int]:
        """The ranks with files whose temporary directory rank 0 cannot see."""
        return [
            rank
            for rank, report in enumerate(reports)
            if rank and report["files"] and not (self._directory / report["dir"]).is_dir()
        ]

    def _gathered(
        self, tag: str, reports: list[dict[str, Any]], published: dict[str, layout.FileEntry]
    ) -> None:
        """Rank 0 uploads its own files of ``tag``: those no other rank reported."""
        peers = {name for rank, report in enumerate(reports) if rank for name in report["files"]}
        self._own[tag] = {n: e for n, e in published.items() if n not in peers}

    def _published(
        self,
        keys: Keys,
        open_tag: OpenTag,
        records: dict[str, FileRecord],
        catalog: Catalog,
        started: float,
        latest: bool,
    ) -> CommitResult:
        """Ranks but 0: wait for rank 0; an away rank then publishes its files locally."""
        tag = open_tag.tag
        answer = self._answer(keys, open_tag, catalog)
        kept = answer.get("metadata")
        if self.rank not in answer.get("away", ()):
            done = committed(catalog.directory, open_tag, records, started, answer["files"], kept)
            catalog.record(tag, int(answer["sequence"]), done, latest=latest)
            catalog.forget_old()
            self._own[tag] = _entries(records)
            self._meet.set(keys.ack(self.rank), "1")
            return done
        try:

            def result(files: Mapping[str, layout.FileEntry]) -> CommitResult:
                sizes = dict(answer["files"]) | {n: e.bytes for n, e in files.items()}
                return committed(catalog.directory, open_tag, records, started, sizes, kept)

            mine = _entries(records)
            sequence = int(answer["sequence"])
            done = catalog.publish(
                open_tag.tmpdir, tag, mine, result, kept, latest=latest, sequence=sequence
            )
        except BaseException as exc:  # its upload can never happen: tell rank 0 at once
            failure = {
                "rank": self.rank,
                "error": f"its local publication failed: {first_line(exc)}",
            }
            upkeys = _UpKeys(self._meet.run, keys.n)
            try:
                self._meet.claim(upkeys.outcome, json.dumps(failure))
            finally:
                self._meet.set(keys.ack(self.rank), "1")
            raise
        self._own[tag] = {n: layout.FileEntry(e.bytes, e.xxh3_64) for n, e in self._local(tag)}
        self._meet.set(keys.ack(self.rank), "1")
        return done

    def _local(self, tag: str) -> list[tuple[str, layout.FileEntry]]:
        manifest = read.read_manifest(self._directory / tag / layout.MANIFEST)
        return [
            (name, layout.FileEntry(int(e["bytes"]), str(e["xxh3_64"])))
            for name, e in manifest["files"].items()
        ]

    # -- upload (the upload thread) -------------------------------------------------------

    def upload(self, tag: str, latest: bool, tier: RemoteTier, early: EarlyFiles) -> None:
        """Upload this rank's files of ``tag``; rank 0 publishes once every rank has.

        Raises :class:`CheckpointError` on every rank when any rank's upload failed.
        """
        n, own = self._numbers.pop(tag), self._own.pop(tag)
        keys = _UpKeys(self._meet.run, n)
        if self._store is None:
            self._store = self._meet.connect()
        store = self._store
        timeout = tier.timeout
        local = self._directory / tag
        files = tuple((str(local / name), name, entry.bytes) for name, entry in own.items())
        mine: BaseException | None = None
        try:
            tier.put_files(tag, files, early)
        except BaseException as exc:  # noqa: BLE001 - every rank learns it, then it is raised
            mine = exc
            failure = {"rank": self.rank, "error": first_line(exc)}
            store.compare_set(keys.outcome, "", json.dumps(failure))
        else:
            report = {name: [entry.bytes, entry.xxh3_64] for name, entry in own.items()}
            store.set(keys.report(self.rank), json.dumps(report))
            if int(store.add(keys.count, 1)) == self.world:
                store.compare_set(keys.outcome, "", _UPLOADED)
        try:
            if self.rank == 0:
                try:
                    self._publish_remote(store, keys, tag, latest, tier)
                except BaseException:
                    if mine is None:
                        tier.discard(tag, tuple(own))
                    raise
            else:
                answer = json.loads(self._get(store, keys.result, timeout + _ACK_SECONDS))
                store.set(keys.ack(self.rank), "1")
                if not answer["ok"] and mine is None:
                    tier.discard(tag, tuple(own))  # never published: leave nothing behind
                    raise CheckpointError(answer["error"])
        except dist.DistError as exc:
            raise CheckpointError(
                f"lost the commit store on rank 0 while the ranks uploaded ({first_line(exc)})"
            ) from exc
        if mine is not None:
            raise mine

    @staticmethod
    def _get(store: Any, key: str, seconds: float) -> str:
        store.set_timeout(datetime.timedelta(seconds=seconds))
        return bytes(store.get(key)).decode()

    def _publish_remote(
        self, store: Any, keys: _UpKeys, tag: str, latest: bool, tier: RemoteTier
    ) -> None:
        """Rank 0: wait for every rank's upload; publish one manifest, then ``latest``."""
        nothing = f"nothing was published in {tier.url}"
        try:
            verdict = self._get(store, keys.outcome, tier.timeout)
        except dist.DistStoreError:
            missing = [r for r in range(self.world) if not store.check([keys.report(r)])]
            late = {
                "rank": missing[0] if missing else -1,
                "error": f"rank(s) {missing} did not finish their upload within "
                f"upload_timeout={tier.timeout} s",
            }
            store.compare_set(keys.outcome, "", json.dumps(late))
            verdict = bytes(store.get(keys.outcome)).decode()
        try:
            if verdict != _UPLOADED:
                failure = json.loads(verdict)
                raise CheckpointError(
                    f"the upload failed on rank {failure['rank']}: {failure['error']}; {nothing}"
                )
            files: dict[str, Any] = {}
            values = store.multi_get([keys.report(r) for r in range(self.world)])
            for value in values:
                for name, (nbytes, xxh3) in json.loads(bytes(value).decode()).items():
                    if name in files:
                        raise CheckpointError(f"file {name!r} was uploaded by two ranks; {nothing}")
                    files[name] = {"bytes": nbytes, "xxh3_64": xxh3}
            manifest = read.read_manifest(self._directory / tag / layout.MANIFEST)
            manifest["files"] = files
            tier.publish(tag, manifest, json.dumps(manifest, indent=1), latest)
        except BaseException as exc:
            store.set(keys.result, json.dumps({"ok": False, "error": first_line(exc)}))
            self._acks(store, keys)
            raise
        store.set(keys.result, json.dumps({"ok": True}))
        self._acks(store, keys)

    def _acks(self, store: Any, keys: _UpKeys) -> None:
        """Rank 0: wait (briefly) until every rank has read the result; drop the keys."""
        if self.world > 1:
            acks = [keys.ack(rank) for rank in range(1, self.world)]
            try:
                store.wait(acks, datetime.timedelta(seconds=_ACK_SECONDS))
            except dist.DistError as exc:
                logger.warning("not every rank acknowledged an upload (%s)", first_line(exc))
        for key in (keys.outcome, keys.count, keys.result):
            store.delete_key(key)
        for rank in range(self.world):
            store.delete_key(keys.report(rank))
            store.delete_key(keys.ack(rank))
