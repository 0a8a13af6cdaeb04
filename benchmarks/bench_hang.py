"""Hang diagnosis at scale: 1,024 ranks of Flight Recorder dumps read and matched.

Writes one NCCL 2.10 dump per rank with ``fixtures/flight_recorder/gen.py`` (an FSDP2 job of
``--units`` units; ``--entries`` per rank, the recorder's default buffer of 2,000 by default, stacks
included, rank ``--culprit`` left the loop) into a temporary folder, then times in a fresh process:

- ``fsdpdoctor analyze DIR --format json`` end to end (interpreter start-up included), with the
  default process pool and with ``--jobs 1``;
- inside one process: reading the dumps into per-rank views (``analysis.hang.load_views``) and
  matching them (``analysis.hang.diagnose``), each separately;
- the peer, ``python -m torch.distributed.flight_recorder.fr_trace DIR`` on the same files (with a
  time limit, ``--peer-timeout``), when torch is installed.

Each is checked to name the culprit. Prints a Markdown table (``--update-docs`` writes it into
docs/performance.md); ``--json FILE`` writes the figures; ``--reuse`` keeps the dumps of an earlier
run in ``--work``.

    python benchmarks/bench_hang.py [--ranks 1024] [--entries 2000] [--work /tmp/bench_hang]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

INSIDE = r"""
import json, resource, sys, time
from pathlib import Path
from fsdpdoctor.ingest.flight_recorder import dumps_in
from fsdpdoctor.analysis.hang import diagnose, load_views

def cpu():  # this process and its finished workers
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

d = Path(sys.argv[1]); jobs = int(sys.argv[2]) or None
t0 = time.perf_counter(); files = dumps_in(d); t1 = time.perf_counter()
c1 = cpu(); views = load_views(files, jobs); t2 = time.perf_counter(); c2 = cpu()
h = diagnose(views); t3 = time.perf_counter()
hwm = next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"find_s": t1 - t0, "read_s": t2 - t1, "read_cpu_s": c2 - c1, "match_s": t3 - t2, "culprits": h.culprit_ranks,
                  "kind": h.kind, "seq": h.seq_id, "peak_rss_mb": hwm}))
"""


def generate(out: Path, ranks: int, entries: int, units: int, culprit: int) -> dict:
    from fixtures.flight_recorder import gen

    per_step = units * 3  # forward all-gather, backward all-gather and reduce-scatter per unit
    steps = max(3, entries // per_step + 2)
    spec = dataclasses.replace(
        gen.PRESETS["missing"],
        world_size=ranks,
        n_units=units,
        steps=steps,
        at_step=steps - 1,
        culprit=culprit,
        buffer=entries,
    )
    t = time.perf_counter()
    truth = gen.write(spec, out)
    size = sum(p.stat().st_size for p in out.iterdir())
    return {
        "truth": dataclasses.asdict(truth),
        "generate_s": time.perf_counter() - t,
        "bytes": size,
        "files": len(list(out.iterdir())),
    }


def timed(cmd: list[str], timeout: float) -> tuple[float | None, subprocess.CompletedProcess | None]:
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, None
    return time.perf_counter() - t, p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--peer-timeout", type=float, default=600)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--update-docs", action="store_true", help="rewrite the generated table in docs/performance.md")
    ap.add_argument("--reuse", action="store_true", help="keep the dumps already in --work (same parameters)")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="bench_hang_"))
    d = work / "dumps"
    culprit = a.ranks // 2 + 1
    if a.reuse and d.is_dir() and len(list(d.iterdir())) == a.ranks:
        g = {"bytes": sum(p.stat().st_size for p in d.iterdir())}
    else:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        g = generate(d, a.ranks, a.entries, a.units, culprit)
    rows = []
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for label, jobs in (("process pool (cores)", 0), ("--jobs 1", 1)):
        inside = subprocess.run(
            [sys.executable, "-c", INSIDE, str(d), str(jobs)], capture_output=True, text=True, env=env
        )
        res = json.loads(inside.stdout)
        cmd = [sys.executable, "-m", "fsdpdoctor", "analyze", str(d), "--format", "json"] + (
            [] if not jobs else ["--jobs", "1"]
        )
        wall, p = timed(cmd, 1800)
        ok = p is not None and p.returncode == 0 and json.loads(p.stdout)["hang"]["missing_ranks"] == [culprit]
        rows.append(
            {
                "what": f"fsdpdoctor analyze, {label}",
                "wall_s": wall,
                "find_s": res["find_s"],
                "read_s": res["read_s"],
                # the pool's workers are the forkserver's children: their CPU time is not ours to read
                "read_cpu_s": res["read_cpu_s"] if jobs == 1 else None,
                "match_s": res["match_s"],
                "peak_rss_mb": res["peak_rss_mb"],
                "correct": ok and res["culprits"] == [culprit],
            }
        )
    peer = {
        "what": "torch fr_trace",
        "wall_s": None,
        "find_s": None,
        "read_s": None,
        "read_cpu_s": None,
        "match_s": None,
        "peak_rss_mb": None,
        "correct": None,
    }
    try:
        import torch  # noqa: F401

        wall, p = timed([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(d)], a.peer_timeout)
        peer["wall_s"] = wall
        if p is not None:
            peer["correct"] = p.returncode == 0 and f"missing ranks: {{{culprit}}}" in (p.stdout + p.stderr)
        else:
            peer["note"] = f"did not finish in {a.peer_timeout:.0f} s"
    except ImportError:
        peer["note"] = "torch not installed"
    rows.append(peer)
    mb = g["bytes"] / 2**20
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    f = lambda v, d=2: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        f"{a.ranks} ranks, {a.entries} entries per dump ({a.units} FSDP2 units, stacks), {mb:.0f} MiB of dumps; "
        f"{cores} cores, load average {load:.1f} when done",
        "",
        "| what | wall (s) | find (s) | read (s) | read, CPU (s) | match (s) | peak RSS (MB) | names the culprit |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['what']} | {f(r['wall_s'])}{' (' + r['note'] + ')' if r.get('note') else ''} | {f(r['find_s'])} | "
            f"{f(r['read_s'])} | {f(r['read_cpu_s'])} | {f(r['match_s'])} | {f(r['peak_rss_mb'], 0)} | {r['correct']} |"
        )
    md = "\n".join(lines)
    print(md)
    if a.update_docs:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from _docs import PERFORMANCE, replace_section

        replace_section(PERFORMANCE, "bench_hang", md)
    if a.json:
        a.json.write_text(
            json.dumps({"ranks": a.ranks, "entries": a.entries, "bytes": g["bytes"], "rows": rows}, indent=1)
        )
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
