"""Compute and what-if facts: FLOPs, engines and MFU; the what-if replay's figures; and how a
schema-4 report's compute figures read into schema 5's. Part of the RunFacts contract
(:mod:`fsdpdoctor.facts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


#: the rate the what-if replay assumes for fp32 GEMM / attention kernels moved onto tensor cores: this
#: share of the device's dense BF16 peak (large bf16 GEMMs reach 60-80% of it, attention less)
TENSOR_CORE_SHARE = 0.5


@dataclass(slots=True)
class ComputeFacts:
    """Compute efficiency (fsdpdoctor.analysis.compute): FLOPs from recorded shapes, GEMM and
    attention kernel time by engine, achieved TFLOP/s and MFU. Per rank, or the run's (means over
    ranks, per device). ``flops_per_step`` counts hardware FLOPs (activation-checkpointing
    recompute included); ``model_flops_per_step`` leaves the recompute out. ``mfu_pct`` /
    ``hfu_pct`` are model / hardware FLOPs per step over (step time × ``peak_tflops``, the
    device's dense BF16 peak, FP16 where it has no BF16, whatever dtype the run used: the PaLM /
    torchtitan convention); ``dtype_mfu_pct`` is the same against the dense peak of the run's
    compute dtype (``dtype_peak_tflops``), for information: an fp32 run near its fp32 peak still
    leaves the tensor cores idle.
    ``dtype_mix``: engine → % of GEMM + attention kernel time (engines: fp32-simt, fp32, tf32,
    bf16, fp16, fp8; fp4-fp8: an FP4 (e2m1, MXFP4 / NVFP4) operand times an FP8 one, at the FP8
    rate; fp4: both FP4). The time by engine also holds the GEMM and attention kernels no op with
    shapes launched, found by their names (``named_ms_per_step`` of it; no FLOPs). ``source`` is
    "shapes" (FLOPs from recorded shapes), "names" (no shapes: kernel time by engine from the
    kernels' names only, no FLOPs, no MFU), or "" (neither)."""

    source: str = ""
    device: str | None = None
    flops_per_step: float = 0.0
    model_flops_per_step: float = 0.0
    matmul_flops_per_step: float = 0.0
    attention_flops_per_step: float = 0.0
    recompute_flops_per_step: float = 0.0
    flops_by_phase: dict[str, float] = field(default_factory=dict)
    gemm_ms_per_step: float = 0.0  # |union| of the GEMM kernels of counted ops
    attention_ms_per_step: float = 0.0
    recompute_ms_per_step: float = 0.0  # |union| of the GEMM / attention kernels of recomputed ops
    gemm_tflops: float | None = None  # GEMM FLOPs / GEMM kernel time
    attention_tflops: float | None = None
    engine_ms_per_step: dict[str, float] = field(default_factory=dict)  # Σ kernel time by engine
    attention_engine_ms_per_step: dict[str, float] = field(default_factory=dict)  # the attention kernels' part of it
    engine_tflops: dict[str, float] = field(default_factory=dict)  # achieved by the kernels of each engine
    named_ms_per_step: float = 0.0  # Σ time of the GEMM / attention kernels found by name only (no FLOPs)
    dtype_mix: dict[str, float] = field(default_factory=dict)
    compute_dtype: str | None = None  # the engine with the most GEMM + attention time
    tensor_cores: bool = False  # the device has matrix units much faster than fp32
    step_ms: float = 0.0  # the step time the rates below are on
    achieved_tflops: float | None = None  # model FLOPs per step / step time
    hardware_tflops: float | None = None
    peak_label: str | None = None
    peak_tflops: float | None = None  # dense BF16 (FP16 without BF16) peak, or --peak-tflops: what MFU is against
    peak_dtype: str | None = None  # "bf16", "fp16" (a device without BF16), None (--peak-tflops)
    dtype_peak: str | None = None  # the compute dtype's peak: "fp32", "tf32", "bf16", "fp16", "fp8"
    dtype_peak_tflops: float | None = None
    device_peaks_tflops: dict[str, float] = field(
        default_factory=dict
    )  # the device's dense peaks by dtype ({}: unknown device)
    mfu_pct: float | None = None
    hfu_pct: float | None = None
    dtype_mfu_pct: float | None = None
    ops_with_shapes: int = 0
    ops_without_shapes: int = 0
    # matmul / attention ops inside torch.compile's one-time work (traced on fake tensors, captured
    # into a CUDA graph, benchmarked): not the step's model FLOPs, not counted
    ops_in_compile: int = 0

    @property
    def gemm_mix(self) -> dict[str, float]:
        """engine → % of the GEMM kernels' time (attention left out): what "of GEMM time" means;
        ``dtype_mix`` when the attention kernels' engines are not known apart."""
        gemm = {e: v - self.attention_engine_ms_per_step.get(e, 0.0) for e, v in self.engine_ms_per_step.items()}
        gemm = {e: v for e, v in gemm.items() if v > 1e-9}
        total = sum(gemm.values())
        return {e: 100.0 * v / total for e, v in gemm.items()} if total else dict(self.dtype_mix)

    @property
    def fp32_share_pct(self) -> float:
        """% of GEMM + attention kernel time on fp32 engines (CUDA cores, or fp32 of no known
        engine): what the tensor-core fix can move."""
        return self.dtype_mix.get("fp32-simt", 0.0) + self.dtype_mix.get("fp32", 0.0)


@dataclass(slots=True)
class WhatIfFacts:
    """What-if replay of one rank's steps (fsdpdoctor.analysis.whatif), or the run's summary.

    ``measured_step_ms`` is the step time as the analysis counts it (the steady rate of the slower
    side, :func:`fsdpdoctor.analysis.steps.step_times_ms`; the mean is ``TimelineSummary.wall_ms``);
    ``replayed_step_ms`` is the unchanged graph's replay, counted alike; ``error_pct`` is its
    *fidelity* (per run: the worst rank): the larger of its error on the step time and its largest
    per-step error on the completion clock. Fidelity is not the error of a saving (a graph built
    from a trace reproduces that trace almost by construction); savings get their ranges from real
    twins (:mod:`fsdpdoctor.savings`). ``sensitivity_ms[fix]``: how much a saving changes when the
    waits the trace does not explain and the inferred edges are left out (per run: the maximum).
    ``step_ms[fix]`` is the replayed mean step time with the fix applied, ``saving_ms[fix]`` the
    replayed step time without it minus with it, on the same steps (per run: the maximum over
    ranks, since the slowest rank sets the step, and ``step_ms[fix]`` of the rank it is from, so
    that the two add up to that rank's unchanged replay where the saving is positive; its stated
    assumptions and the fix's note are that rank's too). ``exposed_rs_ms[fix]`` is the exposed reduce-scatter per step
    in the replay ("none": unchanged).
    """

    measured_step_ms: float = 0.0
    replayed_step_ms: float = 0.0
    error_pct: float = 0.0
    ops: int = 0
    wait_edges: int = 0
    blocking_calls: int = 0
    # ops that started later than anything in the trace explains: an edge inferred where the op
    # started just as work on another stream ended, else the measured wait kept as is
    inferred_edges: int = 0
    unexplained_waits: int = 0
    unexplained_wait_ms: float = 0.0  # Σ of the kept waits per step
    backlog_ops: int = 0  # GPU ops replayed where they were measured (launched before the window)
    step_ms: dict[str, float] = field(default_factory=dict)
    saving_ms: dict[str, float] = field(default_factory=dict)
    exposed_rs_ms: dict[str, float] = field(default_factory=dict)
    sensitivity_ms: dict[str, float] = field(default_factory=dict)
    # fix → [lowest, highest] saving over the fix's stated assumptions replayed at the ends of
    # their span (fsdpdoctor.analysis.whatif.fixes.ASSUMPTIONS), and what was varied, stated
    assumption_ms: dict[str, list[float]] = field(default_factory=dict)
    assumptions: dict[str, str] = field(default_factory=dict)
    evidence: dict[str, str] = field(default_factory=dict)  # fix → what the transformation changed
    per_rank_error_pct: dict[str, float] = field(default_factory=dict)  # run summary only
    saving_rank: dict[str, int] = field(default_factory=dict)  # run summary only: fix → the rank its saving is from
    # fixed-cost share of the median all-gather / reduce-scatter (fit duration = a + bytes/bw);
    # None when the sizes do not vary enough to tell
    latency_share: float | None = None

    def saving(self, fix: str) -> float | None:
        return self.saving_ms.get(fix)


def compute_v4(d: dict[str, Any]) -> None:
    """Schema 4's compute figures in schema 5's fields, in place: MFU against the BF16 peak (4's
    ``mfu_bf16_pct``), the dtype's peak and MFU as ``dtype_*``. Rank summaries' MFU is scaled by
    the run's ratio of the two peaks."""

    def move(c: Any) -> float | None:
        if not isinstance(c, dict) or "dtype_peak_tflops" in c:
            return None
        old_peak, bf16 = c.get("peak_tflops"), c.pop("bf16_peak_tflops", None)
        c["dtype_peak"], c["dtype_peak_tflops"] = c.pop("peak_dtype", None), old_peak
        c["dtype_mfu_pct"] = c.get("mfu_pct")
        label = c.get("peak_label")
        ratio = (
            old_peak / bf16 if isinstance(old_peak, (int, float)) and isinstance(bf16, (int, float)) and bf16 else None
        )
        if label == "--peak-tflops":
            c["peak_dtype"], c["dtype_peak"], c["dtype_peak_tflops"], c["dtype_mfu_pct"] = None, None, None, None
            ratio = 1.0
        else:
            c["peak_tflops"], c["peak_dtype"] = bf16, "bf16" if bf16 else None
            c["mfu_pct"] = c.pop("mfu_bf16_pct", None)
            c["hfu_pct"] = c["hfu_pct"] * ratio if isinstance(c.get("hfu_pct"), (int, float)) and ratio else None
        c.pop("mfu_bf16_pct", None)
        return ratio

    ratio = move(d.get("compute"))
    ranks, sums = d.get("rank_facts"), d.get("rank_summaries")
    for r in ranks if isinstance(ranks, list) else []:
        if isinstance(r, dict):
            move(r.get("compute"))
    for s in sums if isinstance(sums, list) else []:
        if isinstance(s, dict) and isinstance(s.get("mfu_pct"), (int, float)):
            s["mfu_pct"] = s["mfu_pct"] * ratio if ratio else None
