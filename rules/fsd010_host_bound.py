"""What it detects
    The GPU idles for a large share of each step while the CPU is busy: kernel launch overhead,
    FSDP hook overhead, Python, data loading.

Why it hurts
    Time the GPU spends idle is time it is not computing; faster communication cannot help.

How it shows in a trace
    Gaps between kernels inside the step's GPU window with neither compute nor communication
    running; many short kernels; long CPU ranges (FSDP hooks, data loader) between launches.

Fix
    Give the GPU bigger pieces of work: a larger per-GPU batch, ``torch.compile`` or CUDA graphs
    to cut launch overhead, fewer FSDP units, DataLoader workers with ``pin_memory``.
"""

from fsdpdoctor.fmt import ms, pct

from ._util import finding, step_ms

CODE = "FSD010"
SLUG = "host-bound"
TITLE = "GPU waits for the CPU"
SEVERITY = "warning"
THRESHOLDS = ("host_bound_idle_pct",)

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": [("host_bound_idle", None), ("other_idle", None)], "cpu": []}
CLAIM_PRIORITY = 100  # specific findings claim before the general ones that they explain

SUPERSEDED_BY = ("cpu-offload-stall", "straggler-rank")

FIX = """model = torch.compile(model)            # fewer, larger kernels; less Python per step
loader = DataLoader(ds, batch_size=bs, num_workers=8, pin_memory=True, persistent_workers=True)
"""


def check(facts, cfg):
    if not facts.gpu_present:
        return []
    t = facts.timeline
    if t.gpu_window_ms <= 0:
        return []
    idle_pct = 100 * t.idle_ms / t.gpu_window_ms
    if idle_pct < cfg["host_bound_idle_pct"]:
        return []
    evidence = [
        f"GPU idle {ms(t.idle_ms)} of a {ms(t.gpu_window_ms)} GPU window per step = {pct(idle_pct)}",
        f"compute {ms(t.compute_ms)}, exposed communication {ms(t.exposed_comm_ms)} per step",
    ]
    if facts.fsdp.hook_cpu_ms_per_step and step_ms(facts):
        evidence.append(f"CPU time in FSDP hooks {ms(facts.fsdp.hook_cpu_ms_per_step)} per step")
    # what remains idle after the fix: assume 5% of the window
    saving = max(t.idle_ms - 0.05 * t.gpu_window_ms, 0.0)
    return [
        finding(
            __name__,
            f"The GPU is idle {pct(idle_pct)} of each step waiting for the CPU.",
            evidence=evidence,
            cause="kernel launch / Python / FSDP hook overhead or data loading on the critical path",
            fix={"any": FIX},
            confidence=0.6,
            est_saving_ms=saving or None,
        )
    ]
