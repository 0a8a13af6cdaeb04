"""fsdpdoctor on the H200 recordings (``fixtures/recorded/gpu-h200/``: one H200, NCCL, world size 1).

Recorded after the tool was written against the H100 set, to check it on what it was not tuned
on: the fp32 run and its bf16 and TF32 twins on one machine, and a second model
(``fixtures.record_gpu.GPT2Like``: GPT-2's module names, 6 blocks of dim 768, a head tied to the
embedding, bf16, a 5-step window). Expected values come from the recorder's models and
configuration and from the CUDA caching allocator's rounding rules, never from fsdpdoctor's
output; the peak ``torch.cuda.max_memory_allocated`` measured is read from ``recording.json``,
which the recorder wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fsdpdoctor
from fixtures import record_gpu as rg
from fsdpdoctor.analysis.memory import analyze_memory

H200 = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu-h200"
RESULTS = {r["variant"]: r for r in json.loads((H200 / "recording.json").read_text())["results"]}
VARIANTS = ("fsdp2", "fsdp2-bf16", "fsdp2-tf32", "gpt2-bf16", "gpt2-bf16-b96", "gpt2-bf16-b96-ac")
SNAPSHOTS = tuple(v for v in VARIANTS if (H200 / v / "rank0.memory.pickle.gz").exists())
MiB = 2**20


def _units(variant: str) -> dict[str, list]:
    """FSDP unit → its parameter tensors, from the recorder's model (tied parameters once)."""
    model = rg.build_model(variant)
    prefix = "transformer.h" if rg.is_gpt2(variant) else "layers"
    units = {"": []} | {f"{prefix}.{i}": [] for i in range(len(model.layers))}
    for name, p in model.named_parameters():  # named_parameters yields a tied parameter once
        # (checkpoint_wrapper nests each block under _checkpoint_wrapped_module: same unit, same tensors)
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        units[owner].append(p)
    return units


def _block_bytes(nbytes: int) -> tuple[int, int]:
    """The bytes the CUDA caching allocator gives a request, lowest and highest: rounded up to
    512; a large-pool block (> 1 MiB) keeps a remainder of its segment smaller than 1 MiB
    unsplit (c10/cuda/CUDACachingAllocator.cpp: round_size, should_split)."""
    low = -(-nbytes // 512) * 512
    return low, low + (MiB if nbytes > MiB else 0)


@pytest.fixture(scope="module")
def run():
    cache: dict[str, fsdpdoctor.Report] = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = fsdpdoctor.analyze(H200 / variant)
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_loads_as_one_h200_rank_with_the_recorded_steps(variant, run):
    f = run(variant).facts
    assert f.ranks == [0]
    assert f.compute is not None and f.compute.peak_label == "H200"
    _, _, _, active = rg.shape(variant)
    assert f.steps.count == active  # 5 profiled steps for the GPT-2 run, 2 for the others
    assert f.fsdp is not None and f.fsdp.version == 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_units_are_the_models(variant, run):
    units = _units(variant)
    f = run(variant).facts
    assert sorted(u.fqn for u in f.fsdp.units) == sorted(units)
    side = json.loads((H200 / variant / "fsdpdoctor_meta.json").read_text())
    assert {u["fqn"]: u["numel"] for u in side["units"]} == {u: sum(p.numel() for p in ps) for u, ps in units.items()}


def test_snapshots_where_the_recorder_kept_memory_history():
    assert set(SNAPSHOTS) == set(VARIANTS) & rg.MEMORY_VARIANTS


@pytest.mark.parametrize("variant", SNAPSHOTS)
def test_memory_parameters_and_optimizer_state(variant):
    """fp32 shards (world size 1: every parameter) and AdamW's two fp32 states per parameter,
    each tensor in its own allocator block; fused AdamW adds a device ``step`` (4 bytes) per
    tensor. The GPT-2 model's 1.5 MiB position embedding and 2.25 / 6.75 / 9 MiB block weights
    are where the allocator's rounding shows."""
    m = analyze_memory(H200 / variant / "rank0.memory.pickle.gz")
    params = [p for ps in _units(variant).values() for p in ps]
    lo = sum(_block_bytes(4 * p.numel())[0] for p in params)
    hi = sum(_block_bytes(4 * p.numel())[1] for p in params)
    assert lo <= m.categories["parameters_sharded"] <= hi
    step = len(params) * _block_bytes(4)[0]
    assert 2 * lo + step <= m.categories["optimizer_state"] <= 2 * hi + step
    assert m.peak_allocated_bytes == RESULTS[variant]["peak_allocated"]
    # (the categories sum to the peak by construction, "other" taking what no stack explains:
    # nothing of note may fall through to it)
    assert m.categories["other"] < 1 << 20


@pytest.mark.parametrize("variant", SNAPSHOTS)
def test_memory_unsharded_parameters(variant):
    """FSDP2 never reshards the root and holds at most two blocks unsharded at once (the one
    running and the one prefetched): root + k blocks, k in 0..2, in the parameter dtype (bf16
    under MixedPrecisionPolicy)."""
    units = _units(variant)
    width = 2 if "bf16" in variant else 4
    root = sum(p.numel() for p in units[""])
    block = sum(p.numel() for p in units[sorted(units)[1]])
    got = analyze_memory(H200 / variant / "rank0.memory.pickle.gz").categories["parameters_unsharded"]
    assert got in {width * (root + k * block) for k in range(3)}


def test_tf32_twin_changes_no_memory():
    """allow_tf32 changes the GEMM kernels, not one allocation: the fp32 run and its TF32 twin
    peak at the same bytes (the recorder's own measurement)."""
    assert RESULTS["fsdp2-tf32"]["peak_allocated"] == RESULTS["fsdp2"]["peak_allocated"]
    a = analyze_memory(H200 / "fsdp2" / "rank0.memory.pickle.gz").categories
    b = analyze_memory(H200 / "fsdp2-tf32" / "rank0.memory.pickle.gz").categories
    assert a == b


def test_recompute_cost_against_the_twin_without_checkpointing(run):
    """gpt2-bf16-b96-ac is gpt2-bf16-b96 with every block checkpointed, on the same H200: the
    step the raw traces say grows by ≈13 ms. The run is CPU-bound, so FSD019 prices the recompute
    by its CPU time in backward: the backward nodes that recompute, with the Python between the
    recomputed ops (the ops' own durations alone gave 5.6 ms)."""
    from test_step_clock import raw_clock

    real = (
        raw_clock(H200 / "gpt2-bf16-b96-ac" / "rank0.json.gz")["step_ms"]
        - raw_clock(H200 / "gpt2-bf16-b96" / "rank0.json.gz")["step_ms"]
    )
    f = next(x for x in run("gpt2-bf16-b96-ac").findings if x.slug == "activation-recompute")
    assert run("gpt2-bf16-b96-ac").facts.timeline.bound == "cpu"
    assert f.est_saving_ms == pytest.approx(real, rel=0.3)
    assert "activation-recompute" not in {x.slug for x in run("gpt2-bf16-b96").findings}
