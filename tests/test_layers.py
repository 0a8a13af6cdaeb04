"""Repeated blocks from GEMM shapes (fsdpdoctor.analysis.layers) on real recordings.

Truth comes from the recorded models themselves: the number of blocks and the weight and bias
elements of one block's nn.Linear modules (fixtures/record_cpu.py, fixtures/record_gpu.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpdoctor.analysis.layers import periodic_run, repeated_blocks
from fsdpdoctor.analysis.steps import find_steps
from fsdpdoctor.ingest.kineto import load_trace

REPO = Path(__file__).resolve().parents[1]
GPU_RECORDED = REPO / "fixtures" / "recorded" / "gpu"


def test_periodic_run_finds_the_blocks_between_prefix_and_suffix():
    e, a, b, c, h = "emb", "qkv", "fc1", "fc2", "head"
    assert periodic_run([e, a, b, c, a, b, c, a, b, c, h]) == (1, 3, 3)
    # a block with repetition inside it: the block, not its repeated part, is the period
    assert periodic_run([a, a, a, b, c] * 4 + [h]) == (0, 5, 4)
    # two blocks per period cover as much as one: the smaller period wins
    assert periodic_run([a, b] * 6) == (0, 2, 6)
    assert periodic_run([a, b, c, h]) is None
    assert periodic_run([]) is None


def _linear_numel(block) -> int:
    import torch.nn as nn

    return sum(p.numel() for m in block.modules() if isinstance(m, nn.Linear) for p in m.parameters())


def _check(path: Path, n_layers: int, block_numel: int) -> None:
    rt = load_trace(path)
    steps = find_steps(rt).steps
    blocks = repeated_blocks(rt, steps)
    assert blocks is not None
    assert blocks.count == n_layers
    assert blocks.block_numel == block_numel
    assert sorted(blocks.forward_starts) == list(range(len(steps)))
    assert sorted(blocks.backward_ends) == list(range(len(steps)))
    for st, step in enumerate(steps):
        fwd, bwd = step.phases["forward"], step.phases["backward"]
        starts = blocks.forward_starts[st]
        assert all(fwd[0] <= t < fwd[1] for t in starts) and starts == sorted(starts)
        ends = blocks.backward_ends[st]
        # the first block ends the backward pass; the others end in reverse order of the forward
        assert ends[0] is None
        rest = ends[1:]
        assert all(bwd[0] <= t < bwd[1] for t in rest) and rest == sorted(rest, reverse=True)


@pytest.mark.parametrize("variant", ["root-only", "per-block", "fsdp1"])
def test_recorded_cpu_runs(variant, recorded_run, recorder):
    model = recorder.build_model()
    _check(Path(recorded_run(variant)) / "rank0.json.gz", len(model.layers), _linear_numel(model.layers[0]))


@pytest.mark.parametrize("shape", ["ac", "ac-fsdp1", "compiled"])
def test_recorded_cpu_run_shapes(shape, recorded_run, recorder):
    """Activation checkpointing (the recomputed forward GEMMs sit in backward: a longer backward
    period, the same blocks) and compiled blocks."""
    model = recorder.build_model()
    _check(Path(recorded_run(shape)) / "rank0.json.gz", len(model.layers), _linear_numel(model.layers[0]))


def test_recorded_gradient_accumulation(recorded_run, recorder):
    """Micro-batches repeat the whole forward pass: the blocks are those of one pass (not the
    passes), their backward ends in the last backward pass, the one that reduces."""
    model = recorder.build_model()
    rt = load_trace(Path(recorded_run("ga-fsdp2")) / "rank0.json.gz")
    steps = find_steps(rt).steps
    blocks = repeated_blocks(rt, steps)
    assert blocks is not None and len(steps[0].microbatches) == recorder.MICROBATCHES
    assert (blocks.count, blocks.block_numel) == (len(model.layers), _linear_numel(model.layers[0]))
    for st, step in enumerate(steps):
        first, last = step.microbatches[0]["forward"], step.microbatches[-1]["backward"]
        assert all(first[0] <= t < first[1] for t in blocks.forward_starts[st])
        assert all(last[0] <= t < last[1] for t in blocks.backward_ends[st][1:])


def test_recorded_tensor_parallel_blocks(recorded_run, recorder):
    """TP + FSDP: the blocks' GEMMs are the tensor-parallel local ones, one block per layer still."""
    rt = load_trace(Path(recorded_run("tp-fsdp")) / "rank0.json.gz")
    blocks = repeated_blocks(rt, find_steps(rt).steps)
    assert blocks is not None and blocks.count == len(recorder.build_model().layers)


@pytest.mark.parametrize("variant", ["fsdp2", "fsdp2-ac", "fsdp1", "ddp"])
def test_recorded_gpu_runs(variant):
    pytest.importorskip("torch")
    from fixtures import record_gpu

    model = record_gpu.build_model()
    _check(GPU_RECORDED / variant / "rank0.json.gz", len(model.layers), _linear_numel(model.layers[0]))


@pytest.mark.parametrize("variant", ["gpt2-bf16", "fsdp2-tf32", "gpt2-bf16-b96-ac"])
def test_recorded_h200_runs(variant):
    """Recorded apart from the runs the detector was written on: GPT-2's module names, 6 blocks
    of dim 768, a tied head, bf16 and a 5-step window; and the TF32 run's cuBLAS kernels."""
    pytest.importorskip("torch")
    from fixtures import record_gpu

    model = record_gpu.build_model(variant)
    _check(
        GPU_RECORDED.with_name("gpu-h200") / variant / "rank0.json.gz",
        len(model.layers),
        _linear_numel(model.layers[0]),
    )


def test_no_shapes_no_blocks(recorded_run):
    """A trace without recorded shapes: nothing is guessed."""
    rt = load_trace(Path(recorded_run("root-only")) / "rank0.json.gz")
    for a in rt.args.values():
        a.input_dims = None
    assert repeated_blocks(rt, find_steps(rt).steps) is None
