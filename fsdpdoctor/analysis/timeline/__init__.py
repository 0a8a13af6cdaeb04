"""The GPU timeline of one rank: compute, communication, their overlap, memcpy and idle time.

Definitions (DESIGN.md): comm = union of collective kernels; compute = union of all other
kernels (memcpy/memset excluded); overlap % = |comm ∩ compute| / |comm|; exposed comm =
|comm \\ compute|. GPU activity belongs to the step and phase in which the CPU launched it
(the runtime call with the same correlation id), as Holistic Trace Analysis assigns iterations.
Per step, compute + exposed comm + exposed memcpy + other steps + idle = the step's GPU window
exactly. *Idle* is window time in which the GPU runs nothing at all, of any step, counted up to
the start of the next step's GPU work; *other steps* is window time in which only other steps'
work runs (or that lies in the next step's window): when the GPU runs behind the CPU, a step's
window overlaps the next one's, and its gaps are not idle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdpdoctor.facts import StepFacts
from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.comms import (
    COMM_NAME_RX,
    LAUNCH_CATS,
    MEMORY_NAME_RX,
    NOT_COMPUTE_RX,
    SYNC_NAMES,
    Collective,
    comm_kernel_mask,
    launch_rows,
)
from fsdpdoctor.analysis.labels import phase_from_labels
from fsdpdoctor.analysis.rows import name_lut, name_rows
from fsdpdoctor.analysis.steps import PHASES, StepWindow, locate, microbatch_of, step_times_ms
from fsdpdoctor.analysis.timeline.split import ClockClasses

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class GpuClasses:
    rows: np.ndarray  # GPU activity rows
    comm: np.ndarray  # bool per row of ``rows``
    compute: np.ndarray
    memory: np.ndarray
    launch_ts: np.ndarray  # CPU time of the launch (own ts when no launch was found)
    # GPU work launched before the profiler's window opened (its launch call is not in the trace,
    # so Kineto wrote it without a correlated runtime event): the warm-up steps' backlog. All
    # False when the trace links no GPU work to a launch at all (then GPU times place the work).
    backlog: np.ndarray
    launch_row: np.ndarray | None = None  # the runtime call that launched each row (-1: none in the trace)


def launch_times(rt: RankTrace, rows: np.ndarray, with_found: bool = False):
    """CPU timestamp of the runtime call that launched each GPU row (by correlation id); the
    row's own timestamp where no launch is in the trace. With ``with_found``, also the launch
    rows (:func:`~fsdpdoctor.analysis.comms.launch_rows`, -1 where none was found)."""
    lr = launch_rows(rt, rows)
    found = lr >= 0
    out = rt.ts[rows].copy()
    out[found] = rt.ts[lr[found]]
    return (out, lr) if with_found else out


def classify_gpu(rt: RankTrace) -> GpuClasses:
    rows = np.flatnonzero(rt.mask_cat(*GPU_CATS))
    comm_all = comm_kernel_mask(rt)
    is_kernel = rt.mask_cat("kernel")
    row_names = rt.name[rows]
    mem_name = name_lut(rt, lambda n: MEMORY_NAME_RX.match(n) is not None)[row_names]
    not_compute = name_lut(rt, lambda n: NOT_COMPUTE_RX.match(n) is not None)[row_names]
    comm = comm_all[rows]
    memory = (mem_name | rt.mask_cat("gpu_memcpy", "gpu_memset")[rows]) & ~comm
    compute = is_kernel[rows] & ~comm & ~memory & ~not_compute
    lt, lr = launch_times(rt, rows, with_found=True)
    found = lr >= 0
    backlog = ~found if found.any() else np.zeros(rows.size, dtype=bool)
    return GpuClasses(rows, comm, compute, memory, lt, backlog, lr)


def hta_overlap(rt: RankTrace, steps: list[StepWindow] | None = None) -> tuple[float | None, float, float]:
    """Overlap % exactly as Holistic Trace Analysis's ``get_comm_comp_overlap`` computes it.

    Events: every GPU event with a stream (kernels, memcpy, memset; GPU annotations dropped);
    comm by HTA's name pattern (or collective args); compute = everything not matching HTA's
    non-compute pattern (so all-reduce kernels outside NCCL, ``multimem_all_reduce_kernel``, count
    as compute here, unlike in the step timeline). Window: HTA drops the last ProfilerStep (its GPU work is often cut off
    when the profiler stops) by keeping only GPU events launched before that step starts. We do
    the same when there are at least two steps, and use the whole trace otherwise.
    Returns (pct or None when there is no comm, comm ms, compute ms) over that window.
    """
    rows = np.flatnonzero((rt.stream >= 0) & ~rt.mask_cat("gpu_user_annotation", "cpu_op", "user_annotation"))
    if rows.size == 0:
        return None, 0.0, 0.0
    if steps is not None and len(steps) >= 2:
        # like HTA: keep GPU events whose launch is in the trace and precedes the last step
        last_start = max(st.start for st in steps)
        lt, lr = launch_times(rt, rows, with_found=True)
        rows = rows[(lr >= 0) & (lt < last_start)]
    row_names = rt.name[rows]
    comm_m = comm_kernel_mask(rt, hta=True)[rows] | name_lut(rt, lambda n: COMM_NAME_RX.match(n) is not None)[row_names]
    comp_m = ~name_lut(rt, lambda n: NOT_COMPUTE_RX.match(n) is not None)[row_names] & ~comm_m
    s, e = rt.ts[rows], rt.ts[rows] + rt.dur[rows]
    comm = iv.merge(s[comm_m], e[comm_m])
    comp = iv.merge(s[comp_m], e[comp_m])
    comm_t = iv.total(comm)
    if comm_t <= 0:
        return None, 0.0, iv.total(comp) / 1e3
    return 100.0 * iv.intersect_len(comm, comp) / comm_t, comm_t / 1e3, iv.total(comp) / 1e3


@dataclass
class Backlog:
    """GPU work of the warm-up steps still running when the profiler's window opened."""

    ops: int = 0
    gpu_ms: float = 0.0  # |union| of its GPU time
    end_us: float | None = None  # when the last of it finished


def step_timeline(rt: RankTrace, steps: list[StepWindow], colls: list[Collective]) -> list[StepFacts]:
    """Per-step GPU breakdown; also sets ``exposed_us``, ``step`` and ``phase`` on each collective."""
    return step_timeline_backlog(rt, steps, colls)[0]


@dataclass
class GpuSteps:
    """Every GPU activity of a rank, classified, with the step and phase that launched it."""

    g: GpuClasses
    step: np.ndarray  # index into the steps of each row of ``g.rows``; -1 outside every step (the backlog too)
    phase: np.ndarray  # index into PHASES


def gpu_steps(rt: RankTrace, steps: list[StepWindow]) -> GpuSteps:
    """:func:`classify_gpu` and the step / phase whose CPU span launched each activity."""
    g = classify_gpu(rt)
    step_idx, phase_idx = locate(steps, g.launch_ts)
    step_idx[g.backlog] = -1
    return GpuSteps(g, step_idx, phase_idx)


def step_timeline_backlog(
    rt: RankTrace, steps: list[StepWindow], colls: list[Collective], gs: GpuSteps | None = None
) -> tuple[list[StepFacts], Backlog]:
    """:func:`step_timeline` and the carried-over backlog. GPU work belongs to the step whose CPU
    span launched it; the backlog (work with no launch in the trace) belongs to no step.
    ``gs``: :func:`gpu_steps` of these steps, when the caller has it already."""
    gs = gs if gs is not None else gpu_steps(rt, steps)
    g, step_idx, phase_idx = gs.g, gs.step, gs.phase
    # collectives: step from their CPU issue time; phase from the FSDP hook that issued them,
    # else from the time window it was issued in
    c_ts = np.array([c.cpu_ts for c in colls], dtype=np.float64)
    c_step, c_phase = locate(steps, c_ts)
    if g.backlog.any():  # a collective known only by its backlog kernels belongs to no step
        backlog_rows = set(g.rows[g.backlog].tolist())
        for ci, c in enumerate(colls):
            if c.cpu_row < 0 and c.kernel_rows and all(int(k) in backlog_rows for k in c.kernel_rows):
                c_step[ci] = -1
    c_mb = microbatch_of(steps, c_step, c_ts)
    for c, k, p, mb in zip(colls, c_step, c_phase, c_mb):
        c.step, c.microbatch = int(k), int(mb)
        c.phase = PHASES[int(p)]
        by_label = phase_from_labels(c.labels)
        if by_label is not None and c.step >= 0:
            c.phase = by_label
    kernel_to_coll = {k: ci for ci, c in enumerate(colls) for k in c.kernel_rows}
    s_all = rt.ts[g.rows]
    e_all = s_all + rt.dur[g.rows]
    classified = g.comm | g.compute | g.memory
    busy_all = iv.merge(s_all[classified], e_all[classified])  # the GPU running anything, of any step
    blocked = blocking_calls(rt)  # the CPU waiting for the GPU
    out: list[StepFacts] = []
    own_parts: dict[int, tuple] = {}  # step → its compute, exposed comm, exposed memcpy intervals
    host_bound_iv: dict[int, tuple | None] = {}  # step → its host-bound idle intervals (None: none)
    # rows of each step in one stable sort instead of one full-length comparison per step
    by_step = np.argsort(step_idx, kind="stable")
    bounds = np.searchsorted(step_idx[by_step], np.arange(len(steps) + 1), side="left")
    starts = [
        float(s_all[by_step[bounds[k] : bounds[k + 1]]].min()) if bounds[k + 1] > bounds[k] else None
        for k in range(len(steps))
    ]
    seen = iv.Growing()  # the GPU busy with the earlier steps' own work
    for k, st in enumerate(steps):
        in_step = by_step[bounds[k] : bounds[k + 1]]
        sf = StepFacts(number=st.number, start_us=st.start, step_ms=st.dur / 1e3, cpu_span_ms=st.dur / 1e3)
        sf.phase_ms = {name: us / 1e3 for name, us in st.phase_us().items()}
        sf.cpu_outside_phases_ms = outside_phases_us(st) / 1e3
        sf.microbatches = st.n_microbatches
        sf.microbatch_phase_ms = [{name: (b - a) / 1e3 for name, (a, b) in mb.items()} for mb in st.microbatches]
        if in_step.size:
            s, e = s_all[in_step], e_all[in_step]
            cm, cp, mm = g.comm[in_step], g.compute[in_step], g.memory[in_step]
            comp = iv.merge(s[cp], e[cp])
            comm = iv.merge(s[cm], e[cm])
            mem = iv.merge(s[mm], e[mm])
            busy_cc = iv.union(comp, comm)
            window = float(e.max() - s.min())
            exposed = iv.subtract(comm, comp)
            sf.gpu_window_ms = window / 1e3
            sf.compute_ms = iv.total(comp) / 1e3
            sf.comm_ms = iv.total(comm) / 1e3
            sf.exposed_comm_ms = iv.total(exposed) / 1e3
            sf.overlap_ms = sf.comm_ms - sf.exposed_comm_ms
            sf.memcpy_ms = (iv.total(mem) - iv.intersect_len(mem, busy_cc)) / 1e3
            w0 = float(s.min())
            sf.gpu_start_us = w0
            nxt = next((x for x in starts[k + 1 :] if x is not None), None)
            w1 = float(e.max()) if nxt is None else min(float(e.max()), max(nxt, w0))
            own = window / 1e3 - sf.compute_ms - sf.exposed_comm_ms - sf.memcpy_ms
            span = iv.merge(np.array([w0]), np.array([w1]))
            busy_here = iv.window(busy_all, w0, w1)  # the GPU running anything, inside [w0, w1]
            sf.idle_ms = min(max((w1 - w0 - iv.total(busy_here)) / 1e3, 0.0), max(own, 0.0))
            host_bound = None  # the window's gaps outside blocking CPU calls (host-bound idle)
            if sf.idle_ms > 0:
                idle_iv = iv.subtract(span, busy_here)
                host_bound = idle_iv
                if blocked[0].size:
                    in_sync = iv.window(blocked, w0, w1)
                    sf.idle_cpu_blocked_ms = min(iv.intersect_len(idle_iv, in_sync) / 1e3, sf.idle_ms)
                    host_bound = iv.subtract(idle_iv, in_sync)
            host_bound_iv[k] = host_bound
            sf.other_steps_ms = max(own - sf.idle_ms, 0.0)
            own_parts[k] = (comp, exposed, iv.subtract(mem, busy_cc))
            # the GPU busy with this step's work, each instant counted once: time the step's own work
            # shares with an earlier step's (its comm beside their compute) is the earlier step's, so
            # the steps' busy times add up to the GPU's and never exceed the steps' time
            own_busy = iv.union(busy_cc, mem)
            sf.gpu_busy_ms = (iv.total(own_busy) - seen.intersect_len(own_busy)) / 1e3
            seen.add(own_busy)
            ph = phase_idx[in_step]
            for k_ph, name in enumerate(PHASES):
                sel = cp & (ph == k_ph)
                if sel.any():
                    sf.compute_by_phase[name] = iv.total(iv.merge(s[sel], e[sel])) / 1e3
            # share exposed time among the collectives whose kernels cover it
            comm_rows = g.rows[in_step][cm]
            labels = np.array([kernel_to_coll.get(int(r), -1) for r in comm_rows], dtype=object)
            parts = iv.attribute(exposed, s[cm], e[cm], labels)
            for ci, us in parts.items():
                if ci is not None and ci >= 0:
                    colls[ci].exposed_us += us
            by_phase: dict[str, float] = {}
            by_kind: dict[str, float] = {}
            by_role: dict[str, float] = {}
            for ci, us in parts.items():
                if ci is None or ci < 0:
                    phase, kind, role = PHASES[int(np.bincount(phase_idx[in_step][cm]).argmax())], "other", "other"
                else:
                    phase, kind, role = colls[ci].phase, colls[ci].kind, colls[ci].role
                by_phase[phase] = by_phase.get(phase, 0.0) + us / 1e3
                by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3
                by_role[role] = by_role.get(role, 0.0) + us / 1e3
            sf.exposed_by_phase = by_phase
            sf.exposed_by_kind = by_kind
            sf.exposed_by_role = by_role
        out.append(sf)
    bl = Backlog()
    if g.backlog.any():
        b = g.backlog & classified
        bl.ops = int(b.sum())
        if bl.ops:
            bl.gpu_ms = iv.total(iv.merge(s_all[b], e_all[b])) / 1e3
            bl.end_us = float(e_all[b].max())
    step_clock(out, steps, bl.end_us)
    comm_labels = {}  # each collective kernel (index into g.rows) → (kind, phase) of its collective
    for i in np.flatnonzero(g.comm).tolist():
        ci = kernel_to_coll.get(int(g.rows[i]), -1)
        if ci >= 0:
            comm_labels[i] = (colls[ci].kind, colls[ci].phase)
        else:
            comm_labels[i] = ("other", PHASES[int(phase_idx[i])] if step_idx[i] >= 0 else "other")
    classes = ClockClasses(s_all, e_all, g.compute, g.memory, comm_labels)
    clock_parts(out, own_parts, busy_all, host_bound_iv, classes)
    return out, bl


def outside_phases_us(st: StepWindow) -> float:
    """The step's CPU span less the union of its phases' (and micro-batches') intervals in it."""
    ivs = list(st.phases.values()) + [x for mb in st.microbatches for x in mb.values()]
    if not ivs:
        return float(st.dur)
    s = np.array([a for a, _ in ivs], dtype=np.float64)
    e = np.array([b for _, b in ivs], dtype=np.float64)
    inside = iv.intersect_len(iv.merge(s, e), iv.merge(np.array([float(st.start)]), np.array([float(st.end)])))
    return max(float(st.dur) - inside, 0.0)


def clock_parts(
    out: list[StepFacts], own_parts: dict[int, tuple], busy_all, host_bound_iv=None, classes: ClockClasses | None = None
) -> None:
    """Each step's time split on the step clock (``StepFacts.clock_parts_ms``): in the interval of
    length ``step_ms`` ending at its completion, its own compute, exposed comm and exposed
    memcpy, the other steps' GPU work and idle; they add up to the step time. The GPU window
    (first to last activity the step launched) runs over into later steps' intervals when the
    GPU runs behind the CPU; this split does not. Also the clock's idle outside the step's
    host-bound idle intervals (``host_bound_iv``, step → intervals): ``idle_not_host_bound_ms``,
    and with ``classes`` the interval split instant by instant (``clock_split_ms``,
    :mod:`fsdpdoctor.analysis.timeline.split`)."""
    for k, sf in enumerate(out):
        if sf.end_us is None:
            continue
        hi = sf.end_us
        lo = hi - sf.step_ms * 1e3
        idle_clk = iv.subtract(iv.merge(np.array([lo]), np.array([hi])), iv.window(busy_all, lo, hi))
        hb = (host_bound_iv or {}).get(k)
        hb_us = iv.intersect_len(idle_clk, hb) if hb is not None else 0.0
        not_hb = iv.total(idle_clk) - hb_us
        sf.idle_not_host_bound_ms = max(not_hb, 0.0) / 1e3
        if classes is not None:
            split = classes.busy(lo, hi) | {"host_bound_idle": hb_us, "other_idle": not_hb}
            sf.clock_split_ms = {p: v / 1e3 for p, v in split.items()}
        if k not in own_parts:
            continue
        comp, exposed, mem = (iv.window(x, lo, hi) for x in own_parts[k])
        parts = {"compute": iv.total(comp), "exposed_comm": iv.total(exposed), "memcpy": iv.total(mem)}
        busy = iv.total(iv.window(busy_all, lo, hi))
        parts["other_steps"] = max(busy - sum(parts.values()), 0.0)
        parts["idle"] = max(hi - lo - busy, 0.0)
        sf.clock_parts_ms = {p: v / 1e3 for p, v in parts.items()}


def blocking_calls(rt: RankTrace):
    """Merged CPU intervals inside calls that block until GPU work is done (synchronizations,
    synchronous or pageable copies)."""
    rows = name_rows(rt, lambda n: n in SYNC_NAMES, *LAUNCH_CATS)
    return iv.merge(rt.ts[rows].astype(np.float64), (rt.ts[rows] + rt.dur[rows]).astype(np.float64))


def step_clock(out: list[StepFacts], steps: list[StepWindow], backlog_end_us: float | None) -> None:
    """Each step's time (:func:`fsdpdoctor.analysis.steps.step_times_ms`): the interval of the
    slower side, the CPU's step spans or the steps' completions, a step completing when both its
    CPU span and the GPU work it launched are done; their mean is the steady step time over the
    window. ``end_us`` is the step's completion."""
    if not out:
        return
    first = steps[0].start if backlog_end_us is None else max(steps[0].start, backlog_end_us)
    done = []
    for sf, st in zip(out, steps):
        d = st.end
        if sf.gpu_start_us is not None:
            d = max(d, sf.gpu_start_us + sf.gpu_window_ms * 1e3)
        if done:
            d = max(d, done[-1])
        done.append(d)
    gpu = any(sf.gpu_start_us is not None for sf in out)
    times = step_times_ms(
        np.array([st.start for st in steps]), np.array([st.end for st in steps]), np.array(done) if gpu else None, first
    )
    for sf, d, t in zip(out, done, times.tolist()):
        sf.end_us = d
        sf.step_ms = t
        sf.outside_window_ms = max(sf.step_ms - sf.gpu_window_ms, 0.0) if sf.gpu_start_us is not None else 0.0
