"""Fuzz suite: hostile and mutated inputs through the real CLI, each case in its own process.

Cases (``tests/_fuzz_cases.py``): the named hostile inputs of issue 15 (invalid UTF-8, integers
past 64 bits, nesting 10k deep, gzip bombs expanding to 2 GiB, FIFOs and devices, memo-index
pickle bombs, wrongly typed snapshot and baseline fields) and seeded structure-aware mutations of
the real recorded traces, the real memory snapshot and a saved baseline (truncation, byte flips,
type swaps, missing keys, huge numbers, deep nesting).

Each case runs ``fsdpdoctor`` in a child forked by ``tests/_fuzz_runner.py`` (after the runner
has analysed a clean input of the same kind once, so the children do not import the analysis
again; the case files lie in ``_suitefuzz_quiet`` folders, whose parents the layout detection
scans in no time) and must: exit 0
(a mutation that is still valid input), 1 (a ``check`` gate) or 2; on 2, print exactly one line on
stderr that names the input; never print a traceback or reach the internal-error handler; finish
within ``MAX_SECONDS`` of its own CPU time (user + sys: wall time on a loaded 2-core machine
measures the machine: a bomb case took 11.3 s of wall time in CI while the suite recorded its runs;
a case that waits forever is ended by the runner's alarm, ``ALARM_S``, and fails on its exit
status) with a peak RSS under ``MAX_RSS_MB`` (the kernel's ``ru_maxrss``).

CI runs the named cases and ``CI_SEEDED`` seeded ones (well under a minute). For a longer local
run: ``FSDPDOCTOR_FUZZ_CASES=5000 FSDPDOCTOR_FUZZ_SEED=7 pytest tests/test_fuzz.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_in_process

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fuzz_cases import (  # noqa: E402
    RECORDED,
    Case,
    fr_dump_obj,
    fr_field_cases,
    gpu_cases,
    gpu_trace_doc,
    named_cases,
    seeded_cases,
    snapshot_obj,
    trace_doc,
)
from _suitefuzz_quiet import quiet_dir  # noqa: E402

RUNNER = Path(__file__).resolve().parent / "_fuzz_runner.py"
MAX_SECONDS = 10.0
MAX_RSS_MB = 1536
CI_SEEDED = 150
# named cases that are valid input after all: invalid UTF-8 inside a label is replaced, a float
# past 2**64 is still a float, a string device id falls back to the default, an unknown
# allocator_settings shape is ignored
MAY_PASS = {
    "utf8_label.json",
    "utf8_label.json.gz",
    "utf8_key.json",
    "bigint_ts.json",
    "snap_device_str.pickle",
    "snap_settings_list.pickle",
    "bigint_steps.json:check",
    "bigint_steps.json:compare",
    # deep lists in fields the analysis does not read are carried, not refused
    "deep_allocator_settings.pickle",
    "deep_segment_frames.pickle",
    "deep_user_metadata.pickle",
    # a Flight Recorder dump's pg_config ranks and pg_status counters are read leniently (junk: not used)
    "fr_pg_config_junk_rank_0",
    "fr_pg_status_junk_rank_0",
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def baseline(work) -> Path:
    """A real baseline: the report JSON 'analyze --save-baseline' writes for a recorded run."""
    from fsdpdoctor.api import analyze

    p = work / "baseline.json"
    p.write_text(analyze([str(RECORDED / "per-block")], jobs=1).to_json())
    return p


@pytest.fixture(scope="module")
def warm(work, request):
    """kind -> the CLI arguments of a clean input of that kind (the unmutated seeds of the cases),
    which the runner analyses once before it forks the cases (``_fuzz_runner``: warm). Each
    input is written when first asked for; the baseline kinds build the ``baseline`` fixture."""
    d = quiet_dir(work, "warm")
    good = str(RECORDED / "per-block" / "rank0.json.gz")

    def write(name: str, data: bytes) -> str:
        p = d / name
        p.parent.mkdir(exist_ok=True)
        if not p.exists():
            p.write_bytes(data)
        return str(p)

    def get(kind: str) -> list[str]:
        if kind == "trace":
            return ["analyze", write("rank0.json", json.dumps(trace_doc()).encode()), "-j", "1", "--format", "json"]
        if kind == "gpu":
            p = write("gpu/rank0.json", json.dumps(gpu_trace_doc()).encode())
            return ["analyze", p, "-j", "1", "--format", "json"]
        if kind == "memory":
            return ["memory", write("snap.pickle", pickle.dumps(snapshot_obj(), protocol=4)), "--format", "json"]
        if kind == "fsdp1":
            from _suitefuzz_fields import fsdp1_step_doc

            p = write("fsdp1/rank0.json", json.dumps(fsdp1_step_doc()).encode())
            return ["analyze", p, "-j", "1", "--format", "json"]
        if kind == "fr":
            p = write("nccl_trace_rank_0", pickle.dumps(fr_dump_obj(), protocol=2))
            return ["analyze", p, "-j", "1", "--format", "json"]
        baseline = str(request.getfixturevalue("baseline"))
        if kind == "compare":
            return ["compare", baseline, good, "-j", "1", "--format", "json"]
        assert kind == "check", kind
        return ["check", good, "-j", "1", "--baseline", baseline]

    return get


def run_cases(cases: list[Case], work: Path, warm: list[list[str]] = ()) -> list[dict]:
    cases_file, results_file = work / "cases.json", work / "results.json"
    cases_file.write_text(json.dumps({"warm": list(warm), "cases": [{"id": c.id, "argv": c.argv} for c in cases]}))
    subprocess.run([sys.executable, str(RUNNER), str(cases_file), str(results_file)], check=True, timeout=900)
    return json.loads(results_file.read_text())


def problems(case: Case, r: dict, must_refuse: bool) -> list[str]:
    out = []
    lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
    if "Traceback" in r["stderr"] or "internal error" in r["stderr"]:
        out.append("crashed")
    if r["code"] not in ((2,) if must_refuse else (0, 1, 2)):
        out.append(f"exit {r['code']}")
    if r["code"] == 2 and (len(lines) != 1 or case.names not in lines[0]):
        out.append(f"{len(lines)} stderr lines, input named: {bool(lines) and case.names in lines[0]}")
    if r["cpu_s"] > MAX_SECONDS:  # the case's own CPU; a wait that never ends meets the runner's alarm (exit -14)
        out.append(f"{r['cpu_s']:.1f} s CPU ({r['wall_s']:.1f} s wall)")
    if r["maxrss_kb"] > MAX_RSS_MB * 1024:
        out.append(f"{r['maxrss_kb'] // 1024} MB RSS")
    return [f"{case.id}: {', '.join(out)} :: {(lines[-1] if lines else '')[:160]}"] if out else []


def test_named_hostile_inputs(work, baseline, warm):
    cases = named_cases(quiet_dir(work, "named"), baseline)
    families = {c.family for c in cases}
    assert {"utf8", "bigint", "deep", "bomb", "special", "snapshot", "pickle", "baseline"} <= families
    results = run_cases(cases, work, [warm(k) for k in ("trace", "memory", "fr", "compare", "check")])
    assert len(results) == len(cases)
    bad = [p for c, r in zip(cases, results) for p in problems(c, r, must_refuse=c.id not in MAY_PASS)]
    assert not bad, "\n".join(bad)
    by_id = {c.id: r for c, r in zip(cases, results)}
    # the bombs are refused for what they are, not for what the bytes they produced look like
    for cid in ("bomb_ws.json.gz", "bomb_in_array.json.gz", "bomb_between_events.json.gz", "snap_gz_bomb.pickle.gz"):
        assert "likely a gzip bomb" in by_id[cid]["stderr"], by_id[cid]["stderr"]
    assert "likely a gzip bomb" in by_id["bomb_events.json.gz"]["stderr"], by_id["bomb_events.json.gz"]["stderr"]
    for cid, field in (("ts_1e30.json", "'ts'"), ("dur_1e30.json", "'dur'")):
        assert field in by_id[cid]["stderr"] and "range of a trace clock" in by_id[cid]["stderr"], by_id[cid]["stderr"]
    for cid in ("memo_fanout_frames.pickle", "memo_fanout_blocks.pickle", "fr_memo_fanout_rank_0"):
        assert "shared references" in by_id[cid]["stderr"], by_id[cid]["stderr"]
    assert "named pipe" in by_id["fifo_trace"]["stderr"] and "character device" in by_id["dev_zero_trace"]["stderr"]
    assert "regenerate it with 'fsdpdoctor analyze" in by_id["schema_str.json:check"]["stderr"]


def read_or_refused(cases: list[Case], work: Path, warm: list[list[str]]) -> dict[str, dict]:
    """Run ``cases`` and hold each to "read, or refused in one line naming the file, never an
    internal error" (:func:`problems`); each case's result by id."""
    results = run_cases(cases, work, warm)
    assert len(results) == len(cases)
    bad = [p for c, r in zip(cases, results) for p in problems(c, r, must_refuse=False)]
    assert not bad, "\n".join(bad)
    return {c.id: r for c, r in zip(cases, results)}


def test_gpu_trace_fields(work, warm):
    """Every field of a real GPU trace that the compute, MFU and waterfall analyses and the kernel
    classes read, hostile: read (exit 0) or refused in one line naming the file, never an internal
    error. A ``deviceProperties`` name that is not a string (issue 44: exit 3) is an unknown device."""
    cases = gpu_cases(quiet_dir(work, "gpu"))
    assert {"gpu", "deviceProperties", "shapes", "labels"} <= {c.family for c in cases}
    by_id = read_or_refused(cases, work, [warm("gpu")])
    for cid in ("dp_name_int.json", "dp_name_list.json", "dp_mem_str.json", "dp_entries_not_dicts.json"):
        assert by_id[cid]["code"] == 0, by_id[cid]["stderr"]
        rf = json.loads(by_id[cid]["stdout"])["rank_facts"][0]
        assert rf["device_name"] in (None, "NVIDIA H100 80GB HBM3"), rf["device_name"]
    # the name is unknown, the memory (85,017,493,504 bytes in the trace) still read
    rf = json.loads(by_id["dp_name_int.json"]["stdout"])["rank_facts"][0]
    assert rf["device_name"] is None and rf["device_memory_bytes"] == 85_017_493_504
    rf = json.loads(by_id["dp_mem_str.json"]["stdout"])["rank_facts"][0]
    assert rf["device_name"] == "NVIDIA H100 80GB HBM3" and rf["device_memory_bytes"] is None


def test_collective_memory_and_metadata_fields(work, warm):
    """The fields the GPU field cases do not reach (issue 44 item 5; ``_suitefuzz_fields``): a
    real FSDP1 H100 step's collective fields (Collective name, message sizes, group size, dtype,
    process group name, description and ranks, their shapes), the launch grid, the lowercase
    external id, ``[memory]`` events, metadata names, distributedInfo and its process groups and
    the other top-level keys: each hostile in turn is read (exit 0) or refused in one line naming
    the file, never an internal error. A negative Total Allocated was one (exit 3)."""
    from _suitefuzz_fields import field_cases

    cases = field_cases(quiet_dir(work, "fields"))
    assert {"collectives", "kernels", "memory", "meta"} <= {c.family for c in cases}
    by_id = read_or_refused(cases, work, [warm("fsdp1")])
    # sizes past 64 bits are refused for what they are; an unknown collective is read
    for cid in ("coll_in_msg_nelems_big.json", "coll_group_size_big.json", "memory_total_allocated_big.json"):
        assert by_id[cid]["code"] == 2 and "64-bit" in by_id[cid]["stderr"], by_id[cid]["stderr"]
    assert by_id["coll_collective_name_unknown.json"]["code"] == 0


def test_flight_recorder_fields(work, warm):
    """Every field of a Flight Recorder dump, hostile, one at a time: the hang diagnosis reads
    it or refuses it in one line naming the dump, never an internal error."""
    cases = fr_field_cases(quiet_dir(work, "fr"))
    codes = [r["code"] for r in read_or_refused(cases, work, [warm("fr")]).values()]
    assert codes.count(2) > 0 and codes.count(0) + codes.count(1) > 0


def test_seeded_mutations(work, baseline, warm):
    seed = int(os.environ.get("FSDPDOCTOR_FUZZ_SEED", "15"))
    count = int(os.environ.get("FSDPDOCTOR_FUZZ_CASES", str(CI_SEEDED)))
    cases = seeded_cases(quiet_dir(work, "seeded"), seed, count, baseline)
    results = run_cases(cases, work, [warm(k) for k in ("trace", "memory", "fr", "compare", "check")])
    bad = [p for c, r in zip(cases, results) for p in problems(c, r, must_refuse=False)]
    assert not bad, "\n".join(bad)
    codes = [r["code"] for r in results]
    # the mutations are not all harmless: most break the input, some leave it valid
    assert codes.count(2) > len(codes) // 3 and codes.count(0) > 0


def test_invalid_utf8_in_labels_keeps_every_event(work):
    """Lenient where the string is only a label: the same events as the clean file, one name
    carrying U+FFFD."""
    from fsdpdoctor.ingest.kineto import load_trace, load_trace_whole

    doc = trace_doc()
    text = json.dumps(doc).encode()
    i = text.index(b'"name": "') + 9
    p = work / "utf8_rank0.json"
    p.write_bytes(text[:i] + b"\xff" + text[i:])
    n_x = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "python_function")
    for load in (load_trace, load_trace_whole):
        rt = load(p)
        assert rt.event_count == len(doc["traceEvents"])
        assert len(rt) == n_x
        assert any(n.startswith("\ufffd") for n in rt.names)


# -- property-based: hypothesis draws the mutation, the CLI runs in this process ------------------
# Each example must end in exit 0, 1 or 2, never in the internal-error handler (exit 3). CI runs a
# few derandomized examples per kind; FSDPDOCTOR_FUZZ_EXAMPLES=2000 for a long local run.

import copy  # noqa: E402
import gzip  # noqa: E402
import itertools  # noqa: E402
import shutil  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("FSDPDOCTOR_FUZZ_EXAMPLES", "25"))
_LONG = "FSDPDOCTOR_FUZZ_EXAMPLES" in os.environ
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not _LONG,
    database=None,
    suppress_health_check=list(HealthCheck),
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 80), max_value=1 << 80)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


_cli_code = cli_in_process  # (conftest)


def _replace(obj, path_choice: int, value):
    """``obj`` with the value at one of its paths (picked by ``path_choice``) replaced."""
    from _fuzz_cases import _parent, _paths

    obj = copy.deepcopy(obj)
    paths = _paths(obj, limit=600)
    parent, key = _parent(obj, paths[path_choice % len(paths)])
    parent[key] = value
    return obj


@pytest.fixture(scope="module")
def small_doc():
    return trace_doc(max_events=150)


@pytest.fixture(scope="module")
def small_snapshot():
    s = snapshot_obj()
    s["segments"] = s["segments"][:10]
    s["device_traces"] = [t[:60] for t in s["device_traces"]]
    return s


@pytest.fixture(scope="module")
def example_dir(work):
    """A fresh, empty folder for each example (``.../q/eN``, in a quiet folder: _suitefuzz_quiet),
    removed once the example passed (a failing one's input stays for a look)."""
    root, n = quiet_dir(work, "hyp"), itertools.count()

    def fresh() -> Path:
        d = root / f"e{next(n)}"
        d.mkdir()
        return d

    return fresh


def _check(code: int, err: str, path) -> None:
    assert code in (0, 1, 2), err
    assert "internal error" not in err and "Traceback" not in err, err
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and str(path) in lines[0], err
    shutil.rmtree(Path(path).parent)


@PROPERTY
@given(choice=st.integers(min_value=0), value=json_values, gz=st.booleans())
def test_property_trace_field_replaced(example_dir, small_doc, choice, value, gz):
    p = example_dir() / ("rank0.json.gz" if gz else "rank0.json")
    data = json.dumps(_replace(small_doc, choice, value)).encode()
    p.write_bytes(gzip.compress(data, 1) if gz else data)
    _check(*_cli_code(["analyze", str(p), "-j", "1", "--format", "json"]), p)


@PROPERTY
@given(at=st.floats(min_value=0, max_value=1), junk=st.binary(max_size=16), drop=st.integers(0, 64))
def test_property_trace_bytes_spliced(example_dir, small_doc, at, junk, drop):
    data = json.dumps(small_doc, indent=1).encode()
    k = int(at * len(data))
    p = example_dir() / "rank0.json"
    p.write_bytes(data[:k] + junk + data[k + drop :])
    _check(*_cli_code(["analyze", str(p), "-j", "1", "--format", "json"]), p)


@PROPERTY
@given(choice=st.integers(min_value=0), value=json_values)
def test_property_snapshot_field_replaced(example_dir, small_snapshot, choice, value):
    p = example_dir() / "snap.pickle"
    p.write_bytes(pickle.dumps(_replace(small_snapshot, choice, value), protocol=4))
    _check(*_cli_code(["memory", str(p), "--format", "json"]), p)


@PROPERTY
@given(choice=st.integers(min_value=0), value=json_values)
def test_property_baseline_field_replaced(example_dir, baseline, choice, value):
    p = example_dir() / "base.json"
    p.write_text(json.dumps(_replace(json.loads(baseline.read_text()), choice, value)))
    good = RECORDED / "per-block" / "rank0.json.gz"
    _check(*_cli_code(["compare", str(p), str(good), "-j", "1", "--format", "json"]), p)


@pytest.fixture(scope="module")
def gpu_doc_and_paths():
    from _fuzz_cases import gpu_field_paths

    # the whole last step (not trimmed as test_gpu_trace_fields' is): hostile values also meet
    # the full step's cross-stream dependencies and interval growth
    doc = gpu_trace_doc(whole_step=True)
    return doc, gpu_field_paths(doc)


def _with(obj, path: tuple, value):
    """``obj`` with ``value`` at ``path``; only the containers along the path are copied."""
    if not path:
        return value
    out = copy.copy(obj)
    out[path[0]] = _with(obj[path[0]], path[1:], value)
    return out


@settings(PROPERTY, max_examples=EXAMPLES if _LONG else 10)
@given(choice=st.integers(min_value=0), value=json_values)
def test_property_gpu_field_replaced(example_dir, gpu_doc_and_paths, choice, value):
    """Any value in any field of a real GPU trace that the compute / waterfall / kernel-class code
    reads (``_fuzz_cases.gpu_field_paths``: deviceProperties, kernels, launches, FLOP ops' shapes)."""
    doc, paths = gpu_doc_and_paths
    p = example_dir() / "rank0.json"
    p.write_bytes(json.dumps(_with(doc, paths[choice % len(paths)], value)).encode())
    _check(*_cli_code(["analyze", str(p), "-j", "1", "--format", "json"]), p)
