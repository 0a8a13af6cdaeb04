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
    DDP: larger gradient buckets (``bucket_cap_mb``), ``gradient_as_bucket_view``,
    ``static_graph``, a bf16 compression hook. Embedding all-to-all (recommendation models):
    pipeline the sparse input distribution so that it overlaps the previous batch. Other
    communication (inference, point-to-point): fsdpdoctor knows no code fix and says so.
"""

from fsdpdoctor.fmt import ms, pct

from ._util import ALL_COMM, finding, fix_for, is_fsdp, no_fix_known, of_step, step_ms

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

FIX_DDP = """from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

model = DistributedDataParallel(
    model, device_ids=[local_rank],
    bucket_cap_mb=100,             # fewer, larger all-reduces than the default 25 MB buckets
    gradient_as_bucket_view=True,  # gradients are views into the buckets: no copy before each all-reduce
    static_graph=True,             # the same graph every step: buckets follow the backward order
)
model.register_comm_hook(None, default_hooks.bf16_compress_hook)  # half the all-reduce bytes
"""

FIX_EMBEDDING = """# The all-to-all of the sparse features (embedding input distribution) waits on the forward:
# pipeline it so that the next batch's input distribution overlaps this batch's compute (TorchRec)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

pipeline = TrainPipelineSparseDist(model, optimizer, device)
for _ in range(steps):
    pipeline.progress(dataloader_iter)
"""


def _fix(facts, top_kind: str | None) -> dict[str, str]:
    """The fix for the parallelism and the collective kind that carry the exposed time."""
    if top_kind == "all_to_all" and not is_fsdp(facts) and facts.workload != "inference":
        return {"embedding": FIX_EMBEDDING}
    if top_kind in ("all_gather", "reduce_scatter", "all_reduce", None) or is_fsdp(facts):
        return fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, ddp=FIX_DDP,
                       none_known=f"exposed {(top_kind or 'communication').replace('_', '-')} outside FSDP and DDP")
    return no_fix_known(f"exposed {top_kind.replace('_', '-')} communication",
                        "See which phase issues it (table below) and whether it can move off the critical path.")


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
    evidence = [f"overlap {pct(ov)} (threshold {pct(cfg['min_overlap_pct'])})",
                f"exposed communication {ms(exposed)} per step = {of_step(facts, exposed)}"]
    evidence += [f"{k.replace('_', '-')} in {p}: {ms(v)} exposed per step" for p, k, v in top]
    comm = facts.timeline.comm_ms
    # raising overlap to the threshold hides that share of the communication, never more than is exposed
    saving = min(comm * (cfg["min_overlap_pct"] - ov) / 100, exposed) if comm else None
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
        )
    ]
