"""Partial runs: a rank file that cannot be read is left out and named, the rest is analysed.

Ground truth: the generator's per-rank figures (truth.json) for the ranks that remain, and the
file we broke ourselves.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.scenarios.generator import PRESETS, generate, read_truth
from fsdpdoctor.api import analyze
from fsdpdoctor.errors import InputError

WORLD = 8
BAD = 3


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", *map(str, args)], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def run8(tmp_path_factory) -> Path:
    cfg = dataclasses.replace(
        PRESETS["healthy-fsdp2"], world_size=WORLD, num_layers=2, steps=2, hidden_size=512, seq_len=512, vocab_size=1024
    )
    return generate(cfg, tmp_path_factory.mktemp("run8"))


@pytest.fixture(scope="module")
def truncated(run8, tmp_path_factory) -> Path:
    """The 8-rank run with rank 3's file cut in half (a rank killed while writing)."""
    d = tmp_path_factory.mktemp("run8-truncated")
    for p in run8.glob("rank*.json.gz"):
        shutil.copy(p, d / p.name)
    data = (run8 / f"rank{BAD}.json.gz").read_bytes()
    (d / f"rank{BAD}.json.gz").write_bytes(data[: len(data) // 2])
    return d


def test_truncated_rank_is_left_out_and_the_rest_matches_the_truth(run8, truncated):
    truth = read_truth(run8)
    rep = analyze([truncated])
    f = rep.facts
    good = [r for r in range(WORLD) if r != BAD]
    assert f.ranks == good
    assert f.ranks_expected == WORLD
    assert len(f.inputs_excluded) == 1
    ex = f.inputs_excluded[0]
    assert ex.path == str(truncated / f"rank{BAD}.json.gz") and ex.rank == BAD
    assert "gzip" in ex.reason
    for r in good:  # each remaining rank's step time is its own, from the generator
        assert f.steps.per_rank_mean_ms[str(r)] == pytest.approx(truth["ranks"][str(r)]["step_ms_mean"], abs=1e-3)
    want = statistics.fmean(s["step_ms"] for r in good for s in truth["ranks"][str(r)]["steps"])
    assert f.steps.mean_ms == pytest.approx(want, abs=1e-3)
    d = rep.to_dict()
    assert d["inputs_excluded"] == [{"path": ex.path, "rank": BAD, "reason": ex.reason}]
    assert d["ranks_expected"] == WORLD
    assert f"7 of {WORLD} ranks" in rep.to_markdown()


def test_cli_analyze_warns_and_exits_0(truncated):
    proc = run_cli("analyze", truncated, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fsdpdoctor: warning: 7 of 8 ranks analysed")
    assert f"rank{BAD}.json.gz" in lines[0]
    out = json.loads(proc.stdout)
    assert [e["rank"] for e in out["inputs_excluded"]] == [BAD]
    md = run_cli("analyze", truncated, "--format", "markdown")
    assert md.returncode == 0 and "7 of 8 ranks" in md.stdout and f"rank{BAD}.json.gz" in md.stdout


def test_cli_strict_fails_on_the_bad_file(truncated):
    proc = run_cli("analyze", truncated, "--strict")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert str(truncated / f"rank{BAD}.json.gz") in lines[0] and "gzip" in lines[0]


def test_cli_check_fails_unless_missing_ranks_are_allowed(run8, truncated):
    # this small generated run is host-bound (tiny kernels): the findings gate is not what is tested here
    full = run_cli("check", run8, "--format", "json", "--fail-on-new", "never")
    assert full.returncode == 0, full.stdout + full.stderr  # the complete run passes every gate
    assert "missing-ranks" not in {g["name"] for g in json.loads(full.stdout)["gates"]}
    proc = run_cli("check", truncated, "--format", "json", "--fail-on-new", "never")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    gates = {g["name"]: g for g in json.loads(proc.stdout)["gates"]}
    assert gates["missing-ranks"]["status"] == "fail"
    assert gates["missing-ranks"]["current"] == "7 of 8"
    assert f"rank{BAD}.json.gz" in gates["missing-ranks"]["detail"]
    ok = run_cli("check", truncated, "--allow-missing-ranks", "--format", "json", "--fail-on-new", "never")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert {g["name"]: g for g in json.loads(ok.stdout)["gates"]}["missing-ranks"]["status"] == "pass"


def test_gap_in_rank_ids_is_reported(run8, tmp_path):
    for p in run8.glob("rank*.json.gz"):
        if p.name != "rank5.json.gz":
            shutil.copy(p, tmp_path / p.name)
    f = analyze([tmp_path]).facts
    assert f.ranks == [0, 1, 2, 3, 4, 6, 7]
    assert [(e.path, e.rank) for e in f.inputs_excluded] == [(None, 5)]
    assert f.ranks_expected == WORLD
    proc = run_cli("check", tmp_path, "--format", "json")
    assert proc.returncode == 1


def test_bad_file_without_rank_id_in_order_numbered_run(run8, tmp_path):
    """Files numbered by order (no rank in the name, no distributedInfo): the bad one keeps its slot."""
    src = sorted(run8.glob("rank*.json.gz"))[:3]
    for i, p in zip("abc", src):
        raw = json.loads(__import__("gzip").decompress(p.read_bytes()))
        raw.pop("distributedInfo", None)
        (tmp_path / f"{i}.json").write_text(json.dumps(raw))
    (tmp_path / "b.json").write_text('{"traceEvents": [')
    f = analyze([tmp_path]).facts
    assert f.ranks == [0, 2]
    assert [(Path(e.path).name, e.rank) for e in f.inputs_excluded] == [("b.json", 1)]


def test_every_file_bad_raises_the_first_error(tmp_path):
    (tmp_path / "rank0.json").write_text("")
    (tmp_path / "rank1.json").write_text("[")
    with pytest.raises(InputError) as ei:
        analyze([tmp_path])
    assert ei.value.path == str(tmp_path / "rank0.json")
    with pytest.raises(InputError):
        analyze([tmp_path], strict=True)


def test_real_eight_rank_trace_with_one_truncated_rank(tmp_path):
    """The public 8-rank DLRM trace (V100, real Kineto output) with worker 3's file cut short."""
    src = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "public" / "param-dlrm-v100-8ranks"
    if not src.is_dir():
        pytest.skip("../shared/traces/public is absent")
    files = sorted(src.glob("worker*.json.gz"))
    assert len(files) == 8
    for p in files:
        data = p.read_bytes()
        (tmp_path / p.name).write_bytes(data[: len(data) // 3] if p.name.startswith("worker3_") else data)
    full = analyze([src]).facts
    part = analyze([tmp_path]).facts
    assert full.ranks == list(range(8)) and full.inputs_excluded == []
    assert part.ranks == [0, 1, 2, 4, 5, 6, 7] and part.ranks_expected == 8
    (ex,) = part.inputs_excluded
    assert ex.rank == 3 and Path(ex.path).name.startswith("worker3_") and "gzip" in ex.reason
    for r in part.ranks:  # the other ranks' own figures do not depend on rank 3's file
        assert part.steps.per_rank_mean_ms[str(r)] == full.steps.per_rank_mean_ms[str(r)]
        assert part.overlap.per_rank[str(r)] == full.overlap.per_rank[str(r)]
    proc = run_cli("check", tmp_path, "--format", "json")
    gates = {g["name"]: g for g in json.loads(proc.stdout)["gates"]}
    assert proc.returncode == 1 and gates["missing-ranks"]["status"] == "fail"
    assert gates["missing-ranks"]["current"] == "7 of 8"


def test_a_lone_rank_file_is_a_sample_not_a_partial_run(tmp_path):
    """#36 item 9: one rank's trace of a 2-rank job, given alone, is analysed as a sample of the
    job ("1 rank of 2"), without warnings about the ranks it was never meant to hold; two files
    with a hole between them are still a partial run."""
    import shutil
    import subprocess
    import sys

    rec = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "per-block"
    shutil.copy(rec / "rank1.json.gz", tmp_path / "rank1.json.gz")
    r = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "analyze", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    import fsdpdoctor

    f = fsdpdoctor.analyze(tmp_path).facts
    assert f.inputs_excluded == [] and f.ranks == [1] and f.world_size == 2
    assert "1 of 2 ranks given" in f.notes
