"""``compare``'s first split of a step-time change: by the waterfall's parts (what moved against the
ideal: at peak, below peak, recompute, other kernels, exposed comm and copies, GPU idle), before the
components and causes :mod:`fsdpdoctor.analysis.compare` names.

Each rank's parts add up to its mean step (its summary line holds them), so their means over the
ranks ``compare`` reads add up to its step time, before and after, and the deltas to the change.
"""

from __future__ import annotations

from fsdpdoctor.facts import RunFacts
from fsdpdoctor.facts.efficiency import PARTS


def rank_parts(f: RunFacts, ranks: list[int]) -> dict[str, float] | None:
    """The mean over ``ranks`` of each rank's waterfall parts; None when one of them has none
    (no GPU work, or facts saved before the waterfall existed)."""
    by_rank = {s.rank: s.waterfall_ms for s in f.rank_summaries}
    parts = [by_rank.get(r) for r in ranks]
    if not parts or any(not p for p in parts):
        return None
    return {k: sum(p.get(k, 0.0) for p in parts) / len(parts) for k in PARTS}


def waterfall_split(
    before: RunFacts, after: RunFacts, before_ranks: list[int], after_ranks: list[int]
) -> tuple[dict[str, tuple[float, float]], str | None]:
    """(part → (before ms, after ms) per step, or {} and why not)."""
    b, a = rank_parts(before, before_ranks), rank_parts(after, after_ranks)
    if b is None or a is None:
        which = " and ".join(x for x, p in (("before", b), ("after", a)) if p is None)
        return {}, (
            f"no efficiency waterfall in the {which} run's facts (no GPU work in its steps, or saved before "
            "fsdpdoctor measured it): the change is not split by its parts"
        )
    return {k: (b[k], a[k]) for k in PARTS}, None
