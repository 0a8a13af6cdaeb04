"""Many ranks: the local process pool vs a Dask cluster of worker processes.

Generated FSDP2 runs (``fixtures/scenarios``, a small model so that each rank's trace is small
and the per-rank overhead is what is measured) of 64, 256 and 1024 ranks are analysed

- by the default process pool (``fsdpdoctor analyze DIR``, ``--jobs`` = cores), and
- by a Dask cluster started as separate processes with the ``dask`` CLI (``dask scheduler`` +
  ``dask worker --nworkers 2 --nthreads 1``) through ``--scheduler tcp://127.0.0.1:PORT``.

Each analysis runs in a fresh client process that reports: ranks per second (the analyze call
only, not interpreter start-up, nor the JSON report), the client's peak RSS after the analysis
and after also rendering the default JSON report (``VmHWM`` of the client process
alone; pool workers and Dask workers are other processes), and the JSON report's size, by default
(``--rank-detail auto``: full facts for a few ranks, a summary line for every rank) and with every
rank's facts (``all``). The
per-rank summary size is the pickled ``(RankFacts, RankPart)`` that a worker sends back, for a
rank inside the detail limit (with its collectives) and one beyond it.

    python benchmarks/bench_ranks.py [--ranks 64 256 1024] [--work /tmp/bench_ranks] [--workers 2]

Prints a Markdown table; ``--json FILE`` also writes the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from _docs import PERFORMANCE, replace_section  # noqa: E402

CLIENT = r"""
import json, resource, sys, time
import fsdpdoctor.api as api

def peak_rss_mb():
    # VmHWM: this process image's peak (ru_maxrss would carry over the parent's peak from before exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def main():
    path, scheduler = sys.argv[1], (sys.argv[2] or None)
    t = time.perf_counter()
    rep = api.analyze([path], scheduler=scheduler)
    dt = time.perf_counter() - t
    analyze_peak = peak_rss_mb()
    text = rep.to_json_bytes()  # the default report (--rank-detail auto), as the CLI writes it
    ranks, excluded = len(rep.facts.ranks), len(rep.facts.inputs_excluded)
    straggler = rep.facts.cross_rank.ranks[0].rank if rep.facts.cross_rank else None
    auto_mb = len(text) / 2**20
    del text
    with_json = peak_rss_mb()
    del rep
    # --rank-detail all: every rank kept whole from the start (the default run keeps most ranks as
    # their summary line, so its facts cannot write them all); its peak is not the one reported
    all_mb = len(api.analyze([path], scheduler=scheduler, rank_detail="all").to_json_bytes(rank_detail="all")) / 2**20
    print(json.dumps({"seconds": dt, "ranks": ranks, "excluded": excluded,
                      "peak_rss_mb": analyze_peak, "peak_rss_with_json_mb": with_json,
                      "json_mb": auto_mb, "json_all_mb": all_mb,
                      "straggler": straggler}))

if __name__ == "__main__":
    main()
"""


def generate_run(n: int, work: Path) -> Path:
    from fixtures.scenarios.generator import PRESETS, generate

    out = work / f"ranks{n}"
    if (out / f"rank{n - 1}.json.gz").exists() and len(list(out.glob("rank*.json.gz"))) == n:
        return out
    cfg = dataclasses.replace(
        PRESETS["slow-rank"],
        world_size=n,
        num_layers=2,
        steps=2,
        hidden_size=512,
        seq_len=512,
        vocab_size=1024,
        slow_rank=n // 3,
    )
    t = time.perf_counter()
    generate(cfg, out)
    print(
        f"generated {n} ranks in {time.perf_counter() - t:.1f} s ({sum(p.stat().st_size for p in out.glob('rank*')) / 2**20:.1f} MB)",
        file=sys.stderr,
    )
    return out


def run_client(path: Path, scheduler: str | None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, str(path), scheduler or ""],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=str(REPO),
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaskCLICluster:
    """``dask scheduler`` + ``dask worker`` as separate processes; stopped on exit."""

    def __init__(self, workers: int, work: Path):
        self.workers = workers
        self.work = work
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> str:
        dask = shutil.which("dask") or str(Path(sys.executable).parent / "dask")
        port = _free_port()
        addr = f"tcp://127.0.0.1:{port}"
        log = open(self.work / "dask.log", "w")
        self.procs.append(
            subprocess.Popen(
                [dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        time.sleep(2)
        self.procs.append(
            subprocess.Popen(
                [
                    dask,
                    "worker",
                    addr,
                    "--nworkers",
                    str(self.workers),
                    "--nthreads",
                    "1",
                    "--no-dashboard",
                    "--local-directory",
                    str(self.work / "dask-worker-space"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        import distributed

        with distributed.Client(addr, timeout=60) as c:
            c.wait_for_workers(self.workers, timeout=120)
        return addr

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in reversed(self.procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def summary_sizes(path: Path) -> tuple[int, int]:
    from fsdpdoctor.analysis.ranks import analyze_one

    f = sorted(path.glob("rank*.json.gz"))[0]
    return len(pickle.dumps(analyze_one(str(f), 0, True))), len(pickle.dumps(analyze_one(str(f), 0, False)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_ranks"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--update-docs", action="store_true", help="rewrite the generated table in docs/performance.md")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    runs = {n: generate_run(n, args.work) for n in args.ranks}
    rows = []
    with DaskCLICluster(args.workers, args.work) as addr:
        for n, path in runs.items():
            detail, lean = summary_sizes(path)
            for engine, sched in (("process pool", None), (f"dask CLI, {args.workers} workers", addr)):
                r = run_client(path, sched)
                assert r["ranks"] == n and r["excluded"] == 0, r
                rows.append(
                    {
                        "ranks": n,
                        "engine": engine,
                        "ranks_per_s": n / r["seconds"],
                        **r,
                        "summary_bytes_detail": detail,
                        "summary_bytes_lean": lean,
                    }
                )
                print(
                    f"{n:5d} ranks  {engine:22s} {n / r['seconds']:7.1f} ranks/s  client peak RSS {r['peak_rss_mb']:6.0f} MB",
                    file=sys.stderr,
                )
    lines = [
        "| ranks | engine | ranks/s | client peak RSS: analyze | … + JSON report | report JSON (default) | "
        "report JSON (`--rank-detail all`) | worker → client per rank (detail / beyond 64) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['engine']} | {r['ranks_per_s']:.1f} | {r['peak_rss_mb']:.0f} MB | "
            f"{r['peak_rss_with_json_mb']:.0f} MB | {r['json_mb']:.2f} MB | {r['json_all_mb']:.1f} MB | "
            f"{r['summary_bytes_detail']:,} B / {r['summary_bytes_lean']:,} B |"
        )
    for engine in sorted({r["engine"] for r in rows}):
        rss = {r["ranks"]: r["peak_rss_mb"] for r in rows if r["engine"] == engine}
        lo, hi = min(rss), max(rss)
        lines.append(
            f"\n{engine}: client peak RSS {rss[hi]:.0f} MB at {hi} ranks / {rss[lo]:.0f} MB at {lo} ranks "
            f"= {rss[hi] / rss[lo]:.2f}×"
        )
    md = "\n".join(lines)
    print(md)
    if args.update_docs:
        replace_section(PERFORMANCE, "bench_ranks", md)
        print(f"updated {PERFORMANCE.relative_to(REPO)}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
