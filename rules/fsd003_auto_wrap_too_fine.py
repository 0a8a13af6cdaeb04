"""What it detects
    Many FSDP units with small all-gathers (e.g. every ``nn.Linear`` wrapped separately).

Why it hurts
    Each unit costs a collective launch, hook CPU time and NCCL latency regardless of size. Below
    a few MiB a collective runs at its latency floor, far from the link's bandwidth, and the CPU
    time in FSDP hooks grows with the number of units.

How it shows in a trace
    Dozens of ``FSDP::pre_forward`` ranges per step, a small median all-gather
    (``Out msg nelems``), achieved bus bandwidth of the small all-gathers far below the largest
    ones, and a large share of CPU time inside FSDP hook ranges.

Fix
    Wrap at the transformer-block level instead of individual layers.

Known problems
    Its fix is per-block wrapping, but it does not check whether the units already are blocks: a
    generated GPT-2 small (12 blocks, 8 ranks) wrapped one unit per block, with 0.8 ms of CPU per
    FSDP hook, has 13 units and a 13.5 MiB median all-gather (under ``fine_max_median_ag_mib``) and
    fires on the hooks' replay (7.49 ms shorter without them) although its small collectives reach
    79.1% of the best bandwidth; there fewer hook calls help (two blocks per unit, see
    gpu-starved-by-hooks), not per-block wrapping. The saving adds the replay without any hook CPU
    time, which larger units cut but do not remove, so it can run high; on the generated too-fine
    twin it predicted 5.64 ms where the per-block run was 5.98 ms faster. Where the trace has no
    all-gather sizes, they are taken as fp32. CPU-only traces are judged on the hooks' CPU share
    (``hook_overhead_pct``) and get no saving; the real gloo twin (per-linear → per-block) was
    46.49 ms faster per step.
"""

import statistics

from fsdpdoctor.fmt import mib, ms, pct

from ._util import REPLAY_MAX_ERROR_PCT, collectives, finding, fix_for, is_fsdp, of_cpu_step, per_step_per_rank, step_ms

CODE = "FSD003"
SLUG = "auto-wrap-too-fine"
TITLE = "FSDP wrapping too fine: many small, latency-bound all-gathers"
SEVERITY = "warning"
REPLAY_FIX = "hooks_off"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = (
    "fine_min_units",
    "fine_max_median_ag_mib",
    "hook_overhead_pct",
    "fine_latency_share",
    "fine_hook_saving_pct",
)

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {
    "gpu": [("exposed_all_gather", None), ("exposed_reduce_scatter", None), ("host_bound_idle", None)],
    "cpu": [("cpu_fsdp_hooks", None), ("cpu_forward", None), ("cpu_backward", None)],
}
CONFIG_KEYS = ("unit_count",)  # a configuration finding: it explains a change only when these changed
CLAIM_PRIORITY = 70  # specific findings claim before the general ones that they explain


FIX_FSDP2 = """from torch.distributed.fsdp import fully_shard

# one unit per transformer block, not per nn.Linear
for block in model.layers:
    fully_shard(block)
fully_shard(model)
"""
FIX_FSDP1 = """import functools
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
model = FSDP(model, auto_wrap_policy=policy)   # instead of size_based / per-Linear wrapping
"""


def check(facts, cfg):
    if not is_fsdp(facts):
        return []
    units = facts.fsdp.units
    if len(units) < cfg["fine_min_units"]:
        return []
    ags = collectives(facts, "all_gather")
    sizes = [c.bytes for _, c in ags if c.bytes]
    if not sizes:
        sizes = [u.unsharded_numel * 4 for u in units if u.unsharded_numel]  # dtype unknown: assume fp32
    if not sizes:
        return []
    median = statistics.median(sizes)
    if median >= cfg["fine_max_median_ag_mib"] * 2**20:
        return []
    evidence = [
        f"{len(units)} FSDP units; median all-gather {mib(median)} (threshold {mib(cfg['fine_max_median_ag_mib'] * 2**20)})",
    ]
    hook = facts.fsdp.hook_cpu_ms_per_step
    cpu_step = facts.steps.mean_ms or 0.0
    share = 100 * hook / cpu_step if cpu_step > 0 else 0.0
    if hook > 0:
        evidence.append(f"CPU time inside FSDP hooks: {ms(hook)} per step = {of_cpu_step(facts, hook)}")
    # small units alone are no finding: demand measured evidence that they cost time
    measured = []
    w = facts.whatif
    if facts.gpu_present and w is not None and w.error_pct <= REPLAY_MAX_ERROR_PCT:
        hooks_saving = w.saving_ms.get("hooks_off", 0.0)
        if step_ms(facts) > 0 and 100 * hooks_saving / step_ms(facts) >= cfg["fine_hook_saving_pct"]:
            measured.append(
                f"what-if replay: without the FSDP hooks' CPU time the step is {ms(hooks_saving)} shorter "
                f"(the hooks are on the critical path)"
            )
        if w.latency_share is not None and w.latency_share >= cfg["fine_latency_share"]:
            measured.append(
                f"fixed latency is {pct(100 * w.latency_share)} of the median collective's duration "
                f"(fit duration = latency + bytes / bandwidth over the run's all-gathers and reduce-scatters)"
            )
    elif not facts.gpu_present and share >= cfg["hook_overhead_pct"]:
        measured.append(f"no GPU timeline: FSDP hooks take {pct(share)} of the CPU step")
    if not measured:
        return []
    evidence += measured
    saving = None
    timed = [
        (c.bytes, c.gpu_dur_us, c.exposed_us)
        for _, c in collectives(facts)
        if c.kind in ("all_gather", "reduce_scatter") and c.bytes and c.gpu_dur_us
    ]
    if facts.gpu_present and timed:
        best = max(b / d for b, d, _ in timed)  # best achieved bytes/µs in this run
        small = [b / d for b, d, _ in timed if b <= median]
        if small:
            evidence.append(
                f"small collectives reach {pct(100 * statistics.median(small) / best)} of the best achieved bandwidth in this run"
            )
        # time above what the same bytes take at the best achieved rate, where it is exposed
        latency = sum(min(e, max(d - b / best, 0.0)) for b, d, e in timed) / 1e3
        saving = per_step_per_rank(facts, latency) or None
        if w is not None and w.error_pct <= REPLAY_MAX_ERROR_PCT and w.saving_ms.get("hooks_off"):
            # device side (latency above the best achieved rate, where exposed) plus host side
            # (the replay without the hooks' CPU time): fewer, larger units remove most of both
            saving = (saving or 0.0) + w.saving_ms["hooks_off"]
    return [
        finding(
            __name__,
            f"{len(units)} FSDP units with a median all-gather of {mib(median)}: collectives run at their latency floor.",
            evidence=evidence,
            cause="an auto-wrap policy that wraps individual layers (or a small min_num_params)",
            fix=fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, lever="wrap_policy"),
            confidence=0.7,
            est_saving_ms=saving,
        )
    ]
