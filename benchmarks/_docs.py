"""Benchmarks write their tables into the manual: the text between two markers in a page."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PERFORMANCE = REPO / "docs" / "performance.md"


def replace_section(path: Path, name: str, body: str) -> None:
    """Replace the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in ``path``."""
    text = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    i, j = text.index(begin) + len(begin), text.index(end)
    path.write_text(text[:i] + "\n" + body.strip("\n") + "\n" + text[j:])
