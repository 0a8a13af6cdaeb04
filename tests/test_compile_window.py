"""torch.compile's one-time work inside the profiled window (analysis.compile_window, FSD026).

Ground truth from the raw traces, read here with the standard library:

* the suite's ``compiled-cold`` recording (FSDP2 blocks compiled with ``aot_eager``, 2 gloo ranks,
  profiled from the first step): which ``ProfilerStep#N`` holds ``… (dynamo_timed)`` ranges, their
  outermost union, the steps' durations and the events before the first steady step;
* the ``compiled`` shape (the same model profiled after warm-up): no such range;
* the public MI300X Flux traces (tracelens-mi300x-xdit-flux-graphs): ``capture_trace`` records CUDA
  graphs (``CUDAGraphNode.record (dynamo_timed)``, one step), ``profile_trace`` is the same
  denoising step replayed from them: its FLOPs are the capture's steady work.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import fsdpdoctor

SUFFIX = " (dynamo_timed)"
FLUX = "tracelens-mi300x-xdit-flux-graphs"


def _events(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def _union_us(spans: list[tuple[float, float]]) -> float:
    tot, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        tot += b - max(a, end)
        end = b
    return tot


def _compile_ranges(events: list[dict]) -> list[dict]:
    return [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation") and e["name"].endswith(SUFFIX)
    ]


@pytest.fixture(scope="module")
def cold(recorded_run):
    d = recorded_run("compiled-cold")
    return d, fsdpdoctor.analyze(d)


def test_the_steps_that_compile_are_left_out(cold):
    d, rep = cold
    for rf in rep.facts.rank_facts:
        ev = _events(d / f"rank{rf.rank}.json.gz")
        steps = sorted((e for e in ev if e.get("name", "").startswith("ProfilerStep#")), key=lambda e: e["ts"])
        ranges = _compile_ranges(ev)
        compiling = [
            int(s["name"].split("#")[1]) for s in steps if any(s["ts"] <= r["ts"] < s["ts"] + s["dur"] for r in ranges)
        ]
        assert compiling == [0]  # the first step compiles, the next ones do not
        assert [s.number for s in rf.steps] == [int(s["name"].split("#")[1]) for s in steps[1:]]
        cw = rf.compile_window
        assert cw.warmup_steps == [0] and not cw.steady_compile_ms
        assert cw.warmup_ms == [pytest.approx(steps[0]["dur"] / 1e3)]
        first = steps[0]
        inside = [
            (max(r["ts"], first["ts"]), min(r["ts"] + r["dur"], first["ts"] + first["dur"]))
            for r in ranges
            if r["ts"] < first["ts"] + first["dur"]
        ]
        assert cw.warmup_compile_ms == pytest.approx(_union_us(inside) / 1e3)
        assert cw.warmup_compile_ms > 0.5 * cw.warmup_ms[0]  # the first step is mostly compiling
        assert cw.phases and next(iter(cw.phases)) == "_compile.compile_inner"
        # the events before the first steady step: counted in the input ledger, as not read
        t0 = steps[1]["ts"]
        # (the profiler's own span, category Trace, starts before it too)
        before = sum(1 for e in ev if e.get("ph") == "X" and e["ts"] < t0 and e.get("cat") != "python_function")
        row = next(r for r in rf.ledger.rows if r.cat == "torch.compile warm-up steps")
        assert row.events == before and row.used == 0
        assert rf.ledger.events == sum(1 for _ in ev)
    assert rep.facts.steps.count == 2


def test_a_compile_warm_up_draws_no_jitter_and_says_what_was_left_out(cold):
    _, rep = cold
    slugs = {f.slug: f for f in rep.findings}
    assert "step-time-jitter" not in slugs  # the 1.6 s first step is not a stall to fix
    f = slugs["compile-in-window"]
    assert f.severity == "info" and f.est_saving_ms is None
    assert f.summary.startswith("Step 0 ran torch.compile's one-time work")
    assert "schedule(wait=" in f.fix["any"]
    # the steady steps are a few tens of ms: the compile's seconds are gone from the step time
    assert rep.facts.step_clock_ms < 0.2 * rep.facts.compile_window.warmup_ms[0]
    assert "sampled" not in " ".join(rep.facts.notes)  # leaving a warm-up out is no sampling
    assert rep.facts.ops_recorded_pct is None or rep.facts.ops_recorded_pct > 80


def test_a_window_after_the_warm_up_has_no_compile_work(recorded_run):
    d = recorded_run("compiled")
    assert not any(_compile_ranges(_events(p)) for p in sorted(d.glob("rank*.json.gz")))
    rep = fsdpdoctor.analyze(d)
    assert rep.facts.compile_window is None
    assert not any(f.slug == "compile-in-window" for f in rep.findings)


def test_a_cuda_graph_capture_is_named_not_offered_cuda_graphs(shared_traces):
    """capture_trace: one step (no ProfilerStep), 558.6 ms of ``CUDAGraphNode.record`` in it with
    the GPU idle through it. Before: host-bound, critical, offering ``mode="reduce-overhead"`` to a
    run recording its CUDA graphs, and MFU counting the recorded ops (1.7% for 0.6%)."""
    path = shared_traces / FLUX / "capture_trace_rank_0.json.gz"
    ev = _events(path)
    (rec,) = [e for e in _compile_ranges(ev) if e["cat"] == "user_annotation"]
    assert rec["name"] == "CUDAGraphNode.record (dynamo_timed)"
    rep = fsdpdoctor.analyze(path)
    cw = rep.facts.compile_window
    assert cw.warmup_steps == [] and cw.steady_steps == 1
    assert cw.phases == {"CUDAGraphNode.record": pytest.approx(rec["dur"] / 1e3)}
    # no kernel, copy or set runs inside the recording: its time is all GPU idle
    gpu = [
        (max(e["ts"], rec["ts"]), min(e["ts"] + e["dur"], rec["ts"] + rec["dur"]))
        for e in ev
        if e.get("ph") == "X"
        and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        and e["ts"] < rec["ts"] + rec["dur"]
        and e["ts"] + e["dur"] > rec["ts"]
    ]
    assert cw.gpu_idle_ms_per_step == pytest.approx((rec["dur"] - _union_us(gpu)) / 1e3, abs=0.01)
    slugs = {f.slug: f for f in rep.findings}
    assert "host-bound" not in slugs
    f = slugs["compile-in-window"]
    assert f.severity == "warning" and "no steady step" in f.summary
    # the ops inside the recording are captured, not run: the FLOPs are the replayed twin's
    tid = rec["tid"]
    recorded_ops = [
        e
        for e in ev
        if e.get("ph") == "X"
        and e.get("cat") == "cpu_op"
        and e.get("tid") == tid
        and e["name"] in ("aten::mm", "aten::addmm", "aten::bmm")
        and rec["ts"] <= e["ts"] <= rec["ts"] + rec["dur"]
    ]
    assert rep.facts.compute.ops_in_compile == len(recorded_ops) > 0
    twin = fsdpdoctor.analyze(shared_traces / FLUX / "profile_trace_rank_0.json.gz")
    assert twin.facts.compile_window is None
    assert rep.facts.compute.flops_per_step == pytest.approx(twin.facts.compute.flops_per_step, rel=1e-9)


def test_a_recompilation_in_a_steady_step_is_named_and_costed(recorded_run, recorder):
    """compiled-recompile: profiled after its warm-up, its second profiled step runs shorter
    sequences and its blocks recompile there. Nothing is left out; the compile work of that step
    is the finding's, per step of the window, with a span down to none (a last new shape)."""
    d = recorded_run("compiled-recompile")
    rep = fsdpdoctor.analyze(d)
    want_step = recorder.SHAPE_WAIT + recorder.SHAPE_WARMUP + 1
    truth = {}
    for rf in rep.facts.rank_facts:
        ev = _events(d / f"rank{rf.rank}.json.gz")
        steps = sorted((e for e in ev if e.get("name", "").startswith("ProfilerStep#")), key=lambda e: e["ts"])
        ranges = _compile_ranges(ev)
        per = {}
        for s in steps:
            a, b = s["ts"], s["ts"] + s["dur"]
            spans = [
                (max(r["ts"], a), min(r["ts"] + r["dur"], b)) for r in ranges if r["ts"] < b and r["ts"] + r["dur"] > a
            ]
            if spans:
                per[s["name"].split("#")[1]] = _union_us(spans) / 1e3
        assert list(per) == [str(want_step)]  # only the step with the new length compiles
        cw = rf.compile_window
        assert cw.warmup_steps == [] and cw.steady_steps == len(steps) == recorder.SHAPE_ACTIVE
        assert cw.steady_compile_ms == {str(want_step): pytest.approx(per[str(want_step)])}
        truth[rf.rank] = per[str(want_step)]
    run = rep.facts.compile_window
    assert run.ranks == 2 and run.rank == max(truth, key=lambda r: (truth[r], -r))
    slugs = {f.slug: f for f in rep.findings}
    assert "step-time-jitter" not in slugs
    f = slugs["compile-in-window"]
    assert f.severity in ("warning", "critical") and "recompiles" in f.summary
    assert f.est_saving_ms == pytest.approx(truth[run.rank] / recorder.SHAPE_ACTIVE)
    assert f.saving_range_ms[0] == 0.0
    assert "mark_dynamic" in f.fix["any"]


def test_a_gpu_trace_is_read_from_its_first_steady_step(tmp_path):
    """No GPU recording has compile work in its window yet, so one is made from the H200 GPT-2
    recording (5 steps): a ``_compile.compile_inner (dynamo_timed)`` cpu_op, written as torch 2.13
    writes it, over a quarter of its first step. That step is left out; the steps after it are
    the recording's own, so their step times, the replay's fidelity and the FLOPs per step are
    those of the recording read whole (the first steady step's clock starts at its own CPU
    start, so it alone may differ)."""
    src = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu-h200" / "gpt2-bf16" / "rank0.json.gz"
    with gzip.open(src, "rt") as fh:
        doc = json.load(fh)
    ev = doc["traceEvents"]
    steps = sorted(
        (e for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")),
        key=lambda e: e["ts"],
    )
    first = steps[0]
    ext = 1 + max(e["args"].get("External id", 0) for e in ev if isinstance(e.get("args"), dict))
    ev.append(
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "_compile.compile_inner (dynamo_timed)",
            "pid": first["pid"],
            "tid": first["tid"],
            "ts": first["ts"] + 1.0,
            "dur": round(first["dur"] / 4, 3),
            "args": {"External id": ext, "Record function id": 0, "Ev Idx": len(ev)},
        }
    )
    path = tmp_path / "rank0.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)
    whole, cut = fsdpdoctor.analyze(src), fsdpdoctor.analyze(path)
    numbers = [int(s["name"].split("#")[1]) for s in steps]
    a, b = whole.facts.rank_facts[0], cut.facts.rank_facts[0]
    assert [s.number for s in b.steps] == numbers[1:]
    assert b.compile_window.warmup_steps == [numbers[0]]
    assert b.compile_window.warmup_compile_ms == pytest.approx(round(first["dur"] / 4, 3) / 1e3)
    same = {s.number: s.step_ms for s in a.steps}
    for s in b.steps[1:]:
        assert s.step_ms == pytest.approx(same[s.number], rel=1e-9)
    assert cut.facts.whatif.error_pct <= 2.0
    assert cut.facts.compute.flops_per_step == pytest.approx(whole.facts.compute.flops_per_step, rel=1e-6)
    slugs = {f.slug for f in cut.findings}
    assert "compile-in-window" in slugs and "step-time-jitter" not in slugs


def test_compare_names_the_recompilation(recorded_run):
    """compare, warm compiled run → the same run recompiling in a step: the growth of the CPU's
    forward and backward time is compile-in-window's, and it is about the compile work the raw
    trace holds per step (the part each rank's forward / backward grew by). The runs' noise is
    measured on their steps less the compile work in them: the one 1 s step that recompiles is a
    named cause, not spread (before, the change read as "within noise: ±998 ms")."""
    from fsdpdoctor.analysis.compare import compare

    before, after = fsdpdoctor.analyze(recorded_run("compiled")), fsdpdoctor.analyze(recorded_run("compiled-recompile"))
    c = compare(
        before.facts, after.facts, before.findings, after.findings, before_label="warm", after_label="recompile"
    )
    cause = next(k for k in c.causes if k.slug == "compile-in-window")
    total = sum(k.delta_ms for k in c.causes)
    assert cause.delta_ms > 0.9 * total
    # the recompiling step is not the runs' noise: the change stands out and its cause is named
    assert c.noise_ms is not None and total > c.noise_ms and "torch.compile work" in c.spread
    assert c.primary is not None and c.primary.slug == "compile-in-window"
    d = recorded_run("compiled-recompile")
    per_rank = []
    for p in sorted(d.glob("rank*.json.gz")):
        ev = _events(p)
        steps = [e for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
        lo, hi = min(s["ts"] for s in steps), max(s["ts"] + s["dur"] for s in steps)
        spans = [(max(r["ts"], lo), min(r["ts"] + r["dur"], hi)) for r in _compile_ranges(ev) if r["ts"] < hi]
        per_rank.append(_union_us(spans) / 1e3 / len(steps))
    mean = sum(per_rank) / len(per_rank)
    assert 0.8 * mean < cause.delta_ms < 1.2 * mean
