"""Where on a rank's timeline the step's time was lost: the exposed-communication and GPU-idle
intervals behind ``StepFacts.exposed_comm_ms`` and ``EfficiencyFacts.idle_ms``, each with what
it is (the collective's kind and unit; the idle's cause and where it sat on the CPU).

RunFacts keep these as totals per step; the intervals themselves (thousands per rank) are read
again from the rank's trace for the ranks a drawing needs (``analyze --format perfetto``), with
the same code that measured the totals, so that they add up to them:

- exposed communication: per step, the merged collective kernels it launched less its merged
  compute kernels (:func:`fsdpdoctor.analysis.timeline.step_timeline`), each piece given to the
  earliest-starting collective kernel that covers it; per step the pieces add up to
  ``StepFacts.exposed_comm_ms``;
- GPU idle: the steps' intervals on the step clock less all GPU activity, attributed as
  :func:`fsdpdoctor.analysis.efficiency.idle.idle_and_hooks` attributes them; per cause the
  pieces add up to its measured time (``EfficiencyFacts.idle_ms`` before it is scaled to the
  waterfall's ``gpu_idle`` part).

Times are the trace's own microseconds (the clock of its events).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fsdpdoctor.facts import RankFacts
from fsdpdoctor.facts.efficiency import EfficiencyFacts
from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.efficiency import step_windows
from fsdpdoctor.analysis.efficiency.idle import idle_and_hooks
from fsdpdoctor.analysis.timeline import gpu_steps
from fsdpdoctor.analysis.timeline.extract import _collective_index, _comm_kind, _match_collective

MAX_SPANS = 200_000  # per rank and kind: the longest are kept beyond this


@dataclass(slots=True)
class Span:
    start_us: float
    end_us: float
    label: str  # exposed: the collective kind; idle: the cause (facts_efficiency.IDLE_CAUSES)
    step: int  # index into the rank's steps (-1: none)
    detail: str = ""  # exposed: "unit (phase)"; idle: the sync site or the FSDP hook


@dataclass(slots=True)
class RankSpans:
    rank: int
    exposed: list[Span] = field(default_factory=list)
    idle: list[Span] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def rank_spans(rt: RankTrace, rf: RankFacts) -> RankSpans:
    """The exposed-communication and GPU-idle intervals of ``rf``'s steps in ``rt`` (its trace)."""
    from fsdpdoctor.analysis.steps import find_steps

    out = RankSpans(rank=rf.rank)
    steps = find_steps(rt).steps
    if not steps or len(steps) != len(rf.steps) or not rt.mask_cat("kernel").any():
        if rf.steps and len(steps) != len(rf.steps):
            out.notes.append(f"{len(steps)} steps found again where the analysis had {len(rf.steps)}: no spans")
        return out
    gs = gpu_steps(rt, steps)
    g = gs.g
    s_all = rt.ts[g.rows].astype(np.float64)
    e_all = s_all + rt.dur[g.rows]
    order = np.argsort(gs.step, kind="stable")
    bounds = np.searchsorted(gs.step[order], np.arange(len(steps) + 1), side="left")
    for k in range(len(steps)):
        idx = order[bounds[k] : bounds[k + 1]]
        out.exposed.extend(_exposed(rt, rf, k, idx, g, s_all, e_all))
    windows = step_windows(steps, rf.steps)
    classified = g.comm | g.compute | g.memory
    busy_all = iv.merge(s_all[classified], e_all[classified])
    raw: list = []
    idle_and_hooks(EfficiencyFacts(), rt, steps, windows, busy_all, gs, spans=raw)
    ws, we = windows
    for a, b, cause, detail in sorted(raw):
        k = int(np.searchsorted(ws, a, side="right")) - 1
        out.idle.append(Span(a, b, cause, k if 0 <= k < len(ws) and a < we[k] else -1, detail))
    for name in ("exposed", "idle"):
        spans = getattr(out, name)
        if len(spans) > MAX_SPANS:
            keep = sorted(sorted(spans, key=lambda s: s.start_us - s.end_us)[:MAX_SPANS], key=lambda s: s.start_us)
            out.notes.append(f"{len(spans)} {name} spans; the {MAX_SPANS} longest are drawn")
            setattr(out, name, keep)
    return out


def _exposed(rt, rf: RankFacts, k: int, idx: np.ndarray, g, s_all, e_all) -> list[Span]:
    """Step ``k``'s exposed communication (rows ``idx`` of ``g``) as labelled pieces."""
    if idx.size == 0:
        return []
    cm, cp = g.comm[idx], g.compute[idx]
    s, e = s_all[idx], e_all[idx]
    exposed = iv.subtract(iv.merge(s[cm], e[cm]), iv.merge(s[cp], e[cp]))
    if exposed[0].size == 0:
        return []
    index = _collective_index(rf.collectives, k)
    rows = g.rows[idx][cm]
    cs, ce = s[cm], e[cm]
    out: list[Span] = []
    cursor = -np.inf
    for j in np.argsort(cs, kind="stable").tolist():
        a, b = max(float(cs[j]), cursor), float(ce[j])
        cursor = max(cursor, b)
        if b <= a:
            continue
        pieces = iv.clip(exposed, a, b)
        if pieces[0].size == 0:
            continue
        r = int(rows[j])
        kind, detail = _comm_kind(rt, r), ""
        c = _match_collective(index, int(rt.stream[r]), float(cs[j]), float(ce[j]))
        if c is not None:
            kind = c.kind
            detail = " ".join(x for x in ((c.unit or "(root)") if c.unit is not None else "", f"({c.phase})") if x)
        out.extend(Span(float(x), float(y), kind, k, detail) for x, y in zip(*pieces) if y > x)
    return out


def spans_for_facts(facts, ranks: list[RankFacts]) -> dict[int, RankSpans]:
    """:func:`rank_spans` of each of ``ranks`` (RankFacts of ``facts``), its trace read again."""
    from fsdpdoctor.ingest.kineto import load_trace

    out: dict[int, RankSpans] = {}
    for rf in ranks:
        if not rf.gpu_present or not rf.steps:
            continue
        out[rf.rank] = rank_spans(load_trace(rf.path), rf)
    return out
