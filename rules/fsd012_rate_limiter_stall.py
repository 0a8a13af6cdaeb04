"""What it detects
    FSDP1's all-gather rate limiter (``limit_all_gathers=True``, the default) blocking the CPU.

Why it hurts
    With at most two all-gathers in flight, the CPU thread blocks in
    ``FullyShardedDataParallel.rate_limiter`` (a ``cudaEventSynchronize``) until an earlier
    unit's memory is freed, so it cannot enqueue further kernels.

How it shows in a trace
    Long ``FullyShardedDataParallel.rate_limiter`` CPU ranges in forward.

Fix
    If memory allows, ``limit_all_gathers=False``; otherwise larger units or less memory
    pressure (activation checkpointing) so the limiter rarely waits.

Known problems
    Not yet seen firing on a real trace: the recorded FSDP1 CPU run spends 0.18 ms per step in the
    limiter (under ``rate_limiter_min_ms``), the H100 FSDP1 recording none. It is held to a
    generated twin (preset ``rate-limited-fsdp1``: per-``nn.Linear`` units, 8k-token sequences whose
    attention holds no parameters, a 20 GB/s link, where the limiter keeps the FFN's and the
    output's all-gathers from running ahead): its twin with ``limit_all_gathers=False`` is 2.29 ms
    (12%) faster per step, the replay estimates 2.48 ms (1.08x; GPU-bound, no per-step sync:
    2.27 ms, estimated 2.54 ms, 1.12x). Without a replay the cost is the limiter's CPU time capped
    at the GPU's idle time, which may have other causes. CPU-only traces cannot tell whether the blocked CPU costs
    anything and report its CPU time with no saving, while a limiter that blocks a CPU running
    ahead of the GPU costs nothing (a generated FSDP1 run with 20 µs of Python per op: about 40 ms
    per step blocked, and its twin without the limiter no faster, tests/test_whatif.py).
"""

from fsdpdoctor.fmt import ms

from ._util import finding, fix_for, of_cpu_step, replayed_saving, step_ms

CODE = "FSD012"
SLUG = "rate-limiter-stall"
TITLE = "FSDP1 rate limiter blocks the CPU"
SEVERITY = "warning"
REPLAY_FIX = "rate_limiter_off"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = ("rate_limiter_min_ms", "rate_limiter_min_pct")

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {
    "gpu": [("host_bound_idle", None), ("other_idle", None)],
    "cpu": [("cpu_fsdp_hooks", "forward"), ("cpu_forward", None)],
}
CLAIM_PRIORITY = 90  # specific findings claim before the general ones that they explain


def check(facts, cfg):
    fs = facts.fsdp
    rl = fs.rate_limiter_ms_per_step
    sm = step_ms(facts)
    if not fs.fix_applies("rate_limiter_off") or not sm:
        return []
    # a blocked CPU only costs time when the GPU runs dry meanwhile: on GPU traces the cost is
    # bounded by the GPU's idle time; CPU-only traces cannot tell, so the CPU time is reported
    cost = min(rl, facts.timeline.idle_ms) if facts.gpu_present else rl
    replayed = replayed_saving(facts, "rate_limiter_off")
    if replayed is not None:  # the replay with the limiter's synchronizations not blocking
        cost = replayed
    if cost < cfg["rate_limiter_min_ms"] or 100 * cost / sm < cfg["rate_limiter_min_pct"]:
        return []
    saving = cost if facts.gpu_present else None
    return [
        finding(
            __name__,
            f"The CPU blocks {ms(rl)} per step in FSDP1's all-gather rate limiter.",
            evidence=[f"FullyShardedDataParallel.rate_limiter: {ms(rl)} per step = {of_cpu_step(facts, rl)}"]
            + ([f"GPU idle {ms(facts.timeline.idle_ms)} per step"] if facts.gpu_present else []),
            cause="limit_all_gathers=True with units whose memory is freed late",
            fix=fix_for(
                facts, fsdp1="model = FSDP(model, auto_wrap_policy=policy, limit_all_gathers=False)  # if memory allows"
            ),
            confidence=0.8,
            est_saving_ms=saving,
        )
    ]
