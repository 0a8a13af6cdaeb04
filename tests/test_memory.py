"""Memory snapshots and memory timelines: loading (safely), peak, fragmentation and categories.

Real inputs come from ../shared (skipped when absent); exact ground truth comes from
fixtures/snapshots/gen_snapshot.py, whose allocator model writes snapshots in the real layout.
"""

from __future__ import annotations

import collections
import copyreg
import gzip
import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpdoctor.analysis.memory import CATEGORIES, MemoryFacts, analyze_memory, round_size
from fsdpdoctor.ingest.snapshot import (
    MemoryTimeline,
    Snapshot,
    SnapshotError,
    load_memory,
    load_memory_timeline,
    load_snapshot,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
REAL_SNAPSHOT = SHARED / "snapshots/public/cs336-a2-torch211-windows/memory_snapshot.pickle"
REAL_TIMELINE = SHARED / "snapshots/public/hta-memory-timeline.raw.json.gz"
GENERATOR = ROOT / "fixtures/snapshots/gen_snapshot.py"

needs_real_snapshot = pytest.mark.skipif(not REAL_SNAPSHOT.exists(), reason="../shared snapshots not available")
needs_real_timeline = pytest.mark.skipif(not REAL_TIMELINE.exists(), reason="../shared snapshots not available")


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_snapshot", GENERATOR)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_snapshot"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()
HISTORY_VARIANTS = [n for n, v in gen.VARIANTS.items() if v.history and not v.bare_list]
NO_HISTORY_VARIANTS = [n for n, v in gen.VARIANTS.items() if not (v.history and not v.bare_list)]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    out = tmp_path_factory.mktemp("snapshots")
    files = {}
    for name in gen.VARIANTS:
        pkl, truth = gen.write(name, out)
        files[name] = (pkl, json.loads(truth.read_text()))
    return files


def _plain_load(path: Path):
    class Plain(pickle.Unpickler):
        def find_class(self, module, name):
            raise pickle.UnpicklingError(f"{module}.{name}")

    with open(path, "rb") as fh:
        return Plain(fh).load()


# --------------------------------------------------------------------------- real files


@needs_real_snapshot
def test_real_snapshot_loads():
    snap = load_snapshot(REAL_SNAPSHOT)
    assert isinstance(snap, Snapshot)
    assert snap.devices == [0] and snap.has_history
    assert len(snap.device_traces[0]) == 5163
    assert "\\" in snap.device_traces[0][0]["frames"][0]["filename"]  # Windows paths survive as they are
    assert {b["state"] for s in snap.segments for b in s["blocks"]} <= {
        "active_allocated",
        "active_pending_free",
        "inactive",
    }


@needs_real_snapshot
def test_real_snapshot_numbers_are_plausible():
    facts = analyze_memory(REAL_SNAPSHOT)
    raw = _plain_load(REAL_SNAPSHOT)
    reserved_end = sum(s["total_size"] for s in raw["segments"])
    allocated_end = sum(s["allocated_size"] for s in raw["segments"])

    assert facts.source == "snapshot" and not facts.history_missing and facts.device == 0
    assert facts.end_reserved_bytes == reserved_end
    assert facts.end_allocated_bytes == allocated_end
    # no cudaMalloc/cudaFree while recording: reserved is constant and bounds the peak
    assert facts.reserved_at_peak_bytes == reserved_end
    assert allocated_end < facts.peak_allocated_bytes <= facts.reserved_at_peak_bytes
    # accounting at the peak
    assert (
        facts.peak_requested_bytes
        + facts.internal_fragmentation_bytes
        + facts.pending_free_at_peak_bytes
        + facts.external_fragmentation_bytes
        == facts.reserved_at_peak_bytes
    )
    assert sum(facts.categories.values()) == facts.peak_allocated_bytes
    assert set(facts.categories) == set(CATEGORIES)

    # an independent replay of requested bytes (alloc − free_completed, seeded with blocks that
    # exist before recording) peaks at the same requested total
    trace = raw["device_traces"][0]
    touched = {e["addr"] for e in trace}
    first = {}
    for e in trace:
        first.setdefault(e["addr"], e)
    current = sum(
        b["requested_size"]
        for s in raw["segments"]
        for b in s["blocks"]
        if b["state"] != "inactive" and b["address"] not in touched
    )
    current += sum(e["size"] for e in first.values() if e["action"] != "alloc")
    series = []
    for e in trace:
        current += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        series.append(current)
    assert series[facts.peak_event_index] == facts.peak_requested_bytes
    assert max(series) - facts.peak_requested_bytes < 0.001 * facts.peak_allocated_bytes

    # a forward pass of a non-FSDP model at the peak: activations dominate
    assert facts.peak_phase == "forward" and facts.fsdp_version is None
    assert max(facts.categories, key=facts.categories.get) == "activations"
    assert facts.pre_existing_bytes > 0
    times = [e["time_us"] for e in trace]
    assert times[0] <= facts.peak_time_us <= times[-1]
    assert facts.top_sites and all(b > 0 for _, b in facts.top_sites)
    assert 0 < len(facts.curve.x) <= 500 and max(facts.curve.allocated) == facts.peak_allocated_bytes


@needs_real_timeline
def test_real_memory_timeline():
    tl = load_memory_timeline(REAL_TIMELINE)
    assert isinstance(tl, MemoryTimeline) and len(tl.nbytes) == 16845
    facts = analyze_memory(REAL_TIMELINE)
    assert facts.source == "memory_timeline"
    assert facts.peak_allocated_bytes == sum(facts.categories.values())
    assert 3.0e9 < facts.peak_allocated_bytes < 3.2e9
    assert max(facts.categories, key=facts.categories.get) == "activations"
    assert facts.categories["activations"] > 0.8 * facts.peak_allocated_bytes
    assert facts.reserved_at_peak_bytes is None and facts.internal_fragmentation_bytes is None
    assert 0 < len(facts.curve.x) <= 500 and max(facts.curve.allocated) == facts.peak_allocated_bytes


@needs_real_timeline
def test_real_memory_timeline_matches_hta():
    hta_memory = pytest.importorskip("hta.memory_analysis")
    times, sizes = hta_memory.MemoryAnalysis(str(REAL_TIMELINE))._process_raw_events()
    totals = [sum(row) for row in sizes]
    peak = max(totals)
    facts = analyze_memory(REAL_TIMELINE)
    assert facts.peak_allocated_bytes == peak
    hta_row = sizes[totals.index(peak)]
    assert facts.categories["activations"] == hta_row[4]  # HTA column 4 = Activation
    assert facts.categories["optimizer_state"] == hta_row[1]


# --------------------------------------------------------------------------- generated snapshots


def test_generator_is_deterministic():
    a, ta = gen.build("fsdp2")
    b, tb = gen.build("fsdp2")
    assert pickle.dumps(a, protocol=4) == pickle.dumps(b, protocol=4)
    assert ta == tb


def test_generated_layout_matches_real_snapshot(generated):
    obj = _plain_load(generated["fsdp2"][0])
    seg, entry = obj["segments"][0], obj["device_traces"][0][0]
    assert list(seg) == [
        "device",
        "address",
        "total_size",
        "allocated_size",
        "active_size",
        "requested_size",
        "stream",
        "segment_type",
        "segment_pool_id",
        "is_expandable",
        "frames",
        "blocks",
    ]
    assert list(seg["blocks"][0]) == ["address", "size", "requested_size", "state", "frames"]
    assert list(entry) == ["action", "addr", "size", "stream", "time_us", "compile_context", "user_metadata", "frames"]
    frame = next(e["frames"][0] for e in obj["device_traces"][0] if e["frames"])
    assert list(frame) == ["name", "filename", "line"]
    if REAL_SNAPSHOT.exists():  # same keys, in the same order, as the real torch 2.11 file
        real = _plain_load(REAL_SNAPSHOT)
        assert list(seg) == list(real["segments"][0])
        assert list(seg["blocks"][0]) == list(real["segments"][0]["blocks"][0])
        assert list(entry) == list(real["device_traces"][0][0])
        assert set(obj["allocator_settings"]) == set(real["allocator_settings"])
        real_frame = next(e["frames"][0] for e in real["device_traces"][0] if e["frames"])
        assert list(frame) == list(real_frame)


@pytest.mark.parametrize("name", list(gen.VARIANTS))
def test_every_variant_loads(generated, name):
    pkl, truth = generated[name]
    snap = load_snapshot(pkl)
    assert snap.segments
    assert snap.has_history == truth["history"]
    assert snap.bare_segment_list == gen.VARIANTS[name].bare_list
    facts = analyze_memory(snap)
    assert facts.peak_allocated_bytes > 0
    assert sum(facts.categories.values()) == facts.peak_allocated_bytes


@pytest.mark.parametrize("name", list(gen.VARIANTS))
def test_torch_memory_viz_accepts_generated(generated, name):
    """torch's own segsum checks the segment accounting of the generated files."""
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    obj = _plain_load(generated[name][0])
    assert "total_reserved" in memory_viz.segsum(obj if isinstance(obj, dict) else {"segments": obj})


@pytest.mark.parametrize("name", HISTORY_VARIANTS)
def test_generated_peak_and_fragmentation_exact(generated, name):
    pkl, truth = generated[name]
    facts = analyze_memory(pkl)
    assert not facts.history_missing
    assert facts.device == truth["device"]
    assert facts.peak_allocated_bytes == truth["peak_allocated_bytes"]
    assert facts.peak_event_index == truth["peak_event_index"]
    assert facts.peak_time_us == truth["peak_time_us"]
    assert facts.peak_requested_bytes == truth["peak_requested_bytes"]
    assert facts.reserved_at_peak_bytes == truth["reserved_at_peak_bytes"]
    assert facts.internal_fragmentation_bytes == truth["internal_fragmentation_bytes"]
    assert facts.external_fragmentation_bytes == truth["external_fragmentation_bytes"]
    assert facts.pending_free_at_peak_bytes == truth["pending_free_at_peak_bytes"]
    assert facts.end_allocated_bytes == truth["end"]["allocated_bytes"]
    assert facts.end_reserved_bytes == truth["end"]["reserved_bytes"]


@pytest.mark.parametrize("name", HISTORY_VARIANTS)
def test_generated_categories_match_truth(generated, name):
    pkl, truth = generated[name]
    facts = analyze_memory(pkl)
    tolerance = 0.01 * truth["peak_allocated_bytes"]
    off = {
        c: (facts.categories[c], truth["categories"][c])
        for c in CATEGORIES
        if abs(facts.categories[c] - truth["categories"][c]) > tolerance
    }
    assert not off, off


def test_generated_peak_has_every_fsdp_category(generated):
    """The fixture is only a good test if the peak holds each category (and pending frees)."""
    truth = generated["fsdp2"][1]
    assert all(truth["categories"][c] > 0 for c in CATEGORIES if c != "parameters")  # FSDP: no plain parameters
    assert truth["pending_free_at_peak_bytes"] > 0
    assert truth["internal_fragmentation_bytes"] > 0 and truth["external_fragmentation_bytes"] > 0


def test_fsdp_versions_and_world_size(generated):
    for name, version in [("fsdp2", "fsdp2"), ("fsdp2_composable", "fsdp2"), ("fsdp1", "fsdp1")]:
        facts = analyze_memory(generated[name][0])
        assert facts.fsdp_version == version
    assert analyze_memory(generated["fsdp2"][0]).world_size == gen.Spec().world_size


def test_pre_existing_blocks_attributed_by_size(generated):
    """Recording started after step 0: sharded params and Adam state exist before the trace."""
    pkl, truth = generated["fsdp2_midrun"]
    facts = analyze_memory(pkl)
    assert facts.pre_existing_bytes == truth["end"]["allocated_bytes"]  # nothing else survives a step
    assert facts.pre_existing_attributed["parameters_sharded"] == truth["categories"]["parameters_sharded"]
    assert facts.pre_existing_attributed["optimizer_state"] == truth["categories"]["optimizer_state"]
    # a model buffer; the rest of "other" at the peak is the step's input batch, loaded while recording
    batch = gen.Spec().tokens * gen.Spec().hidden * 2
    assert facts.pre_existing_attributed["other"] == truth["categories"]["other"] - batch


def test_expandable_segments(generated):
    obj = _plain_load(generated["fsdp2_expandable"][0])
    actions = collections.Counter(e["action"] for e in obj["device_traces"][0])
    assert actions["segment_map"] > 0 and actions["segment_unmap"] > 0 and actions["segment_alloc"] == 0
    assert all(s["is_expandable"] for s in obj["segments"])


def test_oom_entry(generated):
    pkl, truth = generated["fsdp2_oom"]
    facts = analyze_memory(pkl)
    oom, want = facts.oom, truth["oom"]
    assert oom is not None and oom.count == 1
    assert oom.requested_bytes == want["requested_bytes"]
    assert oom.device_free_bytes == want["device_free_bytes"]
    assert oom.allocated_bytes == want["allocated_bytes"]
    assert oom.reserved_bytes == want["reserved_bytes"]
    assert oom.largest_cached_free_block_bytes == want["largest_cached_free_block_bytes"]
    assert oom.event_index == want["event_index"]
    assert sum(oom.categories.values()) == oom.allocated_bytes
    for c in CATEGORIES:
        assert abs(oom.categories[c] - want["categories"][c]) <= 0.01 * want["allocated_bytes"], c
    # the cache held enough free bytes, just not in one piece
    assert oom.cached_free_bytes >= oom.requested_bytes > oom.largest_cached_free_block_bytes
    assert oom.explanation.startswith("fragmentation")


def test_multi_device_picks_highest_peak(generated):
    pkl, truth = generated["multi_device"]
    snap = load_snapshot(pkl)
    assert len(snap.device_traces) == 3 and snap.device_traces[2] == []  # idle visible device
    facts = analyze_memory(snap)
    assert facts.device == truth["device"] == 1
    assert [(d.device, d.peak_allocated_bytes) for d in facts.devices] == [
        (d["device"], d["peak_allocated_bytes"]) for d in truth["devices"]
    ]


@pytest.mark.parametrize("name", NO_HISTORY_VARIANTS)
def test_without_history_reports_segment_totals(generated, name):
    pkl, truth = generated[name]
    facts = analyze_memory(pkl)
    assert facts.history_missing is True
    assert facts.peak_event_index is None and facts.peak_time_us is None
    end = truth["end"]
    assert facts.peak_allocated_bytes == end["allocated_bytes"]
    assert facts.reserved_at_peak_bytes == end["reserved_bytes"]
    assert facts.internal_fragmentation_bytes == end["internal_fragmentation_bytes"]
    assert facts.external_fragmentation_bytes == end["external_fragmentation_bytes"]
    assert facts.pending_free_at_peak_bytes == end["pending_free_bytes"]
    # categories whose allocation stacks say it all are exact even without lifetimes
    for c in ("parameters_unsharded", "allgather_buffers", "reduce_scatter_buffers", "optimizer_state", "activations"):
        assert facts.categories[c] == end["categories"][c], c


def test_no_history_lists_are_accepted(generated):
    obj = _plain_load(generated["fsdp2"][0])
    for traces in ([], [[]], [[], []], None):
        facts = analyze_memory(dict(obj, device_traces=traces))
        assert facts.history_missing


def test_memory_facts_json_round_trip(generated):
    facts = analyze_memory(generated["fsdp2_oom"][0])
    data = json.loads(json.dumps(facts.to_dict()))
    back = MemoryFacts.from_dict(data)
    assert back == facts
    assert isinstance(back.top_sites[0], tuple)
    assert len(facts.curve.x) == len(facts.curve.allocated) == len(facts.curve.reserved) <= 500


def test_gzip_snapshot_and_load_memory_dispatch(generated, tmp_path):
    raw = generated["fsdp2"][0].read_bytes()
    gz = tmp_path / "snap.pickle.gz"
    gz.write_bytes(gzip.compress(raw))
    assert isinstance(load_memory(gz), Snapshot)
    if REAL_TIMELINE.exists():
        assert isinstance(load_memory(REAL_TIMELINE), MemoryTimeline)


def test_cumulative_timeline_form(tmp_path):
    """export_memory_timeline("x.json"): [times_us, rows of 9 cumulative sizes]."""
    times = [0.0, 1.0, 2.0, 3.0]
    sizes = [
        [0, 100, 0, 0, 0, 0, 0, 0, 0],
        [0, 100, 0, 0, 0, 50, 0, 0, 0],
        [0, 100, 0, 0, 30, 80, 0, 0, 0],
        [0, 100, 0, 0, 0, 0, 20, 0, 0],
    ]
    p = tmp_path / "timeline.json"
    p.write_text(json.dumps([times, sizes]))
    facts = analyze_memory(p)
    assert facts.peak_allocated_bytes == 210
    assert facts.categories["parameters"] == 100 and facts.categories["activations"] == 80  # PARAMETER: no FSDP known
    assert facts.categories["temporary"] == 30 and facts.peak_time_us == 2.0


def test_profiler_pseudo_snapshot_frames():
    """_memory_viz._profile_to_snapshot (CPU-capable) writes frames as name="path(line): func".

    Frames below are copied from a real 2-rank gloo FSDP2 run on torch 2.13 (CPU); the profiler
    itself labels this all-gather buffer "parameter".
    """
    ag = [
        {"filename": "none", "line": 0, "name": "<built-in method empty of type object at 0x7f254aacea40>"},
        {
            "filename": "none",
            "line": 0,
            "name": "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py(52): allocate",
        },
        {
            "filename": "none",
            "line": 0,
            "name": "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py(324): foreach_all_gather",
        },
        {
            "filename": "none",
            "line": 0,
            "name": "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py(540): pre_forward",
        },
        {"filename": "none", "line": 0, "name": "torch/nn/modules/module.py(1782): _call_impl"},
        {"filename": "none", "line": 0, "name": "run.py(21): step"},
    ]
    act = [{"filename": "none", "line": 0, "name": "run.py(10): forward"}, ag[4], ag[5]]
    trace = [
        {"action": "alloc", "addr": 4096, "size": 2102272, "stream": 0, "frames": ag, "category": "parameter"},
        {"action": "alloc", "addr": 1 << 24, "size": 327680, "stream": 0, "frames": act, "category": "activation"},
    ]
    snap = {
        "segments": [{"device": 0, "address": 4096, "total_size": 1 << 40, "stream": 0, "blocks": []}],
        "device_traces": [trace],
    }
    facts = analyze_memory(snap)
    assert facts.categories["allgather_buffers"] == 2102272  # exact size: no allocator rounding
    assert facts.categories["activations"] == 327680
    assert facts.fsdp_version == "fsdp2" and facts.peak_phase == "forward"
    assert facts.reserved_at_peak_bytes is None and facts.external_fragmentation_bytes is None
    assert facts.top_sites[0][0] == "foreach_all_gather (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:324)"


def test_round_size():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    divisions = {str(1 << i): 0 for i in range(16)} | {"1": 4}
    assert round_size(1_200_000, divisions) == 1_310_720  # 1 MiB + 1/4 MiB steps


# --------------------------------------------------------------------------- bad input


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalEvil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w')",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_os_system_pickle_is_refused_and_nothing_runs(tmp_path, protocol):
    marker = tmp_path / f"pwned_{protocol}"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Evil(marker)]]}, protocol=protocol))
    with pytest.raises(SnapshotError) as err:
        load_snapshot(path)
    assert "evil.pickle" in str(err.value) and "system" in str(err.value)
    assert "\n" not in str(err.value)
    assert not marker.exists()
    with pytest.raises(SnapshotError):
        analyze_memory(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        lambda m: collections.OrderedDict(segments=[]),
        lambda m: {"segments": [], "x": _EvalEvil(m)},
        lambda m: {"segments": [collections.Counter()]},
        lambda m: {
            "segments": [],
            "device_traces": [[{"action": "alloc", "addr": 1, "size": 2, "stream": 0, "frames": set()}]],
        },
    ],
    ids=["OrderedDict", "builtins.eval", "Counter", "set-protocol2"],
)
def test_any_global_is_refused(tmp_path, payload):
    marker = tmp_path / "pwned"
    path = tmp_path / "globals.pickle"
    path.write_bytes(pickle.dumps(payload(marker), protocol=2))  # protocol 2 pickles sets via builtins.set
    with pytest.raises(SnapshotError, match="globals.pickle: refused to load"):
        load_snapshot(path)
    assert not marker.exists()


def test_copyreg_extension_cache_cannot_bypass_the_refusal(tmp_path):
    """EXT opcodes resolve via copyreg's cache without find_class: checked in a clean process."""
    path = tmp_path / "ext.pickle"
    path.write_bytes(b"\x80\x02\x82\xf0)R.")  # EXT1 240; (); REDUCE
    code = (
        "import copyreg, pickle, sys\n"
        "copyreg.add_extension('os', 'getcwd', 240)\n"
        f"pickle.loads({path.read_bytes()!r})\n"  # a permissive load fills the extension cache
        "from fsdpdoctor.ingest.snapshot import load_snapshot, SnapshotError\n"
        "try:\n"
        f"    load_snapshot({str(path)!r})\n"
        "except SnapshotError as e:\n"
        "    print('REFUSED', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.startswith("REFUSED") and "ext.pickle" in out


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"", "empty file"),
        (b"this is not a pickle at all", "not a pickle"),
        (b"PK\x03\x04rest-of-a-zip", "zip archive"),
        (b"\x1f\x8b\x08\x00broken gzip", "gzip"),
        (b'{"traceEvents": []}', "JSON"),
    ],
    ids=["empty", "text", "zip", "bad-gzip", "json"],
)
def test_bad_files_give_one_line_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "bad_input.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotError) as err:
        load_snapshot(path)
    msg = str(err.value)
    assert msg.startswith(str(path)) and problem in msg and "\n" not in msg
    assert isinstance(err.value, ValueError)


def test_truncated_pickle(tmp_path, generated):
    data = generated["fsdp2"][0].read_bytes()
    for cut in (1, 10, len(data) // 2, len(data) - 1):
        path = tmp_path / "cut.pickle"
        path.write_bytes(data[:cut])
        with pytest.raises(SnapshotError, match=r"cut\.pickle: .*truncated"):
            load_snapshot(path)


@pytest.mark.parametrize(
    "obj, problem",
    [
        (42, "top level is a int"),
        ({"device_traces": []}, "no 'segments' list"),
        ({"segments": [{"address": 0}]}, "segments[0] has no 'blocks' list"),
        ({"segments": [{"blocks": [{"state": "active_allocated"}]}]}, "has no integer 'size'"),
        ({"segments": [], "device_traces": [[{"addr": 5}]]}, "device_traces[0][0]"),
        ({"segments": [], "device_traces": {"0": []}}, "'device_traces' is a dict"),
    ],
)
def test_wrong_structure(tmp_path, obj, problem):
    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps(obj))
    with pytest.raises(SnapshotError) as err:
        load_snapshot(path)
    assert str(err.value).startswith(f"{path}: wrong structure") and problem in str(err.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(SnapshotError, match="no such file"):
        load_snapshot(tmp_path / "nope.pickle")
    with pytest.raises(SnapshotError, match="is a directory"):
        load_snapshot(tmp_path)


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"", "empty file"),
        (b"[[1, 2, 3, 4], [5, 6", "truncated JSON"),
        (b"[[1, 2, 3]]", "shape"),
        (b"\x80\x04K\x01.", "not a JSON"),
    ],
)
def test_bad_memory_timeline(tmp_path, content, problem):
    path = tmp_path / "tl.raw.json"
    path.write_bytes(content)
    with pytest.raises(SnapshotError) as err:
        load_memory_timeline(path)
    assert str(err.value).startswith(str(path)) and problem in str(err.value)


def test_copyreg_untouched():
    assert not copyreg._extension_cache  # the tests above ran the extension case in a subprocess
