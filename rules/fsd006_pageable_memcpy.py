"""What it detects
    Host↔device copies from or to pageable (unpinned) host memory.

Why it hurts
    A pageable copy is staged through a pinned bounce buffer by the driver and is synchronous
    with respect to the host: it cannot overlap with other work and runs at a fraction of the
    PCIe/NVLink-C2C bandwidth of a pinned copy.

How it shows in a trace
    ``Memcpy HtoD (Pageable -> Device)`` / ``Memcpy DtoH (Device -> Pageable)`` GPU events.

Fix
    Pin the host buffers: ``CPUOffloadPolicy(pin_memory=True)`` (FSDP2), ``pin_memory=True`` in
    the DataLoader, ``tensor.pin_memory()`` for buffers you copy yourself.
"""

from fsdpdoctor.fmt import ms

from ._util import finding

CODE = "FSD006"
SLUG = "pageable-memcpy"
TITLE = "Host copies use pageable memory"
SEVERITY = "warning"
THRESHOLDS = ("pageable_min_count",)

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": [("memcpy", None), ("host_bound_idle", None), ("other_idle", None)], "cpu": []}
CLAIM_PRIORITY = 40  # specific findings claim before the general ones that they explain


FIX = """from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

fully_shard(module, offload_policy=CPUOffloadPolicy(pin_memory=True))
loader = torch.utils.data.DataLoader(dataset, batch_size=bs, pin_memory=True)
"""


def check(facts, cfg):
    off = facts.fsdp.cpu_offload
    if off.pageable_count < cfg["pageable_min_count"] or off.pageable_count == 0:
        return []
    steps = max(facts.steps.count, 1) * max(len([r for r in facts.rank_facts if r.gpu_present]), 1)
    per_step = off.pageable_ms / max(facts.steps.count, 1)
    return [
        finding(
            __name__,
            f"{off.pageable_count} host copies use pageable memory ({ms(per_step)} of copy time per step).",
            evidence=[off.evidence, f"pageable copy time {ms(per_step)} per step"],
            cause="host tensors that are not pinned (CPUOffloadPolicy(pin_memory=False), DataLoader without pin_memory)",
            fix={"any": FIX},
            confidence=0.9,
            # a pinned copy is asynchronous and roughly twice as fast: half the time is recovered at least
            est_saving_ms=per_step * 0.5 if per_step > 0 else None,
            where={"copies": off.pageable_count, "rank_steps": steps},
        )
    ]
