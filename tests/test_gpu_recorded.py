"""fsdpdoctor on the committed GPU recordings (``fixtures/recorded/gpu/``: one H100, NCCL, world size 1).

Expected values are derived from the recorder's model and configuration
(``fixtures.record_gpu``: ``GPU_MODEL``, ``SEQ``, ``BATCH``, ``ACTIVE``, ``OOM_BATCH_FACTOR``;
``fixtures.record_cpu.TinyTransformer``) and from torch's FSDP2 / DDP code, never read back from
fsdpdoctor's own output. Where a value can only come from the run itself (the peak that
``torch.cuda.max_memory_allocated`` measured, the OOM message torch raised) it is read from
``recording.json``, which the recorder wrote, not fsdpdoctor.

What world size 1 means here (see ``fixtures/recorded/gpu/README.md``):

* FSDP2 issues no all-gather and no reduce-scatter: each unit's shards are copied into its
  unsharded parameters (DtoD) in ``FSDP::pre_forward`` / ``FSDP::pre_backward`` and the reduce
  copies the gradients; so every all-gather / reduce-scatter count is 0 and that is the truth.
* FSDP1 clamps to NO_SHARD and all-reduces each unit's flat gradient; DDP all-reduces its
  buckets. NCCL 2.28 launches no kernel for a one-rank in-place all-reduce: the collectives exist
  only as ``record_param_comms`` CPU events.

Per-unit arithmetic (fp32, no padding at world size 1): the root unit (``""``) owns ``tok_emb``,
``norm`` and ``head``; each ``layers.i`` owns its block. FSDP2's CPU-offload path (torch 2.13
``_fsdp_param.py`` ``FSDPParam.all_gather_inputs``: ``_sharded_param_data.to(device,
non_blocking=True)`` per parameter and per unshard; ``_fsdp_collectives.py`` ``foreach_reduce``:
``new_sharded_grad.to("cpu")`` per parameter; ``_fsdp_state.py`` ``_lazy_init``: the root's
``post_forward_mesh_info = None``, so the root is not resharded after forward) gives per step

* H2D = 4 * N_root (root, forward only) + 2 * 4 * N_blocks (each block in forward and again in
  backward), one copy per parameter tensor;
* D2H = 4 * N (every gradient once).

The only other host copies FSDP launches inside its hooks are ``aten::_chunk_cat``'s kernel
arguments (one small pinned H2D per unit reduce, inside ``fsdp::chunk_cat``), on every FSDP2
run with or without offload.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch.distributed as dist

import fsdpdoctor
from fixtures import record_gpu as rg
from fsdpdoctor.analysis.memory import analyze_memory
from fsdpdoctor.api import analyze_memory_only

GPU = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu"
RECORDING = json.loads((GPU / "recording.json").read_text())
RESULTS = {r["variant"]: r for r in RECORDING["results"]}

FSDP2 = ("fsdp2", "fsdp2-bf16", "fsdp2-ac", "fsdp2-offload", "fsdp2-offload-pageable", "oom")
OFFLOAD = ("fsdp2-offload", "fsdp2-offload-pageable")
SNAPSHOTS = tuple(v for v in rg.VARIANTS if v in rg.MEMORY_VARIANTS)  # fsdp2, -bf16, -ac, -offload, fsdp1, oom
UNITS = [""] + [f"layers.{i}" for i in range(rg.GPU_MODEL["n_layers"])]
B, S = rg.BATCH, rg.SEQ
D = rg.GPU_MODEL["dim"]
L = rg.GPU_MODEL["n_layers"]
HIDDEN = rg.GPU_MODEL["mlp_ratio"] * D
MiB, GiB = 2**20, 2**30


# ----------------------------------------------------------------------------------------------
# Ground truth from the model
# ----------------------------------------------------------------------------------------------


class Model:
    """Parameter counts of ``record_gpu.build_model()``, per FSDP unit."""

    def __init__(self) -> None:
        model = rg.build_model()
        self.params = list(model.parameters())
        self.n = sum(p.numel() for p in self.params)
        self.unit_numel = {u: 0 for u in UNITS}
        self.unit_tensors = {u: 0 for u in UNITS}
        for name, p in model.named_parameters():
            owner = max((u for u in UNITS if u == "" or name.startswith(u + ".")), key=len)
            self.unit_numel[owner] += p.numel()
            self.unit_tensors[owner] += 1
        self.n_root = self.unit_numel[""]
        self.n_blocks = self.n - self.n_root
        self.n_block = self.unit_numel["layers.0"]
        self.p = len(self.params)  # parameter tensors
        self.p_root = self.unit_tensors[""]
        self.p_blocks = self.p - self.p_root


@pytest.fixture(scope="module")
def model() -> Model:
    m = Model()
    # the recorder's own sidecar states the same count (a cross-check of this helper, not of fsdpdoctor)
    assert m.n == json.loads((GPU / "fsdp2" / "fsdpdoctor_meta.json").read_text())["extra"]["model"]["parameters"]
    assert all(m.unit_numel[f"layers.{i}"] == m.n_block for i in range(L))
    return m


# ----------------------------------------------------------------------------------------------
# Each directory / snapshot analysed once per module
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run():
    cache: dict[str, fsdpdoctor.Report] = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = fsdpdoctor.analyze(GPU / variant)
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def mem():
    cache: dict = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = analyze_memory(GPU / variant / "rank0.memory.pickle.gz")
        return cache[variant]

    return get


# ----------------------------------------------------------------------------------------------
# An independent reader of the memcpys (deliberately not fsdpdoctor.ingest)
# ----------------------------------------------------------------------------------------------


class Copies:
    """Every memcpy launched in a ProfilerStep, with its step, innermost FSDP label and whether
    it was launched inside ``fsdp::chunk_cat``."""

    def __init__(self, variant: str) -> None:
        with gzip.open(GPU / variant / "rank0.json.gz", "rt") as fh:
            events = json.load(fh)["traceEvents"]
        x = [e for e in events if e.get("ph") == "X"]
        steps = [e for e in x if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
        launch = {
            e["args"]["correlation"]: e
            for e in x
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
        }
        labels = defaultdict(list)  # tid -> FSDP hook ranges
        chunk_cat = defaultdict(list)
        for e in x:
            if e.get("cat") == "user_annotation" and e["name"].startswith("FSDP::"):
                labels[e["tid"]].append(e)
            elif e.get("cat") == "cpu_op" and e["name"] == "fsdp::chunk_cat":
                chunk_cat[e["tid"]].append(e)

        def inside(ev, ranges):
            return [r for r in ranges if r["ts"] <= ev["ts"] and ev["ts"] + ev["dur"] <= r["ts"] + r["dur"]]

        self.rows = []
        for m in x:
            if m.get("cat") != "gpu_memcpy":
                continue
            r = launch.get(m["args"].get("correlation"))
            if r is None:
                continue  # GPU tail of the step before the profiled window: launched before it
            step = next((s["name"] for s in steps if s["ts"] <= r["ts"] <= s["ts"] + s["dur"]), None)
            if step is None:
                continue
            hooks = sorted(inside(r, labels[r["tid"]]), key=lambda e: e["ts"])
            label = hooks[-1]["name"] if hooks else None
            hook = unit = None
            if label:
                mm = re.fullmatch(r"FSDP::(\w+)(?: \((.*)\))?", label)
                assert mm, label
                hook, unit = mm.group(1), mm.group(2) or ""
            self.rows.append(
                {
                    "kind": re.match(r"Memcpy (\w+) \((\w+) -> (\w+)\)", m["name"]).group(1),
                    "host": "Pageable" if "Pageable" in m["name"] else ("Pinned" if "Pinned" in m["name"] else None),
                    "bytes": m["args"]["bytes"],
                    "step": step,
                    "hook": hook,
                    "unit": unit,
                    "chunk_cat": bool(inside(r, chunk_cat[r["tid"]])),
                }
            )
        self.steps = sorted({s["name"] for s in steps})


# ----------------------------------------------------------------------------------------------
# Every variant: what the trace says about the run
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", rg.VARIANTS)
def test_every_variant_loads_as_one_h100_rank(variant, run):
    f = run(variant).facts
    assert f.ranks == [0]
    assert f.world_size == 1
    assert f.gpu_present is True
    assert "H100" in (f.rank_facts[0].device_name or "")
    assert f.steps.count == rg.ACTIVE  # schedule(wait=1, warmup=1, active=2)
    assert f.sidecar is not None and f.sidecar["extra"]["variant"] == variant
    assert f.workload == ("inference" if variant == "inference" else "training")


@pytest.mark.parametrize("variant", rg.VARIANTS)
def test_fsdp_version(variant, run):
    facts = run(variant).facts
    fs = facts.fsdp
    if variant in FSDP2:
        assert fs.version == 2
    elif variant == "fsdp1":
        assert fs.version == 1
        assert fs.sharding_strategy == "NO_SHARD"  # FSDP1 clamps to NO_SHARD at world size 1
    else:
        assert fs.version is None and fs.unit_count == 0
        if variant == "ddp":
            assert facts.parallelism.run_kind == "ddp" and facts.parallelism.ddp


@pytest.mark.parametrize("variant", FSDP2)
def test_fsdp2_units_and_no_collectives_at_world_size_one(variant, run):
    f = run(variant).facts
    fs = f.fsdp
    assert fs.unit_count == len(UNITS) == 5
    assert [u.fqn for u in fs.units] == UNITS  # the root's pre_forward runs first
    for u in fs.units:
        # world size 1: FSDP2 copies shards instead of all-gathering / reduce-scattering
        assert (u.forward_all_gathers, u.backward_all_gathers, u.reduce_scatters) == (0, 0, 0), u.fqn
        assert u.all_gather_bytes == 0 and u.reduce_scatter_bytes == 0, u.fqn
    assert not [c for r in f.rank_facts for c in r.collectives]


def test_activation_checkpointing_detected(run):
    assert run("fsdp2-ac").facts.fsdp.activation_checkpointing is True
    assert run("fsdp2").facts.fsdp.activation_checkpointing is False


def _all_reduce_bytes_per_step(f) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for c in f.rank_facts[0].collectives:
        assert c.kind == "all_reduce", c.kind
        out[c.step].append(c.bytes)
    return out


def test_fsdp1_no_shard_all_reduces_each_flat_gradient(run, model, tmp_path):
    f = run("fsdp1").facts
    fs = f.fsdp
    assert [u.fqn for u in fs.units] == UNITS and all(u.named for u in fs.units)
    # one all-reduce per unit per step of its whole flat gradient (use_orig_params=False, no
    # padding at world size 1): 4 * numel(unit) bytes, 4N per step
    per_step = _all_reduce_bytes_per_step(f)
    assert sorted(per_step) == list(range(rg.ACTIVE))
    for step, sizes in per_step.items():
        assert sorted(sizes) == sorted(4 * model.unit_numel[u] for u in UNITS), step
        assert sum(sizes) == 4 * model.n
    stats = {c.kind: c for c in f.collectives}
    assert stats["all_reduce"].count_per_step == len(UNITS)
    # the trace alone (no sidecar) says NO_SHARD too: FSDP only all-reduces
    shutil.copy(GPU / "fsdp1" / "rank0.json.gz", tmp_path / "rank0.json.gz")
    alone = fsdpdoctor.analyze(tmp_path).facts.fsdp
    assert alone.version == 1 and alone.sharding_strategy == "NO_SHARD"
    assert alone.sources.get("sharding_strategy") == "trace"


def test_ddp_all_reduces_its_buckets(run, model):
    """DDP rebuilds its buckets after the first iteration with [1 MiB first bucket, 25 MiB]
    (torch ``BucketCapacityConfig`` defaults) in gradient-ready order, which for this model is
    the reverse definition order at bucket granularity."""
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * MiB]
    rev = list(reversed(model.params))
    buckets, _ = dist._compute_bucket_assignment_by_size(rev, limits, [False] * len(rev))
    expected = sorted(4 * sum(rev[i].numel() for i in b) for b in buckets)
    per_step = _all_reduce_bytes_per_step(run("ddp").facts)
    assert sorted(per_step) == list(range(rg.ACTIVE))
    for step, sizes in per_step.items():
        assert sorted(sizes) == expected, step
        assert sum(sizes) == 4 * model.n


@pytest.mark.parametrize("variant", ["fsdp1", "ddp"])
def test_one_rank_all_reduce_launches_no_kernel(variant, run):
    """NCCL 2.28 runs a one-rank in-place all-reduce without a kernel: the collectives are
    ``record_param_comms`` CPU events only, with no GPU duration."""
    with gzip.open(GPU / variant / "rank0.json.gz", "rt") as fh:
        events = json.load(fh)["traceEvents"]
    assert not [e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    assert any(e.get("name") == "record_param_comms" for e in events)
    colls = run(variant).facts.rank_facts[0].collectives
    assert colls and all(c.gpu_dur_us is None for c in colls)


@pytest.mark.parametrize("variant", rg.VARIANTS)
def test_phases(variant, run):
    for r in run(variant).facts.rank_facts:
        for s in r.steps:
            if variant == "inference":  # forward passes only: no backward, no optimizer step
                assert set(s.phase_ms) == {"forward"}
                assert s.phase_ms["forward"] > 0
            else:
                assert set(s.phase_ms) == {"forward", "backward", "optimizer"}
                assert all(v > 0 for v in s.phase_ms.values())
            assert sum(s.phase_ms.values()) <= s.cpu_span_ms + 1e-6


# ----------------------------------------------------------------------------------------------
# CPU offload
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", OFFLOAD)
def test_cpu_offload_bytes_match_the_parameters(variant, run, model):
    fs = run(variant).facts.fsdp
    o = fs.cpu_offload
    assert o.detected is True
    assert fs.sources.get("cpu_offload") != "sidecar"  # found in the trace itself
    steps = rg.ACTIVE
    h2d_params = 4 * model.n_root + 2 * 4 * model.n_blocks  # root once, blocks forward + backward
    # gradients to the CPU once per step: exactly 4N bytes, one copy per parameter tensor
    assert o.d2h_bytes == steps * 4 * model.n
    assert o.d2h_count == steps * model.p
    # parameters to the GPU: one copy per parameter tensor per unshard, plus one chunk_cat
    # argument copy per unit reduce (H2D inside FSDP::post_backward_reduce)
    assert o.h2d_count == steps * (model.p_root + 2 * model.p_blocks + len(UNITS))
    # the chunk_cat argument copies are a few hundred KiB per unit (0.22% here): 0.5% bounds them
    assert o.h2d_bytes / steps == pytest.approx(h2d_params, rel=0.005)
    assert o.h2d_bytes / steps >= h2d_params


def test_no_offload_without_offload_policy(run, model):
    o = run("fsdp2").facts.fsdp.cpu_offload
    assert o.detected is False
    assert o.d2h_count == 0 and o.d2h_bytes == 0
    # the only host copies inside FSDP hooks: chunk_cat's arguments, one per unit reduce
    assert o.h2d_count == rg.ACTIVE * len(UNITS)
    assert o.h2d_bytes < 0.01 * 4 * model.n * rg.ACTIVE


@pytest.mark.parametrize("variant", OFFLOAD)
def test_offload_copies_in_the_hooks_pinned_or_pageable(variant, run, model):
    """Read independently from the trace: which copies FSDP's hooks launch, their bytes per unit
    and step, and whether their host side is pinned or pageable."""
    pin = variant == "fsdp2-offload"
    host = "Pinned" if pin else "Pageable"
    copies = Copies(variant)
    assert len(copies.steps) == rg.ACTIVE
    batch_bytes = B * (S + 1) * 8  # the int64 token batch, moved from a pageable tensor each step
    for step in copies.steps:
        rows = [r for r in copies.rows if r["step"] == step and r["kind"] in ("HtoD", "DtoH")]
        outside = [r for r in rows if r["hook"] is None]
        assert [(r["kind"], r["host"], r["bytes"]) for r in outside] == [("HtoD", "Pageable", batch_bytes)]
        got = Counter()
        for r in rows:
            if r["hook"] is None:
                continue
            if r["chunk_cat"]:  # chunk_cat's arguments: pinned by torch, whatever the policy
                assert (r["kind"], r["host"], r["hook"]) == ("HtoD", "Pinned", "post_backward_reduce")
                got[("chunk_cat", r["unit"])] += 1
                continue
            assert r["host"] == host, r
            got[(r["kind"], r["hook"], r["unit"])] += r["bytes"]
        expected = Counter()
        for u in UNITS:
            expected[("HtoD", "pre_forward", u)] = 4 * model.unit_numel[u]
            if u:  # the root is not resharded after forward: no copy-in in backward
                expected[("HtoD", "pre_backward", u)] = 4 * model.unit_numel[u]
            expected[("DtoH", "post_backward_reduce", u)] = 4 * model.unit_numel[u]
            expected[("chunk_cat", u)] = 1
        assert got == expected, step
    # fsdpdoctor counts pageable copies wherever they are
    o = run(variant).facts.fsdp.cpu_offload
    per_step_pageable = 1 + (0 if pin else model.p_root + 2 * model.p_blocks + model.p)
    assert o.pageable_count == rg.ACTIVE * per_step_pageable


# ----------------------------------------------------------------------------------------------
# Memory snapshots
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", SNAPSHOTS)
def test_memory_parameters_and_optimizer_state(variant, mem, model):
    cats = mem(variant).categories
    if variant == "fsdp2-offload":  # sharded parameters and AdamW state live on the CPU
        assert cats["parameters_sharded"] <= 0.01 * 4 * model.n
        assert cats["optimizer_state"] <= 0.01 * 8 * model.n
        return
    # fp32 sharded parameters (world size 1: the whole model; bf16 mixed precision keeps fp32 shards)
    assert cats["parameters_sharded"] == pytest.approx(4 * model.n, rel=0.01)
    # AdamW exp_avg + exp_avg_sq in fp32 (plus a 512-byte device `step` per tensor with fused=True)
    assert cats["optimizer_state"] == pytest.approx(8 * model.n, rel=0.01)


@pytest.mark.parametrize("variant", SNAPSHOTS)
def test_memory_unsharded_parameters(variant, mem, model):
    """FSDP2 never reshards the root and holds at most two blocks unsharded at once (the one
    running and the one prefetched): root + k blocks, k in 0..2, in the unsharded dtype. FSDP1
    NO_SHARD keeps no unsharded copy: its flat parameters are the whole model."""
    got = mem(variant).categories["parameters_unsharded"]
    if variant == "fsdp1":
        assert got == 0
        return
    width = 2 if variant == "fsdp2-bf16" else 4
    allowed = {width * (model.n_root + k * model.n_block) for k in range(3)}
    assert got in allowed


@pytest.mark.parametrize("variant", [v for v in SNAPSHOTS if v != "oom"])
def test_memory_peak_is_the_recorders_max_memory_allocated(variant, mem):
    """capture() starts memory history before the first training step and the recorder resets
    the peak stats before building the model, so the snapshot's window holds every step and the
    training peak: its allocated peak (pre-existing blocks included) is exactly what
    ``torch.cuda.max_memory_allocated`` reported (model construction peaks far lower)."""
    m = mem(variant)
    assert m.history_missing is False
    assert m.peak_allocated_bytes == RESULTS[variant]["peak_allocated"]
    assert sum(m.categories.values()) == m.peak_allocated_bytes


def test_checkpointing_keeps_far_fewer_activations(mem):
    """Without checkpointing every block keeps at least its qkv output (saved by SDPA) and its
    fc1 and GELU outputs (saved by GELU and fc2): B*S*(3D + 2*HIDDEN)*4 bytes; with per-block
    checkpointing it keeps only its input, B*S*D*4. At the checkpointed run's peak at most one
    block is recomputed, so at least L-1 blocks save the difference."""
    full = mem("fsdp2").categories["activations"]
    ac = mem("fsdp2-ac").categories["activations"]
    block_lower_bound = B * S * (3 * D + 2 * HIDDEN) * 4
    block_input = B * S * D * 4
    assert ac <= full - (L - 1) * (block_lower_bound - block_input)
    assert ac >= block_input  # something is kept: at least one checkpointed input


def _oom_message() -> dict[str, float]:
    msg = RESULTS["oom"]["oom"]  # torch's OutOfMemoryError, as the recorder caught it
    num = r"([\d.]+) (MiB|GiB)"
    parts = {
        "requested": rf"Tried to allocate {num}",
        "device_free": rf"of which {num} is free",
        "allocated": rf"Of the allocated memory {num} is allocated by PyTorch",
        "cached_free": rf"and {num} is reserved by PyTorch but unallocated",
    }
    out = {}
    for key, pat in parts.items():
        mm = re.search(pat, msg)
        assert mm, (key, msg)
        out[key] = (float(mm.group(1)), MiB if mm.group(2) == "MiB" else GiB)
    return out


def test_oom_is_a_device_full_oom_in_forward(model):
    rep = fsdpdoctor.analyze(GPU / "oom", memory=[GPU / "oom" / "rank0.memory.pickle.gz"])
    m = rep.facts.memory
    assert m is not None and m.oom is not None
    oom = m.oom
    msg = _oom_message()
    # the request: the GELU output of one block at OOM_BATCH_FACTOR x the batch, fp32
    gelu_out = rg.BATCH * rg.OOM_BATCH_FACTOR * S * HIDDEN * 4
    assert oom.requested_bytes == gelu_out == 512 * MiB
    for key, field in (
        ("requested", "requested_bytes"),
        ("device_free", "device_free_bytes"),
        ("allocated", "allocated_bytes"),
        ("cached_free", "cached_free_bytes"),
    ):
        value, unit = msg[key]
        assert round(getattr(oom, field) / unit, 2) == value, key  # torch prints two decimals
    # not fragmentation: all cached free blocks together are smaller than the request, and the
    # device has less free memory than asked for
    assert oom.cached_free_bytes < oom.requested_bytes
    assert oom.device_free_bytes < oom.requested_bytes
    assert "fragment" not in oom.explanation
    # decided once, with the device's total from the trace: the recorder held 78,335,616,000 bytes
    # outside PyTorch with CuPy (recording.json's oom_by); the CUDA context and libraries add ~1-2 GiB
    held = int(RESULTS["oom"]["oom_by"].split("cudaMalloc of ")[1].split(" bytes")[0])
    assert oom.cause == "outside" and held <= oom.outside_bytes <= held + (2 << 30)
    # the process could not reserve more than the recorder's limit (OOM_HEADROOM x its peak)
    limit = RESULTS["oom"]["limit_bytes"]
    assert limit == int(rg.OOM_HEADROOM * RESULTS["oom"]["peak_allocated"])
    assert oom.reserved_bytes <= limit < oom.reserved_bytes + oom.requested_bytes
    # the OOM state is the snapshot's peak, reached in forward (the failed alloc is a forward
    # activation), above the peak of the normal-batch steps
    assert m.peak_phase == "forward"
    assert oom.allocated_bytes == m.peak_allocated_bytes
    assert m.peak_allocated_bytes > RESULTS["oom"]["peak_allocated"]


def test_memory_only_report_agrees(mem):
    path = GPU / "fsdp2" / "rank0.memory.pickle.gz"
    f = analyze_memory_only(path).facts
    assert f.memory is not None
    assert f.memory.peak_allocated_bytes == RESULTS["fsdp2"]["peak_allocated"]
    assert f.memory.categories == mem("fsdp2").categories


# ----------------------------------------------------------------------------------------------
# The sidecar the recordings carry
# ----------------------------------------------------------------------------------------------


# torch 2.11 keeps one FSDPState._fsdp_param_group, later releases a list _fsdp_param_groups:
# capture reads both (it read only the list when these were first recorded, leaving them empty)
@pytest.mark.parametrize("variant", FSDP2)
def test_fsdp2_sidecar_describes_the_units(variant):
    side = json.loads((GPU / variant / "fsdpdoctor_meta.json").read_text())
    assert side["fsdp_version"] == 2
    assert [u["fqn"] for u in side["units"]] == UNITS
