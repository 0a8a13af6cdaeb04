"""Plan and run: the graph and the transformations that apply, replayed unchanged and with each."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdpdoctor.facts import ComputeFacts, FsdpFacts, WhatIfFacts
from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.comms import Collective
from fsdpdoctor.analysis.layers import repeated_blocks
from fsdpdoctor.analysis.steps import StepWindow
from fsdpdoctor.analysis.whatif.fixes import (
    ASSUMPTIONS,
    FIXES,
    SIDE_FACTOR,
    STRAGGLER_FACTORS,
    TENSOR_CORE_MIN_SHARE,
    fix_compute_scale,
    fix_cpu_scale,
    fix_tensor_cores,
    latency_share,
)
from fsdpdoctor.analysis.whatif.graph import Fix, Graph, build_graph, compact
from fsdpdoctor.analysis.whatif.loop import _slower, measured_clocks_ms, replay, steady_steps


def _exposed_rs_ms(g: Graph, S: np.ndarray, E: np.ndarray) -> float:
    """Exposed reduce-scatter per step (ms) in a replayed timeline."""
    rs = np.array(
        [i for i in np.flatnonzero(g.coll >= 0) if g.colls[int(g.coll[i])].kind == "reduce_scatter"], dtype=np.int64
    )
    if rs.size == 0:
        return 0.0
    comp = np.flatnonzero(g.is_compute)
    exposed = iv.subtract(iv.merge(S[rs], E[rs]), iv.merge(S[comp], E[comp]))
    return iv.total(exposed) / 1e3 / max(len(g.steps), 1)


def _applies(fsdp: FsdpFacts | None) -> dict[str, bool]:
    """Which transformations are worth a replay on this rank (the rest would change nothing, or
    their finding cannot fire)."""
    if fsdp is None:
        return dict.fromkeys(FIXES, True)
    return {name: fsdp.fix_applies(name) for name in FIXES}


def fidelity_pct(base: np.ndarray, base_clocks: np.ndarray, measured: np.ndarray, clocks: np.ndarray) -> float:
    """How closely the unchanged replay reproduces the measured steps, in %: the larger of its
    error on the steady step time (what savings are differences of) and its largest per-step
    error on the completion clock (each step's completion, whichever side made it late). The
    CPU clock's per-step split is not compared: where the CPU blocks on the GPU (a full launch
    queue, a synchronization), the replay may end a step's CPU span earlier and the next one's
    later than measured without changing the rate."""
    m = float(measured.mean())
    steady = 100 * abs(float(base.mean()) - m) / m if m > 0 else 0.0
    return max(steady, step_error_pct(base_clocks[1], clocks[1]))


def step_error_pct(replayed: np.ndarray, measured: np.ndarray) -> float:
    """The replay's error: the largest per-step |replayed − measured| / measured, in %."""
    ok = measured > 0
    if not ok.any():
        return 0.0
    return float(100 * np.max(np.abs(replayed[ok] - measured[ok]) / measured[ok]))


@dataclass
class WhatIfPlan:
    """What the replays need, read from the trace: the graph and the transformations that apply.
    Built while the trace is in memory; :func:`run_whatif` replays it after the trace's columns
    have been let go (the replay's compiled loop and its imports then take their place)."""

    g: Graph
    n_steps: int
    latency_share: float | None
    fixes: list[tuple[str, Fix | tuple[Graph, Fix] | None]]
    # (fix, what is assumed, "low" / "high", the fix at that end of the assumption's span)
    variants: list[tuple[str, str, str, Fix | None]] | None = None


def plan_whatif(
    rt: RankTrace,
    steps: list[StepWindow],
    colls: list[Collective],
    fsdp: FsdpFacts | None = None,
    kflops=None,
    compute: ComputeFacts | None = None,
) -> WhatIfPlan | None:
    """The graph of this rank's steps and every transformation that applies (all of them when
    ``fsdp`` is None): everything of the what-if replay that reads the trace."""
    g = build_graph(rt, steps, colls)
    if g is None:
        return None
    applies = _applies(fsdp)
    fixes = [
        (name, compact(make(g, lambda: repeated_blocks(rt, steps)) if name == "wrap" else make(g)))
        for name, make in FIXES.items()
        if applies.get(name, True)
    ]
    if kflops is not None and compute is not None and compute.fp32_share_pct >= TENSOR_CORE_MIN_SHARE:
        fixes.append(("tensor_cores", compact(fix_tensor_cores(g, kflops, compute))))
    variants = []
    built = {name for name, fx in fixes if fx is not None}
    for name, specs in ASSUMPTIONS.items():
        if name not in built:
            continue
        for what, low, high in specs:
            for end, kw in (("low", low), ("high", high)):
                fx = fix_tensor_cores(g, kflops, compute, **kw) if name == "tensor_cores" else FIXES[name](g, **kw)
                variants.append((name, what, end, compact(fx)))
    fixes += [(f"compute×{f}", compact(fix_compute_scale(g, f))) for f in STRAGGLER_FACTORS]
    # the step's sensitivity to each side (the GPU's: compute×SIDE_FACTOR, one of the straggler's)
    fixes.append((f"cpu×{SIDE_FACTOR}", compact(fix_cpu_scale(g, SIDE_FACTOR))))
    return WhatIfPlan(g, len(steps), latency_share(colls), fixes, variants)


def run_whatif(plan: WhatIfPlan) -> WhatIfFacts:
    """Replay the steps unchanged and with each transformation of ``plan``."""
    g = plan.g
    clocks = measured_clocks_ms(g)
    measured = _slower(clocks)
    due = 1 + sum(fx is not None for _, fx in plan.fixes)  # replays of this rank still to run
    S, E, base, base_clocks, _ = replay(g, replays=due)
    out = WhatIfFacts(
        measured_step_ms=float(measured.mean()),
        replayed_step_ms=float(base.mean()),
        error_pct=fidelity_pct(base, base_clocks, measured, clocks),
        ops=int(g.start.size),
        wait_edges=g.n_wait_edges,
        blocking_calls=sum(1 for s in g.syncs if s[2] >= 0),
        inferred_edges=g.n_inferred,
        unexplained_waits=int((g.g_wait > 0).sum()),
        unexplained_wait_ms=float(g.g_wait.sum()) / 1e3 / max(plan.n_steps, 1),
        backlog_ops=int(g.backlog.sum()),
        latency_share=plan.latency_share,
    )
    out.exposed_rs_ms["none"] = _exposed_rs_ms(g, S, E)
    for name, fx in plan.fixes:
        if fx is None:
            continue
        g2, fx = fx if isinstance(fx, tuple) else (g, fx)
        due -= 1
        S2, E2, _, clocks2, marks2 = replay(g2, fx, due)
        step, saving = _saving(g2, base_clocks, clocks2, E2, marks2, fx)
        out.step_ms[name] = step
        out.saving_ms[name] = saving
        out.exposed_rs_ms[name] = _exposed_rs_ms(g2, S2, E2)
        if fx.note:
            out.evidence[name] = fx.note
    _sensitivity(plan, out)
    _assumptions(plan, out, base_clocks)
    return out


def _saving(
    g: Graph, base_clocks: np.ndarray, clocks: np.ndarray, E, marks: np.ndarray, fx: Fix
) -> tuple[float, float]:
    """(the replay with ``fx``'s step, its saving) in ms, on the steps the backlog the fix cannot
    reach does not hold back (:func:`.loop.steady_steps`), the slower clock of the same steps in
    both replays."""
    keep = steady_steps(g, E, marks, fx)
    t = _slower(clocks[:, keep])
    return float(t.mean()), float(max(_slower(base_clocks[:, keep]).mean() - t.mean(), 0.0))


def _assumptions(plan: WhatIfPlan, out: WhatIfFacts, base_clocks: np.ndarray) -> None:
    """Each material fix replayed at both ends of each of its stated assumptions
    (:data:`.fixes.ASSUMPTIONS`): ``assumption_ms[fix]`` = [lowest, highest] saving (the fix's
    own saving included), ``assumptions[fix]`` = each assumption that moved it, with its span."""
    todo = [
        v
        for v in plan.variants or []
        if v[3] is not None and out.saving_ms.get(v[0], 0.0) >= SENSITIVITY_MIN_PCT / 100 * out.measured_step_ms
    ]
    due = len(todo)
    spans: dict[str, dict[str, list[float]]] = {}
    for name, what, _end, fx in todo:
        _, E, _, clocks, marks = replay(plan.g, fx, due)
        due -= 1
        spans.setdefault(name, {}).setdefault(what, []).append(_saving(plan.g, base_clocks, clocks, E, marks, fx)[1])
    for name, by_what in spans.items():
        est = out.saving_ms[name]
        lo, hi, said = est, est, []
        for what, vals in by_what.items():
            a, b = min(vals + [est]), max(vals + [est])
            lo, hi = min(lo, a), max(hi, b)
            if b - a >= 0.005:
                said.append(f"{what}: {a:.2f}-{b:.2f} ms")
        out.assumption_ms[name] = [lo, hi]
        if said:
            out.assumptions[name] = "; ".join(said)


SENSITIVITY_MIN_PCT = 1.0  # savings of at least this % of the step get the sensitivity replays


def _sensitivity(plan: WhatIfPlan, out: WhatIfFacts) -> None:
    """How much each material saving depends on what the trace does not show: the same replays
    without the waits kept as measured and without the inferred cross-stream edges (the unseen
    dependency gone, rather than held as measured); ``sensitivity_ms[fix]`` = |saving − that
    saving|. Only where the graph has such waits or edges, and for fixes whose saving is at least
    SENSITIVITY_MIN_PCT of the step (the straggler's compute scalings excluded). Not for a graph
    whose only unseen dependencies are a few inferred edges: those replays would cost more than
    they tell (every recording has a handful; their sensitivity there was below 0.01 ms)."""
    g = plan.g
    if g.g_wait is None or not (g.g_wait > 0).any():
        return
    todo = [
        (name, fx)
        for name, fx in plan.fixes
        if fx is not None
        and not name.startswith(("compute×", "cpu×"))
        and out.saving_ms.get(name, 0.0) >= SENSITIVITY_MIN_PCT / 100 * out.measured_step_ms
    ]
    if not todo:
        return
    due = 1 + len(todo)
    base = replay(g, replays=due, blind=True)[3]
    for name, fx in todo:
        g2, fx = fx if isinstance(fx, tuple) else (g, fx)
        due -= 1
        _, E, _, clocks, marks = replay(g2, fx, due, blind=True)
        blind = _saving(g2, base, clocks, E, marks, fx)[1]
        out.sensitivity_ms[name] = abs(out.saving_ms[name] - blind)


def analyze_whatif(
    rt: RankTrace,
    steps: list[StepWindow],
    colls: list[Collective],
    fsdp: FsdpFacts | None = None,
    kflops=None,
    compute: ComputeFacts | None = None,
) -> WhatIfFacts | None:
    """Replay this rank's steps unchanged and with every transformation that applies (all of
    them when ``fsdp`` is None)."""
    plan = plan_whatif(rt, steps, colls, fsdp, kflops, compute)
    return run_whatif(plan) if plan is not None else None
