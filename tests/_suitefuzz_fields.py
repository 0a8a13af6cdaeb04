"""Fuzz cases for the trace fields the GPU field cases (``_fuzz_cases.gpu_cases``) do not reach
(issue 44 item 5: every field the code reads): the collective fields of ``record_param_comms``
(``fsdpdoctor.ingest.events.ARG_FIELDS``: Collective name, In / Out msg nelems, Group size,
dtype, Process Group Name / Description / Ranks, the shapes), the launch grid of kernels, the
``[memory]`` instant events (``MEMORY_ARG_FIELDS``), the metadata events' names, the
lowercase ``external id`` of torch 1.8-1.9 traces and the top-level keys besides
``traceEvents`` (``META_KEYS``: distributedInfo and its fields, schemaVersion, traceName,
baseTimeNanoseconds, computeProperties).

The seed is the real H100 FSDP1 recording (``fixtures/recorded/gpu/fsdp1``: torch 2.11, NCCL,
``record_param_comms`` with every collective field), its last step trimmed as the GPU cases'
(``_suitefuzz_gpu.trim_step``, the collectives kept with everything under them), plus ``[memory]``
instant events as Kineto writes them with ``profile_memory=True`` (the fields and shape of the
public ``hta-df-index-v100`` trace's: ph ``i``, cat ``cpu_instant_event``, s ``t``, args Device
Type / Device Id / Addr / Bytes / Total Allocated / Total Reserved), on the trace's own thread
and clock.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

from _fuzz_cases import BIG, GPU_FLOP_OPS, GPU_SYNC_OPS, RECORDED, Case, _dumps_lenient, _set_all, last_step_doc, nested
from _suitefuzz_gpu import trim_step

FSDP1_TRACE = RECORDED / "gpu" / "fsdp1" / "rank0.json.gz"
COLLECTIVE_OPS = ("record_param_comms", "c10d::allreduce_", "c10d::_allgather_base_", "c10d::_reduce_scatter_base_")

#: the collective fields and the hostile values each gets: the wrong type, past 64 bits, negative,
#: empty, null, a container, and values no profiler writes (one value of each kind: every case
#: costs a whole analysis, ~0.07 s of CPU)
_ANY = (("null", None), ("dict", {"k": [None]}))
_INT = (("str", "many"), ("big", BIG), ("negative", -5))
_STR = (("int", 7), ("empty", ""))
COLLECTIVE_FIELDS: dict[str, tuple] = {
    "Collective name": _STR + (("unknown", "all_to_all_quux"), ("deep", json.loads(nested(400)))),
    "In msg nelems": _INT,
    "Out msg nelems": _INT,
    "Group size": _INT + (("huge", 1 << 40),),
    "dtype": _STR + (("unknown", "Float999"), ("fp8", "Float8_e4m3fn")),
    "Process Group Name": _STR,
    "Process Group Description": _STR,
    "Process Group Ranks": _STR
    + (("bad_list", "[0, x]"), ("big_list", f"[0, {BIG}]"), ("ints", [0, 1, 2]), ("unclosed", "[0, 1")),
    "Input Dims": (("str", "x"), ("big", [[BIG]]), ("negative", [[-4]])),
    "Input type": (("int", 5), ("unknown", ["Quux"])),
}


def fsdp1_step_doc() -> dict:
    """The FSDP1 recording's last step, trimmed, with ``[memory]`` events added."""
    doc = last_step_doc(FSDP1_TRACE)
    doc = trim_step(doc, GPU_FLOP_OPS + GPU_SYNC_OPS + COLLECTIVE_OPS)
    step = next(
        e for e in doc["traceEvents"] if e.get("cat") == "user_annotation" and str(e["name"]).startswith("ProfilerStep")
    )
    # allocations of 1 MiB on the CUDA device (Device Type 1) at ten instants of the step
    total = 40 << 30
    for i in range(10):
        total += 1 << 20
        doc["traceEvents"].append(
            {
                "ph": "i",
                "cat": "cpu_instant_event",
                "s": "t",
                "name": "[memory]",
                "pid": step["pid"],
                "tid": step["tid"],
                "ts": step["ts"] + (i + 1) * step["dur"] / 12,
                "args": {
                    "Device Type": 1,
                    "Device Id": 0,
                    "Addr": 139926520725504 + i * (1 << 20),
                    "Bytes": 1 << 20,
                    "Total Allocated": total,
                    "Total Reserved": 48 << 30,
                },
            }
        )
    return doc


def field_cases(work: Path) -> list[Case]:
    """One hostile value in one field at a time, in every event that carries it."""
    t = work / "fields"
    t.mkdir(parents=True, exist_ok=True)
    doc = fsdp1_step_doc()
    cases: list[Case] = []

    def trace(name: str, d: dict, family: str) -> None:
        p = t / name
        p.write_bytes(_dumps_lenient(d))
        cases.append(Case(name, ["analyze", str(p), "-j", "1", "--format", "json"], str(p), family))

    def top(name: str, fn: Callable[[dict], None]) -> None:
        d = copy.deepcopy({k: v for k, v in doc.items() if k != "traceEvents"})
        fn(d)
        d["traceEvents"] = doc["traceEvents"]
        trace(name, d, "meta")

    def comms(e: dict) -> bool:
        return "Collective name" in (e.get("args") or {})

    assert sum(map(comms, doc["traceEvents"])) > 0, "the seed lost its collectives"
    for key, values in COLLECTIVE_FIELDS.items():
        slug = key.lower().replace(" ", "_")
        for label, v in values + _ANY:
            trace(f"coll_{slug}_{label}.json", _set_all(doc, comms, key, v), "collectives")
        d = dict(doc)
        d["traceEvents"] = [
            {**e, "args": {k: v for k, v in e["args"].items() if k != key}} if comms(e) else e
            for e in doc["traceEvents"]
        ]
        trace(f"coll_{slug}_missing.json", d, "collectives")
    trace("coll_args_null.json", _set_all(doc, comms, "args", None, in_args=False), "collectives")

    # the launch grid (kept for communication kernels) and the lowercase external id
    def kern(e: dict) -> bool:
        return e.get("cat") == "kernel"

    for label, v in (("str", "x"), ("big", [BIG, 1, 1]), ("deep", json.loads(nested(400)))):
        trace(f"grid_{label}.json", _set_all(doc, kern, "grid", v), "kernels")
    trace("kernel_name_nccl.json", _set_all(doc, kern, "name", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"), "kernels")

    def runtime(e: dict) -> bool:
        return e.get("cat") in ("cuda_runtime", "kernel")

    def lowercase_ext(e: dict) -> dict:
        e = copy.deepcopy(e)
        if runtime(e):
            e["args"]["external id"] = e["args"].pop("External id", None)
        return e

    d = dict(doc)
    d["traceEvents"] = [lowercase_ext(e) for e in doc["traceEvents"]]
    trace("external_id_lowercase.json", d, "kernels")
    for label, v in (("str", "x"), ("big", BIG)):
        trace(f"external_id_lowercase_{label}.json", _set_all(d, runtime, "external id", v), "kernels")

    # the [memory] events
    def mem(e: dict) -> bool:
        return e.get("name") == "[memory]"

    for key in ("Total Allocated", "Total Reserved", "Device Type", "Device Id"):
        for label, v in _INT + (("null", None),):
            trace(f"memory_{key.lower().replace(' ', '_')}_{label}.json", _set_all(doc, mem, key, v), "memory")
    trace("memory_args_null.json", _set_all(doc, mem, "args", None, in_args=False), "memory")
    trace("memory_ts_str.json", _set_all(doc, mem, "ts", "soon", in_args=False), "memory")

    # the metadata events' names (thread and process names: the streams, the autograd thread)
    def meta(e: dict) -> bool:
        return e.get("ph") == "M"

    for label, v in (("int", 7), ("null", None), ("list", ["stream 7"])):
        trace(f"meta_name_{label}.json", _set_all(doc, meta, "name", v), "meta")
    trace("meta_args_str.json", _set_all(doc, meta, "args", "x", in_args=False), "meta")

    # the top-level keys besides traceEvents
    hostile: tuple[tuple[str, Any], ...] = (("str", "x"), ("big", BIG), ("null", None), ("dict", {"k": [None]}))
    for key in ("distributedInfo", "schemaVersion", "traceName", "baseTimeNanoseconds", "computeProperties"):
        for label, v in hostile:
            top(f"top_{key}_{label}.json", lambda d, key=key, v=v: d.__setitem__(key, v))
        if key in doc:
            top(f"top_{key}_missing.json", lambda d, key=key: d.pop(key))
    info = doc.get("distributedInfo") or {}
    for key in sorted(info):
        for label, v in (("str", "x"), ("big", BIG), ("null", None)):
            top(f"dist_{key}_{label}.json", lambda d, key=key, v=v: d["distributedInfo"].__setitem__(key, v))
    for key in ("ranks", "pg_size", "pg_name", "backend_config"):
        for label, v in (("str", "x"), ("list_junk", [None, "a", BIG])):
            top(
                f"dist_pg_config_{key}_{label}.json",
                lambda d, key=key, v=v: [c.__setitem__(key, v) for c in d["distributedInfo"]["pg_config"]],
            )
    top("dist_pg_config_not_dicts.json", lambda d: d["distributedInfo"].__setitem__("pg_config", [1, "x", None]))
    return cases
