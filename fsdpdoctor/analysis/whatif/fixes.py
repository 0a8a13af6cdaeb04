"""Transformations: each fix an expert would make, as an edit of the graph."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fsdpdoctor.facts import ComputeFacts
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.comms import Collective
from fsdpdoctor.analysis.layers import RepeatedBlocks
from fsdpdoctor.analysis.whatif.graph import CAP_DEP_US, Fix, Graph, OpMap, Packed
from fsdpdoctor.analysis.whatif.hooks import _hook_own, _hook_us_per_unit, fix_hooks_half, fix_hooks_off
from fsdpdoctor.analysis.whatif.loop import _sync_arrays
from fsdpdoctor.facts.compute import TENSOR_CORE_SHARE  # the assumption, stated in the facts


def _backward_all_gathers(g: Graph) -> list[list[int]]:
    """Per step, the first kernel op of each backward all-gather, in issue order."""
    out: list[list[int]] = [[] for _ in g.steps]
    first_op: dict[int, int] = {}
    for i in np.flatnonzero(g.coll >= 0):
        first_op.setdefault(int(g.coll[i]), int(i))
    for ci, c in enumerate(g.colls):
        if c.kind == "all_gather" and c.phase == "backward" and 0 <= c.step < len(out) and ci in first_op:
            out[c.step].append(first_op[ci])
    for lst in out:
        lst.sort(key=lambda i: g.key[i])
    return out


def _pre_ops(g: Graph, i: int, order: np.ndarray, pos: np.ndarray, comp_stream: int) -> list[int]:
    """GPU work launched just before collective op ``i`` in the same step, back to the previous
    compute-stream launch or collective (FSDP's pre-unshard copies / casts, copy-in)."""
    out = []
    p = int(pos[i]) - 1
    while p >= 0 and len(out) < 16:
        j = int(order[p])
        if g.step[j] != g.step[i] or g.comm[j] or g.stream[j] == comp_stream:
            break
        out.append(j)
        p -= 1
    return out


def _compute_stream(g: Graph) -> int:
    """The stream with the most compute time."""
    comp = np.flatnonzero(g.is_compute)
    if comp.size == 0:
        return -1
    s, inv = np.unique(g.stream[comp], return_inverse=True)
    busy = np.bincount(inv, weights=(g.end - g.start)[comp])
    return int(s[int(np.argmax(busy))])


def fix_prefetch(g: Graph) -> Fix | None:
    """Backward prefetch on: each backward all-gather (and the copies before it) is issued where
    the previous unit's all-gather was, i.e. ahead of that unit's gradient compute and its
    reduce-scatter on the communicator (BACKWARD_PRE)."""
    fx = Fix("prefetch")
    order = np.argsort(g.key, kind="stable")
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size)
    comp_stream = _compute_stream(g)
    for ags in _backward_all_gathers(g):
        for prev, cur in zip(ags, ags[1:]):
            delta = g.key[prev] - g.key[cur] + 1e-3
            for j in [cur, *_pre_ops(g, cur, order, pos, comp_stream)]:
                fx.move[j] = g.key[j] + delta
                fx.drop_deps.add(j)
    return fx if fx.move else None


def fix_no_sync(g: Graph) -> Fix | None:
    """Gradient sync on the last micro-batch only (FSDP2 ``set_requires_gradient_sync(False)`` /
    FSDP1 ``no_sync()`` on the others): the reduce-scatters of every micro-batch of a step but
    its last, and the copies launched just before each (FSDP's chunk-cat of the gradients), are
    dropped."""
    fx = Fix("no_sync")
    order = np.argsort(g.key, kind="stable")
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size)
    comp_stream = _compute_stream(g)
    last: dict[int, int] = {}
    for c in g.colls:
        if c.step >= 0:
            last[c.step] = max(last.get(c.step, -1), c.microbatch)
    n = 0
    for i in np.flatnonzero(g.coll >= 0).tolist():
        c = g.colls[int(g.coll[i])]
        if c.kind != "reduce_scatter" or c.step < 0 or c.microbatch < 0 or c.microbatch >= last.get(c.step, -1):
            continue
        drop = [i, *_pre_ops(g, i, order, pos, comp_stream)]
        # FSDP's reduce: the gradients' chunk-cat on the compute stream just before it, the cast
        # of its output after it on its own stream (up to the next collective there)
        p = int(pos[i]) - 1
        while p >= 0 and g.step[int(order[p])] == g.step[i] and not g.comm[int(order[p])]:
            j = int(order[p])
            if g.stream[j] == comp_stream:
                if "chunk_cat" in g.names[j]:
                    drop.append(j)
                break
            p -= 1
        p = int(pos[i]) + 1
        while p < order.size and g.step[int(order[p])] == g.step[i] and not g.comm[int(order[p])]:
            j = int(order[p])
            if g.stream[j] == g.stream[i]:
                drop.append(j)
            elif g.stream[j] == comp_stream:
                break
            p += 1
        for j in drop:
            fx.scale[j] = 0.0
        n += 1
    if not n:
        return None
    fx.note = f"{n / max(len(g.steps), 1):g} reduce-scatters a step dropped (every micro-batch's but the last)"
    return fx


def _in_ranges(t: float, ranges: list[tuple[float, float]]) -> bool:
    return any(a <= t < b for a, b in ranges)


def _name_mask(g: Graph, pred) -> np.ndarray:
    """``pred(name)`` for every op, evaluated once per distinct name."""
    if g.name_code is None or g.code_names is None:
        return np.fromiter((pred(n) for n in g.names), dtype=bool, count=len(g.names))
    used = np.unique(g.name_code)
    table = np.zeros(len(g.code_names), dtype=bool)
    table[used] = [bool(pred(g.code_names[c])) for c in used.tolist()]
    return table[g.name_code]


def fix_offload_off(g: Graph) -> Fix | None:
    """CPU offload off: FSDP's host<->device copies of parameters and gradients go away (those
    launched outside the optimizer and not on the compute stream: the batch copy stays), and an
    optimizer step with no GPU work (it ran on the CPU) is cut from the CPU timeline. Blocking
    calls that waited for a dropped copy no longer block."""
    fx = Fix("offload_off")
    comp_stream = _compute_stream(g)
    host = _name_mask(g, lambda n: n.startswith(("Memcpy HtoD", "Memcpy DtoH")))
    for i in np.flatnonzero(host & (g.stream != comp_stream) & (g.phase != "optimizer")).tolist():
        fx.scale[i] = 0.0
    dropped = set(fx.scale)
    for ts, te, a, gap, row in g.syncs:
        if a in dropped and row not in g.device_syncs:
            fx.free_syncs.add(row)
    for a, b in g.ranges.get("optimizer", []):
        m = (g.key >= a) & (g.key < b) & g.is_compute
        if not m.any():
            fx.cpu_cuts.append((a, b))
    return fx if fx.scale or fx.cpu_cuts else None


def fix_rate_limiter_off(g: Graph) -> Fix | None:
    """limit_all_gathers=False: the rate limiter's event synchronizations no longer block."""
    rl = g.ranges.get("rate_limiter", [])
    fx = Fix("rate_limiter_off", free_syncs={row for ts, te, a, gap, row in g.syncs if _in_ranges(ts, rl)})
    return fx if fx.free_syncs else None


_FP32 = ("float", "f32", "Float")
_LOW = ("bf16", "BFloat16", "bfloat16", "half", "Half", "fp16", "f16")


def fix_mixed_precision(g: Graph, compute: float = 0.5) -> Fix | None:
    """bf16 mixed precision: fp32 all-gathers and reduce-scatters move half the bytes, and fp32
    forward/backward compute kernels run in bf16 (half the bytes for memory-bound kernels, twice
    TF32's tensor-core rate for GEMMs): duration × ``compute`` (0.5 assumed; ASSUMPTIONS varies
    it). The optimizer keeps fp32."""
    fx = Fix("mixed_precision")
    for i in np.flatnonzero(g.coll >= 0):
        c = g.colls[int(g.coll[i])]
        if c.kind in ("all_gather", "reduce_scatter") and (c.dtype or "").lower() in ("float", "float32"):
            fx.scale[int(i)] = 0.5
    if not fx.scale:
        return None
    fp32 = _name_mask(g, lambda n: any(t in n for t in _FP32) and not any(t in n for t in _LOW))
    fwd_bwd = (g.phase == "forward") | (g.phase == "backward")
    for i in np.flatnonzero(g.is_compute & fwd_bwd & fp32).tolist():
        fx.scale[i] = compute
    return fx


WRAP_SPLIT = 8  # units the coarse unit is split into (a transformer's blocks; the trace does not say)


def _append_ops(g: Graph, src: list[int]) -> tuple[Graph, list[int]]:
    """A copy of ``g`` with a copy of each op in ``src`` appended (same fields); their indices."""
    n = g.start.size
    idx = np.array(src, dtype=np.int64)
    cat = lambda a: np.concatenate([a, a[idx]])  # noqa: E731
    g2 = Graph(
        cat(g.start),
        cat(g.end),
        cat(g.stream),
        cat(g.launch),
        cat(g.key),
        cat(g.backlog),
        cat(g.comm),
        cat(g.coll),
        cat(g.pg),
        cat(g.is_compute),
        cat(g.step),
        cat(g.g_launch),
        cat(g.g_stream),
        cat(g.g_comm),
        dict(g.deps),
        g.syncs,
        g.steps,
        g.colls,
        g.names + [g.names[i] for i in src],
        cat(g.phase),
        g.ranges,
        g.device_syncs,
        g.n_wait_edges,
        g.n_inferred,
        cat(g.g_wait),
        cat(g.name_code) if g.name_code is not None else None,
        g.code_names,
        cat(g.rows) if g.rows is not None else None,
    )
    return g2, list(range(n, n + idx.size))


def _chunks(ops: np.ndarray, dur: np.ndarray, k: int) -> list[np.ndarray]:
    """``ops`` (in order) cut into ``k`` consecutive groups of about equal total duration."""
    c = np.cumsum(dur)
    cut = np.searchsorted(c, c[-1] * np.arange(1, k) / k)
    return [x for x in np.split(ops, cut) if x.size]


def fix_wrap(g: Graph, find_blocks: Callable[[], RepeatedBlocks | None] | None = None) -> tuple[Graph, Fix] | None:
    """Per-block wrapping of the unit that holds most parameters.

    With the model's repeated blocks known from its GEMM shapes (:mod:`.layers`), the unit's
    forward all-gather becomes the root's (what no block holds: embeddings, head, norms; issued
    where it was) followed by one all-gather per block, issued with it (the CPU runs ahead), the
    j-th gating block j's first GEMM; its backward reduce-scatter becomes one per block, issued
    when the block's backward is done (blocks last to first), then the root's where it was. Each
    piece moves its share of the unit's elements. Without shapes: WRAP_SPLIT equal pieces, the
    j-th gating the j-th of WRAP_SPLIT equal-time slices of compute. Backward all-gathers that
    per-block units add are prefetched and assumed hidden. Each added unit's hooks cost CPU time
    (what the coarse unit's hooks cost per unit, measured, forward and backward): inserted where
    the unit's forward starts and where its backward ends. ``find_blocks`` (called only when one
    unit dominates) reads the repeated blocks."""
    ci = [i for i in np.flatnonzero(g.coll >= 0)]
    if not ci:
        return None
    by_unit: dict[object, float] = {}
    for i in ci:
        c = g.colls[int(g.coll[i])]
        if c.kind == "all_gather" and c.phase == "forward":
            by_unit[c.unit] = by_unit.get(c.unit, 0.0) + (c.bytes or 0)
    total = sum(by_unit.values())
    if not total:
        return None
    unit = max(by_unit, key=by_unit.get)
    if by_unit[unit] < 0.5 * total:
        return None
    blocks = find_blocks() if find_blocks is not None else None
    share = _block_share(g, ci, unit, blocks)
    fx = Fix("wrap")
    if share is not None:
        fx.note = (
            f"the unit split as per-block wrapping would: {blocks.count} repeated blocks found from GEMM shapes, "
            f"{100 * share:.1f}% of its elements each, the root keeping {100 * (1 - blocks.count * share):.1f}%"
        )
    else:
        fx.note = f"the unit split into {WRAP_SPLIT} equal units (no repeated blocks found from GEMM shapes: record_shapes=True tells them)"
    new_src, plan = [], []
    dur = g.end - g.start
    for st in range(len(g.steps)):
        for kind, phase in (("all_gather", "forward"), ("reduce_scatter", "backward")):
            ops = [
                int(i)
                for i in ci
                if g.step[i] == st
                and g.colls[int(g.coll[i])].kind == kind
                and g.colls[int(g.coll[i])].phase == phase
                and g.colls[int(g.coll[i])].unit == unit
            ]
            comp = np.flatnonzero(g.is_compute & (g.step == st) & (g.phase == phase))
            if not ops:
                continue
            op = ops[0] if kind == "all_gather" else ops[-1]
            comp = comp[np.argsort(g.key[comp])]
            comp = comp[g.key[comp] > g.key[op]] if kind == "all_gather" else comp[g.key[comp] < g.key[op]]
            pieces = _block_pieces(g, comp, kind, st, blocks, share) if share is not None else None
            if pieces is None:
                if comp.size < WRAP_SPLIT:
                    continue
                groups = _chunks(comp, dur[comp], WRAP_SPLIT)
                m = len(groups)
                anchors = [int(x[0]) for x in groups[1:]] if kind == "all_gather" else [int(x[-1]) for x in groups[:-1]]
                pieces = (1.0 / m, [(1.0 / m, a) for a in anchors])
            plan.append((st, kind, op, pieces))
            new_src += [op] * len(pieces[1])
    if not plan:
        return None
    g2, new = _append_ops(g, new_src)
    it = iter(new)
    extra = {st: len(pieces[1]) for st, kind, _, pieces in plan if kind == "all_gather"}
    hooks, hook_own = _hook_own(g)
    for st, kind, op, (own, pieces) in plan:
        # each added unit runs its own hooks on the CPU: what the coarse unit's cost per unit,
        # forward (pre-forward: the all-gather issue, copy-out) and backward (pre-backward's
        # all-gather issue, post-backward's reduce-scatter issue)
        fwd_hook = _hook_us_per_unit(hooks, hook_own, g.steps[st], "forward", len(by_unit))
        if kind == "all_gather":
            fx.cpu_adds += [(g.key[a] - 1e-4, fwd_hook) for _, a in pieces]
        else:
            bwd_hook = fwd_hook + _hook_us_per_unit(hooks, hook_own, g.steps[st], "backward", len(by_unit))
            fx.cpu_adds += [(g.key[a] + 5e-4, bwd_hook) for _, a in pieces]
            fx.cpu_adds += [(g.key[op] - 1e-4, bwd_hook)] * max(extra.get(st, 0) - len(pieces), 0)
        fx.scale[op] = own
        for j, (scale, anchor) in enumerate(pieces, start=1):
            p = next(it)
            fx.scale[p] = scale
            if kind == "all_gather":
                # issued right after the original, in order; gates its block's first compute
                fx.move[p] = g.key[op] + j * 1e-3
                g2.deps[anchor] = list(g2.deps.get(anchor, [])) + [(p, CAP_DEP_US)]
            else:
                # issued after its slice of backward compute; the original keeps the last slot
                fx.move[p] = g.key[anchor] + 1e-3
                fx.drop_deps.add(p)
                g2.deps[p] = [(anchor, CAP_DEP_US)]
        if kind == "reduce_scatter":
            fx.move[op] = g.key[op]
    return g2, fx


def _block_share(g: Graph, ci: list, unit, blocks: RepeatedBlocks | None) -> float | None:
    """One block's share of the unit's all-gathered elements (None when the blocks are unknown
    or hold more elements than the unit gathers)."""
    if blocks is None or not blocks.forward_starts:
        return None
    st = min(blocks.forward_starts)
    numel = sum(
        g.colls[int(g.coll[i])].out_nelems or 0
        for i in ci
        if g.step[i] == st
        and g.colls[int(g.coll[i])].kind == "all_gather"
        and g.colls[int(g.coll[i])].phase == "forward"
        and g.colls[int(g.coll[i])].unit == unit
    )
    if not numel or blocks.count * blocks.block_numel > numel:
        return None
    return blocks.block_numel / numel


def _block_pieces(
    g: Graph, comp: np.ndarray, kind: str, st: int, blocks: RepeatedBlocks, share: float
) -> tuple[float, list[tuple[float, int]]] | None:
    """(the original's share, [(share, anchor op)] of the other pieces) for step ``st``: forward,
    one piece per block gating the first compute launched at its first GEMM; backward, one per
    block but the first issued after the last compute launched before the next block's backward
    (the first block's goes with the root's, last). None where the step's blocks are unknown."""
    starts = (blocks.forward_starts if kind == "all_gather" else blocks.backward_ends).get(st)
    if starts is None or comp.size == 0:
        return None
    keys = g.key[comp]
    root = 1.0 - blocks.count * share
    pieces = []
    if kind == "all_gather":
        for t in starts:
            i = int(np.searchsorted(keys, t, side="left"))
            if i >= comp.size:
                return None
            pieces.append((share, int(comp[i])))
        return root, pieces
    for t in reversed(starts[1:]):  # blocks last to first
        i = int(np.searchsorted(keys, t, side="left")) - 1
        if i < 0:
            return None
        pieces.append((share, int(comp[i])))
    return root + share, pieces


TENSOR_CORE_MIN_SHARE = 5.0  # % of GEMM + attention time on fp32 engines for the replay to try it


def fix_tensor_cores(
    g: Graph, kf, cf: ComputeFacts, share: float = TENSOR_CORE_SHARE, elementwise: float = 0.5
) -> Fix | None:
    """bf16 mixed precision for a run whose matmuls run in fp32 on a GPU with tensor cores: every
    fp32 GEMM / attention kernel takes its FLOPs at TENSOR_CORE_SHARE of the device's dense BF16
    peak (never longer than measured), and the forward / backward fp32 elementwise kernels move
    half the bytes (× 0.5, bf16 activations). The optimizer keeps fp32. Without shapes (``cf.source``
    "names"), the CUDA-core GEMM / attention kernels found by name take their time × the ratio of
    the device's fp32 peak to its dense BF16 (FP16) one."""
    if not cf.tensor_cores or not cf.peak_tflops or g.rows is None:
        return None
    fx = Fix("tensor_cores")
    gemm_ops = set()
    if kf.rows.size == 0:  # no shapes: the CUDA-core kernels by name, at the engines' peak ratio
        if cf.source != "names":
            return None
        from fsdpdoctor.analysis.compute import engine_in_name, kernel_class
        from fsdpdoctor.analysis.peaks import device_peaks

        f32 = (device_peaks(cf.device) or ("", {}))[1].get("fp32")
        if not f32:
            return None
        simt = _name_mask(g, lambda n: kernel_class(n) is not None and engine_in_name(n) == "fp32-simt")
        gemm_ops = set(np.flatnonzero(g.is_compute & _name_mask(g, lambda n: kernel_class(n) is not None)).tolist())
        for i in np.flatnonzero(g.is_compute & simt).tolist():
            fx.scale[i] = min(1.0, f32 / cf.peak_tflops)
    else:
        rate = share * cf.peak_tflops * 1e6  # FLOPs per µs
        i, hit = _kernel_ops(g, kf)
        gemm_ops = set(i.tolist())
        dur = (g.end - g.start)[i]
        fl = np.asarray(kf.flops, dtype=np.float64)[hit]
        # TF32 GEMMs too: in bf16 they run at the BF16 rate (twice TF32's peak on tensor cores)
        fp32_engine = np.fromiter(
            (e in ("fp32-simt", "fp32", "tf32") for e in kf.engine), dtype=bool, count=len(kf.engine)
        )
        ok = fp32_engine[hit] & (dur > 0) & (fl > 0)
        # as a dict filled kernel by kernel: the last kernel of an op gives its factor
        fx.scale.update(zip(i[ok].tolist(), np.minimum(1.0, fl[ok] / rate / dur[ok]).tolist()))
    if not fx.scale:
        return None
    fp32 = _name_mask(g, lambda n: any(t in n for t in _FP32) and not any(t in n for t in _LOW))
    fwd_bwd = (g.phase == "forward") | (g.phase == "backward")
    # not the backlog: its kernels change as their namesakes in the window do (loop.replay), its
    # GEMMs with the GEMMs (their kernels have no FLOPs here: no launching op in the window)
    for i in np.flatnonzero(g.is_compute & fwd_bwd & fp32 & ~g.backlog).tolist():
        if i not in gemm_ops:
            fx.scale[i] = elementwise
    return fx


def _kernel_ops(g: Graph, kf) -> tuple[np.ndarray, np.ndarray]:
    """The op of each kernel of ``kf`` that is in the graph (the op whose trace row it is; the
    last such op where rows repeat, as a dict of row -> op would give), in ``kf``'s order, and
    which of ``kf``'s kernels have one (bool per kernel)."""
    rows = np.asarray(g.rows, dtype=np.int64)
    order = np.argsort(rows, kind="stable")
    srt = rows[order]
    last = np.ones(srt.size, dtype=bool)  # the last op of each run of equal rows
    last[:-1] = srt[1:] != srt[:-1]
    srt, order = srt[last], order[last]
    want = np.asarray(kf.rows, dtype=np.int64)
    if srt.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(want.size, dtype=bool)
    pos = np.minimum(np.searchsorted(srt, want), srt.size - 1)
    hit = srt[pos] == want
    return order[pos[hit]].astype(np.int64), hit


def latency_share(colls: list[Collective]) -> float | None:
    """Share of the median all-gather's / reduce-scatter's duration that is fixed cost, from a
    least-squares fit duration = a + bytes / bandwidth over this rank's collectives of those
    kinds (None when sizes do not vary enough to separate the two)."""
    pts = [
        (c.bytes, c.gpu_dur_us)
        for c in colls
        if c.kind in ("all_gather", "reduce_scatter") and c.step >= 0 and c.bytes and c.gpu_dur_us and c.gpu_dur_us > 0
    ]
    if len(pts) < 4:
        return None
    x, y = np.array(pts, dtype=float).T
    if x.max() < 1.5 * x.min():
        return None
    b, a = np.polyfit(x, y, 1)
    if b <= 0:
        return None
    med = float(np.median(y))
    return float(np.clip(a / med, 0.0, 1.0)) if med > 0 else None


STRAGGLER_FACTORS = (0.75,)


def fix_compute_scale(g: Graph, f: float) -> Fix:
    """Compute kernels × f: what this rank's step would be with the median rank's compute speed
    (the run summary interpolates between the factors)."""
    ops = np.flatnonzero(g.is_compute)
    return Fix(f"compute×{f}", scale=OpMap.of(ops, np.full(ops.size, f, dtype=np.float64)))


#: how much faster each side is made to read the step's sensitivity to it ("CPU-bound" /
#: "GPU-bound" come from which speed-up shortens the step more)
SIDE_FACTOR = 0.75


def fix_cpu_scale(g: Graph, f: float = SIDE_FACTOR) -> Fix | None:
    """The CPU × ``f``: every piece of CPU time between the thread's launches, blocking calls and
    step marks is cut to ``f`` of its length (the blocking calls themselves wait for the GPU and
    stay): what the step would be on a faster host."""
    if not g.steps:
        return None
    lo, hi = g.steps[0].start, g.steps[-1].end
    keys = g.key[~g.backlog]
    sy = _sync_arrays(g)
    blocked = iv.merge(sy["ts"], sy["te"])
    marks = np.array([x for st in g.steps for x in (st.start, st.end)], dtype=np.float64)
    pts = np.unique(np.concatenate((keys, blocked[0], blocked[1], marks)))
    pts = pts[(pts >= lo) & (pts <= hi)]
    if pts.size < 2:
        return None
    p, q = pts[:-1], pts[1:]
    mid = (p + q) / 2
    j = np.searchsorted(blocked[0], mid, side="right") - 1
    held = (j >= 0) & (mid < blocked[1][np.maximum(j, 0)]) if blocked[0].size else np.zeros(mid.size, dtype=bool)
    ok = (q > p) & ~held
    if not ok.any():
        return None
    return Fix(f"cpu×{f}", cpu_cuts=Packed(np.column_stack((p[ok], p[ok] + (1.0 - f) * (q[ok] - p[ok])))))


#: host<->device bandwidth assumed for a pinned copy when the trace has no pinned copy of its own
#: to measure it on (GB/s): a PCIe 4.0 x16 link's practical rate; a PCIe 5.0 or NVLink-C2C host
#: is faster, so the saving is on the low side there
PINNED_GBPS = 25.0
PINNED_MEASURE_MIN_BYTES = 1 << 20  # pinned copies this large or larger measure the link
PIN_MIN_SHARE = (
    0.005  # pageable copy time (or CPU time blocked in them) per step below this share of the CPU step: no pin replay
)


def pinned_gbps(g: Graph, direction: str, assumed: float = PINNED_GBPS) -> tuple[float, str]:
    """(GB/s a pinned copy in ``direction`` ("HtoD" / "DtoH") runs at, where that comes from):
    the median of the trace's own pinned copies of at least 1 MiB that way, else ``assumed``."""
    if g.nbytes is not None:
        own = _name_mask(g, lambda n: n.startswith(f"Memcpy {direction}") and "Pinned" in n)
        own &= g.nbytes >= PINNED_MEASURE_MIN_BYTES
        dur = g.end - g.start
        ok = own & (dur > 0)
        if ok.any():
            return float(np.median(g.nbytes[ok] / dur[ok] / 1e3)), f"the trace's own pinned {direction} copies"
    return assumed, f"{assumed:g} GB/s assumed (no pinned {direction} copy of 1 MiB or more in the trace)"


def waited_copies(g: Graph, copies: set[int]) -> set[int]:
    """The copies of ``copies`` something waits on, which pinning cannot make non-blocking: every
    device-to-host copy (a read-back: the CPU reads what it copied), and every copy whose call is
    followed by a synchronization (``cuda*Synchronize``, an event wait) before the thread's next
    GPU launch (the data, or the queue behind it, is needed at once). A trace cannot tell torch's
    own synchronization of a blocking ``.to()`` from one the program needs: both are kept."""
    if not copies:
        return set()
    out = {i for i in copies if g.names[i].startswith("Memcpy DtoH")}
    launches = np.sort(g.key[~g.backlog]) if g.key.size else g.key
    calls = sorted(g.syncs, key=lambda s: s[0])
    own = {}  # copy -> its own call's end
    for ts, te, a, gap, row in calls:
        if a in copies and a not in own and ts <= g.key[a] + 0.5:
            own[a] = te
    starts = np.array([c[0] for c in calls], dtype=np.float64)
    for i, te in own.items():
        if i in out:
            continue
        nxt = launches[np.searchsorted(launches, te, side="right")] if launches.size else np.inf
        nxt = nxt if np.searchsorted(launches, te, side="right") < launches.size else np.inf
        lo, hi = np.searchsorted(starts, te, side="left"), np.searchsorted(starts, nxt, side="left")
        if any(not (calls[j][2] in copies and calls[j][0] <= g.key[calls[j][2]] + 0.5) for j in range(lo, hi)):
            out.add(i)
    return out


def fix_pin(g: Graph, assumed_gbps: float = PINNED_GBPS) -> Fix | None:
    """Pinned host memory: every copy from or to pageable memory runs at the pinned rate
    (:func:`pinned_gbps`; never slower than measured); a copy nothing waits on no longer blocks
    the CPU (a pinned copy with ``non_blocking=True`` is asynchronous), while a read-back or a copy
    the thread synchronizes on right after (:func:`waited_copies`) still blocks until it is done."""
    page = _name_mask(g, lambda n: n.startswith(("Memcpy HtoD", "Memcpy DtoH")) and "Pageable" in n)
    if not page.any() or g.nbytes is None:
        return None
    steps = max(len(g.steps), 1)
    span = (g.steps[-1].end - g.steps[0].start) / steps if g.steps else 0.0
    copies = set(np.flatnonzero(page).tolist())
    blocked = sum(te - ts for ts, te, a, gap, row in g.syncs if a in copies and row not in g.device_syncs)
    if max(float((g.end - g.start)[page].sum()), blocked) / steps < PIN_MIN_SHARE * span:
        # a few small copies (a batch's ids) that neither take nor block for long: not worth a
        # replay; the rule estimates them. A small copy that waits long for the GPU's queue is replayed
        return None
    fx = Fix("pin")
    dur = g.end - g.start
    notes = []
    for direction in ("HtoD", "DtoH"):
        sel = page & _name_mask(g, lambda n, d=direction: n.startswith(f"Memcpy {d}"))
        if not sel.any():
            continue
        gbps, src = pinned_gbps(g, direction, assumed_gbps)
        for i in np.flatnonzero(sel).tolist():
            if dur[i] > 0 and g.nbytes[i] > 0:
                fx.scale[i] = min(g.nbytes[i] / (gbps * 1e3) / dur[i], 1.0)
        notes.append(f"{int(sel.sum())} pageable {direction} copies at {gbps:.1f} GB/s ({src})")
    waited = waited_copies(g, copies)
    for ts, te, a, gap, row in g.syncs:
        # the copy's own call (a later synchronization that waited for it waits as measured)
        if a in copies and a not in waited and row not in g.device_syncs and ts <= g.key[a] + 0.5:
            fx.free_syncs.add(row)
    kept = (
        f"; {len(waited)} copies kept blocking (read-backs, or synchronized on before the next launch)"
        if waited
        else ""
    )
    fx.note = "; ".join(notes) + f"; {len(fx.free_syncs)} blocking copy calls no longer block" + kept
    return fx if fx.scale or fx.free_syncs else None


#: a fused AdamW step moves about a third of the bytes the per-op kernels move per parameter (~28:
#: read the parameter, its gradient and both moments, write three; against ~84 over the ~8 ops of
#: the per-parameter or foreach step) and pays no tiny kernel's own floor per op
FUSED_TRAFFIC = 1 / 3
KERNEL_FLOOR_US = 2.0


def fix_fused_optimizer(g: Graph, traffic: float = FUSED_TRAFFIC) -> Fix | None:
    """``AdamW(fused=True)`` for an optimizer step that runs per-parameter or foreach kernels: in
    each ``Optimizer.step`` range, the CPU does one op's work per tensor (group) instead of one per
    op — its CPU time × the share of the most frequent kernel's count it keeps (one kernel per
    tensor, or per group, of ~8 per tensor or group: the count of its rarest kernel name), the
    launches compressed into that time — and each kernel keeps FUSED_TRAFFIC of its time above a
    tiny kernel's floor (KERNEL_FLOOR_US)."""
    fx = Fix("fused_optimizer")
    dur = g.end - g.start
    notes = []
    for a, b in g.ranges.get("optimizer", []):
        m = np.flatnonzero((g.key >= a) & (g.key < b) & g.is_compute & ~g.backlog)
        if m.size < 2 or b <= a:
            continue
        codes = (
            g.name_code[m]
            if g.name_code is not None
            else np.unique(np.array([g.names[i] for i in m]), return_inverse=True)[1]
        )
        counts = np.unique(codes, return_counts=True)[1]
        units = int(counts.min())
        keep = (b - a) * min(units / m.size, 1.0)
        fx.cpu_cuts.append((a + keep, b))
        for i in m.tolist():
            fx.move[i] = a + (g.key[i] - a) * keep / (b - a)
            fx.scale[i] = max(dur[i] - KERNEL_FLOOR_US, 0.0) * traffic / dur[i] if dur[i] > 0 else 1.0
        notes.append((m.size, units, b - a, keep))
    if not notes:
        return None
    k, u, cpu, keep = (sum(x[i] for x in notes) / len(notes) for i in range(4))
    fx.note = (
        f"{k:.0f} optimizer kernels a step ({u:.0f} of its rarest), {cpu / 1e3:.2f} ms of CPU: fused, the step keeps "
        f"{keep / 1e3:.2f} ms of CPU and {100 * traffic:.0f}% of the kernels' time above {KERNEL_FLOOR_US:g} µs each"
    )
    return fx


FIXES = {
    "prefetch": fix_prefetch,
    "pin": fix_pin,
    "offload_off": fix_offload_off,
    "rate_limiter_off": fix_rate_limiter_off,
    "mixed_precision": fix_mixed_precision,
    "wrap": fix_wrap,
    "hooks_off": fix_hooks_off,
    "hooks_half": fix_hooks_half,
    "fused_optimizer": fix_fused_optimizer,
    "no_sync": fix_no_sync,
}

#: each fix's stated assumptions: (what is assumed, the keyword arguments of its transformation
#: at the end of the span that saves least, at the end that saves most). The replay runs the fix
#: at both ends of each; the saving's range is their span (fsdpdoctor.savings). A fix whose
#: transformation reads everything from the trace (prefetch, offload off, the rate limiter off,
#: the wrap split) has none: its span is the replay without the waits the trace does not explain.
ASSUMPTIONS: dict[str, list[tuple[str, dict, dict]]] = {
    "tensor_cores": [
        (
            "the fp32 matmuls' rate on tensor cores: 35-70% of the dense BF16 peak (FP16 without BF16; 50% assumed)",
            {"share": 0.35},
            {"share": 0.7},
        ),
        (
            "fp32 elementwise kernels in bf16 (fp16 without it): 0.75-0.4 of their time (0.5 assumed)",
            {"elementwise": 0.75},
            {"elementwise": 0.4},
        ),
    ],
    "mixed_precision": [
        (
            "fp32 compute kernels in bf16 (fp16 without it): 0.7-0.35 of their time (0.5 assumed)",
            {"compute": 0.7},
            {"compute": 0.35},
        ),
    ],
    "hooks_half": [
        (
            "the hook CPU two blocks per unit keep: 75-50% (50% assumed: a merged unit's hooks cost one unit's)",
            {"kept": 0.75},
            {"kept": 0.5},
        ),
    ],
    "pin": [
        (
            "an assumed pinned link's bandwidth: 12.5-50 GB/s (25 GB/s assumed; a measured one is kept)",
            {"assumed_gbps": 12.5},
            {"assumed_gbps": 50.0},
        ),
    ],
    "fused_optimizer": [
        (
            "a fused AdamW step's memory traffic: 50-25% of the per-op kernels' (33% assumed)",
            {"traffic": 0.5},
            {"traffic": 0.25},
        ),
    ],
}
