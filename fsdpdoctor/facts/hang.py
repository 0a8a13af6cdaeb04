"""HangFacts: what the Flight Recorder dumps of a hung job say (``RunFacts.hang``; JSON ``hang``).

Filled by :mod:`fsdpdoctor.analysis.hang` from one dump per rank; read by the collective-hang rule
and the reports. Part of the report's contract like the rest of :mod:`fsdpdoctor.facts`: add
fields freely, rename none. Times are nanoseconds (``*_ns``, the recorder's clock: wall-clock
time of the host that wrote the dump) or seconds (``*_s``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: What ``HangFacts.kind`` can be, in the order the diagnosis tries them.
HANG_KINDS = ("mismatch", "missing", "late", "no_dump", "in_collective", "none")


@dataclass(slots=True)
class FrProcessGroup:
    """A process group as the dumps name it. ``ranks`` are its members (global ranks): from the
    dump's ``pg_config`` (``ranks_from`` "pg_config"), or, where that does not list them (gloo),
    the ranks whose dumps hold its collectives, or every rank for the default group
    (``ranks_from`` "dumps")."""

    name: str
    desc: str
    ranks: list[int] = field(default_factory=list)
    ranks_from: str = "pg_config"


@dataclass(slots=True)
class HangOp:
    """What one rank ran at the stuck collective. ``status``: "entered" (it ran the collective
    most ranks ran), "different" (another op, sizes or dtypes at the same sequence number),
    "not_entered" (its dump holds no such collective), "no_dump" (no readable dump). ``op`` is the
    operation (``all_gather``, ``_reduce_scatter_base``, ``send``...; "coalesced(a, b)" for a
    coalesced group); ``state`` scheduled / started / completed as recorded (gloo records
    ``scheduled`` only); ``late_s`` how long after the latest on-time rank it entered; ``fsdp``,
    ``phase``, ``step`` and ``unit`` what its stack says (``step``: the forward pass, counted from 1
    from the start of recording; ``unit``: the FSDP unit's position among the pass's all-gathers or
    reductions in this group, from 1); ``call_site`` the innermost frame outside torch."""

    rank: int
    status: str
    op: str | None = None
    profiling_name: str | None = None
    seq_id: int | None = None
    input_sizes: list[list[int]] = field(default_factory=list)
    output_sizes: list[list[int]] = field(default_factory=list)
    input_dtypes: list[str] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    state: str | None = None
    time_created_ns: int | None = None
    late_s: float | None = None
    fsdp: str | None = None
    phase: str | None = None
    step: int | None = None
    unit: int | None = None
    call_site: str | None = None


@dataclass(slots=True)
class LateRank:
    rank: int
    late_s: float  # entered this long after the latest of the ranks that were on time
    gap_s: float | None = None  # time between its previous collective in the group and this one
    others_gap_s: float | None = None  # the same for the on-time ranks (median)


@dataclass(slots=True)
class HangCulprit:
    """A rank the diagnosis holds responsible. ``kind`` missing / mismatch / late / no_dump;
    ``last_op`` its last recorded collective ("all_reduce #18 of default_pg, backward of step 2");
    ``stack`` the Python stack of the entry that matters (its different op, its late entry, its
    last collective), innermost first, ``name (file:line)``."""

    rank: int
    kind: str
    what: str
    last_op: str | None = None
    call_site: str | None = None
    fsdp: str | None = None
    phase: str | None = None
    step: int | None = None
    stack: list[str] = field(default_factory=list)


@dataclass(slots=True)
class DumpLedger:
    """One rank's dump: what it holds and what the diagnosis could not read from it."""

    rank: int
    entries: int = 0
    p2p_entries: int = 0
    states: dict[str, int] = field(default_factory=dict)  # entries per recorded state (gloo: all "scheduled")
    unrecorded_ops: int = 0  # ops op_id counted that no entry records (gloo's send/recv)
    unread_keys: list[str] = field(default_factory=list)  # top-level keys not read (nccl_comm_state, ...)
    steps_known: bool = True  # its forward passes are counted on FSDP's forward collectives


@dataclass(slots=True)
class RankProgress:
    """A rank's place in one process group: its last collective in the dump, and the last
    enqueued / started / completed sequence numbers its ``pg_status`` records (None where not
    recorded: gloo tracks no start, and marks a collective completed when it ends in an error)."""

    rank: int
    group: str
    last_seq: int | None = None
    last_op: str | None = None
    last_enqueued: int | None = None
    last_started: int | None = None
    last_completed: int | None = None


@dataclass(slots=True)
class HangFacts:
    """The diagnosis: ``kind`` (:data:`HANG_KINDS`), one ``summary`` line, the stuck collective
    (``process_group``, ``seq_id``, ``op``; p2p ops by ``p2p_seq_id`` when ``is_p2p``), what each
    rank ran there (``ops``), the ranks that never entered it (``missing_ranks``), entered late
    (``late_ranks``), ran something else (``mismatched_ranks``) or left no dump
    (``ranks_without_dump``), the ranks waiting in it (``waiting_ranks``), the ``culprits`` with
    their stacks, other groups stuck because of it (``also_stuck``, one line each) and every
    rank's progress per group."""

    kind: str = "none"
    summary: str = ""
    process_group: FrProcessGroup | None = None
    seq_id: int | None = None
    is_p2p: bool = False
    op: str | None = None
    ops: list[HangOp] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    late_ranks: list[LateRank] = field(default_factory=list)
    mismatched_ranks: list[HangOp] = field(default_factory=list)
    ranks_without_dump: list[int] = field(default_factory=list)
    waiting_ranks: list[int] = field(default_factory=list)
    culprits: list[HangCulprit] = field(default_factory=list)
    also_stuck: list[str] = field(default_factory=list)
    progress: list[RankProgress] = field(default_factory=list)
    dumps: int = 0
    world_size: int | None = None
    backend: str = ""
    versions: list[str] = field(default_factory=list)
    forms: list[str] = field(default_factory=list)  # "pickle" / "json"
    steps_from_start: bool = True  # steps count from the first collective (no dump's buffer wrapped)
    # the dump ledger: per rank, ops op_id counted that no entry records (gloo's send/recv)
    unrecorded_ops: dict[int, int] = field(default_factory=dict)
    dump_ledger: list[DumpLedger] = field(default_factory=list)
    caveat: str | None = None  # the culprits may be victims of ops the dumps do not record
    paths: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def culprit_ranks(self) -> list[int]:
        return sorted({c.rank for c in self.culprits})
