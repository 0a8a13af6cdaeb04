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
    the measured step, with assumed inputs listed) and one of its own: the optimizer step keeps its
    measured, sharded cost, though under DDP each rank steps every parameter. On the generated
    too-coarse scenario (4 ranks) it estimated DDP 13.04 ms per step faster; the same scenario
    generated as DDP was 0.56 ms faster, its optimizer step taking 17.77 ms instead of 4.45 ms.
    Without a memory snapshot the activations count as 0, so "fits replicated" can be wrong.
"""

from fsdpdoctor.fmt import mib, ms, pct

from ._util import ALL_COMM, finding, is_fsdp

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
    saving = cur.step_ms - ddp.step_ms
    if saving <= 0 or 100 * saving / cur.step_ms < cfg["strategy_min_saving_pct"]:
        return []
    return [
        finding(
            __name__,
            f"The model fits replicated ({mib(ddp.memory_bytes)} per GPU) and DDP is estimated {ms(saving)} per step faster ({pct(100 * saving / cur.step_ms)}).",
            evidence=[
                f"{cur.name}: comm {ms(cur.comm_ms)}, exposed {ms(cur.exposed_ms)}, step {ms(cur.step_ms)}",
                f"DDP: one all-reduce {ms(ddp.comm_ms)}, exposed {ms(ddp.exposed_ms)}, step {ms(ddp.step_ms)}",
            ],
            cause="FSDP used where memory is not the constraint",
            fix={"any": "model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])"},
            confidence=0.5,
            est_saving_ms=saving,
        )
    ]
