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
from operator import attrgetter, eq, is_not
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
# omit_defaults: a kept row's args are encoded with only the fields its event had (see _kept)
_A = K.args_struct(
    "_A", K.ARG_FIELDS, dict.fromkeys(_ID_FIELDS, NA), gc=False, frozen=True, omit_defaults=True, module=__name__
)


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

_astuple = msgspec.structs.astuple
_EXT = attrgetter("external_id")
_CORR = attrgetter("correlation")
_STREAM = attrgetter("stream")
_RARE = tuple(map(attrgetter, ("collective", "nbytes", "out_nelems")))
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


class _KeyIndex(dict):
    """Key -> code; a key not seen before is numbered (in order of first appearance) as it is
    looked up, so a block's codes are one pass of C-level lookups whether or not it brings new
    keys (most blocks bring one or two: a ``ProfilerStep#N`` a step)."""

    __slots__ = ("table",)

    def __missing__(self, k: tuple) -> int:
        t = self.table
        code = self[k] = len(t.values)
        t.values.append(k)
        if k[0] in K.DROPPED_CATEGORIES:
            t.dropped.append(code)
        if K.keeps_shapes(k[1]):
            t.shapes.append(code)
        return code


class KeyTable:
    """Codes for (cat, name, pid, tid) keys, persistent across the blocks one process decodes.

    A trace has a few thousand distinct keys and millions of rows, so a block's codes cost one
    dict lookup per row. Keys not yet shipped to the process that assembles the columns travel
    with the next :class:`Part`.
    """

    def __init__(self) -> None:
        self.token = os.urandom(8).hex()
        self.index = _KeyIndex()
        self.index.table = self
        self.values: list[tuple] = []
        self.sent = 0
        self.dropped: list[int] = []  # codes of keys whose category is not kept
        self.shapes: list[int] = []  # codes of keys whose rows keep their shapes (events.keeps_shapes)

    def lookup(self, codes: list[int]) -> np.ndarray:
        """A boolean array over the codes so far, True at ``codes``: ``lookup(c)[key]`` is
        ``np.isin(key, c)`` without its per-call cost."""
        out = np.zeros(len(self.values), dtype=bool)
        out[codes] = True
        return out

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
    keep_rows: np.ndarray  # rows in the block whose args are kept, ascending
    keep_args: bytes  # their args as a JSON array (events.Args), see _kept
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
    n = len(xs)
    # one pass over the structs: their fields as tuples, one a field (zip reuses its key tuple)
    cat, name, pid, tid, ts, dur, args = zip(*map(_astuple, xs)) if n else ((),) * 7
    del xs
    key = np.fromiter(map(table.index.__getitem__, zip(cat, name, pid, tid)), dtype=np.int32, count=n)
    del cat, name, pid, tid
    if table.dropped:
        drop = table.lookup(table.dropped)[key]
        if drop.any():
            other = Counter(other)
            for code, k in zip(*np.unique(key[drop], return_counts=True)):
                other["X", table.values[int(code)][0]] += int(k)
            gone = np.flatnonzero(drop)
            durs = np.rint(np.fromiter(map(dur.__getitem__, gone.tolist()), dtype=np.float64, count=len(gone)) * 1000)
            codes, inv = np.unique(key[gone], return_inverse=True)
            calls = np.bincount(inv, minlength=len(codes))
            total = np.bincount(inv, weights=durs, minlength=len(codes))
            for c, n_calls, t in zip(codes.tolist(), calls.tolist(), total.tolist()):
                K.add_frame(frames, table.values[c][1], n_calls, int(t))
            rows = np.flatnonzero(~drop).tolist()
            ts, dur, args = (tuple(map(col.__getitem__, rows)) for col in (ts, dur, args))
            key = key[rows]
            n = len(rows)
    ts = np.array(ts, dtype=np.float64).reshape(n)
    dur = np.array(dur, dtype=np.float64).reshape(n)
    try:
        ext = _ids(_EXT, args, n)
    except AttributeError:  # "args": null
        args = tuple(_EMPTY if a is None else a for a in args)
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
    keep_rows = _NO_ROWS
    keep_args = b""
    if n:
        cand: set[int] = set()
        for get in _RARE:
            col = list(map(get, args))
            if col.count(None) != n:
                cand.update(compress(range(n), map(is_not, col, repeat(None))))
        if table.shapes:
            for i in np.flatnonzero(table.lookup(table.shapes)[key]).tolist():
                a = args[i]
                if a.input_dims is not None or a.grid is not None:
                    cand.add(i)
        if cand:
            rows = sorted(cand)
            keep_rows = np.array(rows, dtype=np.int64)
            keep_args = _kept(args, rows)
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
        keep_rows,
        keep_args,
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
        if len(part.keep_rows):
            self.keep.update(zip((part.keep_rows + self.rows).tolist(), kept_args(part.keep_args)))
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


# _A's fields are Args' first ones (same names, same JSON keys): an encoded _A decodes as Args
assert K.Args.__struct_fields__[: len(_A.__struct_fields__)] == _A.__struct_fields__
_NO_ROWS = np.empty(0, dtype=np.int64)
_NBYTES = attrgetter("nbytes")
_KEEP_ENC = msgspec.json.Encoder()
_KEEP_DEC = msgspec.json.Decoder(list[K.Args])
_NA_TEXT = str(NA).encode()


def _kept(args: list, rows: list[int]) -> bytes:
    """The args of ``rows`` as a JSON array of :class:`.events.Args` (:func:`kept_args` reads it).

    _A omits its defaults, so each object holds the fields its event had, as decoded: an id the
    event did not have (NA here) is absent, hence None in Args; the shapes (Raw) are their JSON
    text as it was in the file. Encoding a few hundred structs and decoding them where the
    columns are assembled is several times cheaper than converting them one by one (and than
    pickling Args from a worker process); the decoded Raw values point into this small payload,
    not into the block."""
    kept = list(map(args.__getitem__, rows))
    if str in map(type, map(_NBYTES, kept)):  # ROCm byte counts are strings: as integers
        kept = [_int_nbytes(a) for a in kept]
    return _KEEP_ENC.encode(kept)


def _int_nbytes(a: _A) -> _A:
    return msgspec.structs.replace(a, nbytes=K._to_int(a.nbytes)) if a.nbytes.__class__ is str else a


def kept_args(payload: bytes) -> list[K.Args]:
    """The :class:`.events.Args` that :func:`_kept` encoded."""
    vals = _KEEP_DEC.decode(payload)
    if _NA_TEXT in payload:  # an id of -2**63 in the file is NA: absent, as this decoder always read it
        vals = [_no_na(a) for a in vals]
    return vals


def _no_na(a: K.Args) -> K.Args:
    na = {f: None for f in _ID_FIELDS if getattr(a, f) == NA}
    return msgspec.structs.replace(a, **na) if na else a


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
