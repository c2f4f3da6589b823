"""The benchmark runs, measures every aoffload system, and reports figures honestly.

Speed is not asserted here; the benchmark itself reports it. What is asserted: the run
succeeds only when every aoffload system was measured (an aoffload error is a failure,
never a skip), the overlap section is there, and no figure of fewer than 3 samples is
presented as a median.
"""

from __future__ import annotations

import inspect
import math

import pytest

import aoffload
from aoffload.bench._common import Report, render
from tests._bench_run import BenchRun

OVERLAP_STEPS = [f"step, t_b = {ms} ms" for ms in (0, 10, 30, 100)]


def _overlap_cpu_adams() -> tuple[str, str]:
    """The defaults, named by their real worker_cores, and the other worker_cores choice."""
    default = inspect.signature(aoffload.CPUAdam.__init__).parameters["worker_cores"].default
    other = None if default is not None else 0.8
    return (
        f"aoffload CPUAdam (defaults: worker_cores={default!r})",
        f"aoffload CPUAdam (worker_cores={other!r})",
    )


@pytest.mark.timeout(600)  # the whole benchmark, --smoke; slower on a loaded machine
def test_quick_benchmark_measures_every_aoffload_system(bench_smoke: BenchRun) -> None:
    assert bench_smoke.returncode == 0, bench_smoke.stderr[-4000:]
    for section in (
        "bridge", "checkpoint", "optimizer", "overlap", "loop lag", "distributed", "memory",
    ):  # fmt: skip
        assert f"## {section}" in bench_smoke.stdout
    assert "## FAILED" not in bench_smoke.stdout
    data = bench_smoke.data
    assert data is not None
    assert data["failed"] == []
    assert data["options"]["quick"] is True
    assert data["options"]["smoke"] is True
    assert data["machine"]["cpus"] >= 1
    assert {f["section"] for f in data["figures"]} >= {
        "bridge", "checkpoint", "optimizer", "overlap", "loop lag", "distributed", "memory",
    }  # fmt: skip

    skipped_aoffload = [s for s in data["skipped"] if s["system"].startswith("aoffload")]
    assert skipped_aoffload == [], f"aoffload systems must be measured: {skipped_aoffload}"
    for skipped in data["skipped"]:
        assert skipped["reason"]

    measured: dict[str, set[str]] = {}
    for figure in data["figures"]:
        measured.setdefault(figure["system"], set()).add(figure["metric"])
        values = figure["samples"]
        assert figure["n"] == len(values) >= 1
        assert all(math.isfinite(v) for v in values), figure
        if figure["section"] in ("bridge", "optimizer", "overlap", "loop lag"):
            # n >= 3, except a figure that can only be taken once and says so
            assert figure["n"] >= 3 or figure["single_sample"], f"too few samples: {figure}"
        if figure["n"] < 3:  # never presented as a median
            assert figure["median"] is None, figure
            assert figure["label"], figure
        else:
            assert figure["median"] == figure["value"], figure
            assert not figure["label"], figure

    for system in (
        "aoffload",
        "aoffload bridge (asyncio)",
        "aoffload bridge (uvloop)",
        "aoffload CPUAdam (deepspeed, worker_cores=0.8)",
        "aoffload CPUAdam (torch, worker_cores=0.8)",
        "aoffload CPUAdam (deepspeed, worker_cores=None)",
        "aoffload distributed",
    ):
        assert system in measured, f"{system} was not measured"

    default, alternative = _overlap_cpu_adams()
    for system in (default, alternative):
        assert set(OVERLAP_STEPS) <= measured.get(system, set()), f"{system}: {measured}"
    overflow = "1 step in 10 overflows, t_b = 30 ms"
    for system in (default, "aoffload CPUAdam (defaults, exact_rollback=True)"):
        assert f"mean step, {overflow}" in measured.get(system, set()), system
    deepspeed_anchors = {
        "in-process DeepSpeedCPUAdam, after the backward (sequential)",
        "DeepSpeed SuperOffloadCPUOptimizer (driven as stage 3 drives it)",
    }
    for anchor in deepspeed_anchors:  # a third-party anchor is measured or says why not
        assert anchor in measured or any(s["system"] == anchor for s in data["skipped"])
    if "in-process DeepSpeedCPUAdam, after the backward (sequential)" in measured:
        names = {r["name"] for r in data["ratios"] if r["section"] == "overlap"}
        assert f"{default} / ideal, t_b = 30 ms" in names
    titles = [t["title"] for t in data["tables"] if t["section"] == "overlap"]
    assert any(t.startswith("Step time") for t in titles), titles
    assert any(t.startswith("Overflow") for t in titles), titles


def test_the_memory_section_measures_the_staging_cap(bench_smoke: BenchRun) -> None:
    """Every figure of #35's goals is there, for the capped and the default engine; the
    capped engine's staging never exceeded its cap (a count, not a speed); the peers are
    measured or say why not."""
    data = bench_smoke.data
    assert data is not None
    figures = {(f["system"], f["metric"]): f for f in data["figures"] if f["section"] == "memory"}
    capped = next(system for system, _ in figures if system.startswith("aoffload, staging_bytes="))
    for system in (capped, "aoffload, default staging cap"):
        for metric in (
            "peak staging memory (CommitResult)",
            "peak PSS, trainer + its processes",
            "peak PSS over the trainer before its state",
            "time to durable, 0 s step",
            "time to durable / raw O_DIRECT (paired)",
            "stall after a step longer than the streaming",
        ):
            assert (system, metric) in figures, (system, metric)
    cap = float(capped.split("=")[1].split()[0])
    assert max(figures[capped, "peak staging memory (CommitResult)"]["samples"]) <= cap
    for process in ("trainer", "writer"):
        assert any(
            system == "aoffload, many saves" and metric.startswith(f"{process} PSS growth")
            for system, metric in figures
        ), process
    skipped = {s["system"] for s in data["skipped"] if s["section"] == "memory"}
    for peer in ("DCP async_save THREAD", "torch_checkpointing"):
        assert any(system.startswith(peer) for system, _ in figures) or any(
            s.startswith(peer) for s in skipped
        ), peer
    ratios = {r["name"] for r in data["ratios"] if r["section"] == "memory"}
    assert "time to durable: capped / uncapped (goal <= 1.15)" in ratios


def test_report_labels_few_samples_and_lists_failures() -> None:
    report = Report()
    single = report.add("s", "one", "m", "s", [0.5])
    many = report.add("s", "many", "m", "s", [0.1, 0.3, 0.2])
    ratio = report.ratio("s", "one / many", single, many)
    report.fail("s", "aoffload thing", RuntimeError("boom"))
    text = render(report)

    assert single.as_json()["median"] is None
    assert single.as_json()["single_sample"] is True
    assert many.as_json()["median"] == 0.2
    assert many.as_json()["label"] == ""
    assert "500.0 ms (single sample)" in text
    assert "| many | m | 200.0 ms | 100.0 ms - 300.0 ms | 3 |" in text
    assert ratio is not None
    assert "single sample" in ratio.label
    assert "2.50x (one: single sample)" in text
    assert "## FAILED" in text
    assert "aoffload thing: RuntimeError: boom" in text
