"""Per rank: a Flight Recorder dump reduced to what matching it across ranks needs (for
:mod:`fsdpdoctor.analysis.hang`, which explains the matching; this half runs in the worker
processes).

A :class:`RankView` holds one :class:`GroupSeqs` per process group the rank used: the collective
sequence numbers it recorded with a signature each (op, sizes, dtypes; the ops of a coalesced
group together; sizes left out for ops whose sizes differ by rank, such as all-to-all), the time
each was created and its state, the last :data:`DETAIL` of them op by op with what their stacks
say (:mod:`.hang_stacks`: FSDP operation, phase, forward pass, unit), and its p2p ops. Forward
passes are counted along the buffer: an entry in forward after one in backward or the optimizer
(or the first in forward) starts the next.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from typing import Any

import msgspec

from fsdpdoctor.errors import AnalysisBug, InputError
from fsdpdoctor.ingest.flight_recorder import MAX_RANKS, Dump, Frame, PgStatus, load_dump
from fsdpdoctor.analysis.hang.stacks import StackInfo, read_stack

DETAIL = 16  # last sequence numbers per group kept in full in a rank's view
STATE_CODE = {"scheduled": 0, "started": 1, "completed": 2}


class OpView(msgspec.Struct, gc=False):
    """One recorded op (a collective, or one op of a coalesced group, or a p2p op), with what its
    stack says."""

    op: str
    profiling_name: str
    seq: int
    p2p_seq: int
    is_p2p: bool
    input_sizes: list[list[int]]
    output_sizes: list[list[int]]
    input_dtypes: list[str]
    output_dtypes: list[str]
    state: str
    time_created_ns: int
    record_id: int
    stack: int = -1  # index into RankView.stacks
    phase: str = ""
    fsdp: str | None = None
    call_site: str | None = None
    pass_index: int = 0  # forward pass it belongs to (1 = the first the buffer holds; 0: before any)
    unit: int | None = None
    peer: int | None = None  # p2p: the peer's rank within the group
    duration_ms: float | None = None


class GroupSeqs(msgspec.Struct, gc=False):
    """One rank's collectives in one process group: a sequence number, signature id (into
    :attr:`RankView.sigs`), creation time and state code per recorded collective, in order."""

    name: str
    desc: str
    pg_id: int
    ranks: list[int] | None  # members from pg_config, when it lists them
    size: int | None  # members implied by the collectives' sizes (all-gather out/in), when any
    seqs: Any  # array('q'): compact, and no objects for the garbage collector to walk at 1,000 ranks
    sigs: Any  # array('i')
    times: Any  # array('q'), ns
    states: Any  # array('b'): 0 scheduled, 1 started, 2 completed
    detail: dict[int, list[OpView]]  # the last DETAIL sequence numbers, op by op
    p2p: list[OpView]
    partial_first: bool = False  # the buffer wrapped: the first collective may be cut (coalesced)


class RankView(msgspec.Struct, gc=False):
    path: str
    rank: int
    version: str
    form: str
    backend: str
    comm_lib_version: str | None
    wrapped: bool
    n_entries: int
    groups: list[GroupSeqs]
    sigs: list[Any]
    stacks: list[list[Frame]]
    pg_status: dict[str, PgStatus]
    pg_names: dict[str, list[str]]  # pg_id → [name, desc]
    last: OpView | None
    pg_config_names: list[str]
    steps_known: bool = True  # forward passes counted on FSDP's forward collectives (else: step unknown)
    unrecorded_ops: int = 0  # ops op_id counted that no entry records (gloo's send/recv)
    states: dict[str, int] = {}  # entries per recorded state
    n_p2p: int = 0
    unread_keys: list[str] = []


# --------------------------------------------------------------------------- one rank


def _numel(sizes: list[list[int]]) -> int:
    return sum(math.prod(s) for s in sizes)


def _size_free(op: str) -> bool:
    """Ops whose sizes legitimately differ across ranks: only op and dtypes are compared."""
    o = op.lower()
    return (
        "all_to_all" in o
        or "alltoall" in o
        or o.endswith("_v")
        or o.endswith("_v_single")
        or ("gather" in o and "all" not in o)
        or ("scatter" in o and "reduce" not in o)
    )


def _group_size(op: str, e: Any) -> int | None:
    o = op.lower()
    n_in, n_out = _numel(e.input_sizes), _numel(e.output_sizes)
    size = None
    if ("all_gather" in o or "allgather" in o) and n_in and n_out % n_in == 0:
        size = n_out // n_in
    elif "reduce_scatter" in o and n_out and n_in % n_out == 0:
        size = n_in // n_out
    return size if size is not None and 0 < size <= MAX_RANKS else None  # sizes no recorder writes: no group size


def _peer(profiling_name: str) -> int | None:
    """``nccl:send 0->1`` → 1, ``nccl:recv 1<-0`` → 0 (ranks within the group)."""
    meta = profiling_name.partition(" ")[2]
    for sep in ("->", "<-"):
        if sep in meta:
            try:
                return int(meta.split(sep)[1])
            except ValueError:
                return None
    return None


def view_of(path: str, rank: int | None = None, extra: set[tuple[str, str, int]] | None = None) -> RankView:
    """A rank's dump reduced to what the cross-rank matching needs (runs in a worker process);
    ``extra``: (group name, desc, sequence number) to keep in full besides the last ones."""
    return view_from_dump(load_dump(path, rank), extra)


def view_from_dump(d: Dump, extra: set[tuple[str, str, int]] | None = None) -> RankView:
    infos = [read_stack(s) for s in d.stacks]
    no_info = StackInfo("", None, None, None)
    entries = d.entries
    sig_ids: dict[Any, int] = {}
    esig_cache: dict[tuple, tuple] = {}  # (op, sizes as recorded) → the entry's signature, and its group size
    groups: dict[tuple[str, str], GroupSeqs] = {}
    members: dict[tuple[str, str], list[list[int]]] = {}  # per group, the entry indices of each collective
    p2p_idx: dict[tuple[str, str], list[int]] = {}
    open_parts: dict[tuple[str, str], list] = {}
    passes = [0] * len(entries)
    units: list[int | None] = [None] * len(entries)
    pass_i, last_fb = 0, None
    ordinal: dict[tuple, int] = {}
    seen_unit: dict[tuple, int] = {}
    wrapped = bool(entries) and entries[0].record_id > 0
    op_of: dict[str, str] = {}

    def close(key: tuple[str, str]) -> None:
        parts = open_parts.pop(key, None)
        if parts is not None:
            sig = parts[0] if len(parts) == 1 else ("coalesced", tuple(parts))
            groups[key].sigs.append(sig_ids.setdefault(sig, len(sig_ids)))

    for i, e in enumerate(entries):
        info = infos[e.stack] if 0 <= e.stack < len(infos) else no_info
        phase = info.phase
        if phase == "forward" and last_fb != "forward":
            pass_i += 1
        if phase in ("forward", "backward", "optimizer"):
            last_fb = phase
        passes[i] = pass_i if phase else 0
        key = e.process_group
        g = groups.get(key)
        if g is None:
            cfg = d.pg_config.get(key[0])
            g = groups[key] = GroupSeqs(
                key[0],
                key[1],
                e.pg_id,
                cfg.ranks if cfg is not None else None,
                None,
                array("q"),
                array("i"),
                array("q"),
                array("b"),
                {},
                [],
                partial_first=wrapped,
            )
            members[key] = []
        if info.fsdp_kind in ("unshard", "reduce"):
            ukey = (key, pass_i, phase, info.fsdp_kind)
            if seen_unit.get(ukey) != e.seq:
                ordinal[ukey] = ordinal.get(ukey, 0) + 1
                seen_unit[ukey] = e.seq
            units[i] = ordinal[ukey]
        if e.is_p2p:
            p2p_idx.setdefault(key, []).append(i)
            continue
        op = op_of.get(e.profiling_name)
        if op is None:
            op = op_of[e.profiling_name] = e.op
        ck = (op, repr(e.input_sizes), repr(e.output_sizes), tuple(e.input_dtypes), tuple(e.output_dtypes))
        hit = esig_cache.get(ck)
        if hit is None:
            esig = (
                (op, (), (), ck[3], ck[4])
                if _size_free(op)
                else (op, tuple(map(tuple, e.input_sizes)), tuple(map(tuple, e.output_sizes)), ck[3], ck[4])
            )
            hit = esig_cache[ck] = (esig, _group_size(op, e))
        esig, size = hit
        if size is not None and size > (g.size or 0):
            g.size = size
        parts = open_parts.get(key)
        if parts is not None and g.seqs[-1] == e.seq:  # another op of the same (coalesced) collective
            parts.append(esig)
            g.states[-1] = min(g.states[-1], STATE_CODE.get(e.state, 0))
            members[key][-1].append(i)
            continue
        close(key)
        open_parts[key] = [esig]
        g.seqs.append(e.seq)
        g.times.append(e.time_created_ns)
        g.states.append(STATE_CODE.get(e.state, 0))
        members[key].append([i])
    for key in list(open_parts):
        close(key)

    made: dict[int, OpView] = {}

    def view(i: int) -> OpView:  # OpViews only for the entries kept
        v = made.get(i)
        if v is None:
            e = entries[i]
            info = infos[e.stack] if 0 <= e.stack < len(infos) else no_info
            v = made[i] = OpView(
                e.op,
                e.profiling_name,
                e.seq,
                e.p2p_seq,
                bool(e.is_p2p),
                e.input_sizes,
                e.output_sizes,
                e.input_dtypes,
                e.output_dtypes,
                e.state,
                e.time_created_ns,
                e.record_id,
                e.stack,
                info.phase,
                info.fsdp,
                info.call_site,
                passes[i],
                units[i],
                _peer(e.profiling_name) if e.is_p2p else None,
                e.duration_ms,
            )
        return v

    # the last DETAIL collectives of each group in full (and any asked for), every p2p op, the last op
    for key, g in groups.items():
        want = {q for n, ds, q in (extra or ()) if (n, ds) == key}
        idx = members[key]
        for j, seq in enumerate(g.seqs):
            if j >= len(g.seqs) - DETAIL or seq in want:
                g.detail[seq] = [view(i) for i in idx[j]]
        g.p2p = [view(i) for i in p2p_idx.get(key, [])]
    # A step number only where the dump establishes it: forward passes are counted on FSDP's
    # forward all-gathers; a run whose forward passes record no FSDP collective (DDP records none
    # in forward) never moves the counter, so its steps are unknown, not "step 1".
    starts = [i for i in range(len(entries)) if passes[i] and (i == 0 or passes[i - 1] != passes[i])]
    steps_known = bool(starts) and all(
        any(
            (infos[entries[j].stack] if 0 <= entries[j].stack < len(infos) else no_info).fsdp_kind == "unshard"
            for j in range(i, len(entries))
            if passes[j] == passes[i]
        )
        for i in starts
    )
    if not steps_known:
        passes = [0] * len(entries)
        for v in made.values():
            v.pass_index = 0
    # ops the recorder counted (op_id, per group) and did not record: gloo records no send/recv, so
    # its op_id runs ahead of collective_seq_id. Gloo only: NCCL's op_id legitimately runs ahead
    # on the ops of a coalesced group (one sequence number, an op_id each) and counts p2p apart.
    unrecorded: dict[tuple[str, str], int] = {}
    for e in entries:
        if e.backend == "gloo" and not e.is_p2p and e.op_id > 0 and e.seq is not None:
            unrecorded[e.process_group] = max(unrecorded.get(e.process_group, 0), e.op_id - e.seq)
    last_view = view(len(entries) - 1) if entries else None
    used: dict[int, int] = {}
    for v in made.values():
        if v.stack >= 0 and v.stack not in used:
            used[v.stack] = len(used)
    for v in made.values():
        v.stack = used.get(v.stack, -1)
    stacks = [d.stacks[i] for i in sorted(used, key=used.get)]
    names: dict[str, list[str]] = {}
    for e in entries:
        names.setdefault(str(e.pg_id), list(e.process_group))
    sigs = [None] * len(sig_ids)
    for sg, i in sig_ids.items():
        sigs[i] = sg
    return RankView(
        d.path,
        d.rank,
        d.version,
        d.form,
        d.backend,
        d.comm_lib_version,
        wrapped,
        len(entries),
        list(groups.values()),
        sigs,
        stacks,
        d.pg_status,
        names,
        last_view,
        sorted(d.pg_config),
        steps_known,
        sum(v for v in unrecorded.values() if v > 0),
        dict(Counter(e.state for e in entries)),
        sum(1 for e in entries if e.is_p2p),
        list(d.unread_keys),
    )


def view_task(path: str, rank: int | None = None) -> RankView | InputError:
    """:func:`view_of` as a worker runs it: the InputError returned, not raised; anything else is
    a bug, raised naming the file."""
    try:
        return view_of(path, rank)
    except InputError as exc:
        return exc
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise AnalysisBug.of(path, exc) from exc
