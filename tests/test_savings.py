"""Saving ranges measured on real twins (fsdpdoctor.savings, fsdpdoctor.twins, docs/savings.md).

Truth: each pair's measured difference is read from the two raw traces by the step-clock test's
independent reader (plain ``json``), never from fsdpdoctor. The pairs are listed here, not read
from ``fsdpdoctor.twins``: the table under test is checked against them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fsdpdoctor
from fsdpdoctor.twins import TWINS

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
    cache: dict[str, fsdpdoctor.Report] = {}

    def get(run: str):
        if run not in cache:
            cache[run] = fsdpdoctor.analyze(REC / run)
        return cache[run]

    return get


def _measured(problem: str, fixed: str) -> float:
    return raw_clock(REC / problem / "rank0.json.gz")["step_ms"] - raw_clock(REC / fixed / "rank0.json.gz")["step_ms"]


@pytest.mark.parametrize("slug,problem,fixed", PAIRS, ids=lambda x: x if "/" in str(x) else None)
def test_the_range_holds_the_real_twins_difference(slug, problem, fixed, analyzed):
    """Each finding's saving_range_ms holds what the fix really saved on its twin, and is no wider
    than ±35% of the model's estimate."""
    f = next(x for x in analyzed(problem).findings if x.slug == slug)
    real = _measured(problem, fixed)
    lo, hi = f.saving_range_ms
    assert lo <= real <= hi, (problem, lo, real, hi)
    est = f.model_saving_ms
    assert est and est > 0
    if real > 0:  # (the pinning pair went the other way: its range is below zero, see the next test)
        assert 0.65 * est <= lo and hi <= 1.35 * est, (lo / est, hi / est)


def test_pinning_under_cpu_offload_promises_nothing(analyzed):
    """The pinned twin of the pageable offload run was 18.8 ms *slower* (its CPU AdamW ran longer
    on pinned memory): the finding makes no positive promise, though the replay prices the copies."""
    rep = analyzed("gpu/fsdp2-offload-pageable")
    f = next(x for x in rep.findings if x.slug == "pageable-memcpy")
    assert _measured("gpu/fsdp2-offload-pageable", "gpu/fsdp2-offload") < 0
    assert f.est_saving_ms is None and f.severity == "info"
    assert f.saving_range_ms[1] <= 0
    assert f.model_saving_ms > 50  # the replay does see ~130 ms of blocking pageable copies
    assert rep.facts.whatif.saving_ms["pin"] == pytest.approx(f.model_saving_ms)
    assert "No saving is promised" in f.summary


def test_the_twin_table_is_what_the_tool_predicts_today(analyzed):
    """fsdpdoctor/twins.py (written by benchmarks/savings_table.py) holds today's predictions and
    the raw measurements: it fails when a rule or the replay changed and the table was not
    regenerated."""
    assert {(t.kind.split("/")[0], *t.pair.split(" -> ")) for t in TWINS} >= set(PAIRS)
    for t in TWINS:
        problem, fixed = t.pair.split(" -> ")
        assert t.measured_ms == pytest.approx(_measured(problem, fixed), abs=0.01), t.pair
        slug = t.kind.split("/")[0]
        f = next((x for x in analyzed(problem).findings if x.slug == slug), None)
        predicted = f.model_saving_ms if f is not None and f.model_saving_ms is not None else 0.0
        assert predicted == pytest.approx(t.predicted_ms, abs=0.01), t.pair


def test_a_rule_without_a_twin_says_so(analyzed):
    """A rule without a real twin (the GPU waiting for FSDP's hooks): ±50% of its estimate, said
    in the basis."""
    f = next(x for x in analyzed("gpu/fsdp2-bf16").findings if x.slug == "gpu-starved-by-hooks")
    assert f.saving_range_basis.startswith("no real twin")
    assert f.saving_range_ms == pytest.approx([0.5 * f.model_saving_ms, 1.5 * f.model_saving_ms])


def test_fidelity_is_not_printed_as_a_saving_error(analyzed):
    """The unchanged replay's agreement is fidelity: kept in the JSON, never a ± on a saving."""
    rep = analyzed("gpu/fsdp2")
    f = next(x for x in rep.findings if x.slug == "matmul-wrong-engine")
    assert f.saving_basis == "replay" and f.replay_fidelity_pct == rep.facts.whatif.error_pct
    text = rep.to_markdown()
    assert "±" not in text.split("matmul-wrong-engine", 1)[1].split("\n", 3)[1]
    lo, hi = f.saving_range_ms
    assert f"{lo:.2f}–{hi:.2f} ms/step" in text


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
    rep = fsdpdoctor.analyze(REC / "gpu" / "fsdp2-offload-pageable")
    assert rep.facts.whatif.sensitivity_ms["offload_off"] == pytest.approx(abs(saving - saving_blind), abs=1e-6)
    assert np.isfinite(saving_blind)
