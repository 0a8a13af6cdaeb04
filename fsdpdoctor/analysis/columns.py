"""Per-rank numbers kept as columns while ranks arrive, read back in rank order.

The client folds a run of a thousand ranks without holding a thousand fact objects: each rank's
figures that a run-level fold needs go into columns (8 bytes a number, in :mod:`array` buffers),
keyed by rank, and the fold reads every column in rank order, so its result does not depend on the
order in which the ranks arrived (sums of floats do depend on order). A column holds a value only
for the ranks that have one: ``values(key)`` gives those, ``filled(key, fill)`` one per rank.
"""

from __future__ import annotations

from array import array
from typing import Hashable

import numpy as np


class Columns:
    """Numbers by (column key, rank); keys are any hashable (tuples keep parts apart)."""

    __slots__ = ("_cols", "_ranks")

    def __init__(self) -> None:
        self._cols: dict[Hashable, tuple[array, array]] = {}
        self._ranks = array("q")

    def add(self, rank: int, values: dict[Hashable, float]) -> None:
        """One rank's row (at most one row per rank)."""
        self._ranks.append(rank)
        for key, v in values.items():
            col = self._cols.get(key)
            if col is None:
                col = self._cols[key] = (array("q"), array("d"))
            col[0].append(rank)
            col[1].append(v)

    def __len__(self) -> int:
        return len(self._ranks)

    def ranks(self) -> np.ndarray:
        """The ranks that have a row, ascending."""
        return np.sort(np.frombuffer(self._ranks, dtype=np.int64))

    def keys(self, head: Hashable) -> list[Hashable]:
        """The second parts of the tuple keys ``(head, x)``, sorted."""
        return sorted(k[1] for k in self._cols if isinstance(k, tuple) and len(k) == 2 and k[0] == head)

    def _sorted(self, key: Hashable) -> tuple[np.ndarray, np.ndarray]:
        col = self._cols.get(key)
        if col is None:
            return np.empty(0, dtype=np.int64), np.empty(0)
        ranks, vals = np.frombuffer(col[0], dtype=np.int64), np.frombuffer(col[1], dtype=np.float64)
        order = np.argsort(ranks, kind="stable")
        return ranks[order], vals[order]

    def values(self, key: Hashable) -> list[float]:
        """The column's values in rank order (ranks without one left out)."""
        return self._sorted(key)[1].tolist()

    def with_ranks(self, key: Hashable) -> tuple[list[int], list[float]]:
        ranks, vals = self._sorted(key)
        return ranks.tolist(), vals.tolist()

    def filled(self, key: Hashable, fill: float = 0.0, among: Hashable | None = None) -> list[float]:
        """One value per rank that has a row (or that has column ``among``), in rank order,
        ``fill`` where this column has none."""
        rows = self._sorted(among)[0] if among is not None else self.ranks()
        ranks, vals = self._sorted(key)
        out = np.full(len(rows), fill, dtype=np.float64)
        pos = np.searchsorted(rows, ranks)
        ok = (pos < len(rows)) & (rows[np.minimum(pos, len(rows) - 1)] == ranks) if len(rows) else np.zeros(0, bool)
        out[pos[ok]] = vals[ok]
        return out.tolist()
