"""What it detects
    A tensor-parallel run (Megatron-style: ``ParallelismFacts.run_kind`` "tensor parallel …") whose
    all-reduces inside the forward (and backward) pass are exposed: the GPU computes nothing while
    they run.

Why it hurts
    Row-parallel layers end in an all-reduce of their output, and the next layer needs that output:
    the all-reduce sits on the critical path by design, it cannot overlap the layer that produced
    it. Its cost grows with the activation size and falls with the link's bandwidth, so a TP group
    that crosses nodes (InfiniBand instead of NVLink) pays several times more.

How it shows in a trace
    ``nccl:all_reduce`` (or a custom all-reduce) issued inside forward, one or two per layer, on the
    TP group, with the compute stream idle under each (``exposed_comm.by_phase_kind["forward"]``).
    Low overlap here is not a missing ``async_op``: low-overlap defers to this finding.

Fix
    Megatron-LM: sequence parallelism with the TP communication overlapped with the GEMMs
    (``--sequence-parallel --tp-comm-overlap``, Transformer Engine's userbuffers: the all-reduce
    becomes a reduce-scatter + all-gather pipelined with the matmul chunks); keep the TP group
    inside a node (``--tensor-model-parallel-size`` ≤ GPUs per node) and scale with data or pipeline
    parallelism across nodes; a smaller TP size where the model fits.

Saving
    Not estimated: how much of the all-reduce time the overlap hides depends on the GEMM sizes and
    the userbuffers' chunking, which the trace does not show. The exposed all-reduce time per step
    is the bound.

Known problems
    Inference servers (vLLM) reach the same kind: their all-reduces are exposed by design too, and
    the levers there are the custom / symmetric-memory all-reduce and a smaller TP size; the finding
    names the run's own evidence. An FSDP + TP run is left to the FSDP rules.
"""

from fsdpdoctor.fmt import ms

from ._util import finding, is_fsdp, of_step, step_ms

CODE = "FSD034"
SLUG = "tensor-parallel-on-critical-path"
TITLE = "Tensor-parallel all-reduces on the critical path"
SEVERITY = "warning"
THRESHOLDS = ("low_overlap_min_pct_of_step",)

EXPLAINS = {"gpu": [("exposed_other_comm", None)], "cpu": []}
CLAIM_PRIORITY = 120

FIX_MEGATRON = """# Megatron-LM: sequence parallelism, with the TP communication overlapped with the GEMMs
# (Transformer Engine userbuffers: all-reduce -> reduce-scatter + all-gather pipelined with the matmuls)
--tensor-model-parallel-size 8 --sequence-parallel --tp-comm-overlap
# keep the TP group inside one node (TP size <= GPUs per node: NVLink, not the network);
# scale across nodes with data / pipeline parallelism, e.g. --pipeline-model-parallel-size 2
"""

FIX_INFERENCE = """# vLLM: keep tensor parallelism inside one node (NVLink), and the custom all-reduce on
# (the default; do not pass --disable-custom-all-reduce); where the model fits, a smaller TP size
# with more replicas: --tensor-parallel-size 4 --data-parallel-size 2
"""


def check(facts, cfg):
    kind = facts.parallelism.run_kind or ""
    sm = step_ms(facts)
    if not facts.parallelism.tensor_parallel or is_fsdp(facts) or not facts.gpu_present or not sm:
        return []
    by = facts.exposed_comm.by_phase_kind
    tp_ms = sum(by.get(p, {}).get("all_reduce", 0.0) for p in ("forward", "backward"))
    if 100 * tp_ms / sm < cfg["low_overlap_min_pct_of_step"]:
        return []
    ar = next((c for c in facts.collectives if c.kind == "all_reduce"), None)
    size = facts.parallelism.tp_size or (ar.group_size if ar else None)
    per_node = max((r.gpus_per_node or 0 for r in facts.rank_facts), default=0) or None
    evidence = [
        f"run kind: {kind} ({facts.parallelism.run_kind_evidence})",
        f"all-reduces exposed {ms(tp_ms)} per step in forward/backward = {of_step(facts, tp_ms)}"
        + (f"; {ar.count_per_step:g} all-reduces per step, {ms(ar.gpu_ms_per_step)} of GPU time" if ar else ""),
    ]
    if size and per_node:
        evidence.append(
            f"TP group of {size} on hosts with {per_node} GPUs: "
            + ("inside one node" if size <= per_node else "it crosses nodes: keep it inside one")
        )
    infer = facts.workload == "inference" and kind != "tensor parallel (Megatron)"
    return [
        finding(
            __name__,
            f"Tensor-parallel all-reduces are exposed {ms(tp_ms)} per step ({of_step(facts, tp_ms)}): "
            "on the critical path by design.",
            evidence=evidence,
            cause="each row-parallel layer's output is all-reduced before the next layer can use it",
            fix={"any": FIX_INFERENCE if infer else FIX_MEGATRON},
            confidence=0.7,
            est_saving_ms=None,
            where={"phase": "forward"},
        )
    ]
