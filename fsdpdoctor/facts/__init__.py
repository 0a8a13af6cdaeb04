"""RunFacts: everything the analysis learned, as plain data that serialises to JSON.

The memory facts live in :mod:`.facts_memory`, the compute and what-if facts in
:mod:`.facts_compute`; every class is importable from here.

Rules, reports, ``compare`` and ``check`` read only these classes. A saved RunFacts JSON file is
what ``--baseline`` reads back, so field names here are a compatibility contract: add fields
freely, rename none without bumping :data:`SCHEMA_VERSION`.

Units: times in ``*_ms`` fields are milliseconds, ``*_us`` microseconds, bytes are bytes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

# the contract's pages: importable from here, as every consumer does
from fsdpdoctor.facts.compute import ComputeFacts, WhatIfFacts, compute_v4  # noqa: F401
from fsdpdoctor.facts.memory import MEMORY_CATEGORIES, AllocatorSettings, MemoryFacts, MemoryPressureFacts  # noqa: F401
from fsdpdoctor.facts.hang import HangFacts
from fsdpdoctor.facts.parallelism import (  # noqa: F401
    DATA_PARALLEL_KINDS,
    DDP_KINDS,
    RUN_KINDS,
    TENSOR_PARALLEL_KINDS,
    ParallelismFacts,
)
from fsdpdoctor.facts.ledger import InputLedger, LedgerRow  # noqa: F401
from fsdpdoctor.facts.efficiency import CompileFacts, EfficiencyFacts, GemmShape, HookCost, LoaderFacts, SyncSite  # noqa: F401
from fsdpdoctor.facts.framework import FrameworkFacts, ModuleClassStats, PythonFrames  # noqa: F401

#: 2: the report is one document (every RunFacts field once, at the top level, plus ``findings``);
#: 1 wrote the summaries at the top level and all facts again under ``facts``. Both load.
#: 3: StepFacts.step_ms is the interval between step completions (was the CPU span).
#: 4: ``rank_summaries`` (one line per rank) and ``rank_detail``: ``rank_facts`` may hold only the
#: ranks that matter (``--rank-detail auto``); 3 and older wrote every rank's RankFacts.
#: 5: ``ComputeFacts.mfu_pct`` / ``hfu_pct`` are against the dense BF16 peak (``peak_tflops``)
#: whatever the run's dtype; the dtype's peak moved to ``dtype_peak*`` / ``dtype_mfu_pct``
#: (4 had them as ``peak_*`` / ``mfu_pct`` and the BF16 figures as ``bf16_peak_tflops`` /
#: ``mfu_bf16_pct``: read back into the new fields). StepFacts.step_ms is the slower side's
#: interval (the steady rate of the CPU or of the completions; was the completions').
#: 6: ``fsdp.other_parallelism`` removed: the run's kind is ``parallelism.run_kind`` alone (one
#: classifier, :mod:`fsdpdoctor.analysis.runkind`); 5 and older still load (the key is ignored).
SCHEMA_VERSION = 6
SAMPLED_OPS_PCT = 50.0  # whole traces hold 80-100% of their op numbers (real recordings); sampled ones ~1%
OLDEST_SCHEMA_VERSION = 1  # the oldest saved report / baseline this version still reads

#: the step-time parts of exposed communication, by collective kind (compare, the rules)
EXPOSED = ("exposed_all_gather", "exposed_reduce_scatter", "exposed_other_comm")


@dataclass(slots=True)
class StepFacts:
    number: int
    start_us: float
    # the step's time: the interval between this step's completion and the previous one's (a
    # step completes when its CPU span and the GPU work it launched are both done; the first step
    # starts at its CPU start or when the warm-up backlog finished): what limits the run, GPU or CPU
    step_ms: float
    gpu_window_ms: float = 0.0  # first to last GPU activity launched in this step
    compute_ms: float = 0.0  # |union of compute kernels|
    comm_ms: float = 0.0  # |union of collective kernels|
    overlap_ms: float = 0.0  # |comm ∩ compute|
    exposed_comm_ms: float = 0.0  # |comm \ compute|
    memcpy_ms: float = 0.0  # |memcpy/memset \ (compute ∪ comm)|
    # window time in which the GPU ran nothing at all (no step's work), counted once: up to the
    # start of the next step's GPU work, where a window that runs on into the next one stops
    idle_ms: float = 0.0
    # the part of idle_ms in which the CPU sat in a blocking call (a sync, a synchronous copy): both
    # sides waiting, on something the trace does not show (another rank, an event): not host-bound
    idle_cpu_blocked_ms: float = 0.0
    outside_window_ms: float = 0.0  # step time with no GPU work of this step at all (max(step − window, 0))
    # window time with none of this step's work running that belongs to other steps: their work
    # running on the GPU, or the next step's window (the GPU runs behind the CPU). Per step,
    # compute + exposed comm + memcpy + other_steps + idle = gpu_window
    other_steps_ms: float = 0.0
    gpu_start_us: float | None = None  # start of the first GPU activity launched in this step
    cpu_span_ms: float = 0.0  # the CPU ProfilerStep span
    gpu_busy_ms: float = (
        0.0  # |union of this step's own GPU work| (compute, comm, memcpy/memset), less an earlier step's
    )
    end_us: float | None = None  # the step's completion (see step_ms)
    exposed_by_phase: dict[str, float] = field(default_factory=dict)
    exposed_by_kind: dict[str, float] = field(default_factory=dict)
    phase_ms: dict[str, float] = field(default_factory=dict)  # CPU duration of each phase
    # the CPU span's time outside every phase's interval (its span less the union of the phases'
    # and micro-batches' intervals in it): data loading, logging, the step's own bookkeeping
    cpu_outside_phases_ms: float = 0.0
    compute_by_phase: dict[str, float] = field(default_factory=dict)  # |compute| of kernels launched in each phase
    # the step on the step clock: the interval of length step_ms that ends at the step's completion
    # (end_us), split into this step's compute, exposed comm and exposed memcpy/memset running in it,
    # other steps' GPU work ("other_steps") and nothing running ("idle"); the parts add up to
    # step_ms. Unlike the GPU window it never runs into the next step's interval.
    clock_parts_ms: dict[str, float] = field(default_factory=dict)
    # the idle on the step clock (clock_parts_ms["idle"]: the step's interval with the GPU running
    # nothing at all) outside the step's host-bound idle (the gaps in its GPU window in which the CPU
    # was not in a blocking call): the step's edges, other steps' windows, idle under a CPU sync.
    # Measured from its intervals; None in facts saved before it was (compare says so)
    idle_not_host_bound_ms: float | None = None
    # the same interval split instant by instant, each GPU instant to the first part that covers
    # it whichever step launched the work (fsdpdoctor.analysis.timeline.split): "compute", exposed
    # comm by collective kind and issuing phase ("comm:<kind>:<phase>"), "memcpy", then the idle:
    # "host_bound_idle" (in the step's host-bound gaps) and "other_idle" (= idle_not_host_bound_ms).
    # The parts add up to step_ms; compare's GPU split. Empty in facts saved before it was measured
    clock_split_ms: dict[str, float] = field(default_factory=dict)
    exposed_by_role: dict[str, float] = field(default_factory=dict)  # process-group role → exposed ms
    microbatches: int = 1  # forward passes in this step (gradient accumulation)
    microbatch_phase_ms: list[dict[str, float]] = field(
        default_factory=list
    )  # CPU forward/backward ms of each (when > 1)

    @property
    def overlap_pct(self) -> float | None:
        return 100.0 * self.overlap_ms / self.comm_ms if self.comm_ms > 0 else None


@dataclass(slots=True)
class CollectiveFacts:
    kind: str
    name: str
    step: int  # index into the rank's steps, -1 outside every step
    phase: str
    unit: str | None
    issue_label: str | None
    bytes: int | None
    dtype: str | None
    group_size: int | None
    pg_name: str | None
    stream: int | None
    cpu_ts_us: float
    gpu_start_us: float | None
    gpu_dur_us: float | None
    exposed_us: float
    busbw_gbps: float | None
    in_nelems: int | None = None
    out_nelems: int | None = None
    fsdp_labels: list[str] = field(default_factory=list)  # enclosing FSDP hook labels, outermost first
    role: str = (
        "other"  # process-group role: fsdp_shard / hsdp_replicate / tensor_parallel / expert / data_parallel / other
    )
    microbatch: int = 0  # forward pass of its step (0-based; gradient accumulation)
    library: str = "unknown"  # NCCL, RCCL, DeepEP, NVSHMEM, gloo … (analysis.comms.LIBRARIES)
    blocks: int | None = None  # the most thread blocks one of its kernels launched (each holds an SM)


@dataclass(slots=True)
class UnitFacts:
    index: int
    fqn: str
    # per step (mean over the analysed steps of this rank)
    forward_all_gathers: float = 0.0
    backward_all_gathers: float = 0.0
    all_gather_bytes: float | None = 0.0  # None: the trace does not record the dtype
    reduce_scatters: float = 0.0
    reduce_scatter_bytes: float | None = 0.0
    all_gather_exposed_ms: float = 0.0
    reduce_scatter_exposed_ms: float = 0.0
    unsharded_numel: int | None = None  # all-gather output elements (padded), all parameter groups of one forward pass
    param_groups: int = 1  # parameter groups (all-gathers per forward pass), >1 with per-parameter meshes
    group_sizes: list[int] = field(default_factory=list)  # shard-group size of each parameter group
    named: bool = True  # False: the trace names no FQN; ``fqn`` is a placeholder "<unit K>" (K in execution order)


@dataclass(slots=True)
class OffloadFacts:
    detected: bool = False
    h2d_count: int = 0
    h2d_bytes: int = 0
    d2h_count: int = 0
    d2h_bytes: int = 0
    pageable_count: int = 0  # host copies from/to pageable memory, anywhere in the trace
    pageable_ms: float = 0.0
    pageable_in_hooks: int = 0  # … of them launched inside FSDP hooks (offload with pin_memory=False)
    memcpy_gpu_ms: float = 0.0
    evidence: str = ""


_WRAPPER_NAMES = re.compile(r"(?:^|\.)_(?:fsdp|checkpoint)_wrapped_module(?=\.|$)")
_INDEXED = re.compile(r"(.+)\.(\d+)")


def block_container(fqns: list[str]) -> str | None:
    """See :attr:`FsdpFacts.block_container`."""
    groups: dict[str, set[int]] = {}
    for fqn in fqns:
        m = _INDEXED.fullmatch(_WRAPPER_NAMES.sub("", fqn).lstrip("."))
        if m:
            groups.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not groups:
        return None
    parent, idx = max(groups.items(), key=lambda kv: len(kv[1]))
    return parent if len(idx) >= 2 and idx == set(range(len(idx))) else None


@dataclass(slots=True)
class FsdpFacts:
    version: int | None = None  # 1, 2 or None
    version_evidence: str = ""
    sharding_strategy: str | None = None  # FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD / NO_SHARD (trace or sidecar)
    unit_source: str = ""  # how units and their names were found
    units: list[UnitFacts] = field(default_factory=list)
    backward_prefetch: str | None = None  # BACKWARD_PRE / BACKWARD_POST / NONE / None (unknown)
    backward_prefetch_evidence: dict[str, int] = field(default_factory=dict)
    forward_prefetch: bool | None = None
    reshard_after_forward: bool | None = None
    cpu_offload: OffloadFacts = field(default_factory=OffloadFacts)
    collective_dtypes: dict[str, list[str]] = field(default_factory=dict)
    mixed_precision: bool | None = None
    rate_limiter_ms_per_step: float = 0.0
    hook_cpu_ms_per_step: float = 0.0  # CPU time inside outermost FSDP hook ranges
    # the same CPU time inside the steps, per step, by the phase it falls in (forward / backward /
    # optimizer / other: the step outside those); empty when FSDP was not found or facts predate it
    hook_cpu_ms_by_phase: dict[str, float] = field(default_factory=dict)
    microbatches_per_step: int = 1  # forward passes per optimizer step (gradient accumulation)
    activation_checkpointing: bool | None = None  # forward ops recomputed inside backward; None: unknown
    activation_checkpointing_evidence: str = ""
    recompute_ops: list[str] = field(default_factory=list)  # the forward ops run again inside backward nodes
    recompute_cpu_ms_per_step: float = 0.0  # CPU time of recomputed forward ops inside backward
    # the re-run forward's GPU time: the efficiency waterfall's recompute part where the rank has one
    # (every kernel launched in the re-run forward), else |union| of the kernels the forward-only ops launched
    recompute_gpu_ms_per_step: float = 0.0
    compiled: bool | None = None  # torch.compile regions in the trace; None: no CPU ops to tell
    optimizer_kernels: str | None = (
        None  # how the optimizer step runs on the GPU: fused / foreach / per-parameter (EfficiencyFacts.optimizer)
    )
    reduce_scatters_per_microbatch: float | None = None  # reduce-scatters per forward pass (GA: 0 when sync skipped)
    sources: dict[str, str] = field(default_factory=dict)  # fact → "trace" / "sidecar"

    @property
    def unit_count(self) -> int:
        return len(self.units)

    @property
    def block_container(self) -> str | None:
        """Where the model keeps the blocks its units wrap, from their FQNs: the parent ``P`` of
        units named ``P.0`` .. ``P.n-1`` (two or more; FSDP1's and checkpoint_wrapper's wrapper
        names dropped), e.g. ``"layers"``, ``"transformer.h"``, ``"model.layers"``; None when the
        units do not say (placeholder names, per-linear units, one unit)."""
        return block_container([u.fqn for u in self.units if u.named])

    def fix_applies(self, fix: str) -> bool:
        """Whether the configuration the trace shows leaves room for a what-if fix (the replay's
        transformation of that name, :mod:`fsdpdoctor.analysis.whatif.fixes`): decided here once,
        for the replay (which transformations to run) and the rules (whether to fire)."""
        is_fsdp = self.version in (1, 2)
        return {
            "prefetch": self.backward_prefetch in ("NONE", "BACKWARD_POST"),
            "pin": self.cpu_offload.pageable_count > 0,
            "offload_off": self.cpu_offload.detected,
            "rate_limiter_off": self.version == 1 and self.rate_limiter_ms_per_step > 0,
            # known to be off (None: the trace does not say, e.g. no collective to read a dtype from)
            "mixed_precision": is_fsdp and self.mixed_precision is False,
            "wrap": is_fsdp,
            "hooks_off": is_fsdp,
            "hooks_half": is_fsdp,
            "fused_optimizer": self.optimizer_kernels in ("per-parameter", "foreach"),
            "no_sync": is_fsdp and self.microbatches_per_step >= 2,
        }.get(fix, True)


@dataclass(slots=True)
class CollectiveStats:
    kind: str
    count_per_step: float
    bytes_per_step: float | None  # None when no collective of this kind records its size
    gpu_ms_per_step: float
    exposed_ms_per_step: float
    # bus bandwidth including the wait: bytes over the whole kernel time, which holds the wait for
    # the last rank to arrive (nccl-tests busBw convention; mean over the collectives)
    mean_busbw_gbps: float | None
    dtypes: list[str]
    group_size: int | None = None  # the most common group size of these collectives
    role: str | None = None  # the most common role (see analysis.comms.ROLES)
    roles: dict[str, float] = field(default_factory=dict)  # role → collectives per step
    # with the wait removed (run level; needs every rank's trace, None otherwise): the transfer
    # after the last rank arrived, ms per step, and the bus bandwidth of that time (see
    # ``cross_rank.transfer_*``)
    transfer_ms_per_step: float | None = None
    pure_busbw_gbps: float | None = None
    libraries: dict[str, float] = field(default_factory=dict)  # library → collectives per step
    # collectives without GPU kernels (gloo on CPU): the backend's own spans (``gloo:*``), ms per step
    cpu_comm_ms_per_step: float | None = None
    # the most SMs one of its kernels holds (its launch grid's blocks, at most the GPU's SMs; None: not recorded)
    sms: int | None = None


@dataclass(slots=True)
class RankFacts:
    rank: int
    rank_source: str
    path: str
    world_size: int | None
    device_name: str | None
    gpu_present: bool
    decode_mode: str
    event_count: int
    step_method: str
    phase_method: str
    steps: list[StepFacts]
    overlap_pct: float | None  # Holistic Trace Analysis's definition and window (last step dropped)
    comm_ms_total: float
    compute_ms_total: float
    collectives: list[CollectiveFacts]
    collective_stats: list[CollectiveStats]
    fsdp: FsdpFacts
    pg_config: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    optimizer: str | None = None  # from Optimizer.step#<Name>.step
    gpus_per_node: int | None = None  # deviceProperties entries (the devices on this host)
    device_memory_bytes: int | None = None  # totalGlobalMem of this rank's GPU
    memory_trace: MemoryFacts | None = None  # from the trace's [memory] events (profile_memory)
    parallelism: ParallelismFacts = field(default_factory=ParallelismFacts)
    whatif: WhatIfFacts | None = None  # what-if replay of this rank's steps (GPU traces)
    # large runs (more rank files than the detail limit): ``collectives`` emptied on the worker,
    # its count and per-step exposed ms by phase → kind kept (see analysis.ranks.DETAIL_RANKS)
    collectives_dropped: int = 0
    exposed_ms_by_phase_kind: dict[str, dict[str, float]] | None = None
    # what tells one run from another (the mixed-run check): the trace's wall-clock start
    # (baseTimeNanoseconds + first timestamp, or an epoch timestamp; None on a boot-relative
    # clock), the process-group backend and the NCCL version from distributedInfo
    start_unix_s: float | None = None
    backend: str | None = None
    nccl_version: str | None = None
    workload: str | None = (
        None  # "training" (a backward pass or optimizer step in some step) / "inference" / None (no steps)
    )
    # training pipelines the trace's annotations show already in use, e.g. "TrainPipelineSparseDist"
    # (TorchRec's ``## sparse_data_dist ##`` / ``## wait_sparse_data_dist ##``)
    pipelines: list[str] = field(default_factory=list)
    # the warm-up steps' GPU work still running when the profiler's window opened (no launch
    # event in the trace): counted in no step
    backlog_ops: int = 0
    backlog_ms: float = 0.0
    # % of the profiler's op numbers (External id) between the first and last CPU op the trace
    # holds: near 100 in a whole trace; far below it in a sampled or trimmed one (None: too few ops)
    ops_recorded_pct: float | None = None
    compute: ComputeFacts | None = None  # FLOPs, engines and MFU (traces with recorded shapes)
    efficiency: EfficiencyFacts | None = None  # the step split into parts that add up to it (GPU traces)
    # what the trace holds and what the analysis read of it; written once, under the run's ``inputs``
    ledger: InputLedger | None = None
    loader: LoaderFacts | None = None  # the DataLoader's next() inside the steps (None: no loader range)
    # what the trace's Python frames (with_stack) say: libraries, module classes (analysis.framework)
    python: PythonFrames | None = None
    # torch.compile's one-time work in the window, and the warm-up steps left out for it (None: none)
    compile_window: CompileFacts | None = None

    @property
    def step_ms(self) -> list[float]:
        return [s.step_ms for s in self.steps]


#: ``rank_detail`` policies: every rank's RankFacts / the ranks that matter (all of them in runs of
#: up to AUTO_FULL_RANKS ranks) / none. Every rank has its RankSummary under each.
RANK_DETAIL = ("auto", "all", "none")
AUTO_FULL_RANKS = 16


@dataclass(slots=True)
class RankSummary:
    """One rank in a few numbers, written for every rank whatever ``rank_detail`` (a few hundred
    bytes; its RankFacts, with per-step and per-collective detail, is ~10-20 KB).

    ``detail`` says whether this rank's RankFacts is in ``rank_facts`` ("full") or not
    ("summary"); ``detail_reasons`` why ``--rank-detail auto`` keeps it: "slowest" / "fastest"
    (mean step time), "straggler" (waited least at collectives: the others waited for it),
    "lowest-overlap", "worst-replay" (largest what-if replay error), "first" (the lowest rank id,
    the one single-rank figures quote). ``mean_step`` is the per-field mean of its steps
    (``number`` −1, ``start_us`` the first step's, ``end_us`` the last's): with
    ``exposed_ms_by_phase_kind`` it is what ``compare`` reads for a rank without its RankFacts;
    ``step_times_ms`` (each step's time) is what the run's step figures and the jitter rule read.
    The analysis makes it as the rank arrives, and keeps no more than it of most ranks of a large
    run (:class:`fsdpdoctor.analysis.ranks.Arrivals`).
    """

    rank: int
    path: str
    gpu_present: bool
    steps: int
    step_numbers: list[int] = field(default_factory=list)
    step_ms: float | None = None  # mean step time (StepFacts.step_ms)
    step_min_ms: float | None = None
    step_max_ms: float | None = None
    overlap_pct: float | None = None  # RankFacts.overlap_pct
    backlog_ms: float = 0.0
    wait_ms_per_step: float | None = None  # waited at collectives for later peers (cross_rank)
    replay_error_pct: float | None = None  # what-if replay's largest per-step error
    mfu_pct: float | None = None
    collectives: int = 0  # collectives traced on this rank
    detail: str = "full"
    detail_reasons: list[str] = field(default_factory=list)
    mean_step: StepFacts | None = None
    exposed_ms_by_phase_kind: dict[str, dict[str, float]] = field(default_factory=dict)  # per step
    step_times_ms: list[float] = field(default_factory=list)  # each step's StepFacts.step_ms, in order
    gpu_behind_ms: float = 0.0  # how long the last step's GPU work ends after its CPU span (ranks.wall_clock)
    waterfall_ms: dict[str, float] = field(default_factory=dict)  # its EfficiencyFacts.parts_ms (GPU traces)
    ops_recorded_pct: float | None = None  # RankFacts.ops_recorded_pct

    def stand_in(self) -> RankFacts:
        """A RankFacts with this rank's mean step as its only step (none without steps) and its
        exposed ms by phase and kind: per-rank means over it equal those over the rank's steps."""
        return RankFacts(
            rank=self.rank,
            rank_source="",
            path=self.path,
            world_size=None,
            device_name=None,
            gpu_present=self.gpu_present,
            decode_mode="",
            event_count=0,
            step_method="",
            phase_method="",
            steps=[self.mean_step] if self.mean_step else [],
            overlap_pct=self.overlap_pct,
            comm_ms_total=0.0,
            compute_ms_total=0.0,
            collectives=[],
            collective_stats=[],
            fsdp=FsdpFacts(),
            collectives_dropped=self.collectives,
            exposed_ms_by_phase_kind=self.exposed_ms_by_phase_kind,
            backlog_ms=self.backlog_ms,
        )


@dataclass(slots=True)
class InputFacts:
    path: str
    rank: int
    rank_source: str
    ledger: InputLedger | None = None  # every event counted by phase and category, and what was read


@dataclass(slots=True)
class ExcludedInput:
    """A rank left out of a partial run: its file could not be read, or no file has its id."""

    path: str | None  # None: a gap in the rank ids (no file for this rank)
    rank: int | None  # None: the id is unknown (unreadable file without a rank in its name)
    reason: str


@dataclass(slots=True)
class StepsSummary:
    count: int = 0
    mean_ms: float | None = None
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    method: str = ""
    per_rank_mean_ms: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class OverlapSummary:
    pct: float | None = None
    per_rank: dict[str, float | None] = field(default_factory=dict)
    # over every step (GPU work attributed to steps by launch): Σ overlap / Σ comm
    steps_pct: float | None = None
    steps_per_rank: dict[str, float | None] = field(default_factory=dict)
    definition: str = (
        "pct: |comm ∩ compute| / |comm| over GPU work launched before the last ProfilerStep, as "
        "Holistic Trace Analysis's get_comm_comp_overlap(); steps_pct: the same over every step"
    )


@dataclass(slots=True)
class ExposedSummary:
    mean_ms_per_step: float | None = None
    by_phase: dict[str, float] = field(default_factory=dict)
    by_kind: dict[str, float] = field(default_factory=dict)
    by_phase_kind: dict[str, dict[str, float]] = field(default_factory=dict)  # phase → kind → ms/step
    by_role: dict[str, float] = field(default_factory=dict)  # process-group role → ms/step
    per_rank: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class TimelineSummary:
    """Mean per step over the ranks with a GPU timeline; compute + exposed_comm + memcpy +
    other_steps + idle = gpu_window.

    Three clocks: ``cpu_step_ms`` is the CPU ``ProfilerStep`` span, ``gpu_window_ms`` the span
    from the first to the last GPU activity launched in the step, and ``wall_ms`` the step time
    (``StepFacts.step_ms``): the interval at which steps complete, a step completing when its CPU
    span and the GPU work it launched are both done. When the GPU runs behind the CPU
    (``gpu_behind_ms`` > 0) the step time is the GPU's, longer than the CPU span; when the CPU is
    the bottleneck it is the CPU step. GPU work launched before the window (the backlog) is
    counted in no step.
    """

    gpu_window_ms: float = 0.0
    compute_ms: float = 0.0
    comm_ms: float = 0.0
    exposed_comm_ms: float = 0.0
    memcpy_ms: float = 0.0
    idle_ms: float = 0.0
    idle_cpu_blocked_ms: float = 0.0  # of idle_ms, while the CPU sat in a blocking call (see StepFacts)
    outside_window_ms: float = 0.0  # mean step time in which the GPU had no work of the step
    other_steps_ms: float = 0.0  # window time given to other steps' GPU work (see StepFacts)
    cpu_step_ms: float = 0.0  # mean CPU ProfilerStep span of these ranks
    wall_ms: float = 0.0  # the step time (= ``StepsSummary.mean_ms`` over these ranks; see above)
    gpu_behind_ms: float = 0.0  # end of the last step's GPU work − end of its CPU span (< 0: GPU done first)
    # GPU work launched before the profiler's window opened that ran in it (the warm-up steps'
    # backlog, no launch event in the trace): mean per rank, counted in no step
    backlog_ms: float = 0.0
    backlog_ops: float = 0.0
    gpu_busy_ms: float = 0.0  # mean per step: |union of the step's own GPU work|
    # mean per step of StepFacts.clock_parts_ms: the step time split (compute, exposed_comm, memcpy,
    # other_steps, idle), on the step clock; the GPU window above can be longer than the step
    clock_parts_ms: dict[str, float] = field(default_factory=dict)
    # what limits the step: "gpu" (the GPU is busy with the step's work ≥ 90% of the step time),
    # "cpu" (it is not, and the CPU span fills ≥ 90% of the step), "mixed" otherwise; "" without a GPU
    bound: str = ""


@dataclass(slots=True)
class Candidate:
    name: str
    memory_bytes: float
    fits: bool
    comm_ms: float
    exposed_ms: float
    step_ms: float
    comm_bytes_per_step: float
    note: str = ""


@dataclass(slots=True)
class StrategyFacts:
    current: str | None
    recommended: str | None
    candidates: list[Candidate]
    reasoning: str
    assumptions: list[str]
    inputs: dict[str, float | int | str | None]
    fix: dict[str, str] = field(default_factory=dict)
    # the model's estimate of the current strategy against the measured step, in % (None without a
    # current strategy or a measured step); ``trusted`` is False beyond
    # analysis.strategy.MODEL_TOLERANCE_PCT: then nothing is recommended
    model_error_pct: float | None = None
    trusted: bool = True

    def candidate(self, name: str | None) -> "Candidate | None":
        return next((c for c in self.candidates if c.name == name), None)


@dataclass(slots=True)
class CollectiveSkew:
    """One collective matched across ranks (see :mod:`fsdpdoctor.analysis.ranks.crossrank`)."""

    pg: str
    kind: str
    index: int  # occurrence of this kind in this process group (0-based, trace order)
    step: int
    phase: str
    unit: str | None
    last_rank: int  # the rank that arrived last
    skew_ms: float  # last arrival − first arrival
    mean_wait_ms: float  # mean wait of the other ranks for the last one
    ranks: int  # ranks that had this collective


@dataclass(slots=True)
class RankWait:
    rank: int
    wait_ms_per_step: float  # time this rank waited at collectives for later peers, per step
    last_arrivals: int  # collectives at which this rank arrived last
    step_ms: float | None = None  # mean step time of the rank


@dataclass(slots=True)
class CrossRankFacts:
    """Collective wait skew across ranks and the straggler ranking (all ranks, exact)."""

    arrival: str = ""  # what "arrives" means: "gpu kernel start" or "cpu issue"
    collectives_matched: int = 0
    mean_wait_ms_by_kind: dict[str, float] = field(default_factory=dict)  # mean over collectives
    ranks: list[RankWait] = field(default_factory=list)  # straggler first (least waiting)
    top_skew: list[CollectiveSkew] = field(default_factory=list)  # the largest skews, largest first
    # the transfer with the wait removed (GPU traces): each rank's kernel end − the last rank's
    # arrival, mean over the ranks, over the collectives in a step that every rank of the group
    # reached (``transfer_collectives``); ``transfer_clock_skipped``: left out, their mean end
    # before the last arrival (host clocks disagree). Per kind: ms per step, and the bus bandwidth
    # (nccl-tests convention) of that time, mean over the collectives with a recorded size.
    transfer_collectives: int = 0
    transfer_clock_skipped: int = 0
    transfer_ms_per_step_by_kind: dict[str, float] = field(default_factory=dict)
    pure_busbw_gbps_by_kind: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class RunFacts:
    schema_version: int = SCHEMA_VERSION
    tool: str = ""
    inputs: list[InputFacts] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    world_size: int | None = None
    gpu_present: bool = False
    fsdp: FsdpFacts = field(default_factory=FsdpFacts)
    parallelism: ParallelismFacts = field(default_factory=ParallelismFacts)
    steps: StepsSummary = field(default_factory=StepsSummary)
    overlap: OverlapSummary = field(default_factory=OverlapSummary)
    exposed_comm: ExposedSummary = field(default_factory=ExposedSummary)
    timeline: TimelineSummary = field(default_factory=TimelineSummary)
    collectives: list[CollectiveStats] = field(default_factory=list)
    sidecar: dict[str, Any] | None = None
    memory: MemoryFacts | None = None  # the snapshot with the highest peak, when given
    memory_pressure: MemoryPressureFacts | None = None  # how close ``memory`` came to the capacity (analysis.pressure)
    strategy: StrategyFacts | None = None  # the sharding-strategy estimate (GPU runs)
    memory_per_input: dict[str, int] = field(default_factory=dict)  # snapshot path → peak allocated bytes
    memory_expected: dict[str, float] = field(default_factory=dict)  # ZeRO arithmetic, per rank, by category
    whatif: WhatIfFacts | None = None  # what-if replay summary over ranks (GPU traces)
    compute: ComputeFacts | None = None  # compute efficiency (FLOPs, engines, MFU) over ranks
    efficiency: EfficiencyFacts | None = None  # the waterfall: the step split into parts that add up to it
    notes: list[str] = field(default_factory=list)
    rank_facts: list[RankFacts] = field(default_factory=list)
    # partial runs: ranks left out, and how many ranks the run has (analysed + left out)
    inputs_excluded: list[ExcludedInput] = field(default_factory=list)
    ranks_expected: int | None = None
    cross_rank: CrossRankFacts | None = None  # wait skew and straggler ranking (2+ ranks with collectives)
    workload: str | None = None  # "training" / "inference" (no backward pass or optimizer step in any step) / None
    pipelines: list[str] = field(default_factory=list)  # RankFacts.pipelines of any rank
    # inputs that look like different runs, analysed together with --allow-mixed-runs: what differs
    mixed_runs: list[str] = field(default_factory=list)
    # the lowest RankFacts.ops_recorded_pct over ranks: below SAMPLED_OPS_PCT the traces are sampled
    # or trimmed (events dropped inside the window), and timing figures rest on missing events
    ops_recorded_pct: float | None = None
    hang: HangFacts | None = None  # what the Flight Recorder dumps say (fsdpdoctor.facts.hang), when given
    # one line per rank (every rank, whatever the detail); which ranks' RankFacts are written:
    # "all" (every rank), "auto" (those with detail reasons, or all in small runs), "none"
    rank_summaries: list[RankSummary] = field(default_factory=list)
    rank_detail: str = "all"
    loader: LoaderFacts | None = None  # the DataLoader inside the steps, mean over the ranks that show one
    compile_window: CompileFacts | None = None  # torch.compile's one-time work in the window (the rank with most)
    # the framework that drove the run and the model's repeated block by its class (analysis.framework)
    framework: FrameworkFacts | None = None

    @property
    def sampled(self) -> bool:
        """The traces hold a sample of the events the profiler recorded (see ``ops_recorded_pct``)."""
        return self.ops_recorded_pct is not None and self.ops_recorded_pct < SAMPLED_OPS_PCT

    @property
    def step_clock_ms(self) -> float:
        """What a step costs: the step time (``steps.mean_ms``, the interval at which steps
        complete, whichever side limits them). Shares "of the step", savings and severities are
        measured on it."""
        return self.steps.mean_ms or self.timeline.wall_ms or 0.0

    def all_ranks(self) -> list[RankFacts]:
        """Every rank's RankFacts, by rank: those written, and for a rank written as a summary only
        (``--rank-detail auto|none``) a stand-in holding its mean step as its one step
        (:meth:`RankSummary.stand_in`), which gives the same per-rank means."""
        have = {r.rank for r in self.rank_facts}
        extra = [s.stand_in() for s in self.rank_summaries if s.rank not in have]
        return sorted([*self.rank_facts, *extra], key=lambda r: r.rank) if extra else self.rank_facts

    def step_numbers(self) -> dict[str, list[int]]:
        """rank → the numbers of its steps (from the summaries when its RankFacts is not written)."""
        out = {str(s.rank): list(s.step_numbers) for s in self.rank_summaries}
        out.update({str(r.rank): [s.number for s in r.steps] for r in self.rank_facts})
        return out

    def step_times(self) -> dict[int, list[float]]:
        """rank → each of its steps' time (StepFacts.step_ms), for every rank: from its RankFacts
        when written, else from its summary (summaries written before ``step_times_ms`` existed
        lack them: those ranks are left out)."""
        out = {s.rank: list(s.step_times_ms) for s in self.rank_summaries if s.step_times_ms or not s.steps}
        out.update({r.rank: [s.step_ms for s in r.steps] for r in self.rank_facts})
        return dict(sorted(out.items()))

    # -- serialisation -------------------------------------------------------------------
    def ranks_to_write(self, rank_detail: str = "all") -> tuple[list[RankFacts], list[RankSummary], str]:
        """(RankFacts, summaries, policy) of a document written with ``rank_detail`` (see
        :data:`RANK_DETAIL`): "all" every rank's RankFacts; "auto" those of the ranks with a
        ``detail_reasons`` entry, or every rank in runs of up to :data:`AUTO_FULL_RANKS`;
        "none" no RankFacts. Every rank keeps its summary, ``detail`` saying which."""
        if rank_detail not in RANK_DETAIL:
            raise ValueError(f"rank_detail must be one of {RANK_DETAIL}, not {rank_detail!r}")
        # facts read from a document that was already cut keep the stricter policy
        policy = max(rank_detail, self.rank_detail, key=("all", "auto", "none").index)
        if policy == "all" or (policy == "auto" and len(self.rank_summaries) <= AUTO_FULL_RANKS):
            ranks = self.rank_facts
        elif policy == "auto":
            chosen = {s.rank for s in self.rank_summaries if s.detail_reasons}
            ranks = [r for r in self.rank_facts if r.rank in chosen]
        else:
            ranks = []
        kept = {r.rank for r in ranks}
        sums = [dataclasses.replace(s, detail="full" if s.rank in kept else "summary") for s in self.rank_summaries]
        ranks = [dataclasses.replace(r, ledger=None) if r.ledger is not None else r for r in ranks]  # under inputs
        return ranks, sums, policy

    def to_dict(self, rank_detail: str = "all") -> dict[str, Any]:
        ranks, sums, policy = self.ranks_to_write(rank_detail)
        d = msgspec.to_builtins(dataclasses.replace(self, rank_facts=ranks, rank_summaries=sums, rank_detail=policy))
        d["fsdp"]["unit_count"] = self.fsdp.unit_count
        return d

    def to_json(self, indent: int = 2, rank_detail: str = "all") -> str:
        return msgspec.json.format(msgspec.json.encode(self.to_dict(rank_detail)), indent=indent).decode()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunFacts":
        d = dict(d)
        if isinstance(d.get("fsdp"), dict):
            d["fsdp"] = {k: v for k, v in d["fsdp"].items() if k != "unit_count"}
        version = d.get("schema_version")
        if isinstance(version, int) and version < 5:
            compute_v4(d)
        known = {f for f in cls.__dataclass_fields__}
        out = msgspec.convert({k: v for k, v in d.items() if k in known}, cls)
        if isinstance(version, int) and version < 5 and out.steps.count:
            out.notes.append(
                f"saved by schema {version}: its step times are the steps' completion intervals, where "
                "this version takes the slower of the CPU's and the completions' rates (they differ by a "
                "few % where the CPU and the GPU run at nearly the same pace): save the baseline again"
            )
        return out

    @classmethod
    def load(cls, path: str | Path) -> "RunFacts":
        return cls.load_document(path)[0]

    @classmethod
    def load_document(cls, path: str | Path) -> tuple["RunFacts", dict[str, Any]]:
        """(the facts, the whole JSON document) of a saved facts or report JSON file.

        Every field is checked against its type here, so ``check`` and ``compare`` never meet a
        wrong one; a file from another schema version is refused with how to regenerate it.
        Raises InputError naming the file.
        """
        from fsdpdoctor.errors import InputError
        from fsdpdoctor.ingest._io import read_input, short

        p = Path(path)
        data = read_input(p, "facts/baseline JSON file")
        try:
            doc = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise InputError(p, f"not valid JSON ({short(exc)})") from None
        except UnicodeDecodeError:
            raise InputError(p, f"not valid UTF-8 JSON (a string holds invalid bytes); {REGENERATE}") from None
        except RecursionError:
            raise InputError(p, "JSON nested too deeply; not a fsdpdoctor facts/baseline file") from None
        raw = doc
        if isinstance(raw, dict) and "facts" in raw and isinstance(raw["facts"], dict):
            raw = raw["facts"]  # a full report JSON: take the facts inside it
        if not isinstance(raw, dict) or raw.get("schema_version") is None or "rank_facts" not in raw:
            raise InputError(p, "not a fsdpdoctor facts/baseline file (no schema_version/rank_facts)")
        version = raw["schema_version"]
        if type(version) is not int:
            raise InputError(
                p, f"'schema_version' is {short(ValueError(repr(version)))[:40]}, not an integer; {REGENERATE}"
            )
        if version > SCHEMA_VERSION:
            raise InputError(
                p,
                f"written by a newer fsdpdoctor (schema {version} > {SCHEMA_VERSION}): upgrade fsdpdoctor, or {REGENERATE}",
            )
        if version < OLDEST_SCHEMA_VERSION:
            raise InputError(
                p,
                f"schema version {version} is older than this fsdpdoctor reads ({OLDEST_SCHEMA_VERSION}–{SCHEMA_VERSION}); {REGENERATE}",
            )
        try:
            facts = cls.from_dict(raw)
        except msgspec.ValidationError as exc:
            msg, _, at = str(exc).partition(" - at `$")
            where = f" at {at.rstrip('`')}" if at else ""
            raise InputError(
                p, f"does not match the facts schema v{SCHEMA_VERSION}{where}: {msg[:100]}; {REGENERATE}"
            ) from None
        except RecursionError:
            raise InputError(p, "JSON nested too deeply; not a fsdpdoctor facts/baseline file") from None
        return facts, doc if isinstance(doc, dict) else {}


REGENERATE = "regenerate it with 'fsdpdoctor analyze TRACES --save-baseline FILE'"
