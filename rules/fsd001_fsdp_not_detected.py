"""What it detects
    Traces in which no FSDP hook label appears: no ``FSDP::*`` (fully_shard) and no
    ``FullyShardedDataParallel.*`` (FSDP1) ranges.

Why it matters
    Every FSDP-specific rule needs those labels. The run may be DDP, inference, a different
    sharding library, or an FSDP run profiled without CPU activity.

How it shows in a trace
    Collectives and kernels are there, FSDP labels are not. The finding names the kind
    of run it is instead (DDP, DataParallel, tensor or pipeline parallel, MoE, single-GPU training,
    inference) with what that rests on; the rules that hold for any run still run.

Fix
    Nothing to fix if this is not an FSDP run. For an FSDP run, profile with CPU activity
    (``torch.profiler.ProfilerActivity.CPU``) so that the hook ranges are recorded, e.g. with
    ``fsdpdoctor.capture``.

Known problems
    The run's kind (``parallelism.run_kind``, :mod:`fsdpdoctor.analysis.runkind`) is named from the
    trace alone: FSDP labels, Megatron's tensor-parallel functions, all-reduces inside forward
    (tensor parallel), DDP labels (with TorchRec's all-to-all annotations: the public DLRM and
    sampled 128-rank traces), GPU kernels on several devices in one process (DataParallel),
    all-to-alls (MoE by the routing names), send/recv only (pipeline), else single-GPU training or
    inference. A framework that wraps none of these in a named range (a hand-written all-reduce of
    gradients in forward) can be named wrong; the evidence says what the kind rests on. It fires on every trace without FSDP labels, a single-process inference
    run included (the H100 inference recording: kind "inference", no collectives): it is
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
    kind = facts.parallelism.run_kind
    found = (
        f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} run ({facts.parallelism.run_kind_evidence})"
        if kind
        else facts.parallelism.run_kind_evidence or "no recognised data-parallel wrapper"
    )
    evidence = [
        f"run kind: {kind} ({facts.parallelism.run_kind_evidence})" if kind else f"found: {found}",
        f"collectives: {kinds}",
        f"{len(facts.ranks)} rank(s), {facts.steps.count} step(s) each",
    ]
    if facts.gpu_present:
        evidence.append(f"overlap {pct(facts.overlap.pct)} (reported below; FSDP rules skipped)")
    return [
        finding(
            __name__,
            f"No FSDP hook labels in the traces: {found}. FSDP-specific rules were skipped; the findings "
            "above hold for this kind of run.",
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
