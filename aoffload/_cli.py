"""``python -m aoffload`` (the ``aoffload`` console script): look after checkpoint directories.

The commands read the directory with :mod:`aoffload.checkpoint.format.inspect` (a remote tier's
URL, ``s3://bucket/run``, with :mod:`aoffload.checkpoint.remote.inspect`); this module
parses arguments, prints, and maps outcomes to the exit codes below.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TextIO

from ._errors import CheckpointError
from .checkpoint.format import inspect as _inspect

__all__ = ["EXIT_BUSY", "EXIT_DAMAGED", "EXIT_OK", "EXIT_USAGE", "main"]

EXIT_OK = 0
"""Success; for ``verify``: every file matches its manifest."""
EXIT_DAMAGED = 1
"""``verify``: a file is corrupt or missing, or a manifest is unreadable; ``inspect``: a
file does not match its manifest or could not be loaded, or the manifest is unreadable."""
EXIT_USAGE = 2
"""Bad arguments, no such directory, not a checkpoint directory, no such tag, or a remote
tier that cannot be reached or holds no published checkpoint."""
EXIT_BUSY = 3
"""``clean``: a live engine holds the directory; nothing was removed."""

PROGRESS_BYTES = 512 << 20
"""``verify`` shows a progress bar (on a terminal, with tqdm installed) from this many bytes."""

_EPILOG = f"""\
exit codes:
  {EXIT_OK}  success (verify: every file matches its manifest)
  {EXIT_DAMAGED}  verify: a file is corrupt or missing or a manifest unreadable;
     inspect: a file is corrupt or could not be loaded, or the manifest is unreadable
  {EXIT_USAGE}  bad arguments, no such directory or tag, not a checkpoint directory,
     a remote tier that cannot be reached or holds no published checkpoint
  {EXIT_BUSY}  clean: a live engine holds the directory (DIR/.aoffload.lock); nothing removed
"""


def _say(stream: TextIO, line: str) -> None:
    """One line of the command's output (the command's interface, not a diagnostic)."""
    stream.write(line + "\n")


def _size(nbytes: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while nbytes >= 1024 and index < len(units) - 1:
        nbytes /= 1024
        index += 1
    return f"{nbytes:.0f} B" if index == 0 else f"{nbytes:.1f} {units[index]}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


METADATA_WIDTH = 60
"""``ls`` shows each tag's metadata as compact JSON cut to this many characters."""


def _metadata(metadata: dict[str, Any], width: int | None = METADATA_WIDTH) -> str:
    text = json.dumps(metadata, separators=(", ", ": "), ensure_ascii=False)
    if width is not None and len(text) > width:
        return text[: width - 3] + "..."
    return text


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


# -- commands ------------------------------------------------------------------------------


async def _source(location: str, out: TextIO) -> tuple[Any, Any]:
    """What reads ``location`` and how it is named: a remote tier's URL, or a checkpoint
    directory (:func:`~.checkpoint.format.inspect.locate`: a Lightning folder's is the
    ``.aoffload/`` inside it, which is said). Raises :class:`CheckpointError` for a
    directory that is not a checkpoint directory."""
    if "://" in location:
        from .checkpoint.remote import inspect as _remote_inspect

        return _remote_inspect, location
    directory, nested = await asyncio.to_thread(_inspect.locate, Path(location))
    if nested:
        _say(out, f"{location}: checkpoints of aoffload's Lightning plugin, kept in {directory}")
    return _inspect, directory


async def _ls(args: argparse.Namespace, out: TextIO) -> int:
    reader, directory = await _source(args.directory, out)
    infos, latest = await reader.list_tags(directory)
    if not infos:
        _say(out, f"{directory}: no committed checkpoints")
    else:
        width = max(len(info.tag) for info in infos) + 2
        shown = any(info.metadata for info in infos)
        header = f"{'TAG':<{width}}  {'FILES':>5}  {'BYTES':>10}  {'AGE':<8}"
        _say(out, (header + "  METADATA" if shown else header).rstrip())
        for info in infos:
            mark = " *" if info.tag == latest else ""
            if info.error is not None:
                _say(out, f"{info.tag + mark:<{width}}  {info.error}")
                continue
            row = f"{len(info.files):>5}  {_size(info.bytes):>10}  {_age(info.age):<8}"
            if info.metadata:
                row += "  " + _metadata(info.metadata)
            _say(out, f"{info.tag + mark:<{width}}  {row}".rstrip())
        _say(out, f"* latest: {latest}")
    stale = await asyncio.to_thread(reader.leftovers, directory)
    if stale:
        total = sum(size for _, size in stale)
        _say(
            out,
            f"{_count(len(stale), 'leftover')} of interrupted runs ({_size(total)}); "
            f"`aoffload clean {directory}` removes them",
        )
    return EXIT_OK


def _progress_bar(total: int, enabled: bool) -> Any:
    """A tqdm bar over ``total`` bytes, or ``None`` (no tqdm, not a terminal, too small)."""
    if not enabled or total < PROGRESS_BYTES or not sys.stderr.isatty():
        return None
    if importlib.util.find_spec("tqdm") is None:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify")


async def _verify(args: argparse.Namespace, out: TextIO) -> int:
    reader, directory = await _source(args.directory, out)
    infos = await reader.resolve_tags(directory, args.tag, args.all)
    bar = _progress_bar(sum(info.bytes for info in infos), args.progress)
    try:
        checks = await reader.verify_tags(directory, infos, bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    failed = [check for check in checks if check.error is not None]
    for info in infos:
        mine = [check for check in checks if check.tag == info.tag]
        bad = [check for check in mine if check.error is not None]
        verdict = f"{len(bad)} FAILED" if bad else "ok"
        _say(out, f"{info.tag}: {len(mine)} files, {_size(info.bytes)}: {verdict}")
        for check in bad:
            _say(out, f"  FAILED {check.tag}/{check.name}: {check.error}")
    if failed:
        _say(out, f"{len(failed)} of {len(checks)} files failed verification")
        return EXIT_DAMAGED
    return EXIT_OK


async def _inspect_cmd(args: argparse.Namespace, out: TextIO) -> int:
    reader, directory = await _source(args.directory, out)
    [info] = await reader.resolve_tags(directory, args.tag, False)
    if info.error is not None:
        _say(out, f"{info.tag}: {info.error}")
        return EXIT_DAMAGED
    status = EXIT_OK
    _say(out, f"{info.tag}: {len(info.files)} files, {_size(info.bytes)}")
    if info.metadata:
        _say(out, f"metadata: {_metadata(info.metadata, None)}")
    for summary in await reader.inspect_tag(directory, info, weights_only=args.weights_only):
        size = _size(int(info.files[summary.name]["bytes"]))
        _say(out, f"{info.tag}/{summary.name} ({size} on disk)")
        if summary.error is not None:
            _say(out, f"  ERROR {summary.error}")
            status = EXIT_DAMAGED
            continue
        dtypes = ", ".join(f"{dtype} x{n}" for dtype, n in sorted(summary.dtypes.items()))
        suffix = f" ({dtypes})" if dtypes else ""
        _say(out, f"  tensors: {summary.tensors}, {_size(summary.tensor_bytes)}{suffix}")
        if summary.keys:
            keys = ", ".join(f"{key} ({kind})" for key, kind in summary.keys.items())
            _say(out, f"  keys: {keys}")
        else:
            _say(out, f"  top level: {summary.top}")
    return status


async def _clean(args: argparse.Namespace, out: TextIO) -> int:
    if "://" in args.directory:
        raise CheckpointError("clean works on a local directory, not on a remote tier's URL")
    _, directory = await _source(args.directory, out)
    removed = await asyncio.to_thread(_inspect.clean, directory, dry_run=args.dry_run)
    if removed is None:
        _say(
            sys.stderr,
            f"aoffload: {directory} is in use by a live checkpoint engine (it holds "
            f"{directory}/.aoffload.lock); nothing was removed. Stop the run first.",
        )
        return EXIT_BUSY
    verb = "would remove" if args.dry_run else "removed"
    for path, size in removed:
        _say(out, f"{verb} {path} ({_size(size)})")
    total = sum(size for _, size in removed)
    _say(out, f"{verb} {_count(len(removed), 'leftover')}, {_size(total)}")
    return EXIT_OK


def _local_s3(args: argparse.Namespace, out: TextIO) -> int:
    """Serve moto's S3 server on loopback until Ctrl-C (or SIGTERM); say how to reach it."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
        _say(
            sys.stderr,
            "aoffload: local-s3 needs moto's server and s3fs: pip install 'moto[server]' s3fs",
        )
        return EXIT_USAGE
    from ._moto import S3Endpoint

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)  # the server stops with this command
    try:
        with S3Endpoint.start(port=args.port) as endpoint:
            endpoint.bucket(args.bucket)
            environ = " ".join(f"{k}={v}" for k, v in endpoint.environ.items())
            for line in (
                f"A local S3 endpoint (moto's server) listens on {endpoint.url}: loopback "
                "only, fake credentials, in memory (all is lost when it stops).",
                f"Bucket {args.bucket!r} is created. For a CheckpointEngine:",
                f'  remote="s3://{args.bucket}/run"',
                f"  storage_options={json.dumps(endpoint.storage_options)}",
                "For `aoffload ls|verify|inspect s3://...` and other processes, the environment:",
                f"  export {environ}",
                "Ctrl-C stops it.",
            ):
                _say(out, line)
            out.flush()
            endpoint.process.wait()  # until Ctrl-C or SIGTERM (or the server's own end)
        _say(sys.stderr, "aoffload: the S3 server stopped on its own")
        return EXIT_DAMAGED
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- arguments -----------------------------------------------------------------------------

_Command = Callable[[argparse.Namespace, TextIO], Coroutine[Any, Any, int]]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aoffload",
        description="List, verify, inspect and clean aoffload checkpoint directories.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: _Command, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help,
            description=help,
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument(
            "directory", metavar="DIR", help="the checkpoint directory, or a remote tier's URL"
        )
        sub.set_defaults(run=run)
        return sub

    command("ls", _ls, "list committed tags (latest marked *): files, bytes, age")
    verify = command("verify", _verify, "check every file against its manifest")
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--tag", help="the tag to verify (default: latest)")
    which.add_argument("--all", action="store_true", help="verify every committed tag")
    verify.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar (shown on a terminal for large checkpoints when tqdm is installed)",
    )
    inspect = command(
        "inspect",
        _inspect_cmd,
        "verify each file, then show its tensors and top-level keys (weights_only=True)",
    )
    inspect.add_argument("--tag", help="the tag to inspect (default: latest)")
    inspect.add_argument(
        "--weights-only",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="load with torch.load(weights_only=True), the default; --no-weights-only "
        "loads any pickled object: only for files you trust (it can run arbitrary code)",
    )
    clean = command(
        "clean", _clean, "remove leftovers of dead runs (.tmp-*, .trash-*); never a live run's"
    )
    clean.add_argument("--dry-run", action="store_true", help="list what would be removed")
    help = (
        "serve a local S3 endpoint (moto's server, loopback, fake credentials) to try the "
        "remote tier; prints the remote= and storage_options to use"
    )
    local = commands.add_parser("local-s3", help=help, description=help)
    local.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    local.add_argument("--bucket", default="aoffload-local", help="the bucket to create")
    local.set_defaults(run=None)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "local-s3":
        return _local_s3(args, out or sys.stdout)
    try:
        status: int = asyncio.run(args.run(args, out or sys.stdout))
    except CheckpointError as exc:
        _say(sys.stderr, f"aoffload: {exc}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return status
