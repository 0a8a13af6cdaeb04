"""Ingest benchmark: fsdpdoctor vs a bare typed msgspec decode vs Holistic Trace Analysis.

Generates large realistic traces (a real public trace scaled up, see ``gen_traces.py``) in a
temporary directory, then measures on the same files, in one run, each in its own subprocess:

* ``fsdpdoctor analyze`` end to end (CLI, JSON report to /dev/null);
* a bare typed msgspec decode: read (and gunzip) the file, one ``msgspec.json.Decoder`` call with
  fsdpdoctor's own ``Event`` schema, nothing else (the floor the issue compares against);
* gunzip alone (``.json.gz`` inputs): isal, streamed in 1 MiB reads, output discarded;
* Holistic Trace Analysis: ``TraceAnalysis(trace_dir=...)`` (package ``traceinsight``, import
  ``hta``), which loads every rank of the directory.

Time is the subprocess's wall time, interpreter start and imports included. Peak memory is the
peak of the summed RSS of the subprocess and all its children (sampled every 50 ms with psutil,
so worker processes count), and at least the kernel's ``ru_maxrss`` of the largest process.

    python benchmarks/bench_ingest.py                      # 1 GB .json and .json.gz, 8 x 200 MB
    python benchmarks/bench_ingest.py --size-mb 200 --skip-hta --skip-multi
    python benchmarks/bench_ingest.py --ranks 8 --rank-size-mb 200 --skip-single

Nothing is written into the repository or ``../shared``: files go to a fresh temporary directory
(``--tmp`` to choose its parent), removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_traces
from _docs import PERFORMANCE, replace_section

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
FSDP2_SOURCE = REPO / "fixtures" / "recorded" / "gpu" / "fsdp2" / "rank0.json.gz"

BARE_DECODE = r"""
import gc, os, sys, time
t0 = time.perf_counter()
from fsdpdoctor.ingest.kineto import _typed_decoder  # Union[_TraceDoc, list[Event]], fsdpdoctor's Event schema
path = sys.argv[1]
with open(path, "rb") as fh:
    gz = fh.read(2) == b"\x1f\x8b"
if gz:
    from isal import igzip
    with igzip.open(path, "rb") as fh:
        data = fh.read()
else:
    with open(path, "rb") as fh:
        data = fh.read()
gc.disable()
doc = _typed_decoder.decode(data)
n = len(doc.traceEvents if hasattr(doc, "traceEvents") else doc)
print(f"events={n} inner_s={time.perf_counter() - t0:.2f}", flush=True)
os._exit(0)  # the decode is done; freeing millions of objects is not part of it
"""

GUNZIP = r"""
import sys
from isal import igzip
n = 0
with igzip.open(sys.argv[1], "rb") as fh:
    while chunk := fh.read(1 << 20):
        n += len(chunk)
print(f"bytes={n}")
"""

HTA_LOAD = r"""
import logging, os, sys, time
logging.disable(logging.CRITICAL)
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
t = TraceAnalysis(trace_dir=sys.argv[1])
t1 = time.perf_counter()
ov = t.get_comm_comp_overlap(visualize=False)  # the figure fsdpdoctor's overlap reproduces
pct = float(ov["comp_comm_overlap_pctg"].iloc[0]) if len(ov) else float("nan")
print(f"ranks={len(t.t.traces)} load_s={t1 - t0:.2f} overlap_s={time.perf_counter() - t1:.2f} overlap={pct:.1f}%", flush=True)
os._exit(0)
"""

# ``fsdpdoctor analyze FILE --format json -o /dev/null`` in this process, with the time spent in
# the what-if replay (graph build and every replay, per rank) and in reading the trace (ingest:
# read, gunzip, block decode into columns) summed by wrappers, so one run gives the total and
# the replay's share. A single file is analysed in the calling process (its blocks decoded by
# worker processes), so the wrappers see all of it.
ANALYZE_TIMED = r"""
import os, sys, time
t0 = time.perf_counter()
import fsdpdoctor.analysis.ranks.rank as rank
from fsdpdoctor.cli import main
spent = {"replay": 0.0, "ingest": 0.0}
def timed(fn, key):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t
    return wrapper
rank.plan_whatif = timed(rank.plan_whatif, "replay")  # the replay's graph and transformations
rank.run_whatif = timed(rank.run_whatif, "replay")  # the replays
rank.load_trace = timed(rank.load_trace, "ingest")
try:
    main.main(args=["analyze", *sys.argv[1:], "--format", "json", "-o", os.devnull], standalone_mode=False)
finally:
    print(f"ingest_s={spent['ingest']:.2f} replay_s={spent['replay']:.2f} inner_s={time.perf_counter() - t0:.2f}", flush=True)
os._exit(0)
"""


# Commands run as on a user's machine: byte code cached in __pycache__ (a sandbox or CI image
# may set PYTHONDONTWRITEBYTECODE, which makes every start compile fsdpdoctor from source).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
_warm = False


def warm_up(target: Path, timeout: float) -> None:
    """One untimed ``analyze`` before the first measured one: writes the byte code and numba's
    cached machine code for the replay loop (compiled once per installation, ~2-3 s)."""
    global _warm
    if not _warm:
        subprocess.run(
            [PY, "-m", "compileall", "-q", str(REPO / "fsdpdoctor"), str(REPO / "rules")], env=ENV, check=False
        )
        measure(fsdpdoctor_cmd(target), "warm-up", "fsdpdoctor analyze", timeout)
        _warm = True


@dataclass
class Result:
    label: str
    tool: str
    wall_s: float
    peak_mb: float
    ok: bool
    note: str = ""


# A small launcher runs each command, so that the kernel's ru_maxrss describes the command and
# not this (large) benchmark process: a forked child inherits its parent's RSS high-water mark.
LAUNCHER = r"""
import os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
sys.stderr.write(f"\n@@bench maxrss_kb={ru.ru_maxrss} wall={time.perf_counter() - t0:.4f}\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _tree_rss(proc) -> int:
    """Summed RSS of the launcher's descendants (the command and its worker processes)."""
    total = 0
    try:
        procs = proc.children(recursive=True)
    except Exception:  # noqa: BLE001 - gone
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except Exception:  # noqa: BLE001 - exited between listing and reading
            pass
    return total


def measure(cmd: list[str], label: str, tool: str, timeout: float) -> Result:
    """Run ``cmd``; its wall time and the peak RSS of its process tree."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        psutil = None
    proc = subprocess.Popen(
        [PY, "-S", "-c", LAUNCHER, *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=ENV,
    )
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        if psutil is None:
            return
        try:
            ps = psutil.Process(proc.pid)
        except Exception:  # noqa: BLE001
            return
        while not stop.is_set():
            peak = max(peak, _tree_rss(ps))
            stop.wait(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the command it forked
        out, err = proc.communicate()
        err += f"\ntimed out after {timeout:.0f} s"
    finally:
        stop.set()
        th.join()
    wall, maxrss_kb = float("nan"), 0
    lines = err.strip().splitlines()
    if lines and lines[-1].startswith("@@bench "):
        fields = dict(kv.split("=") for kv in lines.pop()[8:].split())
        wall, maxrss_kb = float(fields["wall"]), int(fields["maxrss_kb"])
    ok = proc.returncode == 0
    peak = max(peak, maxrss_kb * 1024)
    note = (out.strip().splitlines() or [""])[-1] if ok else (lines or ["failed"])[-1][:100]
    return Result(label, tool, wall, peak / 2**20, ok, note)


def fsdpdoctor_cmd(target: Path, jobs: int | None = None) -> list[str]:
    cmd = [PY, "-c", ANALYZE_TIMED, str(target)]
    return cmd + ["-j", str(jobs)] if jobs else cmd


def run_set(label: str, target: Path, files: list[Path], args, gz: bool) -> list[Result]:
    """Measure one input set; ``target`` is a file or a directory of rank files."""
    res = []
    warm_up(target, args.timeout)
    for _ in range(args.repeat):
        res.append(measure(fsdpdoctor_cmd(target), label, "fsdpdoctor analyze", args.timeout))
    res = [min(res, key=lambda r: r.wall_s)]
    if not args.skip_scaling and (len(files) > 1 or not gz):
        one = [
            measure(fsdpdoctor_cmd(target, 1), label, "fsdpdoctor analyze -j 1 (one process)", args.timeout)
            for _ in range(args.repeat)
        ]
        res.append(min(one, key=lambda r: r.wall_s))
    if len(files) == 1:
        bare = [
            measure([PY, "-c", BARE_DECODE, str(files[0])], label, "msgspec typed decode", args.timeout)
            for _ in range(args.repeat)
        ]
        res.append(min(bare, key=lambda r: r.wall_s))
        if gz:
            res.append(measure([PY, "-c", GUNZIP, str(files[0])], label, "gunzip (isal)", args.timeout))
    else:
        # the floor for N files: each decoded alone, one after the other (also reported per core)
        walls, peaks = [], []
        for f in files:
            r = measure([PY, "-c", BARE_DECODE, str(f)], label, "msgspec typed decode", args.timeout)
            walls.append(r.wall_s)
            peaks.append(r.peak_mb)
        res.append(
            Result(label, "msgspec typed decode, files one by one", sum(walls), max(peaks), True, f"{len(files)} files")
        )
    if not args.skip_hta and not (gz and not args.hta_gz):
        hta_dir = target if target.is_dir() else target.parent
        res.append(measure([PY, "-c", HTA_LOAD, str(hta_dir)], label, "HTA TraceAnalysis load", args.timeout))
    return res


def _gzip(src: Path, dst: Path) -> None:
    from isal import igzip

    with open(src, "rb") as fi, igzip.open(dst, "wb", compresslevel=2) as fo:
        shutil.copyfileobj(fi, fo, 4 << 20)


def _copy_as_rank(src: Path, dst: Path, rank: int, head_len: int = 1 << 16) -> None:
    """rank-0 file with ``"rank": 0`` in distributedInfo replaced by ``rank`` (the head only)."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        head = fi.read(head_len).decode("latin-1")
        head = gen_traces._RANK.sub(lambda m: f"{m.group(1)}{rank}", head, count=1)
        fo.write(head.encode("latin-1"))
        shutil.copyfileobj(fi, fo, 4 << 20)


def machine() -> str:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores ({cpu or platform.machine()}), {mem:.0f} GiB RAM, Python {platform.python_version()}, {platform.system()}"


def table(results: list[Result]) -> str:
    lines = [f"{'input':<36} {'tool':<42} {'time s':>8} {'peak RSS MB':>12}  note", "-" * 118]
    for r in results:
        t = f"{r.wall_s:8.2f}" if r.ok else "  failed"
        lines.append(f"{r.label:<36} {r.tool:<42} {t} {r.peak_mb:12.0f}  {r.note}")
    return "\n".join(lines)


def ratios(results: list[Result], sizes: dict[str, int]) -> list[str]:
    out = []
    by: dict[str, dict[str, Result]] = {}
    for r in results:
        by.setdefault(r.label, {})[r.tool.split(",")[0]] = r
    for label, d in by.items():
        f = d.get("fsdpdoctor analyze")
        if f is None or not f.ok:
            continue
        one = d.get("fsdpdoctor analyze -j 1 (one process)")
        bare = d.get("msgspec typed decode")
        gun = d.get("gunzip (isal)")
        hta = d.get("HTA TraceAnalysis load")
        size = sizes.get(label, 0)
        parts = [f"{label}:"]
        if bare and bare.ok:
            floor = bare.wall_s
            parts.append(f"fsdpdoctor / bare decode = {f.wall_s / floor:.2f}x")
        if gun and gun.ok and bare and bare.ok:
            parts.append(f"(gunzip alone {gun.wall_s:.2f} s)")
        if hta and hta.ok:
            parts.append(f"HTA / fsdpdoctor = {hta.wall_s / f.wall_s:.1f}x faster")
        if one and one.ok:
            parts.append(f"-j 1 / default = {one.wall_s / f.wall_s:.2f}x")
        if size:
            parts.append(f"peak RSS / input size = {f.peak_mb * 2**20 / size:.2f}")
        out.append("  ".join(parts))
    return out


def single_file(work: Path, size_mb: float, tpl, args, sizes: dict[str, int]) -> list[Result]:
    """One file of ``size_mb`` (uncompressed), as .json and (``--gz``) as .json.gz."""
    out: list[Result] = []
    d = work / f"single-{size_mb:g}"
    d.mkdir()
    f = d / "rank-0.json"
    t = time.perf_counter()
    n = gen_traces.write_trace(f, int(size_mb * 1e6), rank=0, tpl=tpl)
    print(f"generated {f.name}: {n / 1e6:.0f} MB in {time.perf_counter() - t:.0f} s", flush=True)
    label = f"1 file, {n / 1e6:.0f} MB .json"
    sizes[label] = n
    out += run_set(label, f, [f], args, gz=False)
    print(table(out), flush=True)
    if args.gz:
        gzd = work / f"single-{size_mb:g}-gz"
        gzd.mkdir()
        g = gzd / "rank-0.json.gz"
        _gzip(f, g)
        f.unlink()  # one copy on disk at a time
        label = f"1 file, {n / 1e6:.0f} MB .json.gz ({g.stat().st_size / 1e6:.0f} MB)"
        sizes[label] = n
        out += run_set(label, g, [g], args, gz=True)
        print(table(out[-4:]), flush=True)
        g.unlink()
    else:
        f.unlink()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--size-mb",
        type=float,
        nargs="+",
        default=[300, 1000],
        help="sizes of the single-file traces (uncompressed MB)",
    )
    ap.add_argument("--ranks", type=int, default=8, help="ranks of the multi-rank set")
    ap.add_argument("--rank-size-mb", type=float, default=200, help="size of each rank file (uncompressed MB)")
    ap.add_argument(
        "--gz", action=argparse.BooleanOptionalAction, default=True, help="also measure the .json.gz of the single file"
    )
    ap.add_argument("--skip-single", action="store_true")
    ap.add_argument("--skip-multi", action="store_true")
    ap.add_argument("--skip-hta", action="store_true", help="do not run Holistic Trace Analysis (slow: ~150 s per GB)")
    ap.add_argument("--hta-gz", action="store_true", help="also run HTA on the .json.gz (another ~150 s per GB)")
    ap.add_argument("--skip-scaling", action="store_true", help="do not also run fsdpdoctor with -j 1 (one process)")
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs of fsdpdoctor and the bare decode (the fastest is kept)"
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds per measured command")
    ap.add_argument(
        "--source",
        type=Path,
        default=FSDP2_SOURCE,
        help="real trace to scale up (default: the H100 FSDP2 recording in fixtures/recorded/gpu/fsdp2)",
    )
    ap.add_argument("--update-docs", action="store_true", help="rewrite the generated table in docs/performance.md")
    ap.add_argument("--tmp", type=Path, default=None, help="parent of the temporary directory")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    args = ap.parse_args()
    if not args.source.exists():
        print(f"source trace not found: {args.source} (pass --source)", file=sys.stderr)
        return 2
    if not args.skip_hta:
        try:
            import hta  # noqa: F401
        except ImportError:
            print(
                "Holistic Trace Analysis (pip install traceinsight) not installed: --skip-hta assumed", file=sys.stderr
            )
            args.skip_hta = True
    work = Path(tempfile.mkdtemp(prefix="fsdpdoctor-bench-", dir=args.tmp))
    results: list[Result] = []
    sizes: dict[str, int] = {}
    print(f"machine: {machine()}\nsource: {args.source}\nfiles in {work}\n", flush=True)
    try:
        tpl = gen_traces.load_template(args.source)
        if not args.skip_single:
            for size_mb in args.size_mb:
                results += single_file(work, size_mb, tpl, args, sizes)
        if not args.skip_multi:
            d = work / "multi"
            d.mkdir()
            first = d / "rank-0.json"
            n = gen_traces.write_trace(first, int(args.rank_size_mb * 1e6), rank=0, tpl=tpl)
            files = [first]
            for r in range(1, args.ranks):
                files.append(d / f"rank-{r}.json")
                _copy_as_rank(first, files[-1], r)
            label = f"{args.ranks} files x {n / 1e6:.0f} MB .json"
            sizes[label] = n * args.ranks
            results += run_set(label, d, files, args, gz=False)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + machine())
    print(table(results))
    print()
    for line in ratios(results, sizes):
        print(line)
    md = markdown(results, sizes, args.source)
    print("\n" + md)
    if args.update_docs:
        replace_section(PERFORMANCE, "bench_ingest", md)
        print(f"updated {PERFORMANCE.relative_to(REPO)}")
    # a peer that fails or times out is a finding of the benchmark (the table says so); only
    # fsdpdoctor's own commands and the bare decode it is measured against make the run fail
    return 0 if all(r.ok for r in results if not r.tool.startswith("HTA")) else 1


def _fields(note: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in note.split() if "=" in kv)


def markdown(results: list[Result], sizes: dict[str, int], source: Path) -> str:
    """The table docs/performance.md shows: per input, every tool on the same file."""
    by: dict[str, dict[str, Result]] = {}
    for r in results:
        by.setdefault(r.label, {})[r.tool.split(",")[0]] = r
    rows = [
        f"Source: `{source.relative_to(REPO) if source.is_relative_to(REPO) else source.name}` scaled up; {machine()}.",
        "",
        "| input | bare typed decode | `fsdpdoctor analyze` | ÷ bare decode | of which ingest / what-if replay | "
        "peak RSS ÷ file size | HTA load + overlap |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, d in by.items():
        f, bare, hta = d.get("fsdpdoctor analyze"), d.get("msgspec typed decode"), d.get("HTA TraceAnalysis load")
        if f is None or not f.ok:
            continue
        fx = _fields(f.note)
        ratio = f"{f.wall_s / bare.wall_s:.2f}×" if bare and bare.ok else "–"
        split = (
            f"{float(fx['ingest_s']):.2f} s / {float(fx['replay_s']):.2f} s ({100 * float(fx['replay_s']) / f.wall_s:.0f}%)"
            if "replay_s" in fx
            else "–"
        )
        if hta and hta.ok:
            hx = _fields(hta.note)
            hta_txt = f"{hta.wall_s:.1f} s ({hx.get('load_s', '?')} + {hx.get('overlap_s', '?')} s), {hta.peak_mb / 1024:.2f} GB"
        elif hta:
            hta_txt = f"failed: {hta.note}"
        else:
            hta_txt = "not run"
        bare_txt = f"{bare.wall_s:.2f} s, {bare.peak_mb:.0f} MB" if bare and bare.ok else "–"
        rows.append(
            f"| {label} | {bare_txt} | **{f.wall_s:.2f} s**, {f.peak_mb:.0f} MB | {ratio} | {split} | "
            f"{f.peak_mb * 2**20 / sizes[label]:.2f} | {hta_txt} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
