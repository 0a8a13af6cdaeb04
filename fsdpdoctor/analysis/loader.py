"""The DataLoader inside the steps: the CPU time of its ``__next__`` ranges and the GPU's idle in them.

PyTorch's profiler records each ``next()`` on a DataLoader iterator as a CPU range
``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__`` (in-process loading) or
``…#_MultiProcessingDataLoaderIter.__next__`` (worker processes; the range is the wait for the
next ready batch). A range counts in the step whose CPU span it starts in; its GPU idle is the
range's time in which the GPU ran no activity at all (kernel, memcpy, memset).
"""

from __future__ import annotations

import re

import numpy as np

from fsdpdoctor.facts.efficiency import LoaderFacts
from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.rows import name_rows
from fsdpdoctor.analysis.timeline import GPU_CATS

LOADER_RX = re.compile(r"enumerate\(DataLoader\)#(_\w+DataLoaderIter)\.__next__")


def analyze_loader(rt: RankTrace, steps, gpu_present: bool) -> LoaderFacts | None:
    """LoaderFacts of the rank, means over its steps; None without a loader range in a step."""
    if not steps:
        return None
    rows = name_rows(rt, lambda n: LOADER_RX.fullmatch(n) is not None, "user_annotation", "cpu_op", "python_function")
    if not rows.size:
        return None
    gpu_rows = np.flatnonzero(rt.mask_cat(*GPU_CATS)) if gpu_present else np.empty(0, dtype=int)
    gpu = iv.merge(rt.ts[gpu_rows], rt.ts[gpu_rows] + rt.dur[gpu_rows])
    time_by_iter: dict[str, float] = {}
    calls, cpu_us, idle_us, longest = 0, 0.0, 0.0, 0.0
    for st in steps:
        inside = rows[(rt.ts[rows] >= st.start) & (rt.ts[rows] < st.end)]
        if not inside.size:
            continue
        calls += int(inside.size)
        for r in inside:
            it = LOADER_RX.fullmatch(rt.row_name(int(r))).group(1)
            time_by_iter[it] = time_by_iter.get(it, 0.0) + float(rt.dur[r])
            longest = max(longest, float(rt.dur[r]))
        spans = iv.merge(rt.ts[inside], rt.ts[inside] + rt.dur[inside])
        cpu_us += iv.total(spans)
        if gpu_present:
            idle_us += iv.total(spans) - iv.intersect_len(spans, gpu)
    if not calls:
        return None
    n = len(steps)
    return LoaderFacts(
        iterator=max(time_by_iter, key=time_by_iter.get),
        calls_per_step=calls / n,
        ms_per_step=cpu_us / 1e3 / n,
        gpu_idle_ms_per_step=idle_us / 1e3 / n if gpu_present else None,
        longest_ms=longest / 1e3,
        steps=n,
    )


def fold_loader(per_rank: list[LoaderFacts]) -> LoaderFacts | None:
    """The run's LoaderFacts: means over the ranks that have one (the longest call: the max)."""
    if not per_rank:
        return None
    n = len(per_rank)
    idle = [x.gpu_idle_ms_per_step for x in per_rank if x.gpu_idle_ms_per_step is not None]
    iters: dict[str, float] = {}
    for x in per_rank:
        iters[x.iterator] = iters.get(x.iterator, 0.0) + x.ms_per_step
    return LoaderFacts(
        iterator=max(iters, key=iters.get),
        calls_per_step=sum(x.calls_per_step for x in per_rank) / n,
        ms_per_step=sum(x.ms_per_step for x in per_rank) / n,
        gpu_idle_ms_per_step=sum(idle) / len(idle) if idle else None,
        longest_ms=max(x.longest_ms for x in per_rank),
        steps=min(x.steps for x in per_rank),
        ranks=n,
    )
