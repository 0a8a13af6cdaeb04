"""What-if replay (fsdpdoctor.analysis.whatif) against generated twins with exact ground truth.

Each fault scenario has a twin with the fault removed (same model, seed, ranks); the twin's
step-time difference, read from the generator's own truth.json, is what the fix really saves.
The primary finding's est_saving_ms must be within 15% of it and ranked first.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fixtures.scenarios import generator as gen
from fsdpdoctor.facts import RunFacts

# fault preset (or config), the twin's knobs, the fix the replay applies, the finding it belongs to
TWINS = {
    "no-backward-prefetch-fsdp1": ({"backward_prefetch": "BACKWARD_PRE"}, "prefetch", "missing-backward-prefetch"),
    "no-backward-prefetch-fsdp2": ({"backward_prefetch": "BACKWARD_PRE"}, "prefetch", "missing-backward-prefetch"),
    "too-coarse": ({"wrap": "block"}, "wrap", "auto-wrap-too-coarse"),
    "cpu-offload-pinned": ({"cpu_offload": False}, "offload_off", "cpu-offload-stall"),
    "cpu-offload-pageable": ({"cpu_offload": False}, "offload_off", "cpu-offload-stall"),
    "fp32-collectives": ({"collective_dtype": "bf16"}, "mixed_precision", "no-mixed-precision-collectives"),
    "slow-rank": ({"slow_rank": None, "slow_factor": 1.0}, "straggler", "straggler-rank"),
}
# strategy estimates (sharding strategy, DDP) are not config fixes of the measured run
STRATEGY = ("FSD030", "FSD031")

# GPT-2 small (12 blocks, h=768, ~7.1M parameters = ~13.5 MiB bf16 per block), one unit per
# block, 8 ranks on NVLink-class bandwidth: below the 16 MiB size threshold, yet not latency-bound
GPT2_SMALL = gen.ScenarioConfig(
    name="gpt2-small-per-block",
    description="GPT-2 small wrapped per block on NVLink",
    fsdp_version=2,
    world_size=8,
    num_layers=12,
    hidden_size=768,
    ffn_hidden_size=2048,
    vocab_size=50304,
    seq_len=1024,
    batch_size=8,
    link_bandwidth_gbps=150.0,
    kernel_noise=0.02,
)


@pytest.fixture(scope="module")
def run(analyzed_run):
    def get(cfg: gen.ScenarioConfig, tag: str):
        return analyzed_run(cfg)  # (report, truth), shared by the session's modules: read only

    return get


@pytest.fixture(scope="module")
def truth_of(generated_run):
    """cfg -> the generator's truth.json of its run: a twin whose report the test does not read is
    generated (once per session), never analysed."""

    def get(cfg: gen.ScenarioConfig):
        return gen.read_truth(generated_run(cfg))

    return get


def _truth_step_ms(truth) -> dict[int, float]:
    """The wall-clock time per step (the CPU step where every step syncs; longer where the GPU
    runs behind the CPU), as the generator reads it back."""
    ranks = truth["ranks"]
    items = ranks.items() if isinstance(ranks, dict) else enumerate(ranks)
    return {int(k): v["wall_ms_per_step"] for k, v in items}


@pytest.mark.parametrize("name", sorted(gen.PRESETS))
def test_unchanged_replay_reproduces_the_measured_step_within_2pct(name, run):
    rep, truth = run(gen.PRESETS[name], name)
    f = rep.facts
    want = _truth_step_ms(truth)
    assert f.whatif is not None
    for rf in f.rank_facts:
        w = rf.whatif
        assert w.ops > 0
        assert w.replayed_step_ms == pytest.approx(want[rf.rank], rel=0.02)
        assert w.error_pct < 2.0
    assert f.whatif.error_pct == max(rf.whatif.error_pct for rf in f.rank_facts)


@pytest.mark.parametrize("name", sorted(TWINS))
def test_primary_saving_matches_the_twin_within_15pct(name, run, truth_of):
    knobs, fix, slug = TWINS[name]
    rep, truth = run(gen.PRESETS[name], name)
    twin_truth = truth_of(dataclasses.replace(gen.PRESETS[name], **knobs))
    # the slowest rank sets the step
    real = max(_truth_step_ms(truth).values()) - max(_truth_step_ms(twin_truth).values())
    assert real > 1.0
    assert rep.facts.whatif.saving_ms[fix] == pytest.approx(real, rel=0.15)
    primary = next(f for f in rep.findings if f.slug == slug)
    assert primary.est_saving_ms == pytest.approx(real, rel=0.15)
    assert any("what-if replay" in e for e in primary.evidence)
    fixable = [f for f in rep.findings if f.code not in STRATEGY]
    assert fixable[0].slug == slug, [(f.slug, f.est_saving_ms) for f in rep.findings]
    # no saving larger than the step
    assert all((f.est_saving_ms or 0.0) <= rep.facts.steps.mean_ms for f in rep.findings)


# The wrap split on models the preset was not tuned on: the replay reads the model's repeated
# blocks from its GEMM shapes (GPT-2 small's root keeps 48% of the elements, embedding and head;
# with equal pieces the saving came out 93% over the twin's)
WRAP_MODELS = {
    "gpt2-small-root-only": dataclasses.replace(GPT2_SMALL, name="gpt2-small-root-only", wrap="root_only"),
    "too-coarse-h1024": dataclasses.replace(gen.PRESETS["too-coarse"], hidden_size=1024, ffn_hidden_size=4096),
    "too-coarse-fsdp1": dataclasses.replace(gen.PRESETS["too-coarse"], fsdp_version=1),
}
#: the per-block twin of GPT-2 small root-only is GPT2_SMALL itself (the same run under its own
#: name, which only names the files: generated once, its report read by the test below)
WRAP_TWINS = {"gpt2-small-root-only": GPT2_SMALL}


@pytest.mark.parametrize("name", sorted(WRAP_MODELS))
def test_wrap_split_matches_the_twin_on_other_models(name, run, truth_of):
    cfg = WRAP_MODELS[name]
    rep, truth = run(cfg, name)
    twin = WRAP_TWINS.get(name, dataclasses.replace(cfg, wrap="block"))
    assert dataclasses.replace(twin, name=cfg.name) == dataclasses.replace(cfg, wrap="block")
    twin_truth = truth_of(twin)
    real = max(_truth_step_ms(truth).values()) - max(_truth_step_ms(twin_truth).values())
    assert real > 1.0
    w = rep.facts.whatif
    assert w.saving_ms["wrap"] == pytest.approx(real, rel=0.15)
    assert f"{cfg.num_layers} repeated blocks found from GEMM shapes" in w.evidence["wrap"]
    primary = next(f for f in rep.findings if f.slug == "auto-wrap-too-coarse")
    assert primary.est_saving_ms == pytest.approx(real, rel=0.15)


def test_wrap_split_on_a_host_bound_run_pays_for_the_added_hooks(run, truth_of):
    """GPT-2 small root-only with 40 µs of Python per op: the CPU barely keeps ahead of the GPU,
    and per-block wrapping's 12 more units each run their FSDP hooks on it, so the twin is no
    faster (slower by ~0.2 ms). Without the hooks' CPU time the replay claimed ~1 ms (3% of the step)."""
    cfg = dataclasses.replace(GPT2_SMALL, name="gpt2-small-root-only-host", wrap="root_only", host_overhead_us=40.0)
    rep, truth = run(cfg, "gpt2-host")
    twin_truth = truth_of(dataclasses.replace(cfg, wrap="block"))
    step = max(_truth_step_ms(truth).values())
    real = step - max(_truth_step_ms(twin_truth).values())
    assert real < 0.5  # the regime: wrapping per block does not pay here
    assert rep.facts.whatif.saving_ms["wrap"] <= max(real, 0.0) + 0.01 * step


# the GPU-bound regime: no per-step sync, a launch queue of 96 ops that fills, two warm-up steps
# whose work is still running when the window opens (written without launch calls). The
# generator's queue model (a count of outstanding ops) is not the replay's (blocked launches
# read from their measured duration), so the twins can disagree with the replay.
GPU_BOUND = {"sync_every_step": False, "warmup_steps": 2, "launch_queue_depth": 96}
#: every rule with a generated twin, held in this regime too (issue #42: the no-backward-prefetch
#: FSDP2 twin had slipped to 0.35x here while the step-synced regime held)
GPU_BOUND_TWINS = tuple(sorted(TWINS))


#: held-out GPU-bound variants of the no-backward-prefetch FSDP2 twin (not tuned on: a 4x slower
#: link, 6 blocks and another seed). The backlog of the warm-up steps cannot take the fix (its launches
#: are not in the trace): before the saving was read on the steps it does not hold back, the
#: variants read 0.85x and 0.86x of the truth, the preset 0.86x
GPU_BOUND_VARIANTS = {
    "no-backward-prefetch-fsdp2-slow-link": ("no-backward-prefetch-fsdp2", {"link_bandwidth_gbps": 25.0}),
    "no-backward-prefetch-fsdp2-6-blocks": ("no-backward-prefetch-fsdp2", {"num_layers": 6, "seed": 3}),
}


@pytest.mark.parametrize("name", GPU_BOUND_TWINS + tuple(sorted(GPU_BOUND_VARIANTS)))
def test_gpu_bound_twins(name, run, truth_of):
    preset, extra = GPU_BOUND_VARIANTS.get(name, (name, {}))
    knobs, fix, slug = TWINS[preset]
    cfg = dataclasses.replace(gen.PRESETS[preset], **GPU_BOUND, **extra)
    rep, truth = run(cfg, name + "-gpu-bound")
    twin_truth = truth_of(dataclasses.replace(cfg, **knobs))
    f = rep.facts
    ranks = truth["ranks"]
    if name.startswith("cpu-offload"):
        # the CPU AdamW step waits for the offloaded gradients every step: no backlog can build
        # (the generator's truth), the problem run is CPU-bound whatever the sync; its twin is not
        assert all(v["backlog_ops"] == 0 for v in (ranks.values() if isinstance(ranks, dict) else ranks))
        assert f.timeline.bound == "cpu"
    else:
        # the regime is what it claims: a backlog at the window's start, the GPU the bottleneck
        assert all(v["backlog_ops"] > 0 for v in (ranks.values() if isinstance(ranks, dict) else ranks))
        assert f.timeline.bound == "gpu" and f.timeline.backlog_ops > 0
    want = _truth_step_ms(truth)
    for rf in f.rank_facts:
        assert rf.steps and sum(s.step_ms for s in rf.steps) / len(rf.steps) == pytest.approx(want[rf.rank], rel=0.01)
    assert f.whatif.error_pct < 2.0
    real = max(want.values()) - max(_truth_step_ms(twin_truth).values())
    assert real > 1.0
    primary = next(x for x in rep.findings if x.slug == slug)
    assert primary.est_saving_ms == pytest.approx(real, rel=0.15)
    assert primary.saving_basis == "replay"
    fixable = [x for x in rep.findings if x.code not in STRATEGY]
    assert fixable[0].slug == slug, [(x.slug, x.est_saving_ms) for x in rep.findings]


@pytest.mark.parametrize("regime", ["typical", "typical-gpu-bound"])
def test_hook_saving_is_two_blocks_per_unit_not_all_hooks_gone(regime, run, truth_of):
    """FSD016 prices the fix a user can apply: two blocks per unit, half the hooks. Its generated
    twin halves the hooks' Python per unit (the GPU waits the same at each merged unit's hook as
    at half of each block's: (800 - 2w) / 2 = 400 - w); the estimate is within 15% of that twin's
    real difference in both regimes, its range holds it and stays below the all-hooks-gone
    ceiling, itself within 15% of the twin without the hooks' Python."""
    base = gen.PRESETS[regime]
    rep, truth = run(base, regime)
    half = truth_of(dataclasses.replace(base, hook_overhead_us=base.hook_overhead_us / 2))
    none = truth_of(dataclasses.replace(base, hook_overhead_us=0.0))
    step = max(_truth_step_ms(truth).values())
    real = step - max(_truth_step_ms(half).values())
    gone = step - max(_truth_step_ms(none).values())
    f = next(x for x in rep.findings if x.slug == "gpu-starved-by-hooks")
    assert f.est_saving_ms == pytest.approx(real, rel=0.15), (f.est_saving_ms, real)
    lo, hi = f.saving_range_ms
    assert lo <= real <= hi * 1.15
    assert f.saving_ceiling_ms == pytest.approx(gone, rel=0.15)
    assert f.est_saving_ms < f.saving_ceiling_ms


def test_exposed_reduce_scatter_is_folded_into_missing_prefetch(run):
    rep, _ = run(gen.PRESETS["no-backward-prefetch-fsdp1"], "no-backward-prefetch-fsdp1")
    w = rep.facts.whatif
    # without prefetch the reduce-scatters wait behind on-demand all-gathers on one communicator:
    # the replay with prefetch removes (nearly) all of their exposed time
    assert w.exposed_rs_ms["none"] > 5.0
    assert w.exposed_rs_ms["prefetch"] < 0.5 * w.exposed_rs_ms["none"]
    slugs = [f.slug for f in rep.findings]
    assert "exposed-reduce-scatter" not in slugs
    assert slugs[0] == "missing-backward-prefetch"
    ev = " ".join(rep.findings[0].evidence)
    assert "folded FSD007 exposed-reduce-scatter" in ev
    assert "goes away with prefetch" in ev


def test_prefetch_replay_of_a_prefetched_run_saves_nothing(run, generated_run):
    """The transformation on the healthy twin (its all-gathers are already one unit ahead)
    changes nothing; the analysis does not even replay it there."""
    from fsdpdoctor.analysis import whatif
    from fsdpdoctor.analysis.comms import find_collectives, issue_rows
    from fsdpdoctor.analysis.labels import enclosing, label_rows
    from fsdpdoctor.analysis.steps import find_steps
    from fsdpdoctor.analysis.timeline import step_timeline
    from fsdpdoctor.ingest.kineto import load_trace

    cfg = dataclasses.replace(gen.PRESETS["no-backward-prefetch-fsdp1"], backward_prefetch="BACKWARD_PRE")
    rep, _ = run(cfg, "no-backward-prefetch-fsdp1-twin")
    assert "prefetch" not in rep.facts.whatif.saving_ms
    assert "missing-backward-prefetch" not in [f.slug for f in rep.findings]
    rt = load_trace(str(generated_run(cfg) / "rank0.json.gz"))
    info = find_steps(rt)
    colls = find_collectives(rt, enclosing(rt, label_rows(rt), issue_rows(rt)), group_size=rt.world_size)
    step_timeline(rt, info.steps, colls)
    w = whatif.analyze_whatif(rt, info.steps, colls)  # every transformation
    assert w.saving_ms["prefetch"] < 0.01 * w.replayed_step_ms


def test_rate_limiter_that_blocks_the_cpu_but_costs_nothing_draws_no_finding(run, truth_of):
    """FSDP1 with 20 µs of Python per op: the rate limiter blocks the CPU ~40 ms per step, but
    the CPU is far ahead of the GPU; its twin with limit_all_gathers=False is no faster."""
    cfg = dataclasses.replace(gen.PRESETS["healthy-fsdp1"], host_overhead_us=20.0)
    rep, truth = run(cfg, "rate-limited")
    twin_truth = truth_of(dataclasses.replace(cfg, limit_all_gathers=False))
    real = max(_truth_step_ms(truth).values()) - max(_truth_step_ms(twin_truth).values())
    assert rep.facts.fsdp.rate_limiter_ms_per_step > 10.0
    assert abs(rep.facts.whatif.saving_ms["rate_limiter_off"] - real) < 0.01 * rep.facts.steps.mean_ms
    assert "rate-limiter-stall" not in [f.slug for f in rep.findings]


def test_gpt2_small_wrapped_per_block_draws_no_wrap_finding(run):
    rep, _ = run(GPT2_SMALL, "gpt2-small")
    f = rep.facts
    units = [u for u in f.fsdp.units if u.fqn]
    assert len(units) == 12
    # ~13.5 MiB per block in bf16: under the old size-only threshold of 16 MiB
    ag = [c.bytes for c in f.rank_facts[0].collectives if c.kind == "all_gather" and c.unit == units[0].fqn]
    assert 12 * 2**20 < ag[0] < 16 * 2**20
    assert f.whatif.latency_share is not None and f.whatif.latency_share < 0.5
    slugs = [x.slug for x in rep.findings]
    assert "auto-wrap-too-fine" not in slugs and "auto-wrap-too-coarse" not in slugs


def test_too_fine_fires_on_measured_evidence(run):
    rep, _ = run(gen.PRESETS["too-fine"], "too-fine")
    fd = next(f for f in rep.findings if f.slug == "auto-wrap-too-fine")
    ev = " ".join(fd.evidence)
    assert "critical path" in ev and "fixed latency" in ev


def test_whatif_survives_the_facts_json_round_trip(run):
    rep, _ = run(gen.PRESETS["no-backward-prefetch-fsdp2"], "no-backward-prefetch-fsdp2")
    back = RunFacts.from_dict(rep.facts.to_dict())
    assert back.whatif == rep.facts.whatif
    assert back.rank_facts[0].whatif == rep.facts.rank_facts[0].whatif


@pytest.mark.parametrize("name", sorted(TWINS))
def test_compare_tells_the_same_story_as_analyze(name, run):
    """compare's delta attribution for the fault → twin change agrees with the saving analyze
    estimates on the worse run (both within 15% of the real difference, so of each other)."""
    from fsdpdoctor.analysis.compare import compare

    knobs, _fix, slug = TWINS[name]
    rep, _ = run(gen.PRESETS[name], name)
    twin, _ = run(dataclasses.replace(gen.PRESETS[name], **knobs), name + "-twin")
    cmp = compare(rep.facts, twin.facts, rep.findings, twin.findings)
    cause = next(c for c in cmp.causes if c.slug == slug)
    est = next(f for f in rep.findings if f.slug == slug).est_saving_ms
    assert -cause.delta_ms == pytest.approx(est, rel=0.15)
    assert cmp.primary.slug == slug


def test_compiled_replay_loop_equals_the_python_loop(monkeypatch):
    """The replay's loop runs as plain Python when there is little to replay and compiled
    (numba) from JIT_MIN_WORK events × replays on: both give the same schedule, bit for bit, on
    a real recording (the offload run: blocking copies, a CPU optimizer step, every
    transformation that applies)."""
    import numpy as np

    from fsdpdoctor.analysis.comms import find_collectives, issue_rows
    from fsdpdoctor.analysis.labels import enclosing, label_rows
    from fsdpdoctor.analysis.steps import find_steps
    from fsdpdoctor.analysis.timeline import step_timeline
    from fsdpdoctor.analysis.whatif import fixes as F
    from fsdpdoctor.analysis.whatif import graph as G
    from fsdpdoctor.analysis.whatif import loop as W
    from fsdpdoctor.ingest.kineto import load_trace

    rt = load_trace(
        str(Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu" / "fsdp2-offload" / "rank0.json.gz")
    )
    info = find_steps(rt)
    colls = find_collectives(rt, enclosing(rt, label_rows(rt), issue_rows(rt)))
    step_timeline(rt, info.steps, colls)
    g = G.build_graph(rt, info.steps, colls)
    fixes = [None, F.fix_offload_off(g), F.fix_hooks_off(g), F.fix_compute_scale(g, 0.75)]
    assert all(fx is not None for fx in fixes[1:])
    monkeypatch.setattr(W, "_COMPILED", None)  # numba not loaded yet in this process
    monkeypatch.setattr(W, "_python_work", 0)
    monkeypatch.setattr(W, "JIT_MIN_WORK", 10**12)
    py = [W.replay(g, fx) for fx in fixes]
    assert W._COMPILED is None  # the first four ran in Python
    monkeypatch.setattr(W, "JIT_MIN_WORK", 0)
    jit = [W.replay(g, fx) for fx in fixes]
    for a, b in zip(py, jit):
        for x, y in zip(a, b):
            assert np.array_equal(x, y)
    # and the offload fix really changes the schedule (the comparison is not of two copies of one thing)
    assert py[1][2].sum() < 0.5 * py[0][2].sum()


def test_numba_is_loaded_once_python_has_replayed_as_much_as_it_costs(monkeypatch):
    """The loop runs in Python until what this process has replayed, plus what is due, reaches
    JIT_MIN_WORK events; from then on (and whenever numba is already loaded) compiled."""
    from fsdpdoctor.analysis.whatif import loop as W

    monkeypatch.setattr(W, "_COMPILED", None)
    monkeypatch.setattr(W, "_python_work", 0)
    monkeypatch.setattr(W, "JIT_MIN_WORK", 1000)
    assert not W._use_compiled(300, 2)  # 0 + 600 due
    assert not W._use_compiled(300, 2)  # 300 replayed + 600 due
    assert W._use_compiled(300, 2)  # 600 + 600: load it
    monkeypatch.setattr(W, "_python_work", 0)
    assert W._use_compiled(500, 2)  # one large graph: at once
    monkeypatch.setattr(W, "_COMPILED", object())
    assert W._use_compiled(1, 1)  # loaded: always


def test_the_trace_is_released_before_the_replays(monkeypatch):
    """analyze_rank reads everything it needs from the trace (the replay's graph and
    transformations included) and lets the trace go before replaying, so the trace's columns
    and the replay (with its compiled loop's imports) are never in memory together."""
    import weakref

    import fsdpdoctor.analysis.ranks.rank as rank

    refs, alive_at_replay = [], []
    real_load, real_run = rank.load_trace, rank.run_whatif

    def load(path, *a, **k):
        rt = real_load(path, *a, **k)
        refs.append(weakref.ref(rt))
        return rt

    def run(plan):
        alive_at_replay.append(refs[0]() is not None)
        return real_run(plan)

    monkeypatch.setattr(rank, "load_trace", load)
    monkeypatch.setattr(rank, "run_whatif", run)
    gpu = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu" / "fsdp2" / "rank0.json.gz"
    facts = rank.analyze_rank(str(gpu))
    assert alive_at_replay == [False]
    assert facts.whatif is not None and facts.whatif.error_pct < 2.0


def test_replay_applicability_is_decided_once_with_the_rules():
    """Which transformations the replay runs and whether their rules may fire come from one place
    (FsdpFacts.fix_applies). They had drifted: the replay ran the mixed-precision fix when the
    trace did not say (mixed_precision None) while FSD011 fires only when it is known off."""
    from fsdpdoctor.analysis.whatif.fixes import FIXES
    from fsdpdoctor.analysis.whatif.plan import _applies
    from fsdpdoctor.facts import FsdpFacts

    unknown, off, on = (
        FsdpFacts(version=2),
        FsdpFacts(version=2, mixed_precision=False),
        FsdpFacts(version=2, mixed_precision=True),
    )
    assert (
        not unknown.fix_applies("mixed_precision")
        and off.fix_applies("mixed_precision")
        and not on.fix_applies("mixed_precision")
    )
    for fs in (unknown, off, on):
        assert _applies(fs) == {name: fs.fix_applies(name) for name in FIXES}
    assert _applies(unknown)["mixed_precision"] is False


def test_the_runs_saving_carries_its_own_ranks_step_note_and_assumptions():
    """The run's saving of a fix is the largest rank's (the slowest rank sets the step); the step
    with the fix, the fix's note and the assumptions stated beside it are that rank's, so that the
    finding's "from X to Y ms" adds up to its saving and its range text describes its replays.
    Two ranks built by hand: rank 0 saves 0.55 ms with a stated span, rank 1 saves 1.25 ms and no
    assumption moved it (param-dlrm's fused-optimizer finding showed rank 0's span beside rank 1's
    saving)."""
    from fsdpdoctor.analysis.whatif.fold import fold_whatif
    from fsdpdoctor.facts import WhatIfFacts

    def rank(r, replayed, step, saving, said):
        w = WhatIfFacts(measured_step_ms=replayed, replayed_step_ms=replayed)
        w.step_ms["fused_optimizer"], w.saving_ms["fused_optimizer"] = step, saving
        w.assumption_ms["fused_optimizer"] = [saving - 0.01, saving + 0.01] if said else [saving, saving]
        if said:
            w.assumptions["fused_optimizer"] = said
        w.evidence["fused_optimizer"] = f"rank {r}'s note"
        return dataclasses.replace(_RankStub(), rank=r, whatif=w)

    run = fold_whatif([rank(0, 16.0, 15.45, 0.55, "traffic: 0.54-0.56 ms"), rank(1, 19.9, 18.65, 1.25, "")])
    assert run.saving_ms["fused_optimizer"] == 1.25 and run.saving_rank["fused_optimizer"] == 1
    assert run.step_ms["fused_optimizer"] == 18.65  # rank 1's, not the mean (17.05)
    assert run.evidence["fused_optimizer"] == "rank 1's note"
    assert "fused_optimizer" not in run.assumptions  # rank 0's span is not this saving's
    assert run.replayed_step_ms == pytest.approx(17.95)  # the run's unchanged replay: the mean, as before


@dataclasses.dataclass
class _RankStub:
    rank: int = 0
    whatif: object = None
    compute_ms_total: float = 0.0


def test_a_replayed_finding_on_many_ranks_adds_up(shared_traces):
    """param-dlrm-v100-8ranks (8 ranks, one step each): FSD017's fused-optimizer saving is one
    rank's, and its evidence names that rank and its replayed step before and after, whose
    difference is the saving (to the 0.1 ms shown)."""
    import re

    import fsdpdoctor

    rep = fsdpdoctor.analyze(shared_traces / "param-dlrm-v100-8ranks")
    f = next(x for x in rep.findings if x.slug == "non-matmul-kernels")
    line = next(e for e in f.evidence if e.startswith("what-if replay:"))
    m = re.search(r"takes rank (\d+)'s step from ([\d.]+) to ([\d.]+) ms", line)
    assert m, line
    assert int(m.group(1)) == rep.facts.whatif.saving_rank["fused_optimizer"]
    assert float(m.group(2)) - float(m.group(3)) == pytest.approx(f.est_saving_ms, abs=0.11)
    assert "memory traffic" not in " ".join(f.evidence)  # another rank's span is not stated beside it
