"""The dependency graph of a rank's profiled steps, read from its trace (see :mod:`.`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fsdpdoctor.ingest.events import KERNEL_LAUNCHES
from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis.comms import SYNC_NAMES, Collective, comm_kernel_mask, launch_rows
from fsdpdoctor.analysis.rows import name_lut, name_rows
from fsdpdoctor.analysis.steps import PHASES, StepWindow, locate


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CAP_LAUNCH_US = 30.0  # launch call start -> kernel start when the GPU is free
CAP_DEP_US = 5.0  # previous work on the stream / awaited work -> start
CAP_SYNC_US = 20.0  # awaited GPU work end -> blocking call returns
MIN_SYNC_US = 2.0  # shortest blocking call
WAIT_NAMES = ("cudaStreamWaitEvent", "hipStreamWaitEvent")
# kernel launches: one that takes this long waited for room in the launch queue (the GPU runs
# behind and the queue is full) and is replayed as a blocking call on the GPU work that freed it
LAUNCH_NAMES = KERNEL_LAUNCHES
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
    inferred: list[int] = field(default_factory=list)  # ops whose last cross-stream edge was inferred
    nbytes: np.ndarray | None = None  # per op: bytes of a memcpy / memset (0 where not recorded)


@dataclass
class Fix:
    """One transformation: what to change before the replay. Built as dicts, sets and lists, kept
    as arrays once built (:func:`compact`: :class:`OpMap`, :class:`Packed`); the replay reads
    either, and either has the length and truth of the dict, set or list."""

    name: str
    move: dict[int, float] = field(default_factory=dict)  # op -> new CPU key (launch moves with it)
    scale: dict[int, float] = field(default_factory=dict)  # op -> duration factor (0: dropped)
    drop_deps: set[int] = field(default_factory=set)  # ops whose cross-stream waits are re-derived
    cpu_cuts: list[tuple[float, float]] = field(default_factory=list)  # measured CPU time removed
    free_syncs: set[int] = field(default_factory=set)  # blocking calls that no longer block (rows)
    cpu_adds: list[tuple[float, float]] = field(default_factory=list)  # (CPU key, µs) inserted there
    drop_inferred: set[int] = field(
        default_factory=set
    )  # ops whose inferred cross-stream edge goes (it was the fix's cause)
    note: str = ""  # how the transformation was built, for the finding's evidence


class OpMap:
    """A fix's op -> value map once built (:func:`compact`): its keys and values as two arrays,
    in the dict's order (12 bytes an entry where the dict took ~110; a plan holds a dozen fixes
    of up to one entry per op). Read-only; reads as the dict did."""

    __slots__ = ("k", "v")

    def __init__(self, d: dict[int, float]) -> None:
        self.k = np.fromiter(d.keys(), dtype=np.int64, count=len(d))
        self.v = np.fromiter(d.values(), dtype=np.float64, count=len(d))

    @classmethod
    def of(cls, keys: np.ndarray, values: np.ndarray) -> "OpMap":
        """The map of distinct ``keys`` to ``values``, in that order, built from the arrays."""
        m = cls.__new__(cls)
        m.k, m.v = keys.astype(np.int64), values.astype(np.float64)
        return m

    def __len__(self) -> int:
        return int(self.k.size)

    def __iter__(self):
        return iter(self.k.tolist())

    def keys(self):
        return self.k.tolist()

    def values(self):
        return self.v.tolist()

    def items(self):
        return zip(self.k.tolist(), self.v.tolist())


class Packed:
    """A fix's set of ops (or rows) or its (a, b) pairs once built: one array (sorted ops, or
    (k, 2) floats). Read-only; its length, truth and iteration are the set's or list's."""

    __slots__ = ("a",)

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __len__(self) -> int:
        return int(self.a.shape[0])

    def __iter__(self):
        return iter(self.a.tolist()) if self.a.ndim == 1 else map(tuple, self.a.tolist())


def map_arrays(m: dict[int, float] | OpMap) -> tuple[np.ndarray, np.ndarray]:
    """(ops, values) of a fix's map, dict or :class:`OpMap`."""
    if isinstance(m, OpMap):
        return m.k, m.v
    return np.fromiter(m.keys(), dtype=np.int64, count=len(m)), np.fromiter(m.values(), dtype=np.float64, count=len(m))


def op_array(s) -> np.ndarray:
    """The ops (or rows) of a fix's set, set or :class:`Packed`, as an int64 array."""
    if isinstance(s, Packed):
        return s.a
    return np.fromiter(s, dtype=np.int64, count=len(s))


def pair_array(pairs) -> np.ndarray:
    """A fix's (a, b) pairs (``cpu_cuts``, ``cpu_adds``), list or :class:`Packed`, as a (k, 2) float array."""
    if isinstance(pairs, Packed):
        return pairs.a
    return np.array(pairs, dtype=np.float64).reshape(-1, 2)


def compact(fx):
    """A built fix (or (graph, fix), or None) with its maps, sets and pairs as arrays: what the
    replay reads, in a fraction of the memory. The plan keeps every fix and its assumption
    variants from the trace's reading to the last replay (on the 310 MB FSDP2 benchmark trace
    ~65 MB of dicts, sets and tuples, 2 MB as arrays)."""
    if fx is None:
        return None
    if isinstance(fx, tuple):
        return fx[0], compact(fx[1])
    for name in ("move", "scale"):
        m = getattr(fx, name)
        if isinstance(m, dict):
            setattr(fx, name, OpMap(m))
    for name in ("drop_deps", "free_syncs", "drop_inferred"):
        setattr(fx, name, Packed(np.unique(op_array(getattr(fx, name)))))
    for name in ("cpu_cuts", "cpu_adds"):
        setattr(fx, name, Packed(pair_array(getattr(fx, name))))
    return fx


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
    syncs, device_syncs = _sync_calls(rt, start, end, key, rows, lr, has)
    n_deps = sum(len(v) for v in deps.values())
    explicit = {i: len(v) for i, v in deps.items()}
    g_wait = _unexplained_waits(start, end, key, stream, backlog, g_launch, prev_s, g_stream, prev_p, g_comm, deps)
    n_inferred = sum(len(v) for v in deps.values()) - n_deps
    inferred = [i for i, v in deps.items() if len(v) > explicit.get(i, 0)]
    nbytes = np.zeros(rows.size, dtype=np.float64)
    copies = np.flatnonzero(rt.mask_cat("gpu_memcpy", "gpu_memset")[rows])
    args = rt.args
    known = [  # (op, bytes) of the copies with a byte count
        (k, b)
        for k, a in zip(copies.tolist(), map(args.get, rows[copies].tolist()))
        if a is not None and isinstance(b := a.nbytes, int)
    ]
    if known:
        nbytes[np.fromiter((k for k, _ in known), dtype=np.int64, count=len(known))] = np.fromiter(
            (b for _, b in known), dtype=np.float64, count=len(known)
        )
    names = np.array(rt.names, dtype=object)[rt.name[rows]].tolist()
    _, ph = locate(steps, key)
    phase = np.array(PHASES, dtype=object)[ph]
    ranges = {}
    for label, pred in (
        ("optimizer", lambda n: n.startswith("Optimizer.step#")),
        ("rate_limiter", lambda n: n == RATE_LIMITER),
        ("hooks", _is_hook),
    ):
        r = name_rows(rt, pred, "cpu_op", "user_annotation")
        ranges[label] = [(float(rt.ts[i]), float(rt.ts[i] + rt.dur[i])) for i in r]
    ranges["hooks"] = _outermost(ranges["hooks"])
    return Graph(
        start,
        end,
        stream,
        launch,
        key,
        backlog,
        comm,
        coll,
        pg,
        is_compute,
        step,
        g_launch,
        g_stream,
        g_comm,
        deps,
        syncs,
        steps,
        colls,
        names,
        phase,
        ranges,
        device_syncs,
        n_wait,
        n_inferred,
        g_wait,
        rt.name[rows].astype(np.int64),
        rt.names,
        rows,
        inferred,
        nbytes,
    )


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


def _unexplained_waits(
    start, end, key, stream, backlog, g_launch, prev_s, g_stream, prev_p, g_comm, deps
) -> np.ndarray:
    """Per op, how much later it started than its launch, its stream, its communicator and its
    cross-stream waits allow (with their capped gaps), where that is ≥ UNEXPLAINED_US; an op that
    started within INFER_TOL_US of the end of earlier-launched work on another stream gets an
    edge to it in ``deps`` instead (its wait is then explained)."""
    # the backlog: the first op of it on a stream no earlier than the GPU's first work of the window
    # (where the first of all was measured), the rest queued behind; one that started later waited
    # for something: an edge inferred below, or a wait kept as measured
    opened = float(start[backlog].min()) if backlog.any() else 0.0
    c = np.where(backlog, np.where(prev_s < 0, opened, -np.inf), key + g_launch)
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
    waits = name_rows(rt, lambda n: n in WAIT_NAMES, "cuda_runtime", "cuda_driver")
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
        same_step = np.searchsorted(st_starts, key[cand], side="right") == np.searchsorted(
            st_starts, t[m], side="right"
        )
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


def _sync_calls(rt, start, end, key, rows, lr, has) -> tuple[list, set[int]]:
    """Blocking CPU calls: (ts, end, awaited op, gap, row); awaited -1 when it did not block.
    Also the rows of the device synchronizations among them."""
    runtime = rt.mask_cat("cuda_runtime", "cuda_driver")
    calls = np.flatnonzero(
        runtime
        & (
            rt.mask_names(lambda n: n in SYNC_NAMES)
            | (rt.mask_names(lambda n: n in LAUNCH_NAMES) & (rt.dur > LAUNCH_BLOCKED_US))
        )
    )
    if calls.size == 0:
        return [], set()
    ts = rt.ts[calls].astype(np.float64)
    te = ts + rt.dur[calls]
    a = np.full(calls.size, -1, dtype=np.int64)
    lops = np.flatnonzero(has)
    # synchronous / pageable copies return when their own copy is done
    copy = name_lut(rt, lambda n: n.startswith(("cudaMemcpy", "hipMemcpy")))[rt.name[calls]]
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
    device = name_lut(rt, lambda n: n.endswith("DeviceSynchronize"))[rt.name[calls]]
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
    # a copy call that blocked (longer than a launch that waited for the queue) and returned before
    # its own copy ran waited for room in the launch queue: like the launches, below
    queued = copy & (a < 0) & (te - ts > LAUNCH_BLOCKED_US)
    rest = np.flatnonzero((~copy | queued) & ~device)
    # what a call can wait for: work launched before it, and the backlog (launched before the window)
    cand = np.arange(has.size) if lops.size else lops
    if rest.size and cand.size:
        by_end = cand[np.argsort(end[cand], kind="stable")]
        ends = end[by_end]
        los = np.searchsorted(ends, ts[rest], side="right")
        his = np.searchsorted(ends, te[rest] + 1e-3, side="right")
        key_by_end, ts_l, by_end_l = key[by_end].tolist(), ts.tolist(), by_end.tolist()
        backlog_by_end = (~has[by_end]).tolist()  # the backlog: launched before the window, so before any call
        for r, lo, hi in zip(rest.tolist(), los.tolist(), his.tolist()):
            for q in range(hi - 1, lo - 1, -1):  # by end, latest first: the first launched before the call
                if backlog_by_end[q] or key_by_end[q] < ts_l[r]:
                    a[r] = by_end_l[q]
                    break
    gap = np.where(a >= 0, te - end[np.maximum(a, 0)], 0.0)
    return list(zip(ts.tolist(), te.tolist(), a.tolist(), gap.tolist(), calls.tolist())), set(calls[device].tolist())
