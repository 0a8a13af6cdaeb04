"""HTML: one self-contained page (plotly.js inlined once, no network) with the ticket and charts.

Sections: the headline and findings (as in the terminal, with evidence and fixes), the per-step
GPU time breakdown of every rank, where the step goes against the ideal (the efficiency
waterfall, :mod:`.html_waterfall`), a zoomable GPU timeline of one step of one rank (from
:mod:`fsdpdoctor.analysis.timeline.extract`), per-unit collective bytes and exposed time, memory
at the peak (when a snapshot was given), the detail tables of :mod:`.sections`, and the notes.
:func:`render_comparison` (:mod:`.html_compare`) draws ``compare``'s step-time delta as a waterfall;
the page's building blocks are :mod:`.html_page`'s.

Every string that comes from a trace (module names, kernel names, paths) is escaped: with
:func:`html.escape` in the page, and by plotly's JSON encoder (``<`` as ``\\u003c``) in figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fsdpdoctor.fmt import mib, ms
from fsdpdoctor.report.html_compare import comparison_parts, render_comparison
from fsdpdoctor.report.html_page import (
    COLORS,
    MAX_UNIT_LINES,
    MEMORY_COLORS,
    SEVERITY_COLORS,
    TITLES,
    _byte_scale,
    _comm_color,
    _e,
    _get,
    _headline_html,
    _label,
    _Page,
    _table_html,
)
from fsdpdoctor.report.html_waterfall import waterfall_section
from fsdpdoctor.report.sections import ENGINE_LABEL, all_tables, fix_language, headline, no_collectives, saving_text

if TYPE_CHECKING:
    from fsdpdoctor.analysis.timeline.extract import StepTimeline
    from fsdpdoctor.api import Report

__all__ = ["render", "render_comparison", "comparison_parts", "TITLES"]


def _highlight(code: str, lang: str) -> str:
    """Fix code as HTML, syntax-highlighted in its language with inline styles (Pygments, as the
    terminal's rich does; the page stays one self-contained file)."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import get_lexer_by_name

    return highlight(code, get_lexer_by_name(lang), HtmlFormatter(nowrap=True, noclasses=True, style="default")).rstrip(
        "\n"
    )


def _findings_html(findings: list, facts) -> str:
    out = [f'<h2 id="findings">{_e(TITLES["findings"])}</h2>']
    if not findings:
        out.append('<p class="ok">No findings.</p>')
        return "\n".join(out)
    for i, fd in enumerate(findings, 1):
        color = SEVERITY_COLORS.get(fd.severity, "#555")
        saving = saving_text(fd, facts)
        saving = f' <span class="saving">— {_e(saving)}</span>' if saving else ""
        out.append(f'<article class="finding" style="--sev:{color}">')
        out.append(
            f'<h3>{i}. <span class="sev">{_e(fd.severity)}</span> {_e(fd.code)} <code>{_e(fd.slug)}</code>{saving}</h3>'
        )
        out.append(f"<p>{_e(fd.summary)}</p>")
        if fd.evidence:
            out.append("<h4>Evidence</h4><ul>" + "".join(f"<li>{_e(ev)}</li>" for ev in fd.evidence) + "</ul>")
        if fd.cause:
            out.append(f"<p><b>Likely cause:</b> {_e(fd.cause)}</p>")
        for flavour, code in fd.fix.items():
            lang = fix_language(code)
            out.append(
                f'<h4>Fix ({_e(flavour)})</h4><pre><code class="language-{lang}">{_highlight(code.rstrip(), lang)}</code></pre>'
            )
        meta = [f"confidence {fd.confidence:.0%}"]
        if fd.where:
            meta.append("where: " + ", ".join(f"{k}={v}" for k, v in fd.where.items()))
        out.append(f'<p class="note">{_e(" · ".join(meta))}</p>')
        out.append("</article>")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# charts
# ---------------------------------------------------------------------------------------------


def _steps_figure(f) -> tuple[go.Figure | None, str]:
    """Stacked bars per (rank, step): compute, exposed comm by kind, exposed memcpy, idle."""
    ranks = sorted(f.rank_facts, key=lambda r: r.rank)
    if not any(r.steps for r in ranks):
        return None, "No steps found."
    multi = len(ranks) > 1
    xr: list[str] = []
    xs: list[str] = []
    for r in ranks:
        for k, s in enumerate(r.steps):
            xr.append(f"rank {r.rank}")
            xs.append(f"{k} (#{s.number})")
    x = [xr, xs] if multi else xs
    steps = [s for r in ranks for s in r.steps]
    fig = go.Figure()
    cpu_hover = "%{x}<br>CPU step span %{y:.3f} ms<extra></extra>"
    if not f.gpu_present:
        fig.add_bar(
            x=x,
            y=[s.step_ms for s in steps],
            name="step time (CPU ProfilerStep spans)",
            marker_color=COLORS["cpu_step"],
            hovertemplate=cpu_hover,
        )
        note = "No GPU kernels in these traces (CPU-only run): only the CPU step time is shown."
        fig.update_layout(yaxis_title="ms")
    else:
        kinds = sorted({k for s in steps for k in s.exposed_by_kind}, key=lambda k: (k == "other", k))
        series: list[tuple[str, list[float], str]] = [("compute", [s.compute_ms for s in steps], COLORS["compute"])]
        for kind in kinds:
            series.append(
                (f"exposed {_label(kind)}", [s.exposed_by_kind.get(kind, 0.0) for s in steps], _comm_color(kind))
            )
        series.append(("exposed memcpy/memset", [s.memcpy_ms for s in steps], COLORS["memcpy"]))
        if any(s.other_steps_ms > 0 for s in steps):
            series.append(("other steps' GPU work", [s.other_steps_ms for s in steps], COLORS["other_steps"]))
        series.append(("idle", [s.idle_ms for s in steps], COLORS["idle"]))
        for name, ys, color in series:
            fig.add_bar(
                x=x, y=ys, name=name, marker_color=color, hovertemplate=f"{_e(name)}: %{{y:.3f}} ms<extra></extra>"
            )
        fig.add_scatter(
            x=x,
            y=[s.step_ms for s in steps],
            name="step time",
            mode="markers",
            marker=dict(symbol="diamond", size=8, color=COLORS["step_time"]),
            hovertemplate="%{x}<br>step time %{y:.3f} ms<extra></extra>",
        )
        fig.add_scatter(
            x=x,
            y=[s.cpu_span_ms or s.step_ms for s in steps],
            name="CPU span",
            mode="markers",
            marker=dict(symbol="line-ew-open", size=12, color=COLORS["cpu_step"]),
            hovertemplate=cpu_hover,
        )
        note = (
            "Per step, on the GPU activity the CPU launched in that step: compute + exposed communication "
            "(by collective) + exposed memcpy/memset + other steps' GPU work + idle = the step's GPU window "
            "(idle: nothing running at all; other steps' work: the GPU runs behind the CPU and the next step's "
            "work fills this window). Diamonds: the step time (from the previous step's completion to this "
            "one's: CPU span and GPU work both done); dashes: the CPU ProfilerStep span."
        )
        fig.update_layout(yaxis_title="ms", barmode="stack", hovermode="x unified")
    n = len(steps)
    fig.update_layout(
        height=420,
        margin=dict(l=60, r=20, t=30, b=60 if multi else 50),
        legend=dict(orientation="h", y=1.08, x=0),
        bargap=0.15 if n > 3 else 0.4,
        xaxis_title="step index (ProfilerStep number)" if not multi else None,
    )
    return fig, note


def _timeline_figure(tl: "StepTimeline") -> go.Figure:
    rows: list[str] = []
    row_phase, row_hooks, row_units, row_exposed = (
        "CPU phases",
        "CPU FSDP hooks",
        "FSDP unit starts (GPU)",
        "exposed comm",
    )
    if tl.phases:
        rows.append(row_phase)
    if tl.units:
        rows.append(row_hooks)
        if any(u.gpu_us is not None for u in tl.units):
            rows.append(row_units)
    stream_row = {}
    for st in tl.streams:
        stream_row[st] = f"stream {st} · {tl.stream_roles.get(st, '')}"
    if tl.kernels:
        rows.append(row_exposed)
        rows += [stream_row[s] for s in tl.streams]
    fig = go.Figure()
    # CPU phases
    if tl.phases:
        for name, (a, b) in tl.phases.items():
            fig.add_bar(
                y=[row_phase],
                base=[a / 1e3],
                x=[(b - a) / 1e3],
                orientation="h",
                name=f"CPU {name}",
                marker_color=COLORS.get(name, COLORS["other_phase"]),
                legendgroup="cpu",
                showlegend=False,
                text=[name],
                textposition="inside",
                insidetextanchor="middle",
                hovertemplate=f"CPU {name}: %{{base:.3f}} – %{{customdata:.3f}} ms<extra></extra>",
                customdata=[b / 1e3],
            )
    # FSDP hooks (CPU ranges) and where each unit's GPU work starts
    if tl.units:
        for pass_ in ("forward", "backward"):
            us = [u for u in tl.units if u.pass_ == pass_]
            if not us:
                continue
            fig.add_bar(
                y=[row_hooks] * len(us),
                base=[u.cpu_start_us / 1e3 for u in us],
                x=[max(u.cpu_end_us - u.cpu_start_us, 0.0) / 1e3 for u in us],
                orientation="h",
                name=f"FSDP pre-{pass_} hook (CPU)",
                marker_color=COLORS[pass_],
                marker_line=dict(color="#555", width=0.5),
                legendgroup="hooks",
                customdata=[[u.label, u.unit, (u.cpu_end_us - u.cpu_start_us)] for u in us],
                hovertemplate="%{customdata[0]}<br>unit %{customdata[1]}<br>CPU %{base:.3f} ms, "
                "%{customdata[2]:.1f} µs<extra></extra>",
            )
            marked = [u for u in us if u.gpu_us is not None]
            if marked:
                fig.add_scatter(
                    x=[u.gpu_us / 1e3 for u in marked],
                    y=[row_units] * len(marked),
                    mode="markers+text",
                    name=f"{pass_} unit start (GPU)",
                    marker=dict(
                        symbol="triangle-right" if pass_ == "forward" else "triangle-left",
                        size=10,
                        color=COLORS[pass_],
                        line=dict(color="#333", width=1),
                    ),
                    text=[u.unit for u in marked],
                    textposition=["top center" if i % 2 == 0 else "bottom center" for i in range(len(marked))],
                    textfont=dict(size=10),
                    legendgroup="units",
                    customdata=[[u.label, u.unit, u.gpu_kernel or "", u.cpu_start_us / 1e3] for u in marked],
                    hovertemplate="%{customdata[1]} (" + pass_ + ")<br>GPU work starts %{x:.3f} ms with "
                    "%{customdata[2]}<br>hook %{customdata[0]} began on the CPU at "
                    "%{customdata[3]:.3f} ms<extra></extra>",
                )
        lines = [u for u in tl.units if u.gpu_us is not None][:MAX_UNIT_LINES]
        fig.update_layout(
            shapes=[
                dict(
                    type="line",
                    xref="x",
                    yref="paper",
                    x0=u.gpu_us / 1e3,
                    x1=u.gpu_us / 1e3,
                    y0=0,
                    y1=1,
                    line=dict(color="#888" if u.pass_ == "forward" else "#C08040", width=0.8, dash="dot"),
                    layer="below",
                )
                for u in lines
            ]
        )
    # kernels, one trace per legend entry
    groups: dict[str, list] = {}
    for sp in tl.kernels:
        key = f"comm:{sp.kind or 'other'}" if sp.category == "comm" else sp.category
        groups.setdefault(key, []).append(sp)
    order = ["compute"] + sorted(k for k in groups if k.startswith("comm:")) + ["memcpy", "other"]
    for key in order:
        spans = groups.get(key)
        if not spans:
            continue
        if key.startswith("comm:"):
            kind = key[5:]
            name, color = _label(kind), _comm_color(kind)
        elif key == "memcpy":
            name, color = "memcpy/memset", COLORS["memcpy"]
        elif key == "other":
            name, color = "other GPU activity (sync/wait)", COLORS["other"]
        else:
            name, color = "compute", COLORS["compute"]
        fig.add_bar(
            y=[stream_row[sp.stream] for sp in spans],
            base=[sp.start_us / 1e3 for sp in spans],
            x=[(sp.end_us - sp.start_us) / 1e3 for sp in spans],
            orientation="h",
            name=name,
            marker=dict(color=color, line=dict(width=0)),
            width=0.7,
            customdata=[
                [sp.name, sp.end_us - sp.start_us, sp.unit or "", mib(sp.bytes) if sp.bytes else ""] for sp in spans
            ],
            hovertemplate="%{customdata[0]}<br>start %{base:.3f} ms, %{customdata[1]:.1f} µs"
            + ("<br>unit %{customdata[2]} %{customdata[3]}" if key.startswith("comm:") else "")
            + "<extra>"
            + _e(name)
            + "</extra>",
        )
    # exposed communication: the merged set on its own row, and hatched over each comm kernel
    if tl.exposed:
        fig.add_bar(
            y=[row_exposed] * len(tl.exposed),
            base=[a / 1e3 for a, _ in tl.exposed],
            x=[(b - a) / 1e3 for a, b in tl.exposed],
            orientation="h",
            width=0.7,
            name="exposed comm (not overlapped by compute)",
            marker=dict(color=COLORS["exposed"], line=dict(width=0)),
            legendgroup="exposed",
            hovertemplate="exposed %{base:.3f} ms, %{x:.3f} ms long<extra></extra>",
        )
    if tl.exposed_spans:
        sp = tl.exposed_spans
        fig.add_bar(
            y=[stream_row[e.stream] for e in sp],
            base=[e.start_us / 1e3 for e in sp],
            x=[(e.end_us - e.start_us) / 1e3 for e in sp],
            orientation="h",
            width=0.7,
            name="exposed part of a collective",
            legendgroup="exposed",
            showlegend=False,
            marker=dict(
                color="rgba(228,87,86,0.55)",
                line=dict(width=0),
                pattern=dict(shape="/", fgcolor="#8B0000", solidity=0.35),
            ),
            customdata=[_label(e.kind) for e in sp],
            hovertemplate="exposed %{customdata}: %{base:.3f} ms, %{x:.3f} ms<extra></extra>",
        )
    fig.update_layout(
        barmode="overlay",
        height=max(320, 110 + 34 * len(rows)),
        margin=dict(l=170, r=20, t=40, b=50),
        legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0),
        xaxis=dict(
            title=f"ms since the start of ProfilerStep#{tl.step_number} (CPU and GPU share the clock)", zeroline=False
        ),
        yaxis=dict(type="category", categoryorder="array", categoryarray=rows, autorange="reversed", fixedrange=True),
        hoverlabel=dict(namelength=-1),
        dragmode="zoom",
    )
    return fig


def _compute_figure(f) -> tuple[go.Figure | None, str]:
    """A roofline's ceilings: achieved TFLOP/s of the GEMM / attention kernels of each engine
    (bars) against the device's dense peak for that engine's dtype (markers), and MFU per step
    (the step time of each step of the first rank with FLOPs)."""
    from fsdpdoctor.analysis.peaks import device_peaks

    c = f.compute
    if not f.gpu_present:
        return (
            None,
            "No GPU activity in these traces: FLOPs and MFU are measured on the GPU kernels of matmuls and attention.",
        )
    if c is None or not c.engine_tflops:
        return (
            None,
            "No FLOPs: the traces carry no recorded shapes of matmul or attention ops (profile with record_shapes=True).",
        )
    peaks = (device_peaks(c.device) or ("", {}))[1]
    engines = sorted(c.engine_tflops, key=lambda e: -c.engine_ms_per_step.get(e, 0.0))
    labels = [ENGINE_LABEL.get(e, e) for e in engines]
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        horizontal_spacing=0.12,
        subplot_titles=("TFLOP/s by engine", "MFU per step"),
    )
    fig.add_bar(
        x=labels,
        y=[c.engine_tflops[e] for e in engines],
        name="achieved",
        marker_color=COLORS["compute"],
        hovertemplate="%{x}: %{y:.1f} TFLOP/s achieved<extra></extra>",
        row=1,
        col=1,
    )
    pk = [peaks.get({"fp32-simt": "fp32"}.get(e, e)) for e in engines]
    fig.add_scatter(
        x=labels,
        y=pk,
        name="dense peak",
        mode="markers",
        marker=dict(symbol="line-ew-open", size=28, color="#333"),
        hovertemplate="%{x}: %{y:.0f} TFLOP/s peak<extra></extra>",
        row=1,
        col=1,
    )
    ref_peak, ref_name = c.peak_tflops, (c.peak_dtype or "given").upper() if c.peak_dtype else "given"
    if ref_peak:  # MFU's reference: the dense BF16 peak whatever dtype the run used, as the headline
        fig.add_hline(
            y=ref_peak,
            line_dash="dot",
            line_color=COLORS["exposed"],
            row=1,
            col=1,
            annotation_text=f"{ref_name} dense peak {ref_peak:,.0f}",
            annotation_position="top left",
        )
    r = next((r for r in f.rank_facts if r.compute is not None), None)
    if r is not None and ref_peak:
        mfu = [
            100 * r.compute.model_flops_per_step / (s.step_ms * 1e9) / ref_peak if s.step_ms else None for s in r.steps
        ]
        fig.add_scatter(
            x=[f"#{s.number}" for s in r.steps],
            y=mfu,
            name=f"MFU (rank {r.rank})",
            mode="lines+markers",
            marker_color=COLORS["step_time"],
            hovertemplate="step %{x}: MFU %{y:.1f}%<extra></extra>",
            row=1,
            col=2,
        )
    fig.update_yaxes(title_text="TFLOP/s", type="log", row=1, col=1)
    fig.update_yaxes(title_text=f"% of the {ref_name} dense peak", rangemode="tozero", row=1, col=2)
    fig.update_layout(height=380, margin=dict(l=60, r=20, t=40, b=60), legend=dict(orientation="h", y=-0.2, x=0))
    note = (
        f"{c.model_flops_per_step / 1e9:,.1f} GFLOP per step of matmuls and attention (model), MFU "
        f"{100 * c.achieved_tflops / ref_peak:.1f}% of the {c.peak_label if c.peak_label != '--peak-tflops' else 'given'} "
        f"{ref_name} dense peak"
        if ref_peak and c.achieved_tflops is not None
        else f"{c.model_flops_per_step / 1e9:,.1f} GFLOP per step; no peak known for this device (--peak-tflops)"
    )
    return fig, note + "; per step, the rank's FLOPs per step over that step's time."


def _units_figure(f) -> tuple[go.Figure | None, str]:
    units = f.fsdp.units
    if not units:
        return None, ""
    names = [u.fqn if u.fqn else "(root)" for u in units]
    ag = [u.all_gather_bytes for u in units]
    rs = [u.reduce_scatter_bytes for u in units]
    top = max([b for b in ag + rs if b] or [1.0])
    div, unit = _byte_scale(top)
    rows = 2 if f.gpu_present else 1
    fig = make_subplots(
        rows=rows,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=(f"bytes per step ({unit})",) + (("exposed time per step (ms)",) if rows == 2 else ()),
    )
    hover_b = "%{x}<br>%{customdata}<extra>%{fullData.name}</extra>"
    fig.add_bar(
        x=names,
        y=[(b or 0) / div for b in ag],
        name="all-gather bytes",
        marker_color=COLORS["all_gather"],
        customdata=[mib(b) if b is not None else "unknown dtype" for b in ag],
        hovertemplate=hover_b,
        row=1,
        col=1,
    )
    fig.add_bar(
        x=names,
        y=[(b or 0) / div for b in rs],
        name="reduce-scatter bytes",
        marker_color=COLORS["reduce_scatter"],
        customdata=[mib(b) if b is not None else "unknown dtype" for b in rs],
        hovertemplate=hover_b,
        row=1,
        col=1,
    )
    if rows == 2:
        fig.add_bar(
            x=names,
            y=[u.all_gather_exposed_ms for u in units],
            name="all-gather exposed",
            marker=dict(color=COLORS["all_gather"], pattern=dict(shape="/")),
            hovertemplate="%{x}<br>%{y:.3f} ms<extra>all-gather exposed</extra>",
            row=2,
            col=1,
        )
        fig.add_bar(
            x=names,
            y=[u.reduce_scatter_exposed_ms for u in units],
            name="reduce-scatter exposed",
            marker=dict(color=COLORS["reduce_scatter"], pattern=dict(shape="/")),
            hovertemplate="%{x}<br>%{y:.3f} ms<extra>reduce-scatter exposed</extra>",
            row=2,
            col=1,
        )
    fig.update_layout(
        barmode="group",
        height=260 + 200 * rows,
        margin=dict(l=60, r=20, t=40, b=80),
        legend=dict(orientation="h", y=1.1, x=0),
    )
    parts = [f"Units: {f.fsdp.unit_source}. Per step, mean over the analysed steps."]
    if any(b is None for b in ag + rs):
        parts.append("Some sizes are unknown (the trace does not record the collective's dtype).")
    if not f.gpu_present:
        parts.append("No GPU kernels: exposed time cannot be measured.")
    return fig, " ".join(parts)


def _memory_figures(m) -> list[tuple[str, go.Figure, str]]:
    out: list[tuple[str, go.Figure, str]] = []
    cats = dict(_get(m, "categories", {}) or {})
    peak = _get(m, "peak_allocated_bytes", 0) or 0
    reserved = _get(m, "reserved_at_peak_bytes")
    top = max(peak, reserved or 0, 1)
    div, unit = _byte_scale(top)
    fig = go.Figure()
    row_alloc, row_res = "allocated at peak", "reserved at peak"
    for name, v in sorted(cats.items(), key=lambda kv: -kv[1]):
        if not v:
            continue
        share = 100.0 * v / peak if peak else 0.0
        fig.add_bar(
            y=[row_alloc],
            x=[v / div],
            orientation="h",
            name=name.replace("_", " "),
            marker_color=MEMORY_COLORS.get(name, COLORS["other"]),
            customdata=[[mib(v), share]],
            hovertemplate=f"{_e(name)}: %{{customdata[0]}} (%{{customdata[1]:.1f}}% of allocated)<extra></extra>",
        )
    if reserved is not None:
        pending = _get(m, "pending_free_at_peak_bytes") or 0
        external = _get(m, "external_fragmentation_bytes")
        parts = [("allocated", peak, COLORS["allocated"])]
        if pending:
            parts.append(("freed on another stream (pending)", pending, "#FFBE7D"))
        if external is not None:
            parts.append(("cached free blocks (external fragmentation)", external, "#E3E3E3"))
        else:
            parts.append(("reserved, not allocated", max(reserved - peak - pending, 0), "#E3E3E3"))
        for name, v, color in parts:
            fig.add_bar(
                y=[row_res],
                x=[v / div],
                orientation="h",
                name=name,
                marker_color=color,
                marker_line=dict(color="#999", width=0.5),
                customdata=[mib(v)],
                hovertemplate=f"{_e(name)}: %{{customdata}}<extra></extra>",
            )
    fig.update_layout(
        barmode="stack",
        height=300,
        margin=dict(l=130, r=20, t=30, b=50),
        xaxis_title=unit,
        legend=dict(orientation="h", y=-0.35, x=0, traceorder="normal"),
        yaxis=dict(categoryorder="array", categoryarray=[row_res, row_alloc]),
    )
    phase = _get(m, "peak_phase")
    note = f"Peak {mib(peak)} allocated" + (f" during {phase}" if phase else "")
    if reserved is not None:
        note += f", {mib(reserved)} reserved at that moment"
    note += f" ({_get(m, 'source', '')}: {_get(m, 'path', '') or ''})."
    out.append((TITLES["memory_stack"], fig, note))

    curve = _get(m, "curve")
    xs = list(_get(curve, "x") or [])
    alloc = list(_get(curve, "allocated") or [])
    if xs and alloc:
        res = list(_get(curve, "reserved") or [None] * len(xs))
        x_unit = _get(curve, "x_unit", "event_index")
        if x_unit == "time_us":
            x0 = xs[0]
            xv = [(v - x0) / 1e3 for v in xs]
            x_title = "ms since the first recorded allocator event"
        else:
            xv = xs
            x_title = "allocator event index"
        ctop = max([v for v in alloc + res if v is not None] or [1])
        cdiv, cunit = _byte_scale(ctop)
        fig2 = go.Figure()
        fig2.add_scatter(
            x=xv,
            y=[v / cdiv for v in alloc],
            name="allocated",
            mode="lines",
            line=dict(color=COLORS["allocated"], width=1.5, shape="hv"),
        )
        if any(v is not None for v in res):
            fig2.add_scatter(
                x=xv,
                y=[None if v is None else v / cdiv for v in res],
                name="reserved",
                mode="lines",
                line=dict(color=COLORS["reserved"], width=1.5, shape="hv"),
            )
        k = max(range(len(alloc)), key=lambda i: alloc[i])
        fig2.add_scatter(
            x=[xv[k]],
            y=[alloc[k] / cdiv],
            name="peak",
            mode="markers",
            marker=dict(symbol="star", size=12, color="#C62828"),
        )
        fig2.update_layout(
            height=340,
            margin=dict(l=60, r=20, t=30, b=50),
            xaxis_title=x_title,
            yaxis_title=cunit,
            hovermode="x unified",
            legend=dict(orientation="h", y=1.1, x=0),
        )
        out.append(
            (TITLES["memory_curve"], fig2, "Downsampled: each point keeps the highest allocation of its bucket.")
        )
    return out


# ---------------------------------------------------------------------------------------------
# public
# ---------------------------------------------------------------------------------------------


def _timeline_section(page: _Page, tl: "StepTimeline | None", f) -> None:
    page.add(f'<h2 id="timeline">{_e(TITLES["timeline"])}</h2>')
    if tl is None:
        if f.rank_facts:
            page.add(
                '<p class="missing">No step timeline in this report (the CLI draws one with '
                "<code>--format html</code>; the API with <code>analyze(..., timeline_step=(rank, step))</code>).</p>"
            )
        else:
            page.add('<p class="missing">No traces given: no GPU timeline.</p>')
        return
    where = (
        f"rank {tl.rank if tl.rank is not None else '?'}, step index {tl.step_index} (ProfilerStep#{tl.step_number})"
    )
    if not tl.kernels:
        why = (
            "the trace has no GPU kernels (CPU-only run)"
            if not tl.gpu_present
            else "no GPU activity was launched in this step"
        )
        page.add(
            f'<p class="missing">No GPU timeline for {_e(where)}: {_e(why)}.'
            + (" The CPU side of the step is shown instead." if (tl.phases or tl.units) else "")
            + "</p>"
        )
        if tl.phases or tl.units:
            page.figure(_timeline_figure(tl), "fig-timeline")
        return
    text = (
        f"{where}: step span {ms(tl.step_ms)}, GPU window {ms(tl.gpu_window_ms)}, compute {ms(tl.compute_ms)}, "
        f"communication {ms(tl.comm_ms)}, of which exposed {ms(tl.exposed_comm_ms)} (red; hatched over the "
        f"collective it belongs to). {tl.kernel_count} GPU activities launched in this step."
    )
    if any(u.gpu_us is not None for u in tl.units):
        text += (
            " Triangles: where each FSDP unit's GPU work starts (the first compute kernel launched after its "
            "pre-forward / pre-backward hook began); the CPU rows show the phases and the hook ranges themselves."
        )
    page.add(f'<p class="sub">{_e(text)}</p>')
    page.figure(_timeline_figure(tl), "fig-timeline")
    for n in tl.notes:
        page.add(f'<p class="note">{_e(n)}</p>')


def render(report: "Report", timeline: "StepTimeline | None" = None) -> str:
    """The report as one self-contained HTML page."""
    f = report.facts
    tl = timeline if timeline is not None else getattr(report, "timeline", None)
    page = _Page()
    page.add("<h1>fsdpdoctor report</h1>")
    inputs = ", ".join(sorted({i.path for i in f.inputs})) if f.inputs else ""
    if inputs:
        page.add(f'<p class="sub">{_e(inputs if len(inputs) < 300 else inputs[:297] + "…")}</p>')
    page.add(_headline_html(headline(f)))
    page.add(_findings_html(report.findings, f))

    if f.rank_facts:
        page.add(f'<h2 id="steps">{_e(TITLES["steps"])}</h2>')
        fig, note = _steps_figure(f)
        if note:
            page.add(f'<p class="sub">{_e(note)}</p>')
        if fig is not None:
            page.figure(fig, "fig-steps")
    waterfall_section(page, f)
    _timeline_section(page, tl, f)

    if f.rank_facts:
        page.add(f'<h2 id="compute">{_e(TITLES["compute"])}</h2>')
        fig, note = _compute_figure(f)
        page.add(f'<p class="{"sub" if fig is not None else "missing"}">{_e(note)}</p>')
        if fig is not None:
            page.figure(fig, "fig-compute")

    if f.rank_facts:
        page.add(f'<h2 id="units">{_e(TITLES["units"])}</h2>')
        fig, note = _units_figure(f)
        if fig is None:
            page.add('<p class="missing">No FSDP units found in the traces.</p>')
        elif no_collectives(f):
            page.add(
                f'<p class="missing">{_e(f"{len(f.fsdp.units)} FSDP units, no all-gathers or reduce-scatters to draw: " + no_collectives(f))}.</p>'
            )
        else:
            page.add(f'<p class="sub">{_e(note)}</p>')
            page.figure(fig, "fig-units")

    page.add(f'<h2 id="memory">{_e(TITLES["memory"])}</h2>')
    m = getattr(f, "memory", None)
    if m is None:
        page.add(
            '<p class="missing">No memory snapshot given (use <code>--memory</code>) or found beside the traces.</p>'
        )
    else:
        for i, (title, fig, note) in enumerate(_memory_figures(m)):
            page.add(f"<h3>{_e(title)}</h3>")
            if note:
                page.add(f'<p class="sub">{_e(note)}</p>')
            page.figure(fig, f"fig-memory-{i}")
        for n in _get(m, "notes", []) or []:
            page.add(f'<p class="note">{_e(n)}</p>')

    tables = all_tables(f)
    if tables:
        page.add(f'<h2 id="details">{_e(TITLES["details"])}</h2>')
        page.add("\n".join(_table_html(t) for t in tables))
    if f.notes:
        page.add(f'<h2 id="notes">{_e(TITLES["notes"])}</h2>')
        page.add("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in f.notes) + "</ul>")
    return page.html("fsdpdoctor report")
