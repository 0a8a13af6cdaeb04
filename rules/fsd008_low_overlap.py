"""What it detects
    Communication that is mostly not hidden behind compute, when no more specific rule
    (wrapping, prefetch, offload, exposed reduce-scatter, straggler) explains it.

Why it hurts
    Exposed communication adds directly to the step time.

How it shows in a trace
    ``overlap.pct`` (|comm ∩ compute| / |comm|) below the threshold and exposed communication a
    noticeable share of the step.

Fix
    Depends on the cause: check the collectives table for the kind and phase that dominate.
    Typical levers: bf16 collectives, larger units, forward prefetch, fewer process groups on the
    same link, NCCL tuning.
"""

from fsdpdoctor.fmt import ms, pct

from ._util import ALL_COMM, finding, step_ms

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

FIX = """# FSDP2: forward prefetch of the next blocks and bf16 collectives
for i, block in enumerate(model.layers[:-1]):
    block.set_modules_to_forward_prefetch([model.layers[i + 1]])
# FSDP1: FSDP(model, forward_prefetch=True, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
"""


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
                f"exposed communication {ms(exposed)} per step = {pct(100 * exposed / sm)} of the step"]
    evidence += [f"{k.replace('_', '-')} in {p}: {ms(v)} exposed per step" for p, k, v in top]
    comm = facts.timeline.comm_ms
    saving = comm * (cfg["min_overlap_pct"] - ov) / 100 if comm else None
    return [
        finding(
            __name__,
            f"Only {pct(ov)} of communication overlaps compute; {ms(exposed)} per step is exposed.",
            evidence=evidence,
            cause="collectives are issued when compute has nothing left to run beside them",
            fix={"any": FIX},
            confidence=0.5,
            est_saving_ms=saving,
        )
    ]
