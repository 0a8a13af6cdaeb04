"""``compare``'s GPU parts held to an independent reading of the raw traces (#42.5).

The raw reading (``_stdlib_reading.clock_split``) uses the standard library only (json, gzip),
none of fsdpdoctor's code. The frame is the tool's own step intervals (``StepFacts.step_ms``
ending at ``end_us``, the step clock that ``tests/test_step_clock.py`` holds to the raw trace).
Each instant of a step's interval goes to the first of: compute (a kernel that is neither a
collective nor a copy runs, whichever step launched it), exposed comm by kind (all-gather, then
reduce-scatter, then any other collective kernel), memcpy/memset, host-bound idle (nothing runs,
inside the step's own GPU window and outside the CPU's blocking calls) and other idle (the rest).

Every part is held to this reading alone (never to the step less the other parts), so tripling
any one of them fails here; what the parts leave of the step is ``gpu_unattributed``, shown on its
own, and it is float rounding. The exposed comm's phase is not read here (the kinds are summed
over phases). Pairs: the recorded H100 and H200 pairs the split was developed on, and public
traces it was not (HTA's DDP V100/A100 twins with NCCL all-reduce kernels; PARAM DLRM's ranks 0
and 1, all-to-all and all-reduce), skipped without ``../shared``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from _stdlib_reading import clock_split

from conftest import REPO, SHARED

from _suitegen_cache import committed_report

import fsdpdoctor
from fsdpdoctor.analysis.compare import compare
from fsdpdoctor.report.comparison import render_markdown

REC = REPO / "fixtures" / "recorded"
PUB = SHARED / "traces" / "public"
PAIRS = [
    (REC / "gpu/fsdp2-offload", REC / "gpu/fsdp2-offload-pageable"),
    (REC / "gpu-h200/gpt2-bf16-b96", REC / "gpu-h200/gpt2-bf16-b96-ac"),
    (REC / "gpu/fsdp2", REC / "gpu/fsdp2-bf16"),
    # not developed on
    (PUB / "hta-ddp-v100-2022/control-rank-3.json.gz", PUB / "hta-ddp-v100-2022/test-rank-1.json.gz"),
    (
        PUB / "param-dlrm-v100-8ranks/worker0_step_12.1694128201545.pt.trace.json.gz",
        PUB / "param-dlrm-v100-8ranks/worker1_step_12.1694128201556.pt.trace.json.gz",
    ),
]
#: compare's part → the raw reading's
RAW = {
    "compute": "compute",
    "exposed_all_gather": "comm:all_gather",
    "exposed_reduce_scatter": "comm:reduce_scatter",
    "exposed_other_comm": "comm:other",
    "memcpy": "memcpy",
    "host_bound_idle": "host_bound_idle",
    "other_idle": "other_idle",
}


@lru_cache(maxsize=None)
def _report(run: Path):
    if REC in run.parents:  # shared with the other modules reading the recording (read only)
        return committed_report(run)
    return fsdpdoctor.analyze(str(run))


def _trace(run: Path) -> Path:
    return run if run.is_file() else sorted(run.glob("rank*.json.gz"))[0]


@lru_cache(maxsize=None)
def _raw(run: Path) -> dict[str, float]:
    rf = _report(run).facts.rank_facts[0]
    return clock_split(_trace(run), [(s.end_us - s.step_ms * 1e3, s.end_us) for s in rf.steps])


@pytest.mark.parametrize("before,after", PAIRS, ids=[a.name.split(".")[0] for _, a in PAIRS])
def test_every_gpu_part_is_the_raw_step_clock_split(before, after):
    if not (before.exists() and after.exists()):
        pytest.skip("../shared/traces/public is absent")
    b, a = _report(before), _report(after)
    c = compare(b.facts, a.facts, b.findings, a.findings)
    assert c.basis == "gpu"
    tot = c.component_totals()
    tol = max(2e-3, 1e-4 * c.step_before_ms)
    for i, run in enumerate((before, after)):
        raw = _raw(run)
        for part, key in RAW.items():
            assert tot[part][i] == pytest.approx(raw.get(key, 0.0), abs=tol), (run.name, part)
        # the raw parts tile the step: what compare leaves unattributed is float rounding
        step = (c.step_before_ms, c.step_after_ms)[i]
        assert sum(raw.values()) == pytest.approx(step, abs=tol)
        assert abs(tot["gpu_unattributed"][i]) < 1e-6
    # the remainder is its own part, never taken by a finding nor named the primary cause
    assert all("gpu_unattributed@all" not in x.parts for x in c.causes if x.kind == "finding")
    assert c.primary_cause != "gpu_unattributed"
    assert c.components_sum_ms == pytest.approx(c.step_time_delta_ms, abs=1e-6)
    assert not any("saved before fsdpdoctor split" in n for n in c.notes)
    # a rounding remainder of -1e-14 ms prints as 0.00 ms, never as a negative zero
    md = render_markdown(c)
    assert "-0.00" not in md and "−0.00" not in md


def test_facts_saved_before_the_split_keep_the_window_parts_and_say_so():
    """A baseline saved before ``clock_split_ms`` existed: the GPU-window figures, what they leave
    unattributed, and a note."""
    import copy

    run = REC / "gpu-h200/gpt2-bf16-b96"
    old = copy.deepcopy(_report(run).facts)
    for r in old.rank_facts:
        for s in r.steps:
            s.clock_split_ms = {}
    after = _report(REC / "gpu-h200/gpt2-bf16-b96-ac")
    c = compare(old, after.facts, _report(run).findings, after.findings)
    b, _ = c.component_totals()["compute"]
    s = old.rank_facts[0].steps
    assert b == pytest.approx(sum(x.compute_ms for x in s) / len(s), abs=1e-9)  # the window's own compute
    assert any("saved before fsdpdoctor split the step on the step clock" in n for n in c.notes)
    assert c.components_sum_ms == pytest.approx(c.step_time_delta_ms, abs=1e-6)


CPU_PAIRS = [("per-block", "no-backward-prefetch"), ("per-block", "root-only")]


def raw_outside_span(run: str) -> float:
    """The step clock outside the CPU spans, ms per step, mean over ranks, read with json: on a
    run without a GPU the step clock is the CPU's, each step's interval running from the previous
    ``ProfilerStep`` span's end (the first: its own start) to its own end, so what lies outside the
    span is the gap between consecutive spans."""
    import gzip
    import json

    per_rank = []
    for path in sorted((REC / run).glob("rank*.json.gz")):
        with gzip.open(path, "rt") as fh:
            ev = json.load(fh)["traceEvents"]
        spans = sorted(
            (e["ts"], e["ts"] + e["dur"])
            for e in ev
            if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"
        )
        gaps = [max(spans[k][0] - spans[k - 1][1], 0.0) for k in range(1, len(spans))]
        per_rank.append(sum(gaps) / len(spans) / 1e3)
    return sum(per_rank) / len(per_rank)


@pytest.mark.parametrize("before,after", CPU_PAIRS, ids=[a for _, a in CPU_PAIRS])
def test_cpu_outside_span_is_the_raw_gap_between_steps(before, after):
    b, a = _report(REC / before), _report(REC / after)
    c = compare(b.facts, a.facts, b.findings, a.findings)
    assert c.basis == "cpu"
    tot = c.component_totals()
    for i, run in enumerate((before, after)):
        want = raw_outside_span(run)
        assert want > 0.01  # the recordings' loops spend 20-60 µs between steps
        assert tot["cpu_outside_span"][i] == pytest.approx(want, abs=1e-3), run
        assert abs(tot["cpu_unattributed"][i]) < 1e-3, run  # the phases tile the span: rounding only
    assert c.components_sum_ms == pytest.approx(c.step_time_delta_ms, abs=1e-6)
