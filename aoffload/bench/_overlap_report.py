"""The overlap section's names and tables: the step times against the ideal, the overflow
runs, and where aoffload's step goes (the optimizer's own time in the worker)."""

from __future__ import annotations

from ._common import Figure, Report, Table, format_value
from ._optimizer import CONFIG

__all__ = ["report_own", "report_steps", "step_metric"]

SECTION = "overlap"
SUBGROUPS, NUMEL = 16, 1 << 20
BACKWARDS = (0.0, 0.010, 0.015, 0.030, 0.100)  # 15 ms: about t_adam on 2 cores
OVERFLOW_BACKWARD, OVERFLOW_EVERY = 0.030, 10
LR = float(CONFIG["lr"])

SEQUENTIAL = "in-process DeepSpeedCPUAdam, after the backward (sequential)"
SUPEROFFLOAD = "DeepSpeed SuperOffloadCPUOptimizer (driven as stage 3 drives it)"
ADAPTER = "aoffload.deepspeed SuperOffloadCPUOptimizer (driven as stage 3 drives it)"
BACKWARD_ALONE = "backward alone, no optimizer (time.sleep)"
PINNED = 0.8  # DeepSpeed's cpuadam_cores_perc default
EXACT = "aoffload CPUAdam (defaults, exact_rollback=True)"
IDEAL = "ideal: max(t_b, t_adam) + t_adam / 16"
OWN = "optimizer time in the worker (c)"


def step_metric(t_b: float) -> str:
    return f"step, t_b = {t_b * 1e3:g} ms"


def report_steps(
    report: Report,
    measured: dict[str, dict[str, list[float]]],
    t_adam: Figure | None,
    variants: tuple[str, str],
) -> dict[tuple[str, str], Figure]:
    """The main table and its ratios; returns the step-time figures by (system, metric)."""
    default, alternative = variants
    figures: dict[tuple[str, str], Figure] = {}
    for system, by_metric in measured.items():
        for metric in (step_metric(t_b) for t_b in BACKWARDS):
            if metric in by_metric:
                figures[system, metric] = report.add(
                    SECTION, system, metric, "s", by_metric[metric]
                )
    ideal: dict[float, Figure] = {}
    if t_adam is None:
        report.notes.append("overlap: no t_adam (in-process DeepSpeedCPUAdam skipped): no ideal")
    else:
        for t_b in BACKWARDS:
            ideal[t_b] = report.add(
                SECTION,
                IDEAL,
                step_metric(t_b),
                "s",
                [max(t_b, a) + a / SUBGROUPS for a in t_adam.samples],
                note="derived from each t_adam sample",
            )
    ours = [s for s in variants if s in measured]
    rows: list[list[str]] = []
    for system in (SEQUENTIAL, SUPEROFFLOAD, ADAPTER, default, alternative):
        if system not in measured:
            continue
        row = [system]
        for t_b in BACKWARDS:
            figure = figures.get((system, step_metric(t_b)))
            ratio = report.ratio(
                SECTION, f"{system} / ideal, t_b = {t_b * 1e3:g} ms", figure, ideal.get(t_b)
            )
            cell = "—" if figure is None else format_value(figure.value, "s")
            row.append(cell if ratio is None else f"{cell} ({ratio.value:.2f}x)")
        rows.append(row)
    for t_b in BACKWARDS:
        metric = step_metric(t_b)
        report.ratio(
            SECTION,
            f"{SUPEROFFLOAD} / {ADAPTER}, t_b = {t_b * 1e3:g} ms (> 1: aoffload faster)",
            figures.get((SUPEROFFLOAD, metric)),
            figures.get((ADAPTER, metric)),
        )
        for system in ours:
            for anchor in (SEQUENTIAL, SUPEROFFLOAD):
                report.ratio(
                    SECTION,
                    f"{anchor} / {system}, t_b = {t_b * 1e3:g} ms (> 1: aoffload faster)",
                    figures.get((anchor, metric)),
                    figures.get((system, metric)),
                )
    header = [f"t_b = {t_b * 1e3:g} ms" for t_b in BACKWARDS]
    if ideal:
        rows.append([IDEAL, *(format_value(ideal[t_b].value, "s") for t_b in BACKWARDS)])
    report.tables.append(
        Table(SECTION, "Step time (x the ideal), 16 x 1M sub-groups", ["system", *header], rows)
    )
    _report_overflow(report, measured, default)
    return figures


def _report_overflow(
    report: Report, measured: dict[str, dict[str, list[float]]], default: str
) -> None:
    where = f"1 step in {OVERFLOW_EVERY} overflows, t_b = {OVERFLOW_BACKWARD * 1e3:g} ms"
    rows = []
    means: dict[str, Figure] = {}
    for system in (SEQUENTIAL, SUPEROFFLOAD, ADAPTER, default, EXACT):
        by_metric = measured.get(system, {})
        if "mean" not in by_metric:
            continue
        mean = means[system] = report.add(
            SECTION, system, f"mean step, {where}", "s", by_metric["mean"]
        )
        worst = report.add(
            SECTION, system, f"overflowed step, {where}", "s", by_metric["overflowed"]
        )
        rows.append([system, format_value(mean.value, "s"), format_value(worst.value, "s")])
    report.ratio(
        SECTION,
        f"exact_rollback / algebraic rollback, mean step ({where})",
        means.get(EXACT),
        means.get(default),
    )
    report.tables.append(
        Table(SECTION, f"Overflow: {where}", ["system", "mean step", "overflowed step"], rows)
    )


def report_own(
    report: Report,
    figures: dict[tuple[str, str], Figure],
    own: dict[str, dict[str, list[float]]],
    t_adam: Figure | None,
    variants: tuple[str, str],
) -> None:
    """Where aoffload's step time goes: the optimizer's own time in the worker, ``c``, and
    the step against the ideal built from it, ``max(t_b, c) + c / 16``. What is left
    beyond that ideal is the transport and the scheduling; ``c`` above ``t_adam`` is the
    optimizer slowed by sharing the cores with the trainer."""
    rows: list[list[str]] = []
    for system in variants:
        if system not in own:
            continue
        row = [system]
        for t_b in BACKWARDS:
            metric = step_metric(t_b)
            samples = own[system].get(metric)
            step = figures.get((system, metric))
            if not samples or step is None:
                row.append("—")
                continue
            compute = report.add(SECTION, f"{system}: {OWN}", metric, "s", samples)
            ideal = report.add(
                SECTION,
                f"{system}: ideal from c, max(t_b, c) + c / 16",
                metric,
                "s",
                [max(t_b, c) + c / SUBGROUPS for c in samples],
                note="derived from each step's c",
            )
            ratio = report.ratio(
                SECTION, f"{system} / its ideal from c, t_b = {t_b * 1e3:g} ms", step, ideal
            )
            slowed = report.ratio(
                SECTION, f"{system}: c / t_adam, t_b = {t_b * 1e3:g} ms", compute, t_adam
            )
            cell = f"c {format_value(compute.value, 's')}"
            if slowed is not None:
                cell += f" ({slowed.value:.2f}x t_adam)"
            if ratio is not None:
                cell += f", step {ratio.value:.2f}x its ideal"
            row.append(cell)
        rows.append(row)
    header = [f"t_b = {t_b * 1e3:g} ms" for t_b in BACKWARDS]
    report.tables.append(
        Table(
            SECTION,
            "Where aoffload's step goes: c, the optimizer's own time in the worker, and the "
            "step against max(t_b, c) + c / 16",
            ["system", *header],
            rows,
        )
    )
