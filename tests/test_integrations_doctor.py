"""The part of the trainer callbacks that no trainer owns (fsdpdoctor.integrations._doctor): the
package imports without the trainers, the scalars a logger gets from a real GPU recording, the
stop decisions on real out-of-memory and hang inputs, and the hang watchdog ending a real hung
two-process gloo job with the diagnosis.

Run as a script, this file is one rank of that hung job (a plain training loop with a Doctor):
rank 1 stalls before step ``STALL_AT`` (a data loader that never returns), rank 0 waits in that
step's all-reduce."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "fixtures" / "recorded" / "gpu"
STALL_AT, TIMEOUT_S, WORLD = 3, 3.0, 2


def test_integrations_import_without_the_trainers():
    code = (
        "import sys\n"
        "for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning'): sys.modules[m] = None\n"
        "import fsdpdoctor, fsdpdoctor.capture, fsdpdoctor.integrations, fsdpdoctor.integrations._doctor\n"
        "for name in ('hf', 'lightning'):\n"
        "    try:\n"
        "        __import__('fsdpdoctor.integrations.' + name)\n"
        "    except ImportError as e:\n"
        "        print(name, 'ImportError')\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["hf ImportError", "lightning ImportError"]


def test_stop_on_is_checked():
    from fsdpdoctor.integrations._doctor import Doctor

    with pytest.raises(ValueError, match="stop_on"):
        Doctor(stop_on=("slow",))


def test_scalars_of_a_gpu_recording():
    import fsdpdoctor
    from fsdpdoctor.integrations._doctor import scalars

    sc = scalars(fsdpdoctor.analyze(GPU / "fsdp2", jobs=1))
    parts = {k: v for k, v in sc.items() if k.startswith("fsdpdoctor/waterfall/")}
    # every part of the waterfall, zeros included (measured, not missing), unattributed among them
    assert len(parts) == 10
    assert parts["fsdpdoctor/waterfall/unattributed_ms"] == 0.0  # the steps' intervals tile the step
    at_peak = parts["fsdpdoctor/waterfall/matmul_at_peak_ms"] + parts["fsdpdoctor/waterfall/attention_at_peak_ms"]
    assert 100 * at_peak / sc["fsdpdoctor/step_ms"] == pytest.approx(sc["fsdpdoctor/mfu_pct"], rel=0.01)
    assert "fsdpdoctor/exposed_comm_ms" in sc  # one GPU, no collective kernels: 0 measured


def test_stop_reason_on_the_recorded_oom():
    import fsdpdoctor
    from fsdpdoctor.integrations._doctor import stop_reason

    assert stop_reason(fsdpdoctor.analyze(GPU / "oom", jobs=1), ("oom",)).startswith("memory: the window ran out")
    assert stop_reason(fsdpdoctor.analyze(GPU / "oom", jobs=1), ("hang",)) is None
    assert stop_reason(fsdpdoctor.analyze(GPU / "fsdp2", jobs=1), ("oom", "hang")) is None


def test_stop_reason_on_a_recorded_hang(hang_recording):
    import fsdpdoctor
    from fsdpdoctor.integrations._doctor import stop_reason

    why = stop_reason(fsdpdoctor.analyze(hang_recording("leave-early") / "dumps", jobs=1), ("hang",))
    assert why is not None and why.startswith("hang pattern in the Flight Recorder dumps")
    assert "rank 2" in why  # the recording's culprit (its truth.json)


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from fsdpdoctor.integrations._doctor import Doctor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    doc = Doctor(out, wait=0, warmup=1, active=1, analyze=False, stop_on=("hang",), hang_timeout_s=TIMEOUT_S)
    doc.begin(None, out)
    t = torch.ones(8)
    for step in range(10):
        if rank == 1 and step == STALL_AT:
            time.sleep(120)  # the watchdog ends the process long before
        dist.all_reduce(t)
        doc.step()
    print("not hung", flush=True)


def test_hang_watchdog_ends_a_hung_job_with_the_diagnosis(tmp_path):
    pytest.importorskip("torch")
    from _ranks import free_port, rank_env

    port = str(free_port())
    procs = []
    for rank in range(WORLD):
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, str(tmp_path)],
                env=rank_env(rank, WORLD, port),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=150)[0])
        finally:
            p.kill()
    assert [p.returncode for p in procs] == [3, 3], outs
    assert sorted(q.name for q in (tmp_path / "comm_traces").iterdir() if not q.name.startswith(".")) == [
        "rank_0",
        "rank_1",
    ]
    assert f"no training step finished in {TIMEOUT_S:.0f} s" in outs[0] and "Flight Recorder dumped" in outs[1]
    hang = [line for line in outs[0].splitlines() if line.startswith("fsdpdoctor: Hang")]
    assert len(hang) == 1 and "rank 1" in hang[0], outs[0]  # the rank that stalled
    culprits = [line for line in outs[0].splitlines() if line.startswith("fsdpdoctor: Culprits")]
    assert culprits and "rank 1" in culprits[0] and "rank 0" not in culprits[0]
    assert "not hung" not in outs[0] + outs[1]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
