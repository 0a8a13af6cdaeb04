"""fsdpdoctor.integrations.hf.FsdpDoctorCallback in a real Hugging Face ``Trainer`` run: a tiny
GPT-2 built from its config (never downloaded), FSDP2 through Accelerate (``fsdp_config``
``transformer_layer_cls_to_wrap=GPT2Block``), two processes on gloo, on CPU.

Accelerate enables FSDP only for accelerator devices (``AcceleratorState`` leaves a
``MULTI_CPU`` run as DDP), so the worker's Trainer presents the CPU run as a multi-device one
while the Accelerator is built; everything after that (``fully_shard`` per block and on the root,
the training loop, the callback) is the Trainer's own code path. The run is recorded once per
session; the assertions read what it wrote, against the model's config and the raw trace JSON.

Run as a script, this file is one rank of that run (``RANK``/``WORLD_SIZE``/``MASTER_*`` set by
the fixture, as ``torchrun`` would).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

import pytest

from _ranks import end_process_group, run_ranks

N_LAYER, N_EMBD, VOCAB, N_POSITIONS = 2, 64, 128, 64  # the GPT2Config the worker builds
WAIT, WARMUP, ACTIVE = 1, 1, 3
MAX_STEPS = WAIT + WARMUP + ACTIVE + 1  # one step after the window: training goes on
WORLD = 2


def _worker(out: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from fsdpdoctor.integrations.hf import FsdpDoctorCallback

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 256

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class CpuFsdpTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            from accelerate.state import DistributedType, PartialState

            shared = PartialState()._shared_state
            shared["distributed_type"] = DistributedType.MULTI_GPU  # Accelerate's FSDP gate (see the docstring)
            try:
                super().create_accelerator_and_postprocess()
            finally:
                shared["distributed_type"] = DistributedType.MULTI_CPU

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=N_LAYER,
        n_embd=N_EMBD,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=N_POSITIONS,
        bos_token_id=0,
        eos_token_id=0,
    )
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=MAX_STEPS,
        fsdp="full_shard auto_wrap",
        fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"], "version": 2},
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = CpuFsdpTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens())
    cb = FsdpDoctorCallback(trainer=trainer, wait=WAIT, warmup=WARMUP, active=ACTIVE, flight_recorder=True)
    trainer.add_callback(cb)
    trainer.train()
    rank = int(os.environ["RANK"])
    result = {
        "rank": rank,
        "out_dir": str(cb.out_dir),
        "lines": cb.lines,
        "scalars": cb.scalars,
        "log_history": trainer.state.log_history,
        "global_step": trainer.state.global_step,
        "stop_reason": cb.stop_reason,
        "model_class": type(trainer.model).__name__,
    }
    (out / f"result{rank}.json").write_text(json.dumps(result))
    end_process_group()


@pytest.fixture(scope="session")
def hf_run(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("hf-fsdp")
    results, stdout = run_ranks(__file__, out, WORLD, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return out, results, stdout


@pytest.fixture(scope="session")
def hf_report(hf_run):
    import fsdpdoctor

    _, results, _ = hf_run
    return fsdpdoctor.analyze(results[0]["out_dir"], jobs=1)


def _profiler_steps(path: Path) -> dict[int, tuple[float, float]]:
    """ProfilerStep#N → (start, end) in ms, read from the raw trace with the standard library."""
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return {
        int(e["name"].split("#")[1]): (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3)
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    }


def test_trainer_ran_fsdp2_and_the_window(hf_run):
    _, results, _ = hf_run
    for r in results:
        assert r["model_class"].startswith("FSDP")  # fully_shard's class swap: FSDPGPT2LMHeadModel
        assert r["global_step"] == MAX_STEPS  # the window did not stop training
        assert r["stop_reason"] is None


def test_rank0_prints_the_ticket_when_the_window_closes(hf_run):
    _, results, stdout = hf_run
    printed = stdout[0]
    assert "fsdpdoctor: profiled window written to" in printed
    for key in ("Run", "Step", "Finding"):
        assert any(line.strip().startswith(key) for line in results[0]["lines"]), key
    for line in results[0]["lines"]:
        assert line in printed
    assert "fsdpdoctor analyze" in printed
    assert "fsdpdoctor:" not in stdout[1]  # rank 1 prints nothing
    assert results[1]["lines"] == []


def test_the_folder_holds_what_analyze_reads(hf_run):
    _, results, _ = hf_run
    out = Path(results[0]["out_dir"])
    assert out == hf_run[0] / "trainer" / "fsdpdoctor"  # under the Trainer's output_dir
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {
        "rank0.json.gz",
        "rank1.json.gz",
        "fsdpdoctor_meta.json",
        "comm_traces/rank_0",
        "comm_traces/rank_1",
    } <= names
    meta = json.loads((out / "fsdpdoctor_meta.json").read_text())
    assert meta["complete"] is True and meta["world_size"] == WORLD
    assert meta["capture"]["profiled_steps"] == [[WAIT + WARMUP + i for i in range(ACTIVE)]]
    assert meta["capture"]["flight_recorder"] is True
    assert meta["flight_recorder_files"] == [f"comm_traces/rank_{r}" for r in range(WORLD)]


def _expected_units() -> dict[frozenset[str], int]:
    """The units Accelerate's FSDP2 wrapping makes of the config's GPT-2, with their parameter
    counts from GPT-2's layer shapes: one per ``GPT2Block`` (``fully_shard`` by
    ``transformer_layer_cls_to_wrap``), the tail [final norm, input embedding, tied LM head]
    (Accelerate carves it out; the head's weight is the embedding's), and the root, left with the
    position embedding."""
    d = N_EMBD
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    units = {frozenset({f"transformer.h.{i}"}): block for i in range(N_LAYER)}
    units[frozenset({"transformer.wte", "transformer.ln_f", "lm_head"})] = VOCAB * d + 2 * d
    units[frozenset({""})] = N_POSITIONS * d
    return units


def test_analyze_finds_the_units_of_the_config(hf_report):
    f = hf_report.facts
    assert f.fsdp.version == 2
    found = {frozenset(u.fqn.split(", ")): u.unsharded_numel for u in f.fsdp.units}
    assert found == _expected_units()
    assert sum(1 for u in f.fsdp.units if u.fqn.startswith("transformer.h.")) == N_LAYER


def test_analyze_finds_the_window_steps(hf_run, hf_report):
    out = Path(hf_run[1][0]["out_dir"])
    f = hf_report.facts
    assert f.steps.count == ACTIVE
    window = list(range(WAIT + WARMUP, WAIT + WARMUP + ACTIVE))
    assert all(nums == window for nums in f.step_numbers().values())
    raw = [_profiler_steps(out / f"rank{r}.json.gz") for r in range(WORLD)]
    assert all(sorted(steps) == window for steps in raw)
    # the step time of a CPU-only trace is the CPU step rate (DESIGN.md, "the step"): the window's
    # ProfilerStep spans with the gaps between them, per step, per rank; then the mean over ranks
    mean = sum((s[max(s)][1] - s[min(s)][0]) / len(s) for s in raw) / len(raw)
    assert hf_run[1][0]["scalars"]["fsdpdoctor/step_ms"] == pytest.approx(mean, rel=1e-3)


def test_analyze_finds_the_compute_split(hf_report):
    for r in hf_report.facts.all_ranks():
        for s in r.steps:
            assert set(s.phase_ms) == {"forward", "backward", "optimizer"}
            assert all(v > 0 for v in s.phase_ms.values())
            assert sum(s.phase_ms.values()) <= s.step_ms * 1.001


def test_scalars_reach_the_trainer_log(hf_run):
    _, results, _ = hf_run
    sc = results[0]["scalars"]
    logged = [e for e in results[0]["log_history"] if "fsdpdoctor/step_ms" in e]
    assert len(logged) == 1
    assert logged[0]["step"] == WAIT + WARMUP + ACTIVE  # logged at the step that closed the window
    assert {k: logged[0][k] for k in sc} == sc
    assert {"fsdpdoctor/phase/forward_ms", "fsdpdoctor/phase/backward_ms", "fsdpdoctor/phase/optimizer_ms"} <= set(sc)
    # a CPU trace has no GPU timeline: no MFU, waterfall or exposed communication, and no 0 in their place
    assert not any(k.startswith(("fsdpdoctor/mfu", "fsdpdoctor/waterfall", "fsdpdoctor/exposed")) for k in sc)
    assert results[1]["scalars"] == {}


def test_flight_recorder_dumps_of_a_healthy_window(hf_report):
    h = hf_report.facts.hang
    assert h is not None and h.dumps == WORLD
    assert h.kind == "none"


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


def test_the_run_is_named_an_hf_trainer_run_and_fixes_speak_trainingarguments(hf_run, hf_report):
    """The callback's sidecar names the HF Trainer and the units' class (the worker wraps
    ``GPT2Block``: its ``transformer_layer_cls_to_wrap``); fixes are TrainingArguments, not
    fully_shard code with an assumed TransformerBlock."""
    import transformers

    from fsdpdoctor.rules import _idiom

    fw = hf_report.facts.framework
    assert fw.name == "transformers" and fw.trainer == "Trainer" and fw.version == transformers.__version__
    assert fw.block_class == "GPT2Block" and fw.block_count == N_LAYER and fw.block_class_source == "sidecar"
    meta = json.loads((Path(hf_run[1][0]["out_dir"]) / "fsdpdoctor_meta.json").read_text())
    classes = [u["module_classes"] for u in meta["units"]]
    assert classes.count(["GPT2Block"]) == N_LAYER  # Accelerate also makes [ln_f, wte, lm_head] one unit
    ac = _idiom.render(hf_report.facts, "activation_checkpointing")
    assert '"transformer_layer_cls_to_wrap": ["GPT2Block"]' in ac and '"activation_checkpointing": True' in ac
    assert "TransformerBlock" not in ac
    assert _idiom.render(hf_report.facts, "mixed_precision") == "args = TrainingArguments(..., bf16=True)\n"
    assert 'optim="adamw_torch_fused"' in _idiom.render(hf_report.facts, "fused_optimizer")
    assert "dataloader_num_workers=" in _idiom.render(hf_report.facts, "dataloader")
    for f in hf_report.findings:  # a fix in the Trainer's idiom holds no fully_shard code
        assert "fully_shard(" not in f.fix.get("transformers", ""), f.slug
