"""One line per rank, and which ranks matter: what a report keeps of a run of many ranks.

A run's report holds every rank's :class:`~fsdpdoctor.facts.RankSummary` (a few hundred bytes)
and, with ``--rank-detail auto`` (the default), the full RankFacts (per-step and per-collective
detail, 10-20 KB each) only of the ranks that explain the run: the slowest and fastest, the
straggler, the one with the least overlap, the one whose replay is least trustworthy, and the
first. At 1,024 ranks that keeps the JSON report a few MB instead of tens.
"""

from __future__ import annotations

import dataclasses
import statistics

from fsdpdoctor.facts import CrossRankFacts, RankFacts, RankSummary, StepFacts


def mean_step(steps: list[StepFacts]) -> StepFacts | None:
    """The per-field mean of ``steps``: floats and per-key dicts averaged (a key missing from a
    step counts 0), ``number`` −1, ``start_us`` / ``gpu_start_us`` the first step's, ``end_us``
    the last's, ``microbatches`` the most, the per-microbatch list dropped."""
    if not steps:
        return None
    n = len(steps)
    out: dict = {}
    for f in dataclasses.fields(StepFacts):
        vals = [getattr(s, f.name) for s in steps]
        if f.name == "number":
            out[f.name] = -1
        elif f.name in ("start_us", "gpu_start_us"):
            out[f.name] = vals[0]
        elif f.name == "end_us":
            out[f.name] = vals[-1]
        elif f.name == "microbatches":
            out[f.name] = max(vals)
        elif f.name == "microbatch_phase_ms":
            out[f.name] = []
        elif isinstance(vals[0], dict):
            keys = sorted({k for v in vals for k in v})
            out[f.name] = {k: sum(v.get(k, 0.0) for v in vals) / n for k in keys}
        else:
            out[f.name] = sum(vals) / n
    return StepFacts(**out)


def exposed_by_phase_kind(r: RankFacts) -> dict[str, dict[str, float]]:
    """Exposed collective ms per step by phase → kind, from the rank's collectives (or what the
    worker kept of them when it dropped the list)."""
    if r.exposed_ms_by_phase_kind is not None:
        return {p: dict(k) for p, k in r.exposed_ms_by_phase_kind.items()}
    n = max(len(r.steps), 1)
    out: dict[str, dict[str, float]] = {}
    for c in r.collectives:
        if 0 <= c.step < len(r.steps) and c.exposed_us > 0:
            d = out.setdefault(c.phase, {})
            d[c.kind] = d.get(c.kind, 0.0) + c.exposed_us / 1e3 / n
    return out


def cpu_span(s: StepFacts) -> float:
    """A step's CPU ProfilerStep span (facts saved before it was kept apart: the step time)."""
    return s.cpu_span_ms or s.step_ms


def wall_clock(r: RankFacts) -> tuple[float, float]:
    """(step time in ms, ms by which the last step's GPU work ends after its CPU span) of one
    rank: the mean of its steps' times (the interval at which they complete, see
    :func:`fsdpdoctor.analysis.timeline.step_clock`)."""
    steps = r.steps
    last = steps[-1]
    cpu_end = last.start_us + cpu_span(last) * 1e3
    behind = ((last.gpu_start_us + last.gpu_window_ms * 1e3) - cpu_end) / 1e3 if last.gpu_start_us is not None else 0.0
    return sum(s.step_ms for s in steps) / len(steps), behind


def summarize_rank(r: RankFacts) -> RankSummary:
    """One rank's summary line, without what only the whole run says (its wait at collectives
    and the reasons to keep its detail: :func:`finish`). Made as the rank arrives, so that a
    rank beyond the detail set need not be kept whole (:mod:`.ranks`)."""
    ms = [s.step_ms for s in r.steps]
    mean = mean_step(r.steps)
    if mean is not None:
        mean.cpu_span_ms = sum(cpu_span(s) for s in r.steps) / len(r.steps)  # a step without its span counts its time
    return RankSummary(
        rank=r.rank,
        path=r.path,
        gpu_present=r.gpu_present,
        steps=len(r.steps),
        step_numbers=[s.number for s in r.steps],
        step_ms=statistics.fmean(ms) if ms else None,
        step_min_ms=min(ms) if ms else None,
        step_max_ms=max(ms) if ms else None,
        overlap_pct=r.overlap_pct,
        backlog_ms=r.backlog_ms,
        replay_error_pct=r.whatif.error_pct if r.whatif is not None else None,
        mfu_pct=r.compute.mfu_pct if r.compute is not None else None,
        collectives=len(r.collectives) + r.collectives_dropped,
        mean_step=mean,
        exposed_ms_by_phase_kind=exposed_by_phase_kind(r),
        step_times_ms=ms,
        gpu_behind_ms=wall_clock(r)[1] if r.steps else 0.0,
        waterfall_ms=dict(r.efficiency.parts_ms) if r.efficiency is not None else {},
        ops_recorded_pct=r.ops_recorded_pct,
    )


def finish(sums: list[RankSummary], cross_rank: CrossRankFacts | None) -> list[RankSummary]:
    """The summaries with each rank's wait at collectives and the reasons its detail is worth
    keeping (see :class:`~fsdpdoctor.facts.RankSummary`)."""
    waits = {w.rank: w.wait_ms_per_step for w in cross_rank.ranks} if cross_rank else {}
    for s in sums:
        s.wait_ms_per_step = waits.get(s.rank)
        s.detail_reasons = []
    _mark_reasons(sums, cross_rank)
    return sums


def _mark_reasons(sums: list[RankSummary], cross_rank: CrossRankFacts | None) -> None:
    if not sums:
        return
    by_rank = {s.rank: s for s in sums}

    def mark(rank: int | None, why: str) -> None:
        if rank is not None and rank in by_rank and why not in by_rank[rank].detail_reasons:
            by_rank[rank].detail_reasons.append(why)

    def arg(key, best) -> int | None:
        have = [s for s in sums if key(s) is not None]
        return best(have, key=lambda s: (key(s), s.rank)).rank if have else None

    mark(min(by_rank), "first")
    if len(sums) < 2:
        return
    steps = {s.step_ms for s in sums if s.step_ms is not None}
    if len(steps) > 1:  # (ranks in lockstep have no slowest)
        mark(arg(lambda s: s.step_ms, max), "slowest")
        mark(arg(lambda s: s.step_ms, min), "fastest")
    if cross_rank is not None and cross_rank.ranks:
        mark(cross_rank.ranks[0].rank, "straggler")
    if len({s.overlap_pct for s in sums if s.overlap_pct is not None}) > 1:
        mark(arg(lambda s: s.overlap_pct, min), "lowest-overlap")
    if any(s.replay_error_pct for s in sums):
        mark(arg(lambda s: s.replay_error_pct, max), "worst-replay")
