"""The efficiency waterfall's facts: where a step goes against the ideal.

Filled by :mod:`fsdpdoctor.analysis.efficiency` per rank and folded over ranks; re-exported by
:mod:`fsdpdoctor.facts`, whose conventions hold here too (``*_ms`` milliseconds, per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the parts a step splits into, the busy ones in the order each GPU instant is attributed (the
#: first that covers it wins); ``unattributed`` is what the measured parts leave of the step
PARTS = (
    "matmul_at_peak",
    "matmul_below_peak",
    "attention_at_peak",
    "attention_below_peak",
    "recompute",
    "other_kernels",
    "exposed_comm",
    "exposed_copies",
    "gpu_idle",
    "unattributed",
)

#: the kernel families of the other_kernels part, as the reports and rules name them
FAMILY_LABEL = {
    "elementwise": "elementwise",
    "norm": "norms",
    "softmax_loss": "softmax / loss",
    "casts": "casts",
    "copies": "copies",
    "reductions": "reductions",
    "embedding": "embedding",
    "optimizer_fused": "optimizer (fused)",
    "optimizer_foreach": "optimizer (foreach)",
    "optimizer_per_parameter": "optimizer (per-parameter kernels)",
    "other": "other",
}

#: kernel families of ``other_kernels`` (see analysis.efficiency.family)
#: optimizers PyTorch has a fused implementation of (``fused=True``): the ones a fused step can
#: replace (``Optimizer.step#<Name>.step``); Shampoo, EMA and other optimizers have none
FUSED_OPTIMIZERS = frozenset({"Adam", "AdamW", "SGD", "Adagrad"})
FAMILIES = (
    "elementwise",
    "norm",
    "softmax_loss",
    "casts",
    "copies",
    "reductions",
    "embedding",
    "optimizer_fused",
    "optimizer_foreach",
    "optimizer_per_parameter",
    "other",
)

#: what the CPU was doing while the GPU had nothing to run (see analysis.efficiency_idle)
IDLE_CAUSES = (
    "sync_drain",
    "fsdp_hooks",
    "data_loading",
    "optimizer_cpu",
    "launch",
    "python",
    "gpu_dependency",
    "unattributed",
)


def empty_parts() -> dict[str, float]:
    return dict.fromkeys(PARTS, 0.0)


@dataclass(slots=True)
class GemmShape:
    """One matmul shape of the step (an op name and its input dims), the kernels it launched."""

    op: str  # "aten::mm", "aten::addmm", …
    shape: str  # "M×K · K×N" (batched: "B×M×K · B×K×N")
    dtype: str | None
    engine: str | None  # the engine of most of its kernel time (analysis.compute.ENGINES)
    calls_per_step: float
    ms_per_step: float  # Σ kernel time (not a union: one shape's kernels run one after another)
    gflop_per_step: float
    tflops: float | None  # achieved
    below_peak_ms: float  # ms_per_step − its FLOPs at the peak
    flags: list[str] = field(default_factory=list)  # "dims not multiples of 64", "small", …


@dataclass(slots=True)
class HookCost:
    """The CPU time of one FSDP unit's hook and the GPU idle it sits on."""

    unit: str  # the unit's FQN ("" the root; "(unnamed)" where the labels carry none: FSDP1)
    hook: str  # pre_forward, post_forward, pre_backward, post_backward, root_pre_forward, …
    calls_per_step: float
    cpu_ms_per_step: float  # outermost hook ranges, blocking calls inside them left out
    gpu_wait_ms_per_step: float  # GPU idle while the launching thread was inside it (share of gpu_idle)


@dataclass(slots=True)
class SyncSite:
    """A synchronization inside the step (a sync call, ``.item()``, a blocking copy): every
    explicit synchronization, every copy call that blocked the CPU (BLOCKED_COPY_US or more) and
    every call that drained the launch queue, by call site."""

    site: str  # "## sparse_data_dist ## › aten::to → cudaMemcpyAsync" (the innermost user range › the op → the call)
    calls_per_step: float
    cpu_ms_per_step: float  # the CPU blocked in it
    gpu_idle_ms_per_step: float  # the GPU idle gaps it drained the queue into (share of gpu_idle)
    line: str | None = None  # the Python frame that called it, where the trace has stacks
    annotation: str | None = None  # the innermost user annotation around the call ("## sparse_data_dist ##")
    op: str | None = None  # the outermost aten op around it ("aten::to")
    tensor: str | None = None  # the op's first input, where shapes were recorded ("int64[88]")
    copy: str | None = None  # the copy's kind ("DtoH (Device -> Pageable)"), for a copy call
    bytes_per_call: float = 0.0  # the copy's bytes (mean per call)
    # what the CPU waited for while it blocked (per step): the GPU work that ran (its union), the
    # part of it that was communication, and the time the GPU ran nothing (its queued work held
    # back by a dependency: another stream, an event, a peer); they sum to cpu_ms_per_step
    waited_busy_ms_per_step: float = 0.0
    waited_comm_ms_per_step: float = 0.0
    waited_idle_ms_per_step: float = 0.0
    longest_idle_ms: float = 0.0  # the longest GPU idle gap inside one blocking call


@dataclass(slots=True)
class IdleOp:
    """A CPU range (op or user annotation) the launching thread was inside while the GPU had
    nothing to run and waited for that thread's next launch: the most specific ranges that hold
    a material share of that idle (a range most of whose idle an inner one holds is left out)."""

    name: str  # "Optimizer.step#Shampoo.step", "aten::unflatten_dense_tensors", "## forward ##"
    gpu_idle_ms_per_step: float  # GPU idle while the thread was inside it (at any depth)
    cpu_ms_per_step: float  # its outermost calls' CPU time


@dataclass(slots=True)
class EfficiencyFacts:
    """The step split into measured parts (``parts_ms``, keys :data:`PARTS`), per rank (its mean
    step) or for the run (means over ranks, on the run's step clock).

    Every part is measured in the steps' intervals on the step clock (each step's interval of
    ``step_ms`` ending at its completion; they tile the steps' time), from the intervals of the
    GPU activities inside them, whichever step launched them: each busy instant goes to the first
    part whose kernels cover it, in the order of :data:`PARTS` (model matmuls, model attention,
    recompute, other compute kernels, communication not under compute, copies under neither).
    ``gpu_idle`` is the time in the intervals with no GPU activity at all. At-peak parts are the
    model FLOPs of the step's own matmuls / attention at ``peak_tflops`` (the dense BF16 peak:
    their sum over the step is the MFU) and below-peak parts those kernels' time less that.
    Nothing is scaled: ``unattributed`` is the step less every other part, shown as a part of
    its own. It is 0 where the intervals tile the step and the at-peak time fits in its
    kernels' time; negative where the at-peak time exceeds the kernels' time (a peak below the
    device's); at run level it also holds the run's step clock less the ranks' mean step.
    Contributors: ``other_kernels_ms`` by family and ``idle_ms`` by cause (each sums to its
    part), ``gemm_shapes`` (furthest below peak first), ``hooks`` and ``syncs``."""

    step_ms: float = 0.0
    parts_ms: dict[str, float] = field(default_factory=empty_parts)
    peak_tflops: float | None = None
    # what the parts are made from (a peak given later, --peak-tflops, re-splits them): the
    # kernels' intervals inside the steps' intervals, each instant counted once in the order of
    # PARTS, and the FLOPs of the step's own work
    matmul_ms: float = 0.0  # the model matmuls' kernels
    attention_ms: float = 0.0  # the model attention kernels, matmul time left out
    matmul_flops: float = 0.0  # model FLOPs of the step's own matmul kernels
    attention_flops: float = 0.0
    measured_ms: dict[str, float] = field(
        default_factory=dict
    )  # recompute, other_kernels, exposed_comm, exposed_copies
    window_ms: float = 0.0  # the steps' intervals, per step (the step time where they tile it)
    window_idle_ms: float = 0.0  # no GPU activity at all in the step's interval
    flops_known: bool = False  # False: no recorded shapes; matmuls found by kernel name, no at-peak part
    gpu_busy_ms: float = 0.0  # |union of the step's own GPU work|
    other_kernels_ms: dict[str, float] = field(default_factory=dict)  # family → ms
    optimizer: str | None = None  # "fused" / "foreach" / "per-parameter": how the optimizer step's kernels run
    optimizer_kernels_per_step: float = 0.0
    optimizer_ms: float = 0.0  # the optimizer step's CPU span plus its kernels' time: what fusing it can save at most
    gemm_shapes: list[GemmShape] = field(default_factory=list)
    idle_ms: dict[str, float] = field(default_factory=dict)  # cause → ms (:data:`IDLE_CAUSES`)
    hooks: list[HookCost] = field(default_factory=list)  # by GPU wait, then CPU time
    syncs: list[SyncSite] = field(default_factory=list)
    # what the launching thread was inside while the GPU had nothing to run (the CPU side of
    # ``idle_ms``'s launch / python / optimizer / data-loading causes), by CPU range
    idle_ops: list[IdleOp] = field(default_factory=list)
    compiled_ms: float = 0.0  # CPU time per step in compiled regions (``CompiledFunction``, ``Torch-Compiled Region``)
    kernels_per_step: float = 0.0  # GPU activities (kernels, copies, memsets) the step launched
    launch_bound_kernels_per_step: float = 0.0  # … that ran shorter than their own launch call
    ranks: int = 1  # ranks folded into these figures
    notes: list[str] = field(default_factory=list)

    @property
    def busy_ms(self) -> float:
        return sum(v for k, v in self.parts_ms.items() if k not in ("gpu_idle", "unattributed"))

    @property
    def mfu_pct(self) -> float | None:
        at = self.parts_ms.get("matmul_at_peak", 0.0) + self.parts_ms.get("attention_at_peak", 0.0)
        return 100.0 * at / self.step_ms if self.flops_known and self.step_ms > 0 else None


@dataclass(slots=True)
class LoaderFacts:
    """The DataLoader's ``next()`` inside the steps (``enumerate(DataLoader)#_…Iter.__next__``
    ranges, :mod:`fsdpdoctor.analysis.loader`): means per step over the steps (and ranks)."""

    iterator: str = ""  # "_SingleProcessDataLoaderIter" (num_workers=0) / "_MultiProcessingDataLoaderIter"
    calls_per_step: float = 0.0
    ms_per_step: float = 0.0  # CPU time inside the loader's ranges
    # the part of it in which the GPU ran nothing at all (no kernel, memcpy or memset); None: no GPU
    gpu_idle_ms_per_step: float | None = None
    longest_ms: float = 0.0  # the longest single call
    steps: int = 0  # the steps it is a mean over (the fewest of any rank)
    ranks: int = 1  # ranks with loader ranges (run level)


@dataclass(slots=True)
class CompileFacts:
    """torch.compile's one-time work inside the profiled window: its ``<phase> (dynamo_timed)``
    ranges (compilation, the AOT trace, lowering, CUDA-graph recording, autotuning;
    :mod:`fsdpdoctor.analysis.compile_window`). The leading steps that hold such work are the
    compile's warm-up, left out of the steady steps every other figure is on, where a step
    without it follows; compile work in a steady step (a recompilation, or a window whose every
    step compiles) stays in it and is counted here."""

    warmup_steps: list[int] = field(default_factory=list)  # step numbers left out of the steady steps
    warmup_ms: list[float] = field(default_factory=list)  # their durations
    warmup_compile_ms: float = 0.0  # the compile work in them
    # steady step number → its compile work (ms), steps with some only
    steady_compile_ms: dict[str, float] = field(default_factory=dict)
    steady_steps: int = 0
    steady_step_ms: float | None = None  # the steady steps' mean duration (CPU span of the step range)
    # phase (the name of an outermost range, without " (dynamo_timed)") → ms in the window's steps
    phases: dict[str, float] = field(default_factory=dict)
    # per steady step: the GPU idle inside compile ranges (no kernel, memcpy or memset); None: no GPU
    gpu_idle_ms_per_step: float | None = None
    rank: int = 0  # the rank these are from (run level: the one with the most compile work)
    ranks: int = 1  # ranks with compile work in their window (run level)
