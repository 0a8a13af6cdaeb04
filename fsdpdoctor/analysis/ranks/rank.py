"""One rank, end to end: trace file → RankFacts. Runs in a worker process per file."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import Counter
from typing import Any

import numpy as np

from fsdpdoctor.facts import CollectiveFacts, CollectiveStats, RankFacts
from fsdpdoctor.facts.efficiency import FUSED_OPTIMIZERS
from fsdpdoctor.ingest._io import gc_paused
from fsdpdoctor.ingest.kineto import RankTrace, load_trace
from fsdpdoctor.ingest.ledger import trace_ledger
from fsdpdoctor.analysis.compile_window import split_warmup
from fsdpdoctor.analysis.compute import analyze_compute, finish, ops_by_external_id
from fsdpdoctor.analysis.efficiency import analyze_efficiency
from fsdpdoctor.analysis.framework import python_frames
from fsdpdoctor.analysis import intervals as iv
from fsdpdoctor.analysis.comms import (
    Collective,
    assign_roles,
    comm_kernel_mask,
    find_collectives,
    issue_rows,
    parallelism_facts,
)
from fsdpdoctor.analysis.fsdp import analyze_fsdp
from fsdpdoctor.analysis.labels import enclosing, label_rows
from fsdpdoctor.analysis.loader import analyze_loader
from fsdpdoctor.analysis.memory.trace_events import memory_from_events
from fsdpdoctor.analysis.rows import name_rows
from fsdpdoctor.analysis.runkind import ddp_labels, run_kind
from fsdpdoctor.analysis.steps import find_steps
from fsdpdoctor.analysis.timeline import gpu_steps, hta_overlap, step_timeline_backlog
from fsdpdoctor.analysis.whatif import WhatIfPlan, plan_whatif, run_whatif


def analyze_rank(path: str, order_index: int = 0) -> RankFacts:
    rt = load_trace(path)
    trim_heap()  # what decoding freed
    # The analysis frees what it builds as it goes (no cycles to find), but the cyclic GC's
    # full passes over the trace's tables, the replay's graph and numba's modules cost 0.2-0.3 s
    # at 300 MB: paused for the rank, as the load is.
    with gc_paused():
        facts, plan = _read_rank(rt, order_index)
        del rt  # the trace goes before the replays (and the compiled loop's imports) come
        trim_heap()
        if plan is not None:
            facts.whatif = run_whatif(plan)
    return facts


_LIBC: Any = None


def trim_heap() -> None:
    """Give the pages the C heap holds free back to the operating system (glibc's
    ``malloc_trim(0)``, as Dask's documentation does for its workers; nothing elsewhere). Decoding
    a trace frees far more than it keeps (310 MB of JSON: RSS 135 MB after the load, 98 MB after
    a trim), and glibc keeps such memory in the process until it exits."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc (macOS, Windows, musl without it)
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def analyze_rank_trace(rt: RankTrace, order_index: int = 0) -> RankFacts:
    facts, plan = _read_rank(rt, order_index)
    if plan is not None:
        facts.whatif = run_whatif(plan)
    return facts


MIN_OPS_FOR_SAMPLING = 100  # fewer numbered CPU ops say nothing about what is missing


def ops_recorded_pct(rt: RankTrace) -> float | None:
    """% of the op numbers between the trace's first and last CPU op that it holds. The profiler
    numbers every CPU op it records (``External id``, one counter); a whole trace holds nearly all
    of them (81-100% on every real recording and public trace), a sampled or trimmed one a small
    share (1.4% on HTA's sampled 128-rank trace: kernels, launches and ops dropped inside the
    window). None with too few numbered ops to tell."""
    ids = ops_by_external_id(rt)[1]  # the ids sorted: distinct ones counted on it (np.unique hashes, ~5x slower)
    n = int(np.count_nonzero(ids[1:] != ids[:-1])) + 1 if ids.size else 0
    if n < MIN_OPS_FOR_SAMPLING:
        return None
    return 100.0 * n / float(ids[-1] - ids[0] + 1)


def _read_rank(rt: RankTrace, order_index: int) -> tuple[RankFacts, WhatIfPlan | None]:
    """Everything of a rank that reads its trace: its facts, but for the what-if replay, whose
    graph and transformations come back as a plan to replay once the trace can go."""
    recorded_pct = ops_recorded_pct(rt)  # of the whole window: a warm-up left out is no sampling
    rt, info, compiling = split_warmup(rt, find_steps(rt), bool(rt.mask_cat("kernel").any()))
    labels = label_rows(rt)
    chains = enclosing(rt, labels, issue_rows(rt))
    colls = find_collectives(rt, chains, group_size=rt.world_size)
    pg_config = rt.distributed_info.get("pg_config") if isinstance(rt.distributed_info.get("pg_config"), list) else []
    pg_config = [x for x in pg_config if isinstance(x, dict)]
    assign_roles(colls, pg_config, rt.world_size, ddp=ddp_labels(rt))
    gs = gpu_steps(rt, info.steps)
    steps, backlog = step_timeline_backlog(rt, info.steps, colls, gs)
    n_steps = len(info.steps)
    fsdp = analyze_fsdp(rt, colls, info.steps, n_steps)
    overlap_pct, comm_ms, compute_ms = hta_overlap(rt, info.steps if info.step_method == "ProfilerStep" else None)
    gpu_present = bool(rt.mask_cat("kernel").any())
    rank = rt.rank if rt.rank is not None else order_index
    notes = []
    ledger = trace_ledger(rt)
    ledger.gpu_busy_ms, ledger.comm_busy_ms = _busy_ms(rt)
    if not gpu_present and ledger.device_events:
        notes.append(
            f"no CUDA/ROCm kernels in this trace, but {ledger.device_events:,} device events the analysis does not "
            "read (see the input ledger): GPU timeline metrics are empty"
        )
    elif not gpu_present:
        notes.append("no GPU kernels in this trace (CPU-only run or CPU activity only): GPU timeline metrics are empty")
    if ledger.warning:
        notes.append(ledger.warning)
    if backlog.ops:
        notes.append(
            f"{backlog.ops} GPU activities ({backlog.gpu_ms:.2f} ms of GPU time) at the start of the window were "
            "launched before the profiler started (the warm-up steps' backlog): counted in no step"
        )
    if info.step_method != "ProfilerStep":
        notes.append(f"no ProfilerStep annotations: steps from {info.step_method}")
    if compiling is not None and compiling.warmup_steps:
        notes.append(
            f"step{'s' if len(compiling.warmup_steps) > 1 else ''} "
            f"{', '.join(map(str, compiling.warmup_steps))} left out of the steady steps: torch.compile's one-time "
            f"work ({compiling.warmup_compile_ms:.2f} ms of {sum(compiling.warmup_ms):.2f} ms)"
        )
    device_name, device_mem, gpus = _device(rt)
    compute, kflops = analyze_compute(rt, info.steps, device_name, n_steps)
    if compute.source:
        finish(compute, sum(s.step_ms for s in steps) / len(steps) if steps else None)
    if compute.ops_in_compile:
        notes.append(
            f"{compute.ops_in_compile} matmul/attention ops inside torch.compile's one-time work (traced, captured "
            "into a CUDA graph or benchmarked, their kernels not the step's) are not counted in FLOPs and MFU"
        )
    if compute.source != "shapes" and gpu_present:
        notes.append(
            "no matmul or attention op with recorded shapes in this trace: FLOPs and MFU not computed "
            "(profile with record_shapes=True)"
            if not compute.ops_without_shapes
            else f"{compute.ops_without_shapes} matmul/attention ops without usable shapes: FLOPs and MFU not computed"
        )
    efficiency = (
        analyze_efficiency(rt, info.steps, steps, gs, kflops, compute, fsdp.activation_checkpointing)
        if gpu_present
        else None
    )
    del gs
    if efficiency is not None and fsdp.activation_checkpointing:
        # one figure for the recompute's GPU time: the waterfall's part (every kernel of the re-run
        # forward, each GPU instant once, on the step clock), read by FSD019 and the headline alike
        fsdp.recompute_gpu_ms_per_step = efficiency.parts_ms.get("recompute", 0.0)
    opt = next((n.split("#", 1)[1].split(".")[0] for n in rt.names if n.startswith("Optimizer.step#")), None)
    fusable = opt is None or opt in FUSED_OPTIMIZERS  # Shampoo … has no fused step to replay
    if efficiency is not None and fusable and efficiency.optimizer_ms >= OPTIMIZER_LEVER_PCT / 100 * efficiency.step_ms:
        fsdp.optimizer_kernels = efficiency.optimizer  # a fused step could pay: replay it (the rule's threshold)
    plan = plan_whatif(rt, info.steps, colls, fsdp, kflops=kflops, compute=compute) if gpu_present else None
    parallelism = parallelism_facts(colls, pg_config, n_steps)
    parallelism.run_kind, parallelism.run_kind_evidence = run_kind(
        rt, colls, fsdp.version, workload(info.steps), n_steps
    )
    facts = RankFacts(
        rank=int(rank),
        rank_source=rt.rank_source if rt.rank is not None else "order",
        path=rt.path,
        world_size=rt.world_size,
        device_name=device_name,
        gpu_present=gpu_present,
        decode_mode=rt.decode_mode,
        event_count=rt.event_count,
        step_method=info.step_method,
        phase_method=info.phase_method,
        steps=steps,
        overlap_pct=overlap_pct,
        comm_ms_total=comm_ms,
        compute_ms_total=compute_ms,
        collectives=[_collective_facts(c) for c in colls],
        collective_stats=collective_stats(colls, n_steps, _device_sms(rt)),
        fsdp=fsdp,
        pg_config=pg_config,
        parallelism=parallelism,
        notes=notes,
        optimizer=opt,
        gpus_per_node=gpus,
        device_memory_bytes=device_mem,
        memory_trace=memory_from_events(rt.path, rt.memory_events),
        whatif=None,
        compute=compute if compute.source else None,
        efficiency=efficiency,
        start_unix_s=start_unix_s(rt),
        backend=_text(rt.distributed_info.get("backend")),
        nccl_version=_text(rt.distributed_info.get("nccl_version")),
        workload=workload(info.steps),
        pipelines=pipelines(rt),
        backlog_ops=backlog.ops,
        backlog_ms=backlog.gpu_ms,
        ops_recorded_pct=recorded_pct,
        ledger=ledger,
        loader=analyze_loader(rt, info.steps, gpu_present),
        python=python_frames(rt.python_frames),
        compile_window=compiling,
    )
    return facts, plan


#: the optimizer's CPU span and kernels below this % of the step: a fused step cannot save the share
#: non-matmul-kernels asks for (its default waterfall_min_part_pct), so it is not replayed
OPTIMIZER_LEVER_PCT = 5.0

EPOCH_US = 1e15  # a timestamp this large (µs) counts from the Unix epoch (2001-09-09 on); boot clocks stay far below
LATEST_UNIX_S = 4.1e9  # 2099: anything later is a corrupt clock, not a time


def start_unix_s(rt: RankTrace) -> float | None:
    """Wall-clock time (s since the epoch) of the trace's first complete event: Kineto's
    ``baseTimeNanoseconds`` plus its timestamp, or the timestamp itself where older Kineto wrote
    epoch microseconds; None for a boot-relative clock without a base."""
    if not len(rt.ts):
        return None
    t0 = float(rt.ts.min())
    if rt.base_time_ns is not None:
        t = rt.base_time_ns / 1e9 + t0 / 1e6
    else:
        t = t0 / 1e6 if t0 >= EPOCH_US else None
    return t if t is not None and 0 < t < LATEST_UNIX_S else None


#: CPU annotations that show a training pipeline already in use, and its name
PIPELINE_MARKS = {
    "## sparse_data_dist ##": "TrainPipelineSparseDist",
    "## wait_sparse_data_dist ##": "TrainPipelineSparseDist",
}


def pipelines(rt: RankTrace) -> list[str]:
    """The training pipelines the trace's annotations show (:data:`PIPELINE_MARKS`)."""
    seen = name_rows(rt, lambda n: n in PIPELINE_MARKS, "user_annotation", "cpu_op")
    return sorted({PIPELINE_MARKS[rt.row_name(int(i))] for i in seen})


def workload(steps) -> str | None:
    """ "training" when some step has a backward pass or an optimizer step, else "inference"."""
    if not steps:
        return None
    return "training" if any("backward" in st.phases or "optimizer" in st.phases for st in steps) else "inference"


def _text(v: Any) -> str | None:
    return str(v) if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v) else None


def _device(rt: RankTrace) -> tuple[str | None, int | None, int | None]:
    """(name, memory bytes, devices on the host) of the GPU this rank's kernels ran on."""
    props = [p for p in rt.device_properties if isinstance(p, dict)]
    if not props:
        return None, None, None
    kern = np.flatnonzero(rt.mask_cat("kernel"))
    dev = None
    if kern.size:
        pid = rt.threads[int(rt.thread[kern[0]])][0]
        dev = pid if isinstance(pid, int) else None
    prop = next((p for p in props if p.get("id") == dev), props[0])
    mem = prop.get("totalGlobalMem")
    return prop.get("name"), int(mem) if isinstance(mem, (int, float)) else None, len(props)


def _busy_ms(rt: RankTrace) -> tuple[float | None, float | None]:
    """(GPU busy, communication busy) over the whole trace, ms: the union of the GPU work's intervals."""
    gpu = rt.mask_cat("kernel", "gpu_memcpy", "gpu_memset")
    if not gpu.any():
        return None, None
    comm = comm_kernel_mask(rt)

    def busy(m):
        return round(iv.total(iv.merge(rt.ts[m], rt.ts[m] + rt.dur[m])) / 1e3, 4)

    return busy(gpu), busy(comm) if comm.any() else 0.0


def _device_sms(rt: RankTrace) -> int | None:
    """The SM count of this rank's GPU (deviceProperties ``numSms``; ``multiProcessorCount`` in 2021)."""
    for p in rt.device_properties:
        if isinstance(p, dict):
            v = p.get("numSms", p.get("multiProcessorCount"))
            if isinstance(v, int) and v > 0:
                return v
    return None


def _collective_facts(c: Collective) -> CollectiveFacts:
    return CollectiveFacts(
        kind=c.kind,
        name=c.name,
        step=c.step,
        phase=c.phase,
        unit=c.unit,
        issue_label=c.issue_label,
        bytes=c.bytes,
        dtype=c.dtype,
        group_size=c.group_size,
        pg_name=c.pg_name,
        stream=c.stream,
        cpu_ts_us=c.cpu_ts,
        gpu_start_us=c.gpu_start,
        gpu_dur_us=c.gpu_dur_us,
        exposed_us=c.exposed_us,
        busbw_gbps=c.busbw_gbps(),
        in_nelems=c.in_nelems,
        out_nelems=c.out_nelems,
        library=c.library,
        blocks=c.blocks,
        fsdp_labels=[x for x in c.labels if x.startswith(("FSDP::", "FullyShardedDataParallel."))],
        role=c.role,
        microbatch=max(c.microbatch, 0),
    )


def collective_stats(colls: list[Collective], n_steps: int, device_sms: int | None = None) -> list[CollectiveStats]:
    n = max(n_steps, 1)
    out = []
    kinds = sorted({c.kind for c in colls if c.step >= 0})
    for kind in kinds:
        cs = [c for c in colls if c.kind == kind and c.step >= 0]
        bws = [b for b in (c.busbw_gbps() for c in cs) if b is not None]
        dtypes = sorted({c.dtype for c in cs if c.dtype})
        out.append(
            CollectiveStats(
                kind=kind,
                count_per_step=len(cs) / n,
                bytes_per_step=(sum(c.bytes or 0 for c in cs) / n) if any(c.bytes is not None for c in cs) else None,
                gpu_ms_per_step=sum(c.gpu_dur_us or 0.0 for c in cs) / 1e3 / n,
                exposed_ms_per_step=sum(c.exposed_us for c in cs) / 1e3 / n,
                mean_busbw_gbps=float(np.mean(bws)) if bws else None,
                dtypes=dtypes,
                group_size=most_common(c.group_size for c in cs if c.group_size),
                role=most_common(c.role for c in cs),
                roles={k: v / n for k, v in sorted(Counter(c.role for c in cs).items())},
                libraries={k: v / n for k, v in sorted(Counter(c.library for c in cs).items())},
                sms=_sms(cs, device_sms),
                cpu_comm_ms_per_step=(
                    sum(c.cpu_comm_us for c in cs if c.cpu_comm_us is not None) / 1e3 / n
                    if any(c.cpu_comm_us is not None for c in cs)
                    else None
                ),
            )
        )
    return out


def _sms(cs: list[Collective], device_sms: int | None) -> int | None:
    blocks = [c.blocks for c in cs if c.blocks]
    if not blocks:
        return None
    return min(max(blocks), device_sms) if device_sms else max(blocks)


def most_common(xs) -> Any:
    top = Counter(xs).most_common(1)
    return top[0][0] if top else None
