"""Tests of fsdpdoctor.capture and of the CPU/gloo recordings made through it.

Expected collective counts and sizes are computed from the model's parameter shapes and the
FSDP padding rules (torch 2.13 source), not read back from the recorder:

* FSDP2 (``_fsdp_param.py``/``_fsdp_common.py``): every parameter is chunked on dim 0 into
  ``ws`` pieces with ``torch.chunk`` and each rank's shard is padded to the size of chunk 0,
  i.e. ``ceil(dim0 / ws) * prod(shape[1:])`` elements. One all-gather per unit concatenates the
  padded shards: ``In = sum(padded shards)``, ``Out = ws * In``. The reduce-scatter input pads
  every gradient to ``ceil(dim0 / ws) * ws`` rows (``_get_dim0_padded_size``), so
  ``RS In = AG Out`` and ``RS Out = AG In``.
* FSDP1 (``_flat_param.py``, ``use_orig_params=False``: no alignment padding): one flat
  parameter per unit of ``N`` elements, padded to a multiple of ``ws``: ``In = ceil(N / ws)``,
  ``Out = ws * In``.
* DDP: one all-reduce per gradient bucket; the buckets cover every parameter once.

On CPU/gloo, torch 2.13 emits no ``record_param_comms`` events (only ProcessGroupNCCL does), so
sizes are read from the ``c10d::*`` cpu_op's ``Input Dims`` (with ``record_shapes=True``) and
dtypes from the ``gloo:*`` annotations the gloo worker threads record.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

# Fixtures recorded_run / recorder / recorded_world_size come from the _recording plugin
# (registered in tests/conftest.py with pytest_plugins = ["_recording"]).
from _recording import COMMITTED, REPO, VARIANTS

FSDP2_VARIANTS = ("per-block", "root-only", "per-linear", "no-backward-prefetch", "no-reshard", "bf16-mp")
EPS = 0.002  # us; Kineto timestamps have ns resolution printed as us with 3 decimals

AG_OPS = ("c10d::_allgather_base_", "c10d::allgather_")
RS_OPS = ("c10d::_reduce_scatter_base_",)
AR_OPS = ("c10d::allreduce_",)
DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}


# ----------------------------------------------------------------------------------------------
# Trace helpers (deliberately independent of fsdpdoctor.ingest)
# ----------------------------------------------------------------------------------------------


def load_trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


class Trace:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.raw = load_trace(path)
        self.events = self.raw["traceEvents"]
        self.x = [e for e in self.events if e.get("ph") == "X" and isinstance(e.get("tid"), int)]
        steps = [e for e in self.x if e["name"].startswith("ProfilerStep#")]
        self.steps = {int(e["name"].split("#")[1]): e for e in steps}
        tids = {e["tid"] for e in steps}
        assert len(tids) == 1, tids
        self.main_tid = tids.pop()
        self.main = sorted((e for e in self.x if e["tid"] == self.main_tid), key=lambda e: (e["ts"], -e["dur"]))

    def named(self, prefix: str) -> list[dict]:
        return [e for e in self.main if e["name"].startswith(prefix)]

    def enclosing(self, ev: dict) -> list[str]:
        """Names of main-thread events containing ``ev``, outermost first."""
        lo, hi = ev["ts"], ev["ts"] + ev["dur"]
        out = [e for e in self.main if e is not ev and e["ts"] <= lo + EPS and e["ts"] + e["dur"] >= hi - EPS]
        out.sort(key=lambda e: (e["ts"], -e["dur"]))
        return [e["name"] for e in out]

    def step_of(self, ev: dict) -> int | None:
        for n, s in self.steps.items():
            if s["ts"] - EPS <= ev["ts"] <= s["ts"] + s["dur"] + EPS:
                return n
        return None

    def gloo(self, name: str) -> list[dict]:
        return [e for e in self.x if e["tid"] != self.main_tid and e["name"] == name]


def innermost(names: list[str], prefix: str) -> str | None:
    hits = [n for n in names if n.startswith(prefix)]
    return hits[-1] if hits else None


def label_unit(label: str | None, base: str) -> str | None:
    """``"FSDP::all_gather (layers.0)"`` -> ``"layers.0"``; ``"FSDP::all_gather"`` -> ``""``."""
    if label is None:
        return None
    if label == base:
        return ""
    assert label.startswith(base + " (") and label.endswith(")"), label
    return label[len(base) + 2 : -1]


def ag_numels(ev: dict, ws: int) -> tuple[int, int]:
    """(In, Out) element counts of an all-gather c10d op."""
    dims = ev["args"]["Input Dims"]
    if ev["name"] == "c10d::_allgather_base_":  # (Tensor output, Tensor input, ...)
        return dims[1][0], dims[0][0]
    assert ev["name"] == "c10d::allgather_", ev["name"]  # (Tensor[][] outputs, Tensor[] inputs)
    (inp,) = dims[1]
    return inp[0], inp[0] * ws


def rs_numels(ev: dict) -> tuple[int, int]:
    dims = ev["args"]["Input Dims"]  # (Tensor output, Tensor input, ...)
    return dims[1][0], dims[0][0]


# ----------------------------------------------------------------------------------------------
# Ground truth from the model
# ----------------------------------------------------------------------------------------------


def owned_params(recorder, variant: str) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Parameters of each unit: a parameter belongs to the innermost wrapped module holding it."""
    model = recorder.build_model()
    units = recorder.unit_fqns(variant, model)
    owned: dict[str, list] = {u: [] for u in units}
    for name, p in model.named_parameters():
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        owned[owner].append((name, tuple(p.shape)))
    return owned


def fsdp2_shard_numel(shapes: list[tuple[int, ...]], ws: int) -> int:
    return sum(math.ceil(s[0] / ws) * math.prod(s[1:]) for s in shapes)


def fsdp1_shard_numel(shapes: list[tuple[int, ...]], ws: int) -> int:
    return math.ceil(sum(math.prod(s) for s in shapes) / ws)


# ----------------------------------------------------------------------------------------------
# The capture helper, in a single process
# ----------------------------------------------------------------------------------------------


def test_import_does_not_need_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "import fsdpdoctor.capture as c\n"
        "assert c.trace_filename(3) == 'rank3.json.gz'\n"
        "assert c.trace_filename(0, 2) == 'rank0.cycle2.json.gz'\n"
        "assert c.META_FILENAME == 'fsdpdoctor_meta.json'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _tiny_loop(cap, steps: int, torch, fail_at: int | None = None):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        if i == fail_at:
            raise RuntimeError("boom")
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        cap.step()
    return model


def test_single_process_capture(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from fsdpdoctor.capture import capture

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with capture(tmp_path, wait=1, warmup=1, active=2, extra={"k": 1}) as cap:
        assert cap.profiled_steps() == [2, 3]
        _tiny_loop(cap, 5, torch)

    path = tmp_path / "rank0.json.gz"
    assert cap.trace_paths == [path]
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # gzip magic: export_chrome_trace gzips .gz names
    trace = Trace(path)
    assert sorted(trace.steps) == [2, 3]
    assert trace.raw["record_shapes"] == 1
    assert trace.raw["schemaVersion"] == 1
    assert "distributedInfo" not in trace.raw  # not initialised
    assert not [e for e in trace.events if e.get("cat") in ("kernel", "gpu_memcpy", "cuda_runtime")]

    meta = json.loads((tmp_path / "fsdpdoctor_meta.json").read_text())
    assert meta["schema"] == "fsdpdoctor.meta/1"
    assert meta["complete"] is True
    assert meta["world_size"] == 1
    assert meta["backend"] is None
    assert meta["trace_files"] == ["rank0.json.gz"]
    assert meta["capture"]["profiled_steps"] == [[2, 3]]
    assert meta["capture"]["steps_run_by_rank0"] == 5
    assert meta["capture"]["record_shapes"] is True
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["parallelism"] is None and meta["fsdp_version"] is None and meta["units"] == []
    assert meta["extra"] == {"k": 1}
    if not torch.cuda.is_available():
        assert meta["capture"]["activities"] == ["CPU"]
        assert meta["device_type"] == "cpu"
        assert meta["versions"]["nccl"] is None


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_repeat_writes_one_file_per_cycle(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from fsdpdoctor.capture import capture

    monkeypatch.delenv("RANK", raising=False)
    with capture(tmp_path, wait=0, warmup=1, active=1, repeat=2) as cap:
        _tiny_loop(cap, 4, torch)
    assert [p.name for p in cap.trace_paths] == ["rank0.json.gz", "rank0.cycle1.json.gz"]
    assert sorted(Trace(tmp_path / "rank0.json.gz").steps) == [1]
    assert sorted(Trace(tmp_path / "rank0.cycle1.json.gz").steps) == [3]
    meta = json.loads((tmp_path / "fsdpdoctor_meta.json").read_text())
    assert meta["capture"]["profiled_steps"] == [[1], [3]]
    assert meta["trace_files"] == ["rank0.json.gz", "rank0.cycle1.json.gz"]


def test_rank_from_environment_and_only_rank0_writes_meta(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from fsdpdoctor.capture import capture

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with capture(tmp_path, wait=1, warmup=1, active=1) as cap:
        _tiny_loop(cap, 3, torch)
    assert (cap.rank, cap.world_size) == (3, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank3.json.gz"]


def test_exception_in_block_leaves_incomplete_meta(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from fsdpdoctor.capture import capture

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        with capture(tmp_path, wait=1, warmup=1, active=1) as cap:
            _tiny_loop(cap, 5, torch, fail_at=4)
    meta = json.loads((tmp_path / "fsdpdoctor_meta.json").read_text())
    assert meta["complete"] is False
    assert meta["trace_files"] == ["rank0.json.gz"]  # step 2 was profiled before the failure
    assert sorted(Trace(tmp_path / "rank0.json.gz").steps) == [2]


def test_memory_history_is_skipped_without_cuda(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    # The no-CUDA path runs on every machine, a GPU one included: CUDA is hidden from capture.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from fsdpdoctor.capture import capture

    monkeypatch.delenv("RANK", raising=False)
    with capture(tmp_path, wait=1, warmup=1, active=1, memory_history=True) as cap:
        _tiny_loop(cap, 3, torch)
    assert cap.memory_snapshot_path is None
    assert not list(tmp_path.glob("*.pickle"))
    meta = json.loads((tmp_path / "fsdpdoctor_meta.json").read_text())
    assert meta["capture"]["memory_history"] is False
    assert meta["memory_snapshot_files"] == []


def test_invalid_schedule_rejected(tmp_path):
    from fsdpdoctor.capture import Capture

    with pytest.raises(ValueError):
        Capture(tmp_path, active=0)
    with pytest.raises(ValueError):
        Capture(tmp_path, wait=-1)


def test_describe_plain_model():
    torch = pytest.importorskip("torch")
    from fsdpdoctor.capture import describe_model

    for model in (None, torch.nn.Linear(2, 2)):
        desc = describe_model(model, wrap_policy="none")
        assert desc["parallelism"] is None
        assert desc["fsdp_version"] is None
        assert desc["units"] == []
        assert desc["wrap_policy"] == "none"


# ----------------------------------------------------------------------------------------------
# Recorded runs: fresh (recorded by this session) and committed (fixtures/recorded/)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(params=["fresh", "committed"])
def source(request):
    return request.param


def run_dir(source: str, variant: str, recorded_run) -> Path:
    if source == "fresh":
        return recorded_run(variant)
    d = COMMITTED / variant
    if not d.exists():
        pytest.fail(f"committed fixture {d} is missing")
    return d


_RUNS: dict[Path, tuple[dict, list[Trace]]] = {}


def load_run(d: Path) -> tuple[dict, list[Trace]]:
    """Sidecar and traces of a run directory (parsed once per session; treat as read-only)."""
    if d not in _RUNS:
        meta = json.loads((d / "fsdpdoctor_meta.json").read_text())
        _RUNS[d] = (meta, [Trace(d / name) for name in meta["trace_files"]])
    return _RUNS[d]


@pytest.mark.parametrize("variant", VARIANTS)
def test_run_files_and_sidecar(variant, source, recorded_run, recorder, recorded_world_size):
    import torch

    ws = recorded_world_size
    d = run_dir(source, variant, recorded_run)
    meta, traces = load_run(d)
    assert meta["schema"] == "fsdpdoctor.meta/1"
    assert meta["complete"] is True
    assert meta["world_size"] == ws
    assert meta["backend"] == "gloo"
    assert meta["device_type"] == "cpu"
    assert meta["trace_files"] == [f"rank{r}.json.gz" for r in range(ws)]
    assert sorted(p.name for p in d.glob("rank*")) == sorted(meta["trace_files"])
    assert meta["extra"]["variant"] == variant
    assert meta["versions"]["nccl"] is None
    if source == "fresh":
        assert meta["versions"]["torch"] == torch.__version__
    assert meta["versions"]["torch"].startswith("2.13.0")
    active = meta["capture"]["active"]
    expected_steps = list(range(recorder.WAIT + recorder.WARMUP, recorder.WAIT + recorder.WARMUP + active))
    assert meta["capture"]["profiled_steps"] == [expected_steps]
    for rank, trace in enumerate(traces):
        assert sorted(trace.steps) == expected_steps
        info = trace.raw["distributedInfo"]
        assert (info["backend"], info["rank"], info["world_size"]) == ("gloo", rank, ws)
        assert trace.raw["record_shapes"] == 1
        assert trace.raw["deviceProperties"] == []
        cats = Counter(e.get("cat") for e in trace.events)
        # CPU-only: no GPU activity of any kind, and gloo emits no record_param_comms.
        assert not {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "cuda_runtime", "ac2g"} & set(cats)
        assert not [e for e in trace.x if e["name"] == "record_param_comms"]
        assert not [e for e in trace.events if e.get("cat") == "python_function"]
        assert len(trace.named("Optimizer.step#AdamW.step")) == active

    model = recorder.build_model()
    units = recorder.unit_fqns(variant, model)
    if variant == "ddp":
        assert meta["parallelism"] == "ddp" and meta["fsdp_version"] is None
        assert meta["ddp"]["numel"] == sum(p.numel() for p in model.parameters())
        assert meta["ddp"]["bucket_cap_bytes"] == 25 * 1024 * 1024
        assert meta["units"] == []
        return
    owned = owned_params(recorder, variant)
    if variant == "fsdp1":
        assert meta["parallelism"] == "fsdp1" and meta["fsdp_version"] == 1
        assert meta["sharding_strategy"] == "FULL_SHARD"
        assert meta["backward_prefetch"] == "BACKWARD_PRE"
        assert meta["forward_prefetch"] is False
        assert meta["cpu_offload"] is False
        assert meta["mixed_precision"] is None
        assert [u["fqn"] for u in meta["units"]] == units
        for u in meta["units"]:
            shapes = [s for _, s in owned[u["fqn"]]]
            assert u["param_fqns"] == [n for n, _ in owned[u["fqn"]]]
            assert u["numel"] == sum(math.prod(s) for s in shapes)
            assert u["all_gather_numel"] == ws * fsdp1_shard_numel(shapes, ws)
            assert u["is_root"] is (u["fqn"] == "")
        return

    assert meta["parallelism"] == "fsdp2" and meta["fsdp_version"] == 2
    assert [u["fqn"] for u in meta["units"]] == units
    for u in meta["units"]:
        shapes = [s for _, s in owned[u["fqn"]]]
        root = u["fqn"] == ""
        assert u["is_root"] is root
        assert u["num_params"] == len(shapes)
        assert u["numel"] == sum(math.prod(s) for s in shapes)
        assert u["padded_sharded_numel"] == fsdp2_shard_numel(shapes, ws)
        assert u["all_gather_numel"] == ws * fsdp2_shard_numel(shapes, ws)
        assert u["shard_world_size"] == ws
        # The root's reshard_after_forward defaults to False at lazy init.
        assert u["reshard_after_forward"] is (False if root or variant == "no-reshard" else True)
        assert u["cpu_offload"] is False
    assert meta["sharding_strategy"] == ("SHARD_GRAD_OP" if variant == "no-reshard" else "FULL_SHARD")
    assert meta["backward_prefetch"] == ("none" if variant == "no-backward-prefetch" else "implicit")
    assert meta["forward_prefetch"] == "implicit"
    assert meta["cpu_offload"] is False
    if variant == "bf16-mp":
        assert meta["mixed_precision"] == {
            "param_dtype": "bfloat16",
            "reduce_dtype": None,
            "output_dtype": None,
            "cast_forward_inputs": True,
        }
    else:
        assert meta["mixed_precision"] is None


def _fsdp2_expected(recorder, variant: str, ws: int) -> tuple[list, list, list]:
    """Per step: forward AGs, backward AGs (both as (unit, In, Out)) and RSs (unit, In, Out)."""
    owned = owned_params(recorder, variant)
    units = recorder.unit_fqns(variant)
    shard = {u: fsdp2_shard_numel([s for _, s in owned[u]], ws) for u in units}
    fwd = [(u, shard[u], ws * shard[u]) for u in units]  # root first, then forward order
    bwd = [] if variant == "no-reshard" else [(u, shard[u], ws * shard[u]) for u in units if u]
    rs = [(u, ws * shard[u], shard[u]) for u in units]
    return fwd, bwd, rs


@pytest.mark.parametrize("variant", FSDP2_VARIANTS)
def test_fsdp2_collectives_match_model(variant, source, recorded_run, recorder, recorded_world_size):
    ws = recorded_world_size
    meta, traces = load_run(run_dir(source, variant, recorded_run))
    fwd_exp, bwd_exp, rs_exp = _fsdp2_expected(recorder, variant, ws)
    dtype = "c10::BFloat16" if variant == "bf16-mp" else "float"
    units = recorder.unit_fqns(variant)
    for trace in traces:
        per_step: dict[int, dict[str, list]] = {n: {"fwd": [], "bwd": [], "rs": []} for n in trace.steps}
        for ev in trace.main:
            if ev["name"] not in AG_OPS + RS_OPS + AR_OPS:
                continue
            assert ev["name"] in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_"), ev["name"]
            types = ev["args"]["Input type"]
            assert types[:2] == [dtype, dtype]
            names = trace.enclosing(ev)
            step = trace.step_of(ev)
            assert names[0] == f"ProfilerStep#{step}"
            if ev["name"] in RS_OPS:
                unit = label_unit(innermost(names, "FSDP::post_backward_reduce"), "FSDP::post_backward_reduce")
                per_step[step]["rs"].append((unit, *rs_numels(ev)))
                continue
            unit = label_unit(innermost(names, "FSDP::all_gather"), "FSDP::all_gather")
            phase = "bwd" if innermost(names, "FSDP::pre_backward") else "fwd"
            if phase == "fwd":
                assert innermost(names, "FSDP::pre_forward") == (
                    f"FSDP::pre_forward ({unit})" if unit else "FSDP::pre_forward"
                )
            per_step[step][phase].append((unit, *ag_numels(ev, ws)))
        for step, got in per_step.items():
            assert got["fwd"] == fwd_exp, (trace.path, step)
            assert sorted(got["bwd"]) == sorted(bwd_exp), (trace.path, step)
            assert sorted(got["rs"]) == sorted(rs_exp), (trace.path, step)
        # Bytes per rank per step, from first principles.
        itemsize = DTYPE_BYTES[dtype]
        ag_out_bytes = sum(o for _, _, o in fwd_exp + bwd_exp) * itemsize
        meta_ag = {u["fqn"]: u["all_gather_numel"] for u in meta["units"]}
        assert ag_out_bytes == itemsize * (
            sum(meta_ag.values()) + (0 if variant == "no-reshard" else sum(meta_ag[u] for u in units if u))
        )
        # The gloo worker threads run each collective: one gloo:all_gather per all-gather (its
        # input = this rank's shard) and, for each reduce-scatter, one gloo:all_reduce over the
        # whole (padded, unsharded) gradient buffer.
        n_steps = len(trace.steps)
        gloo_ag = Counter(e["args"]["Input Dims"][0][0] for e in trace.gloo("gloo:all_gather"))
        gloo_ar = Counter(e["args"]["Input Dims"][0][0] for e in trace.gloo("gloo:all_reduce"))
        assert gloo_ag == Counter({i: n_steps * c for i, c in Counter(i for _, i, _ in fwd_exp + bwd_exp).items()})
        assert gloo_ar == Counter({i: n_steps * c for i, c in Counter(i for _, i, _ in rs_exp).items()})
        assert {e["args"]["Input type"][0] for e in trace.gloo("gloo:all_gather")} == {dtype}


# Units whose backward all-gather FSDP2 cannot prefetch with implicit prefetching. In
# per-linear the LM head's output *is* the root's output: the head registered its pre-backward
# hook on that tensor before the root did, so the head's hook fires first and the head gathers
# itself (exposed), and the root's later "FSDP::backward_prefetch for head" finds it unsharded
# and issues nothing.
SELF_GATHERED = {"per-block": set(), "bf16-mp": set(), "per-linear": {"head"}}


@pytest.mark.parametrize("variant", ["per-block", "per-linear", "bf16-mp", "no-backward-prefetch"])
def test_fsdp2_backward_prefetch_structure(variant, source, recorded_run, recorder):
    """Implicit prefetch: unit U's backward all-gather is issued under
    ``FSDP::backward_prefetch for U`` inside the pre-backward of the unit that follows U in
    post-forward order (the root for the last unit), except for SELF_GATHERED units. Disabled:
    no such labels at all, and every unit's all-gather sits directly in its own
    ``FSDP::pre_backward (U)``."""
    meta, traces = load_run(run_dir(source, variant, recorded_run))
    units = recorder.unit_fqns(variant)
    order = units[1:] + [""]  # post-forward order: children first, the root last
    nxt = {u: order[i + 1] for i, u in enumerate(order[:-1])}
    for trace in traces:
        labels = [e for e in trace.main if e["name"].startswith("FSDP::backward_prefetch for ")]
        self_gathered = Counter()
        n_bwd = 0
        for ev in trace.main:
            if ev["name"] != "c10d::_allgather_base_":
                continue
            names = trace.enclosing(ev)
            pre_bwd = innermost(names, "FSDP::pre_backward")
            if pre_bwd is None:
                continue
            n_bwd += 1
            unit = label_unit(innermost(names, "FSDP::all_gather"), "FSDP::all_gather")
            prefetch = innermost(names, "FSDP::backward_prefetch for ")
            owner = label_unit(pre_bwd, "FSDP::pre_backward")
            if prefetch is None:
                assert owner == unit, (names, unit)
                self_gathered[unit] += 1
            else:
                assert prefetch == f"FSDP::backward_prefetch for {unit}"
                assert owner == nxt[unit], (names, unit)
        assert n_bwd == (len(units) - 1) * len(trace.steps)
        if variant == "no-backward-prefetch":
            assert labels == []
            assert self_gathered == Counter({u: len(trace.steps) for u in units if u})
        else:
            assert self_gathered == Counter({u: len(trace.steps) for u in SELF_GATHERED[variant]})
            # Every pre-backward but the first unit's emits one prefetch label, even when the
            # target is already unsharded and the label contains no collective.
            assert len(labels) == (len(units) - 1) * len(trace.steps)
            empty = [
                e["name"]
                for e in labels
                if not [
                    c
                    for c in trace.main
                    if c["name"] == "c10d::_allgather_base_" and e["ts"] <= c["ts"] <= e["ts"] + e["dur"]
                ]
            ]
            assert sorted(empty) == sorted(
                f"FSDP::backward_prefetch for {u}" for u in SELF_GATHERED[variant] for _ in trace.steps
            )


@pytest.mark.parametrize("variant", ["per-block", "no-reshard"])
def test_fsdp2_reshard_after_forward(variant, source, recorded_run, recorder):
    """reshard_after_forward=False: parameters stay unsharded between forward and backward, so no
    ``FSDP::pre_backward`` issues an all-gather and no prefetch label appears."""
    meta, traces = load_run(run_dir(source, variant, recorded_run))
    for trace in traces:
        bwd = [
            e
            for e in trace.main
            if e["name"] == "c10d::_allgather_base_" and innermost(trace.enclosing(e), "FSDP::pre_backward")
        ]
        pre_bwd = {e["name"] for e in trace.named("FSDP::pre_backward")}
        assert pre_bwd == {"FSDP::pre_backward"} | {
            f"FSDP::pre_backward ({u})" for u in recorder.unit_fqns(variant) if u
        }
        if variant == "no-reshard":
            assert bwd == []
            # Implicit prefetch still runs and still emits its labels; they are just empty.
            labels = trace.named("FSDP::backward_prefetch for ")
            assert len(labels) == (len(recorder.unit_fqns(variant)) - 1) * len(trace.steps)
            for lab in labels:
                assert not [
                    e for e in trace.main if e["name"] in AG_OPS and lab["ts"] <= e["ts"] <= lab["ts"] + lab["dur"]
                ]
        else:
            assert len(bwd) == (len(recorder.unit_fqns(variant)) - 1) * len(trace.steps)


def test_ddp_allreduce_covers_all_parameters(source, recorded_run, recorder, recorded_world_size):
    import torch.distributed as dist

    meta, traces = load_run(run_dir(source, "ddp", recorded_run))
    model = recorder.build_model()
    numel = sum(p.numel() for p in model.parameters())
    # DDP's first bucket is capped at _DEFAULT_FIRST_BUCKET_BYTES (1 MiB); every fp32 gradient of
    # this model fits in it, so each step all-reduces exactly one bucket holding all of them.
    assert numel * 4 < dist._DEFAULT_FIRST_BUCKET_BYTES
    for trace in traces:
        assert not [e for e in trace.main if e["name"].startswith("FSDP") or e["name"] in AG_OPS + RS_OPS]
        ars = [e for e in trace.main if e["name"] in AR_OPS]
        assert len(ars) == len(trace.steps)
        for ev in ars:
            dims = ev["args"]["Input Dims"][0]  # Tensor[] (one flat bucket)
            assert sum(math.prod(d) for d in dims) == numel
            assert trace.enclosing(ev)[0].startswith("ProfilerStep#")
        gloo = trace.gloo("gloo:all_reduce")
        assert [(e["args"]["Input Dims"], e["args"]["Input type"]) for e in gloo] == [([[numel]], ["float"])] * len(ars)
        assert len(trace.named("DistributedDataParallel.forward")) == len(trace.steps)


def test_fsdp1_collectives_match_model(source, recorded_run, recorder, recorded_world_size):
    ws = recorded_world_size
    meta, traces = load_run(run_dir(source, "fsdp1", recorded_run))
    owned = owned_params(recorder, "fsdp1")
    units = recorder.unit_fqns("fsdp1")
    shard = {u: fsdp1_shard_numel([s for _, s in owned[u]], ws) for u in units}
    for trace in traces:
        for step in trace.steps:
            evs = [e for e in trace.main if e["name"] in AG_OPS + RS_OPS and trace.step_of(e) == step]
            fwd, bwd, rs = [], [], []
            for ev in evs:
                names = trace.enclosing(ev)
                if ev["name"] in RS_OPS:
                    assert (
                        innermost(names, "FullyShardedDataParallel.") == "FullyShardedDataParallel._post_backward_hook"
                    )
                    rs.append(rs_numels(ev))
                    continue
                # On CPU, FSDP1 all-gathers with dist.all_gather(list) -> c10d::allgather_.
                assert ev["name"] == "c10d::allgather_"
                where = innermost(names, "FullyShardedDataParallel.")
                if where == "FullyShardedDataParallel._pre_forward":
                    fwd.append(ag_numels(ev, ws))
                else:  # BACKWARD_PRE: issued by the previous unit's pre-backward hook
                    assert where == "FullyShardedDataParallel._pre_backward_prefetch", names
                    bwd.append(ag_numels(ev, ws))
            assert fwd == [(shard[u], ws * shard[u]) for u in units]
            # FULL_SHARD never reshards the root after forward: no backward AG for it.
            assert bwd == [(shard[u], ws * shard[u]) for u in reversed(units) if u]
            assert sorted(rs) == sorted((ws * shard[u], shard[u]) for u in units)
        gloo_ag = trace.gloo("gloo:all_gather")
        assert {e["args"]["Input type"][0] for e in gloo_ag} == {"float"}
        assert len(gloo_ag) == (2 * len(units) - 1) * len(trace.steps)


def test_committed_fixtures_are_small_and_documented():
    gpu_sets = ("gpu", "gpu-h200")  # the GPU recordings (fixtures/record_gpu.py), one folder per device
    # the levers' twins (fixtures/record_gpu_levers.py): twelve 4-step runs of a 168M-parameter model, 0.5-1 MB each
    twin_sets = ("gpu-h200-levers",)
    # dump folders written by a framework itself (fixtures/record_torchtitan.py), each with its README
    framework_sets = tuple(p.name for p in COMMITTED.glob("torchtitan-*") if p.is_dir())
    for name in framework_sets:
        own = [p for p in (COMMITTED / name).rglob("*") if p.is_file()]
        assert sum(p.stat().st_size for p in own) < 2 * 1024 * 1024, name
        assert "torchtitan `" in (COMMITTED / name / "README.md").read_text(), name  # the version that wrote it
    for name in twin_sets:
        own = [p for p in (COMMITTED / name).rglob("*") if p.is_file()]
        assert own and sum(p.stat().st_size for p in own) < 12 * 1024 * 1024, name
        readme = (COMMITTED / name / "README.md").read_text()
        assert all(f"`{d.name}`" in readme for d in (COMMITTED / name).iterdir() if d.is_dir()), name
    apart = set(gpu_sets) | set(framework_sets) | set(twin_sets)
    files = [p for p in COMMITTED.rglob("*") if p.is_file() and not apart & set(p.relative_to(COMMITTED).parts)]
    assert sum(p.stat().st_size for p in files) < 3 * 1024 * 1024
    for name in gpu_sets:
        gpu = [p for p in (COMMITTED / name).rglob("*") if p.is_file()]
        assert gpu and sum(p.stat().st_size for p in gpu) < 3 * 1024 * 1024, name
        readme = (COMMITTED / name / "README.md").read_text()
        for d in (p for p in (COMMITTED / name).iterdir() if p.is_dir()):
            assert f"`{d.name}`" in readme, (name, d.name)
    readme = (COMMITTED / "README.md").read_text()
    for variant in VARIANTS:
        assert (COMMITTED / variant / "fsdpdoctor_meta.json").exists(), variant
        assert f"`{variant}`" in readme
        for rank in range(2):
            path = COMMITTED / variant / f"rank{rank}.json.gz"
            assert path.stat().st_size < 300 * 1024, path
