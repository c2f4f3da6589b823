"""The remote tier fails early: a start that cannot list and write the tier raises at once,
what no retry can fix is never retried, and the command line says so with a non-zero exit.

On real S3 endpoints (moto's server on loopback); the command line runs as a user runs it,
in a process of its own. ``aoffload local-s3`` serves such an endpoint for users.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import aoffload
from aoffload._moto import S3Endpoint

_NO_CREDENTIALS = {
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
    "AWS_CONFIG_FILE": "/nonexistent/config",
    "AWS_EC2_METADATA_DISABLED": "true",  # no instance role to ask for
}
_SECRET = "Zx9-never-shown-secret-value"


def _retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]


def _without_credentials(monkeypatch: pytest.MonkeyPatch, endpoint: S3Endpoint) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.url)
    for name, value in _NO_CREDENTIALS.items():
        monkeypatch.setenv(name, value)


def _cli(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    command = [sys.executable, "-m", "aoffload", *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def denying() -> Iterator[S3Endpoint]:
    """A private moto server that checks every request but the first (the bucket's
    creation) against its IAM users: the fake credentials are denied."""
    with S3Endpoint.start(environ={"INITIAL_NO_AUTH_ACTION_COUNT": "1"}) as private:
        private.remote = f"s3://{private.bucket()}/run"  # type: ignore[attr-defined]
        yield private


# -- start() checks the tier ---------------------------------------------------------------


async def test_start_fails_at_once_for_a_missing_bucket_naming_the_url(
    tmp_path: Path,
    aoffload_s3: str,
    aoffload_s3_endpoint: S3Endpoint,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    url = "s3://aoffload-no-such-bucket/run"
    options = {"key": "AKIAAOFFLOADTESTKEY9", "secret": _SECRET}
    engine = aoffload.CheckpointEngine(tmp_path, remote=url, storage_options=options)
    with pytest.raises(aoffload.CheckpointError) as failed:
        await engine.astart()
    message = str(failed.value)
    assert f"the remote tier {url} cannot be used" in message
    assert "the bucket 'aoffload-no-such-bucket' does not exist" in message
    assert _SECRET not in message
    assert not _retries(caplog)  # permanent: no retry
    assert engine.pid is None


def test_start_without_credentials_fails_at_once(
    tmp_path: Path,
    aoffload_s3: str,
    aoffload_s3_endpoint: S3Endpoint,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    _without_credentials(monkeypatch, aoffload_s3_endpoint)  # the uploader inherits it
    with (
        pytest.raises(aoffload.CheckpointError, match=r"NoCredentialsError.*storage_options"),
        aoffload.CheckpointEngine(tmp_path, remote=aoffload_s3),
    ):
        pass
    assert not _retries(caplog)


def test_start_with_denied_credentials_fails_at_once(
    tmp_path: Path,
    denying: S3Endpoint,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    for name, value in denying.environ.items():
        monkeypatch.setenv(name, value)
    url = denying.remote  # type: ignore[attr-defined]
    with (
        pytest.raises(aoffload.CheckpointError, match=r"cannot be used.*access denied"),
        aoffload.CheckpointEngine(tmp_path, remote=url),
    ):
        pass
    assert not _retries(caplog)


async def test_start_probes_the_tier_and_leaves_nothing_behind(
    tmp_path: Path, aoffload_s3: str, aoffload_s3_endpoint: S3Endpoint
) -> None:
    async with aoffload.CheckpointEngine(tmp_path, remote=aoffload_s3) as engine:
        # the probe object was written, then deleted
        assert await asyncio.to_thread(aoffload_s3_endpoint.objects, aoffload_s3) == {}
        await engine.save({"w": torch.ones(4)}, "m.pt", tag="t")
        await engine.commit("t")
        await engine.uploaded("t")
    assert sorted(await asyncio.to_thread(aoffload_s3_endpoint.objects, aoffload_s3)) == [
        "latest",
        "t/.aoffload-manifest.json",
        "t/m.pt",
    ]


# -- the command line: a non-zero exit for what is not a checkpoint location ---------------


def test_the_command_line_exits_non_zero_for_what_is_not_a_checkpoint_location(
    tmp_path: Path, aoffload_s3: str, aoffload_s3_endpoint: S3Endpoint
) -> None:
    status, out = _cli("ls", "s3://aoffload-no-such-bucket/x")
    assert status == 2, out
    assert "the bucket 'aoffload-no-such-bucket' does not exist" in out
    status, out = _cli("ls", aoffload_s3)  # the bucket exists; nothing under the prefix
    assert status == 2, out
    assert "holds no published checkpoint" in out
    status, out = _cli("verify", aoffload_s3)
    assert status == 2, out
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not a checkpoint")
    for command in ("ls", "verify", "inspect", "clean"):
        status, out = _cli(command, str(tmp_path / "plain"))
        assert status == 2, (command, out)
        assert "is not an aoffload checkpoint directory" in out
    status, out = _cli("ls", str(tmp_path / "missing"))
    assert status == 2, out
    assert "is not a directory" in out
    # a real checkpoint directory with nothing committed yet says so, and succeeds
    with aoffload.CheckpointEngine(tmp_path / "fresh"):
        pass
    status, out = _cli("ls", str(tmp_path / "fresh"))
    assert status == 0, out
    assert "no committed checkpoints" in out


def test_the_command_line_without_credentials_fails_at_once(
    aoffload_s3: str, aoffload_s3_endpoint: S3Endpoint
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=aoffload_s3_endpoint.url, **_NO_CREDENTIALS)
    status, out = _cli("ls", aoffload_s3, env=env)
    assert status == 2, out
    assert "NoCredentialsError" in out
    assert "retry" not in out  # permanent: the first attempt's error, at once


# -- aoffload local-s3 -----------------------------------------------------------------------


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_local_s3_serves_an_endpoint_that_its_storage_options_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("moto")
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in _NO_CREDENTIALS.items():  # only what it prints reaches the endpoint
        monkeypatch.setenv(name, value)
    server = subprocess.Popen(
        [sys.executable, "-m", "aoffload", "local-s3", "--bucket", "trial"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        said: dict[str, str] = {}
        for line in server.stdout:
            key, sep, value = line.strip().partition("=")
            if sep and key in ("remote", "storage_options"):
                said[key] = value
            if line.startswith("Ctrl-C"):
                break
        assert said.keys() == {"remote", "storage_options"}, server.stderr.read()
        remote = json.loads(said["remote"])
        options = json.loads(said["storage_options"])
        assert remote == "s3://trial/run"
        port = int(options["endpoint_url"].rpartition(":")[2])
        with aoffload.CheckpointEngine(tmp_path, remote=remote, storage_options=options) as engine:
            engine.save({"w": torch.ones(4)}, "m.pt", tag="t").result()
            engine.commit("t").result()
            assert engine.uploaded("t").result().tag == "t"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        assert _refused(port)  # moto's server went with it
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for stream in (server.stdout, server.stderr):
            if stream is not None:
                stream.close()
