"""What it detects
    Unsharded (all-gathered) parameters kept alive across forward and backward, e.g. FSDP2
    ``reshard_after_forward=False`` or FSDP1 ``SHARD_GRAD_OP``.

Why it hurts
    Every unit's full parameters stay in memory from its forward until its backward, so the
    peak holds the whole unsharded model instead of one or two units at a time.

How it shows in a trace
    The snapshot's blocks allocated by FSDP's all-gather (unsharded parameter storage) are still
    alive at the peak; the trace shows no all-gathers in backward.

Fix
    ``reshard_after_forward=True`` (FSDP2 default for non-root units) / ``FULL_SHARD`` (FSDP1),
    trading one extra all-gather per unit in backward for the memory.

Known problems
    The bytes count every unsharded parameter block alive at the peak, including those the fix
    leaves: the root unit, which FSDP2 by default does not reshard after forward, and the unit
    running or prefetched at that moment. On the H100 fsdp2 recording the 64.0 MiB unsharded at the
    peak are, by size, the root unit's parameters; on fsdp2-ac the 112.1 MiB are the root's
    64.0 MiB and one block's 48.0 MiB. The blocks are recognised by FSDP's unshard and all-gather
    frames in the snapshot's stacks: from a trace alone (the no-reshard CPU recording shows no
    backward all-gathers) it draws nothing.
"""

from fsdpdoctor.fmt import mib, pct

from ._util import finding, fix_for

CODE = "FSD021"
SLUG = "unsharded-params-held"
TITLE = "Unsharded parameters held across forward and backward"
SEVERITY = "warning"
MEMORY_ADVICE = True  # a warning only under memory pressure (engine.judge_pressure)
THRESHOLDS = ("unsharded_share_pct",)

FIX_FSDP2 = """for block in model.layers:
    fully_shard(block, reshard_after_forward=True)   # the default for non-root units
fully_shard(model)
"""
FIX_FSDP1 = """from torch.distributed.fsdp import ShardingStrategy
model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD)
"""


def check(facts, cfg):
    m = facts.memory
    if m is None or not m.peak_allocated_bytes:
        return []
    held = m.categories.get("parameters_unsharded", 0)
    share = 100 * held / m.peak_allocated_bytes
    if share < cfg["unsharded_share_pct"]:
        return []
    evidence = [f"unsharded parameters {mib(held)} = {pct(share)} of the {mib(m.peak_allocated_bytes)} peak"]
    if facts.fsdp.reshard_after_forward is False:
        evidence.append(
            f"no all-gathers in backward: reshard_after_forward is off ({facts.fsdp.sources.get('reshard_after_forward', 'trace')})"
        )
    return [
        finding(
            __name__,
            f"Unsharded parameters hold {pct(share)} of peak memory ({mib(held)}).",
            evidence=evidence,
            cause="reshard_after_forward=False / SHARD_GRAD_OP keeps every unit's full parameters alive until its backward",
            fix=fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, lever="reshard_after_forward"),
            confidence=0.7,
            est_saving_bytes=held,
        )
    ]
