"""The per-rank fan-out on a Dask cluster (``--scheduler``), for runs too big for one machine.

``--scheduler tcp://HOST:8786`` sends one task per rank file to an existing Dask
``distributed`` scheduler; ``--scheduler local`` / ``local:N`` starts a ``LocalCluster`` of N
worker processes (default: one per core) on 127.0.0.1 for the duration of the call. Each task
is :func:`fsdpdoctor.analysis.ranks.rank.analyze_rank` on the worker: the worker opens the file
itself (a local path it can see, or a URL through fsspec), so trace bytes never pass through
the client; what comes back is the rank's :class:`~fsdpdoctor.facts.RankFacts`, and the fold
over ranks then runs here exactly as for the local process pool, so the figures are the same.

Workers need ``fsdpdoctor`` (and the fsspec back-end of the URLs) installed; paths must be
readable from the workers (absolute paths on a shared file system, or URLs). fsspec's
``memory://`` lives in the client's process only and is refused here.

Needs the optional dependency ``dask[distributed]`` (``pip install fsdpdoctor[dask]``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fsdpdoctor.errors import InputError
from fsdpdoctor.facts import RankFacts

_LOCAL = re.compile(r"^local(?::(\d+))?$")
CONNECT_TIMEOUT_S = 30


def parse_scheduler(spec: str) -> tuple[str, int | str]:
    """``("local", n_workers)`` (0: one per core) or ``("address", "tcp://host:port")``."""
    s = spec.strip()
    if m := _LOCAL.match(s):
        n = int(m.group(1)) if m.group(1) else 0
        if m.group(1) is not None and n < 1:
            raise InputError(spec, "--scheduler local:N needs N >= 1")
        return "local", n
    if re.match(r"^(tcp|tls|inproc|ucx|ws|wss)://\S+$", s):
        return "address", s
    raise InputError(spec, "--scheduler must be tcp://HOST:PORT (an existing Dask scheduler) or local[:N]")


def _import_distributed():
    try:
        import distributed
    except ImportError:
        raise InputError("--scheduler", "needs Dask: pip install 'fsdpdoctor[dask]' (dask[distributed])") from None
    return distributed


@contextmanager
def dask_client(spec: str) -> Iterator[object]:
    """A ``distributed.Client`` for ``spec``; a LocalCluster it started is closed on exit."""
    kind, arg = parse_scheduler(spec)
    distributed = _import_distributed()
    cluster = None
    try:
        if kind == "local":
            n = int(arg) or _cores()
            cluster = distributed.LocalCluster(
                n_workers=n,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
            client = distributed.Client(cluster)
        else:
            try:
                client = distributed.Client(str(arg), timeout=CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                raise InputError(spec, f"cannot reach the Dask scheduler ({type(exc).__name__}: {exc})") from None
        try:
            yield client
        finally:
            client.close()
    finally:
        if cluster is not None:
            cluster.close()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class Window:
    """Files handed to workers in order, a few at a time (a bounded number in flight, however
    many files): ``take(n)`` gives the next ``n`` (order index, item) pairs; after
    ``stop_after(k)`` (strict mode: file ``k`` failed) no file after ``k`` is given."""

    def __init__(self, items: list) -> None:
        self._queue = iter(enumerate(items))
        self.stop = len(items)

    def take(self, n: int) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        if n <= 0:
            return out
        for k, it in self._queue:
            if k >= self.stop:  # in order: every later file is past the stop too
                break
            out.append((k, it))
            if len(out) >= n:
                break
        return out

    def stop_after(self, k: int) -> None:
        self.stop = min(self.stop, k)


def run_on_dask(
    items: list[tuple[str, int, bool]],
    spec: str,
    task: Callable[[str, int, bool], object],
    take: Callable[[object], RankFacts | InputError],
    progress: Callable[[int, int], None] | None = None,
    strict: bool = False,
    ahead: int = 4,
) -> list[RankFacts | InputError]:
    """Run ``task`` (:func:`fsdpdoctor.analysis.ranks.rank_task`) for every ``(path, order index,
    detail)`` on the cluster named by
    ``spec``; each result goes through ``take`` as it arrives (which folds and drops its
    cross-rank part) and the results come back in the order of ``items``. With ``strict``, the
    tasks of later files are cancelled once a file fails (the first bad file in order is what
    the caller reports). Files are submitted ``ahead`` per worker thread ahead of the results."""
    from fsdpdoctor.ingest import remote

    for p, _, _ in items:
        if remote.scheme(p) == "memory":
            raise InputError(p, "memory:// exists only in this process; Dask workers cannot read it (drop --scheduler)")
    distributed = _import_distributed()
    sizes = [remote.size(p) for p, _, _ in items] if progress is not None else [0] * len(items)
    total = sum(sizes)
    ranks_cb = getattr(progress, "ranks", None)
    results: list[RankFacts | InputError | None] = [None] * len(items)
    with dask_client(spec) as client:
        # files are submitted in order, a few per worker thread ahead of the results: the client
        # holds a bounded number of futures, not one per rank file
        n_ahead = max(16, ahead * sum(client.nthreads().values()))
        window = Window(items)
        inflight: dict[str, tuple[int, object]] = {}  # future key → (order index, future)

        def submit(n: int) -> list:
            new = []
            for k, (p, i, d) in window.take(n):
                f = client.submit(
                    task, p, i, d, key=f"fsdpdoctor-rank-{i}-{os.urandom(4).hex()}", pure=False, retries=0
                )
                inflight[f.key] = (k, f)
                new.append(f)
            return new

        done_bytes = 0
        n_done = 0
        pending = distributed.as_completed(submit(n_ahead))
        for fut in pending:
            k, _ = inflight.pop(fut.key)
            try:
                results[k] = take(fut.result())
            except distributed.KilledWorker as exc:  # the worker died on this file (out of memory...)
                results[k] = InputError(items[k][0], f"the Dask worker analysing it died ({exc})")
            except distributed.client.FutureCancelledError:
                continue
            n_done += 1
            done_bytes += sizes[k]
            if progress is not None:
                progress(done_bytes, total)
                if ranks_cb is not None:
                    ranks_cb(n_done, len(items))
            fut.release()  # the worker may forget it: nothing of it is kept but what take() returned
            if strict and isinstance(results[k], InputError):
                window.stop_after(k)
                later = [f for j, f in inflight.values() if j > k]
                if later:
                    client.cancel(later)
            for f in submit(1):
                pending.add(f)
    return [r for r in results if r is not None]
