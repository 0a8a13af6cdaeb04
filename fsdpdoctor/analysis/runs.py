"""Do the rank traces come from one run? Inputs of different jobs (a folder holding rank 3 of an
8-rank A100 job and rank 1 of a 2-rank V100 job) would otherwise be read as one run, and every
cross-rank figure (stragglers, wait skew, per-rank tables) would compare unrelated machines.

Ranks of one run agree on the world size, the device model, the process-group backend and the
NCCL version (``distributedInfo``), and their traces start within minutes of each other (one
profiler schedule, counted in steps). :func:`differences` lists what disagrees, naming the files.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import PurePath

from fsdpdoctor.facts import RankFacts

#: Traces of one run start within this many seconds of each other (profilers on every rank follow
#: the same step schedule; ranks start minutes apart at most, even on slow clusters)
MAX_START_GAP_S = 3600.0

#: (what, RankFacts attribute) compared between ranks; None means "not recorded", never a difference
IDENTITY = (("world size", "world_size"), ("device", "device_name"), ("backend", "backend"), ("NCCL", "nccl_version"))


def differences(ranks: list[RankFacts]) -> list[str]:
    """What tells the first rank's run from another's, for the first rank that differs (empty
    when all look like one run): e.g. ``["world size 8 (control-rank-3.json.gz) vs 2
    (test-rank-1.json.gz)", "traces start 8.5 days apart (...)"]``."""
    if len(ranks) < 2:
        return []
    ref = ranks[0]
    for other in ranks[1:]:
        out = []
        for what, attr in IDENTITY:
            a, b = getattr(ref, attr), getattr(other, attr)
            if a is not None and b is not None and a != b:
                out.append(f"{what} {a} ({_name(ref)}) vs {b} ({_name(other)})")
        if ref.start_unix_s is not None and other.start_unix_s is not None:
            gap = abs(other.start_unix_s - ref.start_unix_s)
            if gap > MAX_START_GAP_S:
                out.append(
                    f"traces start {_span(gap)} apart ({_when(ref.start_unix_s)} and {_when(other.start_unix_s)})"
                )
        if out:
            return out
    return []


def _name(r: RankFacts) -> str:
    return PurePath(r.path).name


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _span(seconds: float) -> str:
    hours = seconds / 3600
    return f"{hours:.1f} hours" if hours < 48 else f"{hours / 24:.1f} days"
