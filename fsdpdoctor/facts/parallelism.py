"""The run's parallelism: mesh sizes and its kind (``ParallelismFacts``), and the vocabulary of
kinds that :mod:`fsdpdoctor.analysis.runkind`, the one classifier of the run, names. Part of the
RunFacts contract (:mod:`fsdpdoctor.facts`)."""

from __future__ import annotations

from dataclasses import dataclass, field


#: Every kind of run :mod:`fsdpdoctor.analysis.runkind` names (``ParallelismFacts.run_kind``), the
#: one classifier of the run; consumers ask the families below, never match on free text.
RUN_KINDS = (
    "fsdp2",
    "fsdp1",
    "tensor parallel (Megatron)",
    "tensor parallel",
    "ddp + all-to-all model parallel (TorchRec)",
    "ddp",
    "dataparallel",
    "moe expert parallel",
    "all-to-all model parallel",
    "pipeline parallel",
    "data parallel (all-reduce)",
    "inference",
    "training",  # a rank of a larger job with no collectives seen, a backward pass in its steps
    "single-gpu training",
    "single-process training",
)
#: DistributedDataParallel (its labels in the trace): gradients all-reduced in buckets
DDP_KINDS = frozenset({"ddp", "ddp + all-to-all model parallel (TorchRec)"})
#: replicas that all-reduce their gradients: DDP, or a hand-written all-reduce loop like it
DATA_PARALLEL_KINDS = DDP_KINDS | {"data parallel (all-reduce)"}
TENSOR_PARALLEL_KINDS = frozenset({"tensor parallel (Megatron)", "tensor parallel"})


@dataclass(slots=True)
class ParallelismFacts:
    """Mesh sizes from the trace (None where that dimension is not used), and the run's kind."""

    shard_size: int | None = None  # FSDP shard group
    replicate_size: int | None = None  # HSDP replicate group
    tp_size: int | None = None  # tensor parallel group
    dp_size: int | None = None  # data-parallel (DDP) group
    roles: dict[str, float] = field(default_factory=dict)  # role → collectives per step
    evidence: str = ""
    # what kind of run the trace is (analysis.runkind, one of RUN_KINDS): the one reading of it
    # that the rules, the strategy advisor, the headline and compare use; None: nothing to tell it
    # from (no steps, or collectives that fit no kind); and what it was decided from
    run_kind: str | None = None
    run_kind_evidence: str = ""

    @property
    def ddp(self) -> bool:
        """DistributedDataParallel, by its labels (its all-reduces are bucketed)."""
        return self.run_kind in DDP_KINDS

    @property
    def data_parallel(self) -> bool:
        """Replicas all-reducing gradients: DDP, or an all-reduce loop like it outside the forward."""
        return self.run_kind in DATA_PARALLEL_KINDS

    @property
    def tensor_parallel(self) -> bool:
        """All-reduces inside the forward on a tensor-parallel group (Megatron, a vLLM server)."""
        return self.run_kind in TENSOR_PARALLEL_KINDS
