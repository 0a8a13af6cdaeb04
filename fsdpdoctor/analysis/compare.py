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
  memcpy + host-bound idle + other idle`` where compute, exposed comm and memcpy are the
  analysis' merged-interval figures (``StepFacts``), exposed comm is split by kind and phase with
  each collective's ``exposed_us`` (pieces not covered by a known collective count as other
  exposed comm), and

  - *host-bound idle* = ``StepFacts.idle_ms``, gaps *inside* the step's GPU window in which
    nothing ran. A collective waiting for a slower rank is a running NCCL kernel, so waiting for
    other ranks shows as exposed comm, never here: an empty GPU queue mid-step means the host
    had not launched the next work yet (launch/Python/FSDP-hook overhead, the FSDP1 rate
    limiter, blocking syncs).
    Idle while the CPU sits in a blocking call (both sides waiting on something the trace does
    not show: another rank, an event) is not host-bound and goes to *other idle*.
  - *other idle* = ``step_ms - gpu_window_ms + other_steps_ms + idle_cpu_blocked_ms``, the part
    of the step with none of the step's GPU work running: before the first and after the last
    kernel (data loading, a CPU optimizer step, host synchronisation), inside the window where
    only other steps' work runs, and idle inside CPU synchronizations. It is negative when a
    step's GPU window is longer than its step time, which keeps the sum exact.

  Exposed comm is resolved by phase (forward / backward / optimizer / other, from the CPU time
  each collective was issued); compute, memcpy and idle are per step only (``phase == "all"``),
  because RunFacts holds no per-phase GPU compute or idle.
* **CPU-only runs** (gloo, no GPU timeline): ``step_ms = forward + backward + optimizer + other``
  from ``StepFacts.phase_ms`` (CPU phase durations); the GPU split is unavailable.

Causes: every finding that appeared takes the parts of the step it explains (its rule module's
``EXPLAINS``, in ``CLAIM_PRIORITY`` order when several could) that grew, every finding that went away those that
shrank, and the rest stays with the parts themselves, so the causes also add up to the delta. A
configuration finding whose configuration did not change (its rule's ``CONFIG_KEYS``: it only
crossed a threshold) takes nothing. On GPU runs the causes are ranked by the
delta they carry (in the direction of the total change) and the top one is the primary cause.
On CPU-only runs the step time says little about FSDP's overlap, so findings that appeared (then
disappeared) rank first, by severity.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from ..engine import SEVERITIES, Finding, load_rules
from ..facts import RankFacts, RunFacts
from .compare_tables import (  # noqa: F401  (re-exported: the comparison's row types)
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
from .compare_waterfall import waterfall_split

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
)
CPU_COMPONENTS = ("cpu_forward", "cpu_backward", "cpu_optimizer", "cpu_other")
EXPOSED = ("exposed_all_gather", "exposed_reduce_scatter", "exposed_other_comm")

GPU_BASIS = (
    "step time = interval between step completions (CPU span and its GPU work both done), mean over each "
    "rank's steps then over ranks; "
    "split per step as compute + exposed all-gather + exposed reduce-scatter + other exposed comm + "
    "exposed memcpy + host-bound idle (GPU idle inside the step's GPU window, the CPU not blocked on it) + "
    "other idle (step time minus GPU window, and idle inside CPU synchronizations), which add up exactly; "
    "exposed comm is split by phase"
)
CPU_BASIS = (
    "step time = interval between step completions (the CPU ProfilerStep spans), mean over each rank's steps then over ranks; no GPU "
    "timeline, so it is split into CPU phases (forward + backward + optimizer + rest), which add up "
    "exactly; the GPU split (compute / exposed comm / idle) is unavailable"
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
class Cause:
    slug: str  # a finding slug or a component name
    kind: str  # "finding" or "component"
    delta_ms: float
    summary: str
    status: str | None = None  # for findings: appeared / disappeared
    severity: str | None = None
    est_saving_ms: float | None = None
    parts: list[str] = field(default_factory=list)  # "component@phase" it covers
    fix: dict[str, str] = field(default_factory=dict)
    corroborated: bool = True  # False: a configuration finding whose configuration did not change
    note: str = ""


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


def _rank_cells(r: RankFacts, basis: str) -> dict[tuple[str, str], float]:
    """Mean per step of each (component, phase) of one rank; they add up to its mean step_ms."""
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
            add(("cpu_other", ALL), s.step_ms - known)
        return cells
    exposed_total = 0.0
    exposed_phase = {p: 0.0 for p in PHASES}
    for s in r.steps:
        add(("compute", ALL), s.compute_ms)
        add(("memcpy", ALL), s.memcpy_ms)
        add(("host_bound_idle", ALL), s.idle_ms - s.idle_cpu_blocked_ms)
        add(("other_idle", ALL), s.step_ms - s.gpu_window_ms + s.other_steps_ms + s.idle_cpu_blocked_ms)
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


def _ranks_for(f: RunFacts, basis: str) -> list[RankFacts]:
    rs = [r for r in f.all_ranks() if r.steps]
    if basis == "gpu":
        rs = [r for r in rs if r.gpu_present] or rs
    return rs


def breakdown(f: RunFacts, basis: str) -> tuple[float, dict[tuple[str, str], float]]:
    """(mean step time, cells) of a run on ``basis`` ("gpu" or "cpu"); cells sum to the step time."""
    ranks = _ranks_for(f, basis)
    if not ranks:
        return 0.0, {}
    per = [_rank_cells(r, basis) for r in ranks]
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
}


def compute_split(before: RunFacts, after: RunFacts) -> dict[str, float]:
    """The change in GPU compute per step (``timeline.compute_ms``) split by what changed, the
    parts adding up to it exactly (ms):

    * *recompute*: the change in the measured time of the recomputed GEMM / attention kernels
      (activation checkpointing);
    * *flops*: the after run's model FLOPs minus the before run's, at the before run's achieved
      rate (model FLOPs per ms of its non-recomputed GEMM + attention kernels);
    * *engine* (the GEMM engine changed, ``compute.compute_dtype``) or *efficiency* (it did not):
      the after run's non-recomputed GEMM + attention time minus what its model FLOPs would take
      at the before rate;
    * *other_kernels*: the rest of the compute change (non-GEMM kernels).

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
    kind = "engine" if (a.compute_dtype or "") != (b.compute_dtype or "") else "efficiency"
    total = after.timeline.compute_ms - before.timeline.compute_ms
    out = {"flops": flops, "recompute": recompute, kind: ga - gb - flops}
    out["other_kernels"] = total - sum(out.values())
    return out


# ------------------------------------------------------------------------------------------
# structure, findings, alignment
# ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _rules_by_slug() -> dict[str, Any]:
    return {r.slug: r for r in load_rules()}


def _rule(slug: str) -> Any:
    return _rules_by_slug().get(slug)


def _changed(structure: list[Change], key: str) -> bool:
    """A structure row matching ``key`` (or starting with it, when it ends with '.') changed
    between two known values."""
    return any(
        s.changed
        and _known(s.before)
        and _known(s.after)
        and (s.key == key or (key.endswith(".") and s.key.startswith(key)))
        for s in structure
    )


def _claims_for(slug: str, basis: str, structure: list[Change]) -> tuple[list[tuple[str, str | None]], str]:
    """The parts of the step a finding explains (its rule's ``EXPLAINS``, plus ``EXPLAINS_IF_CHANGED``
    entries whose structure key changed) and the note those extra parts carry."""
    rule = _rule(slug)
    claims = list(rule.explains.get(basis, [])) if rule else []
    note = ""
    for key, extra in (rule.explains_if_changed if rule else {}).items():
        if extra.get(basis) and _changed(structure, key):
            claims += extra[basis]
            note = extra.get("note", "")
    return claims, note


def _corroborated(slug: str, structure: list[Change]) -> bool:
    """A finding about a configuration (its rule's ``CONFIG_KEYS``) explains a change only when that
    configuration changed; otherwise it appeared or disappeared by crossing a threshold."""
    rule = _rule(slug)
    keys = rule.config_keys if rule else None
    if keys is None:
        return True  # a measured finding: its appearance is the evidence
    return any(_changed(structure, k) for k in keys)


def _known(v: str) -> bool:
    return v not in ("", "–", "unknown", "None")


def _rank_causes(
    cells: dict[tuple[str, str], tuple[float, float]],
    changes: list[FindingChange],
    basis: str,
    b: RunFacts,
    a: RunFacts,
    total_delta: float,
    structure: list[Change],
) -> list[Cause]:
    remaining = dict(cells)
    taken_by: dict[tuple[str, str], str] = {}
    candidates = [fc for fc in changes if fc.status in ("appeared", "disappeared")]
    candidates.sort(key=lambda fc: (_rule(fc.slug).claim_priority if _rule(fc.slug) else 1000, fc.status != "appeared"))
    causes: list[Cause] = []
    for fc in candidates:
        claims, extra_note = _claims_for(fc.slug, basis, structure)
        corroborated = _corroborated(fc.slug, structure)
        mine = [k for k in cells if any(k[0] == comp and (ph is None or k[1] == ph) for comp, ph in claims)]
        # a finding that appeared explains parts that grew; one that went away, parts that shrank
        want = 1.0 if fc.status == "appeared" else -1.0
        taken = [k for k in mine if k in remaining and want * (cells[k][1] - cells[k][0]) > 0] if corroborated else []
        delta = sum(remaining[k][1] - remaining[k][0] for k in taken)
        for k in taken:
            del remaining[k]
            taken_by[k] = fc.slug
        note = ""
        if not corroborated:
            note = f"{fc.status} without a change in the configuration it is about (a threshold was crossed): no share of the delta given to it"
        elif not claims:
            note = "no part of the step time is attributed to this finding"
        elif extra_note and taken:
            note = extra_note
        elif mine and not taken:
            others = sorted({taken_by[k] for k in mine if k in taken_by})
            if others:
                note = "its parts of the step time are already counted under " + ", ".join(others)
            else:
                note = "the parts of the step time it explains did not " + ("grow" if want > 0 else "shrink")
        causes.append(
            Cause(
                slug=fc.slug,
                kind="finding",
                delta_ms=delta,
                summary=fc.summary,
                status=fc.status,
                severity=fc.severity,
                est_saving_ms=fc.est_saving_after_ms if fc.status == "appeared" else fc.est_saving_before_ms,
                parts=[f"{c}@{p}" for c, p in sorted(taken)],
                fix=fc.fix if fc.status == "appeared" else {},
                corroborated=corroborated,
                note=note,
            )
        )
    by_comp: dict[str, list[tuple[str, str]]] = {}
    for k in remaining:
        by_comp.setdefault(k[0], []).append(k)
    for comp, keys in by_comp.items():
        delta = sum(remaining[k][1] - remaining[k][0] for k in keys)
        causes.append(
            Cause(
                slug=comp,
                kind="component",
                delta_ms=delta,
                summary="",  # worded by the reporters (fsdpdoctor.report.comparison)
                parts=[f"{c}@{p}" for c, p in sorted(keys)],
            )
        )
    sign = 1.0 if total_delta >= 0 else -1.0
    sev = {s: i for i, s in enumerate(SEVERITIES)}
    if basis == "gpu":
        causes.sort(key=lambda c: -sign * c.delta_ms)
    else:
        # CPU-only: a corroborated finding that appeared (then one that disappeared) outranks
        # the phase times, which do not show FSDP's overlap; findings about a configuration
        # that changed come first
        def key(c: Cause):
            if c.kind == "finding" and c.corroborated:
                about_config = 0 if _rule(c.slug) is not None and _rule(c.slug).config_keys is not None else 1
                return (
                    0 if c.status == "appeared" else 1,
                    about_config,
                    sev.get(c.severity or "", 9),
                    -sign * c.delta_ms,
                )
            return (2, 0, 0, -sign * c.delta_ms)

        causes.sort(key=key)
    return causes


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
        from ..engine import run_rules

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
    sb, cb = breakdown(before, basis)
    sa, ca = breakdown(after, basis)
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
            if p == "other":  # the rest of the step outside forward, backward and optimizer
                return (s.cpu_span_ms or s.step_ms) - sum(
                    s.phase_ms.get(q, 0.0) for q in ("forward", "backward", "optimizer")
                )
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
    causes = _rank_causes(cells, fchanges, basis, before, after, sa - sb, structure)
    delta = sa - sb
    any_finding_change = any(fc.status != "persisting" for fc in fchanges)
    primary = None
    if causes and (any_finding_change or (sb and abs(delta) / sb >= 0.01) or (not sb and abs(delta) > 0)):
        primary = causes[0].slug
    split = compute_split(before, after) if basis == "gpu" else {}
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
        primary_cause=primary,
        ranks=_rank_rows(before, after, basis),
        units=_unit_rows(before, after),
        collectives=_collective_rows(before, after),
        alignment=_alignment(before, after),
        notes=notes,
        fsdp_versions=(before.fsdp.version, after.fsdp.version),
    )
