"""Read PyTorch Flight Recorder dumps: the per-rank ring buffer of collectives a hung job leaves.

A dump is what ``torch._C._distributed_c10d._dump_fr_trace()`` returns, or what the watchdog
writes at a timeout (``TORCH_FR_DUMP_ON_TIMEOUT`` / ``TORCH_NCCL_DUMP_ON_TIMEOUT``) to
``<prefix><rank>`` (``TORCH_FR_DUMP_TEMP_FILE`` / ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; default
``/tmp/nccl_trace_rank_``, torchtitan ``<dump_folder>/comm_trace(s)/rank_``): one pickled dict
per rank. ``_dump_fr_trace_json()`` gives the same without stacks as JSON (state times 0 instead
of None, ``pg_status`` values as strings). Both are recognised by content, whatever their names
(:func:`sniff`); the rank is the number the file name ends in (``<prefix><rank>``).

The pickle is loaded with the refusing unpickler and limits of :mod:`._pickle` (never code
execution; bounded size, memory and work). Fields by version (``version`` key; the C++
``FlightRecorder.hpp`` / ``TraceUtils.h`` constants), all read with defaults:

* 1.x: ``seq_id`` (not yet split into collective and p2p), ``op_id``, ``process_group`` (name,
  desc), ``profiling_name``, ``time_created_ns``, ``input_sizes`` / ``output_sizes``, ``state``,
  ``time_discovered_started_ns`` / ``_completed_ns``, ``retired``, ``frames``, ``duration_ms``
  (``TORCH_NCCL_ENABLE_TIMING``); top level ``entries``, ``version``, ``pg_config``,
  ``nccl_comm_state``.
* 2.x: ``collective_seq_id`` and ``p2p_seq_id``, ``is_p2p``, ``input_dtypes`` /
  ``output_dtypes``, ``timeout_ms``; top level ``pg_status`` (per pg_id: last enqueued / started
  / completed collective); 2.7 ``nccl_version``; ops inside coalesced groups one entry each
  (sharing the ``collective_seq_id``); 2.10 ``comm_lib_version`` (was ``nccl_version``),
  ``thread_id``, ``thread_name``. Minor versions only add fields: 2.x newer than 2.10 is read
  the same way, a major version other than 1 or 2 is refused.

Gloo records too (``gloo:all_gather``), every entry in state ``scheduled`` (no start / completion
tracking), and its ``pg_config`` does not name the groups its entries use (torch 2.13: one entry
keyed ``''``), so group members are inferred from the dumps (:mod:`fsdpdoctor.analysis.hang`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import msgspec

from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest._io import convert_checked, open_input, read_input, short
from fsdpdoctor.ingest._pickle import PICKLE_MAGIC, load_plain_pickle, looks_like_json

__all__ = [
    "FrError",
    "Dump",
    "Entry",
    "Frame",
    "PgConfig",
    "PgStatus",
    "sniff",
    "load_dump",
    "dumps_in",
    "rank_of",
    "DUMP_SUBDIRS",
    "NEWEST_VERSION",
]

#: The newest dump version whose fields this reader knows (torch 2.13 writes it).
NEWEST_VERSION = (2, 10)
#: Sub-folders looked into when a folder is given (torchtitan: ``<dump_folder>/comm_trace(s)/rank_<r>``).
DUMP_SUBDIRS = ("comm_trace", "comm_traces")
SNIFF_BYTES = 64 << 10
# What reading a dump walks (entries, and frames counted at every reference) is bounded by its size:
# a real dump holds one entry per ~100+ bytes and its frames are shared (memo) dicts.
WALK_ITEMS_PER_BYTE = 8
WALK_FLOOR = 4_000_000


class FrError(InputError):
    """A Flight Recorder dump cannot be read; ``str(err)`` is ``"<file>: <problem>"``."""


_I63 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
_S64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class Frame(msgspec.Struct, gc=False, frozen=True):
    """One Python (or C++) frame of the stack that enqueued a collective; innermost first."""

    name: str = ""
    filename: str = ""
    line: _S64 = 0


class Entry(msgspec.Struct, gc=False):
    """One recorded collective, every version's fields under their 2.10 names.

    ``seq`` is ``collective_seq_id`` (``seq_id`` in 1.x, which counted p2p ops too); ``state``
    is scheduled / started / completed; ``started_ns`` / ``completed_ns`` are None where not
    discovered (JSON writes 0); ``stack`` indexes :attr:`Dump.stacks` (-1: none recorded)."""

    record_id: _I63
    profiling_name: str
    time_created_ns: _S64 = 0
    process_group: tuple[str, str] = ("", "")
    pg_id: _S64 = 0
    seq: _I63 | None = msgspec.field(default=None, name="collective_seq_id")
    seq_v1: _I63 | None = msgspec.field(default=None, name="seq_id")
    p2p_seq: _I63 = msgspec.field(default=0, name="p2p_seq_id")
    op_id: _S64 = 0
    is_p2p: bool | None = None
    input_sizes: list[list[_S64]] = []
    output_sizes: list[list[_S64]] = []
    input_dtypes: list[str] = []
    output_dtypes: list[str] = []
    state: str = "scheduled"
    started_ns: _S64 | None = msgspec.field(default=None, name="time_discovered_started_ns")
    completed_ns: _S64 | None = msgspec.field(default=None, name="time_discovered_completed_ns")
    retired: bool | None = None
    timeout_ms: _S64 | None = None
    duration_ms: float | None = None
    thread_name: str | None = None
    stack: int = -1

    @property
    def backend(self) -> str:
        return self.profiling_name.partition(":")[0] if ":" in self.profiling_name else ""

    @property
    def op(self) -> str:
        """``nccl:_all_gather_base`` → ``_all_gather_base``; ``nccl:send 0->1`` → ``send``."""
        name = self.profiling_name.partition(":")[2] or self.profiling_name
        return name.split(" ", 1)[0]


class PgConfig(msgspec.Struct, gc=False):
    name: str = ""
    desc: str = ""
    ranks: list[int] | None = None  # None: not recorded (gloo records '[]' under the name '')


class PgStatus(msgspec.Struct, gc=False):
    last_enqueued: int | None = None
    last_started: int | None = None
    last_completed: int | None = None


class Dump(msgspec.Struct, gc=False):
    """One rank's dump, normalised. ``entries`` in record order (the buffer's oldest first);
    ``stacks`` the distinct stacks (innermost frame first)."""

    path: str
    rank: int
    version: str
    form: str  # "pickle" / "json"
    backend: str  # nccl / gloo / ... (from the entries' profiling names); "" with no entries
    comm_lib_version: str | None = None
    pg_config: dict[str, PgConfig] = {}
    pg_status: dict[str, PgStatus] = {}
    entries: list[Entry] = []
    stacks: list[list[Frame]] = []
    unread_keys: list[str] = []  # top-level keys the analysis does not read (nccl_comm_state, ...)

    @property
    def version_tuple(self) -> tuple[int, int]:
        return _version(self.version) or (0, 0)


# --------------------------------------------------------------------------- recognising dumps


#: the top-level keys of a dump that are read
READ_KEYS = frozenset({"version", "pg_config", "pg_status", "entries", "comm_lib_version", "nccl_version"})


def sniff(head: bytes) -> str | None:
    """ "pickle" or "json" when ``head`` (a file's first, gunzipped bytes) starts a Flight
    Recorder dump, else None. A pickled dict whose first keys are a dump's (``version`` and
    ``pg_config`` in 2.x, ``entries`` with a ``profiling_name`` in 1.x); a JSON object with
    ``pg_config`` or an entry's ``profiling_name`` and no ``traceEvents`` (a Kineto trace)."""
    if head[:2] in PICKLE_MAGIC:
        return "pickle" if (b"pg_config" in head or b"profiling_name" in head) else None
    start = head.lstrip()[:1]
    if start == b"{" and b'"traceEvents"' not in head and (b'"pg_config"' in head or b'"profiling_name"' in head):
        return "json"
    return None


def _head(p: Path) -> bytes:
    try:
        with open_input(p, "Flight Recorder dump", FrError) as st:
            return st.read(SNIFF_BYTES)
    except (InputError, OSError):
        return b""


def is_dump(p: Path) -> bool:
    return sniff(_head(p)) is not None


def dumps_in(directory: Path, exclude: set[Path] | frozenset[Path] = frozenset()) -> list[Path]:
    """The Flight Recorder dumps directly in ``directory`` and in its torchtitan sub-folders
    (:data:`DUMP_SUBDIRS`), by content, in rank order (then name); ``exclude``: files already
    taken as traces."""
    out: list[Path] = []
    for d in [directory, *(directory / s for s in DUMP_SUBDIRS)]:
        try:
            files = sorted(q for q in d.iterdir() if q.is_file() and q not in exclude)
        except OSError:
            continue
        out.extend(q for q in files if is_dump(q))
    return sorted(out, key=lambda q: (rank_of(q) if rank_of(q) is not None else 1 << 62, str(q)))


_RANK = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle|bin|dump|txt))?(?:\.gz)?$", re.IGNORECASE)


def rank_of(p: Path | str) -> int | None:
    """The rank a dump belongs to: the number its name ends in (``<prefix><rank>``, as the
    watchdog names them; ``.json`` / ``.pkl`` / ``.gz`` suffixes allowed)."""
    m = _RANK.search(Path(str(p)).name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- reading one dump


def _version(v: Any) -> tuple[int, int] | None:
    if not isinstance(v, str):
        return None
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", v)
    return (int(m.group(1)), int(m.group(2))) if m else None


#: more ranks than any job runs with: a rank id or a group size implied past it is not believed
#: (the hang diagnosis lists the ranks without a dump, ``range(world)``)
MAX_RANKS = 1 << 20


def _ranks(value: Any) -> list[int] | None:
    """``pg_config[..]["ranks"]``: the string ``"[0, 1, 2]"`` torch writes (or a list); None
    when it names a rank id of ``MAX_RANKS`` or more."""
    if isinstance(value, list) and all(type(x) is int for x in value):
        out = list(value)
    elif isinstance(value, str):
        nums = re.findall(r"-?\d+", value)
        if len(nums) > 1_000_000:
            return None
        out = [int(x) for x in nums if len(x) <= 20]
        if len(out) < len(nums):
            return None
    else:
        return None
    return out if out and max(out) < MAX_RANKS else None


def _int_or_none(v: Any) -> int | None:
    if type(v) is int:
        return v
    if isinstance(v, str) and re.fullmatch(r"-?\d{1,19}", v.strip()):
        return int(v)
    return None


def _validate(path: Any, where: str, value: Any, typ: Any) -> Any:
    return convert_checked(value, typ, lambda msg: FrError(path, msg), where)


_ENTRIES = list[Entry]
_FRAMES = list[Frame]


def _decode(path: Path, data: bytes) -> tuple[Any, str]:
    if data[:2] in PICKLE_MAGIC or data[:1] == b"\x80":
        return load_plain_pickle(path, data, "a Flight Recorder dump", FrError), "pickle"
    if looks_like_json(data):
        try:
            return msgspec.json.decode(data), "json"
        except msgspec.DecodeError as exc:
            raise FrError(
                path, "truncated JSON" if "truncated" in str(exc) else f"invalid JSON ({short(exc)})"
            ) from None
        except RecursionError:
            raise FrError(path, "JSON nested too deeply") from None
    raise FrError(path, f"not a Flight Recorder dump (neither a pickle nor JSON: starts with {data[:8]!r})")


def load_dump(path: str | Path, rank: int | None = None) -> Dump:
    """Read one rank's dump (pickle or JSON, plain or gzip'd) and normalise it; raise
    :class:`FrError` naming the file and the problem on anything else. ``rank``: the rank it
    belongs to, when not the number its name ends in."""
    path = Path(path)
    data = read_input(path, "Flight Recorder dump", FrError)
    if not data:
        raise FrError(path, "empty file")
    obj, form = _decode(path, data)
    return dump_from_object(obj, path, form, len(data), rank)


def dump_from_object(
    obj: Any, path: str | Path, form: str = "pickle", nbytes: int = 0, rank: int | None = None
) -> Dump:
    """Validate and normalise an already-decoded dump (see :func:`load_dump`)."""
    if rank is None:
        rank = rank_of(path)
        if rank is None:
            raise FrError(
                path,
                "cannot tell which rank wrote this dump: its name does not end in the rank "
                "(the watchdog writes <prefix><rank>, e.g. nccl_trace_rank_3)",
            )
    if not isinstance(obj, dict):
        raise FrError(path, f"not a Flight Recorder dump: the top level is a {type(obj).__name__}, not a dict")
    if "version" not in obj or ("entries" not in obj and "pg_config" not in obj):
        keys = ", ".join(sorted(map(str, obj))[:6]) or "none"
        hint = " (a CUDA memory snapshot? give it with --memory)" if "segments" in obj else ""
        raise FrError(path, f"not a Flight Recorder dump: no 'version' and 'entries' (top-level keys: {keys}){hint}")
    version = obj.get("version")
    vt = _version(version)
    if vt is None:
        raise FrError(
            path,
            f"unknown Flight Recorder dump version {short(ValueError(repr(version)))[:40]} (expected 'MAJOR.MINOR')",
        )
    if vt[0] not in (1, 2):
        raise FrError(
            path,
            f"Flight Recorder dump version {vt[0]}.{vt[1]} is not one this fsdpdoctor reads "
            f"(1.x to {NEWEST_VERSION[0]}.{NEWEST_VERSION[1]}); a newer fsdpdoctor may",
        )
    raw_entries = obj.get("entries", [])
    if not isinstance(raw_entries, list):
        raise FrError(path, f"wrong structure: 'entries' is a {type(raw_entries).__name__}, expected a list")
    _bounded(path, raw_entries, nbytes)
    entries = _validate(path, "entries", raw_entries, _ENTRIES)
    stacks = _stacks(path, raw_entries, entries)
    for e in entries:
        if e.is_p2p is None:
            e.is_p2p = e.op in ("send", "recv")
        if e.seq is None:  # 1.x: one counter for collectives and p2p ops
            e.seq = e.seq_v1 or 0
            if e.is_p2p:
                e.p2p_seq = e.seq
        if form == "json":  # JSON writes 0 where the pickle writes None
            e.started_ns = e.started_ns or None
            e.completed_ns = e.completed_ns or None
    return Dump(
        path=str(path),
        rank=rank,
        version=f"{vt[0]}.{vt[1]}",
        form=form,
        backend=_backend(entries),
        comm_lib_version=_str(obj.get("comm_lib_version", obj.get("nccl_version"))),
        pg_config=_pg_config(obj.get("pg_config")),
        pg_status=_pg_status(obj.get("pg_status")),
        entries=entries,
        stacks=stacks,
        unread_keys=sorted(str(k) for k in obj if k not in READ_KEYS),
    )


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _backend(entries: list[Entry]) -> str:
    counts: dict[str, int] = {}
    for e in entries:  # by profiling name first: a few distinct names, thousands of entries
        counts[e.profiling_name] = counts.get(e.profiling_name, 0) + 1
    by_backend: dict[str, int] = {}
    for name, n in counts.items():
        b = name.partition(":")[0] if ":" in name else ""
        by_backend[b] = by_backend.get(b, 0) + n
    return max(by_backend, key=by_backend.get) if by_backend else ""


def _pg_config(raw: Any) -> dict[str, PgConfig]:
    out: dict[str, PgConfig] = {}
    if not isinstance(raw, dict):
        return out
    for key, v in raw.items():
        if not isinstance(v, dict):
            continue
        name = v.get("name") if isinstance(v.get("name"), str) else str(key)
        desc = v.get("desc") if isinstance(v.get("desc"), str) else ""
        out[str(key)] = PgConfig(name=name, desc=desc, ranks=_ranks(v.get("ranks")))
    return out


def _pg_status(raw: Any) -> dict[str, PgStatus]:
    out: dict[str, PgStatus] = {}
    if not isinstance(raw, dict):
        return out
    for key, v in raw.items():
        if isinstance(v, dict):
            out[str(key)] = PgStatus(
                _int_or_none(v.get("last_enqueued_collective")),
                _int_or_none(v.get("last_started_collective")),
                _int_or_none(v.get("last_completed_collective")),
            )
    return out


def _bounded(path: Any, raw_entries: list, nbytes: int) -> None:
    """Refuse a dump whose shared references (pickle memo) make reading it cost far more than its
    size: entries and frames are counted at every reference."""
    limit = max(WALK_FLOOR, WALK_ITEMS_PER_BYTE * nbytes)
    n = len(raw_entries)
    if n <= limit:
        for e in raw_entries:
            fr = e.get("frames") if isinstance(e, dict) else None
            if isinstance(fr, list):
                n += len(fr)
                if n > limit:
                    break
    if n > limit:
        raise FrError(
            path,
            f"refused: its shared references (pickle memo) expand to more than {limit:.3g} entries "
            f"and frames from {nbytes} bytes; a Flight Recorder dump this size holds far fewer",
        )


def _stacks(path: Any, raw_entries: list, entries: list[Entry]) -> list[list[Frame]]:
    """The distinct stacks of the entries (``Entry.stack`` set to its index). Frames are shared
    dicts in a real pickle, so a stack is keyed by the identities of its frames (cheap), then
    by content."""
    stacks: list[list[Frame]] = []
    by_ids: dict[tuple[int, ...], int] = {}
    by_content: dict[tuple[Frame, ...], int] = {}
    for i, (raw, e) in enumerate(zip(raw_entries, entries)):
        frames = raw.get("frames")
        if not isinstance(frames, list) or not frames:
            continue
        key = tuple(map(id, frames))
        idx = by_ids.get(key)
        if idx is None:
            conv = tuple(_validate(path, f"entries[{i}]['frames']", frames, _FRAMES))
            idx = by_content.get(conv)
            if idx is None:
                idx = by_content[conv] = len(stacks)
                stacks.append(list(conv))
            by_ids[key] = idx
        e.stack = idx
    return stacks
