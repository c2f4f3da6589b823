"""The assembler: an engine's options become its core and the roles plugged into it.

The only module that imports the roles (``ranks/``, ``remote/``, ``preemption/``): the
core (``core/``) is handed them through its protocols (``core/roles.py``), and the faces
(:mod:`._engine`, :mod:`._api`) ask the assembler. Who takes part in a commit: this
process alone (:class:`~.core.alone.Alone`) or every rank (:class:`~.ranks.commit.RankCommits`).
What stands behind the directory: nothing (:class:`~.core.alone.LocalTier`) or a remote
tier (:class:`~.remote.tier.RemoteTier`); with both ranks and a remote tier, each rank may
keep its files on its own node and upload them itself (:class:`~.remote.ranks.RankUploads`).
Retention keeps the ``keep_last`` newest tags, and a tag's files until its upload ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .._runtime.core import WorkerCore
from ._options import EngineOptions
from .core.alone import Alone, LocalTier
from .core.catalog import Catalog
from .core.engine import EngineCore
from .core.retention import KeepLast, KeepUntil, Retention
from .core.roles import Coordinator, Parts, Tier
from .meet.rendezvous import Rendezvous
from .preemption.notice import PreemptionNotice, signal_set
from .ranks.commit import RankCommits
from .remote.ranks import RankUploads
from .remote.tier import RemoteTier
from .remote.uploader import Uploader
from .remote.url import load_url, metadata_url
from .remote.worker.calls import UploaderConfig, redact_url
from .writer.calls import TARGET, WriterConfig

__all__ = [
    "Assembly",
    "PreemptionNotice",
    "assemble",
    "load_url",
    "metadata_url",
    "signal_set",
]


@dataclass(frozen=True, slots=True)
class Assembly:
    """An engine's parts: its core, and what makes its preemption notice (once started)."""

    core: EngineCore
    notice: Callable[[Iterable[int]], PreemptionNotice]


def assemble(options: EngineOptions) -> Assembly:
    """The parts of an engine with ``options`` (nothing starts yet)."""
    directory = options.directory
    writer = None
    if options.writer:
        config = WriterConfig(durable=options.durable, direct_io=options.direct_io)
        # The write path needs no torch: the writer's process is spared its import and its
        # memory (some 200 MiB of PSS per rank), distributed or not. A distributed trainer's
        # writer imports torch.distributed only if its trainer dies, to tell the peers.
        writer = WorkerCore(
            TARGET,
            config,
            name="checkpoint-writer",
            close_timeout=options.close_timeout,
            preload=(),
        )
    rendezvous = None
    if options.distributed:
        rendezvous = Rendezvous(directory, writer=options.writer, timeout=options.commit_timeout)
    tier = _tier(options, rendezvous)
    keep = KeepLast(options.keep_last)
    retention: Retention = keep if isinstance(tier, LocalTier) else KeepUntil(keep, tier.holding)
    catalog = Catalog(directory, durable=options.durable, retention=retention)
    coordinator: Coordinator
    if rendezvous is None:
        coordinator = Alone(directory, writer, catalog)
    else:  # with a remote tier, the ranks need no shared filesystem
        coordinator = RankCommits(
            rendezvous,
            writer=writer,
            catalog=catalog,
            durable=options.durable,
            node_local=options.remote is not None,
        )
    core = EngineCore(
        Parts(writer, catalog, coordinator, tier),
        max_pending=options.max_pending,
        unloadable=options.unloadable,
        start_timeout=options.start_timeout,
        close_timeout=options.close_timeout,
        commit_timeout=options.commit_timeout,
        staging_bytes=options.staging_bytes,
    )
    return Assembly(core, lambda signals: PreemptionNotice(signals, rendezvous))


def _tier(options: EngineOptions, rendezvous: Rendezvous | None) -> Tier:
    """What stands behind the directory: nothing, or the remote tier at ``remote``."""
    if options.remote is None:
        return LocalTier(options.directory)
    url = options.remote
    config = UploaderConfig(
        url, dict(options.storage_options or {}), backoff=options.upload_backoff
    )
    uploader = Uploader(options.directory, config, redact_url(url), options.close_timeout)
    return RemoteTier(
        uploader,
        retention=KeepLast(options.keep_last),
        start_timeout=options.start_timeout,
        timeout=options.upload_timeout,
        early=options.early_uploads,
        spread=RankUploads(rendezvous) if rendezvous is not None else None,
    )
