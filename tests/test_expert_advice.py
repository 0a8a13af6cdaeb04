"""Advice an expert would sign on other people's traces (issue #36): each item checked on the
public trace that showed it, against what the raw trace says (plain json), not the tool's output.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path


import fsdpdoctor


def _events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        doc = json.load(fh)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _finding(rep, slug):
    return next((f for f in rep.findings if f.slug == slug), None)


def test_ddp_overlap_advice_follows_the_measured_buckets_dtypes_and_bandwidth(shared_traces):
    """Item 2. MI300 DDP: the whole gradient is 2 bf16 all-reduces of ~11 MiB at ~2.5 GB/s: no
    bigger buckets (one would overlap nothing), no bf16 hook (already bf16); the link / the wait
    is what the fix looks at. A100 2 ranks: fp32 gradients: the bf16 hook is offered, not buckets."""
    mi300 = shared_traces / "tracelens-mi300-ddp" / "resnet_act_checkpoint.json.gz"
    # the trace's own record of the all-reduces: their op, element count and dtype per call
    ar = [
        e
        for e in _events(mi300)
        if e.get("name") == "record_param_comms"
        and "allreduce" in str((e.get("args") or {}).get("Collective name", "")).lower()
    ]
    assert ar and {str(e["args"].get("dtype")) for e in ar} == {"BFloat16"}
    f = _finding(fsdpdoctor.analyze(mi300), "low-overlap")
    code = "\n".join(f.fix.values())
    assert "bucket_cap_mb" not in code and "bf16_compress_hook" not in code
    assert "all_reduce_perf" in code and any("already reduced in BFloat16" in e for e in f.evidence)
    assert any(re.search(r"2 bucket\(s\) per step, 22\.\d MiB", e) for e in f.evidence)
    a100 = shared_traces / "hta-nccl-allreduce-a100-2ranks"
    f = _finding(fsdpdoctor.analyze(a100), "low-overlap")
    code = "\n".join(f.fix.values())
    assert "bf16_compress_hook" in code and "bucket_cap_mb" not in code


def test_straggler_that_arrives_late_is_named_and_not_shown_as_fastest(shared_traces):
    """Item 3. DLRM, 8 ranks: rank 7 reaches the first forward all-to-all last by ~7.6 ms, its GPU
    computes like the others; it is the straggler (a finding, the per-rank table says so), and
    TorchRec's pipeline is not recommended to a run whose trace shows it in use."""
    d = shared_traces / "param-dlrm-v100-8ranks"
    files = sorted(d.glob("*.json.gz"))
    # the raw trace: when each rank's first all-to-all (NCCL's SendRecv kernel) starts, on the
    # synchronized clocks of the job's hosts
    starts = {}
    for p in files:
        rank = int(re.search(r"worker(\d+)", p.name).group(1))
        k = [e for e in _events(p) if e.get("cat") == "kernel" and e.get("name", "").startswith("ncclKernel_SendRecv")]
        starts[rank] = min(float(e["ts"]) for e in k)
    last = max(starts, key=starts.get)
    assert last == 7 and (starts[7] - min(starts.values())) / 1e3 > 5.0
    assert any("## wait_sparse_data_dist ##" == e.get("name") for e in _events(files[0]))
    rep = fsdpdoctor.analyze(d)
    f = _finding(rep, "straggler-rank")
    assert f is not None and f.where["rank"] == 7 and f.saving_basis == "heuristic"
    assert "own trace its step is the shortest" in " ".join(f.evidence)
    table = rep.to_markdown()
    assert re.search(r"\| 7 \|[^\n]*straggler", table)
    lo = _finding(rep, "low-overlap")
    assert lo is None or all("TrainPipelineSparseDist(" not in code for code in lo.fix.values())


def test_wording_says_what_the_trace_shows(shared_traces):
    """Item 11: AMD's matrix cores are not "tensor cores"; a world-size-1 run with no all-gather
    claims no "low-precision all-gathers"; no "Memory at the peak" heading without its table;
    "1 step", not "1 steps"."""
    mi300 = fsdpdoctor.analyze(shared_traces / "tracelens-mi300-ddp").to_markdown()
    assert "matrix cores" in mi300 and "tensor cores" not in mi300
    rec = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
    raw = _events(rec / "gpu" / "fsdp2-bf16" / "rank0.json.gz")
    assert not any("all_gather" in str((e.get("args") or {}).get("Collective name", "")) for e in raw)
    md = fsdpdoctor.analyze(rec / "gpu" / "fsdp2-bf16").to_markdown()
    assert "all-gathers" not in md.split("## ")[0]  # the headline
    df = fsdpdoctor.analyze(shared_traces / "hta-df-index-v100").to_markdown()
    assert "Memory at the peak" not in df
    from fsdpdoctor.fmt import plural

    assert (plural(1, "unit"), plural(5, "unit"), plural(1, "step")) == ("1 unit", "5 units", "1 step")
    assert (plural(1, "host copy", "host copies"), plural(24, "host copy", "host copies")) == (
        "1 host copy",
        "24 host copies",
    )


def _recomputed(path: Path) -> set[str]:
    """Names of the forward ops (aten::conv2d, aten::linear, aten::batch_norm) that run inside an
    autograd backward node (``autograd::engine::evaluate_function: …``) on the same thread."""
    ev = [e for e in _events(path) if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    nodes: dict = {}
    for e in ev:
        if e["name"].startswith("autograd::engine::evaluate_function"):
            nodes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    out = set()
    for e in ev:
        if e["name"] in ("aten::conv2d", "aten::linear", "aten::batch_norm"):
            if any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in nodes.get(e["tid"], ())):
                out.add(e["name"])
    return out


def test_selective_checkpointing_keeps_what_the_model_runs(shared_traces):
    """FSD019's selective-checkpointing policy keeps the expensive ops the recompute re-runs: a
    CNN's convolutions (the public MI300 ResNet re-runs conv2d and batch_norm inside backward
    nodes, its one linear layer not), a transformer's matmuls (the H100 fsdp2-ac recording)."""
    path = shared_traces / "tracelens-mi300-ddp" / "resnet_act_checkpoint.json.gz"
    assert _recomputed(path) == {"aten::conv2d", "aten::batch_norm"}
    cnn = next(f for f in fsdpdoctor.analyze(path).findings if f.slug == "activation-recompute")
    code = "\n".join(cnn.fix.values())
    assert "torch.ops.aten.convolution.default" in code and "aten.mm" not in code
    rec = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu" / "fsdp2-ac" / "rank0.json.gz"
    assert "aten::linear" in _recomputed(rec)
    tf = next(f for f in fsdpdoctor.analyze(rec.parent).findings if f.slug == "activation-recompute")
    code = "\n".join(tf.fix.values())
    assert "torch.ops.aten.mm.default" in code and "convolution" not in code
