"""Runs that are not FSDP (issue #41 item 6), on the real public traces in ../shared.

The run's kind (``parallelism.run_kind``, the one classifier every reader uses) of every public
trace and every recording, held to its PROVENANCE entry or recording script in one table
(``RUN_KINDS_TABLE``) and to what the raw names show; the DataLoader (``loader``, FSD033
dataloader-bound) and Megatron's tensor-parallel all-reduces (FSD034): every figure held to an
independent stdlib reading of the raw JSON (``json`` + ``gzip``, intervals merged by hand), never
the product's code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _suitepub_cache import rank_facts, raw, read_rank, report, stdlib_reading
from conftest import PUBLIC_TRACES
from fsdpdoctor.facts import RUN_KINDS

MEGATRON = "astrasim-megatron-tp8-a100-8ranks/megatron_kineto_{}.json.gz"
VLLM = "tracelens-b200-vllm/eager_trace.json.gz"
DLRM0 = "param-dlrm-v100-8ranks/worker0_step_12.1694128201545.pt.trace.json.gz"
DDP_V100 = "hta-ddp-v100-2022/test-rank-1.json.gz"

#: Every public trace (../shared/traces/public) and every recording (fixtures/recorded, rank 0), the
#: kind the tool must name, and the independent statement it is held to: the folder's PROVENANCE.md
#: entry or the recording's README / recording script. tests/test_run_kinds.py::test_every_input_is_named
#: reads each raw trace with the standard library too, and checks what the kind rests on is there.
P, R = "public", "recorded"
RUN_KINDS_TABLE = [
    *[
        (P, MEGATRON.format(i), "tensor parallel (Megatron)", "Megatron-LM GPT, tensor parallel 8, 8 ranks")
        for i in range(8)
    ],
    (
        P,
        "hta-cpu-only-gloo-300ranks/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz",
        "ddp",
        "CPU-only training job, rank 34 of 300, gloo, 10 gloo:all_reduce",
    ),
    (
        P,
        "hta-cupti-counters-alexnet-a100/benchmark_result_924719_1679055439_trace.json.gz",
        "inference",
        "PARAM AlexNet forward benchmark on one A100",
    ),
    (
        P,
        "hta-ddp-v100-2022/control-rank-3.json.gz",
        "ddp + all-to-all model parallel (TorchRec)",
        "HTA trace_diff: AllReduce + SendRecv (all-to-all), A100 rank 3 of 8",
    ),
    (
        P,
        DDP_V100,
        "ddp + all-to-all model parallel (TorchRec)",
        "HTA trace_diff: AllReduce + SendRecv, V100 rank 1 of 2",
    ),
    (
        P,
        "hta-df-index-v100/rank-1.json.gz",
        "data parallel (all-reduce)",
        "V100, rank 1 of 2, 2020 AllReduce kernels (training, no DDP wrapper labels)",
    ),
    (P, "hta-mtia-artemis-2024-2026/mtia_inference_rank_0.json.gz", "inference", "MTIA feed-ranking inference server"),
    (
        P,
        "hta-mtia-artemis-2024-2026/mtia_rank_0.json.gz",
        "ddp + all-to-all model parallel (TorchRec)",
        "MTIA training, hccl:all_reduce + all-to-all of a recommendation model",
    ),
    (P, "hta-nccl-allreduce-a100-2ranks/rank-0.json.gz", "ddp", "A100, 2 ranks, AllReduce + Broadcast"),
    *[
        (
            P,
            f"hta-sampled-128ranks/sampled_rank-{i}.json.gz",
            "ddp + all-to-all model parallel (TorchRec)",
            "trimmed traces of a 128-rank TorchRec job",
        )
        for i in (0, 1)
    ],
    (
        P,
        "hta-sendrecv-a100-16ranks/rank-0.json.gz",
        "ddp + all-to-all model parallel (TorchRec)",
        "A100-80GB, rank 0 of 16, SendRecv (all-to-all) on three streams",
    ),
    (
        P,
        "hta-v100-ns-resolution-2024/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
        "ddp",
        "ResNet integration test on one V100, 25 nccl:all_reduce + 10 broadcast",
    ),
    (
        P,
        "kineto-tbplugin-2021-computeproperties/gpu_metrics_input.json",
        "single-gpu training",
        "TensorBoard-plugin test input, one V100, one training step",
    ),
    *[
        (
            P,
            f"param-dlrm-v100-8ranks/{name}",
            "ddp + all-to-all model parallel (TorchRec)",
            "8 ranks of DLRM on V100, all-to-all + AllReduce",
        )
        for name in (
            "worker0_step_12.1694128201545.pt.trace.json.gz",
            "worker1_step_12.1694128201556.pt.trace.json.gz",
            "worker2_step_12.1694128201554.pt.trace.json.gz",
            "worker3_step_12.1694128201557.pt.trace.json.gz",
            "worker4_step_12.1694128201547.pt.trace.json.gz",
            "worker5_step_12.1694128201549.pt.trace.json.gz",
            "worker6_step_12.1694128201553.pt.trace.json.gz",
            "worker7_step_12.1694128201553.pt.trace.json.gz",
        )
    ],
    (P, VLLM, "tensor parallel", "vLLM inference on 8x B200 (tensor parallel 8)"),
    (P, "tracelens-mi300-ddp/resnet_act_checkpoint.json.gz", "ddp", "DDP on 8x MI300X"),
    *[
        (
            P,
            f"tracelens-mi300x-xdit-flux-graphs/{name}_trace_rank_0.json.gz",
            "inference",
            "xDiT Flux.1-dev diffusion inference on one MI300X",
        )
        for name in ("capture", "profile")
    ],
    # fixtures/recorded/README.md (record_cpu.py: 2 gloo processes)
    *[
        (R, f"{v}/rank0.json.gz", "fsdp2", f"record_cpu.py `{v}`: fully_shard")
        for v in ("per-block", "root-only", "per-linear", "no-backward-prefetch", "no-reshard", "bf16-mp")
    ],
    (R, "ddp/rank0.json.gz", "ddp", "record_cpu.py `ddp`: DistributedDataParallel(model)"),
    (R, "fsdp1/rank0.json.gz", "fsdp1", "record_cpu.py `fsdp1`: FullyShardedDataParallel(model, ...)"),
    (
        R,
        "torchtitan-cpu-debugmodel/profiling/traces/iteration_4/rank0_trace.json.gz",
        "fsdp2",
        "torchtitan llama3 debugmodel, FSDP2 over data_parallel_shard_degree=2",
    ),
    # fixtures/recorded/gpu/README.md and gpu-h200/README.md (record_gpu.py, one GPU)
    *[
        (R, f"gpu/{v}/rank0.json.gz", "fsdp2", f"record_gpu.py `{v}`: fully_shard")
        for v in ("fsdp2", "fsdp2-bf16", "fsdp2-ac", "fsdp2-offload", "fsdp2-offload-pageable", "oom")
    ],
    (R, "gpu/fsdp1/rank0.json.gz", "fsdp1", "record_gpu.py `fsdp1`: FullyShardedDataParallel"),
    (R, "gpu/ddp/rank0.json.gz", "ddp", "record_gpu.py `ddp`: DistributedDataParallel(device_ids=[0])"),
    (
        R,
        "gpu/inference/rank0.json.gz",
        "inference",
        "record_gpu.py `inference`: the bare model, eval(), inference_mode, forward only",
    ),
    *[
        (R, f"gpu-h200/{v}/rank0.json.gz", "fsdp2", f"record_gpu.py `{v}` on the H200: fully_shard")
        for v in ("fsdp2", "fsdp2-bf16", "fsdp2-tf32", "gpt2-bf16", "gpt2-bf16-b96", "gpt2-bf16-b96-ac")
    ],
    # fixtures/recorded/gpu-h200-levers/README.md (record_gpu_levers.py, one GPU)
    *[
        (R, f"gpu-h200-levers/{v}/rank0.json.gz", "fsdp2", f"record_gpu_levers.py `{v}` on the H200: fully_shard")
        for v in (
            "llama-bf16",
            "llama-bf16-fused",
            "llama-bf16-pairs",
            "llama-bf16-compile",
            "llama-tf32",
            "llama-bf16-b16",
            "llama-bf16-b64",
            "llama-bf16-b64-fused",
            "llama-bf16-b64-pairs",
            "llama-bf16-b64-compile",
            "llama-fp32-b64",
            "llama-tf32-b64",
        )
    ],
]
#: the public runs that are not FSDP, analysed whole for their FSD001 ticket
KINDS = {
    rel: kind
    for _, rel, kind, _ in RUN_KINDS_TABLE
    if rel
    in (
        MEGATRON.format(0),
        VLLM,
        DLRM0,
        DDP_V100,
        "hta-nccl-allreduce-a100-2ranks/rank-0.json.gz",
        "tracelens-mi300-ddp/resnet_act_checkpoint.json.gz",
        "hta-cpu-only-gloo-300ranks/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz",
        "hta-mtia-artemis-2024-2026/mtia_inference_rank_0.json.gz",
        "tracelens-mi300x-xdit-flux-graphs/profile_trace_rank_0.json.gz",
    )
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
    """rel path → (Report, what the tests read in the raw events: :func:`_read`): each analysed
    and read once per session (``_suitepub_cache``), shared with the other modules."""

    def get(rel: str):
        p = _path(rel)
        return report(p), raw(p, _read)

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


#: the public runs the tests below analyse whole and read raw (:func:`_read`)
READ = sorted({*KINDS, MEGATRON.format(6)})


@stdlib_reading(*(PUBLIC_TRACES / rel for rel in READ))
def _read(doc) -> dict:
    """What the tests below read in a raw trace, plain Python over its JSON (json + gzip, intervals
    merged by hand), in the one stdlib pass over the file the session makes."""
    ev = doc.get("traceEvents", [])
    kern = _x(ev, ("kernel",))
    comm = _merge((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kern if "AllReduce" in e["name"])
    compute = _merge((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kern if "AllReduce" not in e["name"])
    return {
        "names": {str(e.get("name", "")) for e in ev},
        "symm_mem cpu_ops": sum(1 for e in _x(ev, ("cpu_op",)) if e.get("name") == "symm_mem::multimem_all_reduce_"),
        "tp exposed ms, nccl:all_reduce": (
            (sum(b - a for a, b in comm) - _overlap(comm, compute)) / 1e3,
            sum(1 for e in _x(ev, ("user_annotation", "cpu_op")) if e.get("name") == "nccl:all_reduce"),
        ),
        "loader": _loader(ev) if _steps(ev) else None,  # per step: only for runs with ProfilerStep spans
    }


# --- the run's kind ---------------------------------------------------------------------------


RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
COLLECTIVE_RX = re.compile(r"^(?:nccl|rccl|hccl|gloo)[:K]|^c10d::", re.I)
ALL_TO_ALL_RX = re.compile(r"all_?to_?all", re.I)
ALL_REDUCE_RX = re.compile(r"all_?reduce", re.I)


def _raw_names(p: Path) -> tuple[set[str], set]:
    """Every event name, and the devices (pids) GPU kernels ran on: json + gzip only (in the one
    stdlib pass over the file the session makes, ``_suitepub_cache.raw``)."""
    return raw(p, _names_of)


@stdlib_reading(PUBLIC_TRACES, *(RECORDED / rel for root, rel, *_rest in RUN_KINDS_TABLE if root == R))
def _names_of(doc) -> tuple[set[str], set]:
    ev = doc["traceEvents"] if isinstance(doc, dict) else doc
    names = {str(e.get("name", "")) for e in ev}
    devices = {e.get("pid") for e in ev if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"}
    return names, devices


def _rests_on(kind: str, names: set[str], devices: set) -> bool:
    """What the raw trace must hold for ``kind`` to be right, read without the product's code."""
    ddp = any(n.startswith("DistributedDataParallel.") for n in names)
    a2a = any(ALL_TO_ALL_RX.search(n) for n in names)
    ar = any(ALL_REDUCE_RX.search(n) for n in names)
    train = any("backward" in n.lower() for n in names) or any(n.startswith("Optimizer.step#") for n in names)
    return {
        "fsdp2": any(n.startswith("FSDP::") for n in names),
        "fsdp1": any(n.startswith("FullyShardedDataParallel.") for n in names),
        "ddp": ddp and not a2a,
        "ddp + all-to-all model parallel (TorchRec)": ddp and a2a,
        "tensor parallel (Megatron)": set(MEGATRON_TP) <= names and not ddp,
        "tensor parallel": ar and not ddp and not train,
        "data parallel (all-reduce)": ar and not ddp and train,
        "inference": not train,
        "single-gpu training": train and len(devices) == 1 and not any(COLLECTIVE_RX.search(n) for n in names),
    }[kind]


def _table_id(root: str, rel: str) -> str:
    if root == R:
        return "recorded:" + rel.removesuffix("/rank0.json.gz").split("/profiling/")[0]
    folder, name = rel.split("/", 1)
    return f"public:{folder}/{name[:18]}"


@pytest.mark.parametrize("root,rel,kind,said", RUN_KINDS_TABLE, ids=[_table_id(r, p) for r, p, *_ in RUN_KINDS_TABLE])
def test_every_input_is_named(root, rel, kind, said):
    """Each public trace and recording: the kind the tool names (one rank, as analysed) is the one
    its PROVENANCE entry or recording script states (``said``), one of the vocabulary every reader
    uses, and what it rests on is in the raw trace."""
    p = _path(rel) if root == P else RECORDED / rel
    # a public file's facts from its analysis shared with the other modules (the same RankFacts)
    rf = rank_facts(p) if root == P else read_rank(p)  # _read_rank(load_trace(p), 0), shared with test_conformance
    assert kind in RUN_KINDS
    assert rf.parallelism.run_kind == kind, (rel, said, rf.parallelism.run_kind, rf.parallelism.run_kind_evidence)
    names, devices = _raw_names(p)
    assert _rests_on(kind, names, devices), (rel, kind)
    # the families the consumers ask (rules, strategy advisor) agree with the kind
    assert rf.parallelism.ddp == kind.startswith("ddp")
    assert rf.parallelism.data_parallel == (kind.startswith("ddp") or kind == "data parallel (all-reduce)")
    assert rf.parallelism.tensor_parallel == kind.startswith("tensor parallel")


def test_the_table_covers_every_input():
    """Every public trace file and every recording (its rank-0 trace) has its row: a new input
    gets its kind stated before it is trusted."""
    rows = {(root, rel) for root, rel, *_ in RUN_KINDS_TABLE}
    assert len(rows) == len(RUN_KINDS_TABLE)
    recorded = {str(p.relative_to(RECORDED)) for p in RECORDED.rglob("rank0*.json.gz")}
    assert recorded == {rel for root, rel in rows if root == R}
    if PUBLIC_TRACES.is_dir():
        public = {str(p.relative_to(PUBLIC_TRACES)) for p in PUBLIC_TRACES.glob("*/*.json*")}
        assert public == {rel for root, rel in rows if root == P}


@pytest.mark.parametrize("rel", sorted(KINDS))
def test_the_runs_kind_is_named(rel, public):
    rep, r = public(rel)
    names = r["names"]
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
    rep, r = public(VLLM)
    cpu = r["symm_mem cpu_ops"]
    ev_text = rep.facts.parallelism.run_kind_evidence
    assert f"{cpu:g} all-reduces per step inside forward (symm_mem::multimem_all_reduce_)" in ev_text
    assert not rep.facts.parallelism.data_parallel and rep.facts.parallelism.tensor_parallel
    assert rep.facts.workload == "inference"


# --- Megatron tensor parallel ------------------------------------------------------------------


def test_megatron_tp_all_reduces_on_the_critical_path(public):
    rep, r = public(MEGATRON.format(0))
    exposed_ms, n_ar = r["tp exposed ms, nccl:all_reduce"]
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
    rep, r = public(rel)
    cpu_ms, idle_ms, iters = r["loader"]
    ld = rep.facts.loader
    assert ld is not None and ld.iterator in iters
    assert ld.ms_per_step == pytest.approx(cpu_ms, rel=0.02, abs=1e-3)
    assert ld.gpu_idle_ms_per_step == pytest.approx(idle_ms, rel=0.02, abs=1e-3)


def test_dataloader_bound_on_the_dlrm_run(public):
    """PARAM DLRM loads in the training process (num_workers=0): the GPU waits for the batch."""
    rep, r = public(DLRM0)
    _cpu, idle_ms, iters = r["loader"]
    assert iters == {"_SingleProcessDataLoaderIter"}
    f = next(f for f in rep.findings if f.slug == "dataloader-bound")
    assert f.est_saving_ms == pytest.approx(idle_ms, rel=0.02)
    assert "num_workers=0" in " ".join(f.evidence)
    for knob in ("num_workers=", "pin_memory=True", "persistent_workers=True", "prefetch_factor="):
        assert knob in f.fix["any"]


def test_no_loader_no_finding(public):
    rep, r = public(VLLM)
    assert not any(LOADER_RX.fullmatch(n) for n in r["names"])
    assert rep.facts.loader is None and "dataloader-bound" not in {f.slug for f in rep.findings}
