"""Command line of the benchmark: ``python -m aoffload.bench [section] [options]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from ._common import Report, machine, progress, render

SECTIONS = ("bridge", "checkpoint", "optimizer", "distributed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aoffload.bench",
        description="Measure aoffload against the systems people would use instead, in one run.",
    )
    parser.add_argument("section", nargs="?", default="all", choices=(*SECTIONS, "all"))
    parser.add_argument(
        "--size-gib",
        type=float,
        default=None,
        help="checkpoint state size in GiB (default 1; 0.25 with --quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer repetitions and a smaller state: under a minute"
    )
    parser.add_argument(
        "--device", default="cpu", help="where the checkpoint state lives: cpu (default) or cuda"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory for checkpoint files (default: a temporary one)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    size_gib = args.size_gib if args.size_gib is not None else (0.25 if args.quick else 1.0)
    sections = SECTIONS if args.section == "all" else (args.section,)
    report = Report()
    started = time.perf_counter()
    for section in sections:
        if section == "bridge":
            from . import _bridge

            _bridge.run(report, quick=args.quick)
        elif section == "checkpoint":
            from . import _checkpoint

            _checkpoint.run(
                report, quick=args.quick, size_gib=size_gib, directory=args.dir, device=args.device
            )
        elif section == "distributed":
            from . import _distributed

            _distributed.run(report, quick=args.quick)
        else:
            from . import _optimizer

            _optimizer.run(report, quick=args.quick)
    elapsed = time.perf_counter() - started
    progress(f"done in {elapsed:.0f} s")
    report.notes.append(
        "medians of repetitions after one warm-up run that is excluded; ratios are between "
        "figures measured in this run"
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
                "size_gib": size_gib,
                "device": args.device,
            },
            "figures": [f.as_json() for f in report.figures],
            "ratios": [vars(r) for r in report.ratios],
            "skipped": [vars(s) for s in report.skipped],
            "notes": report.notes,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
