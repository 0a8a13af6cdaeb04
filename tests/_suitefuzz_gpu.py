"""The real H100 trace's last step, trimmed for the GPU field cases (``_fuzz_cases.gpu_trace_doc``).

Each case analyses the whole trace again with one field made hostile; what a case can reach is
decided by which kinds of events surround the field, not by how many of each there are. So the
step keeps, of the recording's own events (unchanged): the metadata, every annotation (step,
optimizer, FSDP labels), the first ``PER_NAME`` GPU events of each name on each stream (every
kernel class: GEMM, attention, elementwise, reduce, memcpy, memset, ...), every event of the first
``PER_NAME`` of each FLOP op and sync op (aten::mm, addmm, attention forward and backward,
aten::to / item: the op, the ops and runtime calls under it and the kernels they launch), the
first ``PER_NAME`` runtime and driver calls of each name (launches, syncs, stream waits) and of
each launching name inside each annotation, and what ties them together: each kept kernel's launch, each kept
call's enclosing ops, the flow events whose ends are both kept.
"""

from __future__ import annotations

from collections import defaultdict

PER_NAME = 2
_GPU = ("kernel", "gpu_memcpy", "gpu_memset")
_CALLS = ("cuda_runtime", "cuda_driver")
_LABELS = ("user_annotation", "gpu_user_annotation")


def trim_step(doc: dict, ops: tuple[str, ...] | frozenset[str]) -> dict:
    """``doc`` (one step) with the events above (``ops``: the FLOP and sync ops); the top-level
    fields as they are."""
    evs = doc["traceEvents"]
    keep: set[int] = set()
    xs = [k for k, e in enumerate(evs) if e.get("ph") == "X"]
    keep.update(k for k, e in enumerate(evs) if e.get("ph") not in ("X", "s", "f") or e.get("cat") in _LABELS)

    # CPU-side complete events of each thread, by start (longest first): enclosing ops come first
    threads: dict[tuple, list[int]] = defaultdict(list)
    for k in xs:
        if evs[k].get("cat") not in _GPU:
            threads[(evs[k].get("pid"), evs[k].get("tid"))].append(k)
    for ks in threads.values():
        ks.sort(key=lambda k: (evs[k]["ts"], -evs[k].get("dur", 0)))

    def inside(outer: int, k: int) -> bool:
        o, e = evs[outer], evs[k]
        return o["ts"] <= e["ts"] and e["ts"] + e.get("dur", 0) <= o["ts"] + o.get("dur", 0)

    counts: dict[tuple, int] = defaultdict(int)

    def first(k: int, key: tuple) -> bool:
        counts[key] += 1
        return counts[key] <= PER_NAME

    gpu_corrs = {(evs[k].get("args") or {}).get("correlation") for k in xs if evs[k].get("cat") in _GPU}
    # the first few GPU events of each name on each stream, runtime / driver calls of each name,
    # FLOP ops and the ops whose read-backs synchronize, and inside each CPU annotation (every
    # phase: each FSDP unit's forward and backward, the optimizer, zero_grad) the first few
    # calls of each name that launched GPU work
    for k in xs:
        e = evs[k]
        cat, name = e.get("cat"), e.get("name")
        thread = threads.get((e.get("pid"), e.get("tid")), [])
        if cat in _GPU or cat in _CALLS:
            if first(k, (cat, name, e.get("tid") if cat in _GPU else None)):
                keep.add(k)
        elif name in ops and first(k, ("op", name)):
            keep.update(j for j in thread if inside(k, j))  # the op and everything under it
        elif cat == "user_annotation":
            for j in thread:
                ej = evs[j]
                if (
                    ej.get("cat") in _CALLS
                    and inside(k, j)
                    and (ej.get("args") or {}).get("correlation") in gpu_corrs
                    and first(j, (k, ej.get("name")))
                ):
                    keep.add(j)

    # each kept GPU event's launch, each kept launch's GPU events (by correlation)
    by_corr: dict[int, list[int]] = defaultdict(list)
    for k in xs:
        c = (evs[k].get("args") or {}).get("correlation")
        if c is not None:
            by_corr[c].append(k)
    corrs = {(evs[k].get("args") or {}).get("correlation") for k in keep if evs[k].get("ph") == "X"}
    corrs.discard(None)
    for c in corrs:
        keep.update(by_corr[c])

    # every kept CPU-side event's enclosing ops, on its thread
    for ks in threads.values():
        stack: list[int] = []
        for k in ks:
            while stack and not inside(stack[-1], k):
                stack.pop()
            if k in keep:
                keep.update(stack)
            stack.append(k)

    # flow events (launch -> kernel, forward -> backward) whose every end lies on a kept event
    starts = {(evs[k].get("pid"), evs[k].get("tid"), evs[k]["ts"]) for k in keep if evs[k].get("ph") == "X"}
    flows: dict[tuple, list[int]] = defaultdict(list)
    for k, e in enumerate(evs):
        if e.get("ph") in ("s", "f"):
            flows[(e.get("cat"), e.get("id"))].append(k)
    for ends in flows.values():
        if all((evs[k].get("pid"), evs[k].get("tid"), evs[k].get("ts")) in starts for k in ends):
            keep.update(ends)

    out = dict(doc)
    out["traceEvents"] = [e for k, e in enumerate(evs) if k in keep]
    return out
