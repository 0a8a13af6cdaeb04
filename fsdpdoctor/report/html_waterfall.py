"""HTML: the efficiency waterfall, the step as the parts that add up to it, per rank.

One waterfall chart: the run's parts (means over ranks) rising from 0 to the step time, at peak
first; with several ranks a menu switches to each rank's own (every rank's summary line holds its
parts), and a stacked bar per rank shows the spread.
"""

from __future__ import annotations

import plotly.graph_objects as go

from fsdpdoctor.report.html_page import TITLES, _e, _Page
from fsdpdoctor.report.waterfall import PART_LABEL, SHOWN_MIN_MS, waterfall_line

PART_COLORS = {
    "matmul_at_peak": "#2E7D32",
    "attention_at_peak": "#66BB6A",
    "matmul_below_peak": "#4C78A8",
    "attention_below_peak": "#A0CBE8",
    "recompute": "#B279A2",
    "other_kernels": "#F58518",
    "exposed_comm": "#E45756",
    "exposed_copies": "#79706E",
    "gpu_idle": "#BAB0AC",
    "unattributed": "#FF00FF",
}
ORDER = (
    "matmul_at_peak",
    "attention_at_peak",
    "matmul_below_peak",
    "attention_below_peak",
    "recompute",
    "other_kernels",
    "exposed_comm",
    "exposed_copies",
    "gpu_idle",
    "unattributed",  # drawn only where some rank's (or the run's) is not 0
)
MAX_MENU_RANKS = 64  # ranks a menu entry each; beyond, the slowest and fastest
MAX_BAR_RANKS = 256


def _order(*parts: dict[str, float]) -> tuple[str, ...]:
    """:data:`ORDER`, the unattributed part left out where it is 0 in all of ``parts``."""
    if any(abs(p.get("unattributed", 0.0)) >= SHOWN_MIN_MS for p in parts):
        return ORDER
    return ORDER[:-1]


def _waterfall_trace(parts: dict[str, float], name: str, visible: bool, order: tuple[str, ...]) -> go.Waterfall:
    x = [PART_LABEL[k] for k in order] + ["step"]
    y = [parts.get(k, 0.0) for k in order] + [0.0]
    return go.Waterfall(
        x=x,
        y=y,
        measure=["relative"] * len(order) + ["total"],
        name=name,
        visible=visible,
        text=[f"{v:.2f}" for v in y[:-1]] + [f"{sum(y):.2f} ms"],
        textposition="outside",
        connector=dict(line=dict(color="#999", width=1, dash="dot")),
        increasing=dict(marker=dict(color="#4C78A8")),
        totals=dict(marker=dict(color="#333333")),
        hovertemplate="%{x}: %{y:.3f} ms<extra>" + _e(name) + "</extra>",
    )


def _ranks(f) -> list[tuple[int, dict[str, float]]]:
    return [(s.rank, s.waterfall_ms) for s in sorted(f.rank_summaries, key=lambda s: s.rank) if s.waterfall_ms]


def waterfall_figure(f) -> go.Figure | None:
    e = f.efficiency
    if e is None or not e.step_ms:
        return None
    ranks = _ranks(f)
    order = _order(e.parts_ms, *(p for _, p in ranks))
    fig = go.Figure()
    fig.add_trace(_waterfall_trace(e.parts_ms, "run (mean over ranks)" if len(ranks) > 1 else "the step", True, order))
    if len(ranks) > 1:
        shown = ranks
        if len(ranks) > MAX_MENU_RANKS:
            by_step = sorted(ranks, key=lambda rp: sum(rp[1].values()))
            shown = sorted(by_step[: MAX_MENU_RANKS // 2] + by_step[-MAX_MENU_RANKS // 2 :])
        for rank, parts in shown:
            fig.add_trace(_waterfall_trace(parts, f"rank {rank}", False, order))
        n = len(fig.data)
        buttons = [
            dict(label=tr.name, method="update", args=[{"visible": [j == i for j in range(n)]}])
            for i, tr in enumerate(fig.data)
        ]
        fig.update_layout(updatemenus=[dict(buttons=buttons, direction="down", x=1.0, xanchor="right", y=1.15)])
    fig.update_layout(
        height=460,
        margin=dict(l=60, r=20, t=50, b=110),
        yaxis_title="ms per step",
        showlegend=False,
        xaxis=dict(tickangle=-30),
    )
    return fig


def spread_figure(f) -> go.Figure | None:
    """A stacked bar per rank: the same parts, to see which rank's step differs and where."""
    ranks = _ranks(f)[:MAX_BAR_RANKS]
    if len(ranks) < 2:
        return None
    fig = go.Figure()
    x = [f"rank {r}" for r, _ in ranks]
    for k in _order(*(p for _, p in ranks)):
        fig.add_bar(
            x=x,
            y=[p.get(k, 0.0) for _, p in ranks],
            name=PART_LABEL[k],
            marker_color=PART_COLORS[k],
            hovertemplate="%{x}: " + PART_LABEL[k] + " %{y:.3f} ms<extra></extra>",
        )
    fig.update_layout(
        barmode="stack",
        height=380,
        margin=dict(l=60, r=20, t=20, b=60),
        yaxis_title="ms per step",
        legend=dict(orientation="h", y=-0.2, x=0),
    )
    return fig


def waterfall_section(page: _Page, f) -> None:
    if not f.rank_facts:
        return
    page.add(f'<h2 id="waterfall">{_e(TITLES["waterfall"])}</h2>')
    fig = waterfall_figure(f)
    if fig is None:
        page.add('<p class="missing">No GPU activity in the steps: no waterfall to draw.</p>')
        return
    page.add(
        f'<p class="sub">{_e(waterfall_line(f))}. Each GPU instant counts once, in the order drawn; at-peak '
        "parts are the model FLOPs at the dense BF16 peak (their share of the step is the MFU); GPU idle is the "
        "time in the step with nothing running on the GPU. Every part is measured from its own kernels, none "
        "scaled; what they leave of the step, if anything, is drawn as unattributed.</p>"
    )
    page.figure(fig, "fig-waterfall")
    spread = spread_figure(f)
    if spread is not None:
        page.add(f'<p class="sub">The same parts for each of the {len(_ranks(f))} ranks.</p>')
        page.figure(spread, "fig-waterfall-ranks")
