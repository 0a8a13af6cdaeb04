"""Hangs from real Flight Recorder dumps: FSDP2 jobs on gloo (4 CPU processes) broken on purpose,
one scenario per cause (fixtures/record_hang.py), each diagnosed against what the scenario did.

Ground truth comes from the scenario's definition (which rank, which step, which layer) and from
the process group's own sequence counter, logged by every rank before every step
(``ProcessGroup._get_sequence_number_for_group()``: the next collective gets that number + 1);
never from fsdpdoctor's output. torch's ``fr_trace`` runs on the same dumps; what it says is printed
beside our verdict (``pytest -s``), not asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import fsdpdoctor
from _suiteweb_fr_server import run_fr_trace  # _fr_peer.run_fr_trace, torch imported once per process
from fixtures import record_hang as rec

REPO = Path(__file__).resolve().parents[1]


def _case(hang_recording, scenario: str):
    d = hang_recording(scenario)
    truth = json.loads((d / "truth.json").read_text())
    return d / "dumps", truth, fsdpdoctor.analyze(d / "dumps")


def _seq_before(truth: dict, rank: int, step: int, group: str = "default") -> int:
    return truth["ranks"][str(rank)]["seq_at_step"][str(step)][group]


def _line_of(text: str) -> int:
    """The line of fixtures/record_hang.py holding ``text`` (the scenario's own code)."""
    lines = Path(rec.__file__).read_text().splitlines()
    return next(i + 1 for i, ln in enumerate(lines) if text in ln)


def test_leave_early_names_the_rank_that_left_and_the_first_all_gather_of_the_step(hang_recording):
    dumps, truth, rep = _case(hang_recording, "leave-early")
    h = rep.facts.hang
    culprit, at = truth["culprit"], truth["at_step"]
    others = [r for r in range(truth["world_size"]) if r != culprit]
    assert truth["ranks"][str(culprit)]["outcome"].startswith("left the loop")
    assert h.kind == "missing"
    assert h.missing_ranks == [culprit] and h.culprit_ranks == [culprit]
    assert h.waiting_ranks == others
    assert h.seq_id == _seq_before(truth, others[0], at) + 1  # the step's first collective
    assert h.op == "all_gather"
    entered = {o.rank: o for o in h.ops if o.status == "entered"}
    assert sorted(entered) == others
    first = entered[others[0]]
    assert first.fsdp == "FSDP2 unshard" and first.phase == "forward" and first.step == at + 1 and first.unit == 1
    c = h.culprits[0]
    assert c.step == at  # its last collective belongs to the step before (1-based)
    assert c.stack and "post_backward" in " ".join(c.stack)  # it last reduced gradients, then left
    assert rep.findings[0].slug == "collective-hang" and rep.findings[0].severity == "critical"
    assert rep.findings[0].where["ranks"] == [culprit]
    assert h.summary.startswith(f"rank {culprit} never entered all_gather #{h.seq_id} (FSDP2 unshard")
    assert f"forward of step {at + 1}" in h.summary


def test_stall_names_the_late_rank_and_how_late(hang_recording):
    dumps, truth, rep = _case(hang_recording, "stall")
    h = rep.facts.hang
    culprit, at = truth["culprit"], truth["at_step"]
    others = [r for r in range(truth["world_size"]) if r != culprit]
    assert h.kind == "late"
    assert [x.rank for x in h.late_ranks] == [culprit] and h.culprit_ranks == [culprit]
    assert h.seq_id == _seq_before(truth, others[0], at) + 1
    # it slept stall_s before the step; the others entered the step's first all-gather within ms
    assert abs(h.late_ranks[0].late_s - truth["stall_s"]) < 1.0, h.late_ranks
    assert h.late_ranks[0].gap_s > truth["stall_s"] - 0.5 and h.late_ranks[0].others_gap_s < 0.5
    assert h.summary.startswith(f"rank {culprit} entered all_gather #{h.seq_id}")
    assert "after the others" in h.summary


def test_collective_on_rank_0_only_is_a_mismatch_pointing_at_the_metric_line(hang_recording):
    dumps, truth, rep = _case(hang_recording, "rank0-metric")
    h = rep.facts.hang
    culprit = truth["culprit"]
    assert h.kind == "mismatch" and h.culprit_ranks == [culprit]
    assert h.seq_id == truth["ranks"][str(culprit)]["seq_before_metric"] + 1
    mine = next(o for o in h.mismatched_ranks if o.rank == culprit)
    assert mine.op == "all_reduce" and mine.input_sizes == [[]]  # a scalar
    assert mine.call_site == f"record_hang.py:{_line_of('dist.all_reduce(metric)')} in worker"
    assert h.op == "all_gather" and h.waiting_ranks == [1, 2, 3]
    assert h.summary.startswith("rank 0 ran all_reduce of a scalar (record_hang.py:")
    assert "where ranks 1–3 ran all_gather #" in h.summary
    assert "dist.all_reduce(metric" in rep.findings[0].fix["any"] or "all_reduce(metric" in rep.findings[0].fix["any"]


def _shard_numel(out_features: int, in_features: int, ws: int) -> int:
    """FSDP2 shards weight [out, in] and bias [out] on dim 0, padded to a multiple of the world size."""
    rows = math.ceil(out_features / ws)
    return rows * in_features + rows


def test_model_built_differently_is_a_size_mismatch_and_the_aborted_rank_has_no_dump(hang_recording):
    dumps, truth, rep = _case(hang_recording, "model-differs")
    h = rep.facts.hang
    culprit, ws, layer = truth["culprit"], truth["world_size"], truth["diff_layer"]
    no_dump = sorted(int(r) for r, v in truth["ranks"].items() if not v["dump"])
    aborted = sorted(int(r) for r, v in truth["ranks"].items() if v["exit_code"] not in (0, None))
    assert no_dump and no_dump == aborted  # gloo aborts (SIGABRT) the receiving side before it can dump
    assert culprit not in no_dump
    assert h.kind == "mismatch" and h.culprit_ranks == [culprit]
    assert h.ranks_without_dump == no_dump
    ref = next(r for r in range(ws) if r not in no_dump and r != culprit)
    # the root holds no parameters: layer k's all-gather is the step's (k + 1)-th collective
    assert h.seq_id == _seq_before(truth, ref, 0) + layer + 1
    mine = next(o for o in h.mismatched_ranks if o.rank == culprit)
    assert mine.input_sizes == [[_shard_numel(rec.DIFF_WIDTH, rec.DIM, ws)]]
    others = [o for o in h.ops if o.status == "entered"]
    assert others and all(o.input_sizes == [[_shard_numel(rec.DIM, rec.DIM, ws)]] for o in others)
    assert {o.rank for o in h.ops if o.status == "no_dump"} == set(no_dump)
    assert f"no dump from rank{'s' if len(no_dump) > 1 else ''} {no_dump[0]}" in h.summary
    assert "model differs" in rep.findings[0].fix["any"] or "parameter counts" in rep.findings[0].fix["any"]


def test_hsdp_hang_is_placed_in_the_shard_group_and_the_replicas_are_victims(hang_recording):
    dumps, truth, rep = _case(hang_recording, "hsdp")
    h = rep.facts.hang
    culprit, at = truth["culprit"], truth["at_step"]
    # mesh (replicate=2, shard=2): shard groups are consecutive rank pairs
    shard_group = [2 * (culprit // 2), 2 * (culprit // 2) + 1]
    partner = next(r for r in shard_group if r != culprit)
    assert h.kind == "missing" and h.culprit_ranks == [culprit]
    assert h.process_group.ranks == shard_group and h.process_group.desc == "mesh_shard"
    assert h.process_group.ranks_from == "dumps"  # gloo's pg_config names no group
    assert h.seq_id == _seq_before(truth, partner, at, "shard") + 1
    assert h.waiting_ranks == [partner] and h.missing_ranks == [culprit]
    # the other pair got through its shard group and waits in the replicate all-reduce
    assert any("mesh_replicate" in line for line in h.also_stuck), h.also_stuck
    assert not any(r in h.culprit_ranks for r in range(4) if r != culprit)


def test_fsdp1_stacks_say_unshard_in_forward_and_reduce_in_backward(hang_recording):
    dumps, truth, rep = _case(hang_recording, "fsdp1-leave-early")
    h = rep.facts.hang
    culprit, at = truth["culprit"], truth["at_step"]
    others = [r for r in range(truth["world_size"]) if r != culprit]
    assert h.kind == "missing" and h.culprit_ranks == [culprit]
    assert h.seq_id == _seq_before(truth, others[0], at) + 1
    first = next(o for o in h.ops if o.status == "entered")
    # FSDP1 wraps each nn.Linear; the root holds no parameters: the step's first all-gather is layer 0's
    assert (first.fsdp, first.phase, first.step, first.unit) == ("FSDP1 unshard", "forward", at + 1, 1)
    c = h.culprits[0]
    assert c.fsdp == "FSDP1 post_backward reduce" and c.phase == "backward" and c.step == at
    assert any("_post_backward_hook" in f for f in c.stack)


def test_terminal_ticket_names_culprit_and_collective_first(hang_recording):
    d = hang_recording("leave-early") / "dumps"
    truth = json.loads((d.parent / "truth.json").read_text())
    before = sorted(p.name for p in d.iterdir())
    r = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "analyze", str(d)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    head = "\n".join(r.stdout.splitlines()[:4])
    assert "Hang" in head and f"rank {truth['culprit']} never entered all_gather #" in head
    assert sorted(p.name for p in d.iterdir()) == before  # nothing written into the input folder
    js = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "analyze", str(d), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    doc = json.loads(js.stdout)  # validated against the schema too (FSDPDOCTOR_CHECK_SCHEMA=1)
    assert doc["hang"]["missing_ranks"] == [truth["culprit"]] and doc["findings"][0]["where"]["ranks"] == [
        truth["culprit"]
    ]
    for fmt in ("markdown", "html"):
        out = subprocess.run(
            [sys.executable, "-m", "fsdpdoctor", "analyze", str(d), "--format", fmt],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0 and f"rank {truth['culprit']} never entered" in out.stdout, out.stderr


@pytest.mark.parametrize("scenario", rec.SCENARIOS)
def test_torch_fr_trace_beside_ours(hang_recording, scenario):
    """torch's analyzer on the same dumps: recorded, not asserted (on gloo it stops with KeyError)."""
    d = hang_recording(scenario) / "dumps"
    ours = fsdpdoctor.analyze(d).facts.hang
    peer = run_fr_trace(d, "--allow-incomplete-ranks")
    print(f"\n{scenario}: fsdpdoctor: {ours.kind} ranks {ours.culprit_ranks} #{ours.seq_id} | fr_trace: {peer.text()}")
    assert ours.culprit_ranks  # ours always names the culprit; theirs is only reported
