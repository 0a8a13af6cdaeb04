"""What it detects
    Activations (tensors saved for backward) fill most of the memory at the peak.

Why it hurts
    Activation memory grows with batch size × sequence length and limits both. FSDP shards
    parameters, gradients and optimizer state, but not activations: past a point, more GPUs do
    not help and the run OOMs on long context.

How it shows in a trace
    In the memory snapshot, the blocks alive at the peak were allocated by forward ops
    (autograd-saved tensors) and are freed during backward; the peak sits at the end of forward.
    Silent when the run crashed on memory held outside PyTorch's allocator (see FSD024 ``oom``):
    checkpointing cannot help that crash.

    Silent where activations saved for backward are not established: an inference run (the traces
    show no backward pass or optimizer step in any step: nothing is saved, checkpointing cannot
    free anything), and a snapshot without allocation history (its blocks at dump time are told
    apart by their stacks alone: a tensor allocated in forward and alive at the dump may be an
    output, a cache or an inference intermediate; FSD025 ``memory-history-missing`` says how much
    memory that leaves unexplained).

    Checkpointing already applied is read from the snapshot's forward stacks
    (``MemoryFacts.activation_checkpointing``: none / partial / full / selective) or, without
    them, from the recompute the trace shows in backward. The finding says what is applied and
    what more would give: checkpointing for the blocks that lack it (their activations at the
    peak), full instead of selective checkpointing, or, when every block is already checkpointed,
    the other lever.

Fix
    Activation checkpointing per transformer block (recompute in backward), then a smaller
    micro-batch with gradient accumulation.

Known problems
    Blocks are told apart by the line that calls them and FSDP's forward hooks between them; a
    model that calls each block from a line of its own, none of them checkpointed, shows those
    blocks as unchecked activations but does not count them as blocks.
"""

from fsdpdoctor.fmt import mib, pct

from ._idiom import idiom_fix
from ._util import activations_established, finding

CODE = "FSD020"
SLUG = "activation-memory-dominates"
TITLE = "Activations dominate peak memory"
SEVERITY = "warning"
MEMORY_ADVICE = True  # a warning only under memory pressure (engine.judge_pressure)
THRESHOLDS = ("activation_share_pct", "checkpoint_kept_fraction")

FIX = """from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
# FSDP2: call before fully_shard; or wrap each block's forward in torch.utils.checkpoint.checkpoint
"""
REST_FIX = """from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

# checkpointing covers some blocks only: wrap every block (torchtitan: --activation_checkpoint.mode full)
apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
"""
FULL_FIX = """# every block is already checkpointed: what each block keeps (its input) scales with the
# micro-batch and the sequence. Run a smaller micro-batch with gradient accumulation (the global
# batch stays), or split long sequences over GPUs (context parallelism)."""


def check(facts, cfg):
    m = facts.memory
    if m is None or not m.peak_allocated_bytes:
        return []
    if (
        m.oom is not None and m.oom.cause == "outside"
    ):  # the run crashed on memory held outside PyTorch: checkpointing cannot help
        return []
    if not activations_established(facts):
        return []
    act = m.categories.get("activations", 0)
    share = 100 * act / m.peak_allocated_bytes
    if share < cfg["activation_share_pct"]:
        return []
    kept = cfg["checkpoint_kept_fraction"]
    ac = m.activation_checkpointing
    if ac is None and facts.fsdp.activation_checkpointing:  # no stacks to read: the trace's recompute
        ac = "on"
    evidence = [f"activations {mib(act)} = {pct(share)} of the {mib(m.peak_allocated_bytes)} peak"]
    if m.peak_phase:
        evidence.append(f"the peak is reached during {m.peak_phase}")
    head = f"Activations take {pct(share)} of peak memory"
    unchecked = m.activations_unchecked_bytes
    blocks = f"{m.checkpointed_blocks} of {m.forward_blocks} blocks" if m.forward_blocks else "some blocks"
    if ac == "full":
        freed = 0
        summary = (
            f"{head} with activation checkpointing already on every block ({blocks}); the other lever is a "
            "smaller micro-batch or sequence."
        )
        evidence.append(f"activation checkpointing: full ({blocks}, from the allocation stacks)")
        fix = FULL_FIX
    elif ac in ("partial", "selective"):
        freed = int((unchecked or 0) * (1 - kept))
        what = (
            f"checkpointing is on for {blocks}"
            if ac == "partial"
            else f"selective checkpointing is on ({blocks}: a policy saves some ops' outputs)"
        )
        more = "checkpointing the remaining blocks" if ac == "partial" else "full checkpointing of those blocks"
        summary = f"{head}; {what}: {more} would free about {mib(freed)}."
        evidence.append(
            f"activation checkpointing: {ac} ({blocks}, from the allocation stacks); "
            f"{mib(unchecked or 0)} of the activations at the peak come from blocks "
            + ("without it" if ac == "partial" else "under the selective policy")
        )
        fix = REST_FIX
    elif ac == "on":
        freed = 0
        summary = (
            f"{head} with activation checkpointing already on (the trace recomputes forward ops in backward; "
            "how many blocks, the snapshot's stacks do not say)."
        )
        if facts.fsdp.activation_checkpointing_evidence:
            evidence.append(facts.fsdp.activation_checkpointing_evidence)
        fix = FULL_FIX
    else:
        freed = int(act * (1 - kept))
        summary = f"{head}; per-block activation checkpointing would free about {mib(freed)}."
        if ac == "none":
            evidence.append("activation checkpointing: none (no forward allocation runs under torch.utils.checkpoint)")
        fix = FIX
    return [
        finding(
            __name__,
            summary,
            evidence=evidence,
            cause="tensors saved for backward scale with batch × sequence length and are not sharded by FSDP",
            fix={"any": fix} if fix is FULL_FIX else idiom_fix(facts, "activation_checkpointing", {"any": fix}),
            confidence=0.8,
            est_saving_bytes=freed or None,
        )
    ]
