"""Command line of the benchmark: ``python -m aoffload.bench [section] [options]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ._common import Report, machine, progress, render

SMOKE_GIB = 1 / 128
"""--smoke's state: one 8 MiB tensor (a smoke run checks that everything runs, not speed)."""

SECTIONS = (
    "bridge",
    "checkpoint",
    "background",
    "optimizer",
    "overlap",
    "looplag",
    "distributed",
    "offload_adam",
    "remote",
    "preemption",
    "dcp",
    "memory",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m aoffload.bench",
        description="Measure aoffload against the systems people would use instead, in one run.",
    )
    parser.add_argument(
        "section",
        nargs="*",
        help=f"what to measure: {', '.join(SECTIONS)} or all (the default)",
    )
    parser.add_argument(
        "--size-gib",
        type=float,
        default=None,
        help="checkpoint state size in GiB (default 1; 0.25 with --quick; 1/128 with --smoke)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repetitions and a smaller state (about 5 minutes on 2 cores)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=(
            "the least that runs every section and every system end to end: tiny states, one "
            "repetition (figures are single samples, labelled so), for the test suite; its "
            "figures are no measurement of anything"
        ),
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the checkpoint state and offload_adam's real model live: cpu (default) or cuda",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument(
        "--json-dir",
        type=Path,
        default=None,
        help="also write one file per section, DIR/bench-SECTION.json, each with its own "
        "command, date, duration and machine",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="DIR",
        help="write PNG charts of the run (or of --from's files) into DIR (needs matplotlib: "
        "pip install aoffload[bench])",
    )
    parser.add_argument(
        "--from",
        dest="sources",
        type=Path,
        action="append",
        default=None,
        metavar="FILE",
        help="with --plot: chart these JSON reports (repeatable) instead of running anything",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory for checkpoint files (default: a temporary one)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.sources:
        if args.plot is None:
            parser.error("--from charts existing reports: give --plot DIR too")
        if args.section:
            parser.error("--from runs nothing: name no section")
        return _plot(args.plot, [json.loads(p.read_text()) for p in args.sources])
    args.quick = args.quick or args.smoke

    default_gib = SMOKE_GIB if args.smoke else 0.25 if args.quick else 1.0
    size_gib = args.size_gib if args.size_gib is not None else default_gib
    unknown = set(args.section) - {*SECTIONS, "all"}
    if unknown:
        parser.error(f"unknown section {sorted(unknown)}; choose from {', '.join(SECTIONS)}, all")
    chosen = args.section or ["all"]
    sections = SECTIONS if "all" in chosen else tuple(dict.fromkeys(chosen))
    command = [sys.executable, "-m", "aoffload.bench", *(sys.argv[1:] if argv is None else argv)]
    options = {
        "sections": list(sections),
        "quick": args.quick,
        "smoke": args.smoke,
        "size_gib": size_gib,
        "device": args.device,
    }
    report = Report()
    facts = machine()
    runs: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for section in sections:
        marks = report.marks()
        date = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        section_started = time.perf_counter()
        try:
            _run_section(section, report, args, size_gib)
        except Exception as exc:  # noqa: BLE001 - a section that raised is a failure, reported
            traceback.print_exc()
            report.fail(section, "the whole section", exc)
        seconds = time.perf_counter() - section_started
        progress(f"{section} took {seconds:.0f} s")
        runs[section] = {
            "date": date,
            "seconds": seconds,
            "rerun": _rerun(section, args, size_gib),
            "marks": (marks, report.marks()),
        }
    elapsed = time.perf_counter() - started
    progress(f"done in {elapsed:.0f} s")
    report.notes.append(
        "medians of repetitions (n >= 3, min - max and the worst sample beside) after one "
        "warm-up run that is excluded; a figure of fewer samples is labelled as such; ratios "
        "are between figures measured in this run"
    )
    print(render(report))
    payload = _payload(report, report.marks(zero=True), report.marks())
    payload.update(
        command=command,
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        seconds=elapsed,
        machine=facts,
        options=options,
        sections={
            name: {k: v for k, v in run.items() if k != "marks"} for name, run in runs.items()
        },
    )
    if args.json is not None:
        args.json.write_text(json.dumps(payload, indent=2))
        progress(f"wrote {args.json}")
    if args.json_dir is not None:
        args.json_dir.mkdir(parents=True, exist_ok=True)
        for name, run in runs.items():
            one = _payload(report, *run["marks"])
            one.update(
                command=command,
                rerun=run["rerun"],
                date=run["date"],
                seconds=run["seconds"],
                machine=facts,
                options={**options, "sections": [name]},
            )
            path = args.json_dir / f"bench-{name}.json"
            path.write_text(json.dumps(one, indent=2))
            progress(f"wrote {path}")
    code = 0
    if args.plot is not None:
        code = _plot(args.plot, [payload])
    if report.failures:
        failed = "; ".join(f"{f.section} / {f.system}" for f in report.failures)
        print(f"aoffload.bench: {len(report.failures)} failed: {failed}", file=sys.stderr)
        return 1
    return code


def _payload(report: Report, start: dict[str, int], end: dict[str, int]) -> dict[str, Any]:
    """The report's entries between two :meth:`Report.marks`, as JSON."""

    def part(name: str) -> list[Any]:
        return list(getattr(report, name)[start[name] : end[name]])

    return {
        "figures": [f.as_json() for f in part("figures")],
        "ratios": [vars(r) for r in part("ratios")],
        "tables": [vars(t) for t in part("tables")],
        "skipped": [vars(s) for s in part("skipped")],
        "failed": [vars(f) for f in part("failures")],
        "notes": part("notes"),
    }


def _rerun(section: str, args: argparse.Namespace, size_gib: float) -> list[str]:
    """The command that measures this section alone, as it was measured here."""
    command = ["python", "-m", "aoffload.bench", section]
    if args.smoke:
        command.append("--smoke")
    elif args.quick:
        command.append("--quick")
    if args.size_gib is not None:
        command += ["--size-gib", f"{size_gib:g}"]
    if args.device != "cpu":
        command += ["--device", args.device]
    return [*command, "--json", f"bench-{section}.json"]


def _plot(directory: Path, payloads: list[dict[str, Any]]) -> int:
    try:
        from ._plot import plot
    except ImportError as exc:
        print(
            f"aoffload.bench: --plot needs matplotlib ({exc}); pip install aoffload[bench]",
            file=sys.stderr,
        )
        return 2
    written = plot(payloads, directory)
    for path in written:
        progress(f"wrote {path}")
    if not written:
        print("aoffload.bench: nothing to chart in these reports", file=sys.stderr)
        return 1
    return 0


def _run_section(section: str, report: Report, args: argparse.Namespace, size_gib: float) -> None:
    if section == "bridge":
        from . import _bridge

        _bridge.run(report, quick=args.quick, smoke=args.smoke)
    elif section == "checkpoint":
        from . import _checkpoint

        _checkpoint.run(
            report,
            quick=args.quick,
            smoke=args.smoke,
            size_gib=size_gib,
            directory=args.dir,
            device=args.device,
        )
    elif section == "background":
        from . import _background

        _background.run(
            report, quick=args.quick, smoke=args.smoke, size_gib=size_gib, directory=args.dir
        )
    elif section == "optimizer":
        from . import _optimizer, _optimizer_state

        _optimizer.run(report, quick=args.quick, smoke=args.smoke)
        _optimizer_state.run(report, quick=args.quick, smoke=args.smoke)
    elif section == "distributed":
        from . import _distributed

        _distributed.run(report, quick=args.quick, smoke=args.smoke)
    elif section == "offload_adam":
        from . import _offload_adam

        _offload_adam.run(report, quick=args.quick, smoke=args.smoke, device=args.device)
    elif section == "remote":
        from . import _remote

        _remote.run(report, quick=args.quick, smoke=args.smoke)
    elif section == "preemption":
        from . import _preemption

        _preemption.run(
            report, quick=args.quick, smoke=args.smoke, size_gib=size_gib, directory=args.dir
        )
    elif section == "dcp":
        from . import _dcp

        _dcp.run(report, quick=args.quick, smoke=args.smoke, size_gib=size_gib, directory=args.dir)
    elif section == "memory":
        from . import _memory

        _memory.run(report, quick=args.quick, smoke=args.smoke, directory=args.dir)
    elif section == "looplag":
        from . import _looplag

        _looplag.run(
            report, quick=args.quick, smoke=args.smoke, size_gib=size_gib, directory=args.dir
        )
    else:
        from . import _overlap

        _overlap.run(report, quick=args.quick, smoke=args.smoke)


if __name__ == "__main__":
    raise SystemExit(main())
