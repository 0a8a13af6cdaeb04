"""Load CUDA caching-allocator memory snapshots and profiler memory-timeline exports.

Two inputs are understood:

* ``torch.cuda.memory._dump_snapshot()`` pickles (torch 2.0 – 2.13), also the bare segment list
  that ``torch.cuda.memory_snapshot()`` returns, optionally gzip-compressed. They are read with the
  unpickler of :mod:`._pickle` (shared with Flight Recorder dumps), which refuses every global, so
  a pickle can build only dicts, lists, tuples, strings and numbers: a pickle that names
  ``os.system`` (or any other callable or class) is rejected before anything runs.
* ``torch.profiler.profile.export_memory_timeline`` exports: the ``.raw.json(.gz)`` rows
  ``[t_ns, action, bytes, category]`` and the plain ``[times_us, sizes]`` form.

Snapshot fields are read with defaults, because the format grew over releases (see
``notes/memory-snapshot-format.md``): ``time_us`` (2.2+), ``allocator_settings`` (2.3+),
``external_annotations`` (2.5+), ``compile_context`` (2.8+), ``user_metadata`` (2.10+), and
≤2.0 blocks that carry a ``history`` list instead of ``address``/``frames``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from fsdpdoctor.errors import InputError

from fsdpdoctor.ingest._io import convert_checked, read_input
from fsdpdoctor.ingest._io import short as _short
from fsdpdoctor.ingest._pickle import UNPICKLE_BYTES_PER_BYTE, UNPICKLE_FLOOR, load_plain_pickle, looks_like_json  # noqa: F401

__all__ = [
    "SnapshotError",
    "Snapshot",
    "MemoryTimeline",
    "TIMELINE_CATEGORIES",
    "load_snapshot",
    "load_memory_timeline",
    "load_memory",
    "snapshot_from_object",
]

#: Column order of ``export_memory_timeline`` (``_CATEGORY_TO_INDEX`` in torch/profiler/_memory_profiler.py);
#: index 7 is "no category".
TIMELINE_CATEGORIES = (
    "PARAMETER",
    "OPTIMIZER_STATE",
    "INPUT",
    "TEMPORARY",
    "ACTIVATION",
    "GRADIENT",
    "AUTOGRAD_DETAIL",
    "UNKNOWN",
)

_PENDING_STATES = {"active_pending_free", "active_awaiting_free"}  # the docstring spells it "awaiting"
_BLOCK_STATES = {"active_allocated", "inactive"} | _PENDING_STATES


#: trace actions that make a device trace allocation history (an allocation recorded)
HISTORY_ACTIONS = frozenset({"alloc", "segment_alloc", "segment_map"})


def device_has_history(entries: list[dict]) -> bool:
    return any(e.get("action") in HISTORY_ACTIONS for e in entries)


class SnapshotError(InputError):
    """A memory snapshot or memory timeline cannot be loaded; ``str(err)`` is ``"<file>: <problem>"``."""


@dataclass
class Snapshot:
    """A loaded allocator snapshot, normalised so every documented key is present.

    ``segments`` are fresh dicts with the keys ``device, address, total_size, stream, segment_type,
    segment_pool_id, is_expandable, frames, blocks``; each block has ``address, size,
    requested_size, state, frames`` (``state`` ``"active_awaiting_free"`` is folded into
    ``"active_pending_free"``; ``requested_size`` of inactive blocks is stale in real files and is
    never used). ``device_traces`` are the original entry dicts (not copied: real traces hold
    millions of them); read optional entry keys with ``.get``.
    """

    path: str | None
    segments: list[dict]
    device_traces: list[list[dict]]
    allocator_settings: dict = field(default_factory=dict)
    external_annotations: list[dict] = field(default_factory=list)
    bare_segment_list: bool = False

    @property
    def has_history(self) -> bool:
        """Whether any device recorded allocation history: an ``alloc`` or a segment's allocation.
        A device trace holding only ``snapshot`` or a stray free is not history (a dump without
        ``_record_memory_history`` writes such one-entry lists)."""
        return any(device_has_history(t) for t in self.device_traces)

    @property
    def devices(self) -> list[int]:
        """Devices with memory at dump time or allocation history."""
        devs = {s["device"] for s in self.segments}
        devs.update(i for i, t in enumerate(self.device_traces) if device_has_history(t))
        return sorted(devs)

    @property
    def expandable_segments(self) -> bool:
        """Whether the allocator ran with ``expandable_segments`` (changes how blocks are split)."""
        if self.allocator_settings.get("expandable_segments"):
            return True
        if any(s["is_expandable"] for s in self.segments):
            return True
        return any(e.get("action") in ("segment_map", "segment_unmap") for t in self.device_traces for e in t)


@dataclass
class MemoryTimeline:
    """Rows of a profiler memory-timeline export, in file order.

    ``time_ns`` is -1 for tensors that existed before profiling (PREEXISTING); ``action`` is
    1 PREEXISTING, 2 CREATE, 3 INCREMENT_VERSION, 4 DESTROY; ``nbytes`` is signed; ``category``
    indexes :data:`TIMELINE_CATEGORIES`.
    """

    path: str | None
    time_ns: np.ndarray
    action: np.ndarray
    nbytes: np.ndarray
    category: np.ndarray
    form: str = "raw"  # "raw" rows or the cumulative "[times, sizes]" export, converted to rows


# --------------------------------------------------------------------------- file reading


def _read(path: Path) -> bytes:
    """The file's bytes (gunzipped), refused before reading when it is not a regular file and
    while reading once it exceeds the input limits of :mod:`._io`."""
    data = read_input(path, "memory snapshot file", SnapshotError)
    if not data:
        raise SnapshotError(path, "empty file")
    return data


def _looks_like_json(data: bytes) -> bool:
    return looks_like_json(data)


def _unpickle(path: Path, data: bytes) -> Any:
    return load_plain_pickle(path, data, "a memory snapshot", SnapshotError)


# --------------------------------------------------------------------------- work bound

# A pickle's memo lets one list be referenced many times for two bytes each: real snapshots do
# it (every entry with the same traceback shares one frames list), a hostile one nests it (a
# 1,000-frame list shared by 10**6 entries: 10**9 frames to read from 5 MB). What the loader and
# the analysis walk — entries, blocks and their frames, counted per reference — is bounded by the
# pickle's size: real snapshots walk < 0.2 items per byte (the GPU corpus, the public one).
WALK_ITEMS_PER_BYTE = 8
WALK_FLOOR = 4_000_000


def _walk_items(obj: Any) -> int:
    """How many entries, blocks and frames reading ``obj`` visits, each shared list counted at
    every reference — computed once per distinct list, so this costs what the pickle holds."""
    cost: dict[int, int] = {}

    def frames(v: Any) -> int:
        return len(v) if isinstance(v, list) else 0

    def entries(lst: Any, per_item) -> int:
        if not isinstance(lst, list):
            return 0
        k = id(lst)
        if k not in cost:
            cost[k] = len(lst) + sum(map(per_item, lst))
        return cost[k]

    def entry(e: Any) -> int:
        return entries(e.get("frames"), lambda _: 0) if isinstance(e, dict) else 0

    def block(b: Any) -> int:
        if not isinstance(b, dict):
            return 0
        hist = b.get("history")
        return frames(b.get("frames")) + (entries(hist, entry) if isinstance(hist, list) else 0)

    def segment(sg: Any) -> int:
        return (entries(sg.get("blocks"), block) + frames(sg.get("frames"))) if isinstance(sg, dict) else 0

    if isinstance(obj, list):
        return entries(obj, segment)
    if not isinstance(obj, dict):
        return 0
    total = entries(obj.get("segments"), segment)
    traces = obj.get("device_traces", obj.get("traces"))
    if isinstance(traces, list):
        total += entries(traces, lambda t: entries(t, entry))
    annotations = obj.get("external_annotations")
    if isinstance(annotations, list):
        total += len(annotations)
    return total


def _bounded(obj: Any, path: Any, nbytes: int) -> Any:
    """Refuse a pickle whose shared references would make reading it cost far more than its size."""
    limit = max(WALK_FLOOR, WALK_ITEMS_PER_BYTE * nbytes)
    n = _walk_items(obj)
    if n > limit:
        raise SnapshotError(
            path,
            f"refused: its shared references (pickle memo) expand to {n:.3g} entries, blocks and frames "
            f"from {nbytes} bytes (at most {limit:.3g} read); a memory snapshot this size holds far fewer",
        )
    return obj


# --------------------------------------------------------------------------- snapshot structure


_I64 = 1 << 63  # sizes and addresses are 64-bit in the allocator; anything past that is corrupt


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _in_range(path: Any, where: str, key: str, value: Any) -> None:
    if isinstance(value, int) and not -_I64 <= value < _I64:
        raise SnapshotError(path, f"wrong structure: {where}['{key}'] = {_digits(value)} is outside the 64-bit range")


def _digits(v: int) -> str:
    s = str(v) if v.bit_length() < 4000 else "a huge integer"
    return s if len(s) <= 24 else f"{s[:10]}...({len(s)} digits)"


# What the analysis reads from a device-trace entry and a stack frame, with their types. msgspec
# checks every entry in C (the dicts themselves are kept: this is validation only).
_U63 = Annotated[int, msgspec.Meta(ge=0, le=_I64 - 1)]
_S64 = Annotated[int, msgspec.Meta(ge=-_I64, le=_I64 - 1)]


class _Frame(msgspec.Struct, gc=False):
    name: str = ""
    filename: str = ""
    line: _S64 = 0


class _Entry(msgspec.Struct, gc=False):
    action: str = ""
    addr: _U63 | None = 0
    size: _U63 = 0
    stream: _S64 | None = 0
    device_free: _S64 | None = None
    time_us: float | None = None
    frames: list[_Frame] | None = None


class _Annotation(msgspec.Struct, gc=False):
    time_us: float | None = None
    device: _S64 | None = None


def _validate(path: Any, where: str, value: Any, typ: Any) -> None:
    convert_checked(value, typ, lambda msg: SnapshotError(path, msg), where)


_ENTRIES = list[_Entry]
_FRAMES = list[_Frame]
_ANNOTATIONS = list[_Annotation]


def _normalise_block(blk: Any, where: str, path: Any, next_address: int) -> dict:
    if not isinstance(blk, dict):
        raise SnapshotError(path, f"wrong structure: {where} is a {type(blk).__name__}, expected a dict")
    size = blk.get("size")
    if not isinstance(size, int) or size < 0:
        raise SnapshotError(path, f"wrong structure: {where} has no integer 'size'")
    for key in ("size", "address", "requested_size"):
        _in_range(path, where, key, blk.get(key))
    state = blk.get("state", "active_allocated")
    if not isinstance(state, str) or state not in _BLOCK_STATES:
        raise SnapshotError(path, f"wrong structure: {where} has unknown state {state!r}")
    if state in _PENDING_STATES:
        state = "active_pending_free"
    if "frames" in blk:
        frames = blk["frames"] or []
        requested = _int(blk.get("requested_size"), size)
    else:  # torch <= 2.0: what was allocated lives in a per-block history list
        history = blk.get("history") or []
        first = history[0] if history and isinstance(history[0], dict) else {}
        frames = first.get("frames") or []
        requested = _int(first.get("real_size"), _int(blk.get("requested_size"), size))
    if not isinstance(frames, list):
        raise SnapshotError(path, f"wrong structure: {where}['frames'] is not a list")
    if frames:
        _validate(path, f"{where}['frames']", frames, _FRAMES)
    return {
        "address": _int(blk.get("address"), next_address),
        "size": size,
        "requested_size": requested,
        "state": state,
        "frames": frames,
    }


def _normalise_segment(seg: Any, idx: int, path: Any) -> dict:
    where = f"segments[{idx}]"
    if not isinstance(seg, dict):
        raise SnapshotError(path, f"wrong structure: {where} is a {type(seg).__name__}, expected a dict")
    blocks = seg.get("blocks")
    if not isinstance(blocks, list):
        raise SnapshotError(path, f"wrong structure: {where} has no 'blocks' list")
    for key in ("address", "total_size", "device", "stream"):
        _in_range(path, where, key, seg.get(key))
    if _int(seg.get("device")) < 0:
        raise SnapshotError(path, f"wrong structure: {where}['device'] = {seg.get('device')} is not a device index")
    address = _int(seg.get("address"))
    out_blocks = []
    cursor = address
    for j, blk in enumerate(blocks):
        nb = _normalise_block(blk, f"{where}['blocks'][{j}]", path, cursor)
        out_blocks.append(nb)
        cursor = nb["address"] + nb["size"]
    total = seg.get("total_size")
    if not isinstance(total, int):
        total = sum(b["size"] for b in out_blocks)
    pool = seg.get("segment_pool_id", (0, 0))
    return {
        "device": _int(seg.get("device")),
        "address": address,
        "total_size": total,
        "stream": _int(seg.get("stream")),
        "segment_type": seg.get("segment_type") or ("small" if total <= 2 * 1024 * 1024 else "large"),
        "segment_pool_id": tuple(pool) if isinstance(pool, (list, tuple)) else (0, 0),
        "is_expandable": bool(seg.get("is_expandable", False)),
        "frames": seg.get("frames") or [],
        "blocks": out_blocks,
    }


def _entry_ok(e: Any) -> bool:
    return (
        type(e) is dict
        and type(e.get("action")) is str
        and type(e.get("size", 0)) is int
        and (type(e.get("addr")) is int or e.get("action") == "oom")
    )


def _check_traces(traces: Any, path: Any) -> list[list[dict]]:
    if traces is None:
        return []
    if not isinstance(traces, list):
        raise SnapshotError(path, f"wrong structure: 'device_traces' is a {type(traces).__name__}, expected a list")
    for d, entries in enumerate(traces):
        if entries is None:
            traces[d] = []
            continue
        if not isinstance(entries, list):
            raise SnapshotError(path, f"wrong structure: device_traces[{d}] is not a list")
        if not all(map(_entry_ok, entries)):
            i = next(i for i, e in enumerate(entries) if not _entry_ok(e))
            raise SnapshotError(
                path,
                f"wrong structure: device_traces[{d}][{i}] is not an entry with 'action', integer 'addr' and 'size'",
            )
        _validate(path, f"device_traces[{d}]", entries, _ENTRIES)
    return traces


def snapshot_from_object(obj: Any, path: str | Path | None = None) -> Snapshot:
    """Validate and normalise an already-unpickled snapshot (dict, or a bare list of segments)."""
    label = path if path is not None else "<snapshot>"
    bare = isinstance(obj, list)
    if bare:
        obj = {"segments": obj}
    if not isinstance(obj, dict):
        raise SnapshotError(
            label, f"wrong structure: top level is a {type(obj).__name__}, expected a dict or a list of segments"
        )
    segments = obj.get("segments")
    if not isinstance(segments, list):
        keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
        raise SnapshotError(
            label, f"wrong structure: no 'segments' list (top-level keys: {keys}); not a CUDA memory snapshot"
        )
    traces = obj.get("device_traces", obj.get("traces"))  # _memory_viz wraps bare lists with "traces"
    settings = obj.get("allocator_settings")
    annotations = obj.get("external_annotations")
    if isinstance(annotations, list):
        annotations = [a for a in annotations if isinstance(a, dict)]
        _validate(label, "external_annotations", annotations, _ANNOTATIONS)
    return Snapshot(
        path=str(path) if path is not None else None,
        segments=[_normalise_segment(s, i, label) for i, s in enumerate(segments)],
        device_traces=_check_traces(traces, label),
        allocator_settings=settings if isinstance(settings, dict) else {},
        external_annotations=annotations if isinstance(annotations, list) else [],
        bare_segment_list=bare,
    )


def load_snapshot(path: str | Path) -> Snapshot:
    """Read a ``_dump_snapshot`` pickle (plain or gzip) safely; raise :class:`SnapshotError` on any problem."""
    path = Path(path)
    data = _read(path)
    return snapshot_from_object(_bounded(_unpickle(path, data), path, len(data)), path)


# --------------------------------------------------------------------------- memory timeline


def _timeline_from_json(obj: Any, path: Path) -> MemoryTimeline:
    if not isinstance(obj, list) or not obj:
        raise SnapshotError(path, "wrong structure: expected a JSON list of [t, action, bytes, category] rows")
    if (
        len(obj) == 2
        and isinstance(obj[0], list)
        and isinstance(obj[1], list)
        and obj[1]
        and isinstance(obj[1][0], list)
    ):
        return _timeline_from_cumulative(obj[0], obj[1], path)
    try:
        rows = np.asarray(obj, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):
        raise SnapshotError(
            path, "wrong structure: memory timeline rows are not all [t, action, bytes, category] integers"
        ) from None
    if rows.ndim != 2 or rows.shape[1] != 4:
        raise SnapshotError(path, f"wrong structure: memory timeline rows have shape {rows.shape}, expected (n, 4)")
    if rows[:, 3].min() < 0 or rows[:, 3].max() >= len(TIMELINE_CATEGORIES):
        raise SnapshotError(path, "wrong structure: memory timeline category index out of range 0..7")
    return MemoryTimeline(
        str(path), rows[:, 0].copy(), rows[:, 1].astype(np.int8), rows[:, 2].copy(), rows[:, 3].astype(np.int8)
    )


def _timeline_from_cumulative(times: list, sizes: list, path: Path) -> MemoryTimeline:
    """``export_memory_timeline("x.json")``: times in µs, rows of 9 cumulative columns (col 0 unused)."""
    try:
        t = np.asarray(times, dtype=np.float64)
        s = np.asarray(sizes, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):
        raise SnapshotError(path, "wrong structure: [times, sizes] memory timeline holds non-numbers") from None
    if s.ndim != 2 or s.shape[1] != len(TIMELINE_CATEGORIES) + 1 or len(t) != len(s):
        raise SnapshotError(path, f"wrong structure: expected {len(t)} rows of 9 cumulative sizes, got shape {s.shape}")
    delta = np.diff(s[:, 1:], axis=0, prepend=np.zeros((1, s.shape[1] - 1), dtype=np.int64))
    row, cat = np.nonzero(delta)
    nbytes = delta[row, cat]
    return MemoryTimeline(
        str(path),
        (t[row] * 1000).astype(np.int64),
        np.where(nbytes > 0, 2, 4).astype(np.int8),
        nbytes,
        cat.astype(np.int8),
        form="cumulative",
    )


def load_memory_timeline(path: str | Path) -> MemoryTimeline:
    """Read an ``export_memory_timeline`` JSON (``.raw.json``, ``.raw.json.gz`` or the cumulative form)."""
    path = Path(path)
    data = _read(path)
    if not _looks_like_json(data):
        raise SnapshotError(path, f"not a JSON memory timeline (starts with {data[:8]!r})")
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        problem = "truncated JSON" if "truncated" in str(exc) else f"invalid JSON ({_short(exc)})"
        raise SnapshotError(path, problem) from None
    return _timeline_from_json(obj, path)


def load_memory(path: str | Path) -> Snapshot | MemoryTimeline:
    """Load either kind of memory input, deciding by content (gzip and name suffixes do not matter)."""
    path = Path(path)
    data = _read(path)
    if data[:1] != b"\x80" and _looks_like_json(data):
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            problem = "truncated JSON" if "truncated" in str(exc) else f"invalid JSON ({_short(exc)})"
            raise SnapshotError(path, problem) from None
        return _timeline_from_json(obj, path)
    return snapshot_from_object(_bounded(_unpickle(path, data), path, len(data)), path)
