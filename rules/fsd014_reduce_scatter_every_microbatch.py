"""What it detects
    Gradient accumulation that reduce-scatters every unit's gradients on every micro-batch,
    although only the last micro-batch's reduction is needed before the optimizer step.

Why it hurts
    Each skipped micro-batch would save one reduce-scatter per unit (and, with HSDP, one
    replica all-reduce): with k micro-batches, (k-1)/k of the gradient communication is
    redundant. The price of skipping it is memory: FSDP keeps the unsharded gradients between
    micro-batches (FSDP2 ``set_requires_gradient_sync(False)``, FSDP1 ``no_sync()``), so this is
    advice for runs with memory headroom.

How it shows in a trace
    Several forward passes per ``ProfilerStep`` (split at each ``FSDP::root_pre_forward`` /
    outermost ``FullyShardedDataParallel.forward``) and, for every unit, as many reduce-scatters
    per step as forward passes.

Fix
    Turn gradient synchronisation off for all but the last micro-batch.

Known problems
    The saving is the what-if replay of the fix (``no_sync``: every micro-batch's reduce-scatter
    but the last dropped, with FSDP's chunk-cat before it and its output's cast after it): on the
    generated twin with 3 micro-batches it gives 3.55 ms where the run without the extra
    reductions was 3.53 ms faster (3.58 vs 3.57 ms GPU-bound). The exposed reduce-scatter time of
    the earlier micro-batches alone said 2.55 ms: what queued behind those reductions on the
    communicator goes too. Without a replay the saving is that exposed time. There is no real twin
    yet: the ticket says "not validated on a real run". The memory the fix costs (unsharded gradients kept
    between micro-batches) is not read from the snapshot: the finding does not say whether the run
    has the headroom.
"""

from fsdpdoctor.fmt import ms

from fsdpdoctor.config import REPLAY_MAX_ERROR_PCT

from ._util import collectives, finding, fix_for, is_fsdp, per_step_per_rank, replay_evidence

CODE = "FSD014"
SLUG = "reduce-scatter-every-microbatch"
TITLE = "Gradient accumulation reduce-scatters on every micro-batch"
SEVERITY = "info"
REPLAY_FIX = "no_sync"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)

FIX_FSDP2 = """for i, batch in enumerate(microbatches):
    model.set_requires_gradient_sync(i == len(microbatches) - 1)   # reduce only on the last
    loss = model(batch).loss / len(microbatches)
    loss.backward()
optim.step()
"""
FIX_FSDP1 = """import contextlib

for i, batch in enumerate(microbatches):
    last = i == len(microbatches) - 1
    with (contextlib.nullcontext() if last else model.no_sync()):
        (model(batch).loss / len(microbatches)).backward()
optim.step()
"""


def check(facts, cfg):
    fs = facts.fsdp
    k = fs.microbatches_per_step
    if not is_fsdp(facts) or k < 2:
        return []
    units = [u for u in fs.units if u.reduce_scatters > 0]
    if not units or any(u.reduce_scatters < k for u in units):
        return []  # some micro-batches already skip the reduction
    evidence = [
        f"{k} forward passes (micro-batches) per step",
        f"each of {len(units)} FSDP units reduce-scatters {min(u.reduce_scatters for u in units):g} times per step",
    ]
    saving = None
    if facts.gpu_present:
        rs = [c for _, c in collectives(facts, "reduce_scatter")]
        exposed = per_step_per_rank(facts, sum(c.exposed_us for c in rs) / 1e3)
        # the reduce-scatters the fix removes: those of every micro-batch but the last, as exposed
        # as they were measured (the last one's stay)
        early = per_step_per_rank(facts, sum(c.exposed_us for c in rs if c.microbatch < k - 1) / 1e3)
        evidence.append(
            f"reduce-scatters exposed {ms(exposed)} per step, {ms(early)} of it on the {k - 1} micro-batches before the last"
        )
        saving = early if early > 0 else None
        w = facts.whatif
        if w is not None and "no_sync" in w.saving_ms and w.error_pct <= REPLAY_MAX_ERROR_PCT:
            # the replay also frees what queued behind those reduce-scatters on the communicator
            # (the next micro-batch's all-gathers)
            saving = w.saving_ms["no_sync"]
            evidence.append(replay_evidence(facts, "no_sync", "gradient sync on the last micro-batch only"))
    return [
        finding(
            __name__,
            f"Gradients are reduce-scattered on each of {k} micro-batches; only the last one needs it.",
            evidence=evidence,
            cause="gradient synchronisation is left on during gradient accumulation",
            fix=fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1),
            confidence=0.6,
            est_saving_ms=saving,
        )
    ]
