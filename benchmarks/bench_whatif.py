"""What-if replay cost: graph build + every replay vs the whole per-rank analysis, on one trace.

Generates a large realistic trace (a real public trace scaled up, see ``gen_traces.py``; 1 GB by
default) in a temporary directory, loads it once, then times in this process:

* the per-rank analysis end to end (``analyze_rank_trace``: steps, labels, collectives, timeline,
  FSDP, what-if), the decode not included;
* the what-if part alone (``analyze_whatif``: graph build, the unchanged replay and one replay per
  applicable transformation), and inside it the graph build.

    python benchmarks/bench_whatif.py                 # 1 GB
    python benchmarks/bench_whatif.py --size-mb 200
    python benchmarks/bench_whatif.py --trace path/to/rank0.json.gz

Nothing is written into the repository or ``../shared``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_traces  # noqa: E402

from fsdpdoctor.analysis import whatif  # noqa: E402
from fsdpdoctor.analysis.whatif.graph import build_graph  # noqa: E402
from fsdpdoctor.analysis.comms import find_collectives, issue_rows  # noqa: E402
from fsdpdoctor.analysis.fsdp import analyze_fsdp  # noqa: E402
from fsdpdoctor.analysis.labels import enclosing, label_rows  # noqa: E402
from fsdpdoctor.analysis.ranks.rank import analyze_rank_trace  # noqa: E402
from fsdpdoctor.analysis.steps import find_steps  # noqa: E402
from fsdpdoctor.analysis.timeline import step_timeline  # noqa: E402
from fsdpdoctor.ingest.kineto import load_trace  # noqa: E402


def _t(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=1000)
    ap.add_argument("--trace", type=Path, help="an existing trace instead of a generated one")
    ap.add_argument("--tmp", type=Path, default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-whatif-", dir=a.tmp))
    try:
        path = a.trace
        if path is None:
            path = tmp / "rank-0.json"
            n = gen_traces.write_trace(path, int(a.size_mb * 1e6))
            print(f"generated {path}: {n / 1e6:.0f} MB")
        rt, t_load = _t(lambda: load_trace(str(path)))
        print(f"decode: {t_load:.2f} s, {len(rt):,} rows")
        rf, t_rank = _t(lambda: analyze_rank_trace(rt))
        info = find_steps(rt)
        chains = enclosing(rt, label_rows(rt), issue_rows(rt))
        colls = find_collectives(rt, chains, group_size=rt.world_size)
        step_timeline(rt, info.steps, colls)
        fsdp = analyze_fsdp(rt, colls, info.steps, len(info.steps))
        g, t_graph = _t(lambda: build_graph(rt, info.steps, colls))
        w, t_whatif = _t(lambda: whatif.analyze_whatif(rt, info.steps, colls, fsdp))
        ops = g.start.size if g is not None else 0
        print(
            f"per-rank analysis (what-if included): {t_rank:.2f} s; analyze ≈ decode + that = {t_load + t_rank:.2f} s"
        )
        print(
            f"what-if: {t_whatif:.2f} s = {100 * t_whatif / t_rank:.0f}% of the per-rank analysis, "
            f"{100 * t_whatif / (t_rank + t_load):.0f}% with the decode; graph build {t_graph:.2f} s; "
            f"{ops:,} GPU ops, {1 + len(w.step_ms) if w else 0} replays"
        )
        if w is not None:
            print(
                f"unchanged replay: {w.replayed_step_ms:.2f} ms per step vs {w.measured_step_ms:.2f} measured "
                f"({w.error_pct:.2f}%)"
            )
        del rf
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
