"""fsdpdoctor against generated multi-rank GPU traces with exact ground truth (truth.json,
computed by the generator reading its own events back)."""

from __future__ import annotations

import pytest

from fixtures.scenarios import generator as gen
from fsdpdoctor.analysis.ranks.summary import wall_clock

PRESETS = sorted(gen.PRESETS)


@pytest.fixture(scope="module")
def case(scenario_case):
    return scenario_case  # generated and analysed once per session (conftest), shared with other modules


def _truth_ranks(truth):
    ranks = truth["ranks"]
    return {int(k): v for k, v in (ranks.items() if isinstance(ranks, dict) else enumerate(ranks))}


@pytest.mark.parametrize("name", PRESETS)
def test_overlap_and_exposed_comm_match_truth(name, case):
    rep, truth = case(name)
    f = rep.facts
    truth_ranks = _truth_ranks(truth)
    assert f.ranks == sorted(truth_ranks)
    for rf in f.rank_facts:
        tr = truth_ranks[rf.rank]
        assert len(rf.steps) == len(tr["steps"])
        for mine, want in zip(rf.steps, tr["steps"]):
            assert f"ProfilerStep#{mine.number}" == want["name"]
            assert mine.cpu_span_ms == pytest.approx(want["step_ms"], abs=1e-3)  # the truth's CPU ProfilerStep span
            assert mine.step_ms == pytest.approx(want["step_time_ms"], abs=1e-3)  # the slower clock's interval
            assert mine.compute_ms == pytest.approx(want["compute_busy_ms"], abs=1e-3)
            assert mine.comm_ms == pytest.approx(want["comm_busy_ms"], abs=1e-3)
            assert mine.overlap_ms == pytest.approx(want["overlap_ms"], abs=1e-3)
            assert mine.exposed_comm_ms == pytest.approx(want["exposed_comm_ms"], abs=1e-3)
            for kind, v in want["exposed_by_collective_ms"].items():
                assert mine.exposed_by_kind.get(kind, 0.0) == pytest.approx(v, abs=1e-3), kind
            for phase, v in want["exposed_by_phase_ms"].items():
                assert mine.exposed_by_phase.get(phase, 0.0) == pytest.approx(v, abs=0.01), phase
            # the window's parts: idle = nothing of any step running, other steps' work, and the rest
            assert mine.gpu_window_ms == pytest.approx(want["gpu_window_ms"], abs=1e-3)
            assert mine.idle_ms == pytest.approx(want["idle_ms"], abs=1e-3)
            assert mine.other_steps_ms == pytest.approx(want["other_steps_ms"], abs=1e-3)
        assert wall_clock(rf)[0] == pytest.approx(tr["wall_ms_per_step"], abs=1e-3)
        # all steps: within 0.1 point of the truth
        assert f.overlap.steps_per_rank[str(rf.rank)] == pytest.approx(tr["overlap_pct"], abs=0.1)
        # the HTA window (every step but the last), from the truth's own per-step numbers
        steps = tr["steps"][:-1]
        comm = sum(s["comm_busy_ms"] for s in steps)
        if comm > 0:
            hta_window = 100 * sum(s["overlap_ms"] for s in steps) / comm
            assert rf.overlap_pct == pytest.approx(hta_window, abs=0.1)
    assert f.overlap.steps_pct == pytest.approx(truth["summary"]["overlap_pct_mean"], abs=0.1)
    assert f.exposed_comm.mean_ms_per_step == pytest.approx(truth["summary"]["exposed_comm_ms_per_step_mean"], abs=1e-3)


@pytest.mark.parametrize("name", PRESETS)
def test_structure_matches_truth(name, case):
    rep, truth = case(name)
    fs = rep.facts.fsdp
    model = truth["model"]
    if model["parallelism"] != "fsdp":
        assert fs.version is None
        return
    assert fs.version == model["fsdp_version"]
    assert fs.unit_count == len(model["unit_fqns"])
    if fs.version == 2:
        assert [u.fqn for u in fs.units] == model["unit_fqns"]
    if any(u.backward_all_gathers for u in fs.units):  # with no backward all-gather there is nothing to judge
        assert fs.backward_prefetch == (model["backward_prefetch"] or "NONE")
    else:
        assert fs.backward_prefetch is None
    assert bool(fs.cpu_offload.detected) == bool(model["cpu_offload"])
    if not model["cpu_offload"]:
        # every preset copies its input batch H2D each step: not offload, not counted
        assert fs.cpu_offload.h2d_count == 0 and fs.cpu_offload.d2h_count == 0
    want_mp = model["collective_dtype"] in ("BFloat16", "Half")
    assert fs.mixed_precision is want_mp
    # collectives per step and bytes, rank 0, first step
    rf = rep.facts.rank_facts[0]
    t0 = _truth_ranks(truth)[rf.rank]["steps"][0]["collectives"]
    mine = [c for c in rf.collectives if c.step == 0]
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        cs = [c for c in mine if c.kind == kind]
        assert len(cs) == t0[kind]["count"], kind
        assert sum(c.bytes or 0 for c in cs) == t0[kind]["bytes"], kind


@pytest.mark.parametrize("name", PRESETS)
def test_findings_match_the_injected_cause(name, case):
    rep, truth = case(name)
    slugs = {f.slug for f in rep.findings}
    for slug in truth["design_findings"]:
        assert slug in slugs, f"{name}: expected {slug}, got {sorted(slugs)}"
    if not truth["design_findings"]:
        assert not slugs, f"{name} is healthy but got {sorted(slugs)}"
