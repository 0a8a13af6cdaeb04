"""Training steps and their phases (forward / backward / optimizer) from CPU-side annotations."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis.rows import name_rows

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
# One of these starts every forward pass (micro-batch): FSDP2 records root_pre_forward once per
# root forward; FSDP1 and DDP wrap the root's forward (FSDP1 nests the units' forwards in it, so
# only the outermost range counts).
FORWARD_START_NAMES = ("FSDP::root_pre_forward",)
FORWARD_OUTER_NAMES = ("FullyShardedDataParallel.forward", "DistributedDataParallel.forward")


@dataclass
class StepWindow:
    number: int
    start: float  # CPU µs
    end: float
    # phase → (start, end) on the CPU timeline; absent phases are missing
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    # forward/backward windows of each micro-batch (forward pass + its backward), in order; one
    # entry per forward pass when the step has several (gradient accumulation), else empty
    microbatches: list[dict[str, tuple[float, float]]] = field(default_factory=list)

    @property
    def dur(self) -> float:
        return self.end - self.start

    @property
    def n_microbatches(self) -> int:
        return max(len(self.microbatches), 1)

    def phase_us(self) -> dict[str, float]:
        """CPU time of each phase, summed over micro-batches."""
        if not self.microbatches:
            return {name: b - a for name, (a, b) in self.phases.items()}
        out: dict[str, float] = {}
        for mb in self.microbatches:
            for name, (a, b) in mb.items():
                out[name] = out.get(name, 0.0) + (b - a)
        if "optimizer" in self.phases:
            a, b = self.phases["optimizer"]
            out["optimizer"] = b - a
        return out


@dataclass
class StepInfo:
    steps: list[StepWindow]
    step_method: str  # "ProfilerStep", "optimizer-boundaries", "whole-trace"
    phase_method: str  # how phases were found


def _cpu_rows(rt: RankTrace) -> np.ndarray:
    return rt.mask_cat(*CPU_CATS)


def find_steps(rt: RankTrace) -> StepInfo:
    cpu = _cpu_rows(rt)
    step_rows = name_rows(rt, lambda n: n.startswith("ProfilerStep#"), *CPU_CATS)
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
        opt_rows = name_rows(rt, lambda n: n.startswith(OPTIMIZER_PREFIX), *CPU_CATS)
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
    bwd = name_rows(rt, lambda n: n.startswith(BACKWARD_PREFIXES), *CPU_CATS)
    autograd_threads = [
        code
        for code, key in enumerate(rt.threads)
        if rt.thread_names.get(key, "").startswith(("pt_autograd", "autograd"))
    ]
    if autograd_threads:
        bwd = np.union1d(bwd, np.flatnonzero(cpu & np.isin(rt.thread, autograd_threads)))
    opt = name_rows(rt, lambda n: n.startswith(OPTIMIZER_PREFIX), *CPU_CATS)
    b_s, b_e = rt.ts[bwd], rt.ts[bwd] + rt.dur[bwd]
    o_s, o_e = rt.ts[opt], rt.ts[opt] + rt.dur[opt]
    fwd_starts = forward_starts(rt)
    found_bwd = found_opt = False
    for st in steps:
        ph: dict[str, tuple[float, float]] = {}
        om = (o_s >= st.start) & (o_s < st.end)
        opt_start = st.end
        if om.any():
            opt_start = float(o_s[om].min())
            opt_end = float(min(o_e[om].max(), st.end))
            # optimizer.step(closure) (Lightning's automatic optimization, LBFGS): the closure runs
            # forward and backward inside the step's Optimizer.step range; the optimizer's own
            # work is what follows the closure's backward
            inner = (b_s >= opt_start) & (b_s < opt_end)
            if inner.any():
                opt_start = float(min(b_e[inner].max(), opt_end))
            ph["optimizer"] = (opt_start, opt_end)
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
        st.microbatches = _microbatches(st, opt_start, fwd_starts, b_s, b_e)
    parts = []
    if any(st.microbatches for st in steps):
        parts.append("micro-batches split at each forward pass's start (root pre-forward)")
    if found_bwd:
        parts.append("backward from autograd/FSDP backward ranges")
    if found_opt:
        parts.append("optimizer from Optimizer.step# annotations")
    return "; ".join(parts) if parts else "no backward or optimizer ranges: whole step counted as forward"


def forward_starts(rt: RankTrace, cpu: np.ndarray | None = None) -> np.ndarray:
    """Sorted CPU start times of every forward pass: ``FSDP::root_pre_forward`` ranges, else the
    outermost ``FullyShardedDataParallel.forward`` / ``DistributedDataParallel.forward`` ranges."""

    def named(pred) -> np.ndarray:
        return name_rows(rt, pred, *CPU_CATS) if cpu is None else np.flatnonzero(cpu & rt.mask_names(pred))

    rows = named(lambda n: n in FORWARD_START_NAMES)
    if rows.size == 0:
        rows = named(lambda n: n in FORWARD_OUTER_NAMES)
        if rows.size:
            rows = rows[np.lexsort((-rt.dur[rows], rt.ts[rows]))]
            keep, end = [], -np.inf
            for r in rows.tolist():
                if rt.ts[r] >= end:  # not inside the previous outermost range
                    keep.append(r)
                    end = float(rt.ts[r] + rt.dur[r])
            rows = np.array(keep, dtype=np.int64)
    return np.sort(rt.ts[rows]) if rows.size else np.zeros(0)


def _microbatches(st: StepWindow, opt_start: float, fwd_starts: np.ndarray, b_s: np.ndarray, b_e: np.ndarray):
    """Forward/backward windows of each forward pass of a step that holds several."""
    fs = fwd_starts[(fwd_starts >= st.start) & (fwd_starts < opt_start)]
    if fs.size < 2:
        return []
    bounds = [st.start, *fs[1:].tolist(), opt_start]
    out: list[dict[str, tuple[float, float]]] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        m = (b_s >= a) & (b_s < b)
        if out and "backward" in out[-1]:
            a = out[-1]["backward"][1]  # what runs between two micro-batches readies the next forward
        if m.any():
            bs = float(b_s[m].min())
            out.append({"forward": (a, bs), "backward": (bs, float(min(b_e[m].max(), b)))})
        else:
            out.append({"forward": (a, b)})
    return out


def microbatch_of(steps: list[StepWindow], step_idx: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Micro-batch index (0-based) of CPU times ``t`` in their step ``step_idx`` (0 when the step
    has one forward pass, -1 outside every step)."""
    t = np.asarray(t, dtype=np.float64)
    out = np.where(step_idx >= 0, 0, -1).astype(np.int64)
    for k, st in enumerate(steps):
        if len(st.microbatches) < 2:
            continue
        starts = np.array([mb["forward"][0] for mb in st.microbatches])
        m = step_idx == k
        out[m] = np.maximum(np.searchsorted(starts, t[m], side="right") - 1, 0)
    return out


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
    for name in (
        "optimizer",
        "forward",
        "backward",
        *[p for p in PHASES if p not in ("optimizer", "forward", "backward")],
    ):
        a = np.array([st.phases[name][0] if name in st.phases else np.nan for st in steps])
        b = np.array([st.phases[name][1] if name in st.phases else np.nan for st in steps])
        if np.all(np.isnan(a)):
            continue
        pm = inside & (t >= a[kc]) & (t < b[kc])
        phase_idx[pm] = PHASES.index(name)
    _locate_microbatches(steps, t, step_idx, phase_idx)
    return step_idx, phase_idx


def _locate_microbatches(steps: list[StepWindow], t: np.ndarray, step_idx: np.ndarray, phase_idx: np.ndarray) -> None:
    """Within steps of several forward passes, the phase comes from the micro-batch windows."""
    for k, st in enumerate(steps):
        if not st.microbatches:
            continue
        m = step_idx == k
        if not m.any():
            continue
        tm = t[m]
        ph = phase_idx[m]
        opt = st.phases.get("optimizer")
        ph[:] = PHASES.index("other")
        if opt is not None:
            ph[(tm >= opt[0]) & (tm < opt[1])] = PHASES.index("optimizer")
        for mb in st.microbatches:
            for name, (a, b) in mb.items():
                ph[(tm >= a) & (tm < b)] = PHASES.index(name)
        phase_idx[m] = ph


def _locate_loop(steps: list[StepWindow], t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    step_idx = np.full(t.shape, -1, dtype=np.int64)
    phase_idx = np.full(t.shape, PHASES.index("other"), dtype=np.int64)
    for k, st in enumerate(steps):
        m = (t >= st.start) & (t < st.end)
        step_idx[m] = k
        for name, (a, b) in st.phases.items():
            pm = m & (t >= a) & (t < b)
            phase_idx[pm] = PHASES.index(name)
    _locate_microbatches(steps, t, step_idx, phase_idx)
    return step_idx, phase_idx


def step_times_ms(cpu_start: np.ndarray, cpu_end: np.ndarray, done: np.ndarray | None, first: float) -> np.ndarray:
    """Each step's time (ms): the interval of the slower side, so that their mean is the steady
    step time over the window, the larger of two rates (DESIGN.md, *the step*):

    * the **CPU step rate**: ``(cpu_end[-1] − cpu_start[0]) / n``, the CPU's intervals
      ``cpu_end[k] − cpu_end[k−1]`` (the first from its own start: the ``ProfilerStep`` spans,
      with any gap between them);
    * the **completion interval**: a step completes (``done``, µs, non-decreasing) when its CPU
      span and the GPU work it launched are both done; over steps 2..n the rate is
      ``(done[-1] − done[0]) / (n − 1)``. The first step's completion interval starts at the
      previous step's completion, which lies before the window (``first``, the later of its CPU
      start and the warm-up backlog's end, stands for it only when the window holds one step):
      it counts at the rate of the others.

    Steady throughput is bounded by the slower of the two: over a short window the CPU may run
    ahead into the launch queue (its spans shorter than the GPU's intervals) or the GPU drain a
    backlog faster than the CPU refills it (the completions closer together than the CPU spans).
    Used by the analysis (:func:`fsdpdoctor.analysis.timeline.step_clock`) and by the what-if
    replay for its replayed steps, so that both count a step alike. Without GPU work (``done``
    None) the CPU's intervals are the steps' times."""
    cpu, comp = step_clocks_ms(cpu_start, cpu_end, done, first)
    return comp if comp.size and comp.mean() > cpu.mean() else cpu


def step_clocks_ms(
    cpu_start: np.ndarray, cpu_end: np.ndarray, done: np.ndarray | None, first: float
) -> tuple[np.ndarray, np.ndarray]:
    """(the CPU's step intervals, the completion intervals), ms, as :func:`step_times_ms` reads
    them; with one step, its completion interval runs from ``first``; none without GPU work."""
    n = cpu_start.size
    if n == 0:
        return np.zeros(0), np.zeros(0)
    c = np.maximum.accumulate(np.asarray(cpu_end, dtype=np.float64))
    cpu = np.diff(np.concatenate(([min(float(cpu_start[0]), float(c[0]))], c))) / 1e3
    if done is None:
        return cpu, np.zeros(0)
    if n == 1:
        return cpu, np.array([(float(done[0]) - min(first, float(done[0]))) / 1e3])
    rate = (float(done[-1]) - float(done[0])) / (n - 1) / 1e3
    return cpu, np.concatenate(([rate], np.diff(np.asarray(done, dtype=np.float64)) / 1e3))
