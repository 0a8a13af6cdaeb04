"""The replay: the graph's ops scheduled in CPU launch order, compiled with numba for large graphs,
and the step clocks it reads back (as the analysis counts steps)."""

from __future__ import annotations


import gc

import numpy as np

from fsdpdoctor.analysis.steps import step_clocks_ms
from fsdpdoctor.analysis.whatif.graph import CAP_SYNC_US, MIN_SYNC_US, Fix, Graph, map_arrays, op_array, pair_array


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
    cpu, comp = step_clocks_ms(marks[0::2], marks[1::2], done if np.isfinite(gpu_end).any() else None, first)
    return np.vstack((cpu, comp if comp.size else cpu))


def replay(
    g: Graph, fix: Fix | None = None, replays: int = 1, blind: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Replayed (start, end) of every op, the step times (ms) of ``g.steps``, both step clocks
    they come from (rows: CPU intervals, completion intervals; see :func:`_step_clocks`) and the
    steps' replayed CPU (start, end) marks (µs, flat).

    The arrays are prepared here with numpy; the event loop, a list schedule that does not
    vectorize (each start depends on ends just computed), runs compiled once the work is worth
    numba's start-up (:func:`_use_compiled`; ``replays``: how many replays of this graph the
    caller has still to make, this one included)."""
    fix = fix or Fix("none")
    n = g.start.size
    key = g.key.copy()
    if len(fix.move):
        mv, to = map_arrays(fix.move)
        key[mv] = to
    dur = g.end - g.start
    if len(fix.scale):
        sc, by = map_arrays(fix.scale)
        f = np.ones(n)
        f[sc] = by
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
    adds = pair_array(fix.cpu_adds)
    cuts = np.concatenate((pair_array(fix.cpu_cuts), np.column_stack((adds[:, 0] + adds[:, 1], adds[:, 0]))))
    # the CPU-side event list: ops, blocking calls, step boundaries, cuts; one order: the backlog
    # first (launched before the window), then everything by CPU time
    kinds_a = np.concatenate(
        (
            np.zeros(n, np.int8),
            np.ones(sy["ts"].size, np.int8),
            np.full(2 * ns, 2, np.int8),
            np.full(cuts.shape[0], 3, np.int8),
        )
    )
    keys_a = np.concatenate(
        (key, sy["ts"], np.array([x for st in g.steps for x in (st.start, st.end)], dtype=np.float64), cuts[:, 1])
    )
    idx_a = np.concatenate((np.arange(n), np.arange(sy["ts"].size), np.arange(2 * ns), np.arange(cuts.shape[0])))
    first = np.zeros(kinds_a.size, dtype=bool)
    first[:n] = g.backlog
    order = np.lexsort((kinds_a, keys_a, ~first))
    # blind: without what the trace does not show (the waits kept as measured, the inferred
    # cross-stream edges): the replay's sensitivity to them (plan.run_whatif)
    g_wait = g.g_wait.copy() if g.g_wait is not None and not blind else np.zeros(n)
    moved = np.concatenate((map_arrays(fix.move)[0], op_array(fix.drop_deps)))
    if moved.size:  # a moved op's unseen wait is not carried along
        g_wait[moved] = 0.0
    dep_ptr, dep_op, dep_gap = _deps_csr(g, fix.drop_deps, blind, fix.drop_inferred)
    free = np.isin(sy["row"], op_array(fix.free_syncs)) if len(fix.free_syncs) else np.zeros(sy["row"].size, dtype=bool)
    stream_ix = _stream_index(g)
    args = (
        kinds_a[order],
        idx_a[order],
        keys_a[order],
        _backlog_starts(g),
        key,
        dur,
        g.backlog,
        g.g_launch,
        g.g_stream,
        g.g_comm,
        g_wait,
        stream_ix.astype(np.int64),
        int(stream_ix.max()) + 1 if n else 1,
        g.pg,
        int(g.pg.max()) + 1 if n else 0,
        dep_ptr,
        dep_op,
        dep_gap,
        sy["ts"],
        sy["te"],
        sy["a"],
        sy["res"],
        free,
        sy["device"],
        g.end,
        cuts[:, 1] - cuts[:, 0],
        2 * ns,
        MIN_SYNC_US,
        CAP_SYNC_US,
    )
    if _use_compiled(kinds_a.size, replays):
        loading = _COMPILED is None
        S, E, marks = _compiled_loop()(*args)
        if loading:
            # numba's modules, its typing registries and the machine code it loaded: ~70,000
            # objects that live as long as the process, left out of the cyclic GC's passes
            # (each full pass over them cost ~0.1 s)
            gc.freeze()
    else:  # little work so far: the same loop in Python over lists costs less than loading numba
        S, E, marks = _replay_loop(*[a.tolist() if isinstance(a, np.ndarray) else a for a in args])
    marks = np.asarray(marks, dtype=np.float64)
    clocks = _step_clocks(g, marks, np.asarray(E, dtype=np.float64))
    return S, E, _slower(clocks), clocks, marks


def steady_steps(g: Graph, E, marks: np.ndarray, fix: Fix | None = None) -> np.ndarray:
    """The steps of a replay with ``fix`` that the backlog does not hold back (bool per step).

    The backlog is the warm-up steps' GPU work, still running when the window opens and written
    without its launches. A fix that only scales kernels reaches it (:func:`replay` scales the
    backlog's kernels as their namesakes'); one that moves launches, cuts CPU time or drops waits
    cannot, so in its replay the backlog drains as slowly as measured, and the steps whose CPU
    starts before it has drained (their launches wait for room in a queue it fills) run the
    unchanged run's pace, not the fixed one's. Those steps are left out of such a fix's saving
    (all steps where none would be left, or there is no backlog)."""
    ns = len(g.steps)
    keep = np.ones(ns, dtype=bool)
    n = g.backlog.size
    if ns < 2 or not g.backlog.any():
        return keep
    if fix is not None and not (
        fix.move or fix.drop_deps or fix.cpu_cuts or fix.cpu_adds or fix.free_syncs or fix.drop_inferred
    ):
        return keep
    drained = float(np.asarray(E[:n], dtype=np.float64)[g.backlog].max())
    keep = np.asarray(marks[0::2], dtype=np.float64)[:ns] >= drained
    return keep if keep.any() else np.ones(ns, dtype=bool)


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


def _stream_index(g: Graph) -> np.ndarray:
    """Each op's stream numbered 0.. in stream order (``np.unique``'s inverse), once per graph."""
    cached = getattr(g, "_stream_ix", None)
    if cached is None:
        cached = g._stream_ix = np.unique(g.stream, return_inverse=True)[1]  # type: ignore[attr-defined]
    return cached


def _backlog_starts(g: Graph) -> np.ndarray:
    """The measured starts, the backlog's first op on each stream moved to the window's first GPU
    work: the loop starts it there, and a later measured start is carried by its inferred edge or
    its kept wait (graph._unexplained_waits). Once per graph."""
    cached = getattr(g, "_backlog_starts", None)
    if cached is None:
        cached = g.start
        if g.backlog.any():
            bl = np.flatnonzero(g.backlog)
            bl = bl[np.argsort(g.key[bl], kind="stable")]
            first = bl[np.unique(g.stream[bl], return_index=True)[1]]
            cached = g.start.copy()
            cached[first] = g.start[bl].min()
        g._backlog_starts = cached  # type: ignore[attr-defined]
    return cached


def _sync_arrays(g: Graph) -> dict[str, np.ndarray]:
    """The blocking calls as arrays (built once per graph)."""
    cached = getattr(g, "_sync_cache", None)
    if cached is not None:
        return cached
    # column by column (one array of 5-tuples costs ~10x more), each value read as a float64 as before
    cols = [np.array(c, dtype=np.float64) for c in zip(*g.syncs)] if g.syncs else [np.zeros(0)] * 5
    rows = cols[4].astype(np.int64)
    out = {
        "ts": cols[0],
        "te": cols[1],
        "a": cols[2].astype(np.int64),
        "res": cols[3],
        "row": rows,
        "device": np.isin(rows, np.fromiter(g.device_syncs, dtype=np.int64, count=len(g.device_syncs))),
    }
    g._sync_cache = out  # type: ignore[attr-defined]
    return out


def _deps_flat(g: Graph) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``g.deps`` flattened in its order, once per graph (every replay of a plan reads it): each
    edge's op, awaited op and gap, and its place from the end of its op's list (0: the last)."""
    cached = getattr(g, "_deps_flat_cache", None)
    if cached is None:
        deps = g.deps
        sizes = np.fromiter(map(len, deps.values()), dtype=np.int64, count=len(deps))
        owner = np.repeat(np.fromiter(deps.keys(), dtype=np.int64, count=len(deps)), sizes)
        op = np.fromiter((a for dl in deps.values() for a, _ in dl), dtype=np.int64, count=owner.size)
        gap = np.fromiter((x for dl in deps.values() for _, x in dl), dtype=np.float64, count=owner.size)
        ends = np.cumsum(sizes)
        from_end = np.repeat(ends, sizes) - 1 - np.arange(owner.size)
        cached = g._deps_flat_cache = (owner, op, gap, from_end)  # type: ignore[attr-defined]
    return cached


def _deps_csr(
    g: Graph, drop: set[int] | np.ndarray, blind: bool = False, drop_inferred: set[int] | np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cross-stream edges as CSR arrays (ptr per op, awaited op, gap), without ``drop``'s
    (and, ``blind``, without the inferred ones; else without those of ``drop_inferred``)."""
    n = g.start.size
    owner, op, gap, from_end = _deps_flat(g)
    if blind:
        gone = np.asarray(g.inferred, dtype=np.int64)
    elif drop_inferred is not None and len(drop_inferred) and g.inferred:
        inf = np.asarray(g.inferred, dtype=np.int64)
        gone = inf[np.isin(inf, op_array(drop_inferred))]
    else:
        gone = np.zeros(0, dtype=np.int64)
    keep = None
    if gone.size:  # each op of ``gone`` loses its last edge (once per time it is named)
        times = np.bincount(gone, minlength=n)
        keep = from_end >= times[owner]
    if len(drop):
        k = ~np.isin(owner, op_array(drop))
        keep = k if keep is None else keep & k
    if keep is not None:
        owner, op, gap = owner[keep], op[keep], gap[keep]
    srt = np.argsort(owner, kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=n)[:n], out=ptr[1:])
    return ptr, op[srt], gap[srt]


def _replay_loop(
    ev_kind,
    ev_idx,
    ev_key,
    start,
    key,
    dur,
    backlog,
    g_launch,
    g_stream,
    g_comm,
    g_wait,
    stream,
    n_streams,
    pg,
    n_pgs,
    dep_ptr,
    dep_op,
    dep_gap,
    sy_ts,
    sy_te,
    sy_a,
    sy_res,
    sy_free,
    sy_device,
    meas_end,
    cut_len,
    n_marks,
    min_sync,
    cap_sync,
):
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
            # the backlog runs from the window's first GPU work on each stream (``start`` holds it
            # for the first of it on a stream: _backlog_starts), the rest of it queued behind;
            # other ops no earlier than their launch (or measured start), moved with the CPU
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
