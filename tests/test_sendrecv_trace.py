"""The public send/recv trace (HTA, A100, rank 0 of 16, 2023-era Kineto), issue #36 item 10:
its matmuls' FLOPs, against the raw trace read with plain gzip/json.

In this trace a kernel's ``External id`` is its correlation id, not its CPU op's: the link from
``aten::mm`` to its GEMM kernel goes through the ``cudaLaunchKernel`` with the kernel's
correlation id, which runs inside the op on its thread.
"""

from __future__ import annotations

import gzip
import json

import pytest

import fsdpdoctor

TRACE = "hta-sendrecv-a100-16ranks"


def _events(path):
    with gzip.open(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def _matmuls(ev):
    """(op, FLOPs) of every aten::mm / aten::addmm inside a ProfilerStep, and the step count."""
    steps = [e for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    out = []
    for e in ev:
        if e.get("cat") != "cpu_op" or e["name"] not in ("aten::mm", "aten::addmm"):
            continue
        d = e["args"]["Input Dims"]
        (m, k), (_, n) = (d[0], d[1]) if e["name"] == "aten::mm" else (d[1], d[2])
        if any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps):
            out.append((e, 2.0 * m * k * n))
    return out, len(steps)


def test_matmuls_of_a_trace_numbering_kernels_by_correlation_get_their_flops(shared_traces):
    path = shared_traces / TRACE / "rank-0.json.gz"
    ev = _events(path)
    mms, n_steps = _matmuls(ev)
    assert len(mms) == 25 and n_steps == 5
    # the raw linkage: no kernel carries the External id of a matmul op; each matmul holds a
    # cudaLaunchKernel whose correlation id is a GEMM kernel's
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    op_ids = {e["args"]["External id"] for e, _ in mms}
    assert not any(k["args"].get("External id") in op_ids for k in kernels)
    by_corr = {k["args"]["correlation"]: k for k in kernels}
    launches = [e for e in ev if e.get("cat") == "cuda_runtime" and e["name"] == "cudaLaunchKernel"]
    gemm_us = 0.0
    for op, _ in mms:
        inside = [
            by_corr[x["args"]["correlation"]]
            for x in launches
            if x["tid"] == op["tid"]
            and op["ts"] <= x["ts"] <= op["ts"] + op["dur"]
            and x["args"]["correlation"] in by_corr
        ]
        gemm = [k for k in inside if "gemm" in k["name"]]
        assert len(gemm) == 1
        gemm_us += gemm[0]["dur"]
    c = fsdpdoctor.analyze(path).facts.compute
    assert c is not None and c.ops_with_shapes == 25 and c.ops_without_shapes == 0
    assert c.flops_per_step == pytest.approx(sum(f for _, f in mms) / n_steps, rel=1e-9)
    # the GEMM kernels are attributed to their ops: at least their own time (elementwise
    # kernels the ops launch count too), far from zero
    assert c.gemm_ms_per_step >= gemm_us / 1e3 / n_steps * 0.999 > 0.1


def _merged_len(ivs, lo, hi):
    """|union of the intervals, clipped to [lo, hi]|."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in ivs if e > lo and s < hi):
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def test_step_split_is_on_the_step_clock_not_the_overlapping_gpu_window(shared_traces):
    """The GPU runs ~158 ms behind the CPU: a step's GPU window (first to last GPU activity it
    launched) is ~373 ms against a ~215 ms step, and consecutive windows overlap. The split of
    the step is on the step clock: each step's interval of one step time ends at its completion
    (its CPU span ended and its own GPU work done, raw: launches matched by correlation id); idle
    is the time in it with nothing at all on the GPU."""
    path = shared_traces / TRACE / "rank-0.json.gz"
    ev = _events(path)
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in ev
        if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")
    )
    launch = {
        e["args"]["correlation"]: e["ts"] for e in ev if e.get("cat") == "cuda_runtime" and "correlation" in e["args"]
    }
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    first, last = [None] * len(spans), [None] * len(spans)
    for e in gpu:
        lt = launch.get(e["args"].get("correlation"))
        for i, (a, b) in enumerate(spans):
            if lt is not None and a <= lt < b:
                s, t = e["ts"], e["ts"] + e["dur"]
                first[i] = s if first[i] is None else min(first[i], s)
                last[i] = t if last[i] is None else max(last[i], t)
    done = []
    for (a, b), t in zip(spans, last):
        done.append(max(b, t, done[-1] if done else b))
    n = len(spans)
    rate = (done[-1] - done[0]) / (n - 1)
    assert rate > sum(b - a for a, b in spans) / n  # the completions are the slower clock
    step_us = [rate] + [done[k] - done[k - 1] for k in range(1, n)]
    ivs = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    idle = [step_us[k] - _merged_len(ivs, done[k] - step_us[k], done[k]) for k in range(n)]
    window = sum(t - s for s, t in zip(first, last)) / n
    rep = fsdpdoctor.analyze(path)
    t = rep.facts.timeline
    assert t.gpu_window_ms == pytest.approx(window / 1e3, rel=1e-6) and window > 1.5 * rate
    assert sum(t.clock_parts_ms.values()) == pytest.approx(sum(step_us) / n / 1e3, rel=1e-6)
    assert t.clock_parts_ms["idle"] == pytest.approx(sum(idle) / n / 1e3, rel=0.01)
    share = 100 * t.clock_parts_ms["idle"] / sum(t.clock_parts_ms.values())
    text = fsdpdoctor.analyze(path).to_markdown()
    assert "shares of the step time" in text and "GPU step window" not in text
    assert f"| idle (nothing running) | {t.clock_parts_ms['idle']:.2f} ms | {share:.1f}% |" in text
    assert "consecutive steps' windows overlap" in text
