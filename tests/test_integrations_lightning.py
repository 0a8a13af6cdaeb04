"""fsdpdoctor.integrations.lightning.FsdpDoctorCallback in a real Lightning run: a small
LightningModule of ``N_BLOCKS`` residual MLP blocks, ``FSDPStrategy(auto_wrap_policy={Block})``,
two processes on gloo, on CPU, with a CSVLogger (the trainer's own logger).

Lightning allows ``FSDPStrategy`` with CUDA only (an exact-type check on the strategy) and hands
FSDP the CPU device's index (None), which FSDP refuses; torch's FSDP1 itself runs on CPU with
``device_id=torch.device("cpu")``. The worker's strategy is a subclass that wraps the module so
(same policy and sharding strategy) before Lightning's own ``_setup_model``, which then keeps the
wrapped model; the loop, the hooks and the logger are Lightning's. Recorded once per session;
the assertions read what it wrote, against the module's definition and the raw trace JSON.

Run as a script, this file is one rank of that run (``torchrun``'s environment, set by the fixture).
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import sys
from pathlib import Path

import pytest

from _ranks import end_process_group, run_ranks

N_BLOCKS, DIM, IN = 3, 64, 16  # the module the worker builds
WAIT, WARMUP, ACTIVE = 1, 1, 3
MAX_STEPS = WAIT + WARMUP + ACTIVE + 1
WORLD = 2


def _worker(out: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import FSDPStrategy
    from torch import nn

    from fsdpdoctor.integrations.lightning import FsdpDoctorCallback

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.up = nn.Linear(DIM, 4 * DIM)
            self.down = nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(IN, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
            self.head = nn.Linear(DIM, 1)

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class CpuFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model):
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(
                model, device_id=torch.device("cpu"), sharding_strategy=self.sharding_strategy, **self.kwargs
            )
            return super()._setup_model(model)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, IN), torch.randn(512, 1))
    cb = FsdpDoctorCallback(wait=WAIT, warmup=WARMUP, active=ACTIVE, flight_recorder=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=CpuFSDPStrategy(auto_wrap_policy={Block}, process_group_backend="gloo"),
        max_steps=MAX_STEPS,
        default_root_dir=str(out / "root"),
        logger=CSVLogger(str(out / "logs"), name="run", version=0),
        callbacks=[cb],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=8))
    rank = int(os.environ["RANK"])
    result = {
        "rank": rank,
        "out_dir": str(cb.out_dir),
        "lines": cb.lines,
        "scalars": cb.scalars,
        "global_step": trainer.global_step,
        "stop_reason": cb.stop_reason,
        "model_class": type(trainer.strategy.model).__name__,
    }
    (out / f"result{rank}.json").write_text(json.dumps(result))
    end_process_group()


@pytest.fixture(scope="session")
def pl_run(tmp_path_factory):
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning-fsdp")
    results, stdout = run_ranks(
        __file__,
        out,
        WORLD,
        GROUP_RANK="0",
        # Lightning: processes made outside, as by torchrun
        TORCHELASTIC_RUN_ID="fsdpdoctor-test",
    )
    return out, results, stdout


@pytest.fixture(scope="session")
def pl_report(pl_run):
    import fsdpdoctor

    return fsdpdoctor.analyze(pl_run[1][0]["out_dir"], jobs=1)


def _profiler_steps(path: Path) -> dict[int, tuple[float, float]]:
    """ProfilerStep#N → (start, end) in ms, read from the raw trace with the standard library."""
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return {
        int(e["name"].split("#")[1]): (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3)
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    }


def test_lightning_ran_fsdp_and_the_window(pl_run):
    _, results, _ = pl_run
    for r in results:
        assert r["model_class"] == "FullyShardedDataParallel"
        assert r["global_step"] == MAX_STEPS
        assert r["stop_reason"] is None


def test_rank0_prints_the_ticket_when_the_window_closes(pl_run):
    out, results, stdout = pl_run
    for key in ("Run", "Step", "Finding"):
        assert any(line.strip().startswith(key) for line in results[0]["lines"]), key
    for line in results[0]["lines"]:
        assert line in stdout[0]
    assert "fsdpdoctor:" not in stdout[1]
    assert Path(results[0]["out_dir"]) == out / "root" / "fsdpdoctor"  # under default_root_dir


def test_analyze_finds_the_units_of_the_module(pl_report):
    f = pl_report.facts
    assert f.fsdp.version == 1
    d = DIM
    block = 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    units = {u.fqn: u.unsharded_numel for u in f.fsdp.units}
    # one unit per Block (ModuleWrapPolicy), and the root with the embedding and the head
    assert {k: v for k, v in units.items() if k.startswith("blocks.")} == {
        f"blocks.{i}": block for i in range(N_BLOCKS)
    }
    assert len(units) == N_BLOCKS + 1
    root = (IN * d + d) + (d + 1)
    assert units[""] == -(-root // WORLD) * WORLD  # FSDP1's flat parameter, padded to the world size


def test_analyze_finds_the_window_steps(pl_run, pl_report):
    out = Path(pl_run[1][0]["out_dir"])
    f = pl_report.facts
    window = list(range(WAIT + WARMUP, WAIT + WARMUP + ACTIVE))
    assert f.steps.count == ACTIVE
    assert all(nums == window for nums in f.step_numbers().values())
    raw = [_profiler_steps(out / f"rank{r}.json.gz") for r in range(WORLD)]
    assert all(sorted(s) == window for s in raw)
    # the step time of a CPU-only trace is the CPU step rate (DESIGN.md, "the step"): the window's
    # ProfilerStep spans with the gaps between them, per step, per rank; then the mean over ranks
    mean = sum((s[max(s)][1] - s[min(s)][0]) / len(s) for s in raw) / len(raw)
    assert pl_run[1][0]["scalars"]["fsdpdoctor/step_ms"] == pytest.approx(mean, rel=1e-3)


def test_analyze_finds_the_compute_split(pl_report):
    """Lightning runs training_step and backward inside ``optimizer.step(closure)``: the
    Optimizer.step range holds the forward and the backward, and the optimizer phase is only what
    follows the closure's backward (before that fix, the whole step but ~1 ms was "optimizer")."""
    for r in pl_report.facts.all_ranks():
        for s in r.steps:
            assert set(s.phase_ms) == {"forward", "backward", "optimizer"}
            assert all(v > 0 for v in s.phase_ms.values())
            assert s.phase_ms["optimizer"] < s.phase_ms["backward"]
            assert sum(s.phase_ms.values()) <= s.step_ms * 1.001


def test_scalars_reach_the_lightning_logger(pl_run):
    out, results, _ = pl_run
    sc = results[0]["scalars"]
    with open(out / "logs" / "run" / "version_0" / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("fsdpdoctor/step_ms")]
    assert len(rows) == 1
    assert int(rows[0]["step"]) == WAIT + WARMUP + ACTIVE
    for k, v in sc.items():
        assert float(rows[0][k]) == pytest.approx(v, rel=1e-6)
    assert not any(k.startswith(("fsdpdoctor/mfu", "fsdpdoctor/waterfall", "fsdpdoctor/exposed")) for k in sc)


def test_flight_recorder_dumps_of_a_healthy_window(pl_run, pl_report):
    out = Path(pl_run[1][0]["out_dir"])
    assert sorted(p.name for p in (out / "comm_traces").iterdir()) == [f"rank_{r}" for r in range(WORLD)]
    h = pl_report.facts.hang
    assert h is not None and h.dumps == WORLD and h.kind == "none"


def test_an_oom_closes_the_window_and_says_where(tmp_path):
    """Lightning's on_exception with an out-of-memory error inside the window: the profiler stops,
    the sidecar is written (incomplete), and the callback names the folder. One process, CPU: the
    error is raised here, not by an allocator."""
    pytest.importorskip("lightning")
    import torch

    from fsdpdoctor.integrations.lightning import FsdpDoctorCallback

    printed: list[str] = []
    cb = FsdpDoctorCallback(tmp_path, wait=0, warmup=1, active=2, printer=printed.append, rank=0, world_size=1)
    cb.doctor.begin(torch.nn.Linear(4, 4), tmp_path / "unused")
    for _ in range(2):  # the warm-up step and the first active one
        torch.ones(64, 64) @ torch.ones(64, 64)
        cb.doctor.step()
    cb.on_exception(None, None, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert cb.doctor.closed and cb.doctor.capture.profiler is None
    meta = json.loads((tmp_path / "fsdpdoctor_meta.json").read_text())
    assert meta["complete"] is False
    assert printed == [
        f"fsdpdoctor: rank 0 ran out of memory; what the window recorded is in {tmp_path}: fsdpdoctor memory {tmp_path}"
    ]
    cb.on_exception(None, None, RuntimeError("later"))  # once closed, nothing more
    assert len(printed) == 1


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


def test_the_run_is_named_a_lightning_run_and_fixes_speak_trainer_arguments(pl_run, pl_report):
    """The callback's sidecar names Lightning and the FSDP1 units' class (the worker's
    ``auto_wrap_policy={Block}``); fixes are Trainer / FSDPStrategy arguments."""
    import lightning

    from fsdpdoctor.rules import _idiom

    fw = pl_report.facts.framework
    assert fw.name == "lightning" and fw.version == lightning.__version__
    assert fw.block_class == "Block" and fw.block_count == N_BLOCKS
    ac = _idiom.render(pl_report.facts, "activation_checkpointing")
    assert "FSDPStrategy(auto_wrap_policy={Block}" in ac and "activation_checkpointing_policy={Block}" in ac
    mp = _idiom.render(pl_report.facts, "mixed_precision")
    assert mp == 'trainer = Trainer(..., precision="bf16-mixed", strategy=FSDPStrategy(...))\n'
