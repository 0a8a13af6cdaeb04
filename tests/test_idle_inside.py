"""The GPU idle attributed to the CPU ranges around it (``efficiency.idle._inside``): the
vectorised reading of nested ranges gives, in the same key order, what the stack walk over the
ranges gives, written here with the standard library alone; ranges that overlap without
nesting, and idle added to earlier sums, included. Times are whole microseconds, so that every
sum is exact whatever its order (the reports' byte-for-byte identity covers the order)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from fsdpdoctor.analysis.efficiency.idle import _inside


def _measure(target: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in target)


def _reference(ranges, target, idle: dict, parent: dict) -> None:
    """Ranges (start, end, name) sorted by start then longest first, each with idle inside it;
    an open-range stack: a range's idle goes to its name unless a range of the same name is
    open around it, and to (name, name of the range on top) when that one is another."""
    rows = [(a, b, c, _measure(target, a, b)) for a, b, c in ranges]
    rows = sorted((r for r in rows if r[3] > 0), key=lambda r: (r[0], -r[1]))
    stack: list[tuple[float, int]] = []
    for a, b, c, us in rows:
        while stack and stack[-1][0] <= a:
            stack.pop()
        if stack and stack[-1][1] != c:
            parent[(c, stack[-1][1])] = parent.get((c, stack[-1][1]), 0.0) + us
        if all(pc != c for _, pc in stack):
            idle[c] = idle.get(c, 0.0) + us
        stack.append((b, c))


def _ranges(rng: random.Random, nested: bool) -> list[tuple[float, float, int]]:
    out: list[tuple[float, float, int]] = []

    def fill(lo: float, hi: float, depth: int) -> None:
        t = lo
        while t < hi and len(out) < 300:
            a = t + rng.uniform(0, (hi - t) * 0.2)
            b = min(hi, a + rng.uniform(0, (hi - a) * (0.7 if depth < 6 else 0.05)))
            if b <= a:
                break
            out.append((a, b, rng.randrange(5)))
            if rng.random() < 0.6:
                fill(a, b, depth + 1)
            t = b + rng.uniform(0, 5)

    fill(0.0, 1e5, 0)
    if not nested:  # a few ranges stretched past the range they start in
        for _ in range(3):
            i = rng.randrange(len(out))
            a, b, c = out[i]
            out[i] = (a, b + rng.uniform(1, 5e3), c)
    return out


def test_inside_equals_the_stack_walk():
    rng = random.Random(44)
    for trial in range(60):
        ranges = _ranges(rng, nested=trial % 3 != 0)
        ranges = [(float(round(a)), float(round(b)), c) for a, b, c in ranges]  # ties between starts and ends too
        edges = sorted(float(rng.randrange(110_000)) for _ in range(40))
        target = list(zip(edges[::2], edges[1::2]))
        rt = SimpleNamespace(
            ts=np.array([r[0] for r in ranges]),
            dur=np.array([r[1] - r[0] for r in ranges]),
            name=np.array([r[2] for r in ranges], dtype=np.int32),
        )
        # the ranges as _inside reads them (start + duration), and earlier sums to add to
        ranges = [(float(s), float(s + d), c) for s, d, c in zip(rt.ts, rt.dur, rt.name.tolist())]
        out = {"idle": {3: 7.0, 1: 1.0}, "parent": {(2, 0): 3.0}}
        want_idle, want_parent = dict(out["idle"]), dict(out["parent"])
        _reference(ranges, target, want_idle, want_parent)
        tv = (np.array([x for x, _ in target]), np.array([y for _, y in target]))
        _inside(rt, tv, np.arange(len(ranges)), out)
        assert list(out["idle"].items()) == list(want_idle.items()), trial
        assert list(out["parent"].items()) == list(want_parent.items()), trial


def test_accumulate_equals_the_dict_loop_for_small_and_large_codes():
    """Sums by key, new keys in order of first appearance, onto earlier sums: the table of
    small codes and the sort for large ones (past 2**16 pairs) both give what a dict loop gives,
    float for float (values with fractions, so the order of the additions shows)."""
    from fsdpdoctor.analysis.efficiency.idle import _accumulate

    rng = random.Random(7)
    for top in (5, 300, 70_000):
        for pairs in (False, True):
            n = 500
            a = [rng.randrange(top) for _ in range(n)]
            b = [rng.randrange(top) for _ in range(n)]
            vals = [rng.uniform(0, 1e3) for _ in range(n)]
            keys = [(x, y) for x, y in zip(a, b)] if pairs else a
            first = keys[n // 2]
            want = {first: 0.1, "other": 2.0}
            got = dict(want)
            for k, v in zip(keys, vals):
                want[k] = want.get(k, 0.0) + v
            arr = (np.array(a, dtype=np.int64) << 32 | np.array(b, dtype=np.int64)) if pairs else np.array(a, np.int64)
            _accumulate(got, arr, np.array(vals), pairs=pairs)
            assert list(got.items()) == list(want.items()), (top, pairs)
