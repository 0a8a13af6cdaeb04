"""Human formatting of numbers with units, shared by rules (evidence text) and reporters."""

from __future__ import annotations


def ms(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f} ms"


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}%"


def mib(v: float | None) -> str:
    if v is None:
        return "–"
    if v >= 2**30:
        return f"{v / 2**30:.2f} GiB"
    if v >= 2**20:
        return f"{v / 2**20:.1f} MiB"
    if v >= 2**10:
        return f"{v / 2**10:.1f} KiB"
    return f"{v:.0f} B"
