"""Terminal: the support ticket — diagnosis first, evidence and fix shown, the tables behind ``--details``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Callable

from rich import box
from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.rule import Rule
from rich.syntax import Syntax
from rich.table import Table as RichTable
from rich.text import Text

from fsdpdoctor.report.sections import Table, all_tables, fix_language, saving_text, ticket_headline

if TYPE_CHECKING:
    from fsdpdoctor.api import Report

SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def rich_table(t: Table, right: Callable[[int, str], bool] = lambda i, _h: i >= 2) -> RichTable:
    """The one rich table renderer (analyze, compare); ``right(index, header)`` picks the
    right-aligned columns. Cells are plain Text, so strings from a trace are never read as markup."""
    rt = RichTable(title=t.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, caption=t.note or None)
    for i, h in enumerate(t.headers):  # a header never wraps: its column is at least as wide
        rt.add_column(h, justify="right" if right(i, h) else "left", overflow="fold", min_width=len(h))
    for row in t.rows:
        rt.add_row(*[Text(x) for x in row])
    return rt


def _finding_full(fd, f, console: Console) -> None:
    """One critical or warning finding, rustc-style: header, saving, evidence, cause, fix."""
    style = SEVERITY_STYLE.get(fd.severity, "")
    console.print(Text.assemble((f"{fd.severity}[{fd.code}]", style), " ", (fd.slug, "bold"), ": ", fd.summary))
    body: list = []
    saving = saving_text(fd, f)
    if saving:
        body.append(Text.assemble(("= ", "dim"), (saving, "bold")))
    if fd.evidence:
        body.append(Text("evidence:", style="bold"))
        bullets = RichTable.grid(padding=(0, 1))  # a hanging indent: wrapped lines stay under their text
        bullets.add_column(no_wrap=True)
        bullets.add_column()
        for e in fd.evidence:
            bullets.add_row("•", Text(e))
        body.append(Padding(bullets, (0, 0, 0, 2)))
    if fd.cause:
        body.append(Text.assemble(("likely cause: ", "bold"), fd.cause))
    for flavour, code in fd.fix.items():
        body.append(Text(f"fix ({flavour}):", style="bold"))
        # a line too long for the terminal wraps: then line numbers show where each line starts
        wraps = max(map(len, code.rstrip().splitlines() or [""])) > console.width - 4
        body.append(
            Padding(
                Syntax(
                    code.rstrip(),
                    fix_language(code),
                    theme="ansi_dark",
                    background_color="default",
                    word_wrap=True,
                    line_numbers=wraps,
                ),
                (0, 0, 0, 2),
            )
        )
    console.print(Padding(Group(*body), (0, 0, 1, 2)))


def _finding_line(fd, f) -> Text:
    saving = saving_text(fd, f)
    return Text.assemble(
        (f"{fd.severity}[{fd.code}]", SEVERITY_STYLE.get(fd.severity, "")),
        " ",
        (fd.slug, "bold"),
        ": ",
        fd.summary,
        (f" ({saving})" if saving else "", "dim"),
    )


_NUMERIC = re.compile(r"^[−\-–~<]?\s?[\d.,]*\d?\s?(ms|%|MiB|GiB|GB/s|TFLOP/s|×|x)?$")


def _numeric(rows: list[list[str]], i: int) -> bool:
    return all(_NUMERIC.match(r[i].strip()) for r in rows if i < len(r))


def print_table(t: Table, console: Console) -> None:
    """A detail table, or, when it has no rows, its title and the one line saying why. Columns
    after the first two are right-aligned where they hold numbers."""
    if t.rows:  # title and note as full-width lines: a narrow table would wrap them
        console.print(Text(t.title, style="italic"))
        console.print(rich_table(Table("", t.headers, t.rows), right=lambda i, _h: i >= 2 and _numeric(t.rows, i)))
        if t.note:
            console.print(Text(t.note, style="dim"))
        console.print()
    else:
        console.print(Text.assemble((t.title, "italic"), ": ", t.note or "nothing to show"))


def render(report: "Report", console: Console, *, brief: bool = False, details: bool = False) -> None:
    """The ticket: headline, then each critical and warning finding in full, info findings one
    line each, then the detail tables (``details``) or a line naming them. ``brief``: one line per
    finding and nothing else (CI logs). Findings come in the engine's one ranking."""
    f = report.facts
    findings = report.findings
    if brief:
        for fd in findings:
            console.print(_finding_line(fd, f), soft_wrap=True)
        if not findings:
            console.print("no findings")
        return
    head = RichTable.grid(padding=(0, 2))
    head.add_column(style="bold", no_wrap=True)
    head.add_column()
    for k, v in ticket_headline(f):
        head.add_row(k, Text(v))
    console.print(Panel(head, title="fsdpdoctor", title_align="left"))
    full = [fd for fd in findings if fd.severity in ("critical", "warning")]
    rest = [fd for fd in findings if fd.severity not in ("critical", "warning")]
    if not findings:
        console.print(Text("No findings: no rule found a problem in these traces.", style="green"))
    else:
        n = len(findings)
        console.print(Rule(f"{n} finding{'s' if n != 1 else ''}, most important first", align="left", style="dim"))
    for fd in full:
        _finding_full(fd, f, console)
    for fd in rest:
        console.print(_finding_line(fd, f))
    if rest:
        console.print()
    tables = all_tables(f)
    if details:
        console.print(Rule("details", align="left", style="dim"))
        for t in tables:
            print_table(t, console)
        for n in f.notes:
            console.print(Text(f"note: {n}", style="dim"))
    elif tables:
        names = "; ".join(t.title.split(" (")[0] for t in tables)
        console.print(
            Text(f"--details adds {len(tables)} table{'s' if len(tables) != 1 else ''}: {names}.", style="dim")
        )
        if f.notes:
            console.print(Text(f"--details adds {len(f.notes)} note{'s' if len(f.notes) != 1 else ''}.", style="dim"))
