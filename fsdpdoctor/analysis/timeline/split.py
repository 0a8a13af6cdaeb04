"""A step's interval on the step clock split instant by instant (``StepFacts.clock_split_ms``):
the parts ``compare`` splits a step-time change into, measured on the clock the idle is on.

The interval is the one :func:`fsdpdoctor.analysis.timeline.clock_parts` splits (``step_ms``
ending at the step's completion). Each GPU instant in it goes to the first part that covers it,
whichever step launched the work (as the efficiency waterfall assigns its busy parts):

1. ``compute``: a compute kernel runs (the timeline's classes: not a collective, not a copy);
2. ``comm:<kind>:<phase>``: a collective kernel runs (exposed comm), to its collective's kind and
   the phase it was issued in; a kernel no collective claims is ``other`` of the phase its launch
   lies in (``other`` outside every step); where kernels of two labels run at once, the first
   label in :data:`~fsdpdoctor.analysis.comms.KINDS` order, then phase order;
3. ``memcpy``: a memcpy / memset runs;
4. nothing runs: ``host_bound_idle`` inside the step's own host-bound gaps (its GPU window's gaps
   in which the CPU was not in a blocking call), else ``other_idle`` (the step's edges, other
   steps' windows, idle under a CPU synchronization; ``StepFacts.idle_not_host_bound_ms``).

The parts tile the interval, so they add up to ``step_ms`` by measurement (to float rounding).
"""

from __future__ import annotations

import numpy as np

from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.comms import KINDS
from fsdpdoctor.analysis.steps import PHASES


def _order(label: tuple[str, str]) -> tuple[int, int, str, str]:
    kind, phase = label
    k = KINDS.index(kind) if kind in KINDS else len(KINDS)
    p = PHASES.index(phase) if phase in PHASES else len(PHASES)
    return k, p, kind, phase


class ClockClasses:
    """A rank's GPU activity as merged interval sets: compute, the collective kernels by
    (kind, phase) in priority order, copies."""

    __slots__ = ("compute", "comm", "memory")

    def __init__(self, s: np.ndarray, e: np.ndarray, compute: np.ndarray, memory: np.ndarray, comm_labels: dict):
        """``s`` / ``e``: every GPU row's start and end; ``compute`` / ``memory``: masks over them;
        ``comm_labels``: row index → (kind, phase) of each collective kernel."""
        self.compute = iv.merge(s[compute], e[compute])
        self.memory = iv.merge(s[memory], e[memory])
        by: dict[tuple[str, str], list[int]] = {}
        for i, lab in comm_labels.items():
            by.setdefault(lab, []).append(i)
        self.comm = [(lab, iv.merge(s[np.array(by[lab])], e[np.array(by[lab])])) for lab in sorted(by, key=_order)]

    def busy(self, lo: float, hi: float) -> dict[str, float]:
        """The busy parts of the interval [lo, hi] (µs) as the module says (1-3), in µs; the caller
        adds the idle ones (4), which the step clock's own idle reading already gives."""
        covered = iv.window(self.compute, lo, hi)
        out = {"compute": iv.total(covered)}
        for (kind, phase), m in self.comm:
            piece = iv.subtract(iv.window(m, lo, hi), covered)
            t = iv.total(piece)
            if t > 0:
                out[f"comm:{kind}:{phase}"] = t
                covered = iv.union(covered, piece)
        out["memcpy"] = iv.total(iv.subtract(iv.window(self.memory, lo, hi), covered))
        return out
