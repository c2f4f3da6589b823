"""Shared pieces of the benchmark: repetition statistics, progress, machine facts, output.

Honesty rules the report enforces: a figure of three or more samples is shown as its median
with min - max; a figure of fewer is labelled (a single sample is never called a median); a
ratio built on such a figure carries the label too; an aoffload measurement that raised is a
*failure* (the run exits non-zero), while a third-party anchor that cannot run here is
*skipped* with its reason.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def progress(message: str) -> None:
    """Show what is running now (stderr, so the table on stdout stays clean)."""
    print(f"[aoffload.bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


MIN_SAMPLES = 3
"""A figure of fewer samples is labelled, not shown as a median."""


@dataclass
class Figure:
    """One measured quantity of one system: the median of ``samples`` with min and max.

    With fewer than :data:`MIN_SAMPLES` samples it is labelled (:attr:`label`) and its
    :attr:`value` is the single sample (or the mean of two), never called a median.
    """

    section: str
    system: str
    metric: str
    unit: str
    samples: list[float]
    note: str = ""

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"{self.section} / {self.system} / {self.metric}: no samples")

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def label(self) -> str:
        """Empty for a median of >= 3 samples, else what the value really is."""
        if self.n >= MIN_SAMPLES:
            return ""
        return "single sample" if self.n == 1 else f"mean of {self.n} samples, too few for a median"

    @property
    def value(self) -> float:
        """The median of >= 3 samples, else the single sample (or the mean of two)."""
        if self.n >= MIN_SAMPLES:
            return statistics.median(self.samples)
        return statistics.fmean(self.samples)

    @property
    def median(self) -> float:
        """Kept for callers that read it; equals :attr:`value` (see :attr:`label`)."""
        return self.value

    @property
    def worst(self) -> float:
        """The worst sample: the largest, or the smallest for a rate (a unit per second).

        Printed beside the median, so that a figure which is a median of maxima (a loop's
        lag, a stall) never hides its worst run."""
        return min(self.samples) if self.unit.endswith("/s") else max(self.samples)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        many = self.n >= MIN_SAMPLES
        data.update(
            n=self.n,
            value=self.value,
            label=self.label,
            single_sample=self.n == 1,
            median=self.value if many else None,
            min=min(self.samples) if many else None,
            max=max(self.samples) if many else None,
            worst=self.worst,
        )
        return data


@dataclass
class Skipped:
    """An anchor that could not run here, with the reason."""

    section: str
    system: str
    reason: str


@dataclass
class Failure:
    """An aoffload measurement that raised: the run reports it and exits non-zero."""

    section: str
    system: str
    reason: str


@dataclass
class Ratio:
    """``numerator / denominator`` of two figures' values measured in the same run.

    ``label`` is non-empty when either figure has fewer than :data:`MIN_SAMPLES` samples.
    """

    section: str
    name: str
    value: float
    numerator: str
    denominator: str
    label: str = ""


@dataclass
class Table:
    """A summary table of one section, rows of already formatted cells (figures stay above)."""

    section: str
    title: str
    columns: list[str]
    rows: list[list[str]]


@dataclass
class Report:
    """Everything one run measured."""

    figures: list[Figure] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def marks(self, *, zero: bool = False) -> dict[str, int]:
        """How many entries each list holds now (all 0 with ``zero``): a section's entries
        are those between the marks taken before and after it."""
        names = ("figures", "skipped", "failures", "ratios", "tables", "notes")
        return {name: 0 if zero else len(getattr(self, name)) for name in names}

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
        """A third-party anchor that cannot run here (never an aoffload system: see fail)."""
        progress(f"skipped {system}: {reason}")
        self.skipped.append(Skipped(section, system, reason))

    def fail(self, section: str, system: str, error: BaseException | str) -> None:
        """An aoffload measurement that raised: reported, and the run exits non-zero."""
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        progress(f"FAILED {section} / {system}: {reason}")
        self.failures.append(Failure(section, system, reason[:2000]))

    def ratio(
        self, section: str, name: str, numerator: Figure | None, denominator: Figure | None
    ) -> Ratio | None:
        """Record ``numerator / denominator`` (nothing when either is missing or zero)."""
        if numerator is None or denominator is None or denominator.value == 0:
            return None
        labels = [f"{f.system}: {f.label}" for f in (numerator, denominator) if f.label]
        ratio = Ratio(
            section,
            name,
            numerator.value / denominator.value,
            f"{numerator.system}: {numerator.metric}",
            f"{denominator.system}: {denominator.metric}",
            "; ".join(labels),
        )
        self.ratios.append(ratio)
        return ratio

    def find(self, section: str, system: str, metric: str) -> Figure | None:
        for figure in self.figures:
            if (figure.section, figure.system, figure.metric) == (section, system, metric):
                return figure
        return None


def rank_records(processes: list[Any], root: Path, what: str) -> list[dict[str, Any]]:
    """What each rank process wrote to ``root/rank<r>.json``, once all exited 0 (joined)."""
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"a {what} rank failed (exit codes {failed}); see its stderr")
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(len(processes))]


def kill_ranks(processes: list[Any]) -> None:
    """Kill and reap the rank processes still alive (a failed or interrupted run)."""
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


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
        return f"{value:.2f} us" if value < 10 else f"{value:.0f} us"
    return f"{value:.2f} {unit}"


def _figure_row(f: Figure) -> str:
    worst = format_value(f.worst, f.unit)
    if f.label:
        shown, spread = f"{format_value(f.value, f.unit)} ({f.label})", "—"
    else:
        low, high = format_value(min(f.samples), f.unit), format_value(max(f.samples), f.unit)
        shown, spread = format_value(f.value, f.unit), f"{low} - {high}"
    return f"| {f.system} | {f.metric} | {shown} | {spread} | {worst} | {f.n} |"


def render(report: Report) -> str:
    """The human-readable tables."""
    lines: list[str] = []
    sections = dict.fromkeys(f.section for f in report.figures)
    for section in sections:
        lines.append(f"\n## {section}\n")
        lines.append("| system | metric | median | min - max | worst | n |")
        lines.append("| --- | --- | --- | --- | --- | --- |")
        lines.extend(_figure_row(f) for f in report.figures if f.section == section)
        ratios = [r for r in report.ratios if r.section == section]
        if ratios:
            lines.append("")
            lines.append("| ratio | value |")
            lines.append("| --- | --- |")
            for r in ratios:
                label = f" ({r.label})" if r.label else ""
                lines.append(f"| {r.name} | {r.value:.2f}x{label} |")
        for table in (t for t in report.tables if t.section == section and t.rows):
            lines.append(f"\n{table.title}\n")
            lines.append("| " + " | ".join(table.columns) + " |")
            lines.append("|" + " --- |" * len(table.columns))
            lines.extend("| " + " | ".join(row) + " |" for row in table.rows)
    if report.skipped:
        lines.append("\n## skipped\n")
        for s in report.skipped:
            lines.append(f"- {s.section} / {s.system}: {s.reason}")
    if report.failures:
        lines.append("\n## FAILED\n")
        for failure in report.failures:
            lines.append(f"- {failure.section} / {failure.system}: {failure.reason}")
    for note in report.notes:
        lines.append(f"\nNote: {note}")
    return "\n".join(lines)
