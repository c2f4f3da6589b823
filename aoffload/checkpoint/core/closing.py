"""What a closing engine does with the tags it finds in flight, and what it says about them.

:meth:`.engine.EngineCore.close` waits for the commits requested (``commit()``,
``commit_soon()``), at most ``commit_timeout`` seconds in all (:func:`wait_commits`); a
commit still running then is abandoned and raised as such once everything is released
(:func:`abandoned`). Every tag staged and never committed is discarded and named at
WARNING (:func:`say_discarded`); the peers of a distributed rank learn why it leaves work
undone (:func:`unfinished`). Nothing is discarded without a word.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any

from ..._errors import CheckpointError
from ..format import layout

if TYPE_CHECKING:
    from .tags import OpenTag, Tags

__all__ = ["abandoned", "say_discarded", "unfinished", "wait_commits"]

logger = logging.getLogger(__name__)

Late = set[concurrent.futures.Future[Any]]


def wait_commits(open_tags: list[OpenTag], tags: Tags, timeout: float) -> Late:
    """Wait for the commits of ``open_tags``, at most ``timeout`` s in all; those still
    running (logged at WARNING, naming their tags). Their failure, which the writer's stop
    brings, is :func:`abandoned`'s to report, not the engine's next call's."""
    commits = [t.commit for t in open_tags if t.commit is not None]
    _, late = concurrent.futures.wait(commits, timeout=timeout)
    for future in late:
        tags.commit_seen(future)
    if late:
        logger.warning(
            "closing with the commit of %s still running after commit_timeout=%s s; "
            "it is abandoned (latest is left as it is)",
            ", ".join(repr(t.tag) for t in open_tags if t.commit in late),
            timeout,
        )
    return late


def say_discarded(open_tags: list[OpenTag]) -> None:
    """Name at WARNING each tag of ``open_tags`` staged and never committed: discarded."""
    for open_tag in open_tags:
        if open_tag.commit is None and open_tag.files:
            logger.warning(
                "checkpoint %r was saved but never committed; discarded (commit it, or "
                "commit_soon() it, before the engine closes)",
                open_tag.tag,
            )


def unfinished(open_tags: list[OpenTag], late: Late, failure: str | None) -> str | None:
    """Why this rank leaves work undone (for the peers), or ``None``."""
    saved = [t.tag for t in open_tags if t.commit is None and t.files]
    if failure is not None:
        return failure
    if saved:
        return f"checkpoint(s) {saved} saved but never committed"
    if late:
        return f"{len(late)} commit(s) still running after commit_timeout"
    return None


def abandoned(
    open_tags: list[OpenTag], late: Late, timeout: float, latest: str | None
) -> CheckpointError | None:
    """The error that names the commits :func:`wait_commits` gave up on, or ``None``."""
    if not late:
        return None
    tags = [t.tag for t in open_tags if t.commit in late]
    return CheckpointError(
        f"checkpoint(s) {tags} were not committed within commit_timeout={timeout} s and "
        f"were abandoned; {layout.LATEST!r} still names {latest!r}. Raise commit_timeout "
        "if the storage is that slow"
    )
