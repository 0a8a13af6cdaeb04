"""Across ranks, one rank at a time: collective wait skew and the straggler ranking.

The same collective is matched across ranks by (process group, kind, occurrence): the n-th
all-gather of a process group on one rank is the n-th on every other rank, because every rank
of a group issues the group's collectives in the same order. A rank *arrives* at a collective
when its collective kernel starts on the GPU (the kernel then spins until the last peer
arrives); on traces without GPU kernels (gloo), when it issues the collective on the CPU.

At collective i with arrivals a_r: the last rank is argmax a_r, and rank r waits
``max_r a_r − a_r`` for it. Everything is exact and computed in one pass over the ranks
(:class:`CrossRankFold`): the state is a few numbers per collective of one rank (max, its rank,
min, sum, count) plus a few per rank, never all ranks' collectives at once. A rank's total
wait is ``Σ_i max_i − Σ_i a_ri`` over the collectives it has, so it needs only the rank's own
arrival sum and, at the end, prefix sums of the maxima.

Arrival times of ranks on different hosts are compared on the hosts' own clocks (Kineto
timestamps); clock offsets between hosts add to the skew.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..facts import CollectiveSkew, CrossRankFacts, RankFacts, RankWait

TOP = 10  # collectives with the largest skew kept in the facts


@dataclass
class RankPart:
    """What the cross-rank fold needs from one rank: its collectives' arrival times (integer ns,
    one array per (process group, kind), in trace order) and a few per-rank numbers. A few
    numbers per collective of the rank: bounded by units × phases × kinds × steps, not by the
    trace's event count. Built on the worker (:func:`part_of`), sent back beside the RankFacts."""

    rank: int
    arrivals: dict[tuple[str, str], np.ndarray]
    where: dict[tuple[str, str], list[tuple[int, str, str | None]]]  # (step, phase, unit) of each
    n_steps: int
    step_ms: float | None
    basis: frozenset[str]


def part_of(rf: RankFacts) -> RankPart:
    per: dict[tuple[str, str], list[int]] = defaultdict(list)
    where: dict[tuple[str, str], list[tuple[int, str, str | None]]] = defaultdict(list)
    basis = set()
    for c in rf.collectives:
        if c.gpu_start_us is not None:
            a = c.gpu_start_us
            basis.add("gpu")
        else:
            a = c.cpu_ts_us
            basis.add("cpu")
        key = (c.pg_name or "", c.kind)
        per[key].append(round(a * 1000))  # integer ns: sums stay exact, in any order
        where[key].append((c.step, c.phase, c.unit))
    return RankPart(
        rank=rf.rank,
        arrivals={k: np.asarray(v, dtype=np.int64) for k, v in per.items()},
        where=dict(where),
        n_steps=len(rf.steps),
        step_ms=float(np.mean([s.step_ms for s in rf.steps])) if rf.steps else None,
        basis=frozenset(basis),
    )


class _Group:
    """Running state of the collectives of one (process group, kind), indexed by occurrence;
    times in ns relative to the fold's origin."""

    def __init__(self) -> None:
        self.max = np.empty(0, dtype=np.int64)
        self.argmax = np.empty(0, dtype=np.int64)
        self.min = np.empty(0, dtype=np.int64)
        self.sum = np.empty(0, dtype=np.int64)
        self.count = np.empty(0, dtype=np.int64)
        self.where: list[tuple[int, str, str | None]] = []  # (step, phase, unit) from the first rank that had it

    def grow(self, n: int) -> None:
        k = len(self.max)
        if n <= k:
            return
        extra = n - k
        big = np.iinfo(np.int64)
        self.max = np.concatenate([self.max, np.full(extra, big.min, dtype=np.int64)])
        self.argmax = np.concatenate([self.argmax, np.full(extra, big.max, dtype=np.int64)])
        self.min = np.concatenate([self.min, np.full(extra, big.max, dtype=np.int64)])
        self.sum = np.concatenate([self.sum, np.zeros(extra, dtype=np.int64)])
        self.count = np.concatenate([self.count, np.zeros(extra, dtype=np.int64)])


class CrossRankFold:
    """Feed ranks with :meth:`add` (RankFacts) or :meth:`add_part` (a :class:`RankPart`), in any
    order, one at a time, then read :meth:`result`. Integer arithmetic: the result does not
    depend on the order the ranks came in."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], _Group] = defaultdict(_Group)
        self.rank_sum: dict[int, int] = {}  # Σ arrivals of the rank (ns from the origin)
        self.rank_n: dict[int, dict[tuple[str, str], int]] = {}  # collectives per group of the rank
        self.rank_steps: dict[int, int] = {}
        self.rank_step_ms: dict[int, float | None] = {}
        self.basis: set[str] = set()
        self.t0: int | None = None  # origin: any arrival (differences and the results do not depend on it)

    def add(self, rf: RankFacts) -> None:
        self.add_part(part_of(rf))

    def add_part(self, part: RankPart) -> None:
        r = part.rank
        self.basis |= part.basis
        if self.t0 is None and part.arrivals:
            self.t0 = int(min(int(a.min()) for a in part.arrivals.values() if a.size))
        total = 0
        for key, arr in part.arrivals.items():
            a = arr - self.t0
            n = len(a)
            g = self.groups[key]
            g.grow(n)
            if len(g.where) < n and key in part.where:
                g.where.extend(part.where[key][len(g.where) : n])
            later = (a > g.max[:n]) | ((a == g.max[:n]) & (r < g.argmax[:n]))  # ties: the lowest rank
            g.argmax[:n] = np.where(later, r, g.argmax[:n])
            g.max[:n] = np.where(later, a, g.max[:n])
            g.min[:n] = np.minimum(g.min[:n], a)
            g.sum[:n] += a
            g.count[:n] += 1
            total += int(a.sum())
        self.rank_sum[r] = total
        self.rank_n[r] = {k: len(v) for k, v in part.arrivals.items()}
        self.rank_steps[r] = part.n_steps
        self.rank_step_ms[r] = part.step_ms

    def result(self) -> CrossRankFacts | None:
        n_ranks = len(self.rank_sum)
        if n_ranks < 2 or not self.groups:
            return None
        prefix = {k: np.concatenate([[0], np.cumsum(g.max)]) for k, g in self.groups.items()}
        last_counts: dict[int, int] = defaultdict(int)
        top: list[tuple[int, int, CollectiveSkew]] = []
        by_kind: dict[str, list[float]] = defaultdict(list)  # mean wait of the others (ns), per collective
        seq = 0
        for (pg, kind), g in sorted(self.groups.items()):
            shared = g.count >= 2
            for r_last in g.argmax[shared]:
                last_counts[int(r_last)] += 1
            # mean wait of the ranks other than the last: (n·max − Σa) / (n − 1)
            waits = np.where(shared, (g.count * g.max - g.sum) / np.maximum(g.count - 1, 1), 0.0)
            skew = np.where(shared, g.max - g.min, 0)
            by_kind[kind].extend(waits[shared].tolist())
            for i in np.argsort(-skew, kind="stable")[:TOP]:
                if not shared[i]:
                    continue
                step, phase, unit = g.where[i] if i < len(g.where) else (-1, "", None)
                item = CollectiveSkew(
                    pg=pg,
                    kind=kind,
                    index=int(i),
                    step=step,
                    phase=phase,
                    unit=unit,
                    last_rank=int(g.argmax[i]),
                    skew_ms=int(skew[i]) / 1e6,
                    mean_wait_ms=float(waits[i]) / 1e6,
                    ranks=int(g.count[i]),
                )
                seq += 1
                entry = (int(skew[i]), -seq, item)
                if len(top) < TOP:
                    heapq.heappush(top, entry)
                else:
                    heapq.heappushpop(top, entry)
        ranks = []
        for r in sorted(self.rank_sum):
            wait_ns = sum(int(prefix[k][n]) for k, n in self.rank_n[r].items()) - self.rank_sum[r]
            steps = max(self.rank_steps[r], 1)
            ranks.append(
                RankWait(
                    rank=r,
                    wait_ms_per_step=wait_ns / 1e6 / steps,
                    last_arrivals=last_counts.get(r, 0),
                    step_ms=self.rank_step_ms[r],
                )
            )
        # straggler first: it waits least for the others (and arrives last most often)
        ranks.sort(key=lambda w: (w.wait_ms_per_step, -w.last_arrivals, w.rank))
        basis = (
            "gpu kernel start"
            if self.basis == {"gpu"}
            else "cpu issue"
            if self.basis == {"cpu"}
            else "gpu kernel start, else cpu issue"
        )
        return CrossRankFacts(
            arrival=basis,
            collectives_matched=int(sum(int((g.count >= 2).sum()) for g in self.groups.values())),
            mean_wait_ms_by_kind={k: float(np.mean(v)) / 1e6 if v else 0.0 for k, v in sorted(by_kind.items())},
            ranks=ranks,
            top_skew=[e[2] for e in sorted(top, key=lambda e: (-e[0], -e[1]))],
        )
