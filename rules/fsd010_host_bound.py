"""What it detects
    The GPU idles for a large share of each step while the CPU is busy: kernel launch overhead,
    FSDP hook overhead, Python, data loading.

Why it hurts
    Time the GPU spends idle is time it is not computing; faster communication cannot help.

How it shows in a trace
    Gaps between kernels inside the step's GPU window with neither compute nor communication
    running, while the CPU is not blocked waiting for the GPU (idle inside a synchronization is
    both sides waiting on something else, and a GPU that runs behind the CPU is not waiting for
    it); many short kernels; long CPU ranges (FSDP hooks, data loader) between launches.

Fix
    Give the GPU bigger pieces of work: a larger per-GPU batch (where the memory snapshot shows
    headroom, the finding says how much larger fits), ``torch.compile`` or CUDA graphs
    to cut launch overhead, fewer FSDP units, DataLoader workers with ``pin_memory``. For an
    inference run (no backward pass, no optimizer step): CUDA graphs
    (``torch.compile(mode="reduce-overhead")``; in vLLM, leave ``enforce_eager`` off) and larger
    batches; training advice (data loaders, FSDP units) does not apply.

Known problems
    The saving is a heuristic with no real twin (±50%): the idle less 5% of the GPU window, as if a
    fix removed nearly all of it. On the H100 fsdp2-bf16 recording it would claim 21.19 ms of the
    34.24 ms step where the replay without FSDP's hooks' CPU time gives 13.92 ms; there
    gpu-starved-by-hooks takes its place, as cpu-offload-stall and straggler-rank do where they
    fire. Only CUDA/HIP synchronizations and blocking copies count as the CPU waiting for the GPU:
    idle while the CPU waits for another rank outside CUDA (a gloo barrier, a CPU collective)
    counts as host-bound.
"""

from fsdpdoctor.analysis.pressure import batch_headroom
from fsdpdoctor.fmt import mib, ms, pct

from ._util import finding, fix_for, of_cpu_step, of_window, step_ms

CODE = "FSD010"
SLUG = "host-bound"
TITLE = "GPU waits for the CPU"
SEVERITY = "warning"
THRESHOLDS = ("host_bound_idle_pct",)

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": [("host_bound_idle", None), ("other_idle", None)], "cpu": []}
CLAIM_PRIORITY = 100  # specific findings claim before the general ones that they explain

SUPERSEDED_BY = ("cpu-offload-stall", "straggler-rank", "gpu-starved-by-hooks")

FIX = """model = torch.compile(model)            # fewer, larger kernels; less Python per step
loader = DataLoader(ds, batch_size=bs, num_workers=8, pin_memory=True, persistent_workers=True)
"""

FIX_INFERENCE = """# launch overhead between small kernels: replay each step from a CUDA graph
model = torch.compile(model, mode="reduce-overhead")   # CUDA graphs + fused kernels
# vLLM: keep CUDA graphs on (do not pass enforce_eager=True); raise max_num_seqs for larger batches
"""


def check(facts, cfg):
    if not facts.gpu_present:
        return []
    t = facts.timeline
    if t.gpu_window_ms <= 0:
        return []
    # idle while the CPU sits in a blocking call is both sides waiting (on another rank, an
    # event the trace does not show): the host is not what the GPU waits for then
    host_idle = max(t.idle_ms - t.idle_cpu_blocked_ms, 0.0)
    idle_pct = 100 * host_idle / t.gpu_window_ms
    if idle_pct < cfg["host_bound_idle_pct"]:
        return []
    evidence = [
        f"GPU idle (no work of any step running) while the CPU is not blocked on it: {ms(host_idle)} per step = "
        f"{of_window(facts, host_idle)}",
        f"compute {ms(t.compute_ms)}, exposed communication {ms(t.exposed_comm_ms)} per step",
    ]
    if t.idle_cpu_blocked_ms > 0.05 * t.gpu_window_ms:
        evidence.append(
            f"another {ms(t.idle_cpu_blocked_ms)} of GPU idle per step falls inside CPU synchronizations "
            "(both sides wait; not counted)"
        )
    if t.other_steps_ms > 0.05 * t.gpu_window_ms:
        evidence.append(
            f"the GPU runs behind the CPU: {ms(t.other_steps_ms)} of each window belongs to other steps' "
            "work and is not counted as idle"
        )
    if facts.fsdp.hook_cpu_ms_per_step and step_ms(facts):
        evidence.append(
            f"CPU time in FSDP hooks {ms(facts.fsdp.hook_cpu_ms_per_step)} per step = "
            f"{of_cpu_step(facts, facts.fsdp.hook_cpu_ms_per_step)}"
        )
    # what remains idle after the fix: assume 5% of the window
    saving = max(host_idle - 0.05 * t.gpu_window_ms, 0.0)
    inference = facts.workload == "inference"
    fix = fix_for(facts, training=FIX, inference=FIX_INFERENCE)
    grow = batch_headroom(facts)
    if grow is not None and grow >= 1.5 and not inference:
        p, act = facts.memory_pressure, facts.memory.categories.get("activations", 0)
        k = min(int(grow), 8)
        evidence.append(
            f"memory headroom: the peak reserved {mib(p.peak_reserved_bytes)} is {pct(p.used_pct)} of the "
            f"{mib(p.capacity_bytes)} {'budget' if p.capacity_source == 'budget' else 'GPU'}; with activations "
            f"({mib(act)} at the peak) growing with the batch, a micro-batch up to ~{grow:.0f}× larger stays "
            f"under {p.threshold_pct:g}%: more GPU work per launch and per FSDP hook"
        )
        fix = {
            key: f"batch_size = bs * {k}  # activations could grow ~{grow:.0f}x before 80% of memory; grow in steps\n"
            + code
            for key, code in fix.items()
        }
    return [
        finding(
            __name__,
            f"The GPU is idle {pct(idle_pct)} of its step window waiting for the CPU.",
            evidence=evidence,
            cause="kernel launch / Python overhead between small kernels"
            if inference
            else "kernel launch / Python / FSDP hook overhead or data loading on the critical path",
            fix=fix,
            confidence=0.6,
            est_saving_ms=saving,
        )
    ]
