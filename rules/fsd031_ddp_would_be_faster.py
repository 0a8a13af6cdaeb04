"""What it detects
    The model fits on every GPU replicated, and plain DDP (one all-reduce per step) is estimated
    to be faster than FSDP's all-gathers and reduce-scatters.

Why it hurts
    FSDP trades communication for memory. When memory is not the constraint, FULL_SHARD moves
    about 1.5× the bytes of DDP's all-reduce per step and adds per-unit hook overhead.

How it shows in a trace
    An FSDP run whose estimated replicated memory (parameters + gradients + optimizer state +
    measured activations) fits in the device, with exposed all-gathers.

Fix
    Use ``DistributedDataParallel`` (or FSDP ``NO_SHARD``).

Known problems
    It shares the sharding-strategy model's limits (an arithmetic estimate, trusted within 25% of
    the measured step, with assumed inputs listed). The saving is the measured step less the DDP
    step modelled from this run's own compute: its optimizer step on every parameter (the measured
    sharded step × the ranks it was sharded over), one all-reduce at the measured bus bandwidth,
    hidden behind backward but for its last bucket. Its span runs to the model's own difference
    (current strategy as modelled, not as measured). On the generated root-only run at 50 GB/s
    (4 ranks) it estimates 12.73 ms where the same run generated as DDP was 12.90 ms faster
    (0.99x, both regimes); at the default 100 GB/s DDP is 0.57 ms faster, which its optimizer step
    (17.75 ms instead of 4.44 ms) nearly cancels: no finding. Until the optimizer step was scaled
    it estimated 13.04 ms there (23x). FSDP's own copy-in/out kernels are kept under DDP.
    Without a memory snapshot the activations count as 0, so "fits replicated" can be wrong.
"""

from fsdpdoctor.fmt import mib, ms, pct

from ._util import ALL_COMM, finding, is_fsdp, step_ms

CODE = "FSD031"
SLUG = "ddp-would-be-faster"
TITLE = "The model fits replicated: DDP is estimated to be faster"
SEVERITY = "info"
THRESHOLDS = ("strategy_min_saving_pct",)
SAVES_ON = "step"  # a modelled step time: its saving is bounded by the step, not only the GPU window

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": ALL_COMM, "cpu": []}
CLAIM_PRIORITY = 130  # specific findings claim before the general ones that they explain


def check(facts, cfg):
    st = facts.strategy
    if st is None or not st.trusted or not is_fsdp(facts):
        return []
    cur, ddp = st.candidate(st.current), st.candidate("NO_SHARD")
    if cur is None or ddp is None or not ddp.fits or cur.name == "NO_SHARD":
        return []
    measured = step_ms(facts)
    saving = measured - ddp.step_ms  # the measured step, less DDP's modelled one
    modelled = cur.step_ms - ddp.step_ms  # the model's own difference: the span's other end
    if saving <= 0 or 100 * saving / measured < cfg["strategy_min_saving_pct"]:
        return []
    return [
        finding(
            __name__,
            f"The model fits replicated ({mib(ddp.memory_bytes)} per GPU) and DDP is estimated {ms(saving)} per step faster ({pct(100 * saving / measured)}).",
            evidence=[
                f"{cur.name}: comm {ms(cur.comm_ms)}, exposed {ms(cur.exposed_ms)}, step {ms(cur.step_ms)} modelled, {ms(measured)} measured",
                f"DDP: one all-reduce {ms(ddp.comm_ms)}, exposed {ms(ddp.exposed_ms)}, step {ms(ddp.step_ms)} "
                "(the optimizer stepping every parameter on each rank)",
            ],
            cause="FSDP used where memory is not the constraint",
            fix={"any": "model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])"},
            confidence=0.5,
            est_saving_ms=saving,
            saving_span_ms=[min(saving, modelled), max(saving, modelled)],
            saving_assumptions=(
                f"DDP's step modelled from this run's compute, its optimizer on every parameter, one all-reduce "
                f"hidden behind backward but its last bucket; the span: the current step as measured "
                f"({ms(measured)}) or as modelled ({ms(cur.step_ms)})"
            ),
            # DDP removes FSDP's exposed communication, nothing else (and adds the optimizer's)
            saving_ceiling_ms=facts.timeline.exposed_comm_ms or None,
        )
    ]
