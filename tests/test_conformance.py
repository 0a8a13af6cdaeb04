"""Conformance (#41 item 9): every public trace in ../shared/traces/public and every trace
recording in fixtures/recorded/ read by the standard library alone (tests/_stdlib_reading.py),
and the tool's figures held to it within 2%: kernels, profiler steps, GPU busy time (the union of
the GPU work's intervals), communication time (communication kernels' union; gloo/hccl spans on
CPU); and the ledger's unread share of the events that look like GPU work, steps or communication
(by the stdlib reading's own judgement) below 1%, or a headline warning naming them.

docs/inputs.md is generated from the same readings (docs/gen_inputs.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from _stdlib_reading import summarize
from _suitepub_cache import RECORDED as RECORDED_DIR
from _suitepub_cache import rank_facts, raw, read_rank, stdlib_reading
from conftest import PUBLIC_TRACES

REPO = Path(__file__).resolve().parents[1]
RECORDED = sorted((REPO / "fixtures" / "recorded").rglob("rank*.json.gz"))
PUBLIC = sorted(PUBLIC_TRACES.glob("*/*.json*")) if PUBLIC_TRACES.is_dir() else []
REL = 0.02
PAGE = REPO / "docs" / "inputs.md"


@functools.lru_cache(maxsize=None)
def _gen():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_inputs", REPO / "docs" / "gen_inputs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _id(p: Path) -> str:
    return f"{p.parent.name}/{p.name[:20]}"


@functools.lru_cache(maxsize=None)
def _page() -> frozenset[str]:
    return frozenset(PAGE.read_text().splitlines())


# tests/_stdlib_reading.py's reading, in the one stdlib pass over each file the session makes
_read = stdlib_reading(PUBLIC_TRACES, RECORDED_DIR)(summarize)


def _check(path: Path, kind: str) -> None:
    raw_ = raw(path, _read)
    # a public file's analysis is shared with the other modules that read it; a recording's facts
    # are analyze_rank's without its what-if replay (no figure here), shared with test_run_kinds
    rf = rank_facts(path) if kind == "public" else read_rank(path)
    # docs/inputs.md holds this input's row as docs/gen_inputs.py writes it today
    assert _gen().row(kind, path, raw_, rf) in _page(), "docs/inputs.md is stale: run python docs/gen_inputs.py"
    led = rf.ledger
    assert led.events == raw_["events"]
    kernels = sum(r.events for r in led.rows if r.read_as == "kernel")
    assert kernels == raw_["kernels"]
    if raw_["steps"]:
        assert rf.step_method == "ProfilerStep"
        assert len(rf.steps) == raw_["steps"]
    else:
        assert rf.step_method != "ProfilerStep"  # a fallback, named in the notes
    assert (led.gpu_busy_ms or 0.0) == pytest.approx(raw_["gpu_busy_ms"], rel=REL, abs=1e-3)
    assert (led.comm_busy_ms or 0.0) == pytest.approx(raw_["comm_busy_ms"], rel=REL, abs=1e-3)
    spans = sum((c.cpu_comm_ms_per_step or 0.0) for c in rf.collective_stats) * max(len(rf.steps), 1)
    assert spans == pytest.approx(raw_["backend_span_ms"], rel=REL, abs=1e-3)
    # unread share of what the stdlib reading calls GPU work, steps or communication
    unread_rows = {(r.ph, r.cat) for r in led.rows if r.used == 0}
    unread = {k: n for k, n in raw_["notable_kinds"].items() if k in unread_rows}
    share = sum(unread.values()) / raw_["notable"] if raw_["notable"] else 0.0
    if share >= 0.01:
        assert led.warning is not None
        top = max(unread, key=unread.get)
        assert top[1] in led.warning


@pytest.mark.skipif(not PUBLIC, reason="../shared/traces/public is absent")
@pytest.mark.parametrize("path", PUBLIC, ids=_id)
def test_public_trace_conforms_to_the_stdlib_reading(path):
    _check(path, "public")


@pytest.mark.parametrize("path", RECORDED, ids=_id)
def test_recording_conforms_to_the_stdlib_reading(path):
    _check(path, "recorded")
