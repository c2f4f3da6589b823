"""The offload_adam benchmark section runs and measures OffloadAdam against its anchors (in
the suite's one run of the whole benchmark, ``--smoke``: see ``bench_smoke``)."""

from __future__ import annotations

import math

import pytest

from aoffload.bench import _offload_adam as section
from tests._bench_run import BenchRun


@pytest.mark.timeout(600)  # it may be the test that runs the whole benchmark
def test_offload_adam_section_measures_every_system(bench_smoke: BenchRun) -> None:
    assert bench_smoke.returncode == 0, bench_smoke.stderr[-4000:]
    data = bench_smoke.data
    assert data is not None
    assert data["failed"] == []
    figures = [f for f in data["figures"] if f["section"] == section.SECTION]
    ratios = [r for r in data["ratios"] if r["section"] == section.SECTION]
    assert figures, "the offload_adam section measured nothing"
    measured: dict[str, set[str]] = {}
    for figure in figures:
        assert figure["samples"], figure
        assert all(math.isfinite(v) and v > 0 for v in figure["samples"]), figure
        measured.setdefault(figure["system"], set()).add(figure["metric"])
    for system in (
        section.FOREACH,
        section.FUSED,
        section.OFFLOAD,
        section.FUSED_CLIP,
        section.OFFLOAD_CLIP,
        section.ZERO_OFFLOAD,
        section.SEQUENTIAL,
        section.PACED,
        section.PACED_SPLIT,
        section.THREAD,
        section.ALONE,
        section.IDEAL,
        section.COPIES,
        section.ADAM_ONE,
        section.AT_ONCE,
    ):
        assert system in measured, f"{system} was not measured: {sorted(measured)}"
    steps = {m for m in measured[section.PACED] if m.startswith("step, t_b")}
    assert len(steps) == len(section.BACKWARDS) + 1  # the overlap section's t_b, and t_adam
    assert steps == {m for m in measured[section.IDEAL] if m.startswith("step, t_b")}
    names = {r["name"] for r in ratios}
    assert any(n.startswith(f"{section.PACED} / ideal") for n in names), names
    assert any(n.startswith(f"{section.THREAD} / ideal") for n in names), names
    assert any(n.startswith(f"{section.OFFLOAD} / {section.FUSED}") for n in names), names
    # #37.3: ZeRO-Offload (which always clips by, and checks, the global norm) is compared
    # with OffloadAdam(max_grad_norm=...) only, never with OffloadAdam's defaults.
    like = f"{section.OFFLOAD_CLIP} / {section.ZERO_OFFLOAD} (real model, like for like"
    assert any(n.startswith(like) for n in names), names
    assert not any(n.startswith(f"{section.OFFLOAD} / {section.ZERO_OFFLOAD}") for n in names)
    assert "gradient_clipping=1.0" in section.ZERO_OFFLOAD
    assert "max_grad_norm=1.0" in section.OFFLOAD_CLIP
    # #37.4: the in-process overlap is reported against the sequential step too
    titles = [t["title"] for t in data["tables"] if t["section"] == section.SECTION]
    assert any(t.startswith("Paced backward: the sequential step / each overlap") for t in titles)
