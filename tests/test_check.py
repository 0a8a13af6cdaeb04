"""``check``: CI gates, their thresholds, exit codes, Markdown and JUnit output."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from _suitegen_cache import committed_report
from fixtures.scenarios import generator as gen
from fsdpdoctor.check import (
    CHECK_SETTINGS,
    check_defaults,
    load_check_config,
    run_check,
)
from fsdpdoctor.api import LoadedRun, load_run
from fsdpdoctor.errors import InputError

REGRESSIONS = {
    "prefetch-lost": {"backward_prefetch": None},
    "wrap-changed": {"wrap": "root_only"},
    "offload-on": {"cpu_offload": True},
    "slow-rank": {"slow_rank": 2, "slow_factor": 1.35},
    "fp32-collectives": {"collective_dtype": "fp32"},
}
GATES = [
    "min-overlap",
    "max-exposed-comm",
    "step-time-regression",
    "overlap-drop",
    "exposed-comm-regression",
    "min-mfu",
    "mfu-drop",
    "memory-regression",
    "new-findings",
]


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", *map(str, args)], check=False, capture_output=True, text=True, cwd=cwd
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, generated_run, analyzed_run):
    """name → (trace dir, saved baseline JSON) for the healthy run and each regression (the trace
    dirs are shared by the session: read only)."""
    base = gen.PRESETS["healthy-fsdp2"]
    root = tmp_path_factory.mktemp("check")
    out = {}
    for name, cfg in [("healthy", base)] + [(n, dataclasses.replace(base, **kw)) for n, kw in REGRESSIONS.items()]:
        d = generated_run(cfg)
        saved = root / f"{name}.json"
        saved.write_text(analyzed_run(cfg)[0].to_json())
        out[name] = (d, saved)
    return out


def _hta_window_overlap(truth: dict) -> float:
    """The gate's figure from the generator's truth: per rank Σ overlap / Σ comm over every step
    but the last (Holistic Trace Analysis's window), mean over ranks."""
    pcts = []
    for r in truth["ranks"].values():
        steps = r["steps"][:-1]
        pcts.append(100.0 * sum(s["overlap_ms"] for s in steps) / sum(s["comm_busy_ms"] for s in steps))
    return sum(pcts) / len(pcts)


@pytest.fixture
def iso(tmp_path):
    """A working directory with no pyproject.toml above it that sets check thresholds."""
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    return tmp_path


# ------------------------------------------------------------------------------------------
# exit codes on real pairs
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_against_itself_passes(runs, iso):
    d, saved = runs["healthy"]
    for cur in (d, saved):
        r = cli("check", cur, "--baseline", saved, cwd=iso)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "PASSED" in r.stdout


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_each_regression_fails(runs, iso, name):
    # the regressed run as its saved report (the session's analysis of its traces, written by
    # ``runs``): check on trace folders is run end to end by the tests above and below
    _, saved = runs[name]
    r = cli("check", saved, "--baseline", runs["healthy"][1], "--format", "json", cwd=iso)
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["passed"] is False and res["exit_code"] == 1
    status = {g["name"]: g["status"] for g in res["gates"]}
    assert status["step-time-regression"] == "fail"
    assert res["comparison"]["primary_cause"] in {
        "missing-backward-prefetch",
        "auto-wrap-too-coarse",
        "cpu-offload-stall",
        "straggler-rank",
        "no-mixed-precision-collectives",
    }


def test_improvement_passes(runs, iso):
    """The healthy run (its saved report) checked against a regressed baseline: everything got better."""
    r = cli("check", runs["healthy"][1], "--baseline", runs["prefetch-lost"][1], cwd=iso)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "content",
    [
        None,
        "garbage",
        '{"a": 1}',
        '{"schema_version": 1, "foo": 2}',
        '{"schema_version": 1, "rank_facts": 5}',
        '{"schema_version": 99, "rank_facts": []}',
    ],
)
def test_bad_baseline_exits_2(runs, iso, content):
    bad = iso / "baseline.json"
    if content is not None:
        bad.write_text(content)
    r = cli("check", runs["healthy"][0], "--baseline", bad, cwd=iso)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdpdoctor: error:") and "baseline.json" in lines[0]
    assert "Traceback" not in r.stderr


def test_bad_findings_in_baseline_exit_2(runs, iso):
    doc = json.loads(runs["healthy"][1].read_text())
    doc["findings"] = [{"nope": 1}]
    bad = iso / "b.json"
    bad.write_text(json.dumps(doc))
    r = cli("check", runs["healthy"][0], "--baseline", bad, cwd=iso)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--max-step-regression-pct", "abc"],
        ["--min-overlap", "150"],
        ["--min-overlap", "-1"],
        ["--fail-on-new", "bogus"],
        [],
    ],
)
def test_bad_usage_exits_2(runs, iso, args):
    r = cli("check", *(args or [iso / "missing-dir"]), *([runs["healthy"][0]] if args else []), cwd=iso)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------
# absolute gates (no baseline)
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_absolute_gates(runs, iso):
    healthy, lost = runs["healthy"][0], runs["prefetch-lost"][0]
    th, tl = gen.read_truth(healthy), gen.read_truth(lost)
    # the thresholds below sit between the two runs' true figures
    assert _hta_window_overlap(th) > 80 > _hta_window_overlap(tl)
    assert th["summary"]["exposed_comm_ms_per_step_mean"] < 5 < tl["summary"]["exposed_comm_ms_per_step_mean"]
    # the failing figure from the traces, end to end; the verdicts beside it from the runs' saved
    # reports (the same analysis, made once by ``runs``)
    healthy_saved, lost_saved = runs["healthy"][1], runs["prefetch-lost"][1]
    assert cli("check", healthy_saved, "--min-overlap", 80, cwd=iso).returncode == 0
    r = cli("check", lost, "--min-overlap", 80, "--format", "json", cwd=iso)
    assert r.returncode == 1
    g = {x["name"]: x for x in json.loads(r.stdout)["gates"]}
    assert g["min-overlap"]["status"] == "fail"
    assert g["min-overlap"]["value"] == pytest.approx(_hta_window_overlap(gen.read_truth(lost)), abs=0.1)
    assert g["step-time-regression"]["status"] == "skip"  # no baseline
    assert cli("check", healthy_saved, "--max-exposed-comm-ms", 5, cwd=iso).returncode == 0
    assert cli("check", lost_saved, "--max-exposed-comm-ms", 5, cwd=iso).returncode == 1


def test_cpu_only_overlap_is_not_measured(recorded_run, iso):
    d = recorded_run("per-block")
    # (new findings off: a fresh CPU recording on a loaded machine may show step-time jitter)
    r = cli(
        "check",
        d,
        "--min-overlap",
        80,
        "--max-exposed-comm-ms",
        1,
        "--format",
        "json",
        "--fail-on-new",
        "never",
        cwd=iso,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    g = {x["name"]: x for x in json.loads(r.stdout)["gates"]}
    assert g["min-overlap"]["status"] == "skip" and "not measured" in g["min-overlap"]["detail"]
    assert g["max-exposed-comm"]["status"] == "skip"


@pytest.mark.slow
def test_recorded_pair_new_finding_gate(recorded_run, iso):
    """On CPU, losing backward prefetch is a warning: it fails with --fail-on-new warning."""
    before, after = recorded_run("per-block"), recorded_run("no-backward-prefetch")
    base = iso / "base.json"
    assert cli("analyze", before, "--save-baseline", base, "-o", iso / "r.txt", cwd=iso).returncode == 0
    assert cli("check", before, "--baseline", base, cwd=iso).returncode == 0
    # CPU step times of these tiny runs are noise: gate the configuration change only
    r = cli(
        "check",
        after,
        "--baseline",
        base,
        "--fail-on-new",
        "warning",
        "--max-step-regression-pct",
        "off",
        "--format",
        "json",
        cwd=iso,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads(r.stdout)
    g = {x["name"]: x for x in res["gates"]}
    assert g["new-findings"]["status"] == "fail" and "missing-backward-prefetch" in g["new-findings"]["detail"]
    # the step change is noise here: compare names whichever measured part moved it most (in plain
    # words), not the finding for its own sake (a finding is a cause only for the time it explains)
    comp = res["comparison"]
    if comp["primary_cause"] is not None:
        assert comp["primary_cause_text"] and "_" not in comp["primary_cause_text"].split(" (")[0]
        prim = next(k for k in comp["causes"] if k["slug"] == comp["primary_cause"])
        assert abs(prim["delta_ms"]) >= 0.005 and (prim["delta_ms"] > 0) == (comp["step_time_delta_ms"] > 0)
    r = cli("check", after, "--baseline", base, "--fail-on-new", "never", "--max-step-regression-pct", "off", cwd=iso)
    assert r.returncode == 0


# ------------------------------------------------------------------------------------------
# thresholds from pyproject.toml
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pyproject_thresholds_and_cli_precedence(runs, tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        "[tool.fsdpdoctor.check]\n"
        "max_step_regression_pct = 50\n"
        "max-overlap-drop-pts = 60\n"
        'max_exposed_comm_regression_pct = "off"\n'
        "max_mfu_drop_pct = 40\n"  # same FLOPs in a slower step: MFU falls with the step time
        'fail_on_new = "never"\n'
    )
    lost, base = runs["prefetch-lost"][0], runs["healthy"][1]
    r = cli("check", lost, "--baseline", base, "--format", "json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout
    res = json.loads(r.stdout)
    assert res["settings"]["max_step_regression_pct"] == 50
    assert res["settings"]["max_exposed_comm_regression_pct"] is None
    assert res["settings"]["max_mfu_drop_pct"] == 40
    # the regression shows in MFU too: same FLOPs, longer step
    mfu = next(g for g in res["gates"] if g["name"] == "mfu-drop")
    assert mfu["status"] == "pass" and mfu["value"] > 5
    # the command line wins over pyproject
    lost_saved = runs["prefetch-lost"][1]  # the same run's saved report: no second analysis
    assert cli("check", lost_saved, "--baseline", base, "--max-step-regression-pct", 10, cwd=tmp_path).returncode == 1


def test_pyproject_bad_setting_exits_2(runs, tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.fsdpdoctor.check]\nmax_step_regresion_pct = 5\n")
    r = cli("check", runs["healthy"][0], cwd=tmp_path)
    assert r.returncode == 2 and "max_step_regresion_pct" in r.stderr and "Traceback" not in r.stderr


def test_load_check_config(tmp_path):
    p = tmp_path / "pyproject.toml"
    p.write_text(
        "[tool.fsdpdoctor]\nmin_overlap_pct = 50\n[tool.fsdpdoctor.check]\nmin_overlap = 80\nmax_memory_regression_pct = false\n"
    )
    cfg = load_check_config({"max_exposed_comm_ms": "3.5", "fail_on_new": None}, pyproject=p)
    assert cfg["min_overlap"] == 80 and cfg["max_exposed_comm_ms"] == 3.5
    assert cfg["max_memory_regression_pct"] is None
    assert cfg["fail_on_new"] == "critical"
    assert set(cfg) == set(CHECK_SETTINGS)
    with pytest.raises(InputError):
        load_check_config({"fail_on_new": "sometimes"}, pyproject=p)


# ------------------------------------------------------------------------------------------
# outputs
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_junit_and_markdown(runs, iso):
    junit, md = iso / "out.xml", iso / "out.md"
    r = cli(
        "check", runs["prefetch-lost"][0], "--baseline", runs["healthy"][1], "--junit", junit, "--markdown", md, cwd=iso
    )
    assert r.returncode == 1
    root = ET.parse(junit).getroot()
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == GATES  # one test case per gate
    failed = {c.get("name") for c in cases if c.find("failure") is not None}
    skipped = {c.get("name") for c in cases if c.find("skipped") is not None}
    assert {"step-time-regression", "overlap-drop", "exposed-comm-regression"} <= failed
    assert {"min-overlap", "max-exposed-comm", "memory-regression"} <= skipped  # not set / not measured
    assert int(suite.get("tests")) == len(GATES)
    assert int(suite.get("failures")) == len(failed) and int(suite.get("skipped")) == len(skipped)
    text = md.read_text()
    assert text.startswith("## fsdpdoctor check: ❌ failed")
    assert "| step time | 76.65 ms | 87.82 ms (+14.6%) | ≤ +5% | ❌ **fail** |" in text
    assert "missing-backward-prefetch" in text  # the why, from compare
    # terminal verdict table for CI logs
    assert "FAILED" in r.stdout and "step-time-regression" in r.stdout
    # a passing run writes a passing JUnit file
    r = cli("check", runs["healthy"][1], "--baseline", runs["healthy"][1], "--junit", junit, cwd=iso)
    assert r.returncode == 0
    assert ET.parse(junit).getroot().find("testsuite").get("failures") == "0"


# ------------------------------------------------------------------------------------------
# gates as functions (memory, findings)
# ------------------------------------------------------------------------------------------


def _with_memory(run: LoadedRun, peak: int | None) -> LoadedRun:
    facts = copy.copy(run.facts)
    facts.memory = None if peak is None else SimpleNamespace(peak_allocated_bytes=peak)
    return LoadedRun(facts, run.findings, run.label, run.source)


def test_memory_gate(runs):
    base = load_run(str(runs["healthy"][1]))
    s = check_defaults()
    res = run_check(_with_memory(base, 10 * 2**30), _with_memory(base, 9 * 2**30), s)
    g = {x.name: x for x in res.gates}["memory-regression"]
    assert g.status == "fail" and g.value == pytest.approx(100 / 9 * 1, rel=1e-6)
    res = run_check(_with_memory(base, 9 * 2**30), _with_memory(base, 9 * 2**30), s)
    assert {x.name: x for x in res.gates}["memory-regression"].status == "pass"
    res = run_check(_with_memory(base, None), _with_memory(base, 9 * 2**30), s)
    g = {x.name: x for x in res.gates}["memory-regression"]
    assert g.status == "skip" and "not measured" in g.detail


def test_new_critical_finding_gate(runs):
    from fsdpdoctor.engine import Finding

    base = load_run(str(runs["healthy"][1]))
    crit = Finding(slug="cpu-offload-stall", code="FSD005", severity="critical", summary="x")
    cur = LoadedRun(base.facts, [crit], "cur", "traces")
    s = check_defaults()
    assert not run_check(cur, base, s).passed
    # present in the baseline already → not new
    assert run_check(cur, LoadedRun(base.facts, [crit], "b", "traces"), s).passed
    # a warning does not trip the default (critical) level, but does with fail_on_new=warning
    warn = dataclasses.replace(crit, severity="warning")
    cur = LoadedRun(base.facts, [warn], "cur", "traces")
    assert run_check(cur, base, s).passed
    assert not run_check(cur, base, s | {"fail_on_new": "warning"}).passed
    # without a baseline every finding counts as new
    assert not run_check(LoadedRun(base.facts, [crit], "cur", "traces"), None, s).passed


def test_exposed_comm_noise_floor(runs):
    base = load_run(str(runs["healthy"][1]))
    facts = copy.deepcopy(base.facts)
    facts.exposed_comm.mean_ms_per_step = base.facts.exposed_comm.mean_ms_per_step + 0.01  # +0.4%, tiny
    res = run_check(
        LoadedRun(facts, base.findings, "c", "t"), base, check_defaults() | {"max_exposed_comm_regression_pct": 0.1}
    )
    assert {x.name: x for x in res.gates}["exposed-comm-regression"].status == "pass"


@pytest.mark.parametrize("queue", [96, 0], ids=["queue-fills", "queue-never-fills"])
def test_a_gpu_twice_as_slow_fails_the_step_gate_on_a_gpu_bound_run(tmp_path, iso, queue, generated_run, analyzed_run):
    """GPU-bound (the generator's gpu-bound preset: no per-step sync, a warm-up backlog), the
    same run with the GPU at half its throughput. With a launch queue that fills, the CPU spans
    grow with the GPU; with one that never fills (queue 0) the CPU runs ahead and its spans barely
    move: the step clock sees the GPU either way. The generator's truth gives the rise."""
    base = dataclasses.replace(gen.PRESETS["gpu-bound"], launch_queue_depth=queue)
    slow = dataclasses.replace(base, gpu_tflops=base.gpu_tflops / 2)
    d0, d1 = generated_run(base), generated_run(slow)
    saved = tmp_path / "base.json"
    saved.write_text(analyzed_run(base)[0].to_json())  # fsdpdoctor.analyze(d0), once per session

    def step(d):
        ranks = gen.read_truth(d)["ranks"]
        return max(v["wall_ms_per_step"] for v in (ranks.values() if isinstance(ranks, dict) else ranks))

    rise = 100 * (step(d1) / step(d0) - 1)
    assert rise > 20
    r = cli("check", d1, "--baseline", saved, "--format", "json", cwd=iso)
    assert r.returncode == 1, r.stdout + r.stderr
    gates = {g["name"]: g for g in json.loads(r.stdout)["gates"]}
    gate = gates["step-time-regression"]
    assert gate["status"] == "fail"
    assert gate["value"] == pytest.approx(rise, abs=1.0)
    # MFU falls by the same factor (same FLOPs, generator truth): 1 − step before / step after
    assert gates["mfu-drop"]["status"] == "fail"
    assert gates["mfu-drop"]["value"] == pytest.approx(100 * (1 - step(d0) / step(d1)), abs=1.0)


# ------------------------------------------------------------------------------------------
# the tool's own fix passes; schema-4 baselines read with the conventional MFU (#33)
# ------------------------------------------------------------------------------------------

GPU_REC = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu"


@pytest.mark.slow
def test_the_tools_own_fix_passes_every_gate(tmp_path):
    """fp32 → bf16 (FSD015's fix) on the H100: the step falls by half; MFU (against the BF16 peak)
    doubles; the new finding on the GPU waiting for FSDP's hooks is where the bottleneck moved, not a
    regression."""
    base = tmp_path / "fsdp2.json"
    r = cli("analyze", GPU_REC / "fsdp2", "--save-baseline", base, "--format", "json", "-o", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    r = cli("check", GPU_REC / "fsdp2-bf16", "--baseline", base, "--format", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    g = {x["name"]: x for x in json.loads(r.stdout)["gates"]}
    assert g["step-time-regression"]["status"] == "pass" and g["mfu-drop"]["status"] == "pass"
    assert g["new-findings"]["status"] == "pass" and "gpu-starved-by-hooks" in g["new-findings"]["detail"]
    assert "the step got faster" in g["new-findings"]["detail"]


def test_mfu_drop_passes_when_the_step_got_faster(tmp_path):
    """A run doing less work per step (half the batch) can show a lower MFU while its step got
    faster: the MFU gate says so and passes; the same MFU drop with a slower step fails."""
    from fsdpdoctor.check import run_check
    from fsdpdoctor.config import defaults  # noqa: F401  (the gate settings below are check's own)

    rep = committed_report(GPU_REC / "fsdp2")  # fsdpdoctor.analyze, once per process (shared: read only)
    base = LoadedRun(rep.facts, rep.findings, "base", "traces")
    cur_facts = copy.deepcopy(rep.facts)
    cur_facts.compute.mfu_pct = rep.facts.compute.mfu_pct * 0.5
    for rf in cur_facts.rank_facts:
        for s in rf.steps:
            s.step_ms *= 0.8
    cur_facts.steps.mean_ms *= 0.8
    cur = LoadedRun(cur_facts, rep.findings, "cur", "traces")
    settings = {"max_mfu_drop_pct": 5.0, "max_step_regression_pct": 5.0, "fail_on_new": "never"}
    res = run_check(cur, base, settings)
    g = {x.name: x for x in res.gates}
    assert g["mfu-drop"].status == "pass" and "the step got faster" in g["mfu-drop"].detail
    for rf in cur_facts.rank_facts:
        for s in rf.steps:
            s.step_ms *= 1.0 / 0.8 * 1.01
    cur_facts.steps.mean_ms *= 1.0 / 0.8 * 1.01
    res = run_check(LoadedRun(cur_facts, rep.findings, "cur", "traces"), base, settings)
    assert {x.name: x for x in res.gates}["mfu-drop"].status == "fail"


def test_a_schema_4_baseline_reads_with_the_conventional_mfu(tmp_path):
    """Schema 4 wrote MFU against the run's own dtype (fp32: 67 TFLOP/s on the H100) and the BF16
    figure beside it; read back, mfu_pct is the BF16 one (≈4.7%), the fp32 one is dtype_mfu_pct."""
    from fsdpdoctor.facts import RunFacts

    rep = committed_report(GPU_REC / "fsdp2")  # fsdpdoctor.analyze, once per process (shared: read only)
    doc = json.loads(rep.to_json())
    c = doc["compute"]
    bf16, fp32 = c["mfu_pct"], c["dtype_mfu_pct"]
    # the report as schema 4 wrote it (its field names and meanings)
    old = {k: v for k, v in c.items() if not k.startswith("dtype_")}
    old.update(
        peak_tflops=67.0,
        peak_dtype="fp32",
        bf16_peak_tflops=989.0,
        mfu_pct=fp32,
        mfu_bf16_pct=bf16,
        hfu_pct=c["hfu_pct"] * 989.0 / 67.0,
    )
    doc["compute"] = old
    doc["schema_version"] = 4
    for s in doc["rank_summaries"]:
        s["mfu_pct"] = fp32
    path = tmp_path / "v4.json"
    path.write_text(json.dumps(doc))
    f = RunFacts.load(path)
    assert f.compute.mfu_pct == pytest.approx(bf16) and 4.0 < f.compute.mfu_pct < 5.5
    assert f.compute.dtype_mfu_pct == pytest.approx(fp32) and f.compute.dtype_peak_tflops == 67.0
    assert f.compute.peak_tflops == 989.0 and f.compute.hfu_pct == pytest.approx(c["hfu_pct"])
    assert f.rank_summaries[0].mfu_pct == pytest.approx(bf16)
    assert any("saved by schema 4" in n for n in f.notes)
    r = cli("check", GPU_REC / "fsdp2-bf16", "--baseline", path, "--format", "json")
    g = {x["name"]: x for x in json.loads(r.stdout)["gates"]}
    assert g["mfu-drop"]["status"] == "pass" and r.returncode == 0, r.stdout
