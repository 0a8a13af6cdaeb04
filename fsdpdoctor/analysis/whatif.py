"""What-if replay of one rank's measured timeline (in the spirit of Daydream, Zhu et al., ATC 2020).

From the trace we build the dependency graph of the profiled steps and replay it:

* nodes: every GPU activity (kernel, memcpy, memset) with its measured duration;
* each node starts no earlier than its CPU launch (the runtime/driver call with the same
  correlation id), after the previous node on its stream, after the previous collective of its
  communicator (process group, in issue order: NCCL serialises them), and after the nodes it
  waits on across streams: for every ``cudaStreamWaitEvent`` the next GPU activity the thread
  launches waits on the latest-finishing activity of another stream launched before the wait
  (the trace records that a wait was issued, not on which event; FSDP's waits are
  ``wait_stream`` calls on the last work of the other stream, see
  ``notes/fsdp-trace-signatures.md``);
* the CPU timeline keeps its measured gaps; a blocking call (``cuda*Synchronize``, a pageable
  ``cudaMemcpyAsync``) ends when the GPU activity it waited for ends, and every later CPU event
  moves with it.

Each constraint keeps its measured slack up to a small cap (launch latency, back-to-back gap),
so the unchanged replay reproduces the measured step only as well as the graph explains the
waits: its error is the model's error bar, reported next to every saving.

A transformation edits the graph (move, drop or scale nodes, cut CPU time) and the replay gives
the step time with the fix. Only per-transformation step times and small evidence leave this
module (:class:`fsdpdoctor.facts.WhatIfFacts`), never the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..facts import ComputeFacts, FsdpFacts, WhatIfFacts
from ..ingest.kineto import RankTrace
from . import intervals as iv
from .columns import Columns
from .comms import SYNC_NAMES, Collective, comm_kernel_mask, launch_rows
from .layers import RepeatedBlocks, repeated_blocks
from .steps import PHASES, StepWindow, locate, step_clocks_ms

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CAP_LAUNCH_US = 30.0  # launch call start -> kernel start when the GPU is free
CAP_DEP_US = 5.0  # previous work on the stream / awaited work -> start
CAP_SYNC_US = 20.0  # awaited GPU work end -> blocking call returns
MIN_SYNC_US = 2.0  # shortest blocking call
WAIT_NAMES = ("cudaStreamWaitEvent", "hipStreamWaitEvent")
# kernel launches: one that takes this long waited for room in the launch queue (the GPU runs
# behind and the queue is full) and is replayed as a blocking call on the GPU work that freed it
LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "hipLaunchKernel", "hipExtModuleLaunchKernel", "hipModuleLaunchKernel", "hipGraphLaunch")
LAUNCH_BLOCKED_US = 50.0
RATE_LIMITER = "FullyShardedDataParallel.rate_limiter"


@dataclass
class Graph:
    start: np.ndarray  # measured µs
    end: np.ndarray
    stream: np.ndarray
    launch: np.ndarray  # CPU µs of the launch call start (nan: none in the trace)
    key: np.ndarray  # CPU position in the replay order (launch, else measured start)
    backlog: np.ndarray  # bool: launched before the window (no launch in a trace that links launches)
    comm: np.ndarray  # bool: collective kernel
    coll: np.ndarray  # index into the collectives, -1
    pg: np.ndarray  # communicator id, -1
    is_compute: np.ndarray
    step: np.ndarray  # step index of the launch, -1
    g_launch: np.ndarray
    g_stream: np.ndarray
    g_comm: np.ndarray
    deps: dict[int, list[tuple[int, float]]]  # op -> [(awaited op, gap)]
    syncs: list[tuple[float, float, int, float, int]]  # (ts, end, awaited op or -1, end − its end, row)
    steps: list[StepWindow]
    colls: list[Collective]
    names: list[str]  # per op
    phase: np.ndarray  # per op: the phase its launch fell in ("forward", ...)
    ranges: dict[str, list[tuple[float, float]]]  # CPU ranges the fixes need (optimizer, rate limiter)
    device_syncs: set[int]  # rows of cudaDeviceSynchronize calls
    n_wait_edges: int = 0
    n_inferred: int = 0
    # per op: the measured wait past every constraint the trace explains (≥ UNEXPLAINED_US, else
    # 0): a dependency the trace does not show, kept as measured after the explained ones
    g_wait: np.ndarray | None = None
    name_code: np.ndarray | None = None  # per op: index into ``code_names`` (name tests once per distinct name)
    code_names: list[str] | None = None
    rows: np.ndarray | None = None  # per op: its row in the trace


@dataclass
class Fix:
    """One transformation: what to change before the replay."""

    name: str
    move: dict[int, float] = field(default_factory=dict)  # op -> new CPU key (launch moves with it)
    scale: dict[int, float] = field(default_factory=dict)  # op -> duration factor (0: dropped)
    drop_deps: set[int] = field(default_factory=set)  # ops whose cross-stream waits are re-derived
    cpu_cuts: list[tuple[float, float]] = field(default_factory=list)  # measured CPU time removed
    free_syncs: set[int] = field(default_factory=set)  # blocking calls that no longer block (rows)
    cpu_adds: list[tuple[float, float]] = field(default_factory=list)  # (CPU key, µs) inserted there
    note: str = ""  # how the transformation was built, for the finding's evidence


def build_graph(rt: RankTrace, steps: list[StepWindow], colls: list[Collective]) -> Graph | None:
    rows = np.flatnonzero(rt.mask_cat(*GPU_CATS))
    if rows.size == 0 or not steps:
        return None
    rows = rows[np.argsort(rt.ts[rows], kind="stable")]
    start = rt.ts[rows].astype(np.float64)
    end = start + rt.dur[rows]
    stream = rt.stream[rows].astype(np.int64)
    lr = launch_rows(rt, rows)
    has = lr >= 0
    launch = np.full(rows.size, np.nan)
    launch[has] = rt.ts[lr[has]]
    key = np.where(has, launch, start)
    backlog = ~has if has.any() else np.zeros(rows.size, dtype=bool)
    comm = comm_kernel_mask(rt)[rows]
    pos = np.full(len(rt.ts), -1, dtype=np.int64)  # trace row -> op
    pos[rows] = np.arange(rows.size)
    coll = np.full(rows.size, -1, dtype=np.int64)
    pg = np.full(rows.size, -1, dtype=np.int64)
    pg_ids: dict[str, int] = {}
    for ci, c in enumerate(colls):
        g = pg_ids.setdefault(c.pg_name or "", len(pg_ids))
        ks = pos[np.asarray(c.kernel_rows, dtype=np.int64)] if c.kernel_rows else np.zeros(0, dtype=np.int64)
        ks = ks[ks >= 0]
        coll[ks] = ci
        pg[ks] = g
    kernel = rt.mask_cat("kernel")[rows]
    is_compute = kernel & ~comm
    st_starts = np.array([s.start for s in steps])
    st_ends = np.array([s.end for s in steps])
    k = np.searchsorted(st_starts, key, side="right") - 1
    kc = np.maximum(k, 0)
    step = np.where((k >= 0) & (key < st_ends[kc]) & ~backlog, k, -1)

    # measured slack of each constraint, capped
    # (never negative: two ops never overlap on one stream or communicator in the replay)
    g_launch = np.clip(start - key, 0.0, CAP_LAUNCH_US)
    g_launch[~has] = 0.0
    order = replay_order(key, backlog)
    prev_s = _prev_in_group(order, stream)
    prev_p = _prev_in_group(order, pg, skip_negative=True)
    g_stream = _prev_gaps(prev_s, start, end)
    g_comm = _prev_gaps(prev_p, start, end)

    deps, n_wait = _wait_edges(rt, steps, start, end, stream, key, has, lr)
    syncs = _sync_calls(rt, start, end, key, rows, lr, has)
    n_deps = sum(len(v) for v in deps.values())
    g_wait = _unexplained_waits(start, end, key, stream, backlog, g_launch, prev_s, g_stream, prev_p, g_comm, deps)
    n_inferred = sum(len(v) for v in deps.values()) - n_deps
    names = [rt.names[c] for c in rt.name[rows]]
    _, ph = locate(steps, key)
    phase = np.array(PHASES, dtype=object)[ph]
    cpu = rt.mask_cat("cpu_op", "user_annotation")
    ranges = {}
    for label, pred in (("optimizer", lambda n: n.startswith("Optimizer.step#")), ("rate_limiter", lambda n: n == RATE_LIMITER),
                        ("hooks", _is_hook)):
        r = np.flatnonzero(cpu & rt.mask_names(pred))
        ranges[label] = [(float(rt.ts[i]), float(rt.ts[i] + rt.dur[i])) for i in r]
    ranges["hooks"] = _outermost(ranges["hooks"])
    return Graph(start, end, stream, launch, key, backlog, comm, coll, pg, is_compute, step, g_launch, g_stream, g_comm,
                 deps, syncs, steps, colls, names, phase, ranges,
                 {row for *_, row in syncs if rt.row_name(row).endswith("DeviceSynchronize")}, n_wait, n_inferred, g_wait,
                 rt.name[rows].astype(np.int64), rt.names, rows)


def replay_order(key: np.ndarray, backlog: np.ndarray) -> np.ndarray:
    """The one order ops are replayed in: the backlog first (in GPU start order, its key), then
    every launched op in CPU launch order."""
    return np.lexsort((key, ~backlog))


def _prev_in_group(order: np.ndarray, group: np.ndarray, skip_negative: bool = False) -> np.ndarray:
    """Per op, the previous op of its group (stream or communicator) in replay order, -1."""
    out = np.full(order.size, -1, dtype=np.int64)
    g = group[order]
    by = np.argsort(g, kind="stable")  # within a group, replay order is kept
    ops = order[by]
    same = np.zeros(ops.size, dtype=bool)
    same[1:] = g[by][1:] == g[by][:-1]
    if skip_negative:
        same &= g[by] >= 0
    out[ops[1:][same[1:]]] = ops[:-1][same[1:]]
    return out


def _prev_gaps(prev: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per op, the measured gap after ``prev`` (its predecessor), floored at 0 and capped at
    CAP_DEP_US (CAP_DEP_US for the first of a group)."""
    out = np.full(prev.size, CAP_DEP_US)
    m = prev >= 0
    out[m] = np.clip(start[m] - end[prev[m]], 0.0, CAP_DEP_US)
    return out


UNEXPLAINED_US = 50.0  # an op that starts this much later than the trace explains waited on something unseen


INFER_TOL_US = 10.0  # ... and started within this of the end of work on another stream: it waited for that


def _unexplained_waits(start, end, key, stream, backlog, g_launch, prev_s, g_stream, prev_p, g_comm, deps) -> np.ndarray:
    """Per op, how much later it started than its launch, its stream, its communicator and its
    cross-stream waits allow (with their capped gaps), where that is ≥ UNEXPLAINED_US; an op that
    started within INFER_TOL_US of the end of earlier-launched work on another stream gets an
    edge to it in ``deps`` instead (its wait is then explained)."""
    # the backlog: the first op of it on a stream is where it was measured, the rest queued behind
    c = np.where(backlog, np.where(prev_s < 0, start, -np.inf), key + g_launch)
    m = prev_s >= 0
    c[m] = np.maximum(c[m], end[prev_s[m]] + g_stream[m])
    m = prev_p >= 0
    c[m] = np.maximum(c[m], end[prev_p[m]] + g_comm[m])
    for i, dl in deps.items():
        for a, gap in dl:
            c[i] = max(c[i], end[a] + gap)
    w = start - c
    w[(w < UNEXPLAINED_US) | ~np.isfinite(w)] = 0.0
    # an op that started right when work on another stream ended waited for it (an event the
    # trace does not record): a dependency edge, not a fixed wait
    late = np.flatnonzero(w > 0)
    if late.size:
        by_end = np.argsort(end, kind="stable")
        ends = end[by_end]
        los = np.searchsorted(ends, start[late] - INFER_TOL_US, side="left")
        his = np.searchsorted(ends, start[late] + 1e-3, side="right")
        for i, lo, hi in zip(late.tolist(), los.tolist(), his.tolist()):
            cand = by_end[lo:hi]
            cand = cand[(stream[cand] != stream[i]) & (key[cand] <= key[i])]
            if cand.size:
                j = int(cand[np.argmax(end[cand])])
                deps.setdefault(i, []).append((j, float(max(start[i] - end[j], 0.0))))
                w[i] = 0.0
    return w


def _is_hook(name: str) -> bool:
    """FSDP's own CPU work: FSDP2 ``FSDP::*`` ranges, FSDP1 ``FullyShardedDataParallel._*`` hooks
    (not ``FullyShardedDataParallel.forward``, which holds the module's forward)."""
    return name.startswith(("FSDP::", "FullyShardedDataParallel._")) and name != RATE_LIMITER


def _outermost(ranges: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(ranges):
        if out and a < out[-1][1]:
            continue
        out.append((a, b))
    return out


def _wait_edges(rt, steps, start, end, stream, key, has, lr):
    """Cross-stream edges from the ``cudaStreamWaitEvent`` calls (see the module docstring)."""
    deps: dict[int, list[tuple[int, float]]] = {}
    waits = np.flatnonzero(rt.mask_cat("cuda_runtime", "cuda_driver") & rt.mask_names(lambda n: n in WAIT_NAMES))
    if waits.size == 0:
        return deps, 0
    launched = np.flatnonzero(has)
    lthread = rt.thread[lr[launched]]
    order = np.argsort(key[launched], kind="stable")
    launched, lthread = launched[order], lthread[order]
    lkey = key[launched]
    st_starts = np.array([s.start for s in steps])
    t = rt.ts[waits].astype(np.float64)
    # the waiting stream is that of the next GPU work launched, by this thread or, where the
    # thread hands over (end of backward), by the next one
    j = np.searchsorted(lkey, t, side="right")
    ok = j < launched.size
    t, th, j = t[ok], rt.thread[waits][ok], j[ok]
    y = launched[j]
    for code in np.unique(th):
        ops = launched[lthread == code]
        if not ops.size:
            continue
        m = th == code
        jj = np.searchsorted(key[ops], t[m], side="right")
        inside = jj < ops.size
        cand = ops[np.minimum(jj, ops.size - 1)]
        same_step = np.searchsorted(st_starts, key[cand], side="right") == np.searchsorted(st_starts, t[m], side="right")
        y[m] = np.where(inside & same_step, cand, y[m])
    # the awaited op: the latest-ending op of another stream launched last before the wait
    best = np.full(y.size, -1, dtype=np.int64)
    best_end = np.full(y.size, -np.inf)
    for sid in np.unique(stream[launched]):
        ix = launched[stream[launched] == sid]
        p = np.searchsorted(key[ix], t, side="left") - 1
        x = ix[np.maximum(p, 0)]
        take = (p >= 0) & (stream[y] != sid) & (end[x] <= start[y] + 1e-3) & (end[x] > best_end)
        best = np.where(take, x, best)
        best_end = np.where(take, end[x], best_end)
    hit = best >= 0
    gaps = np.minimum(start[y[hit]] - end[best[hit]], CAP_DEP_US)
    for yi, bi, gi in zip(y[hit].tolist(), best[hit].tolist(), gaps.tolist()):
        deps.setdefault(yi, []).append((bi, gi))
    return deps, int(hit.sum())


def _sync_calls(rt, start, end, key, rows, lr, has):
    """Blocking CPU calls: (ts, end, awaited op, gap, row); awaited -1 when it did not block."""
    runtime = rt.mask_cat("cuda_runtime", "cuda_driver")
    calls = np.flatnonzero(runtime & (rt.mask_names(lambda n: n in SYNC_NAMES)
                                      | (rt.mask_names(lambda n: n in LAUNCH_NAMES) & (rt.dur > LAUNCH_BLOCKED_US))))
    if calls.size == 0:
        return []
    ts = rt.ts[calls].astype(np.float64)
    te = ts + rt.dur[calls]
    a = np.full(calls.size, -1, dtype=np.int64)
    lops = np.flatnonzero(has)
    # synchronous / pageable copies return when their own copy is done
    copy = rt.mask_names(lambda n: n.startswith(("cudaMemcpy", "hipMemcpy")))[calls]
    if copy.any() and lops.size:
        corr = rt.correlation[lr[lops]]
        srt = np.argsort(corr, kind="stable")
        corr, by_corr = corr[srt], lops[srt]
        cc = rt.correlation[calls[copy]]
        k = np.minimum(np.searchsorted(corr, cc), corr.size - 1)
        i = by_corr[k]
        own = (corr[k] == cc) & (ts[copy] < end[i]) & (end[i] <= te[copy] + 1e-3)
        a[np.flatnonzero(copy)[own]] = i[own]
    # a device synchronization waits for everything launched before it
    device = rt.mask_names(lambda n: n.endswith("DeviceSynchronize"))[calls]
    if device.any() and lops.size:
        lorder = lops[np.argsort(key[lops], kind="stable")]
        lend = end[lorder]
        run_max = np.maximum.accumulate(lend)
        is_new = np.concatenate(([True], lend[1:] > run_max[:-1]))
        arg_run = np.maximum.accumulate(np.where(is_new, np.arange(lend.size), 0))
        lo = np.searchsorted(key[lorder], ts[device], side="left")
        a[np.flatnonzero(device)[lo > 0]] = lorder[arg_run[lo[lo > 0] - 1]]
    # the rest (stream / event synchronizations, launches that waited for the queue): the
    # latest-ending GPU work launched before the call that ended while it blocked
    rest = np.flatnonzero(~copy & ~device)
    if rest.size and lops.size:
        by_end = lops[np.argsort(end[lops], kind="stable")]
        ends = end[by_end]
        los = np.searchsorted(ends, ts[rest], side="right")
        his = np.searchsorted(ends, te[rest] + 1e-3, side="right")
        for r, lo, hi in zip(rest.tolist(), los.tolist(), his.tolist()):
            for q in range(hi - 1, lo - 1, -1):  # by end, latest first: the first launched before the call
                if key[by_end[q]] < ts[r]:
                    a[r] = by_end[q]
                    break
    gap = np.where(a >= 0, te - end[np.maximum(a, 0)], 0.0)
    return list(zip(ts.tolist(), te.tolist(), a.tolist(), gap.tolist(), calls.tolist()))


def measured_step_ms(g: Graph) -> np.ndarray:
    """Each step's measured time as the analysis counts it (``StepFacts.step_ms``,
    :func:`fsdpdoctor.analysis.steps.step_times_ms`)."""
    return _slower(_step_clocks(g, _marks(g), g.end))


def measured_clocks_ms(g: Graph) -> np.ndarray:
    """The measured steps' two clocks (rows: the CPU's intervals, the completion intervals)."""
    return _step_clocks(g, _marks(g), g.end)


def _marks(g: Graph) -> np.ndarray:
    return np.array([x for st in g.steps for x in (st.start, st.end)], dtype=np.float64)


def _slower(clocks: np.ndarray) -> np.ndarray:
    """The per-step times of the slower clock (:func:`fsdpdoctor.analysis.steps.step_times_ms`)."""
    cpu, comp = clocks
    return comp if comp.size and comp.mean() > cpu.mean() else cpu


def _step_clocks(g: Graph, marks: np.ndarray, E: np.ndarray) -> np.ndarray:
    """Both step clocks (ms; rows: CPU intervals, completion intervals) from the steps' CPU
    (start, end) marks and the ops' end times (µs), as
    :func:`fsdpdoctor.analysis.steps.step_clocks_ms` reads them."""
    ns = len(g.steps)
    n = g.step.size
    gpu_end = np.full(ns, -np.inf)
    own = g.step[:n] >= 0
    np.maximum.at(gpu_end, g.step[:n][own], E[:n][own])
    done = np.maximum.accumulate(np.maximum(marks[1::2], gpu_end))
    first = marks[0]
    bl = g.backlog[:n]
    if bl.any():
        first = max(first, float(E[:n][bl].max()))
    return np.vstack(step_clocks_ms(marks[0::2], marks[1::2], done, first))


def replay(g: Graph, fix: Fix | None = None, replays: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Replayed (start, end) of every op, the step times (ms) of ``g.steps`` and both step clocks
    they come from (rows: CPU intervals, completion intervals; see :func:`_step_clocks`).

    The arrays are prepared here with numpy; the event loop, a list schedule that does not
    vectorize (each start depends on ends just computed), runs compiled once the work is worth
    numba's start-up (:func:`_use_compiled`; ``replays``: how many replays of this graph the
    caller has still to make, this one included)."""
    fix = fix or Fix("none")
    n = g.start.size
    key = g.key.copy()
    if fix.move:
        mv = np.fromiter(fix.move.keys(), dtype=np.int64, count=len(fix.move))
        key[mv] = np.fromiter(fix.move.values(), dtype=np.float64, count=len(fix.move))
    dur = g.end - g.start
    if fix.scale:
        sc = np.fromiter(fix.scale.keys(), dtype=np.int64, count=len(fix.scale))
        f = np.ones(n)
        f[sc] = np.fromiter(fix.scale.values(), dtype=np.float64, count=len(fix.scale))
        if g.backlog.any() and g.name_code is not None:
            # the backlog is earlier steps' work: the same kernels, changed as the fix changes
            # theirs (the mean factor of the launched ops of the same name; unchanged if none)
            launched = ~g.backlog
            codes = g.name_code[:n]
            tot = np.bincount(codes[launched], weights=f[launched], minlength=codes.max() + 1)
            cnt = np.bincount(codes[launched], minlength=codes.max() + 1)
            mean_f = np.where(cnt > 0, tot / np.maximum(cnt, 1), 1.0)
            bl = np.flatnonzero(g.backlog)
            f[bl] = np.where(np.isin(bl, sc), f[bl], mean_f[codes[bl]])
        dur *= f
    sy = _sync_arrays(g)
    ns = len(g.steps)
    # a cut (a, b) removes b − a at b; an insertion of d at t is the cut (t + d, t)
    cuts = np.array(fix.cpu_cuts + [(t + d, t) for t, d in fix.cpu_adds], dtype=np.float64).reshape(-1, 2)
    # the CPU-side event list: ops, blocking calls, step boundaries, cuts; one order: the backlog
    # first (launched before the window), then everything by CPU time
    kinds_a = np.concatenate((np.zeros(n, np.int8), np.ones(sy["ts"].size, np.int8), np.full(2 * ns, 2, np.int8),
                              np.full(cuts.shape[0], 3, np.int8)))
    keys_a = np.concatenate((key, sy["ts"], np.array([x for st in g.steps for x in (st.start, st.end)], dtype=np.float64),
                             cuts[:, 1]))
    idx_a = np.concatenate((np.arange(n), np.arange(sy["ts"].size), np.arange(2 * ns), np.arange(cuts.shape[0])))
    first = np.zeros(kinds_a.size, dtype=bool)
    first[:n] = g.backlog
    order = np.lexsort((kinds_a, keys_a, ~first))
    g_wait = g.g_wait.copy() if g.g_wait is not None else np.zeros(n)
    moved = [*fix.move, *fix.drop_deps]
    if moved:  # a moved op's unseen wait is not carried along
        g_wait[np.array(moved, dtype=np.int64)] = 0.0
    dep_ptr, dep_op, dep_gap = _deps_csr(g, fix.drop_deps)
    free = np.isin(sy["row"], np.fromiter(fix.free_syncs, dtype=np.int64, count=len(fix.free_syncs))) \
        if fix.free_syncs else np.zeros(sy["row"].size, dtype=bool)
    _, stream_ix = np.unique(g.stream, return_inverse=True)
    args = (kinds_a[order], idx_a[order], keys_a[order], g.start, key, dur, g.backlog, g.g_launch, g.g_stream, g.g_comm, g_wait,
            stream_ix.astype(np.int64), int(stream_ix.max()) + 1 if n else 1, g.pg, int(g.pg.max()) + 1 if n else 0,
            dep_ptr, dep_op, dep_gap, sy["ts"], sy["te"], sy["a"], sy["res"], free, sy["device"], g.end,
            cuts[:, 1] - cuts[:, 0], 2 * ns, MIN_SYNC_US, CAP_SYNC_US)
    if _use_compiled(kinds_a.size, replays):
        S, E, marks = _compiled_loop()(*args)
    else:  # little work so far: the same loop in Python over lists costs less than loading numba
        S, E, marks = _replay_loop(*[a.tolist() if isinstance(a, np.ndarray) else a for a in args])
    clocks = _step_clocks(g, np.asarray(marks, dtype=np.float64), np.asarray(E, dtype=np.float64))
    return S, E, _slower(clocks), clocks


#: loop events (ops, blocking calls, step marks) replayed in a process, those due for this rank
#: included, from which the loop runs compiled. Importing numba and loading its cached machine
#: code costs ~0.35-0.45 s and ~45 MB (2-core Xeon; ~0.9 s on a slower machine; 2-3 s more on
#: the first run after installing), the loop in Python ~1 µs an event. Measured on traces scaled
#: up to 310 MB: the H100 FSDP2 recording, 4 replays of ~137k events, 0.38 s compiled against
#: 0.58 s in Python; the public A100 all-reduce trace, 2 replays of 148k, 0.35 s compiled
#: against 0.30 s in Python, the process peaking 50 MB lower.
JIT_MIN_WORK = 400_000
_COMPILED = None
_python_work = 0  # loop events this process has replayed in Python


def _use_compiled(events: int, replays: int) -> bool:
    """Whether to run a replay of ``events`` loop events compiled, ``replays`` replays of this
    graph being due (this one included). Once numba is loaded, always; before, only when what
    Python has replayed in this process plus what is due reaches :data:`JIT_MIN_WORK` (rent until
    renting has cost as much as buying: a process that goes on to replay many ranks, as a worker
    does, loads numba after the first rank or two, and one large trace loads it at once)."""
    global _python_work
    if _COMPILED is not None or _python_work + events * replays >= JIT_MIN_WORK:
        return True
    _python_work += events
    return False


def _compiled_loop():
    """:func:`_replay_loop` compiled by numba (machine code cached on disk after the first run)."""
    global _COMPILED
    if _COMPILED is None:
        from numba import njit

        _COMPILED = njit(cache=True, nogil=True)(_replay_loop)
    return _COMPILED


def _sync_arrays(g: Graph) -> dict[str, np.ndarray]:
    """The blocking calls as arrays (built once per graph)."""
    cached = getattr(g, "_sync_cache", None)
    if cached is not None:
        return cached
    sy = np.array([(ts, te, a, res, row) for ts, te, a, res, row in g.syncs], dtype=np.float64).reshape(-1, 5)
    rows = sy[:, 4].astype(np.int64)
    out = {"ts": sy[:, 0].copy(), "te": sy[:, 1].copy(), "a": sy[:, 2].astype(np.int64), "res": sy[:, 3].copy(), "row": rows,
           "device": np.isin(rows, np.fromiter(g.device_syncs, dtype=np.int64, count=len(g.device_syncs)))}
    g._sync_cache = out  # type: ignore[attr-defined]
    return out


def _deps_csr(g: Graph, drop: set[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cross-stream edges as CSR arrays (ptr per op, awaited op, gap), without ``drop``'s."""
    n = g.start.size
    owner = np.fromiter((i for i, dl in g.deps.items() for _ in dl), dtype=np.int64)
    op = np.fromiter((a for dl in g.deps.values() for a, _ in dl), dtype=np.int64, count=owner.size)
    gap = np.fromiter((x for dl in g.deps.values() for _, x in dl), dtype=np.float64, count=owner.size)
    if drop:
        keep = ~np.isin(owner, np.fromiter(drop, dtype=np.int64, count=len(drop)))
        owner, op, gap = owner[keep], op[keep], gap[keep]
    srt = np.argsort(owner, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=n)[:n], out=ptr[1:])
    return ptr, op[srt], gap[srt]


def _replay_loop(ev_kind, ev_idx, ev_key, start, key, dur, backlog, g_launch, g_stream, g_comm, g_wait,
                 stream, n_streams, pg, n_pgs, dep_ptr, dep_op, dep_gap,
                 sy_ts, sy_te, sy_a, sy_res, sy_free, sy_device, meas_end, cut_len, n_marks, min_sync, cap_sync):
    """The replay's event loop (see :func:`replay`; the module docstring gives the model). Plain
    code over arrays or lists: numba compiles it when there is enough to replay (:func:`_use_compiled`)."""
    n = len(start)
    S = np.zeros(n)
    E = np.zeros(n)
    stream_last = np.full(n_streams, -1, np.int64)
    pg_last = np.full(max(n_pgs, 1), -1, np.int64)
    marks = np.zeros(n_marks)
    shift = 0.0
    last_end = -np.inf
    for o in range(len(ev_kind)):
        kind = ev_kind[o]
        i = ev_idx[o]
        if kind == 0:
            # the backlog runs from where the first of it on each stream was measured (the GPU's
            # state when the window opened), the rest of it queued behind; other ops no earlier
            # than their launch (or measured start), moved with the CPU
            s = stream[i]
            p = stream_last[s]
            if backlog[i]:
                t = start[i] if p < 0 else -np.inf
            else:
                t = key[i] + shift + g_launch[i]
            if p >= 0 and E[p] + g_stream[i] > t:
                t = E[p] + g_stream[i]
            stream_last[s] = i
            c = pg[i]
            if c >= 0:
                p = pg_last[c]
                if p >= 0 and E[p] + g_comm[i] > t:
                    t = E[p] + g_comm[i]
                pg_last[c] = i
            for d in range(dep_ptr[i], dep_ptr[i + 1]):
                v = E[dep_op[d]] + dep_gap[d]
                if v > t:
                    t = v
            t += g_wait[i]
            S[i] = t
            e = t + dur[i]
            E[i] = e
            if e > last_end:
                last_end = e
        elif kind == 1:
            ts = sy_ts[i]
            te = sy_te[i]
            a = sy_a[i]
            residual = sy_res[i]
            t0 = ts + shift
            if sy_free[i]:
                new_end = t0 + min(te - ts, min_sync)
            elif a < 0:
                new_end = t0 + (te - ts)
            else:
                done = last_end if sy_device[i] else E[a]  # a device sync waits for everything
                if meas_end[a] > ts:  # it blocked: returns when the work is done; time the trace does
                    # not explain (waiting on work outside the graph) is kept as measured
                    new_end = max(t0 + min(te - ts, min_sync), done + min(residual, cap_sync))
                    new_end += max(residual - cap_sync, 0.0)
                else:  # the work was done before the call: it may have to wait now
                    new_end = max(t0 + (te - ts), done + min_sync)
            shift = new_end - te
        elif kind == 2:
            marks[i] = ev_key[o] + shift
        else:
            shift -= cut_len[i]
    return S, E, marks


# --------------------------------------------------------------------------------------------
# transformations
# --------------------------------------------------------------------------------------------


def _backward_all_gathers(g: Graph) -> list[list[int]]:
    """Per step, the first kernel op of each backward all-gather, in issue order."""
    out: list[list[int]] = [[] for _ in g.steps]
    first_op: dict[int, int] = {}
    for i in np.flatnonzero(g.coll >= 0):
        first_op.setdefault(int(g.coll[i]), int(i))
    for ci, c in enumerate(g.colls):
        if c.kind == "all_gather" and c.phase == "backward" and 0 <= c.step < len(out) and ci in first_op:
            out[c.step].append(first_op[ci])
    for lst in out:
        lst.sort(key=lambda i: g.key[i])
    return out


def _pre_ops(g: Graph, i: int, order: np.ndarray, pos: np.ndarray, comp_stream: int) -> list[int]:
    """GPU work launched just before collective op ``i`` in the same step, back to the previous
    compute-stream launch or collective (FSDP's pre-unshard copies / casts, copy-in)."""
    out = []
    p = int(pos[i]) - 1
    while p >= 0 and len(out) < 16:
        j = int(order[p])
        if g.step[j] != g.step[i] or g.comm[j] or g.stream[j] == comp_stream:
            break
        out.append(j)
        p -= 1
    return out


def _compute_stream(g: Graph) -> int:
    """The stream with the most compute time."""
    comp = np.flatnonzero(g.is_compute)
    if comp.size == 0:
        return -1
    s, inv = np.unique(g.stream[comp], return_inverse=True)
    busy = np.bincount(inv, weights=(g.end - g.start)[comp])
    return int(s[int(np.argmax(busy))])


def fix_prefetch(g: Graph) -> Fix | None:
    """Backward prefetch on: each backward all-gather (and the copies before it) is issued where
    the previous unit's all-gather was, i.e. ahead of that unit's gradient compute and its
    reduce-scatter on the communicator (BACKWARD_PRE)."""
    fx = Fix("prefetch")
    order = np.argsort(g.key, kind="stable")
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size)
    comp_stream = _compute_stream(g)
    for ags in _backward_all_gathers(g):
        for prev, cur in zip(ags, ags[1:]):
            delta = g.key[prev] - g.key[cur] + 1e-3
            for j in [cur, *_pre_ops(g, cur, order, pos, comp_stream)]:
                fx.move[j] = g.key[j] + delta
                fx.drop_deps.add(j)
    return fx if fx.move else None


def _in_ranges(t: float, ranges: list[tuple[float, float]]) -> bool:
    return any(a <= t < b for a, b in ranges)


def _name_mask(g: Graph, pred) -> np.ndarray:
    """``pred(name)`` for every op, evaluated once per distinct name."""
    if g.name_code is None or g.code_names is None:
        return np.fromiter((pred(n) for n in g.names), dtype=bool, count=len(g.names))
    used = np.unique(g.name_code)
    table = np.zeros(len(g.code_names), dtype=bool)
    table[used] = [bool(pred(g.code_names[c])) for c in used.tolist()]
    return table[g.name_code]


def fix_offload_off(g: Graph) -> Fix | None:
    """CPU offload off: FSDP's host<->device copies of parameters and gradients go away (those
    launched outside the optimizer and not on the compute stream: the batch copy stays), and an
    optimizer step with no GPU work (it ran on the CPU) is cut from the CPU timeline. Blocking
    calls that waited for a dropped copy no longer block."""
    fx = Fix("offload_off")
    comp_stream = _compute_stream(g)
    host = _name_mask(g, lambda n: n.startswith(("Memcpy HtoD", "Memcpy DtoH")))
    for i in np.flatnonzero(host & (g.stream != comp_stream) & (g.phase != "optimizer")).tolist():
        fx.scale[i] = 0.0
    dropped = set(fx.scale)
    for ts, te, a, gap, row in g.syncs:
        if a in dropped and row not in g.device_syncs:
            fx.free_syncs.add(row)
    for a, b in g.ranges.get("optimizer", []):
        m = (g.key >= a) & (g.key < b) & g.is_compute
        if not m.any():
            fx.cpu_cuts.append((a, b))
    return fx if fx.scale or fx.cpu_cuts else None


def fix_rate_limiter_off(g: Graph) -> Fix | None:
    """limit_all_gathers=False: the rate limiter's event synchronizations no longer block."""
    rl = g.ranges.get("rate_limiter", [])
    fx = Fix("rate_limiter_off", free_syncs={row for ts, te, a, gap, row in g.syncs if _in_ranges(ts, rl)})
    return fx if fx.free_syncs else None


_FP32 = ("float", "f32", "Float")
_LOW = ("bf16", "BFloat16", "bfloat16", "half", "Half", "fp16", "f16")


def fix_mixed_precision(g: Graph) -> Fix | None:
    """bf16 mixed precision: fp32 all-gathers and reduce-scatters move half the bytes, and fp32
    forward/backward compute kernels run in bf16 (half the bytes for memory-bound kernels, twice
    TF32's tensor-core rate for GEMMs): duration × 0.5. The optimizer keeps fp32."""
    fx = Fix("mixed_precision")
    for i in np.flatnonzero(g.coll >= 0):
        c = g.colls[int(g.coll[i])]
        if c.kind in ("all_gather", "reduce_scatter") and (c.dtype or "").lower() in ("float", "float32"):
            fx.scale[int(i)] = 0.5
    if not fx.scale:
        return None
    fp32 = _name_mask(g, lambda n: any(t in n for t in _FP32) and not any(t in n for t in _LOW))
    fwd_bwd = (g.phase == "forward") | (g.phase == "backward")
    for i in np.flatnonzero(g.is_compute & fwd_bwd & fp32).tolist():
        fx.scale[i] = 0.5
    return fx


WRAP_SPLIT = 8  # units the coarse unit is split into (a transformer's blocks; the trace does not say)


def _append_ops(g: Graph, src: list[int]) -> tuple[Graph, list[int]]:
    """A copy of ``g`` with a copy of each op in ``src`` appended (same fields); their indices."""
    n = g.start.size
    idx = np.array(src, dtype=np.int64)
    cat = lambda a: np.concatenate([a, a[idx]])  # noqa: E731
    g2 = Graph(cat(g.start), cat(g.end), cat(g.stream), cat(g.launch), cat(g.key), cat(g.backlog), cat(g.comm), cat(g.coll),
               cat(g.pg), cat(g.is_compute), cat(g.step), cat(g.g_launch), cat(g.g_stream), cat(g.g_comm),
               dict(g.deps), g.syncs, g.steps, g.colls, g.names + [g.names[i] for i in src], cat(g.phase),
               g.ranges, g.device_syncs, g.n_wait_edges, g.n_inferred, cat(g.g_wait),
               cat(g.name_code) if g.name_code is not None else None, g.code_names,
               cat(g.rows) if g.rows is not None else None)
    return g2, list(range(n, n + idx.size))


def _chunks(ops: np.ndarray, dur: np.ndarray, k: int) -> list[np.ndarray]:
    """``ops`` (in order) cut into ``k`` consecutive groups of about equal total duration."""
    c = np.cumsum(dur)
    cut = np.searchsorted(c, c[-1] * np.arange(1, k) / k)
    return [x for x in np.split(ops, cut) if x.size]


def fix_wrap(g: Graph, find_blocks: Callable[[], RepeatedBlocks | None] | None = None) -> tuple[Graph, Fix] | None:
    """Per-block wrapping of the unit that holds most parameters.

    With the model's repeated blocks known from its GEMM shapes (:mod:`.layers`), the unit's
    forward all-gather becomes the root's (what no block holds: embeddings, head, norms; issued
    where it was) followed by one all-gather per block, issued with it (the CPU runs ahead), the
    j-th gating block j's first GEMM; its backward reduce-scatter becomes one per block, issued
    when the block's backward is done (blocks last to first), then the root's where it was. Each
    piece moves its share of the unit's elements. Without shapes: WRAP_SPLIT equal pieces, the
    j-th gating the j-th of WRAP_SPLIT equal-time slices of compute. Backward all-gathers that
    per-block units add are prefetched and assumed hidden. Each added unit's hooks cost CPU time
    (what the coarse unit's hooks cost per unit, measured, forward and backward): inserted where
    the unit's forward starts and where its backward ends. ``find_blocks`` (called only when one
    unit dominates) reads the repeated blocks."""
    ci = [i for i in np.flatnonzero(g.coll >= 0)]
    if not ci:
        return None
    by_unit: dict[object, float] = {}
    for i in ci:
        c = g.colls[int(g.coll[i])]
        if c.kind == "all_gather" and c.phase == "forward":
            by_unit[c.unit] = by_unit.get(c.unit, 0.0) + (c.bytes or 0)
    total = sum(by_unit.values())
    if not total:
        return None
    unit = max(by_unit, key=by_unit.get)
    if by_unit[unit] < 0.5 * total:
        return None
    blocks = find_blocks() if find_blocks is not None else None
    share = _block_share(g, ci, unit, blocks)
    fx = Fix("wrap")
    if share is not None:
        fx.note = (f"the unit split as per-block wrapping would: {blocks.count} repeated blocks found from GEMM shapes, "
                   f"{100 * share:.1f}% of its elements each, the root keeping {100 * (1 - blocks.count * share):.1f}%")
    else:
        fx.note = f"the unit split into {WRAP_SPLIT} equal units (no repeated blocks found from GEMM shapes: record_shapes=True tells them)"
    new_src, plan = [], []
    dur = g.end - g.start
    for st in range(len(g.steps)):
        for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward")):
            ops = [int(i) for i in ci if g.step[i] == st and g.colls[int(g.coll[i])].kind == kind
                   and g.colls[int(g.coll[i])].phase == phase and g.colls[int(g.coll[i])].unit == unit]
            comp = np.flatnonzero(g.is_compute & (g.step == st) & (g.phase == phase))
            if not ops:
                continue
            op = ops[0] if kind == "all_gather" else ops[-1]
            comp = comp[np.argsort(g.key[comp])]
            comp = comp[g.key[comp] > g.key[op]] if kind == "all_gather" else comp[g.key[comp] < g.key[op]]
            pieces = _block_pieces(g, comp, kind, st, blocks, share) if share is not None else None
            if pieces is None:
                if comp.size < WRAP_SPLIT:
                    continue
                groups = _chunks(comp, dur[comp], WRAP_SPLIT)
                m = len(groups)
                anchors = [int(x[0]) for x in groups[1:]] if kind == "all_gather" else [int(x[-1]) for x in groups[:-1]]
                pieces = (1.0 / m, [(1.0 / m, a) for a in anchors])
            plan.append((st, kind, op, pieces))
            new_src += [op] * len(pieces[1])
    if not plan:
        return None
    g2, new = _append_ops(g, new_src)
    it = iter(new)
    extra = {st: len(pieces[1]) for st, kind, _, pieces in plan if kind == "all_gather"}
    hooks, hook_own = _hook_own(g)
    for st, kind, op, (own, pieces) in plan:
        # each added unit runs its own hooks on the CPU: what the coarse unit's cost per unit,
        # forward (pre-forward: the all-gather issue, copy-out) and backward (pre-backward's
        # all-gather issue, post-backward's reduce-scatter issue)
        fwd_hook = _hook_us_per_unit(hooks, hook_own, g.steps[st], "forward", len(by_unit))
        if kind == "all_gather":
            fx.cpu_adds += [(g.key[a] - 1e-4, fwd_hook) for _, a in pieces]
        else:
            bwd_hook = fwd_hook + _hook_us_per_unit(hooks, hook_own, g.steps[st], "backward", len(by_unit))
            fx.cpu_adds += [(g.key[a] + 5e-4, bwd_hook) for _, a in pieces]
            fx.cpu_adds += [(g.key[op] - 1e-4, bwd_hook)] * max(extra.get(st, 0) - len(pieces), 0)
        fx.scale[op] = own
        for j, (scale, anchor) in enumerate(pieces, start=1):
            p = next(it)
            fx.scale[p] = scale
            if kind == "all_gather":
                # issued right after the original, in order; gates its block's first compute
                fx.move[p] = g.key[op] + j * 1e-3
                g2.deps[anchor] = list(g2.deps.get(anchor, [])) + [(p, CAP_DEP_US)]
            else:
                # issued after its slice of backward compute; the original keeps the last slot
                fx.move[p] = g.key[anchor] + 1e-3
                fx.drop_deps.add(p)
                g2.deps[p] = [(anchor, CAP_DEP_US)]
        if kind == "reduce_scatter":
            fx.move[op] = g.key[op]
    return g2, fx


def _block_share(g: Graph, ci: list, unit, blocks: RepeatedBlocks | None) -> float | None:
    """One block's share of the unit's all-gathered elements (None when the blocks are unknown
    or hold more elements than the unit gathers)."""
    if blocks is None or not blocks.forward_starts:
        return None
    st = min(blocks.forward_starts)
    numel = sum(g.colls[int(g.coll[i])].out_nelems or 0 for i in ci
                if g.step[i] == st and g.colls[int(g.coll[i])].kind == "all_gather"
                and g.colls[int(g.coll[i])].phase == "forward" and g.colls[int(g.coll[i])].unit == unit)
    if not numel or blocks.count * blocks.block_numel > numel:
        return None
    return blocks.block_numel / numel


def _block_pieces(g: Graph, comp: np.ndarray, kind: str, st: int, blocks: RepeatedBlocks,
                  share: float) -> tuple[float, list[tuple[float, int]]] | None:
    """(the original's share, [(share, anchor op)] of the other pieces) for step ``st``: forward,
    one piece per block gating the first compute launched at its first GEMM; backward, one per
    block but the first issued after the last compute launched before the next block's backward
    (the first block's goes with the root's, last). None where the step's blocks are unknown."""
    starts = (blocks.forward_starts if kind == "all_gather" else blocks.backward_ends).get(st)
    if starts is None or comp.size == 0:
        return None
    keys = g.key[comp]
    root = 1.0 - blocks.count * share
    pieces = []
    if kind == "all_gather":
        for t in starts:
            i = int(np.searchsorted(keys, t, side="left"))
            if i >= comp.size:
                return None
            pieces.append((share, int(comp[i])))
        return root, pieces
    for t in reversed(starts[1:]):  # blocks last to first
        i = int(np.searchsorted(keys, t, side="left")) - 1
        if i < 0:
            return None
        pieces.append((share, int(comp[i])))
    return root + share, pieces


def _hook_own(g: Graph) -> tuple[np.ndarray, np.ndarray]:
    """The outermost FSDP hook ranges (n × 2, CPU µs) and each one's own CPU time: its duration
    less the blocking calls inside it (they wait for the GPU, not for Python)."""
    hooks = np.array(g.ranges.get("hooks", []), dtype=np.float64).reshape(-1, 2)
    # blocked time inside each hook: prefix sums over the blocking calls in start order
    sy = np.array([(ts, te) for ts, te, *_ in g.syncs], dtype=np.float64).reshape(-1, 2)
    sy = sy[np.argsort(sy[:, 0], kind="stable")]
    csum = np.concatenate(([0.0], np.cumsum(sy[:, 1] - sy[:, 0])))
    lo = np.searchsorted(sy[:, 0], hooks[:, 0], side="left")
    hi = np.searchsorted(sy[:, 0], hooks[:, 1], side="left")
    return hooks, hooks[:, 1] - hooks[:, 0] - (csum[hi] - csum[lo])


def fix_hooks_off(g: Graph) -> Fix | None:
    """FSDP hooks free on the CPU: the CPU time of the outermost FSDP hook ranges is cut (less
    the blocking calls inside them, which wait for the GPU, not for Python). What fewer, larger
    units would save at most on the host side; a saving means the hooks sit on the critical path."""
    hooks, own = _hook_own(g)
    if not hooks.size:
        return None
    keep = own > 0
    cuts = list(zip((hooks[keep, 1] - own[keep]).tolist(), hooks[keep, 1].tolist()))
    return Fix("hooks_off", cpu_cuts=cuts) if cuts else None


def _hook_us_per_unit(hooks: np.ndarray, own: np.ndarray, step: StepWindow, phase: str, units: int) -> float:
    """Own CPU µs (:func:`_hook_own`) of the FSDP hooks that start in ``step``'s ``phase``, per unit."""
    win = step.phases.get(phase)
    if win is None or units < 1 or not hooks.size:
        return 0.0
    m = (hooks[:, 0] >= win[0]) & (hooks[:, 0] < win[1]) & (own > 0)
    return float(own[m].sum()) / units


#: the rate assumed for fp32 GEMM / attention kernels moved onto tensor cores: this share of the
#: device's dense BF16 peak (large bf16 GEMMs reach 60-80% of it, attention less)
TENSOR_CORE_SHARE = 0.5
TENSOR_CORE_MIN_SHARE = 5.0  # % of GEMM + attention time on fp32 engines for the replay to try it


def fp32_share(cf: ComputeFacts) -> float:
    """% of GEMM + attention kernel time on fp32 engines (CUDA cores, or fp32 of unknown engine)."""
    return cf.dtype_mix.get("fp32-simt", 0.0) + cf.dtype_mix.get("fp32", 0.0)


def fix_tensor_cores(g: Graph, kf, cf: ComputeFacts) -> Fix | None:
    """bf16 mixed precision for a run whose matmuls run in fp32 on a GPU with tensor cores: every
    fp32 GEMM / attention kernel takes its FLOPs at TENSOR_CORE_SHARE of the device's dense BF16
    peak (never longer than measured), and the forward / backward fp32 elementwise kernels move
    half the bytes (× 0.5, bf16 activations). The optimizer keeps fp32."""
    if not cf.tensor_cores or not cf.bf16_peak_tflops or g.rows is None or kf.rows.size == 0:
        return None
    rate = TENSOR_CORE_SHARE * cf.bf16_peak_tflops * 1e6  # FLOPs per µs
    pos = {int(r): i for i, r in enumerate(g.rows.tolist())}
    fx = Fix("tensor_cores")
    dur = g.end - g.start
    gemm_ops = set()
    for r, fl, eng in zip(kf.rows.tolist(), kf.flops.tolist(), kf.engine):
        i = pos.get(int(r))
        if i is None:
            continue
        gemm_ops.add(i)
        if eng in ("fp32-simt", "fp32") and dur[i] > 0 and fl > 0:
            fx.scale[i] = min(1.0, fl / rate / dur[i])
    if not fx.scale:
        return None
    fp32 = _name_mask(g, lambda n: any(t in n for t in _FP32) and not any(t in n for t in _LOW))
    fwd_bwd = (g.phase == "forward") | (g.phase == "backward")
    for i in np.flatnonzero(g.is_compute & fwd_bwd & fp32).tolist():
        if i not in gemm_ops:
            fx.scale[i] = 0.5
    return fx


def latency_share(colls: list[Collective]) -> float | None:
    """Share of the median all-gather's / reduce-scatter's duration that is fixed cost, from a
    least-squares fit duration = a + bytes / bandwidth over this rank's collectives of those
    kinds (None when sizes do not vary enough to separate the two)."""
    pts = [(c.bytes, c.gpu_dur_us) for c in colls if c.kind in ("all_gather", "reduce_scatter") and c.step >= 0
           and c.bytes and c.gpu_dur_us and c.gpu_dur_us > 0]
    if len(pts) < 4:
        return None
    x, y = np.array(pts, dtype=float).T
    if x.max() < 1.5 * x.min():
        return None
    b, a = np.polyfit(x, y, 1)
    if b <= 0:
        return None
    med = float(np.median(y))
    return float(np.clip(a / med, 0.0, 1.0)) if med > 0 else None


STRAGGLER_FACTORS = (0.75,)


def fix_compute_scale(g: Graph, f: float) -> Fix:
    """Compute kernels × f: what this rank's step would be with the median rank's compute speed
    (the run summary interpolates between the factors)."""
    return Fix(f"compute×{f}", scale={int(i): f for i in np.flatnonzero(g.is_compute)})


FIXES = {
    "prefetch": fix_prefetch,
    "offload_off": fix_offload_off,
    "rate_limiter_off": fix_rate_limiter_off,
    "mixed_precision": fix_mixed_precision,
    "wrap": fix_wrap,
    "hooks_off": fix_hooks_off,
}


def _exposed_rs_ms(g: Graph, S: np.ndarray, E: np.ndarray) -> float:
    """Exposed reduce-scatter per step (ms) in a replayed timeline."""
    rs = np.array([i for i in np.flatnonzero(g.coll >= 0) if g.colls[int(g.coll[i])].kind == "reduce_scatter"],
                  dtype=np.int64)
    if rs.size == 0:
        return 0.0
    comp = np.flatnonzero(g.is_compute)
    exposed = iv.subtract(iv.merge(S[rs], E[rs]), iv.merge(S[comp], E[comp]))
    return iv.total(exposed) / 1e3 / max(len(g.steps), 1)


def _applies(fsdp: FsdpFacts | None) -> dict[str, bool]:
    """Which transformations are worth a replay on this rank (the rest would change nothing, or
    their finding cannot fire)."""
    if fsdp is None:
        return dict.fromkeys(FIXES, True)
    is_fsdp = fsdp.version in (1, 2)
    return {
        "prefetch": fsdp.backward_prefetch in ("NONE", "BACKWARD_POST"),
        "offload_off": fsdp.cpu_offload.detected,
        "rate_limiter_off": fsdp.version == 1 and fsdp.rate_limiter_ms_per_step > 0,
        "mixed_precision": is_fsdp and fsdp.mixed_precision is not True,
        "wrap": is_fsdp,
        "hooks_off": is_fsdp,
    }


def fidelity_pct(base: np.ndarray, base_clocks: np.ndarray, measured: np.ndarray, clocks: np.ndarray) -> float:
    """How closely the unchanged replay reproduces the measured steps, in %: the larger of its
    error on the steady step time (what savings are differences of) and its largest per-step
    error on the completion clock (each step's completion, whichever side made it late). The
    CPU clock's per-step split is not compared: where the CPU blocks on the GPU (a full launch
    queue, a synchronization), the replay may end a step's CPU span earlier and the next one's
    later than measured without changing the rate."""
    m = float(measured.mean())
    steady = 100 * abs(float(base.mean()) - m) / m if m > 0 else 0.0
    return max(steady, step_error_pct(base_clocks[1], clocks[1]))


def step_error_pct(replayed: np.ndarray, measured: np.ndarray) -> float:
    """The replay's error: the largest per-step |replayed − measured| / measured, in %."""
    ok = measured > 0
    if not ok.any():
        return 0.0
    return float(100 * np.max(np.abs(replayed[ok] - measured[ok]) / measured[ok]))


@dataclass
class WhatIfPlan:
    """What the replays need, read from the trace: the graph and the transformations that apply.
    Built while the trace is in memory; :func:`run_whatif` replays it after the trace's columns
    have been let go (the replay's compiled loop and its imports then take their place)."""

    g: Graph
    n_steps: int
    latency_share: float | None
    fixes: list[tuple[str, Fix | tuple[Graph, Fix] | None]]


def plan_whatif(rt: RankTrace, steps: list[StepWindow], colls: list[Collective],
                fsdp: FsdpFacts | None = None, kflops=None, compute: ComputeFacts | None = None) -> WhatIfPlan | None:
    """The graph of this rank's steps and every transformation that applies (all of them when
    ``fsdp`` is None): everything of the what-if replay that reads the trace."""
    g = build_graph(rt, steps, colls)
    if g is None:
        return None
    applies = _applies(fsdp)
    fixes = [(name, make(g, lambda: repeated_blocks(rt, steps)) if name == "wrap" else make(g))
             for name, make in FIXES.items() if applies.get(name, True)]
    if kflops is not None and compute is not None and fp32_share(compute) >= TENSOR_CORE_MIN_SHARE:
        fixes.append(("tensor_cores", fix_tensor_cores(g, kflops, compute)))
    fixes += [(f"compute×{f}", fix_compute_scale(g, f)) for f in STRAGGLER_FACTORS]
    return WhatIfPlan(g, len(steps), latency_share(colls), fixes)


def run_whatif(plan: WhatIfPlan) -> WhatIfFacts:
    """Replay the steps unchanged and with each transformation of ``plan``."""
    g = plan.g
    clocks = measured_clocks_ms(g)
    measured = _slower(clocks)
    due = 1 + sum(fx is not None for _, fx in plan.fixes)  # replays of this rank still to run
    S, E, base, base_clocks = replay(g, replays=due)
    out = WhatIfFacts(
        measured_step_ms=float(measured.mean()),
        replayed_step_ms=float(base.mean()),
        error_pct=fidelity_pct(base, base_clocks, measured, clocks),
        ops=int(g.start.size),
        wait_edges=g.n_wait_edges,
        blocking_calls=sum(1 for s in g.syncs if s[2] >= 0),
        inferred_edges=g.n_inferred,
        unexplained_waits=int((g.g_wait > 0).sum()),
        unexplained_wait_ms=float(g.g_wait.sum()) / 1e3 / max(plan.n_steps, 1),
        backlog_ops=int(g.backlog.sum()),
        latency_share=plan.latency_share,
    )
    out.exposed_rs_ms["none"] = _exposed_rs_ms(g, S, E)
    for name, fx in plan.fixes:
        if fx is None:
            continue
        g2, fx = fx if isinstance(fx, tuple) else (g, fx)
        due -= 1
        S2, E2, t, _ = replay(g2, fx, due)
        out.step_ms[name] = float(t.mean())
        out.saving_ms[name] = float(max(base.mean() - t.mean(), 0.0))
        out.exposed_rs_ms[name] = _exposed_rs_ms(g2, S2, E2)
        if fx.note:
            out.evidence[name] = fx.note
    return out


def analyze_whatif(rt: RankTrace, steps: list[StepWindow], colls: list[Collective],
                   fsdp: FsdpFacts | None = None, kflops=None, compute: ComputeFacts | None = None) -> WhatIfFacts | None:
    """Replay this rank's steps unchanged and with every transformation that applies (all of
    them when ``fsdp`` is None)."""
    plan = plan_whatif(rt, steps, colls, fsdp, kflops, compute)
    return run_whatif(plan) if plan is not None else None


_WHATIF_SUMS = ("ops", "wait_edges", "blocking_calls", "inferred_edges", "unexplained_waits", "backlog_ops")


class WhatIfFold:
    """:func:`fold_whatif` as ranks arrive: each rank's replay figures go into columns (its
    WhatIfFacts need not be kept), read back in rank order; kept whole only the replay of the
    rank with the most compute (the straggler fix interpolates its replays)."""

    __slots__ = ("cols", "evidence", "slow")

    def __init__(self) -> None:
        self.cols = Columns()
        self.evidence: dict[str, tuple[int, str]] = {}  # fix → (rank, text) of the lowest rank that has one
        self.slow: tuple[tuple[float, int], int, float, WhatIfFacts] | None = None

    def add(self, rank: int, w: WhatIfFacts | None, compute_ms_total: float) -> None:
        if w is None:
            return
        row: dict = {"measured": w.measured_step_ms, "replayed": w.replayed_step_ms, "error": w.error_pct,
                     "unexplained_wait_ms": w.unexplained_wait_ms}
        for attr in _WHATIF_SUMS:
            row[attr] = float(getattr(w, attr))
        if w.latency_share is not None:
            row["latency_share"] = w.latency_share
        for name, v in w.saving_ms.items():
            row[("saving", name)], row[("step", name)] = v, w.step_ms[name]
            if name in w.evidence and (name not in self.evidence or rank < self.evidence[name][0]):
                self.evidence[name] = (rank, w.evidence[name])
        for name, v in w.exposed_rs_ms.items():
            row[("rs", name)] = v
        if compute_ms_total > 0:
            row["compute_ms"] = compute_ms_total
            key = (compute_ms_total, -rank)
            if self.slow is None or key > self.slow[0]:
                self.slow = (key, rank, compute_ms_total, w)
        self.cols.add(rank, row)

    def result(self) -> WhatIfFacts | None:
        """The run's what-if summary: worst error over ranks, savings as the maximum over ranks."""
        cols = self.cols
        if not len(cols):
            return None
        ranks, errors = cols.with_ranks("error")
        out = WhatIfFacts(
            measured_step_ms=float(np.mean(cols.values("measured"))),
            replayed_step_ms=float(np.mean(cols.values("replayed"))),
            error_pct=max(errors),
            unexplained_wait_ms=max(cols.values("unexplained_wait_ms")),
            per_rank_error_pct={str(r): e for r, e in zip(ranks, errors)},
            **{attr: int(sum(cols.values(attr))) for attr in _WHATIF_SUMS},
        )
        shares = cols.values("latency_share")
        out.latency_share = float(np.median(shares)) if shares else None
        for name in cols.keys("saving"):
            out.saving_ms[name] = max(cols.values(("saving", name)))
            out.step_ms[name] = float(np.mean(cols.values(("step", name))))
            ev = self.evidence.get(name)
            if ev and ev[1]:
                out.evidence[name] = ev[1]
        self._straggler(out)
        for name in cols.keys("rs"):
            out.exposed_rs_ms[name] = float(np.mean(cols.values(("rs", name))))
        return out

    def _straggler(self, out: WhatIfFacts) -> None:
        """Straggler fixed: the rank with the most compute, replayed with its compute kernels at
        the median rank's (interpolating its replays at compute × 1 and × 0.75); the others only
        waited for it inside their collectives. Saving = slowest replayed step − that."""
        cms = self.cols.values("compute_ms")
        if len(cms) < 2 or self.slow is None:
            return
        med = float(np.median(cms))
        _, slow_rank, slow_ms, w = self.slow
        f = med / slow_ms
        xs = [1.0] + list(STRAGGLER_FACTORS)
        ys = [w.replayed_step_ms] + [w.step_ms.get(f"compute×{x}") for x in STRAGGLER_FACTORS]
        if any(y is None for y in ys) or f >= 1.0:
            return
        order = np.argsort(xs)
        fixed = float(np.interp(f, np.array(xs)[order], np.array(ys, dtype=float)[order]))
        worst = max(v for v in self.cols.filled("replayed", float("-inf"), among="compute_ms"))
        out.saving_ms["straggler"] = max(worst - fixed, 0.0)
        out.step_ms["straggler"] = fixed
        out.evidence["straggler"] = (f"rank {slow_rank}'s compute at the median rank's ({100 * f:.0f}% of its own) "
                                     f"replays to {fixed:.1f} ms per step")


def fold_whatif(ranks: list) -> WhatIfFacts | None:
    """The run's what-if summary from RankFacts in rank order (see :class:`WhatIfFold`)."""
    acc = WhatIfFold()
    for r in ranks:
        acc.add(r.rank, r.whatif, r.compute_ms_total)
    return acc.result()
