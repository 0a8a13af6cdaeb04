"""The run's replay figures folded over its ranks."""

from __future__ import annotations


import numpy as np

from fsdpdoctor.facts import WhatIfFacts
from fsdpdoctor.analysis.columns import Columns
from fsdpdoctor.analysis.whatif.fixes import STRAGGLER_FACTORS


_WHATIF_SUMS = ("ops", "wait_edges", "blocking_calls", "inferred_edges", "unexplained_waits", "backlog_ops")


class WhatIfFold:
    """:func:`fold_whatif` as ranks arrive: each rank's replay figures go into columns (its
    WhatIfFacts need not be kept), read back in rank order; kept whole only the replay of the
    rank with the most compute (the straggler fix interpolates its replays)."""

    __slots__ = ("cols", "top", "slow")

    def __init__(self) -> None:
        self.cols = Columns()
        # fix → ((saving, -rank), the rank's note on the fix, the assumptions it stated, its step
        # with the fix) of the rank whose saving is the run's (the largest; the lowest rank among
        # equals): what a finding shows beside the run's saving is that rank's, not another's
        self.top: dict[str, tuple[tuple[float, int], str, str, float]] = {}
        self.slow: tuple[tuple[float, int], int, float, WhatIfFacts] | None = None

    def add(self, rank: int, w: WhatIfFacts | None, compute_ms_total: float) -> None:
        if w is None:
            return
        row: dict = {
            "measured": w.measured_step_ms,
            "replayed": w.replayed_step_ms,
            "error": w.error_pct,
            "unexplained_wait_ms": w.unexplained_wait_ms,
        }
        for attr in _WHATIF_SUMS:
            row[attr] = float(getattr(w, attr))
        if w.latency_share is not None:
            row["latency_share"] = w.latency_share
        for name, v in w.saving_ms.items():
            row[("saving", name)], row[("step", name)] = v, w.step_ms[name]
            key = (v, -rank)
            if name not in self.top or key > self.top[name][0]:
                self.top[name] = (key, w.evidence.get(name, ""), w.assumptions.get(name, ""), w.step_ms[name])
        for name, v in w.exposed_rs_ms.items():
            row[("rs", name)] = v
        for name, v in w.sensitivity_ms.items():
            row[("sens", name)] = v
        for name, (lo, hi) in w.assumption_ms.items():
            row[("alo", name)], row[("ahi", name)] = lo, hi
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
            out.step_ms[name] = self.top[name][3]  # the step of the rank whose saving it is
            out.saving_rank[name] = -self.top[name][0][1]
            if self.top[name][1]:
                out.evidence[name] = self.top[name][1]
        self._straggler(out)
        for name in cols.keys("rs"):
            out.exposed_rs_ms[name] = float(np.mean(cols.values(("rs", name))))
        for name in cols.keys("sens"):
            out.sensitivity_ms[name] = max(cols.values(("sens", name)))
        # the run's saving is the maximum over ranks: so are the ends of its span
        for name in cols.keys("alo"):
            out.assumption_ms[name] = [max(cols.values(("alo", name))), max(cols.values(("ahi", name)))]
            if name in self.top and self.top[name][2]:
                out.assumptions[name] = self.top[name][2]
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
        out.evidence["straggler"] = (
            f"rank {slow_rank}'s compute at the median rank's ({100 * f:.0f}% of its own) "
            f"replays to {fixed:.1f} ms per step"
        )


def fold_whatif(ranks: list) -> WhatIfFacts | None:
    """The run's what-if summary from RankFacts in rank order (see :class:`WhatIfFold`)."""
    acc = WhatIfFold()
    for r in ranks:
        acc.add(r.rank, r.whatif, r.compute_ms_total)
    return acc.result()
