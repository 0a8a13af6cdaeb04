"""Small helpers shared by rule modules. They read RunFacts only."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from fsdpdoctor.engine import Finding
from fsdpdoctor.facts import CollectiveFacts, RunFacts


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
