"""Kineto (PyTorch profiler) Chrome-trace JSON → :class:`RankTrace`, a columnar table per rank.

Decoding uses a typed msgspec schema that names only the fields fsdpdoctor reads, which is
several times faster than generic JSON and allocates far less (see ``shared/notes/ingest-performance.md``).
Only complete events (``ph == "X"``) become rows; thread-name metadata is kept on the side.
Argument dictionaries are kept only for the few rows that carry collective metadata or memcpy
sizes, so memory stays proportional to the columns, not to the JSON.

:func:`load_trace` streams the file through the block decoder (:mod:`.blocks`): a few MiB of JSON
at a time, optionally decoded in worker processes, so peak memory is the columns plus a few
blocks whatever the file size. :func:`load_trace_whole` is the reference it is tested against:
the whole file in memory and one decode (the definition of every field and error message).

A file whose fields have unexpected types (a string where the schema says int) falls back to a
lenient per-event conversion instead of failing.
"""

from __future__ import annotations

import re
from collections import Counter
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import msgspec
import numpy as np

from fsdpdoctor.errors import InputError

from fsdpdoctor.ingest._io import gc_paused, read_input
from fsdpdoctor.ingest.categories import canonical_categories
from fsdpdoctor.ingest._io import short as _short

from fsdpdoctor.ingest.events import (
    DROPPED_CATEGORIES,
    OVERFLOW,
    RAW_FIELDS,
    TOO_DEEP,
    Args,
    META_KEYS,
    Event,
    _coerce_event,
    _to_int,
    add_frame,
    decode_lenient_utf8,
    keeps_shapes,
    memory_array,
    memory_row,
)


class _TraceDoc(msgspec.Struct, gc=False):
    traceEvents: list[Event] | None = None
    distributedInfo: Any = None
    deviceProperties: Any = None
    schemaVersion: Any = None
    traceName: Any = None
    baseTimeNanoseconds: Any = None
    computeProperties: Any = None


_typed_decoder = msgspec.json.Decoder(Union[_TraceDoc, list[Event]])
_untyped_decoder = msgspec.json.Decoder()


# --------------------------------------------------------------------------------------------
# The columnar result
# --------------------------------------------------------------------------------------------


def _mask_of_codes(column: np.ndarray, codes, n_codes: int) -> np.ndarray:
    """``np.isin(column, codes)`` as one table lookup per row (several times faster)."""
    lut = np.zeros(max(n_codes, int(np.max(codes)) + 1), dtype=bool)
    lut[np.asarray(codes, dtype=np.int64)] = True
    return lut.take(column)


@dataclass
class RankTrace:
    """One rank's trace as columns. Row i of every array is the same complete (``X``) event."""

    path: str
    rank: int | None
    rank_source: str  # "distributedInfo", "file name", or "order"
    world_size: int | None
    distributed_info: dict
    device_properties: list
    trace_name: str | None
    base_time_ns: int | None  # baseTimeNanoseconds: the wall-clock time (ns since the epoch) ``ts`` counts from
    # columns
    cat: np.ndarray  # int codes into ``cats``
    name: np.ndarray  # int codes into ``names``
    thread: np.ndarray  # int codes into ``threads`` (pid, tid) pairs
    ts: np.ndarray  # float64 µs
    dur: np.ndarray  # float64 µs
    external_id: np.ndarray  # int64, -1 when absent
    correlation: np.ndarray  # int64, -1 when absent
    stream: np.ndarray  # int64, -1 when absent (CPU rows)
    cats: list[str]
    names: list[str]
    threads: list[tuple[Any, Any]]
    args: dict[int, Args]  # row → args, only for rows with collective metadata or byte counts
    thread_names: dict[tuple[Any, Any], str] = field(default_factory=dict)
    event_count: int = 0  # all events in the file, every phase
    decode_mode: str = "typed"
    # one row per ``[memory]`` instant event, columns MEMORY_COLUMNS (empty without profile_memory)
    memory_events: np.ndarray = field(default_factory=lambda: memory_array([]))
    # (ph, category as written) -> count of the events that are not rows: every phase but X, and
    # X events of DROPPED_CATEGORIES (the input ledger, :mod:`.ledger`, accounts for them)
    other_events: dict = field(default_factory=dict)
    # category as written -> the name the analysis reads it under (``Kernel`` -> ``kernel``), for
    # the categories renamed on reading (:func:`.ledger.canonical_category`)
    cat_aliases: dict = field(default_factory=dict)
    # name -> [events, total ns] of the Python frames (``python_function`` X events, with_stack),
    # which are no rows: what analysis.framework reads the framework and module classes from
    python_frames: dict = field(default_factory=dict)
    _masks: dict = field(default_factory=dict, repr=False, compare=False)  # mask_cat cache

    @property
    def end(self) -> np.ndarray:
        return self.ts + self.dur

    def __len__(self) -> int:
        return len(self.ts)

    def cat_code(self, cat: str) -> int:
        try:
            return self.cats.index(cat)
        except ValueError:
            return -1

    def mask_cat(self, *cats: str) -> np.ndarray:
        codes = [c for c in (self.cat_code(x) for x in cats) if c >= 0]
        if not codes:
            return np.zeros(len(self.ts), dtype=bool)
        # analyses ask for the same few categories many times: keep each mask, hand out copies
        key = (id(self.cat), len(self.cat), tuple(sorted(codes)))
        cached = self._masks.get(key)
        if cached is None:
            cached = self._masks[key] = _mask_of_codes(self.cat, codes, len(self.cats))
        return cached.copy()

    def name_codes(self, predicate) -> np.ndarray:
        """Codes of all names for which ``predicate(name)`` is true."""
        return np.fromiter((i for i, n in enumerate(self.names) if predicate(n)), dtype=np.int64)

    def mask_names(self, predicate) -> np.ndarray:
        codes = self.name_codes(predicate)
        if len(codes) == 0:
            return np.zeros(len(self.ts), dtype=bool)
        return _mask_of_codes(self.name, codes, len(self.names))

    def row_name(self, i: int) -> str:
        return self.names[self.name[i]]

    def since(self, t0: float, why: str) -> "RankTrace":
        """The trace without the complete events that start before ``t0`` (µs), as if the
        profiler's window had opened then: those events are counted in ``other_events`` under
        ``("X", why)`` (the input ledger lists them as not read), the ``[memory]`` events and
        everything else kept. GPU work launched before ``t0`` and run after it keeps its rows and
        loses its launch, like the warm-up backlog of a window that opens mid-run."""
        keep = self.ts >= t0
        rows = np.flatnonzero(keep)
        new_row = np.full(len(self.ts), -1, dtype=np.int64)
        new_row[rows] = np.arange(rows.size)
        other = dict(self.other_events)
        other[("X", why)] = other.get(("X", why), 0) + int(len(self.ts) - rows.size)
        cols = {
            k: getattr(self, k)[rows]
            for k in ("cat", "name", "thread", "ts", "dur", "external_id", "correlation", "stream")
        }
        args = {int(new_row[r]): a for r, a in self.args.items() if keep[r]}
        return dataclasses.replace(self, **cols, args=args, other_events=other, _masks={})

    def to_dataframe(self) -> "pd.DataFrame":  # noqa: F821
        """The events as a pandas DataFrame (names and categories as pandas Categoricals)."""
        import pandas as pd

        return pd.DataFrame(
            {
                "cat": pd.Categorical.from_codes(self.cat, self.cats),
                "name": pd.Categorical.from_codes(self.name, self.names),
                "pid": [self.threads[t][0] for t in self.thread],
                "tid": [self.threads[t][1] for t in self.thread],
                "ts": self.ts,
                "dur": self.dur,
                "external_id": self.external_id,
                "correlation": self.correlation,
                "stream": self.stream,
            }
        )


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

TRACE_SUFFIXES = (".json", ".json.gz")


def read_bytes(path: Path) -> bytes:
    """The file's JSON bytes, gunzipped when the file is gzip (detected by magic, not by name),
    within the input limits of :mod:`._io`."""
    data = read_input(path, "trace file")
    if not data.strip():
        raise InputError(path, "empty file")
    return data


def _json_error(path: Path, exc: msgspec.DecodeError) -> InputError:
    if "truncated" in str(exc).lower():
        return InputError(path, "truncated JSON (the file ends mid-document)")
    return InputError(path, f"not valid JSON ({_short(exc)})")


def _decode(path: Path, data: bytes) -> tuple[list[Event], dict, str]:
    """Typed decode; lenient per-event conversion when a field has an unexpected type."""
    with gc_paused():
        try:
            doc = decode_lenient_utf8(_typed_decoder, data)
            mode = "typed"
        except msgspec.ValidationError:
            doc, mode = None, "lenient"
        except msgspec.DecodeError as exc:
            raise _json_error(path, exc) from None
        except RecursionError:
            raise InputError(path, TOO_DEEP) from None
        if doc is None:
            try:
                raw = decode_lenient_utf8(_untyped_decoder, data)
            except msgspec.DecodeError as exc:
                raise _json_error(path, exc) from None
            except RecursionError:
                raise InputError(path, TOO_DEEP) from None
            return _lenient(path, raw)
    if isinstance(doc, list):
        return doc, {}, mode
    if doc.traceEvents is None:
        raise InputError(path, "JSON is not a Chrome/Kineto trace (no 'traceEvents' array)")
    return doc.traceEvents, {k: getattr(doc, k) for k in META_KEYS}, mode


def _lenient(path: Path, raw: Any) -> tuple[list[Event], dict, str]:
    if isinstance(raw, dict):
        events_raw = raw.get("traceEvents")
        if not isinstance(events_raw, list):
            raise InputError(path, "JSON is not a Chrome/Kineto trace (no 'traceEvents' array)")
        meta = {k: raw.get(k) for k in META_KEYS}
    elif isinstance(raw, list):
        events_raw, meta = raw, {}
    else:
        raise InputError(path, "JSON is not a Chrome/Kineto trace (top level is neither object nor array)")
    events = [ev for ev in (_coerce_event(d) for d in events_raw) if ev is not None]
    return events, meta, "lenient"


# --------------------------------------------------------------------------------------------
# Rank identity
# --------------------------------------------------------------------------------------------

_RANK_IN_STR = re.compile(r"""['"]?rank['"]?\s*[:=]\s*['"]?(\d+)""")
_WS_IN_STR = re.compile(r"""['"]?world_size['"]?\s*[:=]\s*['"]?(\d+)""")
_RANK_IN_NAME = [
    re.compile(r"rank[-_.]?(\d+)", re.I),
    re.compile(r"worker[-_.]?(\d+)", re.I),
    re.compile(r"(?:^|[-_.])r(\d+)(?:[-_.]|$)", re.I),
]


def distributed_info(raw: Any) -> dict:
    """``distributedInfo`` as a dict; some torch versions write it as a (JSON or repr) string."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str) and raw.strip():
        try:
            val = msgspec.json.decode(raw.encode())
            if isinstance(val, dict):
                return val
        except msgspec.DecodeError:
            pass
        out: dict = {}
        if m := _RANK_IN_STR.search(raw):
            out["rank"] = int(m.group(1))
        if m := _WS_IN_STR.search(raw):
            out["world_size"] = int(m.group(1))
        return out
    return {}


def device_properties(raw: Any) -> list[dict]:
    """``deviceProperties`` as a list of dicts whose fields the analysis reads have their types:
    a ``name`` that is not a non-empty string and a ``totalGlobalMem`` that is not a positive
    finite number are left out (the device's name or memory unknown), entries that are not
    objects dropped. The profiler writes them so; a file that does not is read, not refused."""
    out = []
    for p in raw if isinstance(raw, list) else []:
        if not isinstance(p, dict):
            continue
        name, mem = p.get("name"), p.get("totalGlobalMem")
        bad_name = "name" in p and not (isinstance(name, str) and name)
        bad_mem = "totalGlobalMem" in p and (
            isinstance(mem, bool) or not isinstance(mem, (int, float)) or not 0 < mem < float("inf")
        )
        if bad_name or bad_mem:
            p = {k: v for k, v in p.items() if not (k == "name" and bad_name or k == "totalGlobalMem" and bad_mem)}
        out.append(p)
    return out


def rank_from_filename(path: str | Path) -> int | None:
    name = Path(path).name
    for rx in _RANK_IN_NAME:
        if m := rx.search(name):
            return int(m.group(1))
    return None


# --------------------------------------------------------------------------------------------
# Columns
# --------------------------------------------------------------------------------------------


def _factorize(values: list) -> tuple[np.ndarray, list]:
    import pandas as pd

    codes, uniques = pd.factorize(np.asarray(values, dtype=object), use_na_sentinel=False)
    return codes.astype(np.int32, copy=False), list(uniques)


def _build(path: Path, events: list[Event], meta: dict, mode: str) -> RankTrace:
    n_all = len(events)
    xs = [e for e in events if e.ph == "X" and e.cat not in DROPPED_CATEGORIES]
    other = Counter((e.ph, e.cat) for e in events if e.ph != "X" or e.cat in DROPPED_CATEGORIES)
    frames: dict[str, list] = {}
    for e in events:
        if e.ph == "X" and e.cat in DROPPED_CATEGORIES:
            add_frame(frames, e.name, 1, round(e.dur * 1000))
    thread_names: dict[tuple[Any, Any], str] = {}
    mem_rows = []
    for e in events:
        if e.ph == "M" and e.name == "thread_name" and e.args is not None and e.args.name:
            thread_names[(e.pid, e.tid)] = e.args.name
        elif e.ph == "i" and (row := memory_row(e)) is not None:
            mem_rows.append(row)
    n = len(xs)
    cat_codes, cats = _factorize([e.cat for e in xs])
    name_codes, names = _factorize([e.name for e in xs])
    thr_index: dict[tuple[Any, Any], int] = {}
    thr_codes = np.fromiter((thr_index.setdefault((e.pid, e.tid), len(thr_index)) for e in xs), dtype=np.int32, count=n)
    threads = list(thr_index)
    ts = np.fromiter((e.ts for e in xs), dtype=np.float64, count=n)
    dur = np.fromiter((e.dur for e in xs), dtype=np.float64, count=n)
    ext = np.full(n, -1, dtype=np.int64)
    corr = np.full(n, -1, dtype=np.int64)
    stream = np.full(n, -1, dtype=np.int64)
    keep: dict[int, Args] = {}
    for i, e in enumerate(xs):
        a = e.args
        if a is None:
            continue
        if a.external_id is not None:
            ext[i] = a.external_id
        elif a.external_id_lc is not None:
            ext[i] = a.external_id_lc
        if a.correlation is not None:
            corr[i] = a.correlation
        if a.stream is not None:
            stream[i] = a.stream
        if (
            a.collective is not None
            or a.nbytes is not None
            or a.out_nelems is not None
            or ((a.input_dims is not None or a.grid is not None) and keeps_shapes(e.name))
        ):
            if isinstance(a.nbytes, str):
                a.nbytes = _to_int(a.nbytes)
            # a Raw pins the whole file's buffer; keep private copies of the few we retain
            for f in RAW_FIELDS:
                if getattr(a, f) is not None:
                    setattr(a, f, getattr(a, f).copy())
            keep[i] = a
    return _make_trace(
        path,
        meta,
        mode,
        cat_codes,
        name_codes,
        thr_codes,
        ts,
        dur,
        ext,
        corr,
        stream,
        [str(c) for c in cats],
        [str(x) for x in names],
        threads,
        keep,
        thread_names,
        n_all,
        memory_array(mem_rows),
        dict(other),
        frames,
    )


#: The most a Kineto clock field (µs) may hold: 2**53 µs (~285 years) is where a float64 stops
#: resolving a microsecond. Epoch-based timestamps are ~1.8e15, a step's events far below.
CLOCK_MAX_US = float(1 << 53)


def _check_clock(
    path, field: str, col: np.ndarray, names: list[str] | None, name_codes: np.ndarray | None, what: str = ""
) -> None:
    """Refuse a time field that no clock produces (1e30, inf, NaN): one line naming the file,
    the field and the first event holding it, instead of silently wrong (or overflowing) sums."""
    bad = ~(np.abs(col) <= CLOCK_MAX_US)  # also catches NaN
    if not bad.any():
        return
    i = int(np.argmax(bad))
    if not what:
        label = names[int(name_codes[i])] if names is not None and name_codes is not None else ""
        what = f"event {label[:60]!r}" if label else f"event {i}"
    raise InputError(
        path,
        f"wrong structure: {what} has '{field}' = {col[i]:.6g}, outside the range of a trace clock "
        f"(|{field}| <= 2**53 µs); the file is corrupt",
    )


def _make_trace(
    path: Path,
    meta: dict,
    mode: str,
    cat: np.ndarray,
    name: np.ndarray,
    thread: np.ndarray,
    ts: np.ndarray,
    dur: np.ndarray,
    ext: np.ndarray,
    corr: np.ndarray,
    stream: np.ndarray,
    cats: list[str],
    names: list[str],
    threads: list[tuple[Any, Any]],
    keep: dict[int, Args],
    thread_names: dict[tuple[Any, Any], str],
    event_count: int,
    memory_events: np.ndarray | None = None,
    other_events: dict | None = None,
    python_frames: dict | None = None,
) -> RankTrace:
    _check_clock(path, "ts", ts, names, name)
    _check_clock(path, "dur", dur, names, name)
    if memory_events is not None and len(memory_events):
        _check_clock(path, "ts", memory_events[:, 0], None, None, "a [memory] event")
    np.maximum(dur, 0.0, out=dur)
    cat, cats, aliases = canonical_categories(cat, cats)
    dinfo = distributed_info(meta.get("distributedInfo"))
    rank = _to_int(dinfo.get("rank")) if dinfo else None
    source = "distributedInfo"
    if rank is None:
        rank = rank_from_filename(path)
        source = "file name"
    if rank is None:
        source = "order"
    ws = _to_int(dinfo.get("world_size")) if dinfo else None
    devprops = meta.get("deviceProperties")
    if not (isinstance(devprops, list) and devprops):  # torch 1.9-era traces: computeProperties
        devprops = meta.get("computeProperties") if isinstance(meta.get("computeProperties"), list) else devprops
    trace_name = meta.get("traceName")
    base = _to_int(meta.get("baseTimeNanoseconds"))
    return RankTrace(
        path=str(path),
        rank=rank,
        rank_source=source,
        world_size=ws,
        distributed_info=dinfo,
        device_properties=device_properties(devprops),
        trace_name=trace_name if isinstance(trace_name, str) else None,
        base_time_ns=base if base is not None and 0 < base < 1 << 63 else None,
        cat=cat,
        name=name,
        thread=thread,
        ts=ts,
        dur=dur,
        external_id=ext,
        correlation=corr,
        stream=stream,
        cats=cats,
        names=names,
        threads=threads,
        args=keep,
        thread_names=thread_names,
        event_count=event_count,
        decode_mode=mode,
        memory_events=memory_array([]) if memory_events is None else memory_events,
        other_events=other_events or {},
        cat_aliases=aliases,
        python_frames=python_frames or {},
    )


_progress_hook: Callable[[int, int], None] | None = None


@contextmanager
def progress_hook(fn: Callable[[int, int], None] | None) -> Iterator[None]:
    """Within the block, :func:`load_trace` calls without a ``progress`` argument report to ``fn``
    (how worker processes and callers that do not call load_trace themselves get progress)."""
    global _progress_hook
    prev, _progress_hook = _progress_hook, fn
    try:
        yield
    finally:
        _progress_hook = prev


_decode_workers = 0


@contextmanager
def parallel_decode(workers: int) -> Iterator[None]:
    """Within the block, :func:`load_trace` calls without a ``workers`` argument decode large
    files in ``workers`` processes (0: in this process)."""
    global _decode_workers
    prev, _decode_workers = _decode_workers, max(0, int(workers))
    try:
        yield
    finally:
        _decode_workers = prev


def load_trace(
    path: str | Path, progress: Callable[[int, int], None] | None = None, workers: int | None = None
) -> RankTrace:
    """Read one ``.json`` / ``.json.gz`` Kineto trace. Raises :class:`InputError` on bad input.

    The file is streamed through the block decoder (:mod:`.blocks`): memory stays proportional
    to the resulting columns. ``progress(done, total)`` is called after each chunk read, in bytes
    of the file on disk (default: the function set by :func:`progress_hook`, if any).
    ``workers`` > 0 decodes a large file's blocks in that many processes (default: as set by
    :func:`parallel_decode`, else 0); the result is identical.
    """
    from fsdpdoctor.ingest import remote
    from fsdpdoctor.ingest.blocks import load_blocks

    path = remote.localize(path)
    path = path if remote.is_url(path) else Path(path)  # a URL stays a string: Path would fold its '//'
    progress = progress or _progress_hook
    workers = _decode_workers if workers is None else workers
    with gc_paused():
        out = load_blocks(path, progress, workers)
        if isinstance(out, bytes):  # a shape only the whole-file decoder reads (it also words the errors)
            return _load_whole(path, out)
        meta, cols, mode = out
        if cols.event_count == 0:
            raise InputError(path, "trace has no events")
        try:
            rt = _trace_from_columns(path, meta, mode, cols)
        except OverflowError:
            raise InputError(path, OVERFLOW) from None
    if len(rt) == 0:
        raise InputError(path, "trace has no complete ('X') events to analyse")
    return rt


def _trace_from_columns(path: Path, meta: dict, mode: str, cols) -> RankTrace:
    return _make_trace(
        path,
        meta,
        mode,
        cols.column("cat", np.int32),
        cols.column("name", np.int32),
        cols.column("thread", np.int32),
        cols.column("ts", np.float64),
        cols.column("dur", np.float64),
        cols.column("ext", np.int64),
        cols.column("corr", np.int64),
        cols.column("stream", np.int64),
        [str(c) for c in cols.cats.values],
        [str(x) for x in cols.names.values],
        list(cols.threads.values),
        cols.keep,
        cols.thread_names,
        cols.event_count,
        cols.memory_events(),
        dict(cols.other),
        cols.python_frames,
    )


def load_trace_whole(path: str | Path) -> RankTrace:
    """The reference decoder: the whole file in memory, one typed decode, columns from the list
    of events. Several times the file size in memory; kept as the definition the block decoder
    is tested against, and for shapes the block decoder hands back."""
    path = Path(path)
    return _load_whole(path, read_bytes(path))


def _load_whole(path: Path, data: bytes) -> RankTrace:
    if not data.strip():
        raise InputError(path, "empty file")
    events, meta, mode = _decode(path, data)
    del data
    if not events:
        raise InputError(path, "trace has no events")
    with gc_paused():
        try:
            rt = _build(path, events, meta, mode)
        except OverflowError:
            raise InputError(path, OVERFLOW) from None
    if len(rt) == 0:
        raise InputError(path, "trace has no complete ('X') events to analyse")
    return rt
