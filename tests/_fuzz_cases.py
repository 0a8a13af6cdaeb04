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


def gz_members(*parts: bytes, repeat_middle: int = 1) -> bytes:
    """A multi-member gzip (what ``zcat`` reads as one stream); the middle part is repeated as
    identical members, so a few MB on disk can expand to GBs without compressing GBs."""
    head, *mid, tail = parts if len(parts) >= 2 else (parts[0], b"")
    out = [gzip.compress(head, 1)]
    for m in mid:
        member = gzip.compress(m, 9)
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
    ws = b" " * (64 << 20)
    trace("bomb_ws.json.gz", gz_members(b"", ws, b"", repeat_middle=32), "bomb")
    head, tail = text.split(b'"traceEvents": [', 1)
    trace("bomb_in_array.json.gz", gz_members(head + b'"traceEvents": [', ws, tail, repeat_middle=32), "bomb")
    first_sep = tail.index(b"}, {") + 1
    trace(
        "bomb_between_events.json.gz",
        gz_members(head + b'"traceEvents": [' + tail[:first_sep], ws, tail[first_sep:], repeat_middle=32),
        "bomb",
    )
    trace("bomb_zeros.json.gz", gz_members(b"", b"\0" * (64 << 20), b"", repeat_middle=32), "bomb")
    # issue 26: ~1 GB of real events from a small repeated pattern, decoded by the parallel
    # block reader (no -j 1): the refusal must not be lost to the ring's buffer still exported
    evs = b", ".join([json.dumps(e).encode() for e in doc["traceEvents"] if e.get("ph") == "X"][:8])
    pattern = (evs + b", ") * max(1, (8 << 20) // (len(evs) + 2))
    p = t / "bomb_events.json.gz"
    p.write_bytes(gz_members(head + b'"traceEvents": [', pattern, tail, repeat_middle=(1 << 30) // len(pattern)))
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
        s = copy.deepcopy(snap)
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
    o = copy.deepcopy(snap)
    e0 = dict(o["device_traces"][0][0])
    e0["frames"] = [{"name": "forward", "filename": "model.py", "line": 1}] * 1000
    o["device_traces"] = [[e0] * 1_000_000]
    memory("memo_fanout_frames.pickle", o, family="pickle")
    o = copy.deepcopy(snap)
    s0 = o["segments"][0]
    s0["blocks"] = [s0["blocks"][0]] * 1000
    o["segments"] = [s0] * 1_000_000
    memory("memo_fanout_blocks.pickle", o, family="pickle")
    # 200k nested lists (APPENDS into each other): the unpickler does not recurse; not a snapshot
    memory("deep_pickle.pickle", data=b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b".", family="pickle")
    # 100k-deep lists where the snapshot holds free-form data (the unpickler builds them without
    # recursion; nothing may walk them recursively afterwards)
    for where in ("allocator_settings", "segment_frames", "user_metadata"):
        o = copy.deepcopy(snap)
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
        "snap_gz_bomb.pickle.gz", data=gz_members(b"\x80\x04", b"\0" * (64 << 20), b"", repeat_middle=32), family="bomb"
    )

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
    snap_small = copy.deepcopy(snap)
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
