"""The terminal ticket (issue 24): diagnosis first, evidence and fix shown, one ranking across
formats, the OOM explained with the memory held outside PyTorch, snapshots found beside traces.

Read as a person reads it: the rendered text of a rich Console of fixed width."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

import fsdpdoctor
from fsdpdoctor.cli import main
from fsdpdoctor.engine import Finding, rank
from fsdpdoctor.report import html as htmlmod
from fsdpdoctor.report.terminal import render

REPO = Path(__file__).resolve().parents[1]
OOM = REPO / "fixtures" / "recorded" / "gpu" / "oom"
NO_PREFETCH = REPO / "fixtures" / "recorded" / "no-backward-prefetch"
GIB = 2**30


def text_of(report, width: int = 120, **kw) -> str:
    con = Console(record=True, width=width, file=open("/dev/null", "w"), highlight=False, color_system=None)
    render(report, con, **kw)
    return con.export_text()


@pytest.fixture(scope="module")
def oom_report():
    return fsdpdoctor.analyze(OOM)  # no memory=: the snapshot beside the trace is found


@pytest.fixture(scope="module")
def prefetch_report():
    return fsdpdoctor.analyze(NO_PREFETCH)


def torch_oom_truth() -> dict[str, float]:
    """Torch's own OOM message, recorded by the capture run (fixtures/record_gpu.py) in the sidecar."""
    msg = json.loads((OOM / "fsdpdoctor_meta.json").read_text())["extra"]["run"]["oom"]

    def gib(pattern: str) -> float:
        v, unit = re.search(pattern + r" ([\d.]+) (GiB|MiB)", msg).groups()
        return float(v) / (1024 if unit == "MiB" else 1)

    return {
        "total": gib(r"total capacity of"),
        "in_use": gib(r"this process has"),
        "allocated": gib(r"Of the allocated memory"),
        "reserved_free": float(re.search(r"and ([\d.]+) MiB is reserved by PyTorch but unallocated", msg).group(1))
        / 1024,
        "free": float(re.search(r"of which ([\d.]+) MiB is free", msg).group(1)) / 1024,
    }


def test_oom_found_without_memory_and_leads_the_ticket(oom_report):
    assert oom_report.facts.memory is not None and oom_report.facts.memory.discovered
    text = text_of(oom_report)
    assert "rank0.memory.pickle.gz, found beside the traces" in text
    first = next(ln for ln in text.splitlines() if re.match(r"(critical|warning|info)\[", ln))
    assert first.startswith("critical[FSD024] oom:")
    assert oom_report.findings[0].slug == "oom"


def test_oom_names_the_memory_outside_pytorch(oom_report):
    t = torch_oom_truth()
    # torch: "this process has X in use" minus what PyTorch allocated and reserved-but-unallocated
    outside_truth = t["in_use"] - t["allocated"] - t["reserved_free"]
    assert 70 < outside_truth < 78  # the recording filled ~73 GiB with CuPy (sidecar "oom_by")
    text = text_of(oom_report, width=200)
    m = re.search(r"outside PyTorch's allocator: ([\d.]+) GiB", text)
    assert m, text
    assert abs(float(m.group(1)) - outside_truth) < 0.05
    assert re.search(rf"device total {t['total']:.2f} GiB", text)
    lead = oom_report.findings[0]
    assert "outside PyTorch" in lead.cause
    # checkpointing cannot help memory held by another library: nothing in the ticket proposes it
    # (the headline states that none is applied: that is the only mention)
    proposals = [ln for ln in text.lower().splitlines() if "checkpoint" in ln]
    assert proposals == [ln for ln in proposals if "checkpointing  none (activation checkpointing" in ln], proposals
    assert all("checkpoint" not in (f.summary + f.cause + "".join(f.fix.values())).lower() for f in oom_report.findings)
    assert "expandable_segments" not in text
    assert "nvidia-smi" in text
    assert all(f.slug != "activation-memory-dominates" for f in oom_report.findings)


def test_oom_fix_is_labelled_in_its_language(oom_report):
    md = oom_report.to_markdown()
    assert "```bash\nnvidia-smi" in md
    assert "```python\n# Held outside PyTorch" in md


def test_missing_prefetch_shows_evidence_and_fix(prefetch_report):
    fd = next(f for f in prefetch_report.findings if f.slug == "missing-backward-prefetch")
    assert fd.severity in ("critical", "warning")
    text = text_of(prefetch_report, width=200)
    assert "[FSD004] missing-backward-prefetch:" in text
    assert "evidence:" in text and "likely cause:" in text and "fix (fsdp2):" in text
    # the recording runs 2 ranks × 2 profiled steps of a 4-block model with prefetching disabled:
    # each step all-gathers the 4 blocks in backward, none prefetched → 8 of 8 per rank
    assert re.search(r"• 8 of 8 backward all-gathers issued inside the unit's own pre-backward hook", text)
    assert "cur.set_modules_to_backward_prefetch([prev])" in text


def test_info_findings_one_line_and_tables_behind_details(prefetch_report):
    text = text_of(prefetch_report)
    info = [f for f in prefetch_report.findings if f.severity == "info"]
    assert info
    for f in info:
        assert sum(ln.startswith(f"info[{f.code}]") for ln in text.splitlines()) == 1
    assert "Collectives (per step" not in text and "--details" in text
    detailed = text_of(prefetch_report, details=True)
    assert "Collectives (per step, mean over ranks)" in detailed


def test_brief_is_one_line_per_finding(prefetch_report, oom_report):
    for rep in (prefetch_report, oom_report):
        lines = [ln for ln in text_of(rep, width=400, brief=True).splitlines() if ln.strip()]
        assert len(lines) == len(rep.findings)
        assert [ln.split(":")[0] for ln in lines] == [f"{f.severity}[{f.code}] {f.slug}" for f in rep.findings]


def test_same_findings_same_order_in_every_format(oom_report, prefetch_report):
    for rep in (oom_report, prefetch_report):
        term = re.findall(r"^(?:critical|warning|info)\[(FSD\d+)\]", text_of(rep, width=200), re.M)
        md = re.findall(r"^### \d+\. \[\w+\] (FSD\d+)", rep.to_markdown(), re.M)
        page = re.findall(r"<h3>\d+\. <span class=\"sev\">\w+</span> (FSD\d+)", htmlmod.render(rep))
        assert term == md == page == [f.code for f in rep.findings]


def test_world_size_one_says_there_are_no_collectives(oom_report):
    text = text_of(oom_report, details=True)
    assert "no collectives in the traces (world size 1" in text
    assert not re.search(r"\b0\.0\s+0 B\s+0\.0\s+0 B", text)  # no rows of zeros
    page = htmlmod.render(oom_report)
    assert "no all-gathers or reduce-scatters to draw" in page
    assert 'id="fig-units"' not in page


def test_ranking_contract():
    def fd(slug, sev, ms=None, b=None):
        return Finding(slug=slug, code=slug.upper(), severity=sev, summary="", est_saving_ms=ms, est_saving_bytes=b)

    ranked = rank(
        [
            fd("copy", "info", ms=0.0),
            fd("act-mem", "warning", b=2 * GIB),
            fd("opt-mem", "warning", b=3 * GIB),
            fd("prefetch", "warning", ms=4.0),
            fd("overlap", "critical", ms=9.0),
            fd("nothing", "warning"),
            fd("oom", "critical"),
        ],
        crash={"oom"},
    )
    assert [f.slug for f in ranked] == ["oom", "overlap", "prefetch", "opt-mem", "act-mem", "nothing", "copy"]


def test_snapshot_found_by_content_and_bad_one_is_a_note(tmp_path):
    for name in ("rank0.json.gz", "fsdpdoctor_meta.json"):
        shutil.copy(OOM / name, tmp_path / name)
    shutil.copy(OOM / "rank0.memory.pickle.gz", tmp_path / "memdump_rank0")  # no suffix: found by content
    (tmp_path / "rank1.snapshot.pickle").write_bytes(b"\x80\x04garbage")  # pickle magic, not a snapshot
    (tmp_path / "notes.txt").write_text("not a pickle")
    rep = fsdpdoctor.analyze(tmp_path)
    assert rep.facts.memory is not None and Path(rep.facts.memory.path).name == "memdump_rank0"
    assert any(
        n.startswith("memory snapshot rank1.snapshot.pickle beside the traces not read") for n in rep.facts.notes
    )
    assert rep.findings[0].slug == "oom"


def test_cli_brief_and_details():
    r = CliRunner().invoke(main, ["analyze", str(OOM), "--brief"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith("critical[FSD024] oom:")


def test_snapshot_found_in_a_url_directory():
    fsspec = pytest.importorskip("fsspec")
    mem = fsspec.filesystem("memory")
    for name in ("rank0.json.gz", "fsdpdoctor_meta.json", "rank0.memory.pickle.gz"):
        mem.pipe(f"/ticket-oom/{name}", (OOM / name).read_bytes())
    try:
        rep = fsdpdoctor.analyze("memory://ticket-oom")
    finally:
        mem.rm("/ticket-oom", recursive=True)
    m = rep.facts.memory
    assert (
        m is not None and m.discovered and m.path.startswith("memory://") and m.path.endswith("rank0.memory.pickle.gz")
    )
    assert rep.findings[0].slug == "oom"
    assert "outside PyTorch" in rep.findings[0].cause


def test_fix_language_of_every_rules_fix_strings():
    from fsdpdoctor.report.sections import fix_language

    assert (
        fix_language("# before the first CUDA allocation\nexport PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        == "bash"
    )
    assert fix_language("nvidia-smi --query-compute-apps=pid --format=csv") == "bash"
    assert fix_language("model = torch.compile(model)") == "python"
    assert fix_language("# No code fix is known for this setup.") == "python"
