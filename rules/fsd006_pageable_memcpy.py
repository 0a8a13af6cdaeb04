"""What it detects
    Host↔device copies from or to pageable (unpinned) host memory.

Why it hurts
    A pageable copy is staged through a pinned bounce buffer by the driver and is synchronous
    with respect to the host: it cannot overlap with other work and runs at a fraction of the
    PCIe/NVLink-C2C bandwidth of a pinned copy.

How it shows in a trace
    ``Memcpy HtoD (Pageable -> Device)`` / ``Memcpy DtoH (Device -> Pageable)`` GPU events, and
    ``cudaMemcpyAsync`` calls on the CPU that last as long as their copy.

Saving
    The what-if replay with every pageable copy at the pinned rate (the trace's own pinned copies
    of 1 MiB or more, else 25 GB/s, varied 12.5-50 GB/s for the range) and the CPU call of each
    copy nothing waits on no longer blocking: a device-to-host copy is a read-back the CPU needs,
    and a copy the thread synchronizes on before its next launch (``cudaStreamSynchronize`` right
    after it, as on the public DLRM trace) is needed at once; both keep blocking. The copies'
    effect on the step through the critical path, nothing where the step is bound elsewhere. Under CPU offload
    the one real twin (H100, FSDP2 ``CPUOffloadPolicy``) went the other way: the pinned run was
    slower, its CPU AdamW step running ~1.6× longer on pinned host memory, which the replay does
    not see; there the finding promises no saving.

Fix
    Pin the host buffers: ``CPUOffloadPolicy(pin_memory=True)`` (FSDP2), ``pin_memory=True`` in
    the DataLoader, ``tensor.pin_memory()`` for buffers you copy yourself.

Known problems
    Under CPU offload the one real twin went the other way (the pinned run 18.8 ms slower: its CPU
    AdamW ran longer on pinned host memory), so the finding promises nothing there. The replay
    frees the CPU at every pinned copy; a consumer that needs the data still waits for it, which
    the trace shows only where it synchronizes.
"""

from fsdpdoctor.fmt import ms, plural

from ._idiom import idiom_parts
from ._util import REPLAY_MAX_ERROR_PCT, finding, fix_for, is_fsdp, of_step, replay_evidence

CODE = "FSD006"
SLUG = "pageable-memcpy"
TITLE = "Host copies use pageable memory"
SEVERITY = "warning"
REPLAY_FIX = "pin"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = ("pageable_min_count",)

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": [("memcpy", None), ("host_bound_idle", None), ("other_idle", None)], "cpu": []}
CLAIM_PRIORITY = 40  # specific findings claim before the general ones that they explain
# copies that .item() / .cpu() read back each step: removing the read (sync-in-step) is the fix, not pinning
SUPERSEDED_BY = ("sync-in-step",)


FIX_OFFLOAD = """from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

fully_shard(module, offload_policy=CPUOffloadPolicy(pin_memory=True))  # offloaded shards in pinned memory
"""

FIX_LOADER = """loader = torch.utils.data.DataLoader(dataset, batch_size=bs, pin_memory=True)  # batches in pinned memory
batch = batch.to(device, non_blocking=True)                                     # asynchronous copy
"""
FIX_BUFFERS = """# a host tensor copied every step: allocate it once in pinned memory
buf = torch.empty(shape, dtype=dtype, pin_memory=True)
"""
FIX_DATA = FIX_LOADER + FIX_BUFFERS

FIX_INFERENCE = """inputs = inputs.pin_memory()                   # or allocate host buffers with pin_memory=True once
inputs = inputs.to(device, non_blocking=True)
"""


def check(facts, cfg):
    off = facts.fsdp.cpu_offload
    if off.pageable_count < cfg["pageable_min_count"] or off.pageable_count == 0:
        return []
    steps = max(facts.steps.count, 1) * max(len([r for r in facts.all_ranks() if r.gpu_present]), 1)
    per_step = off.pageable_ms / max(facts.steps.count, 1)
    in_hooks = off.pageable_in_hooks
    evidence = [
        off.evidence
        if in_hooks
        else f"{plural(off.pageable_count, 'host copy', 'host copies')} from/to pageable memory"
        + (", none inside FSDP hooks" if is_fsdp(facts) else "")
    ]
    if facts.gpu_present:
        evidence.append(f"pageable copy time {ms(per_step)} per step = {of_step(facts, per_step)}")
    offload = bool(in_hooks and is_fsdp(facts) and off.detected)
    if in_hooks and is_fsdp(facts):
        fix = fix_for(
            facts,
            fsdp2=FIX_OFFLOAD,
            none_known="pageable copies in FSDP1's hooks (its CPUOffload pins "
            "the flat parameters: pin what else is copied there)",
        )
        cause = "FSDP offloads to pageable host memory (CPUOffloadPolicy(pin_memory=False))"
    else:
        # the loader's pinning as the run's framework sets it; buffers the user copies stay torch code
        plain = fix_for(facts, training=FIX_DATA, inference=FIX_INFERENCE)
        fix = idiom_parts(facts, [("pin_memory", FIX_LOADER), (None, FIX_BUFFERS)], plain)
        cause = "host tensors copied to or from the GPU are not pinned (input batches, .cpu() results)"
    # the saving: the replay of pinned copies; without it (CPU-only, or a replay that misses the
    # measured steps), half the copy time (a pinned copy is asynchronous and several times faster)
    saving = per_step * 0.5 if facts.gpu_present else None
    w = facts.whatif
    if w is not None and "pin" in w.saving_ms and w.error_pct <= REPLAY_MAX_ERROR_PCT:
        saving = w.saving_ms["pin"]
        evidence.append(replay_evidence(facts, "pin", "pinned host memory"))
        if w.evidence.get("pin"):
            evidence.append(f"replayed with {w.evidence['pin']}")
    return [
        finding(
            __name__,
            f"{plural(off.pageable_count, 'host copy', 'host copies')} {'uses' if off.pageable_count == 1 else 'use'} pageable memory "
            f"({ms(per_step)} of copy time per step).",
            evidence=evidence,
            cause=cause,
            fix=fix,
            confidence=0.9,
            est_saving_ms=saving,
            # under CPU offload pinned memory also changes the CPU optimizer's speed (its real twin)
            saving_kind=f"{SLUG}/cpu-offload" if offload else "",
            where={"copies": off.pageable_count, "in_fsdp_hooks": in_hooks, "rank_steps": steps},
        )
    ]
