"""The block decoder's internal schema and the columns it fills (:mod:`.blocks` reads the file
and cuts it into blocks; this module decodes a block's events and appends them to columns).

The internal schema has the same fields as :class:`.events.Event` / :class:`.events.Args`, but
absent ids decode to a sentinel instead of None and absent args to a shared empty instance, so
that columns can be pulled out with C-level attrgetter/np.fromiter instead of Python loops.
"""

from __future__ import annotations

import os
from collections import Counter
from itertools import compress, repeat
from operator import attrgetter, eq, ne
from typing import Any, Union

import msgspec
import numpy as np

from fsdpdoctor.ingest import events as K

# --------------------------------------------------------------------------------------------
# Internal schema: the same fields as events.Event / events.Args, but absent ids decode to a
# sentinel instead of None and absent args to a shared empty instance, so that columns can be
# pulled out with C-level attrgetter/np.fromiter instead of Python loops.
# --------------------------------------------------------------------------------------------

NA = -(1 << 63)  # "absent" for the three id fields; a real file never holds int64's minimum

IntOrStr = Union[int, str]


_ID_FIELDS = ("external_id", "correlation", "stream")  # NA in _A, None in events.Args
_A = K.args_struct("_A", K.ARG_FIELDS, dict.fromkeys(_ID_FIELDS, NA), gc=False, frozen=True, module=__name__)


_EMPTY = _A()  # shared; never mutated


# Events are a union tagged by ``ph``: complete events decode in full, metadata events only as
# far as thread names need, every other phase (flows, instants, counters...) to an empty struct,
# its fields skipped unread. The phases are those of the Chrome trace event format; an event
# whose ``ph`` is not one of them fails validation and sends the file to the lenient path.
class _X(msgspec.Struct, gc=False, tag_field="ph", tag="X"):
    cat: str = ""
    name: str = ""
    pid: IntOrStr = 0
    tid: IntOrStr = 0
    ts: float = 0.0
    dur: float = 0.0
    args: _A | None = _EMPTY


class _MArgs(msgspec.Struct, gc=False):
    name: str | None = None


class _M(msgspec.Struct, gc=False, tag_field="ph", tag="M"):
    cat: str = ""
    name: str = ""
    pid: IntOrStr = 0
    tid: IntOrStr = 0
    args: _MArgs | None = None


_MemA = K.args_struct("_MemA", K.MEMORY_ARG_FIELDS, gc=False, module=__name__)


class _I(msgspec.Struct, gc=False, tag_field="ph", tag="i"):
    """Instant events: only ``[memory]`` ones are kept (allocator totals)."""

    cat: str = ""
    name: str = ""
    ts: float = 0.0
    args: _MemA | None = None


OTHER_PHASES = "BEICbneSTpFstfPONDVvRc()"
# their category alone is decoded: the input ledger (:mod:`.ledger`) counts every event by phase and category
_Others = tuple(
    msgspec.defstruct(f"_Ph{ord(c)}", [("cat", str, "")], tag_field="ph", tag=c, gc=False) for c in OTHER_PHASES
)
_OTHER_BY_PH = dict(zip(OTHER_PHASES, _Others))
_Event = Union[(_X, _M, _I, *_Others)]  # type: ignore[valid-type]
_OTHER = _Others[0]()  # stands for any event that is neither X nor M (lenient path)
_TAG = {c: c.__struct_config__.tag for c in (_X, _M, _I, *_Others)}.__getitem__  # event class -> its ph


class _Doc(msgspec.Struct, gc=False):
    traceEvents: list[_Event] | None = None  # type: ignore[valid-type]
    distributedInfo: Any = None
    deviceProperties: Any = None
    schemaVersion: Any = None
    traceName: Any = None
    baseTimeNanoseconds: Any = None
    computeProperties: Any = None


_BLOCK = msgspec.json.Decoder(list[_Event])  # type: ignore[valid-type]
_FINAL_OBJ = msgspec.json.Decoder(_Doc)
_UNTYPED = msgspec.json.Decoder()

_META_KEYS = K.META_KEYS

_TS = attrgetter("ts")
_DUR = attrgetter("dur")
_ARGS = attrgetter("args")
_EXT = attrgetter("external_id")
_CORR = attrgetter("correlation")
_STREAM = attrgetter("stream")
_RARE = attrgetter("collective", "nbytes", "out_nelems")
_NONE3 = (None, None, None)
_KEY = attrgetter("cat", "name", "pid", "tid")
_CAT = attrgetter("cat")
_NAME = attrgetter("name")


class _Lenient(Exception):
    """A field had an unexpected type: start over in lenient mode."""


class _Whole(Exception):
    """Not a shape the block decoder handles: decode the whole file instead."""

    def __init__(self, data: bytes):
        self.data = data


# --------------------------------------------------------------------------------------------
# Columns, built block by block
# --------------------------------------------------------------------------------------------


def _ids(getter, args: list, n: int) -> np.ndarray:
    try:
        out = np.fromiter(map(getter, args), dtype=np.int64, count=n)
    except TypeError:  # an explicit null somewhere
        out = np.fromiter((NA if v is None else v for v in map(getter, args)), dtype=np.int64, count=n)
    out[out == NA] = -1
    return out


class KeyTable:
    """Codes for (cat, name, pid, tid) keys, persistent across the blocks one process decodes.

    A trace has a few thousand distinct keys and millions of rows, so after the first blocks a
    block's codes cost one dict lookup per row. Keys not yet shipped to the process that
    assembles the columns travel with the next :class:`Part`.
    """

    def __init__(self) -> None:
        self.token = os.urandom(8).hex()
        self.index: dict[tuple, int] = {}
        self.values: list[tuple] = []
        self.sent = 0
        self.dropped: list[int] = []  # codes of keys whose category is not kept
        self.shapes: list[int] = []  # codes of keys whose rows keep their shapes (events.keeps_shapes)

    def codes(self, xs: list) -> np.ndarray:
        """The codes of the keys of events ``xs``."""
        idx = self.index
        try:  # most blocks hold no new key: no list of keys
            return np.fromiter(map(idx.__getitem__, map(_KEY, xs)), dtype=np.int32, count=len(xs))
        except KeyError:
            pass
        keys = list(map(_KEY, xs))
        got = list(map(idx.get, keys))
        i = -1
        try:
            while True:  # new keys, numbered in order of first appearance
                i = got.index(None, i + 1)
                k = keys[i]
                code = idx.get(k)
                if code is None:
                    code = idx[k] = len(self.values)
                    self.values.append(k)
                    if k[0] in K.DROPPED_CATEGORIES:
                        self.dropped.append(code)
                    if K.keeps_shapes(k[1]):
                        self.shapes.append(code)
                got[i] = code
        except ValueError:
            pass
        return np.fromiter(got, dtype=np.int32, count=len(got))

    def unsent(self) -> list[tuple]:
        new = self.values[self.sent :]
        self.sent = len(self.values)
        return new


class Part(msgspec.Struct, gc=False):
    """The columns of one block; ``key`` holds codes of the decoding process's KeyTable."""

    table: str
    new_keys: list
    event_count: int
    thread_names: dict
    key: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    ext: np.ndarray
    corr: np.ndarray
    stream: np.ndarray
    keep: dict  # row in the block -> events.Args
    mem: np.ndarray  # [memory] events, events.MEMORY_COLUMNS
    other: dict  # (ph, cat) -> count of the events that are not rows (every phase but X; X of dropped categories)
    frames: dict = {}  # name -> [events, total ns] of the dropped Python frames (events.add_frame)

    def __len__(self) -> int:
        return len(self.ts)


def extract(evs: list, table: KeyTable, counted: int | None = None) -> Part:
    """Columns of one decoded block."""
    thread_names: dict[tuple[Any, Any], str] = {}
    xs = [e for e in evs if e.__class__ is _X]
    mem_rows = []
    other: dict = {}
    if len(xs) != len(evs):
        nx = [e for e in evs if e.__class__ is not _X]
        by_class = Counter(zip(map(type, nx), map(_CAT, nx)))
        if any(c is _M for c, _ in by_class):
            ms = [e for e in nx if e.__class__ is _M]  # (process names, sort indices, labels... too)
            for e in compress(ms, map(eq, map(_NAME, ms), repeat("thread_name"))):
                if e.args is not None and e.args.name:
                    thread_names[(e.pid, e.tid)] = e.args.name
        if any(c is _I for c, _ in by_class):
            mem_rows = [r for r in map(K.memory_row, (e for e in nx if e.__class__ is _I)) if r is not None]
        other = {(_TAG(c), cat): k for (c, cat), k in by_class.items()}
        del nx
    count = len(evs) if counted is None else counted
    frames: dict = {}  # Python frames of dropped rows (events.add_frame)
    key = table.codes(xs)
    if table.dropped:
        drop = np.isin(key, table.dropped)
        if drop.any():
            other = Counter(other)
            for code, k in zip(*np.unique(key[drop], return_counts=True)):
                other["X", table.values[int(code)][0]] += int(k)
            gone = np.flatnonzero(drop)
            durs = np.rint(np.fromiter((xs[i].dur for i in gone.tolist()), dtype=np.float64, count=len(gone)) * 1000)
            codes, inv = np.unique(key[gone], return_inverse=True)
            calls = np.bincount(inv, minlength=len(codes))
            total = np.bincount(inv, weights=durs, minlength=len(codes))
            for c, n_calls, t in zip(codes.tolist(), calls.tolist(), total.tolist()):
                K.add_frame(frames, table.values[c][1], n_calls, int(t))
            rows = np.flatnonzero(~drop)
            xs = [xs[i] for i in rows.tolist()]
            key = key[rows]
    n = len(xs)
    ts = np.fromiter(map(_TS, xs), dtype=np.float64, count=n)
    dur = np.fromiter(map(_DUR, xs), dtype=np.float64, count=n)
    args = list(map(_ARGS, xs))
    try:
        ext = _ids(_EXT, args, n)
    except AttributeError:  # "args": null
        args = [_EMPTY if a is None else a for a in args]
        ext = _ids(_EXT, args, n)
    miss = np.flatnonzero(ext == -1)
    if miss.size:  # 2021-era GPU and runtime events: "external id"
        for i in miss.tolist():
            v = args[i].external_id_lc
            if v is not None:
                ext[i] = v
    corr = _ids(_CORR, args, n)
    stream = _ids(_STREAM, args, n)
    # rows whose args are kept: collective metadata, byte counts, c10d input shapes
    keep: dict[int, K.Args] = {}
    if n:
        rare = list(map(_RARE, args))
        cand = (
            []
            if rare.count(_NONE3) == n
            else [np.flatnonzero(np.fromiter(map(ne, rare, repeat(_NONE3)), dtype=bool, count=n))]
        )
        del rare
        if table.shapes:
            rows = np.flatnonzero(np.isin(key, table.shapes)).tolist()
            cand.append(
                np.array([i for i in rows if args[i].input_dims is not None or args[i].grid is not None], dtype=np.intp)
            )
        if cand:
            keep = {i: _public_args(args[i]) for i in np.unique(np.concatenate(cand)).tolist()}
    return Part(
        table.token,
        table.unsent(),
        count,
        thread_names,
        key,
        ts,
        dur,
        ext,
        corr,
        stream,
        keep,
        K.memory_array(mem_rows),
        dict(other),
        frames,
    )


class _Interner:
    """Codes in first-appearance order, as ``pd.factorize`` over the whole file gives."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}
        self.values: list[Any] = []

    def code(self, v: Any) -> int:
        c = self.index.get(v)
        if c is None:
            c = self.index[v] = len(self.values)
            self.values.append(v)
        return c


class Columns:
    """The columns of one trace, appended block by block (in file order)."""

    KEYS = ("key", "ts", "dur", "ext", "corr", "stream")

    def __init__(self) -> None:
        self.cats = _Interner()
        self.names = _Interner()
        self.threads = _Interner()
        self.keys = _Interner()
        self.key_cat: list[int] = []
        self.key_name: list[int] = []
        self.key_thread: list[int] = []
        self.maps: dict[str, list[int]] = {}  # KeyTable token -> its codes as global key codes
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in self.KEYS}
        self.thread_names: dict[tuple[Any, Any], str] = {}
        self.keep: dict[int, K.Args] = {}
        self.rows = 0
        self.event_count = 0
        self.mem: list[np.ndarray] = []
        self.other: Counter = Counter()  # Part.other, summed
        self.python_frames: dict = {}  # Part.frames, summed

    def append(self, part: Part) -> None:
        self.event_count += part.event_count
        if part.other:
            self.other.update(part.other)
        for name, (calls, us) in part.frames.items():
            K.add_frame(self.python_frames, name, calls, us)
        self.thread_names.update(part.thread_names)
        if len(part.mem):
            self.mem.append(part.mem)
        m = self.maps.setdefault(part.table, [])
        for k in part.new_keys:
            if k[0] in K.DROPPED_CATEGORIES:
                m.append(-1)  # never in a row
                continue
            # Keys new to the whole file arrive in order of first appearance, so interning the
            # key's category, name and thread here numbers those in first-appearance order too.
            g = self.keys.code(k)
            if g == len(self.key_cat):
                self.key_cat.append(self.cats.code(k[0]))
                self.key_name.append(self.names.code(k[1]))
                self.key_thread.append(self.threads.code((k[2], k[3])))
            m.append(g)
        n = len(part)
        if n == 0:
            return
        p = self.parts
        p["key"].append(np.asarray(m, dtype=np.int32)[part.key])
        for key in ("ts", "dur", "ext", "corr", "stream"):
            p[key].append(getattr(part, key))
        base = self.rows
        for i, a in part.keep.items():
            self.keep[base + i] = a
        self.rows += n

    def memory_events(self) -> np.ndarray:
        return np.concatenate(self.mem) if self.mem else K.memory_array([])

    def column(self, key: str, dtype) -> np.ndarray:
        if key in ("cat", "name", "thread"):
            table = {"cat": self.key_cat, "name": self.key_name, "thread": self.key_thread}[key]
            return np.asarray(table, dtype=dtype)[self.column("key", np.int32)] if self.rows else np.empty(0, dtype)
        parts = self.parts[key]
        out = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
        if key != "key":
            parts.clear()
        return out.astype(dtype, copy=False)


# _A's fields are Args' first ones, in order: an _A converts positionally
assert K.Args.__struct_fields__[: len(_A.__struct_fields__)] == _A.__struct_fields__
_ID_POS = tuple(_A.__struct_fields__.index(f) for f in _ID_FIELDS)
_RAW_POS = tuple(_A.__struct_fields__.index(f) for f in K.RAW_FIELDS)
_NBYTES_POS = _A.__struct_fields__.index("nbytes")
_astuple = msgspec.structs.astuple


def _public_args(a: _A) -> K.Args:
    t = list(_astuple(a))
    for i in _ID_POS:
        if t[i] == NA:
            t[i] = None
    if t[_NBYTES_POS].__class__ is str:
        t[_NBYTES_POS] = K._to_int(t[_NBYTES_POS])
    # a Raw points into the block's buffer; keep private copies of the few we retain
    for i in _RAW_POS:
        if t[i] is not None:
            t[i] = t[i].copy()
    return K.Args(*t)


def _internal(e: K.Event):
    """A leniently coerced event as the block decoder's own types."""
    if e.ph == "M":
        ma = None if e.args is None else _MArgs(name=e.args.name)
        return _M(cat=e.cat, name=e.name, pid=e.pid, tid=e.tid, args=ma)
    if e.ph == "i":
        a = e.args
        mem = None if a is None else _MemA(a.total_allocated, a.total_reserved, a.device_type, a.device_id)
        return _I(cat=e.cat, name=e.name, ts=e.ts, args=mem)
    if e.ph != "X":
        cls = _OTHER_BY_PH.get(e.ph)
        return _OTHER if cls is None else cls(cat=e.cat)
    a = e.args
    ia = None
    if a is not None:
        kw = {f: getattr(a, f) for f in _A.__struct_fields__}
        for f in _ID_FIELDS:
            if kw[f] is None:
                kw[f] = NA
        ia = _A(**kw)
    return _X(cat=e.cat, name=e.name, pid=e.pid, tid=e.tid, ts=e.ts, dur=e.dur, args=ia)
