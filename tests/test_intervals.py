"""Interval arithmetic against a brute-force reference on a fine time grid."""

import numpy as np
import pytest

from fsdpdoctor.analysis import intervals as iv


def _grid(starts, ends, res=1000):
    """Boolean occupancy on a grid of 1/res µs over [0, 100)."""
    g = np.zeros(100 * res, dtype=bool)
    for s, e in zip(starts, ends):
        g[int(round(s * res)) : int(round(e * res))] = True
    return g


def _random_set(rng, n):
    s = np.round(rng.uniform(0, 90, n), 3)
    e = s + np.round(rng.uniform(0, 10, n), 3)
    return s, e


@pytest.mark.parametrize("seed", range(20))
def test_union_intersection_difference_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    a_s, a_e = _random_set(rng, rng.integers(0, 30))
    b_s, b_e = _random_set(rng, rng.integers(0, 30))
    a = iv.merge(a_s, a_e)
    b = iv.merge(b_s, b_e)
    ga, gb = _grid(a_s, a_e), _grid(b_s, b_e)
    res = 1000
    assert iv.total(a) == pytest.approx(ga.sum() / res, abs=1e-6)
    assert iv.intersect_len(a, b) == pytest.approx((ga & gb).sum() / res, abs=1e-6)
    assert iv.total(iv.intersect(a, b)) == pytest.approx((ga & gb).sum() / res, abs=1e-6)
    assert iv.total(iv.subtract(a, b)) == pytest.approx((ga & ~gb).sum() / res, abs=1e-6)
    assert iv.total(iv.union(a, b)) == pytest.approx((ga | gb).sum() / res, abs=1e-6)
    # merged output is sorted and disjoint
    s, e = a
    assert np.all(s[1:] > e[:-1])


def test_merge_joins_touching_intervals_like_hta():
    s, e = iv.merge(np.array([0.0, 5.0, 2.0]), np.array([5.0, 7.0, 3.0]))
    assert s.tolist() == [0.0] and e.tolist() == [7.0]


def test_attribute_splits_shared_time_equally_and_sums_to_total():
    target = iv.merge(np.array([0.0]), np.array([10.0]))
    starts = np.array([0.0, 4.0])
    ends = np.array([6.0, 8.0])
    parts = iv.attribute(target, starts, ends, np.array(["ag", "rs"], dtype=object))
    # [0,4) ag alone, [4,6) shared, [6,8) rs alone, [8,10) nobody
    assert parts["ag"] == pytest.approx(4 + 1)
    assert parts["rs"] == pytest.approx(1 + 2)
    assert parts[None] == pytest.approx(2)
    assert sum(parts.values()) == pytest.approx(iv.total(target))


def test_clip_and_empty_sets():
    a = iv.merge(np.array([0.0, 10.0]), np.array([5.0, 20.0]))
    c = iv.clip(a, 3.0, 12.0)
    assert iv.total(c) == pytest.approx(2.0 + 2.0)
    assert iv.total(iv.EMPTY) == 0.0
    assert iv.intersect_len(a, iv.EMPTY) == 0.0
    assert iv.total(iv.subtract(iv.EMPTY, a)) == 0.0


def test_window_is_the_intersection_with_the_window():
    rng = np.random.default_rng(7)
    for _ in range(50):
        s = np.sort(rng.uniform(0, 100, 30))
        merged = iv.merge(s, s + rng.uniform(0, 5, 30))
        lo, hi = sorted(rng.uniform(-10, 110, 2))
        got = iv.window(merged, lo, hi)
        # brute force on a 0.01 grid: covered by the set and inside [lo, hi]
        x = np.arange(-10, 110, 0.01) + 0.005
        inside = np.zeros(x.size, dtype=bool)
        for a, b in zip(*merged):
            inside |= (x >= a) & (x < b)
        want = 0.01 * np.count_nonzero(inside & (x >= lo) & (x < hi))
        assert iv.total(got) == pytest.approx(want, abs=0.03)
        assert np.all(got[0] >= lo) and np.all(got[1] <= hi) and np.all(got[1] > got[0])


def test_growing_union_is_the_full_union_float_for_float():
    """iv.Growing (the per-step loop's union of earlier steps) gives exactly what re-merging the
    whole union each time gives: the same intervals and the same covered length, bit for bit."""
    rng = np.random.default_rng(7)
    for trial in range(60):
        seen, grow, t = iv.EMPTY, iv.Growing(), 0.0
        for _ in range(int(rng.integers(1, 40))):
            n = int(rng.integers(0, 25))
            s = t + rng.random(n) * 100 - 30  # overlapping the earlier sets, reaching back before them
            if trial % 2:
                s = np.round(s, 1)  # ties and touching ends
            a = iv.merge(s, s + rng.random(n) * 20)
            assert grow.intersect_len(a) == iv.intersect_len(a, seen)
            seen = iv.union(seen, a)
            grow.add(a)
            assert np.array_equal(grow.intervals[0], seen[0]) and np.array_equal(grow.intervals[1], seen[1])
            t += rng.random() * 60


@pytest.mark.parametrize("dense", [True, False])
def test_attribute_matches_a_grid_reference_with_repeated_labels(dense, monkeypatch):
    """Each grid cell of the target goes in equal shares to the distinct labels covering it
    (a label's overlapping intervals count once), the rest to None: the same whether the
    (label, segment) pairs are marked in a table or sorted (DENSE_COVER). Whole microseconds,
    so that every sum is exact."""
    monkeypatch.setattr(iv, "DENSE_COVER", 1 << 22 if dense else 0)
    rng = np.random.default_rng(11)
    for _ in range(20):
        ts, te = iv.merge(*(np.floor(x) for x in _random_set(rng, 6)))
        s, e = (np.floor(x) for x in _random_set(rng, 12))
        labels = np.array([["a", "b", "c"][i % 3] for i in range(12)], dtype=object)
        got = iv.attribute((ts, te), s, e, labels)
        tgt = _grid(ts, te)
        cover = {lab: _grid(s[labels == lab], e[labels == lab]) for lab in "abc"}
        n = sum(c.astype(int) for c in cover.values())
        want = {lab: float(np.sum(np.where(tgt & c, 1.0 / np.maximum(n, 1), 0.0))) / 1000 for lab, c in cover.items()}
        want[None] = float(np.sum(tgt & (n == 0))) / 1000
        for lab, v in want.items():
            assert got.get(lab, 0.0) == pytest.approx(v, abs=1e-6), (lab, got, want)
        assert sum(got.values()) == pytest.approx(iv.total((ts, te)), rel=1e-12)
