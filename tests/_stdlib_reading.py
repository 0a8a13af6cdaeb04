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


# ------------------------------------------------------------------------------------------
# a step's interval on the step clock, split instant by instant (compare's GPU parts)
# ------------------------------------------------------------------------------------------

SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")
COPY_NAME = re.compile(r"^(hip)?(Memcpy|Memset)|^dma")


def comm_kind(name: str, args: dict) -> str:
    """A collective kernel's kind from its name (or its ``Collective name`` arg): all_gather,
    reduce_scatter, or other."""
    text = (str(args.get("Collective name", "")) + " " + name).lower().replace("_", "")
    if "allgather" in text:
        return "all_gather"
    if "reducescatter" in text:
        return "reduce_scatter"
    return "other"


def intersect(a, b) -> list[tuple[float, float]]:
    """Two merged, sorted interval lists intersected."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(iv) -> float:
    return sum(b - a for a, b in iv)


def clock_split(path: str | Path, frame: list[tuple[float, float]]) -> dict[str, float]:
    """Each step interval of ``frame`` (µs) split instant by instant, ms per step (mean over the
    frame's steps), read with the standard library:

    * ``compute``: a kernel that is neither a collective (NCCL name or ``Collective name`` arg) nor
      a copy runs, whichever step launched it;
    * ``comm:<kind>``: else a collective kernel runs (all_gather, then reduce_scatter, then other);
    * ``memcpy``: else a ``gpu_memcpy`` / ``gpu_memset`` (or a copy kernel) runs;
    * ``host_bound_idle``: else, inside the step's own GPU window (first to last GPU activity
      launched from its ``ProfilerStep`` span, by ``correlation``, ending where the next step's
      own work starts) and outside the CPU's blocking calls (``SYNC_CALLS``);
    * ``other_idle``: the rest.
    """
    p = Path(path)
    with gzip.open(p, "rt") if p.read_bytes()[:2] == b"\x1f\x8b" else open(p) as fh:
        doc = json.load(fh)
    ev = [e for e in (doc["traceEvents"] if isinstance(doc, dict) else doc) if e.get("ph") == "X"]
    launch = {
        e["args"]["correlation"]: e["ts"]
        for e in ev
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})
    }
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    compute, copies, comm = [], [], {"all_gather": [], "reduce_scatter": [], "other": []}
    for e in gpu:
        iv, args = (e["ts"], e["ts"] + e["dur"]), e.get("args") or {}
        if e["cat"] == "kernel" and (COMM_KERNEL.search(e["name"]) or "Collective name" in args):
            comm[comm_kind(e["name"], args)].append(iv)
        elif e["cat"] != "kernel" or COPY_NAME.search(e["name"]):
            copies.append(iv)
        else:
            compute.append(iv)
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    blocked = union(
        [
            (e["ts"], e["ts"] + e["dur"])
            for e in ev
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in SYNC_CALLS
        ]
    )
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in ev
        if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"
    )
    own = []  # each step's GPU activity: (first start, last end)
    for a, b in spans:
        mine = [g for g in gpu if a <= launch.get((g.get("args") or {}).get("correlation"), -1) < b]
        own.append((min(g["ts"] for g in mine), max(g["ts"] + g["dur"] for g in mine)) if mine else None)
    compute, copies = union(compute), union(copies)
    comm = {k: union(v) for k, v in comm.items()}
    out: dict[str, float] = {}

    def add(key: str, v: float) -> None:
        out[key] = out.get(key, 0.0) + v / len(frame) / 1e3

    for k, (lo, hi) in enumerate(frame):
        step = [(lo, hi)]
        covered = intersect(compute, step)
        add("compute", length(covered))
        for kind, iv in comm.items():
            piece = subtract(intersect(iv, step), covered)
            if piece:
                add(f"comm:{kind}", length(piece))
                covered = union(covered + piece)
        add("memcpy", length(subtract(intersect(copies, step), covered)))
        idle = subtract(step, busy)
        host_bound = []
        if own[k] is not None:
            w0, w1 = own[k]
            nxt = next((o[0] for o in own[k + 1 :] if o is not None), None)
            w1 = w1 if nxt is None else min(w1, max(nxt, w0))
            host_bound = intersect(idle, subtract(subtract([(w0, w1)], busy), blocked))
        add("host_bound_idle", length(host_bound))
        add("other_idle", length(idle) - length(host_bound))
    return out
