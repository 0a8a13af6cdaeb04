"""The caching allocator, replayed: block sizes, lifetimes and reserved memory per trace event.

Trace entries carry the *requested* size; the allocator hands out larger blocks (512-byte
rounding, and large-pool blocks are not split when ≤ 1 MiB would remain). The block size is
recovered from the address layout: a block starts at the beginning of a free run, which ends at
the next live block or the segment end. Blocks still alive at the end use their exact size.
*Allocated* follows ``torch.cuda.memory_allocated()``: a block counts from ``alloc`` until
``free_requested``; from then until ``free_completed`` it is *pending*. *Reserved* replays
``segment_alloc/map`` − ``segment_free/unmap`` backwards from the final segments.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdpdoctor.ingest.snapshot import Snapshot

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to 1 MiB use the small pool; large blocks keep ≤ 1 MiB tails


# =========================================================================== allocator arithmetic


def round_size(size: int, divisions: dict | None = None) -> int:
    """The caching allocator's ``round_size`` (512-byte multiples, or power-of-2 divisions if configured)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions:
        index = min(max(size.bit_length() - 1 - 20, 0), 15)  # intervals start at 1 MiB
        div = int(divisions.get(str(1 << index), 0) or 0)
        if div > 1 and size > MIN_BLOCK * div:
            if size & (size - 1) == 0:
                return size
            floor = 1 << (size.bit_length() - 1)
            step = floor >> (div.bit_length() - 1)
            if step == 0:
                return floor << 1
            rounded_floor = size & ~(step - 1)
            return size if rounded_floor == size else rounded_floor + step
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


# =========================================================================== trace replay

NEVER = np.iinfo(np.int64).max // 4  # free index of blocks alive at the end


@dataclass
class Replay:
    n: int
    addr: np.ndarray
    size: np.ndarray
    requested: np.ndarray
    alloc_idx: np.ndarray  # -1: allocated before recording
    free_req: np.ndarray  # -1: free requested before recording; NEVER: not freed
    free_done: np.ndarray
    frames: list  # allocation stack per block (list of frame dicts)
    entry_category: list  # `category` of pseudo-snapshot entries, else None
    pseudo: bool  # made by _memory_viz._profile_to_snapshot: no caching allocator behind it
    reserved: np.ndarray  # after each event
    reserved_seed: int
    ooms: list[dict]
    notes: list[str]


class _LiveBlocks:
    """Sorted start addresses of active (allocated or pending) blocks, for free-run lookups."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.block: dict[int, int] = {}

    def add(self, addr: int, bid: int) -> None:
        bisect.insort(self.starts, addr)
        self.block[addr] = bid

    def remove(self, addr: int) -> None:
        del self.block[addr]
        del self.starts[bisect.bisect_left(self.starts, addr)]

    def next_start_after(self, addr: int) -> int | None:
        j = bisect.bisect_right(self.starts, addr)
        return self.starts[j] if j < len(self.starts) else None


class _Segments:
    """Non-expandable segment ranges, replayed alongside the trace."""

    def __init__(self, ends: dict[int, int]):
        self.end = dict(ends)
        self.starts = sorted(self.end)

    def add(self, addr: int, size: int) -> None:
        if addr not in self.end:
            bisect.insort(self.starts, addr)
        self.end[addr] = addr + size

    def remove(self, addr: int) -> None:
        if self.end.pop(addr, None) is not None:
            del self.starts[bisect.bisect_left(self.starts, addr)]

    def containing(self, addr: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0:
            return None
        start = self.starts[i]
        end = self.end[start]
        return (start, end) if addr < end else None


@dataclass
class _BlockSizer:
    """Recover the allocator block size of an allocation from the free run it was carved from."""

    segments: _Segments
    live: _LiveBlocks
    expandable: bool
    max_split: int
    divisions: dict | None
    exact: bool  # no caching allocator (profiler pseudo-snapshot): block = request

    def size(self, addr: int, requested: int) -> int:
        if self.exact:
            return requested
        rounded = round_size(requested, self.divisions)
        if self.expandable or requested <= SMALL_SIZE:
            return rounded  # small pool / expandable segments split whenever ≥ 512 B would remain
        seg = self.segments.containing(addr)
        if seg is None:
            return rounded
        nxt = self.live.next_start_after(addr)
        limit = seg[1] if nxt is None else min(seg[1], nxt)
        run = limit - addr
        if run < rounded:
            return rounded
        oversize = self.max_split > 0 and rounded >= self.max_split
        if oversize or run - rounded <= SMALL_SIZE:
            return run  # the allocator did not split off the tail
        return rounded


def replay(snap: Snapshot, device: int, trace: list[dict]) -> Replay:
    n = len(trace)
    segs_dev = [s for s in snap.segments if s["device"] == device]
    settings = snap.allocator_settings
    max_split = settings.get("max_split_size", -1)
    max_split = max_split if isinstance(max_split, int) else -1
    divisions = settings.get("roundup_power2_divisions")
    divisions = divisions if isinstance(divisions, dict) else None
    notes: list[str] = []

    # segment ranges as they were when recording started: undo the recorded cudaMalloc/cudaFree
    ends = {s["address"]: s["address"] + s["total_size"] for s in segs_dev if not s["is_expandable"]}
    seg_delta = np.zeros(n, dtype=np.int64)
    first_event: dict[int, dict] = {}  # address -> its first alloc/free entry
    for i in range(n - 1, -1, -1):
        e = trace[i]
        a = e["action"]
        if a in ("alloc", "free_requested", "free_completed"):
            first_event[e["addr"]] = e  # overwritten going backwards -> first in time
        elif a == "segment_alloc":
            ends.pop(e["addr"], None)
            seg_delta[i] = e["size"]
        elif a == "segment_free":
            ends[e["addr"]] = e["addr"] + e["size"]
            seg_delta[i] = -e["size"]
        elif a == "segment_map":
            seg_delta[i] = e["size"]
        elif a == "segment_unmap":
            seg_delta[i] = -e["size"]
    reserved_end = sum(s["total_size"] for s in segs_dev)
    reserved_seed = reserved_end - int(seg_delta.sum())
    reserved = reserved_seed + np.cumsum(seg_delta)
    if n and not seg_delta.any():
        notes.append("no cudaMalloc/cudaFree recorded: reserved memory was constant during recording")

    segments = _Segments(ends)
    live = _LiveBlocks()
    pseudo = any("category" in e for e in trace)
    sizer = _BlockSizer(segments, live, snap.expandable_segments, max_split, divisions, exact=pseudo)

    addr: list[int] = []
    size: list[int] = []
    req: list[int] = []
    alloc_idx: list[int] = []
    free_req: list[int] = []
    free_done: list[int] = []
    frames: list = []
    entry_cat: list = []

    def new_block(a: int, sz: int, rq: int, ai: int, fr: int, fd: int, frm: list, cat: Any = None) -> int:
        addr.append(a)
        size.append(sz)
        req.append(rq)
        alloc_idx.append(ai)  # noqa: E702
        free_req.append(fr)
        free_done.append(fd)
        frames.append(frm)
        entry_cat.append(cat)  # noqa: E702
        return len(addr) - 1

    # seed: blocks alive at the end that the trace never touches were alive throughout
    end_live = {b["address"]: b for s in segs_dev for b in s["blocks"] if b["state"] != "inactive"}
    for a, b in end_live.items():
        if a not in first_event:
            pending = b["state"] == "active_pending_free"
            bid = new_block(a, b["size"], b["requested_size"], -1, -1 if pending else NEVER, NEVER, b["frames"])
            live.add(a, bid)
    # seed: addresses whose first event is a free were allocated before recording (or before the
    # ring buffer wrapped); their block size is recovered once all seeds are in place
    freed_seeds = []
    for a in sorted(first_event):
        e = first_event[a]
        if e["action"] != "alloc" and a not in live.block:
            pending = e["action"] == "free_completed"  # its free_requested happened before recording
            freed_seeds.append(new_block(a, 0, e["size"], -1, -1 if pending else NEVER, NEVER, []))
            live.add(a, freed_seeds[-1])
    for bid in freed_seeds:
        size[bid] = sizer.size(addr[bid], req[bid])

    ooms = []
    for i, e in enumerate(trace):
        act = e["action"]
        if act == "alloc":
            a = e["addr"]
            old = live.block.get(a)
            if old is not None:  # a free fell out of the record: close the old block here
                free_req[old] = min(free_req[old], i)
                free_done[old] = i
                live.remove(a)
            bid = new_block(
                a, sizer.size(a, e["size"]), e["size"], i, NEVER, NEVER, e.get("frames") or [], e.get("category")
            )
            live.add(a, bid)
        elif act == "free_requested":
            bid = live.block.get(e["addr"])
            if bid is not None and free_req[bid] == NEVER:
                free_req[bid] = i
        elif act == "free_completed":
            a = e["addr"]
            bid = live.block.get(a)
            if bid is not None:
                if free_req[bid] == NEVER:
                    free_req[bid] = i
                free_done[bid] = i
                live.remove(a)
        elif act == "segment_alloc":
            segments.add(e["addr"], e["size"])
        elif act == "segment_free":
            segments.remove(e["addr"])
        elif act == "oom":
            ooms.append({"index": i, "largest_cached_free_block_bytes": _largest_free_run(segments, live, size, sizer)})

    # blocks still open must match the final segments: take their exact size and stack from there
    inconsistent = resized = 0
    for a, bid in live.block.items():
        b = end_live.get(a)
        if b is None:
            inconsistent += 1
        elif alloc_idx[bid] >= 0:
            resized += size[bid] != b["size"]
            size[bid], req[bid] = b["size"], b["requested_size"]
            frames[bid] = frames[bid] or b["frames"]  # context="state" keeps stacks only on live blocks
    if inconsistent:
        notes.append(f"{inconsistent} blocks open at the end of the trace are not in the final segments")
    if resized:
        notes.append(f"{resized} blocks alive at the end had a block size other than the one inferred from the trace")

    as_i8 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return Replay(
        n=n,
        addr=as_i8(addr),
        size=as_i8(size),
        requested=as_i8(req),
        alloc_idx=as_i8(alloc_idx),
        free_req=as_i8(free_req),
        free_done=as_i8(free_done),
        frames=frames,
        entry_category=entry_cat,
        pseudo=pseudo,
        reserved=reserved,
        reserved_seed=reserved_seed,
        ooms=ooms,
        notes=notes,
    )


def _largest_free_run(segments: _Segments, live: _LiveBlocks, size: list[int], sizer: _BlockSizer) -> int | None:
    """Largest contiguous cached-free range inside non-expandable segments right now."""
    if sizer.expandable or not segments.starts:
        return None
    best = 0
    for start in segments.starts:
        end = segments.end[start]
        cursor = start
        j = bisect.bisect_left(live.starts, start)
        while j < len(live.starts) and live.starts[j] < end:
            a = live.starts[j]
            best = max(best, a - cursor)
            cursor = max(cursor, a + size[live.block[a]])
            j += 1
        best = max(best, end - cursor)
    return best


def state_series(r: Replay) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Allocated and pending bytes after each event, and their values before the first event."""
    n = r.n
    d_alloc = np.zeros(n + 1, dtype=np.int64)
    d_pend = np.zeros(n + 1, dtype=np.int64)
    traced = r.alloc_idx >= 0
    np.add.at(d_alloc, r.alloc_idx[traced], r.size[traced])
    req_in = (r.free_req >= 0) & (r.free_req < n)
    np.add.at(d_alloc, r.free_req[req_in], -r.size[req_in])
    np.add.at(d_pend, r.free_req[req_in], r.size[req_in])
    done_in = (r.free_done >= 0) & (r.free_done < n)
    np.add.at(d_pend, r.free_done[done_in], -r.size[done_in])
    seed_alloc = int(r.size[(r.alloc_idx < 0) & (r.free_req >= 0)].sum())
    seed_pend = int(r.size[(r.alloc_idx < 0) & (r.free_req < 0)].sum())
    return seed_alloc + np.cumsum(d_alloc[:n]), seed_pend + np.cumsum(d_pend[:n]), seed_alloc, seed_pend
