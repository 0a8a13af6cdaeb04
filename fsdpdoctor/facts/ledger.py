"""The input ledger's facts: what each input holds and what the analysis read of it
(:mod:`fsdpdoctor.ingest.ledger` fills them; see docs/inputs.md)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class LedgerRow:
    """The events of one phase (``ph``) and category (``cat``, as the file writes it)."""

    ph: str
    cat: str
    events: int
    used: int  # how many the analysis reads
    read_as: str | None = None  # the category the analysis reads them under (``Kernel`` -> ``kernel``); None: unread
    # summed durations of the complete events (ms); None where not measured (phases without a
    # duration, complete events of a category dropped on reading)
    dur_ms: float | None = None
    used_ms: float | None = None
    notable: int = 0  # of these, events that look like GPU work, profiler steps or communication
    why: str = ""  # for an unread kind: why it is not read, or what it is


@dataclass(slots=True)
class InputLedger:
    """Every event of one input, counted by phase and category, with what the analysis read."""

    events: int = 0
    used: int = 0
    rows: list[LedgerRow] = field(default_factory=list)
    # the kinds (``ph/cat``) the analysis reads none of
    unread_kinds: list[str] = field(default_factory=list)
    # events that look like GPU/device work, profiler steps or communication, and how many of
    # those the analysis reads none of (their share: unread_notable_pct)
    notable: int = 0
    unread_notable: int = 0
    unread_notable_pct: float | None = None
    device_events: int = 0  # GPU or other accelerator work, read or not (0: the file has none)
    # the headline's line when the unread share of notable events is 1% or more, else None
    warning: str | None = None
    # the time the read GPU work covers over the whole trace (ms; None without any): the union of
    # the kernel, copy and set intervals, and of the communication kernels' (analysis.comms)
    gpu_busy_ms: float | None = None
    comm_busy_ms: float | None = None
