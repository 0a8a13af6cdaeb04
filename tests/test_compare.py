"""``compare``: the step-time delta split into parts that add up, and the primary cause.

Generated GPU pairs (``fixtures/scenarios/generator.py``): the healthy FSDP2 preset and the same
config with exactly one knob changed, so the injected cause and the ground truth
(``truth.json``) are known. Recorded CPU pairs (real torch + gloo runs): no GPU timeline, so the
split is by CPU phase with FSDP hook CPU time apart, and the primary cause is the measured part
that moved the step most (tests/test_compare_causes.py checks it against the raw traces).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from fsdpdoctor.analysis.compare import CPU_COMPONENTS, GPU_COMPONENTS, compare
from fsdpdoctor.api import load_run
from fsdpdoctor.report.comparison import render_markdown, to_json

# name → (knob changed from the healthy preset, finding slug it must be blamed on)
PAIRS = {
    "prefetch-lost": ({"backward_prefetch": None}, "missing-backward-prefetch"),
    "wrap-changed": ({"wrap": "root_only"}, "auto-wrap-too-coarse"),
    "offload-on": ({"cpu_offload": True}, "cpu-offload-stall"),
    "slow-rank": ({"slow_rank": 2, "slow_factor": 1.35}, "straggler-rank"),
    "fp32-collectives": ({"collective_dtype": "fp32"}, "no-mixed-precision-collectives"),
}


@pytest.fixture(scope="module")
def generated(generated_run, analyzed_run):
    """name → (dir, Report, truth) for the healthy run and each one-knob variant (the dirs are
    shared by the session: read only)."""
    from fixtures.scenarios import generator as gen

    base = gen.PRESETS["healthy-fsdp2"]
    out = {}
    for name, cfg in [("healthy", base)] + [(n, dataclasses.replace(base, **kw)) for n, (kw, _) in PAIRS.items()]:
        out[name] = (generated_run(cfg), *analyzed_run(cfg))
    return out


def _cmp(generated, before: str, after: str):
    _, rb, _ = generated[before]
    _, ra, _ = generated[after]
    return compare(rb.facts, ra.facts, rb.findings, ra.findings, before_label=before, after_label=after)


def _causes_sum(c) -> float:
    return sum(k.delta_ms for k in c.causes)


@pytest.mark.parametrize("name", list(PAIRS))
def test_generated_pair_primary_cause_and_sum(generated, name):
    c = _cmp(generated, "healthy", name)
    tb, ta = generated["healthy"][2]["summary"], generated[name][2]["summary"]
    measured = ta["wall_ms_mean"] - tb["wall_ms_mean"]  # ground truth from the generator
    assert c.basis == "gpu"
    assert c.step_time_delta_ms == pytest.approx(measured, abs=2e-3)
    assert c.step_time_delta_ms > 0
    assert c.step_time_delta_pct == pytest.approx(100 * measured / tb["wall_ms_mean"], rel=1e-3)
    # the parts add up to the measured delta (within 1%; by construction exactly)
    assert abs(c.components_sum_ms - measured) <= 0.01 * abs(measured)
    assert c.components_sum_ms == pytest.approx(c.step_time_delta_ms, abs=1e-6)
    assert _causes_sum(c) == pytest.approx(c.step_time_delta_ms, abs=1e-6)
    # the injected cause is named, and it carries most of the delta
    expected = PAIRS[name][1]
    assert c.primary_cause == expected
    prim = c.primary
    assert prim.kind == "finding" and prim.status == "appeared"
    assert prim.fix, "the primary finding's fix is included"
    assert prim.delta_ms >= 0.8 * c.step_time_delta_ms
    assert c.causes[0].slug == expected
    # every component is present and the set is the documented one
    assert set(c.component_totals()) == set(GPU_COMPONENTS)


@pytest.mark.parametrize("name", list(PAIRS))
def test_generated_pair_components_match_truth(generated, name):
    """compute and exposed all-gather / reduce-scatter deltas equal the generator's ground truth."""
    c = _cmp(generated, "healthy", name)
    tb, ta = generated["healthy"][2]["summary"], generated[name][2]["summary"]
    tot = c.component_totals()

    def d(key):
        b, a = tot[key]
        return a - b

    assert d("compute") == pytest.approx(
        ta["compute_busy_ms_per_step_mean"] - tb["compute_busy_ms_per_step_mean"], abs=2e-3
    )
    for comp, kind in (("exposed_all_gather", "all_gather"), ("exposed_reduce_scatter", "reduce_scatter")):
        want = ta["exposed_by_collective_ms_per_step_mean"][kind] - tb["exposed_by_collective_ms_per_step_mean"][kind]
        assert d(comp) == pytest.approx(want, abs=2e-3)
    exp = sum(d(k) for k in ("exposed_all_gather", "exposed_reduce_scatter", "exposed_other_comm"))
    assert exp == pytest.approx(ta["exposed_comm_ms_per_step_mean"] - tb["exposed_comm_ms_per_step_mean"], abs=2e-3)
    # exposed comm by phase also matches
    for phase in ("forward", "backward"):
        got = sum(x.delta_ms for x in c.components if x.phase == phase)
        want = ta["exposed_by_phase_ms_per_step_mean"][phase] - tb["exposed_by_phase_ms_per_step_mean"][phase]
        assert got == pytest.approx(want, abs=2e-3)


def test_structure_changes_name_the_knob(generated):
    def changed(name):
        return {s.key: (s.before, s.after) for s in _cmp(generated, "healthy", name).structure if s.changed}

    assert changed("prefetch-lost")["backward_prefetch"] == ("BACKWARD_PRE", "NONE")
    assert changed("wrap-changed")["unit_count"] == ("9", "1")  # root + 8 blocks → root only
    assert changed("offload-on")["cpu_offload"] == ("no", "yes")
    fp32 = changed("fp32-collectives")
    assert fp32["mixed_precision"] == ("yes", "no")
    assert fp32["dtype.all_gather"] == ("BFloat16", "Float")
    # bytes per all-gather double with fp32
    c = _cmp(generated, "healthy", "fp32-collectives")
    ag = {r.unit: r for r in c.collectives if r.kind == "all_gather" and r.phase == "forward"}
    assert ag["layers.0"].bytes[1] == pytest.approx(2 * ag["layers.0"].bytes[0])
    # the slow rank changes no configuration; the per-rank rows show which rank slowed down
    assert changed("slow-rank") == {}
    ranks = _cmp(generated, "healthy", "slow-rank").ranks
    dcomp = {r.rank: r.compute_after_ms - r.compute_before_ms for r in ranks}
    assert max(dcomp, key=dcomp.get) == 2
    assert dcomp[2] == pytest.approx(0.35 * ranks[2].compute_before_ms, rel=0.05)


def test_units_aligned_by_fqn(generated):
    c = _cmp(generated, "healthy", "wrap-changed")
    status = {u.fqn: u.status for u in c.units}
    assert status[""] == "both"
    assert {f"layers.{i}" for i in range(8)} == {k for k, v in status.items() if v == "removed"}
    assert c.alignment["units"]["only_before"] == sorted(f"layers.{i}" for i in range(8))
    assert c.alignment["ranks"]["common"] == [0, 1, 2, 3]


def test_offload_time_outside_the_gpu_window_is_counted(generated):
    """The CPU optimizer step of an offloaded run has no GPU work: it lands in 'other idle'."""
    c = _cmp(generated, "healthy", "offload-on")
    tot = c.component_totals()
    other = tot["other_idle"][1] - tot["other_idle"][0]
    assert other > 0.5 * c.step_time_delta_ms
    assert "other_idle@all" in c.primary.parts


def test_reverse_direction_blames_the_finding_that_went_away(generated):
    c = _cmp(generated, "prefetch-lost", "healthy")
    assert c.step_time_delta_ms < 0
    assert c.primary_cause == "missing-backward-prefetch"
    assert c.primary.status == "disappeared"
    assert c.primary.delta_ms < 0
    assert _causes_sum(c) == pytest.approx(c.step_time_delta_ms, abs=1e-6)


def test_run_against_itself_has_no_cause(generated):
    c = _cmp(generated, "healthy", "healthy")
    assert c.step_time_delta_ms == 0
    assert c.components_sum_ms == pytest.approx(0, abs=1e-9)
    assert c.primary_cause is None
    assert not [s for s in c.structure if s.changed]
    assert all(f.status == "persisting" for f in c.findings)


def test_outputs(generated):
    c = _cmp(generated, "healthy", "prefetch-lost")
    d = json.loads(to_json(c))
    assert d["step_time_delta_ms"] == pytest.approx(c.step_time_delta_ms)
    assert d["step_time_delta_pct"] == pytest.approx(c.step_time_delta_pct)
    assert d["primary_cause"] == "missing-backward-prefetch"
    assert d["causes"][0]["slug"] == "missing-backward-prefetch"
    assert all({"slug", "delta_ms"} <= set(x) for x in d["causes"])
    assert sum(x["delta_ms"] for x in d["causes"]) == pytest.approx(d["step_time_delta_ms"], abs=1e-6)
    assert sum(v["delta_ms"] for v in d["components"].values()) == pytest.approx(d["step_time_delta_ms"], abs=1e-6)
    assert "step completions" in d["basis_definition"]
    md = render_markdown(c)
    assert md.startswith("# Step time 76.")
    # the primary cause is the measured part, with its sign, and the finding that explains it
    assert "Primary cause: exposed reduce-scatter in backward +" in md
    assert "Explained by `missing-backward-prefetch` (warning, appeared)" in md
    assert "set_modules_to_backward_prefetch" in md  # the FSDP2 fix
    assert "Fix (fsdp2)" in md and "Fix (fsdp1)" not in md  # code for the run's FSDP version only
    assert "| backward prefetch | BACKWARD_PRE | NONE |" in md
    from rich.console import Console

    from fsdpdoctor.report.comparison import render_terminal

    con = Console(record=True, width=120)
    render_terminal(c, con)
    text = con.export_text()
    assert "missing-backward-prefetch" in text and "Step time" in text


@pytest.mark.slow
def test_cli_compare_traces_and_saved_facts(generated, tmp_path):
    d_before, _, _ = generated["healthy"]
    d_after, _, _ = generated["wrap-changed"]
    saved = tmp_path / "before.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdpdoctor",
            "analyze",
            str(d_before),
            "--save-baseline",
            str(saved),
            "-o",
            str(tmp_path / "r.txt"),
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    outs = []
    for before in (str(d_before), str(saved)):
        r = subprocess.run(
            [sys.executable, "-m", "fsdpdoctor", "compare", before, str(d_after), "--format", "json"],
            check=False,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    for d in outs:
        assert d["primary_cause"] == "auto-wrap-too-coarse"
    assert outs[0]["step_time_delta_ms"] == pytest.approx(outs[1]["step_time_delta_ms"], abs=1e-9)
    assert [c["slug"] for c in outs[0]["causes"]] == [c["slug"] for c in outs[1]["causes"]]
    # the other formats on the same pair, both as saved reports (the after run's: the session's
    # analysis of its traces; compare on trace folders ran above)
    saved_after = tmp_path / "after.json"
    saved_after.write_text(generated["wrap-changed"][1].to_json())
    for fmt in ("terminal", "markdown"):
        r = subprocess.run(
            [sys.executable, "-m", "fsdpdoctor", "compare", str(saved), str(saved_after), "--format", fmt],
            check=False,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        assert "auto-wrap-too-coarse" in r.stdout


def test_cli_compare_bad_input(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1}')
    r = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "compare", str(bad), str(bad)], check=False, capture_output=True, text=True
    )
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------
# recorded CPU pairs (real torch 2.13 + gloo runs, no GPU timeline)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(recorded_run):
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = load_run(str(recorded_run(variant)))
        return cache[variant]

    return get


def _rec(recorded, before, after):
    b, a = recorded(before), recorded(after)
    return compare(b.facts, a.facts, b.findings, a.findings, before_label=before, after_label=after)


def _mean_step(facts):
    per_rank = [sum(s.step_ms for s in r.steps) / len(r.steps) for r in facts.rank_facts]
    return sum(per_rank) / len(per_rank)


# The finding each change brings (a configuration the traces show: robust). Which measured part
# moved the step most is not: these runs are recorded afresh on a machine shared with other work,
# and their CPU step times move by tens of ms from one recording to the next (per-block's FSDP hook
# CPU time 33.8 ms in the committed recording, 77.9 ms in one made under load), so the primary cause
# is checked for what holds in any recording: measured, moving the step the way it moved, and never
# a finding that explains no measured time (it used to be the configuration finding, 0 ms and all).
# tests/test_compare_causes.py checks the primary cause of the committed recordings against their
# raw traces.
@pytest.mark.parametrize(
    "before,after,finding",
    [
        ("per-block", "no-backward-prefetch", "missing-backward-prefetch"),
        ("per-block", "root-only", "auto-wrap-too-coarse"),
        ("per-block", "per-linear", "auto-wrap-too-fine"),
        ("bf16-mp", "per-block", "no-mixed-precision-collectives"),
        ("per-block", "ddp", "fsdp-not-detected"),
    ],
)
def test_recorded_pairs(recorded, before, after, finding):
    c = _rec(recorded, before, after)
    assert c.basis == "cpu"
    assert c.step_time_delta_ms == pytest.approx(
        _mean_step(recorded(after).facts) - _mean_step(recorded(before).facts), abs=1e-9
    )
    assert abs(c.components_sum_ms - c.step_time_delta_ms) <= 0.01 * abs(c.step_time_delta_ms) + 1e-9
    assert _causes_sum(c) == pytest.approx(c.step_time_delta_ms, abs=1e-6)
    assert set(c.component_totals()) == set(CPU_COMPONENTS)
    f = next(k for k in c.causes if k.slug == finding)
    assert f.kind == "finding" and f.status == "appeared"
    p = c.primary
    if p is not None:  # measured, and moving the step the way it moved
        assert abs(p.delta_ms) >= 0.005 and (p.delta_ms > 0) == (c.step_time_delta_ms > 0)
    if f.delta_ms == 0:
        assert c.primary_cause != finding
    assert any("GPU split" in n and "unavailable" in n for n in c.notes)
    assert "unavailable" in c.basis_text


def test_recorded_structure(recorded):
    def changed(b, a):
        return {s.key: (s.before, s.after) for s in _rec(recorded, b, a).structure if s.changed}

    assert changed("per-block", "no-backward-prefetch")["backward_prefetch"] == ("BACKWARD_PRE", "NONE")
    assert changed("per-block", "root-only")["unit_count"] == ("5", "1")
    mp = changed("bf16-mp", "per-block")
    assert mp["dtype.all_gather"] == ("c10::BFloat16", "float")
    assert mp["mixed_precision"] == ("yes", "no")
    # bf16 halves the bytes of each all-gather: ground truth from the model (README table)
    c = _rec(recorded, "bf16-mp", "per-block")
    ag = {(r.unit, r.phase): r for r in c.collectives if r.kind == "all_gather"}
    assert ag[("layers.0", "forward")].bytes == (49_984 * 2, 49_984 * 4)
    assert ag[("", "forward")].bytes == (32_636 * 2, 32_636 * 4)
    # root-only: the four blocks are no longer units
    c = _rec(recorded, "per-block", "root-only")
    assert c.alignment["units"]["only_before"] == [f"layers.{i}" for i in range(4)]


def test_recorded_no_reshard_is_not_blamed_on_a_threshold_crossing(recorded):
    """per-block has an info finding that no-reshard lacks only because fewer bytes move:
    the dtype did not change, so that finding takes no share of the delta."""
    c = _rec(recorded, "per-block", "no-reshard")
    f = next((k for k in c.causes if k.slug == "no-mixed-precision-collectives"), None)
    if f is not None:
        assert not f.corroborated and f.delta_ms == 0
    assert c.primary_cause != "no-mixed-precision-collectives"
    assert {s.key for s in c.structure if s.changed} >= {"reshard_after_forward"}


def test_recorded_self(recorded):
    c = _rec(recorded, "per-block", "per-block")
    assert c.step_time_delta_ms == 0 and c.primary_cause is None
