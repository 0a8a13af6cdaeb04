"""``check``: CI gates over a run's RunFacts, alone or against a saved baseline.

Every gate reads RunFacts (and findings) only. A gate passes, fails, or is skipped (not set,
no baseline, or the figure is not measured in one of the runs, e.g. overlap on a CPU-only
trace or peak memory without a snapshot). ``check`` fails (exit 1) when any gate fails.

Thresholds, in increasing precedence: the defaults in :data:`CHECK_SETTINGS`, the table
``[tool.fsdpdoctor.check]`` of the nearest ``pyproject.toml``, the command line. A numeric
threshold set to ``"off"`` (or ``false`` in TOML) switches its gate off.

```toml
[tool.fsdpdoctor.check]
min_overlap = 80                      # % (absolute; no baseline needed)
max_exposed_comm_ms = 5.0             # ms per step (absolute)
max_step_regression_pct = 5           # vs baseline
max_overlap_drop_pts = 5              # percentage points vs baseline
max_exposed_comm_regression_pct = 10  # vs baseline
max_memory_regression_pct = 5         # peak allocated bytes vs baseline
min_mfu = 30                          # % (absolute; traces with recorded shapes)
max_mfu_drop_pct = 5                  # relative MFU drop vs baseline
fail_on_new = "critical"              # critical | warning | never
```
"""

from __future__ import annotations

import math
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from fsdpdoctor.engine import SEVERITIES, Finding
from fsdpdoctor.errors import InputError
from fsdpdoctor.facts import RunFacts
from fsdpdoctor.fmt import mib, ms, pct

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from rich.console import Console

    from fsdpdoctor.analysis.compare import Comparison
    from fsdpdoctor.api import LoadedRun

# name → (default, documentation); None = gate off unless set
CHECK_SETTINGS: dict[str, tuple[Any, str]] = {
    "min_overlap": (None, "fail when overlap (% of communication hidden behind compute) is below this; absolute"),
    "max_exposed_comm_ms": (None, "fail when exposed communication per step (ms) is above this; absolute"),
    "max_step_regression_pct": (5.0, "fail when the step time rose more than this % over the baseline"),
    "max_overlap_drop_pts": (5.0, "fail when overlap dropped more than this many percentage points below the baseline"),
    "max_exposed_comm_regression_pct": (
        10.0,
        "fail when exposed communication per step rose more than this % over the baseline",
    ),
    "exposed_comm_noise_ms": (0.05, "… but only when it also rose by more than this many ms per step"),
    "max_memory_regression_pct": (5.0, "fail when peak allocated memory rose more than this % over the baseline"),
    "min_mfu": (
        None,
        "fail when MFU (model FLOPs / step time / the device's dense BF16 peak, %) is below this; absolute",
    ),
    "max_mfu_drop_pct": (5.0, "fail when MFU fell more than this % (relative) below the baseline's"),
    "fail_on_new": (
        "critical",
        "fail when a finding of this severity or worse appears that the baseline did not have (critical | warning | never); without a baseline every finding counts as new",
    ),
}
FAIL_ON_NEW = ("critical", "warning", "never")


def check_defaults() -> dict[str, Any]:
    return {k: v for k, (v, _) in CHECK_SETTINGS.items()}


def _coerce(key: str, value: Any, origin: str) -> Any:
    if key not in CHECK_SETTINGS:
        raise InputError(origin, f"unknown check setting '{key}' (known: {', '.join(CHECK_SETTINGS)})")
    if key == "fail_on_new":
        v = str(value).strip().lower()
        if v not in FAIL_ON_NEW:
            raise InputError(origin, f"'fail_on_new' must be one of {', '.join(FAIL_ON_NEW)}, got {value!r}")
        return v
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("off", "none", "")):
        return None
    if isinstance(value, bool):
        raise InputError(origin, f"setting '{key}' needs a number or \"off\", got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(origin, f"setting '{key}' needs a number or \"off\", got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise InputError(origin, f"setting '{key}' must be a non-negative number, got {value!r}")
    if key == "min_overlap" and v > 100:
        raise InputError(origin, f"'min_overlap' is a percentage (0-100), got {value!r}")
    return v


def load_check_config(cli: dict[str, Any] | None = None, pyproject: Path | None = None) -> dict[str, Any]:
    """Defaults, then ``[tool.fsdpdoctor.check]``, then command-line values (None = not given)."""
    from fsdpdoctor.config import find_pyproject

    cfg = check_defaults()
    path = pyproject if pyproject is not None else find_pyproject()
    if path is not None:
        try:
            doc = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise InputError(path, f"cannot read settings ({exc})") from None
        table = doc.get("tool", {}).get("fsdpdoctor", {}).get("check", {})
        if not isinstance(table, dict):
            raise InputError(path, "[tool.fsdpdoctor.check] must be a table")
        for k, v in table.items():
            key = k.replace("-", "_")
            cfg[key] = _coerce(key, v, f"{path} [tool.fsdpdoctor.check]")
    for k, v in (cli or {}).items():
        if v is not None:
            cfg[k] = _coerce(k, v, f"--{k.replace('_', '-')}")
    return cfg


# ------------------------------------------------------------------------------------------
# gates
# ------------------------------------------------------------------------------------------


@dataclass
class Gate:
    name: str  # stable id, the JUnit test case name
    title: str
    status: str  # pass / fail / skip
    baseline: str  # the baseline's figure, human
    current: str  # this run's figure, human
    threshold: str
    detail: str
    value: float | None = None  # the compared figure (a delta for baseline gates)
    limit: float | None = None


@dataclass
class CheckResult:
    current_label: str
    baseline_label: str | None
    gates: list[Gate]
    settings: dict[str, Any]
    comparison: Comparison | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(g.status == "fail" for g in self.gates)

    @property
    def failed(self) -> list[Gate]:
        return [g for g in self.gates if g.status == "fail"]

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def verdict_line(self) -> str:
        n = {s: sum(g.status == s for g in self.gates) for s in ("pass", "fail", "skip")}
        if self.passed:
            return f"fsdpdoctor check: PASSED ({n['pass']} passed, {n['skip']} skipped)"
        return f"fsdpdoctor check: FAILED ({n['fail']} of {len(self.gates)} gates: {', '.join(g.name for g in self.failed)})"

    # -- outputs -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "passed": self.passed,
            "exit_code": self.exit_code,
            "current": self.current_label,
            "baseline": self.baseline_label,
            "gates": [msgspec.to_builtins(g) for g in self.gates],
            "settings": self.settings,
            "notes": self.notes,
        }
        if self.comparison is not None:
            from fsdpdoctor.report.comparison import primary_text

            c = self.comparison
            d["comparison"] = {
                "step_time_delta_ms": c.step_time_delta_ms,
                "step_time_delta_pct": c.step_time_delta_pct,
                "primary_cause": c.primary_cause,
                "primary_cause_text": primary_text(c),
                "causes": [{"slug": k.slug, "delta_ms": k.delta_ms} for k in c.causes[:5]],
            }
        return d

    def to_json(self, indent: int = 2) -> str:
        return msgspec.json.format(msgspec.json.encode(self.to_dict()), indent=indent).decode()

    def to_markdown(self) -> str:
        mark = "✅ passed" if self.passed else "❌ failed"
        lines = [f"## fsdpdoctor check: {mark}", ""]
        lines.append(
            f"Run `{self.current_label}`"
            + (
                f" against baseline `{self.baseline_label}`."
                if self.baseline_label
                else " (no baseline: absolute gates only)."
            )
        )
        lines.append("")
        from fsdpdoctor.report.markdown import table as md_table
        from fsdpdoctor.report.sections import Table

        icon = {"pass": "✅ pass", "fail": "❌ **fail**", "skip": "➖ skip"}
        rows = [[g.title, g.baseline, g.current, g.threshold, icon[g.status]] for g in self.gates]
        lines.append(md_table(Table("", ["gate", "baseline", "current", "threshold", "verdict"], rows)))
        failed = self.failed
        if failed:
            lines.append("")
            lines += [f"- **{g.name}**: {g.detail}" for g in failed]
        c = self.comparison
        if c is not None and c.primary is not None and not self.passed:
            from fsdpdoctor.report.comparison import headline, primary_sentence

            lines += ["", "### Why", "", headline(c) + ".", "", primary_sentence(c)]
            from fsdpdoctor.report.comparison import preferred_fix

            for flavour, code in preferred_fix(c, c.primary):
                lines += [
                    "",
                    f"<details><summary>Fix ({flavour})</summary>",
                    "",
                    "```python",
                    code.rstrip(),
                    "```",
                    "",
                    "</details>",
                ]
        lines += ["", "_" + self.verdict_line() + "_", ""]
        return "\n".join(lines)

    def to_junit(self) -> str:
        """JUnit XML: one test suite, one test case per gate (failure / skipped)."""
        suites = ET.Element("testsuites", name="fsdpdoctor")
        suite = ET.SubElement(
            suites,
            "testsuite",
            name="fsdpdoctor check",
            tests=str(len(self.gates)),
            failures=str(sum(g.status == "fail" for g in self.gates)),
            errors="0",
            skipped=str(sum(g.status == "skip" for g in self.gates)),
            time="0",
        )
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="current", value=self.current_label)
        ET.SubElement(props, "property", name="baseline", value=self.baseline_label or "")
        for g in self.gates:
            tc = ET.SubElement(suite, "testcase", classname="fsdpdoctor.check", name=g.name, time="0")
            if g.status == "fail":
                el = ET.SubElement(tc, "failure", message=g.detail, type="regression")
                el.text = f"{g.title}: baseline {g.baseline}, current {g.current}, threshold {g.threshold}"
            elif g.status == "skip":
                ET.SubElement(tc, "skipped", message=g.detail)
            out = ET.SubElement(tc, "system-out")
            out.text = f"{g.title}: baseline {g.baseline}, current {g.current}, threshold {g.threshold} — {g.detail}"
        ET.indent(suites)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"

    def render_terminal(self, console: Console) -> None:
        from rich import box
        from rich.table import Table as RichTable
        from rich.text import Text

        title = f"fsdpdoctor check: {self.current_label}" + (
            f" vs baseline {self.baseline_label}" if self.baseline_label else ""
        )
        t = RichTable(title=Text(title), title_justify="left", box=box.ASCII2, pad_edge=False)
        for h in ("gate", "baseline", "current", "threshold", "verdict"):
            t.add_column(h, justify="right" if h in ("baseline", "current", "threshold") else "left")
        style = {"pass": "green", "fail": "bold red", "skip": "dim"}
        for g in self.gates:
            t.add_row(
                Text(g.title),
                Text(g.baseline),
                Text(g.current),
                Text(g.threshold),
                Text(g.status.upper(), style=style[g.status]),
            )
        console.print(t)
        for g in self.gates:
            if g.status == "fail":
                console.print(Text(f"FAIL {g.name}: {g.detail}"))
        c = self.comparison
        if c is not None and not self.passed and c.primary_cause:
            from fsdpdoctor.report.comparison import headline, primary_text

            console.print(
                Text(
                    f"{headline(c)}; primary cause: {primary_text(c)} (run 'fsdpdoctor compare BASELINE RUN' for details)"
                )
            )
        console.print(Text(self.verdict_line(), style="bold green" if self.passed else "bold red"))


def _peak_memory(f: RunFacts) -> float | None:
    mem = getattr(f, "memory", None)
    if mem is None:
        return None
    v = mem.get("peak_allocated_bytes") if isinstance(mem, dict) else getattr(mem, "peak_allocated_bytes", None)
    return float(v) if v else None


def _num(v: float | None, unit: str) -> str:
    if v is None:
        return "not measured"
    if unit == "ms":
        return ms(v)
    if unit == "%":
        return pct(v)
    if unit == "B":
        return mib(v)
    return f"{v:g}"


def _sev_at_least(sev: str, level: str) -> bool:
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return order.get(sev, 9) <= order.get(level, -1)


def _signed(v: float, digits: int = 1) -> str:
    return f"{'+' if v >= 0 else '−'}{abs(v):.{digits}f}"


def _gate(
    name, title, limit, threshold, before, after, unit, option, baseline_given, missing, judge, value=None
) -> Gate:
    """One gate: skipped when its limit is not set, the baseline it needs is absent or a figure is
    not measured; otherwise ``judge(before, after, limit)`` returns (failed, detail, suffix for
    the current figure[, compared value]). ``baseline_given`` is None for absolute gates."""
    relative = baseline_given is not None
    g = Gate(
        name,
        title,
        "skip",
        _num(before, unit) if relative else "–",
        _num(after, unit),
        "–" if limit is None else threshold.format(limit),
        "",
        value,
        limit,
    )
    if limit is None:
        g.detail = f"not set ({option})"
    elif relative and not baseline_given:
        g.detail = "no baseline given"
    elif after is None or (relative and before is None):
        g.detail = missing(before, after, relative)
    else:
        failed, g.detail, suffix, *compared = judge(before, after, limit)
        if compared:
            g.value = compared[0]
        g.current += suffix
        g.status = "fail" if failed else "pass"
    return g


def _missing_ranks_gate(cur: RunFacts, allowed: bool) -> Gate:
    from fsdpdoctor.analysis.ranks import partial_run_line

    n, m = len(cur.ranks), cur.ranks_expected or len(cur.ranks)
    return Gate(
        "missing-ranks",
        "ranks analysed",
        "pass" if allowed else "fail",
        "–",
        f"{n} of {m}",
        f"{m} of {m}",
        partial_run_line(cur)
        + (" (allowed by --allow-missing-ranks)" if allowed else " (--allow-missing-ranks to accept)"),
        float(m - n),
        0.0,
    )


def run_check(
    current: LoadedRun, baseline: LoadedRun | None, settings: dict[str, Any], allow_missing_ranks: bool = False
) -> CheckResult:
    """Evaluate every gate; gates that are not set or cannot be measured are skipped.

    A partial run (ranks left out because their files could not be read, or a gap in the rank
    ids) adds the gate ``missing-ranks``, which fails unless ``allow_missing_ranks``."""
    from fsdpdoctor.analysis.compare import compare, step_time_ms

    cur, base = current.facts, baseline.facts if baseline else None
    s = settings

    def missing(what: str, note: str = ""):
        def text(before, after, relative: bool) -> str:
            if not relative:
                return f"{what} not measured{note}"
            which = "either run" if before is None and after is None else "one of the runs"
            return f"{what} not measured in {which}{note}"

        return text

    ov = cur.overlap.pct if cur.gpu_present else None
    ex = cur.exposed_comm.mean_ms_per_step if cur.gpu_present else None
    gpu_base = base is not None and base.gpu_present
    noise = s.get("exposed_comm_noise_ms") or 0.0

    def at_least(b, a, lim):
        return a < lim, f"overlap {pct(a)} {'≥' if a >= lim else '<'} {lim:g}%", ""

    def at_most_ms(b, a, lim):
        return a > lim, f"exposed comm {ms(a)} per step {'≤' if a <= lim else '>'} {lim:g} ms", ""

    def rise(fmt, what):
        def judge(b, a, lim):
            d = 100 * (a - b) / b
            return d > lim, f"{what} {fmt(b)} → {fmt(a)} ({_signed(d)}%; limit +{lim:g}%)", f" ({_signed(d)}%)", d

        return judge

    def overlap_drop(b, a, lim):
        drop = b - a
        return (
            drop > lim,
            f"overlap {pct(b)} → {pct(a)} ({'dropped' if drop > 0 else 'rose'} {abs(drop):.1f} pts; limit {lim:g} pts)",
            "",
            drop,
        )

    def exposed_rise(b, a, lim):
        delta = a - b
        d = 100 * delta / b if b > 0 else (math.inf if delta > 0 else 0.0)
        rel = f"{_signed(d)}%" if math.isfinite(d) else "from 0"
        detail = f"exposed comm {ms(b)} → {ms(a)} per step ({rel}; limit +{lim:g}% and > {noise:g} ms)"
        return d > lim and delta > noise, detail, f" ({_signed(delta, 2)} ms)", d if math.isfinite(d) else None

    step_a = step_time_ms(cur)
    step_b = step_time_ms(base) if base else None
    from fsdpdoctor.analysis.compare import step_noise

    step_noise_ms, step_spread = (
        step_noise(base, cur, "gpu" if cur.gpu_present and base.gpu_present else "cpu") if base else (None, "")
    )

    def step_rise(b, a, lim):
        """The step-time gate: a rise over the limit that also stands out of the runs' own
        step-to-step spread (where both runs have the steps to measure it)."""
        failed, detail, short, d = rise(ms, "step time")(b, a, lim)
        if failed and step_noise_ms is not None and a - b <= step_noise_ms:
            return False, detail + f"; within noise: {step_spread}", short, d
        return failed, detail, short, d

    mfu_a = cur.compute.mfu_pct if cur.compute is not None else None
    mfu_b = base.compute.mfu_pct if base is not None and base.compute is not None else None

    def mfu_at_least(b, a, lim):
        return a < lim, f"MFU {pct(a)} {'≥' if a >= lim else '<'} {lim:g}%", ""

    def mfu_drop(b, a, lim):
        d = 100 * (b - a) / b if b else 0.0
        return (
            d > lim,
            f"MFU {pct(b)} → {pct(a)} ({'fell' if d > 0 else 'rose'} {abs(d):.1f}%; limit {lim:g}%)",
            f" ({_signed(-d)}%)",
            d,
        )

    faster = step_a is not None and step_b is not None and step_a < step_b

    def unless_faster(judge):
        """A figure that describes the step (overlap, exposed communication, MFU) is no regression
        when the step itself got faster: a faster compute leaves less to hide communication
        behind, and a run that does less work per step can show a lower MFU. The gate passes and
        says why."""

        def gated(b, a, lim):
            failed, detail, *rest = judge(b, a, lim)
            if failed and faster:
                d = 100 * (step_a - step_b) / step_b
                return (
                    False,
                    f"{detail}; passes: the step got faster ({ms(step_b)} → {ms(step_a)}, {_signed(d)}%)",
                    *rest,
                )
            return (failed, detail, *rest)

        return gated

    gates: list[Gate] = [
        _gate(
            "min-overlap",
            "overlap",
            s.get("min_overlap"),
            "≥ {:g}%",
            None,
            ov,
            "%",
            "--min-overlap",
            None,
            missing("overlap", " (no GPU communication in the trace)"),
            at_least,
            value=ov,
        ),
        _gate(
            "max-exposed-comm",
            "exposed comm per step",
            s.get("max_exposed_comm_ms"),
            "≤ {:g} ms",
            None,
            ex,
            "ms",
            "--max-exposed-comm-ms",
            None,
            missing("exposed communication", " (no GPU timeline)"),
            at_most_ms,
            value=ex,
        ),
        _gate(
            "step-time-regression",
            "step time",
            s.get("max_step_regression_pct"),
            "≤ +{:g}%",
            step_b or None,
            step_a,
            "ms",
            "--max-step-regression-pct",
            base is not None,
            missing("step time", " (no steps found)"),
            step_rise,
        ),
        _gate(
            "overlap-drop",
            "overlap drop",
            s.get("max_overlap_drop_pts"),
            "≤ {:g} pts",
            base.overlap.pct if gpu_base else None,
            ov,
            "%",
            "--max-overlap-drop-pts",
            base is not None,
            missing("overlap"),
            unless_faster(overlap_drop),
        ),
        _gate(
            "exposed-comm-regression",
            "exposed comm rise",
            s.get("max_exposed_comm_regression_pct"),
            "≤ +{:g}%",
            base.exposed_comm.mean_ms_per_step if gpu_base else None,
            ex,
            "ms",
            "--max-exposed-comm-regression-pct",
            base is not None,
            missing("exposed communication"),
            unless_faster(exposed_rise),
        ),
        _gate(
            "min-mfu",
            "MFU",
            s.get("min_mfu"),
            "≥ {:g}%",
            None,
            mfu_a,
            "%",
            "--min-mfu",
            None,
            missing("MFU", " (no matmul shapes recorded, or an unknown device: --peak-tflops)"),
            mfu_at_least,
            value=mfu_a,
        ),
        _gate(
            "mfu-drop",
            "MFU drop",
            s.get("max_mfu_drop_pct"),
            "≤ {:g}%",
            mfu_b,
            mfu_a,
            "%",
            "--max-mfu-drop-pct",
            base is not None,
            missing("MFU"),
            unless_faster(mfu_drop),
        ),
        _gate(
            "memory-regression",
            "peak memory",
            s.get("max_memory_regression_pct"),
            "≤ +{:g}%",
            _peak_memory(base) if base is not None else None,
            _peak_memory(cur),
            "B",
            "--max-memory-regression-pct",
            base is not None,
            missing("peak memory", " (no memory snapshot)"),
            rise(mib, "peak allocated"),
        ),
    ]

    # findings
    level = s.get("fail_on_new") or "critical"
    bf: list[Finding] = baseline.findings if baseline else []
    had = {f.slug for f in bf if _sev_at_least(f.severity, level)} if level != "never" else set()
    new = [f for f in current.findings if level != "never" and _sev_at_least(f.severity, level) and f.slug not in had]
    # a run whose step got faster moved its bottleneck: a new finding about step time is what to
    # work on next, not a regression (a new memory or crash finding still fails)
    moved = [f for f in new if faster and f.est_saving_ms is not None]
    new = [f for f in new if f not in moved]
    n_base = sum(_sev_at_least(f.severity, level) for f in bf) if level != "never" else 0
    n_cur = sum(_sev_at_least(f.severity, level) for f in current.findings) if level != "never" else 0
    g = Gate(
        "new-findings",
        f"new {level} findings" if level != "never" else "new findings",
        "skip",
        str(n_base) if baseline else "–",
        str(n_cur) if level != "never" else "–",
        "none" if level != "never" else "–",
        "",
        float(len(new)),
        0.0,
    )
    if level == "never":
        g.detail = "off (--fail-on-new never)"
    else:
        g.status = "fail" if new else "pass"
        scope = "not in the baseline" if baseline else "(no baseline: every finding counts as new)"
        g.detail = (
            f"{len(new)} {level}-or-worse finding(s) {scope}: " + ", ".join(f"{f.slug} ({f.severity})" for f in new)
            if new
            else f"no {level}-or-worse finding {scope}"
        )
        if moved:
            g.detail += "; not counted, as the step got faster (the bottleneck moved): " + ", ".join(
                f"{f.slug} ({f.severity})" for f in moved
            )
    gates.append(g)
    if cur.inputs_excluded:
        gates.append(_missing_ranks_gate(cur, allow_missing_ranks))

    comparison = None
    notes: list[str] = []
    if baseline is not None:
        comparison = compare(
            base, cur, baseline.findings, current.findings, before_label=baseline.label, after_label=current.label
        )
        notes += comparison.notes
    return CheckResult(current.label, baseline.label if baseline else None, gates, dict(s), comparison, notes)
