"""The hook fixes: FSDP's pre/post hooks' own CPU time cut from the graph (all of it, or one
unit's hooks in two when two blocks share a unit), each cut computed once per graph."""

from __future__ import annotations

import numpy as np

from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.steps import StepWindow
from fsdpdoctor.analysis.whatif.graph import Fix, Graph, Packed


def _hook_own(g: Graph) -> tuple[np.ndarray, np.ndarray]:
    """The outermost FSDP hook ranges (n × 2, CPU µs) and each one's own CPU time: its duration
    less the blocking calls inside it (they wait for the GPU, not for Python)."""
    hooks = np.array(g.ranges.get("hooks", []), dtype=np.float64).reshape(-1, 2)
    # blocked time inside each hook: prefix sums over the blocking calls in start order
    sy = np.array([(ts, te) for ts, te, *_ in g.syncs], dtype=np.float64).reshape(-1, 2)
    sy = sy[np.argsort(sy[:, 0], kind="stable")]
    csum = np.concatenate(([0.0], np.cumsum(sy[:, 1] - sy[:, 0])))
    lo = np.searchsorted(sy[:, 0], hooks[:, 0], side="left")
    hi = np.searchsorted(sy[:, 0], hooks[:, 1], side="left")
    return hooks, hooks[:, 1] - hooks[:, 0] - (csum[hi] - csum[lo])


CUT_EPS_US = 1e-3


def _hook_cuts(g: Graph) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_hook_cuts_of` ``g`` as arrays ((k, 2) cuts, the ops that lose their inferred edge),
    computed once per graph: hooks_off, hooks_half and its assumption's two variants read the
    same cuts. Read-only."""
    cached = getattr(g, "_hook_cuts_cache", False)
    if cached is False:
        cut = _hook_cuts_of(g)
        cached = None if cut is None else (np.array(cut[0], dtype=np.float64), np.fromiter(cut[1], dtype=np.int64))
        g._hook_cuts_cache = cached  # type: ignore[attr-defined]
    return cached


def _hook_cuts_of(g: Graph) -> tuple[list[tuple[float, float]], set[int]] | None:
    """FSDP hooks free on the CPU: the CPU time of the outermost FSDP hook ranges is cut where it
    is spent — every gap between the launches and blocking calls inside a hook, so that what the
    hook launches goes out at its start — except the blocking calls themselves, which wait for the
    GPU, not for Python; what the hooks launched loses its inferred cross-stream edge (its start
    was the hook's timing). What fewer, larger units would save at most on the host side; a saving
    means the hooks sit on the critical path."""
    hooks, own = _hook_own(g)
    hooks = hooks[own > 0]
    if not hooks.size:
        return None
    a, b = hooks[:, 0], hooks[:, 1]  # sorted, disjoint (the outermost ranges)
    order = np.argsort(g.key, kind="stable")
    order = order[~g.backlog[order]]
    keys = g.key[order]
    k = np.searchsorted(a, keys, side="right") - 1
    inside = (k >= 0) & (keys < b[np.maximum(k, 0)])
    sy = np.array([(ts, te) for ts, te, *_ in g.syncs], dtype=np.float64).reshape(-1, 2)
    ks = np.searchsorted(a, sy[:, 0], side="right") - 1
    sy_in = (ks >= 0) & (sy[:, 0] < b[np.maximum(ks, 0)])
    blocked = iv.merge(sy[sy_in, 0], np.minimum(sy[sy_in, 1], b[ks[sy_in]]))
    # every hook's points: its ends, the launches inside it and the ends of its blocking calls; a
    # piece between two points of one hook is cut unless a blocking call holds it
    pts = np.concatenate((a, b, keys[inside], blocked[0], blocked[1]))
    owner = np.concatenate(
        (
            np.arange(a.size),
            np.arange(a.size),
            k[inside],
            np.searchsorted(a, blocked[0], side="right") - 1,
            np.searchsorted(a, blocked[1], side="left") - 1,
        )
    )
    srt = np.lexsort((pts, owner))
    pts, owner = pts[srt], owner[srt]
    same = owner[1:] == owner[:-1]
    p, q = pts[:-1][same], pts[1:][same]
    mid = (p + q) / 2
    j = np.searchsorted(blocked[0], mid, side="right") - 1
    held = (j >= 0) & (mid < blocked[1][np.maximum(j, 0)]) if blocked[0].size else np.zeros(mid.size, dtype=bool)
    ok = (q > p) & ~held
    # a cut takes effect at its end, after what the CPU launched at that instant: end it just before
    cuts = list(zip((p[ok] - CUT_EPS_US).tolist(), (q[ok] - CUT_EPS_US).tolist()))
    dropped = set(order[inside].tolist())
    return (cuts, dropped) if cuts else None


def fix_hooks_off(g: Graph) -> Fix | None:
    """Every FSDP hook's CPU time removed (:func:`_hook_cuts`): no fix a user can apply does this;
    it is the ceiling of what fewer hooks can save (the part of the step the hooks hold)."""
    cut = _hook_cuts(g)
    return Fix("hooks_off", cpu_cuts=Packed(cut[0]), drop_inferred=Packed(cut[1])) if cut else None


#: the share of the hooks' CPU time that two blocks per unit keep: half the units, each merged
#: unit's hooks costing what one unit's did (FSDP2's hooks cost ~a millisecond of Python per call
#: whatever the unit's size); ASSUMPTIONS varies it up to 0.75 (part of the cost grows with the
#: unit's parameters)
HOOKS_KEPT = 0.5


def fix_hooks_half(g: Graph, kept: float = HOOKS_KEPT) -> Fix | None:
    """Two blocks per ``fully_shard`` unit: half the hooks. Each piece of hook CPU time
    :func:`_hook_cuts` would remove is cut to ``kept`` of its length (from its start), so what
    each hook launches goes out earlier by that much; what the hooks launched loses its inferred
    cross-stream edge, as for :func:`fix_hooks_off`."""
    cut = _hook_cuts(g)
    if not cut:
        return None
    a, b = cut[0][:, 0], cut[0][:, 1]
    keep = b > a
    a, b = a[keep], b[keep]
    fx = Fix(
        "hooks_half", cpu_cuts=Packed(np.column_stack((a, a + (1.0 - kept) * (b - a)))), drop_inferred=Packed(cut[1])
    )
    fx.note = (
        f"two blocks per unit: each hook's CPU time between its launches cut to {100 * kept:.0f}% "
        "(half the hooks, a merged unit's costing what one unit's did)"
    )
    return fx


def _hook_us_per_unit(hooks: np.ndarray, own: np.ndarray, step: StepWindow, phase: str, units: int) -> float:
    """Own CPU µs (:func:`_hook_own`) of the FSDP hooks that start in ``step``'s ``phase``, per unit."""
    win = step.phases.get(phase)
    if win is None or units < 1 or not hooks.size:
        return 0.0
    m = (hooks[:, 0] >= win[0]) & (hooks[:, 0] < win[1]) & (own > 0)
    return float(own[m].sum()) / units
