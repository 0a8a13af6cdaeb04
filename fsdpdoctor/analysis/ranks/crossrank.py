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
timestamps, no alignment); clock offsets between hosts add to the skew.

Pure transfer time. A collective kernel spins from its rank's arrival until the last peer
arrives, then moves the data: on rank r the transfer is ``end_r − max_r a_r``. Its mean over
the ranks is ``Σ_r end_r / n − max``, folded like the waits (the sum of the ends per collective).
Only collectives that every rank of their group reached (count ≥ group size; with no group size,
every rank folded) and that every rank timed on the GPU are timed so; one whose mean end comes
before the last arrival (host clocks that disagree: they are not aligned) is left out and
counted. The pure bus bandwidth of a collective is its mean size over the ranks × the
nccl-tests bus factor / its pure transfer time.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from fsdpdoctor.facts import CollectiveSkew, CrossRankFacts, RankFacts, RankWait
from fsdpdoctor.analysis.comms import bus_factor

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
    # per collective, beside ``arrivals``: the kernel end (integer ns, NO_END without a GPU kernel),
    # the size in bytes (-1: not recorded), the group size (0: not known) and the step (-1: none)
    ends: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    sizes: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    group: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    step: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)


NO_END = np.iinfo(np.int64).min


def _ns(us: float) -> int:
    """µs → integer ns, exactly: a Unix-epoch µs timestamp (~1.7e15) times 1000 is beyond a
    float's 53 bits (it would round to 256 ns), so the whole µs are multiplied as an integer."""
    whole = math.floor(us)
    return whole * 1000 + round((us - whole) * 1000)


def part_of(rf: RankFacts) -> RankPart:
    per: dict[tuple[str, str], list[int]] = defaultdict(list)
    ends: dict[tuple[str, str], list[int]] = defaultdict(list)
    sizes: dict[tuple[str, str], list[int]] = defaultdict(list)
    group: dict[tuple[str, str], list[int]] = defaultdict(list)
    step: dict[tuple[str, str], list[int]] = defaultdict(list)
    where: dict[tuple[str, str], list[tuple[int, str, str | None]]] = defaultdict(list)
    basis = set()
    for c in rf.collectives:
        key = (c.pg_name or "", c.kind)
        if c.gpu_start_us is not None:
            a = c.gpu_start_us
            basis.add("gpu")
            ends[key].append(_ns(a) + round(c.gpu_dur_us * 1000) if c.gpu_dur_us is not None else NO_END)
        else:
            a = c.cpu_ts_us
            basis.add("cpu")
            ends[key].append(NO_END)
        per[key].append(_ns(a))  # integer ns: sums stay exact, in any order
        sizes[key].append(c.bytes if c.bytes is not None else -1)
        group[key].append(c.group_size or 0)
        step[key].append(c.step)
        where[key].append((c.step, c.phase, c.unit))

    def arrays(d: dict) -> dict:
        return {k: np.asarray(v, dtype=np.int64) for k, v in d.items()}

    return RankPart(
        rank=rf.rank,
        arrivals=arrays(per),
        where=dict(where),
        n_steps=len(rf.steps),
        step_ms=float(np.mean([s.step_ms for s in rf.steps])) if rf.steps else None,
        basis=frozenset(basis),
        ends=arrays(ends),
        sizes=arrays(sizes),
        group=arrays(group),
        step=arrays(step),
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
        self.end_sum = np.empty(0, dtype=np.int64)  # Σ kernel ends of the ranks that timed it on the GPU
        self.end_n = np.empty(0, dtype=np.int64)
        self.size_sum = np.empty(0, dtype=np.int64)  # Σ bytes of the ranks that recorded its size
        self.size_n = np.empty(0, dtype=np.int64)
        # group size, step and (step, phase, unit): from the lowest rank that had them, so the
        # result does not depend on the order the ranks arrive in
        self.group = np.empty(0, dtype=np.int64)
        self.group_rank = np.empty(0, dtype=np.int64)
        self.step = np.empty(0, dtype=np.int64)
        self.step_rank = np.empty(0, dtype=np.int64)
        self.where: list[tuple[int, str, str | None]] = []
        self.where_rank = np.empty(0, dtype=np.int64)

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
        zeros = np.zeros(extra, dtype=np.int64)
        self.count = np.concatenate([self.count, zeros])
        self.end_sum = np.concatenate([self.end_sum, zeros])
        self.end_n = np.concatenate([self.end_n, zeros])
        self.size_sum = np.concatenate([self.size_sum, zeros])
        self.size_n = np.concatenate([self.size_n, zeros])
        nobody = np.full(extra, big.max, dtype=np.int64)
        self.group = np.concatenate([self.group, zeros])
        self.group_rank = np.concatenate([self.group_rank, nobody])
        self.step = np.concatenate([self.step, np.full(extra, -2, dtype=np.int64)])
        self.step_rank = np.concatenate([self.step_rank, nobody])
        self.where.extend([(-1, "", None)] * extra)
        self.where_rank = np.concatenate([self.where_rank, nobody])


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
            w = part.where.get(key)
            if w:
                m = min(n, len(w))
                for i in np.flatnonzero(g.where_rank[:m] > r):
                    g.where[i] = w[i]
                g.where_rank[:m] = np.minimum(g.where_rank[:m], r)
            later = (a > g.max[:n]) | ((a == g.max[:n]) & (r < g.argmax[:n]))  # ties: the lowest rank
            g.argmax[:n] = np.where(later, r, g.argmax[:n])
            g.max[:n] = np.where(later, a, g.max[:n])
            g.min[:n] = np.minimum(g.min[:n], a)
            g.sum[:n] += a
            g.count[:n] += 1
            total += int(a.sum())
            e = part.ends.get(key)
            if e is not None and len(e) == n:
                timed = e != NO_END
                g.end_sum[:n] += np.where(timed, e - self.t0, 0)
                g.end_n[:n] += timed
            z = part.sizes.get(key)
            if z is not None and len(z) == n:
                g.size_sum[:n] += np.maximum(z, 0)
                g.size_n[:n] += z >= 0
            gs = part.group.get(key)
            if gs is not None and len(gs) == n:
                take = (gs != 0) & (r < g.group_rank[:n])
                g.group[:n] = np.where(take, gs, g.group[:n])
                g.group_rank[:n] = np.where(take, r, g.group_rank[:n])
            st = part.step.get(key)
            if st is not None and len(st) == n:
                take = (st != -2) & (r < g.step_rank[:n])
                g.step[:n] = np.where(take, st, g.step[:n])
                g.step_rank[:n] = np.where(take, r, g.step_rank[:n])
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
                step, phase, unit = g.where[i]
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
        transfer = self._transfer(n_ranks)
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
            **transfer,
        )

    def _transfer(self, n_ranks: int) -> dict:
        """Pure transfer time per step and pure bus bandwidth per kind (see the module doc), over
        the collectives inside a step that every rank of their group reached and timed on the GPU."""
        steps = max(Counter(self.rank_steps.values()).most_common(1)[0][0], 1) if self.rank_steps else 1
        ms: dict[str, float] = defaultdict(float)
        bws: dict[str, list[float]] = defaultdict(list)
        timed = skipped = 0
        for (_pg, kind), g in sorted(self.groups.items()):
            need = np.where(g.group > 0, g.group, n_ranks)
            ok = (g.count >= np.maximum(need, 2)) & (g.end_n == g.count) & (g.step >= 0)
            if not ok.any():
                continue
            pure_ns = g.end_sum / np.maximum(g.end_n, 1) - g.max  # mean over the ranks of end − last arrival
            skipped += int((ok & (pure_ns <= 0)).sum())
            ok &= pure_ns > 0
            timed += int(ok.sum())
            if not ok.any():
                continue
            ms[kind] += float(pure_ns[ok].sum()) / 1e6 / steps
            sized = ok & (g.size_n == g.count) & (g.size_sum > 0)
            for i in np.flatnonzero(sized):
                size = g.size_sum[i] / g.size_n[i]
                bws[kind].append(size / (pure_ns[i] * 1e-9) / 1e9 * bus_factor(kind, int(g.group[i]) or n_ranks))
        return {
            "transfer_collectives": timed,
            "transfer_clock_skipped": skipped,
            "transfer_ms_per_step_by_kind": dict(sorted(ms.items())),
            "pure_busbw_gbps_by_kind": {k: float(np.mean(v)) for k, v in sorted(bws.items())},
        }
