"""Sharding-strategy advisor: known arithmetic, generated multi-node scenarios, the plan CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from _suitegen_cache import committed_report
import fsdpdoctor
from fixtures.scenarios import generator as gen
from fsdpdoctor.analysis.strategy import PlanInputs, advise, estimate, inputs_from_facts

GiB = 2**30


def _plan(params, gpus, per_node, mem=80 * GiB, **kw):
    inp = PlanInputs(params=params, world_size=gpus, gpus_per_node=per_node, gpu_memory_bytes=mem)
    for k, v in kw.items():
        setattr(inp, k, v)
    return inp


def test_zero_arithmetic_7b_adam_bf16_with_fp32_master():
    inp = _plan(7e9, 8, 8)
    assert inp.bytes_per_param == 16  # bf16 param 2 + bf16 grad 2 + fp32 master 4 + Adam 8
    c = {x.name: x for x in estimate(inp)}
    assert c["NO_SHARD"].memory_bytes == pytest.approx(7e9 * 16 + 50 * 2**20)
    assert not c["NO_SHARD"].fits  # 112 GB replicated does not fit in 80 GiB
    # FULL_SHARD: 16 B/param / 8 ranks + two unsharded units (P/32 each, bf16)
    assert c["FULL_SHARD"].memory_bytes == pytest.approx(7e9 * 16 / 8 + 2 * 7e9 / 32 * 2)
    assert c["FULL_SHARD"].fits
    # SHARD_GRAD_OP holds the whole bf16 model unsharded from forward to backward
    assert c["SHARD_GRAD_OP"].memory_bytes == pytest.approx(7e9 * 16 / 8 + 7e9 * 2)


def test_70b_on_8x80gb_does_not_fit_replicated_or_sharded():
    st = advise(_plan(70e9, 8, 8))
    c = {x.name: x for x in st.candidates}
    assert not c["NO_SHARD"].fits and not c["FULL_SHARD"].fits
    assert st.recommended is None and "No strategy fits" in st.reasoning


def test_communication_follows_nccl_tests_convention():
    inp = _plan(1e9, 8, 8, intra_busbw_gbps=100.0)
    c = {x.name: x for x in estimate(inp)}
    ag = 1e9 * 2 * 7 / 8 / 100e9 * 1e3  # ms: size·(n−1)/n / busbw
    assert c["FULL_SHARD"].comm_ms == pytest.approx(3 * ag)  # AG fwd + AG bwd + RS (same size)
    assert c["SHARD_GRAD_OP"].comm_ms == pytest.approx(2 * ag)
    assert c["NO_SHARD"].comm_ms == pytest.approx(1e9 * 2 * 2 * 7 / 8 / 100e9 * 1e3)
    assert "HYBRID_SHARD" not in c  # one node: nothing to replicate across


@pytest.fixture(scope="module")
def scenario(analyzed_run):
    def make(preset, **knobs):
        return analyzed_run(dataclasses.replace(gen.PRESETS[preset], **knobs))[0]  # shared: read only

    return make


def test_hybrid_shard_wins_across_nodes_on_a_slow_link(scenario):
    rep = scenario("healthy-fsdp2", world_size=16, link_bandwidth_gbps=8.0)
    inp = inputs_from_facts(rep.facts)
    assert inp.gpus_per_node == 8 and inp.world_size == 16  # deviceProperties lists 8 GPUs per host
    assert inp.sources["inter_busbw_gbps"].startswith("measured")
    assert inp.inter_busbw_gbps < 10  # the collectives crossed the 8 GB/s link
    st = rep.facts.strategy
    assert st.current == "FULL_SHARD" and st.recommended == "HYBRID_SHARD"
    assert "sharding-strategy" in {f.slug for f in rep.findings}
    # the estimate for the current strategy is close to what was measured
    cur = st.candidate("FULL_SHARD")
    assert cur.step_ms == pytest.approx(rep.facts.timeline.gpu_window_ms, rel=0.2)


def test_shard_grad_op_wins_with_memory_to_spare_and_exposed_backward_allgathers(scenario):
    rep = scenario("healthy-fsdp2", link_bandwidth_gbps=10.0)
    st = rep.facts.strategy
    assert st.recommended == "SHARD_GRAD_OP"
    assert rep.facts.exposed_comm.by_phase_kind["backward"]["all_gather"] > 1.0
    f = next(f for f in rep.findings if f.slug == "sharding-strategy")
    assert "reshard_after_forward=False" in f.fix["fsdp2"] and f.est_saving_ms > 10


def test_healthy_run_keeps_its_strategy(scenario):
    rep = scenario("healthy-fsdp2")
    st = rep.facts.strategy
    assert st.current == "FULL_SHARD"
    assert not {"sharding-strategy", "ddp-would-be-faster"} & {f.slug for f in rep.findings}
    cur = st.candidate("FULL_SHARD")
    assert cur.step_ms == pytest.approx(rep.facts.timeline.gpu_window_ms, rel=0.05)
    assert rep.to_dict()["strategy"]["recommended"] in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def test_cpu_runs_get_no_strategy_estimate():
    from pathlib import Path

    rep = committed_report(Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "per-block")  # shared
    assert rep.facts.strategy is None


def test_plan_cli_prints_table_and_assumptions():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdpdoctor",
            "plan",
            "--params",
            "7e9",
            "--gpus",
            "16",
            "--nodes",
            "2",
            "--gpu-mem",
            "80GiB",
            "--seq",
            "4096",
            "--batch",
            "1",
            "--layers",
            "32",
            "--hidden",
            "4096",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    names = [c["name"] for c in st["candidates"]]
    assert names == ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
    assert any(a.startswith("inter_busbw_gbps") for a in st["assumptions"])
    assert st["recommended"] in names
    bad = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "plan", "--params", "7e9", "--gpus", "10", "--nodes", "3"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "multiple of nodes" in bad.stderr and "Traceback" not in bad.stderr


def test_zero_expected_memory_per_category():
    from fsdpdoctor.analysis.strategy import expected_memory

    inp = _plan(8e9, 8, 8)  # bf16 params + fp32 master, Adam
    e = expected_memory(inp, "FULL_SHARD")
    assert e["parameters_sharded"] == pytest.approx(8e9 * (2 + 4) / 8)
    assert e["gradients"] == pytest.approx(8e9 * 2 / 8)
    assert e["optimizer_state"] == pytest.approx(8e9 * 8 / 8)
    assert expected_memory(inp, "NO_SHARD")["optimizer_state"] == pytest.approx(8e9 * 8)
    inp.gpus_per_node, inp.world_size = 4, 16
    assert expected_memory(inp, "HYBRID_SHARD")["gradients"] == pytest.approx(8e9 * 2 / 4)


@pytest.mark.parametrize(
    "text, count",
    [("7B", 7e9), ("70b", 70e9), ("1.5T", 1.5e12), ("125M", 125e6), ("350k", 350e3), ("7e9", 7e9), (".5B", 0.5e9)],
)
def test_plan_params_as_model_cards_write_them(text, count):
    from fsdpdoctor.cli.plan import parse_count

    assert parse_count(text) == pytest.approx(count)


def test_plan_params_7b_equals_7e9_and_rejects_bytes():
    def run(params):
        return subprocess.run(
            [sys.executable, "-m", "fsdpdoctor", "plan", "--params", params, "--gpus", "8", "--format", "json"],
            capture_output=True,
            text=True,
        )

    a, b = run("7B"), run("7e9")
    assert a.returncode == 0 and a.stdout == b.stdout
    bad = run("7GiB")
    assert (
        bad.returncode == 2
        and "7GiB" in bad.stderr
        and "parameter count" in bad.stderr
        and "Traceback" not in bad.stderr
    )


def test_one_size_parser_binary_units():
    """Sizes are parsed in one place with binary units however they are spelled: plan's --gpu-mem
    80G used to be 80e9 bytes while --max-input-bytes 80G was 80 GiB."""
    import subprocess
    import sys

    from fsdpdoctor.fmt import parse_size

    for text in ("80G", "80GB", "80GiB", "80 gib", "85899345920", "8.589934592e10"):
        assert parse_size(text) == 80 * 2**30, text
    for bad in ("", "x", "80Q", "-1G"):
        with pytest.raises(ValueError):
            parse_size(bad)

    def plan(mem: str) -> str:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "fsdpdoctor",
                "plan",
                "--params",
                "7B",
                "--gpus",
                "8",
                "--gpu-mem",
                mem,
                "--format",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert plan("80G") == plan("80GiB")
    assert json.loads(plan("80G"))["inputs"]["gpu_memory_bytes"] == 80 * 2**30


def test_no_impossible_strategy_on_other_peoples_traces(shared_traces):
    """#36 item 7. The TorchRec / DLRM traces all-reduce a few scalars and ids (2-10 bytes of
    "parameters" per GPU): no strategy estimate at all. On the MI300 DDP run the model puts the
    current DDP at ~3x the measured 18.8 ms: it is not trusted and recommends nothing."""
    for name in ("param-dlrm-v100-8ranks", "hta-sendrecv-a100-16ranks", "hta-sampled-128ranks"):
        assert fsdpdoctor.analyze(shared_traces / name).facts.strategy is None, name
    f = fsdpdoctor.analyze(shared_traces / "tracelens-mi300-ddp").facts
    st = f.strategy
    cur = st.candidate(st.current)
    assert abs(cur.step_ms - f.step_clock_ms) > 0.25 * f.step_clock_ms  # the model misses the run
    assert not st.trusted and st.recommended is None
    assert "nothing is recommended" in st.reasoning
    rep = fsdpdoctor.analyze(shared_traces / "tracelens-mi300-ddp")
    assert "recommended" not in rep.to_markdown().split("Sharding strategy")[-1].split("\n\n")[1]


def test_never_recommends_a_strategy_slower_than_the_measured_step():
    """7B on 8 GPUs: the model puts FULL_SHARD at ~250 ms and SHARD_GRAD_OP at ~168 ms. Measured at
    the model's own FULL_SHARD figure, it recommends SHARD_GRAD_OP; a run no candidate beats gets
    no recommendation; a run the model misses by 3x neither."""
    inp = PlanInputs(params=7e9, world_size=8, gpus_per_node=8, gpu_memory_bytes=80 * 2**30)
    inp.current = "FULL_SHARD"
    cands = {c.name: c for c in estimate(inp)}
    cur, best = cands["FULL_SHARD"], cands["SHARD_GRAD_OP"]
    assert best.fits and best.step_ms < cur.step_ms / 1.25 + 10  # (the arithmetic the case rests on)
    inp.measured_step_ms = cur.step_ms
    st = advise(inp)
    assert st.trusted and st.model_error_pct == pytest.approx(0.0) and st.recommended == "SHARD_GRAD_OP"
    # compute-bound (300 ms of compute, fast links): every strategy within a few ms of the others;
    # measured at the best one's own estimate, the model is right about the current one (within
    # tolerance) and no candidate is faster than the run: it recommends nothing new
    fast = PlanInputs(
        params=7e9,
        world_size=8,
        gpus_per_node=8,
        gpu_memory_bytes=80 * 2**30,
        intra_busbw_gbps=5000.0,
        compute_forward_ms=100.0,
        compute_backward_ms=200.0,
    )
    fast.current = "SHARD_GRAD_OP"
    cs = {c.name: c for c in estimate(fast)}
    fastest = cs["FULL_SHARD"]  # ties SHARD_GRAD_OP on time and leaves more memory free
    assert fastest.step_ms <= cs["SHARD_GRAD_OP"].step_ms <= 1.25 * fastest.step_ms
    fast.measured_step_ms = fastest.step_ms
    st = advise(fast)
    assert st.trusted and st.recommended == "SHARD_GRAD_OP" and "nothing to recommend" in st.reasoning
    inp.measured_step_ms = 0.5 * best.step_ms  # the model misses the run by 3x: not trusted
    st = advise(inp)
    assert not st.trusted and st.recommended is None
