"""Small helpers shared by rule modules. They read RunFacts only."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from fsdpdoctor.analysis.compare import EXPOSED
from fsdpdoctor.engine import Finding
from fsdpdoctor.facts import CollectiveFacts, RunFacts

#: For a rule's ``EXPLAINS`` (see fsdpdoctor.analysis.compare): every exposed-communication part, any phase.
ALL_COMM = [(c, None) for c in EXPOSED]


def finding(module_name: str, summary: str, **kw: Any) -> Finding:
    mod: ModuleType = sys.modules[module_name]
    kw.setdefault("severity", mod.SEVERITY)
    return Finding(slug=mod.SLUG, code=mod.CODE, summary=summary, **kw)


def step_ms(facts: RunFacts) -> float:
    return facts.steps.mean_ms or 0.0


def is_fsdp(facts: RunFacts) -> bool:
    return facts.fsdp.version in (1, 2)


def collectives(facts: RunFacts, kind: str | None = None, phase: str | None = None) -> list[tuple[int, CollectiveFacts]]:
    """(rank, collective) pairs inside steps, optionally filtered by kind and phase."""
    out = []
    for r in facts.rank_facts:
        for c in r.collectives:
            if c.step < 0 or (kind and c.kind != kind) or (phase and c.phase != phase):
                continue
            out.append((r.rank, c))
    return out


def per_step_per_rank(facts: RunFacts, total: float) -> float:
    """A sum over all ranks and steps (of :func:`collectives`) turned into a mean per step per
    rank; ranks whose collectives were dropped (large runs) are in neither."""
    n = sum(len(r.steps) for r in facts.rank_facts if r.gpu_present and not r.collectives_dropped) or 1
    return total / n


def exposed_ms(facts: RunFacts, phase: str, kind: str) -> float:
    return facts.exposed_comm.by_phase_kind.get(phase, {}).get(kind, 0.0)


REPLAY_MAX_ERROR_PCT = 5.0  # a replay that misses the measured step by more explains too little to trust


def replayed_saving(facts: RunFacts, fix: str) -> float | None:
    """The what-if replay's saving per step for ``fix`` (fsdpdoctor.analysis.whatif), capped at the
    step's GPU window (a GPU-side fix cannot save more than the GPU's busy span); None when the
    run was not replayed (CPU-only traces, old baselines), the fix does not apply, or the
    unchanged replay misses the measured step by more than REPLAY_MAX_ERROR_PCT on some rank."""
    w = facts.whatif
    if w is None or fix not in w.saving_ms or w.error_pct > REPLAY_MAX_ERROR_PCT:
        return None
    s = w.saving_ms[fix]
    window = facts.timeline.gpu_window_ms
    return min(s, window) if window > 0 else s


def replay_evidence(facts: RunFacts, fix: str, what: str) -> str:
    """One evidence line: the replayed saving and the replay's own error bar."""
    w = facts.whatif
    return (f"what-if replay: {what} takes the step from {w.replayed_step_ms:.1f} to {w.step_ms.get(fix, 0.0):.1f} ms "
            f"(unchanged replay within {w.error_pct:.2f}% of the measured step)")
