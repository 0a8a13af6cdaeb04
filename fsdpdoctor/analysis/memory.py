"""Memory facts from a CUDA allocator snapshot or a profiler memory timeline.

Method (see ``notes/memory-categorization.md``):

1. Per device, replay ``device_traces`` over a seed of blocks that were alive before recording
   started (live at the end with no event at their address, or freed without a recorded alloc).
   *Allocated* follows ``torch.cuda.memory_allocated()``: a block counts from ``alloc`` until
   ``free_requested``; from then until ``free_completed`` it is *pending* (freed by Python, still
   in use by another stream). *Reserved* replays ``segment_alloc/map`` − ``segment_free/unmap``
   backwards from the final segments.
2. Trace entries carry the *requested* size; the allocator hands out larger blocks (512-byte
   rounding, and large-pool blocks are not split when ≤ 1 MiB would remain). The block size is
   recovered from the address layout: a block starts at the beginning of a free run, which ends at
   the next live block or the segment end. Blocks still alive at the end use their exact size.
   Allocated bytes, categories and internal fragmentation are therefore in allocator (block) bytes.
3. The peak is the first maximum of allocated bytes. At the peak, reserved = requested +
   internal fragmentation (rounding) + pending frees + external fragmentation (cached free blocks).
4. Blocks live at the peak are categorised from their allocation stack (innermost matching
   frame wins; FSDP1, FSDP2 in ``_composable/fsdp`` (2.4) and ``_fully_shard`` (2.6+), torch.optim,
   activation checkpointing), then by lifetime relative to the forward / backward / optimizer
   phase they were allocated in: phases come from stack markers (and ``external_annotations``),
   frameless events inherit the phase before them (backward allocations on the autograd thread
   have no Python frames). Checkpoint recomputation (``checkpoint.py`` ``unpack_hook`` /
   ``recompute_fn``) is backward, and the frameless events after it too; ``zero_grad`` starts an
   idle phase (the next step's inputs are not optimizer memory), and so do main-thread frames
   without a marker after backward (the next micro-batch). When the recording stops inside
   forward (OOM, dump), a forward block alive at a later FSDP unit boundary is an activation;
   blocks allocated since the last boundary take the fate of the block at the same position and
   size in the previous unit. At an OOM, what the failing statement allocated from the user's own
   line (a cast such as ``logits.float()`` in the loss: no torch frame) is that statement's
   temporary, not an activation. FSDP1's per-parameter gradients are recognised by their
   concatenation into the flat gradient; an unsharded-size backward block that autograd frees
   before FSDP's next event is a gradient-accumulation temporary.
5. Blocks allocated before recording are reported as pre-existing and attributed by size where the
   trace shows parameter-shaped sizes (optimizer state created in the trace, FSDP unsharded sizes
   divided by the world size recovered from reduce-scatter input/output pairs, or long-lived
   gradients), split between parameters and optimizer state by multiplicity (Adam keeps two
   states per parameter; without an optimizer step in the trace, by the number of parameters
   per size that the first complete forward pass all-gathers). The rest goes to ``other``.
6. Two peaks: the allocated peak (``max_memory_allocated``: a block counts until
   ``free_requested``) names the instant of ``categories``; memory_viz's active peak (until
   ``free_completed``) has its own categories. The README's memory section has the semantics.

Non-FSDP runs: resident full parameters are counted as ``parameters_sharded`` (the persistent
parameter storage); ``parameters_unsharded`` is reserved for FSDP's transient all-gathered copies.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..ingest.snapshot import (
    TIMELINE_CATEGORIES,
    MemoryTimeline,
    Snapshot,
    load_memory,
    snapshot_from_object,
)
from ..facts import MEMORY_CATEGORIES as CATEGORIES
from ..facts import MemoryFacts

__all__ = ["CATEGORIES", "MemoryFacts", "analyze_memory", "analyze_snapshot", "analyze_timeline", "round_size"]

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to 1 MiB use the small pool; large blocks keep ≤ 1 MiB tails
CURVE_POINTS = 500
TOP_SITES = 10

# profiler Category (export index order) -> ours
_TIMELINE_TO_CATEGORY = {
    "PARAMETER": "parameters_sharded",
    "OPTIMIZER_STATE": "optimizer_state",
    "INPUT": "other",
    "TEMPORARY": "temporary",
    "ACTIVATION": "activations",
    "GRADIENT": "gradients",
    "AUTOGRAD_DETAIL": "temporary",
    "UNKNOWN": "other",
}
# `category` on trace entries of _memory_viz._profile_to_snapshot pseudo-snapshots
_PROFILE_ENTRY_CATEGORY = {k.lower(): v for k, v in _TIMELINE_TO_CATEGORY.items()}


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


# =========================================================================== stack frames

# labels beyond CATEGORIES that need lifetime to decide
_RS = "rs"  # reduce-scatter input (buffer) or output (sharded gradient)
_OPT = "optim"  # inside an optimizer step: state if it survives the step, else temporary

_FSDP2_DIRS = ("torch/distributed/fsdp/_fully_shard/", "torch/distributed/_composable/fsdp/")
_FSDP1_DIR = "torch/distributed/fsdp/"

_FSDP2_RULES = {
    "_fsdp_collectives.py": {
        "foreach_all_gather": "allgather_buffers",
        "_get_param_all_gather_inputs": "allgather_buffers",
        "foreach_all_gather_copy_out": "parameters_unsharded",
        "foreach_reduce": _RS,
        "foreach_reduce_scatter": _RS,
    },
    "_fsdp_param.py": {
        "alloc_storage": "parameters_unsharded",
        "init_all_gather_outputs": "parameters_unsharded",
        "alloc_all_gather_outputs": "parameters_unsharded",
        "init_unsharded_param": "parameters_unsharded",
        "_init_sharded_param": "parameters_sharded",
        "reset_sharded_param": "parameters_sharded",
        "to_sharded_post_forward": "parameters_sharded",
        "to_accumulated_grad_if_needed": "gradients",
        "accumulate_unsharded_grad_if_needed": "gradients",
        "all_gather_inputs": "allgather_buffers",
    },
}
_FSDP1_RULES = {
    "_flat_param.py": {
        "_alloc_padded_unsharded_flat_param": "parameters_unsharded",
        "unshard": "parameters_unsharded",
        "_all_gather_flat_param": "parameters_unsharded",
        "_use_low_precision_shard": "allgather_buffers",
        "flatten_tensors": "parameters_sharded",
        "flatten_tensors_into_flat_param": "parameters_sharded",
        "_init_flat_param_and_metadata": "parameters_sharded",
        "_get_shard": "parameters_sharded",
        "_get_unpadded_shard": "parameters_sharded",
        "shard": "parameters_sharded",
        "_use_unsharded_grad_views": "gradients",
        "_use_sharded_grad_views": "gradients",
        "prepare_gradient_for_backward": "gradients",
        "prepare_gradient_for_optim": "gradients",
    },
    "_runtime_utils.py": {
        "_get_reduce_scatter_tensors": _RS,
        "_reduce_grad": _RS,
        "_reduce_grad_no_shard": _RS,
        "_post_backward_hook": _RS,
        "_cast_grad_to_param_dtype": "gradients",
        "_accumulate_sharded_grad": "gradients",
        "_unshard": "parameters_unsharded",
    },
}
_OPTIM_STATE_FUNCS = {"_init_group", "load_state_dict", "_process_value_according_to_param_policy"}
#: optimizer file stem -> states kept per parameter (besides the parameter)
_OPTIM_STATES = {
    "adam": 2,
    "adamw": 2,
    "nadam": 2,
    "radam": 2,
    "adamax": 2,
    "adadelta": 2,
    "sgd": 1,
    "adagrad": 1,
    "rmsprop": 1,
    "rprop": 2,
    "asgd": 2,
}

_BACKWARD_PY = {
    ("torch/_tensor.py", "backward"),
    ("torch/autograd/__init__.py", "backward"),
    ("torch/autograd/__init__.py", "grad"),
    ("torch/autograd/__init__.py", "_make_grads"),
    ("torch/autograd/graph.py", "_engine_run_backward"),
}
_FSDP_BACKWARD_FUNCS = {
    "pre_backward",
    "post_backward",
    "_pre_backward",
    "_post_backward",
    "_pre_backward_hook",
    "_post_backward_hook",
    "_root_post_backward_final_callback",
    "_post_backward_final_callback",
    "foreach_reduce",
    "_reduce_grad",
    "backward",
}
_FSDP_FORWARD_FUNCS = {"pre_forward", "post_forward", "_pre_forward", "_post_forward", "_pre_forward_unshard"}
#: torch/utils/checkpoint.py functions that run the recomputation in backward (non-reentrant:
#: unpack_hook -> recompute_fn on the autograd thread; reentrant: CheckpointFunction.backward)
_RECOMPUTE_FUNCS = {"unpack_hook", "recompute_fn", "_recompute", "backward"}
_CPP_BACKWARD = re.compile(
    r"torch::autograd::(Engine::|generated::\w+Backward|AccumulateGrad)|^<built-in method run_backward "
)
# _memory_viz._profile_to_snapshot writes Python frames as {"filename": "none", "line": 0, "name": "path(line): func"}
_PROFILER_FRAME = re.compile(r"^(?P<path>[^()]+\.py)\((?P<line>\d+)\): (?P<func>.+)$")

PH_UNKNOWN, PH_FORWARD, PH_BACKWARD, PH_OPTIM, PH_RECOMPUTE, PH_IDLE = 0, 1, 2, 3, 4, 5
# PH_RECOMPUTE: checkpoint recomputation (module forwards run inside backward); PH_IDLE: from
# zero_grad to the next forward (the input batch is loaded there: it is not optimizer memory)
_PHASE_NAMES = {
    PH_UNKNOWN: None,
    PH_FORWARD: "forward",
    PH_BACKWARD: "backward",
    PH_OPTIM: "optimizer",
    PH_RECOMPUTE: "backward",
    PH_IDLE: None,
}
# which marker wins when one stack carries several (recompute runs module forwards in backward)
_PHASE_PRIORITY = (PH_IDLE, PH_OPTIM, PH_RECOMPUTE, PH_BACKWARD, PH_FORWARD)


@dataclass(frozen=True)
class _FrameInfo:
    label: str | None  # rule label when this frame decides the category
    phase: int  # phase marker carried by this frame
    python: bool
    in_torch: bool
    site: str
    fsdp: str | None  # "fsdp1" / "fsdp2" when the frame is FSDP code
    optimizer: str | None  # torch.optim file stem
    autograd: bool = False  # torch/autograd/ code (custom Function.backward runs under it)
    script: bool = False  # a script's top level (`<module>`): the bottom of a main-thread stack


def _short_path(path: str) -> str:
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    if path.startswith("torch/"):
        return path
    i = path.find("/torch/")
    if i >= 0:
        return path[i + 1 :]
    parts = path.rsplit("/", 2)
    return "/".join(parts[-2:])


@lru_cache(maxsize=1 << 16)
def _frame_info(filename: str, name: str, line: int) -> _FrameInfo:
    if line == 0 and filename in ("none", "") and (m := _PROFILER_FRAME.match(name)):
        filename, name, line = m["path"], m["func"], int(m["line"])
    path = filename.replace("\\", "/")
    python = line > 0
    base = path.rsplit("/", 1)[-1]
    label = None
    phase = PH_UNKNOWN
    fsdp = None
    optimizer = None
    in_torch = "/torch/" in path or path.startswith("torch/")
    if python and in_torch:
        if any(d in path for d in _FSDP2_DIRS):
            fsdp = "fsdp2"
            label = _FSDP2_RULES.get(base, {}).get(name)
        elif _FSDP1_DIR in path:
            fsdp = "fsdp1"
            label = _FSDP1_RULES.get(base, {}).get(name)
        if fsdp:
            if name in _FSDP_BACKWARD_FUNCS:
                phase = PH_BACKWARD
            elif name in _FSDP_FORWARD_FUNCS:
                phase = PH_FORWARD
        if path.endswith("torch/optim/optimizer.py") and name == "zero_grad":
            phase = PH_IDLE  # frees gradients; what follows belongs to the next step
        elif "torch/optim/" in path or "torch/distributed/optim/" in path:
            phase = PH_OPTIM
            optimizer = base[:-3] if "torch/optim/" in path else None
            label = "optimizer_state" if name in _OPTIM_STATE_FUNCS else _OPT
        elif path.endswith("torch/utils/checkpoint.py"):
            # forward under checkpoint is plain forward (lifetime decides); recomputation is backward
            if name in _RECOMPUTE_FUNCS:
                phase = PH_RECOMPUTE
        elif any(path.endswith(p) and name == f for p, f in _BACKWARD_PY):
            phase = PH_BACKWARD
        elif path.endswith("torch/nn/modules/module.py") and name in ("_call_impl", "_wrapped_call_impl"):
            phase = PH_FORWARD
    elif not python and _CPP_BACKWARD.search(name):
        phase = PH_BACKWARD
    site = f"{name} ({_short_path(path)}:{line})" if python else name
    return _FrameInfo(
        label, phase, python, in_torch, site, fsdp, optimizer, python and "torch/autograd/" in path, name == "<module>"
    )


@dataclass(frozen=True)
class _Stack:
    """What one allocation/free stack says: its phase marker, rule label and allocation site."""

    phase: int = PH_UNKNOWN
    label: str | None = None
    site: str | None = None
    fsdp: str | None = None
    optimizer: str | None = None
    # no phase marker, nothing from torch/autograd, and the stack bottoms out at a script's top
    # level: the main thread, which is blocked in backward while the autograd thread runs it (whose
    # Python hooks have no `<module>` frame), so such a stack is outside backward
    main_thread: bool = False
    # Python frames, none of them in torch: the user's own line allocated it (a cast, an
    # elementwise op, a tensor creation), not a module, a functional or an optimizer
    user_only: bool = False


_NO_STACK = _Stack()


def _summarize(key: tuple) -> _Stack:
    infos = [_frame_info(str(f), str(n), int(ln or 0)) for f, n, ln in key]
    phases = {i.phase for i in infos}
    phase = next((ph for ph in _PHASE_PRIORITY if ph in phases), PH_UNKNOWN)
    hit = next((i for i in infos if i.label is not None), None)  # innermost matching frame wins
    if hit is not None:
        site = hit.site
    else:
        python = [i for i in infos if i.python]
        user = [i for i in python if not i.in_torch]
        site = (user or python)[0].site if python else None
    return _Stack(
        phase=phase,
        label=hit.label if hit else None,
        site=site,
        fsdp=next((i.fsdp for i in infos if i.fsdp), None),
        optimizer=next((i.optimizer for i in infos if i.optimizer), None),
        main_thread=phase == PH_UNKNOWN
        and any(i.script for i in infos if i.python)
        and not any(i.autograd for i in infos),
        user_only=any(i.python for i in infos) and not any(i.in_torch for i in infos if i.python),
    )


class _StackCache:
    """Stacks repeat (same code path, same frames): summarise each distinct one once."""

    def __init__(self) -> None:
        self.seen: dict[tuple, _Stack] = {}

    def __call__(self, frames: list | None) -> _Stack:
        if not frames:
            return _NO_STACK
        key = tuple([(f.get("filename", ""), f.get("name", ""), f.get("line", 0)) for f in frames])
        st = self.seen.get(key)
        if st is None:
            st = self.seen[key] = _summarize(key)
        return st


# =========================================================================== trace replay

NEVER = np.iinfo(np.int64).max // 4  # free index of blocks alive at the end


@dataclass
class _Replay:
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


def _replay(snap: Snapshot, device: int, trace: list[dict]) -> _Replay:
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
    return _Replay(
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


def _state_series(r: _Replay) -> tuple[np.ndarray, np.ndarray, int, int]:
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


# =========================================================================== phases & categories


def _event_phases(
    trace: list[dict], stacks: _StackCache, times: np.ndarray | None, annotations: list[dict], device: int
) -> np.ndarray:
    """forward / backward / optimizer per trace entry, from stack markers and annotations."""
    n = len(trace)
    phase = np.fromiter((stacks(e.get("frames")).phase for e in trace), dtype=np.int8, count=n)
    if times is not None and annotations and (phase == PH_UNKNOWN).any() and (np.diff(times) >= 0).all():
        for start, end, ph in _annotation_intervals(annotations, device):
            lo, hi = np.searchsorted(times, [start, end], side="left")
            seg = phase[lo:hi]
            seg[seg == PH_UNKNOWN] = ph
    # frameless events (autograd thread, context off) take the phase of the last known event;
    # events before the first marker (model construction, data loading) stay unknown
    if not (phase != PH_UNKNOWN).any():
        return phase
    filled = _fill(phase)
    # main-thread code after backward (the next micro-batch's inputs) ends the backward phase
    main = np.fromiter((stacks(e.get("frames")).main_thread for e in trace), dtype=bool, count=n)
    after_backward = main & (phase == PH_UNKNOWN) & ((filled == PH_BACKWARD) | (filled == PH_RECOMPUTE))
    if after_backward.any():
        phase[after_backward] = PH_IDLE
        filled = _fill(phase)
    # frameless events after a recomputation are the autograd thread's backward ops, not recompute
    filled[(phase == PH_UNKNOWN) & (filled == PH_RECOMPUTE)] = PH_BACKWARD
    return filled


def _fill(phase: np.ndarray) -> np.ndarray:
    """Events without a marker take the phase of the last event with one."""
    known = phase != PH_UNKNOWN
    idx = np.where(known, np.arange(len(phase)), 0)
    np.maximum.accumulate(idx, out=idx)
    return phase[idx]


def _annotation_intervals(annotations: list[dict], device: int) -> list[tuple[float, float, int]]:
    opened: dict[str, float] = {}
    out = []
    for a in annotations:
        if not isinstance(a, dict) or a.get("device", device) != device or a.get("time_us") is None:
            continue
        name = str(a.get("name", ""))
        low = name.lower()
        ph = (
            PH_IDLE
            if low.startswith("optimizer.zero_grad")
            else PH_OPTIM
            if low.startswith("optimizer.")
            else PH_BACKWARD
            if "backward" in low
            else PH_FORWARD
            if "forward" in low
            else None
        )
        if ph is None:
            continue
        if a.get("stage") == "START":
            opened[name] = a["time_us"]
        elif a.get("stage") == "END" and name in opened:
            out.append((opened.pop(name), a["time_us"], ph))
    return out


def _times(trace: list[dict]) -> np.ndarray | None:
    t = [e.get("time_us") for e in trace]
    if not t or None in t:
        return None
    return np.asarray(t, dtype=np.float64)


def _run_ends(phase: np.ndarray) -> np.ndarray:
    """For each event, the index where its run of equal phase ends."""
    n = len(phase)
    change = np.flatnonzero(np.diff(phase)) + 1
    run_id = np.zeros(n, dtype=np.int64)
    run_id[change] = 1
    return np.append(change, n)[np.cumsum(run_id)]


def _pair_reduce_scatter(r: _Replay, rs_ids: list[int]) -> tuple[set[int], int | None]:
    """Reduce-scatter inputs (world_size × the output allocated right after them) and world_size."""
    inputs: set[int] = set()
    ratios: Counter = Counter()
    k = 0
    while k + 1 < len(rs_ids):
        a, b = rs_ids[k], rs_ids[k + 1]
        ra, rb = int(r.requested[a]), int(r.requested[b])
        if rb > 0 and ra % rb == 0 and ra // rb >= 2:
            inputs.add(a)
            ratios[ra // rb] += 1
            k += 2
        else:
            k += 1
    return inputs, (ratios.most_common(1)[0][0] if ratios else None)


@dataclass
class _Labels:
    category: list[str]
    site: list[str]
    pre_existing: np.ndarray  # bool per block
    fsdp: str | None
    world_size: int | None
    attributed: dict[str, int]  # pre-existing bytes per category (all pre-existing blocks)


def _forward_fates(
    r: _Replay, fwd: np.ndarray, open_ended: np.ndarray, rounded: dict[int, int], boundaries: np.ndarray
) -> dict[int, bool]:
    """Activation (True) or temporary (False) for forward blocks the recording cut off (OOM, dump
    mid-forward), decided by FSDP unit boundaries (module doc, step 4):

    * a block alive at a later unit boundary (FSDP pre_forward / unshard / reshard) is saved for
      backward: an activation;
    * blocks allocated since the last boundary take the fate of the block at the same position,
      with the same size, in the previous unit (transformer blocks repeat), else stay undecided.
    """
    if not len(boundaries):
        return {}
    alloc = r.alloc_idx[fwd]
    seg = np.searchsorted(boundaries, alloc, side="right")  # unit segment of each forward block
    nxt = np.append(boundaries, NEVER)[seg]  # the first boundary after the allocation
    survived = dict(zip(fwd.tolist(), (r.free_req[fwd] > nxt).tolist(), strict=True))
    crossed = dict(zip(fwd.tolist(), (nxt < NEVER).tolist(), strict=True))
    by_seg: dict[int, list[int]] = {}
    for b, sgm in zip(fwd.tolist(), seg.tolist(), strict=True):
        by_seg.setdefault(sgm, []).append(b)
    fates: dict[int, bool] = {}
    last = len(boundaries)
    prev = next((by_seg[k] for k in sorted(by_seg, reverse=True) if k < last and by_seg[k]), [])
    for j, b in enumerate(by_seg.get(last, [])):
        if open_ended[b] and j < len(prev) and rounded[prev[j]] == rounded[b]:
            fates[b] = survived[prev[j]]
    for b in fwd.tolist():
        if open_ended[b] and crossed[b]:
            fates[b] = True
    return fates


def _failing_statement_temps(r: _Replay, ev: list[_Stack], st: list[_Stack], open_ended: np.ndarray,
                             traced: np.ndarray) -> set[int]:
    """Blocks the statement that ran out of memory allocated from the user's own line (a cast such
    as ``logits.float()``, an elementwise op: no torch frame) and still held at the OOM: that
    statement's intermediates, which it frees once it completes (autograd keeps what torch's
    functions return, such as a log-softmax output, not these), so temporaries, however large.

    The statement is the run of trace events up to the OOM whose innermost user frame is the OOM's
    (frameless events, which C++ code records, inside the run)."""
    if not r.ooms:
        return set()
    i = int(r.ooms[-1]["index"])
    site = ev[i].site if 0 <= i < len(ev) else None
    if site is None:
        return set()
    j = i
    while j > 0 and ev[j - 1].site in (site, None):
        j -= 1
    return {
        b for b in traced.tolist()
        if open_ended[b] and j <= r.alloc_idx[b] < i and st[b].user_only and st[b].site == site
    }


def _concatenated_grads(r: _Replay, candidates: np.ndarray) -> set[int]:
    """FSDP1: autograd computes one gradient per original parameter, then the backward of the
    flat parameter's split concatenates them into the flat gradient and frees them at once. Blocks
    freed right after a candidate's allocation whose requested sizes add up to its size are those
    per-parameter gradients."""
    freed_at = {int(i): int(b) for b, i in enumerate(r.free_req.tolist()) if 0 <= i < r.n}
    completed = {int(i) for i in r.free_done.tolist() if 0 <= i < r.n}
    out: set[int] = set()
    for x in candidates.tolist():
        want, total, parts = int(r.requested[x]), 0, []
        j = int(r.alloc_idx[x]) + 1
        while (j in freed_at or j in completed) and total < want:
            b = freed_at.get(j)
            j += 1
            if b is None:  # free_completed of a free already counted
                continue
            if r.alloc_idx[b] >= r.alloc_idx[x]:
                break
            total += int(r.requested[b])
            parts.append(b)
        if total == want and len(parts) >= 2:
            out.update(parts)
    return out


def _label_blocks(r: _Replay, stacks: _StackCache, phase: np.ndarray, trace: list[dict]) -> _Labels:
    n = r.n
    run_end = _run_ends(phase) if n else np.zeros(0, dtype=np.int64)
    nb = len(r.addr)
    st = [stacks(f) for f in r.frames]
    pre = r.alloc_idx < 0
    seen = list(stacks.seen.values())  # every distinct stack, allocation and free
    fsdp_votes = Counter(x.fsdp for x in seen if x.fsdp)
    fsdp = fsdp_votes.most_common(1)[0][0] if fsdp_votes else None
    optimizers = {x.optimizer for x in seen if x.optimizer}
    ev = [stacks(e.get("frames")) for e in trace]
    ev_fsdp = np.flatnonzero(np.fromiter((x.fsdp is not None for x in ev), dtype=bool, count=n))
    # FSDP unit boundaries in forward: pre_forward / unshard / post_forward reshard events
    boundaries = np.flatnonzero(
        np.fromiter((x.fsdp is not None and x.phase == PH_FORWARD for x in ev), dtype=bool, count=n)
    )

    order = np.argsort(r.alloc_idx, kind="stable")
    rs_inputs, world_size = _pair_reduce_scatter(r, [int(b) for b in order if st[b].label == _RS and not pre[b]])
    # FSDP unsharded gradients have the unsharded parameter's size (FSDP1: minus the flat padding,
    # so compare allocator-rounded sizes)
    unsharded = {round_size(int(r.requested[b])) for b in range(nb) if st[b].label == "parameters_unsharded"}

    traced = np.flatnonzero(~pre)
    rounded = {int(b): round_size(int(r.requested[b])) for b in traced}
    short_lived = np.zeros(nb, dtype=bool)  # freed before the phase it was allocated in ended
    open_ended = np.zeros(nb, dtype=bool)  # alive when recording stopped inside its phase (OOM, dump)
    short_lived[traced] = r.free_req[traced] < run_end[r.alloc_idx[traced]]
    open_ended[traced] = (r.free_req[traced] >= n) & (run_end[r.alloc_idx[traced]] == n)
    block_phase = np.full(nb, PH_UNKNOWN, dtype=np.int8)
    block_phase[traced] = phase[r.alloc_idx[traced]]
    unlabeled = np.array([st[b].label is None for b in range(nb)], dtype=bool)
    fwd = traced[unlabeled[traced] & (block_phase[traced] == PH_FORWARD)]
    fates = _forward_fates(r, fwd, open_ended, rounded, boundaries) if fsdp else {}
    # what completed phases (and decided forward fates) teach about sizes, for blocks whose
    # lifetime the recording cut off
    seen_short: dict[int, set] = {k: set() for k in _PHASE_NAMES}
    seen_long: dict[int, set] = {k: set() for k in _PHASE_NAMES}
    for b in traced:
        if st[b].label is None and not open_ended[b]:
            (seen_short if short_lived[b] else seen_long)[int(block_phase[b])].add(rounded[b])
    for b, long in fates.items():
        (seen_long if long else seen_short)[PH_FORWARD].add(rounded[b])
    bwd = traced[unlabeled[traced] & (block_phase[traced] == PH_BACKWARD)]
    flat_grad_like = np.array([b for b in bwd.tolist() if rounded[b] in unsharded], dtype=np.int64)
    cat_grads = _concatenated_grads(r, flat_grad_like) if fsdp == "fsdp1" else set()
    # the first FSDP event (hook, collective, reshard) after each allocation
    next_fsdp = np.append(ev_fsdp, NEVER)[np.searchsorted(ev_fsdp, r.alloc_idx[traced], side="right")]
    next_fsdp_of = dict(zip(traced.tolist(), next_fsdp.tolist(), strict=True))
    bwd_set = set(bwd.tolist())
    # unsharded-size backward blocks: kept (gradient) or an accumulation addend (temporary: freed
    # before FSDP's next event); one the recording cut off is an addend while a same-sized
    # gradient kept by an earlier forward/backward pass (micro-batch) is still held
    unsharded_grad_kept: dict[int, bool] = {}
    is_fwd = phase == PH_FORWARD
    passes = np.cumsum(is_fwd & ~np.r_[False, is_fwd[:-1]]) if n else is_fwd  # forward passes so far
    last_kept: dict[int, int] = {}
    for b in order.tolist():
        if b in bwd_set and rounded[b] in unsharded:
            sz, i = rounded[b], int(r.alloc_idx[b])
            if open_ended[b]:
                k = last_kept.get(sz)
                held = k is not None and r.free_req[k] > i and passes[r.alloc_idx[k]] != passes[i]
                unsharded_grad_kept[b] = not held
            else:
                unsharded_grad_kept[b] = bool(r.free_req[b] >= next_fsdp_of[b])
                if unsharded_grad_kept[b]:
                    last_kept[sz] = b
    cat_sizes = {rounded[b] for b in cat_grads}
    rs_input_sizes = {rounded[b] for b in rs_inputs}
    stmt_temps = _failing_statement_temps(r, ev, st, open_ended, traced)

    def lifetime(b: int, ph: int, default_long: bool) -> bool:
        """Whether block b outlives its phase."""
        if not open_ended[b]:
            return not short_lived[b]
        if rounded[b] in seen_long[ph]:
            return True
        return False if rounded[b] in seen_short[ph] else default_long

    cats = ["other"] * nb
    site = [x.site for x in st]
    for b in traced:
        lab, ph = st[b].label, int(block_phase[b])
        if lab in CATEGORIES:
            cat = lab
        elif lab == _RS:  # an input cut off before its output was allocated (OOM) by an earlier input's size
            is_input = b in rs_inputs or (open_ended[b] and rounded[b] in rs_input_sizes)
            cat = "reduce_scatter_buffers" if short_lived[b] or is_input else "gradients"
        elif r.entry_category[b] in _PROFILE_ENTRY_CATEGORY:  # pseudo-snapshot: versions, not allocations
            cat = _PROFILE_ENTRY_CATEGORY[r.entry_category[b]]
        elif b in stmt_temps:
            cat = "temporary"
        elif lab == _OPT or ph == PH_OPTIM:
            cat = "optimizer_state" if lifetime(b, PH_OPTIM, True) else "temporary"
        elif ph == PH_FORWARD:
            long = fates[b] if b in fates else lifetime(b, ph, True)
            cat = "activations" if long else "temporary"
        elif ph == PH_RECOMPUTE:  # recomputed saved tensors live into the backward ops that use them
            cat = "activations" if lifetime(b, ph, True) else "temporary"
        elif ph == PH_BACKWARD:
            # FSDP: gradients are recognised by size (unsharded; a same-sized block that autograd
            # frees before FSDP's next hook is a gradient-accumulation temporary), by the
            # concatenation into FSDP1's flat gradient, or by stack (reduce-scatter output), so an
            # unexplained backward block cut off by the recording is most likely a temporary
            if fsdp is not None and rounded[b] in unsharded:
                cat = "gradients" if unsharded_grad_kept.get(b, True) else "temporary"
            elif b in cat_grads or (open_ended[b] and rounded[b] in cat_sizes):  # cut off before the concat
                cat = "gradients"
            else:
                cat = "gradients" if lifetime(b, ph, fsdp is None) else "temporary"
        else:  # PH_IDLE / unknown: inputs loaded between steps (after zero_grad) or before any marker
            cat = "temporary" if short_lived[b] else "other"
        cats[b] = cat
        if site[b] is None:
            site[b] = f"<no Python frames: {_PHASE_NAMES[ph] or 'unknown phase'}>"
    for b in np.flatnonzero(pre):
        site[b] = site[b] or "<allocated before recording>"
    attributed = _attribute_pre_existing(r, cats, pre, fsdp, world_size, optimizers, phase)
    return _Labels(cats, site, pre, fsdp, world_size, attributed)


def _shard_divisor(unsharded: set[int], pre_sizes: Counter) -> int | None:
    """The divisor d from unsharded to sharded parameter sizes (the world size, or half of it when
    unsharded parameters are bf16 copies of fp32 shards): the one that maps unsharded sizes onto
    the most bytes of blocks alive since before recording (two blocks at least)."""
    best: tuple[int, int | None] = (0, None)
    for d in range(2, 1025):
        sizes = _shards_of(unsharded, d)
        blocks = sum(pre_sizes[s] for s in sizes)
        got = sum(s * pre_sizes[s] for s in sizes)
        if blocks >= 2 and got > best[0]:
            best = (got, d)
    return best[1]


def _shards_of(unsharded, d: int) -> set[int]:
    return {u * f // d for u in unsharded for f in (1, 2) if (u * f) % d == 0}


def _params_per_shard_size(
    r: _Replay, cats: list[str], phase: np.ndarray, divisor: int, pre_sizes: Counter
) -> Counter:
    """How many parameters have each sharded size: FSDP all-gathers every parameter (FSDP1: every
    flat parameter) once in a forward pass, so count the unsharded allocations of the first
    complete forward pass."""
    bwd = np.flatnonzero((phase == PH_BACKWARD) | (phase == PH_RECOMPUTE))
    if not len(bwd):
        return Counter()
    per_u = Counter(
        int(r.requested[b])
        for b in range(len(cats))
        if cats[b] == "parameters_unsharded" and 0 <= r.alloc_idx[b] < bwd[0] and phase[r.alloc_idx[b]] == PH_FORWARD
    )
    out: Counter = Counter()
    for u, k in per_u.items():
        for s in _shards_of({u}, divisor):
            if s in pre_sizes:
                out[s] += k
    return out


def _attribute_pre_existing(
    r: _Replay,
    cats: list[str],
    pre: np.ndarray,
    fsdp: str | None,
    world_size: int | None,
    optimizers: set[str],
    phase: np.ndarray,
) -> dict[str, int]:
    """Give pre-existing blocks a category where their size is parameter-shaped (see module doc)."""
    n = r.n
    traced = ~pre
    pre_alive = np.flatnonzero(pre & (r.free_req >= n))
    opt_sizes = {int(r.requested[b]) for b in np.flatnonzero(traced) if cats[b] == "optimizer_state"}
    param_sizes: set[int] = set()
    pre_sizes = Counter(int(r.requested[b]) for b in pre_alive)
    per_size_params: Counter = Counter()
    if fsdp:
        unsharded = {int(r.requested[b]) for b in np.flatnonzero(traced) if cats[b] == "parameters_unsharded"}
        if world_size:
            param_sizes |= {u // world_size for u in unsharded if u % world_size == 0}
        # no reduce-scatter yet (OOM or dump in the first forward): the divisor that fits
        divisor = _shard_divisor(unsharded, pre_sizes) if unsharded else None
        if divisor and not world_size:
            param_sizes |= _shards_of(unsharded, divisor)
        if divisor and not optimizers:  # optimizer state from before the recording, no step in it
            per_size_params = _params_per_shard_size(r, cats, phase, divisor, pre_sizes)
        # FSDP1's sharded flat parameter has the size of its sharded (reduce-scattered) gradient
        param_sizes |= {
            int(r.requested[b]) for b in np.flatnonzero(traced) if cats[b] == "gradients" and fsdp == "fsdp1"
        }
    else:
        param_sizes |= {
            int(r.requested[b]) for b in np.flatnonzero(traced) if cats[b] == "gradients" and r.free_req[b] >= n
        }
    n_states = max((_OPTIM_STATES.get(o, 0) for o in optimizers), default=0)

    always_alive = np.flatnonzero(pre & (r.free_req >= n))
    by_size: dict[int, list[int]] = {}
    for b in always_alive:
        by_size.setdefault(int(r.requested[b]), []).append(int(b))
    for s, ids in by_size.items():
        ids.sort(key=lambda b: int(r.addr[b]))
        if s in opt_sizes:  # the optimizer state of these parameters was created while recording
            for b in ids:
                cats[b] = "parameters_sharded"
            continue
        if s not in param_sizes:
            continue
        m = len(ids)
        k = per_size_params.get(s, 0)
        if not n_states and k and m % k == 0 and 2 <= m // k <= 4:
            n_params, n_opt = k, m - k  # the blocks beyond one per parameter: its optimizer state
        else:
            per_param = next((d for d in (1 + n_states, 2 + n_states, 1) if m % d == 0), 1)
            n_params = m // per_param
            n_opt = min(n_states * n_params, m - n_params)
        for j, b in enumerate(ids):
            cats[b] = (
                "parameters_sharded" if j < n_params else "optimizer_state" if j < n_params + n_opt else "gradients"
            )
    out: Counter = Counter()
    for b in np.flatnonzero(pre):
        out[cats[b]] += int(r.size[b])
    return {c: out[c] for c in CATEGORIES if out[c]}


# =========================================================================== assembling facts


def _categories(mask: np.ndarray, r: _Replay, labels: _Labels) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for b in np.flatnonzero(mask):
        out[labels.category[b]] += int(r.size[b])
    return out


def _top_sites(mask: np.ndarray, r: _Replay, labels: _Labels) -> list[tuple[str, int]]:
    c: Counter = Counter()
    for b in np.flatnonzero(mask):
        c[labels.site[b]] += int(r.size[b])
    return [(s, int(v)) for s, v in c.most_common(TOP_SITES)]


def _downsample(x: np.ndarray, alloc: np.ndarray, reserved: np.ndarray | None, x_unit: str) -> dict:
    n = len(alloc)
    if n <= CURVE_POINTS:
        idx = np.arange(n)
    else:  # per bucket keep the highest point, so the peak survives
        bounds = np.linspace(0, n, CURVE_POINTS + 1).astype(np.int64)
        idx = np.array(
            [lo + int(np.argmax(alloc[lo:hi])) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo]
        )
    return {
        "x_unit": x_unit,
        "x": [float(v) if x_unit == "time_us" else int(v) for v in x[idx]],
        "allocated": [int(v) for v in alloc[idx]],
        "reserved": [int(v) for v in reserved[idx]] if reserved is not None else [None] * len(idx),
    }


def _segment_totals(segs: list[dict]) -> dict[str, int]:
    t = Counter()
    for s in segs:
        t["reserved"] += s["total_size"]
        for b in s["blocks"]:
            if b["state"] == "active_allocated":
                t["allocated"] += b["size"]
                t["requested"] += b["requested_size"]
            elif b["state"] == "active_pending_free":
                t["pending"] += b["size"]
            else:
                t["external"] += b["size"]
    t["internal"] = t["allocated"] - t["requested"]
    return t


def _analyze_device(snap: Snapshot, device: int) -> MemoryFacts:
    trace = snap.device_traces[device] if device < len(snap.device_traces) else []
    segs = [s for s in snap.segments if s["device"] == device]
    end = _segment_totals(segs)
    if not trace:
        return _analyze_without_history(snap, device, segs, end)

    r = _replay(snap, device, trace)
    stacks = _StackCache()
    times = _times(trace)
    phase = _event_phases(trace, stacks, times, snap.external_annotations, device)
    labels = _label_blocks(r, stacks, phase, trace)
    alloc, pend, seed_alloc, seed_pend = _state_series(r)
    full = np.concatenate([[seed_alloc], alloc])
    p = int(np.argmax(full)) - 1  # -1: before the first event
    peak = int(full[p + 1])
    # memory_viz's active peak: blocks count until free_completed (pending frees included)
    active = np.concatenate([[seed_alloc + seed_pend], alloc + pend])
    pa = int(np.argmax(active)) - 1
    live_active = (r.alloc_idx <= pa) & (pa < r.free_done)
    live = (r.alloc_idx <= p) & (p < r.free_req)
    pending = int(pend[p]) if p >= 0 else seed_pend
    reserved = int(r.reserved[p]) if p >= 0 else r.reserved_seed
    requested = int(r.requested[live].sum())
    external = reserved - peak - pending
    notes = list(r.notes)
    if r.pseudo:
        notes = [
            "pseudo-snapshot from torch.profiler (_memory_viz._profile_to_snapshot): no allocator state, so no "
            "reserved memory or fragmentation; in-place updates appear as free+alloc pairs of tensor versions"
        ]
    elif external < 0:
        notes.append(f"reserved at peak is {-external} bytes below allocated+pending: the trace misses segment events")
    x, unit = (times, "time_us") if times is not None else (np.arange(r.n), "event_index")
    if times is None:
        notes.append("trace entries have no time_us (torch < 2.2): the peak is located by event index")
    pre_bytes = int(r.size[labels.pre_existing].sum())
    pre_live = live & labels.pre_existing
    if pre_live.any():
        count, nbytes = int(pre_live.sum()), int(r.size[pre_live].sum())
        notes.append(f"{count} blocks ({nbytes} bytes) alive at the peak were allocated before recording started")

    facts = MemoryFacts(
        source="snapshot",
        path=snap.path,
        device=device,
        n_events=r.n,
        peak_allocated_bytes=peak,
        peak_requested_bytes=requested,
        reserved_at_peak_bytes=None if r.pseudo else reserved,
        peak_time_us=(float(times[max(p, 0)]) if times is not None else None),
        peak_event_index=p,
        peak_phase=_PHASE_NAMES[int(phase[max(p, 0)])],
        pending_free_at_peak_bytes=pending,
        internal_fragmentation_bytes=None if r.pseudo else peak - requested,
        external_fragmentation_bytes=None if r.pseudo else max(external, 0),
        categories=_categories(live, r, labels),
        categories_instant="peak_allocated",
        peak_active_bytes=int(active[pa + 1]),
        peak_active_event_index=pa,
        peak_active_time_us=(float(times[max(pa, 0)]) if times is not None else None),
        categories_at_active_peak=_categories(live_active, r, labels),
        pre_existing_bytes=pre_bytes,
        pre_existing_attributed=labels.attributed,
        top_sites=_top_sites(live, r, labels),
        end_allocated_bytes=end["allocated"],
        end_reserved_bytes=None if r.pseudo else end["reserved"],
        fsdp_version=labels.fsdp,
        world_size=labels.world_size,
        curve=_downsample(x, alloc, None if r.pseudo else r.reserved, unit),
        notes=notes,
    )
    if r.ooms:
        facts.oom = _oom(r, trace, labels, alloc, pend, r.ooms, device, times)
    return facts


def _oom(r: _Replay, trace, labels: _Labels, alloc, pend, ooms: list[dict], device: int, times) -> dict:
    last = ooms[-1]
    k = last["index"]
    e = trace[k]
    live = (r.alloc_idx <= k) & (k < r.free_req)
    allocated, pending, reserved = int(alloc[k]), int(pend[k]), int(r.reserved[k])
    requested = int(e.get("size", 0))
    free_dev = e.get("device_free")
    cached = reserved - allocated - pending
    largest = last["largest_cached_free_block_bytes"]
    if largest is not None and cached >= requested > largest:
        why = "fragmentation: enough cached free memory in total, but no contiguous block large enough"
    elif cached + (free_dev or 0) >= requested:
        why = "cached free memory plus free device memory would cover the request, but neither alone does"
    else:
        why = "the device is full: allocated tensors (see categories) leave too little free memory"
    return {
        "device": device,
        "count": len(ooms),
        "event_index": k,
        "time_us": float(times[k]) if times is not None else None,
        "requested_bytes": requested,
        "device_free_bytes": free_dev,
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "pending_free_bytes": pending,
        "cached_free_bytes": cached,
        "largest_cached_free_block_bytes": largest,
        "categories": _categories(live, r, labels),
        "top_sites": _top_sites(live, r, labels),
        "explanation": why,
    }


def _analyze_without_history(snap: Snapshot, device: int, segs: list[dict], end: Counter) -> MemoryFacts:
    """Only the final segments: totals, and categories from allocation stacks without lifetimes."""
    cats = dict.fromkeys(CATEGORIES, 0)
    sites: Counter = Counter()
    stacks = _StackCache()
    blocks = [b for s in segs for b in s["blocks"] if b["state"] == "active_allocated"]
    rs_sizes = [b["requested_size"] for b in blocks if stacks(b["frames"]).label == _RS]
    for b in blocks:
        st = stacks(b["frames"])
        lab, ph, site = st.label, st.phase, st.site
        if lab in CATEGORIES:
            cat = lab
        elif lab == _RS:  # an RS input is world_size × an RS output that is alive beside it
            cat = (
                "gradients"
                if any(s != b["requested_size"] and s % max(b["requested_size"], 1) == 0 for s in rs_sizes)
                else "reduce_scatter_buffers"
            )
        elif lab == _OPT or ph == PH_OPTIM:
            cat = "optimizer_state"
        elif ph in (PH_FORWARD, PH_RECOMPUTE):  # alive now: saved (or recomputed) for backward
            cat = "activations"
        elif ph == PH_BACKWARD:
            cat = "gradients"
        else:
            cat = "other"
        cats[cat] += b["size"]
        sites[site or ("<no frames>")] += b["size"]
    return MemoryFacts(
        source="snapshot",
        path=snap.path,
        device=device,
        history_missing=True,
        peak_allocated_bytes=end["allocated"],
        peak_requested_bytes=end["requested"],
        reserved_at_peak_bytes=end["reserved"],
        pending_free_at_peak_bytes=end["pending"],
        internal_fragmentation_bytes=end["internal"],
        external_fragmentation_bytes=end["external"],
        categories=cats,
        categories_instant="snapshot",
        top_sites=[(s, int(v)) for s, v in sites.most_common(TOP_SITES)],
        end_allocated_bytes=end["allocated"],
        end_reserved_bytes=end["reserved"],
        notes=[
            "no allocation history (recorded without _record_memory_history or a bare segment list): "
            "numbers are the state at snapshot time; categories come from stacks only"
        ],
    )


def analyze_snapshot(snap: Snapshot) -> MemoryFacts:
    devices = snap.devices
    if not devices:
        return MemoryFacts(
            source="snapshot",
            path=snap.path,
            history_missing=not snap.has_history,
            notes=["the snapshot holds no segments and no history"],
        )
    per = [_analyze_device(snap, d) for d in devices]
    best = max(per, key=lambda f: f.peak_allocated_bytes)
    best.devices = [
        {
            "device": f.device,
            "peak_allocated_bytes": f.peak_allocated_bytes,
            "reserved_at_peak_bytes": f.reserved_at_peak_bytes,
            "peak_time_us": f.peak_time_us,
            "peak_event_index": f.peak_event_index,
            "history_missing": f.history_missing,
            "oom": f.oom is not None,
        }
        for f in per
    ]
    if best.oom is None:
        best.oom = next((f.oom for f in per if f.oom is not None), None)
    return best


def analyze_timeline(tl: MemoryTimeline) -> MemoryFacts:
    """Replay a profiler memory timeline in file order; the state at a time is after all its rows."""
    n = len(tl.nbytes)
    if n == 0:
        return MemoryFacts(source="memory_timeline", path=tl.path, notes=["empty memory timeline"])
    total = np.cumsum(tl.nbytes)
    group_end = np.flatnonzero(np.r_[tl.time_ns[1:] != tl.time_ns[:-1], True])
    g = group_end[int(np.argmax(total[group_end]))]
    per_cat = np.zeros(len(TIMELINE_CATEGORIES), dtype=np.int64)
    np.add.at(per_cat, tl.category[: g + 1], tl.nbytes[: g + 1])
    cats = dict.fromkeys(CATEGORIES, 0)
    for i, name in enumerate(TIMELINE_CATEGORIES):
        cats[_TIMELINE_TO_CATEGORY[name]] += int(per_cat[i])
    t = int(tl.time_ns[g])
    timed = group_end[tl.time_ns[group_end] >= 0]
    return MemoryFacts(
        source="memory_timeline",
        path=tl.path,
        n_events=n,
        peak_allocated_bytes=int(total[g]),
        peak_time_us=t / 1000 if t >= 0 else None,
        peak_event_index=int(g),
        categories=cats,
        pre_existing_bytes=int(tl.nbytes[tl.time_ns < 0].sum()),
        end_allocated_bytes=int(total[-1]),
        curve=_downsample(tl.time_ns[timed] / 1000, total[timed], None, "time_us"),
        notes=[
            "profiler memory timeline: categories are torch.profiler's (INPUT and unknown count as other, "
            "AUTOGRAD_DETAIL as temporary); no reserved memory or fragmentation information"
        ],
    )


def analyze_memory(source: str | Path | Snapshot | MemoryTimeline | dict | list) -> MemoryFacts:
    """Memory facts from a snapshot/timeline path, a loaded :class:`Snapshot`/:class:`MemoryTimeline`,
    or an already-unpickled snapshot object. For several devices the one with the highest peak is
    reported in full and every device's peak is listed in ``devices``."""
    if isinstance(source, (str, Path)):
        source = load_memory(source)
    elif isinstance(source, (dict, list)):
        source = snapshot_from_object(source)
    if isinstance(source, MemoryTimeline):
        return analyze_timeline(source)
    if isinstance(source, Snapshot):
        return analyze_snapshot(source)
    raise TypeError(f"analyze_memory: unsupported input {type(source).__name__}")
