"""Phases per trace event and a category per block (module doc of :mod:`..memory`, steps 4 and 5).

Blocks are categorised from their allocation stack (innermost matching frame wins), then by
lifetime relative to the forward / backward / optimizer phase they were allocated in; blocks
allocated before recording are attributed by size where the trace shows parameter-shaped sizes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from fsdpdoctor.facts import MEMORY_CATEGORIES as CATEGORIES
from fsdpdoctor.analysis.memory.allocator import NEVER, Replay, round_size
from fsdpdoctor.analysis.memory.statement import Statement, failing_statement
from fsdpdoctor.analysis.memory.stacks import (
    OPT,
    OPTIM_STATES,
    PH_BACKWARD,
    PH_FORWARD,
    PH_IDLE,
    PH_OPTIM,
    PH_RECOMPUTE,
    PH_UNKNOWN,
    PHASE_NAMES,
    RS,
    StackCache,
)


# profiler Category (export index order) -> ours
TIMELINE_TO_CATEGORY = {
    "PARAMETER": "parameters",  # the profiler cannot tell FSDP's sharded from unsharded
    "OPTIMIZER_STATE": "optimizer_state",
    "INPUT": "other",
    "TEMPORARY": "temporary",
    "ACTIVATION": "activations",
    "GRADIENT": "gradients",
    "AUTOGRAD_DETAIL": "temporary",
    "UNKNOWN": "other",
}
# `category` on trace entries of _memory_viz._profile_to_snapshot pseudo-snapshots
PROFILE_ENTRY_CATEGORY = {k.lower(): v for k, v in TIMELINE_TO_CATEGORY.items()}

# =========================================================================== phases & categories


def event_phases(
    trace: list[dict], stacks: StackCache, times: np.ndarray | None, annotations: list[dict], device: int
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


def event_times(trace: list[dict]) -> np.ndarray | None:
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


def _pair_reduce_scatter(r: Replay, rs_ids: list[int]) -> tuple[set[int], int | None]:
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
class Labels:
    category: list[str]
    site: list[str]
    pre_existing: np.ndarray  # bool per block
    fsdp: str | None
    world_size: int | None
    attributed: dict[str, int]  # pre-existing bytes per category (all pre-existing blocks)
    statement: Statement | None = None  # the statement of the last OOM


def _forward_fates(
    r: Replay, fwd: np.ndarray, open_ended: np.ndarray, rounded: dict[int, int], boundaries: np.ndarray
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


def _concatenated_grads(r: Replay, candidates: np.ndarray) -> set[int]:
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


def label_blocks(r: Replay, stacks: StackCache, phase: np.ndarray, trace: list[dict]) -> Labels:
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
    rs_inputs, world_size = _pair_reduce_scatter(r, [int(b) for b in order if st[b].label == RS and not pre[b]])
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
    seen_short: dict[int, set] = {k: set() for k in PHASE_NAMES}
    seen_long: dict[int, set] = {k: set() for k in PHASE_NAMES}
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
    statement = failing_statement(r, ev, st, phase)
    stmt_temps = statement.temporaries if statement is not None else set()

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
        elif lab == RS:  # an input cut off before its output was allocated (OOM) by an earlier input's size
            is_input = b in rs_inputs or (open_ended[b] and rounded[b] in rs_input_sizes)
            cat = "reduce_scatter_buffers" if short_lived[b] or is_input else "gradients"
        elif r.entry_category[b] in PROFILE_ENTRY_CATEGORY:  # pseudo-snapshot: versions, not allocations
            cat = PROFILE_ENTRY_CATEGORY[r.entry_category[b]]
        elif b in stmt_temps:
            cat = "temporary"
        elif lab == OPT or ph == PH_OPTIM:
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
            site[b] = f"<no Python frames: {PHASE_NAMES[ph] or 'unknown phase'}>"
    for b in np.flatnonzero(pre):
        site[b] = site[b] or "<allocated before recording>"
    attributed = _attribute_pre_existing(r, cats, pre, fsdp, world_size, optimizers, phase)
    return Labels(cats, site, pre, fsdp, world_size, attributed, statement)


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


def _params_per_shard_size(r: Replay, cats: list[str], phase: np.ndarray, divisor: int, pre_sizes: Counter) -> Counter:
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
    r: Replay,
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
    n_states = max((OPTIM_STATES.get(o, 0) for o in optimizers), default=0)

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
