"""``compare``'s causes: which measured part of the step accounts for the change, and which finding
(if any) explains it.

The step-time delta is split into cells, ``(part, phase) → (before, after)``, that add up to it
exactly (:func:`fsdpdoctor.analysis.compare.breakdown`). A finding that appeared takes the cells it
explains (its rule module's ``EXPLAINS``, in ``CLAIM_PRIORITY`` order when several could) that
grew, one that went away the cells that shrank; a configuration finding whose configuration did
not change (its rule's ``CONFIG_KEYS``: it only crossed a threshold) takes nothing. The cells no
finding took stay with their part. So the causes add up to the delta, and each carries only the
measured time it explains: a finding that took nothing is listed as explaining nothing
measurable, never as a cause.

The causes are ranked by the time they carry in the direction of the change; the primary cause
is the first, the measured part that moved the step most that way (with the finding that explains
it, where one does). Where the parts moved both ways the primary can carry more than the whole
change: :func:`offsets` names what offset it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from fsdpdoctor.engine import load_rules
from fsdpdoctor.analysis.compare.tables import Change, FindingChange

EPS_MS = 0.005  # a cause below this carries nothing measurable (the reports print 0.00 ms)


@dataclass
class Cause:
    slug: str  # a finding slug or a part (component) name
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

    @property
    def measurable(self) -> bool:
        """Whether it carries any measured time (a finding that took no part does not)."""
        return abs(self.delta_ms) >= EPS_MS


@functools.lru_cache(maxsize=1)
def _rules_by_slug() -> dict[str, Any]:
    return {r.slug: r for r in load_rules()}


def _rule(slug: str) -> Any:
    return _rules_by_slug().get(slug)


def _known(v: str) -> bool:
    return v not in ("", "–", "unknown", "None")


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


def rank_causes(
    cells: dict[tuple[str, str], tuple[float, float]],
    changes: list[FindingChange],
    basis: str,
    total_delta: float,
    structure: list[Change],
) -> list[Cause]:
    """The causes, adding up to ``total_delta``: findings with the cells they explain, then each
    part with the cells left to it; ranked by the time carried in the direction of the change, the
    findings that explain nothing measurable last."""
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
            note = f"{fc.status} without a change in the configuration it is about (a threshold was crossed)"
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
    # measured causes by the time they carry towards the change; findings that took nothing last
    causes.sort(key=lambda c: (0 if c.measurable or c.kind == "component" else 1, -sign * c.delta_ms))
    return causes


def primary(causes: list[Cause], total_delta: float, significant: bool) -> Cause | None:
    """The cause that moved the step most in the direction of the change: measured, of the change's
    sign; None when the change is not significant or nothing moved that way."""
    if not significant or abs(total_delta) < 1e-12:
        return None
    sign = 1.0 if total_delta > 0 else -1.0
    # what no measured part covers is never a cause of its own
    top = next((c for c in causes if c.measurable and not c.slug.endswith("unattributed")), None)
    return top if top is not None and sign * top.delta_ms > 0 else None


def offsets(causes: list[Cause], prim: Cause, total_delta: float) -> list[Cause]:
    """The measured causes that moved against the change, largest first: what offsets a primary
    cause carrying more than the whole change (their sum with the rest is ``total - prim``)."""
    sign = 1.0 if total_delta >= 0 else -1.0
    against = [c for c in causes if c is not prim and c.measurable and sign * c.delta_ms < 0]
    return sorted(against, key=lambda c: sign * c.delta_ms)
