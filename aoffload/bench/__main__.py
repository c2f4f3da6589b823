"""Command line of the benchmark: ``python -m aoffload.bench [section] [options]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from pathlib import Path

from ._common import Report, machine, progress, render

SMOKE_GIB = 1 / 16
"""--smoke's state: one 64 MiB tensor, the checkpoint section's smallest."""

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


def main(argv: list[str] | None = None) -> int:
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
        help="checkpoint state size in GiB (default 1; 0.25 with --quick; 1/16 with --smoke)",
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
            "--quick, smaller still: the least that runs every section and every system end "
            "to end (figures of n >= 3 keep 3 samples), for the test suite; its figures are "
            "no measurement of anything"
        ),
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the checkpoint state and offload_adam's real model live: cpu (default) or cuda",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory for checkpoint files (default: a temporary one)",
    )
    args = parser.parse_args(argv)
    args.quick = args.quick or args.smoke
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    default_gib = SMOKE_GIB if args.smoke else 0.25 if args.quick else 1.0
    size_gib = args.size_gib if args.size_gib is not None else default_gib
    unknown = set(args.section) - {*SECTIONS, "all"}
    if unknown:
        parser.error(f"unknown section {sorted(unknown)}; choose from {', '.join(SECTIONS)}, all")
    chosen = args.section or ["all"]
    sections = SECTIONS if "all" in chosen else tuple(dict.fromkeys(chosen))
    report = Report()
    started = time.perf_counter()
    for section in sections:
        try:
            _run_section(section, report, args, size_gib)
        except Exception as exc:  # noqa: BLE001 - a section that raised is a failure, reported
            traceback.print_exc()
            report.fail(section, "the whole section", exc)
    elapsed = time.perf_counter() - started
    progress(f"done in {elapsed:.0f} s")
    report.notes.append(
        "medians of repetitions (n >= 3, min - max beside) after one warm-up run that is "
        "excluded; a figure of fewer samples is labelled as such; ratios are between figures "
        "measured in this run"
    )
    print(render(report))
    if args.json is not None:
        payload = {
            "command": [sys.executable, "-m", "aoffload.bench", *(argv or sys.argv[1:])],
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": elapsed,
            "machine": machine(),
            "options": {
                "sections": list(sections),
                "quick": args.quick,
                "smoke": args.smoke,
                "size_gib": size_gib,
                "device": args.device,
            },
            "figures": [f.as_json() for f in report.figures],
            "ratios": [vars(r) for r in report.ratios],
            "tables": [vars(t) for t in report.tables],
            "skipped": [vars(s) for s in report.skipped],
            "failed": [vars(f) for f in report.failures],
            "notes": report.notes,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        progress(f"wrote {args.json}")
    if report.failures:
        failed = "; ".join(f"{f.section} / {f.system}" for f in report.failures)
        print(f"aoffload.bench: {len(report.failures)} failed: {failed}", file=sys.stderr)
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
