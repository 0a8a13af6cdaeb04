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
    ``efficiency.syncs``, with the Python line where the trace has stacks). Or one call site that
    keeps the CPU blocked a material share of the step while the GPU itself runs nothing for
    that share too (``sync_blocked_min_pct``, both): a small copy
    to pageable memory (``aten::to`` → ``cudaMemcpyAsync``, ``Memcpy DtoH (Device -> Pageable)``)
    that waits for everything queued before it on the GPU. The finding names the call's user
    annotation, op, tensor (shape, dtype, bytes) and what the CPU waited for: the GPU work that
    ran meanwhile (communication among it) and the time the GPU itself ran nothing, its queued
    work held back by a dependency the trace does not show.

Fix
    For a small tensor copied to the CPU inside the step: ``non_blocking=True`` into pinned memory
    (and wait on an event only where the value is needed), or keep it on the GPU, or move the
    ``.to("cpu")`` out of the step. Keep values on the GPU inside the step (accumulate the loss
    as a tensor, log every N steps), avoid data-dependent Python on GPU values
    (``if x.any():``), and find the calls with ``torch.cuda.set_sync_debug_mode("warn")``.

Saving
    A blocked CPU wait is the time the CPU waited for the GPU's queue to drain: removing the
    synchronization frees that CPU time, but the GPU's queued work (and whatever its queue waits
    on) still has to run. For blocking copies to pageable memory the saving is the what-if
    replay's with those copies pinned and no longer blocking (``pin``); for ``.item()`` read-backs
    (kept on the GPU and read every N steps by the fix) the CPU's wait in them, at most the GPU's
    idle; elsewhere the idle the synchronizations drain the GPU into. On the generated typical
    run with an ``.item()`` after each of 4 blocks it estimates 3.74 ms where the twin without
    them was 3.78 ms faster (0.99x, step-synced and GPU-bound; 2.50 ms, 0.66x, before).

Known problems
    The saving is the idle the synchronizations drain the GPU into (or the replay's); where the
    value is needed every step (gradient clipping by a norm read on the CPU), moving the read is
    the fix, not removing it. The replay frees the blocking copies and keeps every GPU wait it
    cannot explain as measured: where such a wait was itself caused by the synchronization (on
    another rank), the saving is low. The profiler's own synchronization at the end of its window drains nothing and
    is not counted.
"""

from fsdpdoctor.fmt import ms

from ._util import REPLAY_MAX_ERROR_PCT, finding, of_step, replay_evidence, step_ms

CODE = "FSD018"
SLUG = "sync-in-step"
TITLE = "Synchronizations inside the step drain the GPU's launch queue"
SEVERITY = "warning"
THRESHOLDS = ("waterfall_min_part_pct", "sync_drain_min_pct", "severity_warning_pct", "sync_blocked_min_pct")

EXPLAINS = {"gpu": [("host_bound_idle", None), ("other_idle", None)], "cpu": []}
CLAIM_PRIORITY = 92
SUPERSEDED_BY = ("cpu-offload-stall",)

FIX_COPY = """# a small tensor copied to the CPU inside the step waits for everything queued on the GPU:
# copy it asynchronously into pinned memory and wait for it only where the value is needed
host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)  # once, outside the loop
host.copy_(t, non_blocking=True)
done = torch.cuda.Event(); done.record()
...                                            # launch more GPU work here
done.synchronize()                             # the value, as late as possible
# or keep the tensor on the GPU (no .to("cpu") / .tolist() in the step), or move the read out of the step
"""

FIX = """# keep values on the GPU inside the step; read them back every N steps
running_loss += loss.detach()                     # instead of loss.item() every step
if step % log_every == 0:
    print((running_loss / log_every).item())
    running_loss.zero_()
# find every synchronizing call (warns with the Python stack)
torch.cuda.set_sync_debug_mode("warn")
"""


def _waited(facts, s) -> str:
    """What the CPU waited for while ``s`` blocked it."""
    work = f"{ms(s.waited_busy_ms_per_step)} of GPU work queued before it" + (
        f" ({ms(s.waited_comm_ms_per_step)} of it communication)" if s.waited_comm_ms_per_step >= 0.05 else ""
    )
    idle = (
        f" and {ms(s.waited_idle_ms_per_step)} in which the GPU ran nothing, its queued work held back by a "
        f"dependency the trace does not show (another stream, an event, a peer; the longest gap {ms(s.longest_idle_ms)})"
        if s.waited_idle_ms_per_step >= 0.05
        else ""
    )
    return f"the CPU waited for the GPU's queue to drain: {work}{idle}"


def _what(s) -> str:
    """``## sparse_data_dist ##`` → ``aten::to`` of int64[88] (704 B, DtoH (Device -> Pageable))."""
    where = " → ".join(x for x in (s.annotation, s.op) if x) or s.site
    copy = f"a {s.copy} copy" if s.copy else None
    size = f"{s.bytes_per_call:.0f} bytes" if s.bytes_per_call else None
    detail = ", ".join(b for b in (s.tensor, size, copy) if b)
    return f"{where}{' (' + detail + ')' if detail else ''}"


def check(facts, cfg):
    e = facts.efficiency
    step = step_ms(facts)
    if e is None or not facts.gpu_present or not step or facts.fsdp.cpu_offload.detected:
        return []  # CPU offload's blocking copies drain the queue: cpu-offload-stall's
    idle, drained = e.parts_ms["gpu_idle"], e.idle_ms.get("sync_drain", 0.0)
    # a call that blocks the CPU while the GPU itself runs nothing for long: both sides wait, the
    # GPU's stall shows in the CPU's profile as the call's time (a step-end synchronization of a
    # GPU-bound step waits on a busy GPU: nothing hidden there)
    least = cfg["sync_blocked_min_pct"] * step / 100
    blocking = [s for s in e.syncs if s.cpu_ms_per_step >= least and s.waited_idle_ms_per_step >= least]
    drains = 100 * idle / step >= cfg["waterfall_min_part_pct"] and 100 * drained / step >= max(
        cfg["sync_drain_min_pct"], cfg["severity_warning_pct"]
    )
    if not drains and not blocking:
        return []
    sites = [s for s in e.syncs if s.gpu_idle_ms_per_step >= 0.005 and s not in blocking]
    evidence = []
    blocked = sum(s.cpu_ms_per_step for s in blocking)
    for s in blocking[:3]:
        evidence.append(
            f"{_what(s)}: {s.calls_per_step:g} a step, the CPU blocked {ms(s.cpu_ms_per_step)} per step = "
            f"{of_step(facts, s.cpu_ms_per_step)}" + (f" ({s.line})" if s.line else "")
        )
        evidence.append(_waited(facts, s))
    if drains:
        evidence.append(
            f"GPU idle {ms(idle)} per step = {of_step(facts, idle)}; {ms(drained)} of it right after "
            "synchronizations: the GPU ran dry while the CPU waited, then waited for the next launch"
        )
    for s in sites[:5]:
        evidence.append(
            f"{s.site}{' (' + s.line + ')' if s.line else ''}: {s.calls_per_step:g} a step, the CPU blocked "
            f"{ms(s.cpu_ms_per_step)}, the GPU idle {ms(s.gpu_idle_ms_per_step)} after it"
        )
    if not any(s.line for s in blocking + sites):
        evidence.append("the trace has no Python stacks (profile with with_stack=True) to name the calling lines")
    saving = drained
    copies = [s for s in blocking if s.copy and "Pageable" in s.copy]
    w = facts.whatif
    if copies and w is not None and "pin" in w.saving_ms and w.error_pct <= REPLAY_MAX_ERROR_PCT:
        saving = max(saving, w.saving_ms["pin"])
        evidence.append(replay_evidence(facts, "pin", "these copies into pinned memory, not blocking"))
    # scalar read-backs (.item()): the fix keeps the value on the GPU and reads it every N steps, so
    # the CPU no longer waits there; the step shortens by that wait where the CPU is the critical
    # path, never by more than the GPU's idle (its queued work still runs). Copies of tensors the CPU
    # needs to launch what follows (a split's lengths) are not claimed: their fix is pinning (above)
    items = [s for s in e.syncs if s.op in ("aten::item", "aten::_local_scalar_dense")]
    item_wait = sum(s.cpu_ms_per_step for s in items)
    span = None
    if item_wait >= 0.005 and min(item_wait, idle) > saving:
        low, saving = saving, min(item_wait, idle)
        span = [low, saving]
        evidence.append(
            f".item() read-backs block the CPU {ms(item_wait)} per step; kept on the GPU and read every N steps, "
            f"the step shortens by that wait, at most the GPU's idle {ms(idle)} (saving {ms(saving)}; "
            f"{ms(low)} if only the idle right after them goes)"
        )
    if blocking:
        evidence.append(
            f"removing the wait frees {ms(blocked)} of CPU per step, not that much of the step: the GPU's queued work "
            f"still has to run, and the step shortens only by what the CPU can then do beside it (saving: {ms(saving)})"
        )
    top = blocking[0] if blocking else (sites[0] if sites else None)
    name = (_what(top) if blocking else top.site) if top else "synchronizations"
    more = " and more" if len(blocking) + len(sites) > 1 else ""
    summary = (
        f"{name} blocks the CPU {ms(blocked)} per step ({of_step(facts, blocked)}) waiting for the GPU's queue."
        if blocking
        else f"Synchronizations inside the step ({name}{more}) leave the GPU idle {ms(drained)} per step "
        f"({of_step(facts, drained)})."
    )
    fix = {"any": FIX_COPY + "\n" + FIX} if copies else {"any": FIX}
    return [
        finding(
            __name__,
            summary,
            evidence=evidence,
            cause="a GPU value read back on the CPU inside the step (a copy to pageable memory, .item(), .cpu(), "
            "an explicit synchronization) waits for all the GPU work queued before it",
            fix=fix,
            confidence=0.6,
            est_saving_ms=saving,
            saving_span_ms=span,
            saving_assumptions=(
                "nothing on the CPU needs the .item() values inside the step, and the CPU is the critical path "
                "while it waits; the span's low end: only the idle right after them goes"
                if span
                else ""
            ),
            saving_ceiling_ms=idle or None,
            where={"site": top.site if top else "synchronizations"},
        )
    ]
