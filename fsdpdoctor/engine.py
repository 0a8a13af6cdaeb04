"""Rule registry and runner.

A rule is a module with ``CODE``, ``SLUG``, ``TITLE``, ``SEVERITY`` (and the other metadata of
:class:`fsdpdoctor.rulemeta.RuleMeta`, read once by :func:`load_rules`), a docstring in the form
*What it detects / Why it hurts / How it shows in a trace / Fix*, and ``check(facts, cfg)``
returning a list of :class:`Finding`. Built-in rules live in the ``fsdpdoctor.rules`` package
(the top-level ``rules/`` folder); third-party rules register modules under the
``fsdpdoctor.rules`` entry-point group.

What the runner does with every finding, whatever the rule (so that no rule can get it wrong):

* **Saving bounds.** A rule's ``SAVES_ON`` says which clock its fix shortens: ``"gpu"`` (the
  default: GPU time inside the step's GPU window — exposed communication, idle gaps, copies)
  or ``"step"`` (time the GPU waits outside its window too, such as a CPU optimizer step). A
  saving is capped at that clock: the GPU window (never more than the wall-clock time per
  step) or the wall-clock time per step (:attr:`RunFacts.step_clock_ms`); on CPU-only traces,
  the CPU step. A capped estimate says so in its evidence.
* **Severity** of a finding with an estimated saving comes from the saving's share of the step
  (the step time): ``severity_critical_pct`` and ``severity_warning_pct`` in the
  thresholds table; below the warning share it is info; never above its rule's ``MAX_SEVERITY``
  (trade-off findings such as activation checkpointing's recompute). A finding without an estimate (CPU-only
  traces, memory findings) keeps the severity its rule gave it.
* **Memory pressure.** Memory advice (a rule with ``MEMORY_ADVICE = True``) is a warning or worse
  only when the run is short of memory (:attr:`RunFacts.memory_pressure`: it ran out, or the peak
  reserved reached ``memory_pressure_pct`` of the GPU or of ``--memory-budget``); otherwise info,
  stating the headroom: freeing memory nobody needs costs compute for nothing.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from fsdpdoctor.facts import RunFacts
from fsdpdoctor.fmt import ms
from fsdpdoctor.rulemeta import SEVERITIES, RuleError, RuleMeta, is_rule_module, rule_meta


@dataclass
class Finding:
    slug: str
    code: str
    severity: str
    summary: str
    evidence: list[str] = field(default_factory=list)  # numbers with units and where measured
    cause: str = ""
    fix: dict[str, str] = field(default_factory=dict)  # "fsdp1" / "fsdp2" / "any" → code
    confidence: float = 0.5
    est_saving_ms: float | None = None  # per step
    saving_pct_of_step: float | None = (
        None  # est_saving_ms as % of the step (wall-clock time per step): sets the severity
    )
    est_saving_bytes: int | None = None  # memory findings: bytes the fix frees at the peak
    where: dict[str, Any] = field(default_factory=dict)  # rank / step / phase / unit
    folded_into: str | None = None  # slug of the finding whose fix removes this cost (engine folds it)
    # where est_saving_ms comes from: "replay" (the what-if replay of the rule's fix),
    # "heuristic" (the rule's own estimate from measured figures), "heuristic-replay-off" (the
    # rule has a replay, but it misses the measured step by more than REPLAY_MAX_ERROR_PCT)
    saving_basis: str = ""
    # how closely the unchanged replay reproduces the measured run (%): fidelity, not the error of
    # the saving (that is saving_range_ms)
    replay_fidelity_pct: float | None = None
    # [low, high] ms per step the saving can be trusted to, measured on real twins (fsdpdoctor.savings),
    # and what the range rests on; model_saving_ms is the model's own figure (kept where a twin
    # withdrew the point estimate: est_saving_ms None)
    saving_range_ms: list[float] | None = None
    saving_range_basis: str = ""
    model_saving_ms: float | None = None
    # the kind of saving whose twins give the range: the rule's slug, or "slug/context" where the
    # fix behaves differently (a rule sets it; default the slug)
    saving_kind: str = ""
    # the part of the step the fix acts on (ms per step): no saving exceeds it ("at most X ms");
    # a rule sets it where it knows the part, else the clock its fix shortens bounds it
    saving_ceiling_ms: float | None = None
    # a rule's own estimate (no replay): its span [low, high] over the assumptions its formula
    # makes (ms per step) and those assumptions, stated: the range's width where no replay varies them
    saving_span_ms: list[float] | None = None
    saving_assumptions: str = ""


def load_rules() -> tuple[RuleMeta, ...]:
    """Built-in rules, then entry-point rules, as frozen :class:`RuleMeta`; sorted by code. A
    built-in rule whose metadata is wrong is a bug (RuleError); a plugin's is said in a warning
    and the plugin left out."""
    metas = dict(_builtin_rules())
    for ep in _plugin_entry_points():
        try:
            mod = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the tool, nor go unsaid
            msg = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
            _plugin_problem(ep, f"failed to load ({type(exc).__name__}{': ' + msg if msg else ''})")
            continue
        if not is_rule_module(mod):
            _plugin_problem(ep, "is not a rule module (it needs CODE, SLUG and check)")
            continue
        try:
            meta = rule_meta(mod)
        except RuleError as exc:
            _plugin_problem(ep, f"has unusable metadata ({exc})")
            continue
        metas.setdefault(meta.code, meta)
    return tuple(metas[k] for k in sorted(metas))


_BUILTIN: tuple[tuple[str, RuleMeta], ...] | None = None
_ENTRY_POINTS: tuple[Any, tuple] = (None, ())


def _builtin_rules() -> tuple[tuple[str, RuleMeta], ...]:
    """(code, metadata) of the built-in rules, read once per process (every analysis runs the
    rules: listing and checking them each time cost ~0.02 s a call)."""
    global _BUILTIN
    if _BUILTIN is None:
        from fsdpdoctor import rules as pkg

        found = []
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name.startswith("_"):
                continue
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            if is_rule_module(mod):
                found.append((mod.CODE, rule_meta(mod)))
        _BUILTIN = tuple(found)
    return _BUILTIN


def _plugin_entry_points() -> tuple:
    """The ``fsdpdoctor.rules`` entry points, looked up once per process (reading every installed
    distribution's metadata cost ~0.04 s a call); again if ``entry_points`` was replaced."""
    global _ENTRY_POINTS
    if _ENTRY_POINTS[0] is not entry_points:
        _ENTRY_POINTS = (entry_points, tuple(entry_points(group="fsdpdoctor.rules")))
    return _ENTRY_POINTS[1]


class PluginLoadWarning(UserWarning):
    """A rule plugin (entry point ``fsdpdoctor.rules``) could not be used; its rules do not run."""


#: entry point -> why it was not used, for every plugin that could not be (warned once each)
PLUGIN_PROBLEMS: dict[str, str] = {}


def _plugin_problem(ep, why: str) -> None:
    key = f"{ep.name} = {ep.value}"
    if key in PLUGIN_PROBLEMS:
        return
    PLUGIN_PROBLEMS[key] = why
    import warnings

    warnings.warn(PluginLoadWarning(f"rule plugin '{key}' {why}; its rules did not run"), stacklevel=3)


def find_rule(key: str) -> RuleMeta | None:
    key = key.strip().lower()
    for rule in load_rules():
        if key in (rule.code.lower(), rule.slug.lower()):
            return rule
    return None


def run_rules(facts: RunFacts, config: dict[str, Any] | None = None) -> list[Finding]:
    """All findings, in the one ranking of :func:`rank`."""
    cfg = config or {}
    from fsdpdoctor.config import defaults

    cfg = defaults() | cfg
    findings: list[Finding] = []
    disabled = set(cfg.get("disable", []))
    rules = [r for r in load_rules() if r.code not in disabled and r.slug not in disabled]
    for rule in rules:
        findings.extend(rule.check(facts, cfg))
    findings = _drop_explained(findings, {r.slug: set(r.superseded_by) for r in rules})
    findings = _fold(findings)
    by_slug = {r.slug: r for r in rules}
    for f in findings:
        rule = by_slug[f.slug]
        if rule.memory_advice:
            judge_pressure(f, facts)
        bound_saving(f, facts, rule.saves_on)
        mark_basis(f, facts, rule.replay_fix)
        set_range(f, facts, rule.replay_fix, rule.saves_on)
        grade(f, facts, cfg)
        cap = rule.max_severity
        if cap in SEVERITIES and SEVERITIES.index(f.severity) < SEVERITIES.index(cap):
            f.severity = cap  # a trade-off finding (its rule's MAX_SEVERITY) is never graded above it
        if facts.sampled and f.est_saving_ms is not None:
            sampled_down(f, facts)
    return rank(findings, frozenset(r.slug for r in rules if r.crash))


def sampled_down(f: Finding, facts: RunFacts) -> None:
    """A time finding on sampled traces: its figures rest on the events the sampling dropped (idle
    time where launches are missing, overlap without all the kernels): graded info, said so."""
    f.severity = "info"
    f.confidence = min(f.confidence, 0.3)
    f.evidence.append(
        f"the traces are sampled: they hold {facts.ops_recorded_pct:.1f}% of the CPU ops the profiler numbered "
        "between their first and last, so this figure rests on missing events (graded info; profile the "
        "whole window to confirm it)"
    )


def rank(findings: list[Finding], crash: set[str] | frozenset[str] = frozenset({"oom"})) -> list[Finding]:
    """The one order every report shows findings in (terminal, Markdown, HTML, JSON).

    1. What made the run crash (a rule with ``CRASH = True``, the OOM) comes first.
    2. Then by severity: a finding without a saving never outranks a critical one.
    3. Within a severity, findings with a time saving by what a user will get: the lower end of
       the saving's range (largest first); where two findings' ranges overlap, the one whose
       range rests on real twins goes first; then memory findings by bytes freed (largest
       first), then the rest by code.
    """
    sev = {s: i for i, s in enumerate(SEVERITIES)}

    def low(f: Finding) -> float:
        r = f.saving_range_ms
        return r[0] if r is not None else (f.est_saving_ms or 0.0)

    def key(f: Finding) -> tuple:
        if f.est_saving_ms is not None:
            kind, amount = 0, -low(f)
        elif f.est_saving_bytes:
            kind, amount = 1, -float(f.est_saving_bytes)
        else:
            kind, amount = 2, 0.0
        return (f.slug not in crash, sev.get(f.severity, 9), kind, amount, f.code)

    out = sorted(findings, key=key)
    # overlapping ranges of the same severity: one validated on real twins goes before one that
    # is not; on the same footing the low ends keep their order
    twinned = lambda f: not f.saving_range_basis.startswith("not validated") and "real twin" in f.saving_range_basis  # noqa: E731

    def before(a: Finding, b: Finding) -> bool:
        """True where ``b`` should go before its neighbour ``a``."""
        if a.est_saving_ms is None or b.est_saving_ms is None or a.severity != b.severity:
            return False
        if (a.slug in crash) != (b.slug in crash) or not a.saving_range_ms or not b.saving_range_ms:
            return False
        if b.saving_range_ms[1] < a.saving_range_ms[0]:
            return False  # no overlap: the low end decides
        return twinned(b) and not twinned(a)

    for _ in range(len(out) ** 2):
        swapped = False
        for i in range(len(out) - 1):
            if before(out[i], out[i + 1]):
                out[i], out[i + 1] = out[i + 1], out[i]
                swapped = True
        if not swapped:
            break
    return out


def saving_bound(facts: RunFacts, clock: str = "gpu") -> tuple[float, str]:
    """(the most a fix on ``clock`` can save per step, what that bound is), see the module doc."""
    step = facts.step_clock_ms
    t = facts.timeline
    if not facts.gpu_present or not t.wall_ms:
        return step, f"{ms(step)} CPU step"
    if clock == "gpu" and 0 < t.gpu_window_ms < step:
        return t.gpu_window_ms, f"{ms(t.gpu_window_ms)} GPU window per step"
    return step, f"{ms(step)} wall-clock time per step"


def mark_basis(f: Finding, facts: RunFacts, fix: str | None) -> None:
    """Say where a time saving comes from (``Finding.saving_basis``): the what-if replay of the
    rule's fix (its ``REPLAY_FIX``) with the replay's error bar, or the rule's heuristic, saying
    in the evidence when the replay was set aside for missing the measured step."""
    from fsdpdoctor.config import REPLAY_MAX_ERROR_PCT

    if f.est_saving_ms is None or f.saving_basis:  # (a rule may say its saving is its own estimate)
        return
    w = facts.whatif
    if fix is None or w is None or fix not in w.saving_ms:
        f.saving_basis = "heuristic"
        return
    f.replay_fidelity_pct = w.error_pct
    if w.error_pct <= REPLAY_MAX_ERROR_PCT:
        f.saving_basis = "replay"
        return
    f.saving_basis = "heuristic-replay-off"
    f.evidence.append(
        f"the what-if replay misses a measured step by {w.error_pct:.1f}% (more than {REPLAY_MAX_ERROR_PCT:g}%): "
        "this saving is the rule's estimate from measured figures, not a replay"
    )


def set_range(f: Finding, facts: RunFacts, fix: str | None, clock: str = "gpu") -> None:
    """``f.saving_range_ms`` (:mod:`fsdpdoctor.savings`): the span of the replay over the fix's
    stated assumptions and the waits the trace does not explain, where the saving is the replay's,
    widened by the out-of-sample error of real twins of the same device class and model family;
    capped at the part of the step the fix acts on. It always holds ``est_saving_ms``. A
    same-class twin that went the other way withdraws the point estimate (no saving is promised,
    the finding is info)."""
    from fsdpdoctor.savings import run_family, saving_range

    if f.est_saving_ms is None:
        return
    est = f.est_saving_ms
    f.model_saving_ms = est
    lo = hi = est
    said = []
    w = facts.whatif
    if f.saving_basis == "replay" and w is not None and fix is not None and w.saving_ms.get(fix):
        # the replay's span, as a share of its own saving (a rule's estimate may be a part of it)
        k = est / w.saving_ms[fix]
        a = w.assumption_ms.get(fix)
        if a:
            lo, hi = min(lo, a[0] * k), max(hi, a[1] * k)
            said.append(
                w.assumptions.get(fix)
                or (
                    "the fix's stated assumptions did not move it"
                    if a[1] - a[0] < 0.005
                    else "the fix's assumptions varied over the ranks"
                )
            )
        sens = w.sensitivity_ms.get(fix, 0.0) * k
        if sens >= 0.005:
            lo, hi = lo - sens, hi + sens
            said.append(f"± {sens:.2f} ms without the waits the trace does not explain")
    elif f.saving_basis != "replay":
        if f.saving_span_ms is not None:
            lo, hi = min(lo, f.saving_span_ms[0]), max(hi, f.saving_span_ms[1])
        said.append(
            f"a rule's estimate from measured figures: {f.saving_assumptions}"
            if f.saving_assumptions
            else "a rule's estimate from measured figures: no assumption varied"
        )
    device = next((r.device_name for r in facts.rank_facts if r.device_name), None)
    r = saving_range(
        f.saving_kind or f.slug,
        est,
        lo,
        hi,
        device=device,
        family=run_family(facts),
        assumptions="; ".join(said),
        step_ms=facts.step_clock_ms,
    )
    bound, _ = saving_bound(facts, clock)
    ceiling = min(x for x in (bound, f.saving_ceiling_ms) if x is not None) if (bound or f.saving_ceiling_ms) else None
    high = min(r.high_ms, ceiling) if ceiling else r.high_ms
    f.saving_range_ms = [
        min(max(r.low_ms, -(facts.step_clock_ms or 0.0)), est),
        max(high, est) if not r.withdrawn else high,
    ]
    f.saving_range_basis = r.basis
    if not r.withdrawn and est >= 0.005:
        lo_, hi_ = f.saving_range_ms
        f.evidence.append(f"saving {ms(est)} per step, range {lo_:.2f}–{ms(hi_)}: {r.basis}")
    if r.withdrawn:
        f.evidence.append(
            f"the model prices this fix at {ms(est)} per step, but {r.basis}: no saving is promised, measure it"
        )
        f.summary = f.summary.rstrip() + (" No saving is promised: on a real twin the fix made the step slower.")
        f.est_saving_ms = None
        f.severity = "info"


def bound_saving(f: Finding, facts: RunFacts, clock: str = "gpu") -> None:
    """Cap ``f.est_saving_ms`` at what a fix on ``clock`` can save and at the part of the step
    the fix acts on (``f.saving_ceiling_ms``), saying so in the evidence."""
    if f.est_saving_ms is None:
        return
    f.est_saving_ms = max(f.est_saving_ms, 0.0)
    bound, what = saving_bound(facts, clock)
    if f.saving_ceiling_ms is not None and (not bound or f.saving_ceiling_ms < bound):
        bound, what = f.saving_ceiling_ms, f"{ms(f.saving_ceiling_ms)} the fix acts on"
    if bound and f.est_saving_ms > bound:
        f.evidence.append(f"estimated {ms(f.est_saving_ms)} per step, capped at the {what}: no fix saves more")
        f.est_saving_ms = bound


def judge_pressure(f: Finding, facts: RunFacts) -> None:
    """Memory advice without memory pressure is information, with the headroom in its evidence."""
    from fsdpdoctor.fmt import mib as gib, pct

    p = facts.memory_pressure
    if p is not None and p.under_pressure:
        if p.used_pct is not None:
            f.evidence.append(
                f"memory pressure: the peak reserved {gib(p.peak_reserved_bytes)} is {pct(p.used_pct)} of "
                f"the {gib(p.capacity_bytes)} {_capacity(p)}"
            )
        return
    f.severity = "info"
    if p is None or p.level == "unknown":
        f.evidence.append(
            "memory pressure unknown (no GPU memory size in the traces): informational; give "
            "--memory-budget GiB to judge against the memory the run must fit in"
        )
        return
    f.evidence.append(
        f"no memory pressure: the peak reserved {gib(p.peak_reserved_bytes)} is {pct(p.used_pct)} of the "
        f"{gib(p.capacity_bytes)} {_capacity(p)} ({gib(p.headroom_bytes)} free; warnings start at {p.threshold_pct:g}%): "
        "worth doing only to fit a larger micro-batch or longer sequences"
    )


def _capacity(p) -> str:
    return "budget (--memory-budget)" if p.capacity_source == "budget" else "GPU"


#: a finding whose part of the step (its ceiling) is under this share is never critical
PART_MIN_CRITICAL_PCT = 1.0


def grade(f: Finding, facts: RunFacts, cfg: dict[str, Any]) -> None:
    """Severity from the saving's share of the step (findings with an estimated saving)."""
    step = facts.step_clock_ms
    if f.est_saving_ms is None or not step:
        return
    share = 100.0 * f.est_saving_ms / step
    f.saving_pct_of_step = share
    part = f.saving_ceiling_ms if f.saving_ceiling_ms is not None else f.est_saving_ms
    if share >= cfg["severity_critical_pct"] and 100.0 * part / step >= PART_MIN_CRITICAL_PCT:
        f.severity = "critical"
    elif share >= cfg["severity_warning_pct"]:
        f.severity = "warning"
    else:
        f.severity = "info"


def _fold(findings: list[Finding]) -> list[Finding]:
    """A finding whose cost another finding's fix removes (``folded_into``, decided by the rule
    from the what-if replay) becomes evidence of that finding instead of a rival cause."""
    by_slug = {f.slug: f for f in findings}
    out = []
    for f in findings:
        target = by_slug.get(f.folded_into) if f.folded_into else None
        if target is None or target is f:
            f.folded_into = None
            out.append(f)
            continue
        target.evidence.append(f"folded {f.code} {f.slug}: {f.summary} — its fix is this one")
    return out


def _drop_explained(findings: list[Finding], superseded_by: dict[str, set[str]]) -> list[Finding]:
    """A general finding (low-overlap, host-bound) yields to specific ones only when they explain
    it: when their estimated savings cover at least half of its own (a specific finding without
    an estimate, as on CPU-only traces, counts as explaining it)."""
    out = []
    for f in findings:
        specific = [g for g in findings if g.slug in superseded_by.get(f.slug, ())]
        if specific:
            if any(g.est_saving_ms is None for g in specific) or f.est_saving_ms is None:
                continue
            # what the specific findings' fixes act on (their ceiling, where a rule states it:
            # FSD016's half the hooks explains all the GPU's wait at the hooks)
            if sum(max(g.saving_ceiling_ms or 0.0, g.est_saving_ms) for g in specific) >= 0.5 * f.est_saving_ms:
                continue
        out.append(f)
    return out
