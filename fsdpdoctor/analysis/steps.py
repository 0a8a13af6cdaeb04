"""Training steps and their phases (forward / backward / optimizer) from CPU-side annotations."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..ingest.kineto import RankTrace

PHASES = ("forward", "backward", "optimizer", "other")
_STEP_RX = re.compile(r"^ProfilerStep#(\d+)$")
CPU_CATS = ("cpu_op", "user_annotation")

# CPU ranges that only occur while autograd runs the backward pass.
BACKWARD_PREFIXES = (
    "autograd::engine::evaluate_function",
    "FSDP::pre_backward",
    "FSDP::post_backward",
    "FSDP::backward_prefetch",
    "FSDP::root_post_backward",
    "FullyShardedDataParallel._pre_backward_hook",
    "FullyShardedDataParallel._post_backward_hook",
    "FullyShardedDataParallel._post_backward_final_callback",
)
OPTIMIZER_PREFIX = "Optimizer.step#"


@dataclass
class StepWindow:
    number: int
    start: float  # CPU µs
    end: float
    # phase → (start, end) on the CPU timeline; absent phases are missing
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class StepInfo:
    steps: list[StepWindow]
    step_method: str  # "ProfilerStep", "optimizer-boundaries", "whole-trace"
    phase_method: str  # how phases were found


def _cpu_rows(rt: RankTrace) -> np.ndarray:
    return rt.mask_cat(*CPU_CATS)


def find_steps(rt: RankTrace) -> StepInfo:
    cpu = _cpu_rows(rt)
    step_rows = np.flatnonzero(cpu & rt.mask_names(lambda n: n.startswith("ProfilerStep#")))
    steps: list[StepWindow] = []
    if step_rows.size:
        best: dict[int, int] = {}
        for i in step_rows:
            m = _STEP_RX.match(rt.row_name(i))
            if not m:
                continue
            num = int(m.group(1))
            if num not in best or rt.dur[i] > rt.dur[best[num]]:
                best[num] = int(i)
        steps = [StepWindow(num, float(rt.ts[i]), float(rt.ts[i] + rt.dur[i])) for num, i in best.items()]
        steps.sort(key=lambda s: s.start)
        method = "ProfilerStep"
    else:
        opt_rows = np.flatnonzero(cpu & rt.mask_names(lambda n: n.startswith(OPTIMIZER_PREFIX)))
        cpu_ts = rt.ts[cpu]
        t0 = float(cpu_ts.min()) if cpu_ts.size else float(rt.ts.min())
        t1 = float((rt.ts + rt.dur)[cpu].max()) if cpu_ts.size else float((rt.ts + rt.dur).max())
        if opt_rows.size >= 2:
            ends = np.sort(rt.ts[opt_rows] + rt.dur[opt_rows])
            bounds = np.concatenate(([t0], ends))
            steps = [StepWindow(k, float(bounds[k]), float(bounds[k + 1])) for k in range(len(ends))]
            method = "optimizer-boundaries"
        else:
            steps = [StepWindow(0, t0, t1)]
            method = "whole-trace"
    phase_method = _assign_phases(rt, cpu, steps)
    return StepInfo(steps, method, phase_method)


def _assign_phases(rt: RankTrace, cpu: np.ndarray, steps: list[StepWindow]) -> str:
    bwd = np.flatnonzero(cpu & rt.mask_names(lambda n: n.startswith(BACKWARD_PREFIXES)))
    autograd_threads = [
        code
        for code, key in enumerate(rt.threads)
        if rt.thread_names.get(key, "").startswith(("pt_autograd", "autograd"))
    ]
    if autograd_threads:
        bwd = np.union1d(bwd, np.flatnonzero(cpu & np.isin(rt.thread, autograd_threads)))
    opt = np.flatnonzero(cpu & rt.mask_names(lambda n: n.startswith(OPTIMIZER_PREFIX)))
    b_s, b_e = rt.ts[bwd], rt.ts[bwd] + rt.dur[bwd]
    o_s, o_e = rt.ts[opt], rt.ts[opt] + rt.dur[opt]
    found_bwd = found_opt = False
    for st in steps:
        ph: dict[str, tuple[float, float]] = {}
        om = (o_s >= st.start) & (o_s < st.end)
        opt_start = st.end
        if om.any():
            opt_start = float(o_s[om].min())
            ph["optimizer"] = (opt_start, float(min(o_e[om].max(), st.end)))
            found_opt = True
        bm = (b_s >= st.start) & (b_s < opt_start)
        if bm.any():
            bs = float(b_s[bm].min())
            be = float(min(b_e[bm].max(), opt_start))
            ph["forward"] = (st.start, bs)
            ph["backward"] = (bs, be)
            found_bwd = True
        else:
            ph["forward"] = (st.start, opt_start)
        st.phases = ph
    parts = []
    if found_bwd:
        parts.append("backward from autograd/FSDP backward ranges")
    if found_opt:
        parts.append("optimizer from Optimizer.step# annotations")
    return "; ".join(parts) if parts else "no backward or optimizer ranges: whole step counted as forward"


def locate(steps: list[StepWindow], t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step index (-1 when outside every step) and phase index into PHASES for CPU times ``t``."""
    t = np.asarray(t, dtype=np.float64)
    step_idx = np.full(t.shape, -1, dtype=np.int64)
    phase_idx = np.full(t.shape, PHASES.index("other"), dtype=np.int64)
    if not steps:
        return step_idx, phase_idx
    starts = np.array([st.start for st in steps], dtype=np.float64)
    ends = np.array([st.end for st in steps], dtype=np.float64)
    if np.any(starts[1:] < starts[:-1]) or np.any(ends[:-1] > starts[1:]):
        return _locate_loop(steps, t)  # overlapping or unsorted windows: the last one wins
    k = np.searchsorted(starts, t, side="right") - 1
    kc = np.maximum(k, 0)
    inside = (k >= 0) & (t < ends[kc])
    step_idx[inside] = k[inside]
    # phases in the order _assign_phases inserts them (a later one wins where they overlap)
    for name in ("optimizer", "forward", "backward", *[p for p in PHASES if p not in ("optimizer", "forward", "backward")]):
        a = np.array([st.phases[name][0] if name in st.phases else np.nan for st in steps])
        b = np.array([st.phases[name][1] if name in st.phases else np.nan for st in steps])
        if np.all(np.isnan(a)):
            continue
        pm = inside & (t >= a[kc]) & (t < b[kc])
        phase_idx[pm] = PHASES.index(name)
    return step_idx, phase_idx


def _locate_loop(steps: list[StepWindow], t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    step_idx = np.full(t.shape, -1, dtype=np.int64)
    phase_idx = np.full(t.shape, PHASES.index("other"), dtype=np.int64)
    for k, st in enumerate(steps):
        m = (t >= st.start) & (t < st.end)
        step_idx[m] = k
        for name, (a, b) in st.phases.items():
            pm = m & (t >= a) & (t < b)
            phase_idx[pm] = PHASES.index(name)
    return step_idx, phase_idx
