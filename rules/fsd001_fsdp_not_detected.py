"""What it detects
    Traces in which no FSDP hook label appears: no ``FSDP::*`` (fully_shard) and no
    ``FullyShardedDataParallel.*`` (FSDP1) ranges.

Why it matters
    Every FSDP-specific rule needs those labels. The run may be DDP, inference, a different
    sharding library, or an FSDP run profiled without CPU activity.

How it shows in a trace
    Collectives and kernels are there, FSDP labels are not. The finding says what was found
    (DDP labels, all-reduce or all-to-all traffic) and the timeline is still reported.

Fix
    Nothing to fix if this is not an FSDP run. For an FSDP run, profile with CPU activity
    (``torch.profiler.ProfilerActivity.CPU``) so that the hook ranges are recorded, e.g. with
    ``fsdpdoctor.capture``.

Known problems
    What was found is named by the first of: DDP labels, all-to-all or point-to-point traffic,
    all-reduces. The public 8-rank DLRM trace (TorchRec: 5 all-to-alls and 3 all-reduces per step)
    and the public sampled 128-rank trace are both reported as DDP; their all-to-alls show only in
    the collectives line. It fires on every trace without FSDP labels, a single-process inference
    run included (the H100 inference recording: "no collectives (single process)"): it is
    information about the input, not a problem of the run.
"""

from fsdpdoctor.fmt import pct

from ._util import ALL_COMM, finding

CODE = "FSD001"
SLUG = "fsdp-not-detected"
TITLE = "No FSDP in these traces"
SEVERITY = "info"
THRESHOLDS = ()

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {"gpu": ALL_COMM, "cpu": [("cpu_fsdp_hooks", None), ("cpu_forward", None), ("cpu_backward", None)]}
CONFIG_KEYS = ("fsdp_version",)  # a configuration finding: it explains a change only when these changed
CLAIM_PRIORITY = 10  # specific findings claim before the general ones that they explain


def check(facts, cfg):
    if facts.fsdp.version is not None or not facts.rank_facts:
        return []
    kinds = (
        ", ".join(f"{c.kind.replace('_', '-')} ×{c.count_per_step:g}/step" for c in facts.collectives)
        or "no collectives"
    )
    found = facts.fsdp.other_parallelism or "no recognised data-parallel wrapper"
    evidence = [
        f"found: {found}",
        f"collectives: {kinds}",
        f"{len(facts.ranks)} rank(s), {facts.steps.count} step(s) each",
    ]
    if facts.gpu_present:
        evidence.append(f"overlap {pct(facts.overlap.pct)} (reported below; FSDP rules skipped)")
    return [
        finding(
            __name__,
            f"No FSDP hook labels in the traces; found {found}. FSDP-specific rules were skipped.",
            evidence=evidence,
            cause="the run does not use FSDP, or the profiler recorded no CPU activity",
            fix={
                "any": "from fsdpdoctor.capture import capture\n"
                "with capture('traces/', model=model) as cap:  # records CPU + CUDA activity\n"
                "    for batch in loader:\n        train_step(batch)\n        cap.step()"
            },
            confidence=0.9,
        )
    ]
