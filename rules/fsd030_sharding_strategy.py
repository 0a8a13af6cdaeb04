"""What it detects
    Another sharding strategy is estimated to be clearly faster than the one the run uses, and
    it fits in GPU memory.

Why it hurts
    FULL_SHARD all-gathers every parameter twice per step; with memory to spare SHARD_GRAD_OP
    skips the backward all-gathers, and across nodes on a slow link HYBRID_SHARD keeps the
    all-gathers inside a node.

How it shows in a trace
    Exposed all-gathers in backward (SHARD_GRAD_OP helps) or collectives whose measured bus
    bandwidth is that of the inter-node link (HYBRID_SHARD helps), with memory left on the GPU.

Fix
    Switch to the recommended strategy (the code is in the finding and the strategy table).

Known problems
    The estimate is arithmetic, not a replay, and recommends only where its estimate of the current
    strategy lands within 25% of the measured step: on the public MI300 DDP trace it was 194% over
    and nothing is recommended; on the public 2-rank A100 DDP trace 6.8% under. What the trace
    lacks is assumed and listed among the strategy's assumptions: GPUs per node (one node without
    ``deviceProperties``), the inter-node bandwidth where no collective crosses nodes (25 GB/s),
    Adam's 8 bytes per parameter unless the trace names a known optimizer, and activations (0
    without a memory snapshot, so "fits" can be wrong). The optimizer step keeps its measured cost
    in every candidate, though HYBRID_SHARD steps more parameters per rank. The saving is the
    smaller of the model's own difference (the current strategy as modelled) and the measured step
    less the recommended strategy's modelled one; the larger is the span's other end. It is held to
    generated twins: FULL_SHARD over 2 nodes of 2 GPUs, 12.5 GB/s between the nodes and 100 GB/s
    inside one, which the trace does not measure and the model assumes at 150 GB/s (preset
    ``full-shard-inter-node``), against the same run as HSDP: 35.41 ms faster per step, estimated
    39.22 ms (1.11x, both regimes), where the model's own difference, the saving before, said
    55.20 ms (1.56x; the current step modelled 19% over the measured one) and the range's low end
    stays above the truth; the per-Linear run (``too-fine``) against ``reshard_after_forward=False``:
    2.16 ms, estimated 2.29 ms (1.06x; GPU-bound 2.15 ms, estimated 2.08 ms, 0.97x). On the
    host-bound run the measured step less SHARD_GRAD_OP's says 2.00 ms where its twin saves 0.30 ms
    (the CPU sets the step): the model's difference, 0.90 ms, is under the threshold, no finding.
    No twin checks it on a real GPU; on CPU (gloo, where no strategy is
    estimated) ``reshard_after_forward=False`` made the real twin 7.56 ms faster per step.
"""

from fsdpdoctor.fmt import mib, ms, pct

from ._util import finding, fix_for, is_fsdp, step_ms

CODE = "FSD030"
SLUG = "sharding-strategy"
TITLE = "A different sharding strategy is estimated to be faster"
SEVERITY = "warning"
THRESHOLDS = ("strategy_min_saving_pct",)
SAVES_ON = "step"  # a modelled step time: its saving is bounded by the step, not only the GPU window

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": [("exposed_all_gather", None), ("exposed_reduce_scatter", None)], "cpu": []}
CLAIM_PRIORITY = 120  # specific findings claim before the general ones that they explain


def check(facts, cfg):
    st = facts.strategy
    if st is None or not st.trusted or not is_fsdp(facts) or st.recommended in (None, st.current, "NO_SHARD"):
        return []
    cur, best = st.candidate(st.current), st.candidate(st.recommended)
    if cur is None or best is None:
        return []
    measured = step_ms(facts) or cur.step_ms
    modelled = cur.step_ms - best.step_ms  # the model's own difference
    # the smaller of the model's own difference and the measured step less the recommended one:
    # what the model puts above the measured step is not saved, and what it does not see in the
    # measured step (a CPU that sets the step) is not the strategy's to save
    saving = min(measured - best.step_ms, modelled)
    other = max(measured - best.step_ms, modelled)  # the span's other end
    if saving <= 0 or 100 * saving / measured < cfg["strategy_min_saving_pct"]:
        return []
    return [
        finding(
            __name__,
            f"{best.name} is estimated {ms(saving)} per step faster than {cur.name} ({pct(100 * saving / measured)}) and fits in memory.",
            evidence=[
                f"{cur.name}: {mib(cur.memory_bytes)} per GPU, comm {ms(cur.comm_ms)}, exposed {ms(cur.exposed_ms)}, "
                f"step {ms(cur.step_ms)} modelled, {ms(measured)} measured",
                f"{best.name}: {mib(best.memory_bytes)} per GPU, comm {ms(best.comm_ms)}, exposed {ms(best.exposed_ms)}, step {ms(best.step_ms)}",
                st.reasoning,
            ],
            cause="the sharding strategy does not match this model size, memory budget and network",
            fix=fix_for(facts, fsdp2=st.fix.get("fsdp2"), fsdp1=st.fix.get("fsdp1")),
            confidence=0.6,
            est_saving_ms=saving,
            saving_span_ms=[saving, other],
            saving_assumptions=(
                f"{best.name}'s step modelled from this run's compute and measured bus bandwidths (assumed where "
                f"no collective measured them); the span: the current step as measured ({ms(measured)}) or as "
                f"modelled ({ms(cur.step_ms)}), the smaller difference the estimate"
            ),
        )
    ]
