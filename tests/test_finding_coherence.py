"""Findings an expert would sign, on every input the project has: each public trace, every
recorded run (CPU shapes and the GPU recordings) and every generated scenario.

- no saving above what a step can hold, read from the raw trace files here (json/gzip, none of
  fsdpdoctor): a rank's whole span per ProfilerStep for every fix, its GPU activity's span per
  step for fixes of GPU time;
- severity is monotone in the saving: a larger saving never ranks below a smaller one;
- no FSDP code when FSDP is not detected, and only the detected FSDP version's code when it is;
  no training advice (data loaders, optimizers, FSDP) for an inference run;
- a straggler is named only in the generated run whose truth made one rank slow, and it is that rank;
- shares say what they are a share of;
- traces of different runs are refused (exit 2, one line naming what differs) unless
  ``--allow-mixed-runs``.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpdoctor
from _suitepub_cache import raw, report, stdlib_reading
from conftest import PUBLIC_TRACES, REPO, public_trace_files
from fixtures.scenarios import generator as gen
from fsdpdoctor.config import defaults
from fsdpdoctor.engine import load_rules

CFG = defaults()
CLOCK = {r.slug: r.saves_on for r in load_rules()}
# the rules whose fix also removes time outside the GPU window: exactly these, each for its reason
STEP_CLOCK_RULES = {"cpu-offload-stall", "step-time-jitter", "sharding-strategy", "ddp-would-be-faster"}
FSDP_CODE = re.compile(
    r"fully_shard|FullyShardedDataParallel|\bFSDP\(|CPUOffloadPolicy|MixedPrecisionPolicy|"
    r"BackwardPrefetch|ShardingStrategy|set_modules_to_|set_requires_gradient_sync"
)
TRAINING_ADVICE = re.compile(
    r"DataLoader|optimizer|backward|fully_shard|FSDP(?!doctor)|DistributedDataParallel|bucket_cap_mb", re.I
)
GPU_RECORDED = REPO / "fixtures" / "recorded" / "gpu"
MULTI_RANK_PUBLIC = ("param-dlrm-v100-8ranks", "hta-sampled-128ranks")


SEV_ORDER = {"critical": 0, "warning": 1, "info": 2}


def raw_step_bounds(paths) -> tuple[float, float]:
    """(wall ms, GPU ms) per step, read from the raw trace files here with json/gzip and nothing
    of fsdpdoctor: for each rank, its whole span (first event start to last event end) and its
    GPU activity's span, divided by its ProfilerStep count (1 without any); the largest over the
    ranks. No fix can save more per step than a rank's whole trace per step. (Each file read
    once per session, a public one in the stdlib pass the session makes: ``_suitepub_cache.raw``.)"""
    wall = gpu = 0.0
    for p in paths:
        w, g = raw(p, _step_bounds_of)
        wall = max(wall, w)
        if g is not None:
            gpu = max(gpu, g)
    return wall, gpu


@stdlib_reading()
def _step_bounds_of(doc) -> tuple[float, float | None]:
    """One rank's (wall ms, GPU ms or None without GPU activity) per step (:func:`raw_step_bounds`)."""
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    # one ProfilerStep#N per step (Kineto also mirrors it on the GPU timeline: count names)
    n = len({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}) or 1
    ends = [e["ts"] + max(e.get("dur", 0), 0) for e in events]
    wall = (max(ends) - min(e["ts"] for e in events)) / 1e3 / n
    g = [
        (e["ts"], e["ts"] + max(e.get("dur", 0), 0))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset")
    ]
    return wall, ((max(b for _, b in g) - min(a for a, _ in g)) / 1e3 / n if g else None)


def trace_files(path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(q for q in path.glob("*.json*") if q.name != "fsdpdoctor_meta.json" and "truth" not in q.name)


def check_report(rep: fsdpdoctor.Report, what: str, files=None) -> None:
    f = rep.facts
    fsdp = f.fsdp.version
    wall, gpu = raw_step_bounds(files) if files else (None, None)
    graded = sorted((x for x in rep.findings if x.est_saving_ms is not None), key=lambda x: -x.est_saving_ms)
    for a, b in zip(graded, graded[1:]):  # a larger saving never ranks below a smaller one
        assert SEV_ORDER[a.severity] <= SEV_ORDER[b.severity], (
            f"{what}: {a.slug} {a.severity} above {b.slug} {b.severity}"
        )
    for x in rep.findings:
        where = f"{what}: {x.slug}"
        if x.est_saving_ms is not None:
            assert x.est_saving_ms >= 0, where
            if wall:
                assert x.est_saving_ms <= wall * 1.001, (
                    f"{where} saves {x.est_saving_ms} ms of a {wall} ms step (raw trace)"
                )
            if gpu and CLOCK[x.slug] == "gpu" and f.gpu_present:
                assert x.est_saving_ms <= gpu * 1.001, (
                    f"{where} saves {x.est_saving_ms} ms of {gpu} ms of GPU span per step"
                )
        code = "\n".join(x.fix.values())
        if fsdp is None and (f.memory is None or f.memory.fsdp_version is None):
            assert not {"fsdp1", "fsdp2"} & set(x.fix), where
            assert not FSDP_CODE.search(code), f"{where}: FSDP code without FSDP: {code}"
        elif fsdp is not None:
            assert f"fsdp{3 - fsdp}" not in x.fix, f"{where}: code for the other FSDP version"
        if f.workload == "inference":
            assert set(x.fix) <= {"inference", "any"}, where
            if x.slug != "fsdp-not-detected":  # its fix is how to record a trace
                assert not TRAINING_ADVICE.search(code), f"{where}: training advice for an inference run: {code}"
        for line in x.evidence + [x.summary]:
            assert "% of the step" not in line, f"{where}: a share that does not say of what: {line}"


# ---------------------------------------------------------------------------------------------
# every input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", public_trace_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_public_trace_files(path, public_report):
    check_report(public_report(path), str(path), [path])  # (conftest: analysed once per process)


@pytest.mark.parametrize("name", MULTI_RANK_PUBLIC)
def test_public_multi_rank_runs(name):
    d = PUBLIC_TRACES / name
    if not d.is_dir():
        pytest.skip("../shared/traces/public is absent")
    rep = report(d)  # fsdpdoctor.analyze(d), once per session (shared with test_savings)
    assert not rep.facts.mixed_runs  # one run: nothing refused, nothing flagged
    check_report(rep, name, trace_files(d))


def test_dlrm_rank1_waits_most_and_no_straggler():
    """The issue's case: rank 1 seemed to compute 17% longer than the median, but 64 of its GPU
    kernels were the warm-up backlog (launched before the profiler's window: no launch call in
    its file), which belongs to no step. Left out, no rank computes much longer than the median,
    rank 1 waits the longest at collectives, and it is no straggler. The straggler is rank 7, the
    one the others wait for (issue 36: it arrives last, its GPU computing like theirs)."""
    d = PUBLIC_TRACES / "param-dlrm-v100-8ranks"
    if not d.is_dir():
        pytest.skip("../shared/traces/public is absent")
    rep = report(d)  # fsdpdoctor.analyze(d), once per session
    f = rep.facts
    compute = {r.rank: statistics.fmean(s.compute_ms for s in r.steps) for r in f.rank_facts}
    median = statistics.median(compute.values())
    assert max(compute.values()) < median * (1 + CFG["straggler_pct"] / 100)
    assert next(r for r in f.rank_facts if r.rank == 1).backlog_ops == 64  # launch-less kernels in worker1's file
    wait = {w.rank: w.wait_ms_per_step for w in f.cross_rank.ranks}
    assert max(wait, key=wait.get) == 1
    stragglers = [x for x in rep.findings if x.slug == "straggler-rank"]
    assert [x.where["rank"] for x in stragglers] == [7]
    assert "computes no longer than theirs" in stragglers[0].summary


@pytest.mark.parametrize(
    "variant",
    sorted(
        f"{s.name}/{p.name}"
        for s in (GPU_RECORDED, GPU_RECORDED.with_name("gpu-h200"))
        for p in s.iterdir()
        if p.is_dir()
    ),
)
def test_gpu_recordings(variant):
    d = GPU_RECORDED.parent / variant
    snap = d / "rank0.memory.pickle.gz"
    rep = fsdpdoctor.analyze(d, memory=[snap] if snap.exists() else None)
    check_report(rep, variant, trace_files(d))
    assert not any(x.slug in ("sharding-strategy", "ddp-would-be-faster") for x in rep.findings)  # one GPU
    assert rep.facts.strategy is None


def test_gpu_inference_recording_gets_inference_advice():
    """The recorded forward-only run idles ~19% of its GPU window: host-bound at a 10% threshold,
    and its advice is for inference (CUDA graphs), not a data loader."""
    from fsdpdoctor.engine import run_rules

    rep = fsdpdoctor.analyze(GPU_RECORDED / "inference")
    f = rep.facts
    assert f.workload == "inference"
    idle_pct = 100 * f.timeline.idle_ms / f.timeline.gpu_window_ms
    cfg = defaults() | {"host_bound_idle_pct": idle_pct / 2}
    host = next(x for x in run_rules(f, cfg) if x.slug == "host-bound")
    assert set(host.fix) == {"inference"} and "CUDA graph" in host.fix["inference"]
    assert not TRAINING_ADVICE.search(host.fix["inference"])


def test_gpu_offload_saving_exceeds_the_window_and_matches_the_twin():
    """CPU offload's cost is mostly the CPU optimizer step, which runs outside the GPU window
    while the GPU idles: its saving is bounded by the wall-clock step, not the window. The
    recording without offload (same model, same GPU) is the fix applied."""
    off = fsdpdoctor.analyze(GPU_RECORDED / "fsdp2-offload")
    twin = fsdpdoctor.analyze(GPU_RECORDED / "fsdp2").facts
    stall = next(x for x in off.findings if x.slug == "cpu-offload-stall")
    real = off.facts.step_clock_ms - twin.step_clock_ms
    assert stall.est_saving_ms > off.facts.timeline.gpu_window_ms
    assert stall.est_saving_ms == pytest.approx(real, rel=0.1)
    assert stall.severity == "critical"


@pytest.mark.parametrize(
    "variant",
    [
        "per-block",
        "root-only",
        "per-linear",
        "no-backward-prefetch",
        "no-reshard",
        "bf16-mp",
        "ddp",
        "fsdp1",
        "ga-fsdp2",
        "ga-fsdp1",
        "ac",
        "hsdp",
        "tp-fsdp",
    ],
)
def test_recorded_runs(variant, recorded_report, recorded_run):
    check_report(recorded_report(variant), f"recorded/{variant}", trace_files(recorded_run(variant)))


@pytest.mark.parametrize("name", sorted(gen.PRESETS))
def test_generated_scenarios(name, scenario_case):
    rep, truth = scenario_case(name)
    check_report(rep, f"scenario/{name}", trace_files(scenario_case.dirs[name]))
    # a straggler is named only where the generator made one slow, and then that rank
    slow = truth["config"].get("slow_rank")
    named = [x.where["rank"] for x in rep.findings if x.slug == "straggler-rank"]
    assert named == ([] if slow is None else [slow]), (name, slow, named)


def test_slow_rank_scenario_names_the_injected_straggler(scenario_case):
    rep, truth = scenario_case("slow-rank")
    x = next(x for x in rep.findings if x.slug == "straggler-rank")
    assert x.where["rank"] == truth["config"]["slow_rank"]


def test_a_tiny_saving_is_info(scenario_case):
    """Severity follows the share: the same finding on the same run drops to info when its
    saving is made small (here: a warning share above any real saving)."""
    from fsdpdoctor.engine import run_rules

    rep, _ = scenario_case("no-backward-prefetch-fsdp2")
    cfg = defaults()
    assert {x.slug: x.severity for x in run_rules(rep.facts, cfg)}["missing-backward-prefetch"] != "info"
    cfg["severity_warning_pct"] = cfg["severity_critical_pct"] = 101.0
    assert {x.slug: x.severity for x in run_rules(rep.facts, cfg)}["missing-backward-prefetch"] == "info"


# ---------------------------------------------------------------------------------------------
# traces of different runs
# ---------------------------------------------------------------------------------------------


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_mixed_2022_folder_is_refused_unless_allowed(tmp_path):
    """hta-ddp-v100-2022 holds rank 3 of an 8-rank A100 job and rank 1 of a 2-rank V100 job."""
    d = PUBLIC_TRACES / "hta-ddp-v100-2022"
    if not d.is_dir():
        pytest.skip("../shared/traces/public is absent")
    proc = _cli("analyze", d)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    line = lines[0]
    for what in (
        "control-rank-3.json.gz",
        "test-rank-1.json.gz",
        "world size 2",
        "vs 8",
        "Tesla V100-SXM2-16GB",
        "NVIDIA A100-PG509-200",
        "days apart",
        "--allow-mixed-runs",
    ):
        assert what in line, (what, line)
    for cmd in (("compare", d, d), ("check", d)):
        p = _cli(*cmd)
        assert p.returncode == 2 and "not one run" in p.stderr, cmd
    out = tmp_path / "r.json"
    ok = _cli("analyze", d, "--allow-mixed-runs", "--format", "json", "-o", out)
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(out.read_text())
    assert any("world size" in m for m in doc["mixed_runs"])
    assert "straggler-rank" not in {x["slug"] for x in doc["findings"]}  # different machines are not compared
    assert doc["notes"][0].startswith("inputs from different runs")
