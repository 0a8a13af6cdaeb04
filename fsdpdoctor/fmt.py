"""Human formatting of numbers with units, shared by rules (evidence text) and reporters."""

from __future__ import annotations

import re


def ms(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f} ms"


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}%"


def plural(n: int | float, word: str, many: str | None = None) -> str:
    """ "1 unit", "5 units", "2.5 steps"; ``many`` where the plural is not ``word`` + "s"."""
    return f"{n:g} " + (word if n == 1 else many or word + "s")


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


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+]?[0-9]+)?)\s*(?:([kmgt])i?)?b?\s*$", re.I)
_SIZE_UNITS = {None: 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """A size in bytes as people write it: ``"123"``, ``"8.6e10"``, ``"64M"``, ``"8GiB"``,
    ``"1.5G"``, ``"80GB"``. The one parser of sizes (``--max-input-bytes``, ``plan --gpu-mem``):
    units are binary whatever the spelling (80G = 80GB = 80GiB = 80 × 2^30 bytes), as GPU memory
    is counted. Raises ValueError."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(text)
    value = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower() or None]
    if value > 1 << 62:
        raise ValueError(text)
    return int(value)


def rank_list(ranks, limit: int = 12) -> str:
    """ "0, 1, 3", "1–3", "0–511, 513–1023": ranks in order, runs of three or more as ranges, at
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
            items.extend(str(r) for r in rs[i : j + 1])
        i = j + 1
    if len(items) > limit:
        return ", ".join(items[:limit]) + f", … ({len(rs)} ranks)"
    return ", ".join(items)


def ranks_text(ranks) -> str:
    """ "rank 2", "ranks 0, 1, 3", "ranks 1–3"."""
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
