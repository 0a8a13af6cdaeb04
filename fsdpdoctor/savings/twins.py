"""Real twins: predicted savings against the step-time difference really measured.

Written by ``python benchmarks/savings_table.py --write`` (do not edit by hand): for every pair of
real recordings in ``fixtures/recorded/`` that differ by one fix, the saving fsdpdoctor predicts
on the run with the problem (``predicted_ms``) and the difference of the two runs' step times as
the test suite's independent reader measures them from the raw traces (``measured_ms``).
:mod:`fsdpdoctor.savings` turns them into each finding's saving range.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Twin:
    kind: str  # the saving kind: the rule's slug, or "slug/context" where the fix behaves differently
    pair: str  # "problem -> fixed"
    device: str
    predicted_ms: float
    measured_ms: float
    why: str = ""  # what the twin showed that the model does not see
    family: str = "transformer"  # the model family (fsdpdoctor.savings.run_family)


TWINS: tuple[Twin, ...] = (
    Twin(
        "matmul-wrong-engine", "gpu/fsdp2 -> gpu/fsdp2-bf16", "NVIDIA H100 80GB HBM3", 34.911, 37.896, "", "transformer"
    ),
    Twin(
        "matmul-wrong-engine", "gpu-h200/fsdp2 -> gpu-h200/fsdp2-bf16", "NVIDIA H200", 36.271, 46.022, "", "transformer"
    ),
    Twin(
        "matmul-wrong-engine/tf32",
        "gpu-h200/fsdp2-tf32 -> gpu-h200/fsdp2-bf16",
        "NVIDIA H200",
        0.000,
        9.760,
        "the bf16 twin's CPU span is 7.9 ms shorter; the replay moves only the fp32 attention kernels",
        "transformer",
    ),
    Twin(
        "activation-recompute", "gpu/fsdp2-ac -> gpu/fsdp2", "NVIDIA H100 80GB HBM3", 14.314, 14.116, "", "transformer"
    ),
    Twin(
        "activation-recompute",
        "gpu-h200/gpt2-bf16-b96-ac -> gpu-h200/gpt2-bf16-b96",
        "NVIDIA H200",
        9.839,
        10.902,
        "",
        "transformer",
    ),
    Twin(
        "cpu-offload-stall",
        "gpu/fsdp2-offload -> gpu/fsdp2",
        "NVIDIA H100 80GB HBM3",
        530.623,
        539.988,
        "",
        "transformer",
    ),
    Twin(
        "cpu-offload-stall",
        "gpu/fsdp2-offload-pageable -> gpu/fsdp2",
        "NVIDIA H100 80GB HBM3",
        457.360,
        521.205,
        "",
        "transformer",
    ),
    Twin(
        "pageable-memcpy/cpu-offload",
        "gpu/fsdp2-offload-pageable -> gpu/fsdp2-offload",
        "NVIDIA H100 80GB HBM3",
        83.557,
        -18.783,
        "the pinned twin's CPU AdamW step ran 525 vs 333 ms per step (pinned host memory), which the replay does not see",
        "transformer",
    ),
)
