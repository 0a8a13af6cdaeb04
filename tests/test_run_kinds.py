"""Runs that are not FSDP (issue #41 item 6), on the real public traces in ../shared.

The run's kind (``parallelism.run_kind``), the DataLoader (``loader``, FSD033 dataloader-bound) and
Megatron's tensor-parallel all-reduces (FSD034): every figure held to an independent stdlib reading
of the raw JSON (``json`` + ``gzip``, intervals merged by hand), never the product's code.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

import fsdpdoctor
from conftest import PUBLIC_TRACES

MEGATRON = "astrasim-megatron-tp8-a100-8ranks/megatron_kineto_{}.json.gz"
VLLM = "tracelens-b200-vllm/eager_trace.json.gz"
DLRM0 = "param-dlrm-v100-8ranks/worker0_step_12.1694128201545.pt.trace.json.gz"
DDP_V100 = "hta-ddp-v100-2022/test-rank-1.json.gz"

#: what each public run is, from its PROVENANCE entry (and the raw names checked in the test)
KINDS = {
    MEGATRON.format(0): "tensor parallel (Megatron)",  # Megatron-LM GPT, TP 8
    VLLM: "tensor parallel",  # vLLM server, TP 8 (symmetric-memory all-reduces)
    DLRM0: "ddp + all-to-all model parallel (TorchRec)",  # PARAM DLRM: DDP dense + sharded embeddings
    DDP_V100: "ddp + all-to-all model parallel (TorchRec)",
    "hta-nccl-allreduce-a100-2ranks/rank-0.json.gz": "ddp",
    "tracelens-mi300-ddp/resnet_act_checkpoint.json.gz": "ddp",
    "hta-cpu-only-gloo-300ranks/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz": "ddp",
    "hta-mtia-artemis-2024-2026/mtia_inference_rank_0.json.gz": "inference",
    "tracelens-mi300x-xdit-flux-graphs/profile_trace_rank_0.json.gz": "inference",
}
LOADER_RX = re.compile(r"enumerate\(DataLoader\)#(_\w+DataLoaderIter)\.__next__")
MEGATRON_TP = ("_ReduceFromModelParallelRegion", "LinearWithGradAccumulationAndAsyncCommunication")


def _path(rel: str) -> Path:
    p = PUBLIC_TRACES / rel
    if not p.exists():
        pytest.skip(f"../shared/traces/public/{rel} is absent")
    return p


@pytest.fixture(scope="session")
def public():
    """rel path → (Report, raw events): each analysed and read once per session."""
    cache: dict[str, tuple] = {}

    def get(rel: str):
        if rel not in cache:
            p = _path(rel)
            with gzip.open(p, "rt") if p.suffix == ".gz" else open(p) as fh:
                raw = json.load(fh)
            cache[rel] = (fsdpdoctor.analyze(p), raw.get("traceEvents", []))
        return cache[rel]

    return get


# --- an independent reading -----------------------------------------------------------------


def _merge(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(a, b) -> float:
    """|a ∩ b| of two merged interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def _x(ev, cats):
    return [e for e in ev if e.get("ph") == "X" and e.get("cat") in cats]


def _steps(ev):
    return sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in _x(ev, ("user_annotation",))
        if str(e.get("name", "")).startswith("ProfilerStep#")
    )


def _loader(ev):
    """(CPU ms per step, GPU-idle ms per step, iterator names) of the loader's ranges inside steps."""
    steps = _steps(ev)
    gpu = _merge(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in _x(ev, ("kernel", "gpu_memcpy", "gpu_memset"))
    )
    ranges = [e for e in _x(ev, ("user_annotation", "cpu_op")) if LOADER_RX.fullmatch(str(e.get("name", "")))]
    cpu = idle = 0.0
    iters = set()
    for a, b in steps:
        inside = _merge((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ranges if a <= float(e["ts"]) < b)
        iters |= {LOADER_RX.fullmatch(e["name"]).group(1) for e in ranges if a <= float(e["ts"]) < b}
        span = sum(y - x for x, y in inside)
        cpu += span
        idle += span - _overlap(inside, gpu)
    return cpu / 1e3 / len(steps), idle / 1e3 / len(steps), iters


# --- the run's kind ---------------------------------------------------------------------------


@pytest.mark.parametrize("rel", sorted(KINDS))
def test_the_runs_kind_is_named(rel, public):
    rep, ev = public(rel)
    names = {str(e.get("name", "")) for e in ev}
    kind = rep.facts.parallelism.run_kind
    assert kind == KINDS[rel], (rel, kind, rep.facts.parallelism.run_kind_evidence)
    # what the kind rests on is in the raw trace
    if kind.startswith("ddp"):
        assert any(n.startswith("DistributedDataParallel.") for n in names)
    if kind == "tensor parallel (Megatron)":
        assert set(MEGATRON_TP) <= names
    if kind in ("inference",) or kind.startswith("tensor parallel"):
        assert not any("backward" in n.lower() and "autograd" in n.lower() for n in names)
        assert not any(n.startswith("Optimizer.step#") for n in names)
    # FSDP not detected stays an info note, and names the kind
    fsd001 = [f for f in rep.findings if f.code == "FSD001"]
    assert fsd001 and fsd001[0].severity == "info" and kind in fsd001[0].summary
    assert all("DDP-like" not in f.summary for f in rep.findings) or kind == "data parallel (all-reduce)"


def test_vllm_tensor_parallel_is_not_ddp_like(public):
    rep, ev = public(VLLM)
    cpu = [e for e in _x(ev, ("cpu_op",)) if e.get("name") == "symm_mem::multimem_all_reduce_"]
    ev_text = rep.facts.parallelism.run_kind_evidence
    assert f"{len(cpu):g} all-reduces per step inside forward (symm_mem::multimem_all_reduce_)" in ev_text
    assert not rep.facts.parallelism.data_parallel and rep.facts.parallelism.tensor_parallel
    assert rep.facts.workload == "inference"


# --- Megatron tensor parallel ------------------------------------------------------------------


def test_megatron_tp_all_reduces_on_the_critical_path(public):
    rep, ev = public(MEGATRON.format(0))
    kern = _x(ev, ("kernel",))
    comm = _merge((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kern if "AllReduce" in e["name"])
    compute = _merge((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kern if "AllReduce" not in e["name"])
    exposed_ms = (sum(b - a for a, b in comm) - _overlap(comm, compute)) / 1e3
    n_ar = sum(1 for e in _x(ev, ("user_annotation", "cpu_op")) if e.get("name") == "nccl:all_reduce")
    slugs = [f.slug for f in rep.findings]
    assert "tensor-parallel-on-critical-path" in slugs and "low-overlap" not in slugs
    f = next(f for f in rep.findings if f.slug == "tensor-parallel-on-critical-path")
    got = rep.facts.exposed_comm.by_phase_kind["forward"]["all_reduce"]
    assert got == pytest.approx(exposed_ms, rel=0.02)
    assert f"{got:.2f} ms per step" in f.summary and "critical path by design" in f.summary
    assert any(f"{n_ar:g} all-reduces per step" in e for e in f.evidence)  # 85 on rank 0
    assert "--sequence-parallel --tp-comm-overlap" in f.fix["any"] and "inside one node" in f.fix["any"]
    assert f.est_saving_ms is None  # not estimated: said so in the docs


# --- the DataLoader ------------------------------------------------------------------------------


@pytest.mark.parametrize("rel", [DLRM0, DDP_V100, MEGATRON.format(6)])
def test_loader_time_and_gpu_idle_per_step(rel, public):
    rep, ev = public(rel)
    cpu_ms, idle_ms, iters = _loader(ev)
    ld = rep.facts.loader
    assert ld is not None and ld.iterator in iters
    assert ld.ms_per_step == pytest.approx(cpu_ms, rel=0.02, abs=1e-3)
    assert ld.gpu_idle_ms_per_step == pytest.approx(idle_ms, rel=0.02, abs=1e-3)


def test_dataloader_bound_on_the_dlrm_run(public):
    """PARAM DLRM loads in the training process (num_workers=0): the GPU waits for the batch."""
    rep, ev = public(DLRM0)
    _cpu, idle_ms, iters = _loader(ev)
    assert iters == {"_SingleProcessDataLoaderIter"}
    f = next(f for f in rep.findings if f.slug == "dataloader-bound")
    assert f.est_saving_ms == pytest.approx(idle_ms, rel=0.02)
    assert "num_workers=0" in " ".join(f.evidence)
    for knob in ("num_workers=", "pin_memory=True", "persistent_workers=True", "prefetch_factor="):
        assert knob in f.fix["any"]


def test_no_loader_no_finding(public):
    rep, ev = public(VLLM)
    assert not any(LOADER_RX.fullmatch(str(e.get("name", ""))) for e in ev)
    assert rep.facts.loader is None and "dataloader-bound" not in {f.slug for f in rep.findings}
