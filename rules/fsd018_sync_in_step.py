"""What it detects
    Synchronizations inside the step that drain the GPU's launch queue: a call that blocks until
    the GPU is done (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``.item()``'s
    ``aten::_local_scalar_dense``, ``.cpu()``, a copy to pageable memory) after which the GPU sits
    idle until the CPU launches again.

Why it hurts
    While the CPU runs ahead, the GPU always has queued work; a synchronization throws that lead
    away: the GPU finishes everything queued, then waits for the CPU to launch the next kernel,
    and the CPU's time between the synchronization and the next launch is on the critical path.

How it shows in a trace
    A blocking call that begins while the GPU is busy and returns when it has run dry, and a GPU
    idle gap from there to the next kernel (``efficiency.idle_ms["sync_drain"]``, by call site in
    ``efficiency.syncs``, with the Python line where the trace has stacks).

Fix
    Keep values on the GPU inside the step (accumulate the loss as a tensor, log every N steps),
    avoid data-dependent Python on GPU values (``if x.any():``), and find the calls with
    ``torch.cuda.set_sync_debug_mode("warn")``.

Known problems
    The saving is the idle the synchronizations drain the GPU into; where the value is needed
    every step (gradient clipping by a norm read on the CPU), moving the read is the fix, not
    removing it. The profiler's own synchronization at the end of its window drains nothing and
    is not counted.
"""

from fsdpdoctor.fmt import ms

from ._util import finding, of_step, step_ms

CODE = "FSD018"
SLUG = "sync-in-step"
TITLE = "Synchronizations inside the step drain the GPU's launch queue"
SEVERITY = "warning"
THRESHOLDS = ("waterfall_min_part_pct", "sync_drain_min_pct", "severity_warning_pct")

EXPLAINS = {"gpu": [("host_bound_idle", None), ("other_idle", None)], "cpu": []}
CLAIM_PRIORITY = 92
SUPERSEDED_BY = ("cpu-offload-stall",)

FIX = """# keep values on the GPU inside the step; read them back every N steps
running_loss += loss.detach()                     # instead of loss.item() every step
if step % log_every == 0:
    print((running_loss / log_every).item())
    running_loss.zero_()
# find every synchronizing call (warns with the Python stack)
torch.cuda.set_sync_debug_mode("warn")
"""


def check(facts, cfg):
    e = facts.efficiency
    step = step_ms(facts)
    if e is None or not facts.gpu_present or not step or facts.fsdp.cpu_offload.detected:
        return []  # CPU offload's blocking copies drain the queue: cpu-offload-stall's
    idle, drained = e.parts_ms["gpu_idle"], e.idle_ms.get("sync_drain", 0.0)
    if 100 * idle / step < cfg["waterfall_min_part_pct"] or 100 * drained / step < max(
        cfg["sync_drain_min_pct"], cfg["severity_warning_pct"]
    ):
        return []
    sites = [s for s in e.syncs if s.gpu_idle_ms_per_step >= 0.005]
    evidence = [
        f"GPU idle {ms(idle)} per step = {of_step(facts, idle)}; {ms(drained)} of it right after "
        "synchronizations: the GPU ran dry while the CPU waited, then waited for the next launch"
    ]
    for s in sites[:5]:
        evidence.append(
            f"{s.site}{' (' + s.line + ')' if s.line else ''}: {s.calls_per_step:g} a step, the CPU blocked "
            f"{ms(s.cpu_ms_per_step)}, the GPU idle {ms(s.gpu_idle_ms_per_step)} after it"
        )
    if not any(s.line for s in sites):
        evidence.append("the trace has no Python stacks (profile with with_stack=True) to name the calling lines")
    top = sites[0].site if sites else "synchronizations"
    return [
        finding(
            __name__,
            f"Synchronizations inside the step ({top}{' …' if len(sites) > 1 else ''}) leave the GPU idle "
            f"{ms(drained)} per step ({of_step(facts, drained)}).",
            evidence=evidence,
            cause="GPU values read back on the CPU inside the step (.item(), .cpu(), explicit synchronizations)",
            fix={"any": FIX},
            confidence=0.6,
            est_saving_ms=drained,
            where={"site": top},
        )
    ]
