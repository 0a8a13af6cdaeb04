"""Bus bandwidth with the wait removed (issue #36 item 10), on the public DLRM trace (8 V100 ranks).

A collective kernel spins from its rank's arrival until the last rank arrives, then moves the
data. Ground truth from the raw per-rank JSON (plain gzip/json): each rank's NCCL kernels, matched
across ranks by their order per (stream, kernel name); per collective the last start, each rank's
end, the transfer = mean over ranks of (end − last start). Sizes from the issuing
``c10d::alltoall_base_`` op's first recorded input (elements × dtype width), per rank, in order.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections import defaultdict
from pathlib import Path

import pytest

import fsdpdoctor

DLRM = "param-dlrm-v100-8ranks"
WIDTH = {"float": 4, "int": 4, "long int": 8}
KIND = {"SendRecv": "all_to_all", "AllReduce": "all_reduce"}  # DLRM's all-to-alls run as SendRecv kernels


def _events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def _raw(d: Path):
    """rank → {(stream, kernel kind): [(start, end), ...] in order}, rank → [all-to-all bytes in order]."""
    kernels, sizes = {}, {}
    for p in sorted(d.glob("*.json.gz")):
        rank = int(re.search(r"worker(\d+)", p.name).group(1))
        ev = _events(p)
        per = defaultdict(list)
        for e in sorted(
            (e for e in ev if e.get("cat") == "kernel" and "ncclKernel" in e["name"]), key=lambda e: e["ts"]
        ):
            kind = KIND[re.match(r"ncclKernel_([A-Za-z]+)_", e["name"]).group(1)]
            per[(e["args"]["stream"], kind)].append((e["ts"], e["ts"] + e["dur"]))
        kernels[rank] = per
        ops = sorted((e for e in ev if e.get("name") == "c10d::alltoall_base_"), key=lambda e: e["ts"])
        sizes[rank] = [math.prod(e["args"]["Input Dims"][0]) * WIDTH[e["args"]["Input type"][0]] for e in ops]
    return kernels, sizes


_CACHE: dict = {}


@pytest.fixture
def dlrm(shared_traces):
    if not _CACHE:  # read and analysed once for the module
        d = shared_traces / DLRM
        _CACHE["run"] = (d, _raw(d), fsdpdoctor.analyze(d))
    return _CACHE["run"]


def test_transfer_time_is_the_time_after_the_last_arrival(dlrm):
    """Per kind: Σ over collectives of mean_r(end_r − max_r start_r) (1 step per rank); it is a
    small part of the kernel time, which holds rank 7's 7.6 ms late arrival."""
    _, (kernels, _), rep = dlrm
    ranks = sorted(kernels)
    assert len(ranks) == 8 and all(kernels[r].keys() == kernels[0].keys() for r in ranks)
    truth: dict[str, float] = defaultdict(float)
    kernel_time: dict[str, float] = defaultdict(float)
    for key in kernels[0]:
        n = len(kernels[0][key])
        assert all(len(kernels[r][key]) == n for r in ranks)
        for i in range(n):
            last = max(kernels[r][key][i][0] for r in ranks)
            truth[key[1]] += sum(kernels[r][key][i][1] - last for r in ranks) / len(ranks) / 1e3
            kernel_time[key[1]] += sum(kernels[r][key][i][1] - kernels[r][key][i][0] for r in ranks) / len(ranks) / 1e3
    got = {c.kind: c for c in rep.facts.collectives}
    assert set(got) == set(truth) == {"all_to_all", "all_reduce"}
    for kind, t in truth.items():
        assert got[kind].transfer_ms_per_step == pytest.approx(t, abs=1e-6)
        assert got[kind].gpu_ms_per_step == pytest.approx(kernel_time[kind], abs=1e-6)
    # the wait dominates the kernels: the all-to-alls move data for 0.04 of their 4.74 ms
    assert truth["all_to_all"] < 0.05 < 4.0 < kernel_time["all_to_all"]
    cr = rep.facts.cross_rank
    assert cr.transfer_collectives == sum(len(v) for v in kernels[0].values()) == 8
    assert cr.transfer_clock_skipped == 0
    assert cr.transfer_ms_per_step_by_kind == {k: got[k].transfer_ms_per_step for k in truth}


def test_pure_bus_bandwidth_of_the_all_to_alls(dlrm):
    """busbw = mean over the all-to-alls of mean_r(bytes_r) × (n−1)/n / transfer; the figure
    including the wait (bytes over each rank's whole kernel) stays, far lower."""
    _, (kernels, sizes), rep = dlrm
    ranks = sorted(kernels)
    (key,) = [k for k in kernels[0] if k[1] == "all_to_all"]
    n = len(kernels[0][key])
    assert all(len(sizes[r]) == n for r in ranks)
    pure, with_wait = [], []
    for i in range(n):
        last = max(kernels[r][key][i][0] for r in ranks)
        transfer_us = sum(kernels[r][key][i][1] - last for r in ranks) / len(ranks)
        size = sum(sizes[r][i] for r in ranks) / len(ranks)
        pure.append(size * 7 / 8 / (transfer_us * 1e-6) / 1e9)
        for r in ranks:
            s, e = kernels[r][key][i]
            with_wait.append(sizes[r][i] * 7 / 8 / ((e - s) * 1e-6) / 1e9)
    a2a = next(c for c in rep.facts.collectives if c.kind == "all_to_all")
    assert a2a.pure_busbw_gbps == pytest.approx(sum(pure) / n, rel=1e-6)
    assert a2a.mean_busbw_gbps == pytest.approx(sum(with_wait) / len(with_wait), rel=1e-6)
    assert a2a.pure_busbw_gbps > 5 * a2a.mean_busbw_gbps
    # the all-reduces record no sizes (old trace): a transfer time, no bandwidth
    ar = next(c for c in rep.facts.collectives if c.kind == "all_reduce")
    assert ar.pure_busbw_gbps is None and ar.transfer_ms_per_step > 0


def test_both_figures_are_in_the_json_and_the_detail_table(dlrm):
    _, _, rep = dlrm
    doc = json.loads(rep.to_json())
    a2a = next(c for c in doc["collectives"] if c["kind"] == "all_to_all")
    assert a2a["pure_busbw_gbps"] == pytest.approx(rep.facts.collectives[1].pure_busbw_gbps)
    assert a2a["transfer_ms_per_step"] > 0 and a2a["mean_busbw_gbps"] > 0
    md = rep.to_markdown()
    head = re.search(r"^\|[^\n]*transfer[^\n]*\|$", md, flags=re.M)
    assert head and "bw+wait" in head.group(0) and "bw pure" in head.group(0)
    assert re.search(r"\| all-to-all \|[^\n]*\| 0\.04 ms \| 0\.17 \| 1\.2 \|", md)


def test_straggler_evidence_says_how_little_of_the_kernel_time_moves_data(dlrm):
    _, _, rep = dlrm
    f = next(f for f in rep.findings if f.slug == "straggler-rank")
    assert any(
        re.search(r"of the collectives' 6\.07 ms kernel time per step, 0\.21 ms moves data", e) for e in f.evidence
    )


def test_one_rank_has_no_pure_figure(shared_traces):
    """One rank's trace cannot say when the last rank arrived: no pure figure, and the report
    says that it needs every rank; the DDP advice says its bandwidth includes the wait."""
    one = sorted((shared_traces / DLRM).glob("*.json.gz"))[0]
    rep = fsdpdoctor.analyze(one)
    assert rep.facts.cross_rank is None
    assert all(c.pure_busbw_gbps is None and c.transfer_ms_per_step is None for c in rep.facts.collectives)
    assert "the pure figures need every rank's trace" in rep.to_markdown()
    mi300 = fsdpdoctor.analyze(shared_traces / "tracelens-mi300-ddp")
    lo = next(f for f in mi300.findings if f.slug == "low-overlap")
    assert any("GB/s bus bandwidth including the wait for other ranks" in e for e in lo.evidence)
    assert "including the wait" in "\n".join(lo.fix.values())


def test_ranks_missing_from_the_group_give_no_pure_figure(shared_traces):
    """2 of a 128-rank job: collectives are matched across the two (skew, straggler), but the
    last of 128 arrivals is unknown, so no transfer time (raw: the job's world size; the trace
    records no group size, so the group is the world)."""
    d = shared_traces / "hta-sampled-128ranks"
    files = sorted(d.glob("*.json.gz"))
    worlds = set()
    for p in files:
        with gzip.open(p, "rt") as fh:
            worlds.add(json.load(fh)["distributedInfo"]["world_size"])
    assert worlds == {128} and len(files) == 2
    rep = fsdpdoctor.analyze(d)
    cr = rep.facts.cross_rank
    assert cr is not None and cr.collectives_matched > 0 and cr.transfer_collectives == 0
    assert all(c.transfer_ms_per_step is None and c.pure_busbw_gbps is None for c in rep.facts.collectives)
    assert "the pure figures need every rank's trace" in rep.to_markdown()
