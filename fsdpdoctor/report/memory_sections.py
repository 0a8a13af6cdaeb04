"""The memory headline and tables: the peak by category, devices, the snapshot ledger (part of :mod:`.sections`)."""

from __future__ import annotations

from pathlib import Path

from fsdpdoctor.facts import RunFacts
from fsdpdoctor.fmt import mib, pct
from fsdpdoctor.report.tables import Table

BAR_WIDTH = 24  # the breakdown tables' bars, in characters


def memory_headline(f: RunFacts) -> list[tuple[str, str]]:
    m = f.memory
    if m is None:
        return []
    if m.history_missing:  # no peak: what the blocks held when the snapshot was taken
        peak = (
            "state at dump time, no allocation history recorded (`torch.cuda.memory._record_memory_history`): "
            f"{mib(m.peak_allocated_bytes)} allocated"
        )
        if m.reserved_at_peak_bytes is not None:
            peak += f", {mib(m.reserved_at_peak_bytes)} reserved"
    else:
        peak = f"peak {mib(m.peak_allocated_bytes)} allocated"
        if m.reserved_at_peak_bytes is not None:
            peak += f", {mib(m.reserved_at_peak_bytes)} reserved at that moment"
    if m.peak_phase:
        peak += f" (during {m.peak_phase})"
    top = sorted(((k, v) for k, v in m.categories.items() if v), key=lambda kv: -kv[1])[:2]
    if top and m.peak_allocated_bytes:
        peak += "; " + ", ".join(f"{k} {pct(100 * v / m.peak_allocated_bytes)}" for k, v in top)
    if m.path:
        peak += f" · {m.source} {Path(m.path).name}" + (", found beside the traces" if m.discovered else "")
    lines = [("Memory", peak)]
    lines += _memory_devices_line(m)
    if m.stack_libraries:
        at = "at dump time" if m.history_missing else "at the peak"
        lines.append(
            (
                "Stacks show",
                ", ".join(f"{k} {mib(v)}" for k, v in m.stack_libraries.items())
                + f" (blocks {at} allocated under that code)",
            )
        )
    if m.peak_active_bytes and m.peak_active_bytes != m.peak_allocated_bytes:
        # another moment than the allocated peak: its own reserved figure (active never exceeds it)
        active = mib(m.peak_active_bytes)
        if m.reserved_at_active_peak_bytes is not None:
            active += f", {mib(m.reserved_at_active_peak_bytes)} reserved at that moment"
        if m.peak_active_phase and m.peak_active_phase != "unknown":
            active += f" (during {m.peak_active_phase})"
        lines.append(("Active peak", active + "; memory_viz's peak: freed blocks still in use on another stream count"))
    ac = m.activation_checkpointing
    if ac is not None:
        blocks = (
            f" on {m.checkpointed_blocks} of {m.forward_blocks} blocks" if ac != "none" and m.forward_blocks else ""
        )
        lines.append(("Checkpointing", f"{ac}{blocks} (activation checkpointing, from the allocation stacks)"))
    if m.oom:
        st = m.oom.statement
        where = f" in `{st.function}` ({st.file}:{st.line})" if st else ""
        if len(m.devices) > 1 and m.oom.device is not None:  # one process, several GPUs: which one ran out
            where += f" on cuda:{m.oom.device}"
        lines.append(
            ("OOM", f"the run ran out of memory requesting {mib(m.oom.requested_bytes)}{where} (see the oom finding)")
        )
    return lines


def _memory_devices_line(m) -> list[tuple[str, str]]:
    """One process, several GPUs: every device's peak (or state at dump time) and the imbalance."""
    held = [d for d in m.devices if d.peak_allocated_bytes > 0]
    seen = m.visible_devices or 0
    if len(held) < 2 and seen < 2:
        return []
    word = "at dump time" if all(d.history_missing for d in held) else "peak allocated"
    txt = " · ".join(
        f"cuda:{d.device} {mib(d.peak_allocated_bytes)}"
        + (" (no history)" if d.history_missing and word != "at dump time" else "")
        for d in held
    )
    txt += f" {word}"
    if m.device_imbalance is not None:
        txt += f"; imbalance {m.device_imbalance:.1f}× (highest / lowest)"
    if seen > len(held):
        txt += f"; {seen} devices seen by the process, {seen - len(held)} without memory"
    if len(held) > 1:
        txt += f"; the breakdown is cuda:{m.device}'s"
    return [("Devices", txt)]


def _instant_note(m) -> str:
    """Which instant the category breakdown describes."""
    if m.categories_instant == "snapshot":
        return "categories: the state when the snapshot was taken (no allocation history)"
    where = f"event {m.peak_event_index}" if m.peak_event_index is not None else ""
    if m.peak_phase:
        where += f"{', ' if where else ''}during {m.peak_phase}"
    note = "categories at the allocated peak (torch.cuda.max_memory_allocated: a block counts until Python frees it"
    note += f"; {where})" if where else ")"
    if m.peak_active_bytes and m.peak_active_bytes != m.peak_allocated_bytes:
        note += (
            f"; 'at active peak': memory_viz's peak of {mib(m.peak_active_bytes)} at event {m.peak_active_event_index}, "
            "where a block counts until its free completes on every stream"
        )
    return note


def memory_tables(f: RunFacts) -> list[Table]:
    m = f.memory
    if m is None:
        return []
    total = m.peak_allocated_bytes or 1
    rows = []
    exp = f.memory_expected
    active = (
        m.categories_at_active_peak if m.peak_active_bytes and m.peak_active_bytes != m.peak_allocated_bytes else {}
    )
    for k, v in sorted(m.categories.items(), key=lambda kv: -kv[1]):
        if not v and k not in exp and not active.get(k):
            continue
        bar = "█" * max(1, round(BAR_WIDTH * v / total)) if v else ""
        row = [k, mib(v), pct(100 * v / total), bar]
        if active:
            row.insert(2, mib(active.get(k, 0)))
        if exp:
            row.insert(2, mib(exp[k]) if k in exp else "")
        rows.append(row)
    headers = ["category", "bytes", "share", ""]
    if active:
        headers.insert(2, "at active peak")
    if exp:
        headers.insert(2, "expected (ZeRO)")
    at = "at dump time" if m.history_missing else "at the peak"
    out = [Table(f"Memory {at} ({m.source}: {m.path or ''})", headers, rows, note=_instant_note(m))] if rows else []
    frag = [["allocated at dump time" if m.history_missing else "peak allocated", mib(m.peak_allocated_bytes)]]
    if m.reserved_at_peak_bytes is not None:
        frag.append(
            ["reserved at dump time" if m.history_missing else "reserved at peak", mib(m.reserved_at_peak_bytes)]
        )
    if m.internal_fragmentation_bytes is not None:
        frag.append(["internal fragmentation (rounding)", mib(m.internal_fragmentation_bytes)])
    if m.external_fragmentation_bytes is not None:
        frag.append(["external fragmentation (cached free blocks)", mib(m.external_fragmentation_bytes)])
    if m.pending_free_at_peak_bytes:
        frag.append(["freed on another stream, not yet reusable", mib(m.pending_free_at_peak_bytes)])
    if m.pre_existing_bytes:
        frag.append(["allocated before recording started", mib(m.pre_existing_bytes)])
    out.append(Table(f"Reserved memory {at}", ["part", "bytes"], frag))
    if m.top_sites:
        out.append(
            Table(f"Top allocation sites {at}", ["site", "bytes"], [[site, mib(b)] for site, b in m.top_sites[:8]])
        )
    if len(m.devices) > 1 or any(d.entries_unread for d in m.devices):
        out.append(_snapshot_ledger_table(m))
    return out


def _snapshot_ledger_table(m) -> Table:
    """The snapshot ledger: per device what the snapshot holds and what was read of it."""
    rows = []
    for d in m.devices:
        unread = ", ".join(f"{n} {a}" for a, n in d.entries_unread.items())
        rows.append(
            [
                f"cuda:{d.device}",
                "no" if d.history_missing else "yes",
                mib(d.peak_allocated_bytes),
                mib(d.reserved_bytes) if d.reserved_bytes is not None else "",
                str(d.segments if d.segments is not None else ""),
                str(d.blocks if d.blocks is not None else ""),
                f"{d.history_entries_read} of {d.history_entries}" if d.history_entries is not None else "",
                unread,
            ]
        )
    return Table(
        "Snapshot ledger (per device)",
        ["device", "history", "peak / at dump", "reserved at dump", "segments", "blocks", "entries read", "not read"],
        rows,
        note="history: alloc or segment_alloc entries recorded (torch.cuda.memory._record_memory_history)",
    )
