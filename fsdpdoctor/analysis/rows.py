"""Rows of a rank's trace by name and category, and indexes of the trace the analyses share.

The analyses ask for the rows of a few names (the ``ProfilerStep#`` ranges, the FSDP hooks, the
synchronizations …) some forty times a rank. A mask over every row for each question costs a
pass over the whole table (~2 ms at 300 MB: the name lookup, the category mask, the nonzero
scan); :func:`name_rows` reads the rows of the wanted names from one index of the rows by name
code (one radix sort, built on the first question), so a question costs what its rows cost.
Results are exactly ``np.flatnonzero(rt.mask_cat(*cats) & rt.mask_names(pred))``.

Indexes are kept on the trace (:func:`trace_cache`, in its cache of masks) for as long as it
lives; a table without that cache (a test's stand-in) builds them at each call.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fsdpdoctor.ingest.kineto import RankTrace

#: past this share of the table, the rows are read from a mask over every row (one pass) rather
#: than gathered from the index and sorted
MASK_SHARE = 1 / 8


def trace_cache(rt: RankTrace, key: str, build: Callable[[], Any]) -> Any:
    """``build()``, kept on ``rt`` under ``key`` while its columns are the same arrays."""
    cache = getattr(rt, "_masks", None)
    if cache is None:
        return build()
    k = ("analysis", key, id(rt.name), id(rt.cat), id(rt.correlation), len(rt.ts))
    got = cache.get(k)
    if got is None:
        got = cache[k] = build()
    return got


def name_lut(rt: RankTrace, pred: Callable[[str], bool]) -> np.ndarray:
    """Per name code, whether ``pred`` holds for the name: ``name_lut(rt, p)[rt.name[rows]]`` is
    ``rt.mask_names(p)[rows]`` at the cost of ``rows``."""
    lut = np.zeros(len(rt.names), dtype=bool)
    lut[rt.name_codes(pred)] = True
    return lut


def _by_name(rt: RankTrace) -> tuple[np.ndarray, np.ndarray]:
    """Every row grouped by name code, rows ascending within a name, and each name's bounds."""
    n_names = len(rt.names)
    codes = rt.name.astype(np.uint16) if n_names <= 1 << 16 else rt.name  # a radix sort for 16-bit codes
    order = np.argsort(codes, kind="stable")
    if order.size < 2**31:  # half the memory while the trace lives
        order = order.astype(np.int32)
    bounds = np.zeros(n_names + 1, dtype=np.int64)
    np.cumsum(np.bincount(rt.name, minlength=n_names), out=bounds[1:])
    return order, bounds


def name_rows(rt: RankTrace, pred: Callable[[str], bool], *cats: str) -> np.ndarray:
    """Rows whose name satisfies ``pred`` and, where ``cats`` are given, whose category is one
    of them, ascending: ``np.flatnonzero(rt.mask_cat(*cats) & rt.mask_names(pred))``."""
    lut = name_lut(rt, pred)
    codes = np.flatnonzero(lut)
    cat_lut = None
    if cats:
        cat_codes = [c for c in (rt.cat_code(x) for x in cats) if c >= 0]
        if not cat_codes:
            return np.zeros(0, dtype=np.int64)
        cat_lut = np.zeros(len(rt.cats), dtype=bool)
        cat_lut[cat_codes] = True
    if codes.size == 0:
        return np.zeros(0, dtype=np.int64)
    order, bounds = trace_cache(rt, "rows by name", lambda: _by_name(rt))
    lo, hi = bounds[codes], bounds[codes + 1]
    if int((hi - lo).sum()) > MASK_SHARE * len(rt.ts):
        mask = lut.take(rt.name)
        if cats:
            mask &= rt.mask_cat(*cats)
        return np.flatnonzero(mask)
    parts = [order[a:b] for a, b in zip(lo.tolist(), hi.tolist()) if b > a]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    rows = parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts))
    if cat_lut is not None:
        rows = rows[cat_lut[rt.cat[rows]]]
    return rows.astype(np.int64)  # a copy: the index itself is never handed out
