"""The streaming block decoder gives exactly what the whole-file reference decoder gives.

``load_trace`` (blocks) and ``load_trace_whole`` (one typed decode of the whole file, the old
definition) must agree on every RankTrace field, for real traces, for odd but valid layouts, and
on the error message for bad input. Small chunk sizes force many blocks and cuts that land
inside strings and nested objects.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest import blocks
from fsdpdoctor.ingest.kineto import load_trace, load_trace_whole, progress_hook

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PUBLIC = sorted((SHARED / "traces" / "public").glob("*/*.json.gz")) if (SHARED / "traces" / "public").is_dir() else []
RECORDED = sorted((REPO / "fixtures" / "recorded").glob("*/rank*.json.gz"))


def assert_same(a, b, *, mode: bool = True) -> None:
    for f in dataclasses.fields(a):
        if (f.name == "decode_mode" and not mode) or not f.compare:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert x == y, f.name


@pytest.fixture(params=[None, 4096, 333], ids=["default-chunks", "4k-chunks", "333b-chunks"])
def chunk(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(blocks, "CHUNK_BYTES", request.param)
    return request.param


def _both(path: Path):
    return load_trace(path), load_trace_whole(path)


# ---------------------------------------------------------------------------------------------
# real traces
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not PUBLIC, reason="../shared/traces/public not present")
@pytest.mark.parametrize("path", PUBLIC, ids=lambda p: f"{p.parent.name}/{p.name[:24]}")
def test_public_traces_identical(path):
    a, b = _both(path)
    assert a.decode_mode == "typed"
    assert_same(a, b)


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recorded_traces_identical(path):
    assert_same(*_both(path))


def test_recorded_trace_identical_with_tiny_blocks(chunk):
    assert_same(*_both(RECORDED[0]))


# ---------------------------------------------------------------------------------------------
# layouts: compact JSON, metadata after the events, a bare array, awkward strings
# ---------------------------------------------------------------------------------------------


def _events_doc(path: Path) -> dict:
    with gzip.open(path, "rb") as fh:
        return json.loads(fh.read())


def test_compact_json_without_newlines(tmp_path, chunk):
    doc = _events_doc(RECORDED[0])
    p = tmp_path / "compact.json"
    p.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    assert b"\n" not in p.read_bytes()
    a, b = _both(p)
    assert_same(a, b)
    assert len(a) > 1000


def test_metadata_after_trace_events(tmp_path, chunk):
    doc = _events_doc(RECORDED[0])
    reordered = {"traceEvents": doc.pop("traceEvents"), **doc, "traceName": "/tmp/after.json"}
    reordered["deviceProperties"] = [{"id": 0, "name": "GPU A"}, {"id": 1, "name": "GPU B"}]
    p = tmp_path / "after.json"
    p.write_text(json.dumps(reordered, indent=1))
    a, b = _both(p)
    assert_same(a, b)
    assert a.trace_name == "/tmp/after.json"
    assert a.rank == 0 and a.rank_source == "distributedInfo"
    assert a.device_properties[1]["name"] == "GPU B"


def test_metadata_split_around_trace_events(tmp_path, chunk):
    doc = _events_doc(RECORDED[0])
    events = doc.pop("traceEvents")
    dinfo = doc.pop("distributedInfo")
    split = {"schemaVersion": 1, "traceEvents": events, "distributedInfo": dinfo, "traceName": "x"}
    p = tmp_path / "split.json.gz"
    p.write_bytes(gzip.compress(json.dumps(split).encode()))
    a, b = _both(p)
    assert_same(a, b)
    assert a.distributed_info == dinfo


def test_top_level_array(tmp_path, chunk):
    events = _events_doc(RECORDED[0])["traceEvents"]
    p = tmp_path / "rank3.json"
    p.write_text(json.dumps(events, indent=2))
    a, b = _both(p)
    assert_same(a, b)
    assert a.rank == 3 and a.rank_source == "file name"


AWKWARD_NAMES = [
    'weird},{"ph": "X"}, {name',
    'quote " and }, { and \\ and \\" end',
    "newline\nand tab\t},\n  {",
    "unicode é ✓ 名前 \u2028",
    "}",
    "},{",
]


def _awkward_trace(n: int = 400) -> dict:
    evs = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "thread 2 (main)"}}]
    for i in range(n):
        name = AWKWARD_NAMES[i % len(AWKWARD_NAMES)] + f" #{i % 7}"
        args = {"External id": i, "note": "a},{b", "nested": [{"k": "},{"}, {"k": [1, {"x": "}, {"}]}]}
        if i % 5 == 0:
            args.update(
                {
                    "Collective name": "allreduce",
                    "In msg nelems": 10,
                    "Out msg nelems": 10,
                    "dtype": "Float",
                    "Process Group Ranks": [0, 1],
                    "Group size": 2,
                }
            )
        if i % 11 == 0:
            args.update({"Input Dims": [[3, 4], []], "Input type": ["float", "Scalar"]})
        cat = ["cpu_op", "kernel", "python_function", "user_annotation"][i % 4]
        evs.append(
            {
                "ph": "X",
                "cat": cat,
                "name": "c10d::allreduce_" if i % 11 == 0 else name,
                "pid": 1,
                "tid": 2 + i % 3,
                "ts": 1000.5 + i,
                "dur": 2.25,
                "args": args,
            }
        )
        if i % 3 == 0:
            evs.append(
                {"ph": "f", "id": i, "pid": 1, "tid": 2, "ts": 1000.0 + i, "cat": "ac2g", "name": "ac2g", "bp": "e"}
            )
    evs.append(
        {"ph": "X", "cat": "kernel", "name": "null args", "pid": 0, "tid": 7, "ts": 5.0, "dur": 1.0, "args": None}
    )
    evs.append(
        {
            "ph": "X",
            "cat": "kernel",
            "name": "null id",
            "pid": 0,
            "tid": 7,
            "ts": 6.0,
            "dur": -1.0,
            "args": {"External id": None, "stream": 7, "bytes": "4096"},
        }
    )
    evs.append(
        {"ph": "X", "cat": "Trace", "name": "span", "pid": "Spans", "tid": "PyTorch Profiler", "ts": 1.0, "dur": 9.0}
    )
    return {"schemaVersion": 1, "distributedInfo": {"rank": 1, "world_size": 2}, "traceEvents": evs}


@pytest.mark.parametrize("indent", [None, 2], ids=["compact", "pretty"])
def test_strings_with_separators_escapes_and_nested_objects(tmp_path, chunk, indent):
    p = tmp_path / "awkward.json"
    p.write_text(json.dumps(_awkward_trace(), indent=indent, ensure_ascii=indent is None))
    a, b = _both(p)
    assert_same(a, b)
    assert set(AWKWARD_NAMES) <= {n.rsplit(" #", 1)[0] for n in a.names}
    assert "python_function" not in a.cats
    assert a.thread_names == {(1, 2): "thread 2 (main)"}
    assert a.args and all(isinstance(v, type(next(iter(a.args.values())))) for v in a.args.values())


def test_lenient_fallback_matches_reference(tmp_path, chunk):
    doc = _awkward_trace(100)
    x = [e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("args")][40]
    x["args"]["External id"] = "12"  # a string where the schema says int
    p = tmp_path / "lenient.json"
    p.write_text(json.dumps(doc, indent=2))
    a, b = _both(p)
    assert a.decode_mode == b.decode_mode == "lenient"
    assert_same(a, b)


def test_unknown_phase_is_read_leniently(tmp_path):
    doc = _awkward_trace(50)
    doc["traceEvents"].insert(10, {"ph": "Z", "name": "not in the Chrome format", "pid": 1, "tid": 2, "ts": 1.0})
    p = tmp_path / "phase.json"
    p.write_text(json.dumps(doc, indent=2))
    a, b = _both(p)
    assert a.decode_mode == "lenient"
    for col in ("cat", "name", "thread", "ts", "dur", "external_id", "correlation", "stream"):
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col))
    assert (a.names, a.threads, a.event_count, sorted(a.args)) == (b.names, b.threads, b.event_count, sorted(b.args))


def test_progress_hook_reports_bytes_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(blocks, "CHUNK_BYTES", 4096)
    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress(json.dumps(_awkward_trace()).encode()))
    seen: list[tuple[int, int]] = []
    with progress_hook(lambda d, t: seen.append((d, t))):
        load_trace(p)
    size = p.stat().st_size
    assert len(seen) > 3
    assert all(t == size for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1][0] == size


# ---------------------------------------------------------------------------------------------
# bad input: the same message as the whole-file decoder
# ---------------------------------------------------------------------------------------------


def _errors(path: Path) -> tuple[str, str]:
    with pytest.raises(InputError) as e1:
        load_trace(path)
    with pytest.raises(InputError) as e2:
        load_trace_whole(path)
    return str(e1.value), str(e2.value)


def _pretty_bytes(n: int = 300) -> bytes:
    return json.dumps(_awkward_trace(n), indent=2).encode()


def _at(data: bytes, where: float, old: bytes, new: bytes) -> bytes:
    """Replace the first ``old`` after the fraction ``where`` of the data."""
    i = data.index(old, int(len(data) * where))
    return data[:i] + new + data[i + len(old) :]


def test_truncated_gzip(tmp_path, chunk):
    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress(_pretty_bytes())[:-2000])
    got, want = _errors(p)
    assert got == want and "truncated or corrupt gzip data" in got


@pytest.mark.parametrize("cut", [0.3, 0.5, 0.9, 0.999])
def test_truncated_json_mid_block(tmp_path, chunk, cut):
    data = _pretty_bytes()
    p = tmp_path / "t.json"
    p.write_bytes(data[: int(len(data) * cut)])
    got, want = _errors(p)
    assert got == want and "truncated JSON" in got


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d.replace(b'"dur": 2.25', b'"dur": 2.2.5', 1),
        lambda d: _at(d, 0.5, b'"ph": "X"', b'"ph": "X" @@'),
        lambda d: _at(d, 0.75, b"},\n    {", b"},,\n    {"),
        lambda d: d + b"trailing garbage",
        lambda d: d.replace(b'"traceEvents": [', b'"traceEvents": [,', 1),
    ],
    ids=["bad-number", "garbage-mid-file", "double-comma", "trailing-garbage", "leading-comma"],
)
def test_malformed_json_reports_like_the_whole_file_decoder(tmp_path, chunk, damage):
    p = tmp_path / "t.json"
    p.write_bytes(damage(_pretty_bytes()))
    got, want = _errors(p)
    assert got == want and "not valid JSON" in got


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"  \n ",
        b"42",
        b'{"hello": 1}',
        b'{"traceEvents": []}',
        b'{"traceEvents": null}',
        b"[]",
        b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "x"}}]}',
        b'{"a": "\\"traceEvents\\": [", "traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 1}]',
    ],
    ids=[
        "empty",
        "blank",
        "scalar",
        "no-events-key",
        "zero-events",
        "null-events",
        "empty-array",
        "only-metadata",
        "key-inside-a-string-then-truncated",
    ],
)
def test_degenerate_documents(tmp_path, content):
    p = tmp_path / "t.json"
    p.write_bytes(content)
    got, want = _errors(p)
    assert got == want


def test_key_inside_a_string_is_not_the_event_array(tmp_path, chunk):
    doc = {"note": '"traceEvents": [{"ph": "X"}]', "nested": {"traceEvents": [1, 2]}, **_awkward_trace(30)}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    assert_same(*_both(p))


# Every argument the block decoder keeps, written by hand: the shapes with odd spacing (they must
# come back as the file's own text), an id of -2**63 (the decoder's "absent"), a byte count as a
# string (ROCm) and one that is not a number.
_KEPT_EVENTS = [
    '{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather", "pid": 1, "tid": 2, "ts": 1.0, "dur": 2.0, '
    '"args": {"External id": -9223372036854775808, "correlation": 5, "stream": 7, "device": 0, '
    '"Collective name": "allgather", "In msg nelems": 3, "Out msg nelems": 6, "Group size": 2, "dtype": "BFloat16", '
    '"Process Group Name": "0", "Process Group Description": "default_pg", "Process Group Ranks": [0, 1], '
    '"bytes": "4096", "name": "x", "external id": 9, "grid": [ 4,1,  1 ], "other": {"k": [1, 2]}}}',
    '{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 3.0, "dur": 1.0, '
    '"args": {"External id": 11, "Input Dims": [[2,  3], [3, 4]], "Input type": ["c10::BFloat16", "c10::BFloat16"], '
    '"Concrete Inputs": ["", ""], "Input Strides": [[3, 1], [4, 1]]}}',
    '{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 1, "tid": 3, "ts": 4.0, "dur": 1.0, '
    '"args": {"External id": 12, "correlation": 13, "stream": 7, "bytes": "many"}}',
    '{"ph": "X", "cat": "cpu_op", "name": "aten::relu", "pid": 1, "tid": 2, "ts": 5.0, "dur": 1.0, '
    '"args": {"External id": 14, "Input Dims": [[2, 3]]}}',
]
_KEPT_EXPECTED = {  # row -> the non-None fields of its events.Args
    0: {
        "correlation": 5,
        "stream": 7,
        "device": 0,
        "collective": "allgather",
        "in_nelems": 3,
        "out_nelems": 6,
        "group_size": 2,
        "dtype": "BFloat16",
        "pg_name": "0",
        "pg_desc": "default_pg",
        "pg_ranks": [0, 1],
        "nbytes": 4096,
        "name": "x",
        "external_id_lc": 9,
        "grid": b"[ 4,1,  1 ]",
    },
    1: {
        "external_id": 11,
        "input_dims": b"[[2,  3], [3, 4]]",
        "input_type": b'["c10::BFloat16", "c10::BFloat16"]',
        "concrete_inputs": b'["", ""]',
    },
    2: {"external_id": 12, "correlation": 13, "stream": 7},  # "many" bytes: no count
}


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "workers"])
def test_kept_args_are_the_files_own(tmp_path, monkeypatch, workers):
    """The args of kept rows (collectives, byte counts, shapes) travel from the block decoder to
    the trace as one JSON payload a block: each field comes back as the file wrote it."""
    if workers:
        monkeypatch.setattr(blocks, "CHUNK_BYTES", 256)
        monkeypatch.setattr(blocks, "PARALLEL_AFTER", 0)
    p = tmp_path / "kept.json"
    p.write_text('{"traceEvents": [\n' + ",\n".join(_KEPT_EVENTS) + "\n]}")
    rt = load_trace(p, workers=workers)
    got = {
        row: {
            f: (bytes(v) if isinstance(v, msgspec.Raw) else v)
            for f in a.__struct_fields__
            if (v := getattr(a, f)) is not None
        }
        for row, a in rt.args.items()
    }
    assert got == _KEPT_EXPECTED
    # row 0: -2**63 is the decoder's "absent", so its lowercase id is read; row 3 keeps nothing
    assert rt.external_id.tolist() == [9, 11, 12, 14]


def test_raw_args_are_private_copies():
    rt = load_trace(RECORDED[0])
    raws = [a.input_dims for a in rt.args.values() if a.input_dims is not None]
    assert raws
    for r in raws:
        assert isinstance(msgspec.json.decode(r), list)


# ---------------------------------------------------------------------------------------------
# blocks decoded in worker processes (files read by the workers, or .gz piped to them)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def parallel(monkeypatch):
    monkeypatch.setattr(blocks, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(blocks, "PARALLEL_AFTER", 0)


def _parallel_and_whole(path: Path):
    return load_trace(path, workers=2), load_trace_whole(path)


@pytest.mark.parametrize("gz", [False, True], ids=["json", "gz"])
@pytest.mark.parametrize("indent", [None, 2], ids=["compact", "pretty"])
def test_parallel_workers_identical(tmp_path, parallel, gz, indent):
    data = json.dumps(_awkward_trace(600), indent=indent).encode()
    p = tmp_path / ("t.json.gz" if gz else "t.json")
    p.write_bytes(gzip.compress(data) if gz else data)
    assert_same(*_parallel_and_whole(p))


@pytest.mark.parametrize("gz", [False, True], ids=["json", "gz"])
def test_parallel_workers_identical_on_a_recorded_trace(tmp_path, parallel, gz):
    data = gzip.decompress(RECORDED[0].read_bytes())
    p = tmp_path / ("rank0.json.gz" if gz else "rank0.json")
    p.write_bytes(gzip.compress(data) if gz else data)
    assert_same(*_parallel_and_whole(p))


def test_parallel_workers_metadata_after_events(tmp_path, parallel):
    doc = _awkward_trace(300)
    doc = {"traceEvents": doc.pop("traceEvents"), **doc, "deviceProperties": [{"id": i} for i in range(50)]}
    p = tmp_path / "after.json"
    p.write_text(json.dumps(doc, indent=2))
    assert_same(*_parallel_and_whole(p))


def test_parallel_workers_lenient(tmp_path, parallel):
    doc = _awkward_trace(300)
    [e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("args")][200]["args"]["stream"] = "7"
    p = tmp_path / "lenient.json"
    p.write_text(json.dumps(doc, indent=2))
    a, b = _parallel_and_whole(p)
    assert a.decode_mode == "lenient"
    assert_same(a, b)


@pytest.mark.parametrize("gz", [False, True], ids=["json", "gz"])
@pytest.mark.parametrize(
    "damage",
    [lambda d: _at(d, 0.6, b'"ph": "X"', b'"ph": "X" @@'), lambda d: d[: len(d) * 2 // 3]],
    ids=["malformed", "truncated"],
)
def test_parallel_workers_errors(tmp_path, parallel, gz, damage):
    data = damage(_pretty_bytes(600))
    p = tmp_path / ("t.json.gz" if gz else "t.json")
    p.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(InputError) as e1:
        load_trace(p, workers=2)
    with pytest.raises(InputError) as e2:
        load_trace_whole(p)
    assert str(e1.value) == str(e2.value)


# ---------------------------------------------------------------------------------------------
# long blank runs (issue 15: the reader must not rescan what it has searched)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["before-array", "in-array", "around-comma", "after-array"])
def test_long_blank_runs_read_like_the_whole_file(tmp_path, chunk, where):
    """Blank runs many chunks long before the array, before the first event, on both sides of a
    separator's comma (so the separator spans chunks) and after the array: the block reader's
    incremental separator search must find the same events as one whole-file decode."""
    doc = _events_doc(RECORDED[0])
    doc["traceEvents"] = doc["traceEvents"][:300]
    text = json.dumps(doc, indent=1).encode()
    blank = b" \n\t" * (20_000 if chunk else 1_500_000)  # 60 kB for small chunks, 4.5 MB for default
    head, tail = text.split(b'"traceEvents": [', 1)
    if where == "before-array":
        text = blank + text
    elif where == "in-array":
        text = head + b'"traceEvents": [' + blank + tail
    elif where == "around-comma":
        k = tail.index(b"},") + 1
        j = tail.index(b"},", k + 50000 if len(tail) > k + 60000 else k + 1) + 1
        tail = tail[:k] + blank + b"," + blank + tail[k + 1 : j] + blank + tail[j:]
        text = head + b'"traceEvents": [' + tail
    else:
        text = text + blank
    p = tmp_path / "blank.json"
    p.write_bytes(text)
    a, b = _both(p)
    assert_same(a, b)
    assert a.event_count == 300


@pytest.mark.parametrize("gz", [False, True], ids=["json", "gz"])
def test_parallel_workers_blanks_around_every_comma(tmp_path, parallel, gz):
    """Valid JSON with blanks between each event's ``}`` and its ``,``: every cut the workers'
    paths make must leave the ``,`` out of the next block."""
    doc = _events_doc(RECORDED[0])
    doc["traceEvents"] = doc["traceEvents"][:1500]
    data = json.dumps(doc, indent=1).encode().replace(b"},\n", b"}\n  \t,\n")
    p = tmp_path / ("t.json.gz" if gz else "t.json")
    p.write_bytes(gzip.compress(data) if gz else data)
    a, b = _parallel_and_whole(p)
    assert_same(a, b)
    assert a.event_count == 1500
