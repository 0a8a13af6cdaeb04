"""The efficiency waterfall (fsdpdoctor.analysis.efficiency) on the real recordings and the public
traces.

Truths, none of them fsdpdoctor's: the GPU's idle time read here from the raw Chrome trace with
plain ``json`` (:func:`raw_idle`: each step's interval on the step clock, less the union of all GPU
activity in it); the matmul FLOPs of the recorder's model (``tests/test_compute.py::model_flops``,
from ``fixtures/record_gpu.py``'s configuration) at the device's BF16 dense peak (H100 SXM and
H200: 989 TFLOP/s, NVIDIA's datasheets); the FSDP hooks' CPU ranges and the launch calls read from
the raw trace; the real twin without activation checkpointing.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

import fsdpdoctor
from fsdpdoctor.facts.efficiency import PARTS

from _suitepub_cache import PUBLIC_TRACES, RECORDED, raw, report, stdlib_reading
from conftest import public_trace_files
from fixtures.scenarios.waterfall_truth import (
    union as _union,
)  # the generator truth's plain interval union (no fsdpdoctor code)
from test_compute import model_flops

REC = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
GPU_RUNS = sorted(p for d in (REC / "gpu", REC / "gpu-h200") for p in d.iterdir() if (p / "rank0.json.gz").is_file())
PUBLIC = public_trace_files()
STEP_RX = re.compile(r"^ProfilerStep#(\d+)$")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
BF16_PEAK = 989e12  # H100 SXM and H200 dense BF16 FLOP/s
_NOT_BUSY = re.compile(r"^(Stream Wait|cudaStreamWait)")


def _events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        doc = json.load(fh)
    return [e for e in (doc["traceEvents"] if isinstance(doc, dict) else doc) if e.get("ph") == "X"]


def raw_idle(path: Path) -> dict | None:
    """Per step, the time in its interval on the step clock with no GPU activity at all, mean over
    steps (ms). The clock is the slower of the CPU's (``ProfilerStep`` spans end to end) and the
    completions' (a step completes when its span and the GPU work it launched, by correlation id,
    are done; the first step's interval at the mean rate of the others). Read in the one stdlib
    pass over the file the session makes (``_suitepub_cache.raw``)."""
    return raw(path, _idle_of)


def _x_events(doc) -> list[dict]:
    return [e for e in (doc["traceEvents"] if isinstance(doc, dict) else doc) if e.get("ph") == "X"]


@stdlib_reading(PUBLIC_TRACES, RECORDED / "gpu", RECORDED / "gpu-h200")
def _idle_of(doc) -> dict | None:
    events = _x_events(doc)
    spans: dict[int, tuple[float, float]] = {}
    launch: dict[int, float] = {}
    gpu: list[tuple[float, float, object]] = []
    for e in events:
        cat, args = e.get("cat"), e.get("args") or {}
        m = STEP_RX.match(e.get("name", ""))
        if m and cat in ("user_annotation", "cpu_op"):
            a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            if int(m.group(1)) not in spans or b - a > spans[int(m.group(1))][1] - spans[int(m.group(1))][0]:
                spans[int(m.group(1))] = (a, b)
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launch[args["correlation"]] = float(e["ts"])
        elif cat in GPU_CATS and not _NOT_BUSY.match(e.get("name", "")):
            gpu.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), args.get("correlation")))
    steps = sorted(spans.values())
    if not steps:
        return None
    n = len(steps)
    done: list[float] = []
    for a, b in steps:
        ends = [t for s, t, c in gpu if c in launch and a <= launch[c] < b]
        done.append(max([b, *ends, *done[-1:]]))
    cpu = (steps[-1][1] - steps[0][0]) / n
    rate = (done[-1] - done[0]) / (n - 1) if n > 1 else None
    if rate is not None and rate > cpu:
        wins = [(done[0] - rate, done[0]), *zip(done, done[1:])]
    else:
        wins = [steps[0], *((p[1], q[1]) for p, q in zip(steps, steps[1:]))]
    busy = _union([(s, t) for s, t, _ in gpu])
    idle = sum((b - a) - sum(max(0.0, min(y, b) - max(x, a)) for x, y in busy) for a, b in wins)
    return {"idle_ms": idle / n / 1e3, "step_ms": sum(b - a for a, b in wins) / n / 1e3}


@pytest.fixture(scope="module")
def analyzed():
    """path -> ``fsdpdoctor.analyze(path)``, once per session (``_suitepub_cache.report``)."""
    return report


def _check_parts(facts) -> None:
    e = facts.efficiency
    assert e is not None
    assert list(e.parts_ms) == list(PARTS)
    assert all(v >= 0 for k, v in e.parts_ms.items() if k != "unattributed"), e.parts_ms
    # each part is measured (tests/test_waterfall_raw.py holds them to the raw trace), none
    # scaled: on a rank, the steps' intervals tile its steps, so nothing is left unattributed;
    # the run's is its step clock less the ranks' mean step (the parts are the ranks' means)
    ranks = [r for r in facts.rank_facts if r.efficiency is not None]
    for r in ranks:
        assert abs(r.efficiency.parts_ms["unattributed"]) < 1e-4 * r.efficiency.step_ms, r.efficiency.parts_ms
    mean_step = sum(sum(s.step_ms for s in r.steps) / len(r.steps) for r in ranks) / len(ranks)
    want = facts.step_clock_ms - mean_step
    assert e.parts_ms["unattributed"] == pytest.approx(want if abs(want) >= 1e-3 else 0.0, abs=2e-3)
    # each part's contributors add up to it
    assert sum(e.other_kernels_ms.values()) == pytest.approx(e.parts_ms["other_kernels"], rel=1e-6, abs=1e-9)
    assert sum(e.idle_ms.values()) == pytest.approx(e.parts_ms["gpu_idle"], rel=1e-6, abs=1e-9)
    assert sum(h.gpu_wait_ms_per_step for h in e.hooks) <= e.idle_ms.get("fsdp_hooks", 0.0) + 1e-9


@pytest.mark.parametrize("run_dir", GPU_RUNS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_parts_add_up_and_the_idle_is_the_raw_traces(run_dir, analyzed):
    facts = analyzed(run_dir).facts
    _check_parts(facts)
    truth = raw_idle(run_dir / "rank0.json.gz")
    assert facts.efficiency.parts_ms["gpu_idle"] == pytest.approx(truth["idle_ms"], rel=0.10, abs=0.02)


@pytest.mark.parametrize("path", PUBLIC, ids=lambda p: f"{p.parent.name}/{p.name[:24]}")
def test_parts_add_up_on_public_traces(path, analyzed):
    facts = analyzed(path).facts
    if not facts.gpu_present:
        pytest.skip("no GPU activity")
    _check_parts(facts)
    truth = raw_idle(path)
    if truth is not None:  # traces with ProfilerStep spans (the vLLM one has none)
        assert facts.efficiency.parts_ms["gpu_idle"] == pytest.approx(truth["idle_ms"], rel=0.10, abs=0.02)


@pytest.mark.parametrize(
    "run_dir", [p for p in GPU_RUNS if p.name not in ("inference",)], ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_matmul_at_peak_is_the_models_matmul_flops_at_the_bf16_peak(run_dir, analyzed):
    """Whatever the dtype the run computed in: its matmul FLOPs (from the recorder's model) at
    the dense BF16 peak; their sum with attention's over the step is the MFU."""
    facts = analyzed(run_dir).facts
    e = facts.efficiency
    want = model_flops(f"{run_dir.parent.name}/{run_dir.name}" if run_dir.parent.name != "gpu" else run_dir.name)
    assert e.peak_tflops == 989.0
    assert e.parts_ms["matmul_at_peak"] == pytest.approx(want["matmul"] / BF16_PEAK * 1e3, rel=0.03)
    assert e.parts_ms["attention_at_peak"] == pytest.approx(want["attention"] / BF16_PEAK * 1e3, rel=0.03)
    at = e.parts_ms["matmul_at_peak"] + e.parts_ms["attention_at_peak"]
    assert 100 * at / facts.step_clock_ms == pytest.approx(facts.compute.mfu_pct, rel=0.01)


def test_fp32_run_is_mostly_matmul_below_peak(analyzed):
    """fp32 GEMMs on CUDA cores (gpu/fsdp2): the matmuls' time far from the BF16 peak is the
    step's largest part, and the wrong engine stays the first finding."""
    rep = analyzed(REC / "gpu" / "fsdp2")
    p = rep.facts.efficiency.parts_ms
    assert max(p, key=p.get) == "matmul_below_peak"
    assert p["matmul_below_peak"] > 0.6 * rep.facts.step_clock_ms
    assert rep.findings[0].code == "FSD015"


def test_gpt2_b96_waterfall(analyzed):
    """The H200 GPT-2 run at batch 96 (issue #32): 55 ms = ~17 at peak + matmul / attention below
    peak + ~21.5 of other kernels + ~7.3 idle; the idle sits on the blocks' FSDP2 pre-forward
    hooks, whose CPU time per block is what the raw trace's hook ranges say."""
    rep = analyzed(REC / "gpu-h200" / "gpt2-bf16-b96")
    e = rep.facts.efficiency
    p = e.parts_ms
    assert 20 < p["other_kernels"] < 23 and 6.5 < p["gpu_idle"] < 8.5
    assert max(e.idle_ms, key=e.idle_ms.get) == "fsdp_hooks"
    # each block's pre_forward: CPU per call from the raw ranges (one call per step and block)
    events = _events(REC / "gpu-h200" / "gpt2-bf16-b96" / "rank0.json.gz")
    steps = [e_ for e_ in events if STEP_RX.match(e_.get("name", "")) and e_.get("cat") == "user_annotation"]
    raw: dict[str, float] = {}
    for ev in events:
        m = re.match(r"^FSDP::pre_forward \((transformer\.h\.\d+)\)$", ev.get("name", ""))
        if m and ev.get("cat") == "user_annotation":
            raw[m.group(1)] = raw.get(m.group(1), 0.0) + float(ev["dur"]) / 1e3 / len(steps)
    got = {h.unit: h for h in e.hooks if h.hook == "pre_forward" and h.unit.startswith("transformer.h.")}
    assert set(got) == set(raw) and len(raw) == 6
    for unit, ms in raw.items():
        assert got[unit].cpu_ms_per_step == pytest.approx(ms, rel=0.05)
        assert got[unit].calls_per_step == 1.0
        assert 0.2 < got[unit].gpu_wait_ms_per_step < ms  # the GPU waits for part of each hook
    assert 1.1 < sum(raw.values()) / 6 < 1.5


def test_launch_bound_activities_are_the_raw_traces(analyzed):
    """GPU activities (kernels, copies, memsets) launched per step, and those that ran shorter than
    their own launch call, counted from the raw trace (gpu/fsdp2-bf16, CPU-bound)."""
    path = REC / "gpu" / "fsdp2-bf16" / "rank0.json.gz"
    events = _events(path)
    spans = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if STEP_RX.match(e.get("name", "")) and e.get("cat") == "user_annotation"
    ]
    launch = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})
    }
    total = short = 0
    for e in events:
        call = launch.get((e.get("args") or {}).get("correlation")) if e.get("cat") in GPU_CATS else None
        if call is not None and any(a <= call["ts"] < b for a, b in spans):
            total += 1
            short += float(e["dur"]) < float(call["dur"])
    eff = analyzed(path.parent).facts.efficiency
    assert eff.kernels_per_step == total / len(spans)
    assert eff.launch_bound_kernels_per_step == short / len(spans)
    assert eff.launch_bound_kernels_per_step > 0.4 * eff.kernels_per_step


@pytest.mark.parametrize(
    "pair", [("gpu/fsdp2-ac", "gpu/fsdp2"), ("gpu-h200/gpt2-bf16-b96-ac", "gpu-h200/gpt2-bf16-b96")]
)
def test_recompute_is_what_the_real_twin_runs_less(pair, analyzed):
    """Activation checkpointing's re-run forward, every re-run op: the GPU time its twin without
    checkpointing does not spend (the two runs' own GPU busy time per step, from the timeline)."""
    ac, plain = (analyzed(REC / p).facts for p in pair)
    rec = ac.efficiency.parts_ms["recompute"]
    assert plain.efficiency.parts_ms["recompute"] == 0.0
    extra = ac.timeline.gpu_busy_ms - plain.timeline.gpu_busy_ms
    assert rec == pytest.approx(extra, rel=0.10)


def test_recompute_counts_every_rerun_op_on_the_public_checkpointed_trace(shared_traces, analyzed):
    """The MI300X DDP ResNet with activation checkpointing: the re-run forward's convolutions,
    batch norms and the elementwise ops between them. TraceLens's checkpoint-tree method measures
    1.37 ms a step on it (issue #32); the GEMM / convolution ops alone give 1.20 ms."""
    e = analyzed(shared_traces / "tracelens-mi300-ddp" / "resnet_act_checkpoint.json.gz").facts.efficiency
    assert e.parts_ms["recompute"] == pytest.approx(1.37, rel=0.05)


def test_a_given_peak_resplits_the_parts(analyzed):
    """--peak-tflops: the at-peak parts are the same FLOPs at the given peak, the parts still add up
    to the step, and their share is the MFU against that peak."""
    base = analyzed(REC / "gpu-h200" / "gpt2-bf16-b96").facts.efficiency
    rep = fsdpdoctor.analyze(REC / "gpu-h200" / "gpt2-bf16-b96", config={"peak_tflops": 500.0})
    e = rep.facts.efficiency
    assert e.peak_tflops == 500.0
    assert e.parts_ms["matmul_at_peak"] == pytest.approx(base.parts_ms["matmul_at_peak"] * 989 / 500, rel=1e-9)
    assert sum(e.parts_ms.values()) == pytest.approx(rep.facts.step_clock_ms, rel=1e-6)
    assert e.parts_ms["gpu_idle"] == pytest.approx(base.parts_ms["gpu_idle"], rel=1e-9)
    assert e.mfu_pct == pytest.approx(rep.facts.compute.mfu_pct, rel=1e-6)


def test_compare_splits_the_change_by_the_parts_first(analyzed):
    """The checkpointed GPT-2 run against its twin: the parts' deltas add up to the step-time
    change, and the recompute part carries most of it."""
    from fsdpdoctor.analysis.compare import compare

    ac, plain = (analyzed(REC / "gpu-h200" / v) for v in ("gpt2-bf16-b96-ac", "gpt2-bf16-b96"))
    c = compare(ac.facts, plain.facts, ac.findings, plain.findings)
    assert list(c.waterfall) == list(PARTS)
    assert sum(a - b for b, a in c.waterfall.values()) == pytest.approx(c.step_time_delta_ms, rel=1e-6, abs=1e-6)
    deltas = {k: a - b for k, (b, a) in c.waterfall.items()}
    assert min(deltas, key=deltas.get) == "recompute"
    assert deltas["matmul_at_peak"] == pytest.approx(0.0, abs=1e-6)  # the same model FLOPs


def test_every_launch_call_in_the_public_traces_is_a_launch_to_the_idle_and_the_replay(shared_traces):
    """The runtime calls whose correlation id names a kernel (raw JSON: ``cuda_runtime`` /
    ``cuda_driver`` events linked to a ``kernel``) are launches to both the GPU-idle attribution
    and the what-if replay. The MI300 trace launches with ``hipExtModuleLaunchKernel`` (1,167
    calls), which the idle attribution did not know, and ``hipExtLaunchKernel``, which the replay
    did not."""
    from fsdpdoctor.analysis.efficiency.idle import LAUNCH_CALLS
    from fsdpdoctor.analysis.whatif.graph import LAUNCH_NAMES

    names: set[str] = set()
    for path in [*shared_traces.glob("tracelens-mi300-ddp/*.json.gz"), *shared_traces.glob("hta-df-index-v100/*.gz")]:
        names |= raw(path, _launch_names_of)
    assert {"hipExtModuleLaunchKernel", "hipExtLaunchKernel", "hipLaunchKernel"} <= names
    assert names <= set(LAUNCH_CALLS) and names <= set(LAUNCH_NAMES)


@stdlib_reading(*(PUBLIC_TRACES / d for d in ("tracelens-mi300-ddp", "hta-df-index-v100")))
def _launch_names_of(doc) -> set[str]:
    """The names of the runtime calls linked to a kernel by correlation id (raw JSON)."""
    events = _x_events(doc)
    kernels = {(e.get("args") or {}).get("correlation") for e in events if e.get("cat") == "kernel"}
    return {
        e["name"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
        and (e.get("args") or {}).get("correlation") in kernels
        and "Launch" in e["name"]
    }
