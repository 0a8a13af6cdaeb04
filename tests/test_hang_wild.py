"""Flight Recorder dumps the FSDP counters do not fit (issue #41 item 8).

The dumps are written in the layout of a real torch 2.13 gloo recording (the entry dicts keep
every key of ``$FSDPDOCTOR_HANG_DIR/leave-early`` rank 0's last entry, only what differs is set):

* a DDP job on 2 ranks: DDP records no collective in forward (one buffer broadcast from its
  forward in the first step here), its gradient buckets are all-reduced in backward; rank 1
  stops before step 3's backward. The truth is step 3; the forward-driven counter never moves,
  so the report must say "step unknown", not "backward of step 1".
* the same with a send/recv per step that gloo does not record (``op_id`` counts it,
  ``collective_seq_id`` does not); in step 3 rank 1 waits in a receive from rank 0 that rank 0
  never sends. Rank 1 is named (it never entered the all-reduce) and is the victim: the report
  must say it may be.
"""

from __future__ import annotations

import copy
import json
import io
import os
import pickle
from pathlib import Path

import pytest

import fsdpdoctor

HANG = Path(os.environ.get("FSDPDOCTOR_HANG_DIR", "/work/hang"))
TEMPLATE = HANG / "leave-early" / "dumps" / "nccl_trace_rank_0"
pytestmark = pytest.mark.skipif(not TEMPLATE.is_file(), reason="recorded gloo hangs absent (FSDPDOCTOR_HANG_DIR)")

TORCH = "/venv/lib/python3.11/site-packages/torch"
BUCKETS = ([[1048576]], [[262144]])  # two gradient buckets, all-reduced each backward


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):  # noqa: ARG002
        raise pickle.UnpicklingError("refused")


def _template() -> dict:
    return _NoGlobals(io.BytesIO(TEMPLATE.read_bytes())).load()


def _frames(kind: str) -> list[dict]:
    train = {"name": "train", "filename": "/job/train_ddp.py", "line": 40}
    if kind == "forward":  # DDP.forward -> _sync_buffers -> broadcast
        return [
            {"name": "broadcast", "filename": f"{TORCH}/distributed/distributed_c10d.py", "line": 2790},
            {"name": "_sync_buffers", "filename": f"{TORCH}/nn/parallel/distributed.py", "line": 2100},
            {"name": "forward", "filename": f"{TORCH}/nn/parallel/distributed.py", "line": 1640},
            {"name": "_call_impl", "filename": f"{TORCH}/nn/modules/module.py", "line": 1784},
            train,
        ]
    return [  # the reducer's bucket all-reduce, under loss.backward()
        {"name": "all_reduce", "filename": f"{TORCH}/distributed/distributed_c10d.py", "line": 2940},
        {"name": "_engine_run_backward", "filename": f"{TORCH}/autograd/graph.py", "line": 829},
        {"name": "backward", "filename": f"{TORCH}/autograd/__init__.py", "line": 364},
        {"name": "backward", "filename": f"{TORCH}/_tensor.py", "line": 647},
        {"name": "train", "filename": "/job/train_ddp.py", "line": 44},
    ]


def _write(tmp: Path, *, sendrecv: bool) -> Path:
    tpl = _template()
    base = tpl["entries"][-1]
    out = tmp / "dumps"
    out.mkdir()
    for rank in (0, 1):
        entries, seq, op = [], 0, 0

        def add(profiling, sizes, kind):
            nonlocal seq, op
            seq += 1
            op += 1
            e = copy.deepcopy(base)
            e.update(
                record_id=len(entries),
                collective_seq_id=seq,
                op_id=op,
                p2p_seq_id=0,
                profiling_name=profiling,
                input_sizes=sizes,
                output_sizes=sizes,
                input_dtypes=["Float"],
                output_dtypes=["Float"],
                time_created_ns=base["time_created_ns"] + 1_000_000 * len(entries),
                frames=_frames(kind),
            )
            entries.append(e)

        for step in (1, 2, 3):
            if step == 1:
                add("gloo:broadcast", [[64]], "forward")
            if sendrecv:  # a send (rank 0) / recv (rank 1) gloo does not record: op_id moves alone
                if step == 3 and rank == 1:
                    break  # rank 1 waits in the recv from rank 0, which rank 0 never sends
                if step < 3:
                    op += 1
            elif step == 3 and rank == 1:
                break  # rank 1 stops before step 3's backward
            for sizes in BUCKETS:
                add("gloo:all_reduce", sizes, "backward")
        dump = dict(tpl, entries=entries)
        dump["pg_status"] = {
            "0": {"last_enqueued_collective": seq, "last_started_collective": -1, "last_completed_collective": seq - 1}
        }
        (out / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
    return out


def test_ddp_hang_has_no_step_number(tmp_path):
    h = fsdpdoctor.analyze(_write(tmp_path, sendrecv=False)).facts.hang
    assert h.kind == "missing" and h.missing_ranks == [1]
    assert h.seq_id == 6  # broadcast + 2 buckets x 2 steps, then step 3's first bucket
    assert "step 1" not in h.summary and "step unknown" in h.summary
    assert all(o.step is None for o in h.ops)
    assert any("DDP records no collective in forward" in n for n in h.notes)
    assert h.caveat is None  # every op was recorded


def test_unrecorded_send_recv_makes_the_named_rank_a_possible_victim(tmp_path):
    out = tmp_path / "r.txt"
    dumps = _write(tmp_path, sendrecv=True)
    rep = fsdpdoctor.analyze(dumps)
    h = rep.facts.hang
    assert h.culprit_ranks == [1]
    # op_id ran ahead by one unrecorded send/recv per completed step: 2 on each rank
    assert h.unrecorded_ops == {0: 2, 1: 2}
    assert h.caveat is not None and "rank 1 may be a victim of an unrecorded send/recv" in h.caveat
    from conftest import cli_in_process

    code, err = cli_in_process(["analyze", str(dumps), "-o", str(out)])
    assert code == 0, err
    assert "may be a victim of an unrecorded send/recv" in " ".join(out.read_text().replace("│", " ").split())


def test_real_fsdp_hangs_keep_their_step():
    """The real FSDP2 gloo recordings still establish the step (truth: record_hang.py AT_STEP)."""
    h = fsdpdoctor.analyze(HANG / "leave-early" / "dumps").facts.hang
    assert "forward of step 3" in h.summary and h.caveat is None and not h.unrecorded_ops


# --------------------------------------------------------------------------- real gloo recordings


def test_real_ddp_hang_says_step_unknown(hang_recording):
    """fixtures/record_hang.py ``ddp-leave-early``: DDP on 4 gloo processes, rank 1 leaves before
    step index 2 (the third step). DDP's only forward collectives are a broadcast in the second
    step's ``_pre_forward``; the step counter read 'backward of step 1'."""
    d = hang_recording("ddp-leave-early")
    truth = json.loads((d / "truth.json").read_text())
    culprit, at = truth["culprit"], str(truth["at_step"])
    h = fsdpdoctor.analyze(d / "dumps").facts.hang
    assert h.kind == "missing" and h.missing_ranks == [culprit]
    assert h.seq_id == truth["ranks"][str(culprit)]["seq_at_step"][at]["default"] + 1
    assert "backward, step unknown" in h.summary
    assert "of step" not in h.summary and all(o.step is None for o in h.ops)
    assert h.caveat is None and not h.unrecorded_ops  # DDP on gloo records every collective it runs


def test_real_sendrecv_victims_are_said_to_be_possible_victims(hang_recording):
    """``sendrecv-victim``: a ring send/recv before every step (gloo records none of them); at step
    index 2 rank 0 skips its send. Rank 1 waits in its receive from 0, rank 2 in its receive from
    1; ranks 0 and 3 enter the step's first all-gather. Ranks 1 and 2 are named (they never entered
    it) and are victims: the caveat says they may be."""
    d = hang_recording("sendrecv-victim")
    truth = json.loads((d / "truth.json").read_text())
    at = truth["at_step"]
    h = fsdpdoctor.analyze(d / "dumps").facts.hang
    assert h.missing_ranks == [1, 2] and truth["culprit"] == 0
    # op_id counts at each rank's last recorded entry: 2 ring ops per finished step, plus the step
    # `at`'s ops of the ranks that got through it (rank 0: its receive; rank 3: receive and send)
    assert h.unrecorded_ops == {0: 2 * at + 1, 1: 2 * at, 2: 2 * at, 3: 2 * at + 2}
    assert h.caveat.startswith("ranks 1, 2 may be victims of an unrecorded send/recv")


def test_the_dump_ledger_counts_every_entry_and_state():
    """Per rank: entries, p2p entries and states as the raw pickles hold them (read here with an
    unpickler that refuses every global); gloo records no started/completed state."""
    d = HANG / "leave-early" / "dumps"
    h = fsdpdoctor.analyze(d).facts.hang
    for led in h.dump_ledger:
        raw = _NoGlobals(io.BytesIO((d / f"nccl_trace_rank_{led.rank}").read_bytes())).load()
        states: dict[str, int] = {}
        for e in raw["entries"]:
            states[e["state"]] = states.get(e["state"], 0) + 1
        assert led.entries == len(raw["entries"]) and led.states == states == {"scheduled": len(raw["entries"])}
        assert led.p2p_entries == sum(bool(e.get("is_p2p")) for e in raw["entries"])
        assert led.unread_keys == sorted(
            set(raw) - {"version", "pg_config", "pg_status", "entries", "comm_lib_version"}
        )
    assert [x.rank for x in h.dump_ledger] == [0, 1, 2, 3]
    assert any("no entry records a started or completed state" in n for n in h.notes)


@pytest.mark.parametrize("preset", ["coalesced", "p2p", "missing"])
def test_nccl_op_ids_ahead_on_coalesced_and_p2p_are_no_caveat(tmp_path, preset):
    """NCCL's op_id runs ahead of collective_seq_id on a coalesced group's ops and on p2p ops,
    which NCCL records: no unrecorded ops, no caveat, and FSDP steps still counted."""
    from fixtures.flight_recorder import gen

    gen.write(gen.PRESETS[preset], tmp_path)
    h = fsdpdoctor.analyze(tmp_path).facts.hang
    assert not h.unrecorded_ops and h.caveat is None
    assert "step unknown" not in h.summary
