"""Where `fsdpdoctor analyze` spends its time and memory, stage by stage, against another checkout.

Measures one trace file (``--size-mb N`` generates one from the H100 FSDP2 recording with
``gen_traces.py``, as ``bench_ingest.py`` does; or pass ``--file``) with this checkout and,
with ``--against DIR`` (a checkout of another commit: ``git worktree add /tmp/base 9449817``;
may be repeated) with those, the checkouts alternating run by run so that the shared machine's load falls on both:

* end to end: ``fsdpdoctor analyze FILE --format json -o /dev/null`` as a user runs it (block
  decoding in worker processes), and a bare typed msgspec decode of the same file: read it whole,
  one ``msgspec.json.Decoder(Union[_TraceDoc, list[Event]]).decode`` into fsdpdoctor's own typed
  ``Event`` / ``Args`` structs (the fields ``analyze`` reads), no columns and no analysis. Wall time, CPU time (user + sys of the
  command and its worker processes: steadier than wall time on a busy machine) and peak RSS (of the
  command and its workers together, sampled every 20 ms, at least the largest process's
  ``ru_maxrss``);
* per stage, in one process (``--jobs 1``, so that every stage runs where it is timed): decode
  (``msgspec`` on the blocks), blocks (cutting the file into blocks, columns from the decoded
  events, the rank's table), analysis (steps, collectives, FSDP units, overlap, compute, the
  waterfall, the what-if replay's plan and replays), facts (the run's RunFacts from the ranks'),
  rules, report (the JSON). Wall and CPU seconds, the peak RSS inside the stage (the kernel's
  high-water mark, reset as the stage starts) and the RSS the stage leaves.

Minimum and median of ``--repeat`` runs (default 3).

    python benchmarks/bench_stages.py --size-mb 300 --against /tmp/base --repeat 3
    python benchmarks/bench_stages.py --file trace.json --update-docs

Nothing is written into the repository (but docs/performance.md with ``--update-docs``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_traces
from _docs import PERFORMANCE, replace_section

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
FSDP2_SOURCE = REPO / "fixtures" / "recorded" / "gpu" / "fsdp2" / "rank0.json.gz"

# A checkout given by --against is put first on sys.path. Its rules/ directory is installed as
# fsdpdoctor.rules (pyproject's package-dir): the checkout's root joins fsdpdoctor's search path
# so that ``fsdpdoctor.rules`` is its rules/ (fsdpdoctor's own subpackages are found first).
PRELUDE = r"""
import os, sys
_co = os.environ.get("BENCH_CHECKOUT")
if _co:
    sys.path.insert(0, _co)
    import fsdpdoctor
    fsdpdoctor.__path__.append(_co)
    assert fsdpdoctor.__file__.startswith(_co), fsdpdoctor.__file__
"""

ANALYZE = (
    PRELUDE
    + r"""
from fsdpdoctor.cli import main
main.main(args=["analyze", sys.argv[1], "--format", "json", "-o", os.devnull])
"""
)

BARE_DECODE = r"""
import gc, os, sys
from fsdpdoctor.ingest.kineto import _typed_decoder  # Union[_TraceDoc, list[Event]], fsdpdoctor's Event schema
with open(sys.argv[1], "rb") as fh:
    data = fh.read()
gc.disable()
doc = _typed_decoder.decode(data)
os._exit(0)  # the decode is done; freeing millions of objects is not part of it
"""

# One process, --jobs 1: every stage timed where it runs. Stages are entered one after the
# other (ingest, analysis, facts, rules, report); decode is timed inside ingest and blocks is
# the rest of it. The peak RSS of a stage is the kernel's high-water mark, reset as it starts.
STAGES = (
    PRELUDE
    + r"""
import json, time
T0w, T0c = time.perf_counter(), time.process_time()

def rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def hwm_mb():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0

def reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass

out = {}
depth = [0]

def add(key, wall, cpu, peak=None, rss=None):
    d = out.setdefault(key, {"wall": 0.0, "cpu": 0.0, "peak": 0.0, "rss": 0.0})
    d["wall"] += wall
    d["cpu"] += cpu
    if peak is not None:
        d["peak"] = max(d["peak"], peak)
        d["rss"] = rss

def stage(fn, key, top=True):
    def wrapper(*a, **k):
        if top and depth[0] == 0:
            reset_hwm()
        depth[0] += top
        w, c = time.perf_counter(), time.process_time()
        try:
            return fn(*a, **k)
        finally:
            depth[0] -= top
            if top and depth[0] == 0:
                add(key, time.perf_counter() - w, time.process_time() - c, hwm_mb(), rss_mb())
            else:
                add(key, time.perf_counter() - w, time.process_time() - c)
    return wrapper

import importlib
import fsdpdoctor.api as api
import fsdpdoctor.ingest.blocks as blocks
import fsdpdoctor.engine  # noqa: F401
try:  # the package layout since #44 item 3; a checkout from before it has analysis/rank.py, cli.py
    rank = importlib.import_module("fsdpdoctor.analysis.ranks.rank")
except ImportError:
    rank = importlib.import_module("fsdpdoctor.analysis.rank")
from fsdpdoctor.cli import main

out["startup"] = {"wall": time.perf_counter() - T0w, "cpu": time.process_time() - T0c, "peak": hwm_mb(), "rss": rss_mb()}
blocks._decode = stage(blocks._decode, "decode", top=False)
rank.load_trace = stage(rank.load_trace, "ingest")
rank._read_rank = stage(rank._read_rank, "analysis")
rank.run_whatif = stage(rank.run_whatif, "analysis")
rank.trim_heap = stage(rank.trim_heap, "analysis")
api.fold = stage(api.fold, "facts")
api.run_rules = stage(api.run_rules, "rules")
api.Report.to_json_bytes = stage(api.Report.to_json_bytes, "report")
try:
    main.main(args=["analyze", sys.argv[1], "--format", "json", "-o", os.devnull, "-j", "1"], standalone_mode=False)
finally:
    total = {"wall": time.perf_counter() - T0w, "cpu": time.process_time() - T0c}
    sys.stderr.write("@@stages " + json.dumps({"stages": out, "total": total}) + "\n")
os._exit(0)
"""
)

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run(code: str, arg: str, checkout: Path | None, timeout: float) -> dict:
    """Run ``python -c code arg``: wall, CPU of it and its reaped children, peak summed RSS."""
    import psutil

    env = dict(ENV)
    env.pop("BENCH_CHECKOUT", None)
    if checkout is not None:
        env["BENCH_CHECKOUT"] = str(checkout)
    t0 = time.perf_counter()
    p = subprocess.Popen([PY, "-c", code, arg], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak, stop = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        try:
            ps = psutil.Process(p.pid)
        except psutil.Error:
            return
        while not stop.is_set():
            total = 0
            try:
                procs = [ps, *ps.children(recursive=True)]
            except psutil.Error:
                procs = []
            for q in procs:
                try:
                    total += q.memory_info().rss
                except psutil.Error:
                    pass
            peak = max(peak, total)
            stop.wait(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    _, status, ru = os.wait4(p.pid, 0)  # rusage of the command and the children it reaped
    wall = time.perf_counter() - t0
    timer.cancel()
    stop.set()
    th.join()
    err = p.stderr.read().decode(errors="replace")
    p.stdout.read()
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise RuntimeError(f"exit {rc}: {err.strip()[-500:]}")
    res = {
        "wall": wall,
        "cpu": ru.ru_utime + ru.ru_stime,
        "peak": max(peak / 2**20, ru.ru_maxrss / 1024),
    }
    for line in err.splitlines():
        if line.startswith("@@stages "):
            res.update(json.loads(line[9:]))
    return res


STAGE_ROWS = [
    ("startup", "start-up (interpreter, imports)"),
    ("decode", "decode (msgspec, the blocks)"),
    ("blocks", "blocks (cutting, columns, the rank's table)"),
    ("analysis", "analysis (rank facts, what-if replay)"),
    ("facts", "facts (the run's RunFacts)"),
    ("rules", "rules"),
    ("report", "report (JSON)"),
]


def _stage_values(r: dict) -> dict[str, dict]:
    s = {k: dict(v) for k, v in r["stages"].items()}
    ing = s.pop("ingest", {"wall": 0.0, "cpu": 0.0, "peak": 0.0, "rss": 0.0})
    dec = s.get("decode", {"wall": 0.0, "cpu": 0.0})
    s["decode"] = {"wall": dec["wall"], "cpu": dec["cpu"], "peak": ing["peak"], "rss": ing["rss"]}
    s["blocks"] = {
        "wall": ing["wall"] - dec["wall"],
        "cpu": ing["cpu"] - dec["cpu"],
        "peak": ing["peak"],
        "rss": ing["rss"],
    }
    return s


def summarise(runs: list[dict], key: str) -> tuple[float, float]:
    xs = [r[key] for r in runs]
    return min(xs), statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", type=Path, help="trace to measure (default: generate one of --size-mb)")
    ap.add_argument("--size-mb", type=float, default=300)
    ap.add_argument("--source", type=Path, default=FSDP2_SOURCE, help="real trace gen_traces scales up")
    ap.add_argument(
        "--against",
        type=Path,
        action="append",
        default=[],
        help="another checkout (e.g. a git worktree of the base commit); may be given more than once",
    )
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--against-label", action="append", default=[], help="a label per --against (default: its name)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--update-docs", action="store_true", help="rewrite the stage table in docs/performance.md")
    args = ap.parse_args()
    work = None
    if args.file is None:
        work = Path(tempfile.mkdtemp(prefix="fsdpdoctor-stages-"))
        args.file = work / "rank-0.json"
        gen_traces.write_trace(args.file, int(args.size_mb * 1e6), rank=0, tpl=gen_traces.load_template(args.source))
    size = args.file.stat().st_size
    labels = args.against_label + [co.name for co in args.against[len(args.against_label) :]]
    sides: list[tuple[str, Path | None]] = [(lb, co.resolve()) for lb, co in zip(labels, args.against)]
    sides.append((args.label, None))
    try:
        for label, co in sides:  # warm-up: byte code and numba's cache, untimed
            run(ANALYZE, str(args.file), co, args.timeout)
        e2e: dict[str, list[dict]] = {label: [] for label, _ in sides}
        st: dict[str, list[dict]] = {label: [] for label, _ in sides}
        bare: list[dict] = []
        for i in range(args.repeat):
            for label, co in sides:
                e2e[label].append(run(ANALYZE, str(args.file), co, args.timeout))
                print(f"run {i} {label}: analyze {e2e[label][-1]['wall']:.2f} s", file=sys.stderr, flush=True)
            bare.append(run(BARE_DECODE, str(args.file), None, args.timeout))
            for label, co in sides:
                st[label].append(run(STAGES, str(args.file), co, args.timeout))
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    md = markdown(args, size, sides, e2e, st, bare)
    print(md)
    if args.update_docs:
        replace_section(PERFORMANCE, "bench_stages", md)
        print(f"updated {PERFORMANCE.relative_to(REPO)}", file=sys.stderr)
    return 0


def markdown(args, size, sides, e2e, st, bare) -> str:
    bw, bwm = summarise(bare, "wall")
    bc, bcm = summarise(bare, "cpu")
    load = os.getloadavg()[0]
    rows = [
        f"{size / 1e6:.0f} MB `.json` (`{_shown(args.source) if args.file.parent.name.startswith('fsdpdoctor-') else args.file.name}`"
        f" scaled up by `gen_traces.py`), min / median of {args.repeat} runs, the checkouts alternating; {gen_machine()}, "
        f"load average {load:.1f} when done. Bare typed decode: the file read whole and decoded by one "
        "msgspec call into fsdpdoctor's typed `Event` structs (every field `analyze` reads), nothing else; "
        "`analyze`: the CLI end to end, its block decoding in worker processes (their CPU counted).",
        "",
        "| | `analyze` wall s | CPU s | ÷ bare decode (wall / CPU) | peak RSS MB | RSS ÷ file |",
        "|---|---:|---:|---:|---:|---:|",
        f"| bare typed decode | {bw:.2f} / {bwm:.2f} | {bc:.2f} / {bcm:.2f} | 1 | {min(r['peak'] for r in bare):.0f} | "
        f"{min(r['peak'] for r in bare) * 2**20 / size:.2f} |",
    ]
    for label, _ in sides:
        w, wm = summarise(e2e[label], "wall")
        c, cm = summarise(e2e[label], "cpu")
        p, pm = summarise(e2e[label], "peak")
        rows.append(
            f"| {label} | {w:.2f} / {wm:.2f} | {c:.2f} / {cm:.2f} | {wm / bwm:.2f} / {cm / bcm:.2f} | "
            f"{p:.0f} / {pm:.0f} | {pm * 2**20 / size:.2f} |"
        )
    rows += [
        "",
        "Per stage, one process (`--jobs 1`); wall / CPU s (median), peak RSS inside the stage / RSS after it, MB:",
        "",
    ]
    head = "| stage | " + " | ".join(f"{label}: wall / CPU s | {label}: peak / after MB" for label, _ in sides) + " |"
    rows += [head, "|---|" + "---:|---:|" * len(sides)]
    per = {label: [_stage_values(r) for r in st[label]] for label, _ in sides}
    for key, name in STAGE_ROWS:
        cells = []
        for label, _ in sides:
            vals = [p.get(key) for p in per[label] if p.get(key)]
            if not vals:
                cells += ["–", "–"]
                continue
            med = {k: statistics.median(v[k] for v in vals) for k in ("wall", "cpu", "peak", "rss")}
            cells += [f"{med['wall']:.2f} / {med['cpu']:.2f}", f"{med['peak']:.0f} / {med['rss']:.0f}"]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = []
    for label, _ in sides:
        tw = statistics.median(r["total"]["wall"] for r in st[label])
        tc = statistics.median(r["total"]["cpu"] for r in st[label])
        tp = statistics.median(max(s["peak"] for s in r["stages"].values()) for r in st[label])
        cells += [f"{tw:.2f} / {tc:.2f}", f"{tp:.0f}"]
    rows.append("| **total** | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it is inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def gen_machine() -> str:
    from bench_ingest import machine

    return machine()


if __name__ == "__main__":
    sys.exit(main())
