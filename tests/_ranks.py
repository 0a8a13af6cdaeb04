"""One real multi-process run of a framework's training script, as ``torchrun`` would start it:
``world`` processes of ``script`` (with ``out`` as its argument) on gloo, each with the rank
variables and a free local port, their output in ``out/stdout<rank>.txt``; each rank writes
``out/result<rank>.json``. Used by the HF Trainer and Lightning integration tests; the rank
environment (:func:`rank_env`) and port also by the hang-watchdog test."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: str, **env: str) -> dict[str, str]:
    """The environment ``torchrun`` gives rank ``rank`` of ``world`` on this machine (gloo on
    127.0.0.1:``port``, one thread), with ``env`` on top."""
    return dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        OMP_NUM_THREADS="1",
        **env,
    )


def run_ranks(script: str, out: Path, world: int, timeout: float = 240, **env: str) -> tuple[list, list]:
    """Run the ranks to their end; assert each exited 0 (its output's tail as the message) and
    return (each rank's result JSON, each rank's output)."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        log = open(out / f"stdout{rank}.txt", "w")
        cmd = [sys.executable, script, str(out)]
        procs.append(
            (subprocess.Popen(cmd, env=rank_env(rank, world, port, **env), stdout=log, stderr=subprocess.STDOUT), log)
        )
    for p, log in procs:
        try:
            p.wait(timeout=timeout)
        finally:
            p.kill()
            log.close()
    for rank, (p, _) in enumerate(procs):
        assert p.returncode == 0, (out / f"stdout{rank}.txt").read_text()[-3000:]
    results = [json.loads((out / f"result{r}.json").read_text()) for r in range(world)]
    stdout = [(out / f"stdout{r}.txt").read_text() for r in range(world)]
    return results, stdout


def end_process_group() -> None:
    """An orderly end for a rank, once it has written its result: gloo's threads stopped, then the
    process ends without the interpreter's teardown. A rank left with gloo's threads running
    aborted at exit ('terminate called without an active exception'); with them stopped, a rank
    of the HF Trainer run still aborted so in about 1 of 12 runs (a CI run of 2026-11-27 and one
    local run in 22), after its work and its result were done, in torch's C++ teardown."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
