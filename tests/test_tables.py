"""One table renderer per output format: Markdown (analyze, compare, check) and rich (terminal)."""

from __future__ import annotations

from rich.console import Console

from fsdpdoctor.report.markdown import table
from fsdpdoctor.report.sections import Table
from fsdpdoctor.report.terminal import rich_table


def test_markdown_cells_cannot_break_the_row():
    t = Table("Units", ["unit", "bytes"], [["a|b", "1\n2"], ["c\r\nd", "3"]], note="n")
    lines = table(t).splitlines()
    assert lines[:4] == ["### Units", "", "| unit | bytes |", "|---|---|"]
    assert lines[4] == "| a\\|b | 1 2 |"
    assert lines[5] == "| c  d | 3 |"
    assert lines[-1] == "_n_"


def test_markdown_without_title_or_rows():
    assert table(Table("", ["a"], [["1"]])).splitlines()[0] == "| a |"
    assert table(Table("T", ["a"], [], note="nothing measured")) == "### T\n\n_nothing measured_"


def test_rich_cells_are_text_not_markup():
    con = Console(record=True, width=80)
    con.print(rich_table(Table("T", ["name", "x", "y"], [["[bold]layers.0[/bold]", "1", "2"]])))
    assert "[bold]layers.0[/bold]" in con.export_text()
