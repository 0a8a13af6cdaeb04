"""Terminal: a one-screen rich summary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table as RichTable
from rich.text import Text

from ..fmt import mib
from ..engine import saving_text
from .sections import Table, all_tables, headline

if TYPE_CHECKING:
    from ..api import Report

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def rich_table(t: Table, right: Callable[[int, str], bool] = lambda i, _h: i >= 2) -> RichTable:
    """The one rich table renderer (analyze, compare); ``right(index, header)`` picks the
    right-aligned columns. Cells are plain Text, so strings from a trace are never read as markup."""
    rt = RichTable(title=t.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, caption=t.note or None)
    for i, h in enumerate(t.headers):
        rt.add_column(h, justify="right" if right(i, h) else "left", overflow="fold")
    for row in t.rows:
        rt.add_row(*[Text(x) for x in row])
    return rt


def render(report: "Report", console: Console) -> None:
    f = report.facts
    head = RichTable.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for k, v in headline(f):
        head.add_row(k, v)
    console.print(Panel(head, title="fsdpdoctor", title_align="left"))
    if report.findings:
        ft = RichTable(title="Findings (ranked by estimated saving)", title_justify="left", box=box.SIMPLE_HEAD, expand=True)
        ft.add_column("sev", no_wrap=True)
        ft.add_column("rule", no_wrap=True)
        ft.add_column("finding", ratio=1)
        ft.add_column("saving/step", justify="right", no_wrap=True)
        for fd in report.findings[:8]:
            saving = saving_text(fd).replace("/step (", "\n(") if fd.est_saving_ms else (mib(fd.est_saving_bytes) if fd.est_saving_bytes else "–")
            ft.add_row(
                Text(fd.severity, style=SEVERITY_STYLE.get(fd.severity, "")),
                fd.code,
                Text.assemble((fd.slug, "bold"), "  ", fd.summary),
                saving,
            )
        console.print(ft)
    else:
        console.print(Text("No findings.", style="green"))
    console.print(Group(*[rich_table(t) for t in all_tables(f)]))
    for n in f.notes:
        console.print(Text(f"note: {n}", style="dim"))
