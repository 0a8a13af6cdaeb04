"""Frameworks' dump folders, found as they lie.

torchtitan writes what it records under its ``job.dump_folder`` (0.3.0: ``--dump-folder``), one
folder per iteration:

* ``<traces>/iteration_<N>/[<leaf>/]rank<r>_trace.json[.gz]`` (``profiling.save_traces_folder``:
  ``profile_traces`` before 0.3.0, ``profiling/traces`` in 0.3.0, which writes ``.json.gz``),
  every ``profile_freq`` steps;
* memory snapshots at the same steps (``save_memory_snapshot_folder``): before 0.3.0
  ``memory_snapshot/iteration_<N>/[<leaf>/]rank<r>_memory_snapshot.pickle``, and
  ``iteration_<N>_exit`` when the run ran out of memory after step N; in 0.3.0
  ``profiling/memory_snapshot/step_<N:012d>/[<leaf>/]<r:06d>_step_<N>.pickle`` and
  ``step_<N:012d>_exit`` (torchtitan/tools/profiler.py: ``MEMORY_STEP_DIR``, ``MEMORY_FILE``);
* Flight Recorder dumps in ``comm_traces/rank_<r>`` (read by :mod:`.flight_recorder`).

The folder names are settings, so a *series* is found by what it holds: a folder (the one given,
or one or two levels inside it: 0.3.0's ``profiling/traces``) whose children are
``iteration_<N>[_exit]`` or ``step_<N>[_exit]`` folders. Trace files are the ``*.json`` /
``*.json.gz`` there, snapshots the ``*.pickle`` / ``*.pkl`` (``.gz`` too); the readers then judge
their content as for any other input. A layout is a function in :data:`LAYOUTS` from a folder to a
:class:`DumpFolder` (or None): another framework's, or another kind of artifact in torchtitan's, is
added there.

Layouts without iteration folders (Lightning's ``PyTorchProfiler``, Accelerate, plain
``tensorboard_trace_handler`` names with host and pid) need none: their files lie in one folder
and are found by content (:mod:`.discover`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fsdpdoctor.errors import InputError

_ITERATION = re.compile(r"^(?:iteration|step)_(\d+)(_exit)?$")
#: how deep below the given folder a series folder is looked for (0.3.0: ``profiling/traces``)
SERIES_DEPTH = 2
# a snapshot's rank in its file name: ``rank<r>_memory_snapshot.pickle``, 0.3.0's ``<r:06d>_step_<N>.pickle``
_SNAPSHOT_RANK = (re.compile(r"rank[_-]?(\d+)", re.I), re.compile(r"^(\d+)_step_\d+\.p(?:ic)?kl", re.I))
_TRACE_SUFFIXES = (".json", ".json.gz")
_SNAPSHOT_SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")


@dataclass
class DumpFolder:
    """What a framework's dump folder holds for one iteration."""

    root: Path
    layout: str  # "torchtitan"
    iteration: int | None  # the iteration whose traces are read (None: no traces)
    traces: list[Path] = field(default_factory=list)
    snapshots: list[Path] = field(default_factory=list)  # for the traces' iteration
    latest_snapshots: list[Path] = field(default_factory=list)  # the last snapshot iteration (an OOM's _exit too)
    latest_snapshot_iteration: str | None = None  # its folder's name: "iteration_12_exit", "step_000000000012"
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (folder, why): other iterations


def _files(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files with one of ``suffixes`` in ``folder`` and in the folders directly inside it (torchtitan's leaf folder)."""
    out: list[Path] = []
    try:
        for p in sorted(folder.iterdir()):
            if p.is_file() and p.name.endswith(suffixes):
                out.append(p)
            elif p.is_dir():
                out.extend(q for q in sorted(p.iterdir()) if q.is_file() and q.name.endswith(suffixes))
    except OSError:
        return []
    return out


def _iterations(folder: Path) -> dict[tuple[int, bool], Path]:
    try:
        return {(int(m[1]), bool(m[2])): d for d in folder.iterdir() if d.is_dir() and (m := _ITERATION.match(d.name))}
    except OSError:
        return {}


def _subfolders(root: Path, depth: int) -> list[Path]:
    """``root`` and the folders up to ``depth`` levels below it, not inside iteration folders."""
    out = [root]
    level = [root]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                nxt.extend(sorted(q for q in d.iterdir() if q.is_dir() and not _ITERATION.match(q.name)))
            except OSError:
                continue
        out.extend(nxt)
        level = nxt
    return out


def snapshot_rank(path: Path | str) -> int | None:
    """The rank in a snapshot's file name (torchtitan's names, before and in 0.3.0); None without one."""
    name = Path(str(path)).name
    for rx in _SNAPSHOT_RANK:
        if m := rx.search(name):
            return int(m.group(1))
    return None


def torchtitan(root: Path, iteration: int | None = None) -> DumpFolder | None:
    """torchtitan's dump folder (or one of its series folders) at ``root``; None when it is not one.

    The traces are the given ``iteration``'s, else the latest; the snapshots those of the same
    iteration (``iteration_<N>``, else ``iteration_<N>_exit``). ``latest_snapshots`` is the last
    snapshot iteration (``_exit`` after the plain one of the same N), for ``fsdpdoctor memory``."""
    if not root.is_dir():
        return None
    traces: dict[int, list[Path]] = {}
    snaps: dict[tuple[int, bool], list[Path]] = {}
    names: dict[tuple[int, bool], str] = {}  # the snapshot iteration folders' names
    for series in _subfolders(root, SERIES_DEPTH):
        for (n, exit_), d in sorted(_iterations(series).items()):
            if not exit_:
                traces.setdefault(n, []).extend(_files(d, _TRACE_SUFFIXES))
            found = _files(d, _SNAPSHOT_SUFFIXES)
            snaps.setdefault((n, exit_), []).extend(found)
            if found:
                names.setdefault((n, exit_), d.name)
    traces = {n: t for n, t in traces.items() if t}
    snaps = {k: s for k, s in snaps.items() if s}
    if not traces and not snaps:
        return None
    out = DumpFolder(root=root, layout="torchtitan", iteration=None)
    if traces:
        if iteration is not None and iteration not in traces:
            raise InputError(root, f"has profile traces for iterations {sorted(traces)}, not {iteration} (--iteration)")
        out.iteration = max(traces) if iteration is None else iteration
        out.traces = traces[out.iteration]
        out.snapshots = snaps.get((out.iteration, False)) or snaps.get((out.iteration, True)) or []
        for n in sorted(traces):
            if n != out.iteration:
                why = f"iteration {n}; iteration {out.iteration} analysed (--iteration N to choose)"
                out.skipped.append((str(traces[n][0].parent), why))
    if snaps:
        if iteration is not None:
            key = (iteration, False) if (iteration, False) in snaps else (iteration, True)
            if key not in snaps:
                if not traces:
                    raise InputError(
                        root,
                        f"has memory snapshots for iterations {sorted({n for n, _ in snaps})}, "
                        f"not {iteration} (--iteration)",
                    )
                key = max(snaps)
        else:
            key = max(snaps)
        out.latest_snapshots = snaps[key]
        out.latest_snapshot_iteration = names[key]
        if out.traces and key[1] and out.latest_snapshots != out.snapshots and key[0] >= out.iteration:
            out.skipped.append(
                (
                    str(out.latest_snapshots[0].parent),
                    "the memory snapshot of an out-of-memory exit after "
                    "the traces' iteration: 'fsdpdoctor memory' on the dump folder reads it",
                )
            )
    return out


#: the dump-folder layouts tried, in order
LAYOUTS: tuple[Callable[[Path, int | None], DumpFolder | None], ...] = (torchtitan,)


def dump_folder(path: Path | str, iteration: int | None = None) -> DumpFolder | None:
    """The first layout that recognises the local folder ``path``; None for anything else."""
    p = Path(path)
    if not p.is_dir():
        return None
    for layout in LAYOUTS:
        found = layout(p, iteration)
        if found is not None:
            return found
    return None


def containing_dump_folder(path: Path | str) -> DumpFolder | None:
    """The dump folder a trace file lies in, read from its own position; None elsewhere.

    A torchtitan trace lies in ``<series>/iteration_<N>/[<leaf>/]<file>``, so only a file with an
    iteration folder among its two parents is looked at, and only the series folder and the
    :data:`SERIES_DEPTH` folders above it are read: a trace elsewhere (a home or temporary folder
    with thousands of folders beside it) costs two name matches, never a scan of its
    surroundings."""
    p = Path(path)
    iteration = next((d for d in list(p.parents)[:2] if _ITERATION.match(d.name)), None)
    if iteration is None:
        return None
    me = p.resolve()
    for up in list(iteration.parents)[: SERIES_DEPTH + 1]:
        found = dump_folder(up)
        if found is not None and any(t.resolve() == me for t in found.traces):
            return found
    return None
