"""HTML for ``compare``: the step-time change from before to after as a waterfall, the components,
the causes and the findings that appeared or went away."""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go

from fsdpdoctor.fmt import ms
from fsdpdoctor.report.html_page import TITLES, Table, _e, _headline_html, _Page, _table_html


def _as_dict(obj: Any) -> dict:
    """A comparison's JSON dict (a :class:`~fsdpdoctor.analysis.compare.Comparison` is converted)."""
    if isinstance(obj, dict):
        return obj
    from fsdpdoctor.report.comparison import to_dict

    return to_dict(obj)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def comparison_parts(comparison: Any) -> tuple[float | None, list[tuple[str, float]], float | None, float | None]:
    """(before ms, [(component, delta ms)], after ms, total delta ms) of a comparison.

    Reads the keys :func:`fsdpdoctor.report.comparison.to_dict` writes: ``step_time_before_ms``,
    ``step_time_after_ms``, ``step_time_delta_ms`` and ``components`` (name → ``delta_ms``).
    """
    d = _as_dict(comparison)
    before, after = _number(d.get("step_time_before_ms")), _number(d.get("step_time_after_ms"))
    total = _number(d.get("step_time_delta_ms"))
    comps = [
        (str(n), v)
        for n, c in (d.get("components") or {}).items()
        if isinstance(c, dict) and (v := _number(c.get("delta_ms"))) is not None
    ]
    if total is None and before is not None and after is not None:
        total = after - before
    return before, comps, after, total


def _component_labels() -> dict[str, str]:
    from fsdpdoctor.report.comparison import LABELS

    return dict(LABELS)


def _waterfall(
    before: float | None,
    comps: list[tuple[str, float]],
    after: float | None,
    total: float | None,
    labels: dict[str, str],
) -> go.Figure:
    x: list[str] = []
    y: list[float] = []
    text: list[str] = []
    measure: list[str] = []
    if before is not None:
        x.append("before")
        y.append(before)
        text.append(f"{before:.2f} ms")
        measure.append("absolute")
    explained = sum(v for _, v in comps)
    for name, v in comps:
        if abs(v) < 5e-4:  # below the 0.001 ms the labels show: left to the table
            continue
        x.append(labels.get(name, name.replace("_", " ")))
        y.append(v)
        text.append(f"{v:+.2f}")
        measure.append("relative")
    if total is not None and abs(total - explained) > 1e-6 * max(1.0, abs(total)):
        x.append("unexplained")
        y.append(total - explained)
        text.append(f"{total - explained:+.2f}")
        measure.append("relative")
    x.append("after" if before is not None else "total change")
    y.append(0.0)
    end = (before or 0.0) + (total if total is not None else explained)
    text.append(f"{end:.2f} ms" if before is not None else f"{end:+.2f} ms")
    measure.append("total")
    fig = go.Figure(
        go.Waterfall(
            x=x,
            y=y,
            measure=measure,
            orientation="v",
            text=text,
            increasing=dict(marker=dict(color="#E45756")),  # slower
            decreasing=dict(marker=dict(color="#54A24B")),  # faster
            totals=dict(marker=dict(color="#4C78A8")),
            connector=dict(line=dict(color="#999", width=1, dash="dot")),
            texttemplate="%{text}",
            textposition="outside",
            hovertemplate="%{x}: %{delta:+.3f} ms (running %{y:.3f} ms)<extra></extra>",
        )
    )
    fig.update_layout(
        height=480,
        margin=dict(l=60, r=20, t=30, b=140),
        yaxis_title="step time (ms)",
        showlegend=False,
        xaxis=dict(tickangle=-30),
    )
    return fig


def render_comparison(comparison: Any, title: str = "fsdpdoctor compare") -> str:
    """A self-contained page with the before → after step-time waterfall.

    ``comparison`` is :class:`fsdpdoctor.analysis.compare.Comparison` or its JSON dict
    (:func:`fsdpdoctor.report.comparison.to_dict`). Components are drawn largest first; a part of
    the total that they do not add up to is drawn as "unexplained".
    """
    d = _as_dict(comparison)
    before, comps, after, total = comparison_parts(d)
    comps = sorted(comps, key=lambda kv: -abs(kv[1]))
    labels = _component_labels()
    page = _Page()
    page.add(f"<h1>{_e(title)}</h1>")
    pairs = []
    for label, key in (("Before", "before"), ("After", "after")):
        if isinstance(d.get(key), str) and d[key]:
            pairs.append((label, d[key]))
    if before is not None:
        pairs.append(("Step time before", ms(before)))
    if after is not None:
        pairs.append(("Step time after", ms(after)))
    if total is not None:
        rel = f" ({100 * total / before:+.1f}%)" if before else ""
        pairs.append(("Change", f"{total:+.2f} ms{rel}"))
    if isinstance(d.get("primary_cause_text"), str):
        pairs.append(("Primary cause", d["primary_cause_text"]))
    elif isinstance(d.get("primary_cause"), str):
        pairs.append(("Primary cause", d["primary_cause"]))
    if pairs:
        page.add(_headline_html(pairs))
    page.add(f'<h2 id="compare">{_e(TITLES["compare"])}</h2>')
    if not comps and total is None:
        page.add('<p class="missing">The comparison holds no step-time delta to draw.</p>')
    else:
        basis = d.get("basis_definition")
        page.add(
            '<p class="sub">Components sorted by size; red makes the step slower, green faster. '
            "An <i>unexplained</i> bar, when present, is the part of the change no component accounts for."
            + (f" Basis: {_e(basis)}." if isinstance(basis, str) else "")
            + "</p>"
        )
        page.figure(_waterfall(before, comps, after, total, labels), "fig-compare")
        rows = [[labels.get(n, n.replace("_", " ")), f"{v:+.3f} ms"] for n, v in comps]
        if rows:
            page.add(_table_html(Table("Components", ["component", "delta"], rows)))
    parts = d.get("waterfall_ms")
    if isinstance(parts, dict) and parts and before is not None:
        from fsdpdoctor.report.waterfall import PART_LABEL

        deltas = [
            (str(k), v)
            for k, p in parts.items()
            if isinstance(p, dict) and (v := _number(p.get("delta_ms"))) is not None
        ]
        page.add(
            '<h2 id="compare-parts">Where the change went against the ideal</h2><p class="sub">The same change split by '
            "the efficiency waterfall's parts (at peak, below peak, recompute, other kernels, exposed comm and copies, "
            "GPU idle), in that order.</p>"
        )
        page.figure(_waterfall(before, deltas, after, total, dict(PART_LABEL)), "fig-compare-parts")
    causes = d.get("causes")
    if isinstance(causes, list) and causes and all(isinstance(c, dict) for c in causes):
        rows = [
            [
                str(c.get("label") or labels.get(str(c.get("slug", "")), c.get("slug", ""))),
                f"{c['delta_ms']:+.3f} ms"
                if c.get("measurable", True) and _number(c.get("delta_ms")) is not None
                else "–",
                str(c.get("summary", "")),
            ]
            for c in causes
        ]
        page.add(f'<h2 id="causes">Causes, ranked</h2>{_table_html(Table("", ["cause", "delta", "summary"], rows))}')
        prim = next((c for c in causes if c.get("slug") == d.get("primary_cause")), None)
        for flavour, code in ((prim or {}).get("fix") or {}).items():
            page.add(
                f"<h4>Fix for the primary cause ({_e(flavour)})</h4><pre><code>{_e(str(code).rstrip())}</code></pre>"
            )
    findings = d.get("findings") or {}  # {"appeared": [...], "disappeared": [...], "persisting": [...]}
    findings = [dict(f, status=st) for st, lst in findings.items() for f in lst]
    if findings:
        items = []
        for fdd in findings:
            status = f"[{fdd['status']}] " if fdd.get("status") else ""
            items.append(
                f"<li>{_e(status)}<b>{_e(fdd.get('code', ''))}</b> <code>{_e(fdd.get('slug', ''))}</code> "
                f"{_e(fdd.get('summary', ''))}</li>"
            )
        page.add(f"<h2>Findings</h2><ul>{''.join(items)}</ul>")
    notes = d.get("notes")
    if isinstance(notes, list) and notes:
        page.add(
            f'<h2 id="notes">{_e(TITLES["notes"])}</h2><ul>' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"
        )
    return page.html(title)
