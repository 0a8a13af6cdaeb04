"""Dask fan-out and fsspec paths give the same report as the local process pool.

A Dask LocalCluster of two worker processes on 127.0.0.1 (started once for the module, closed
at its end) analyses recorded CPU FSDP runs and generated GPU runs; traces are also served from
fsspec's ``memory://`` and from a local ``http.server``. The reference is always the default
path (no scheduler, local files): the JSON must be identical apart from the file names.
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import json
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import distributed
import fsspec
import pytest

from fixtures.scenarios.generator import PRESETS, generate
from fsdpdoctor.api import analyze
from fsdpdoctor.distributed import parse_scheduler
from fsdpdoctor.errors import InputError
from fsdpdoctor.ingest.discover import discover


@pytest.fixture(scope="module")
def cluster():
    c = distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    try:
        yield c.scheduler_address
    finally:
        c.close(timeout=60)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory) -> Path:
    cfg = dataclasses.replace(
        PRESETS["healthy-fsdp2"], world_size=4, num_layers=2, steps=2, hidden_size=512, seq_len=512, vocab_size=1024
    )
    return generate(cfg, tmp_path_factory.mktemp("gpu4"))


@pytest.fixture(scope="module")
def gpu_ref(gpu_run):
    """The reference for ``gpu_run``: ``analyze([gpu_run])`` on the default path (no scheduler,
    local files), made once for the module. Read it, never change it."""
    return analyze([gpu_run])


@pytest.fixture(scope="module")
def gpu_glob_ref(gpu_run) -> dict:
    """The reference JSON for the rank files of ``gpu_run`` named by a glob (default path)."""
    return _json(analyze([str(gpu_run / "rank*.json.gz")]))


@pytest.fixture(scope="module")
def recorded_ref(recorded_run):
    """variant -> ``analyze([recorded_run(variant)])`` on the default path, once per module."""
    cache: dict[str, object] = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = analyze([recorded_run(variant)])
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def served(gpu_run):
    """``http://127.0.0.1:PORT/`` serving the generated run's folder; stopped at the end."""
    handler = functools.partial(_QuietHandler, directory=str(gpu_run))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):  # keep the test output clean
        pass


def _json(report, replace: tuple[str, str] | None = None) -> dict:
    text = report.to_json()
    if replace is not None:
        text = text.replace(*replace)
    return json.loads(text)


def test_parse_scheduler():
    assert parse_scheduler("local") == ("local", 0)
    assert parse_scheduler("local:3") == ("local", 3)
    assert parse_scheduler("tcp://10.0.0.1:8786") == ("address", "tcp://10.0.0.1:8786")
    for bad in ("local:0", "8786", "http://x:8786", "local:x"):
        with pytest.raises(InputError):
            parse_scheduler(bad)


@pytest.mark.parametrize("variant", ["per-block", "fsdp1"])
def test_dask_matches_default_on_recorded_cpu_runs(cluster, recorded_run, recorded_ref, variant):
    d = recorded_run(variant)
    ref = recorded_ref(variant)
    got = analyze([d], scheduler=cluster)
    assert len(got.facts.ranks) >= 2
    assert _json(got) == _json(ref)


def test_dask_matches_default_on_generated_gpu_run(cluster, gpu_run, gpu_ref):
    ref = gpu_ref
    seen: dict[str, list] = {"bytes": [], "ranks": []}

    class progress:  # noqa: N801 - a callable with a ranks() method, as the progress bar is
        def __call__(self, d, t):
            seen["bytes"].append((d, t))

        def ranks(self, d, t):
            seen["ranks"].append((d, t))

    got = analyze([gpu_run], scheduler=cluster, progress=progress())
    total = sum(p.stat().st_size for p in gpu_run.glob("rank*.json.gz"))
    assert seen["bytes"][-1] == (total, total) and seen["ranks"][-1] == (4, 4)
    assert got.facts.ranks == [0, 1, 2, 3] and got.facts.gpu_present
    assert _json(got) == _json(ref)
    assert [f.slug for f in got.findings] == [f.slug for f in ref.findings]


def test_dask_leaves_a_truncated_rank_out(cluster, gpu_run, tmp_path):
    for p in gpu_run.glob("rank*.json.gz"):
        shutil.copy(p, tmp_path / p.name)
    bad = tmp_path / "rank2.json.gz"
    bad.write_bytes(bad.read_bytes()[:5000])
    ref = analyze([tmp_path])
    got = analyze([tmp_path], scheduler=cluster)
    assert got.facts.ranks == [0, 1, 3]
    assert [(e.path, e.rank) for e in got.facts.inputs_excluded] == [(str(bad), 2)]
    assert _json(got) == _json(ref)
    with pytest.raises(InputError) as ei:
        analyze([tmp_path], scheduler=cluster, strict=True)
    assert ei.value.path == str(bad)


def test_memory_urls_file_dir_and_glob(gpu_run, gpu_glob_ref):
    mem = fsspec.filesystem("memory")
    for p in gpu_run.glob("rank*.json.gz"):
        mem.pipe(f"/t16/run/{p.name}", p.read_bytes())
    try:
        ref = gpu_glob_ref  # the rank files that were copied
        prefix = ("memory:///t16/run", str(gpu_run))
        assert _json(analyze(["memory://t16/run"]), prefix) == ref
        assert _json(analyze(["memory://t16/run/rank*.json.gz"]), prefix) == ref
        files = discover(["memory://t16/run/rank*.json.gz"])
        assert files == [f"memory:///t16/run/rank{r}.json.gz" for r in range(4)]
        one = analyze(["memory://t16/run/rank1.json.gz"])
        assert one.facts.ranks == [1]
        with pytest.raises(InputError, match="pattern matches no files"):
            discover(["memory://t16/run/*.nothing"])
    finally:
        mem.rm("/t16", recursive=True)


def test_file_urls(gpu_run, gpu_ref, gpu_glob_ref):
    assert _json(analyze([f"file://{gpu_run}"])) == _json(gpu_ref)
    assert _json(analyze([f"file://{gpu_run}/rank*.json.gz"])) == gpu_glob_ref


def test_http_matches_default_locally_and_on_dask(cluster, gpu_run, gpu_ref, served):
    ref = _json(gpu_ref)
    prefix = (served, str(gpu_run))
    assert _json(analyze([served + "/"]), (served + "/", str(gpu_run) + "/")) == ref  # a directory listing
    urls = [f"{served}/rank{r}.json.gz" for r in range(4)]
    ref = _json(analyze([gpu_run / f"rank{r}.json.gz" for r in range(4)]))  # the same files, named one by one
    assert _json(analyze(urls), prefix) == ref
    assert _json(analyze(urls, scheduler=cluster), prefix) == ref  # the workers fetch the URLs


def test_http_missing_file(served, gpu_run):
    rep = analyze([f"{served}/rank0.json.gz", f"{served}/rank1.json.gz", f"{served}/rank9.json.gz"])
    assert rep.facts.ranks == [0, 1]
    ex = {e.rank: e for e in rep.facts.inputs_excluded}
    assert ex[9].path == f"{served}/rank9.json.gz" and "no such file" in ex[9].reason
    assert sorted(ex) == list(range(2, 10))  # 9 unreadable, 2..8 a gap
    with pytest.raises(InputError, match="no such file"):
        analyze([f"{served}/rank9.json.gz"])


@pytest.mark.slow
def test_cli_scheduler_local(gpu_run, gpu_ref):
    """End to end: the CLI starts its own LocalCluster (worker processes) and stops it."""
    proc = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "analyze", str(gpu_run), "--format", "json", "--scheduler", "local:2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == _json(gpu_ref)
    bad = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "analyze", str(gpu_run), "--scheduler", "nowhere"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--scheduler" in bad.stderr


@pytest.mark.parametrize("on_dask", [False, True])
def test_ranks_beyond_the_detail_limit_keep_every_run_figure(cluster, gpu_run, on_dask):
    """Ranks after the first ``detail_ranks`` come back without their collectives; every
    run-level figure (steps, overlap, exposed comm by phase and kind, cross-rank skew) is the
    same as with every rank in detail."""
    from fsdpdoctor.analysis.ranks import fold, load_ranks

    files = discover([gpu_run])
    full = load_ranks(files)
    lean = load_ranks(files, detail_ranks=2, scheduler=cluster if on_dask else None)
    assert [len(r.collectives) > 0 for r in lean.ranks] == [True, True, False, False]
    assert [r.collectives_dropped for r in lean.ranks[2:]] == [len(r.collectives) for r in full.ranks[2:]]
    assert lean.cross_rank == full.cross_rank
    a = fold(full.ranks, cross_rank=full.cross_rank)
    b = fold(lean.ranks, cross_rank=lean.cross_rank, arrived=lean.arrived)
    for attr in ("steps", "overlap", "timeline", "collectives", "fsdp", "cross_rank"):
        assert getattr(a, attr) == getattr(b, attr), attr
    pk_a, pk_b = a.exposed_comm.by_phase_kind, b.exposed_comm.by_phase_kind
    assert pk_a.keys() == pk_b.keys() and all(pk_b[p] == pytest.approx(pk_a[p], rel=1e-12) for p in pk_a)
    assert any(v > 0 for d in pk_a.values() for v in d.values())
    # the per-rank summary that comes back is smaller without the collectives
    import pickle

    assert len(pickle.dumps(lean.ranks[3])) < len(pickle.dumps(full.ranks[3]))


def test_report_json_equals_its_dict(gpu_ref, recorded_ref):
    """to_json encodes the per-rank facts straight from the dataclasses: same JSON as to_dict()."""
    for rep in (gpu_ref, recorded_ref("fsdp1")):
        assert json.loads(rep.to_json()) == rep.to_dict()
        assert rep.facts.rank_facts and json.loads(rep.to_json())["rank_facts"][0]["steps"]


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory) -> Path:
    """More rank files than either engine keeps in flight (the pool: 4 per process; Dask: at least
    16), with two of them truncated."""
    cfg = dataclasses.replace(
        PRESETS["healthy-fsdp2"], world_size=24, num_layers=1, steps=2, hidden_size=256, seq_len=256, vocab_size=512
    )
    d = generate(cfg, tmp_path_factory.mktemp("wide"))
    for r in (9, 21):
        bad = d / f"rank{r}.json.gz"
        bad.write_bytes(bad.read_bytes()[:4000])
    return d


@pytest.mark.parametrize("on_dask", [False, True])
@pytest.mark.slow
def test_files_beyond_the_submission_window(cluster, wide_run, on_dask):
    """Files are handed to the workers a few at a time: every file is still analysed once, in
    order, and strict mode still reports the first bad file in order (not the first to fail)."""
    from fsdpdoctor.analysis.ranks import load_ranks

    files = discover([wide_run])
    sched = cluster if on_dask else None
    load = load_ranks(files, jobs=2, scheduler=sched)
    assert [r.rank for r in load.ranks] == [r for r in range(24) if r not in (9, 21)]
    assert [e.rank for e in load.excluded] == [9, 21]
    with pytest.raises(InputError) as ei:
        load_ranks(files, jobs=2, scheduler=sched, strict=True)
    bad = {str(wide_run / f"rank{r}.json.gz") for r in (9, 21)}
    assert ei.value.path == next(str(f) for f in files if str(f) in bad)  # the first in the order given
