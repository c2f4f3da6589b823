"""The dcp benchmark section measures DCP and every peer on 2 ranks (in the suite's one run
of the whole benchmark, ``--smoke``: see ``bench_smoke``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from aoffload.bench import _dcp as section
from aoffload.bench._dcp_peers import (
    AOFFLOAD_DCP_CAPPED,
    AOFFLOAD_DCP_FACE,
    AOFFLOAD_ENGINE,
    DCP_BLOCKING,
    TORCH_CHECKPOINTING,
    aoffload_dcp_name,
    dcp_async_name,
)
from tests._bench_run import BenchRun


def check_dcp_section(data: dict[str, Any]) -> None:
    """What a run's JSON report must hold for the dcp section (``--smoke`` or not)."""
    assert data["failed"] == [], data["failed"]
    figures = [f for f in data["figures"] if f["section"] == section.SECTION]
    assert figures, "the dcp section measured nothing"
    steps = section.SMOKE_STEPS if data["options"]["smoke"] else section.STEPS
    metrics = {
        "call",
        *(f"stall after a {t:g} s step" for t in steps),
        *(f"time to durable, {t:g} s step" for t in steps),
        "peak PSS, rank + its processes",
        "peak PSS over the rank alone",
    }
    measured: dict[str, set[str]] = {}
    for figure in figures:
        assert all(math.isfinite(v) for v in figure["samples"]), figure
        if figure["unit"] == "s" or figure["metric"].startswith("peak PSS,"):
            assert all(v > 0 for v in figure["samples"]), figure
        measured.setdefault(figure["system"], set()).add(figure["metric"])
    cuda = torch.cuda.is_available()
    expected = [DCP_BLOCKING, AOFFLOAD_ENGINE, AOFFLOAD_DCP_FACE, AOFFLOAD_DCP_CAPPED]
    expected += [aoffload_dcp_name(False), aoffload_dcp_name(True)]
    expected += [
        dcp_async_name(process, shared, cuda)
        for process in (False, True)
        for shared in (None, False, True)
    ]
    for system in expected:
        assert measured.get(system) == metrics, (system, sorted(measured.get(system, ())))
    skipped = {s["system"]: s["reason"] for s in data["skipped"] if s["section"] == "dcp"}
    ours = [s for s in measured if s.startswith(TORCH_CHECKPOINTING)]
    assert len(ours) == 1 or skipped.get(TORCH_CHECKPOINTING)
    for system in ours:
        assert measured[system] == metrics, system
        assert "writes" in system  # which writes it was given, O_DIRECT or buffered
    assert measured.pop(section.DISK) == {f"time to durable, {steps[0]:g} s step"}
    [table] = [t for t in data["tables"] if t["section"] == section.SECTION]
    assert {row[0] for row in table["rows"]} == {*measured, section.DISK}
    names = {r["name"] for r in data["ratios"] if r["section"] == section.SECTION}
    for system in (
        aoffload_dcp_name(False),
        aoffload_dcp_name(True),
        AOFFLOAD_DCP_FACE,
        AOFFLOAD_DCP_CAPPED,
    ):
        assert any(n.startswith(f"stall after a {steps[-1]:g} s step: {system} /") for n in names)
        assert f"time to durable, {steps[0]:g} s step: {system} / {section.DISK}" in names


@pytest.mark.timeout(600)  # it may be the test that runs the whole benchmark
def test_dcp_section_measures_every_system(bench_smoke: BenchRun) -> None:
    assert bench_smoke.returncode == 0, bench_smoke.stderr[-4000:]
    assert bench_smoke.data is not None
    check_dcp_section(bench_smoke.data)
