"""Reporters for ``compare`` (JSON, Markdown, terminal) and the wording of its parts.

The comparison itself (data and arithmetic) is :mod:`fsdpdoctor.analysis.compare`; what each
finding explains lives in its rule module. Content is built once as format-neutral tables
(:class:`~fsdpdoctor.report.sections.Table`); each renderer only decides how to draw it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from fsdpdoctor.fmt import mib
from fsdpdoctor.fmt import ms as _ms
from fsdpdoctor.report.markdown import table as md_table
from fsdpdoctor.report.sections import Table
from fsdpdoctor.report.terminal import rich_table

if TYPE_CHECKING:
    from rich.console import Console

    from fsdpdoctor.analysis.compare import Cause, Comparison

LABELS = {
    "compute": "compute",
    "exposed_all_gather": "exposed all-gather",
    "exposed_reduce_scatter": "exposed reduce-scatter",
    "exposed_other_comm": "other exposed comm",
    "memcpy": "exposed memcpy/memset",
    "host_bound_idle": "host-bound idle (gaps inside the GPU window)",
    "other_idle": "idle outside the GPU window",
    "gpu_unattributed": "unattributed (the step less the measured GPU parts)",
    "cpu_fsdp_hooks": "FSDP hook CPU time",
    "cpu_forward": "forward outside FSDP hooks (CPU)",
    "cpu_backward": "backward outside FSDP hooks (CPU)",
    "cpu_optimizer": "optimizer step outside FSDP hooks (CPU)",
    "cpu_other": "rest of the step (CPU)",
    "cpu_outside_span": "step clock outside the CPU span (between steps)",
    "cpu_unattributed": "unattributed (the step less the measured CPU parts)",
}
# the plain name of a part in a phase ("FSDP hook CPU time in backward")
_SHORT = {
    "compute": "GPU compute",
    "memcpy": "exposed memcpy/memset",
    "host_bound_idle": "host-bound idle",
    "gpu_unattributed": "step time no measured GPU part covers",
    "cpu_forward": "CPU time in forward outside FSDP hooks",
    "cpu_backward": "CPU time in backward outside FSDP hooks",
    "cpu_optimizer": "CPU time in the optimizer step",
    "cpu_other": "CPU time in the rest of the step",
    "cpu_outside_span": "time between the steps' CPU spans",
    "cpu_unattributed": "step time no measured CPU part covers",
}

# What to look at when a part of the step itself is the largest cause (no finding explains it).
HINTS = {
    "compute": "Compute per step changed: compare the model, batch/sequence size, compute dtype, "
    "activation checkpointing and GPU clocks of the two runs.",
    "exposed_all_gather": "More all-gather time is exposed: check prefetching (backward_prefetch, "
    "forward prefetch), the wrap policy and all-gather bytes/bandwidth.",
    "exposed_reduce_scatter": "More reduce-scatter time is exposed: check reduce dtype, bytes per "
    "reduce-scatter and whether the last unit's gradients overlap with anything.",
    "exposed_other_comm": "Other collectives (all-reduce, broadcast, …) are more exposed: look for "
    "new collectives (grad-norm clipping, metrics, DDP buckets).",
    "memcpy": "Host/device copies are exposed: CPU offload, pageable memory, or .item()/.cpu() in the step.",
    "host_bound_idle": "The GPU waits for the host inside the step: launch, Python or FSDP hook "
    "overhead (torch.compile, fewer units, larger batches).",
    "other_idle": "Time without GPU work at the step's edges: data loading, CPU-side optimizer, synchronisation.",
    "gpu_unattributed": "Step time no measured GPU part covers: float rounding where the step is split on the "
    "step clock; in facts saved before that split, other steps' GPU work running in this step's interval (the GPU "
    "runs behind the CPU) less this step's own work that runs outside it.",
    "cpu_fsdp_hooks": "FSDP's hooks (unsharding, resharding, gradient reduction bookkeeping) cost CPU time per unit "
    "and per call: fewer or larger units, or torch.compile, make them cheaper.",
    "cpu_forward": "The forward pass outside FSDP's hooks takes longer on the CPU (the model's own ops).",
    "cpu_backward": "The backward pass outside FSDP's hooks takes longer on the CPU (the model's own ops).",
    "cpu_optimizer": "The optimizer step takes longer on the CPU.",
    "cpu_other": "Time in the step outside forward, backward and optimizer (data loading, logging).",
    "cpu_outside_span": "The step clock runs outside the step's CPU span: the training loop's own code between "
    "ProfilerStep spans (prof.step(), logging, data loading outside the step), or the step's GPU work finishing "
    "after its span.",
    "cpu_unattributed": "Step time no measured CPU part covers: phases whose intervals overlap, or facts that do "
    "not place the step on the clock.",
}


def part_name(parts: list[str], c: Comparison | None = None) -> str:
    """The measured parts a cause carries in plain words: "FSDP hook CPU time in backward". With
    the comparison, a part's phases that did not move are left out of the name."""
    moved = {f"{x.name}@{x.phase}" for x in c.components if abs(x.delta_ms) >= 0.005} if c is not None else None
    by: dict[str, list[str]] = {}
    for p in parts:
        comp, _, phase = p.partition("@")
        if moved is None or p in moved:
            by.setdefault(comp, []).append(phase)
    out = []
    for comp, phases in by.items():
        name = _SHORT.get(comp, LABELS.get(comp, comp.replace("_", " ")))
        named = [p for p in phases if p not in ("all", "")]
        every = {x.phase for x in c.components if x.name == comp and abs(x.delta_ms) >= 0.005} if c else set()
        if named and len(named) == len(phases) and (set(named) != every or len(named) == 1):
            name += " in " + " and ".join(named)
        out.append(name)
    return ", ".join(out) if out else "nothing measurable"


def _pieces(k: Cause, c: Comparison) -> list[tuple[str, float]]:
    """A cause's measured parts by component, each named with the phases it covers, and its delta;
    largest first."""
    cells = {f"{x.name}@{x.phase}": x.delta_ms for x in c.components}
    by: dict[str, list[str]] = {}
    for p in k.parts:
        by.setdefault(p.partition("@")[0], []).append(p)
    out = [(part_name(ps, c), sum(cells.get(p, 0.0) for p in ps)) for ps in by.values()]
    return sorted((x for x in out if abs(x[1]) >= 0.005), key=lambda x: -abs(x[1]))


def cause_name(k: Cause, c: Comparison | None = None) -> str:
    """What a cause is, in plain words: the measured part, and for a finding the finding."""
    if k.kind == "finding" and not k.measurable:
        return f"{k.slug} ({_verb(k)}, explains nothing measurable)"
    name = part_name(k.parts, c)
    return name if k.kind == "component" else f"{name} ({k.slug} {_verb(k)})"


def cause_summary(k: Cause) -> str:
    """A finding's own summary; for a part of the step, its name and how it moved."""
    if k.kind == "finding":
        return k.summary
    return f"{LABELS.get(k.slug, k.slug)} {dms(k.delta_ms)} per step"


def primary_text(c: Comparison) -> str:
    """The primary cause in a few words with its sign: "FSDP hook CPU time −25.86 ms"."""
    p = c.primary
    if p is None and c.noise_ms is not None and not c.significant:
        return f"none (within noise: ±{c.noise_ms:.2f} ms)"
    if p is None:
        return "none (no significant change)"
    name = ", ".join(n for n, _ in _pieces(p, c)) or part_name(p.parts, c)
    return f"{name} {dms(p.delta_ms)}" + (f" ({p.slug} {_verb(p)})" if p.kind == "finding" else "")


def _verb(k: Cause) -> str:
    return "appeared" if k.status == "appeared" else "went away"


def cause_hint(k: Cause) -> str:
    return HINTS.get(k.slug, "") if k.kind == "component" else ""


# ------------------------------------------------------------------------------------------
# JSON
# ------------------------------------------------------------------------------------------


def to_dict(c: Comparison) -> dict[str, Any]:
    """The comparison as JSON (``compare --format json``)."""
    totals = c.component_totals()
    prim = c.primary
    return {
        "before": c.before_label,
        "after": c.after_label,
        "basis": c.basis,
        "basis_definition": c.basis_text,
        "step_time_before_ms": c.step_before_ms,
        "step_time_after_ms": c.step_after_ms,
        "step_time_delta_ms": c.step_time_delta_ms,
        "step_time_delta_pct": c.step_time_delta_pct,
        "components_sum_delta_ms": c.components_sum_ms,
        "primary_cause": c.primary_cause,
        "primary_cause_text": primary_text(c),
        "primary_fix": prim.fix if prim else {},
        "compute_split_ms": dict(c.compute_split),
        "waterfall_ms": {k: {"before_ms": b, "after_ms": a, "delta_ms": a - b} for k, (b, a) in c.waterfall.items()},
        "causes": [
            {
                "slug": k.slug,
                "kind": k.kind,
                "label": cause_name(k, c),
                "measurable": k.measurable,
                "delta_ms": k.delta_ms,
                "share_pct": (100.0 * k.delta_ms / c.step_time_delta_ms) if c.step_time_delta_ms else None,
                "summary": cause_summary(k),
                "status": k.status,
                "severity": k.severity,
                "est_saving_ms": k.est_saving_ms,
                "parts": k.parts,
                "fix": k.fix,
                "hint": cause_hint(k),
                "corroborated": k.corroborated,
                "note": k.note,
            }
            for k in c.causes
        ],
        "components": {n: {"before_ms": b, "after_ms": a, "delta_ms": a - b} for n, (b, a) in totals.items()},
        "components_by_phase": [
            {
                "component": x.name,
                "phase": x.phase,
                "before_ms": x.before_ms,
                "after_ms": x.after_ms,
                "delta_ms": x.delta_ms,
            }
            for x in c.components
        ],
        "phases": [msgspec.to_builtins(p) for p in c.phases],
        "structure": [
            {"key": s.key, "label": s.label, "before": s.before, "after": s.after, "changed": s.changed}
            for s in c.structure
        ],
        "findings": {
            st: [msgspec.to_builtins(f) for f in c.findings if f.status == st]
            for st in ("appeared", "disappeared", "persisting")
        },
        "ranks": [msgspec.to_builtins(r) for r in c.ranks],
        "units": [msgspec.to_builtins(u) for u in c.units],
        "collectives": [msgspec.to_builtins(x) for x in c.collectives],
        "alignment": c.alignment,
        "notes": c.notes,
    }


def to_json(c: Comparison, indent: int = 2) -> str:
    return msgspec.json.format(msgspec.json.encode(to_dict(c)), indent=indent).decode()


def ms(v: float | None, digits: int = 2) -> str:
    """A duration: 1.23 ms; a value that rounds to zero prints 0.00 ms, never "-0.00 ms"."""
    return _ms(0.0 if v is not None and abs(v) < 0.5 * 10**-digits else v, digits)


def dms(v: float | None, digits: int = 2) -> str:
    """A signed duration: +1.23 ms / −0.40 ms."""
    if v is None:
        return "–"
    if abs(v) < 0.5 * 10**-digits:
        return f"{0:.{digits}f} ms"
    return f"{'+' if v > 0 else '−'}{abs(v):.{digits}f} ms"


def dpct(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{'+' if v > 0 else '−' if v < 0 else ''}{abs(v):.1f}%"


def _share(c: Comparison, v: float) -> str:
    """``v``'s share of the change; a part that moved more than the whole change (others moved the
    other way) reads ">100%", not a share it cannot have."""
    d = c.step_time_delta_ms
    if abs(d) <= 1e-9:
        return "–"
    x = 100 * v / d
    if x > 100.05:
        return ">100%"
    return f"{'−' if x < -0.05 else ''}{abs(x):.1f}%"


_OVER_NOTE = (
    ">100%: that part alone moved the step more than the whole change; the parts with a negative share moved it "
    "the other way"
)


def _over(c: Comparison, v: float) -> bool:
    d = c.step_time_delta_ms
    return abs(d) > 1e-9 and v / d > 1.0005


def headline(c: Comparison) -> str:
    return (
        f"Step time {ms(c.step_before_ms)} → {ms(c.step_after_ms)} "
        f"({dms(c.step_time_delta_ms)}, {dpct(c.step_time_delta_pct)})"
    )


def primary_sentence(c: Comparison) -> str:
    p = c.primary
    if p is None and c.noise_ms is not None and not c.significant:
        return (
            f"Within noise: the step time moved {dms(c.step_time_delta_ms)}, inside the runs' own step-to-step "
            f"spread ({c.spread}); no primary cause is named. How its parts moved is shown below."
        )
    if p is None:
        return (
            f"No significant change: the step time moved by less than 1% ({dms(c.step_time_delta_ms)}) and no measured "
            "part that a finding explains moved it; how its parts moved is shown below."
        )
    d = c.step_time_delta_ms
    pieces = _pieces(p, c)
    if len(pieces) > 1:  # a finding's parts, each with its delta
        s = "Primary cause: " + ", ".join(f"{n} {dms(v)}" for n, v in pieces) + f" ({dms(p.delta_ms)} per step in all)"
    else:
        s = f"Primary cause: {part_name(p.parts, c)} {dms(p.delta_ms)} per step"
    offsets_named: list[Cause] = []
    if _over(c, p.delta_ms):
        from fsdpdoctor.analysis.compare import offsets

        against = offsets(c.causes, p, d)
        offsets_named = against[:3]
        named = ", ".join(f"{cause_name(k, c)} {dms(k.delta_ms)}" for k in against[:3])
        s += (
            f", more than the whole {dms(d)} change: other parts moved the other way by {dms(d - p.delta_ms)} in all"
            + (f" ({named}{', …' if len(against) > 3 else ''})" if named else "")
            + "."
        )
    else:
        s += f", {_share(c, p.delta_ms)} of the {dms(d)} change."
    if p.kind == "finding":
        s += f" Explained by `{p.slug}` ({p.severity}, {_verb(p)}): {p.summary}"
        if p.note:
            s += f" ({p.note})"
        if p.est_saving_ms:
            s += f" The rule estimates {ms(p.est_saving_ms)} per step for it."
    else:
        s += " No finding that appeared or went away explains it. " + cause_hint(p)
    seen = _context(c, [p, *offsets_named])
    if seen:
        s += f" What changed with it: {seen}."
    nothing = [k for k in c.causes if k.kind == "finding" and not k.measurable]
    if len(nothing) == 1:
        s += f" A finding that {_verb(nothing[0])} explains nothing measurable: `{nothing[0].slug}`."
    elif nothing:
        s += " Findings that appeared or went away but explain nothing measurable: "
        s += ", ".join(f"`{k.slug}` ({_verb(k)})" for k in nothing) + "."
    return s.rstrip()


# the rows of "what changed" that go with a part of the step (shown beside it when it moves)
_CHANGED_WITH = {
    "compute": ("compute_dtype", "activation_checkpointing"),
    "exposed_all_gather": ("unit_count", "backward_prefetch", "mixed_precision"),
    "exposed_reduce_scatter": ("unit_count", "backward_prefetch", "mixed_precision"),
    "other_idle": ("optimizer_cpu_ms",),
    "memcpy": ("copies.pageable", "copies.h2d", "copies.d2h"),
    "host_bound_idle": ("copies.pageable",),
    "cpu_fsdp_hooks": ("unit_count", "backward_prefetch"),
    "cpu_forward": ("unit_count", "mixed_precision"),
    "cpu_backward": ("unit_count", "mixed_precision"),
}


def _context(c: Comparison, causes: list[Cause]) -> str:
    """The structure rows that changed and go with these parts: "optimizer step CPU time 525.26 ms →
    332.96 ms"."""
    rows = {s.key: s for s in c.structure if s.changed}
    comps = [x.partition("@")[0] for cause in causes for x in cause.parts]
    keys = [k for comp in dict.fromkeys(comps) for k in _CHANGED_WITH.get(comp, ())]
    out = [f"{rows[k].label} {rows[k].before} → {rows[k].after}" for k in dict.fromkeys(keys) if k in rows]
    return "; ".join(out)


def causes_table(c: Comparison, compact: bool = False) -> Table:
    rows = []
    for k in c.causes:
        if k.kind == "component" and abs(k.delta_ms) < 0.005 and k.slug != c.primary_cause:
            continue
        if k.kind == "finding" and not k.measurable:
            what = f"{_verb(k)}, explains nothing measurable"
            if not k.corroborated:
                what += " (threshold crossed, configuration unchanged)"
            elif k.note and not compact:
                what += f" ({k.note})"
            rows.append([str(len(rows) + 1), k.slug, "–", "–", what])
            continue
        if compact:
            what = f"{k.slug} {_verb(k)}" if k.kind == "finding" else "no finding explains it"
        else:
            what = f"{k.slug} {_verb(k)}: {k.summary}" if k.kind == "finding" else "no finding explains it"
            if k.note:
                what += f" ({k.note})"
        name = part_name(k.parts, c)
        rows.append([str(len(rows) + 1), name, dms(k.delta_ms), _share(c, k.delta_ms), what])
    over = any(_over(c, k.delta_ms) for k in c.causes)
    return Table(
        "Causes, largest first",
        ["#", "measured part", "Δ per step", "share of Δ", "explained by"],
        rows,
        "findings take the parts of the step they explain; the rest stays with the parts. The causes add up to the "
        "total change" + ("; " + _OVER_NOTE if over else "") + ".",
    )


def parts_table(c: Comparison) -> Table:
    rows = []
    for name, (b, a) in c.component_totals().items():
        rows.append([LABELS.get(name, name), ms(b), ms(a), dms(a - b), _share(c, a - b)])
    rows.append(
        [
            "step time",
            ms(c.step_before_ms),
            ms(c.step_after_ms),
            dms(c.step_time_delta_ms),
            "100%" if c.step_time_delta_ms else "–",
        ]
    )
    rows.append(["sum of the parts", "", "", dms(c.components_sum_ms, 3), ""])
    note = _OVER_NOTE if any(_over(c, a - b) for b, a in c.component_totals().values()) else ""
    title = "Where the step time went (mean per step)" + (
        " — GPU split" if c.basis == "gpu" else " — CPU phases, no GPU timeline"
    )
    return Table(title, ["part", "before", "after", "Δ", "share of Δ"], rows, note)


def phase_table(c: Comparison) -> Table | None:
    if c.basis != "gpu":
        return None  # the parts table already is the split by phase
    rows = []
    for p in c.phases:
        cpu = "–" if p.cpu_before_ms is None else f"{ms(p.cpu_before_ms)} → {ms(p.cpu_after_ms)}"
        row = [p.phase if p.phase != "other" else "other (rest of the step)", cpu]
        if c.basis == "gpu":
            row += [
                dms(p.exposed_delta_ms.get(k, 0.0))
                for k in ("exposed_all_gather", "exposed_reduce_scatter", "exposed_other_comm")
            ]
        rows.append(row)
    headers = ["phase", "CPU time (launch side)"]
    if c.basis == "gpu":
        headers += ["Δ exposed AG", "Δ exposed RS", "Δ other comm"]
    note = "compute, memcpy and idle are not split by phase in RunFacts" if c.basis == "gpu" else ""
    return Table("By phase (per step)", headers, rows, note)


def structure_table(c: Comparison) -> Table:
    rows = [[s.label, s.before, s.after] for s in c.structure if s.changed]
    added = [u.fqn or "(root)" for u in c.units if u.status == "added"]
    removed = [u.fqn or "(root)" for u in c.units if u.status == "removed"]
    if added:
        rows.append(["units only after", "", _names(added)])
    if removed:
        rows.append(["units only before", _names(removed), ""])
    return Table(
        "What changed in structure and configuration",
        ["", "before", "after"],
        rows,
        "" if rows else "nothing: same structure and configuration",
    )


def _names(xs: list[str], limit: int = 6) -> str:
    return ", ".join(xs[:limit]) + (f" … (+{len(xs) - limit})" if len(xs) > limit else "")


def findings_table(c: Comparison) -> Table:
    order = {"appeared": 0, "disappeared": 1, "persisting": 2}
    rows = []
    for f in sorted(c.findings, key=lambda f: order[f.status]):
        rows.append(
            [f.status, f"{f.code} {f.slug}", f.severity, f"{ms(f.est_saving_before_ms)} → {ms(f.est_saving_after_ms)}"]
        )
    return Table(
        "Findings",
        ["", "finding", "severity", "est. saving/step before → after"],
        rows,
        "" if rows else "no findings in either run",
    )


def ranks_table(c: Comparison) -> Table | None:
    if len(c.ranks) < 2:
        return None
    rows = []
    for r in c.ranks:
        d = None if r.step_before_ms is None or r.step_after_ms is None else r.step_after_ms - r.step_before_ms
        row = [str(r.rank), ms(r.step_before_ms), ms(r.step_after_ms), dms(d)]
        if c.basis == "gpu":
            dc = (
                None
                if r.compute_before_ms is None or r.compute_after_ms is None
                else r.compute_after_ms - r.compute_before_ms
            )
            de = (
                None
                if r.exposed_before_ms is None or r.exposed_after_ms is None
                else r.exposed_after_ms - r.exposed_before_ms
            )
            row += [dms(dc), dms(de)]
        rows.append(row)
    headers = ["rank", "step before", "step after", "Δ step"] + (
        ["Δ compute", "Δ exposed comm"] if c.basis == "gpu" else []
    )
    return Table("Per rank", headers, rows)


def collectives_table(c: Comparison, limit: int = 16) -> Table | None:
    def changed(r) -> bool:
        return (
            abs(r.count[0] - r.count[1]) > 1e-6
            or r.bytes[0] != r.bytes[1]
            or abs(r.exposed_ms[0] - r.exposed_ms[1]) >= 0.005
        )

    rows_src = [r for r in c.collectives if changed(r)]
    if not rows_src:
        return None
    rows_src.sort(key=lambda r: -abs(r.exposed_ms[1] - r.exposed_ms[0]))
    rows = []
    for r in rows_src[:limit]:
        rows.append(
            [
                r.unit or "(root)",
                r.phase,
                r.kind.replace("_", "-"),
                f"{r.count[0]:.1f} → {r.count[1]:.1f}",
                f"{mib(r.bytes[0])} → {mib(r.bytes[1])}",
                f"{ms(r.exposed_ms[0])} → {ms(r.exposed_ms[1])}" if c.basis == "gpu" else "–",
            ]
        )
    note = f"… and {len(rows_src) - limit} more changed groups" if len(rows_src) > limit else ""
    return Table(
        "Collectives that changed (by unit, phase and kind; per step, mean over ranks)",
        ["unit", "phase", "kind", "count", "bytes", "exposed"],
        rows,
        note,
    )


def compute_split_table(c: Comparison) -> Table | None:
    """The compute change split by what changed (analysis.compare.compute_split)."""
    from fsdpdoctor.analysis.compare import COMPUTE_SPLIT

    if not c.compute_split:
        return None
    total = sum(c.compute_split.values())
    rows = [
        [COMPUTE_SPLIT.get(k, k), dms(v), _share(c, v)]
        for k, v in sorted(c.compute_split.items(), key=lambda kv: -abs(kv[1]))
    ]
    return Table(
        "Where the compute change comes from (per step)",
        ["part", "Δ", "share of Δ step"],
        rows,
        f"the GPU compute change is {dms(total)} per step; each part measured on its own (the unattributed row is "
        "what they leave of it); FLOP-driven parts at the before "
        "run's achieved GEMM + attention rate",
    )


def waterfall_table(c: Comparison) -> Table | None:
    """The change split by the efficiency waterfall's parts, before the components and causes."""
    from fsdpdoctor.report.waterfall import PART_LABEL

    if not c.waterfall:
        return None
    rows = [
        [PART_LABEL.get(k, k), ms(b), ms(a), dms(a - b), _share(c, a - b)]
        for k, (b, a) in c.waterfall.items()
        if abs(a - b) >= 0.0005 or b or a
    ]
    return Table(
        "Where the change went against the ideal (per step)",
        ["part", "before", "after", "Δ", "share of Δ step"],
        rows,
        "the parts add up to each run's step time; at-peak parts are the model FLOPs at the dense BF16 peak "
        "(MFU), the rest the time lost below it"
        + ("; " + _OVER_NOTE if any(_over(c, a - b) for b, a in c.waterfall.values()) else ""),
    )


def all_tables(c: Comparison, compact: bool = False) -> list[Table]:
    ts = [
        waterfall_table(c),
        causes_table(c, compact),
        compute_split_table(c),
        parts_table(c),
        phase_table(c),
        structure_table(c),
        findings_table(c),
        ranks_table(c) if not compact or len(c.ranks) <= 8 else None,
        collectives_table(c, 8 if compact else 16),
    ]
    return [t for t in ts if t is not None]


# ------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------


def preferred_fix(c: Comparison, p: Cause) -> list[tuple[str, str]]:
    """The fix flavours of a cause, the one for the run's FSDP version first."""
    v = c.fsdp_versions[1] if p.status == "appeared" else c.fsdp_versions[0]
    first = f"fsdp{v}" if v else None
    items = list(p.fix.items())
    items.sort(key=lambda kv: 0 if kv[0] == first else (1 if kv[0] == "any" else 2))
    return items


def _md_fix(c: Comparison, p: Cause) -> list[str]:
    out = []
    for flavour, code in preferred_fix(c, p):
        out += ["", f"**Fix ({flavour}):**", "", "```python", code.rstrip(), "```"]
    return out


def render_markdown(c: Comparison) -> str:
    lines = [f"# {headline(c)}", ""]
    lines.append(f"Compared **before** `{c.before_label}` with **after** `{c.after_label}`.")
    lines.append("")
    lines.append(primary_sentence(c))
    p = c.primary
    if p is not None and p.fix:
        lines += _md_fix(c, p)
    lines.append("")
    for t in all_tables(c):
        lines.append(md_table(t, "##"))
        lines.append("")
    lines.append("## How these numbers are defined")
    lines.append("")
    lines.append(c.basis_text[0].upper() + c.basis_text[1:] + ".")
    lines += [f"- {n}" for n in c.notes]
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# terminal
# ------------------------------------------------------------------------------------------


def render_terminal(c: Comparison, console: Console) -> None:
    from rich.panel import Panel
    from rich.table import Table as RichTable
    from rich.text import Text

    head = RichTable.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("Before", Text(c.before_label))
    head.add_row("After", Text(c.after_label))
    d = c.step_time_delta_ms
    style = "bold red" if d > 0 and (c.step_time_delta_pct or 0) >= 1 else ("bold green" if d < 0 else "")
    head.add_row(
        "Step time",
        Text(f"{ms(c.step_before_ms)} → {ms(c.step_after_ms)}  ({dms(d)}, {dpct(c.step_time_delta_pct)})", style=style),
    )
    head.add_row("Primary cause", Text(primary_text(c), style="bold"))
    console.print(Panel(head, title="fsdpdoctor compare", title_align="left"))
    console.print(Text(primary_sentence(c)))
    p = c.primary
    if p is not None and p.fix:
        flavour, code = preferred_fix(c, p)[0]
        console.print(Text(f"Fix ({flavour}):", style="bold"))
        console.print(Text(code.rstrip(), style="cyan"))
    for t in all_tables(c, compact=True):
        if not t.rows:
            console.print(Text(f"{t.title}: {t.note}"))
            continue
        console.print(rich_table(t, right=lambda _i, h: h.startswith(("Δ", "share", "before", "after", "step"))))
    console.print(Text(f"basis: {c.basis_text}", style="dim"))
    for n in c.notes:
        console.print(Text(f"note: {n}", style="dim"))
