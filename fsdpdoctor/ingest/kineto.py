"""Kineto (PyTorch profiler) Chrome-trace JSON → :class:`RankTrace`, a columnar table per rank.

Decoding uses a typed msgspec schema that names only the fields fsdpdoctor reads, which is
several times faster than generic JSON and allocates far less (see ``shared/notes/ingest-performance.md``).
Only complete events (``ph == "X"``) become rows; thread-name metadata is kept on the side.
Argument dictionaries are kept only for the few rows that carry collective metadata or memcpy
sizes, so memory stays proportional to the columns, not to the JSON.

A file whose fields have unexpected types (a string where the schema says int) falls back to a
lenient per-event conversion instead of failing.
"""

from __future__ import annotations

import gc
import gzip
import re
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Union

import msgspec
import numpy as np
import pandas as pd

from ..errors import InputError

try:  # isal's gzip is ~6x faster than zlib's; fall back when the wheel is unavailable
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover - exercised only without isal
    _gzip = gzip

# --------------------------------------------------------------------------------------------
# Typed schema: the fields we read, nothing else. Unknown fields are skipped by the decoder.
# --------------------------------------------------------------------------------------------

IntOrStr = Union[int, str]


class Args(msgspec.Struct, gc=False, omit_defaults=True):
    external_id: int | None = msgspec.field(name="External id", default=None)
    correlation: int | None = None
    stream: int | None = None
    device: int | None = None
    collective: str | None = msgspec.field(name="Collective name", default=None)
    in_nelems: int | None = msgspec.field(name="In msg nelems", default=None)
    out_nelems: int | None = msgspec.field(name="Out msg nelems", default=None)
    group_size: int | None = msgspec.field(name="Group size", default=None)
    dtype: str | None = None
    pg_name: str | None = msgspec.field(name="Process Group Name", default=None)
    pg_desc: str | None = msgspec.field(name="Process Group Description", default=None)
    pg_ranks: str | list[int] | None = msgspec.field(name="Process Group Ranks", default=None)
    # ROCm traces write memcpy byte counts as strings.
    nbytes: int | str | None = msgspec.field(name="bytes", default=None)
    name: str | None = None  # thread/process names on ph == "M" events
    # shapes/types (record_shapes=True) stay undecoded: only c10d collective ops need them
    input_dims: msgspec.Raw | None = msgspec.field(name="Input Dims", default=None)
    input_type: msgspec.Raw | None = msgspec.field(name="Input type", default=None)


class Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: IntOrStr = 0
    tid: IntOrStr = 0
    ts: float = 0.0
    dur: float = 0.0
    args: Args | None = None


class _TraceDoc(msgspec.Struct, gc=False):
    traceEvents: list[Event] | None = None
    distributedInfo: Any = None
    deviceProperties: Any = None
    schemaVersion: Any = None
    traceName: Any = None


_typed_decoder = msgspec.json.Decoder(Union[_TraceDoc, list[Event]])
_args_fields = set(Args.__struct_fields__)

# Categories whose rows are kept. Python-function rows (with_stack) are the bulk of some traces
# and nothing downstream reads them.
DROPPED_CATEGORIES = frozenset({"python_function"})


# --------------------------------------------------------------------------------------------
# The columnar result
# --------------------------------------------------------------------------------------------


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
        return np.isin(self.cat, codes)

    def name_codes(self, predicate) -> np.ndarray:
        """Codes of all names for which ``predicate(name)`` is true."""
        return np.fromiter((i for i, n in enumerate(self.names) if predicate(n)), dtype=np.int64)

    def mask_names(self, predicate) -> np.ndarray:
        codes = self.name_codes(predicate)
        if len(codes) == 0:
            return np.zeros(len(self.ts), dtype=bool)
        return np.isin(self.name, codes)

    def row_name(self, i: int) -> str:
        return self.names[self.name[i]]

    def to_dataframe(self) -> pd.DataFrame:
        """The events as a pandas DataFrame (names and categories as pandas Categoricals)."""
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


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The decoder allocates millions of small objects; the cyclic GC only slows it down."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_bytes(path: Path) -> bytes:
    """The file's JSON bytes, gunzipped when the file is gzip (detected by magic, not by name)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
            fh.seek(0)
            if head == b"\x1f\x8b":
                try:
                    with _gzip.open(fh, "rb") as gz:
                        data = gz.read()
                except (EOFError, OSError, zlib.error, gzip.BadGzipFile) as exc:
                    raise InputError(path, f"truncated or corrupt gzip data ({_short(exc)})") from None
            else:
                data = fh.read()
    except IsADirectoryError:
        raise InputError(path, "is a directory, expected a trace file") from None
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except PermissionError:
        raise InputError(path, "permission denied") from None
    if not data.strip():
        raise InputError(path, "empty file")
    return data


def _short(exc: BaseException) -> str:
    msg = str(exc).strip() or type(exc).__name__
    return msg.splitlines()[0][:120]


def _decode(path: Path, data: bytes) -> tuple[list[Event], dict, str]:
    """Typed decode; lenient per-event conversion when a field has an unexpected type."""
    with _gc_paused():
        try:
            doc = _typed_decoder.decode(data)
            mode = "typed"
        except msgspec.ValidationError:
            doc, mode = None, "lenient"
        except msgspec.DecodeError as exc:
            msg = str(exc)
            if "truncated" in msg.lower():
                raise InputError(path, "truncated JSON (the file ends mid-document)") from None
            raise InputError(path, f"not valid JSON ({_short(exc)})") from None
        if doc is None:
            raw = msgspec.json.decode(data)
            return _lenient(path, raw)
    if isinstance(doc, list):
        return doc, {}, mode
    if doc.traceEvents is None:
        raise InputError(path, "JSON is not a Chrome/Kineto trace (no 'traceEvents' array)")
    meta = {
        "distributedInfo": doc.distributedInfo,
        "deviceProperties": doc.deviceProperties,
        "schemaVersion": doc.schemaVersion,
        "traceName": doc.traceName,
    }
    return doc.traceEvents, meta, mode


def _lenient(path: Path, raw: Any) -> tuple[list[Event], dict, str]:
    if isinstance(raw, dict):
        events_raw = raw.get("traceEvents")
        if not isinstance(events_raw, list):
            raise InputError(path, "JSON is not a Chrome/Kineto trace (no 'traceEvents' array)")
        meta = {k: raw.get(k) for k in ("distributedInfo", "deviceProperties", "schemaVersion", "traceName")}
    elif isinstance(raw, list):
        events_raw, meta = raw, {}
    else:
        raise InputError(path, "JSON is not a Chrome/Kineto trace (top level is neither object nor array)")
    events = [ev for ev in (_coerce_event(d) for d in events_raw) if ev is not None]
    return events, meta, "lenient"


def _to_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


def _to_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _coerce_event(d: Any) -> Event | None:
    if not isinstance(d, dict):
        return None
    a = d.get("args")
    args = None
    if isinstance(a, dict):
        args = Args(
            external_id=_to_int(a.get("External id")),
            correlation=_to_int(a.get("correlation")),
            stream=_to_int(a.get("stream")),
            device=_to_int(a.get("device")),
            collective=_str_or_none(a.get("Collective name")),
            in_nelems=_to_int(a.get("In msg nelems")),
            out_nelems=_to_int(a.get("Out msg nelems")),
            group_size=_to_int(a.get("Group size")),
            dtype=_str_or_none(a.get("dtype")),
            pg_name=_str_or_none(a.get("Process Group Name")),
            pg_desc=_str_or_none(a.get("Process Group Description")),
            pg_ranks=_str_or_none(a.get("Process Group Ranks")),
            nbytes=_to_int(a.get("bytes")),
            name=_str_or_none(a.get("name")),
            input_dims=_raw(a.get("Input Dims")),
            input_type=_raw(a.get("Input type")),
        )
    pid, tid = d.get("pid", 0), d.get("tid", 0)
    return Event(
        ph=str(d.get("ph", "")),
        cat=str(d.get("cat", "") or ""),
        name=str(d.get("name", "") or ""),
        pid=pid if isinstance(pid, (int, str)) else str(pid),
        tid=tid if isinstance(tid, (int, str)) else str(tid),
        ts=_to_float(d.get("ts", 0.0)),
        dur=_to_float(d.get("dur", 0.0)),
        args=args,
    )


def _raw(v: Any) -> msgspec.Raw | None:
    return None if v is None else msgspec.Raw(msgspec.json.encode(v))


def _str_or_none(v: Any) -> str | None:
    if v is None:
        return None
    return v if isinstance(v, str) else str(v)


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
    codes, uniques = pd.factorize(np.asarray(values, dtype=object), use_na_sentinel=False)
    return codes.astype(np.int32, copy=False), list(uniques)


def _build(path: Path, events: list[Event], meta: dict, mode: str) -> RankTrace:
    n_all = len(events)
    xs = [e for e in events if e.ph == "X" and e.cat not in DROPPED_CATEGORIES]
    thread_names: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.ph == "M" and e.name == "thread_name" and e.args is not None and e.args.name:
            thread_names[(e.pid, e.tid)] = e.args.name
    n = len(xs)
    cat_codes, cats = _factorize([e.cat for e in xs])
    name_codes, names = _factorize([e.name for e in xs])
    thr_index: dict[tuple[Any, Any], int] = {}
    thr_codes = np.fromiter(
        (thr_index.setdefault((e.pid, e.tid), len(thr_index)) for e in xs), dtype=np.int32, count=n
    )
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
        if a.correlation is not None:
            corr[i] = a.correlation
        if a.stream is not None:
            stream[i] = a.stream
        if a.collective is not None or a.nbytes is not None or a.out_nelems is not None or (
            a.input_dims is not None and (e.name.startswith("c10d::") or e.name == "record_param_comms")
        ):
            if isinstance(a.nbytes, str):
                a.nbytes = _to_int(a.nbytes)
            # a Raw pins the whole file's buffer; keep private copies of the few we retain
            if a.input_dims is not None:
                a.input_dims = a.input_dims.copy()
            if a.input_type is not None:
                a.input_type = a.input_type.copy()
            keep[i] = a
    np.maximum(dur, 0.0, out=dur)

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
    trace_name = meta.get("traceName")
    return RankTrace(
        path=str(path),
        rank=rank,
        rank_source=source,
        world_size=ws,
        distributed_info=dinfo,
        device_properties=devprops if isinstance(devprops, list) else [],
        trace_name=trace_name if isinstance(trace_name, str) else None,
        cat=cat_codes,
        name=name_codes,
        thread=thr_codes,
        ts=ts,
        dur=dur,
        external_id=ext,
        correlation=corr,
        stream=stream,
        cats=[str(c) for c in cats],
        names=[str(x) for x in names],
        threads=threads,
        args=keep,
        thread_names=thread_names,
        event_count=n_all,
        decode_mode=mode,
    )


def load_trace(path: str | Path) -> RankTrace:
    """Read one ``.json`` / ``.json.gz`` Kineto trace. Raises :class:`InputError` on bad input."""
    path = Path(path)
    data = read_bytes(path)
    events, meta, mode = _decode(path, data)
    del data
    if not events:
        raise InputError(path, "trace has no events")
    with _gc_paused():
        rt = _build(path, events, meta, mode)
    if len(rt) == 0:
        raise InputError(path, "trace has no complete ('X') events to analyse")
    return rt
