"""What it detects
    CPU offload on the critical path: host↔device copies of parameters and gradients that the
    GPU waits for, and an optimizer step running on the CPU while the GPU idles.

Why it hurts
    With ``CPUOffload(offload_params=True)`` / ``CPUOffloadPolicy`` every all-gather needs an H2D
    copy of the shard first, every reduce-scatter is followed by a D2H copy of the gradient, the
    end of backward synchronises on those copies, and the optimizer step runs on the CPU.

How it shows in a trace
    ``Memcpy HtoD (Pinned -> Device)`` before each all-gather and ``Memcpy DtoH`` after each
    reduce-scatter, launched inside FSDP hooks; exposed memcpy time on the GPU; a long
    ``Optimizer.step#`` range with the GPU idle.

Fix
    Turn offload off if the model fits (see the memory report), or keep it only for the
    optimizer state; otherwise keep ``pin_memory=True`` and overlap the optimizer step.

Known problems
    Dropping offload also moves the optimizer step to the GPU; the replay cuts the CPU optimizer
    step and does not add the GPU one (small for AdamW), so it can run slightly high; on its two
    real twins the measured saving was 1.02× and 1.14× the prediction.
"""

from fsdpdoctor.fmt import mib, ms

from ._util import REPLAY_MAX_ERROR_PCT, finding, fix_for, is_fsdp, of_cpu_step, replay_evidence

CODE = "FSD005"
SLUG = "cpu-offload-stall"
TITLE = "CPU offload stalls the GPU"
SEVERITY = "warning"
REPLAY_FIX = "offload_off"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = ("offload_min_ms",)
SAVES_ON = "step"  # the GPU also waits outside its window, while the CPU runs the optimizer step

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {
    "gpu": [("memcpy", None), ("host_bound_idle", None), ("other_idle", None)],
    "cpu": [("cpu_optimizer", None)],
}
CONFIG_KEYS = ("cpu_offload",)  # a configuration finding: it explains a change only when these changed
CLAIM_PRIORITY = 30  # specific findings claim before the general ones that they explain


FIX_FSDP2 = """from torch.distributed.fsdp import fully_shard

# drop offload_policy=CPUOffloadPolicy() when parameters + optimizer state fit on the GPU
for block in model.layers:
    fully_shard(block)
fully_shard(model)
"""
FIX_FSDP1 = """from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

# drop cpu_offload=CPUOffload(offload_params=True) when the model fits on the GPU
model = FSDP(model, auto_wrap_policy=policy)
"""


def _optimizer_ms(facts) -> float:
    per_rank = [
        sum(s.phase_ms.get("optimizer", 0.0) for s in r.steps) / len(r.steps) for r in facts.all_ranks() if r.steps
    ]
    return sum(per_rank) / len(per_rank) if per_rank else 0.0


def check(facts, cfg):
    off = facts.fsdp.cpu_offload
    if not is_fsdp(facts) or not facts.fsdp.fix_applies("offload_off"):
        return []
    evidence = [off.evidence]
    if not facts.gpu_present:
        return [
            finding(
                __name__,
                "CPU offload is on; this trace has no GPU activity, so its cost cannot be measured here.",
                evidence=evidence,
                fix=fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, lever="cpu_offload_off"),
                severity="info",
                confidence=0.5,
            )
        ]
    t = facts.timeline
    opt = _optimizer_ms(facts)
    # the GPU waits for host copies (exposed memcpy) and, while the CPU runs the optimizer step,
    # has no work: idle inside the GPU window plus step time with no GPU work at all
    stall = t.memcpy_ms + min(t.idle_ms + t.outside_window_ms, opt)
    replayed = facts.whatif.saving_ms.get("offload_off") if facts.whatif is not None else None
    if replayed is not None and facts.whatif.error_pct > REPLAY_MAX_ERROR_PCT:
        replayed = None
    if replayed is not None:  # a CPU-side cut too: bounded by the step (SAVES_ON), not the GPU window
        stall = replayed
    if stall < cfg["offload_min_ms"]:
        return []
    evidence += [
        f"exposed memcpy {ms(t.memcpy_ms)} per step; GPU idle {ms(t.idle_ms + t.outside_window_ms)} per step "
        f"(inside its {ms(t.gpu_window_ms)} window, and while the CPU step runs on without GPU work)",
        f"optimizer phase (CPU) {ms(opt)} per step = {of_cpu_step(facts, opt)}",
        f"copies per step: {mib(off.h2d_bytes / max(facts.steps.count, 1))} H2D, {mib(off.d2h_bytes / max(facts.steps.count, 1))} D2H",
    ]
    if replayed is not None:
        evidence.append(replay_evidence(facts, "offload_off", "dropping the host copies and the CPU optimizer step"))
    return [
        finding(
            __name__,
            f"CPU offload costs about {ms(stall)} per step: the GPU waits for host copies and the CPU optimizer step.",
            evidence=evidence,
            cause="CPUOffload(offload_params=True) / CPUOffloadPolicy moves parameters, gradients and the optimizer step to the host",
            fix=fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, lever="cpu_offload_off"),
            confidence=0.8,
            est_saving_ms=stall,
        )
    ]
