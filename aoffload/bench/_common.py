"""Shared pieces of the benchmark: repetition statistics, progress, machine facts, output."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


def progress(message: str) -> None:
    """Show what is running now (stderr, so the table on stdout stays clean)."""
    print(f"[aoffload.bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Figure:
    """One measured quantity of one system: the median of ``samples`` with min and max."""

    section: str
    system: str
    metric: str
    unit: str
    samples: list[float]
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(median=self.median, min=min(self.samples), max=max(self.samples))
        return data


@dataclass
class Skipped:
    """An anchor that could not run here, with the reason."""

    section: str
    system: str
    reason: str


@dataclass
class Ratio:
    """``numerator / denominator`` of two figures' medians measured in the same run."""

    section: str
    name: str
    value: float
    numerator: str
    denominator: str


@dataclass
class Report:
    """Everything one run measured."""

    figures: list[Figure] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(
        self,
        section: str,
        system: str,
        metric: str,
        unit: str,
        samples: Iterable[float],
        note: str = "",
    ) -> Figure:
        figure = Figure(section, system, metric, unit, list(samples), note)
        self.figures.append(figure)
        return figure

    def skip(self, section: str, system: str, reason: str) -> None:
        progress(f"skipped {system}: {reason}")
        self.skipped.append(Skipped(section, system, reason))

    def ratio(
        self, section: str, name: str, numerator: Figure | None, denominator: Figure | None
    ) -> None:
        if numerator is None or denominator is None or denominator.median == 0:
            return
        self.ratios.append(
            Ratio(
                section,
                name,
                numerator.median / denominator.median,
                f"{numerator.system}: {numerator.metric}",
                f"{denominator.system}: {denominator.metric}",
            )
        )

    def find(self, section: str, system: str, metric: str) -> Figure | None:
        for figure in self.figures:
            if (figure.section, figure.system, figure.metric) == (section, system, metric):
                return figure
        return None


def repeat(times: int, call: Callable[[], float]) -> list[float]:
    """Call ``call`` ``times`` times and collect what each call measured."""
    return [call() for _ in range(times)]


def machine() -> dict[str, Any]:
    """Facts about the machine and the library versions the figures belong to."""
    import torch

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
    try:
        facts["memory_gib"] = round(
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1
        )
    except (ValueError, OSError):
        facts["memory_gib"] = None
    try:
        import deepspeed

        facts["deepspeed"] = deepspeed.__version__
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        facts["deepspeed"] = f"not available: {type(exc).__name__}: {exc}"
    try:
        import uvloop

        facts["uvloop"] = getattr(uvloop, "__version__", "installed")
    except ImportError:
        facts["uvloop"] = None
    return facts


def format_value(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "ms":
        return f"{value:.3f} ms" if value < 1 else f"{value:.1f} ms"
    if unit == "us":
        return f"{value:.0f} us"
    return f"{value:.2f} {unit}"


def render(report: Report) -> str:
    """The human-readable tables."""
    lines: list[str] = []
    sections = dict.fromkeys(f.section for f in report.figures)
    for section in sections:
        lines.append(f"\n## {section}\n")
        lines.append("| system | metric | median | min - max | n |")
        lines.append("| --- | --- | --- | --- | --- |")
        for f in report.figures:
            if f.section != section:
                continue
            spread = (
                f"{format_value(min(f.samples), f.unit)} - {format_value(max(f.samples), f.unit)}"
            )
            lines.append(
                f"| {f.system} | {f.metric} | {format_value(f.median, f.unit)} | "
                f"{spread} | {len(f.samples)} |"
            )
        ratios = [r for r in report.ratios if r.section == section]
        if ratios:
            lines.append("")
            lines.append("| ratio | value |")
            lines.append("| --- | --- |")
            for r in ratios:
                lines.append(f"| {r.name} | {r.value:.2f}x |")
    if report.skipped:
        lines.append("\n## skipped\n")
        for s in report.skipped:
            lines.append(f"- {s.section} / {s.system}: {s.reason}")
    for note in report.notes:
        lines.append(f"\nNote: {note}")
    return "\n".join(lines)
