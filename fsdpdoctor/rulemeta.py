"""A rule's metadata, declared once: what ``load_rules`` reads from a rule module.

A rule module declares its metadata as module-level names (``CODE``, ``SLUG``, ``TITLE``,
``SEVERITY``, ...; the table below) beside ``check(facts, cfg)`` and its docstring, as sqlfluff's
``BaseRule`` declares them as class attributes. :func:`rule_meta` reads them into one frozen
:class:`RuleMeta` with every default in one place and every value checked: a misspelt name
(``SAVE_ON`` for ``SAVES_ON``) or a value of the wrong kind is an error, not a silent default.
Other module-level names (fix templates, constants) are the rule's own.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

SEVERITIES = ("critical", "warning", "info")
CLOCKS = ("gpu", "step")


class RuleError(ValueError):
    """A rule module whose metadata cannot be used."""


@dataclass(frozen=True)
class RuleMeta:
    """One rule: its identity, its documentation and how the engine, ``compare`` and the manual
    treat its findings. Field names are the module-level names lower-cased."""

    code: str  # FSDnnn
    slug: str  # kebab-case
    check: Callable[..., list]  # check(facts: RunFacts, cfg: dict) -> list[Finding]
    module: ModuleType
    title: str = ""
    severity: str = "warning"  # the default severity of its findings (a time saving grades them)
    thresholds: tuple[str, ...] = ()  # config keys it reads (fsdpdoctor.config.THRESHOLDS)
    saves_on: str = "gpu"  # which clock its fix shortens: "gpu" (its GPU window) or "step"
    replay_fix: str | None = None  # the what-if transformation its saving comes from
    max_severity: str | None = None  # a trade-off finding is never graded above this
    memory_advice: bool = False  # a warning only under memory pressure (engine.judge_pressure)
    crash: bool = False  # what made the run crash: ranked first
    superseded_by: tuple[str, ...] = ()  # slugs of specific findings that explain this general one
    explains: dict[str, Any] = field(default_factory=dict)  # compare: parts of the step it explains
    explains_if_changed: dict[str, Any] = field(default_factory=dict)
    config_keys: tuple[str, ...] | None = None  # compare: a configuration finding's keys
    claim_priority: int = 1000  # compare: specific findings (lower) claim before general ones

    @property
    def doc(self) -> str:
        return (self.module.__doc__ or "").strip()

    @property
    def path(self) -> str:
        return getattr(self.module, "__file__", "") or ""


_NAMES = {f.name.upper(): f for f in fields(RuleMeta) if f.name not in ("check", "module")}
_REQUIRED = ("CODE", "SLUG")


def is_rule_module(mod: Any) -> bool:
    return isinstance(mod, ModuleType) and all(hasattr(mod, a) for a in (*_REQUIRED, "check"))


def rule_meta(mod: ModuleType) -> RuleMeta:
    """The metadata of rule module ``mod``; raises RuleError naming the module and the problem."""
    name = mod.__name__
    declared = {k: v for k, v in vars(mod).items() if k.isupper() and not k.startswith("_")}
    for k in declared:
        if k not in _NAMES:
            close = difflib.get_close_matches(k, _NAMES, n=1, cutoff=0.85)
            if close:
                raise RuleError(f"{name}: unknown rule metadata {k} (did you mean {close[0]}?)")
    kw: dict[str, Any] = {_NAMES[k].name: v for k, v in declared.items() if k in _NAMES}
    for k in _REQUIRED:
        if not isinstance(declared.get(k), str) or not declared[k]:
            raise RuleError(f"{name}: {k} must be a non-empty string")
    check = getattr(mod, "check", None)
    if not callable(check) or len(inspect.signature(check).parameters) != 2:
        raise RuleError(f"{name}: check must be a function check(facts, cfg)")
    for k in ("severity", "max_severity"):
        if k in kw and kw[k] is not None and kw[k] not in SEVERITIES:
            raise RuleError(f"{name}: {k.upper()} {kw[k]!r} is not one of {', '.join(SEVERITIES)}")
    if kw.get("saves_on", "gpu") not in CLOCKS:
        raise RuleError(f"{name}: SAVES_ON {kw['saves_on']!r} is not one of {', '.join(CLOCKS)}")
    for k in ("thresholds", "superseded_by", "config_keys"):
        if k in kw and kw[k] is not None:
            if isinstance(kw[k], str) or not all(isinstance(x, str) for x in kw[k]):
                raise RuleError(f"{name}: {k.upper()} must be a tuple of strings")
            kw[k] = tuple(kw[k])
    for k in ("explains", "explains_if_changed"):
        if k in kw and not isinstance(kw[k], dict):
            raise RuleError(f"{name}: {k.upper()} must be a dict")
    for k in ("memory_advice", "crash"):
        if k in kw and not isinstance(kw[k], bool):
            raise RuleError(f"{name}: {k.upper()} must be True or False")
    if "claim_priority" in kw and not isinstance(kw["claim_priority"], int):
        raise RuleError(f"{name}: CLAIM_PRIORITY must be an integer")
    return RuleMeta(check=check, module=mod, **kw)
