"""Saving ranges measured on real twins (fsdpdoctor.savings, fsdpdoctor.savings.twins, docs/savings.md).

Truth: each pair's measured difference is read from the two raw traces by the step-clock test's
independent reader (plain ``json``), never from fsdpdoctor. The pairs are listed here, not read
from ``fsdpdoctor.savings.twins``: the table under test is checked against them.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fsdpdoctor.savings.twins import TWINS

from _suitepub_cache import PUBLIC_TRACES, raw, report, stdlib_reading
from test_step_clock import raw_clock

REC = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"

#: the seven real twin pairs of issue #33: (rule slug, problem run, the same run with the fix)
PAIRS = [
    ("matmul-wrong-engine", "gpu/fsdp2", "gpu/fsdp2-bf16"),
    ("matmul-wrong-engine", "gpu-h200/fsdp2", "gpu-h200/fsdp2-bf16"),
    ("activation-recompute", "gpu/fsdp2-ac", "gpu/fsdp2"),
    ("activation-recompute", "gpu-h200/gpt2-bf16-b96-ac", "gpu-h200/gpt2-bf16-b96"),
    ("cpu-offload-stall", "gpu/fsdp2-offload", "gpu/fsdp2"),
    ("cpu-offload-stall", "gpu/fsdp2-offload-pageable", "gpu/fsdp2"),
    ("pageable-memcpy", "gpu/fsdp2-offload-pageable", "gpu/fsdp2-offload"),
]


@pytest.fixture(scope="module")
def analyzed():
    """run (under fixtures/recorded, or a path) -> ``fsdpdoctor.analyze``, once per session
    (``_suitepub_cache.report``)."""
    return lambda run: report(REC / run)


def _measured(problem: str, fixed: str) -> float:
    return raw_clock(REC / problem / "rank0.json.gz")["step_ms"] - raw_clock(REC / fixed / "rank0.json.gz")["step_ms"]


#: out of sample (the finding's range never uses its own run's twin): the pairs whose range
#: holds the measured difference today, and each rule's largest measured error of its
#: prediction (|predicted / measured - 1|, rounded up): inflating a rule's estimate by 25% breaks
#: one or the other (the measured differences come from the raw traces, not from the tool)
HOLDS_OUT_OF_SAMPLE = {("gpu/fsdp2", "gpu/fsdp2-bf16"), ("gpu/fsdp2-offload", "gpu/fsdp2")}
MAX_ERROR = {"matmul-wrong-engine": 0.25, "activation-recompute": 0.12, "cpu-offload-stall": 0.15}


@pytest.mark.parametrize(
    "slug,problem,fixed", [p for p in PAIRS if p[0] != "pageable-memcpy"], ids=lambda x: x if "/" in str(x) else None
)
def test_the_range_is_out_of_sample_and_holds_its_estimate(slug, problem, fixed, analyzed):
    """The finding's range on a twin's own problem run is made without that twin (its basis does
    not cite the pair), holds its estimate, and is checked against what the fix really saved."""
    f = next(x for x in analyzed(problem).findings if x.slug == slug)
    real = _measured(problem, fixed)
    lo, hi = f.saving_range_ms
    assert lo <= f.est_saving_ms <= hi
    assert f"{problem} -> {fixed}" not in f.saving_range_basis
    assert re.search(r"real twins? on Hopper", f.saving_range_basis)  # the other same-class twins, named
    if (problem, fixed) in HOLDS_OUT_OF_SAMPLE:
        assert lo <= real <= hi, (problem, lo, real, hi)
    assert abs(f.est_saving_ms / real - 1) <= MAX_ERROR[slug], (problem, f.est_saving_ms, real)


def test_pinning_under_cpu_offload_promises_nothing(analyzed):
    """The pinned twin of the pageable offload run was 18.8 ms *slower* (its CPU AdamW ran longer
    on pinned memory): the finding makes no positive promise, though the replay prices the copies."""
    rep = analyzed("gpu/fsdp2-offload-pageable")
    f = next(x for x in rep.findings if x.slug == "pageable-memcpy")
    assert _measured("gpu/fsdp2-offload-pageable", "gpu/fsdp2-offload") < 0
    assert f.est_saving_ms is None and f.severity == "info"
    assert f.saving_range_ms[1] <= 0
    assert f.model_saving_ms > 50  # the replay does see the blocking pageable copies
    assert rep.facts.whatif.saving_ms["pin"] == pytest.approx(f.model_saving_ms)
    assert "No saving is promised" in f.summary


def test_the_twin_table_is_what_the_tool_predicts_today(analyzed):
    """fsdpdoctor/savings/twins.py (written by benchmarks/savings_table.py) holds today's predictions and
    the raw measurements: it fails when a rule or the replay changed and the table was not
    regenerated."""
    assert {(t.kind.split("/")[0], *t.pair.split(" -> ")) for t in TWINS} >= set(PAIRS)
    for t in TWINS:
        problem, fixed = t.pair.split(" -> ")
        assert t.measured_ms == pytest.approx(_measured(problem, fixed), abs=0.01), t.pair
        slug = t.kind.split("/")[0]
        f = next((x for x in analyzed(problem).findings if x.slug == slug), None)
        if f is not None and "/" in t.kind and f.saving_kind.startswith(slug + "/") and f.saving_kind != t.kind:
            f = None  # a rule with two levers (FSD017) predicted for the other one: none for this twin
        predicted = f.model_saving_ms if f is not None and f.model_saving_ms is not None else 0.0
        assert predicted == pytest.approx(t.predicted_ms, abs=0.01), t.pair


def test_a_rule_without_a_twin_says_so_and_states_its_assumption(analyzed):
    """A rule without a real twin (the GPU waiting for FSDP's hooks): "not validated on a real
    run"; its range is the replay of two blocks per unit with the hook CPU a merged unit keeps at
    50% (the estimate) and 75%, stated; the ceiling is the replay with no hook CPU at all."""
    rep = analyzed("gpu/fsdp2-bf16")
    f = next(x for x in rep.findings if x.slug == "gpu-starved-by-hooks")
    w = rep.facts.whatif
    assert f.saving_range_basis.startswith("not validated on a real run")
    assert "two blocks per unit keep: 75-50%" in f.saving_range_basis
    assert f.est_saving_ms == pytest.approx(w.saving_ms["hooks_half"])
    assert f.saving_range_ms == pytest.approx(w.assumption_ms["hooks_half"])
    assert f.saving_ceiling_ms == pytest.approx(w.saving_ms["hooks_off"])
    assert f.est_saving_ms < w.saving_ms["hooks_off"]


def test_twins_of_another_device_class_are_never_the_basis():
    """The H100 / H200 twins are not cited for a V100 or an MI300 run, nor for another family."""
    from fsdpdoctor.savings import device_class, saving_range

    assert device_class("Tesla V100-SXM2-32GB") == "Volta" and device_class("NVIDIA H200") == "Hopper"
    for dev in ("Tesla V100-SXM2-32GB", "AMD Instinct MI300X", "NVIDIA A100-SXM4-80GB"):
        for kind in ("matmul-wrong-engine", "activation-recompute", "cpu-offload-stall"):
            r = saving_range(kind, 10.0, device=dev)
            assert r.twins == 0 and r.basis.startswith("not validated on a real run"), (dev, r.basis)
            assert "Hopper transformer: another device class" in r.basis
    r = saving_range("matmul-wrong-engine", 10.0, device="NVIDIA H100 80GB HBM3", family="other")
    assert r.twins == 0 and r.basis.startswith("not validated")
    r = saving_range("matmul-wrong-engine", 10.0, device="NVIDIA H100 80GB HBM3")
    hopper = [t for t in TWINS if t.kind == "matmul-wrong-engine" and t.predicted_ms > 0]  # all on H100 / H200
    assert len(hopper) == 4 and r.twins == len(hopper) and r.low_ms <= 10.0 <= r.high_ms


def test_fidelity_is_not_printed_as_a_saving_error(analyzed):
    """The unchanged replay's agreement is fidelity: kept in the JSON, never a ± on a saving."""
    rep = analyzed("gpu/fsdp2")
    f = next(x for x in rep.findings if x.slug == "matmul-wrong-engine")
    assert f.saving_basis == "replay" and f.replay_fidelity_pct == rep.facts.whatif.error_pct
    text = rep.to_markdown()
    assert "±" not in text.split("matmul-wrong-engine", 1)[1].split("\n", 3)[1]
    lo, hi = f.saving_range_ms
    assert f"saves ~{f.est_saving_ms:.2f} ms/step ({lo:.2f}–{hi:.2f} ms)" in text


def test_sensitivity_replays_drop_what_the_trace_does_not_show():
    """On the pageable offload run (60 waits kept as measured) the blind replay never runs slower
    than the one that keeps them, by at most the kept waits; the sensitivity of a saving is the
    difference of the two replays' savings."""
    from fsdpdoctor.analysis.comms import find_collectives, issue_rows
    from fsdpdoctor.analysis.labels import enclosing, label_rows
    from fsdpdoctor.analysis.steps import find_steps
    from fsdpdoctor.analysis.timeline import step_timeline
    from fsdpdoctor.analysis.whatif.fixes import fix_offload_off
    from fsdpdoctor.analysis.whatif.graph import build_graph
    from fsdpdoctor.analysis.whatif.loop import replay
    from fsdpdoctor.ingest.kineto import load_trace

    rt = load_trace(str(REC / "gpu" / "fsdp2-offload-pageable" / "rank0.json.gz"))
    info = find_steps(rt)
    colls = find_collectives(rt, enclosing(rt, label_rows(rt), issue_rows(rt)))
    step_timeline(rt, info.steps, colls)
    g = build_graph(rt, info.steps, colls)
    kept = float(g.g_wait.sum()) / 1e3 / len(info.steps)
    assert kept > 1.0
    seen = replay(g)[2].mean()
    blind = replay(g, blind=True)[2].mean()
    assert blind <= seen + 1e-6
    assert seen - blind <= kept + 1e-6
    fx = fix_offload_off(g)
    saving, saving_blind = seen - replay(g, fx)[2].mean(), blind - replay(g, fx, blind=True)[2].mean()
    rep = report(REC / "gpu" / "fsdp2-offload-pageable")
    assert rep.facts.whatif.sensitivity_ms["offload_off"] == pytest.approx(abs(saving - saving_blind), abs=1e-6)
    assert np.isfinite(saving_blind)


def _inputs() -> list[Path]:
    """Every GPU recording, and every public trace folder (a folder holding several runs: each file)."""
    from conftest import PUBLIC_TRACES

    out = sorted(p for p in REC.glob("gpu*/*") if p.is_dir())
    if PUBLIC_TRACES.is_dir():
        for d in sorted(p for p in PUBLIC_TRACES.iterdir() if p.is_dir()):
            files = sorted(d.glob("*.json*"))
            mixed = d.name.startswith(("hta-ddp-v100", "hta-mtia", "tracelens-mi300x-xdit"))
            out += files if mixed else [d]
    return out


@pytest.mark.parametrize("path", _inputs(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_range_holds_its_estimate_below_the_step(path, analyzed):
    """On every recording and public trace: low <= estimate <= high, the high end within the
    step and within the part of the step the fix acts on; no basis cites another device class."""
    from fsdpdoctor.savings import device_class

    rep = analyzed(str(path.relative_to(REC)) if REC in path.parents else path)
    step = rep.facts.step_clock_ms
    cls = device_class(next((r.device_name for r in rep.facts.rank_facts if r.device_name), None))
    for f in rep.findings:
        if f.saving_range_ms is None:
            continue
        lo, hi = f.saving_range_ms
        if f.est_saving_ms is not None:
            assert lo <= f.est_saving_ms <= hi, (f.code, lo, f.est_saving_ms, hi)
            assert hi <= step + 1e-9, (f.code, hi, step)
            if f.saving_ceiling_ms is not None:
                assert hi <= f.saving_ceiling_ms + 1e-9, (f.code, hi, f.saving_ceiling_ms)
        if "real twin" in f.saving_range_basis and not f.saving_range_basis.startswith("not validated"):
            assert f"on {cls}" in f.saving_range_basis, (f.code, f.saving_range_basis)
        if f.saving_pct_of_step is not None and f.severity == "critical":
            assert 100 * (f.saving_ceiling_ms or f.est_saving_ms) / step >= 1.0


def test_dlrm_first_finding_is_not_the_pageable_copy(shared_traces):
    """The public DLRM trace's copies are read-backs or synchronized on at once (each followed by
    cudaStreamSynchronize): pinning them cannot make them non-blocking, so FSD006 (0.01 ms of copy
    time) is not the first finding, nor critical."""
    rep = report(shared_traces / "param-dlrm-v100-8ranks")
    assert rep.findings[0].slug != "pageable-memcpy"
    f = next((x for x in rep.findings if x.slug == "pageable-memcpy"), None)
    assert f is None or f.severity != "critical"


def test_ranking_by_what_a_user_will_get():
    """Findings rank by the low end of their range; where ranges overlap, the one resting on real
    twins goes first; a finding whose part of the step is under 1% is never critical."""
    from fsdpdoctor.engine import Finding, grade, rank

    def f(code, est, lo, hi, basis):
        return Finding(
            code.lower(), code, "warning", code, est_saving_ms=est, saving_range_ms=[lo, hi], saving_range_basis=basis
        )

    a = f("FSD900", 10.0, 4.0, 10.0, "not validated on a real run")
    b = f("FSD901", 8.0, 6.0, 9.0, "not validated on a real run")
    assert [x.code for x in rank([a, b])] == ["FSD901", "FSD900"]  # the larger low end first
    c = f("FSD902", 7.0, 5.0, 8.0, "1 real twin on Hopper (x -> y): measured 1.10x the prediction, out of sample")
    assert [x.code for x in rank([a, b, c])][0] == "FSD902"  # overlaps FSD901's range, twinned
    d = f("FSD903", 3.0, 2.0, 3.0, "1 real twin on Hopper")
    assert [x.code for x in rank([b, d])] == ["FSD901", "FSD903"]  # no overlap: the low end decides

    class Facts:
        step_clock_ms = 100.0

    cfg = {"severity_critical_pct": 2.0, "severity_warning_pct": 1.0}
    g = Finding("x", "FSD904", "warning", "x", est_saving_ms=0.9, saving_ceiling_ms=0.9)
    grade(g, Facts(), {"severity_critical_pct": 0.5, "severity_warning_pct": 0.1})
    assert g.severity == "warning"  # 0.9% of the step: never critical
    h = Finding("x", "FSD905", "warning", "x", est_saving_ms=3.0, saving_ceiling_ms=5.0)
    grade(h, Facts(), cfg)
    assert h.severity == "critical"


def test_a_formula_estimate_spans_its_own_assumption(shared_traces):
    """The HTA V100 rank's jitter finding (a rule's formula, no replay) had a zero-width range and
    outranked the replayed FSD015 on certainty it had not earned. Its range now spans the
    assumption it makes (the stall-free step: the median; the fastest step, or only the slowest
    step's stall gone), read here from the raw step spans; the ranking follows the low ends."""
    import statistics

    path = shared_traces / "hta-ddp-v100-2022" / "test-rank-1.json.gz"
    rep = report(path)
    f = next(x for x in rep.findings if x.slug == "step-time-jitter")
    times = raw(path, _step_durations_of)
    med = statistics.median(times)
    lo, hi = f.saving_range_ms
    assert lo < f.est_saving_ms < hi
    assert f.est_saving_ms == pytest.approx(statistics.fmean(times) - med, rel=0.05)
    assert lo == pytest.approx((max(times) - med) / len(times), rel=0.05)
    assert hi == pytest.approx(statistics.fmean(times) - min(times), rel=0.05)
    assert "the step without its stalls is the median" in f.saving_range_basis
    timed = [x for x in rep.findings if x.est_saving_ms is not None]
    lows = [x.saving_range_ms[0] for x in timed if x.severity == timed[0].severity]
    assert lows == sorted(lows, reverse=True)  # none of them rests on a real twin: the low end decides


@stdlib_reading(PUBLIC_TRACES / "hta-ddp-v100-2022" / "test-rank-1.json.gz")
def _step_durations_of(doc) -> list[float]:
    """The ProfilerStep spans' durations (ms), in time order, from the raw JSON."""
    steps = sorted(
        (e["ts"], e["dur"] / 1e3)
        for e in doc["traceEvents"]
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    )
    return [d for _, d in steps]
