"""torch.compile's one-time work inside the profiled window, and the steady steps without it.

``torch._dynamo.utils.dynamo_timed`` wraps every phase of a compilation in a profiler range named
``<phase> (dynamo_timed)``: ``_compile.compile_inner``, ``aot_trace_joint_graph``,
``OutputGraph.call_user_compiler``, inductor's ``GraphLowering.run``, autotuning, and
``CUDAGraphNode.record`` where cudagraph trees record a CUDA graph (torch 2.13 writes them as
``cpu_op``, earlier versions as ``user_annotation``). Calls into compiled code carry none of them
(``Torch-Compiled Region``, ``TorchDynamo Cache Lookup`` are per call). The ops traced, captured or
benchmarked inside them are not the step's model work: a captured op's kernels do not run there,
and a traced one runs on fake tensors.

A profiler window that opens with the first steps of a compiled model holds the compilation:
on the suite's CPU recording (``compiled-cold``) the first step takes 1.6 s and the next ones
52 ms. Those leading steps are the compile's warm-up; with a step after them that holds no
compile work, the analysis reads the trace from that step on, as if the profiler's window had
opened there (its ``wait`` / ``warmup``): every figure is on the steady steps, and the input
ledger counts the warm-up's events as not read. Compile work in a later step is a
recompilation and stays in its step; in a window whose every step compiles, nothing is left out.
"""

from __future__ import annotations

import numpy as np

from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.rows import name_rows
from fsdpdoctor.analysis.steps import CPU_CATS, StepInfo, find_steps
from fsdpdoctor.analysis.timeline import GPU_CATS
from fsdpdoctor.facts.efficiency import CompileFacts
from fsdpdoctor.ingest.kineto import RankTrace

SUFFIX = " (dynamo_timed)"


def compile_rows(rt: RankTrace) -> np.ndarray:
    """The rows of torch.compile's one-time ranges (``… (dynamo_timed)``) on the CPU."""
    return name_rows(rt, lambda n: n.endswith(SUFFIX), *CPU_CATS)


def _outermost(rt: RankTrace, rows: np.ndarray) -> np.ndarray:
    """The ranges of ``rows`` not inside another one of them on the same thread."""
    order = rows[np.lexsort((-(rt.ts[rows] + rt.dur[rows]), rt.ts[rows], rt.thread[rows]))]
    keep, end, thread = [], -np.inf, None
    for r in order.tolist():
        t, e = int(rt.thread[r]), float(rt.ts[r] + rt.dur[r])
        if t != thread:
            thread, end = t, -np.inf
        if float(rt.ts[r]) >= end:
            keep.append(r)
            end = e
        else:
            end = max(end, e)
    return np.asarray(keep, dtype=np.int64)


#: what the input ledger calls the events of the warm-up steps left out
WARMUP_EVENTS = "torch.compile warm-up steps"


def split_warmup(rt: RankTrace, info: StepInfo, gpu_present: bool) -> tuple[RankTrace, StepInfo, CompileFacts | None]:
    """The trace and steps from the first step on that holds no compile work, where the steps
    before it all hold some (the compile's warm-up: the trace from that step on, as if the
    profiler had opened its window there, :meth:`.kineto.RankTrace.since`), and what the
    window's compile work was; None where it holds none."""
    rows = compile_rows(rt)
    if rows.size == 0 or not info.steps:
        return rt, info, None
    top = _outermost(rt, rows)
    spans = iv.merge(rt.ts[top].astype(np.float64), (rt.ts[top] + rt.dur[top]).astype(np.float64))
    per_step = [iv.total(iv.clip(spans, s.start, s.end)) for s in info.steps]
    if not any(per_step):
        return rt, info, None
    lead = 0
    while lead < len(per_step) and per_step[lead] > 0:
        lead += 1
    if lead == len(per_step):
        lead = 0  # every step compiles: nothing to leave out
    warmup, steady = info.steps[:lead], info.steps[lead:]
    lo, hi = info.steps[0].start, info.steps[-1].end
    phases: dict[str, float] = {}
    for r in top.tolist():
        a, b = max(float(rt.ts[r]), lo), min(float(rt.ts[r] + rt.dur[r]), hi)
        if b > a:
            name = rt.row_name(r)[: -len(SUFFIX)]
            phases[name] = phases.get(name, 0.0) + (b - a) / 1e3
    if warmup:
        rt = rt.since(steady[0].start, WARMUP_EVENTS)
        info = find_steps(rt)
        steady = info.steps
    idle = None
    if gpu_present and steady:
        g = np.flatnonzero(rt.mask_cat(*GPU_CATS))
        busy = iv.merge(rt.ts[g].astype(np.float64), (rt.ts[g] + rt.dur[g]).astype(np.float64))
        window = iv.merge(np.array([s.start for s in steady]), np.array([s.end for s in steady]))
        inside = iv.intersect(spans, window)
        idle = (iv.total(inside) - iv.intersect_len(inside, busy)) / 1e3 / len(steady)
    in_steady = [iv.total(iv.clip(spans, s.start, s.end)) for s in steady]  # the steps as read now
    facts = CompileFacts(
        warmup_steps=[s.number for s in warmup],
        warmup_ms=[(s.end - s.start) / 1e3 for s in warmup],
        warmup_compile_ms=sum(per_step[:lead]) / 1e3,
        steady_compile_ms={str(s.number): us / 1e3 for s, us in zip(steady, in_steady) if us > 0},
        steady_steps=len(steady),
        steady_step_ms=sum(s.end - s.start for s in steady) / 1e3 / len(steady) if steady else None,
        phases=dict(sorted(phases.items(), key=lambda kv: -kv[1])),
        gpu_idle_ms_per_step=idle,
    )
    return rt, info, facts


def fold_compile(per_rank: list[tuple[int, CompileFacts]]) -> CompileFacts | None:
    """The run's CompileFacts: the rank with the most compile work (its warm-up's and its steady
    steps'), with the count of ranks that show any."""
    if not per_rank:
        return None
    rank, best = max(per_rank, key=lambda rc: (rc[1].warmup_compile_ms + sum(rc[1].steady_compile_ms.values()), -rc[0]))
    best.rank, best.ranks = rank, len(per_rank)
    return best
