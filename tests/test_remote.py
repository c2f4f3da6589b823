"""The remote tier on a real S3 endpoint: moto's server on loopback, reached through s3fs.

Uploads, publication order, resume on a fresh machine, a paused and a dead endpoint,
retention on both tiers, credentials, and a loop blocked while the upload goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload._moto import S3Endpoint
from aoffload.checkpoint.format import layout

from ._ranks import complete_tags

FAST_FAIL = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}
"""botocore's own retries off: a dead endpoint fails each attempt at once (ours remain).
(``max_attempts`` counts *retries* in botocore's default mode: ``max_attempts: 1`` left one
retry, after a random wait of up to a second, in every attempt of ours.)"""
FAST_BACKOFF = 0.01
"""Our retries all remain (five attempts), 0.15 s apart in all instead of 7.5 s."""


def state(step: int, rows: int = 64) -> dict[str, torch.Tensor]:
    return {"w": torch.full((rows, 1024), float(step)), "b": torch.arange(4) + step}


def remote_tags(endpoint: S3Endpoint, url: str) -> list[str]:
    objects = endpoint.objects(url)
    return sorted(p.split("/")[0] for p in objects if p.endswith("/" + layout.MANIFEST))


def check_complete(objects: dict[str, bytes]) -> str | None:
    """Raise if ``latest`` names a tag whose manifest or files are missing; that tag."""
    if "latest" not in objects:
        return None
    tag = objects["latest"].decode().strip()
    manifest = json.loads(objects[f"{tag}/{layout.MANIFEST}"])
    for name, entry in manifest["files"].items():
        assert len(objects[f"{tag}/{name}"]) == entry["bytes"], f"partial tag {tag}: {name}"
    return tag


@pytest.fixture
def s3(aoffload_s3_endpoint: S3Endpoint) -> S3Endpoint:
    """The session's endpoint (the one ``aoffload_s3`` is on), to read what was uploaded."""
    return aoffload_s3_endpoint


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Endpoint]:
    """A private moto server with one bucket, for the tests that pause or kill it."""
    with S3Endpoint.start() as private:
        for name, value in private.environ.items():
            monkeypatch.setenv(name, value)
        private.remote = f"s3://{private.bucket()}/run"  # type: ignore[attr-defined]
        yield private


# -- uploads -------------------------------------------------------------------------------


async def test_commit_is_local_then_uploaded_publishes_files_manifest_latest(
    tmp_path: Path, aoffload_s3: str, s3: S3Endpoint
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, remote=aoffload_s3) as engine:
        await engine.save(state(1), "model.pt", tag="step-1")
        await engine.save({"m": torch.ones(8)}, "optim/adam.pt", tag="step-1")
        result = await engine.commit("step-1")
        assert (tmp_path / "step-1" / "model.pt").is_file()  # durable locally first
        assert await engine.uploaded("step-1") == result
        assert await engine.uploaded() == result  # the newest commit
    objects = await asyncio.to_thread(s3.objects, aoffload_s3)
    local = (tmp_path / "step-1" / layout.MANIFEST).read_bytes()
    assert objects["step-1/" + layout.MANIFEST] == local  # the same manifest, no re-hash
    assert objects["latest"] == b"step-1\n"
    for name in ("model.pt", "optim/adam.pt"):
        assert objects[f"step-1/{name}"] == (tmp_path / "step-1" / name).read_bytes()
    assert check_complete(objects) == "step-1"


async def test_uploaded_without_a_remote_tier_or_for_an_unknown_tag_is_invalid(
    tmp_path: Path, aoffload_s3: str
) -> None:
    async with aoffload.CheckpointEngine(tmp_path / "plain") as plain:
        with pytest.raises(aoffload.InvalidStateError, match="no remote tier"):
            await plain.uploaded("x")
    async with aoffload.CheckpointEngine(tmp_path / "r", remote=aoffload_s3) as engine:
        with pytest.raises(aoffload.InvalidStateError, match="committed nothing"):
            await engine.uploaded()
        with pytest.raises(aoffload.InvalidStateError, match="no published checkpoint"):
            await engine.uploaded("never")
    with pytest.raises(ValueError, match="fsspec URL"):
        aoffload.CheckpointEngine(tmp_path, remote="/not/a/url")
    for backoff in (-0.1, 8.5, float("nan")):
        with pytest.raises(ValueError, match="upload_backoff must be between 0 and 8"):
            aoffload.CheckpointEngine(tmp_path, remote=aoffload_s3, upload_backoff=backoff)


async def test_aclose_waits_for_the_uploads_in_flight(
    tmp_path: Path, aoffload_s3: str, s3: S3Endpoint
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, remote=aoffload_s3) as engine:
        for step in (1, 2):
            await engine.save(state(step, rows=512), "model.pt", tag=f"step-{step}")
            engine.commit_soon(f"step-{step}")
    assert await asyncio.to_thread(remote_tags, s3, aoffload_s3) == ["step-1", "step-2"]


@pytest.mark.blocks_loop
async def test_the_upload_goes_on_while_the_loop_is_blocked(
    tmp_path: Path, aoffload_s3: str
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, remote=aoffload_s3) as engine:
        await engine.save(state(1, rows=256), "model.pt", tag="step-1")
        engine.commit_soon("step-1")
        upload = engine._core.uploaded("step-1")
        deadline = time.monotonic() + 60
        while not upload.done() and time.monotonic() < deadline:
            time.sleep(0.05)  # noqa: ASYNC251 - a synchronous training step: the loop never turns
        assert upload.done(), "the upload waited for the event loop"
        assert upload.result().tag == "step-1"


# -- resume anywhere -----------------------------------------------------------------------


async def test_a_fresh_machine_resumes_from_the_remote_tier(
    tmp_path: Path, aoffload_s3: str, s3: S3Endpoint
) -> None:
    async with aoffload.CheckpointEngine(tmp_path / "a", remote=aoffload_s3) as engine:
        for step in (1, 2):
            await engine.save(state(step), "model.pt", tag=f"step-{step}")
            await engine.save({"step": step}, "meta.pt", tag=f"step-{step}")
            await engine.commit(f"step-{step}", metadata={"step": step, "loss": 1.0 / step})
        await engine.uploaded()
    fresh = tmp_path / "b"
    async with aoffload.CheckpointEngine(fresh, remote=aoffload_s3) as engine:
        assert engine.tags() == ["step-1", "step-2"]
        assert engine.latest() == "step-2"
        assert engine.metadata() == {"step": 2, "loss": 0.5}  # from the remote manifest
        assert engine.metadata("step-1") == {"step": 1, "loss": 1.0}
        loaded = await engine.load("model.pt")
        assert torch.equal(loaded["w"], state(2)["w"])
        older = await engine.load("model.pt", tag="step-1")
        assert torch.equal(older["b"], state(1)["b"])
        cached = fresh / ".remote-cache" / "step-2" / "model.pt"
        assert cached.is_file()
        before = cached.stat().st_mtime_ns
        await engine.load("model.pt")  # from the cache: not downloaded again
        assert cached.stat().st_mtime_ns == before
        # a new tag continues the sequence of the remote tier
        await engine.save(state(3), "model.pt", tag="step-3")
        await engine.commit("step-3")
        await engine.uploaded("step-3")
        assert engine.tags() == ["step-1", "step-2", "step-3"]
    restarted = await asyncio.to_thread(remote_tags, s3, aoffload_s3)
    assert restarted == ["step-1", "step-2", "step-3"]
    found = await aoffload.load_checkpoint(aoffload_s3, "model.pt")
    assert torch.equal(found["w"], state(3)["w"])
    found = await aoffload.load_checkpoint(aoffload_s3, "meta.pt", tag="step-1")
    assert found == {"step": 1}
    assert await aoffload.load_metadata(aoffload_s3, "step-2") == {"step": 2, "loss": 0.5}
    assert await aoffload.load_metadata(aoffload_s3) == {}  # step-3 was committed without
    with pytest.raises(aoffload.CheckpointError, match="no published checkpoint 'step-9'"):
        await aoffload.load_metadata(aoffload_s3, "step-9")


async def test_a_corrupt_remote_file_is_never_cached_nor_loaded(
    tmp_path: Path, aoffload_s3: str, s3: S3Endpoint
) -> None:
    async with aoffload.CheckpointEngine(tmp_path / "a", remote=aoffload_s3) as engine:
        await engine.save(state(1), "model.pt", tag="step-1")
        await engine.commit("step-1")
        await engine.uploaded("step-1")
    path = aoffload_s3 + "/step-1/model.pt"
    data = bytearray(await asyncio.to_thread(s3.get, path))
    data[len(data) // 2] ^= 0xFF  # one flipped bit, same size
    await asyncio.to_thread(s3.put, path, bytes(data))
    async with aoffload.CheckpointEngine(tmp_path / "b", remote=aoffload_s3) as engine:
        with pytest.raises(aoffload.CorruptCheckpointError, match="does not match the manifest"):
            await engine.load("model.pt")
    assert not list((tmp_path / "b").rglob("model.pt*"))


# -- a paused and a dead endpoint ----------------------------------------------------------


def _snapshot(endpoint: S3Endpoint, url: str) -> dict[str, bytes]:
    """Every object under ``url``, with ``latest`` as read *before* the listing: whatever it
    names was complete by then. (Read after the listing, it could name a tag published in
    between, whose files the listing predates.)"""
    try:
        latest: bytes | None = endpoint.get(f"{url}/{layout.LATEST}")
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
        latest = None
    objects = endpoint.objects(url)
    objects.pop(layout.LATEST, None)
    if latest is not None:
        objects[layout.LATEST] = latest
    return objects


def _watch(endpoint: S3Endpoint, url: str, stop: threading.Event, seen: list[str | None]) -> None:
    """Read the remote tier over and over; fail (record the error) on any partial tag."""
    while not stop.is_set():
        try:
            seen.append(check_complete(_snapshot(endpoint, url)))
        except (AssertionError, KeyError) as exc:  # a file or the manifest missing
            seen.append(f"PARTIAL: {exc!r}")
        except OSError as exc:  # a read the paused endpoint timed out or refused
            seen.append(f"ERR {exc!r}")


async def test_a_paused_endpoint_delays_the_upload_and_latest_never_names_a_partial_tag(
    tmp_path: Path, endpoint: S3Endpoint
) -> None:
    url = endpoint.remote  # type: ignore[attr-defined]
    stop, seen = threading.Event(), list[str | None]()
    watcher = threading.Thread(target=_watch, args=(endpoint, url, stop, seen))
    watcher.start()
    try:
        async with aoffload.CheckpointEngine(tmp_path, remote=url) as engine:
            await engine.save(state(1), "model.pt", tag="step-1")
            await engine.commit("step-1")
            await engine.uploaded("step-1")
            big = await asyncio.to_thread(state, 2, 2048)  # built off the loop: 8 MiB
            for name in ("model.pt", "optim.pt"):  # 16 MiB: the pause lands mid-upload
                await engine.save(big, name, tag="step-2")
            await engine.commit("step-2")
            endpoint.pause()
            await asyncio.sleep(3)
            endpoint.resume()
            result = await engine.uploaded("step-2")
            assert result.tag == "step-2"
    finally:
        endpoint.resume()
        stop.set()
        await asyncio.to_thread(watcher.join)
    assert not [s for s in seen if s and s.startswith("PARTIAL")], seen
    assert "step-1" in seen  # the watcher saw the old tag while the new one was uploaded
    assert check_complete(await asyncio.to_thread(endpoint.objects, url)) == "step-2"


async def test_an_endpoint_that_stays_down_fails_the_upload_clearly_and_keeps_the_local_tier(
    tmp_path: Path, endpoint: S3Endpoint
) -> None:
    url = endpoint.remote  # type: ignore[attr-defined]
    async with aoffload.CheckpointEngine(
        tmp_path, remote=url, storage_options=FAST_FAIL, upload_backoff=FAST_BACKOFF
    ) as engine:
        await engine.save(state(1), "model.pt", tag="step-1")
        await engine.commit("step-1")
        await engine.uploaded("step-1")
        await asyncio.to_thread(endpoint.stop)  # it waits for the server's exit
        await engine.save(state(2), "model.pt", tag="step-2")
        result = await engine.commit("step-2")  # durable locally: the remote tier is not waited for
        assert result.tag == "step-2"
        with pytest.raises(aoffload.CheckpointError) as failed:
            await engine.uploaded("step-2")
        message = str(failed.value)
        assert f"'step-2' was not published in {url}" in message
        assert "after 5 attempts" in message
        assert "Could not connect to the endpoint URL" in message
        assert "committed locally" in message
        assert "still names 'step-1'" in message
        # seen through uploaded(): not raised again; the engine goes on
        await engine.save(state(3), "model.pt", tag="step-3")
        await engine.commit("step-3")
        loaded = await engine.load("model.pt", tag="step-2")
        assert torch.equal(loaded["w"], state(2)["w"])
        with pytest.raises(aoffload.CheckpointError, match="'step-3' was not published"):
            await engine.uploaded("step-3")
        # step-4's failure nobody awaits: the engine's next call raises it
        await engine.save(state(4), "model.pt", tag="step-4")
        engine.commit_soon("step-4")
        with contextlib.suppress(aoffload.CheckpointError):
            await asyncio.wrap_future(engine._core.uploaded("step-4"))  # it ended; not seen
        with pytest.raises(aoffload.CheckpointError, match="'step-4' was not published"):
            engine.stage(state(5), "model.pt", tag="step-5")
        await engine.save(state(5), "model.pt", tag="step-5")  # raised once, not again
        await engine.commit("step-5")
        with pytest.raises(aoffload.CheckpointError, match="'step-5' was not published"):
            await engine.aclose()  # the last failure, nobody saw it: aclose raises it
    assert complete_tags(tmp_path) == ["step-1", "step-2", "step-3", "step-4", "step-5"]


async def test_aclose_gives_up_on_an_upload_after_upload_timeout(
    tmp_path: Path, endpoint: S3Endpoint
) -> None:
    url = endpoint.remote  # type: ignore[attr-defined]
    engine = aoffload.CheckpointEngine(tmp_path, remote=url, upload_timeout=2.0)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(endpoint.resume)
        await engine.astart()
        await engine.save(state(1), "model.pt", tag="step-1")
        await engine.commit("step-1")
        endpoint.pause()
        started = time.monotonic()
        with pytest.raises(aoffload.CheckpointError, match=r"upload_timeout=2\.0"):
            await engine.aclose()
        assert 2.0 <= time.monotonic() - started < 2.0 + 3.0  # upload_timeout, and no more
    assert complete_tags(tmp_path) == ["step-1"]


# -- retention and credentials -------------------------------------------------------------


async def test_retention_applies_to_both_tiers_after_the_upload(
    tmp_path: Path, endpoint: S3Endpoint
) -> None:
    url = endpoint.remote  # type: ignore[attr-defined]
    async with aoffload.CheckpointEngine(tmp_path, remote=url, keep_last=1) as engine:
        await engine.save(state(1), "model.pt", tag="step-1")
        await engine.commit("step-1")
        await engine.uploaded("step-1")
        endpoint.pause()  # step-2's upload waits: local retention must not delete it
        await engine.save(state(2), "model.pt", tag="step-2")
        await engine.commit("step-2")
        await engine.save(state(3), "model.pt", tag="step-3")
        await engine.commit("step-3")
        assert (tmp_path / "step-2" / "model.pt").is_file()  # still being uploaded
        assert engine.tags() == ["step-3"]
        endpoint.resume()
        await engine.uploaded("step-3")
        await engine.uploaded("step-2")
    assert complete_tags(tmp_path) == ["step-3"]
    objects = await asyncio.to_thread(endpoint.objects, url)
    assert sorted({p.split("/")[0] for p in objects}) == ["latest", "step-3"]
    assert check_complete(objects) == "step-3"


async def test_a_credential_never_appears_in_a_log_or_an_error(
    tmp_path: Path, endpoint: S3Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    secret, key = "Zx9-very-secret-credential-value", "AKIAAOFFLOADTESTKEY1"
    options = {"key": key, "secret": secret, **FAST_FAIL}
    url = endpoint.remote  # type: ignore[attr-defined]
    caplog.set_level(logging.DEBUG)
    async with aoffload.CheckpointEngine(
        tmp_path, remote=url, storage_options=options, upload_backoff=0.1
    ) as engine:
        await engine.save(state(1), "model.pt", tag="step-1")
        await engine.commit("step-1")
        await engine.uploaded("step-1")  # moto takes any credentials: a real upload
        await asyncio.to_thread(endpoint.stop)  # it waits for the server's exit
        await engine.save(state(2), "model.pt", tag="step-2")
        await engine.commit("step-2")
        with pytest.raises(aoffload.CheckpointError) as failed:
            await engine.uploaded("step-2")
        config = engine._core.tier.uploader.core._process._config
        shown = [str(failed.value), repr(failed.value), repr(config), str(config)]
    logged = [record.getMessage() for record in caplog.records]
    assert any("retry 1 of 4 in 0.1 s" in line for line in logged)  # the worker's logs came
    assert any("retry 4 of 4 in 0.8 s" in line for line in logged)  # upload_backoff, doubled
    for text in shown + logged:
        assert secret not in text, text
        assert key not in text, text


def test_the_command_line_reads_a_remote_tier(
    tmp_path: Path, aoffload_s3: str, s3: S3Endpoint
) -> None:
    async def commit() -> None:
        async with aoffload.CheckpointEngine(tmp_path, remote=aoffload_s3) as engine:
            for step in (1, 2):
                await engine.save(state(step), "model.pt", tag=f"step-{step}")
                await engine.commit(f"step-{step}", metadata={"epoch": step})
            await engine.uploaded()

    def run(*argv: str) -> tuple[int, str]:  # as a user runs it: its own process
        command = [sys.executable, "-m", "aoffload", *argv]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout + done.stderr

    asyncio.run(commit())
    status, out = run("ls", aoffload_s3)
    assert status == 0, out
    assert "step-1" in out
    assert "step-2 *" in out
    assert "* latest: step-2" in out
    assert '{"epoch": 2}' in out  # each tag's metadata, from the remote manifests
    status, out = run("verify", aoffload_s3, "--all")
    assert status == 0, out
    assert "step-2: 1 files" in out
    assert "ok" in out
    status, out = run("inspect", aoffload_s3)
    assert status == 0, out
    assert "tensors: 2" in out
    assert "w (Tensor" in out
    s3.put(aoffload_s3 + "/step-1/model.pt", b"torn")
    status, out = run("verify", aoffload_s3, "--all")
    assert status == 1, out
    assert "FAILED step-1/model.pt" in out
    status, out = run("inspect", aoffload_s3, "--tag", "step-1")  # the download is verified
    assert status == 1, out
    assert "the downloaded file does not match the manifest" in out
    status, out = run("clean", aoffload_s3)
    assert status == 2, out
    assert "local directory" in out


_LANES = """
import concurrent.futures, json, os, sys, threading
from aoffload.checkpoint.remote.worker.store import RemoteStore

url, folder = sys.argv[1], sys.argv[2]
store = RemoteStore(url)
store.scan()  # as an engine's start does: the store's client exists
files = []
for i in range(4):
    path = os.path.join(folder, f"part-{i}.bin")
    with open(path, "wb") as f:
        f.write(bytes([i]) * ((1 << 20) + i))
    files.append(path)
together = threading.Barrier(4)

def send(path, tag):
    together.wait()  # four upload threads at once
    store.put_file(path, tag, os.path.basename(path), os.path.getsize(path))

def send_one(path):
    store.put_file(path, "t3", os.path.basename(path), os.path.getsize(path))

def lanes():
    return sum(t.name.startswith("aoffload-upload-lane") for t in threading.enumerate())

def shared():  # the lanes read the service models the store's session loaded
    loader = getattr(getattr(store.fs, "session", None), "get_component", None)
    return [lane.fs.session.get_component("data_loader") is loader("data_loader")
            for lane in store.lanes._lanes] if loader else []

seen = []
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    for tag in ("t1", "t2"):
        list(pool.map(send, files, [tag] * 4))
        seen.append([store.lanes.count, lanes()])
    seen.append(shared())
    store.lanes.close()
    late = pool.submit(send_one, files[0]).exception()  # refused at once, never waits
seen.append([store.lanes.count, lanes()])
seen.append(type(late).__name__ if late else None)
print(json.dumps(seen))
"""


@pytest.mark.parametrize("remote", ["s3", "file"])
def test_each_upload_thread_sends_through_a_loop_of_its_own(
    tmp_path: Path, aoffload_s3: str, s3: S3Endpoint, remote: str
) -> None:
    # in a process of its own: botocore's models stay out of the test process
    url = aoffload_s3 if remote == "s3" else (tmp_path / "remote").as_uri()
    (tmp_path / "local").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _LANES, url, str(tmp_path / "local")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    if remote == "s3":  # one lane per upload thread, kept for the next tag, stopped by close
        assert seen == [[4, 4], [4, 4], [True] * 4, [0, 0], "CheckpointError"]
        objects = s3.objects(url)
    else:  # file:// has no event loop: no lanes
        assert seen == [[0, 0], [0, 0], [], [0, 0], None]
        root = tmp_path / "remote"
        objects = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*.bin")}
    for tag in ("t1", "t2"):
        for i in range(4):
            assert objects[f"{tag}/part-{i}.bin"] == bytes([i]) * ((1 << 20) + i)
