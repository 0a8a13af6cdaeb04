"""What the CPU was doing while the GPU had nothing to run, and what FSDP's hooks cost the CPU.

The GPU's idle gaps are read over the steps' time (from the first step's start to the last one's
completion): the instants no GPU activity of any step runs. Each gap ends when the next activity
starts; the call that launched it says which CPU thread the GPU was waiting for, and when:

* a gap the GPU fell into while a **synchronization** was blocking the CPU (a sync call,
  ``.item()``, a blocking copy that started before the gap and returned inside it) is that
  synchronization's: it drained the launch queue, and the CPU must refill it (``sync_drain``,
  by call site);
* a gap whose next activity was launched before the gap began was not waiting for the CPU: the
  work was queued behind a dependency (another stream, an event, a peer) (``gpu_dependency``);
* otherwise, from the gap's start until the launch: what the launching thread was inside, the
  first that applies of an FSDP hook (by unit and hook), data loading (``DataLoader`` ranges),
  the optimizer step's CPU side, a kernel launch call, else Python and ops outside them
  (``python``); from the launch to the kernel's start, the launch itself (``launch``).

These measured gap times give the shares; :func:`fsdpdoctor.analysis.efficiency.split` scales
them to the waterfall's ``gpu_idle`` part. Every hook's CPU cost (per unit, per call) is read
from the outermost FSDP hook ranges in the steps, blocking calls inside them left out.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from fsdpdoctor.ingest.shapes import canonical, decode_list
from fsdpdoctor.facts.efficiency import EfficiencyFacts, HookCost, IdleOp, SyncSite
from fsdpdoctor.ingest.events import KERNEL_LAUNCHES
from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.comms import LAUNCH_CATS, SYNC_NAMES
from fsdpdoctor.analysis.labels import enclosing
from fsdpdoctor.analysis.rows import name_rows
from fsdpdoctor.analysis.steps import StepWindow
from fsdpdoctor.analysis.timeline import GpuSteps

LAUNCH_CALLS = (*KERNEL_LAUNCHES, "cudaMemcpyAsync", "cudaMemsetAsync", "hipMemcpyAsync", "hipMemsetAsync")
_FSDP2 = re.compile(r"^FSDP::(?P<hook>[A-Za-z_]+)(?: \((?P<fqn>[^)]*)\))?(?: for (?P<target>\S+))?")
_FSDP1 = "FullyShardedDataParallel."


def is_hook_label(name: str) -> bool:
    """FSDP's own CPU work: FSDP2 ``FSDP::*`` ranges, FSDP1 ``FullyShardedDataParallel._*`` hooks
    (not ``FullyShardedDataParallel.forward``, which holds the module's forward, nor the rate
    limiter's wait)."""
    return name.startswith(("FSDP::", "FullyShardedDataParallel._")) and name != "FullyShardedDataParallel.rate_limiter"


@functools.lru_cache(maxsize=4096)  # a trace repeats a few hundred hook labels many times
def hook_of(name: str) -> tuple[str, str]:
    """(unit, hook) of a hook label: ``FSDP::pre_forward (layers.0)`` → ("layers.0", "pre_forward");
    FSDP2's root hooks have no FQN (""); FSDP1's labels name no unit ("(unnamed)")."""
    m = _FSDP2.match(name)
    if m:
        hook = m.group("hook")
        unit = m.group("fqn") or m.group("target") or ""
    else:
        hook = name.removeprefix(_FSDP1).strip("_").removesuffix("_hook")
        unit = "(unnamed)"
    if hook.startswith("post_backward"):
        hook = "post_backward"
    elif hook.startswith("root_post_backward"):
        hook = "root_post_backward"
    return unit, hook


def _cpu_rows(rt: RankTrace, pred) -> np.ndarray:
    return name_rows(rt, pred, "cpu_op", "user_annotation")


def _outermost(rt: RankTrace, rows: np.ndarray) -> np.ndarray:
    """Those of ``rows`` no other of them encloses (on its thread), in start order per thread."""
    out = []
    for th in np.unique(rt.thread[rows]).tolist():
        r = rows[rt.thread[rows] == th]
        r = r[np.lexsort((-(rt.ts[r] + rt.dur[r]), rt.ts[r]))]  # by start, the longer first
        e = (rt.ts[r] + rt.dur[r]).astype(np.float64)
        before = np.concatenate(([-np.inf], np.maximum.accumulate(e)[:-1]))
        out.append(r[rt.ts[r] >= before - 1e-6])  # starts where everything before it has ended
    return np.concatenate(out) if out else rows


def idle_and_hooks(
    eff: EfficiencyFacts,
    rt: RankTrace,
    steps: list[StepWindow],
    windows: iv.Intervals,
    busy: iv.Intervals,
    gs: GpuSteps,
    spans: list | None = None,
) -> None:
    """Fill ``eff.idle_ms`` (measured, by cause), ``hooks`` and ``syncs``: the idle gaps are
    ``windows`` (the steps' intervals on the step clock) less ``busy`` (all GPU activity).
    ``spans`` (a list, optional) receives each attributed piece of idle as
    ``(start_us, end_us, cause, detail)`` (detail: the sync site, the FSDP hook ``unit hook``, or
    ""); the pieces of a cause add up to its measured time."""
    n = max(len(steps), 1)
    g = gs.g
    lo, hi = float(windows[0][0]), float(windows[1][-1])
    classified = g.comm | g.compute | g.memory
    s_all = rt.ts[g.rows].astype(np.float64)
    gaps = iv.subtract(windows, busy)
    g0, g1 = gaps
    causes: dict[str, float] = {}
    c0, c1 = float(steps[0].start), float(steps[-1].end)  # the steps' CPU spans: their hooks and syncs
    hooks = _hook_rows(rt, min(lo, c0), max(hi, c1))
    hook_wait: dict[tuple[str, str], float] = {}
    sync_idle: dict[str, float] = {}
    drains: list[int] = []
    inside: dict = {}  # GPU idle by the CPU ranges the launching thread was inside (_inside)
    if g0.size:
        # the activity each gap waits for: the first to start at or after the gap's end
        act = np.flatnonzero(classified)
        act = act[np.argsort(s_all[act], kind="stable")]
        k = np.searchsorted(s_all[act], g1, side="left")
        has_next = k < act.size
        nxt = np.where(has_next, act[np.minimum(k, max(act.size - 1, 0))], -1)
        lrow = np.where(nxt >= 0, g.launch_row[np.maximum(nxt, 0)] if g.launch_row is not None else -1, -1)
        # synchronizations that drained the queue: began before the gap, returned inside it
        drained = np.zeros(g0.size, dtype=bool)
        sync_site, drains = _drain_syncs(rt, gaps, lo, hi)
        for gi, site in sync_site.items():
            drained[gi] = True
            sync_idle[site] = sync_idle.get(site, 0.0) + float(g1[gi] - g0[gi])
            if spans is not None:
                spans.append((float(g0[gi]), float(g1[gi]), "sync_drain", site))
        causes["sync_drain"] = sum(sync_idle.values())
        rest = ~drained
        lt = np.where(lrow >= 0, rt.ts[np.maximum(lrow, 0)], np.nan)
        queued = rest & ((lrow < 0) & has_next | (lrow >= 0) & (lt <= g0))
        causes["gpu_dependency"] = float(np.sum(g1[queued] - g0[queued]))
        waiting = rest & ~queued & (lrow >= 0)
        causes["launch"] = float(np.sum(g1[waiting] - np.maximum(lt[waiting], g0[waiting])))
        if spans is not None:
            spans.extend((float(a), float(b), "gpu_dependency", "") for a, b in zip(g0[queued], g1[queued]))
            la = np.maximum(lt[waiting], g0[waiting])
            spans.extend((float(a), float(b), "launch", "") for a, b in zip(la, g1[waiting]) if b > a)
        # the tail after the last activity (or gaps whose activity has no launch): the main thread's
        tail = rest & ~queued & (lrow < 0)
        thread = np.where(lrow >= 0, rt.thread[np.maximum(lrow, 0)], _main_thread(rt, steps)).astype(np.int64)
        cut = np.where(waiting, np.minimum(lt, g1), g1)
        _by_cpu_state(rt, thread, g0, cut, waiting | tail, hooks, causes, hook_wait, inside, spans)
    eff.idle_ms = {c: v / 1e3 / n for c, v in causes.items() if v > 0}
    eff.hooks = _hook_costs(rt, hooks[(rt.ts[hooks] >= c0) & (rt.ts[hooks] < c1)], hook_wait, n)
    comm_rows = g.rows[g.comm]
    comm = iv.merge(rt.ts[comm_rows], rt.ts[comm_rows] + rt.dur[comm_rows])
    eff.syncs = _sync_costs(rt, c0, c1, sync_idle, drains, n, busy, comm)
    host = sum(v for k, v in causes.items() if k not in ("sync_drain", "gpu_dependency"))
    eff.idle_ops = _idle_ops(rt, c0, c1, inside, host, n)
    eff.compiled_ms = _compiled_ms(rt, c0, c1, n)


def _main_thread(rt: RankTrace, steps: list[StepWindow]) -> int:
    rows = _cpu_rows(rt, lambda x: x.startswith("ProfilerStep#"))
    return int(rt.thread[rows[0]]) if rows.size else -1


def _hook_rows(rt: RankTrace, lo: float, hi: float) -> np.ndarray:
    rows = _cpu_rows(rt, is_hook_label)
    rows = rows[(rt.ts[rows] >= lo) & (rt.ts[rows] < hi)]
    return _outermost(rt, rows)


def _by_cpu_state(rt, thread, g0, g1, sel, hooks, causes, hook_wait, inside=None, spans=None) -> None:
    """Attribute the gap pieces [g0, g1] selected by ``sel`` by what their thread was inside
    (and, into ``inside``, by every CPU range around them: :func:`_inside`; into ``spans``, each
    piece with its cause: :func:`idle_and_hooks`)."""
    idx = np.flatnonzero(sel & (g1 > g0))
    if idx.size == 0:
        return
    dl = _cpu_rows(rt, is_data_loading)
    ranges = _cpu_rows(rt, lambda x: not x.startswith("ProfilerStep#")) if inside is not None else None
    opt = _cpu_rows(rt, lambda x: x.startswith("Optimizer.step#"))
    launches = name_rows(rt, lambda x: x in LAUNCH_CALLS, *LAUNCH_CATS)
    for th in np.unique(thread[idx]).tolist():
        mine = idx[thread[idx] == th]
        target = iv.merge(g0[mine], g1[mine])
        if ranges is not None:
            _inside(rt, target, ranges[rt.thread[ranges] == th], inside)
        h = hooks[rt.thread[hooks] == th]
        if h.size:
            labels = np.empty(h.size, dtype=object)
            labels[:] = [hook_of(rt.row_name(int(r))) for r in h.tolist()]
            got = iv.attribute(target, rt.ts[h].astype(np.float64), (rt.ts[h] + rt.dur[h]).astype(np.float64), labels)
            for lab, us in got.items():
                if lab is not None:
                    hook_wait[lab] = hook_wait.get(lab, 0.0) + us
                    causes["fsdp_hooks"] = causes.get("fsdp_hooks", 0.0) + us
            if spans is not None:
                _hook_spans(rt, target, h, labels, spans)
            target = iv.subtract(target, iv.merge(rt.ts[h], rt.ts[h] + rt.dur[h]))
        for cause, rows in (("data_loading", dl), ("optimizer_cpu", opt), ("launch", launches)):
            r = rows[rt.thread[rows] == th]
            if r.size and target[0].size:
                cover = iv.merge(rt.ts[r], rt.ts[r] + rt.dur[r])
                causes[cause] = causes.get(cause, 0.0) + iv.intersect_len(target, cover)
                if spans is not None:
                    a, b = iv.intersect(target, cover)
                    spans.extend((float(x), float(y), cause, "") for x, y in zip(a, b) if y > x)
                target = iv.subtract(target, cover)
        causes["python"] = causes.get("python", 0.0) + iv.total(target)
        if spans is not None:
            spans.extend((float(x), float(y), "python", "") for x, y in zip(*target) if y > x)


def _hook_spans(rt: RankTrace, target: iv.Intervals, h: np.ndarray, labels: np.ndarray, spans: list) -> None:
    """The pieces of ``target`` inside each hook range of ``h`` (outermost ranges of one thread,
    so disjoint: what :func:`iv.attribute` gives each label, as intervals), each as ``fsdp_hooks``
    with its ``unit hook``."""
    order = np.argsort(rt.ts[h], kind="stable")
    cursor = -np.inf
    for i in order.tolist():
        a, b = max(float(rt.ts[h[i]]), cursor), float(rt.ts[h[i]] + rt.dur[h[i]])
        cursor = max(cursor, b)
        if b <= a:
            continue
        unit, hook = labels[i]
        detail = f"{unit or '(root)'} {hook}"
        spans.extend((float(x), float(y), "fsdp_hooks", detail) for x, y in zip(*iv.clip(target, a, b)) if y > x)


def is_data_loading(name: str) -> bool:
    """A data-loading range: the DataLoader's own (``enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__``)
    or a user annotation that says so (``## data_load ##``)."""
    n = name.lower()
    return "dataloader" in n or "data_load" in n or "dataload" in n


def _inside(rt: RankTrace, target: iv.Intervals, rows: np.ndarray, out: dict) -> None:
    """Add to ``out["idle"]`` (name code → µs) the measure of ``target`` inside each of ``rows``
    (ranges on one thread, which nest; a name nested in itself counted once), and to
    ``out["parent"]`` (name code, enclosing name code) → µs of the former inside the latter."""
    t0, t1 = target
    if t0.size == 0 or rows.size == 0:
        return
    s, e = rt.ts[rows].astype(np.float64), (rt.ts[rows] + rt.dur[rows]).astype(np.float64)
    cum = iv.running_total(target)
    got = iv.measure_below(target, e, cum) - iv.measure_below(target, s, cum)
    keep = got > 0
    rows, s, e, got = rows[keep], s[keep], e[keep], got[keep]
    order = start_order(s, e)
    rows, s, e, got = rows[order], s[order], e[order], got[order]
    codes = rt.name[rows].astype(np.int64)
    idle, parent = out.setdefault("idle", {}), out.setdefault("parent", {})
    nest = _nesting(s, e, codes)
    if nest is None:  # ranges that overlap without nesting: the stack walk itself
        _inside_loop(codes.tolist(), s.tolist(), e.tolist(), got.tolist(), idle, parent)
        return
    up, same = nest
    child = np.flatnonzero(up >= 0)
    child = child[codes[up[child]] != codes[child]]
    _accumulate(parent, codes[child] << 32 | codes[up[child]], got[child], pairs=True)
    _accumulate(idle, codes[~same], got[~same])


def start_order(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """``np.lexsort((-e, s))``: by start, the longer first, else as given. A trace's ranges come
    in start order with the outer first, so one stable sort by start (nearly free on sorted
    input, where the lexsort costs ~10 ms per 200,000 ranges) is that order unless some starts
    tie with the shorter first, which the lexsort then orders."""
    order = np.argsort(s, kind="stable")
    so, eo = s[order], e[order]
    if np.any((so[1:] == so[:-1]) & (eo[1:] > eo[:-1])):
        return np.lexsort((-e, s))
    return order


def _inside_loop(codes: list, s: list, e: list, got: list, idle: dict, parent: dict) -> None:
    """:func:`_inside`'s walk, range by range, with a stack of the open ranges."""
    stack: list[tuple[float, int]] = []  # (end, name code) of the open ranges
    for c, a, b, us in zip(codes, s, e, got):
        while stack and stack[-1][0] <= a:
            stack.pop()
        if stack and stack[-1][1] != c:
            parent[(c, stack[-1][1])] = parent.get((c, stack[-1][1]), 0.0) + us
        if all(pc != c for _, pc in stack):
            idle[c] = idle.get(c, 0.0) + us
        stack.append((b, c))


def _nesting(s: np.ndarray, e: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """For ranges sorted by start (then longest first), each of non-zero length: the index of
    the range that :func:`_inside_loop`'s stack has on top when it comes to each one (-1: none)
    and whether a range of its own name is on the stack, or None where the ranges do not nest
    (a range that ends after the one it starts in), which the walk alone defines.

    Where every range ends no later than the range on top of the stack, the stack holds exactly
    the earlier ranges that end after a range's start (their ends fall from bottom to top, so
    the pops remove exactly the others): a range's depth is how many they are, and the top is
    the last earlier range one level up. Checked range by range, in order, so the first range
    that breaks it is found before anything depends on it."""
    n = s.size
    if not np.all(e > s):  # (NaN too)
        return None
    depth = np.arange(n) - np.searchsorted(np.sort(e), s, side="right")
    # by depth, then index (a small int: numpy's stable sort of 16-bit ints is a radix sort)
    by_depth = np.argsort(depth.astype(np.int16) if n and depth.max() < 2**15 else depth, kind="stable")
    keyed = depth[by_depth] * (n + 1) + by_depth
    up = np.full(n, -1, dtype=np.int64)
    deep = by_depth[depth[by_depth] > 0]
    # each deep range's (depth - 1, index): in this order, ascending like ``keyed`` itself
    pos = np.searchsorted(keyed, keyed[n - deep.size :] - (n + 1)) - 1
    if deep.size:
        if pos.min() < 0:
            return None
        top = by_depth[pos]
        if np.any(depth[top] != depth[deep] - 1) or np.any(e[deep] > e[top]):
            return None
        up[deep] = top
    same = np.zeros(n, dtype=bool)
    act, anc = deep, up[deep]
    while act.size:  # up the chain of enclosing ranges, one level a round
        hit = codes[anc] == codes[act]
        same[act[hit]] = True
        on = ~hit & (up[anc] >= 0)
        act, anc = act[on], up[anc[on]]
    return up, same


def _accumulate(out: dict, keys: np.ndarray, values: np.ndarray, pairs: bool = False) -> None:
    """``out[k] = out.get(k, 0.0) + v`` for each (k, v) in order, keys new to ``out`` added in
    order of first appearance: the same sums, to the last bit (``np.bincount`` adds its weights
    in order, each key's from its earlier value). ``pairs``: keys are ``a << 32 | b`` for (a, b).
    Keys (name codes, or pairs of them) are counted in a table as long as the codes are small,
    else numbered with ``np.unique`` (a sort)."""
    if keys.size == 0:
        return
    if pairs:
        a, b = keys >> 32, keys & 0xFFFFFFFF
        width = int(max(a.max(), b.max())) + 1
        dense, span = a * width + b, width * width
    else:
        width, dense, span = 1, keys, int(keys.max()) + 1
    if keys.min() < 0 or span > max(4 * keys.size, 1 << 16):
        uniq, first_at, inv = np.unique(keys, return_index=True, return_inverse=True)
        index = inv.ravel()
        names = [(int(k) >> 32, int(k) & 0xFFFFFFFF) for k in uniq.tolist()] if pairs else uniq.tolist()
    else:  # a table of the keys: first appearances by np.minimum.at, no sort
        first = np.full(span, keys.size, dtype=np.int64)
        np.minimum.at(first, dense, np.arange(keys.size))
        uniq = np.flatnonzero(first < keys.size)
        first_at = first[uniq]
        lookup = np.zeros(span, dtype=np.int64)
        lookup[uniq] = np.arange(uniq.size)
        index = lookup[dense]
        names = [(k // width, k % width) for k in uniq.tolist()] if pairs else uniq.tolist()
    prior = np.array([out.get(k, 0.0) for k in names], dtype=np.float64)
    sums = np.bincount(
        np.concatenate((np.arange(uniq.size), index)), np.concatenate((prior, values)), minlength=uniq.size
    ).tolist()
    for j in np.argsort(first_at, kind="stable").tolist():
        out[names[j]] = sums[j]


TOP_IDLE_OPS = 12
IDLE_OP_MIN_SHARE = 0.02  # a range holding less of the idle it is attributed from is not listed
WRAPPER_SHARE = 0.6  # a range one of whose listed inner ranges holds this share of its idle is a wrapper


def _idle_ops(rt: RankTrace, lo: float, hi: float, inside: dict, total_us: float, n: int) -> list[IdleOp]:
    """The CPU ranges the GPU's idle was spent in (:func:`_inside`): the most specific ones, the
    most first (a range is left out where a range inside it holds most of its idle), with each
    name's CPU time in the steps (its outermost calls)."""
    idle: dict[int, float] = inside.get("idle", {})
    if not idle or total_us <= 0:
        return []
    listed = {c for c, us in idle.items() if us >= IDLE_OP_MIN_SHARE * total_us}
    # an aten op inside (view, empty, copy_) does not make its caller a wrapper: the caller says more
    wrappers = {
        p
        for (c, p), us in inside.get("parent", {}).items()
        if c in listed and us >= WRAPPER_SHARE * idle[p] and not rt.names[c].startswith("aten::")
    }
    specific = listed - wrappers
    out = []
    for code in sorted(specific, key=lambda c: -idle[c])[:TOP_IDLE_OPS]:
        rows = np.flatnonzero(rt.mask_cat("cpu_op", "user_annotation") & (rt.name == code))
        rows = _outermost(rt, rows[(rt.ts[rows] >= lo) & (rt.ts[rows] < hi)])
        out.append(IdleOp(rt.names[code], idle[code] / 1e3 / n, float(rt.dur[rows].sum()) / 1e3 / n))
    return out


COMPILED = ("CompiledFunction", "CompiledFunctionBackward", "Torch-Compiled Region")


def _compiled_ms(rt: RankTrace, lo: float, hi: float, n: int) -> float:
    """CPU time per step in compiled regions (torch.compile's ``CompiledFunction`` /
    ``Torch-Compiled Region`` ranges, outermost)."""
    rows = _cpu_rows(rt, lambda x: x in COMPILED or x.startswith("Torch-Compiled Region"))
    rows = _outermost(rt, rows[(rt.ts[rows] >= lo) & (rt.ts[rows] < hi)])
    return float(rt.dur[rows].sum()) / 1e3 / n


#: calls that wait for the GPU whatever they are given (``SYNC_NAMES`` also holds the copies,
#: which block only from or to pageable memory)
EXPLICIT_SYNCS = (
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "hipDeviceSynchronize",
    "hipStreamSynchronize",
    "hipEventSynchronize",
    "hipMemcpy",
)
BLOCKED_COPY_US = 50.0  # a copy call this long waited for the GPU (a launch takes a few µs)


def _sync_rows(rt: RankTrace, lo: float, hi: float, explicit: bool = False) -> np.ndarray:
    """Calls that blocked on the GPU in [lo, hi): the explicit synchronizations, and (unless
    ``explicit``) copy calls that lasted BLOCKED_COPY_US or more."""
    rows = name_rows(rt, lambda x: x in SYNC_NAMES, *LAUNCH_CATS)
    rows = rows[(rt.ts[rows] >= lo) & (rt.ts[rows] < hi)]
    sync = np.isin(rt.name[rows], rt.name_codes(lambda x: x in EXPLICIT_SYNCS))
    return rows[sync] if explicit else rows[sync | (rt.dur[rows] >= BLOCKED_COPY_US)]


def _drain_syncs(rt: RankTrace, gaps, lo: float, hi: float) -> tuple[dict[int, str], list[int]]:
    """(gap index → the site of the synchronization that drained the GPU into it: a blocking call
    that began before the gap and returned inside it (the GPU finished while the CPU waited), those
    calls' rows)."""
    rows = _sync_rows(rt, lo, hi)
    g0, g1 = gaps
    if rows.size == 0 or g0.size == 0:
        return {}, []
    te = (rt.ts[rows] + rt.dur[rows]).astype(np.float64)
    k = np.searchsorted(g0, te, side="right") - 1
    ok = (k >= 0) & (te < g1[np.maximum(k, 0)]) & (rt.ts[rows] < g0[np.maximum(k, 0)])
    out: dict[int, str] = {}
    sites = _sites(rt, rows[ok])
    for r, gi in zip(rows[ok].tolist(), k[ok].tolist()):
        out.setdefault(int(gi), sites[r])
    return out, rows[ok].tolist()


def _sites(rt: RankTrace, rows: np.ndarray) -> dict[int, str]:
    """A call site for each synchronization row (:func:`_site_info`'s site)."""
    return {r: v[0] for r, v in _site_info(rt, rows).items()}


def _site_info(rt: RankTrace, rows: np.ndarray) -> dict[int, tuple[str, str | None, int]]:
    """(site, innermost user annotation, outermost aten op row or -1) for each synchronization
    row. The site: the innermost user range › the outermost aten op around the call (``aten::item``,
    ``aten::to``) with its first input where shapes were recorded, else the innermost FSDP / user
    range, then the call."""
    if rows.size == 0:
        return {}
    threads = np.unique(rt.thread[rows])
    cand = np.flatnonzero(rt.mask_cat("cpu_op", "user_annotation") & np.isin(rt.thread, threads))
    # only the ranges that hold one of the calls' starts (any thread: the sweep sorts them out)
    t = np.sort(rt.ts[rows].astype(np.float64))
    cand = cand[np.searchsorted(t, rt.ts[cand], "left") < np.searchsorted(t, rt.ts[cand] + rt.dur[cand], "right")]
    chains = enclosing(rt, cand, rows)
    ann_cat = rt.cat_code("user_annotation")
    out = {}
    for r in rows.tolist():
        chain = chains.get(r, [])
        names = [rt.row_name(c) for c in chain]
        aten = [c for c, x in zip(chain, names) if x.startswith("aten::")]
        other = [x for x in names if not x.startswith(("aten::", "ProfilerStep#"))]
        ann = [x for c, x in zip(chain, names) if rt.cat[c] == ann_cat and not x.startswith("ProfilerStep#")]
        where = rt.row_name(aten[0]) if aten else (other[-1] if other else "")
        tensor = _tensor(rt, aten[0]) if aten else None
        if tensor:  # one site per tensor: a 704-byte read-back is not a 48-byte one
            where = f"{where}({tensor})"
        call = rt.row_name(r)
        site = f"{where} → {call}" if where else call
        a = ann[-1] if ann else None
        if a is not None and aten:
            site = f"{a} › {site}"
        out[r] = (site, a, aten[0] if aten else -1)
    return out


def _tensor(rt: RankTrace, op: int) -> str | None:
    """The op's first input as ``dtype[d0, d1]`` where its shapes were recorded."""
    a = rt.args.get(op) if op >= 0 else None
    if a is None or a.input_dims is None:
        return None
    dims, types = decode_list(a.input_dims), decode_list(a.input_type)
    if not dims or not isinstance(dims[0], list) or not dims[0] or not all(isinstance(d, int) for d in dims[0]):
        return None
    t = types[0] if types and isinstance(types[0], str) and types[0] else "?"
    return f"{canonical(t) or t}[{', '.join(str(d) for d in dims[0])}]"


def _copies(rt: RankTrace, rows: np.ndarray) -> dict[int, tuple[str, float]]:
    """For the copy calls among ``rows``: (the copy's kind "DtoH (Device -> Pageable)", bytes)
    of the GPU copy with the call's correlation id."""
    out: dict[int, tuple[str, float]] = {}
    calls = rows[rt.correlation[rows] >= 0]
    if calls.size == 0:
        return out
    gpu = np.flatnonzero(rt.mask_cat("gpu_memcpy") & np.isin(rt.correlation, rt.correlation[calls]))
    by_corr = {int(c): int(g) for c, g in zip(rt.correlation[gpu].tolist(), gpu.tolist())}
    for r in calls.tolist():
        g = by_corr.get(int(rt.correlation[r]))
        if g is not None:
            a = rt.args.get(g)
            nb = a.nbytes if a is not None and isinstance(a.nbytes, int) else 0
            out[r] = (rt.row_name(g).removeprefix("Memcpy "), float(nb))
    return out


def _hook_costs(rt: RankTrace, hooks: np.ndarray, wait: dict, n: int) -> list[HookCost]:
    if hooks.size == 0:
        return []
    blocked = _sync_rows(rt, -np.inf, np.inf)
    own = rt.dur[hooks].astype(np.float64)
    for th in np.unique(rt.thread[hooks]).tolist():
        m = rt.thread[hooks] == th
        b = blocked[rt.thread[blocked] == th]
        if b.size:
            h = hooks[m]
            bs = iv.merge(rt.ts[b], rt.ts[b] + rt.dur[b])
            own[m] = np.maximum(
                own[m] - (iv.measure_below(bs, rt.ts[h] + rt.dur[h]) - iv.measure_below(bs, rt.ts[h])), 0.0
            )
    codes, inv = np.unique(rt.name[hooks], return_inverse=True)  # by label, then by (unit, hook)
    us = np.bincount(inv.reshape(-1), weights=own, minlength=codes.size)
    calls = np.bincount(inv.reshape(-1), minlength=codes.size)
    out: dict[tuple[str, str], HookCost] = {}
    for code, u, c in zip(codes.tolist(), us.tolist(), calls.tolist()):
        key = hook_of(rt.names[code])
        h = out.setdefault(
            key,
            HookCost(
                unit=key[0],
                hook=key[1],
                calls_per_step=0.0,
                cpu_ms_per_step=0.0,
                gpu_wait_ms_per_step=wait.get(key, 0.0) / 1e3 / n,
            ),
        )
        h.calls_per_step += c / n
        h.cpu_ms_per_step += u / 1e3 / n
    return sorted(out.values(), key=lambda c: (-c.gpu_wait_ms_per_step, -c.cpu_ms_per_step, c.unit, c.hook))


def _while_blocked(
    rt: RankTrace, rows: np.ndarray, busy: iv.Intervals | None, comm: iv.Intervals | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each call of ``rows``: the GPU's busy time inside it, the collectives' time inside it,
    and its longest GPU idle gap (µs), for every call at once."""
    zero = np.zeros(rows.size)
    if busy is None or rows.size == 0:
        return zero, zero, zero
    ts, te = rt.ts[rows].astype(np.float64), (rt.ts[rows] + rt.dur[rows]).astype(np.float64)
    work = iv.measure_below(busy, te) - iv.measure_below(busy, ts) if busy[0].size else zero
    in_comm = iv.measure_below(comm, te) - iv.measure_below(comm, ts) if comm is not None and comm[0].size else zero
    # the idle gaps (busy's complement) each call overlaps: the longest, clipped to the call
    gs = np.concatenate(([-np.inf], busy[1]))
    ge = np.concatenate((busy[0], [np.inf]))
    lo = np.searchsorted(ge, ts, side="right")
    hi = np.searchsorted(gs, te, side="left")
    counts = np.maximum(hi - lo, 0)
    longest = np.zeros(rows.size)
    if counts.sum():
        ci = np.repeat(np.arange(rows.size), counts)
        gi = np.repeat(lo, counts) + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        length = np.maximum(np.minimum(ge[gi], te[ci]) - np.maximum(gs[gi], ts[ci]), 0.0)
        np.maximum.at(longest, ci, length)
    return work, in_comm, longest


def _sync_costs(
    rt: RankTrace,
    lo: float,
    hi: float,
    idle: dict[str, float],
    drains: list[int],
    n: int,
    busy: iv.Intervals | None = None,
    comm: iv.Intervals | None = None,
) -> list[SyncSite]:
    """The explicit synchronizations, the copies that blocked and the calls that drained the
    queue (``drains``), by site, with what the GPU did while each blocked (``busy``: all GPU
    activity, ``comm``: the collectives')."""
    rows = np.union1d(_sync_rows(rt, lo, hi), np.array(drains, dtype=np.int64))
    info = _site_info(rt, rows)
    copies = _copies(rt, rows)
    work, in_comm, longest = _while_blocked(rt, rows, busy, comm)
    out: dict[str, SyncSite] = {}
    nbytes: dict[str, list[float]] = {}
    for i, r in enumerate(rows.tolist()):
        site, ann, op = info[r]
        s = out.get(site)
        if s is None:
            s = out[site] = SyncSite(
                site=site,
                calls_per_step=0.0,
                cpu_ms_per_step=0.0,
                gpu_idle_ms_per_step=idle.get(site, 0.0) / 1e3 / n,
                annotation=ann,
                op=rt.row_name(op) if op >= 0 else None,
                tensor=_tensor(rt, op),
            )
        s.calls_per_step += 1.0 / n
        s.cpu_ms_per_step += float(rt.dur[r]) / 1e3 / n
        if r in copies:
            s.copy = s.copy or copies[r][0]
            nbytes.setdefault(site, []).append(copies[r][1])
        if busy is not None:
            s.waited_busy_ms_per_step += float(work[i]) / 1e3 / n
            s.waited_idle_ms_per_step += max(float(rt.dur[r]) - float(work[i]), 0.0) / 1e3 / n
            s.waited_comm_ms_per_step += float(in_comm[i]) / 1e3 / n
            s.longest_idle_ms = max(s.longest_idle_ms, float(longest[i]) / 1e3)
    for site, b in nbytes.items():
        out[site].bytes_per_call = float(np.mean(b))
    return sorted(out.values(), key=lambda s: (-s.gpu_idle_ms_per_step, -s.cpu_ms_per_step, s.site))
