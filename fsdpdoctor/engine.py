"""Rule registry and runner.

A rule is a module with ``CODE``, ``SLUG``, ``TITLE``, ``SEVERITY``, a docstring in the form
*What it detects / Why it hurts / How it shows in a trace / Fix*, and ``check(facts, cfg)``
returning a list of :class:`Finding`. Built-in rules live in the ``fsdpdoctor.rules`` package
(the top-level ``rules/`` folder); third-party rules register modules under the
``fsdpdoctor.rules`` entry-point group.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any

from .facts import RunFacts

SEVERITIES = ("critical", "warning", "info")


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
    est_saving_bytes: int | None = None  # memory findings: bytes the fix frees at the peak
    where: dict[str, Any] = field(default_factory=dict)  # rank / step / phase / unit
    folded_into: str | None = None  # slug of the finding whose fix removes this cost (engine folds it)


def _is_rule(mod: ModuleType) -> bool:
    return all(hasattr(mod, a) for a in ("CODE", "SLUG", "check"))


def load_rules() -> list[ModuleType]:
    """Built-in rule modules, then entry-point rules; sorted by code."""
    from . import rules as pkg

    mods: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        if _is_rule(mod):
            mods[mod.CODE] = mod
    for ep in entry_points(group="fsdpdoctor.rules"):
        try:
            mod = ep.load()
        except Exception:  # a broken plugin must not break the tool
            continue
        if isinstance(mod, ModuleType) and _is_rule(mod):
            mods.setdefault(mod.CODE, mod)
    return [mods[k] for k in sorted(mods)]


def find_rule(key: str) -> ModuleType | None:
    key = key.strip().lower()
    for mod in load_rules():
        if key in (mod.CODE.lower(), mod.SLUG.lower()):
            return mod
    return None


def run_rules(facts: RunFacts, config: dict[str, Any] | None = None) -> list[Finding]:
    """All findings, ranked by estimated saving (largest first), then severity."""
    cfg = config or {}
    from .config import defaults

    cfg = defaults() | cfg
    findings: list[Finding] = []
    disabled = set(cfg.get("disable", []))
    mods = [m for m in load_rules() if m.CODE not in disabled and m.SLUG not in disabled]
    for mod in mods:
        findings.extend(mod.check(facts, cfg))
    findings = _drop_explained(findings, {m.SLUG: set(getattr(m, "SUPERSEDED_BY", ())) for m in mods})
    findings = _fold(findings)
    step = facts.steps.mean_ms
    for f in findings:  # no fix saves more than the whole step
        if f.est_saving_ms is not None and step:
            f.est_saving_ms = min(f.est_saving_ms, step)
    sev = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: (-(f.est_saving_ms or 0.0), sev.get(f.severity, 9), f.code))
    return findings


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
            if sum(g.est_saving_ms for g in specific) >= 0.5 * f.est_saving_ms:
                continue
        out.append(f)
    return out
