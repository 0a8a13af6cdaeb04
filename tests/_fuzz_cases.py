"""Bad-input cases for the fuzz suite: hand-named hostile files and seeded, structure-aware
mutations of real inputs (recorded CPU FSDP traces, the memory snapshot, a saved baseline) and
of a Flight Recorder dump from the NCCL generator.

Every case is ``Case(id, argv, names)``: the CLI arguments, and the path the one error line must
name when the case is refused. Files are written under a directory the caller owns.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import pickle
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "fixtures" / "recorded"
REAL_SNAPSHOT = REPO.parent / "shared" / "snapshots" / "public" / "cs336-a2-torch211-windows" / "memory_snapshot.pickle"

BIG = 1 << 70  # past 64 bits
DEEP = 10_000  # nesting depth of the deep cases


@dataclass
class Case:
    id: str
    argv: list[str]
    names: str  # the input the error line must name
    family: str = ""


# ------------------------------------------------------------------------------ the seeds


def trace_doc(variant: str = "per-block", rank: int = 0, max_events: int | None = 400) -> dict:
    """A real recorded trace (the first ``max_events`` events, to keep each case fast)."""
    with gzip.open(RECORDED / variant / f"rank{rank}.json.gz", "rb") as f:
        doc = json.loads(f.read())
    if max_events is not None:
        evs = doc["traceEvents"]
        # keep the ProfilerStep spans and a slice of everything else: still a valid, analysable run
        doc["traceEvents"] = [e for e in evs if str(e.get("name", "")).startswith("ProfilerStep")] + [
            e for e in evs if not str(e.get("name", "")).startswith("ProfilerStep")
        ][:max_events]
    return doc


GPU_TRACE = RECORDED / "gpu" / "fsdp2" / "rank0.json.gz"


def last_step_doc(path: Path) -> dict:
    """A recorded trace cut to its last ``ProfilerStep`` and what follows it, metadata kept."""
    with gzip.open(path, "rb") as f:
        doc = json.loads(f.read())
    evs = doc["traceEvents"]
    last = max(
        e["ts"] for e in evs if e.get("cat") == "user_annotation" and str(e.get("name")).startswith("ProfilerStep")
    )
    doc["traceEvents"] = [e for e in evs if e.get("ph") == "M" or e.get("ts", 0) >= last]
    return doc


def gpu_trace_doc(whole_step: bool = False) -> dict:
    """The real H100 FSDP2 trace (torch 2.11, ``record_shapes=True``: GEMM and attention ops with
    their ``Input Dims`` / ``Input type`` / ``Concrete Inputs``, cuBLAS / CUTLASS / fmha kernels,
    ``deviceProperties``), cut to its last step to keep each case fast: what the compute, MFU and
    waterfall analyses and the kernel classes read, which the CPU recordings do not have. Unless
    ``whole_step``, the step is trimmed to a few events of each kind (``_suitefuzz_gpu``)."""
    doc = last_step_doc(GPU_TRACE)
    if whole_step:
        return doc
    from _suitefuzz_gpu import trim_step

    return trim_step(doc, GPU_FLOP_OPS + GPU_SYNC_OPS)


#: ops whose shapes give FLOPs (fsdpdoctor.ingest.events.FLOP_OPS on this trace)
GPU_FLOP_OPS = ("aten::mm", "aten::addmm", "aten::_scaled_dot_product_efficient_attention")
GPU_FLOP_OPS += tuple(n + "_backward" for n in GPU_FLOP_OPS[2:])
#: ops whose read-backs synchronize (fsdpdoctor.ingest.events.SYNC_OPS)
GPU_SYNC_OPS = ("aten::to", "aten::item", "aten::_local_scalar_dense", "aten::cpu")


def gpu_field_paths(doc: dict) -> list[tuple]:
    """Paths to every field the GPU analyses read in ``doc``: each ``deviceProperties`` entry's
    fields, and for the first kernel of each class (GEMM, attention, elementwise, memcpy), the
    first runtime launch and the first event of each FLOP op: ``name``, ``cat``, ``ts``, ``dur``,
    ``pid``, ``tid`` and every arg (shapes, types, concrete inputs, correlation, stream ...)."""
    out: list[tuple] = [("deviceProperties",)]
    for i, p in enumerate(doc.get("deviceProperties") or []):
        out += [("deviceProperties", i), *[("deviceProperties", i, k) for k in p]]
    evs = doc["traceEvents"]
    picks: dict[str, int] = {}
    for k, e in enumerate(evs):
        name, cat = str(e.get("name", "")), e.get("cat")
        if cat == "kernel":
            cls = next((c for c in ("gemm", "fmha", "elementwise", "reduce") if c in name), "other")
            picks.setdefault("kernel:" + cls, k)
        elif cat in ("gpu_memcpy", "gpu_memset", "cuda_runtime"):
            picks.setdefault(f"{cat}:{name}", k)
        elif name in GPU_FLOP_OPS or name.startswith(("ProfilerStep#", "Optimizer.step#", "FSDP::")):
            picks.setdefault(name.split("#")[0].split(" (")[0], k)
    for k in picks.values():
        e = evs[k]
        out += [("traceEvents", k, f) for f in e if f != "args"]
        out += [("traceEvents", k, "args"), *[("traceEvents", k, "args", a) for a in e.get("args", {})]]
    return out


def _set_all(doc: dict, pred: Callable[[dict], bool], key: str, value: Any, in_args: bool = True) -> dict:
    """``doc`` with ``key`` (of ``args``, else of the event) set to ``value`` in every event
    ``pred`` picks; those events are copies, the others ``doc``'s own (the result is written out,
    never changed)."""
    d = dict(doc)
    d["traceEvents"] = evs = []
    for e in doc["traceEvents"]:
        if pred(e):
            e = copy.deepcopy(e)
            (e.setdefault("args", {}) if in_args else e)[key] = copy.deepcopy(value)
        evs.append(e)
    return d


def gpu_cases(work: Path, doc: dict | None = None) -> list[Case]:
    """Hostile values in every field of a real GPU trace (``doc``, else :func:`gpu_trace_doc`)
    that the compute / MFU / waterfall analyses and the kernel classes read:
    ``deviceProperties``, kernel names and args, the shapes, types and concrete inputs of the
    FLOP ops, the step, optimizer and FSDP labels."""
    t = work / "gpu"
    t.mkdir(parents=True, exist_ok=True)
    doc = gpu_trace_doc() if doc is None else doc
    cases: list[Case] = []

    def trace(name: str, d: dict, family: str = "gpu") -> None:
        p = t / name
        p.write_bytes(_dumps_lenient(d))
        cases.append(Case(name, ["analyze", str(p), "-j", "1", "--format", "json"], str(p), family))

    def dev(name: str, fn: Callable[[dict], None]) -> None:
        d = dict(doc)  # fn changes deviceProperties or the top level only
        d["deviceProperties"] = copy.deepcopy(doc["deviceProperties"])
        fn(d)
        trace(name, d, "deviceProperties")

    def first(d: dict) -> dict:
        return d["deviceProperties"][0]

    # deviceProperties: the name as an int is issue 44's regression (exit 3, an internal error)
    for label, v in (("int", 7), ("float", 1.5), ("list", ["H100"]), ("dict", {"a": 1}), ("null", None), ("empty", "")):
        dev(f"dp_name_{label}.json", lambda d, v=v: first(d).__setitem__("name", v))
    dev("dp_name_unknown_gpu.json", lambda d: first(d).__setitem__("name", "NVIDIA Quux 9000 " + "9" * 400))
    for label, v in (
        ("str", "80GB"),
        ("negative", -1),
        ("zero", 0),
        ("big", BIG),
        ("huge_float", 1e308),
        ("bool", True),
    ):
        dev(f"dp_mem_{label}.json", lambda d, v=v: first(d).__setitem__("totalGlobalMem", v))
    for label, v in (("str", "0"), ("list", [0]), ("big", BIG)):
        dev(f"dp_id_{label}.json", lambda d, v=v: first(d).__setitem__("id", v))
    for k in ("computeMajor", "computeMinor", "numSms"):
        dev(f"dp_{k}_str.json", lambda d, k=k: first(d).__setitem__(k, "x"))
    dev("dp_entries_not_dicts.json", lambda d: d.__setitem__("deviceProperties", [3, "x", None, [1]]))
    dev("dp_dict.json", lambda d: d.__setitem__("deviceProperties", {"name": "NVIDIA H100 80GB HBM3"}))
    dev("dp_str.json", lambda d: d.__setitem__("deviceProperties", "NVIDIA H100"))
    dev("dp_many.json", lambda d: d.__setitem__("deviceProperties", [first(d)] * 5000))

    # kernel names: the GEMM / attention / family classes parse them
    def kern(e: dict, sub: str = "") -> bool:
        return e.get("cat") == "kernel" and sub in str(e.get("name", ""))

    for label, v in (
        ("int", 12345),
        ("empty", ""),
        ("long", "sm90_xmma_gemm_" + "9" * 100_000),
        ("digits", "nvjet_tst_" + "9" * 40 + "x" + "9" * 40 + "_64x8_" + "9" * 30 + "_v_bz_TNN"),
        ("cutlass_digits", "cutlass3x_sm90_tensorop_gemm_" + "9" * 40 + "x" + "9" * 40 + "_f16"),
        ("regex", "sm80_xmma_gemm_([{\\%s*+?|^$.}])_f32"),
        ("nul", "sm80_xmma_gemm_\x00\ud800_bf16"),
        ("fp8_no_dims", "sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n"),
    ):
        trace(f"kernel_name_gemm_{label}.json", _set_all(doc, lambda e: kern(e, "gemm"), "name", v, in_args=False))
    trace("kernel_name_fmha_int.json", _set_all(doc, lambda e: kern(e, "fmha"), "name", 7, in_args=False))
    trace("kernel_names_all_same.json", _set_all(doc, kern, "name", "ncclDevKernel_AllGather_RING_LL", in_args=False))
    trace("kernel_cat_memcpy.json", _set_all(doc, lambda e: kern(e, "gemm"), "cat", "gpu_memcpy", in_args=False))
    for k, v in (("correlation", "x"), ("correlation", -1), ("stream", BIG), ("device", "cuda:0"), ("device", -7)):
        trace(f"kernel_{k}_{str(v)[:6]}.json", _set_all(doc, kern, k, v))
    for k in ("ts", "dur"):
        trace(f"kernel_{k}_str.json", _set_all(doc, kern, k, "soon", in_args=False))
        trace(f"kernel_{k}_negative.json", _set_all(doc, kern, k, -5.0, in_args=False))

    # the FLOP ops' shapes, types and concrete inputs (compute, MFU, matmul shapes below peak)
    def flop(e: dict) -> bool:
        return e.get("name") in GPU_FLOP_OPS

    for label, v in (
        ("str", "x"),
        ("big", [[BIG, BIG], [BIG, BIG]]),
        ("huge", [[1 << 62, 1 << 62], [1 << 62, 1 << 62], [1 << 62]]),
        ("negative", [[-4, 8], [8, -4], [-1]]),
        ("zero", [[0, 0], [0, 0], [0]]),
        ("empty", []),
        ("empty_lists", [[], [], []]),
        ("one_input", [[4, 4]]),
        ("float", [[1.5, 2.5], [2.5, 1.5]]),
        ("huge_float", [[1e308, 1e308], [1e308, 1e308]]),
        ("strings", [["a", "b"], ["c", "d"]]),
        ("nulls", [None, None, None]),
        ("dict", {"a": [1, 2]}),
        ("deep", json.loads(nested(400))),
        ("attention_3d", [[8, 1024, 64], [8, 1024, 64], [8, 1024, 64]]),
    ):
        trace(f"dims_{label}.json", _set_all(doc, flop, "Input Dims", v), "shapes")
    for label, v in (("int", 5), ("ints", [1, 2, 3]), ("unknown", ["float999", "quux", ""]), ("null", None)):
        trace(f"input_type_{label}.json", _set_all(doc, flop, "Input type", v), "shapes")
    for label, v in (
        ("int", 5),
        ("junk", ["", "", "", "", "maybe", "x", "True", 1]),
        ("deep", json.loads(nested(400))),
    ):
        trace(f"concrete_{label}.json", _set_all(doc, flop, "Concrete Inputs", v), "shapes")
    trace("flop_args_null.json", _set_all(doc, flop, "args", None, in_args=False), "shapes")
    trace("flop_args_list.json", _set_all(doc, flop, "args", [1, 2], in_args=False), "shapes")

    # labels the step clock, the waterfall and the FSDP analysis read
    def named(prefix: str) -> Callable[[dict], bool]:
        return lambda e: str(e.get("name", "")).startswith(prefix)

    for label, v in (("bare", "Optimizer.step#"), ("long", "Optimizer.step#" + "A" * 50_000 + ".step"), ("int", 3)):
        trace(f"optimizer_{label}.json", _set_all(doc, named("Optimizer.step#"), "name", v, in_args=False), "labels")
    for label, v in (("bare", "ProfilerStep#"), ("bigint", "ProfilerStep#" + "9" * 40), ("text", "ProfilerStep#x")):
        trace(f"profilerstep_{label}.json", _set_all(doc, named("ProfilerStep#"), "name", v, in_args=False), "labels")
    trace(
        "fsdp_label_unclosed.json",
        _set_all(doc, named("FSDP::"), "name", "FSDP::pre_forward (", in_args=False),
        "labels",
    )
    return cases


def fr_field_cases(work: Path) -> list[Case]:
    """Every field of a Flight Recorder dump that the hang diagnosis reads, one hostile value at a
    time: the wrong type, a value past 64 bits or negative, an empty one, and the values a
    watchdog never writes (an unknown state, times running backwards, NaN durations, a stack id
    past the stack table, ranks of another world)."""
    t = work / "fr_fields"
    t.mkdir(parents=True, exist_ok=True)
    fr = fr_dump_obj()
    cases: list[Case] = []

    def dump(name: str, fn: Callable[[dict], None]) -> None:
        o = copy.deepcopy(fr)
        fn(o)
        p = t / f"{name}_rank_0"
        p.write_bytes(pickle.dumps(o, protocol=2))
        cases.append(Case(p.name, ["analyze", str(p), "-j", "1", "--format", "json"], str(p), "fr"))

    def every_entry(key: str, v: Any) -> Callable[[dict], None]:
        return lambda o: [e.__setitem__(key, copy.deepcopy(v)) for e in o["entries"]]

    entry_keys = sorted({k for e in fr["entries"] for k in e})
    for key in entry_keys:
        for label, v in (("str", "x"), ("big", BIG), ("negative", -1), ("null", None), ("list", [[1], "a"])):
            dump(f"fr_entry_{key}_{label}", every_entry(key, v))
        if key in fr["entries"][0]:
            dump(f"fr_entry_{key}_missing", lambda o, key=key: [e.pop(key, None) for e in o["entries"]])
    for label, v in (
        ("state_unknown", ("state", "exploded")),
        ("pg_one", ("process_group", ("0",))),
        ("pg_empty", ("process_group", ("", ""))),
        ("sizes_negative", ("input_sizes", [[-1, -5]])),
        ("sizes_huge", ("output_sizes", [[1 << 62, 1 << 62]])),
        ("dtypes_unknown", ("input_dtypes", ["Quux", ""])),
        ("duration_nan", ("duration_ms", float("nan"))),
        ("duration_inf", ("duration_ms", float("inf"))),
        ("timeout_zero", ("timeout_ms", 0)),
        ("profiling_name_empty", ("profiling_name", "")),
        ("profiling_name_bare", ("profiling_name", "nccl:")),
        ("profiling_name_odd", ("profiling_name", "nccl:all_gather_into_tensor_coalesced:" + "x" * 5000)),
    ):
        dump(f"fr_{label}", every_entry(*v))
    dump("fr_times_backwards", lambda o: [e.__setitem__("time_created_ns", -k) for k, e in enumerate(o["entries"])])
    dump(
        "fr_started_after_completed",
        lambda o: [e.update(time_discovered_started_ns=10**12, time_discovered_completed_ns=1) for e in o["entries"]],
    )
    dump("fr_pg_ranks_huge", lambda o: o["pg_config"]["0"].__setitem__("ranks", "[0, 1, 4611686018427387904]"))
    dump("fr_pg_ranks_bigint", lambda o: o["pg_config"]["0"].__setitem__("ranks", [0, 1, BIG]))
    dump("fr_pg_ranks_long_digits", lambda o: o["pg_config"]["0"].__setitem__("ranks", "[0, " + "9" * 5000 + "]"))
    dump("fr_seq_repeated", every_entry("collective_seq_id", 1))
    dump("fr_record_id_repeated", every_entry("record_id", 0))
    top = sorted(k for k in fr if k != "entries")
    for key in top:
        for label, v in (("str", "x"), ("int", BIG), ("null", None), ("list", [1, "a"]), ("dict", {"k": [None]})):
            dump(f"fr_top_{key}_{label}", lambda o, key=key, v=v: o.__setitem__(key, copy.deepcopy(v)))
        dump(f"fr_top_{key}_missing", lambda o, key=key: o.pop(key))
    return cases


def snapshot_obj() -> dict:
    """The real torch 2.11 snapshot when ../shared is present, else a small one of the same shape."""
    if REAL_SNAPSHOT.is_file():
        with open(REAL_SNAPSHOT, "rb") as f:
            obj = pickle.load(f)  # trusted: our own read-only copy of a public file
        obj["device_traces"] = [t[:300] for t in obj["device_traces"]]
        return obj
    frame = {"name": "forward", "filename": "model.py", "line": 54}
    return {
        "segments": [
            {
                "device": 0,
                "address": 1 << 32,
                "total_size": 2 << 20,
                "allocated_size": 1 << 20,
                "active_size": 1 << 20,
                "requested_size": 1 << 20,
                "stream": 0,
                "segment_type": "small",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": [
                    {
                        "address": 1 << 32,
                        "size": 1 << 20,
                        "requested_size": 1 << 20,
                        "state": "active_allocated",
                        "frames": [frame],
                    },
                    {
                        "address": (1 << 32) + (1 << 20),
                        "size": 1 << 20,
                        "requested_size": 0,
                        "state": "inactive",
                        "frames": [],
                    },
                ],
            }
        ],
        "device_traces": [
            [
                {
                    "action": "alloc",
                    "addr": 1 << 32,
                    "size": 1 << 20,
                    "stream": 0,
                    "time_us": 1000 + i,
                    "frames": [frame],
                }
                for i in range(3)
            ]
        ],
        "allocator_settings": {},
        "external_annotations": [],
    }


def fr_dump_obj(json_form: bool = False) -> dict:
    """One rank's Flight Recorder dump of a small hung NCCL job (fixtures/flight_recorder/gen.py)."""
    import dataclasses
    import sys

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from fixtures.flight_recorder import gen

    spec = dataclasses.replace(gen.PRESETS["missing"], steps=3, n_units=2, at_step=2)
    ranks, _, _ = gen._simulate(spec)
    return gen.dump_dict(spec, ranks[0], json_form)


def _clone(obj: Any) -> Any:
    """A deep copy of plain data (dicts, lists, tuples, numbers, strings; shared parts stay
    shared, as with ``copy.deepcopy``) through pickle: ~10x faster on a snapshot."""
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def gz_members(*parts: bytes, repeat_middle: int = 1, members: dict[bytes, bytes] | None = None) -> bytes:
    """A multi-member gzip (what ``zcat`` reads as one stream); the middle part is repeated as
    identical members, so a few MB on disk can expand to GBs without compressing GBs.
    ``members``: the caller's memo of compressed middle parts (one part given to several bombs
    is compressed once)."""
    head, *mid, tail = parts if len(parts) >= 2 else (parts[0], b"")
    out = [gzip.compress(head, 1)]
    memo = {} if members is None else members
    for m in mid:
        member = memo.get(m)
        if member is None:
            member = memo[m] = gzip.compress(m, 9)
        out.extend([member] * repeat_middle)
    out.append(gzip.compress(tail, 1))
    return b"".join(out)


def nested(depth: int, leaf: str = "0") -> str:
    return "[" * depth + leaf + "]" * depth


# ------------------------------------------------------------------------------ named cases


def named_cases(work: Path, baseline: Path | None) -> list[Case]:
    """The hostile inputs the issue lists, one family each."""
    cases: list[Case] = []
    t = work / "named"
    t.mkdir(parents=True, exist_ok=True)
    doc = trace_doc()
    text = json.dumps(doc).encode()

    def trace(name: str, data: bytes, family: str, extra: tuple[str, ...] = ()) -> None:
        p = t / name
        p.write_bytes(data)
        cases.append(Case(name, ["analyze", str(p), "-j", "1", *extra], str(p), family))

    # 1. invalid UTF-8 inside a string (a label) and inside a key
    i = text.index(b'"name": "') + 9
    trace("utf8_label.json", text[:i] + b"\xff\xfe" + text[i:], "utf8")
    trace("utf8_label.json.gz", gzip.compress(text[:i] + b"\xc3\x28" + text[i:]), "utf8")
    j = text.index(b'"ts"')
    trace("utf8_key.json", text[: j + 1] + b"\xff" + text[j + 1 :], "utf8")
    # 2. integers past 64 bits where the analysis reads integers
    for key in ("External id", "correlation", "stream", "bytes", "In msg nelems", "Group size"):
        d = copy.deepcopy(doc)
        for e in d["traceEvents"]:
            if e.get("ph") == "X":
                e.setdefault("args", {})[key] = BIG
        trace(f"bigint_{key.replace(' ', '_')}.json", json.dumps(d).encode(), "bigint")
    d = copy.deepcopy(doc)
    d["traceEvents"][0]["ts"] = BIG
    trace("bigint_ts.json", json.dumps(d).encode(), "bigint")
    # a float clock no profiler writes (issue 26): on a step span, on a kernel-side event's duration
    d = copy.deepcopy(doc)
    next(e for e in d["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep"))["ts"] = 1e30
    trace("ts_1e30.json", json.dumps(d).encode(), "bigint")
    d = copy.deepcopy(doc)
    [e for e in d["traceEvents"] if e.get("ph") == "X"][-1]["dur"] = 1e30
    trace("dur_1e30.json", json.dumps(d).encode(), "bigint")
    d = copy.deepcopy(doc)
    d["distributedInfo"] = {"rank": BIG, "world_size": BIG}
    trace("bigint_rank.json", json.dumps(d).encode(), "bigint")
    # 3. nesting 10k deep: in an event's args, in the metadata, as an event
    x = next(k for k, e in enumerate(doc["traceEvents"]) if e.get("ph") == "X")
    deep_args = text.replace(b'"args": {', b'"args": {"deep": ' + nested(DEEP).encode() + b", ", 1)
    trace("deep_args.json", deep_args, "deep")
    trace("deep_meta.json", text[:-1] + b', "distributedInfo": ' + nested(DEEP).encode() + b"}", "deep")
    trace("deep_meta_first.json", b'{"deviceProperties": ' + nested(DEEP).encode() + b", " + text[1:], "deep")
    trace("deep_event.json", b'{"traceEvents": [' + nested(DEEP).encode() + b"]}", "deep")
    trace("deep_object.json", b'{"a":' * DEEP + b"1" + b"}" * DEEP, "deep")
    del x
    # 4. gzip bombs: 2 GB of whitespace alone, inside the event array, and after it
    ws, zeros, members = b" " * (64 << 20), b"\0" * (64 << 20), {}
    trace("bomb_ws.json.gz", gz_members(b"", ws, b"", repeat_middle=32, members=members), "bomb")
    head, tail = text.split(b'"traceEvents": [', 1)
    trace(
        "bomb_in_array.json.gz",
        gz_members(head + b'"traceEvents": [', ws, tail, repeat_middle=32, members=members),
        "bomb",
    )
    first_sep = tail.index(b"}, {") + 1
    trace(
        "bomb_between_events.json.gz",
        gz_members(
            head + b'"traceEvents": [' + tail[:first_sep], ws, tail[first_sep:], repeat_middle=32, members=members
        ),
        "bomb",
    )
    trace("bomb_zeros.json.gz", gz_members(b"", zeros, b"", repeat_middle=32, members=members), "bomb")
    # issue 26: ~384 MB of real events from a small repeated pattern, decoded by the parallel
    # block reader (no -j 1): the refusal must not be lost to the ring's buffer still exported.
    # ~2.4 MB on disk, so the cap is the ratio's floor (RATIO_FLOOR, 256 MiB): refused after
    # ~128 trips round the ring of 2 MiB blocks (1 GB of events, 6.3 MB on disk, decoded 630 MB
    # before the refusal: 4.3 s of CPU instead of ~1.8)
    evs = b", ".join([json.dumps(e).encode() for e in doc["traceEvents"] if e.get("ph") == "X"][:8])
    pattern = (evs + b", ") * max(1, (8 << 20) // (len(evs) + 2))
    p = t / "bomb_events.json.gz"
    p.write_bytes(gz_members(head + b'"traceEvents": [', pattern, tail, repeat_middle=(384 << 20) // len(pattern)))
    cases.append(Case("bomb_events.json.gz", ["analyze", str(p)], str(p), "bomb"))
    # 5. special files
    fifo = t / "fifo.json"
    if not fifo.exists():
        os.mkfifo(fifo)
    cases.append(Case("fifo_trace", ["analyze", str(fifo), "-j", "1"], str(fifo), "special"))
    cases.append(Case("dev_zero_trace", ["analyze", "/dev/zero", "-j", "1"], "/dev/zero", "special"))
    cases.append(Case("dev_urandom_memory", ["memory", "/dev/urandom"], "/dev/urandom", "special"))
    good = RECORDED / "per-block" / "rank0.json.gz"
    cases.append(Case("fifo_memory", ["analyze", str(good), "-j", "1", "--memory", str(fifo)], str(fifo), "special"))
    cases.append(Case("fifo_baseline", ["check", str(good), "-j", "1", "--baseline", str(fifo)], str(fifo), "special"))
    cases.append(Case("fifo_compare", ["compare", str(fifo), str(good), "-j", "1"], str(fifo), "special"))

    # 6. snapshots
    snap = snapshot_obj()

    def memory(name: str, obj: Any = None, data: bytes | None = None, family: str = "snapshot") -> None:
        p = t / name
        p.write_bytes(data if data is not None else pickle.dumps(obj, protocol=4))
        cases.append(Case(name, ["memory", str(p)], str(p), family))

    def mutated(fn: Callable[[dict], None]) -> dict:
        s = _clone(snap)
        fn(s)
        return s

    memory(
        "snap_total_size_big.pickle",
        mutated(lambda s: s["segments"][0].__setitem__("total_size", BIG)),
        family="bigint",
    )
    memory(
        "snap_block_size_big.pickle",
        mutated(lambda s: s["segments"][0]["blocks"][0].__setitem__("size", BIG)),
        family="bigint",
    )
    memory(
        "snap_seg_address_big.pickle", mutated(lambda s: s["segments"][0].__setitem__("address", BIG)), family="bigint"
    )
    memory(
        "snap_addr_big.pickle", mutated(lambda s: s["device_traces"][0][0].__setitem__("addr", BIG)), family="bigint"
    )
    memory(
        "snap_entry_size_big.pickle",
        mutated(lambda s: s["device_traces"][0][0].__setitem__("size", BIG)),
        family="bigint",
    )
    memory(
        "snap_size_negative.pickle",
        mutated(lambda s: s["device_traces"][0][0].__setitem__("size", -BIG)),
        family="bigint",
    )
    memory(
        "snap_frames_not_dicts.pickle",
        mutated(lambda s: s["device_traces"][0][0].__setitem__("frames", [1, "x", None])),
    )
    memory(
        "snap_block_frames_not_dicts.pickle",
        mutated(lambda s: s["segments"][0]["blocks"][0].__setitem__("frames", [3, [4]])),
    )
    memory(
        "snap_frame_types.pickle",
        mutated(lambda s: s["device_traces"][0][0].__setitem__("frames", [{"name": 1, "filename": None, "line": "x"}])),
    )
    memory(
        "snap_time_us_str.pickle", mutated(lambda s: [e.__setitem__("time_us", "soon") for e in s["device_traces"][0]])
    )
    memory("snap_stream_str.pickle", mutated(lambda s: s["device_traces"][0][0].__setitem__("stream", "s")))
    memory(
        "snap_device_negative.pickle", mutated(lambda s: s["segments"][-1].__setitem__("device", -2))
    )  # found by hypothesis
    memory("snap_device_str.pickle", mutated(lambda s: s["segments"][0].__setitem__("device", "cuda:0")))
    memory("snap_settings_list.pickle", mutated(lambda s: s.__setitem__("allocator_settings", [1, 2])))
    memory(
        "snap_deep_frames.pickle",
        mutated(lambda s: s["device_traces"][0][0].__setitem__("frames", json.loads(nested(400)))),
    )
    # a 20-byte pickle whose memo index claims 2**28 entries; and a huge frame/bytes length
    memory("memo_bomb.pickle", data=b"\x80\x04]r" + struct.pack("<I", 1 << 28) + b"0N.", family="pickle")
    memory("memo_bomb_put.pickle", data=b"\x80\x02]p268435456\n0N.", family="pickle")
    memory("bytes8_claim.pickle", data=b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"xx.", family="pickle")
    memory("frame_claim.pickle", data=b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.", family="pickle")
    # memo fan-out (issue 26): one 1,000-frame list shared by 10**6 entries, 10**9 frames from 5 MB
    o = _clone(snap)
    e0 = dict(o["device_traces"][0][0])
    e0["frames"] = [{"name": "forward", "filename": "model.py", "line": 1}] * 1000
    o["device_traces"] = [[e0] * 1_000_000]
    memory("memo_fanout_frames.pickle", o, family="pickle")
    o = _clone(snap)
    s0 = o["segments"][0]
    s0["blocks"] = [s0["blocks"][0]] * 1000
    o["segments"] = [s0] * 1_000_000
    memory("memo_fanout_blocks.pickle", o, family="pickle")
    # 200k nested lists (APPENDS into each other): the unpickler does not recurse; not a snapshot
    memory("deep_pickle.pickle", data=b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b".", family="pickle")
    # 100k-deep lists where the snapshot holds free-form data (the unpickler builds them without
    # recursion; nothing may walk them recursively afterwards)
    for where in ("allocator_settings", "segment_frames", "user_metadata"):
        o = _clone(snap)
        tok = "PLACEHOLDER_FOR_DEEP_LIST"
        if where == "segment_frames":
            o["segments"][0]["frames"] = tok
        elif where == "user_metadata":
            o["device_traces"][0][0]["user_metadata"] = tok
        else:
            o[where] = tok
        pat = b"X" + struct.pack("<I", len(tok)) + tok.encode()
        memory(
            f"deep_{where}.pickle",
            data=pickle.dumps(o, protocol=2).replace(pat, b"]" * 100_000 + b"a" * 99_999),
            family="pickle",
        )
    memory(
        "snap_gz_bomb.pickle.gz",
        data=gz_members(b"\x80\x04", zeros, b"", repeat_middle=32, members=members),
        family="bomb",
    )
    del ws, zeros, members

    # 6b. Flight Recorder dumps (issue 35): named like the watchdog names them, given to analyze
    fr = fr_dump_obj()

    def dump(name: str, obj: Any = None, data: bytes | None = None, family: str = "fr") -> None:
        p = t / name
        p.write_bytes(data if data is not None else pickle.dumps(obj, protocol=2))
        cases.append(Case(name, ["analyze", str(p), "-j", "1"], str(p), family))

    def fr_mut(fn: Callable[[dict], None]) -> dict:
        o = copy.deepcopy(fr)
        fn(o)
        return o

    dump("fr_seq_big_rank_0", fr_mut(lambda o: o["entries"][2].__setitem__("collective_seq_id", BIG)), family="bigint")
    dump("fr_time_big_rank_0", fr_mut(lambda o: o["entries"][2].__setitem__("time_created_ns", -BIG)), family="bigint")
    dump("fr_sizes_big_rank_0", fr_mut(lambda o: o["entries"][2].__setitem__("input_sizes", [[BIG]])), family="bigint")
    dump("fr_version_3_rank_0", fr_mut(lambda o: o.__setitem__("version", "3.0")))
    dump("fr_version_int_rank_0", fr_mut(lambda o: o.__setitem__("version", 2)))
    dump("fr_entries_dict_rank_0", fr_mut(lambda o: o.__setitem__("entries", {"0": 1})))
    dump("fr_pg_tuple3_rank_0", fr_mut(lambda o: o["entries"][1].__setitem__("process_group", ("0", "x", "y"))))
    dump("fr_frames_not_dicts_rank_0", fr_mut(lambda o: o["entries"][1].__setitem__("frames", [1, "x", None])))
    dump("fr_deep_frames_rank_0", fr_mut(lambda o: o["entries"][1].__setitem__("frames", json.loads(nested(400)))))
    dump(
        "fr_pg_config_junk_rank_0",
        fr_mut(lambda o: o.__setitem__("pg_config", {"0": {"ranks": "[" + "1," * 100000 + "]"}})),
    )
    dump(
        "fr_pg_status_junk_rank_0",
        fr_mut(lambda o: o.__setitem__("pg_status", {"0": {"last_enqueued_collective": "9" * 5000}})),
    )
    o = copy.deepcopy(fr)  # memo fan-out: one 1,000-frame list shared by 10**5 entries
    e0 = dict(o["entries"][0])
    e0["frames"] = [{"name": "f", "filename": "x.py", "line": 1}] * 1000
    o["entries"] = [e0] * 100_000
    dump("fr_memo_fanout_rank_0", o, family="pickle")
    dump("fr_truncated_rank_0", data=pickle.dumps(fr, protocol=2)[:-200], family="truncated")
    dump("fr_json_truncated_rank_0.json", data=json.dumps(fr_dump_obj(True)).encode()[:-100], family="truncated")

    # 7. baselines
    if baseline is not None:
        raw = json.loads(baseline.read_bytes())

        def base(name: str, fn: Callable[[dict], None], family: str = "baseline") -> None:
            d = copy.deepcopy(raw)
            fn(d)
            p = t / name
            p.write_text(json.dumps(d))
            cases.append(Case(name + ":check", ["check", str(good), "-j", "1", "--baseline", str(p)], str(p), family))
            cases.append(Case(name + ":compare", ["compare", str(p), str(good), "-j", "1"], str(p), family))

        facts = (lambda d: d["facts"]) if "facts" in raw else (lambda d: d)
        base("schema_str.json", lambda d: facts(d).__setitem__("schema_version", "1"))
        base("schema_old.json", lambda d: facts(d).__setitem__("schema_version", 0))
        base("schema_new.json", lambda d: facts(d).__setitem__("schema_version", 99))
        base("fsdp_null.json", lambda d: facts(d).__setitem__("fsdp", None))
        base("fsdp_list.json", lambda d: facts(d).__setitem__("fsdp", [1, 2]))
        base("steps_str.json", lambda d: facts(d).__setitem__("steps", "fast"))
        base("rank_facts_dict.json", lambda d: facts(d).__setitem__("rank_facts", {"0": 1}))
        base("overlap_str.json", lambda d: facts(d)["overlap"].__setitem__("pct", "high"))
        base("findings_str.json", lambda d: d.__setitem__("findings", ["x"]))
        base("memory_list.json", lambda d: facts(d).__setitem__("memory", [1]))
        base("bigint_steps.json", lambda d: facts(d)["steps"].__setitem__("count", BIG), family="bigint")
        p = t / "baseline_utf8.json"
        p.write_bytes(baseline.read_bytes().replace(b'"tool": "', b'"tool": "\xff', 1))
        cases.append(
            Case("baseline_utf8.json:check", ["check", str(good), "-j", "1", "--baseline", str(p)], str(p), "utf8")
        )
        p = t / "baseline_deep.json"
        p.write_bytes(b'{"schema_version": 1, "rank_facts": [], "notes": ' + nested(DEEP).encode() + b"}")
        cases.append(
            Case("baseline_deep.json:check", ["check", str(good), "-j", "1", "--baseline", str(p)], str(p), "deep")
        )
    return cases


# ------------------------------------------------------------------------------ seeded mutations


def _paths(obj: Any, prefix: tuple = (), out: list | None = None, limit: int = 4000) -> list[tuple]:
    """Paths to every value in a JSON-like object (breadth limited)."""
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            _paths(v, prefix + (k,), out, limit)
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:50]):
            out.append(prefix + (i,))
            _paths(v, prefix + (i,), out, limit)
    return out


def _parent(obj: Any, path: tuple) -> tuple[Any, Any]:
    for k in path[:-1]:
        obj = obj[k]
    return obj, path[-1]


_SWAPS: list[Any] = [None, True, -1, 0, BIG, -BIG, 1e308, "x", "", [], {}, [1, "a"], {"k": None}, "\ud800"]


def mutate_obj(obj: Any, rng: random.Random) -> tuple[Any, str]:
    """One structure-aware mutation of a JSON-like object: type swap, missing key, huge number,
    deep nesting, duplicated or emptied container."""
    obj = copy.deepcopy(obj)
    paths = _paths(obj)
    if not paths:
        return obj, "none"
    path = rng.choice(paths)
    parent, key = _parent(obj, path)
    op = rng.choice(["swap", "swap", "drop", "big", "deep", "empty"])
    if op == "drop":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif op == "swap":
        parent[key] = rng.choice(_SWAPS)
    elif op == "big":
        parent[key] = rng.choice([BIG, -BIG, 1 << 63, -(1 << 63) - 1, float("1e400") if False else 1e300])
    elif op == "deep":
        parent[key] = json.loads(nested(rng.choice([100, 400])))
    else:
        v = parent[key]
        parent[key] = type(v)() if isinstance(v, (dict, list, str)) else None
    return obj, f"{op} {'/'.join(map(str, path))[:80]}"


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Byte-level: truncation, flipped bytes, inserted invalid UTF-8, a deleted span."""
    op = rng.choice(["truncate", "flip", "flip", "utf8", "cut"])
    n = len(data)
    if op == "truncate":
        k = rng.randrange(0, n)
        return data[:k], f"truncate at {k}"
    if op == "flip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            k = rng.randrange(n)
            b[k] ^= 1 << rng.randrange(8)
        return bytes(b), "flip"
    if op == "utf8":
        k = rng.randrange(n)
        return data[:k] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"]) + data[
            k:
        ], f"utf8 at {k}"
    k = rng.randrange(n)
    m = min(n, k + rng.randint(1, 4096))
    return data[:k] + data[m:], f"cut {k}:{m}"


def _dumps_lenient(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


def seeded_cases(work: Path, seed: int, count: int, baseline: Path | None) -> list[Case]:
    """``count`` random mutations: traces (object and byte level, plain and gzip), snapshots,
    baselines, in rotation."""
    rng = random.Random(seed)
    t = work / f"seeded-{seed}"
    t.mkdir(parents=True, exist_ok=True)
    doc = trace_doc(max_events=300)
    snap = snapshot_obj()
    snap_small = _clone(snap)
    snap_small["segments"] = snap_small["segments"][:20]
    snap_small["device_traces"] = [d[:100] for d in snap_small["device_traces"]]
    base_raw = json.loads(baseline.read_bytes()) if baseline is not None else None
    good = RECORDED / "per-block" / "rank0.json.gz"
    cases: list[Case] = []
    side = json.loads((RECORDED / "per-block" / "fsdpdoctor_meta.json").read_text())
    small_trace = json.dumps(doc).encode()
    fr = fr_dump_obj()
    kinds = [
        "trace_obj",
        "trace_bytes",
        "trace_gz",
        "snapshot_obj",
        "snapshot_bytes",
        "sidecar",
        "fr_obj",
        "fr_bytes",
    ] + (["baseline"] if base_raw else [])
    for i in range(count):
        kind = kinds[i % len(kinds)]
        cid = f"s{seed}-{i}-{kind}"
        if kind == "trace_obj":
            obj, what = mutate_obj(doc, rng)
            p = t / f"{cid}.json"
            p.write_bytes(_dumps_lenient(obj))
            argv = ["analyze", str(p), "-j", "1", "--format", "json"]
        elif kind in ("trace_bytes", "trace_gz"):
            data, what = mutate_bytes(json.dumps(doc, indent=rng.choice([None, 1])).encode(), rng)
            if kind == "trace_gz":
                data = gzip.compress(data, 1)
                if rng.random() < 0.5:
                    data, w2 = mutate_bytes(data, rng)
                    what += "; gz " + w2
            p = t / (f"{cid}.json" + (".gz" if kind == "trace_gz" else ""))
            p.write_bytes(data)
            argv = ["analyze", str(p), "-j", "1", "--format", "json"]
        elif kind == "snapshot_obj":
            obj, what = mutate_obj(snap_small, rng)
            p = t / f"{cid}.pickle"
            p.write_bytes(pickle.dumps(obj, protocol=rng.choice([2, 4, 5])))
            argv = ["memory", str(p), "--format", "json"]
        elif kind == "snapshot_bytes":
            data, what = mutate_bytes(pickle.dumps(snap_small, protocol=rng.choice([2, 4])), rng)
            p = t / f"{cid}.pickle"
            p.write_bytes(data)
            argv = ["memory", str(p), "--format", "json"]
        elif kind in ("fr_obj", "fr_bytes"):  # a Flight Recorder dump, as the watchdog names it
            if kind == "fr_obj":
                obj, what = mutate_obj(fr, rng)
                data = pickle.dumps(obj, protocol=2)
            else:
                data, what = mutate_bytes(pickle.dumps(fr, protocol=2), rng)
            p = t / f"{cid}-nccl_trace_rank_{i % 4}"
            p.write_bytes(data)
            argv = ["analyze", str(p), "-j", "1", "--format", "json"]
        elif kind == "sidecar":  # a run directory whose capture sidecar is mutated
            obj, what = mutate_obj(side, rng)
            d = t / cid
            d.mkdir(exist_ok=True)
            (d / "rank0.json").write_bytes(small_trace)
            p = d / "fsdpdoctor_meta.json"
            p.write_bytes(_dumps_lenient(obj))
            argv = ["analyze", str(d), "-j", "1", "--format", "json"]
        else:
            obj, what = mutate_obj(base_raw, rng)
            p = t / f"{cid}.json"
            p.write_bytes(_dumps_lenient(obj))
            argv = (
                ["check", str(good), "-j", "1", "--baseline", str(p)]
                if i % 2
                else ["compare", str(p), str(good), "-j", "1"]
            )
        cases.append(Case(f"{cid}: {what}", argv, str(p), kind))
    return cases
