"""Memory pressure: how close the run came to the memory it has, decided once for every rule.

Memory advice (checkpoint activations, shard more, defragment) costs compute or complexity; it
pays only where memory is short. The run is under pressure when it ran out of memory, or when the
most it reserved reaches ``memory_pressure_pct`` (80%) of its capacity: the budget the user
gave (``--memory-budget``), else the GPU's total memory (the traces' ``deviceProperties``).
Without a known capacity the pressure is "unknown" and memory findings stay informational.

The headroom (capacity − peak reserved) is also a lever of its own: a GPU that idles while
three quarters of its memory is free can take a larger micro-batch (:func:`batch_headroom`).
"""

from __future__ import annotations

from fsdpdoctor.facts import MemoryPressureFacts, RunFacts

GiB = 1 << 30


def device_total(facts: RunFacts, rank: int | None) -> int | None:
    """Total memory of rank ``rank``'s GPU from the traces' ``deviceProperties`` (any rank's
    when ``rank`` is unknown and every rank has the same GPU); None without traces."""
    totals = {r.rank: r.device_memory_bytes for r in facts.rank_facts if r.device_memory_bytes}
    if rank in totals:
        return totals[rank]
    return next(iter(totals.values())) if len(set(totals.values())) == 1 else None


def peak_reserved(facts: RunFacts) -> int | None:
    """The most the caching allocator reserved: at the allocated peak, along the memory curve, at
    the end (the allocated peak when no reserved figure was recorded)."""
    m = facts.memory
    if m is None:
        return None
    seen = [v for v in (m.reserved_at_peak_bytes, m.end_reserved_bytes) if v]
    seen += [int(v) for v in m.curve.reserved if v]
    if seen:
        return max(seen)
    return m.peak_allocated_bytes or None


def judge_oom(facts: RunFacts) -> None:
    """The OOM's cause, decided once: where a trace gives the device's total, the memory held
    outside PyTorch's allocator (total − free − reserved at the OOM); when it exceeds what PyTorch
    reserved and the request, that is the cause ("outside"), whatever the allocator's state says."""
    m = facts.memory
    o = m.oom if m is not None else None
    if o is None:
        return
    total = device_total(facts, m.rank)
    o.device_total_bytes = total
    if not total or o.device_free_bytes is None:
        return
    o.outside_bytes = max(total - o.device_free_bytes - o.reserved_bytes, 0)
    if o.outside_bytes > o.reserved_bytes and o.outside_bytes >= o.requested_bytes:
        o.cause = "outside"
        o.explanation = (
            f"memory outside PyTorch's allocator ({o.outside_bytes} bytes: another process, another library's "
            "pool, NCCL buffers or a second model) leaves too little for the request"
        )


def memory_pressure(facts: RunFacts, budget_gib: float = 0.0, pressure_pct: float = 80.0) -> MemoryPressureFacts | None:
    """The run's memory pressure (None without memory facts); decides the OOM's cause too
    (:func:`judge_oom`)."""
    m = facts.memory
    if m is None:
        return None
    judge_oom(facts)
    out = MemoryPressureFacts(threshold_pct=pressure_pct, peak_reserved_bytes=peak_reserved(facts))
    if budget_gib and budget_gib > 0:
        out.capacity_bytes, out.capacity_source = int(budget_gib * GiB), "budget"
    else:
        total = device_total(facts, m.rank)
        if total:
            out.capacity_bytes, out.capacity_source = int(total), "device"
    if out.capacity_bytes and out.peak_reserved_bytes is not None:
        out.used_pct = 100.0 * out.peak_reserved_bytes / out.capacity_bytes
        out.headroom_bytes = out.capacity_bytes - out.peak_reserved_bytes
    if m.oom:
        out.level = "oom"
    elif out.used_pct is None:
        out.level = "unknown"
    else:
        out.level = "high" if out.used_pct >= pressure_pct else "low"
    out.batch_headroom = batch_headroom(facts, out)
    return out


def batch_headroom(facts: RunFacts, p: MemoryPressureFacts | None = None) -> float | None:
    """How many times the micro-batch could grow before the peak reaches the pressure threshold,
    with activations growing in proportion and everything else fixed: ``(threshold × capacity −
    (peak − activations)) / activations`` on the allocated peak. None where it cannot be told
    (no capacity, no activations in the snapshot, or under pressure already)."""
    p = p if p is not None else facts.memory_pressure
    m = facts.memory
    if p is None or m is None or p.level != "low" or not p.capacity_bytes:
        return None
    act = m.categories.get("activations", 0)
    if act <= 0 or not m.peak_allocated_bytes:
        return None
    reserved_over = max((p.peak_reserved_bytes or 0) - m.peak_allocated_bytes, 0)  # kept by the cache at the peak
    fixed = m.peak_allocated_bytes - act + reserved_over
    room = p.threshold_pct / 100 * p.capacity_bytes - fixed
    return room / act if room > act else None
