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

Fix
    Only what can help the cause found: free or move what holds memory outside PyTorch;
    ``expandable_segments`` for fragmentation; activation checkpointing when activations
    dominate; more sharding or CPU offload for parameters, gradients and optimizer state;
    smaller micro-batches or chunked computation for temporaries.
"""

from fsdpdoctor.fmt import mib

from ._util import finding, name_blocks, oom_cause

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


def check(facts, cfg):
    m = facts.memory
    if m is None or not m.oom:
        return []
    o = m.oom
    req = o.get("requested_bytes") or 0
    free = o.get("device_free_bytes")
    alloc = o.get("allocated_bytes") or 0
    reserved = o.get("reserved_bytes") or 0
    cached = o.get("cached_free_bytes") or 0
    largest = o.get("largest_cached_free_block_bytes")
    kind, total, outside = oom_cause(facts)
    cats = sorted(((k, v) for k, v in (o.get("categories") or {}).items() if v), key=lambda kv: -kv[1])
    evidence = [f"requested {mib(req)} with {mib(free)} free on the device"]
    if total:
        evidence.append(f"device total {mib(total)} (the trace's deviceProperties)")
    evidence.append(f"PyTorch's allocator: {mib(reserved)} reserved, {mib(alloc)} allocated, {mib(cached)} cached free"
                    + (f" (largest cached free block {mib(largest)})" if largest is not None else ""))
    if outside is not None:
        evidence.append(f"outside PyTorch's allocator: {mib(outside)} = total {mib(total)} − free {mib(free)} − reserved {mib(reserved)}")
    else:
        evidence.append("device total unknown (no trace with deviceProperties): memory outside PyTorch not measured")
    if cats:
        evidence.append("allocated by: " + ", ".join(f"{k} {mib(v)}" for k, v in cats[:4]))
    if o.get("count", 1) > 1:
        evidence.append(f"{o['count']} OOM events recorded; the last is described")

    if kind == "outside":
        cause = (f"{mib(outside)} of the {mib(total)} device is held outside PyTorch's allocator (another process, another "
                 f"library's pool, NCCL buffers or a second model); PyTorch itself reserved only {mib(reserved)}")
        fix = {"find it": OUTSIDE_FIX_SHELL, "any": OUTSIDE_FIX}
    elif kind == "fragmentation":
        cause = (f"fragmentation: {mib(cached)} cached free in PyTorch's allocator, but no free block of {mib(req)} "
                 f"(largest {mib(largest)})")
        fix = {"any": FRAGMENTATION_FIX}
    elif kind == "cache":
        cause = (f"{mib(cached)} cached free plus {mib(free)} free on the device would cover the {mib(req)} request, "
                 "but neither alone does")
        fix = {"any": CACHE_FIX}
    else:
        top, v = cats[0] if cats else ("other", 0)
        cause = (f"PyTorch's allocated tensors fill the device; {top} take the most ({mib(v)} of {mib(alloc)})"
                 if cats else "PyTorch's allocated tensors fill the device")
        fix = {"any": CATEGORY_FIX.get(top, "# Reduce what dominates the allocated memory (see the evidence).")}
    fix = {k: name_blocks(facts, code) for k, code in fix.items()}
    return [
        finding(
            __name__,
            f"Out of memory requesting {mib(req)}: {cause.split(';')[0]}.",
            evidence=evidence,
            cause=cause,
            fix=fix,
            confidence=0.9,
        )
    ]
