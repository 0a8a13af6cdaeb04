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

import numpy as np

from ..facts import CollectiveSkew, CrossRankFacts, RankFacts, RankWait

TOP = 10  # collectives with the largest skew kept in the facts


class _Group:
    """Running state of the collectives of one (process group, kind), indexed by occurrence."""

    def __init__(self) -> None:
        self.max = np.empty(0)
        self.argmax = np.empty(0, dtype=np.int64)
        self.min = np.empty(0)
        self.sum = np.empty(0)
        self.count = np.empty(0, dtype=np.int64)
        self.where: list[tuple[int, str, str | None]] = []  # (step, phase, unit) from the first rank that had it

    def grow(self, n: int) -> None:
        k = len(self.max)
        if n <= k:
            return
        extra = n - k
        self.max = np.concatenate([self.max, np.full(extra, -np.inf)])
        self.argmax = np.concatenate([self.argmax, np.full(extra, -1, dtype=np.int64)])
        self.min = np.concatenate([self.min, np.full(extra, np.inf)])
        self.sum = np.concatenate([self.sum, np.zeros(extra)])
        self.count = np.concatenate([self.count, np.zeros(extra, dtype=np.int64)])


class CrossRankFold:
    """Feed ranks with :meth:`add` (any order, one at a time), then read :meth:`result`."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], _Group] = defaultdict(_Group)
        self.rank_sum: dict[int, float] = {}  # Σ arrivals of the rank
        self.rank_n: dict[int, dict[tuple[str, str], int]] = {}  # collectives per group of the rank
        self.rank_steps: dict[int, int] = {}
        self.rank_step_ms: dict[int, float | None] = {}
        self.basis: set[str] = set()
        self.t0: float | None = None  # arrivals are kept relative to this (sums of epoch µs lose ns)

    def add(self, rf: RankFacts) -> None:
        per: dict[tuple[str, str], list[float]] = defaultdict(list)
        meta: dict[tuple[str, str], list[tuple[int, str, str | None]]] = defaultdict(list)
        for c in rf.collectives:
            if c.gpu_start_us is not None:
                a = c.gpu_start_us
                self.basis.add("gpu")
            else:
                a = c.cpu_ts_us
                self.basis.add("cpu")
            key = (c.pg_name or "", c.kind)
            per[key].append(a)
            meta[key].append((c.step, c.phase, c.unit))
        r = rf.rank
        total = 0.0
        if self.t0 is None and per:
            self.t0 = min(min(v) for v in per.values())
        for key, arr in per.items():
            a = np.asarray(arr, dtype=np.float64) - self.t0
            g = self.groups[key]
            g.grow(len(a))
            n = len(a)
            if len(g.where) < n:
                g.where.extend(meta[key][len(g.where) : n])
            later = (a > g.max[:n]) | ((a == g.max[:n]) & (r < g.argmax[:n]))  # ties: the lowest rank
            g.argmax[:n] = np.where(later, r, g.argmax[:n])
            g.max[:n] = np.where(later, a, g.max[:n])
            g.min[:n] = np.minimum(g.min[:n], a)
            g.sum[:n] += a
            g.count[:n] += 1
            total += float(a.sum())
        self.rank_sum[r] = total
        self.rank_n[r] = {k: len(v) for k, v in per.items()}
        self.rank_steps[r] = len(rf.steps)
        self.rank_step_ms[r] = float(np.mean([s.step_ms for s in rf.steps])) if rf.steps else None

    def result(self) -> CrossRankFacts | None:
        n_ranks = len(self.rank_sum)
        if n_ranks < 2 or not self.groups:
            return None
        prefix = {k: np.concatenate([[0.0], np.cumsum(g.max)]) for k, g in self.groups.items()}
        last_counts: dict[int, int] = defaultdict(int)
        top: list[tuple[float, int, CollectiveSkew]] = []
        by_kind: dict[str, list[float]] = defaultdict(list)  # mean wait of the others (µs), per collective
        seq = 0
        for (pg, kind), g in sorted(self.groups.items()):
            shared = g.count >= 2
            for r_last in g.argmax[shared]:
                last_counts[int(r_last)] += 1
            # mean wait of the ranks other than the last: (n·max − Σa) / (n − 1)
            waits = np.where(shared, (g.count * g.max - g.sum) / np.maximum(g.count - 1, 1), 0.0)
            skew = np.where(shared, g.max - g.min, 0.0)
            by_kind[kind].extend(waits[shared].tolist())
            for i in np.argsort(-skew, kind="stable")[:TOP]:
                if not shared[i]:
                    continue
                step, phase, unit = g.where[i]
                item = CollectiveSkew(
                    pg=pg, kind=kind, index=int(i), step=step, phase=phase, unit=unit, last_rank=int(g.argmax[i]),
                    skew_ms=float(skew[i]) / 1e3, mean_wait_ms=float(waits[i]) / 1e3, ranks=int(g.count[i]),
                )
                seq += 1
                entry = (item.skew_ms, -seq, item)
                if len(top) < TOP:
                    heapq.heappush(top, entry)
                else:
                    heapq.heappushpop(top, entry)
        ranks = []
        for r in sorted(self.rank_sum):
            wait_us = sum(float(prefix[k][n]) for k, n in self.rank_n[r].items()) - self.rank_sum[r]
            steps = max(self.rank_steps[r], 1)
            ranks.append(RankWait(rank=r, wait_ms_per_step=wait_us / 1e3 / steps, last_arrivals=last_counts.get(r, 0),
                                  step_ms=self.rank_step_ms[r]))
        # straggler first: it waits least for the others (and arrives last most often)
        ranks.sort(key=lambda w: (w.wait_ms_per_step, -w.last_arrivals, w.rank))
        basis = "gpu kernel start" if self.basis == {"gpu"} else "cpu issue" if self.basis == {"cpu"} else "gpu kernel start, else cpu issue"
        return CrossRankFacts(
            arrival=basis,
            collectives_matched=int(sum(int((g.count >= 2).sum()) for g in self.groups.values())),
            mean_wait_ms_by_kind={k: float(np.mean(v)) / 1e3 if v else 0.0 for k, v in sorted(by_kind.items())},
            ranks=ranks,
            top_skew=[e[2] for e in sorted(top, key=lambda e: (-e[0], -e[1]))],
        )
