"""The benchmark runs every section and every system, reports figures honestly, and charts them.

Speed is not asserted here; the benchmark itself reports it. What is asserted of the suite's
one ``--smoke`` run: every section reported figures and nothing failed or was skipped (an
aoffload error is a failure, never a skip; the test environment has every third-party
anchor installed), each section's own JSON names its command, date and machine, and the
charts were drawn. The report's honesty rules and the charts are checked on small reports.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest

import aoffload
from aoffload.bench import __main__ as bench
from aoffload.bench._checkpoint_stall import DURABLE
from aoffload.bench._common import Report, render
from aoffload.bench._overlap_report import step_metric
from tests._bench_run import BenchRun

OVERLAP_STEPS = [f"step, t_b = {ms} ms" for ms in (0, 10, 30, 100)]
FIGURE_SECTIONS = {name: "loop lag" if name == "looplag" else name for name in bench.SECTIONS}
"""Each command-line section and the name its figures carry."""
DEEPSPEED_ANCHORS = {
    ("optimizer", "in-process DeepSpeedCPUAdam"),
    ("optimizer", "DeepSpeed SuperOffloadCPUOptimizer"),
    ("overlap", "in-process DeepSpeedCPUAdam, after the backward (sequential)"),
    ("overlap", "DeepSpeed SuperOffloadCPUOptimizer (driven as stage 3 drives it)"),
    ("checkpoint", "DeepSpeed decoupled"),
}
"""The third-party anchors that may be skipped, only where DeepSpeed is not installed, and
only for exactly the reason the benchmark gives then."""
CHARTS = (
    "checkpoint-stall.png",
    "checkpoint-durable.png",
    "distributed-durable.png",
    "overlap-step-vs-t_b.png",
    "offload_adam-step-vs-t_b.png",
    "dcp-stall.png",
    "dcp-durable.png",
)


def _overlap_cpu_adams() -> tuple[str, str]:
    """The defaults, named by their real worker_cores, and the other worker_cores choice."""
    default = inspect.signature(aoffload.CPUAdam.__init__).parameters["worker_cores"].default
    other = None if default is not None else 0.8
    return (
        f"aoffload CPUAdam (defaults: worker_cores={default!r})",
        f"aoffload CPUAdam (worker_cores={other!r})",
    )


def _allowed_skips() -> set[tuple[str, str, str]]:
    if importlib.util.find_spec("deepspeed") is not None:
        return set()
    reason = "ModuleNotFoundError: No module named 'deepspeed'"
    return {(section, system, reason) for section, system in DEEPSPEED_ANCHORS}


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.timeout(600)  # the whole benchmark, --smoke; slower on a loaded machine
def test_smoke_run_reports_every_section_and_system(bench_smoke: BenchRun) -> None:
    assert bench_smoke.returncode == 0, bench_smoke.stderr[-4000:]
    assert "## FAILED" not in bench_smoke.stdout
    data = bench_smoke.data
    assert data is not None
    assert data["failed"] == []
    assert data["options"]["smoke"] is True
    skipped = {(s["section"], s["system"], s["reason"]) for s in data["skipped"]}
    assert skipped <= _allowed_skips(), f"nothing may be skipped here: {data['skipped']}"
    assert {f["section"] for f in data["figures"]} == set(FIGURE_SECTIONS.values())

    measured: dict[str, set[str]] = {}
    for figure in data["figures"]:
        measured.setdefault(figure["system"], set()).add(figure["metric"])
        assert figure["samples"], figure
        assert all(math.isfinite(v) for v in figure["samples"]), figure
    for system in (
        "aoffload",
        "aoffload bridge (asyncio)",
        "aoffload bridge (uvloop)",
        "aoffload CPUAdam (deepspeed, worker_cores=0.8)",
        "aoffload CPUAdam (torch, worker_cores=0.8)",
        "aoffload CPUAdam (deepspeed, worker_cores=None)",
        "aoffload distributed",
        "aoffload preemption",
        "aoffload commit() -> uploaded()",
    ):
        assert system in measured, f"{system} was not measured"
    default, alternative = _overlap_cpu_adams()
    for system in (default, alternative):
        assert set(OVERLAP_STEPS) <= measured.get(system, set()), f"{system}: {measured}"
    overflow = "1 step in 10 overflows, t_b = 30 ms"
    for system in (default, "aoffload CPUAdam (defaults, exact_rollback=True)"):
        assert f"mean step, {overflow}" in measured.get(system, set()), system
    names = {r["name"] for r in data["ratios"] if r["section"] == "overlap"}
    assert f"{default} / ideal, t_b = 30 ms" in names
    titles = [t["title"] for t in data["tables"] if t["section"] == "overlap"]
    assert any(t.startswith("Step time") for t in titles), titles
    assert any(t.startswith("Overflow") for t in titles), titles


def test_smoke_run_measures_dcp_at_its_best_and_every_time_to_durable(
    bench_smoke: BenchRun,
) -> None:
    """#37.5: DCP runs with DefaultStager, in THREAD and PROCESS mode, and every ratio of the
    checkpoint and distributed sections is taken against those, never its plain mode."""
    data = bench_smoke.data
    assert data is not None
    systems = {(f["section"], f["system"]) for f in data["figures"]}
    for section, suffix in (("checkpoint", ""), ("distributed", ", gloo")):
        assert (section, f"dcp.async_save + DefaultStager (thread{suffix})") in systems
        process = f"dcp.async_save + DefaultStager (process, shared memory{suffix})"
        assert (section, process) in systems
    durable = {f["system"] for f in data["figures"] if f["metric"] == DURABLE}
    assert durable == {s for sec, s in systems if sec == "checkpoint" and "limit" not in s} - {
        "real CPU step"
    }
    for ratio in data["ratios"]:
        if ratio["section"] in ("checkpoint", "distributed") and "dcp" in ratio["name"]:
            assert "DefaultStager" in ratio["name"], ratio["name"]


def test_each_section_has_its_own_report_with_its_provenance(bench_smoke: BenchRun) -> None:
    """#37: a figure quoted from a section's JSON names the command, date and machine."""
    assert set(bench_smoke.sections) == set(bench.SECTIONS)
    for name, report in bench_smoke.sections.items():
        assert report["figures"], f"{name} reported no figures"
        assert report["failed"] == [], name
        assert report["skipped"] == [], name
        assert {f["section"] for f in report["figures"]} == {FIGURE_SECTIONS[name]}
        assert report["rerun"] == [
            "python", "-m", "aoffload.bench", name, "--smoke", "--json", f"bench-{name}.json"
        ]  # fmt: skip
        assert report["command"][1:4] == ["-m", "aoffload.bench", "all"]
        assert report["date"]
        assert report["seconds"] > 0
        assert report["machine"]["cpus"] >= 1
        assert report["machine"]["torch"]
        assert report["options"]["sections"] == [name]
        for figure in report["figures"]:
            assert figure["worst"] == max(figure["samples"]) or figure["unit"].endswith("/s")


def test_smoke_run_draws_its_charts(bench_smoke: BenchRun) -> None:
    for name in CHARTS:
        width, height = _png_size(bench_smoke.charts / name)
        assert (width > 400, height > 300) == (True, True), name


def _sample_report() -> dict[str, Any]:
    """A small report with the metrics each chart reads, as the sections name them."""
    report = Report()
    for system, stalls in (("aoffload", (0.09, 0.0004)), ("torch.save+fsync", (0.9, 3.5))):
        for compute, stall in zip((0.0, 0.5), stalls, strict=True):
            report.add("checkpoint", system, f"trainer stall, {compute:g} s step", "s", [stall])
        report.add("checkpoint", system, DURABLE, "s", [0.5, 0.6, 0.7])
    for system, offset in (("aoffload CPUAdam (defaults: worker_cores=None)", 0.004),):
        for t_b in (0.0, 0.01, 0.03):
            report.add("overlap", system, step_metric(t_b), "s", [t_b + offset] * 3)
    payload = bench._payload(report, report.marks(zero=True), report.marks())
    payload.update(command=["python", "-m", "aoffload.bench"], date="2026-01-01", machine={})
    return payload


def test_plot_from_a_report_writes_the_charts_without_running(tmp_path: Path) -> None:
    source = tmp_path / "report.json"
    source.write_text(json.dumps(_sample_report()))
    charts = tmp_path / "charts"
    assert bench.main(["--plot", str(charts), "--from", str(source)]) == 0
    written = sorted(p.name for p in charts.iterdir())
    assert written == ["checkpoint-durable.png", "checkpoint-stall.png", "overlap-step-vs-t_b.png"]
    for name in written:
        assert _png_size(charts / name)[0] > 400
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"figures": []}))
    assert bench.main(["--plot", str(charts), "--from", str(empty)]) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--from", "x.json"], "--from charts existing reports: give --plot DIR too"),
        (["bridge", "--plot", "d", "--from", "x.json"], "--from runs nothing: name no section"),
        (["nosuch"], "unknown section ['nosuch']"),
    ],
)
def test_bad_command_lines_say_what_to_do(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


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
    # the same goal from saves alternated in one process: the disk's drift cancels
    assert "time to durable: capped / uncapped, alternated saves" in ratios
    assert ("aoffload, alternated saves", "time to durable: capped / uncapped (paired)") in figures


def test_report_labels_few_samples_and_lists_failures() -> None:
    report = Report()
    single = report.add("s", "one", "m", "s", [0.5])
    many = report.add("s", "many", "m", "s", [0.1, 0.3, 0.2])
    rate = report.add("s", "rate", "m", "MB/s", [10.0, 30.0, 20.0])
    ratio = report.ratio("s", "one / many", single, many)
    report.fail("s", "aoffload thing", RuntimeError("boom"))
    text = render(report)

    assert single.as_json()["median"] is None
    assert single.as_json()["single_sample"] is True
    assert many.as_json()["median"] == 0.2
    assert many.as_json()["label"] == ""
    assert (many.worst, rate.worst) == (0.3, 10.0)  # the slowest run; the lowest rate
    assert "500.0 ms (single sample)" in text
    assert "| many | m | 200.0 ms | 100.0 ms - 300.0 ms | 300.0 ms | 3 |" in text
    assert ratio is not None
    assert "single sample" in ratio.label
    assert "2.50x (one: single sample)" in text
    assert "## FAILED" in text
    assert "aoffload thing: RuntimeError: boom" in text
