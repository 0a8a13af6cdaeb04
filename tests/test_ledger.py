"""The input ledger (#41 items 1-3): every event counted by phase and category, what the analysis
read; the 2021 capitalised schema read as today's; communication outside NCCL named by library.

Real inputs are read from ../shared (skipped without it); ground truth is an independent stdlib
reading of the raw JSON, or the generator's own numbers for the DeepEP / NVSHMEM traces (no public
file has them), whose events copy a real kernel event's fields (the public HTA A100 trace) with
another name.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest

import fsdpdoctor
from _suitepub_cache import raw, report, stdlib_reading
from conftest import PUBLIC_TRACES

OLD = PUBLIC_TRACES / "kineto-tbplugin-2021-computeproperties" / "gpu_metrics_input.json"
MTIA = PUBLIC_TRACES / "hta-mtia-artemis-2024-2026" / "mtia_rank_0.json.gz"
CUPTI = PUBLIC_TRACES / "hta-cupti-counters-alexnet-a100" / "benchmark_result_924719_1679055439_trace.json.gz"
GLOO = PUBLIC_TRACES / "hta-cpu-only-gloo-300ranks" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"


def _need(p: Path) -> None:
    if not p.exists():
        pytest.skip(f"../shared/traces/public: {p.parent.name} is absent")


@stdlib_reading(OLD, MTIA, CUPTI, GLOO)
def _read(doc) -> dict:
    """What the tests below count in the raw JSON (plain Python, none of fsdpdoctor), in the one
    stdlib pass over each file the session makes (``_suitepub_cache.raw``)."""
    ev = doc["traceEvents"]
    kernels = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "Kernel"]
    gloo = [e for e in ev if e.get("name") == "gloo:all_reduce"]
    return {
        "events": len(ev),
        "by_kind": Counter((e.get("ph", ""), e.get("cat") or "") for e in ev),
        "x_by_cat": Counter(e.get("cat") for e in ev if e.get("ph") == "X"),
        "Kernel": (len(kernels), sum(e["dur"] for e in kernels)),
        "Operator steps": sum(
            1 for e in ev if e.get("cat") == "Operator" and e.get("name", "").startswith("ProfilerStep#")
        ),
        "steps": sum(1 for e in ev if e.get("name", "").startswith("ProfilerStep#")),
        "gloo:all_reduce": (len(gloo), sum(e["dur"] for e in gloo)),
        "device": [d.get("name") for d in doc.get("computeProperties", [])],
    }


def _report(p: Path):
    """``fsdpdoctor.analyze(p)``, once per session (shared with the other modules that read it)."""
    return report(p)


def _ticket(rep) -> str:
    from fsdpdoctor.report.sections import headline, ticket_headline

    return "\n".join(f"{k}: {v}" for k, v in [*headline(rep.facts), *ticket_headline(rep.facts)])


# ------------------------------------------------------------------------------------------
# the ledger counts every event of the file
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [OLD, MTIA, CUPTI, GLOO], ids=lambda p: p.parent.name)
def test_ledger_counts_every_event_by_phase_and_category(path):
    _need(path)
    r = raw(path, _read)
    want = r["by_kind"]
    led = _report(path).facts.inputs[0].ledger
    assert led.events == r["events"]
    got = Counter()
    for r in led.rows:
        got[r.ph, r.cat] += r.events
    assert got == want


def test_2021_capitalised_categories_read_as_today():
    """torch 1.9's Kernel / Memcpy / Runtime / Operator (ProfilerStep#2 under Operator) and
    computeProperties: kernels, the step and the GPU are read (main: "no GPU activity")."""
    _need(OLD)
    r = raw(OLD, _read)
    kernels, kernel_us = r["Kernel"]
    rep = _report(OLD)
    f = rep.facts
    assert f.gpu_present
    assert f.steps.count == r["Operator steps"] == 1
    assert rep.facts.rank_facts[0].device_name == r["device"][0]
    led = f.inputs[0].ledger
    row = next(r for r in led.rows if r.cat == "Kernel")
    assert (row.read_as, row.events, row.used) == ("kernel", kernels, kernels)
    assert row.dur_ms == pytest.approx(kernel_us / 1e3, rel=1e-6)
    assert led.warning is None and led.unread_notable == 0
    assert "no GPU activity" not in _ticket(rep)


@pytest.mark.parametrize(
    ("path", "cat"), [(MTIA, "mtia_ccp_events"), (CUPTI, "cuda_profiler_range")], ids=["mtia", "cupti"]
)
def test_unread_device_work_is_a_headline_warning_not_no_gpu_activity(path, cat):
    _need(path)
    n = raw(path, _read)["x_by_cat"][cat]
    rep = _report(path)
    led = rep.facts.inputs[0].ledger
    assert led.device_events == n > 0
    assert f"{n:,} {cat}" in (led.warning or "")
    text = _ticket(rep)
    assert "Not read" in text and cat in text
    assert "no GPU activity" not in text


def test_cpu_only_gloo_trace_reads_every_step_and_collective():
    """300-rank gloo rank: 'no GPU activity' (it has none), 5 steps, the 10 gloo:all_reduce as
    communication by gloo, timed by their spans (stdlib: the annotations' durations)."""
    _need(GLOO)
    r = raw(GLOO, _read)
    steps = r["steps"]
    spans, spans_us = r["gloo:all_reduce"]
    rep = _report(GLOO)
    f = rep.facts
    assert not f.gpu_present and f.inputs[0].ledger.device_events == 0
    assert "no GPU activity" in _ticket(rep)
    assert f.steps.count == steps == 5
    (ar,) = f.collectives
    assert ar.kind == "all_reduce" and ar.count_per_step == spans / steps == 2
    assert ar.libraries == {"gloo": 2.0}
    truth = spans_us / 1e3 / steps
    assert ar.cpu_comm_ms_per_step == pytest.approx(truth, rel=0.02)
    assert "single process" not in json.dumps([x.summary for x in rep.findings])


# ------------------------------------------------------------------------------------------
# generated traces: DeepEP and NVSHMEM kernels in the real schema, field for field
# ------------------------------------------------------------------------------------------

# copied from the public HTA A100 trace (hta-nccl-allreduce-a100-2ranks/rank-0.json.gz)
REAL_KERNEL = {
    "ph": "X",
    "cat": "kernel",
    "name": "void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 32, true, 1>(float, float, float, float, "
    "cudnnTensorStruct, float const*, cudnnTensorStruct, float const*, cudnnTensorStruct, float*, float const*, "
    "float*, float*, float const*, float const*, float)",
    "pid": 0,
    "tid": 7,
    "ts": 4458676983543.183,
    "dur": 41.407,
    "args": {
        "External id": 12353,
        "queued": 0,
        "device": 0,
        "context": 1,
        "stream": 7,
        "correlation": 57541,
        "registers per thread": 40,
        "shared memory": 400,
        "blocks per SM": 4.740741,
        "warps per SM": 75.851852,
        "grid": [512, 1, 1],
        "block": [512, 1, 1],
        "est. achieved occupancy %": 75,
    },
}
REAL_LAUNCH = {
    "ph": "X",
    "cat": "cuda_runtime",
    "name": "cudaLaunchKernel",
    "pid": 2910249,
    "tid": 2919752,
    "ts": 4458676983526.767,
    "dur": 15.633,
    "args": {"External id": 12353, "cbid": 211, "correlation": 57541},
}
REAL_OP = {
    "ph": "X",
    "cat": "cpu_op",
    "name": "aten::mm",
    "pid": 2910249,
    "tid": 2919752,
    "ts": 4458676523516.223,
    "dur": 97.58,
    "args": {"External id": 2071, "Record function id": 1931, "Ev Idx": 22},
}
REAL_STEP = {
    "ph": "X",
    "cat": "user_annotation",
    "name": "ProfilerStep#4",
    "pid": 2910249,
    "tid": 2910249,
    "ts": 4458676416788.066,
    "dur": 222442.191,
    "args": {"External id": 1, "Record function id": 1, "Ev Idx": 7200},
}
REAL_DEVICE = {
    "id": 0,
    "name": "NVIDIA A100-PG509-200",
    "totalGlobalMem": 42297524224,
    "computeMajor": 8,
    "computeMinor": 0,
    "maxThreadsPerBlock": 1024,
    "maxThreadsPerMultiprocessor": 2048,
    "regsPerBlock": 65536,
    "warpSize": 32,
    "sharedMemPerBlock": 49152,
    "numSms": 108,
    "regsPerMultiprocessor": 65536,
    "sharedMemPerBlockOptin": 166912,
    "sharedMemPerMultiprocessor": 167936,
}

T0 = 4458676416788.066
STEP_US = 10_000.0
# compute kernels of a step: [100 + 1000 i, 900 + 1000 i], i = 0..8, on stream 7
COMPUTE = [(100.0 + 1000 * i, 800.0) for i in range(9)]


def _gen(path: Path, comm: list[tuple[str, float, float]], grid: int, world: int = 64) -> None:
    """Two ProfilerSteps; per step the compute kernels above and ``comm`` = (name, start, dur)
    kernels on stream 20 with a launch grid of ``grid`` blocks; each kernel with its launch and
    CPU op, fields copied from the real events."""
    ev: list[dict] = []
    ext = corr = 100

    def kernel(name, ts, dur, stream, blocks, op):
        nonlocal ext, corr
        ext += 1
        corr += 1
        o = copy.deepcopy(REAL_OP)
        o.update(name=op, ts=ts - 30, dur=20.0)
        o["args"]["External id"] = ext
        la = copy.deepcopy(REAL_LAUNCH)
        la.update(ts=ts - 25, dur=10.0)
        la["args"].update({"External id": ext, "correlation": corr})
        k = copy.deepcopy(REAL_KERNEL)
        k.update(name=name, ts=ts, dur=dur, tid=stream)
        k["args"].update({"External id": ext, "correlation": corr, "stream": stream, "grid": [blocks, 1, 1]})
        ev.extend([o, la, k])

    for s in range(2):
        base = T0 + s * STEP_US
        st = copy.deepcopy(REAL_STEP)
        st.update(name=f"ProfilerStep#{s}", ts=base, dur=STEP_US)
        ev.append(st)
        for a, d in COMPUTE:
            kernel(REAL_KERNEL["name"], base + a, d, 7, 512, "aten::mm")
        for name, a, d in comm:
            kernel(name, base + a, d, 20, grid, "aten::empty")
    dev = dict(REAL_DEVICE, name="NVIDIA H800", numSms=132)
    doc = {
        "schemaVersion": 1,
        "deviceProperties": [dev],
        "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": world},
        "traceEvents": sorted(ev, key=lambda e: e["ts"]),
        "traceName": str(path),
    }
    path.write_text(json.dumps(doc))


def _exposed(comm: list[tuple[str, float, float]]) -> float:
    """µs of the comm kernels not covered by compute (the generator's truth, per step)."""
    out = 0.0
    for _n, a, d in comm:
        t, end = a, a + d
        for c0, cd in COMPUTE:
            lo, hi = max(t, c0), min(end, c0 + cd)
            if hi > lo:
                out -= hi - lo
        out += d
    return out


DEEPEP = [
    ("void dpsk::ep::internode::cached_notify<8>(int, int, int*, int, int*, void**, int, int, bool)", 300.0, 100.0),
    ("void dpsk::ep::internode::dispatch<false, 8, 3, 20>(int4*, float*, int*, long*, float*, int*)", 500.0, 2000.0),
    (
        "void dpsk::ep::internode::combine<__nv_bfloat16, 8, 3, 20>(int4*, float*, int4 const*, float const*)",
        9000.0,
        800.0,
    ),
]
NVSHMEM = [
    (
        "void nvshmemi_alltoall_threadgroup_kernel<float, 1>(nvshmem_team_t, float*, float const*, unsigned long)",
        2500.0,
        1000.0,
    )
]


@pytest.mark.parametrize(
    ("comm", "grid", "library", "kind"),
    [(DEEPEP, 20, "DeepEP", "all_to_all"), (NVSHMEM, 8, "NVSHMEM", "all_to_all")],
    ids=["deepep", "nvshmem"],
)
def test_communication_outside_nccl_is_communication_named_by_library(tmp_path, comm, grid, library, kind):
    p = tmp_path / "rank0.json"
    _gen(p, comm, grid)
    rep = fsdpdoctor.analyze(str(p))
    f = rep.facts
    (c,) = [c for c in f.collectives if c.kind == kind]
    assert c.count_per_step == len(comm)
    assert c.libraries == {library: float(len(comm))}
    assert c.gpu_ms_per_step == pytest.approx(sum(d for _n, _a, d in comm) / 1e3, rel=0.02)
    assert c.exposed_ms_per_step == pytest.approx(_exposed(comm) / 1e3, rel=0.02)
    assert c.sms == grid
    from fsdpdoctor.report.sections import collectives_table

    assert collectives_table(f).rows[0][0] == f"{kind.replace('_', '-')} ({library}, {grid} SMs)"
    # the run's world size, never "single process"
    text = _ticket(rep) + json.dumps([(x.summary, x.evidence) for x in rep.findings])
    assert "single process" not in text
    assert "of 64" in text
    assert f.inputs[0].ledger.warning is None


def test_no_collectives_on_a_rank_of_a_larger_world_is_not_single_process(tmp_path):
    p = tmp_path / "rank0.json"
    _gen(p, [], 1)
    rep = fsdpdoctor.analyze(str(p))
    text = json.dumps([(x.summary, x.evidence) for x in rep.findings])
    assert "single process" not in text and "world size 64" in text
