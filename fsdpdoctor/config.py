"""Rule thresholds: one documented table, overridable from ``[tool.fsdpdoctor]`` in the nearest
``pyproject.toml`` and from the command line (``--set key=value``), in that order.

```toml
[tool.fsdpdoctor]
min_overlap_pct = 80
disable = ["step-time-jitter"]
```
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fsdpdoctor.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# name → (default, documentation)
THRESHOLDS: dict[str, tuple[float, str]] = {
    "severity_critical_pct": (
        20.0,
        "any finding: critical when its estimated saving is at least this % of the step (wall-clock time per step)",
    ),
    "severity_warning_pct": (
        3.0,
        "any finding: warning when its estimated saving is at least this % of the step; below it, info",
    ),
    "coarse_max_unit_share": (0.5, "auto-wrap-too-coarse: one unit gathering more than this share of all parameters"),
    "coarse_split_into": (8, "auto-wrap-too-coarse: units assumed after re-wrapping, for the saving estimate"),
    "fine_min_units": (8, "auto-wrap-too-fine: at least this many units"),
    "fine_max_median_ag_mib": (16, "auto-wrap-too-fine: median all-gather below this size (MiB) is latency-bound"),
    "prefetch_min_exposed_ms": (
        0.05,
        "missing-backward-prefetch: exposed backward all-gather per step (ms) below which the finding is info only",
    ),
    "offload_min_ms": (1.0, "cpu-offload-stall: exposed memcpy + optimizer-phase GPU idle per step (ms)"),
    "pageable_min_count": (1, "pageable-memcpy: host copies from/to pageable memory per trace"),
    "exposed_rs_min_ms": (0.5, "exposed-reduce-scatter: exposed reduce-scatter per step (ms)"),
    "exposed_rs_min_pct": (3.0, "exposed-reduce-scatter: … and as % of the step"),
    "min_overlap_pct": (70.0, "low-overlap: overlap below this %"),
    "low_overlap_min_pct_of_step": (5.0, "low-overlap: exposed comm must also be this % of the step"),
    "straggler_pct": (10.0, "straggler-rank: a rank's compute per step this % above the median rank"),
    "host_bound_idle_pct": (30.0, "host-bound: GPU idle this % of the step's GPU window"),
    "mp_min_ag_mib": (1.0, "no-mixed-precision-collectives: fp32 all-gathers of at least this many MiB per step"),
    "rate_limiter_min_ms": (1.0, "rate-limiter-stall: CPU time blocked in FSDP1's rate limiter per step (ms)"),
    "rate_limiter_min_pct": (2.0, "rate-limiter-stall: … and as % of the step"),
    "jitter_cv_pct": (10.0, "step-time-jitter: coefficient of variation of step times (%)"),
    "jitter_min_steps": (3, "step-time-jitter: steps needed to judge"),
    "activation_share_pct": (50.0, "activation-memory-dominates: activations this % of peak allocated memory"),
    "checkpoint_kept_fraction": (
        0.2,
        "activation-memory-dominates: share of activation memory still held with per-block checkpointing",
    ),
    "unsharded_share_pct": (25.0, "unsharded-params-held: unsharded parameters this % of peak allocated memory"),
    "fragmentation_pct": (30.0, "allocator-fragmentation: cached free blocks this % of reserved memory at the peak"),
    "fragmentation_min_mib": (1024, "allocator-fragmentation: … and at least this many MiB"),
    "optimizer_share_pct": (40.0, "optimizer-state-dominates: optimizer state this % of peak allocated memory"),
    "strategy_min_saving_pct": (5.0, "sharding-strategy / ddp-would-be-faster: estimated saving as % of the step"),
    "fine_latency_share": (
        0.5,
        "auto-wrap-too-fine: fixed-latency share of the median collective (fit duration = a + bytes/bw) that counts as latency-bound",
    ),
    "fine_hook_saving_pct": (
        5.0,
        "auto-wrap-too-fine: step saving (% of the step) of the what-if replay with FSDP hook CPU time removed that puts the hooks on the critical path",
    ),
    "recompute_min_pct": (3.0, "activation-recompute: GPU time of recomputed forward ops per step as % of the step"),
    "wrong_engine_min_pct": (
        20.0,
        "matmul-wrong-engine: GEMM + attention kernel time on fp32 engines (CUDA cores, no TF32) as % of all of it, on a GPU with tensor cores",
    ),
    "peak_tflops": (
        0.0,
        "compute: the dense peak TFLOP/s MFU is measured against (0: the device's dense BF16 peak from the peak table, by device name; --peak-tflops)",
    ),
    "memory_budget_gib": (
        0.0,
        "memory: the memory (GiB per GPU) memory findings are judged against (0: the GPU's total memory from the traces; --memory-budget)",
    ),
    "memory_pressure_pct": (
        80.0,
        "memory: memory findings are warnings or worse only when the peak reserved is at least this % of that memory, or the run ran out of memory",
    ),
    "hang_late_s": (
        1.0,
        "collective-hang: a rank that entered the stuck collective at least this many seconds after the median rank (Flight Recorder time_created_ns) is late",
    ),
    "hook_overhead_pct": (30.0, "auto-wrap-too-fine: CPU time in FSDP hooks as % of the step that counts as evidence"),
    "waterfall_min_part_pct": (
        5.0,
        "the waterfall's rules (gpu-starved-by-hooks, non-matmul-kernels, sync-in-step, matmul-shapes-below-peak): their part of the step is material from this %",
    ),
    "hook_idle_min_pct": (
        3.0,
        "gpu-starved-by-hooks: GPU idle while the launching thread is inside FSDP hooks, as % of the step",
    ),
    "sync_drain_min_pct": (
        1.0,
        "sync-in-step: GPU idle after synchronizations that drained the launch queue, as % of the step",
    ),
    "sync_blocked_min_pct": (
        10.0,
        "sync-in-step: one call site blocking the CPU on the GPU this % of the step while the GPU, too, runs nothing this % (a blocking copy, .item(), a synchronization)",
    ),
    "loader_min_pct": (
        5.0,
        "dataloader-bound: GPU idle inside the DataLoader's next() this % of the step",
    ),
    "fusion_min_pct": (
        15.0,
        "non-matmul-kernels: elementwise, norm, softmax and cast kernels this % of the step before torch.compile's fusion is named a lever (where the optimizer's is not)",
    ),
    "gemm_flagged_min_pct": (
        2.0,
        "matmul-shapes-below-peak: below-peak time of misaligned or small matmul shapes, as % of the step",
    ),
}


#: a what-if replay whose unchanged run misses a measured step by more than this (%) explains too
#: little to trust: savings then come from the rules' heuristics, and the report says so
REPLAY_MAX_ERROR_PCT = 5.0


def defaults() -> dict[str, Any]:
    return {k: v for k, (v, _) in THRESHOLDS.items()} | {"disable": []}


def find_pyproject(start: Path | None = None) -> Path | None:
    d = (start or Path.cwd()).resolve()
    for p in [d, *d.parents]:
        cand = p / "pyproject.toml"
        if cand.is_file():
            return cand
    return None


def _coerce(key: str, value: Any, origin: str) -> Any:
    if key == "disable":
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise InputError(origin, "'disable' must be a list of rule codes or slugs")
    if key not in THRESHOLDS:
        raise InputError(origin, f"unknown setting '{key}' (see 'fsdpdoctor rules --thresholds')")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(origin, f"setting '{key}' needs a number, got {value!r}") from None


def load_config(overrides: list[str] | None = None, pyproject: Path | None = None, section: str = "") -> dict[str, Any]:
    """Defaults, then ``[tool.fsdpdoctor]`` (ignoring sub-tables), then ``key=value`` overrides."""
    cfg = defaults()
    path = pyproject if pyproject is not None else find_pyproject()
    if path is not None:
        try:
            doc = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InputError(path, f"cannot read settings ({exc})") from None
        table = doc.get("tool", {}).get("fsdpdoctor", {})
        for k, v in table.items():
            if isinstance(v, dict):  # sub-tables such as [tool.fsdpdoctor.check]
                continue
            cfg[k] = _coerce(k, v, f"{path} [tool.fsdpdoctor]")
    for item in overrides or []:
        if "=" not in item:
            raise InputError(item, "expected KEY=VALUE")
        k, v = item.split("=", 1)
        cfg[k.strip()] = _coerce(k.strip(), v.strip(), f"--set {item}")
    return cfg
