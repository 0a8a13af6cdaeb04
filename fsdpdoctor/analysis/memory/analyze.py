"""MemoryFacts from a snapshot (per device: replay, phases, categories, peaks, OOM) or from a
profiler memory timeline."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from fsdpdoctor.facts import MEMORY_CATEGORIES as CATEGORIES
from fsdpdoctor.facts import AllocatorSettings, MemoryFacts
from fsdpdoctor.facts.memory import MemoryDevice, OomFacts, OomStatement
from fsdpdoctor.ingest.snapshot import (
    TIMELINE_CATEGORIES,
    MemoryTimeline,
    Snapshot,
    device_has_history,
    load_memory,
    snapshot_from_object,
)
from fsdpdoctor.analysis.memory.allocator import Replay, replay, state_series
from fsdpdoctor.analysis.memory.checkpointing import detect as detect_checkpointing
from fsdpdoctor.analysis.memory.categorize import TIMELINE_TO_CATEGORY, Labels, event_phases, event_times, label_blocks
from fsdpdoctor.analysis.memory.curve import downsample
from fsdpdoctor.analysis.memory.ledger import device_imbalance, device_ledger, fold_parameters, stack_libraries
from fsdpdoctor.analysis.memory.stacks import (
    OPT,
    PH_BACKWARD,
    PH_FORWARD,
    PH_OPTIM,
    PH_RECOMPUTE,
    PHASE_NAMES,
    RS,
    StackCache,
)

TOP_SITES = 10

# =========================================================================== assembling facts


def _categories(mask: np.ndarray, r: Replay, labels: Labels) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for b in np.flatnonzero(mask):
        out[labels.category[b]] += int(r.size[b])
    return out


def _top_sites(mask: np.ndarray, r: Replay, labels: Labels) -> list[tuple[str, int]]:
    c: Counter = Counter()
    for b in np.flatnonzero(mask):
        c[labels.site[b]] += int(r.size[b])
    return [(s, int(v)) for s, v in c.most_common(TOP_SITES)]


def _segment_totals(segs: list[dict]) -> dict[str, int]:
    t = Counter()
    for s in segs:
        t["reserved"] += s["total_size"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                t["allocated"] += b["size"]
                t["requested"] += b["requested_size"]
            elif b["state"] == "active_pending_free":
                t["pending"] += b["size"]
            else:
                t["external"] += b["size"]
    t["internal"] = t["allocated"] - t["requested"]
    return t


def _analyze_device(snap: Snapshot, device: int) -> MemoryFacts:
    trace = snap.device_traces[device] if device < len(snap.device_traces) else []
    segs = [s for s in snap.segments if s["device"] == device]
    end = _segment_totals(segs)
    if not device_has_history(trace):  # none, or only a `snapshot` marker or a stray free
        return _analyze_without_history(snap, device, segs, end)

    r = replay(snap, device, trace)
    stacks = StackCache()
    times = event_times(trace)
    phase = event_phases(trace, stacks, times, snap.external_annotations, device)
    labels = label_blocks(r, stacks, phase, trace)
    alloc, pend, seed_alloc, seed_pend = state_series(r)
    full = np.concatenate([[seed_alloc], alloc])
    p = int(np.argmax(full)) - 1  # -1: before the first event
    peak = int(full[p + 1])
    # memory_viz's active peak: blocks count until free_completed (pending frees included)
    active = np.concatenate([[seed_alloc + seed_pend], alloc + pend])
    pa = int(np.argmax(active)) - 1
    live_active = (r.alloc_idx <= pa) & (pa < r.free_done)
    live = (r.alloc_idx <= p) & (p < r.free_req)
    pending = int(pend[p]) if p >= 0 else seed_pend
    reserved = int(r.reserved[p]) if p >= 0 else r.reserved_seed
    requested = int(r.requested[live].sum())
    external = reserved - peak - pending
    notes = list(r.notes)
    if r.pseudo:
        notes = [
            "pseudo-snapshot from torch.profiler (_memory_viz._profile_to_snapshot): no allocator state, so no "
            "reserved memory or fragmentation; in-place updates appear as free+alloc pairs of tensor versions"
        ]
    elif external < 0:
        notes.append(f"reserved at peak is {-external} bytes below allocated+pending: the trace misses segment events")
    x, unit = (times, "time_us") if times is not None else (np.arange(r.n), "event_index")
    if times is None:
        notes.append("trace entries have no time_us (torch < 2.2): the peak is located by event index")
    pre_bytes = int(r.size[labels.pre_existing].sum())
    pre_live = live & labels.pre_existing
    if pre_live.any():
        count, nbytes = int(pre_live.sum()), int(r.size[pre_live].sum())
        notes.append(f"{count} blocks ({nbytes} bytes) alive at the peak were allocated before recording started")

    facts = MemoryFacts(
        source="snapshot",
        path=snap.path,
        device=device,
        n_events=r.n,
        peak_allocated_bytes=peak,
        peak_requested_bytes=requested,
        reserved_at_peak_bytes=None if r.pseudo else reserved,
        peak_time_us=(float(times[max(p, 0)]) if times is not None else None),
        peak_event_index=p,
        peak_phase=PHASE_NAMES[int(phase[max(p, 0)])],
        pending_free_at_peak_bytes=pending,
        internal_fragmentation_bytes=None if r.pseudo else peak - requested,
        external_fragmentation_bytes=None if r.pseudo else max(external, 0),
        categories=_categories(live, r, labels),
        categories_instant="peak_allocated",
        peak_active_bytes=int(active[pa + 1]),
        peak_active_event_index=pa,
        peak_active_time_us=(float(times[max(pa, 0)]) if times is not None else None),
        reserved_at_active_peak_bytes=None if r.pseudo else (int(r.reserved[pa]) if pa >= 0 else r.reserved_seed),
        peak_active_phase=PHASE_NAMES[int(phase[max(pa, 0)])],
        categories_at_active_peak=_categories(live_active, r, labels),
        pre_existing_bytes=pre_bytes,
        pre_existing_attributed=labels.attributed,
        top_sites=_top_sites(live, r, labels),
        end_allocated_bytes=end["allocated"],
        end_reserved_bytes=None if r.pseudo else end["reserved"],
        fsdp_version=labels.fsdp,
        world_size=labels.world_size,
        curve=downsample(x, alloc, None if r.pseudo else r.reserved, unit),
        notes=notes,
        stack_libraries=stack_libraries([(r.frames[b], r.size[b]) for b in np.flatnonzero(live)]),
    )
    ckpt = detect_checkpointing([stacks(e.get("frames")) for e in trace], [e["action"] for e in trace], phase)
    facts.activation_checkpointing = ckpt.verdict
    facts.checkpointed_blocks, facts.forward_blocks = ckpt.checkpointed, ckpt.blocks
    if ckpt.verdict in ("partial", "selective", "full"):
        cat = np.array(labels.category)
        unchecked = np.zeros(len(cat), dtype=bool)
        traced = r.alloc_idx >= 0
        unchecked[traced] = ckpt.unchecked_events[r.alloc_idx[traced]]
        facts.activations_unchecked_bytes = int(r.size[live & unchecked & (cat == "activations")].sum())
    if r.ooms:
        facts.oom = _oom(r, trace, labels, alloc, pend, r.ooms, device, times)
    return facts


def allocator_settings(snap: Snapshot) -> AllocatorSettings | None:
    """The allocator settings the snapshot recorded (torch >= 2.3), None when it has none."""
    s = snap.allocator_settings
    if not s:
        return None
    split = s.get("max_split_size")
    gc = s.get("garbage_collection_threshold")
    conf = s.get("PYTORCH_CUDA_ALLOC_CONF")
    expandable = s.get("expandable_segments")
    return AllocatorSettings(
        expandable_segments=expandable if isinstance(expandable, bool) else None,
        max_split_size_bytes=split if isinstance(split, int) and not isinstance(split, bool) and split > 0 else None,
        garbage_collection_threshold=float(gc) if isinstance(gc, (int, float)) and not isinstance(gc, bool) else None,
        alloc_conf=conf if isinstance(conf, str) else None,
    )


def _oom(r: Replay, trace, labels: Labels, alloc, pend, ooms: list[dict], device: int, times) -> OomFacts:
    last = ooms[-1]
    k = last["index"]
    e = trace[k]
    live = (r.alloc_idx <= k) & (k < r.free_req)
    allocated, pending, reserved = int(alloc[k]), int(pend[k]), int(r.reserved[k])
    requested = int(e.get("size", 0))
    free_dev = e.get("device_free")
    cached = reserved - allocated - pending
    largest = last["largest_cached_free_block_bytes"]
    if largest is not None and cached >= requested > largest:
        cause, why = (
            "fragmentation",
            "fragmentation: enough cached free memory in total, but no contiguous block large enough",
        )
    elif cached + (free_dev or 0) >= requested:
        cause, why = (
            "cache",
            "cached free memory plus free device memory would cover the request, but neither alone does",
        )
    else:
        cause, why = "allocated", "the device is full: allocated tensors (see categories) leave too little free memory"
    return OomFacts(
        device=device,
        count=len(ooms),
        event_index=k,
        time_us=float(times[k]) if times is not None else None,
        requested_bytes=requested,
        device_free_bytes=free_dev,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        pending_free_bytes=pending,
        cached_free_bytes=cached,
        largest_cached_free_block_bytes=largest,
        categories=_categories(live, r, labels),
        top_sites=_top_sites(live, r, labels),
        cause=cause,
        explanation=why,
        statement=OomStatement(**labels.statement.as_dict(r.size)) if labels.statement is not None else None,
    )


def _analyze_without_history(snap: Snapshot, device: int, segs: list[dict], end: Counter) -> MemoryFacts:
    """Only the final segments: totals, and categories from allocation stacks without lifetimes."""
    cats = dict.fromkeys(CATEGORIES, 0)
    sites: Counter = Counter()
    stacks = StackCache()
    blocks = [b for s in segs for b in s["blocks"] if b["state"] == "active_allocated"]
    rs_sizes = [b["requested_size"] for b in blocks if stacks(b["frames"]).label == RS]
    fsdp_votes: Counter = Counter()
    for b in blocks:
        st = stacks(b["frames"])
        lab, ph, site = st.label, st.phase, st.site
        if lab in CATEGORIES:
            cat = lab
        elif lab == RS:  # an RS input is world_size × an RS output that is alive beside it
            cat = (
                "gradients"
                if any(s != b["requested_size"] and s % max(b["requested_size"], 1) == 0 for s in rs_sizes)
                else "reduce_scatter_buffers"
            )
        elif lab == OPT or ph == PH_OPTIM:
            cat = "optimizer_state"
        elif ph in (PH_FORWARD, PH_RECOMPUTE):  # alive now: saved (or recomputed) for backward
            cat = "activations"
        elif ph == PH_BACKWARD:
            cat = "gradients"
        else:
            cat = "other"
        cats[cat] += b["size"]
        sites[site or ("<no frames>")] += b["size"]
        if st.fsdp:
            fsdp_votes[st.fsdp] += 1
    return MemoryFacts(
        source="snapshot",
        path=snap.path,
        device=device,
        history_missing=True,
        peak_allocated_bytes=end["allocated"],
        peak_requested_bytes=end["requested"],
        reserved_at_peak_bytes=end["reserved"],
        pending_free_at_peak_bytes=end["pending"],
        internal_fragmentation_bytes=end["internal"],
        external_fragmentation_bytes=end["external"],
        categories=cats,
        categories_instant="snapshot",
        fsdp_version=fsdp_votes.most_common(1)[0][0] if fsdp_votes else None,
        top_sites=[(s, int(v)) for s, v in sites.most_common(TOP_SITES)],
        end_allocated_bytes=end["allocated"],
        end_reserved_bytes=end["reserved"],
        notes=[
            "state at dump time, no allocation history recorded (torch.cuda.memory._record_memory_history): "
            "no peak; the blocks held when the snapshot was taken, categorised from their stacks only"
        ],
        stack_libraries=stack_libraries([(b["frames"], b["size"]) for b in blocks]),
    )


def analyze_snapshot(snap: Snapshot) -> MemoryFacts:
    devices = snap.devices
    if not devices:
        return MemoryFacts(
            source="snapshot",
            path=snap.path,
            history_missing=not snap.has_history,
            notes=["the snapshot holds no segments and no history"],
        )
    per = [_analyze_device(snap, d) for d in devices]
    best = max(per, key=lambda f: f.peak_allocated_bytes)
    best.devices = [
        device_ledger(
            snap,
            f.device,
            MemoryDevice(
                device=f.device,
                peak_allocated_bytes=f.peak_allocated_bytes,
                reserved_at_peak_bytes=f.reserved_at_peak_bytes,
                peak_time_us=f.peak_time_us,
                peak_event_index=f.peak_event_index,
                history_missing=f.history_missing,
                oom=f.oom is not None,
            ),
        )
        for f in per
    ]
    if best.oom is None:
        best.oom = next((f.oom for f in per if f.oom is not None), None)
    best.allocator_settings = allocator_settings(snap)
    best.visible_devices = len(snap.device_traces) if snap.device_traces else None
    best.device_imbalance = device_imbalance(best)
    ignored = [i for i, t in enumerate(snap.device_traces) if t and i not in devices]
    if ignored:
        best.notes.append(
            "device_traces of device "
            + ", ".join(map(str, ignored))
            + " hold no allocation history and no segment (only "
            + ", ".join(sorted({e.get("action", "?") for i in ignored for e in snap.device_traces[i]}))
            + " entries): not a device with memory"
        )
    fold_parameters(best)
    return best


def analyze_timeline(tl: MemoryTimeline) -> MemoryFacts:
    """Replay a profiler memory timeline in file order; the state at a time is after all its rows."""
    n = len(tl.nbytes)
    if n == 0:
        return MemoryFacts(source="memory_timeline", path=tl.path, notes=["empty memory timeline"])
    total = np.cumsum(tl.nbytes)
    group_end = np.flatnonzero(np.r_[tl.time_ns[1:] != tl.time_ns[:-1], True])
    g = group_end[int(np.argmax(total[group_end]))]
    per_cat = np.zeros(len(TIMELINE_CATEGORIES), dtype=np.int64)
    np.add.at(per_cat, tl.category[: g + 1], tl.nbytes[: g + 1])
    cats = dict.fromkeys(CATEGORIES, 0)
    for i, name in enumerate(TIMELINE_CATEGORIES):
        cats[TIMELINE_TO_CATEGORY[name]] += int(per_cat[i])
    t = int(tl.time_ns[g])
    timed = group_end[tl.time_ns[group_end] >= 0]
    return MemoryFacts(
        source="memory_timeline",
        path=tl.path,
        n_events=n,
        peak_allocated_bytes=int(total[g]),
        peak_time_us=t / 1000 if t >= 0 else None,
        peak_event_index=int(g),
        categories=cats,
        pre_existing_bytes=int(tl.nbytes[tl.time_ns < 0].sum()),
        end_allocated_bytes=int(total[-1]),
        curve=downsample(tl.time_ns[timed] / 1000, total[timed], None, "time_us"),
        fsdp_version=None,
        notes=[
            "profiler memory timeline: categories are torch.profiler's (INPUT and unknown count as other, "
            "AUTOGRAD_DETAIL as temporary); no reserved memory or fragmentation information"
        ],
    )


def analyze_memory(source: str | Path | Snapshot | MemoryTimeline | dict | list) -> MemoryFacts:
    """Memory facts from a snapshot/timeline path, a loaded :class:`Snapshot`/:class:`MemoryTimeline`,
    or an already-unpickled snapshot object. For several devices the one with the highest peak is
    reported in full and every device's peak is listed in ``devices``."""
    if isinstance(source, (str, Path)):
        source = load_memory(source)
    elif isinstance(source, (dict, list)):
        source = snapshot_from_object(source)
    if isinstance(source, MemoryTimeline):
        return analyze_timeline(source)
    if isinstance(source, Snapshot):
        return analyze_snapshot(source)
    raise TypeError(f"analyze_memory: unsupported input {type(source).__name__}")
