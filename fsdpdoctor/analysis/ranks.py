"""Across ranks: load every rank (in parallel processes), then fold RankFacts into RunFacts."""

from __future__ import annotations

import os
import statistics
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

from .. import __version__
from ..errors import InputError
from ..facts import (
    CollectiveStats,
    ExposedSummary,
    InputFacts,
    OverlapSummary,
    RankFacts,
    RunFacts,
    StepsSummary,
    TimelineSummary,
)
from .rank import analyze_rank
from .steps import PHASES


def _worker(args: tuple[str, int]) -> RankFacts | InputError:
    path, idx = args
    try:
        return analyze_rank(path, idx)
    except InputError as exc:  # returned, not raised, so the parent reports the first bad file
        return exc


def analyze_ranks(
    paths: list[Path], jobs: int | None = None, progress: Callable[[int, int], None] | None = None
) -> list[RankFacts]:
    """RankFacts for each file; several files are analysed in parallel worker processes."""
    items = [(str(p), i) for i, p in enumerate(paths)]
    jobs = jobs or min(len(items), os.cpu_count() or 1)
    results: list[RankFacts | InputError]
    if len(items) == 1 or jobs <= 1:
        results = []
        for k, it in enumerate(items):
            results.append(_worker(it))
            if progress:
                progress(k + 1, len(items))
    else:
        results = [None] * len(items)  # type: ignore[list-item]
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for k, res in enumerate(pool.map(_worker, items)):
                results[k] = res
                if progress:
                    progress(k + 1, len(items))
    for r in results:
        if isinstance(r, InputError):
            raise r
    ranks: list[RankFacts] = results  # type: ignore[assignment]
    seen: dict[int, str] = {}
    for rf in ranks:
        if rf.rank in seen:
            raise InputError(rf.path, f"rank {rf.rank} appears twice (also in {seen[rf.rank]})")
        seen[rf.rank] = rf.path
    return sorted(ranks, key=lambda r: r.rank)


def _mean(xs: list[float]) -> float | None:
    return float(statistics.fmean(xs)) if xs else None


def fold(ranks: list[RankFacts]) -> RunFacts:
    """RunFacts from per-rank facts. Per-step figures are means over ranks of per-rank means."""
    rf = RunFacts(tool=f"fsdpdoctor {__version__}")
    rf.rank_facts = ranks
    rf.inputs = [InputFacts(r.path, r.rank, r.rank_source) for r in ranks]
    rf.ranks = [r.rank for r in ranks]
    ws = [r.world_size for r in ranks if r.world_size]
    rf.world_size = Counter(ws).most_common(1)[0][0] if ws else None
    rf.gpu_present = any(r.gpu_present for r in ranks)
    # steps
    all_steps = [s.step_ms for r in ranks for s in r.steps]
    rf.steps = StepsSummary(
        count=min((len(r.steps) for r in ranks), default=0),
        mean_ms=_mean(all_steps),
        median_ms=float(statistics.median(all_steps)) if all_steps else None,
        min_ms=min(all_steps) if all_steps else None,
        max_ms=max(all_steps) if all_steps else None,
        method=Counter(r.step_method for r in ranks).most_common(1)[0][0] if ranks else "",
        per_rank_mean_ms={str(r.rank): _mean([s.step_ms for s in r.steps]) or 0.0 for r in ranks},
    )
    # overlap
    per_rank = {str(r.rank): r.overlap_pct for r in ranks}
    vals = [v for v in per_rank.values() if v is not None]
    steps_per_rank = {}
    for r in ranks:
        comm = sum(s.comm_ms for s in r.steps)
        steps_per_rank[str(r.rank)] = 100.0 * sum(s.overlap_ms for s in r.steps) / comm if comm > 0 else None
    svals = [v for v in steps_per_rank.values() if v is not None]
    rf.overlap = OverlapSummary(pct=_mean(vals), per_rank=per_rank, steps_pct=_mean(svals), steps_per_rank=steps_per_rank)
    # exposed comm and the timeline, only for ranks with GPU activity
    gpu_ranks = [r for r in ranks if r.gpu_present and r.steps]
    if gpu_ranks:
        per = {str(r.rank): _mean([s.exposed_comm_ms for s in r.steps]) or 0.0 for r in gpu_ranks}
        by_phase = {p: _mean([_mean([s.exposed_by_phase.get(p, 0.0) for s in r.steps]) or 0.0 for r in gpu_ranks]) or 0.0 for p in PHASES}
        kinds = sorted({k for r in gpu_ranks for s in r.steps for k in s.exposed_by_kind})
        by_kind = {k: _mean([_mean([s.exposed_by_kind.get(k, 0.0) for s in r.steps]) or 0.0 for r in gpu_ranks]) or 0.0 for k in kinds}
        by_pk: dict[str, dict[str, float]] = {}
        for r in gpu_ranks:
            n = max(len(r.steps), 1)
            for c in r.collectives:
                if c.step >= 0 and c.exposed_us > 0:
                    d = by_pk.setdefault(c.phase, {})
                    d[c.kind] = d.get(c.kind, 0.0) + c.exposed_us / 1e3 / n / len(gpu_ranks)
        rf.exposed_comm = ExposedSummary(
            mean_ms_per_step=_mean(list(per.values())), by_phase=by_phase, by_kind=by_kind, by_phase_kind=by_pk, per_rank=per
        )

        def m(attr: str) -> float:
            return _mean([_mean([getattr(s, attr) for s in r.steps]) or 0.0 for r in gpu_ranks]) or 0.0

        rf.timeline = TimelineSummary(
            gpu_window_ms=m("gpu_window_ms"),
            compute_ms=m("compute_ms"),
            comm_ms=m("comm_ms"),
            exposed_comm_ms=m("exposed_comm_ms"),
            memcpy_ms=m("memcpy_ms"),
            idle_ms=m("idle_ms"),
            outside_window_ms=m("outside_window_ms"),
        )
    rf.collectives = _fold_collectives(ranks)
    # FSDP structure: the rank whose detection says most (normally all agree)
    if ranks:
        best = max(ranks, key=lambda r: (r.fsdp.version is not None, len(r.fsdp.units), -r.rank))
        rf.fsdp = best.fsdp
        versions = {r.fsdp.version for r in ranks}
        if len(versions) > 1:
            rf.notes.append(f"ranks disagree on the FSDP version: {sorted(map(str, versions))}")
    sources = Counter(r.rank_source for r in ranks)
    rf.notes.append("rank ids from " + ", ".join(f"{src} ({n})" for src, n in sources.items()))
    if ranks and rf.world_size and len(ranks) < rf.world_size:
        rf.notes.append(f"{len(ranks)} of {rf.world_size} ranks given")
    return rf


def _fold_collectives(ranks: list[RankFacts]) -> list[CollectiveStats]:
    kinds = sorted({c.kind for r in ranks for c in r.collective_stats})
    out = []
    for k in kinds:
        cs = [c for r in ranks for c in r.collective_stats if c.kind == k]
        bws = [c.mean_busbw_gbps for c in cs if c.mean_busbw_gbps is not None]
        out.append(
            CollectiveStats(
                kind=k,
                count_per_step=_mean([c.count_per_step for c in cs]) or 0.0,
                bytes_per_step=_mean([c.bytes_per_step for c in cs if c.bytes_per_step is not None]),
                gpu_ms_per_step=_mean([c.gpu_ms_per_step for c in cs]) or 0.0,
                exposed_ms_per_step=_mean([c.exposed_ms_per_step for c in cs]) or 0.0,
                mean_busbw_gbps=_mean(bws),
                dtypes=sorted({d for c in cs for d in c.dtypes}),
            )
        )
    return out
