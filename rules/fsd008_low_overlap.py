"""What it detects
    Communication that is mostly not hidden behind compute, when no more specific rule
    (wrapping, prefetch, offload, exposed reduce-scatter, straggler) explains it.

Why it hurts
    Exposed communication adds directly to the step time.

How it shows in a trace
    ``overlap.pct`` (|comm ∩ compute| / |comm|) below the threshold and exposed communication a
    noticeable share of the step.

Fix
    Depends on the cause and on the parallelism the traces show: check the collectives table for
    the kind and phase that dominate. FSDP: forward prefetch, bf16 collectives, larger units.
    DDP, from the measured all-reduces: larger gradient buckets (``bucket_cap_mb``) only where
    many small all-reduces are latency-bound, a bf16 compression hook only where gradients are
    reduced in fp32, and a measurement of the link where the bus bandwidth is far below any GPU
    interconnect's: the pure bus bandwidth (the transfer after the last rank arrived) where every
    rank's trace is given, so a slow link is told from ranks that arrive late; from one rank's
    trace only the figure including the wait, which says "the link is slow or the collectives
    wait for other ranks" (no schedule hides either). Embedding all-to-all (recommendation models): pipeline the sparse input distribution
    so that it overlaps the previous batch, unless the trace shows it already is. Other
    communication (inference, point-to-point): fsdpdoctor knows no code fix and says so.

Known problems
    The saving is a heuristic, not a replay: the communication that overlap at ``min_overlap_pct``
    would hide, capped at the exposed time, with no real twin (±50%). A collective kernel's time
    includes its wait for the other ranks, which no overlap hides: on the public MI300 DDP trace
    (one rank's file of an 8-GPU job) the all-reduces reach 2.5 GB/s of bus bandwidth and it still
    claims 7.08 ms of the 11.76 ms exposed per step. DDP bucket and compression advice needs the
    buckets' sizes and dtypes (``record_shapes=True``). The 404 all-reduces per step of the public
    V100 trace (hta-df-index-v100) carry neither; they are one per parameter, launched from Python
    without DDP, and get DDP's buckets as the fix (as FSD010 does for their CPU cost).
"""

from fsdpdoctor.fmt import mib, ms, pct

from ._util import (
    ALL_COMM,
    FIX_BUCKETS,
    finding,
    fix_for,
    is_ddp,
    is_fsdp,
    no_fix_known,
    of_step,
    per_parameter_allreduces,
    step_ms,
)

CODE = "FSD008"
SLUG = "low-overlap"
TITLE = "Communication is not overlapped with compute"
SEVERITY = "warning"
THRESHOLDS = ("min_overlap_pct", "low_overlap_min_pct_of_step")

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": ALL_COMM, "cpu": []}
CLAIM_PRIORITY = 140  # specific findings claim before the general ones that they explain

SUPERSEDED_BY = (
    "auto-wrap-too-coarse",
    "auto-wrap-too-fine",
    "missing-backward-prefetch",
    "cpu-offload-stall",
    "exposed-reduce-scatter",
    "straggler-rank",
    "tensor-parallel-on-critical-path",  # Megatron-style TP: its all-reduces are exposed by design
)

FIX_FSDP2 = """from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # half the all-gather bytes
for block in model.layers:
    fully_shard(block, mp_policy=mp)
fully_shard(model, mp_policy=mp)
for i, block in enumerate(model.layers[:-1]):                 # all-gather the next block during this one
    block.set_modules_to_forward_prefetch([model.layers[i + 1]])
"""

FIX_FSDP1 = """from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision

model = FSDP(model, auto_wrap_policy=policy, forward_prefetch=True,
             backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
"""

#: DDP advice follows the measured all-reduces: larger buckets only where many small ones are
#: latency-bound, bf16 compression only where gradients are reduced in fp32, and a look at the link
#: and the other ranks where the bus bandwidth is far below what any GPU interconnect gives
DDP_SMALL_BUCKET_BYTES = 4 << 20
DDP_MANY_BUCKETS = 8
DDP_SLOW_BUSBW_GBPS = 20.0

DDP_BUCKETS = "    bucket_cap_mb=100,  # {n:.0f} all-reduces per step of {avg} each are latency-bound: fewer, larger"
DDP_BF16 = "model.register_comm_hook(None, default_hooks.bf16_compress_hook)  # reduced in {dtype} now: half the bytes"
DDP_LINK = (
    "# the all-reduces run at {busbw:.1f} GB/s bus bandwidth including the wait: measure the link itself and look\n"
    "# for ranks that arrive late (their wait counts in the kernel) before changing the schedule\n"
    "#   NCCL_DEBUG=INFO torchrun ...                       which transport and topology NCCL picked\n"
    "#   ./build/all_reduce_perf -b {size} -e {size} -g 1   nccl-tests / rccl-tests on the same nodes"
)
DDP_LINK_PURE = (
    "# the all-reduces move data at {busbw:.1f} GB/s bus bandwidth once the last rank has arrived (the wait\n"
    "# removed): the link itself is slow; measure it before changing the schedule\n"
    "#   NCCL_DEBUG=INFO torchrun ...                       which transport and topology NCCL picked\n"
    "#   ./build/all_reduce_perf -b {size} -e {size} -g 1   nccl-tests / rccl-tests on the same nodes"
)


FIX_EMBEDDING = """# The all-to-all of the sparse features (embedding input distribution) waits on the forward:
# pipeline it so that the next batch's input distribution overlaps this batch's compute (TorchRec)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

pipeline = TrainPipelineSparseDist(model, optimizer, device)
for _ in range(steps):
    pipeline.progress(dataloader_iter)
"""


def ddp_fix(facts) -> tuple[str | None, list[str]]:
    """The DDP fix the measured all-reduces call for (None when they call for none), and the
    evidence it rests on: the buckets (count and size per step), their dtype, their bus bandwidth."""
    ar = next((c for c in facts.collectives if c.kind == "all_reduce"), None)
    if ar is None or not ar.count_per_step:
        return None, []
    n, total = ar.count_per_step, ar.bytes_per_step or 0.0
    if per_parameter_allreduces(facts, ar):
        # no DDP here: a loop that reduces one gradient at a time (FSD010 names its CPU cost)
        return FIX_BUCKETS, [
            f"{n:g} all-reduces per step, one per parameter, each launched from Python (no DDP labels, no "
            "buckets): each waits for its own gradient and its own launch"
        ]
    avg = total / n
    dtypes = "/".join(ar.dtypes) or "dtype unknown"
    if not total:
        return None, [
            f"DDP all-reduces {n:.0f} bucket(s) per step; the trace records neither their sizes nor their "
            "dtypes (profile with record_shapes=True): no bucket or compression advice can follow from it"
        ]
    wait_bw, pure_bw = ar.mean_busbw_gbps, ar.pure_busbw_gbps
    if pure_bw is not None:
        bw = f", at {pure_bw:.1f} GB/s bus bandwidth once the last rank has arrived" + (
            f" ({wait_bw:.1f} GB/s including the wait)" if wait_bw else ""
        )
    elif wait_bw:
        bw = f", at {wait_bw:.1f} GB/s bus bandwidth including the wait for other ranks"
    else:
        bw = ""
    evidence = [f"DDP all-reduces {n:.0f} bucket(s) per step, {mib(total)} in all ({mib(avg)} each), {dtypes}{bw}"]
    ctor, hook, link = [], [], []
    if n > DDP_MANY_BUCKETS and avg < DDP_SMALL_BUCKET_BYTES:
        ctor.append(DDP_BUCKETS.format(n=n, avg=mib(avg)))
    else:
        evidence.append(
            f"larger buckets would not help: {n:.0f} bucket(s) of {mib(avg)} are not latency-bound "
            "(and fewer buckets overlap less)"
        )
    fp32 = [d for d in ar.dtypes if d.lower() in ("float", "float32", "fp32")]
    if fp32:
        hook.append(DDP_BF16.format(dtype=fp32[0]))
    elif ar.dtypes:
        evidence.append(f"the gradients are already reduced in {dtypes}: no compression hook")
    size = f"{max(int(avg) >> 20, 1)}M"
    if pure_bw is not None and avg >= 1 << 20:
        if pure_bw < DDP_SLOW_BUSBW_GBPS:
            link.append(DDP_LINK_PURE.format(busbw=pure_bw, size=size))
            evidence.append(
                f"{pure_bw:.1f} GB/s of bus bandwidth with the wait removed is slow for {mib(avg)} messages: "
                "the link is slow, which no schedule hides"
            )
        elif wait_bw is not None and wait_bw < DDP_SLOW_BUSBW_GBPS:
            evidence.append(
                f"the link is not slow ({pure_bw:.1f} GB/s once the last rank has arrived): the kernels' "
                f"{wait_bw:.1f} GB/s is the wait for ranks that arrive late (see the per-rank table)"
            )
    elif wait_bw is not None and wait_bw < DDP_SLOW_BUSBW_GBPS and avg >= 1 << 20:
        link.append(DDP_LINK.format(busbw=wait_bw, size=size))
        evidence.append(
            f"{wait_bw:.1f} GB/s of bus bandwidth including the wait is slow for {mib(avg)} messages: the "
            "collectives wait for other ranks or the link is slow, which no schedule hides (every rank's "
            "trace tells the two apart)"
        )
    code: list[str] = []
    if hook:
        code += ["from torch.distributed.algorithms.ddp_comm_hooks import default_hooks", ""]
    if ctor:
        code += ["model = DistributedDataParallel(", "    model, device_ids=[local_rank],", *ctor, ")"]
    code += hook
    if link:
        code += ([""] if code else []) + link
    return ("\n".join(code) + "\n" if code else None), evidence


def _fix(facts, top_kind: str | None) -> dict[str, str]:
    """The fix for the parallelism and the collective kind that carry the exposed time."""
    if top_kind == "all_to_all" and not is_fsdp(facts) and facts.workload != "inference":
        if "TrainPipelineSparseDist" in facts.pipelines:
            return no_fix_known(
                "exposed all-to-all",
                "The sparse input distribution is already pipelined "
                "(TrainPipelineSparseDist's annotations are in the trace): see which ranks the "
                "all-to-alls wait for (cross-rank table).",
            )
        return {"embedding": FIX_EMBEDDING}
    if top_kind in ("all_gather", "reduce_scatter", "all_reduce", None) or is_fsdp(facts):
        if is_ddp(facts) and not is_fsdp(facts) and facts.workload != "inference":
            ddp = ddp_fix(facts)[0]
            return (
                {"ddp": ddp}
                if ddp
                else no_fix_known(
                    f"exposed {(top_kind or 'communication').replace('_', '-')} in this DDP run",
                    "Nothing in the measured buckets, dtypes or bandwidth calls for a change (see the evidence).",
                )
            )
        return fix_for(
            facts,
            fsdp2=FIX_FSDP2,
            fsdp1=FIX_FSDP1,
            # as the run's framework sets them (HF Trainer, Lightning, Accelerate)
            lever=("prefetch", "mixed_precision") if is_fsdp(facts) else None,
            none_known=f"exposed {(top_kind or 'communication').replace('_', '-')} outside FSDP and DDP",
        )
    return no_fix_known(
        f"exposed {top_kind.replace('_', '-')} communication",
        "See which phase issues it (table below) and whether it can move off the critical path.",
    )


def check(facts, cfg):
    if not facts.gpu_present or facts.overlap.pct is None:
        return []
    ov = facts.overlap.pct
    exposed = facts.exposed_comm.mean_ms_per_step or 0.0
    sm = step_ms(facts)
    if ov >= cfg["min_overlap_pct"] or not sm or 100 * exposed / sm < cfg["low_overlap_min_pct_of_step"]:
        return []
    top = sorted(
        ((p, k, v) for p, kinds in facts.exposed_comm.by_phase_kind.items() for k, v in kinds.items()),
        key=lambda x: -x[2],
    )[:3]
    evidence = [
        f"overlap {pct(ov)} (threshold {pct(cfg['min_overlap_pct'])})",
        f"exposed communication {ms(exposed)} per step = {of_step(facts, exposed)}",
    ]
    evidence += [f"{k.replace('_', '-')} in {p}: {ms(v)} exposed per step" for p, k, v in top]
    if is_ddp(facts) and not is_fsdp(facts):
        evidence += ddp_fix(facts)[1]
    e = facts.efficiency
    blocked = max(e.syncs, key=lambda s: s.waited_comm_ms_per_step) if e is not None and e.syncs else None
    if blocked is not None and blocked.waited_comm_ms_per_step >= 0.5 * exposed > 0:
        evidence.append(
            f"{ms(blocked.waited_comm_ms_per_step)} of communication per step ran while the CPU was blocked in "
            f"{blocked.site} ({ms(blocked.cpu_ms_per_step)} a step): the CPU could launch nothing for it to overlap "
            "(see sync-in-step)"
        )
    comm = facts.timeline.comm_ms
    # raising overlap to the threshold hides that share of the communication, never more than is exposed
    saving = min(comm * (cfg["min_overlap_pct"] - ov) / 100, exposed) if comm else None
    # the assumption: overlap raised to the threshold. Its span: half way there (low), every
    # exposed collective hidden (high)
    span = [min(comm * (cfg["min_overlap_pct"] - ov) / 200, saving), max(exposed, saving)] if saving else None
    top_kind = max(facts.exposed_comm.by_kind.items(), key=lambda kv: kv[1])[0] if facts.exposed_comm.by_kind else None
    return [
        finding(
            __name__,
            f"Only {pct(ov)} of communication overlaps compute; {ms(exposed)} per step is exposed.",
            evidence=evidence,
            cause="collectives are issued when compute has nothing left to run beside them",
            fix=_fix(facts, top_kind),
            confidence=0.5,
            est_saving_ms=saving,
            saving_span_ms=span,
            saving_assumptions=(
                f"overlap raised to {pct(cfg['min_overlap_pct'])} (assumed); half way there or all of the "
                f"{ms(exposed)} exposed hidden"
                if span
                else ""
            ),
        )
    ]
