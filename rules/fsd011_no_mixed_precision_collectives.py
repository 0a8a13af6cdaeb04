"""What it detects
    FSDP all-gathers in fp32 where bf16 parameters would halve the bytes on the wire.

Why it hurts
    All-gather time is proportional to bytes. Training in bf16 autocast while FSDP gathers fp32
    parameters moves twice the data for the same math.

How it shows in a trace
    ``dtype`` ``Float`` in the all-gather ``record_param_comms`` args (or ``float`` in the c10d
    op's input types).

Fix
    FSDP2 ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``;
    FSDP1 ``MixedPrecision(param_dtype=torch.bfloat16, ...)``.

Known problems
    It needs the all-gathers' dtype: single-GPU runs (no all-gathers) and traces without dtypes
    draw nothing. It reads the all-gathers only, so fp32 reduce-scatters under a bf16
    ``param_dtype`` are not flagged. Its replay also runs the forward and backward kernels in bf16
    (``param_dtype`` is the dtype the layers compute in), so most of the saving can be compute: on
    the generated fp32-collectives scenario 69.5 ms of a 147.1 ms step, with 2.41 ms of exposed
    all-gather. It is within 15% of generated twins, with no real GPU twin yet (±50%). On CPU it
    fires with no saving, and there bf16 made the real gloo twin 70.60 ms slower per step (no fast
    bf16 path on CPU, docs/savings.md).
"""

from fsdpdoctor.fmt import mib, ms

from ._util import (
    ALL_COMM,
    MIXED_PRECISION_FSDP1,
    MIXED_PRECISION_FSDP2,
    exposed_ms,
    finding,
    fix_for,
    is_fsdp,
    replay_evidence,
    replayed_saving,
)

CODE = "FSD011"
SLUG = "no-mixed-precision-collectives"
TITLE = "fp32 all-gathers where bf16 would halve the traffic"
SEVERITY = "info"
REPLAY_FIX = "mixed_precision"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = ("mp_min_ag_mib",)

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": ALL_COMM, "cpu": [("cpu_fsdp_hooks", None), ("cpu_forward", None), ("cpu_backward", None)]}
# param_dtype is also the dtype the layers compute in: when the collective dtype changed, so did compute
EXPLAINS_IF_CHANGED = {
    "dtype.": {
        "gpu": [("compute", None)],
        "note": "includes compute: FSDP's param_dtype is also the dtype the layers compute in, and it changed between the runs",
    },
}
CONFIG_KEYS = ("mixed_precision", "dtype.")  # a configuration finding: it explains a change only when these changed
CLAIM_PRIORITY = 80  # specific findings claim before the general ones that they explain


FIX_FSDP2 = MIXED_PRECISION_FSDP2
FIX_FSDP1 = MIXED_PRECISION_FSDP1


def check(facts, cfg):
    fs = facts.fsdp
    if not is_fsdp(facts) or not fs.fix_applies("mixed_precision"):
        return []
    ag = next((c for c in facts.collectives if c.kind == "all_gather"), None)
    if ag is None or not ag.bytes_per_step or ag.bytes_per_step < cfg["mp_min_ag_mib"] * 2**20:
        return []
    evidence = [f"all-gathers move {mib(ag.bytes_per_step)} per step in {', '.join(ag.dtypes)}"]
    saving = None
    if facts.gpu_present:
        exp = sum(exposed_ms(facts, p, "all_gather") for p in ("forward", "backward", "optimizer", "other"))
        evidence.append(f"exposed all-gather {ms(exp)} per step; bf16 halves the bytes")
        saving = exp / 2
        replayed = replayed_saving(facts, "mixed_precision")
        if replayed is not None:
            saving = replayed
            evidence.append(
                replay_evidence(
                    facts,
                    "mixed_precision",
                    "bf16 parameters (half the collective bytes, bf16 instead of fp32 forward/backward kernels)",
                )
            )
    return [
        finding(
            __name__,
            f"All-gathers run in fp32 ({mib(ag.bytes_per_step)} per step); bf16 parameters would halve that.",
            evidence=evidence,
            cause="no mixed-precision policy on the FSDP units",
            fix=fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, lever="mixed_precision"),
            confidence=0.8,
            est_saving_ms=saving,
        )
    ]
