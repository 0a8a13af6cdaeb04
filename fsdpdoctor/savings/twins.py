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
    # the problem run's step clock as the tool reads it (RunFacts.step_clock_ms): which run a
    # finding is on, so that a twin is never part of its own run's range (leave-one-out)
    problem_step_ms: float = 0.0


TWINS: tuple[Twin, ...] = (
    Twin(
        "matmul-wrong-engine",
        "gpu/fsdp2 -> gpu/fsdp2-bf16",
        "NVIDIA H100 80GB HBM3",
        35.116,
        37.896,
        "",
        "transformer",
        72.140,
    ),
    Twin(
        "matmul-wrong-engine",
        "gpu-h200/fsdp2 -> gpu-h200/fsdp2-bf16",
        "NVIDIA H200",
        35.952,
        46.022,
        "",
        "transformer",
        70.914,
    ),
    Twin(
        "matmul-wrong-engine/tf32",
        "gpu-h200/fsdp2-tf32 -> gpu-h200/fsdp2-bf16",
        "NVIDIA H200",
        0.000,
        9.760,
        "the bf16 twin's CPU span is 7.9 ms shorter; the replay moves only the fp32 attention kernels",
        "transformer",
        34.618,
    ),
    Twin(
        "activation-recompute",
        "gpu/fsdp2-ac -> gpu/fsdp2",
        "NVIDIA H100 80GB HBM3",
        14.314,
        14.116,
        "",
        "transformer",
        86.256,
    ),
    Twin(
        "activation-recompute",
        "gpu-h200/gpt2-bf16-b96-ac -> gpu-h200/gpt2-bf16-b96",
        "NVIDIA H200",
        9.839,
        10.902,
        "",
        "transformer",
        65.952,
    ),
    Twin(
        "cpu-offload-stall",
        "gpu/fsdp2-offload -> gpu/fsdp2",
        "NVIDIA H100 80GB HBM3",
        530.623,
        539.988,
        "",
        "transformer",
        612.152,
    ),
    Twin(
        "cpu-offload-stall",
        "gpu/fsdp2-offload-pageable -> gpu/fsdp2",
        "NVIDIA H100 80GB HBM3",
        456.886,
        521.205,
        "",
        "transformer",
        593.373,
    ),
    Twin(
        "non-matmul-kernels/fusion",
        "gpu-h200-levers/llama-bf16-b64 -> gpu-h200-levers/llama-bf16-b64-compile",
        "NVIDIA H200",
        13.851,
        15.240,
        "",
        "transformer",
        84.716,
    ),
    Twin(
        "non-matmul-kernels/optimizer",
        "gpu-h200-levers/llama-bf16-b64 -> gpu-h200-levers/llama-bf16-b64-fused",
        "NVIDIA H200",
        0.000,
        2.618,
        "a fused step saves 3% of this GPU-bound step, below the finding's threshold: the finding is the fusion lever",
        "transformer",
        84.716,
    ),
    Twin(
        "gpu-starved-by-hooks",
        "gpu-h200-levers/llama-bf16-b64 -> gpu-h200-levers/llama-bf16-b64-pairs",
        "NVIDIA H200",
        0.000,
        -1.646,
        "",
        "transformer",
        84.716,
    ),
    Twin(
        "matmul-wrong-engine",
        "gpu-h200-levers/llama-fp32-b64 -> gpu-h200-levers/llama-bf16-b64",
        "NVIDIA H200",
        499.936,
        530.175,
        "the replay's steady steps take ~120 ms where bf16 ran 84.7 (its GEMMs at ~75% of the BF16 peak; the replay assumes 50%)",
        "transformer",
        614.905,
    ),
    Twin(
        "matmul-wrong-engine",
        "gpu-h200-levers/llama-tf32-b64 -> gpu-h200-levers/llama-bf16-b64",
        "NVIDIA H200",
        78.807,
        102.928,
        "",
        "transformer",
        187.621,
    ),
    Twin(
        "pageable-memcpy/cpu-offload",
        "gpu/fsdp2-offload-pageable -> gpu/fsdp2-offload",
        "NVIDIA H100 80GB HBM3",
        83.563,
        -18.783,
        "the pinned twin's CPU AdamW step ran 525 vs 333 ms per step (pinned host memory), which the replay does not see",
        "transformer",
        593.373,
    ),
)
