"""``compare``'s *other idle* held to an independent reading of the raw trace (#42.5).

Read here with the standard library (json, gzip), none of fsdpdoctor's code. The frame is the
tool's own step intervals (``StepFacts.step_ms`` ending at ``end_us``, the step clock that
``tests/test_step_clock.py`` holds to the raw trace). Per step:

* the GPU busy = the union of every kernel, memcpy and memset;
* the step's GPU window = its first to last GPU activity launched (``cuda_runtime`` /
  ``cuda_driver`` correlation) from its CPU ``ProfilerStep`` span, ending where the next step's
  own work starts;
* host-bound idle = the window less the GPU busy less the CPU's blocking calls
  (``cuda*Synchronize``, ``cudaMemcpy``, ``cudaMemcpyAsync``);
* other idle = the step interval less the GPU busy less the host-bound idle.

The part is held to this reading alone (not to the step less the other parts), so tripling it
fails here; what the parts leave of the step is ``gpu_unattributed``, shown on its own.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache

import pytest

from _stdlib_reading import subtract, union

from conftest import REPO

from _suitegen_cache import committed_report
from fsdpdoctor.analysis.compare import compare

REC = REPO / "fixtures" / "recorded"
SYNC = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")
PAIRS = [
    ("gpu/fsdp2-offload", "gpu/fsdp2-offload-pageable"),
    ("gpu-h200/gpt2-bf16-b96", "gpu-h200/gpt2-bf16-b96-ac"),
    ("gpu/fsdp2", "gpu/fsdp2-bf16"),
]


def _len(iv) -> float:
    return sum(b - a for a, b in iv)


def raw_other_idle(path, frame: list[tuple[float, float]]) -> float:
    """Other idle, ms per step, in the step intervals ``frame`` (µs) of the trace at ``path``."""
    with gzip.open(path, "rt") as fh:
        ev = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    launch = {
        e["args"]["correlation"]: e["ts"]
        for e in ev
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    blocked = union(
        [
            (e["ts"], e["ts"] + e["dur"])
            for e in ev
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNC
        ]
    )
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in ev
        if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"
    )
    own = []  # each step's GPU activity: (first start, last end)
    for a, b in spans:
        mine = [g for g in gpu if a <= launch.get(g.get("args", {}).get("correlation"), -1) < b]
        own.append((min(g["ts"] for g in mine), max(g["ts"] + g["dur"] for g in mine)) if mine else None)
    total = 0.0
    for k, (lo, hi) in enumerate(frame):
        idle = subtract([(lo, hi)], busy)
        if own[k] is not None:
            w0, w1 = own[k]
            nxt = next((o[0] for o in own[k + 1 :] if o is not None), None)
            w1 = w1 if nxt is None else min(w1, max(nxt, w0))
            host_bound = subtract(subtract([(w0, w1)], busy), blocked)
            idle = subtract(idle, host_bound)
        total += _len(idle)
    return total / len(frame) / 1e3


@lru_cache(maxsize=None)
def _report(run: str):
    return committed_report(REC / run)  # fsdpdoctor.analyze, once per process (shared: read only)


def _frame(run: str) -> list[tuple[float, float]]:
    rf = _report(run).facts.rank_facts[0]
    return [(s.end_us - s.step_ms * 1e3, s.end_us) for s in rf.steps]


@pytest.mark.parametrize("before,after", PAIRS, ids=[a.split("/")[-1] for _, a in PAIRS])
def test_other_idle_is_the_raw_idle_no_host_bound_gap_covers(before, after):
    b, a = _report(before), _report(after)
    c = compare(b.facts, a.facts, b.findings, a.findings)
    tot = c.component_totals()
    for run, got in ((before, tot["other_idle"][0]), (after, tot["other_idle"][1])):
        want = raw_other_idle(REC / run / "rank0.json.gz", _frame(run))
        assert got == pytest.approx(want, abs=max(2e-3, 1e-4 * c.step_before_ms)), (run, got, want)
    # the remainder is its own part, never taken by a finding nor named the primary cause
    assert all("gpu_unattributed@all" not in x.parts for x in c.causes if x.kind == "finding")
    assert c.primary_cause != "gpu_unattributed"
    assert c.components_sum_ms == pytest.approx(c.step_time_delta_ms, abs=1e-6)
