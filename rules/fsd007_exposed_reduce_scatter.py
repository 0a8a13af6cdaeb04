"""What it detects
    Reduce-scatters that run with nothing to hide behind: typically the last ones of backward,
    after the final gradient kernels, and the root unit's, which is issued last.

Why it hurts
    The optimizer step cannot start before the last reduce-scatter finishes, so every exposed
    millisecond lands on the step time.

How it shows in a trace
    Reduce-scatter kernels at the end of backward with no compute kernels running beside them.

Fix
    Keep the last unit to run in backward small: wrap the output layer / embeddings as units of
    their own so the root's reduce-scatter is small, and use bf16 reduce-scatters.

Known problems
    The saving is all the exposed reduce-scatter time, though the last reduce-scatter of backward
    has no gradient compute after it to hide behind whatever the wrapping: a fix leaves part of it.
    A reduce-scatter kernel also counts the time it waits for a late rank: in the generated
    slow-rank scenario it claims 13.03 ms per step (12.8% of the step) that the straggler causes
    and no wrapping or bf16 removes (the twin without the slow rank was 25.52 ms faster;
    straggler-rank's replay predicted 24.79 ms). It is folded into missing-backward-prefetch or
    auto-wrap-too-coarse only where a replay that reproduces the measured step within 5% shows
    their fix removing at least half of it. CPU-only traces draw nothing.
"""

from fsdpdoctor.fmt import ms

from ._idiom import idiom_parts
from ._util import REPLAY_MAX_ERROR_PCT, finding, fix_for, is_fsdp, of_step, step_ms

FOLD_SHARE = 0.5  # folded into the finding whose fix removes at least this share of it (what-if replay)
FOLD_INTO = (
    ("prefetch", "missing-backward-prefetch", "backward prefetch"),
    ("wrap", "auto-wrap-too-coarse", "per-block wrapping"),
)

CODE = "FSD007"
SLUG = "exposed-reduce-scatter"
TITLE = "Reduce-scatters not hidden behind compute"
SEVERITY = "warning"
THRESHOLDS = ("exposed_rs_min_ms", "exposed_rs_min_pct")

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": [("exposed_reduce_scatter", None)], "cpu": []}
CLAIM_PRIORITY = 110  # specific findings claim before the general ones that they explain


FIX_FSDP2 = """from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
fully_shard(model.output, mp_policy=mp)        # last in forward = first in backward, small
for block in model.layers:
    fully_shard(block, mp_policy=mp)
fully_shard(model.tok_embeddings, mp_policy=mp)  # keep the root unit small: its RS runs last
fully_shard(model, mp_policy=mp)
"""
FIX_FSDP1 = """from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

# wrap embeddings / output projection as their own units so the root's reduce-scatter is small
policy = ModuleWrapPolicy({TransformerBlock, torch.nn.Embedding})
model = FSDP(model, auto_wrap_policy=policy,
             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
"""


#: under a framework that wraps the units itself: what to keep small, then its bf16 setting
WHY_IDIOM = (
    "# keep the unit that runs last in backward small: the embeddings and output layer as units of their\n"
    "# own (not left in the root, whose reduce-scatter is issued last), and bf16 reduce-scatters:\n"
)


def check(facts, cfg):
    if not is_fsdp(facts) or not facts.gpu_present:
        return []
    exp = facts.exposed_comm.by_kind.get("reduce_scatter", 0.0)
    sm = step_ms(facts)
    if exp < cfg["exposed_rs_min_ms"] or not sm or 100 * exp / sm < cfg["exposed_rs_min_pct"]:
        return []
    worst = sorted(facts.fsdp.units, key=lambda u: -u.reduce_scatter_exposed_ms)[:3]
    evidence = [f"exposed reduce-scatter {ms(exp)} per step = {of_step(facts, exp)}"]
    evidence += [
        f"unit '{u.fqn or '(root)'}': {ms(u.reduce_scatter_exposed_ms)} exposed per step"
        for u in worst
        if u.reduce_scatter_exposed_ms > 0
    ]
    folded = None
    w = facts.whatif
    for fix, slug, what in FOLD_INTO if w is not None and w.error_pct <= REPLAY_MAX_ERROR_PCT else ():
        # e.g. reduce-scatters waiting for on-demand all-gathers on the same communicator: the
        # cost is the missing prefetch's, not a rival cause (the engine folds it only when that
        # finding fires)
        before, after = w.exposed_rs_ms.get("none", 0.0), w.exposed_rs_ms.get(fix)
        if after is not None and before > 0 and before - after >= FOLD_SHARE * before:
            folded = slug
            evidence.append(f"what-if replay: with {what} it drops to {ms(after)} per step")
            break
    return [
        finding(
            __name__,
            f"Reduce-scatters are exposed for {ms(exp)} per step, mostly at the end of backward.",
            folded_into=folded,
            evidence=evidence,
            cause="the last units of backward have no remaining gradient compute to overlap their reduce-scatter",
            fix=idiom_parts(
                facts, [(None, WHY_IDIOM), ("mixed_precision", "")], fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1)
            ),
            confidence=0.7,
            est_saving_ms=exp,
            # the assumption: the fix hides all of it; the low end leaves the worst unit's exposed
            # (the reduce-scatter that runs last has nothing after it to overlap, whatever its size)
            saving_span_ms=[max(exp - (worst[0].reduce_scatter_exposed_ms if worst else 0.0), 0.0), exp],
            saving_assumptions=(
                "all of the exposed reduce-scatter hidden (assumed); the worst unit's left exposed at the low end"
            ),
            where={"unit": worst[0].fqn if worst else None},
        )
    ]
