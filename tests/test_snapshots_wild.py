"""Memory snapshots as they come (issue #41 items 4 and 5), held to independent stdlib readings.

Every public snapshot in ``../shared/snapshots/public`` (PROVENANCE.md there) is read here with
a pickle Unpickler that refuses every global, and its figures derived with plain Python: per
device, the bytes allocated at dump time (``active_allocated`` blocks), whether allocation
history was recorded (an ``alloc`` or ``segment_alloc`` entry in ``device_traces``) and, with
history, the peak of allocated bytes walked backwards from the dump: before an ``alloc`` entry
there were ``size`` bytes fewer, before a ``free_requested`` ``size`` bytes more (the trace's
sizes are requested sizes, the blocks' allocator-rounded ones: the 2% tolerance covers that).
The report's figures are held to those within 2%.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest

from conftest import PUBLIC_SNAPSHOTS, cli_in_process

SNAPSHOTS = {
    "fullstep": "cs336-a2-2p7b-fullstep-fp32/memory_ctx128_fullstep.pickle",
    "compiled": "cs336-a2-compiled-gpt2small/memory_snapshot.pickle",
    "windows": "cs336-a2-torch211-windows/memory_snapshot.pickle",
    "diffusers": "layoutediting-diffusers-cuda1-2024/dump_snapshot.pickle",
    "legacy_list": "layoutediting-diffusers-cuda1-2024/memory_snapshot.pkl",
}
TIMELINE = "hta-memory-timeline.raw.json.gz"
GIB = 1 << 30

pytestmark = pytest.mark.skipif(not PUBLIC_SNAPSHOTS.is_dir(), reason="../shared/snapshots/public absent")


# --------------------------------------------------------------------------- the independent reading


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):  # noqa: ARG002
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def _raw(path: Path):
    return _NoGlobals(io.BytesIO(path.read_bytes())).load()


def _reading(obj) -> dict[int, dict]:
    """device -> {allocated_at_dump, reserved_at_dump, segments, blocks, entries, history, peak}."""
    segments = obj if isinstance(obj, list) else obj["segments"]
    traces = [] if isinstance(obj, list) else (obj.get("device_traces") or [])
    out: dict[int, dict] = {}
    for seg in segments:
        d = out.setdefault(
            seg["device"], {"allocated_at_dump": 0, "reserved_at_dump": 0, "segments": 0, "blocks": 0, "entries": 0}
        )
        d["segments"] += 1
        d["reserved_at_dump"] += seg["total_size"]
        d["blocks"] += len(seg["blocks"])
        d["allocated_at_dump"] += sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    for dev, entries in enumerate(traces):
        history = any(e["action"] in ("alloc", "segment_alloc") for e in entries)
        if dev not in out and not history:
            continue
        d = out.setdefault(
            dev, {"allocated_at_dump": 0, "reserved_at_dump": 0, "segments": 0, "blocks": 0, "entries": 0}
        )
        d["entries"] = len(entries)
        d["history"] = history
        if history:
            cur = best = d["allocated_at_dump"]
            for e in reversed(entries):
                if e["action"] == "alloc":
                    cur -= e["size"]
                elif e["action"] == "free_requested":
                    cur += e["size"]
                best = max(best, cur)
            d["peak"] = best
    for d in out.values():
        d.setdefault("history", False)
    return out


@pytest.fixture(scope="session")
def readings() -> dict[str, dict[int, dict]]:
    return {k: _reading(_raw(PUBLIC_SNAPSHOTS / v)) for k, v in SNAPSHOTS.items()}


@pytest.fixture(scope="session")
def reports() -> dict[str, dict]:
    """``fsdpdoctor.analyze(<the snapshot alone>)``'s JSON report, once per file."""
    import fsdpdoctor

    return {k: json.loads(fsdpdoctor.analyze(PUBLIC_SNAPSHOTS / v).to_json()) for k, v in SNAPSHOTS.items()}


def _close(a: float, b: float, tol: float = 0.02) -> bool:
    return abs(a - b) <= tol * max(abs(b), 1)


def test_the_readings_are_what_provenance_says(readings):
    """The readings themselves against PROVENANCE.md, so they can be trusted to judge the report."""
    full = readings["fullstep"][0]
    assert full["segments"] == 1010 and full["entries"] == 19342 and full["history"]
    assert _close(full["reserved_at_dump"] / GIB, 56.9, 0.01)
    assert readings["compiled"][0]["segments"] == 96 and readings["compiled"][0]["history"]
    diff = readings["diffusers"]
    assert list(diff) == [1] and diff[1]["segments"] == 673 and not diff[1]["history"]
    assert _close(diff[1]["reserved_at_dump"] / GIB, 10.50, 0.01)
    assert list(readings["legacy_list"]) == [1] and readings["legacy_list"][1]["segments"] == 255


# --------------------------------------------------------------------------- item 4: analyze takes it by content


@pytest.mark.parametrize("name", list(SNAPSHOTS))
def test_analyze_reads_a_snapshot_alone(reports, readings, name):
    """`fsdpdoctor analyze memory_snapshot.pickle` (was: "cannot tell which rank wrote this dump")."""
    m = reports[name]["memory"]
    assert m is not None and m["source"] == "snapshot"
    (dev, want), *_ = sorted(readings[name].items(), key=lambda kv: -kv[1].get("peak", kv[1]["allocated_at_dump"]))
    assert m["device"] == dev
    if want["history"]:
        assert not m["history_missing"]
        assert _close(m["peak_allocated_bytes"], want["peak"]), (m["peak_allocated_bytes"], want["peak"])
    else:
        assert m["history_missing"]
        assert _close(m["peak_allocated_bytes"], want["allocated_at_dump"])
        assert _close(m["reserved_at_peak_bytes"], want["reserved_at_dump"])


def test_analyze_cli_takes_a_snapshot_a_timeline_and_a_mix(tmp_path):
    for name in (SNAPSHOTS["compiled"], TIMELINE):
        code, err = cli_in_process(["analyze", str(PUBLIC_SNAPSHOTS / name), "-o", str(tmp_path / "r.txt")])
        assert code == 0, err
        assert "cannot tell which rank" not in err
        assert "Memory" in (tmp_path / "r.txt").read_text()
    # a folder of snapshots alone, and a snapshot beside Flight Recorder dumps
    code, err = cli_in_process(
        ["analyze", str(PUBLIC_SNAPSHOTS / "layoutediting-diffusers-cuda1-2024"), "-o", str(tmp_path / "d.txt")]
    )
    assert code == 0, err


def test_a_pickle_that_is_neither_is_one_line(tmp_path):
    p = tmp_path / "model.pkl"
    p.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    code, err = cli_in_process(["analyze", str(p)])
    assert code == 2
    assert err.count("\n") == 1 and str(p) in err and "not a CUDA memory snapshot" in err


# --------------------------------------------------------------------------- item 5: snapshots as they come


@pytest.mark.parametrize("name", ["diffusers", "legacy_list"])
def test_without_history_it_is_the_state_at_dump_time_not_a_peak(tmp_path, name):
    out = tmp_path / "r.txt"
    code, err = cli_in_process(["analyze", str(PUBLIC_SNAPSHOTS / SNAPSHOTS[name]), "-o", str(out)])
    assert code == 0, err
    text = " ".join(out.read_text().replace("│", " ").split())
    assert "state at dump time, no allocation history recorded" in text
    assert "torch.cuda.memory._record_memory_history" in text
    head = text.split("Memory", 1)[1].split("finding")[0]
    assert "peak" not in head


def test_several_devices_in_one_process_each_get_their_peak(tmp_path, readings):
    """One process driving two GPUs: two public snapshots put on devices 0 and 1 of one snapshot
    (fields as they are, only ``device`` changed), so each device's truth is its file's reading."""
    a, b = _raw(PUBLIC_SNAPSHOTS / SNAPSHOTS["compiled"]), _raw(PUBLIC_SNAPSHOTS / SNAPSHOTS["windows"])
    for seg in b["segments"]:
        seg["device"] = 1
    both = dict(a, segments=a["segments"] + b["segments"], device_traces=[a["device_traces"][0], b["device_traces"][0]])
    p = tmp_path / "two_gpus.pickle"
    p.write_bytes(pickle.dumps(both))
    import fsdpdoctor

    rep = fsdpdoctor.analyze(p)
    m = json.loads(rep.to_json())["memory"]
    peaks = {d["device"]: d["peak_allocated_bytes"] for d in m["devices"]}
    want = {0: readings["compiled"][0]["peak"], 1: readings["windows"][0]["peak"]}
    assert set(peaks) == {0, 1}
    for dev in (0, 1):
        assert _close(peaks[dev], want[dev]), (dev, peaks[dev], want[dev])
    assert m["device"] == 1  # the breakdown is the device with the highest peak
    assert _close(m["device_imbalance"], want[1] / want[0])
    ledger = {d["device"]: d for d in m["devices"]}
    assert ledger[0]["segments"] == readings["compiled"][0]["segments"]
    assert ledger[1]["blocks"] == readings["windows"][0]["blocks"]
    assert ledger[1]["history_entries"] == ledger[1]["history_entries_read"] == readings["windows"][0]["entries"]
    out = tmp_path / "r.txt"
    code, err = cli_in_process(["analyze", str(p), "-o", str(out)])
    assert code == 0, err
    text = " ".join(out.read_text().replace("│", " ").split())
    assert "cuda:0" in text and "cuda:1" in text and "imbalance" in text


def test_the_snapshot_ledger_is_in_the_json_report(reports, readings):
    for name, rep in reports.items():
        m = rep["memory"]
        for d in m["devices"]:
            want = readings[name][d["device"]]
            assert d["segments"] == want["segments"] and d["blocks"] == want["blocks"], name
            assert d["history_missing"] == (not want["history"]), name
            assert d["history_entries"] == want["entries"], name
            if not want["history"]:
                assert d["history_entries_read"] == 0
                assert sum(d["entries_unread"].values()) == want["entries"]
    diff = reports["diffusers"]["memory"]
    assert diff["visible_devices"] == 2  # device_traces has two lists; every segment is on device 1
    assert [d["device"] for d in diff["devices"]] == [1]
    assert reports["legacy_list"]["memory"]["visible_devices"] is None  # a bare list records no devices


@pytest.mark.parametrize("name", ["fullstep", "compiled", "windows", "diffusers"])
def test_no_fsdp_means_parameters(reports, name):
    m = reports[name]["memory"]
    assert m["fsdp_version"] is None
    assert m["categories"]["parameters_sharded"] == m["categories"]["parameters_unsharded"] == 0


def test_fullstep_parameters_are_the_2p7b_model(reports):
    """The 2.7B config in fp32: its parameters are 'parameters', about 2.7e9 × 4 bytes (PROVENANCE:
    d_model 2560, 32 layers; optimizer state is AdamW's two states per parameter)."""
    c = reports["fullstep"]["memory"]["categories"]
    assert 0.9 < c["parameters"] / (2.7e9 * 4) < 1.3
    assert _close(c["optimizer_state"], 2 * c["parameters"], 0.05)


def test_adapters_and_quantized_weights_are_named_from_the_stacks(tmp_path, reports):
    """The diffusers run's stacks pass through diffusers/models/lora.py; a QLoRA-shaped snapshot
    (peft LoRA weights, a bitsandbytes Params4bit base weight) has them named by library."""
    libs = reports["diffusers"]["memory"]["stack_libraries"]
    raw = _raw(PUBLIC_SNAPSHOTS / SNAPSHOTS["diffusers"])
    want = sum(
        b["size"]
        for s in raw["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated"
        and any("diffusers/models/lora.py" in f["filename"].replace("\\", "/") for f in b.get("frames") or [])
    )
    assert want > 0 and _close(libs["LoRA layers (diffusers)"], want)

    def frame(path, name, line=1):
        return {"filename": path, "name": name, "line": line}

    lora = [frame("/x/site-packages/peft/tuners/lora/layer.py", "update_layer", 120)]
    nf4 = [  # Params4bit._quantize -> bnb.functional.quantize_4bit, innermost first
        frame("/x/site-packages/bitsandbytes/functional.py", "quantize_4bit", 1010),
        frame("/x/site-packages/bitsandbytes/nn/modules.py", "_quantize", 290),
        frame("/x/train.py", "main", 9),
    ]
    seg = {
        "device": 0,
        "address": 1 << 32,
        "total_size": 20 << 20,
        "stream": 0,
        "segment_type": "large",
        "blocks": [
            {
                "address": 1 << 32,
                "size": 4 << 20,
                "requested_size": 4 << 20,
                "state": "active_allocated",
                "frames": lora,
            },
            {
                "address": (1 << 32) + (4 << 20),
                "size": 16 << 20,
                "requested_size": 16 << 20,
                "state": "active_allocated",
                "frames": nf4,
            },
        ],
    }
    p = tmp_path / "qlora.pickle"
    p.write_bytes(pickle.dumps({"segments": [seg], "device_traces": [[]]}))
    import fsdpdoctor

    m = json.loads(fsdpdoctor.analyze(p).to_json())["memory"]
    assert m["stack_libraries"] == {"4-bit quantized weights (bitsandbytes)": 16 << 20, "LoRA adapters (peft)": 4 << 20}


def test_the_gpu_that_ran_out_is_named_beside_the_others(tmp_path, readings):
    """DataParallel-like: the project's real OOM recording (fixtures/recorded/gpu/oom) on device 1
    beside the public Windows snapshot on device 0 (a higher peak, no OOM). The breakdown is the
    highest peak's (cuda:0), the OOM line names cuda:1, and both devices have their peak."""
    import gzip

    from conftest import REPO

    oom = _NoGlobals(
        io.BytesIO(gzip.decompress((REPO / "fixtures/recorded/gpu/oom/rank0.memory.pickle.gz").read_bytes()))
    ).load()
    want_oom = _reading(oom)[0]["peak"]  # before it moves to device 1
    win = _raw(PUBLIC_SNAPSHOTS / SNAPSHOTS["windows"])
    for seg in oom["segments"]:
        seg["device"] = 1
    both = dict(
        win,
        segments=win["segments"] + oom["segments"],
        device_traces=[win["device_traces"][0], oom["device_traces"][0]],
    )
    p = tmp_path / "dp.pickle"
    p.write_bytes(pickle.dumps(both))
    out = tmp_path / "r.txt"
    code, err = cli_in_process(["analyze", str(p), "-o", str(out)])
    assert code == 0, err
    text = " ".join(out.read_text().replace("│", " ").split())
    assert "ran out of memory" in text and "on cuda:1" in text
    assert "the breakdown is cuda:0's" in text
    import fsdpdoctor

    m = json.loads(fsdpdoctor.analyze(p).to_json())["memory"]
    assert m["device"] == 0 and m["oom"]["device"] == 1
    assert [d["oom"] for d in m["devices"]] == [False, True]
    assert _close(m["devices"][0]["peak_allocated_bytes"], readings["windows"][0]["peak"])
    assert _close(m["devices"][1]["peak_allocated_bytes"], want_oom), (
        m["devices"][1]["peak_allocated_bytes"],
        want_oom,
    )
