"""Small helpers shared by rule modules. They read RunFacts only."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from fsdpdoctor.facts import EXPOSED
from fsdpdoctor.engine import Finding
from fsdpdoctor.facts import CollectiveFacts, RunFacts
from fsdpdoctor.fmt import ms, pct

from ._idiom import idiom_fix, name_blocks  # noqa: F401  (name_blocks: re-exported for the rules)

#: For a rule's ``EXPLAINS`` (see fsdpdoctor.analysis.compare): every exposed-communication part, any phase.
ALL_COMM = [(c, None) for c in EXPOSED]


def finding(module_name: str, summary: str, **kw: Any) -> Finding:
    mod: ModuleType = sys.modules[module_name]
    kw.setdefault("severity", mod.SEVERITY)
    return Finding(slug=mod.SLUG, code=mod.CODE, summary=summary, **kw)


def step_ms(facts: RunFacts) -> float:
    """The step every share and threshold "of the step" is measured on: the step time, the
    interval at which steps complete whichever side limits them (:attr:`RunFacts.step_clock_ms`)."""
    return facts.step_clock_ms


def step_name(facts: RunFacts) -> str:
    """What :func:`step_ms` is, for evidence: "45.30 ms GPU-bound step", "45.30 ms step"."""
    side = {"gpu": " GPU-bound", "cpu": " CPU-bound"}.get(facts.timeline.bound, "") if facts.gpu_present else ""
    return f"{ms(step_ms(facts))}{side} step"


def of_step(facts: RunFacts, v: float) -> str:
    """ "12.3% of the 45.30 ms GPU-bound step": a share that says what it is a share of."""
    sm = step_ms(facts)
    return f"{pct(100 * v / sm) if sm else '–'} of the {step_name(facts)}"


def of_window(facts: RunFacts, v: float) -> str:
    """ "12.3% of the 85.20 ms GPU window" (mean per step)."""
    w = facts.timeline.gpu_window_ms
    return f"{pct(100 * v / w) if w else '–'} of the {ms(w)} GPU window"


def of_cpu_step(facts: RunFacts, v: float) -> str:
    """ "12.3% of the 45.30 ms CPU step" (the ProfilerStep span): for CPU-side time."""
    c = facts.timeline.cpu_step_ms or facts.steps.mean_ms or 0.0
    return f"{pct(100 * v / c) if c else '–'} of the {ms(c)} CPU step"


def fsdp_version(facts: RunFacts) -> int | None:
    """1 or 2 when the traces (or, for a snapshot alone, its allocation frames) show FSDP."""
    if facts.fsdp.version in (1, 2):
        return facts.fsdp.version
    mem = facts.memory.fsdp_version if facts.memory is not None else None
    return {"fsdp1": 1, "fsdp2": 2}.get(mem or "")


#: all-reduces per step from which a data-parallel loop without DDP's labels reduces one
#: gradient at a time (DDP's ~25 MiB buckets make a few dozen at most)
PER_PARAM_ALLREDUCES = 100
FIX_BUCKETS = (
    "# one all-reduce per parameter, each launched from Python: let DDP bucket them (25 MiB buckets,\n"
    "# launched as the gradients are ready, overlapping the backward pass)\n"
    "model = DistributedDataParallel(model, device_ids=[rank], bucket_cap_mb=25, gradient_as_bucket_view=True)\n"
)


def per_parameter_allreduces(facts: RunFacts, ar) -> bool:
    """Whether ``ar`` (the run's all-reduce stats) are one per parameter, each launched from
    Python: at least PER_PARAM_ALLREDUCES a step, and no DDP labels (DDP buckets its own)."""
    return ar is not None and ar.count_per_step >= PER_PARAM_ALLREDUCES and not facts.parallelism.ddp


def is_ddp(facts: RunFacts) -> bool:
    """DistributedDataParallel (or an all-reduce data-parallel loop like it), FSDP not detected:
    the run's kind (``parallelism.run_kind``) is a data-parallel one."""
    return not is_fsdp(facts) and facts.parallelism.data_parallel


def activations_established(facts: RunFacts) -> bool:
    """Whether the memory the snapshot calls ``activations`` is known to be tensors saved for a
    backward pass, the premise of training-only memory advice (activation checkpointing): not in
    an inference run (the traces show no backward pass or optimizer step), and not from a snapshot
    without allocation history (blocks at dump time told apart by their stacks only, no lifetimes)."""
    m = facts.memory
    return facts.workload != "inference" and m is not None and not m.history_missing


def no_fix_known(what: str, hint: str = "") -> dict[str, str]:
    """The fix entry of a finding for which no code change is known for the detected setup."""
    return {"any": f"# No code fix is known for {what}." + (f"\n# {hint}" if hint else "")}


def fix_for(
    facts: RunFacts,
    *,
    fsdp1: str | None = None,
    fsdp2: str | None = None,
    ddp: str | None = None,
    inference: str | None = None,
    training: str | None = None,
    none_known: str = "this setup",
    lever: str | None = None,
) -> dict[str, str]:
    """The fixes of a finding for what the traces show, never for a parallelism that is not there:
    an inference run gets ``inference`` only; an FSDP run the code for its FSDP version
    (:func:`fsdp_version`); a DDP run ``ddp``; otherwise ``training`` (under the key ``any``).
    Nothing that fits: one comment saying so (``none_known`` names the setup). The code names the
    model's own blocks as the run names them (:func:`name_blocks`). With ``lever`` (one of
    :data:`._idiom.LEVERS`), a run driven by a framework with its own setting for that lever (HF
    Trainer, Lightning, Accelerate, torchtitan) gets that instead (:func:`._idiom.idiom_fix`)."""
    plain = _fix_for(facts, fsdp1, fsdp2, ddp, inference, training, none_known)
    if lever is not None:
        return idiom_fix(facts, lever, plain)
    return {k: name_blocks(facts, code) for k, code in plain.items()}


def _fix_for(facts: RunFacts, fsdp1, fsdp2, ddp, inference, training, none_known) -> dict[str, str]:
    if facts.workload == "inference":
        return {"inference": inference} if inference else no_fix_known(f"{none_known} in an inference run")
    out: dict[str, str] = {}
    version = fsdp_version(facts)
    if version is not None:
        for v, code in ((1, fsdp1), (2, fsdp2)):
            if code and version == v:
                out[f"fsdp{v}"] = code
    elif is_ddp(facts) and ddp:
        out["ddp"] = ddp
    if not out and training:
        out["any"] = training
    return out or no_fix_known(none_known)


def is_fsdp(facts: RunFacts) -> bool:
    return facts.fsdp.version in (1, 2)


def collectives(
    facts: RunFacts, kind: str | None = None, phase: str | None = None
) -> list[tuple[int, CollectiveFacts]]:
    """(rank, collective) pairs inside steps, optionally filtered by kind and phase."""
    out = []
    for r in facts.rank_facts:
        for c in r.collectives:
            if c.step < 0 or (kind and c.kind != kind) or (phase and c.phase != phase):
                continue
            out.append((r.rank, c))
    return out


def per_step_per_rank(facts: RunFacts, total: float) -> float:
    """A sum over all ranks and steps (of :func:`collectives`) turned into a mean per step per
    rank; ranks whose collectives were dropped (large runs) are in neither."""
    n = sum(len(r.steps) for r in facts.rank_facts if r.gpu_present and not r.collectives_dropped) or 1
    return total / n


def exposed_ms(facts: RunFacts, phase: str, kind: str) -> float:
    return facts.exposed_comm.by_phase_kind.get(phase, {}).get(kind, 0.0)


from fsdpdoctor.config import REPLAY_MAX_ERROR_PCT  # noqa: E402  (re-exported for the rules)


def replayed_saving(facts: RunFacts, fix: str) -> float | None:
    """The what-if replay's saving per step for ``fix`` (fsdpdoctor.analysis.whatif), capped at the
    step's GPU window (a GPU-side fix cannot save more than the GPU's busy span); None when the
    run was not replayed (CPU-only traces, old baselines), the fix does not apply, or the
    unchanged replay misses the measured step by more than REPLAY_MAX_ERROR_PCT on some rank."""
    w = facts.whatif
    if w is None or fix not in w.saving_ms or w.error_pct > REPLAY_MAX_ERROR_PCT:
        return None
    s = w.saving_ms[fix]
    window = facts.timeline.gpu_window_ms
    return min(s, window) if window > 0 else s


def replay_evidence(facts: RunFacts, fix: str, what: str) -> str:
    """One evidence line: the replayed saving and the replay's own error bar."""
    w = facts.whatif
    kept = (
        f"; {w.unexplained_waits} waits the trace does not explain kept as measured ({w.unexplained_wait_ms:.2f} ms per step)"
        if w.unexplained_waits
        else ""
    )
    step, saving = w.step_ms.get(fix, 0.0), w.saving_ms.get(fix, 0.0)
    # from the unchanged replay of the same steps on the same rank (the saving's), where it saves
    before = step + saving if saving > 0 else w.replayed_step_ms
    whose = (
        f"rank {w.saving_rank[fix]}'s step"
        if saving > 0 and fix in w.saving_rank and len(w.per_rank_error_pct) > 1
        else "the step"
    )
    return (
        f"what-if replay: {what} takes {whose} from {before:.1f} to {step:.1f} ms "
        f"(the unchanged replay reproduces the measured steps within {w.error_pct:.2f}%{kept})"
    )


def tensor_parallel_degree(facts: RunFacts) -> dict[str, int]:
    """FSDP unit → tensor-parallel degree, for units whose parameters are TP-sharded DTensors.

    On a 2-D (dp, tp) mesh FSDP gathers each parameter's *TP-local* shard, so a unit's gathered
    elements understate its parameters by up to the TP degree while units without TP (the root:
    embeddings, head, norms) are counted whole. A unit is TP-sharded when the forward pass runs
    tensor-parallel collectives (``role == "tensor_parallel"``) after its all-gather and before
    the next unit's: the Colwise/Rowwise plans all-reduce inside the modules they shard.
    Read from the first rank with collectives, first step only."""
    for rf in facts.rank_facts:
        first = min((x.step for x in rf.collectives if x.step >= 0), default=0)  # once, not once per collective
        colls = [c for c in rf.collectives if c.step == first and c.phase == "forward"]
        tp = [c for c in colls if c.role == "tensor_parallel" and c.group_size and c.group_size > 1]
        if not tp:
            continue
        gathers = sorted((c.cpu_ts_us, c.unit) for c in colls if c.kind == "all_gather" and c.unit is not None)
        out: dict[str, int] = {}
        for c in tp:
            before = [u for ts, u in gathers if ts <= c.cpu_ts_us]
            if before:
                out[before[-1]] = max(out.get(before[-1], 1), int(c.group_size))
        return out
    return {}


#: The mixed-precision fixes (bf16 parameters for compute and all-gathers, fp32 gradient reduction)
#: that more than one rule proposes.
MIXED_PRECISION_FSDP2 = """from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.layers:
    fully_shard(block, mp_policy=mp)
fully_shard(model, mp_policy=mp)
"""
MIXED_PRECISION_FSDP1 = """from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

model = FSDP(model, auto_wrap_policy=policy,
             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
"""
