"""Memory facts: a snapshot's (or memory timeline's) categories at the peak, and the memory
pressure memory advice is judged by. Part of the RunFacts contract (:mod:`fsdpdoctor.facts`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec


MEMORY_CATEGORIES = (
    "parameters",  # where no FSDP shows: the model's parameters, neither sharded nor unsharded
    "parameters_sharded",
    "parameters_unsharded",
    "gradients",
    "optimizer_state",
    "activations",
    "temporary",
    "allgather_buffers",
    "reduce_scatter_buffers",
    "other",
)


@dataclass(slots=True)
class AllocatorSettings:
    """The caching allocator's settings a snapshot recorded (``PYTORCH_CUDA_ALLOC_CONF``, torch >= 2.3)."""

    expandable_segments: bool | None = None
    max_split_size_bytes: int | None = None  # None: unlimited (the default)
    garbage_collection_threshold: float | None = None  # None or 0: off
    alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF as the process saw it


@dataclass(slots=True)
class MemoryCurve:
    """Allocated and reserved bytes along the run, at most 500 points (each bucket's highest):
    ``x`` in ``x_unit`` ("time_us" or "event_index"); ``reserved`` None where not recorded."""

    x_unit: str = "event_index"
    x: list[float] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)
    reserved: list[int | None] = field(default_factory=list)


@dataclass(slots=True)
class MemoryDevice:
    """One device of a snapshot (or of a trace's ``[memory]`` events): its own peak."""

    device: int
    peak_allocated_bytes: int = 0
    reserved_at_peak_bytes: int | None = None
    peak_time_us: float | None = None
    peak_event_index: int | None = None
    history_missing: bool = False
    oom: bool = False
    events: int | None = None  # trace [memory] events of this device
    # the snapshot ledger of this device: what it holds and what the analysis read of it
    segments: int | None = None
    blocks: int | None = None  # blocks of every state (allocated, pending free, cached free)
    reserved_bytes: int | None = None  # at dump time (sum of the segments)
    allocated_bytes: int | None = None  # at dump time (active_allocated blocks)
    history_entries: int | None = None  # device_traces entries
    history_entries_read: int | None = None  # of them, the actions the replay reads
    entries_unread: dict[str, int] = field(default_factory=dict)  # action -> entries not read


@dataclass(slots=True)
class OomStatement:
    """The failing statement of an OOM: the innermost Python line of the failed request's stack,
    its enclosing function, the lines of the statement, what it is (``kind``: "loss",
    "activation", "allgather", "optimizer", ...) and the blocks it already held (its
    temporaries, allocated since it began)."""

    site: str = ""
    function: str = ""
    file: str = ""
    line: int = 0
    lines: list[int] = field(default_factory=list)
    kind: str | None = None
    op: str | None = None
    first_event_index: int | None = None
    temporaries: int = 0
    temporaries_bytes: int = 0


#: OomFacts.cause: "outside" (memory held outside PyTorch's allocator exceeds what PyTorch
#: reserved and the request; needs the device's total from a trace), "fragmentation" (cached free
#: memory would cover the request, no block is large enough), "cache" (cached free plus device
#: free would, neither alone), "allocated" (PyTorch's tensors fill the device)
OOM_CAUSES = ("outside", "fragmentation", "cache", "allocated")


@dataclass(slots=True)
class OomFacts:
    """An out-of-memory the snapshot recorded (the last, when several), decided once: its cause
    (:data:`OOM_CAUSES`) from the snapshot's allocator state and, where a trace gives the device's
    total, the memory held outside PyTorch (:func:`fsdpdoctor.analysis.pressure.judge_oom`)."""

    device: int | None = None
    count: int = 1
    event_index: int | None = None
    time_us: float | None = None
    requested_bytes: int = 0
    device_free_bytes: int | None = None
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    pending_free_bytes: int = 0
    cached_free_bytes: int = 0
    largest_cached_free_block_bytes: int | None = None
    categories: dict[str, int] = field(default_factory=dict)
    top_sites: list[tuple[str, int]] = field(default_factory=list)
    cause: str = "allocated"
    explanation: str = ""
    device_total_bytes: int | None = None  # from the traces' deviceProperties, when known
    outside_bytes: int | None = None  # device total − free − reserved, when the total is known
    statement: OomStatement | None = None


@dataclass(slots=True)
class MemoryFacts:
    """Plain memory facts for one run (one rank's snapshot or memory timeline).

    Byte counts are allocator block bytes unless named ``requested``. ``peak_event_index`` is the
    trace entry after which the peak is reached (-1: already at the start of recording; None:
    no history). ``categories`` always has every name in :data:`MEMORY_CATEGORIES` and sums to
    ``peak_allocated_bytes``; where the stacks show no FSDP (``fsdp_version`` None) the model's
    parameters are ``parameters`` and the two FSDP names stay 0. ``curve`` holds ``x`` (``x_unit`` "time_us" or "event_index"),
    ``allocated`` and ``reserved`` (None entries where unknown), at most 500 points, peak kept.

    Two peaks: ``peak_allocated_bytes`` is ``torch.cuda.max_memory_allocated()`` (a block leaves
    at ``free_requested``); ``peak_active_bytes`` is memory_viz's active-memory peak (a block
    leaves at ``free_completed``: freed by Python but still in use on another stream counts).
    ``categories_instant`` names the instant ``categories`` describe: "peak_allocated" (the
    allocated peak) or "snapshot" (no history: the state when the snapshot was taken);
    ``categories_at_active_peak`` holds the categories at the active peak, pending frees included.
    """

    source: str
    path: str | None = None
    device: int | None = None
    rank: int | None = None  # the rank the snapshot belongs to (from its file name), when known
    discovered: bool = False  # found beside the traces (not named with --memory)
    devices: list[MemoryDevice] = field(default_factory=list)
    history_missing: bool = False
    n_events: int = 0
    peak_allocated_bytes: int = 0
    peak_requested_bytes: int | None = None
    reserved_at_peak_bytes: int | None = None
    peak_time_us: float | None = None
    peak_event_index: int | None = None
    peak_phase: str | None = None
    pending_free_at_peak_bytes: int | None = None
    internal_fragmentation_bytes: int | None = None
    external_fragmentation_bytes: int | None = None
    categories: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEMORY_CATEGORIES, 0))
    categories_instant: str = "peak_allocated"
    peak_active_bytes: int | None = None
    peak_active_event_index: int | None = None
    peak_active_time_us: float | None = None
    reserved_at_active_peak_bytes: int | None = None  # reserved at the active peak's moment (not the allocated peak's)
    peak_active_phase: str | None = None
    categories_at_active_peak: dict[str, int] = field(default_factory=dict)
    pre_existing_bytes: int = 0
    pre_existing_attributed: dict[str, int] = field(default_factory=dict)
    top_sites: list[tuple[str, int]] = field(default_factory=list)
    end_allocated_bytes: int | None = None
    end_reserved_bytes: int | None = None
    fsdp_version: str | None = None
    world_size: int | None = None
    oom: OomFacts | None = None
    curve: MemoryCurve = field(default_factory=MemoryCurve)
    notes: list[str] = field(default_factory=list)
    activation_checkpointing: str | None = None  # from forward stacks: none/partial/full/selective; None: unknown
    checkpointed_blocks: int | None = None  # the share is checkpointed_blocks / forward_blocks (one forward pass)
    forward_blocks: int | None = None
    activations_unchecked_bytes: int | None = None  # at the peak, from blocks without checkpointing (or selective)
    allocator_settings: AllocatorSettings | None = None  # as the snapshot recorded them (torch >= 2.3)
    visible_devices: int | None = None  # devices the process saw (len(device_traces)); None: not recorded
    device_imbalance: float | None = None  # several devices with memory: highest / lowest peak allocated
    # blocks at the peak (or at dump time) whose allocation stack passes through an adapter or a
    # quantization library, by what the stack shows: "LoRA adapters (peft)", "4-bit weights (bitsandbytes)"...
    stack_libraries: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: dict) -> MemoryFacts:
        names = {f.name for f in dataclasses.fields(cls)}
        return msgspec.convert({k: v for k, v in data.items() if k in names}, cls)


@dataclass(slots=True)
class MemoryPressureFacts:
    """How close the run came to its memory (:mod:`fsdpdoctor.analysis.pressure`).

    ``level``: "oom" (it ran out), "high" (the peak reserved is at least ``threshold_pct`` of the
    capacity), "low" (below it), "unknown" (no capacity known: no trace with ``deviceProperties``
    and no ``--memory-budget``). ``capacity_source``: "budget" (``--memory-budget``) or "device"
    (the GPU's total memory). Memory findings are warnings or worse only at "oom" or "high"."""

    level: str = "unknown"
    threshold_pct: float = 80.0
    capacity_bytes: int | None = None
    capacity_source: str = ""
    peak_reserved_bytes: int | None = None
    used_pct: float | None = None  # peak reserved / capacity
    headroom_bytes: int | None = None  # capacity − peak reserved
    # how many times the micro-batch could grow before the peak reaches the threshold (activations
    # growing in proportion); None where it cannot be told or under pressure already
    batch_headroom: float | None = None

    @property
    def under_pressure(self) -> bool:
        return self.level in ("oom", "high")
