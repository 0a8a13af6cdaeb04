"""What it detects
    A memory snapshot without allocation history (``device_traces`` empty), e.g. from
    ``torch.cuda.memory_snapshot()`` or a dump without ``_record_memory_history``.

Why it matters
    Without history there are no lifetimes and no stack per allocation event: the peak cannot be
    located in time and categories come from the final segments only.

How it shows in a trace
    The snapshot has segments and blocks but no ``alloc``/``free`` entries.

    What that leaves unknown is said: the blocks alive at the dump that were allocated under forward
    frames (the snapshot's ``activations``) may be saved for a backward pass or may be outputs,
    caches and intermediates of a run without one (an inference or evaluation loop); with no
    lifetimes to tell, no activation-checkpointing advice is given (FSD020 stays silent).

Fix
    Record history before the steps you want to see, then dump.

Known problems
    It fires only when the history is empty. A history cut short by its ring buffer
    (``max_entries``) is not flagged: blocks allocated before its first entry count as
    pre-existing, attributed by size where they look like parameters or optimizer state, else to
    other memory.
"""

from fsdpdoctor.fmt import mib, pct

from ._util import finding

CODE = "FSD025"
SLUG = "memory-history-missing"
TITLE = "Memory snapshot has no allocation history"
SEVERITY = "info"
THRESHOLDS = ()

FIX = """torch.cuda.memory._record_memory_history(max_entries=200_000)
for step in range(3):
    train_step()
torch.cuda.memory._dump_snapshot(f"snapshot_rank{rank}.pickle")
# or: fsdpdoctor.capture.capture(out_dir, model=model, memory_history=True)
"""


def check(facts, cfg):
    m = facts.memory
    if m is None or not m.history_missing:
        return []
    evidence = [f"segments at dump: {mib(m.reserved_at_peak_bytes)} reserved, {mib(m.peak_allocated_bytes)} allocated"]
    summary = "The snapshot has no allocation history: only the segments at dump time are reported."
    fwd = m.categories.get("activations", 0)
    if fwd and m.peak_allocated_bytes:
        summary = (
            "The snapshot has no allocation history: only the segments at dump time are reported, and whether the "
            f"{mib(fwd)} allocated in forward are activations saved for backward is not established (no "
            "checkpointing advice)."
        )
        evidence.append(
            f"not established: whether the {mib(fwd)} ({pct(100 * fwd / m.peak_allocated_bytes)}) allocated under "
            "forward frames and alive at the dump are activations saved for a backward pass, or outputs and "
            "intermediates of a run without one: no lifetimes and no backward pass recorded, so no "
            "activation-checkpointing advice"
        )
    return [
        finding(
            __name__,
            summary,
            evidence=evidence,
            cause="snapshot taken without torch.cuda.memory._record_memory_history",
            fix={"any": FIX},
            confidence=1.0,
        )
    ]
