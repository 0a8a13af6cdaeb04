"""The HTML page's building blocks shared by the report and ``compare``'s page: one colour per
meaning, the section titles, the stylesheet, escaping, tables, and the page that inlines plotly.js
once (the page must open offline)."""

from __future__ import annotations

import html
import json
import re
from typing import Any, Iterable

import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

from fsdpdoctor import __version__
from fsdpdoctor.report.tables import Table

# One colour per meaning, shared by every chart (and the legend of each).
COLORS = {
    "compute": "#4C78A8",
    "all_gather": "#54A24B",
    "reduce_scatter": "#F58518",
    "all_reduce": "#B279A2",
    "all_to_all": "#72B7B2",
    "send_recv": "#EECA3B",
    "broadcast": "#FF9DA6",
    "barrier": "#9D755D",
    "other_comm": "#9D755D",
    "memcpy": "#79706E",
    "other": "#BAB0AC",
    "idle": "#E3E3E3",
    "other_steps": "#B8C4D6",
    "exposed": "#E45756",
    "cpu_step": "#333333",
    "step_time": "#d62728",
    "forward": "#A0CBE8",
    "backward": "#FFBE7D",
    "optimizer": "#D4A6C8",
    "other_phase": "#EEEEEE",
    "allocated": "#3D5A80",
    "reserved": "#E45756",
}
MEMORY_COLORS = {
    "parameters": "#4C78A8",
    "parameters_sharded": "#4C78A8",
    "parameters_unsharded": "#A0CBE8",
    "gradients": "#F58518",
    "optimizer_state": "#B279A2",
    "activations": "#54A24B",
    "temporary": "#8CD17D",
    "allgather_buffers": "#72B7B2",
    "reduce_scatter_buffers": "#FFBE7D",
    "other": "#BAB0AC",
}
SEVERITY_COLORS = {"critical": "#C62828", "warning": "#E08A00", "info": "#1565C0"}

#: Section and chart titles (tests and users look for these).
TITLES = {
    "findings": "Findings",
    "steps": "Where each step's GPU time goes, per rank",
    "timeline": "GPU timeline of one step",
    "units": "FSDP units: all-gather / reduce-scatter bytes and exposed time",
    "memory": "Memory",
    "memory_stack": "Memory at the peak by category",
    "memory_curve": "Allocated and reserved memory over time",
    "compute": "Compute: achieved TFLOP/s by engine against the peak, and MFU per step",
    "details": "Details",
    "notes": "Notes",
    "compare": "Step-time change from before to after",
    "waterfall": "Where the step goes against the ideal",
}

PLOT_CONFIG = {"displaylogo": False, "responsive": True, "scrollZoom": False}
MAX_UNIT_LINES = 400  # vertical unit-boundary lines on the timeline (shapes are slow beyond that)

CSS = """
:root { --fg:#1f2328; --muted:#59636e; --line:#d1d9e0; --bg:#ffffff; --code:#f6f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: var(--fg);
       background: var(--bg); margin: 0; }
main { max-width: 1360px; margin: 0 auto; padding: 24px 28px 64px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 20px; margin: 36px 0 8px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 16px; margin: 18px 0 6px; }
.sub { color: var(--muted); margin: 0 0 16px; }
table { border-collapse: collapse; margin: 6px 0 14px; }
th, td { padding: 4px 10px; border-bottom: 1px solid var(--line); text-align: right; vertical-align: top; }
th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) { text-align: left; }
th { background: #f6f8fa; font-weight: 600; }
th.text, td.text { text-align: left; }
table.headline th { background: none; text-align: left; padding-right: 18px; white-space: nowrap; }
table.headline td { text-align: left; }
.finding { border: 1px solid var(--line); border-left: 6px solid var(--sev); border-radius: 6px;
           padding: 10px 16px; margin: 12px 0; }
.finding h3 { margin: 2px 0 6px; }
.sev { display: inline-block; color: #fff; background: var(--sev); border-radius: 4px; padding: 0 7px;
       font-size: 12px; font-weight: 600; text-transform: uppercase; vertical-align: 2px; }
.saving { color: var(--muted); font-weight: normal; }
.finding h4 { margin: 10px 0 2px; font-size: 13px; }
pre { background: var(--code); border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px;
      overflow-x: auto; font: 12.5px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
code { font: 12.5px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.note { color: var(--muted); }
.missing { background: #fff8e1; border: 1px solid #f0d48a; border-radius: 6px; padding: 8px 12px; }
.chart { width: 100%; }
.ok { color: #2e7d32; font-weight: 600; }
footer { color: var(--muted); margin-top: 40px; font-size: 12px; }
"""


def _script_safe(js: str) -> str:
    """JSON that cannot close or confuse the <script> element it is written into: ``<``, ``>``
    and ``&`` only occur inside JSON strings, where their \\u escapes mean the same."""
    return (
        js.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """Attribute or key access, so dataclasses and their dict forms (saved JSON) both work."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _byte_scale(max_bytes: float) -> tuple[float, str]:
    for div, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= div:
            return float(div), unit
    return 1.0, "B"


def _label(kind: str) -> str:
    return kind.replace("_", "-")


COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv", "broadcast", "barrier")


def _comm_color(kind: str | None) -> str:
    return COLORS[kind] if kind in COMM_KINDS else COLORS["other_comm"]


class _Page:
    """Collects body HTML and figures; plotly.js goes into the head once, if any figure is drawn."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.figures = 0

    def add(self, text: str) -> None:
        self.parts.append(text)

    def figure(self, fig: go.Figure, div_id: str) -> None:
        """The figure as a div and a script; the JSON is made safe to sit inside <script> here
        (not every plotly version escapes ``</script>`` in trace-derived strings)."""
        self.figures += 1
        fig.update_layout(template="plotly_white", font=dict(size=12))
        data = _script_safe(pio.to_json(fig, validate=False, pretty=False))
        config = _script_safe(json.dumps(PLOT_CONFIG))
        height = int(fig.layout.height or 450)
        self.parts.append(
            f'<div class="chart"><div id="{_e(div_id)}" class="plotly-graph-div" style="height:{height}px; width:100%;">'
            f'</div>\n<script type="text/javascript">\n(function () {{ var fig = {data};\n'
            f"Plotly.newPlot({json.dumps(div_id)}, fig.data, fig.layout, {config}); }})();\n</script></div>"
        )

    def html(self, title: str) -> str:
        head = [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f'<meta name="generator" content="fsdpdoctor {_e(__version__)}">',
            f"<title>{_e(title)}</title>",
            f"<style>{CSS}</style>",
        ]
        if self.figures:
            # plotly.js, inlined once: the page must open offline (no CDN, no network)
            head.append('<script type="text/javascript">window.PlotlyConfig = {MathJaxConfig: "local"};</script>')
            head.append(f'<script type="text/javascript">{get_plotlyjs()}</script>')
        head.append("</head>")
        foot = f"<footer>fsdpdoctor {_e(__version__)} · charts: drag to zoom, double-click to reset</footer>"
        return "\n".join(head + ["<body>", "<main>", *self.parts, foot, "</main>", "</body>", "</html>", ""])


_NUMERIC = re.compile(r"^\s*([+\-−–]|\d|\.\d|$)")


def _table_html(t: Table) -> str:
    # the first two columns are labels; after them a column is numbers (right-aligned) unless
    # some cell in it is text
    text_col = [
        i < 2 or any(not _NUMERIC.match(str(r[i])) for r in t.rows if i < len(r)) for i in range(len(t.headers))
    ]

    def cls(i: int) -> str:
        return ' class="text"' if i >= 2 and i < len(text_col) and text_col[i] else ""

    if not t.rows:  # nothing to show: the title and the one line saying why
        return "\n".join(
            ([f"<h3>{_e(t.title)}</h3>"] if t.title else [])
            + [f'<p class="missing">{_e(t.note or "nothing to show")}</p>']
        )
    out = ([f"<h3>{_e(t.title)}</h3>"] if t.title else []) + ["<table>", "<thead><tr>"]
    out += [f"<th{cls(i)}>{_e(h)}</th>" for i, h in enumerate(t.headers)]
    out.append("</tr></thead><tbody>")
    for row in t.rows:
        out.append("<tr>" + "".join(f"<td{cls(i)}>{_e(c)}</td>" for i, c in enumerate(row)) + "</tr>")
    out.append("</tbody></table>")
    if t.note:
        out.append(f'<p class="note">{_e(t.note)}</p>')
    return "\n".join(out)


def _headline_html(pairs: Iterable[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in pairs)
    return f'<table class="headline">{rows}</table>'
