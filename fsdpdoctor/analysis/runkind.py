"""What kind of run a trace is, and what that was decided from (``ParallelismFacts.run_kind``).

The one classifier of the run: the rules (DDP fixes, FSD010's buckets, FSD034), the strategy
advisor's current strategy, the headline and ``compare`` read its kind, one of
:data:`fsdpdoctor.facts.RUN_KINDS`, through the families there (``ParallelismFacts.ddp``,
``.data_parallel``, ``.tensor_parallel``).

Read from the trace alone, in this order (the first that holds):

- FSDP hook labels: ``fsdp2`` / ``fsdp1`` (:func:`fsdpdoctor.analysis.fsdp.detect_version`);
- Megatron's tensor-parallel autograd functions (``_ReduceFromModelParallelRegion``,
  ``LinearWithGradAccumulationAndAsyncCommunication`` …): ``tensor parallel (Megatron)``;
- all-reduces issued inside the forward pass on a tensor-parallel group, or on any group of two or
  more ranks without ``DistributedDataParallel`` labels (a data-parallel all-reduce runs in
  backward, after the forward): ``tensor parallel`` (a vLLM server);
- ``DistributedDataParallel.*`` labels: ``ddp``; with TorchRec's all-to-all annotations
  (``KJTAllToAll…``, ``## alltoall_fwd_single ##``): ``ddp + all-to-all model parallel (TorchRec)``;
- GPU kernels on two or more devices in one process: ``dataparallel`` (``nn.DataParallel``);
- all-to-alls with MoE routing in the names (expert, moe, dispatch, combine; DeepEP's ``::ep::``
  kernels): ``moe expert parallel``; other all-to-alls: ``all-to-all model parallel``;
- point-to-point send/recv only: ``pipeline parallel``;
- all-reduces outside the forward: ``data parallel (all-reduce)``;
- no collective: ``inference`` (no backward pass or optimizer step in any step), else
  ``single-gpu training`` (``single-process training`` without GPU kernels).
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from fsdpdoctor.ingest.kineto import RankTrace
from fsdpdoctor.analysis.comms import Collective, no_collectives_text

MEGATRON_TP_NAMES = (
    "_ReduceFromModelParallelRegion",
    "_CopyToModelParallelRegion",
    "_GatherFromModelParallelRegion",
    "_ScatterToModelParallelRegion",
    "_GatherFromSequenceParallelRegion",
    "_ReduceScatterToSequenceParallelRegion",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "_VocabParallelCrossEntropy",
)
TORCHREC_MARKS = ("KJTAllToAll", "alltoall_fwd_single", "alltoall_bwd_single", "SplitsAllToAll")
MOE_RX = re.compile(r"expert|moe|dispatch|combine|::ep::|deep_ep", re.I)


def ddp_labels(rt: RankTrace) -> bool:
    """Whether the trace has ``DistributedDataParallel.*`` labels (DDP wraps the model)."""
    return any(x.startswith("DistributedDataParallel.") for x in rt.names)


def run_kind(rt: RankTrace, colls: list[Collective], fsdp_version: int | None, workload: str | None, n_steps: int):
    """(kind, evidence) of one rank's trace (see the module's docstring)."""
    n = max(n_steps, 1)
    names = rt.names
    kinds = Counter(c.kind for c in colls if c.step >= 0) or Counter(c.kind for c in colls)
    per_step = ", ".join(f"{k.replace('_', '-')} ×{v / n:g}/step" for k, v in sorted(kinds.items()))
    no_bwd = "; no backward pass or optimizer step in any step (inference)" if workload == "inference" else ""
    if fsdp_version in (1, 2):
        return f"fsdp{fsdp_version}", f"FSDP{fsdp_version} hook labels"
    fwd_ar = [c for c in colls if c.kind == "all_reduce" and c.phase == "forward"]
    ddp = ddp_labels(rt)
    megatron = sorted(x for x in names if x in MEGATRON_TP_NAMES)
    if megatron:
        size = Counter(c.group_size for c in fwd_ar if c.group_size).most_common(1)
        return "tensor parallel (Megatron)", (
            f"Megatron tensor-parallel functions {', '.join(megatron[:3])}; "
            f"{len(fwd_ar) / n:g} all-reduces per step inside forward"
            + (f" on groups of {size[0][0]}" if size else "")
            + no_bwd
        )
    tp = [c for c in fwd_ar if c.role == "tensor_parallel" or (not ddp and (c.group_size or 0) >= 2)]
    if tp:
        size = Counter(c.group_size for c in tp if c.group_size).most_common(1)
        op = Counter(c.name for c in tp).most_common(1)[0][0]
        return "tensor parallel", (
            f"{len(tp) / n:g} all-reduces per step inside forward ({op})"
            + (f" on groups of {size[0][0]}" if size else "")
            + ", no DistributedDataParallel labels"
            + no_bwd
        )
    if ddp:
        marks = sorted({m for m in TORCHREC_MARKS for x in names if m in x})
        if marks and kinds.get("all_to_all"):
            return "ddp + all-to-all model parallel (TorchRec)", (
                f"DistributedDataParallel labels; TorchRec all-to-all annotations ({', '.join(marks[:3])}); {per_step}"
            )
        return "ddp", f"DistributedDataParallel labels; {per_step or 'no collectives'}"
    devices = _kernel_devices(rt)
    if len(devices) >= 2:
        return "dataparallel", (
            f"GPU kernels on {len(devices)} devices ({', '.join(map(str, sorted(devices)))}) in one process "
            "(nn.DataParallel's replicas)"
        )
    if kinds.get("all_to_all"):
        moe = sorted({x for x in names if MOE_RX.search(x)})
        if moe:
            return "moe expert parallel", f"all-to-alls with expert routing ({', '.join(moe[:3])}); {per_step}"
        return "all-to-all model parallel", per_step
    if kinds.get("send_recv") and set(kinds) <= {"send_recv", "barrier", "broadcast"}:
        return "pipeline parallel", f"point-to-point send/recv only: {per_step}"
    if kinds.get("all_reduce"):
        return "data parallel (all-reduce)", f"all-reduces outside the forward, no DDP labels: {per_step}"
    if not colls:
        ws = rt.world_size or 1
        none = no_collectives_text(rt.world_size)  # never "single" against the trace's world size
        if workload == "inference":
            return "inference", f"{none}; no backward pass or optimizer step in any step"
        if workload == "training" and ws > 1:
            return "training", f"{none}; a backward pass or optimizer step in the steps"
        if workload == "training":
            gpu = bool(rt.mask_cat("kernel").any())
            what = "single-gpu training" if gpu else "single-process training"
            return what, "no collectives; a backward pass or optimizer step in the steps"
        return None, f"{none}; no steps to tell training from inference"
    return None, f"collectives {per_step} fit no known kind"


def _kernel_devices(rt: RankTrace) -> set:
    """The device ids (trace pids) that GPU kernels ran on."""
    kern = np.flatnonzero(rt.mask_cat("kernel"))
    if not kern.size:
        return set()
    return {rt.threads[int(t)][0] for t in np.unique(rt.thread[kern])}
