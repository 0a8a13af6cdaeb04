"""Where a step goes against the ideal: the step split into parts that add up to it.

Per rank, over the step's own GPU work (what its CPU span launched, as the timeline assigns it):

* **matmul / attention at peak**: the model FLOPs of the matmul (attention) kernels at the
  device's dense BF16 peak (``ComputeFacts.peak_tflops``), so that their sum over the step is the
  MFU; **below peak**: those kernels' time (the union of their intervals) less that. Attention
  time is counted where no matmul runs. Without recorded shapes, matmul and attention kernels are
  found by their names and their time is all "below peak" (the split is unknown; a note says so);
  with shapes, so are the ones no counted op launched (custom ops: vLLM's fused MoE GEMMs, FP8
  paged attention), whose FLOPs are unknown.
* **recompute**: kernels of activation checkpointing's re-run forward, every re-run op (the
  region of a backward node from its first forward-only op, ``aten::linear`` / ``layer_norm`` /
  SDPA …, through its last, and the forward activations that follow it), where no model matmul
  or attention runs.
* **other kernels**: the rest of the compute (elementwise, norms, softmax, casts, copies on
  compute streams, the optimizer), split by family.
* **exposed comm / exposed copies**: as :mod:`fsdpdoctor.analysis.timeline` measures them
  (``StepFacts.exposed_comm_ms`` / ``memcpy_ms``).
* **GPU idle**: the step time (``StepFacts.step_ms``) less the GPU's busy time with the step's
  work (``StepFacts.gpu_busy_ms``); what the CPU was doing meanwhile is
  :mod:`fsdpdoctor.analysis.efficiency.idle`'s.

Each GPU instant is attributed once, to the first part above that covers it, so the busy parts
add up to the step's busy time and all parts to the step (per rank, means over its steps).
"""

from __future__ import annotations

import numpy as np

from fsdpdoctor.facts import ComputeFacts, StepFacts
from fsdpdoctor.facts.efficiency import FAMILIES, EfficiencyFacts, GemmShape, HookCost, IdleOp, SyncSite, empty_parts
from fsdpdoctor.ingest.events import GEMM_OPS
from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.ingest.shapes import decode_list
from fsdpdoctor.analysis.compute import KernelFlops, _op_dtype, kernel_class, launching_ops
from fsdpdoctor.analysis.efficiency.idle import TOP_IDLE_OPS, idle_and_hooks
from fsdpdoctor.analysis.fsdp import BACKWARD_NODE_PREFIX, FORWARD_ONLY_OPS
from fsdpdoctor.analysis.labels import enclosing
from fsdpdoctor.analysis.rows import name_lut, name_rows
from fsdpdoctor.analysis.steps import PHASES, StepWindow
from fsdpdoctor.analysis.timeline import GpuSteps

#: forward activations that follow a block's last forward-only op in a re-run forward
FORWARD_TAIL_OPS = frozenset(
    {
        "aten::gelu",
        "aten::relu",
        "aten::relu_",
        "aten::silu",
        "aten::silu_",
        "aten::dropout",
        "aten::native_dropout",
        "aten::tanh",
        "aten::sigmoid",
        "aten::hardtanh_",
        "aten::add",
        "aten::add_",
        "aten::mul",
    }
)
TOP_GEMM_SHAPES = 8
SMALL_GEMM_FLOP = 2.0 * 512**3  # a matmul under this many FLOPs per call is "small"


def family(kernel: str, op: str, optimizer: bool) -> str:
    """The family of a non-matmul kernel, from its name, the op that launched it and whether it
    ran in the optimizer step (see :data:`fsdpdoctor.facts.efficiency.FAMILIES`)."""
    k, o = kernel.lower(), op.lower()
    if optimizer:
        if "_fused_" in o or "fused_adam" in k or "fusedadam" in k or "fused_sgd" in k:
            return "optimizer_fused"
        if "_foreach_" in o or "multi_tensor_apply" in k:
            return "optimizer_foreach"
        return "optimizer_per_parameter"
    both = o + " " + k
    if any(
        x in both for x in ("layer_norm", "rms_norm", "layernorm", "rmsnorm", "batch_norm", "group_norm", "batchnorm")
    ):
        return "norm"
    if any(x in both for x in ("softmax", "cross_entropy", "nll_loss")):
        return "softmax_loss"
    if o in ("aten::_to_copy", "aten::to") or "_to_copy" in o:
        return "casts"
    if any(x in both for x in ("copy", "clone", "contiguous", "aten::cat", "chunk_cat", "split_with_sizes", "cat_")):
        return "copies"
    if any(x in both for x in ("embedding", "index_select", "indexing_backward", "index_add", "index_put")):
        return "embedding"
    if "reduce_kernel" in k or o in ("aten::sum", "aten::mean", "aten::norm", "aten::linalg_vector_norm", "aten::amax"):
        return "reductions"
    if "elementwise" in k or o.startswith("aten::") or "fill" in k:
        return "elementwise"
    return "other"


def recompute_regions(rt: RankTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activation checkpointing's re-run forwards: (thread, start, end) CPU ranges, one per
    backward node that runs forward-only ops (its innermost such node), from the first of them to
    the end of the last, extended over the forward activations right after it."""
    none = (np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    nodes = name_rows(rt, lambda n: n.startswith(BACKWARD_NODE_PREFIX), "cpu_op")
    if nodes.size == 0:
        return none
    ops = name_rows(rt, lambda n: n in FORWARD_ONLY_OPS, "cpu_op")
    chains = enclosing(rt, nodes, ops) if ops.size else {}
    by_node: dict[int, list[int]] = {}
    for r, ch in chains.items():
        if ch:
            by_node.setdefault(ch[-1], []).append(r)
    if not by_node:
        return none
    tail = name_rows(rt, lambda n: n in FORWARD_TAIL_OPS, "cpu_op")
    tail = tail[np.argsort(rt.ts[tail], kind="stable")]
    out = []
    for node, rs in by_node.items():
        rs_a = np.array(rs)
        a, b = float(rt.ts[rs_a].min()), float((rt.ts[rs_a] + rt.dur[rs_a]).max())
        node_end = float(rt.ts[node] + rt.dur[node])
        th = int(rt.thread[node])
        # forward activations right after the last forward-only op (a block's closing GELU)
        j = int(np.searchsorted(rt.ts[tail], b, side="left"))
        while j < tail.size and rt.ts[tail[j]] < node_end and rt.thread[tail[j]] == th and rt.ts[tail[j]] - b < 50.0:
            b = max(b, float(rt.ts[tail[j]] + rt.dur[tail[j]]))
            j += 1
        out.append((th, a, b))
    out.sort()
    t, s, e = (np.array(x) for x in zip(*out))
    return t.astype(np.int64), s.astype(np.float64), e.astype(np.float64)


def _in_regions(regions, thread: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Whether each CPU time ``t`` on ``thread`` lies in one of ``regions``."""
    rth, rs, re_ = regions
    out = np.zeros(t.size, dtype=bool)
    for th in np.unique(rth).tolist():
        m = rth == th
        s, e = iv.merge(rs[m], re_[m])
        sel = np.flatnonzero(thread == th)
        k = np.searchsorted(s, t[sel], side="right") - 1
        ok = k >= 0
        out[sel[ok]] = t[sel[ok]] <= e[k[ok]]
    return out


def analyze_efficiency(
    rt: RankTrace,
    steps: list[StepWindow],
    step_facts: list[StepFacts],
    gs: GpuSteps,
    kf: KernelFlops,
    compute: ComputeFacts | None,
    checkpointing: bool | None = None,
) -> EfficiencyFacts | None:
    """The rank's waterfall over its steps (means per step); None without steps or GPU work.
    ``checkpointing``: ``FsdpFacts.activation_checkpointing`` (False: no re-run forward to find)."""
    g = gs.g
    n = len(step_facts)
    if n == 0 or g.rows.size == 0 or not any(sf.gpu_start_us is not None for sf in step_facts):
        return None
    rows = g.rows
    own = gs.step >= 0
    comp = g.compute & own
    start = rt.ts[rows].astype(np.float64)
    end = start + rt.dur[rows]
    eff = EfficiencyFacts(step_ms=sum(sf.step_ms for sf in step_facts) / n)
    # matmul / attention / recompute / flops of every GPU row
    flops = np.zeros(rows.size)
    is_mm = np.zeros(rows.size, dtype=bool)
    is_attn = np.zeros(rows.size, dtype=bool)
    rec = np.zeros(rows.size, dtype=bool)
    pos = np.searchsorted(rows, kf.rows)
    ok = (pos < rows.size) & (rows[np.minimum(pos, rows.size - 1)] == kf.rows) if kf.rows.size else np.zeros(0, bool)
    pos, kfi = pos[ok], np.flatnonzero(ok)
    eff.flops_known = bool(kfi.size) and compute is not None and bool(compute.source)
    # by name, tested once per distinct name: every matmul / attention kernel without shapes, and
    # (with shapes) those no counted op launched (custom ops: vLLM's fused MoE, FP8 attention)
    by_name = np.ones(rows.size, dtype=bool)
    if eff.flops_known:
        flops[pos] = kf.flops[kfi]
        is_attn[pos] = kf.attention[kfi]
        is_mm[pos] = ~kf.attention[kfi]
        rec[pos] = kf.recompute[kfi]
        by_name[pos] = False
    row_names = rt.name[rows]
    is_attn |= by_name & name_lut(rt, lambda x: kernel_class(x) == "attention")[row_names]
    is_mm |= by_name & name_lut(rt, lambda x: kernel_class(x) == "gemm")[row_names]
    regions = recompute_regions(rt) if checkpointing is not False else (np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    lr = g.launch_row if g.launch_row is not None else np.full(rows.size, -1, dtype=np.int64)
    has_l = lr >= 0
    if regions[0].size:
        rec[has_l] |= _in_regions(regions, rt.thread[lr[has_l]].astype(np.int64), rt.ts[lr[has_l]].astype(np.float64))
    m_sel = comp & is_mm & ~rec  # the step's own model matmuls: their FLOPs
    a_sel = comp & is_attn & ~rec
    # the parts' time: every kernel on the GPU timeline inside the steps' intervals on the step
    # clock (whichever step launched it), each instant to the first part that covers it
    mm_k, at_k, rc_k = g.compute & is_mm & ~rec, g.compute & is_attn & ~rec, g.compute & rec
    windows = step_windows(steps, step_facts)
    order = np.argsort(start, kind="stable")  # one sort for every union
    so, eo = start[order], end[order]

    def union(sel: np.ndarray) -> iv.Intervals:
        m = sel[order]
        return iv.intersect(iv.merge_sorted(so[m], eo[m]), windows)

    classified = g.comm | g.compute | g.memory
    u_m, u_ma, u_mar = union(mm_k), union(mm_k | at_k), union(mm_k | at_k | rc_k)
    u_c, u_cc, u_all = union(g.compute), union(g.compute | g.comm), union(classified)
    t_m, t_ma, t_mar, t_c, t_cc, t_all = (iv.total(u) / 1e3 / n for u in (u_m, u_ma, u_mar, u_c, u_cc, u_all))
    eff.matmul_ms = t_m
    eff.attention_ms = t_ma - t_m
    eff.matmul_flops = float(flops[m_sel].sum()) / n
    eff.attention_flops = float(flops[a_sel].sum()) / n
    eff.gpu_busy_ms = sum(sf.gpu_busy_ms for sf in step_facts) / n
    eff.measured_ms = {
        "recompute": t_mar - t_ma,
        "other_kernels": t_c - t_mar,
        "exposed_comm": t_cc - t_c,
        "exposed_copies": t_all - t_cc,
    }
    eff.window_ms = iv.total(windows) / 1e3 / n
    eff.window_idle_ms = eff.window_ms - t_all
    busy_all = iv.merge(start[classified], end[classified])
    # contributors: the other kernels by family, the matmul shapes, the optimizer's style
    op = launching_ops(rt, rows)
    o_sel = g.compute & ~(mm_k | at_k | rc_k)
    opt_phase = gs.phase == PHASES.index("optimizer")
    fam = _families(rt, rows, op, o_sel, opt_phase)
    target = iv.subtract(u_c, u_mar)
    parts = iv.attribute(target, start[o_sel], end[o_sel], fam[o_sel]) if o_sel.any() else {}
    eff.other_kernels_ms = {f: parts[f] / 1e3 / n for f in FAMILIES if parts.get(f, 0.0) > 0.1}
    if parts.get(None):
        eff.other_kernels_ms["other"] = eff.other_kernels_ms.get("other", 0.0) + parts[None] / 1e3 / n
    opt_k = own & g.compute & opt_phase & (fam != "")
    if opt_k.any():
        in_opt = fam[opt_k]
        styled = np.fromiter((f.startswith("optimizer_") for f in in_opt.tolist()), dtype=bool, count=in_opt.size)
        kinds, counts = np.unique(in_opt[styled], return_counts=True)
        if kinds.size:
            eff.optimizer = str(kinds[int(np.argmax(counts))]).removeprefix("optimizer_").replace("_", "-")
            eff.optimizer_kernels_per_step = float(counts.sum()) / n
            # what fusing it could save at most: its CPU span and its kernels' time
            cpu = sum(sf.phase_ms.get("optimizer", 0.0) for sf in step_facts) / n
            gpu = float((end[opt_k] - start[opt_k]).sum()) / 1e3 / n
            eff.optimizer_ms = cpu + gpu
    if eff.flops_known:
        eff.gemm_shapes = _gemm_shapes(rt, rows, kf, pos, kfi, m_sel, start, end, n, compute)
    kern = own  # kernels, copies and memsets: each is a launch
    eff.kernels_per_step = float(kern.sum()) / n
    kl = kern & has_l
    eff.launch_bound_kernels_per_step = float(np.sum(rt.dur[rows[kl]] < rt.dur[lr[kl]])) / n
    idle_and_hooks(eff, rt, steps, windows, busy_all, gs)
    split(eff, compute.peak_tflops if compute is not None else None)
    if not eff.flops_known:
        eff.notes.append(
            "no recorded shapes: matmul and attention kernels found by name, their at-peak part unknown "
            "(all of their time shown below peak)"
        )
    return eff


def _families(rt: RankTrace, rows: np.ndarray, op: np.ndarray, sel: np.ndarray, opt: np.ndarray) -> np.ndarray:
    """The family of each selected row ("" elsewhere), worked out once per (kernel, op, phase)."""
    out = np.full(rows.size, "", dtype=object)
    idx = np.flatnonzero(sel | opt)
    if idx.size == 0:
        return out
    kname = rt.name[rows[idx]].astype(np.int64)
    oname = np.where(op[idx] >= 0, rt.name[np.maximum(op[idx], 0)], -1).astype(np.int64) + 1
    n_names = len(rt.names) + 1
    key = (kname * n_names + oname) * 2 + opt[idx].astype(np.int64)  # one integer per (kernel, op, phase)
    uniq, inv = np.unique(key, return_inverse=True)
    fams = np.array(
        [
            family(
                rt.names[int(k // 2 // n_names)],
                rt.names[int(k // 2 % n_names) - 1] if k // 2 % n_names else "",
                bool(k % 2),
            )
            for k in uniq.tolist()
        ],
        dtype=object,
    )
    out[idx] = fams[inv.reshape(-1)]
    return out


def _gemm_dims(name: str, dims: list) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a matmul op from its input dims."""
    t = [d for d in dims if isinstance(d, list)]
    try:
        if name in ("aten::mm", "aten::_scaled_mm"):
            (m, k), (_, n) = t[0], t[1]
            return 1, m, k, n
        if name in ("aten::addmm", "aten::_addmm_activation"):
            (m, k), (_, n) = t[1], t[2]
            return 1, m, k, n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = t[0], t[1]
            return b, m, k, n
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = t[1], t[2]
            return b, m, k, n
    except (ValueError, TypeError, IndexError):
        return None
    return None


def _gemm_shapes(rt, rows, kf, pos, kfi, m_sel, start, end, n, compute) -> list[GemmShape]:
    """The model matmuls by shape, those furthest below the peak first (at most TOP_GEMM_SHAPES)."""
    peak = compute.peak_tflops if compute is not None else None
    sel = m_sel[pos]
    if not sel.any() or kf.ops is None:
        return []
    p, k = pos[sel], kfi[sel]
    # one key per distinct op (its name and recorded dims), then sums by key
    ops, inv = np.unique(kf.ops[k], return_inverse=True)
    key_of: dict[tuple, int] = {}
    info: list[tuple] = []
    gid = np.empty(ops.size, dtype=np.int64)
    for i, r_op in enumerate(ops.tolist()):
        a = rt.args.get(int(r_op))
        raw = a.input_dims if a is not None else None
        key = (rt.row_name(int(r_op)), bytes(raw) if raw is not None else b"")
        j = key_of.setdefault(key, len(key_of))
        if j == len(info):
            info.append((key[0], key[1], a.input_type if a is not None else None))
        gid[i] = j
    g = gid[inv.reshape(-1)]
    dur = end[p] - start[p]
    us = np.bincount(g, weights=dur, minlength=len(info))
    fl = np.bincount(g, weights=kf.flops[k], minlength=len(info))
    calls = np.bincount(gid, minlength=len(info))
    engines = np.array(kf.engine, dtype=object)[k]
    eng_names, eng_code = np.unique(engines.astype(str), return_inverse=True)
    by_eng = np.zeros((len(info), eng_names.size))
    np.add.at(by_eng, (g, eng_code.reshape(-1)), dur)
    groups = {
        (name, raw): {
            "ops": int(calls[j]),
            "us": float(us[j]),
            "flops": float(fl[j]),
            "type": typ,
            "eng": str(eng_names[int(np.argmax(by_eng[j]))]) if eng_names.size else None,
        }
        for j, (name, raw, typ) in enumerate(info)
    }
    out = []
    for (name, raw), d in groups.items():
        ms = d["us"] / 1e3 / n
        at = d["flops"] / n / (peak * 1e9) if peak else 0.0
        dims = _gemm_dims(name, decode_list(raw)) if name in GEMM_OPS or name.startswith("aten::") else None
        shape, flags = "?", []
        if dims is not None:
            b, m, kk, nn = dims
            shape = (f"{b}×" if b > 1 else "") + f"{m}×{kk} · " + (f"{b}×" if b > 1 else "") + f"{kk}×{nn}"
            if any(x % 64 for x in (m, kk, nn)):
                flags.append("dims not multiples of 64: " + ", ".join(str(x) for x in (m, kk, nn) if x % 64))
            if 2.0 * b * m * kk * nn < SMALL_GEMM_FLOP:
                flags.append("small (under 0.27 GFLOP a call)")
        out.append(
            GemmShape(
                op=name,
                shape=shape,
                dtype=_op_dtype(d["type"]) if d["type"] is not None else None,
                engine=d["eng"],
                calls_per_step=d["ops"] / n,
                ms_per_step=ms,
                gflop_per_step=d["flops"] / n / 1e9,
                tflops=d["flops"] / (d["us"] * 1e6) if d["us"] > 0 else None,
                below_peak_ms=max(ms - at, 0.0),
                flags=flags,
            )
        )
    out.sort(key=lambda x: -x.below_peak_ms)
    return out[:TOP_GEMM_SHAPES]


def step_windows(steps: list[StepWindow], step_facts: list[StepFacts]) -> iv.Intervals:
    """Each step's interval on the step clock, end to end: the clock's intervals
    (``StepFacts.step_ms``) ending at the steps' completions (``end_us``) when it is the
    completion clock, at the CPU spans' ends when it is the CPU's (see
    :func:`fsdpdoctor.analysis.steps.step_times_ms`); they tile the steps' time."""
    t = np.array([sf.step_ms for sf in step_facts]) * 1e3
    cpu_end = np.maximum.accumulate(np.array([st.end for st in steps], dtype=np.float64))
    cpu = np.diff(np.concatenate(([min(float(steps[0].start), float(cpu_end[0]))], cpu_end)))
    done = np.array(
        [sf.end_us if sf.end_us is not None else st.end for sf, st in zip(step_facts, steps)], dtype=np.float64
    )
    ends = cpu_end if np.allclose(t, cpu, rtol=1e-9, atol=1e-6) else done
    return iv.merge(ends - t, ends)


def split(eff: EfficiencyFacts, peak_tflops: float | None) -> EfficiencyFacts:
    """The parts at ``peak_tflops`` (TFLOP/s), each as measured: the at-peak parts from the FLOPs,
    below peak the matmul (attention) kernels' time less that, the other busy parts and the idle
    as measured in the steps' intervals, and ``unattributed`` what they leave of the step (never
    spread over them; negative where the at-peak time exceeds the kernels' own time)."""
    eff.peak_tflops = peak_tflops
    p = eff.parts_ms = empty_parts()
    if eff.flops_known and peak_tflops:
        p["matmul_at_peak"] = eff.matmul_flops / (peak_tflops * 1e9)
        p["attention_at_peak"] = eff.attention_flops / (peak_tflops * 1e9)
    p["matmul_below_peak"] = max(eff.matmul_ms - p["matmul_at_peak"], 0.0)
    p["attention_below_peak"] = max(eff.attention_ms - p["attention_at_peak"], 0.0)
    for k in _FOLDED_PARTS:
        p[k] = eff.measured_ms.get(k, 0.0)
    p["gpu_idle"] = max(eff.window_idle_ms, 0.0)
    p["unattributed"] = 0.0
    rest = eff.step_ms - sum(p.values())
    p["unattributed"] = rest if abs(rest) >= UNATTRIBUTED_MIN_MS else 0.0
    if not eff.other_kernels_ms and p["other_kernels"] > 0:
        eff.other_kernels_ms = {"other": p["other_kernels"]}
    _idle_unattributed(eff)
    return eff


#: below this (ms per step) what the parts leave of the step is rounding, shown as 0: 1 µs, four
#: times the resolution of a float64 timestamp in µs since the epoch at ns precision (~0.25 µs)
UNATTRIBUTED_MIN_MS = 1e-3


def _idle_unattributed(eff: EfficiencyFacts) -> None:
    """What the idle's measured causes (``idle_ms``, each the gaps of its kind) leave of the idle
    part, as the cause ``unattributed`` (with its size, where it is 1 µs or more): the causes are
    never scaled to fill the part (#42.5; they tiled it on every input measured)."""
    eff.idle_ms.pop("unattributed", None)
    rest = eff.parts_ms["gpu_idle"] - sum(eff.idle_ms.values())
    if abs(rest) >= UNATTRIBUTED_MIN_MS:
        eff.idle_ms["unattributed"] = rest


_SCALARS = (
    "step_ms",
    "matmul_ms",
    "attention_ms",
    "matmul_flops",
    "attention_flops",
    "gpu_busy_ms",
    "window_ms",
    "window_idle_ms",
    "optimizer_ms",
    "kernels_per_step",
    "launch_bound_kernels_per_step",
    "optimizer_kernels_per_step",
    "compiled_ms",
)
#: a sync site's figures folded as means over ranks
_SYNC_FIELDS = (
    "calls_per_step",
    "cpu_ms_per_step",
    "gpu_idle_ms_per_step",
    "bytes_per_call",
    "waited_busy_ms_per_step",
    "waited_comm_ms_per_step",
    "waited_idle_ms_per_step",
    "longest_idle_ms",
)
_FOLDED_PARTS = ("recompute", "other_kernels", "exposed_comm", "exposed_copies")


class EfficiencyFold:
    """The run's waterfall as ranks arrive: each rank's figures in columns (its EfficiencyFacts
    need not be kept), read back in rank order; the run's figures are means over the ranks that
    have a waterfall, split on the run's step clock."""

    __slots__ = ("cols", "info", "styles")

    def __init__(self) -> None:
        from fsdpdoctor.analysis.columns import Columns

        self.cols = Columns()
        self.info: dict = {}  # gemm key → (op, shape, dtype, engine, flags); sync site → line
        self.styles: dict[str, int] = {}  # optimizer style → ranks

    def add(self, rank: int, e: EfficiencyFacts | None) -> None:
        if e is None:
            return
        row: dict = {"eff": 1.0, "known": float(e.flops_known)}
        row.update({a: getattr(e, a) for a in _SCALARS})
        row.update({("measured", p): e.measured_ms.get(p, 0.0) for p in _FOLDED_PARTS})
        row.update({("family", f): v for f, v in e.other_kernels_ms.items()})
        row.update({("idle", c): v for c, v in e.idle_ms.items()})
        for h in e.hooks:
            k = (h.unit, h.hook)
            row[("hook_calls", k)], row[("hook_cpu", k)], row[("hook_wait", k)] = (
                h.calls_per_step,
                h.cpu_ms_per_step,
                h.gpu_wait_ms_per_step,
            )
        for x in e.gemm_shapes:
            k = (x.op, x.shape, x.dtype)
            self.info.setdefault(k, (x.engine, list(x.flags)))
            row[("gemm_calls", k)], row[("gemm_ms", k)], row[("gemm_gflop", k)] = (
                x.calls_per_step,
                x.ms_per_step,
                x.gflop_per_step,
            )
        for s in e.syncs:
            self.info.setdefault(s.site, (s.line, s.annotation, s.op, s.tensor, s.copy))
            row.update({("sync_" + f, s.site): getattr(s, f) for f in _SYNC_FIELDS})
        for o in e.idle_ops:
            row[("idle_op", o.name)], row[("idle_op_cpu", o.name)] = o.gpu_idle_ms_per_step, o.cpu_ms_per_step
        if e.optimizer:
            self.styles[e.optimizer] = self.styles.get(e.optimizer, 0) + 1
        self.cols.add(rank, row)

    def _mean(self, key) -> float:
        vals = self.cols.filled(key, 0.0, among="eff")
        return float(np.mean(vals)) if vals else 0.0

    def result(self, step_ms: float | None, peak_tflops: float | None) -> EfficiencyFacts | None:
        cols = self.cols
        if not cols.values("eff"):
            return None
        out = EfficiencyFacts(ranks=len(cols.values("eff")))
        for a in _SCALARS:
            setattr(out, a, self._mean(a))
        if step_ms:  # the run's clock; what it differs from the ranks' mean step is unattributed
            if out.step_ms and abs(step_ms - out.step_ms) >= 0.005:
                out.notes.append(
                    f"the run's step ({step_ms:.2f} ms, its clock) differs from the ranks' mean step "
                    f"({out.step_ms:.2f} ms, where their parts are measured) by {step_ms - out.step_ms:+.2f} ms: "
                    "that difference is part of the unattributed time"
                )
            out.step_ms = step_ms
        out.flops_known = bool(cols.values("known")) and min(cols.values("known")) > 0
        out.measured_ms = {p: self._mean(("measured", p)) for p in _FOLDED_PARTS}
        out.other_kernels_ms = {f: self._mean(("family", f)) for f in FAMILIES if f in cols.keys("family")}
        out.idle_ms = {c: self._mean(("idle", c)) for c in cols.keys("idle")}
        out.hooks = sorted(
            (
                HookCost(
                    unit=k[0],
                    hook=k[1],
                    calls_per_step=self._mean(("hook_calls", k)),
                    cpu_ms_per_step=self._mean(("hook_cpu", k)),
                    gpu_wait_ms_per_step=self._mean(("hook_wait", k)),
                )
                for k in cols.keys("hook_calls")
            ),
            key=lambda c: (-c.gpu_wait_ms_per_step, -c.cpu_ms_per_step, c.unit, c.hook),
        )
        shapes = []
        for k in cols.keys("gemm_calls"):
            ms, gf = self._mean(("gemm_ms", k)), self._mean(("gemm_gflop", k))
            at = gf / peak_tflops if peak_tflops else 0.0
            eng, flags = self.info.get(k, (None, []))
            shapes.append(
                GemmShape(
                    op=k[0],
                    shape=k[1],
                    dtype=k[2],
                    engine=eng,
                    calls_per_step=self._mean(("gemm_calls", k)),
                    ms_per_step=ms,
                    gflop_per_step=gf,
                    tflops=gf / ms if ms > 0 else None,
                    below_peak_ms=max(ms - at, 0.0),
                    flags=list(flags),
                )
            )
        out.gemm_shapes = sorted(shapes, key=lambda x: -x.below_peak_ms)[:TOP_GEMM_SHAPES]
        syncs = []
        for k in cols.keys("sync_calls_per_step"):
            line, ann, op, tensor, copy = self.info.get(k, (None,) * 5)
            figs = {f: self._mean(("sync_" + f, k)) for f in _SYNC_FIELDS}
            syncs.append(SyncSite(site=k, line=line, annotation=ann, op=op, tensor=tensor, copy=copy, **figs))
        out.syncs = sorted(syncs, key=lambda s: (-s.gpu_idle_ms_per_step, -s.cpu_ms_per_step, s.site))
        out.idle_ops = sorted(
            # the idle over every rank (a rank that does not list a range held little of it), the
            # CPU time over the ranks that list it (a range's own time is no less on the others)
            (
                IdleOp(k, self._mean(("idle_op", k)), float(np.mean(cols.values(("idle_op_cpu", k)))))
                for k in cols.keys("idle_op")
            ),
            key=lambda o: (-o.gpu_idle_ms_per_step, o.name),
        )[:TOP_IDLE_OPS]
        out.optimizer = max(self.styles, key=lambda s: (self.styles[s], s)) if self.styles else None
        if not out.flops_known:
            out.notes.append(
                "no recorded shapes on every rank: matmul and attention kernels found by name, their at-peak "
                "part unknown (all of their time shown below peak)"
            )
        return split(out, peak_tflops)
