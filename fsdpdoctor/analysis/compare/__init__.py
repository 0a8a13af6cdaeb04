"""``compare``: explain the step-time change between two runs from their RunFacts.

Plain functions over :class:`~fsdpdoctor.facts.RunFacts` (and the findings drawn from them); no
trace is ever re-read. :func:`compare` aligns the two runs (ranks, steps, FSDP units by FQN,
collectives by unit, phase and kind), splits the step-time delta into parts that add up to it
exactly (first by the efficiency waterfall's parts, :mod:`.compare_waterfall`), lists what changed in structure and configuration and which findings appeared or
disappeared, and ranks the causes.

Step time and its parts (the *basis*; :data:`GPU_BASIS` / :data:`CPU_BASIS` state it in every
output):

* **step time** = ``StepFacts.step_ms``, the interval at which steps complete (a step completes
  when its CPU span and the GPU work it launched are both done: the GPU's step where the GPU
  runs behind the CPU, the CPU's where it does not) — the figure throughput is measured on —
  averaged over a rank's steps, then over ranks (ranks with a GPU timeline when both runs have
  one).
* **GPU runs** (both runs have GPU activity): per step,
  ``step_ms = compute + exposed all-gather + exposed reduce-scatter + other exposed comm +
  memcpy + host-bound idle + other idle + unattributed``, read from ``StepFacts.clock_split_ms``
  (:mod:`fsdpdoctor.analysis.timeline.split`): the step's interval on the step clock (one step
  time ending at its completion) split instant by instant, each instant to the first part that
  covers it, whichever step launched the work running then:

  1. *compute*: a compute kernel runs;
  2. *exposed comm*: a collective kernel runs, to its collective's kind (all-gather,
     reduce-scatter, anything else as other comm) and the phase it was issued in; a kernel no
     collective claims is other comm of the phase its launch lies in;
  3. *memcpy*: a memcpy / memset runs;
  4. nothing runs: *host-bound idle* inside the step's own GPU-window gaps in which the CPU was
     not in a blocking call (an empty GPU queue mid-step: the host had not launched the next work
     yet: launch/Python/FSDP-hook overhead, the FSDP1 rate limiter); *other idle* elsewhere (the
     step's edges: data loading, a CPU optimizer step; idle while the CPU sits in a blocking
     call, both sides waiting on something the trace does not show). A collective waiting for a
     slower rank is a running NCCL kernel, so waiting for other ranks shows as exposed comm,
     never as idle.

  The parts tile the interval, so they add up to the step by measurement; *unattributed* is what
  they leave (float rounding, under 1e-9 ms a step), named as such, in no cause. Facts saved
  before the split was measured are read as before (the step's GPU-window compute, exposed comm
  and memcpy, host-bound idle from the window, other idle on the clock; a note says so) and what
  they leave is unattributed.

  Exposed comm is resolved by phase (forward / backward / optimizer / other, from the CPU time
  each collective was issued); compute, memcpy and idle are per step only (``phase == "all"``).
* **CPU-only runs** (gloo, no GPU timeline): ``step_ms = FSDP hooks + forward + backward +
  optimizer + other + outside the span + unattributed``: the CPU phase durations (``StepFacts.phase_ms``) with the
  FSDP hook CPU time inside each (``FsdpFacts.hook_cpu_ms_by_phase``, collective calls inside the
  hooks left out) taken out into a part of its own, resolved by phase; *other* is the CPU span's
  time outside every phase's interval (``StepFacts.cpu_outside_phases_ms``), measured; *outside
  the span* is the step's interval on the step clock outside its CPU span (:func:`outside_span_ms`:
  between the previous span and this one, or after it until its GPU work is done), measured; what
  the parts leave of the step time is *unattributed*, named as such (0 to float rounding where the
  phases' intervals do not overlap). The GPU split is unavailable.

Causes (:mod:`.compare_causes`): every finding that appeared takes the parts of the step it
explains that grew, every finding that went away those that shrank, and the rest stays with the
parts themselves, so the causes also add up to the delta; a finding that takes nothing is listed
as explaining nothing measurable. The causes are ranked by the delta they carry in the direction
of the total change, and the top one, a measured part (with the finding that explains it, where
one does), is the primary cause.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

from fsdpdoctor.engine import Finding
from fsdpdoctor.facts import EXPOSED, RankFacts, RunFacts  # noqa: F401  (EXPOSED re-exported)
from fsdpdoctor.analysis.compare.causes import Cause, offsets, primary, rank_causes  # noqa: F401  (Cause, offsets re-exported)
from fsdpdoctor.analysis.compare.tables import (
    PHASES,
    Change,
    CollectiveRow,
    FindingChange,
    RankRow,
    UnitRow,
    _alignment,
    _collective_rows,
    _mean,
    _rank_rows,
    _unit_rows,
    findings_diff,
    structure_diff,
)
from fsdpdoctor.analysis.compare.waterfall import waterfall_split

STEP_CLOCK_SCHEMA = 3  # facts of this schema on measure a step from completion to completion
ALL = "all"  # a part that RunFacts does not resolve by phase

GPU_COMPONENTS = (
    "compute",
    "exposed_all_gather",
    "exposed_reduce_scatter",
    "exposed_other_comm",
    "memcpy",
    "host_bound_idle",
    "other_idle",
    "gpu_unattributed",
)
CPU_COMPONENTS = (
    "cpu_fsdp_hooks",
    "cpu_forward",
    "cpu_backward",
    "cpu_optimizer",
    "cpu_other",
    "cpu_outside_span",
    "cpu_unattributed",
)

GPU_BASIS = (
    "step time = interval between step completions (CPU span and its GPU work both done), mean over each "
    "rank's steps then over ranks; "
    "split per step on the step clock, instant by instant: each instant of the step's interval (one step time "
    "ending at its completion) goes to the first of compute (a compute kernel of any step runs), exposed "
    "all-gather / reduce-scatter / other comm (a collective kernel runs, by its collective's kind), exposed "
    "memcpy/memset, host-bound idle (nothing runs, inside the step's GPU-window gaps with the CPU not blocked) and "
    "other idle (nothing runs: the step's edges, idle inside CPU synchronizations); the parts tile the interval, "
    "so what they leave (unattributed) is float rounding; exposed comm is split by phase"
)
CPU_BASIS = (
    "step time = interval between step completions (the CPU ProfilerStep spans), mean over each rank's steps then over ranks; no GPU "
    "timeline, so it is split on the CPU: FSDP hook CPU time (collective calls inside the hooks left out) + forward, "
    "backward and optimizer outside the hooks + the rest of the CPU span (outside every phase's interval) + the "
    "step's interval on the step clock outside its CPU span (between the spans, or until its GPU work is done), each "
    "measured on its own; what they leave of the step time is shown as unattributed (phases whose intervals "
    "overlap); the GPU split (compute / exposed comm / idle) is unavailable"
)

# ------------------------------------------------------------------------------------------
# result classes
# ------------------------------------------------------------------------------------------


@dataclass
class Component:
    """One part of the step time (``phase`` "all" when RunFacts does not split it by phase)."""

    name: str
    phase: str
    before_ms: float
    after_ms: float

    @property
    def delta_ms(self) -> float:
        return self.after_ms - self.before_ms


@dataclass
class PhaseRow:
    phase: str
    cpu_before_ms: float | None
    cpu_after_ms: float | None
    exposed_delta_ms: dict[str, float] = field(default_factory=dict)  # component → Δ (GPU runs)


@dataclass
class Comparison:
    before_label: str
    after_label: str
    basis: str  # "gpu" or "cpu"
    basis_text: str
    step_before_ms: float
    step_after_ms: float
    components: list[Component]
    phases: list[PhaseRow]
    structure: list[Change]
    findings: list[FindingChange]
    causes: list[Cause]
    primary_cause: str | None
    ranks: list[RankRow]
    units: list[UnitRow]
    collectives: list[CollectiveRow]
    alignment: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    fsdp_versions: tuple[int | None, int | None] = (None, None)
    # the GPU compute change split by what changed (:func:`compute_split`); empty without FLOPs
    compute_split: dict[str, float] = field(default_factory=dict)
    # the step as the waterfall's parts, before and after (:mod:`.compare_waterfall`); GPU runs
    waterfall: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the runs' own step-to-step noise on the difference (:func:`step_noise`): None with fewer
    # than MIN_STEPS steps in either run; ``spread`` says what it rests on; ``significant``:
    # the step time moved by more than the noise (or, without it, by 1% or with a finding)
    noise_ms: float | None = None
    spread: str = ""
    significant: bool = True

    # -- headline numbers ------------------------------------------------------------------
    @property
    def step_time_delta_ms(self) -> float:
        return self.step_after_ms - self.step_before_ms

    @property
    def step_time_delta_pct(self) -> float | None:
        return 100.0 * self.step_time_delta_ms / self.step_before_ms if self.step_before_ms else None

    @property
    def components_sum_ms(self) -> float:
        return sum(c.delta_ms for c in self.components)

    def component_totals(self) -> dict[str, tuple[float, float]]:
        """component → (before, after) summed over phases, in display order."""
        names = GPU_COMPONENTS if self.basis == "gpu" else CPU_COMPONENTS
        out = {n: (0.0, 0.0) for n in names}
        for c in self.components:
            b, a = out.get(c.name, (0.0, 0.0))
            out[c.name] = (b + c.before_ms, a + c.after_ms)
        return out

    @property
    def primary(self) -> Cause | None:
        return next((c for c in self.causes if c.slug == self.primary_cause), None)


# ------------------------------------------------------------------------------------------
# step-time breakdown of one run
# ------------------------------------------------------------------------------------------


def _comm_component(kind: str) -> str:
    if kind == "all_gather":
        return "exposed_all_gather"
    if kind == "reduce_scatter":
        return "exposed_reduce_scatter"
    return "exposed_other_comm"


def outside_span_ms(s) -> float:
    """The step's interval on the step clock (``step_ms`` ending at ``end_us``) outside its CPU
    ``ProfilerStep`` span, measured as intervals: the time between the previous step's span and
    this one (the loop's own code around ``prof.step()``), and after the span until the step
    completes (its GPU work finishing). 0 where the facts do not place the step (no ``end_us`` or
    span)."""
    if s.end_us is None or s.cpu_span_ms <= 0:
        return 0.0
    lo, hi = s.end_us - s.step_ms * 1e3, s.end_us
    a, b = s.start_us, s.start_us + s.cpu_span_ms * 1e3
    inside = max(min(hi, b) - max(lo, a), 0.0)
    return (hi - lo - inside) / 1e3


def _rank_cells(r: RankFacts, basis: str, hooks: bool = False) -> dict[tuple[str, str], float]:
    """Mean per step of each (component, phase) of one rank; they add up to its mean step_ms.
    ``hooks`` (CPU runs): FSDP hook CPU time taken out of each phase into its own part."""
    n = len(r.steps)
    cells: dict[tuple[str, str], float] = {}

    def add(key: tuple[str, str], v: float) -> None:
        cells[key] = cells.get(key, 0.0) + v / n

    if basis == "cpu":
        for s in r.steps:
            known = 0.0
            for p in ("forward", "backward", "optimizer"):
                v = s.phase_ms.get(p, 0.0)
                add((f"cpu_{p}", ALL), v)
                known += v
            # the rest of the CPU span, measured (its time outside every phase's interval); what
            # the parts leave of the step (the step clock past the CPU span, phases that overlap,
            # facts saved before the rest was measured) is unattributed, named as such
            add(("cpu_other", ALL), s.cpu_outside_phases_ms)
            outside = outside_span_ms(s)
            add(("cpu_outside_span", ALL), outside)
            add(("cpu_unattributed", ALL), s.step_ms - known - s.cpu_outside_phases_ms - outside)
        for p, v in (r.fsdp.hook_cpu_ms_by_phase if hooks else {}).items():
            cells[("cpu_fsdp_hooks", p)] = cells.get(("cpu_fsdp_hooks", p), 0.0) + v
            key = ("cpu_other" if p not in ("forward", "backward", "optimizer") else f"cpu_{p}", ALL)
            cells[key] = cells.get(key, 0.0) - v
        return cells
    if all(s.clock_split_ms for s in r.steps):
        return _clock_cells(r)
    exposed_total = 0.0
    exposed_phase = {p: 0.0 for p in PHASES}
    for s in r.steps:
        add(("compute", ALL), s.compute_ms)
        add(("memcpy", ALL), s.memcpy_ms)
        add(("host_bound_idle", ALL), s.idle_ms - s.idle_cpu_blocked_ms)
        # other idle measured on its own intervals (the step clock's idle outside the host-bound
        # gaps); what the parts leave of the step is unattributed, named as such, in no cause
        other = s.idle_not_host_bound_ms or 0.0  # None: facts saved before it was measured
        add(("other_idle", ALL), other)
        known = s.compute_ms + s.exposed_comm_ms + s.memcpy_ms + s.idle_ms - s.idle_cpu_blocked_ms + other
        add(("gpu_unattributed", ALL), s.step_ms - known)
        exposed_total += s.exposed_comm_ms
        for p, v in s.exposed_by_phase.items():
            exposed_phase[p if p in exposed_phase else "other"] += v
    # exposed comm by kind and phase from the collectives; the uncovered rest is "other" comm
    covered = 0.0
    covered_phase = {p: 0.0 for p in PHASES}
    for ph_, kinds in (r.exposed_ms_by_phase_kind or {}).items():  # a rank whose collectives were dropped
        ph = ph_ if ph_ in covered_phase else "other"
        for kind, v in kinds.items():
            add((_comm_component(kind), ph), v * n)
            covered += v * n
            covered_phase[ph] += v * n
    for c in r.collectives:
        if 0 <= c.step < n and c.exposed_us:
            ph = c.phase if c.phase in covered_phase else "other"
            add((_comm_component(c.kind), ph), c.exposed_us / 1e3)
            covered += c.exposed_us / 1e3
            covered_phase[ph] += c.exposed_us / 1e3
    rest = exposed_total - covered
    if abs(rest) > 1e-12:
        share = {p: max(exposed_phase[p] - covered_phase[p], 0.0) for p in PHASES}
        tot = sum(share.values())
        if tot > 0:
            for p, v in share.items():
                if v:
                    add(("exposed_other_comm", p), rest * v / tot)
        else:
            add(("exposed_other_comm", "other"), rest)
    return cells


#: the step-clock split's parts that are compare's parts as they are (resolved per step only)
_CLOCK_PARTS = ("compute", "memcpy", "host_bound_idle", "other_idle")


def _clock_cells(r: RankFacts) -> dict[tuple[str, str], float]:
    """A rank's cells (means per step) from its steps' ``clock_split_ms``: every instant of each
    step's interval on the step clock in one part (:mod:`fsdpdoctor.analysis.timeline.split`),
    exposed comm by kind and phase; what they leave of the step (float rounding) is unattributed,
    named as such."""
    n = len(r.steps)
    cells: dict[tuple[str, str], float] = {}

    def add(key: tuple[str, str], v: float) -> None:
        cells[key] = cells.get(key, 0.0) + v / n

    for s in r.steps:
        known = 0.0
        for part, v in s.clock_split_ms.items():
            if part.startswith("comm:"):
                _, kind, ph = part.split(":", 2)
                add((_comm_component(kind), ph if ph in PHASES else "other"), v)
            elif part in _CLOCK_PARTS:
                add((part, ALL), v)
            else:  # a part this version does not know: left to the remainder, never spread
                continue
            known += v
        add(("gpu_unattributed", ALL), s.step_ms - known)
    return cells


MIN_STEPS = 2  # steps per run, at least, to measure its step-to-step spread (a variance needs two)


def step_samples(f: RunFacts, basis: str) -> list[float]:
    """The run's step times, one a step (the mean over its ranks of each step's time), each less
    the torch.compile work in it (a recompilation: a cause compile-in-window names, not noise)."""
    ranks = [r for r in _ranks_for(f, basis) if r.steps]
    if not ranks:
        return []
    n = min(len(r.steps) for r in ranks)

    def compiling(r: RankFacts, i: int) -> float:
        cw = r.compile_window
        return cw.steady_compile_ms.get(str(r.steps[i].number), 0.0) if cw is not None else 0.0

    return [sum(r.steps[i].step_ms - compiling(r, i) for r in ranks) / len(ranks) for i in range(n)]


def step_noise(before: RunFacts, after: RunFacts, basis: str) -> tuple[float | None, str]:
    """(the noise on the difference of the two runs' mean steps, what it rests on): two standard
    errors of the difference of the means (each run's own step-to-step variance over its steps),
    None where either run has fewer than MIN_STEPS steps."""
    xb, xa = step_samples(before, basis), step_samples(after, basis)
    if len(xb) < MIN_STEPS or len(xa) < MIN_STEPS:
        return None, f"too few steps to measure the runs' spread ({len(xb)} and {len(xa)}; {MIN_STEPS} needed)"

    def var(x: list[float]) -> float:
        m = sum(x) / len(x)
        return sum((v - m) ** 2 for v in x) / (len(x) - 1)

    noise = 2 * math.sqrt(var(xb) / len(xb) + var(xa) / len(xa))
    less = (
        " (less their torch.compile work)"
        if any(
            r.compile_window is not None and r.compile_window.steady_compile_ms
            for f in (before, after)
            for r in f.all_ranks()
        )
        else ""
    )
    spread = (
        f"steps{less} {min(xb):.2f}–{max(xb):.2f} ms before ({len(xb)} steps), {min(xa):.2f}–{max(xa):.2f} ms after "
        f"({len(xa)}): ±{noise:.2f} ms on the difference (two standard errors)"
    )
    return noise, spread


def _ranks_for(f: RunFacts, basis: str) -> list[RankFacts]:
    rs = [r for r in f.all_ranks() if r.steps]
    if basis == "gpu":
        rs = [r for r in rs if r.gpu_present] or rs
    return rs


def hooks_split(f: RunFacts) -> bool:
    """Whether a run's facts split FSDP hook CPU time by phase on every rank compare reads (a rank
    without FSDP has none to split); facts saved before they held it do not."""
    return all(r.fsdp.version is None or r.fsdp.hook_cpu_ms_by_phase for r in _ranks_for(f, "cpu"))


def breakdown(f: RunFacts, basis: str, hooks: bool = False) -> tuple[float, dict[tuple[str, str], float]]:
    """(mean step time, cells) of a run on ``basis`` ("gpu" or "cpu"); cells sum to the step time.
    ``hooks``: on CPU runs, FSDP hook CPU time as a part of its own (:func:`hooks_split`)."""
    ranks = _ranks_for(f, basis)
    if not ranks:
        return 0.0, {}
    per = [_rank_cells(r, basis, hooks) for r in ranks]
    keys = sorted({k for c in per for k in c})
    cells = {k: _mean([c.get(k, 0.0) for c in per]) for k in keys}
    step = _mean([_mean([s.step_ms for s in r.steps]) for r in ranks])
    return step, cells


def step_time_ms(f: RunFacts) -> float | None:
    """The step time compare and check use: mean over ranks of each rank's mean ProfilerStep span."""
    basis = "gpu" if f.gpu_present else "cpu"
    ranks = _ranks_for(f, basis)
    if not ranks:
        return None
    return _mean([_mean([s.step_ms for s in r.steps]) for r in ranks])


COMPUTE_SPLIT = {
    "flops": "FLOPs changed (model, batch or sequence)",
    "recompute": "activation-checkpointing recompute added or removed",
    "engine": "GEMM / attention on another engine or dtype",
    "efficiency": "same engine, another achieved TFLOP/s",
    "other_kernels": "other compute kernels (elementwise, norms, optimizer)",
    "unattributed": "not attributed: the compute change less the measured parts above",
}


def compute_split(before: RunFacts, after: RunFacts, total: float | None = None) -> dict[str, float]:
    """The change in GPU compute per step (``total``: compare's compute part, measured on the step
    clock; else ``timeline.compute_ms``, the steps' own compute) split by what changed (ms):

    * *recompute*: the change in activation checkpointing's re-run forward, every re-run kernel
      (the efficiency waterfall's ``recompute`` part, the figure FSD019 and the headline give;
      the recomputed GEMM / attention kernels alone where a run has no waterfall);
    * *flops*: the after run's model FLOPs minus the before run's, at the before run's achieved
      rate (model FLOPs per ms of its non-recomputed GEMM + attention kernels);
    * *engine* (the GEMM engine changed, ``compute.compute_dtype``) or *efficiency* (it did not):
      the after run's non-recomputed GEMM + attention time minus what its model FLOPs would take
      at the before rate;
    * *other_kernels*: the change in the waterfall's other-kernels part (the non-GEMM compute
      kernels' own intervals, measured), where both runs have a waterfall;
    * *unattributed*: what the measured parts leave of the compute change, named as such (the
      parts are measured on their own kernels, not fitted to the total).

    Empty when either run has no FLOPs (no recorded shapes)."""
    b, a = before.compute, after.compute
    if b is None or a is None:
        return {}
    gb = b.gemm_ms_per_step + b.attention_ms_per_step - b.recompute_ms_per_step
    ga = a.gemm_ms_per_step + a.attention_ms_per_step - a.recompute_ms_per_step
    if gb <= 0 or not b.model_flops_per_step:
        return {}
    rate = b.model_flops_per_step / gb  # model FLOPs per ms of GEMM + attention kernels, before
    flops = (a.model_flops_per_step - b.model_flops_per_step) / rate
    recompute = a.recompute_ms_per_step - b.recompute_ms_per_step
    wf = before.efficiency is not None and after.efficiency is not None
    if wf:
        recompute = after.efficiency.parts_ms["recompute"] - before.efficiency.parts_ms["recompute"]
    kind = "engine" if (a.compute_dtype or "") != (b.compute_dtype or "") else "efficiency"
    if total is None:
        total = after.timeline.compute_ms - before.timeline.compute_ms
    out = {"flops": flops, "recompute": recompute, kind: ga - gb - flops}
    if wf:
        out["other_kernels"] = after.efficiency.parts_ms["other_kernels"] - before.efficiency.parts_ms["other_kernels"]
    out["unattributed"] = total - sum(out.values())
    return out


# ------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------


def compare(
    before: RunFacts,
    after: RunFacts,
    before_findings: list[Finding] | None = None,
    after_findings: list[Finding] | None = None,
    *,
    before_label: str = "before",
    after_label: str = "after",
) -> Comparison:
    """Compare two runs. Findings default to running the rules on each RunFacts."""
    if before_findings is None or after_findings is None:
        from fsdpdoctor.engine import run_rules

        before_findings = run_rules(before) if before_findings is None else before_findings
        after_findings = run_rules(after) if after_findings is None else after_findings
    notes: list[str] = []
    basis = "gpu" if before.gpu_present and after.gpu_present else "cpu"
    if basis == "cpu" and (before.gpu_present or after.gpu_present):
        notes.append("only one run has a GPU timeline: both are compared on CPU phase times")
    for f, label in ((before, before_label), (after, after_label)):
        if f.gpu_present and f.schema_version < STEP_CLOCK_SCHEMA:
            notes.append(
                f"{label}: saved by an fsdpdoctor whose step time was the CPU ProfilerStep span (schema "
                f"{f.schema_version} < {STEP_CLOCK_SCHEMA}); where the GPU runs behind the CPU the two runs are "
                "on different clocks: regenerate it with 'fsdpdoctor analyze TRACES --save-baseline FILE'"
            )
        old_split = basis == "gpu" and any(not s.clock_split_ms for r in _ranks_for(f, basis) for s in r.steps)
        if old_split:
            notes.append(
                f"{label}: saved before fsdpdoctor split the step on the step clock instant by instant: its compute, "
                "exposed comm and memcpy are the step's GPU-window figures, and what they leave of the step is "
                "unattributed (regenerate it with 'fsdpdoctor analyze TRACES --save-baseline FILE')"
            )
        if old_split and any(s.idle_not_host_bound_ms is None for r in _ranks_for(f, basis) for s in r.steps):
            notes.append(
                f"{label}: saved before fsdpdoctor measured the idle outside the host-bound gaps: its other idle "
                "is shown as unattributed (regenerate it with 'fsdpdoctor analyze TRACES --save-baseline FILE')"
            )
    hooks = basis == "cpu" and hooks_split(before) and hooks_split(after)
    if basis == "cpu" and not hooks:
        notes.append(
            "FSDP hook CPU time is not split out of the CPU phases: a run's facts were saved before fsdpdoctor "
            "measured it by phase (regenerate them with 'fsdpdoctor analyze TRACES --save-baseline FILE')"
        )
    sb, cb = breakdown(before, basis, hooks)
    sa, ca = breakdown(after, basis, hooks)
    if not any(r.steps for r in before.all_ranks()):
        notes.append(f"{before_label}: no steps found, step time taken as 0")
    if not any(r.steps for r in after.all_ranks()):
        notes.append(f"{after_label}: no steps found, step time taken as 0")
    names = GPU_COMPONENTS if basis == "gpu" else CPU_COMPONENTS
    phase_order = {p: i for i, p in enumerate((*PHASES, ALL))}
    keys = sorted(
        set(cb) | set(ca), key=lambda k: (names.index(k[0]) if k[0] in names else 99, phase_order.get(k[1], 99))
    )
    components = [Component(k[0], k[1], cb.get(k, 0.0), ca.get(k, 0.0)) for k in keys]
    cells = {k: (cb.get(k, 0.0), ca.get(k, 0.0)) for k in keys}

    # per-phase view: CPU phase durations and, on GPU runs, exposed comm by kind
    def phase_ms(f: RunFacts, p: str) -> float | None:
        ranks = _ranks_for(f, basis)

        def one(s) -> float:
            if p == "other":  # the CPU span outside forward, backward and optimizer, measured
                return s.cpu_outside_phases_ms
            return s.phase_ms.get(p, 0.0)

        vals = [_mean([one(s) for s in r.steps]) for r in ranks]
        return _mean(vals) if vals else None

    phases = []
    for p in PHASES:
        pr = PhaseRow(p, phase_ms(before, p), phase_ms(after, p))
        if basis == "gpu":
            pr.exposed_delta_ms = {
                c: cells.get((c, p), (0.0, 0.0))[1] - cells.get((c, p), (0.0, 0.0))[0] for c in EXPOSED
            }
        phases.append(pr)
    if basis == "gpu":
        notes.append("compute, memcpy and idle are per step only: RunFacts does not split GPU compute or idle by phase")
    else:
        notes.append(
            "no GPU timeline in "
            + ("either run" if not (before.gpu_present or after.gpu_present) else "one run")
            + ": the GPU split (compute / exposed comm / idle) is unavailable"
        )

    fchanges = findings_diff(before_findings, after_findings)
    structure = structure_diff(before, after)
    delta = sa - sb
    causes = rank_causes(cells, fchanges, basis, delta, structure)
    any_finding_change = any(fc.status != "persisting" for fc in fchanges)
    noise, spread = step_noise(before, after, basis)
    if noise is not None:  # measured: the change stands out of the runs' own step-to-step spread
        significant = abs(delta) > noise
    else:  # too few steps to measure the spread
        significant = bool(any_finding_change or (sb and abs(delta) / sb >= 0.01) or (not sb and abs(delta) > 0))
    prim = primary(causes, delta, significant)
    comp = [c for c in components if c.name == "compute"]
    split = compute_split(before, after, sum(c.delta_ms for c in comp) if comp else None) if basis == "gpu" else {}
    parts, why = (
        waterfall_split(
            before, after, [r.rank for r in _ranks_for(before, basis)], [r.rank for r in _ranks_for(after, basis)]
        )
        if basis == "gpu"
        else ({}, None)
    )
    notes += [why] if why else []
    return Comparison(
        compute_split=split,
        waterfall=parts,
        before_label=before_label,
        after_label=after_label,
        basis=basis,
        basis_text=GPU_BASIS if basis == "gpu" else CPU_BASIS,
        step_before_ms=sb,
        step_after_ms=sa,
        components=components,
        phases=phases,
        structure=structure,
        findings=fchanges,
        causes=causes,
        primary_cause=prim.slug if prim is not None else None,
        ranks=_rank_rows(before, after, basis),
        units=_unit_rows(before, after),
        collectives=_collective_rows(before, after),
        alignment=_alignment(before, after),
        notes=notes,
        fsdp_versions=(before.fsdp.version, after.fsdp.version),
        noise_ms=noise,
        spread=spread,
        significant=significant,
    )
