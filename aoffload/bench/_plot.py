"""Charts of a benchmark report (``--plot DIR``), drawn with matplotlib from the JSON alone.

Three kinds, each per section that has the figures for it, named by the section:

* ``SECTION-stall.png``: the trainer's stall per checkpoint against the step length, one line
  per system (figures whose metric ends ``stall, N s step`` or ``stall after a N s step``);
* ``SECTION-durable.png``: the time until a checkpoint is durable, one bar per system (figures
  whose metric starts with ``time to durable``);
* ``SECTION-step-vs-t_b.png``: a training step's time against the backward's length ``t_b``,
  one line per system (figures whose metric starts with ``step, t_b = N ms``).

Each point is the figure's value (a median of >= 3 samples, or a labelled single sample),
with its min - max as an error bar; every chart names the command, date and machine of the
report it was drawn from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["DURABLE", "STALL", "STEP", "plot"]

STALL = re.compile(r"\bstall(?:,| after a) (\d+(?:\.\d+)?) s step$")
DURABLE = re.compile(r"^time to durable\b")
STEP = re.compile(r"^step, t_b = (\d+(?:\.\d+)?) ms\b")
DERIVED = re.compile(r"optimizer time in the worker|ideal from c")
"""Rows of the overlap section that are not step times (the worker's own time, and ideals
computed from it): left out of the step chart."""
_TO_MS = {"s": 1e3, "ms": 1.0, "us": 1e-3}


def plot(payloads: Iterable[dict[str, Any]], directory: Path) -> list[Path]:
    """Write every chart the reports have figures for into ``directory``; their paths."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only, whatever the environment asks
    directory.mkdir(parents=True, exist_ok=True)
    written: dict[Path, None] = {}
    for payload in payloads:
        figures = [f for f in payload.get("figures", []) if f.get("unit") in _TO_MS]
        footer = _provenance(payload)
        for section in dict.fromkeys(f["section"] for f in figures):
            mine = [f for f in figures if f["section"] == section]
            slug = re.sub(r"[^a-z0-9_]+", "-", section.lower()).strip("-")
            for name, draw in (("stall", _stall), ("durable", _durable), ("step-vs-t_b", _steps)):
                path = directory / f"{slug}-{name}.png"
                if draw(section, mine, footer, path):
                    written[path] = None
    return list(written)


def _provenance(payload: dict[str, Any]) -> str:
    command = payload.get("command") or []
    shown = " ".join(["python", *command[1:]] if command else ["(no command recorded)"])
    facts = payload.get("machine") or {}
    where = ", ".join(
        str(part)
        for part in (
            f"{facts.get('cpus')} CPUs" if facts.get("cpus") else None,
            f"torch {facts['torch']}" if facts.get("torch") else None,
            f"DeepSpeed {facts['deepspeed']}"
            if str(facts.get("deepspeed", "")).split(".")[0].isdigit()
            else None,
        )
        if part
    )
    smoke = " (a --smoke run: its figures measure nothing)" if _smoke(payload) else ""
    return f"{shown}\n{payload.get('date', 'no date')}; {where}{smoke}"


def _smoke(payload: dict[str, Any]) -> bool:
    return bool((payload.get("options") or {}).get("smoke"))


def _ms(figure: dict[str, Any]) -> tuple[float, float, float]:
    """(value, below, above) in ms: the error bar spans the samples' min - max."""
    scale = _TO_MS[figure["unit"]]
    samples = figure["samples"]
    value = figure["value"] * scale
    return value, value - min(samples) * scale, max(samples) * scale - value


def _new(title: str, footer: str) -> Any:
    from matplotlib.figure import Figure

    chart = Figure(figsize=(10, 6), layout="constrained")
    axes = chart.add_subplot()
    axes.set_title(title)
    chart.supxlabel(footer, fontsize=7, color="dimgray", x=0.01, ha="left")
    return chart, axes


def _series(figures: list[dict[str, Any]], pattern: re.Pattern[str]) -> dict[str, list[Any]]:
    series: dict[str, list[Any]] = {}
    for figure in figures:
        match = pattern.search(figure["metric"])
        if match and not DERIVED.search(figure["system"]):
            series.setdefault(figure["system"], []).append((float(match.group(1)), figure))
    return {system: sorted(points, key=lambda p: p[0]) for system, points in series.items()}


def _lines(axes: Any, series: dict[str, list[Any]]) -> None:
    import matplotlib

    palette = matplotlib.colormaps["tab20"]
    for index, (system, points) in enumerate(series.items()):
        x = [p[0] for p in points]
        values = [_ms(f) for _, f in points]
        axes.errorbar(
            x,
            [v[0] for v in values],
            yerr=[[v[1] for v in values], [v[2] for v in values]],
            marker="o",
            capsize=3,
            color=palette((2 * index + index // 10) % 20),
            linestyle="--" if system.startswith(("ideal", "backward alone", "paced")) else "-",
            label=system,
        )


def _stall(section: str, figures: list[dict[str, Any]], footer: str, path: Path) -> bool:
    title = f"{section}: the trainer's stall per checkpoint"
    x = "step length (s): the step between stage() and the fence"
    y = "stall per checkpoint (ms, log scale; bars: min - max)"
    return _line_chart(_series(figures, STALL), title, footer, path, xlabel=x, ylabel=y, log=True)


def _steps(section: str, figures: list[dict[str, Any]], footer: str, path: Path) -> bool:
    title = f"{section}: step time against the backward's length t_b"
    x, y = "t_b: the backward's length (ms)", "step time (ms; bars: min - max)"
    return _line_chart(_series(figures, STEP), title, footer, path, xlabel=x, ylabel=y)


def _line_chart(
    series: dict[str, list[Any]],
    title: str,
    footer: str,
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    log: bool = False,
) -> bool:
    if not series:
        return False
    chart, axes = _new(title, footer)
    _lines(axes, series)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    if log:
        axes.set_yscale("log")
    axes.grid(True, which="both" if log else "major", alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    chart.savefig(path, dpi=110)
    return True


def _durable(section: str, figures: list[dict[str, Any]], footer: str, path: Path) -> bool:
    chosen = [f for f in figures if DURABLE.search(f["metric"])]
    if not chosen:
        return False
    metrics = list(dict.fromkeys(f["metric"] for f in chosen))
    systems = list(dict.fromkeys(f["system"] for f in chosen))
    chart, axes = _new(f"{section}: time until a checkpoint is durable", footer)
    height = 0.8 / len(metrics)
    for i, metric in enumerate(metrics):
        rows = [(systems.index(f["system"]), _ms(f)) for f in chosen if f["metric"] == metric]
        axes.barh(
            [row + i * height for row, _ in rows],
            [v[0] for _, v in rows],
            height=height,
            xerr=[[v[1] for _, v in rows], [v[2] for _, v in rows]],
            capsize=3,
            label=metric,
        )
        for row, v in rows:
            axes.annotate(
                f"{v[0]:.3g} ms" if v[0] < 1000 else f"{v[0] / 1e3:.3g} s",
                (v[0] + v[2], row + i * height),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
    axes.set_yticks([row + (len(metrics) - 1) * height / 2 for row in range(len(systems))])
    axes.set_yticklabels(systems, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("time to durable (ms; bars: min - max)")
    axes.grid(True, axis="x", alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    chart.savefig(path, dpi=110)
    return True
