"""What it detects
    The GPU idles for a large share of each step while the CPU is busy: kernel launch overhead,
    FSDP hook overhead, Python, data loading.

Why it hurts
    Time the GPU spends idle is time it is not computing; faster communication cannot help.

How it shows in a trace
    Gaps between kernels inside the step's GPU window with neither compute nor communication
    running, while the CPU is not blocked waiting for the GPU (idle inside a synchronization is
    both sides waiting on something else, and a GPU that runs behind the CPU is not waiting for
    it); many short kernels; long CPU ranges (FSDP hooks, data loader) between launches. The
    finding names the CPU ranges the launching thread was inside while the GPU idled (the most
    specific ones holding a material share of that idle), and offers each fix only where its
    cause shows: DataLoader workers where data loading holds GPU idle, ``torch.compile`` only
    where no compiled region runs, FSDP hook advice only under FSDP, ``broadcast_buffers=False``
    only for DDP with its buffer broadcast visible, DDP's buckets only for a loop of
    per-parameter all-reduces, the optimizer's CPU step where it holds GPU idle.

Fix
    Give the GPU bigger pieces of work: a larger per-GPU batch (where the memory snapshot shows
    headroom, the finding says how much larger fits), ``torch.compile`` or CUDA graphs
    to cut launch overhead (not where compiled regions already run), fewer FSDP units, DataLoader
    workers with ``pin_memory``, ``DistributedDataParallel(broadcast_buffers=False)`` where DDP's
    buffer broadcast holds the idle, DDP's gradient buckets instead of one all-reduce per
    parameter, a fused optimizer (or, for Shampoo, preconditioning less often). For an
    inference run (no backward pass, no optimizer step): CUDA graphs
    (``torch.compile(mode="reduce-overhead")``; in vLLM, leave ``enforce_eager`` off) and larger
    batches; training advice (data loaders, FSDP units) does not apply.

Known problems
    The saving is a heuristic with no real twin (±50%): the idle less 5% of the GPU window, as if a
    fix removed nearly all of it. On the H100 fsdp2-bf16 recording it would claim 21.19 ms of the
    34.24 ms step where the replay without FSDP's hooks' CPU time gives 13.92 ms; there
    gpu-starved-by-hooks takes its place, as cpu-offload-stall and straggler-rank do where they
    fire. Only CUDA/HIP synchronizations and blocking copies count as the CPU waiting for the GPU:
    idle while the CPU waits for another rank outside CUDA (a gloo barrier, a CPU collective)
    counts as host-bound. Idle inside torch.compile's one-time work (compilation, CUDA-graph
    recording) does not: on the public MI300X trace of a CUDA-graph capture, 558 of its 641 ms of
    idle lie in ``CUDAGraphNode.record``, and CUDA graphs were being offered to a run recording them
    (compile-in-window says so instead).
"""

from fsdpdoctor.fmt import mib, ms, pct

from ._idiom import batch_line, idiom_parts
from ._util import (
    FIX_BUCKETS,
    finding,
    fix_for,
    is_ddp,
    is_fsdp,
    of_cpu_step,
    of_window,
    per_parameter_allreduces,
    step_ms,
)

CODE = "FSD010"
SLUG = "host-bound"
TITLE = "GPU waits for the CPU"
SEVERITY = "warning"
THRESHOLDS = ("host_bound_idle_pct",)

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": [("host_bound_idle", None), ("other_idle", None)], "cpu": []}
CLAIM_PRIORITY = 100  # specific findings claim before the general ones that they explain

SUPERSEDED_BY = ("cpu-offload-stall", "straggler-rank", "gpu-starved-by-hooks")

FIX_COMPILE = "model = torch.compile(model)            # fewer, larger kernels; less Python per step\n"
FIX_LOADER = "loader = DataLoader(ds, batch_size=bs, num_workers=8, pin_memory=True, persistent_workers=True)\n"
FIX_BROADCAST = (
    "# DDP broadcasts the module's buffers (flatten / broadcast / unflatten) before every forward;\n"
    "# where the buffers are not updated in training (or are the same on every rank):\n"
    "model = DistributedDataParallel(model, device_ids=[rank], broadcast_buffers=False)\n"
)
FIX_OPTIMIZER = "# the optimizer's step runs on the CPU while the GPU waits\n"
FIX_FUSED = "opt = torch.optim.{cls}(params, lr=lr, fused=True)   # one fused kernel per parameter group\n"
FIX_SHAMPOO = "# Shampoo: compute its preconditioners less often (a larger precondition_frequency)\n"
FIX_HOOKS = "# FSDP hooks between small kernels: fewer, larger FSDP units (wrap per block, not per layer)\n"
FIX_PLAIN = "# launch overhead between small kernels: larger per-GPU batches, or CUDA graphs for the steady part\n"
#: a cause holds a material share of the host-bound idle from this share (data loading, the optimizer)
CAUSE_MIN_SHARE = 0.05

FIX_INFERENCE = """# launch overhead between small kernels: replay each step from a CUDA graph
model = torch.compile(model, mode="reduce-overhead")   # CUDA graphs + fused kernels
# vLLM: keep CUDA graphs on (do not pass enforce_eager=True); raise max_num_seqs for larger batches
"""


def check(facts, cfg):
    if not facts.gpu_present:
        return []
    t = facts.timeline
    if t.gpu_window_ms <= 0:
        return []
    # idle while the CPU sits in a blocking call is both sides waiting (on another rank, an
    # event the trace does not show): the host is not what the GPU waits for then
    host_idle = max(t.idle_ms - t.idle_cpu_blocked_ms, 0.0)
    # nor is idle inside torch.compile's one-time work (compilation, CUDA-graph recording)
    cw = facts.compile_window
    compiling = min(cw.gpu_idle_ms_per_step or 0.0, host_idle) if cw is not None else 0.0
    host_idle -= compiling
    idle_pct = 100 * host_idle / t.gpu_window_ms
    if idle_pct < cfg["host_bound_idle_pct"]:
        return []
    evidence = [
        f"GPU idle (no work of any step running) while the CPU is not blocked on it: {ms(host_idle)} per step = "
        f"{of_window(facts, host_idle)}",
        f"compute {ms(t.compute_ms)}, exposed communication {ms(t.exposed_comm_ms)} per step",
    ]
    if t.idle_cpu_blocked_ms > 0.05 * t.gpu_window_ms:
        evidence.append(
            f"another {ms(t.idle_cpu_blocked_ms)} of GPU idle per step falls inside CPU synchronizations "
            "(both sides wait; not counted)"
        )
    if compiling > 0.05 * t.gpu_window_ms:
        evidence.append(
            f"another {ms(compiling)} of GPU idle per step falls inside torch.compile's one-time work "
            "(compilation, CUDA-graph recording: see compile-in-window; not counted)"
        )
    if t.other_steps_ms > 0.05 * t.gpu_window_ms:
        evidence.append(
            f"the GPU runs behind the CPU: {ms(t.other_steps_ms)} of each window belongs to other steps' "
            "work and is not counted as idle"
        )
    if is_fsdp(facts) and facts.fsdp.hook_cpu_ms_per_step and step_ms(facts):
        evidence.append(
            f"CPU time in FSDP hooks {ms(facts.fsdp.hook_cpu_ms_per_step)} per step = "
            f"{of_cpu_step(facts, facts.fsdp.hook_cpu_ms_per_step)}"
        )
    causes, parts = _causes(facts, host_idle)
    evidence += causes
    # what remains idle after the fix: assume 5% of the window
    saving = max(host_idle - 0.05 * t.gpu_window_ms, 0.0)
    span = [max(host_idle - 0.10 * t.gpu_window_ms, 0.0), host_idle]
    inference = facts.workload == "inference"
    plain = fix_for(facts, training="".join(parts) or FIX_PLAIN, inference=FIX_INFERENCE)
    # each part the run's framework has a setting for (loader, compile, fused optimizer) in its idiom
    fix = idiom_parts(facts, [(_lever(p), p) for p in parts], plain)
    grow = facts.memory_pressure.batch_headroom if facts.memory_pressure is not None else None
    if grow is not None and grow >= 1.5 and not inference:
        p, act = facts.memory_pressure, facts.memory.categories.get("activations", 0)
        k = min(int(grow), 8)
        evidence.append(
            f"memory headroom: the peak reserved {mib(p.peak_reserved_bytes)} is {pct(p.used_pct)} of the "
            f"{mib(p.capacity_bytes)} {'budget' if p.capacity_source == 'budget' else 'GPU'}; with activations "
            f"({mib(act)} at the peak) growing with the batch, a micro-batch up to ~{grow:.0f}× larger stays "
            f"under {p.threshold_pct:g}%: more GPU work per launch and per FSDP hook"
        )
        fix = {key: batch_line(facts, k, grow) + code for key, code in fix.items()}
    return [
        finding(
            __name__,
            f"The GPU is idle {pct(idle_pct)} of its step window waiting for the CPU.",
            evidence=evidence,
            cause="kernel launch / Python overhead between small kernels" if inference else _cause(facts, parts),
            fix=fix,
            confidence=0.6,
            est_saving_ms=saving,
            # the part of the step the fix acts on: the GPU's idle time the CPU causes (never more
            # than the step less the GPU's busy time)
            saving_ceiling_ms=host_idle,
            saving_span_ms=span,
            saving_assumptions="the GPU still idle after the fix: 5% of its window (assumed), 0-10%",
        )
    ]


def _lever(part: str) -> str | None:
    """The idiom lever (rules/_idiom.py) a fix part pulls, None for advice no framework setting carries."""
    if part == FIX_LOADER:
        return "dataloader"
    if part == FIX_COMPILE:
        return "compile"
    if part.startswith("opt = torch.optim.") and "fused=True" in part:
        return "fused_optimizer"
    return None


def _cause(facts, parts: list[str]) -> str:
    what = {
        FIX_LOADER: "data loading",
        FIX_BROADCAST: "DDP's buffer broadcast",
        FIX_BUCKETS: "per-parameter all-reduces launched from Python",
        FIX_OPTIMIZER: "the optimizer's CPU step",
        FIX_HOOKS: "FSDP hook overhead",
        FIX_COMPILE: "Python and kernel launches between small kernels",
    }
    named = [what[p] for p in parts if p in what]
    return (", ".join(named) or "kernel launch / Python overhead between small kernels") + " on the critical path"


def _causes(facts, host_idle: float) -> tuple[list[str], list[str]]:
    """Evidence lines (what the CPU was doing while the GPU idled) and the fixes whose cause shows."""
    e = facts.efficiency
    lines: list[str] = []
    parts: list[str] = []
    if e is None:
        return lines, [FIX_COMPILE]
    ops = [o for o in e.idle_ops if o.gpu_idle_ms_per_step >= 0.01]
    if ops:
        lines.append(
            "while the GPU idled the CPU was in: "
            + "; ".join(
                f"{o.name} {ms(o.gpu_idle_ms_per_step)} (its CPU time {ms(o.cpu_ms_per_step)})" for o in ops[:5]
            )
            + " per step"
        )
    idle = e.idle_ms
    floor = CAUSE_MIN_SHARE * host_idle
    if idle.get("data_loading", 0.0) >= floor:
        lines.append(f"data loading holds {ms(idle['data_loading'])} of GPU idle per step")
        parts.append(FIX_LOADER)
    kinds = {c.kind: c for c in facts.collectives}
    names = {o.name for o in ops}
    if is_ddp(facts) and "broadcast" in kinds and any("flatten_dense_tensors" in n for n in names):
        held = sum(o.gpu_idle_ms_per_step for o in ops if "flatten_dense_tensors" in o.name)
        lines.append(
            f"DDP's buffer broadcast: {kinds['broadcast'].count_per_step:g} broadcasts a step, their flatten / "
            f"unflatten holding {ms(held)} of GPU idle per step"
        )
        parts.append(FIX_BROADCAST)
    ar = kinds.get("all_reduce")
    if per_parameter_allreduces(facts, ar):
        lines.append(
            f"{ar.count_per_step:g} all-reduces a step, one per parameter (no DDP buckets), each launched from "
            f"Python; {pct(100 * ar.exposed_ms_per_step / ar.gpu_ms_per_step) if ar.gpu_ms_per_step else '–'} "
            "of their time exposed"
        )
        parts.append(FIX_BUCKETS)
    opt = [o for o in ops if o.name.startswith("Optimizer.step#")]
    held = max(idle.get("optimizer_cpu", 0.0), sum(o.gpu_idle_ms_per_step for o in opt))
    if held >= floor:
        lines.append(
            f"the optimizer step's CPU side holds {ms(held)} of GPU idle per step"
            + (f" ({', '.join(o.name.removeprefix('Optimizer.step#') for o in opt[:3])})" if opt else "")
        )
        parts.append(FIX_OPTIMIZER)
        for o in opt[:3]:
            cls = o.name.removeprefix("Optimizer.step#").removesuffix(".step")
            if "Shampoo" in cls:
                parts.append(FIX_SHAMPOO)
            elif cls in ("SGD", "Adam", "AdamW", "Adagrad") and e.optimizer in ("foreach", "per-parameter"):
                parts.append(FIX_FUSED.format(cls=cls))
    if is_fsdp(facts) and idle.get("fsdp_hooks", 0.0) >= floor:
        parts.append(FIX_HOOKS)
    if e.compiled_ms > 0:
        again = "CUDA graphs for them are what is offered" if facts.workload == "inference" else "not offered again"
        lines.append(f"torch.compile already runs: {ms(e.compiled_ms)} of CPU per step in compiled regions ({again})")
    elif idle.get("python", 0.0) + idle.get("launch", 0.0) >= floor:
        parts.append(FIX_COMPILE)
    return lines, parts
