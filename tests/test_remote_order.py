"""The remote tier publishes each tag in order: its files, then its manifest, then ``latest``.

A reader of the remote tier must never see a manifest whose files are not all there, nor a
``latest`` naming a tag whose manifest is not: so every file of a tag is whole before its
manifest is written, and the manifest is whole before ``latest`` names the tag. The remote
tier here is an fsspec filesystem that journals each write's start and end, in the order
they happen, from every uploader process (tests/_recording_fs.py); the order is read from
the journal, not from a watcher's lucky timing. On one rank and on two.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ._ranks import MANIFEST, run_ranks
from ._recording_fs import read_journal

STEPS = 4
_DIST = """Metadata-Version: 2.1
Name: aoffload-test-recording-fs
Version: 0
"""
_ENTRY_POINTS = """[fsspec.specs]
recording = tests._recording_fs:RecordingFileSystem
"""


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on ``sys.path`` holding a distribution that registers ``recording://`` with
    fsspec; the ranks (and their engines' workers) inherit this process's ``sys.path``."""
    folder = tmp_path / "site"
    info = folder / "aoffload_test_recording_fs-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(_DIST)
    (info / "entry_points.txt").write_text(_ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(folder))
    return tmp_path / "remote"


@pytest.mark.parametrize("world", [1, 2])
def test_files_then_manifest_then_latest_for_every_tag(
    tmp_path: Path, recording: Path, world: int
) -> None:
    journal = tmp_path / "journal"
    url = f"recording://{recording}"
    outcomes = run_ranks(
        world,
        "tests._order_scenarios:publish",
        tmp_path / "ranks",
        timeout=180,
        url=url,
        journal=str(journal),
        steps=STEPS,
    )
    for outcome in outcomes:
        assert outcome.check() == {"latest": f"step-{STEPS}"}
    events = read_journal(str(journal))
    where = {(event, path): index for index, (event, path) in enumerate(events)}
    assert len(where) == len(events), "a write was journalled twice"
    root = re.escape(str(recording))
    # nothing but files, manifests and `latest` is written (and, by each rank's start, the
    # probe object it deletes at once: the tier can be written)
    probes = [path for _, path in events if re.fullmatch(rf"{root}/\.aoffload-probe-\w+", path)]
    assert len(probes) == 2 * world, probes  # its start and end, once per rank
    events = [(event, path) for event, path in events if path not in probes]
    for _, path in events:
        assert re.fullmatch(rf"{root}/(latest=step-\d|step-\d/\S+)", path), path
    named = [path.rsplit("=", 1)[1] for event, path in events if event == "start" and "=" in path]
    assert named == [f"step-{step}" for step in range(1, STEPS + 1)], named
    for step in range(1, STEPS + 1):
        tag = f"{recording}/step-{step}"
        files = [f"{tag}/{part}-{rank}.pt" for rank in range(world) for part in ("a", "b")]
        manifest = f"{tag}/{MANIFEST}"
        latest = f"{recording}/latest=step-{step}"
        for path in (*files, manifest, latest):
            assert ("start", path) in where, f"{path} was never written: {events}"
            assert where["start", path] < where["end", path]
        last_file = max(where["end", path] for path in files)
        assert last_file < where["start", manifest], f"step-{step}: manifest before a file"
        assert where["end", manifest] < where["start", latest], f"step-{step}: latest too soon"
