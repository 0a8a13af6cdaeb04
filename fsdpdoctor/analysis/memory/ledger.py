"""What a snapshot holds and what the analysis read of it (the snapshot ledger), the device
imbalance of one process driving several GPUs, and the adapter / quantization libraries the
allocation stacks pass through.

The ledger is per device (:class:`~fsdpdoctor.facts.memory.MemoryDevice`): segments, blocks of
every state, reserved and allocated bytes at dump time, ``device_traces`` entries and, of them,
those the allocator replay reads (:data:`READ_ACTIONS`) and, by action, those it does not
(``snapshot`` markers; ``free_requested`` / ``free_completed`` on a device with no allocation
history, which are no history on their own).
"""

from __future__ import annotations

from collections import Counter

from fsdpdoctor.facts.memory import MemoryDevice, MemoryFacts
from fsdpdoctor.ingest.snapshot import Snapshot, device_has_history

#: the trace actions the allocator replay (:mod:`.allocator`) reads
READ_ACTIONS = frozenset(
    {
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "oom",
    }
)

#: (what the stack shows, file-path fragment, frame-name fragments or None for any frame of that file);
#: the first that matches a block's stack names it. Paths use "/" (Windows paths are normalised).
LIBRARIES = (
    ("4-bit quantized weights (bitsandbytes)", "bitsandbytes/", ("4bit", "Params4bit", "Linear4bit", "nf4", "fp4")),
    ("8-bit quantized weights (bitsandbytes)", "bitsandbytes/", ("8bit", "Int8Params", "Linear8bitLt", "int8")),
    ("bitsandbytes", "bitsandbytes/", None),
    ("LoRA adapters (peft)", "peft/tuners/lora", None),
    ("PEFT adapters (peft)", "peft/tuners/", None),
    ("LoRA layers (diffusers)", "diffusers/models/lora.py", None),
    ("LoRA layers (diffusers)", "diffusers/loaders/lora", None),
    ("quantized weights (torchao)", "torchao/quantization", None),
    ("quantized weights (auto_gptq)", "auto_gptq/", None),
    ("quantized weights (awq)", "awq/", None),
)


def library_of(frames: list) -> str | None:
    """What an allocation stack passes through (:data:`LIBRARIES`), None for none."""
    if not frames:
        return None
    paths = [
        (str(f.get("filename", "")).replace("\\", "/"), str(f.get("name", ""))) for f in frames if isinstance(f, dict)
    ]
    for label, frag, names in LIBRARIES:
        for path, name in paths:
            if frag in path and (names is None or any(n.lower() in (name + path).lower() for n in names)):
                return label
    return None


def stack_libraries(blocks: list[tuple[list, int]]) -> dict[str, int]:
    """Bytes per library over ``(frames, size)`` pairs, largest first; libraries with no bytes left out."""
    out: Counter = Counter()
    cache: dict[int, str | None] = {}
    for frames, size in blocks:
        k = id(frames)
        if k not in cache:
            cache[k] = library_of(frames)
        if cache[k] is not None:
            out[cache[k]] += int(size)
    return dict(out.most_common())


def device_ledger(snap: Snapshot, device: int, d: MemoryDevice) -> MemoryDevice:
    """Fill ``d``'s ledger fields from the snapshot."""
    segs = [s for s in snap.segments if s["device"] == device]
    trace = snap.device_traces[device] if device < len(snap.device_traces) else []
    d.segments = len(segs)
    d.blocks = sum(len(s["blocks"]) for s in segs)
    d.reserved_bytes = sum(s["total_size"] for s in segs)
    d.allocated_bytes = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated")
    d.history_entries = len(trace)
    history = device_has_history(trace)
    actions = Counter(e.get("action", "") for e in trace)
    read = {a: n for a, n in actions.items() if history and a in READ_ACTIONS}
    d.history_entries_read = sum(read.values())
    d.entries_unread = {a: n for a, n in sorted(actions.items()) if a not in read}
    return d


def device_imbalance(facts: MemoryFacts) -> float | None:
    """Highest / lowest peak allocated over the devices that hold memory, when there are several."""
    peaks = [d.peak_allocated_bytes for d in facts.devices if d.peak_allocated_bytes > 0]
    if len(peaks) < 2:
        return None
    return max(peaks) / min(peaks)


def fold_parameters(facts: MemoryFacts) -> None:
    """Where the stacks show no FSDP, the parameters are neither sharded nor unsharded: both
    FSDP categories move to ``parameters`` (in every breakdown the facts hold)."""
    if facts.fsdp_version is not None:
        return
    dicts = [facts.categories, facts.categories_at_active_peak, facts.pre_existing_attributed]
    if facts.oom is not None:
        dicts.append(facts.oom.categories)
    for c in dicts:
        moved = c.get("parameters_sharded", 0) + c.get("parameters_unsharded", 0)
        if "parameters_sharded" not in c and "parameters_unsharded" not in c:
            continue
        c["parameters"] = c.get("parameters", 0) + moved
        for k in ("parameters_sharded", "parameters_unsharded"):
            if k in c:
                c[k] = 0
        if c is facts.pre_existing_attributed:
            for k in ("parameters_sharded", "parameters_unsharded"):
                c.pop(k, None)
            if not c["parameters"]:
                c.pop("parameters")
