"""What it detects
    An out-of-memory event recorded in the CUDA memory snapshot, and why the request failed.

Why it hurts
    The run crashed (or retried after freeing the cache). Nothing else in the report matters
    until it runs.

How it shows in a trace
    An ``oom`` entry in the snapshot's ``device_traces``: the requested size and the free device
    memory at that moment; the snapshot's replay gives what PyTorch had allocated and reserved
    then, and by what (categories). The trace's ``deviceProperties`` give the device's total
    memory, so the memory held *outside* PyTorch's allocator (another process, another library's
    pool such as CuPy or JAX, NCCL buffers, a second model, the CUDA context) is
    ``total − free − reserved``, as in torch's own OOM message ("Including non-PyTorch memory,
    this process has ... in use").

    The cause is chosen from those figures, in this order: memory outside PyTorch larger than
    what PyTorch reserved; fragmentation (enough cached free memory in total, no block large
    enough); cached free plus device free memory covering the request; otherwise the category
    of allocated memory that dominates.

    The failing statement is named from the failed request's stack: its innermost user line and
    function (``cross_entropy_loss (loss.py:21)``), the lines it spans, the C++ op where the
    stack has C++ frames, and the blocks it already holds (allocated since it began, in the same
    call, not below a module call) with their size; those count as temporaries, not activations.

Fix
    Only what can help the cause found: free or move what holds memory outside PyTorch;
    otherwise the fix for what the failing statement is, when it is recognised (a loss over a
    large vocabulary: a chunked or fused cross-entropy, loss parallel, a smaller local batch; an
    attention or MLP activation: checkpointing, or a smaller micro-batch where every block is
    already checkpointed; an all-gather: smaller FSDP units), else for what dominates memory
    (activation checkpointing for activations, more sharding or CPU offload for parameters,
    gradients and optimizer state, smaller micro-batches or chunked computation for
    temporaries); ``expandable_segments`` for fragmentation, or for cached plus device free
    memory covering the request, unless the snapshot's ``allocator_settings`` say it is on.
    Checkpointing only where activations saved for backward are established: never in an
    inference run (the traces show no backward pass or optimizer step).

Known problems
    The statement is read from line numbers, not source: lines of the failing call's function
    that ran after the failing line since the statement began count as its lines, so a loop
    body re-entered in the same call joins the statement. Without Python frames on the failed
    request (an autograd-thread allocation in backward) no statement is named.
"""

from fsdpdoctor.fmt import mib

from ._idiom import idiom_fix
from ._util import activations_established, finding, name_blocks

CODE = "FSD024"
SLUG = "oom"
TITLE = "Out of memory"
SEVERITY = "critical"
THRESHOLDS = ()
CRASH = True  # the run crashed: the engine ranks this finding first

OUTSIDE_FIX_SHELL = "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv"
OUTSIDE_FIX = """# Held outside PyTorch: another process, another library's pool
# (CuPy, JAX, TensorRT), NCCL buffers or a second model. Measure it:
free, total = torch.cuda.mem_get_info()
outside = total - free - torch.cuda.memory_reserved()
print(f"{outside / 2**30:.1f} GiB outside PyTorch")
# then stop that process, or free the library's pool first, e.g.
# cupy.get_default_memory_pool().free_all_blocks()"""
FRAGMENTATION_FIX = "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
CACHE_FIX = """# PyTorch's cache holds free blocks that together with the device's free memory would fit:
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"""
CATEGORY_FIX = {
    "activations": """from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))""",
    "temporary": """# Temporaries (one op's workspace or output) dominate: run smaller micro-batches
# (gradient accumulation keeps the global batch), or chunk the largest op (e.g. the loss over the vocabulary).""",
    "parameters_sharded": """# Shard across more GPUs (FULL_SHARD over a larger group), or offload to CPU:
fully_shard(module, offload_policy=CPUOffloadPolicy())  # FSDP2""",
    "parameters_unsharded": """# Unsharded parameters held: reshard after forward
fully_shard(block, reshard_after_forward=True)  # FSDP2""",
    "gradients": """# Shard gradients (FULL_SHARD / SHARD_GRAD_OP instead of NO_SHARD), or shard across more GPUs.""",
    "optimizer_state": """# Optimizer state is sharded with the parameters: shard across more GPUs, or offload:
fully_shard(module, offload_policy=CPUOffloadPolicy())  # FSDP2""",
    "allgather_buffers": """# Fewer all-gathered units alive at once: reshard after forward, no deeper prefetch
fully_shard(block, reshard_after_forward=True)  # FSDP2""",
    "reduce_scatter_buffers": """# Reduce-scatter buffers alive at once: smaller FSDP units (wrap each block).""",
}


LOSS_FIX = """# The loss over a large vocabulary holds logits-sized fp32 buffers at once (the upcast copy,
# the log-softmax output). Any of:
# 1. chunk it over the sequence, so one chunk's fp32 copy exists at a time
n = labels.numel()
loss = sum(F.cross_entropy(x.flatten(0, 1).float(), y.flatten(), reduction="sum")
           for x, y in zip(logits.split(1024, dim=1), labels.split(1024, dim=1))) / n
# 2. a fused linear + cross-entropy kernel that never materialises the logits
#    (e.g. Liger-Kernel's LigerFusedLinearCrossEntropyLoss)
# 3. with tensor parallelism, keep the logits sharded over the vocabulary:
#    with torch.distributed.tensor.parallel.loss_parallel(): loss = F.cross_entropy(logits, labels)
# 4. a smaller local batch (gradient accumulation keeps the global batch)"""
ALLGATHER_FIX = """# All-gathered parameters do not fit beside what is held: smaller FSDP units (wrap each block,
# or its attention and MLP), so less is gathered at once; no deeper prefetch
for block in model.layers:
    fully_shard(block, reshard_after_forward=True)  # FSDP2"""
SMALLER_BATCH_FIX = """# Every block already recomputes its activations in backward (full activation checkpointing):
# the other lever is the batch: a smaller micro-batch (or sequence) with gradient accumulation
# keeping the global batch, or more GPUs with context / tensor parallelism for long sequences."""
REMAINING_BLOCKS_FIX = """from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

# checkpointing is on for some blocks only: wrap the rest too
apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))"""
KIND_WORDS = {
    "loss": "in the loss",
    "activation": "in a forward activation",
    "allgather": "all-gathering parameters",
    "optimizer": "in the optimizer step",
}


def _activation_fix(m) -> str:
    ac = m.activation_checkpointing
    if ac == "full":
        return SMALLER_BATCH_FIX
    return REMAINING_BLOCKS_FIX if ac in ("partial", "selective") else CATEGORY_FIX["activations"]


def _statement_evidence(st) -> str:
    lines = st.lines or [st.line]
    where = f"{st.file}:{st.line}" + (f", lines {lines[0]}-{lines[-1]}" if len(lines) > 1 else "")
    text = f"failing statement: `{st.function}` ({where})" + (f", op {st.op}" if st.op else "")
    if st.temporaries_bytes:
        n = st.temporaries
        text += (
            f"; it already holds {n} block{'s' if n != 1 else ''} of its own, {mib(st.temporaries_bytes)}, "
            "allocated since it began (counted as temporary, freed when it completes)"
        )
    return text


def _expandable_on(m) -> bool:
    return bool(m.allocator_settings and m.allocator_settings.expandable_segments)


def check(facts, cfg):
    m = facts.memory
    if m is None or not m.oom:
        return []
    o = m.oom
    req, free, alloc, reserved = o.requested_bytes, o.device_free_bytes, o.allocated_bytes, o.reserved_bytes
    cached, largest = o.cached_free_bytes, o.largest_cached_free_block_bytes
    kind, total, outside = o.cause, o.device_total_bytes, o.outside_bytes
    cats = sorted(((k, v) for k, v in o.categories.items() if v), key=lambda kv: -kv[1])
    evidence = [f"requested {mib(req)} with {mib(free)} free on the device"]
    if total:
        evidence.append(f"device total {mib(total)} (the trace's deviceProperties)")
    evidence.append(
        f"PyTorch's allocator: {mib(reserved)} reserved, {mib(alloc)} allocated, {mib(cached)} cached free"
        + (f" (largest cached free block {mib(largest)})" if largest is not None else "")
    )
    if outside is not None:
        evidence.append(
            f"outside PyTorch's allocator: {mib(outside)} = total {mib(total)} − free {mib(free)} − reserved {mib(reserved)}"
        )
    else:
        evidence.append("device total unknown (no trace with deviceProperties): memory outside PyTorch not measured")
    if cats:
        evidence.append("allocated by: " + ", ".join(f"{k} {mib(v)}" for k, v in cats[:4]))
    if o.count > 1:
        evidence.append(f"{o.count} OOM events recorded; the last is described")
    st = o.statement
    if st:
        evidence.insert(0, _statement_evidence(st))
    if _expandable_on(m) and kind in ("fragmentation", "cache"):
        evidence.append("expandable_segments is already on (the snapshot's allocator_settings)")

    if kind == "outside":
        cause = (
            f"{mib(outside)} of the {mib(total)} device is held outside PyTorch's allocator (another process, another "
            f"library's pool, NCCL buffers or a second model); PyTorch itself reserved only {mib(reserved)}"
        )
        fix = {"find it": OUTSIDE_FIX_SHELL, "any": OUTSIDE_FIX}
    elif kind == "fragmentation":
        cause = (
            f"fragmentation: {mib(cached)} cached free in PyTorch's allocator, but no free block of {mib(req)} "
            f"(largest {mib(largest)})"
        )
        fix = {} if _expandable_on(m) else {"any": FRAGMENTATION_FIX}
    elif kind == "cache":
        cause = (
            f"{mib(cached)} cached free plus {mib(free)} free on the device would cover the {mib(req)} request, "
            "but neither alone does"
        )
        fix = {} if _expandable_on(m) else {"any": CACHE_FIX}
    else:
        top, v = cats[0] if cats else ("other", 0)
        cause = (
            f"PyTorch's allocated tensors fill the device; {top} take the most ({mib(v)} of {mib(alloc)})"
            if cats
            else "PyTorch's allocated tensors fill the device"
        )
        if top == "activations" and not activations_established(facts):  # inference: nothing saved for backward
            top = None
        fix = {"any": CATEGORY_FIX.get(top, "# Reduce what dominates the allocated memory (see the evidence).")}
    summary = f"Out of memory requesting {mib(req)}: {cause.split(';')[0]}."
    if st and kind != "outside":  # what the statement is decides the fix; the allocator's state follows
        what = KIND_WORDS.get(st.kind, "in")
        summary = f"Out of memory requesting {mib(req)} {what}, `{st.function}` ({st.file}:{st.line})"
        if st.temporaries_bytes:
            summary += f", while the statement already holds {mib(st.temporaries_bytes)} of its own"
        summary += (
            "; besides, no cached free block is large enough (fragmentation)." if kind == "fragmentation" else "."
        )
        stmt_fix = {"loss": LOSS_FIX, "allgather": ALLGATHER_FIX, "activation": _activation_fix(m)}.get(st.kind)
        if st.kind == "activation" and not activations_established(facts):
            stmt_fix = None  # an inference run saves nothing for backward: checkpointing cannot help
        if stmt_fix is not None:
            fix = {"any": stmt_fix, **({"allocator": fix["any"]} if kind in ("fragmentation", "cache") and fix else {})}
    elif st:
        where = f"`{st.function}` ({st.file}:{st.line})"
        summary = f"Out of memory requesting {mib(req)} at {where}: {cause.split(';')[0]}."
    if not fix:
        fix = {"any": "# expandable_segments is already on: reduce the largest requests (see the evidence)"}
    if "apply_activation_checkpointing" in fix.get("any", ""):  # the blocks' activations: the run's own way
        fix = idiom_fix(facts, "activation_checkpointing", {"any": fix["any"]}) | {
            k: v for k, v in fix.items() if k != "any"
        }
    fix = {k: name_blocks(facts, code) for k, code in fix.items()}
    return [
        finding(
            __name__,
            summary,
            evidence=evidence,
            cause=cause,
            fix=fix,
            confidence=0.9,
        )
    ]
