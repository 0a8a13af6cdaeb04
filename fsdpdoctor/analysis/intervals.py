"""Interval arithmetic on numpy arrays.

An *interval set* is a pair ``(starts, ends)`` of float64 arrays, sorted, disjoint and
non-touching after :func:`merge`. Every GPU-time metric in fsdpdoctor is computed on merged sets,
never on summed durations: summing kernel durations across streams double-counts concurrent
work (DESIGN.md, "Metric definitions").
"""

from __future__ import annotations

import numpy as np

Intervals = tuple[np.ndarray, np.ndarray]

EMPTY: Intervals = (np.zeros(0), np.zeros(0))


def merge(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """Union of possibly overlapping intervals as a sorted disjoint set.

    Touching intervals (one starts exactly where another ends) merge, as in Holistic Trace
    Analysis's ``merge_kernel_intervals``.
    """
    starts = np.asarray(starts, dtype=np.float64)
    ends = np.asarray(ends, dtype=np.float64)
    if starts.size == 0:
        return EMPTY
    order = starts.argsort(kind="stable")
    return merge_sorted(starts[order], ends[order])


def merge_sorted(s: np.ndarray, e: np.ndarray) -> Intervals:
    """:func:`merge` of float64 intervals already sorted by start."""
    if s.size == 0:
        return EMPTY
    run_max = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_max[:-1]
    idx = new.nonzero()[0]
    return s[idx], np.maximum.reduceat(e, idx)


def total(iv: Intervals) -> float:
    return float((iv[1] - iv[0]).sum()) if iv[0].size else 0.0


def union(*sets: Intervals) -> Intervals:
    return merge(np.concatenate([s[0] for s in sets]), np.concatenate([s[1] for s in sets]))


def measure_below(iv: Intervals, x: np.ndarray, cum: np.ndarray | None = None) -> np.ndarray:
    """F(x) = |iv ∩ (-inf, x]| for each x (vectorised). ``iv`` must be merged. ``cum``: its
    running total, ``[0, cumsum(e - s)...]``, when the caller keeps it (:class:`Growing`)."""
    s, e = iv
    x = np.asarray(x, dtype=np.float64)
    if s.size == 0:
        return np.zeros_like(x)
    if cum is None:
        cum = running_total(iv)
    k = s.searchsorted(x, side="right")  # intervals starting at or before x
    full = cum[k]
    # the k-th interval (index k-1) may extend past x: remove that tail
    last_end = np.where(k > 0, e[np.maximum(k - 1, 0)], -np.inf)
    return full - np.where(k > 0, np.maximum(last_end - x, 0.0), 0.0)


def running_total(iv: Intervals) -> np.ndarray:
    """``[0, cumsum(e - s)...]`` of a merged set: :func:`measure_below`'s ``cum``."""
    return np.concatenate(([0.0], (iv[1] - iv[0]).cumsum()))


def intersect_len(a: Intervals, b: Intervals) -> float:
    """|a ∩ b| for merged sets."""
    if a[0].size == 0 or b[0].size == 0:
        return 0.0
    cum = running_total(b)
    return float((measure_below(b, a[1], cum) - measure_below(b, a[0], cum)).sum())


class Growing:
    """A merged set that grows by unions, for a loop that asks, for each new set, how much of it
    the union of the earlier ones covers (``seen.intersect_len(x)`` then ``seen.add(x)``).

    Gives exactly ``intersect_len(x, seen)`` and ``seen = union(seen, x)``, float for float, at a
    cost that follows the new set, not the whole union: an added set re-merges only the intervals
    that end at or after its first start (those before are left as they are, as the full merge
    would leave them), and the running total that :func:`measure_below` needs is extended from the
    first changed interval on (``cumsum`` adds in sequence, so its prefix does not change). The
    arrays grow by doubling.
    """

    def __init__(self) -> None:
        self._s = np.zeros(64)
        self._e = np.zeros(64)
        self._cum = np.zeros(65)  # _cum[j] = |first j intervals|, summed in order
        self.n = 0

    @property
    def intervals(self) -> Intervals:
        return self._s[: self.n], self._e[: self.n]

    def intersect_len(self, a: Intervals) -> float:
        """:func:`intersect_len` ``(a, self)``."""
        if a[0].size == 0 or self.n == 0:
            return 0.0
        b, cum = self.intervals, self._cum[: self.n + 1]
        return float((measure_below(b, a[1], cum) - measure_below(b, a[0], cum)).sum())

    def add(self, a: Intervals) -> None:
        """``self = union(self, a)`` for a merged ``a``."""
        if a[0].size == 0:
            return
        s, e = self.intervals
        # intervals ending before a's first start neither touch nor overlap any of a (touching
        # merges: a run continues while a start is <= the running end)
        i = int(np.searchsorted(e, a[0][0], side="left"))
        ts, te = merge(np.concatenate((s[i:], a[0])), np.concatenate((e[i:], a[1])))
        n = i + ts.size
        if n > self._s.size:
            cap = max(n, 2 * self._s.size)
            for name in ("_s", "_e"):
                new = np.zeros(cap)
                new[:i] = getattr(self, name)[:i]
                setattr(self, name, new)
            cum = np.zeros(cap + 1)
            cum[: i + 1] = self._cum[: i + 1]
            self._cum = cum
        self._s[i:n] = ts
        self._e[i:n] = te
        self._cum[i + 1 : n + 1] = np.cumsum(np.concatenate((self._cum[i : i + 1], te - ts)))[1:]
        self.n = n


def window(iv: Intervals, lo: float, hi: float) -> Intervals:
    """The part of a merged set inside [lo, hi], found by binary search (cost independent of the
    set's size outside the window)."""
    s, e = iv
    i = int(e.searchsorted(lo, side="right"))
    j = int(s.searchsorted(hi, side="left"))
    if j <= i:
        return EMPTY
    return np.maximum(s[i:j], lo), np.minimum(e[i:j], hi)


def clip(iv: Intervals, lo: float, hi: float) -> Intervals:
    """The part of ``iv`` inside [lo, hi]."""
    s, e = iv
    keep = (e > lo) & (s < hi)
    return np.maximum(s[keep], lo), np.minimum(e[keep], hi)


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """a \\ b as a merged set."""
    if a[0].size == 0 or b[0].size == 0:
        return a
    # gaps of b inside a's span are the complement; intersect a with the complement of b
    cs = np.concatenate(([-np.inf], b[1]))
    ce = np.concatenate((b[0], [np.inf]))
    return intersect(a, (cs, ce))


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """a ∩ b as a merged set (both inputs merged)."""
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
    # candidate pairs: for each a-interval, the b-intervals that can overlap it
    lo = b[1].searchsorted(a[0], side="right")
    hi = b[0].searchsorted(a[1], side="left")
    counts = np.maximum(hi - lo, 0)
    total_n = int(counts.sum())
    if total_n == 0:
        return EMPTY
    ai = np.arange(a[0].size).repeat(counts)
    offs = np.arange(total_n) - (counts.cumsum() - counts).repeat(counts)
    bi = lo.repeat(counts) + offs
    s = np.maximum(a[0][ai], b[0][bi])
    e = np.minimum(a[1][ai], b[1][bi])
    ok = e > s
    return s[ok], e[ok]


#: (labels x elementary segments) up to which :func:`attribute` marks the segments each label
#: covers in a table, rather than by sorting the (label, segment) pairs
DENSE_COVER = 1 << 22


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)`` of a float array, by a stable sort (fast on the nearly sorted times of a
    trace, where np.unique's quicksort is not)."""
    a = np.sort(x, kind="stable")
    if a.size and a[-1] != a[-1]:  # NaN sorts last: np.unique's rules for them
        return np.unique(x)
    keep = np.empty(a.size, dtype=bool)
    keep[:1] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def attribute(target: Intervals, starts: np.ndarray, ends: np.ndarray, labels: np.ndarray) -> dict:
    """Split the measure of ``target`` among labelled intervals that cover it.

    Each elementary piece of ``target`` is shared equally by the distinct labels whose
    intervals cover it; pieces covered by no label go to ``None``. The parts sum to
    ``total(target)`` exactly, which is what lets per-phase and per-kind breakdowns add up.
    """
    out: dict = {}
    if target[0].size == 0:
        return out
    labs = np.asarray(labels, dtype=object).tolist()
    uniq = list(dict.fromkeys(labs))
    bounds = _sorted_unique(np.concatenate([target[0], target[1], starts, ends]))
    seg_s, seg_e = bounds[:-1], bounds[1:]
    mid = (seg_s + seg_e) / 2
    cum = running_total(target)
    in_target = (measure_below(target, seg_e, cum) - measure_below(target, seg_s, cum)) > 0
    seg_len = np.where(in_target, seg_e - seg_s, 0.0)
    # segments each interval covers (mid in [start, end)), as (label, segment) pairs, once each
    lab_idx = {lab: j for j, lab in enumerate(uniq)}
    lab_of = np.fromiter(map(lab_idx.__getitem__, labs), dtype=np.int64, count=len(labs))
    lo = mid.searchsorted(starts, side="left")
    hi = mid.searchsorted(ends, side="left")
    cnt = np.maximum(hi - lo, 0)
    seg = lo.repeat(cnt) + (np.arange(cnt.sum()) - (cnt.cumsum() - cnt).repeat(cnt))
    n_seg = seg_s.size
    if len(uniq) * n_seg <= DENSE_COVER:  # a table of (label, segment): each pair once
        cover = np.zeros((len(uniq), n_seg), dtype=bool)
        cover[lab_of.repeat(cnt), seg] = True
        n_cover = cover.sum(axis=0)
        share = np.where(n_cover > 0, seg_len / np.maximum(n_cover, 1), 0.0)
        of_label = [share[cover[j]] for j in range(len(uniq))]  # by segment, as the pairs' order
    else:
        pairs = np.unique(lab_of.repeat(cnt) * n_seg + seg)  # sorted by label, then segment
        p_lab, p_seg = pairs // n_seg, pairs % n_seg
        n_cover = np.bincount(p_seg, minlength=n_seg)
        share = np.where(n_cover > 0, seg_len / np.maximum(n_cover, 1), 0.0)
        cuts = p_lab.searchsorted(np.arange(len(uniq) + 1), side="left")
        of_label = [share[p_seg[cuts[j] : cuts[j + 1]]] for j in range(len(uniq))]
    for lab, sh in zip(uniq, of_label):
        v = float(sh.sum())
        if v:
            out[lab] = v
    rest = float(seg_len[n_cover == 0].sum())
    if rest:
        out[None] = rest
    return out
