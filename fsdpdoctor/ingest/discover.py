"""Turn the user's PATH arguments (files, directories, globs) into an ordered list of trace files."""

from __future__ import annotations

import glob
import os
import re
import stat
from pathlib import Path

from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest import flight_recorder as fr
from fsdpdoctor.ingest import remote
from fsdpdoctor.ingest.layouts import dump_folder
from fsdpdoctor.ingest.sidecar import SIDECAR_NAME

TRACE_PATTERNS = ("*.json", "*.json.gz")


def _is_trace_name(p: Path) -> bool:
    return p.name.endswith((".json", ".json.gz"))


#: How much of a file's (decompressed) start is read to tell a Kineto trace from other JSON.
SNIFF_BYTES = 1 << 20
_CYCLE = re.compile(r"\.cycle(\d+)\.json(?:\.gz)?$")  # fsdpdoctor.capture(repeat > 1): rank{R}.cycle{K}.json.gz


def looks_like_trace(p: Path | str) -> bool:
    """Whether a JSON file beside the traces is one of them.

    Decided by content, whatever the file's size, from at most its first ``SNIFF_BYTES``
    (decompressed; never the whole of a large file). Not a trace: a document that is not an
    object (a memory-timeline export is a list), or an object without a trace's top-level keys
    (``traceEvents``, ``schemaVersion``) in that head: a training config, a generator's
    ``truth.json`` of any size (profilers write ``schemaVersion`` and the small metadata first).
    An unreadable, empty or truncated file counts as a trace, so its reader names the problem."""
    from fsdpdoctor.ingest._io import open_input

    try:
        with open_input(p, "trace file") as st:
            head = st.read(SNIFF_BYTES)
    except (InputError, OSError):
        return True
    start = head.lstrip()[:1]
    if not start:
        return True
    if start != b"{":
        return False
    return b'"traceEvents"' in head or b'"schemaVersion"' in head


def _traces_among(
    found: list,
    cycle: int | None,
    skipped: list[tuple[str, str]],
    dumps: list | None = None,
    memory: list | None = None,
) -> list:
    """The traces among the files a directory or pattern expanded to, of one capture cycle (with
    ``dumps``: a Flight Recorder dump in JSON form goes there instead of into ``skipped``; with
    ``memory``: where no trace is among them, a profiler memory timeline, a JSON list, goes there)."""
    kept: list = []
    timelines: list[Path] = []
    for q in found:
        if Path(str(q)).name == SIDECAR_NAME:  # read as the run's sidecar, not a trace
            continue
        if looks_like_trace(q):
            kept.append(q)
        elif dumps is not None and not remote.is_url(q) and fr.is_dump(Path(q)):
            dumps.append(Path(q))
        elif memory is not None and not remote.is_url(q) and memory_kind(Path(q)) == "timeline":
            timelines.append(Path(q))
        else:
            skipped.append((str(q), f"not a profiler trace (no traceEvents in its first {SNIFF_BYTES >> 20} MiB)"))
    if memory is not None and not kept:  # memory timelines alone: the memory report reads them
        memory.extend(timelines)
    else:  # beside traces a JSON list is listed, not read (a snapshot beside them is: snapshots_beside)
        skipped.extend((str(q), "a memory timeline beside the traces: name it to read it") for q in timelines)
    return _pick_cycle(kept, cycle, skipped) if kept else kept


def _direct_dump(p: Path) -> bool:
    """A file named directly that is not JSON trace-like: a Flight Recorder dump (or any pickle,
    whose reader then says what it is)."""
    head = fr._head(p)
    return head[:2] in _PICKLE_MAGIC or fr.sniff(head) is not None


def memory_kind(p: Path) -> str | None:
    """What a file is by its content (its first, gunzipped bytes), for the memory readers:
    "snapshot" for a pickle that is not a Flight Recorder dump (``_dump_snapshot``'s dict with
    ``segments`` / ``device_traces``, or the bare segment list of ``torch.cuda.memory_snapshot()``:
    any other pickle too, whose reader then names what it lacks); "timeline" for JSON whose
    top level is a list (``export_memory_timeline``'s rows or its ``[times, sizes]`` form); None
    for anything else (a trace, a dump, other JSON)."""
    head = fr._head(p)
    if fr.sniff(head) is not None:
        return None
    if head[:2] in _PICKLE_MAGIC:
        return "snapshot"
    return "timeline" if head.lstrip()[:1] == b"[" else None


def cycle_of(p: Path | str) -> int:
    """The capture cycle a trace file belongs to (``rank3.cycle2.json.gz`` → 2; no suffix → 0)."""
    m = _CYCLE.search(Path(str(p)).name)
    return int(m.group(1)) if m else 0


def _pick_cycle(found: list[Path], cycle: int | None, skipped: list[tuple[str, str]]) -> list[Path]:
    cycles = sorted({cycle_of(q) for q in found})
    if len(cycles) < 2 and cycle is None:
        return found
    want = cycles[-1] if cycle is None else cycle
    if want not in cycles:
        raise InputError(found[0].parent, f"has capture cycles {cycles}, not {want} (--cycle)")
    for q in found:
        if cycle_of(q) != want:
            skipped.append((str(q), f"capture cycle {cycle_of(q)}; cycle {want} analysed (--cycle N to choose)"))
    return [q for q in found if cycle_of(q) == want]


def discover(
    paths: list[str | Path],
    *,
    cycle: int | None = None,
    skipped: list[tuple[str, str]] | None = None,
    iteration: int | None = None,
    dumps: list[Path] | None = None,
    memory: list[Path] | None = None,
) -> list[Path | str]:
    """Trace files named by ``paths``, in a stable order, without duplicates.

    A directory contributes the Kineto traces directly inside it (not recursively): its
    ``*.json`` / ``*.json.gz`` files whose content is a trace (:func:`looks_like_trace`); when
    ``fsdpdoctor.capture`` wrote several profiling cycles there, only cycle ``cycle`` (default:
    the last). What a directory held and was not taken is appended to ``skipped`` as
    ``(path, why)``. A pattern with ``*?[`` is expanded as a glob and filtered the same way; a
    file named directly is taken as it is (its reader says what is wrong with it). URLs
    (``s3://``, ``gs://``, ``http(s)://``, ``memory://``...; see :mod:`.remote`) are expanded through
    fsspec alike and come back as URL strings; ``file://`` URLs as local Paths.

    A framework's dump folder (:mod:`.layouts`: torchtitan's ``profile_traces/iteration_<N>``)
    contributes the traces of iteration ``iteration`` (default: the latest).

    With ``dumps`` (a list), PyTorch Flight Recorder dumps are collected there too, by content:
    those directly in a directory and in its torchtitan ``comm_trace(s)/`` sub-folder
    (:func:`fsdpdoctor.ingest.flight_recorder.dumps_in`), those a pattern matches, and a file named
    directly that is a dump (or any pickle); then a directory of dumps alone is no error, and the
    list of traces may be empty.

    With ``memory`` (a list), memory inputs go there by content (:func:`memory_kind`): a file named
    directly that is a CUDA memory snapshot (any pickle that is not a dump) or a profiler memory
    timeline, and memory timelines a directory or pattern holds; a directory whose snapshots
    :func:`snapshots_beside` finds (the caller reads those) is then no error either.
    """
    skipped = [] if skipped is None else skipped
    out: list[Path | str] = []
    folders = 0  # framework dump folders (layouts) among the paths
    memory_folders = 0  # folders that hold memory snapshots and no traces
    for raw in paths:
        raw = remote.localize(raw)
        if remote.is_url(raw):
            urls = remote.expand_url(str(raw), lambda n: _is_trace_name(Path(n)))
            if urls == [str(raw)]:  # one object named directly: its reader judges it
                out.extend(urls)
                continue
            found = _traces_among(urls, cycle, skipped)
            if not found:
                raise InputError(str(raw), "no trace files there (*.json, *.json.gz with traceEvents)")
            out.extend(found)
            continue
        s = str(raw)
        p = Path(s)
        try:
            st = os.stat(p)
        except PermissionError:
            raise InputError(p, "permission denied") from None
        except OSError:
            st = None
        dump = dump_folder(p, iteration) if st is not None and stat.S_ISDIR(st.st_mode) else None
        folders += dump is not None
        if dump is not None and dump.traces:
            skipped.extend(dump.skipped)
            found = _traces_among(dump.traces, cycle, skipped)
            if not found:
                raise InputError(p, f"no trace files in iteration {dump.iteration}'s profile traces")
            if dumps is not None:  # the job's Flight Recorder dumps (torchtitan's comm_traces/)
                dumps.extend(fr.dumps_in(p, exclude=set()))
            out.extend(found)
        elif st is not None and stat.S_ISDIR(st.st_mode):
            try:
                named = sorted(q for q in p.iterdir() if q.is_file() and _is_trace_name(q))
            except PermissionError:
                raise InputError(p, "permission denied (cannot list the directory)") from None
            except OSError as exc:
                raise InputError(p, f"cannot list the directory ({exc.strerror or exc})") from None
            before = len(dumps) if dumps is not None else 0
            before_mem = len(memory) if memory is not None else 0
            found = _traces_among(named, cycle, skipped, dumps, memory)
            if dumps is not None:
                dumps.extend(fr.dumps_in(p, exclude=set(named)))
            got_dumps = dumps is not None and len(dumps) > before
            if memory is not None and not found and not got_dumps:  # memory inputs alone
                if len(memory) > before_mem or snapshots_beside([p], iteration):
                    memory_folders += 1  # its snapshots are read by the caller (snapshots_beside)
                    continue
            if not found and dump is not None and not got_dumps:  # iteration folders of snapshots only
                hint = f" ({dump.latest_snapshot_iteration}): fsdpdoctor memory {p}" if dump.latest_snapshots else ""
                raise InputError(p, f"a {dump.layout} dump folder without profile traces; its memory snapshots{hint}")
            if not found and not got_dumps:
                raise InputError(
                    p,
                    "directory contains no trace files (*.json, *.json.gz with traceEvents)"
                    + (" and no Flight Recorder dumps" if dumps is not None else ""),
                )
            out.extend(found)
        elif st is not None:
            if memory is not None and stat.S_ISREG(st.st_mode) and not looks_like_trace(p) and memory_kind(p):
                memory.append(p)
                continue
            if dumps is not None and stat.S_ISREG(st.st_mode) and not looks_like_trace(p) and _direct_dump(p):
                dumps.append(p)
                continue
            out.append(p)  # not a regular file? the reader says so, by stat, before opening
        elif any(ch in s for ch in "*?["):
            matched = sorted(Path(q) for q in glob.glob(s) if Path(q).is_file())
            if not matched:
                raise InputError(s, "pattern matches no files")
            before = len(dumps) if dumps is not None else 0
            if dumps is not None:  # dumps have any name: those without a trace's are sniffed first
                dumps.extend(q for q in matched if not _is_trace_name(q) and fr.is_dump(q))
                matched = [q for q in matched if q not in dumps]
            before_mem = len(memory) if memory is not None else 0
            if memory is not None:  # snapshots have any name too
                memory.extend(q for q in matched if q not in (dumps or ()) and memory_kind(q) == "snapshot")
                matched = [q for q in matched if q not in memory]
            found = _traces_among(matched, cycle, skipped, dumps, memory)
            if not found and dumps is not None and len(dumps) > before:
                continue
            if not found and memory is not None and len(memory) > before_mem:
                continue
            if not found:
                raise InputError(s, "pattern matches no trace files (*.json, *.json.gz with traceEvents)")
            out.extend(found)
        else:
            raise InputError(p, "no such file or directory")
    if iteration is not None and not folders:
        raise InputError(
            " ".join(map(str, paths)), "--iteration chooses among a framework's dump folder's iterations; none given"
        )
    seen: set[Path | str] = set()
    unique = []
    for p in out:
        key = p if isinstance(p, str) else p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    if dumps is not None:
        dumps[:] = list(dict.fromkeys(q.resolve() for q in dumps))
    if memory is not None:
        memory[:] = list(dict.fromkeys(memory))
    if not unique and not dumps and not memory and not memory_folders:
        raise InputError(" ".join(map(str, paths)) or "(no paths)", "no trace files given")
    return unique


# --------------------------------------------------------------------------- memory snapshots beside traces

#: pickle protocols 2-5 start with PROTO (0x80) and the protocol number; torch writes 4 or 5
_PICKLE_MAGIC = tuple(bytes([0x80, v]) for v in range(2, 6))


def looks_like_snapshot(p: Path) -> bool:
    """Whether a file is a pickle (plain or gzip'd), by its first bytes: what
    ``torch.cuda.memory._dump_snapshot`` writes. Its content is then read by the safe unpickler
    of :mod:`.snapshot`, which refuses anything but plain data."""
    import gzip

    try:
        with open(p, "rb") as fh:
            head = fh.read(2)
            if head == b"\x1f\x8b":
                fh.seek(0)
                with gzip.GzipFile(fileobj=fh) as gz:
                    head = gz.read(2)
    except (OSError, EOFError):
        return False
    return head in _PICKLE_MAGIC


def _url_snapshot_head(url: str) -> bytes:
    """The first two (gunzipped) bytes of an object, b"" when it cannot be read."""
    from fsdpdoctor.ingest._io import open_input

    try:
        with open_input(url) as st:
            return st.read(2)
    except (InputError, OSError):
        return b""


def _url_listing(url: str) -> list[str]:
    """The objects directly in a URL directory or matching a URL glob, as full URLs ([] for one
    object, or when the store cannot list)."""
    try:
        return remote.listing(url) or []
    except InputError:  # a store that cannot list has no snapshots to offer
        return []


def snapshots_beside(paths: list[str | Path], iteration: int | None = None) -> list[Path | str]:
    """Memory snapshots in the directories (or among the files a glob matches) that ``paths``
    name, local or URL, recognised by content (:func:`looks_like_snapshot`), in a stable order;
    URLs come back as URL strings. In a framework's dump folder, those of the traces' iteration."""
    out: list[Path | str] = []
    for raw in paths:
        raw = remote.localize(raw)
        if remote.is_url(raw):
            out.extend(
                u
                for u in _url_listing(str(raw))
                if not _is_trace_name(Path(u)) and _url_snapshot_head(u) in _PICKLE_MAGIC
            )
            continue
        s = str(raw)
        p = Path(s)
        dump = dump_folder(p, iteration)
        if dump is not None and dump.traces:
            cands = dump.snapshots
        elif p.is_dir():
            try:
                cands = sorted(q for q in p.iterdir() if q.is_file() and not _is_trace_name(q))
            except OSError:
                continue
            if dump is not None:  # traces lie in the folder itself, snapshots in iteration folders below
                cands += dump.latest_snapshots
        elif not p.exists() and any(ch in s for ch in "*?["):
            cands = sorted(Path(q) for q in glob.glob(s) if Path(q).is_file() and not _is_trace_name(Path(q)))
        else:
            continue
        out.extend(q for q in cands if looks_like_snapshot(q) and not fr.is_dump(q))
    return list(dict.fromkeys(out))
