"""benchmarks/gen_traces.py: a scaled-up trace reads as one long recording (read back with the stdlib)."""

from __future__ import annotations

import gzip
import json
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gen_traces  # noqa: E402

SOURCE = REPO / "fixtures" / "recorded" / "gpu" / "fsdp2" / "rank0.json.gz"


def _events(path) -> list[dict]:
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def test_three_repetitions_number_their_ops_without_gaps_and_keep_their_links(tmp_path):
    src = _events(SOURCE)
    tpl = gen_traces.load_template(SOURCE)
    out = tmp_path / "rank-0.json"
    gen_traces.write_trace(out, 3 * len(tpl.repeated), tpl=tpl)
    evs = _events(out)
    ops = [e for e in evs if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})]
    src_ids = {e["args"]["External id"] for e in src if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    ids = sorted({e["args"]["External id"] for e in ops})
    # three copies of the source's op numbers, none shared between copies
    assert len(ids) == 3 * len(src_ids)
    # the share of op numbers present between the first and the last, as in the source (a shift of
    # 10**6 per copy left 0.4% of them present: a sampled trace to the analysis)
    src_share = len(src_ids) / (max(src_ids) - min(src_ids) + 1)
    assert len(ids) / (ids[-1] - ids[0] + 1) >= src_share - 0.01

    # the kernels' links hold in every copy as in the source: as many kernels name a CPU op (by
    # External id) and a launch (by correlation) in the file as in three sources
    def linked(events: list[dict]) -> tuple[int, int, int]:
        op_ids = {e["args"]["External id"] for e in events if e.get("cat") == "cpu_op" and "External id" in e["args"]}
        launches = {
            e["args"]["correlation"] for e in events if e.get("cat") == "cuda_runtime" and "correlation" in e["args"]
        }
        kernels = [e for e in events if e.get("cat") == "kernel"]
        return (
            len(kernels),
            sum(e["args"].get("External id") in op_ids for e in kernels),
            sum(e["args"].get("correlation") in launches for e in kernels),
        )

    n, by_op, by_launch = linked(src)
    assert n and by_op and by_launch
    assert linked(evs) == (3 * n, 3 * by_op, 3 * by_launch)
