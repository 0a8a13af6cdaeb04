"""Across ranks: load every rank (in parallel processes), then fold RankFacts into RunFacts."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import statistics
from collections import Counter
from dataclasses import dataclass, field
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import msgspec

from fsdpdoctor import __version__
from fsdpdoctor.distributed import Window
from fsdpdoctor.errors import AnalysisBug, InputError
from fsdpdoctor.ingest import remote
from fsdpdoctor.ingest.kineto import parallel_decode, progress_hook, rank_from_filename
from fsdpdoctor.facts import (
    CollectiveStats,
    CrossRankFacts,
    ExcludedInput,
    ExposedSummary,
    FsdpFacts,
    InputFacts,
    OverlapSummary,
    RankFacts,
    RankSummary,
    RunFacts,
    StepsSummary,
    TimelineSummary,
)
from fsdpdoctor.analysis.ranks.crossrank import CrossRankFold, RankPart, part_of
from fsdpdoctor.analysis.ranks.rank import analyze_rank, most_common
from fsdpdoctor.analysis.ranks.summary import cpu_span, exposed_by_phase_kind, finish, summarize_rank
from fsdpdoctor.analysis.columns import Columns
from fsdpdoctor.analysis.compute import ComputeFold
from fsdpdoctor.analysis.efficiency import EfficiencyFold
from fsdpdoctor.analysis.compile_window import fold_compile
from fsdpdoctor.analysis.loader import fold_loader
from fsdpdoctor.analysis.whatif import WhatIfFold
from fsdpdoctor.analysis.steps import PHASES


_slots = None  # in a worker process: shared per-file counters of bytes read (progress)


def _init_worker(slots) -> None:
    global _slots
    _slots = slots
    remote.forget_instances()  # a forked worker must not reuse the parent's async HTTP/cloud sessions


# Rank files beyond this many (by order) come back without their list of collectives: only the
# bounded aggregates (collective_stats, exposed ms by phase and kind, the cross-rank arrivals).
# The fold's figures stay exact over every rank; what reads single collectives (rules' unit
# detail, compare's per-unit table, the strategy's bus bandwidth) sees the first DETAIL_RANKS.
DETAIL_RANKS = 64

Result = tuple[RankFacts, RankPart]

SUBMIT_AHEAD = 4  # files queued per worker process ahead of the results


def analyze_one(path: str, idx: int, detail: bool = True) -> Result:
    """One rank file → (RankFacts, its cross-rank part); without ``detail`` the RankFacts drops
    its per-collective list (kept: the per-step exposed ms by phase and kind)."""
    rf = analyze_rank(path, idx)
    part = part_of(rf)
    if not detail:
        rf.exposed_ms_by_phase_kind = exposed_by_phase_kind(rf)
        rf.collectives_dropped = len(rf.collectives)
        rf.collectives = []
        part.where = {}
    return rf, part


def _worker(args: tuple[str, int, bool]) -> Result | InputError:
    path, idx, detail = args
    hook = None
    if _slots is not None:
        slots = _slots

        def hook(done: int, total: int) -> None:
            slots[idx] = done

    with progress_hook(hook):
        return rank_task(path, idx, detail)


def rank_task(path: str, idx: int, detail: bool = True) -> Result | InputError:
    """One rank file as a worker runs it (process pool or Dask): :func:`analyze_one`'s result,
    or the InputError saying why not, returned rather than raised (the caller decides: leave the
    rank out, or fail)."""
    try:
        return analyze_one(path, idx, detail)
    except InputError as exc:
        return exc
    except Exception as exc:
        return url_error(path, exc)


def url_error(path: str, exc: Exception) -> InputError:
    """A URL's I/O or back-end error (network, HTTP status, auth) as the InputError of that file
    (back-end errors often cannot be pickled back from a worker: aiohttp's carry the response
    headers). Anything else is a bug and raised as one, naming the file (:class:`AnalysisBug`);
    on a local file, whose read errors are InputErrors already, every other exception is one.
    Running out of memory stays what it is."""
    if isinstance(exc, MemoryError):
        raise exc
    if not remote.is_url(path) or not remote.is_backend_error(exc):
        raise AnalysisBug.of(path, exc) from exc
    return InputError(path, remote.problem(exc))


def share_strings(obj: Any, pool: dict[str, str]) -> Any:
    """``obj`` with every string in it (field values, list items, dict keys and values) replaced by
    the equal one already in ``pool`` (added when new). Each result a worker sends is unpickled
    with its own copies of the same keys and labels ("forward", "all_gather", the unit FQNs, the
    notes): with a thousand ranks that is megabytes of one string over and over."""
    if isinstance(obj, str):
        return pool.setdefault(obj, obj)
    if isinstance(obj, dict):
        items = [(share_strings(k, pool), share_strings(v, pool)) for k, v in obj.items()]
        obj.clear()
        obj.update(items)
    elif isinstance(obj, list):
        obj[:] = [share_strings(v, pool) for v in obj]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.name != "pg_config":  # shared already, one table per process group
                setattr(obj, f.name, share_strings(getattr(obj, f.name), pool))
    return obj


# The reasons a rank's detail is kept (rank_summary._mark_reasons), as keys whose largest value
# wins (ties as there); "straggler" needs every rank's arrivals and is not among them. "fsdp":
# the rank whose FSDP structure the run reports (fold's choice).
_CANDIDATE_KEYS: dict[str, Callable[[RankFacts, RankSummary], Any]] = {
    "first": lambda r, s: -r.rank,
    "slowest": lambda r, s: None if s.step_ms is None else (s.step_ms, r.rank),
    "fastest": lambda r, s: None if s.step_ms is None else (-s.step_ms, -r.rank),
    "lowest-overlap": lambda r, s: None if s.overlap_pct is None else (-s.overlap_pct, -r.rank),
    "worst-replay": lambda r, s: None if s.replay_error_pct is None else (s.replay_error_pct, r.rank),
    "fsdp": lambda r, s: (r.fsdp.version is not None, len(r.fsdp.units), -r.rank),
}


class Arrivals:
    """What the client folds and keeps of each rank as it arrives, so that its memory stays flat
    in the number of ranks: every rank's summary line (:func:`summarize_rank`); its compute,
    replay and collective figures folded into columns (:class:`ComputeFold`,
    :class:`WhatIfFold`, :class:`CollectiveFold`); the whole RankFacts of the detail ranks (those
    the workers sent with their collectives, :data:`DETAIL_RANKS`) and of the ranks that are, so
    far, the slowest, fastest, least overlapped, worst replayed, first, or hold the FSDP
    structure. With ``lean``, every other rank is cut down in place (:func:`make_lean`).
    The folds read their columns in rank order: the result does not depend on arrival order."""

    def __init__(self, lean: bool = True) -> None:
        self.allow_lean = lean
        self.summaries: dict[int, RankSummary] = {}
        self.lean: set[int] = set()
        self.best: dict[str, tuple[Any, RankFacts]] = {}
        self.compute = ComputeFold()
        self.efficiency = EfficiencyFold()
        self.whatif = WhatIfFold()
        self.collectives = CollectiveFold()

    def add(self, r: RankFacts) -> None:
        s = self.summaries[r.rank] = summarize_rank(r)
        self.compute.add(r.rank, r.compute)
        self.efficiency.add(r.rank, r.efficiency)
        self.whatif.add(r.rank, r.whatif, r.compute_ms_total)
        self.collectives.add(r.rank, r.collective_stats)
        if not self.allow_lean:
            return
        beaten: list[RankFacts] = []
        for why, key in _CANDIDATE_KEYS.items():
            k = key(r, s)
            held = self.best.get(why)
            if k is not None and (held is None or k > held[0]):
                if held is not None:
                    beaten.append(held[1])
                self.best[why] = (k, r)
        holders = {id(x) for _, x in self.best.values()}
        for x in (*beaten, r):
            if id(x) not in holders and x.exposed_ms_by_phase_kind is not None and x.rank not in self.lean:
                make_lean(x, self.summaries[x.rank])
                self.lean.add(x.rank)


class CollectiveFold:
    """Per collective kind, the means over the ranks' CollectiveStats (each rank has one per
    kind), as ranks arrive: figures in columns, read back in rank order."""

    __slots__ = ("cols", "dtypes", "codes")

    def __init__(self) -> None:
        self.cols = Columns()
        self.dtypes: dict[str, set[str]] = {}
        self.codes: dict[str, int] = {}  # role → its code in the "role" columns

    def add(self, rank: int, stats: list[CollectiveStats]) -> None:
        row: dict = {}
        for c in stats:
            k = c.kind
            row[("count", k)], row[("gpu", k)], row[("exposed", k)] = (
                c.count_per_step,
                c.gpu_ms_per_step,
                c.exposed_ms_per_step,
            )
            if c.bytes_per_step is not None:
                row[("bytes", k)] = c.bytes_per_step
            if c.mean_busbw_gbps is not None:
                row[("busbw", k)] = c.mean_busbw_gbps
            if c.group_size:
                row[("group", k)] = float(c.group_size)
            if c.role:
                row[("role", k)] = float(self.codes.setdefault(c.role, len(self.codes)))
            for role, v in c.roles.items():
                row[("roles", (k, role))] = v
            for lib, v in c.libraries.items():
                row[("libs", (k, lib))] = v
            if c.sms:
                row[("sms", k)] = float(c.sms)
            if c.cpu_comm_ms_per_step is not None:
                row[("cpu_comm", k)] = c.cpu_comm_ms_per_step
            self.dtypes.setdefault(k, set()).update(c.dtypes)
        if row:
            self.cols.add(rank, row)

    def result(self) -> list[CollectiveStats]:
        cols, out = self.cols, []
        names = {code: role for role, code in self.codes.items()}
        for k in cols.keys("count"):
            counts = cols.values(("count", k))
            n = len(counts)
            out.append(
                CollectiveStats(
                    kind=k,
                    count_per_step=_mean(counts) or 0.0,
                    bytes_per_step=_mean(cols.values(("bytes", k))),
                    gpu_ms_per_step=_mean(cols.values(("gpu", k))) or 0.0,
                    exposed_ms_per_step=_mean(cols.values(("exposed", k))) or 0.0,
                    mean_busbw_gbps=_mean(cols.values(("busbw", k))),
                    dtypes=sorted(self.dtypes.get(k, ())),
                    group_size=most_common(int(v) for v in cols.values(("group", k))),
                    role=most_common(names[int(v)] for v in cols.values(("role", k))),
                    roles={
                        role: sum(cols.filled(("roles", (kind, role)), 0.0, among=("count", k))) / n
                        for kind, role in cols.keys("roles")
                        if kind == k
                    },
                    libraries={
                        lib: sum(cols.filled(("libs", (kind, lib)), 0.0, among=("count", k))) / n
                        for kind, lib in cols.keys("libs")
                        if kind == k
                    },
                    sms=int(max(cols.values(("sms", k)))) if cols.values(("sms", k)) else None,
                    cpu_comm_ms_per_step=_mean(cols.values(("cpu_comm", k))),
                )
            )
        return out


_NO_FSDP = FsdpFacts()


def make_lean(r: RankFacts, s: RankSummary) -> None:
    """``r`` cut down, in place, to what the fold reads of a rank that is not kept whole: its one
    step the mean of its steps (``s.mean_step``: per-rank means are unchanged), no FSDP units
    (the fold reports another rank's), no compute, replay or collective figures (folded as it
    arrived, :class:`Arrivals`); its identity and scalars kept. Its summary ``s`` holds its step
    times and the rest of its line."""
    r.steps = [s.mean_step] if s.mean_step is not None else []
    r.fsdp = _NO_FSDP if r.fsdp.version is None else FsdpFacts(version=r.fsdp.version)
    r.collectives, r.collective_stats, r.compute, r.whatif, r.efficiency = [], [], None, None, None
    r.exposed_ms_by_phase_kind = s.exposed_ms_by_phase_kind  # one copy, the summary's


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _size(path: str) -> int:
    return remote.size(path)


@dataclass
class RankLoad:
    """What :func:`load_ranks` read: the ranks, sorted by id, and the ranks left out."""

    ranks: list[RankFacts]
    excluded: list[ExcludedInput] = field(default_factory=list)
    cross_rank: CrossRankFacts | None = None
    # what was folded and kept of each rank as it arrived (summaries, lean ranks, figures)
    arrived: "Arrivals | None" = None

    @property
    def expected(self) -> int:
        """M in "N of M ranks": the ranks analysed plus the ranks left out."""
        return len(self.ranks) + len(self.excluded)


def analyze_ranks(
    paths: list[Path | str], jobs: int | None = None, progress: Callable[[int, int], None] | None = None
) -> list[RankFacts]:
    """RankFacts for each file; the first unreadable file (in order) raises its InputError.
    See :func:`load_ranks` for partial runs."""
    return load_ranks(paths, jobs, progress, strict=True).ranks


def load_ranks(
    paths: list[Path | str],
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    *,
    strict: bool = False,
    scheduler: str | None = None,
    detail_ranks: int | None = DETAIL_RANKS,
) -> RankLoad:
    """RankFacts for each file, using up to ``jobs`` processes (default: one per core), or the
    Dask cluster named by ``scheduler`` (see :mod:`fsdpdoctor.distributed`).

    With at least as many files as processes, each worker process analyses whole files. With
    fewer (one big trace on a multi-core machine), files are analysed one by one here and each
    file's JSON blocks are decoded by ``jobs`` worker processes instead. Either way the result is
    the same as ``jobs=1``.

    A file that cannot be read (an :class:`InputError`: truncated, corrupt, missing) is left out
    and listed in ``excluded`` with its reason, as is every id missing from the rank ids (a gap
    below the highest id). ``strict=True`` raises the first bad file's error (in order) instead.
    When no file can be read, the first error is raised either way.

    ``progress(done, total)`` is called from this (the calling) thread in bytes of the input files
    on disk, several times a second while files are read and once as each file completes. When
    the callback has a ``ranks(done, total)`` method it is also told how many ranks are done.

    With more than ``detail_ranks`` files, the ranks after the first ``detail_ranks`` come back
    without their per-collective list (:data:`DETAIL_RANKS`; None keeps every list). Each
    rank's cross-rank part is folded as it arrives and then dropped.
    """
    items = [(str(p), i, detail_ranks is None or i < detail_ranks) for i, p in enumerate(paths)]
    cross = CrossRankFold()
    shared_pg: dict[bytes, Any] = {}  # one copy of each process-group table (each lists its ranks) and parallelism
    shared_str: dict[str, str] = {}  # one copy of each string (unpickling makes one per rank)
    arrived = Arrivals(lean=detail_ranks is not None)

    def take(res: Result | InputError) -> RankFacts | InputError:
        if isinstance(res, InputError):
            return res
        rf, part = res
        cross.add_part(part)
        if rf.pg_config:
            rf.pg_config = shared_pg.setdefault(msgspec.json.encode(rf.pg_config), rf.pg_config)
        rf.parallelism = shared_pg.setdefault(msgspec.json.encode(rf.parallelism), rf.parallelism)
        share_strings(rf, shared_str)
        arrived.add(rf)
        return rf

    if scheduler:
        from fsdpdoctor.distributed import run_on_dask

        results = run_on_dask(items, scheduler, rank_task, take, progress=progress, strict=strict, ahead=SUBMIT_AHEAD)
    else:
        results = _run_local(items, jobs, progress, strict, take)
    errors = [(k, r) for k, r in enumerate(results) if isinstance(r, InputError)]
    if errors and (strict or len(errors) == len(items)):
        raise errors[0][1]
    ranks: list[RankFacts] = [r for r in results if isinstance(r, RankFacts)]
    seen: dict[int, str] = {}
    for rf in ranks:
        if rf.rank in seen:
            raise InputError(rf.path, f"rank {rf.rank} appears twice (also in {seen[rf.rank]})")
        seen[rf.rank] = rf.path
    excluded: list[ExcludedInput] = []
    order_ids = all(r.rank_source == "order" for r in ranks)
    for k, exc in errors:
        rid = rank_from_filename(exc.path)
        if rid is None and order_ids and k not in seen:
            rid = k  # the others are numbered by order: this file held rank k
        if rid in seen:
            rid = None
        excluded.append(ExcludedInput(path=exc.path, rank=rid, reason=exc.problem))
    ids = set(seen) | {e.rank for e in excluded if e.rank is not None}
    # one rank's file given alone is a sample of the job, not a partial run: the ranks it does not
    # hold are no gaps (the note says "1 of W ranks given"); with two or more, a missing id is one
    lone = len(items) == 1 and not excluded
    for k in range(max(ids) + 1 if ids and not lone else 0):
        if k not in ids:
            excluded.append(
                ExcludedInput(path=None, rank=k, reason="no trace file for this rank id (a gap in the rank ids)")
            )
    excluded.sort(key=lambda e: (e.rank is None, e.rank if e.rank is not None else 0, e.path or ""))
    cross_rank = cross.result()
    _straggler_whole(ranks, items, cross_rank, arrived, jobs, scheduler)
    return RankLoad(sorted(ranks, key=lambda r: r.rank), excluded, cross_rank, arrived)


def _straggler_whole(
    ranks: list[RankFacts],
    items: list[tuple[str, int, bool]],
    cross_rank: CrossRankFacts,
    arrived: Arrivals,
    jobs: int | None,
    scheduler: str | None,
) -> None:
    """The straggler (the rank the others wait for) is known only once every rank has arrived:
    when it was kept lean, its file is read again, on the same engine, so that the report's
    detail holds it whole (one more file out of many; if it cannot be read now, it stays lean)."""
    if not arrived.lean or not cross_rank.ranks or cross_rank.ranks[0].rank not in arrived.lean:
        return
    rank = cross_rank.ranks[0].rank
    k = next(k for k, r in enumerate(ranks) if r.rank == rank)
    item = next(it for it in items if it[0] == ranks[k].path)

    def whole(res: Result | InputError) -> RankFacts | InputError:
        return res if isinstance(res, InputError) else res[0]

    if scheduler:
        from fsdpdoctor.distributed import run_on_dask

        got = run_on_dask([item], scheduler, rank_task, whole)
    else:
        got = _run_local([item], jobs, None, False, whole)
    if got and isinstance(got[0], RankFacts) and got[0].rank == rank:
        ranks[k] = got[0]
        arrived.lean.discard(rank)


def _run_local(
    items: list[tuple[str, int, bool]],
    jobs: int | None,
    progress: Callable[[int, int], None] | None,
    strict: bool,
    take: Callable[[Result | InputError], RankFacts | InputError],
) -> list[RankFacts | InputError]:
    want = jobs or _cores()
    if any(remote.scheme(p) == "memory" for p, _, _ in items):
        want = 1  # fsspec's memory:// filesystem lives in this process only
    # URLs are opened here, one file at a time, their blocks decoded by ``want`` processes: a
    # process pool forked from a process that has used fsspec's async (HTTP, cloud) filesystems
    # returned results it could not pickle back. Many URLs across machines: --scheduler.
    urls = any(remote.is_url(p) for p, _, _ in items)
    sizes = [_size(p) for p, _, _ in items] if progress is not None else [0] * len(items)
    total = sum(sizes)
    ranks_cb = getattr(progress, "ranks", None)
    results: list[RankFacts | InputError | None] = [None] * len(items)
    if want <= 1 or len(items) < want or urls:
        block_workers = want if want > 1 else 0
        base = 0
        for k, it in enumerate(items):
            hook = None
            if progress is not None:

                def hook(done: int, _total: int, base: int = base) -> None:
                    progress(base + done, total)

            try:
                try:
                    with progress_hook(hook), parallel_decode(block_workers):
                        results[k] = take(analyze_one(*it))
                except InputError:
                    raise
                except Exception as exc:
                    raise url_error(it[0], exc) from None
            except InputError as exc:
                results[k] = exc
                if strict:
                    break  # the first bad file (in order) is the one reported
            base += sizes[k]
            if progress is not None:
                progress(base, total)
                if ranks_cb is not None:
                    ranks_cb(k + 1, len(items))
    else:
        slots = multiprocessing.Array("q", len(items), lock=False) if progress is not None else None
        finished = [False] * len(items)
        with ProcessPoolExecutor(max_workers=want, initializer=_init_worker, initargs=(slots,)) as pool:
            # files are submitted in order, a few per process ahead of the results (not all at once:
            # a thousand queued futures and work items are memory the client need not hold)
            futures: dict = {}
            window = Window(items)

            def submit(n: int) -> set:
                new = set()
                for k, it in window.take(n):
                    f = pool.submit(_worker, it)
                    futures[f] = k
                    new.add(f)
                return new

            pending = submit(SUBMIT_AHEAD * want)
            while pending:
                done, pending = wait(
                    pending, timeout=0.1 if progress is not None else None, return_when=FIRST_COMPLETED
                )
                for f in done:
                    k = futures.pop(f)  # the future holds the result (with its cross-rank part): let it go
                    results[k] = take(f.result())
                    finished[k] = True
                    if strict and isinstance(results[k], InputError):  # later files cannot change the outcome
                        window.stop_after(k)
                        for g in list(pending):
                            if futures[g] > k and g.cancel():
                                pending.discard(g)
                pending |= submit(len(done))
                if progress is not None and slots is not None:
                    progress(sum(s if finished[k] else min(slots[k], s) for k, s in enumerate(sizes)), total)
                    if ranks_cb is not None:
                        ranks_cb(sum(finished), len(items))
    return [r for r in results if r is not None]


def _mean(xs: list[float]) -> float | None:
    return float(statistics.fmean(xs)) if xs else None


_UNSET: Any = object()


def fold(
    ranks: list[RankFacts],
    excluded: list[ExcludedInput] | None = None,
    cross_rank: CrossRankFacts | None = _UNSET,
    *,
    arrived: Arrivals | None = None,
) -> RunFacts:
    """RunFacts from per-rank facts. Per-step figures are means over ranks of per-rank means.

    ``excluded``: the ranks left out of a partial run (:attr:`RankLoad.excluded`), named in
    ``inputs_excluded`` and in a note. ``cross_rank``: as folded by :func:`load_ranks` while
    the ranks arrived (default: folded here from the ranks' collectives). ``arrived``: what
    :func:`load_ranks` folded and kept of the ranks as they arrived (:attr:`RankLoad.arrived`;
    default: folded here from ``ranks``, none made lean). A lean rank is in ``ranks`` cut down
    (:func:`make_lean`): its step figures come from its summary, the rest from the folds, and
    it is left out of ``rank_facts``."""
    rf = RunFacts(tool=f"fsdpdoctor {__version__}")
    if arrived is None:
        arrived = Arrivals(lean=False)
        for r in ranks:
            arrived.add(r)
    sums = [arrived.summaries[r.rank] for r in ranks]
    lean = arrived.lean
    rf.rank_facts = [r for r in ranks if r.rank not in lean] if lean else ranks
    if lean:
        rf.rank_detail = "auto"  # the facts hold the ranks that matter, not every rank: none can write them all
    rf.inputs = [InputFacts(r.path, r.rank, r.rank_source, r.ledger) for r in ranks]
    rf.ranks = [r.rank for r in ranks]
    ws = [r.world_size for r in ranks if r.world_size]
    rf.world_size = Counter(ws).most_common(1)[0][0] if ws else None
    rf.gpu_present = any(r.gpu_present for r in ranks)
    # steps: every step's time from the summaries; per-rank means from each rank's mean step
    all_steps = [t for s in sums for t in s.step_times_ms]
    rf.steps = StepsSummary(
        count=min((s.steps for s in sums), default=0),
        mean_ms=_mean(all_steps),
        median_ms=float(statistics.median(all_steps)) if all_steps else None,
        min_ms=min(all_steps) if all_steps else None,
        max_ms=max(all_steps) if all_steps else None,
        method=Counter(r.step_method for r in ranks).most_common(1)[0][0] if ranks else "",
        per_rank_mean_ms={str(s.rank): s.step_ms or 0.0 for s in sums},
    )
    # overlap
    per_rank = {str(r.rank): r.overlap_pct for r in ranks}
    vals = [v for v in per_rank.values() if v is not None]
    steps_per_rank = {}
    for s in sums:
        m = s.mean_step
        steps_per_rank[str(s.rank)] = 100.0 * m.overlap_ms / m.comm_ms if m is not None and m.comm_ms > 0 else None
    svals = [v for v in steps_per_rank.values() if v is not None]
    rf.overlap = OverlapSummary(
        pct=_mean(vals), per_rank=per_rank, steps_pct=_mean(svals), steps_per_rank=steps_per_rank
    )
    # exposed comm and the timeline, only for ranks with GPU activity
    gpu = [(r, s) for r, s in zip(ranks, sums) if r.gpu_present and s.mean_step is not None]
    if gpu:
        means = [s.mean_step for _, s in gpu]

        def m(attr: str) -> float:
            return _mean([getattr(x, attr) for x in means]) or 0.0

        def by_key(attr: str, keys=None) -> dict[str, float]:
            keys = keys if keys is not None else sorted({k for x in means for k in getattr(x, attr)})
            return {k: _mean([getattr(x, attr).get(k, 0.0) for x in means]) or 0.0 for k in keys}

        by_pk: dict[str, dict[str, float]] = {}
        for _, s in gpu:
            for ph, kinds in s.exposed_ms_by_phase_kind.items():
                d = by_pk.setdefault(ph, {})
                for kind, v in kinds.items():
                    d[kind] = d.get(kind, 0.0) + v / len(gpu)
        rf.exposed_comm = ExposedSummary(
            mean_ms_per_step=m("exposed_comm_ms"),
            by_phase=by_key("exposed_by_phase", PHASES),
            by_kind=by_key("exposed_by_kind"),
            by_phase_kind=by_pk,
            per_rank={str(s.rank): s.mean_step.exposed_comm_ms for _, s in gpu},
            by_role=by_key("exposed_by_role"),
        )
        busy = _mean([x.gpu_busy_ms / max(x.step_ms, 1e-9) for x in means]) or 0.0
        cpu_share = _mean([cpu_span(x) / max(x.step_ms, 1e-9) for x in means]) or 0.0
        rf.timeline = TimelineSummary(
            gpu_window_ms=m("gpu_window_ms"),
            compute_ms=m("compute_ms"),
            comm_ms=m("comm_ms"),
            exposed_comm_ms=m("exposed_comm_ms"),
            memcpy_ms=m("memcpy_ms"),
            idle_ms=m("idle_ms"),
            idle_cpu_blocked_ms=m("idle_cpu_blocked_ms"),
            outside_window_ms=m("outside_window_ms"),
            other_steps_ms=m("other_steps_ms"),
            cpu_step_ms=_mean([cpu_span(x) for x in means]) or 0.0,
            wall_ms=_mean([s.step_ms or 0.0 for _, s in gpu]) or 0.0,
            gpu_behind_ms=_mean([s.gpu_behind_ms for _, s in gpu]) or 0.0,
            backlog_ms=_mean([r.backlog_ms for r, _ in gpu]) or 0.0,
            backlog_ops=_mean([float(r.backlog_ops) for r, _ in gpu]) or 0.0,
            gpu_busy_ms=m("gpu_busy_ms"),
            clock_parts_ms=by_key("clock_parts_ms", CLOCK_PARTS) if any(x.clock_parts_ms for x in means) else {},
            bound=bound_side(busy, cpu_share),
        )
        if rf.timeline.backlog_ops:
            rf.notes.append(
                f"the GPU was still running {rf.timeline.backlog_ms:.2f} ms of work launched before the profiler's window "
                "(the warm-up steps' backlog, no launch event in the trace): it is counted in no step"
            )
    kinds_of_work = {r.workload for r in ranks if r.workload}
    rf.workload = "training" if "training" in kinds_of_work else ("inference" if kinds_of_work else None)
    rf.pipelines = sorted({p for r in ranks for p in r.pipelines})
    rf.collectives = arrived.collectives.result()
    rf.whatif = arrived.whatif.result()
    if rf.timeline is not None:
        rf.timeline.bound = bound_from_replay(rf.whatif, rf.timeline.bound)
        w = rf.whatif
        if w is not None and "cpu×0.75" in w.saving_ms and "compute×0.75" in w.saving_ms:
            rf.notes.append(
                f"{rf.timeline.bound}-bound from the replay: the step shortens {w.saving_ms['cpu×0.75']:.2f} ms with "
                f"a 25% faster CPU, {w.saving_ms['compute×0.75']:.2f} ms with 25% faster GPU kernels"
            )
    rf.compute = arrived.compute.result(rf.step_clock_ms)
    rf.efficiency = arrived.efficiency.result(
        rf.step_clock_ms, rf.compute.peak_tflops if rf.compute is not None else None
    )
    if (rf.compute is None or rf.compute.source != "shapes") and rf.gpu_present:
        rf.notes.append(
            "FLOPs and MFU not computed: no matmul or attention op with recorded shapes "
            "(profile with record_shapes=True)"
        )
    elif rf.compute is not None and rf.compute.named_ms_per_step >= 0.005 and rf.compute.mfu_pct is not None:
        rf.notes.append(
            f"MFU counts the FLOPs of the ops with recorded shapes: {rf.compute.named_ms_per_step:.2f} ms per step of "
            "GEMM and attention kernels launched by ops without shapes (custom ops such as a fused MoE, found by "
            "kernel name) have no FLOPs, so the MFU leaves their work out"
        )
    if rf.compute is not None and rf.compute.source == "shapes" and rf.compute.peak_tflops is None:
        rf.notes.append(
            f"MFU not computed: no peak known for device {rf.compute.device!r} and dtype "
            f"{rf.compute.compute_dtype} (give one with --peak-tflops)"
        )
    if cross_rank is _UNSET:
        cross = CrossRankFold()
        for r in ranks:
            cross.add(r)
        cross_rank = cross.result()
    rf.cross_rank = cross_rank
    if cross_rank is not None:
        for c in rf.collectives:
            c.transfer_ms_per_step = cross_rank.transfer_ms_per_step_by_kind.get(c.kind)
            c.pure_busbw_gbps = cross_rank.pure_busbw_gbps_by_kind.get(c.kind)
    rf.rank_summaries = finish(sums, cross_rank)
    dropped = [r for r in ranks if r.collectives_dropped]
    if dropped:
        rf.notes.append(
            f"{len(ranks)} ranks: per-collective detail kept for {len(ranks) - len(dropped)} of them; the other "
            f"{len(dropped)} contribute their per-rank aggregates (figures over all ranks stay exact; per-unit "
            "collective detail is from the detailed ranks)"
        )
    # FSDP structure: the rank whose detection says most (normally all agree)
    if ranks:
        best = max(ranks, key=lambda r: (r.fsdp.version is not None, len(r.fsdp.units), -r.rank))
        rf.fsdp = best.fsdp
        rf.parallelism = best.parallelism
        versions = {r.fsdp.version for r in ranks}
        if len(versions) > 1:
            rf.notes.append(f"ranks disagree on the FSDP version: {sorted(map(str, versions))}")
    rf.loader = fold_loader([r.loader for r in ranks if r.loader is not None])
    rf.compile_window = fold_compile([(r.rank, r.compile_window) for r in ranks if r.compile_window is not None])
    kept = [s.ops_recorded_pct for s in sums if s.ops_recorded_pct is not None]
    rf.ops_recorded_pct = min(kept) if kept else None
    sources = Counter(r.rank_source for r in ranks)
    rf.notes.append("rank ids from " + ", ".join(f"{src} ({n})" for src, n in sources.items()))
    if ranks and rf.world_size and len(ranks) < rf.world_size:
        rf.notes.append(f"{len(ranks)} of {rf.world_size} ranks given")
    if excluded:
        rf.inputs_excluded = list(excluded)
        rf.ranks_expected = len(ranks) + len(excluded)
        rf.notes.insert(0, partial_run_line(rf))
    return rf


CLOCK_PARTS = ("compute", "exposed_comm", "memcpy", "other_steps", "idle")
GPU_BOUND_BUSY = 0.9  # the GPU busy with the step's own work this share of the step time: GPU-bound
CPU_BOUND_SPAN = 0.9  # else the CPU span this share of it: CPU-bound


def bound_side(gpu_busy_share: float, cpu_span_share: float) -> str:
    """ "gpu", "cpu" or "mixed" from the shares of the step time (see :class:`TimelineSummary`)."""
    if gpu_busy_share >= GPU_BOUND_BUSY:
        return "gpu"
    return "cpu" if cpu_span_share >= CPU_BOUND_SPAN else "mixed"


def bound_from_replay(w, fallback: str) -> str:
    """ "gpu", "cpu" or "mixed" from the replay's sensitivity: how much the step shortens with the
    GPU's compute kernels × 0.75 and with the CPU's own time × 0.75 (the same speed-up for each
    side). The side whose speed-up shortens the step more binds it; "mixed" where the other
    side's shortening is at least half of it. ``fallback`` (the measured busy / span shares)
    where there is no trustworthy replay or neither speed-up moves the step by 0.5%."""
    from fsdpdoctor.config import REPLAY_MAX_ERROR_PCT
    from fsdpdoctor.analysis.whatif.fixes import SIDE_FACTOR

    if w is None or w.error_pct > REPLAY_MAX_ERROR_PCT or not w.replayed_step_ms:
        return fallback
    gpu, cpu = w.saving_ms.get(f"compute×{SIDE_FACTOR}"), w.saving_ms.get(f"cpu×{SIDE_FACTOR}")
    if gpu is None or cpu is None or max(gpu, cpu) < 0.005 * w.replayed_step_ms:
        return fallback
    if min(gpu, cpu) >= 0.5 * max(gpu, cpu):
        return "mixed"
    return "gpu" if gpu > cpu else "cpu"


def partial_run_line(rf: RunFacts) -> str:
    """ "7 of 8 ranks analysed; left out: rank 3 (traces/rank3.json.gz: truncated ...)"."""
    parts = []
    for e in rf.inputs_excluded:
        who = f"rank {e.rank}" if e.rank is not None else "a file"
        parts.append(f"{who} ({e.path + ': ' if e.path else ''}{e.reason})")
    return f"{len(rf.ranks)} of {rf.ranks_expected} ranks analysed; left out: " + "; ".join(parts)
