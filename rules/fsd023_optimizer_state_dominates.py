"""What it detects
    Optimizer state (Adam's two moments, master weights) fills most of peak memory.

Why it hurts
    Adam keeps 8 bytes per parameter (12 with an fp32 master copy). Without sharding it, or with
    too few ranks, it dominates memory for large models.

How it shows in a trace
    Snapshot blocks allocated from ``torch/optim/*`` at the first optimizer step and alive
    ever after.

Fix
    Shard it: FULL_SHARD / fully_shard shard optimizer state by construction; otherwise use more
    ranks, a lighter optimizer, or CPU offload of optimizer state.

Known problems
    Optimizer state is told from ``torch/optim`` frames and the optimizer phase; state created
    before the memory history started is attributed by size and count (Adam's two states per
    parameter), and goes to other memory where the sizes do not match. The fix does not know how
    far the state is already sharded: an FSDP2 run is told to ``fully_shard``, which it already
    does, where the levers left are more ranks or a lighter optimizer. On the H100 fsdp2 recording
    (one GPU, where ``fully_shard`` shards nothing) the AdamW state is 512.5 MiB, 12.7% of the
    3.94 GiB peak, under ``optimizer_share_pct``.
"""

from fsdpdoctor.fmt import mib, pct

from ._util import finding, fix_for

CODE = "FSD023"
SLUG = "optimizer-state-dominates"
TITLE = "Optimizer state dominates peak memory"
SEVERITY = "info"
MEMORY_ADVICE = True  # a warning only under memory pressure (engine.judge_pressure)
THRESHOLDS = ("optimizer_share_pct",)


FIX_FSDP2 = "fully_shard(model)  # parameters, gradients and optimizer state are sharded across ranks"
FIX_FSDP1 = "model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD)"
FIX_ZERO = """from torch.distributed.optim import ZeroRedundancyOptimizer

# each data-parallel rank keeps 1/world_size of the optimizer state
optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
"""


def check(facts, cfg):
    m = facts.memory
    if m is None or not m.peak_allocated_bytes:
        return []
    opt = m.categories.get("optimizer_state", 0)
    share = 100 * opt / m.peak_allocated_bytes
    if share < cfg["optimizer_share_pct"]:
        return []
    return [
        finding(
            __name__,
            f"Optimizer state takes {pct(share)} of peak memory ({mib(opt)}).",
            evidence=[f"optimizer state {mib(opt)} of a {mib(m.peak_allocated_bytes)} peak"],
            cause="unsharded or lightly sharded Adam-style state (8-12 bytes per parameter)",
            fix=fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, ddp=FIX_ZERO, training=FIX_ZERO),
            confidence=0.6,
            est_saving_bytes=None,
        )
    ]
