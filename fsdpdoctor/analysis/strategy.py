"""Sharding-strategy advisor: FULL_SHARD vs SHARD_GRAD_OP vs HYBRID_SHARD vs NO_SHARD/DDP.

Plain arithmetic over a :class:`PlanInputs`, filled either from a measured run (RunFacts, the
sidecar, a memory snapshot) or from the command line (``fsdpdoctor plan``). Every input records
where it came from, so each estimate can be defended.

Memory per rank (ZeRO arithmetic, bytes per parameter *b* = stored param + grad + fp32 master
+ optimizer state, e.g. 2 + 2 + 4 + 8 = 16 for bf16 Adam with fp32 master weights):

- FULL_SHARD / FSDP2 default: b·P/W + 2 unsharded units (current + prefetched, in the
  communication dtype) + activations
- SHARD_GRAD_OP / ``reshard_after_forward=False``: b·P/W + the whole unsharded model (kept from
  forward to backward) + activations
- HYBRID_SHARD (shard within a node of G GPUs, replicate across nodes): b·P/G + 2 units + activations
- NO_SHARD / DDP: b·P + gradient buckets + activations

Communication per step, timed with the nccl-tests convention t = S·f(n)/busbw (f = (n−1)/n for
all-gather / reduce-scatter, 2(n−1)/n for all-reduce) on the link each collective crosses
(intra-node when its group fits in a node, else inter-node):

- FULL_SHARD: all-gather P in forward and again in backward, reduce-scatter P
- SHARD_GRAD_OP: all-gather P in forward, reduce-scatter P
- HYBRID_SHARD: FULL_SHARD's collectives within the node, plus an all-reduce of P/G across nodes
- DDP: one all-reduce of P

Exposed communication: forward collectives hide behind forward compute and backward ones behind
backward compute; what exceeds the compute is exposed, plus the first all-gather and the last
reduce-scatter (one unit each), which nothing can hide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from fsdpdoctor.facts import Candidate, RunFacts, StrategyFacts

GiB = 2**30
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "adagrad": 4, "rmsprop": 4, "adafactor": 2, "lion": 4}
DEFAULT_INTRA_BUSBW = 150.0  # GB/s, NVLink-class, reachable by NCCL collectives
DEFAULT_INTER_BUSBW = 25.0  # GB/s, 200 Gb/s InfiniBand / RoCE per GPU
DEFAULT_MEMORY_HEADROOM = 0.9  # a plan must leave 10% for the allocator and CUDA context
DDP_BUCKETS_BYTES = 2 * 25 * 2**20
#: the estimate of the current strategy must land within this % of the measured step for the
#: model to recommend anything: one that misses the run it describes cannot rank the others
MODEL_TOLERANCE_PCT = 25.0
#: fewer parameters than this read from a trace's collectives are not a model's parameters (a
#: metric all-reduced, an embedding lookup's ids): the strategy cannot be estimated
MIN_PARAMS = 1_000_000
CANDIDATES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
CODE = {
    "FULL_SHARD": {
        "fsdp2": "fully_shard(block)  # default reshard_after_forward=True, for each block, then the root",
        "fsdp1": "FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=policy)",
    },
    "SHARD_GRAD_OP": {
        "fsdp2": "fully_shard(block, reshard_after_forward=False)  # for each block, then the root",
        "fsdp1": "FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, auto_wrap_policy=policy)",
    },
    "HYBRID_SHARD": {
        "fsdp2": "mesh = init_device_mesh('cuda', (num_nodes, gpus_per_node), mesh_dim_names=('replicate', 'shard'))\n"
        "fully_shard(block, mesh=mesh)  # HSDP: shard within a node, replicate across nodes",
        "fsdp1": "FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=policy)",
    },
    "NO_SHARD": {
        "fsdp2": "model = DistributedDataParallel(model, device_ids=[local_rank])",
        "fsdp1": "model = DistributedDataParallel(model, device_ids=[local_rank])  # or ShardingStrategy.NO_SHARD",
    },
}


@dataclass
class PlanInputs:
    params: float
    world_size: int
    gpus_per_node: int
    gpu_memory_bytes: float
    param_bytes: float = 2.0  # stored/communicated parameter dtype (bf16)
    grad_bytes: float = 2.0
    master_bytes: float = 4.0  # fp32 master copy when params are low precision
    optimizer_bytes: float = 8.0
    comm_bytes: float = 2.0  # all-gather dtype
    reduce_bytes: float = 2.0  # reduce-scatter / all-reduce dtype
    largest_unit_params: float = 0.0
    activation_bytes: float = 0.0
    compute_forward_ms: float = 0.0
    compute_backward_ms: float = 0.0
    compute_other_ms: float = 0.0  # optimizer step and anything else on the GPU
    # the optimizer step's GPU time per step (part of compute_other_ms), as measured under the
    # current strategy: each rank steps the parameters it holds, so it scales with 1 / the number
    # of ranks the parameters are sharded over (W under FULL/SHARD_GRAD_OP, G under HYBRID, 1 under DDP)
    optimizer_ms: float = 0.0
    other_ms: float = 0.0  # measured idle / memcpy that no strategy changes
    intra_busbw_gbps: float = DEFAULT_INTRA_BUSBW
    inter_busbw_gbps: float = DEFAULT_INTER_BUSBW
    current: str | None = None
    measured_step_ms: float | None = None
    sources: dict[str, str] = field(default_factory=dict)  # input → "measured" / "sidecar" / "assumed" / "given"

    @property
    def nodes(self) -> int:
        return max(1, -(-self.world_size // max(self.gpus_per_node, 1)))

    @property
    def bytes_per_param(self) -> float:
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes


def _t(size_bytes: float, factor: float, busbw_gbps: float) -> float:
    """nccl-tests time in ms for a collective of ``size_bytes`` at bus bandwidth ``busbw_gbps``."""
    return size_bytes * factor / (busbw_gbps * 1e9) * 1e3 if busbw_gbps > 0 else float("inf")


def estimate(inp: PlanInputs) -> list[Candidate]:
    P, W, G = inp.params, inp.world_size, min(inp.gpus_per_node, inp.world_size)
    n_nodes = inp.nodes
    b = inp.bytes_per_param
    unit = inp.largest_unit_params or P / 32
    act = inp.activation_bytes
    cf, cb = inp.compute_forward_ms, inp.compute_backward_ms
    shards = {"FULL_SHARD": W, "SHARD_GRAD_OP": W, "HYBRID_SHARD": G, "NO_SHARD": 1}
    opt_all = inp.optimizer_ms * shards.get(inp.current or "", 1)  # the whole model's optimizer step
    base0 = cf + cb + inp.compute_other_ms - inp.optimizer_ms + inp.other_ms
    base_of = lambda name: base0 + opt_all / max(shards[name], 1)  # noqa: E731
    bw_world = inp.intra_busbw_gbps if W <= G else inp.inter_busbw_gbps
    ag = lambda n, bw: _t(P * inp.comm_bytes, (n - 1) / n, bw) if n > 1 else 0.0  # noqa: E731
    rs = lambda n, bw: _t(P * inp.reduce_bytes, (n - 1) / n, bw) if n > 1 else 0.0  # noqa: E731

    def exposed(fwd: float, bwd: float, first: float, last: float) -> float:
        return max(0.0, fwd - cf) + max(0.0, bwd - cb) + first + last

    out = []
    share = unit / P if P else 0.0
    # FULL_SHARD
    f_ag, f_rs = ag(W, bw_world), rs(W, bw_world)
    mem = b * P / W + 2 * unit * inp.comm_bytes + act
    e = exposed(f_ag, f_ag + f_rs, share * f_ag, share * f_rs)
    out.append(
        Candidate(
            "FULL_SHARD",
            mem,
            False,
            2 * f_ag + f_rs,
            e,
            base_of("FULL_SHARD") + e,
            P * (2 * inp.comm_bytes + inp.reduce_bytes),
        )
    )
    # SHARD_GRAD_OP
    mem = b * P / W + P * inp.comm_bytes + act
    e = exposed(f_ag, f_rs, share * f_ag, share * f_rs)
    out.append(
        Candidate(
            "SHARD_GRAD_OP",
            mem,
            False,
            f_ag + f_rs,
            e,
            base_of("SHARD_GRAD_OP") + e,
            P * (inp.comm_bytes + inp.reduce_bytes),
        )
    )
    # HYBRID_SHARD: shard group = one node
    if n_nodes > 1:
        h_ag, h_rs = ag(G, inp.intra_busbw_gbps), rs(G, inp.intra_busbw_gbps)
        h_ar = _t(P / G * inp.reduce_bytes, 2 * (n_nodes - 1) / n_nodes, inp.inter_busbw_gbps)
        mem = b * P / G + 2 * unit * inp.comm_bytes + act
        e = exposed(h_ag, h_ag + h_rs + h_ar, share * h_ag, share * (h_rs + h_ar))
        out.append(
            Candidate(
                "HYBRID_SHARD",
                mem,
                False,
                2 * h_ag + h_rs + h_ar,
                e,
                base_of("HYBRID_SHARD") + e,
                P * (2 * inp.comm_bytes + inp.reduce_bytes) + P / G * inp.reduce_bytes,
                note=f"shard group {G} GPUs, replicated over {n_nodes} nodes",
            )
        )
    # NO_SHARD / DDP
    d_ar = _t(P * inp.reduce_bytes, 2 * (W - 1) / W, bw_world) if W > 1 else 0.0
    mem = b * P + DDP_BUCKETS_BYTES + act
    e = max(0.0, d_ar - cb) + _t(25 * 2**20, 2 * (W - 1) / max(W, 1), bw_world)
    out.append(Candidate("NO_SHARD", mem, False, d_ar, e, base_of("NO_SHARD") + e, P * inp.reduce_bytes))
    for c in out:
        c.fits = c.memory_bytes <= DEFAULT_MEMORY_HEADROOM * inp.gpu_memory_bytes
    return out


def advise(inp: PlanInputs) -> StrategyFacts:
    cands = estimate(inp)
    fitting = [c for c in cands if c.fits]
    best = (
        min(fitting, key=lambda c: (round(c.step_ms, 3), -(inp.gpu_memory_bytes - c.memory_bytes))) if fitting else None
    )
    cur = next((c for c in cands if c.name == inp.current), None)
    measured = inp.measured_step_ms
    error = 100 * (cur.step_ms - measured) / measured if cur is not None and measured else None
    trusted = error is None or abs(error) <= MODEL_TOLERANCE_PCT
    if not trusted:
        best = None
        reasoning = (
            f"The model estimates the current {cur.name} at {cur.step_ms:.1f} ms per step where the run measured "
            f"{measured:.1f} ms ({error:+.0f}%, beyond its ±{MODEL_TOLERANCE_PCT:g}% tolerance): it does not "
            "describe this run well enough to rank the others, so nothing is recommended."
        )
    elif best is None:
        least = min(cands, key=lambda c: c.memory_bytes)
        reasoning = (
            f"No strategy fits in {DEFAULT_MEMORY_HEADROOM:.0%} of {inp.gpu_memory_bytes / GiB:.0f} GiB per GPU: even "
            f"{least.name} needs {least.memory_bytes / GiB:.1f} GiB"
            + (f", of which activations {inp.activation_bytes / GiB:.1f} GiB" if inp.activation_bytes else "")
            + ". Reduce activations first (checkpointing, smaller micro-batch), then add GPUs or offload."
        )
    elif measured and best.name != inp.current and best.step_ms >= measured:
        # never recommend a strategy the model itself puts at or above the step the run measured
        reasoning = (
            f"The fastest strategy that fits, {best.name}, is estimated at {best.step_ms:.1f} ms per step, no "
            f"faster than the measured {measured:.1f} ms: nothing to recommend."
        )
        best = cur
    else:
        why = []
        if best.name == "HYBRID_SHARD":
            why.append(
                f"the inter-node link ({inp.inter_busbw_gbps:.0f} GB/s bus bandwidth) is the bottleneck; "
                f"sharding inside a node keeps all-gathers on {inp.intra_busbw_gbps:.0f} GB/s links"
            )
        elif best.name == "SHARD_GRAD_OP":
            why.append(
                "memory allows keeping unsharded parameters from forward to backward, which removes the backward all-gathers"
            )
        elif best.name == "NO_SHARD":
            why.append(
                "the model fits replicated, and one all-reduce moves less than FSDP's all-gathers plus reduce-scatter"
            )
        else:
            why.append("it is the only candidate that fits, or the fastest that does")
        reasoning = (
            f"{best.name} is estimated at {best.step_ms:.1f} ms per step with {best.memory_bytes / GiB:.1f} GiB per GPU: "
            + "; ".join(why)
            + "."
        )
        if cur is not None and cur.name != best.name:
            reasoning += f" The current {cur.name} is estimated at {cur.step_ms:.1f} ms"
            reasoning += f" (measured {measured:.1f} ms)." if measured else "."
    assumptions = [f"{k}: {_fmt(getattr(inp, k))} ({src})" for k, src in sorted(inp.sources.items())]
    return StrategyFacts(
        current=inp.current,
        recommended=best.name if best else None,
        candidates=cands,
        reasoning=reasoning,
        assumptions=assumptions,
        inputs={k: getattr(inp, k) for k in inp.__dataclass_fields__ if k != "sources"},
        fix=CODE.get(best.name, {}) if best else {},
        model_error_pct=error,
        trusted=trusted,
    )


def _fmt(v) -> str:
    if isinstance(v, float) and v >= 1e6:
        return f"{v:.3g}"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


# ---------------------------------------------------------------------------------------------
# Inputs from a measured run
# ---------------------------------------------------------------------------------------------


def current_strategy(facts: RunFacts) -> str | None:
    fs = facts.fsdp
    if fs.sharding_strategy:
        return fs.sharding_strategy.upper()
    if fs.version is None:
        return "NO_SHARD" if facts.parallelism.data_parallel else None  # DDP replicates like NO_SHARD
    groups = [c.group_size for r in facts.rank_facts for c in r.collectives if c.kind == "all_gather" and c.group_size]
    if groups and facts.world_size and max(groups) < facts.world_size:
        return "HYBRID_SHARD"
    if fs.reshard_after_forward is False:
        return "SHARD_GRAD_OP"
    return "FULL_SHARD"


def inputs_from_facts(facts: RunFacts, gpus_per_node: int | None = None) -> PlanInputs | None:
    """PlanInputs from a measured FSDP/DDP run; None when the run says too little (no GPU)."""
    if not facts.gpu_present or not facts.rank_facts:
        return None
    src: dict[str, str] = {}
    fs = facts.fsdp
    units = [u for u in fs.units if u.unsharded_numel]
    params = float(sum(u.unsharded_numel for u in units))
    if not params and facts.sidecar:
        params = float(facts.sidecar.get("extra", {}).get("total_params") or 0)
    if not params:
        ar = [
            c
            for r in facts.rank_facts[:1]
            for c in r.collectives
            if c.kind == "all_reduce" and c.step == 0 and c.in_nelems and c.role != "tensor_parallel"
        ]
        params = float(sum(c.in_nelems for c in ar))  # DDP: the gradient buckets cover the parameters
    if params < MIN_PARAMS:  # nothing, or too little to be a model's parameters: cannot estimate
        return None
    src["params"] = "measured (all-gather sizes)" if units else "measured (all-reduce sizes)"
    r0 = facts.rank_facts[0]
    ws = facts.world_size or len(facts.ranks)
    g = gpus_per_node or r0.gpus_per_node or ws
    src["gpus_per_node"] = (
        "given" if gpus_per_node else ("measured (deviceProperties)" if r0.gpus_per_node else "assumed (one node)")
    )
    g = min(g, ws)
    mem = float(r0.device_memory_bytes or 80 * GiB)
    src["gpu_memory_bytes"] = "measured (deviceProperties)" if r0.device_memory_bytes else "assumed"
    low = fs.mixed_precision is True
    comm = 2.0 if low else 4.0
    inp = PlanInputs(params=params, world_size=ws, gpus_per_node=g, gpu_memory_bytes=mem)
    inp.comm_bytes = inp.reduce_bytes = comm
    inp.param_bytes = inp.grad_bytes = 4.0
    inp.master_bytes = 0.0  # FSDP keeps sharded fp32 parameters: they are the master copy
    src["param_bytes"] = "fp32 sharded parameters (FSDP keeps the original dtype)"
    src["comm_bytes"] = "measured (collective dtype)"
    opt = (r0.optimizer or "").lower()
    inp.optimizer_bytes = float(OPTIMIZER_STATE_BYTES.get(opt, 8))
    src["optimizer_bytes"] = (
        f"measured (Optimizer.step#{r0.optimizer})" if opt in OPTIMIZER_STATE_BYTES else "assumed (Adam)"
    )
    inp.largest_unit_params = float(max((u.unsharded_numel for u in units), default=0))
    if facts.memory is not None:
        inp.activation_bytes = float(facts.memory.categories.get("activations", 0))
        src["activation_bytes"] = "measured (memory snapshot)"
    else:
        src["activation_bytes"] = "unknown (no snapshot): 0"
    # means over every rank (a rank kept as its summary line: its mean step) of its per-step means
    ranks = [r for r in facts.all_ranks() if r.steps]
    n = max(len(ranks), 1)

    def per_step(fn) -> float:
        return sum(sum(fn(s) for s in r.steps) / len(r.steps) for r in ranks) / n

    inp.compute_forward_ms = per_step(lambda s: s.compute_by_phase.get("forward", 0.0))
    inp.compute_backward_ms = per_step(lambda s: s.compute_by_phase.get("backward", 0.0))
    inp.compute_other_ms = per_step(lambda s: s.compute_ms) - inp.compute_forward_ms - inp.compute_backward_ms
    inp.optimizer_ms = per_step(lambda s: s.compute_by_phase.get("optimizer", 0.0))
    inp.other_ms = facts.timeline.idle_ms + facts.timeline.memcpy_ms
    src["compute_forward_ms"] = src["compute_backward_ms"] = src["optimizer_ms"] = "measured (GPU timeline)"
    intra, inter = [], []
    for r in facts.rank_facts:
        for c in r.collectives:
            if c.busbw_gbps and c.kind in ("all_gather", "reduce_scatter", "all_reduce") and (c.bytes or 0) >= 2**20:
                (intra if (c.group_size or ws) <= g else inter).append(c.busbw_gbps)
    if intra:
        inp.intra_busbw_gbps = float(median(intra))
        src["intra_busbw_gbps"] = (
            f"measured (median of {len(intra)} collectives ≥ 1 MiB, their wait for late ranks included)"
        )
    else:
        src["intra_busbw_gbps"] = "assumed"
    if inter:
        inp.inter_busbw_gbps = float(median(inter))
        src["inter_busbw_gbps"] = (
            f"measured (median of {len(inter)} collectives ≥ 1 MiB, their wait for late ranks included)"
        )
    else:
        src["inter_busbw_gbps"] = "assumed"
    inp.current = current_strategy(facts)
    inp.measured_step_ms = facts.step_clock_ms
    inp.sources = src
    return inp


def expected_memory(inp: PlanInputs, strategy: str | None) -> dict[str, float]:
    """Per-rank persistent state the ZeRO arithmetic predicts for ``strategy``, by category name."""
    shard = {
        "FULL_SHARD": inp.world_size,
        "SHARD_GRAD_OP": inp.world_size,
        "HYBRID_SHARD": min(inp.gpus_per_node, inp.world_size),
        "NO_SHARD": 1,
    }.get(strategy or "FULL_SHARD", inp.world_size)
    P = inp.params
    return {
        "parameters_sharded": P * (inp.param_bytes + inp.master_bytes) / shard,
        "gradients": P * inp.grad_bytes / shard,
        "optimizer_state": P * inp.optimizer_bytes / shard,
    }
