"""Each rule's estimated saving against a truth it did not make (issue #42: inflating any rule's
estimate by 25% fails a test; ``benchmarks/inflate_rules.py`` runs that check).

Truth here is the generator's own (fixtures/scenarios): the run with the problem and its twin
with the fix, both generated, the difference of their steps read from each one's truth.json; or,
where the fix has no generated twin, the generator's truth of the part of the step the fix acts
on. Every rule with a generated twin is held in both regimes: step-synced and GPU-bound (no
per-step sync, a launch queue that fills, warm-up work still running when the window opens).
The tolerance of each check is its measured error rounded up; each figure's ratio to its truth
is in the docstring, so that x1.25 is seen to break it.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

import fsdpdoctor
from fixtures.scenarios import generator as gen

GPU_BOUND = {"sync_every_step": False, "warmup_steps": 2, "launch_queue_depth": 96}
REGIMES = {"synced": {}, "gpu-bound": GPU_BOUND}


@pytest.fixture(scope="module")
def run(analyzed_run, generated_run):
    """cfg -> (report, truth), shared by the session's modules: read only; ``run.truth(cfg)``: the
    truth alone, for a twin whose report no test here reads (generated, never analysed)."""

    def get(cfg):
        return analyzed_run(cfg)

    get.truth = lambda cfg: gen.read_truth(generated_run(cfg))
    return get


def _step(truth) -> float:
    """The slowest rank's wall-clock time per step, as the generator reads it back."""
    return max(v["wall_ms_per_step"] for v in truth["ranks"].values())


def _twin_saving(run, cfg, **fix) -> tuple[fsdpdoctor.Report, float]:
    rep, truth = run(cfg)
    twin = run.truth(dataclasses.replace(cfg, **fix))
    return rep, _step(truth) - _step(twin)


def _finding(rep, slug):
    f = next((x for x in rep.findings if x.slug == slug), None)
    assert f is not None, [x.slug for x in rep.findings]
    return f


#: (preset, config changes, the twin's fix, rule slug, the figure checked, tolerance). Measured
#: ratios (figure / truth, synced; gpu-bound): too-fine FSD003 0.94, 0.99; reduce-scatter on every
#: micro-batch FSD014 1.01, 1.00 (0.72 before the no-sync replay); host-bound FSD010 0.93, 0.89
#: and its ceiling 0.99, 0.95; pageable offload FSD006's model 0.90, 0.90; root-only FSDP2 on a
#: 50 GB/s link against its DDP twin FSD031 0.99, 0.99 (23x on the 100 GB/s run before the DDP
#: optimizer step was scaled to every parameter); the typical run with an .item() after each of 4
#: blocks against its twin without FSD018 0.99, 0.99 (0.66 when it claimed the drained idle only);
#: FSDP1's rate limiter holding back the all-gathers (per-linear units, long sequences) against its
#: twin with limit_all_gathers=False FSD012 1.08, 1.12; FULL_SHARD across 2 nodes of 2 GPUs on a
#: 12.5 GB/s inter-node link against its HSDP twin FSD030 1.11, 1.11 (1.56 when the saving was the
#: model's own difference, its current step 19% over the measured one) and the per-Linear run against
#: its reshard_after_forward=False twin FSD030 1.06, 0.97; GPT-2's vocabulary of 50,257 against its
#: twin padded to 50,304 FSD032 0.96, 0.96
TWINNED = {
    "too-fine": ("too-fine", {}, {"wrap": "block"}, "auto-wrap-too-fine", "est", 0.15),
    "ga-sync": (
        "ga-fsdp2-sync",
        {},
        {"grad_sync_every_microbatch": False},
        "reduce-scatter-every-microbatch",
        "est",
        0.1,
    ),
    "ddp-slow-link": (
        "too-coarse",
        {"link_bandwidth_gbps": 50.0},
        {"parallelism": "ddp"},
        "ddp-would-be-faster",
        "est",
        0.1,
    ),
    "item-readback": (
        "typical",
        {"sync_items_per_step": 4},
        {"sync_items_per_step": 0},
        "sync-in-step",
        "est",
        0.1,
    ),
    "host-bound": ("host-bound", {}, {"host_overhead_us": 0.0}, "host-bound", "est", 0.15),
    "host-bound-ceiling": ("host-bound", {}, {"host_overhead_us": 0.0}, "host-bound", "ceiling", 0.1),
    # the pinned twin (CPUOffloadPolicy(pin_memory=True)); on Hopper a real pinned twin ran slower
    # (its CPU AdamW): the point estimate is withdrawn there, the model's own figure is checked
    "pageable": ("cpu-offload-pageable", {}, {"pin_memory": True}, "pageable-memcpy", "model", 0.12),
    "rate-limiter": ("rate-limited-fsdp1", {}, {"limit_all_gathers": False}, "rate-limiter-stall", "est", 0.15),
    # the twin's step is the generator's HSDP run: shard groups inside a node on its 100 GB/s link, the
    # replica all-reduce on the 12.5 GB/s one (the model assumes 150 GB/s inside a node: none is measured)
    "inter-node": ("full-shard-inter-node", {}, {"replicate_size": 2}, "sharding-strategy", "est", 0.15),
    "shard-grad-op": ("too-fine", {}, {"reshard_after_forward": False}, "sharding-strategy", "est", 0.1),
    "vocab-unpadded": ("vocab-unpadded", {}, {"vocab_size": 50304}, "matmul-shapes-below-peak", "est", 0.1),
}
#: the cases whose finding must be gone on the twin (the twin is the run with the fix applied)
GONE_ON_THE_TWIN = ("rate-limiter", "inter-node", "shard-grad-op", "vocab-unpadded")


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("case", sorted(TWINNED))
def test_saving_matches_the_generated_twin(case, regime, run):
    preset, kw, fix, slug, what, tol = TWINNED[case]
    cfg = dataclasses.replace(gen.PRESETS[preset], **kw, **REGIMES[regime])
    rep, real = _twin_saving(run, cfg, **fix)
    assert real > 1.0
    f = _finding(rep, slug)
    got = {"est": f.est_saving_ms, "model": f.model_saving_ms, "ceiling": f.saving_ceiling_ms}[what]
    assert got == pytest.approx(real, rel=tol), (case, regime, what, got, real)
    if f.est_saving_ms is not None:
        lo, hi = f.saving_range_ms
        assert lo <= f.est_saving_ms <= hi


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("case", GONE_ON_THE_TWIN)
def test_the_finding_is_gone_on_the_twin(case, regime, run):
    """The run with the fix applied (the twin) draws no finding of the rule: no rate limiter, the
    recommended HYBRID_SHARD or SHARD_GRAD_OP already in use, the vocabulary padded."""
    preset, kw, fix, slug, _, _ = TWINNED[case]
    cfg = dataclasses.replace(gen.PRESETS[preset], **kw, **REGIMES[regime])
    twin, _ = run(dataclasses.replace(cfg, **fix))
    assert slug not in {f.slug for f in twin.findings}


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_no_ddp_finding_where_its_twin_saves_under_the_threshold(regime, run):
    """FSD031 on the root-only run at 100 GB/s: its DDP twin is 0.57 ms (0.7%) faster, its
    optimizer step stepping every parameter (4x) eating what the all-reduce hides: under the 5%
    the rule reports from, so no finding (it once claimed 13.04 ms here)."""
    cfg = dataclasses.replace(gen.PRESETS["too-coarse"], **REGIMES[regime])
    rep, real = _twin_saving(run, cfg, parallelism="ddp")
    _, truth = run(cfg)
    assert real < 0.05 * _step(truth)
    assert "ddp-would-be-faster" not in {f.slug for f in rep.findings}


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_no_strategy_finding_where_its_twin_saves_under_the_threshold(regime, run):
    """FSD030 on the host-bound run (150 us of Python per op): the model recommends SHARD_GRAD_OP,
    whose twin (reshard_after_forward=False) is 0.30 ms (under 1%) faster, the CPU setting the step
    either way: under the 5% the rule reports from, so no finding. The measured step less the
    modelled SHARD_GRAD_OP step says 2.00 ms (6.7x): the CPU time the model does not see is not the
    strategy's to save (the model's own difference, 0.90 ms, is the smaller)."""
    cfg = dataclasses.replace(gen.PRESETS["host-bound"], **REGIMES[regime])
    rep, real = _twin_saving(run, cfg, reshard_after_forward=False)
    _, truth = run(cfg)
    assert rep.facts.strategy.recommended == "SHARD_GRAD_OP"
    assert real < 0.05 * _step(truth)
    assert "sharding-strategy" not in {f.slug for f in rep.findings}


def _mean_over_steps(truth, get) -> float:
    return statistics.fmean(get(s) for r in truth["ranks"].values() for s in r["steps"])


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("preset", ["too-fine", "ga-fsdp2-sync"])
def test_exposed_reduce_scatter_is_the_part_its_fix_acts_on(preset, regime, run):
    """FSD007's estimate is the exposed reduce-scatter per step (the part its fix, small last
    units, acts on): the generator's exposed reduce-scatter, mean over ranks and steps (ratio 1.00)."""
    rep, truth = run(dataclasses.replace(gen.PRESETS[preset], **REGIMES[regime]))
    want = _mean_over_steps(truth, lambda s: s["exposed_by_collective_ms"]["reduce_scatter"])
    assert _finding(rep, "exposed-reduce-scatter").est_saving_ms == pytest.approx(want, rel=0.05)


def test_low_overlap_hides_what_raising_overlap_to_the_threshold_hides(run):
    """FSD008 on the tensor-parallel run (overlap low by design): raising the overlap to the
    threshold hides (threshold - overlap) of the communication, never more than is exposed; read
    from the generator's per-step communication and overlap."""
    from fsdpdoctor.config import defaults

    rep, truth = run(gen.PRESETS["tp-fsdp"])
    comm = _mean_over_steps(truth, lambda s: s["comm_busy_ms"])
    over = _mean_over_steps(truth, lambda s: s["overlap_ms"])
    exposed = _mean_over_steps(truth, lambda s: s["exposed_comm_ms"])
    want = min(comm * defaults()["min_overlap_pct"] / 100 - over, exposed)
    assert want > 1.0
    assert _finding(rep, "low-overlap").est_saving_ms == pytest.approx(want, rel=0.1)


def test_jitter_saving_is_the_mean_step_above_the_median(run):
    """FSD013 on the jitter run: the steps above the median brought down to it, mean - median of
    the most variable rank's steps in the generator's truth."""
    rep, truth = run(dataclasses.replace(gen.PRESETS["jitter"], seed=1, steps=5))
    worst = max(
        truth["ranks"].values(),
        key=lambda r: (
            statistics.pstdev(s["step_ms"] for s in r["steps"]) / statistics.fmean(s["step_ms"] for s in r["steps"])
        ),
    )
    times = [s["step_ms"] for s in worst["steps"]]
    want = statistics.fmean(times) - statistics.median(times)
    assert want > 1.0
    f = _finding(rep, "step-time-jitter")
    assert f.est_saving_ms == pytest.approx(want, rel=0.1)
    # its range: the assumption's span (the fastest step; only the slowest step's stall), stated
    lo, hi = f.saving_range_ms
    assert lo == pytest.approx((max(times) - statistics.median(times)) / len(times), rel=0.05)
    assert hi == pytest.approx(statistics.fmean(times) - min(times), rel=0.05)
    assert "the step without its stalls is the median" in f.saving_range_basis


def test_every_rule_with_a_saving_is_listed_for_the_inflation_check():
    """benchmarks/inflate_rules.py inflates each rule's estimate by 25% and runs the tests listed
    for it: every rule that can emit est_saving_ms is listed (with its tests, or why it has none),
    and every listed test exists."""
    import importlib.util
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("inflate_rules", repo / "benchmarks" / "inflate_rules.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    codes = mod.rules_with_savings()
    assert {"FSD004", "FSD013", "FSD015"} <= set(codes)
    assert set(codes) == set(mod.TRUTH)
    for code in codes:
        assert mod.TRUTH[code] or mod.MISSING.get(code), code
        for node in mod.TRUTH[code]:
            path, name = node.split("::", 1)
            func = re.sub(r"\[.*\]$", "", name)
            assert re.search(rf"^def {func}\(", (repo / path).read_text(), re.M), node
