"""Saving ranges: how far a predicted saving can be trusted, measured on real twins.

A finding's estimated saving comes from the what-if replay of its fix or from its rule's
heuristic. Either is a model; how close it lands is known only from *real twins*: the same run
recorded with and without the fix (``fixtures/recorded/``). :mod:`fsdpdoctor.twins` holds, per
rule, each twin's predicted saving and the step-time difference really measured between the two
runs (written by ``benchmarks/savings_table.py``, which also writes the manual's validation
table, ``docs/savings.md``).

The range of a saving ``s`` from a rule with twins: ``[s × (min r − NOISE), s × (max r + NOISE)]``
where ``r`` = measured / predicted over its twins and ``NOISE`` allows for run-to-run variation of
the twins themselves; widened by the replay's sensitivity to what the trace does not show (its
kept waits and inferred edges, :attr:`fsdpdoctor.facts.WhatIfFacts.sensitivity_ms`). A rule with
no twin yet gets ``s × [1 − NO_TWIN, 1 + NO_TWIN]`` and says so. Where a twin shows the fix made
the step *slower*, the point estimate is withdrawn: the finding promises no saving.

The unchanged replay's agreement with the trace it was built from is *fidelity*
(``replay_fidelity_pct``), never a saving's error bar.
"""

from __future__ import annotations

from dataclasses import dataclass

from .twins import TWINS, Twin

NOISE = 0.05  # run-to-run variation allowed for on top of the twins' own spread (share of the estimate)
NO_TWIN = 0.5  # a rule without a real twin: ± this share of its estimate


@dataclass(frozen=True)
class SavingRange:
    low_ms: float
    high_ms: float
    basis: str  # "2 real twins (measured 0.92-1.11x the prediction)", "no real twin yet (±50%)"
    withdrawn: bool = False  # a twin went the other way: no saving is promised
    twins: int = 0


def twins_of(kind: str) -> list[Twin]:
    """The real twins of a saving kind (a rule's slug, or ``slug/context``)."""
    return [t for t in TWINS if t.kind == kind]


def saving_range(kind: str, est_ms: float, sensitivity_ms: float = 0.0) -> SavingRange:
    """The range of a saving of ``est_ms`` of kind ``kind`` (see the module doc)."""
    twins = [t for t in twins_of(kind) if t.predicted_ms > 0]
    sens = max(sensitivity_ms, 0.0)
    extra = f"; ± {sens:.2f} ms the replay's sensitivity to waits the trace does not explain" if sens >= 0.005 else ""
    if not twins:
        return SavingRange(
            max(est_ms * (1 - NO_TWIN) - sens, 0.0),
            est_ms * (1 + NO_TWIN) + sens,
            f"no real twin yet: ±{100 * NO_TWIN:.0f}%{extra}",
        )
    r = [t.measured_ms / t.predicted_ms for t in twins]
    lo, hi = est_ms * (min(r) - NOISE) - sens, est_ms * (max(r) + NOISE) + sens
    n = len(twins)
    spread = f"{min(r):.2f}x" if n == 1 else f"{min(r):.2f}-{max(r):.2f}x"
    slower = [t for t in twins if t.measured_ms < 0]
    basis = (
        f"{n} real twin{'s' if n > 1 else ''}: measured {spread} the prediction, ±{100 * NOISE:.0f}% run to run{extra}"
    )
    if slower:
        t = slower[0]
        basis = (
            f"on {len(slower)} of {n} real twin{'s' if n > 1 else ''} the fix made the step slower "
            f"({t.pair}: predicted {t.predicted_ms:.1f} ms saved, measured {-t.measured_ms:.1f} ms slower"
            f"{'; ' + t.why if t.why else ''})"
        )
    return SavingRange(lo, hi, basis, withdrawn=bool(slower), twins=n)
