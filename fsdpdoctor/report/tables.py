"""The one table type every report section is built from (drawn by each reporter)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""
