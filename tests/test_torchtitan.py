"""A real torchtitan dump folder read as it lies (issue 43 item 2).

``fixtures/recorded/torchtitan-cpu-debugmodel/`` was written by torchtitan 0.3.0 itself
(``fixtures/record_torchtitan.py``: the llama3 debug model, FSDP2 over 2 CPU processes, gloo, its
profiler and Flight Recorder on), in its default layout: ``profiling/traces/iteration_<N>/`` and
``comm_traces/rank_<r>``. The expected figures come from the recorder's settings, torchtitan's
debug-model config (``torchtitan/models/llama3/__init__.py``, ``_debugmodel``) and stdlib readings
of the raw files, never from fsdpdoctor's own readers.

A CPU run cannot write a memory snapshot (torch's memory history is CUDA's caching allocator's),
so the snapshot test places a real snapshot (the committed H100 ``gpu/fsdp2`` recording) where
torchtitan 0.3.0 writes them (``torchtitan/tools/profiler.py``: ``profiling/memory_snapshot``,
``step_<N:012d>``, ``<rank:06d>_step_<N>.pickle``) beside the real torchtitan traces.
"""

from __future__ import annotations

import gzip
import json
import pickle
import re
import shutil
from pathlib import Path

import pytest

import fsdpdoctor
from fixtures import record_torchtitan as rec
from fsdpdoctor.api import analyze_memory_only

from conftest import cli_in_process

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REC = FIXTURES / "recorded" / "torchtitan-cpu-debugmodel"
GPU_SNAPSHOT = FIXTURES / "recorded" / "gpu" / "fsdp2" / "rank0.memory.pickle.gz"

# torchtitan 0.3.0's llama3 "debugmodel" (models/llama3/__init__.py, _debugmodel): 6 layers, dim 256,
# vocab 2048, fused qkv, FFN hidden = compute_ffn_hidden_dim(256, multiple_of=256): 2/3 of 4 x dim
# (682), rounded up to a multiple of 256 = 768; RMSNorm weights of dim elements.
N_LAYERS, DIM, VOCAB = 6, 256, 2048
HIDDEN = -(-int(2 * 4 * DIM / 3) // 256) * 256
LAYER_NUMEL = DIM * 3 * DIM + DIM * DIM + 3 * DIM * HIDDEN + 2 * DIM  # wqkv, wo, w1/w2/w3, 2 norms
EMBEDDING_NUMEL = VOCAB * DIM
NORM_LM_HEAD_NUMEL = DIM + DIM * VOCAB
# torchtitan's apply_fsdp_to_decoder (distributed/fsdp.py): tok_embeddings, [norm, lm_head] as one
# unit, every layer, then the root (which holds no parameter of its own); in execution order:
UNITS = ["tok_embeddings", *(f"layers.{i}" for i in range(N_LAYERS)), "norm, lm_head"]

ITERATION = rec.STEPS  # profile_freq = STEPS: the one window is written at step STEPS
TRACES = [REC / "profiling" / "traces" / f"iteration_{ITERATION}" / f"rank{r}_trace.json.gz" for r in range(rec.NPROC)]
DUMPS = [REC / "comm_traces" / f"rank_{r}" for r in range(rec.NPROC)]


class _Plain(pickle.Unpickler):
    """The stdlib unpickler refusing every global, as fsdpdoctor's own does."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}")


def _plain(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        return _Plain(fh).load()


@pytest.fixture(scope="module")
def raw_traces() -> list[dict]:
    """Each rank's trace as the stdlib reads it."""
    out = []
    for path in TRACES:
        with gzip.open(path, "rt") as fh:
            out.append(json.load(fh))
    return out


@pytest.fixture(scope="module")
def report():
    return fsdpdoctor.analyze(REC)


def test_the_recording_is_torchtitans_layout():
    files = sorted(str(p.relative_to(REC)) for p in REC.rglob("*") if p.is_file())
    assert files == sorted(["README.md", *(str(p.relative_to(REC)) for p in TRACES + DUMPS)])
    assert sum((REC / f).stat().st_size for f in files) < 2_000_000
    readme = (REC / "README.md").read_text()
    assert "torchtitan `0.3.0`" in readme and "torch `2.13.0+cpu`" in readme


def test_the_dump_folder_is_found_as_it_lies(report, raw_traces):
    f = report.facts
    assert [Path(i.path).resolve() for i in f.inputs] == [p.resolve() for p in TRACES]
    # the ranks each trace names itself (Kineto's distributedInfo), read with json
    ranks = [t["distributedInfo"]["rank"] for t in raw_traces]
    assert ranks == list(range(rec.NPROC))
    assert [i.rank for i in f.inputs] == ranks
    assert f.world_size == rec.NPROC
    # the Flight Recorder dumps in comm_traces/, with no path beyond the folder
    assert f.hang is not None and f.hang.dumps == rec.NPROC and f.hang.backend == "gloo"
    assert [Path(p).resolve() for p in f.hang.paths] == [p.resolve() for p in DUMPS]


def test_the_cli_reads_the_folder_alone(tmp_path):
    out = tmp_path / "report.json"
    code, err = cli_in_process(["analyze", str(REC), "--format", "json", "-o", str(out)])
    assert code == 0, err
    doc = json.loads(out.read_text())
    facts = doc.get("facts", doc)
    assert len(facts["inputs"]) == rec.NPROC and facts["hang"]["dumps"] == rec.NPROC


def test_a_sub_folder_of_the_dump_folder_is_read_too():
    f = fsdpdoctor.analyze(REC / "profiling").facts  # profiling/traces/iteration_N below it
    assert [Path(i.path).name for i in f.inputs] == [p.name for p in TRACES]


def test_units_are_the_debug_models_layers(report, raw_traces):
    fsdp = report.facts.fsdp
    assert [u.fqn for u in fsdp.units] == UNITS
    # the raw trace's FSDP labels name the same units (stdlib JSON reading)
    for t in raw_traces:
        labels = {
            m.group(1)
            for e in t["traceEvents"]
            if (m := re.fullmatch(r"FSDP::pre_forward \((.+)\)", e.get("name", "")))
        }
        assert labels == set(UNITS)
    by = {u.fqn: u for u in fsdp.units}
    assert LAYER_NUMEL == 852_480
    for i in range(N_LAYERS):
        assert by[f"layers.{i}"].unsharded_numel == LAYER_NUMEL
        assert by[f"layers.{i}"].forward_all_gathers == 1 and by[f"layers.{i}"].backward_all_gathers == 1
    assert by["tok_embeddings"].unsharded_numel == EMBEDDING_NUMEL


def test_the_norm_lm_head_unit_size(report):
    """torchtitan's ChunkedLossWrapper unshards lm_head again after the model's forward
    (components/loss.py:739): the [norm, lm_head] unit is gathered twice in one forward pass, one
    parameter group of the size the config gives, not two."""
    u = next(u for u in report.facts.fsdp.units if u.fqn == "norm, lm_head")
    assert u.unsharded_numel == NORM_LM_HEAD_NUMEL and u.param_groups == 1


def test_steps_are_the_profiled_window(report, raw_traces):
    f = report.facts
    wait = rec.STEPS - rec.WARMUP - rec.ACTIVE  # torchtitan: wait = profile_freq - (active + warmup)
    want = [f"ProfilerStep#{wait + rec.WARMUP + k}" for k in range(rec.ACTIVE)]
    for r, t in enumerate(raw_traces):
        steps = sorted(
            (e for e in t["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")),
            key=lambda e: e["ts"],
        )
        assert [e["name"] for e in steps] == want
        mean_ms = sum(e["dur"] for e in steps) / len(steps) / 1e3
        assert f.steps.per_rank_mean_ms[str(r)] == pytest.approx(mean_ms, rel=0.01)
    assert f.steps.count == rec.ACTIVE and f.steps.method == "ProfilerStep"


def test_flight_recorder_entries(report):
    from fsdpdoctor.ingest.flight_recorder import load_dump

    progress = {p.rank: p for p in report.facts.hang.progress}
    for r, path in enumerate(DUMPS):
        raw = _plain(path)
        entries = raw["entries"]
        assert 0 < len(entries) < rec.TRACE_BUF  # the ring buffer did not wrap: every collective is there
        assert [e["record_id"] for e in entries] == list(range(len(entries)))
        seqs = [e["collective_seq_id"] for e in entries]
        assert seqs == list(range(1, len(entries) + 1))
        # torchtitan's one barrier: set_pg_timeouts after the first step (distributed/utils.py:586)
        assert [e["profiling_name"] for e in entries].count("gloo:barrier") == 1
        d = load_dump(path)
        assert d.rank == r and d.backend == "gloo" and d.version == raw["version"]
        assert [(e.seq, e.profiling_name) for e in d.entries] == [
            (e["collective_seq_id"], e["profiling_name"]) for e in entries
        ]
        assert progress[r].last_seq == seqs[-1]
    assert report.facts.hang.kind == "none"  # the run ended cleanly: no rank behind another


def _with_snapshot(tmp_path: Path, folder: str) -> Path:
    """The recording with the real H100 snapshot placed in torchtitan 0.3.0's snapshot layout."""
    root = tmp_path / "outputs"
    shutil.copytree(REC, root)
    dst = root / "profiling" / "memory_snapshot" / folder / f"{0:06d}_step_{ITERATION}.pickle"
    dst.parent.mkdir(parents=True)
    with gzip.open(GPU_SNAPSHOT) as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo)
    return dst


def _independent_peak(path: Path) -> int:
    """Peak allocated bytes from the raw snapshot: the blocks alive before the history starts, then
    its alloc / free_completed events replayed, sizes rounded as the caching allocator rounds them
    (512-byte multiples: CUDACachingAllocator's kMinBlockSize)."""
    raw = _plain(path)
    r512 = lambda n: max(512, -(-n // 512) * 512)  # noqa: E731
    trace = [e for e in raw["device_traces"][0] if e["action"] in ("alloc", "free_requested", "free_completed")]
    first: dict[int, dict] = {}
    for e in trace:
        first.setdefault(e["addr"], e)
    live = {a: r512(e["size"]) for a, e in first.items() if e["action"] != "alloc"}
    untouched = sum(
        b["size"]
        for s in raw["segments"]
        for b in s["blocks"]
        if b["state"] != "inactive" and b["address"] not in first
    )
    cur = untouched + sum(live.values())
    peak = cur
    for e in trace:
        if e["action"] == "alloc":
            cur += r512(e["size"]) - live.get(e["addr"], 0)
            live[e["addr"]] = r512(e["size"])
        elif e["action"] == "free_completed":
            cur -= live.pop(e["addr"], 0)
        peak = max(peak, cur)
    assert cur == sum(s["allocated_size"] for s in raw["segments"])  # the replay ends where the snapshot does
    return peak


def test_a_snapshot_in_the_0_3_0_layout_is_found(tmp_path):
    snap = _with_snapshot(tmp_path, f"step_{ITERATION:012d}")
    f = fsdpdoctor.analyze(snap.parents[3]).facts
    assert len(f.inputs) == rec.NPROC and f.hang.dumps == rec.NPROC
    assert f.memory is not None and Path(f.memory.path) == snap
    assert f.memory.rank == 0 and f.memory.discovered
    assert f.memory.peak_allocated_bytes == _independent_peak(snap)


def test_an_oom_exit_snapshot_in_the_0_3_0_layout(tmp_path):
    snap = _with_snapshot(tmp_path, f"step_{ITERATION:012d}_exit")
    root = snap.parents[3]
    m = analyze_memory_only(root).facts.memory  # fsdpdoctor memory <dump folder>: the latest, an OOM's too
    assert Path(m.path) == snap and m.rank == 0
