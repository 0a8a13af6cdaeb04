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

from ..facts_efficiency import EfficiencyFacts, HookCost, SyncSite
from ..ingest.kineto import RankTrace
from . import intervals as iv
from .comms import LAUNCH_CATS, SYNC_NAMES
from .labels import enclosing
from .steps import StepWindow
from .timeline import GpuSteps

LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "hipLaunchKernel",
    "hipExtLaunchKernel",
    "hipModuleLaunchKernel",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
)
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
    return np.flatnonzero(rt.mask_cat("cpu_op", "user_annotation") & rt.mask_names(pred))


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
) -> None:
    """Fill ``eff.idle_ms`` (measured, by cause), ``hooks`` and ``syncs``: the idle gaps are
    ``windows`` (the steps' intervals on the step clock) less ``busy`` (all GPU activity)."""
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
        causes["sync_drain"] = sum(sync_idle.values())
        rest = ~drained
        lt = np.where(lrow >= 0, rt.ts[np.maximum(lrow, 0)], np.nan)
        queued = rest & ((lrow < 0) & has_next | (lrow >= 0) & (lt <= g0))
        causes["gpu_dependency"] = float(np.sum(g1[queued] - g0[queued]))
        waiting = rest & ~queued & (lrow >= 0)
        causes["launch"] = float(np.sum(g1[waiting] - np.maximum(lt[waiting], g0[waiting])))
        # the tail after the last activity (or gaps whose activity has no launch): the main thread's
        tail = rest & ~queued & (lrow < 0)
        thread = np.where(lrow >= 0, rt.thread[np.maximum(lrow, 0)], _main_thread(rt, steps)).astype(np.int64)
        cut = np.where(waiting, np.minimum(lt, g1), g1)
        _by_cpu_state(rt, thread, g0, cut, waiting | tail, hooks, causes, hook_wait)
    eff.idle_ms = {c: v / 1e3 / n for c, v in causes.items() if v > 0}
    eff.hooks = _hook_costs(rt, hooks[(rt.ts[hooks] >= c0) & (rt.ts[hooks] < c1)], hook_wait, n)
    eff.syncs = _sync_costs(rt, c0, c1, sync_idle, drains, n)


def _main_thread(rt: RankTrace, steps: list[StepWindow]) -> int:
    rows = _cpu_rows(rt, lambda x: x.startswith("ProfilerStep#"))
    return int(rt.thread[rows[0]]) if rows.size else -1


def _hook_rows(rt: RankTrace, lo: float, hi: float) -> np.ndarray:
    rows = _cpu_rows(rt, is_hook_label)
    rows = rows[(rt.ts[rows] >= lo) & (rt.ts[rows] < hi)]
    return _outermost(rt, rows)


def _by_cpu_state(rt, thread, g0, g1, sel, hooks, causes, hook_wait) -> None:
    """Attribute the gap pieces [g0, g1] selected by ``sel`` by what their thread was inside."""
    idx = np.flatnonzero(sel & (g1 > g0))
    if idx.size == 0:
        return
    dl = _cpu_rows(rt, lambda x: "DataLoader" in x)
    opt = _cpu_rows(rt, lambda x: x.startswith("Optimizer.step#"))
    launches = np.flatnonzero(rt.mask_cat(*LAUNCH_CATS) & rt.mask_names(lambda x: x in LAUNCH_CALLS))
    for th in np.unique(thread[idx]).tolist():
        mine = idx[thread[idx] == th]
        target = iv.merge(g0[mine], g1[mine])
        h = hooks[rt.thread[hooks] == th]
        if h.size:
            labels = np.empty(h.size, dtype=object)
            labels[:] = [hook_of(rt.row_name(int(r))) for r in h.tolist()]
            got = iv.attribute(target, rt.ts[h].astype(np.float64), (rt.ts[h] + rt.dur[h]).astype(np.float64), labels)
            for lab, us in got.items():
                if lab is not None:
                    hook_wait[lab] = hook_wait.get(lab, 0.0) + us
                    causes["fsdp_hooks"] = causes.get("fsdp_hooks", 0.0) + us
            target = iv.subtract(target, iv.merge(rt.ts[h], rt.ts[h] + rt.dur[h]))
        for cause, rows in (("data_loading", dl), ("optimizer_cpu", opt), ("launch", launches)):
            r = rows[rt.thread[rows] == th]
            if r.size and target[0].size:
                cover = iv.merge(rt.ts[r], rt.ts[r] + rt.dur[r])
                causes[cause] = causes.get(cause, 0.0) + iv.intersect_len(target, cover)
                target = iv.subtract(target, cover)
        causes["python"] = causes.get("python", 0.0) + iv.total(target)


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
    rows = np.flatnonzero(rt.mask_cat(*LAUNCH_CATS) & rt.mask_names(lambda x: x in SYNC_NAMES))
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
    """A call site for each synchronization row: the outermost aten op around it (``aten::item``,
    ``aten::to``), else the innermost FSDP / user range, then the call."""
    if rows.size == 0:
        return {}
    threads = np.unique(rt.thread[rows])
    cand = np.flatnonzero(rt.mask_cat("cpu_op", "user_annotation") & np.isin(rt.thread, threads))
    # only the ranges that hold one of the calls' starts (any thread: the sweep sorts them out)
    t = np.sort(rt.ts[rows].astype(np.float64))
    cand = cand[np.searchsorted(t, rt.ts[cand], "left") < np.searchsorted(t, rt.ts[cand] + rt.dur[cand], "right")]
    chains = enclosing(rt, cand, rows)
    out = {}
    for r in rows.tolist():
        names = [rt.row_name(c) for c in chains.get(r, [])]
        aten = [x for x in names if x.startswith("aten::")]
        other = [x for x in names if not x.startswith(("aten::", "ProfilerStep#"))]
        where = aten[0] if aten else (other[-1] if other else "")
        call = rt.row_name(r)
        out[r] = f"{where} → {call}" if where else call
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


def _sync_costs(
    rt: RankTrace, lo: float, hi: float, idle: dict[str, float], drains: list[int], n: int
) -> list[SyncSite]:
    """The explicit synchronizations and the calls that drained the queue (``drains``), by site."""
    rows = np.union1d(_sync_rows(rt, lo, hi, explicit=True), np.array(drains, dtype=np.int64))
    sites = _sites(rt, rows)
    out: dict[str, SyncSite] = {}
    for r in rows.tolist():
        s = out.setdefault(
            sites[r],
            SyncSite(
                site=sites[r],
                calls_per_step=0.0,
                cpu_ms_per_step=0.0,
                gpu_idle_ms_per_step=idle.get(sites[r], 0.0) / 1e3 / n,
            ),
        )
        s.calls_per_step += 1.0 / n
        s.cpu_ms_per_step += float(rt.dur[r]) / 1e3 / n
    return sorted(out.values(), key=lambda s: (-s.gpu_idle_ms_per_step, -s.cpu_ms_per_step, s.site))
