"""What it detects
    Activation checkpointing's price: the forward ops of checkpointed modules run a second time
    inside backward, and how much of the step that recompute takes.

Why it hurts
    Checkpointing trades compute for memory: every checkpointed block's forward is recomputed in
    backward (about a third more compute for a transformer block). On a GPU-bound run that time
    is on the critical path; it is worth paying only for the memory it saves.

How it shows in a trace
    Forward-only operators (``aten::gelu``, ``aten::layer_norm``, attention's forward, …) inside
    ``autograd::engine::evaluate_function`` backward nodes, and the GPU kernels they launch
    (``FsdpFacts.recompute_gpu_ms_per_step``: the efficiency waterfall's ``recompute`` part, the
    same figure in both places). ``compare`` names it when a run gained or lost checkpointing.

Fix
    Keep it only where the memory is needed: checkpoint every other block, or selectively (save
    the matmul outputs, recompute the cheap pointwise ops), or drop it when the peak fits without
    it (``fsdpdoctor analyze --memory`` shows the activation share of the peak).

Known problems
    The saving is the rule's estimate (the recomputed forward's GPU time, or on a CPU-bound run the
    CPU time of the backward nodes the recompute runs in), not a replay; on its two real twins the
    measured difference was 0.99× and 1.11× the estimate. The saving is that of dropping
    checkpointing; checkpointing every other block saves about half of it. Removing checkpointing
    costs memory: the finding is never graded above warning.
"""

from fsdpdoctor.fmt import ms

from ._util import finding, fix_for, of_step

CODE = "FSD019"
SLUG = "activation-recompute"
TITLE = "Activation checkpointing recomputes the forward in backward"
SEVERITY = "info"
MAX_SEVERITY = "warning"  # a trade of compute for memory: worth a look, never critical by itself
THRESHOLDS = ("recompute_min_pct",)
SAVES_ON = "gpu"

# compare: a run that gained (lost) checkpointing: the compute (CPU backward) it added (removed)
EXPLAINS = {"gpu": [("compute", None)], "cpu": [("cpu_backward", None)]}
CONFIG_KEYS = ("activation_checkpointing",)  # it explains a change only when checkpointing changed
CLAIM_PRIORITY = 50

FIX = """# the saving above is dropping checkpointing (where the peak fits without it: analyze --memory);
# checkpointing every other block instead saves about half of it and keeps about half of the memory it saves
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
blocks = set(list(model.layers)[::2])
apply_activation_checkpointing(model, check_fn=lambda m: m in blocks)

# or selectively: keep {what} outputs, recompute only the cheap ops (torch >= 2.4)
from functools import partial
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy
def policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in ({saved}) \\
        else CheckpointPolicy.PREFER_RECOMPUTE
out = checkpoint(block, x, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy))
"""
MATMUL_SAVED = ("matmul", "torch.ops.aten.mm.default, torch.ops.aten.addmm.default")
CONV_SAVED = ("convolution", "torch.ops.aten.convolution.default,")


def _fix_code(fs) -> str:
    """FIX with the expensive ops the recompute re-runs kept: convolutions where it re-runs
    convolutions and no matmul (a CNN: the MI300 ResNet re-runs aten::conv2d and batch_norm),
    else the matmuls."""
    names = " ".join(fs.recompute_ops)
    conv = "conv" in names and not any(k in names for k in ("linear", "matmul", "mm", "attention"))
    what, saved = CONV_SAVED if conv else MATMUL_SAVED
    return FIX.format(what=what, saved=saved)


def check(facts, cfg):
    fs = facts.fsdp
    if not fs.activation_checkpointing:
        return []
    gpu = fs.recompute_gpu_ms_per_step
    cpu = fs.recompute_cpu_ms_per_step
    step = facts.step_clock_ms
    # what the recompute costs the step: its GPU time where the GPU limits the step, its CPU
    # time where the CPU does (the launches of the recomputed ops)
    gpu_side = facts.gpu_present and facts.timeline.bound != "cpu"
    cost = gpu if gpu_side else cpu
    if not step or 100 * cost / step < cfg["recompute_min_pct"]:
        return []
    evidence = [fs.activation_checkpointing_evidence]
    if facts.gpu_present:
        evidence.append(
            f"recomputed forward kernels: {ms(gpu)} of GPU time per step = {of_step(facts, gpu)}"
            + (" (the recompute part of the step's breakdown)" if facts.efficiency is not None else "")
        )
    evidence.append(f"recomputed forward ops: {ms(cpu)} of CPU time per step")
    if facts.gpu_present and not gpu_side:
        evidence.append(
            f"the step is CPU-bound: the recompute costs it the CPU time of the re-run forward ({ms(cpu)}), "
            f"not its GPU time ({ms(gpu)})"
        )
    m = facts.memory
    if m is not None and m.peak_allocated_bytes:
        act = m.categories.get("activations", 0)
        if act:
            evidence.append(
                f"activations at the memory peak: {act / 2**30:.2f} GiB of {m.peak_allocated_bytes / 2**30:.2f} GiB"
            )
    code = _fix_code(fs)
    return [
        finding(
            __name__,
            f"Activation checkpointing recomputes the forward in backward: {ms(cost)} per step "
            f"({'GPU' if gpu_side else 'CPU'} time, {of_step(facts, cost)}); dropping it saves about that, "
            "checkpointing every other block about half.",
            evidence=evidence,
            cause="checkpoint_wrapper / apply_activation_checkpointing / torch.utils.checkpoint around the blocks",
            fix=fix_for(facts, fsdp2=code, fsdp1=code, ddp=code, training=code, lever="activation_checkpointing_less"),
            confidence=0.8,
            est_saving_ms=cost,
        )
    ]
