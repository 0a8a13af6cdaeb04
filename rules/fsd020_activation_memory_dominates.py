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

Fix
    Activation checkpointing per transformer block (recompute in backward), then a smaller
    micro-batch with gradient accumulation.
"""

from fsdpdoctor.fmt import mib, pct

from ._util import finding, name_blocks, oom_cause

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


def check(facts, cfg):
    m = facts.memory
    if m is None or not m.peak_allocated_bytes:
        return []
    if oom_cause(facts)[0] == "outside":  # the run crashed on memory held outside PyTorch: checkpointing cannot help
        return []
    act = m.categories.get("activations", 0)
    share = 100 * act / m.peak_allocated_bytes
    if share < cfg["activation_share_pct"]:
        return []
    freed = int(act * (1 - cfg["checkpoint_kept_fraction"]))
    evidence = [f"activations {mib(act)} = {pct(share)} of the {mib(m.peak_allocated_bytes)} peak"]
    if m.peak_phase:
        evidence.append(f"the peak is reached during {m.peak_phase}")
    return [
        finding(
            __name__,
            f"Activations take {pct(share)} of peak memory; per-block activation checkpointing would free about {mib(freed)}.",
            evidence=evidence,
            cause="tensors saved for backward scale with batch × sequence length and are not sharded by FSDP",
            fix={"any": name_blocks(facts, FIX)},
            confidence=0.8,
            est_saving_bytes=freed,
        )
    ]
