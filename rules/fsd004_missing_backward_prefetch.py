"""What it detects
    Backward all-gathers issued on demand instead of prefetched: FSDP1 with
    ``backward_prefetch=None`` (or ``BACKWARD_POST`` where ``BACKWARD_PRE`` would overlap more),
    FSDP2 with backward prefetching switched off.

Why it hurts
    Each unit's parameters are re-gathered in backward. Without prefetch the all-gather for a
    unit is issued only when its gradient computation is about to start, and the compute stream
    waits for it: every backward all-gather lands on the critical path.

How it shows in a trace
    The backward ``c10d::_allgather_base_`` / ``record_param_comms`` sits directly under
    ``FullyShardedDataParallel._pre_backward_hook`` (FSDP1) or ``FSDP::pre_backward (<fqn>)``
    (FSDP2) of the same unit, not under ``_pre_backward_prefetch`` / ``FSDP::backward_prefetch
    for <fqn>``; on the GPU, compute idles while each backward all-gather runs.

Fix
    FSDP1: ``backward_prefetch=BackwardPrefetch.BACKWARD_PRE`` (the default). FSDP2: remove the
    override that disabled prefetching, or prefetch explicitly.

Known problems
    The mode is read from the FSDP label around each backward all-gather; a single prefetched
    all-gather makes an FSDP2 run count as prefetched. The saving is the what-if replay with each
    backward all-gather issued one unit ahead (without a trusted replay, the exposed backward
    all-gather time): within 15% of generated twins (FSDP1 and FSDP2, also with the GPU the
    bottleneck, tests/test_whatif.py), with no real GPU twin yet (±50%). CPU-only traces get no
    saving: on the real gloo twin prefetching made the step 3.46 ms shorter (docs/savings.md), less
    than the 16.4 ms between the two steps of the problem recording itself (rank 0: 52.6 and
    69.0 ms).
"""

from fsdpdoctor.fmt import ms

from ._util import ALL_COMM, exposed_ms, finding, fix_for, is_fsdp, of_step, replay_evidence, replayed_saving

CODE = "FSD004"
SLUG = "missing-backward-prefetch"
TITLE = "Backward all-gathers are not prefetched"
SEVERITY = "warning"
REPLAY_FIX = "prefetch"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = ("prefetch_min_exposed_ms",)  # below it the finding is info only

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {
    "gpu": [(c, "backward") for c, _ in ALL_COMM],
    "cpu": [("cpu_fsdp_hooks", "backward"), ("cpu_backward", None)],
}
CONFIG_KEYS = (
    "backward_prefetch",
    "fsdp_version",
)  # a configuration finding: it explains a change only when these changed
CLAIM_PRIORITY = 50  # specific findings claim before the general ones that they explain


FIX_FSDP1 = """from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP

model = FSDP(model, auto_wrap_policy=policy, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
"""
FIX_FSDP2 = """# FSDP2 prefetches one unit ahead in backward by default: remove any
# set_modules_to_backward_prefetch(...) that disables it, or prefetch explicitly:
layers = list(model.layers)
for prev, cur in zip(layers, layers[1:]):
    cur.set_modules_to_backward_prefetch([prev])   # backward runs cur, then prev
"""


def check(facts, cfg):
    fs = facts.fsdp
    if not is_fsdp(facts) or not fs.fix_applies("prefetch"):
        return []
    ev = fs.backward_prefetch_evidence
    n_total = sum(ev.values())
    mode = fs.backward_prefetch
    evidence = []
    if fs.sources.get("backward_prefetch") == "sidecar":
        evidence.append(f"sidecar: backward prefetch {mode}")
    elif mode == "NONE":
        evidence.append(
            f"{ev.get('on_demand', 0)} of {n_total} backward all-gathers issued inside the unit's own pre-backward hook (none prefetched)"
        )
    else:
        evidence.append(
            f"{ev.get('post', 0)} of {n_total} backward all-gathers issued in _post_backward_prefetch (BACKWARD_POST)"
        )
    saving = None
    if facts.gpu_present:
        exp = exposed_ms(facts, "backward", "all_gather")
        evidence.append(f"exposed backward all-gather: {ms(exp)} per step = {of_step(facts, exp)}")
        # prefetching moves the all-gather under the preceding unit's gradient compute and ahead
        # of that unit's reduce-scatter on the communicator: the replay sees both effects
        replayed = replayed_saving(facts, "prefetch")
        saving = replayed if replayed is not None else exp
        if replayed is not None:
            evidence.append(replay_evidence(facts, "prefetch", "issuing each backward all-gather one unit ahead"))
            w = facts.whatif
            before, after = w.exposed_rs_ms.get("none", 0.0), w.exposed_rs_ms.get("prefetch", 0.0)
            if before - after > 0.05:
                evidence.append(
                    f"{ms(before - after)} of exposed reduce-scatter per step goes away with prefetch "
                    f"(it waited for the on-demand all-gathers on the same communicator): {ms(before)} → {ms(after)}"
                )
        if saving < cfg["prefetch_min_exposed_ms"]:
            evidence.append(
                f"this run does not pay for it yet: {ms(saving)} per step is below "
                f"{ms(cfg['prefetch_min_exposed_ms'])} (prefetch_min_exposed_ms)"
            )
    what = "not prefetched" if mode == "NONE" else "prefetched only after the current gradients (BACKWARD_POST)"
    return [
        finding(
            __name__,
            f"Backward all-gathers are {what}: compute waits for each unit's parameters in backward.",
            evidence=evidence,
            cause="backward_prefetch=None / BACKWARD_POST (FSDP1) or prefetching disabled (FSDP2)",
            fix=fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, lever="prefetch"),
            confidence=0.9 if fs.sources.get("backward_prefetch") == "trace" else 0.7,
            est_saving_ms=saving,
        )
    ]
