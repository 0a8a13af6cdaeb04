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


def rank_list(ranks, limit: int = 12) -> str:
    """"0, 1, 3", "1–3", "0–511, 513–1023": ranks in order, runs of three or more as ranges, at
    most ``limit`` items before "… (N ranks)"."""
    rs = sorted(set(ranks))
    items: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            items.append(f"{rs[i]}–{rs[j]}")
        else:
            items.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    if len(items) > limit:
        return ", ".join(items[:limit]) + f", … ({len(rs)} ranks)"
    return ", ".join(items)


def ranks_text(ranks) -> str:
    """"rank 2", "ranks 0, 1, 3", "ranks 1–3"."""
    rs = sorted(set(ranks))
    return ("rank " if len(rs) == 1 else "ranks ") + rank_list(rs)


def seconds(v: float | None) -> str:
    if v is None:
        return "–"
    if abs(v) >= 100:
        return f"{v:.0f} s"
    if abs(v) >= 1:
        return f"{v:.1f} s"
    return f"{v * 1000:.0f} ms"
