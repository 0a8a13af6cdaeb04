"""Training-only memory advice (activation checkpointing: FSD020, FSD024's fix) is given only where
activations saved for a backward pass are established (#41): never from a snapshot without
allocation history (blocks at dump time told apart by their stacks alone), never in an inference
run (no backward pass or optimizer step); FSD025 says what could not be established instead.

The real snapshots are the public ones in ../shared/snapshots/public (PROVENANCE.md there); what
each holds is read independently with the standard library (a pickle loader refusing every
global), never with the product's code.
"""

from __future__ import annotations

import copy
import pickle
from collections import Counter

import pytest

import fsdpdoctor
from conftest import PUBLIC_SNAPSHOTS
from fsdpdoctor.config import defaults
from fsdpdoctor.engine import run_rules

HISTORY_LESS = "layoutediting-diffusers-cuda1-2024/dump_snapshot.pickle"  # diffusers evaluation, no history
TRAINING = "cs336-a2-torch211-windows/memory_snapshot.pickle"  # forward + loss.backward(), with history
CHECKPOINT_CODE = "apply_activation_checkpointing"


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name}")


def _raw(rel: str) -> dict:
    p = PUBLIC_SNAPSHOTS / rel
    if not p.exists():
        pytest.skip(f"../shared/snapshots/public/{rel} is absent")
    with open(p, "rb") as fh:
        return _NoGlobals(fh).load()


def _analyze(rel: str):
    return fsdpdoctor.analyze(PUBLIC_SNAPSHOTS / rel)


def _advice(rep) -> list[str]:
    """Codes of the findings whose fix is activation checkpointing."""
    return [f.code for f in rep.findings if any(CHECKPOINT_CODE in code for code in f.fix.values())]


def test_history_less_snapshot_gets_no_checkpointing_advice():
    raw = _raw(HISTORY_LESS)
    actions = Counter(e.get("action") for t in raw["device_traces"] for e in t)
    assert not actions["alloc"]  # no allocation history: no lifetimes, no backward recorded
    gib = sum(b["size"] for s in raw["segments"] for b in s["blocks"] if b["state"] == "active_allocated") / 2**30
    rep = _analyze(HISTORY_LESS)
    codes = [f.code for f in rep.findings]
    assert "FSD020" not in codes and not _advice(rep), [f.summary for f in rep.findings]
    # said instead: what could not be established, with the bytes in question
    f = next(f for f in rep.findings if f.code == "FSD025")
    fwd = rep.facts.memory.categories["activations"]
    assert fwd > 0 and f"{fwd / 2**30:.2f} GiB allocated in forward" in f.summary
    assert "is not established" in f.summary and "no checkpointing advice" in f.summary
    assert f"{gib:.2f} GiB allocated" in " ".join(f.evidence)  # 9.98 GiB, as the stdlib sums it


def test_training_snapshot_keeps_its_advice_and_an_inference_run_gets_none():
    """The torch 2.11 snapshot records a training step (its history holds loss.backward()'s
    _make_grads): FSD020 advises checkpointing. The same memory in a run whose traces show no
    backward pass (workload "inference", as the trace classifier sets it) gets no such advice."""
    raw = _raw(TRAINING)
    frames = [f.get("name") for t in raw["device_traces"] for e in t for f in e.get("frames") or []]
    assert "_make_grads" in frames and "backward" in frames
    rep = _analyze(TRAINING)
    assert "FSD020" in _advice(rep)
    facts = copy.deepcopy(rep.facts)
    facts.workload = "inference"
    found = run_rules(facts, defaults())
    assert "FSD020" not in [f.code for f in found]
    assert not [f.code for f in found if any(CHECKPOINT_CODE in c for c in f.fix.values())]


def test_oom_in_a_forward_activation_of_an_inference_run_is_not_told_to_checkpoint(tmp_path):
    """FSD024 names checkpointing for an OOM in a forward activation of a training run (the
    generated snapshot's truth), and not in an inference run: the allocator's fix stays."""
    from fixtures.snapshots import gen_snapshot as gen

    snap, _truth = gen.write("fsdp2_act_oom", tmp_path)
    rep = fsdpdoctor.api.analyze_memory_only(snap)
    oom = next(f for f in rep.findings if f.code == "FSD024")
    assert CHECKPOINT_CODE in oom.fix["any"]
    facts = copy.deepcopy(rep.facts)
    facts.workload = "inference"
    oom = next(f for f in run_rules(facts, defaults()) if f.code == "FSD024")
    assert not any(CHECKPOINT_CODE in c for c in oom.fix.values()), oom.fix
    assert "expandable_segments" in oom.fix["any"]  # the fragmentation it also found
