"""An independent reading of a Kineto trace with the standard library only (json, gzip, re):
none of fsdpdoctor's code. The conformance test (tests/test_conformance.py) and the inputs page
generator (docs/gen_inputs.py) hold the tool's figures to it."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset")  # lowercased categories
COMM_KERNEL = re.compile(
    r"nccl|rccl|hccl|xccl|oneccl|dpsk::ep::|deep_ep::(?!layout::)|nvshmem|multimem_(?:all_reduce|all_gather|reduce_scatter)"
    r"|one_shot_all_reduce|two_shot_all_reduce|cross_device_reduce_[12]stage|allreduce_fusion_kernel"
    r"|oneshotallreduce|twoshotallreduce",
    re.I,
)
NOTABLE_CAT = re.compile(r"kernel|memcpy|memset|^gpu_|ccp_events|profiler_range", re.I)
NOTABLE_NAME = re.compile(r"^ProfilerStep#|nccl|rccl|hccl|gloo|nvshmem|deep_?ep|dpsk::ep", re.I)


def _union_us(intervals) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def union(iv) -> list[tuple[float, float]]:
    """The union of intervals (a, b), sorted and merged."""
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(a, b) -> list[tuple[float, float]]:
    """The merged intervals ``a`` less the merged, sorted intervals ``b``."""
    out = []
    for x, y in a:
        cur = x
        for p, q in b:
            if q <= cur or p >= y:
                continue
            if p > cur:
                out.append((cur, p))
            cur = max(cur, q)
        if cur < y:
            out.append((cur, y))
    return out


def read(path: str | Path) -> dict:
    """kernels, steps (ProfilerStep# events), gpu_busy_ms and comm_busy_ms (unions over the whole
    trace), backend_span_ms (gloo:* / hccl:* CPU spans, summed), events by (ph, cat), notable
    events (GPU-work categories, steps and communication names, any spelling)."""
    p = Path(path)
    with gzip.open(p, "rb") if p.read_bytes()[:2] == b"\x1f\x8b" else open(p, "rb") as fh:
        return summarize(json.load(fh))


def summarize(doc) -> dict:
    """:func:`read` of a trace's parsed JSON (``json.load`` of the file)."""
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    kinds: Counter = Counter()
    notable_kinds: Counter = Counter()
    kernels = steps = notable = 0
    gpu, comm = [], []
    spans = 0.0
    for e in events:
        ph, cat, name = e.get("ph", ""), e.get("cat") or "", str(e.get("name", ""))
        kinds[ph, cat] += 1
        if ph != "X":
            continue
        low = cat.lower()
        ts, dur = float(e.get("ts", 0)), max(float(e.get("dur", 0) or 0), 0.0)
        if NOTABLE_CAT.search(cat) or (low != "python_function" and NOTABLE_NAME.search(name)):
            notable += 1
            notable_kinds[ph, cat] += 1
        if low == "kernel":
            kernels += 1
            args = e.get("args") or {}
            if COMM_KERNEL.search(name) or "Collective name" in args:
                comm.append((ts, ts + dur))
        if low in GPU_WORK:
            gpu.append((ts, ts + dur))
        if name.startswith("ProfilerStep#") and low != "gpu_user_annotation":  # the CPU's (GPU traces repeat it)
            steps += 1
        if low in ("user_annotation", "cpu_op") and name.startswith(("gloo:", "hccl:")):
            spans += dur
    return {
        "events": len(events),
        "kinds": kinds,
        "kernels": kernels,
        "steps": steps,
        "gpu_busy_ms": _union_us(gpu) / 1e3,
        "comm_busy_ms": _union_us(comm) / 1e3,
        "backend_span_ms": spans / 1e3,
        "notable": notable,
        "notable_kinds": notable_kinds,
    }
