"""The HTML report (issue 8): one self-contained page, checked as text and in a real headless browser.

Inputs: the committed CPU recording (fixtures/recorded/per-block, no GPU timeline), a real public
GPU trace from ../shared (skipped when absent) and a generated multi-rank GPU FSDP2 run
(fixtures/scenarios, skipped when the generator is absent). The browser test runs Debian's
chromium when it is installed (``.ci/run`` installs it) and is skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import html as htmlmod
import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from plotly.offline import get_plotlyjs

from fsdpdoctor.analysis.steps import find_steps
from fsdpdoctor.analysis.timeline.extract import extract_for_facts, extract_step, median_step_index, short_name
from fsdpdoctor.api import analyze
from fsdpdoctor.cli import main
from fsdpdoctor.engine import Finding
from fsdpdoctor.ingest.kineto import load_trace
from fsdpdoctor.report.comparison import to_dict as comparison_dict
from fsdpdoctor.report.html import TITLES, comparison_parts, render, render_comparison

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PER_BLOCK = REPO / "fixtures" / "recorded" / "per-block"
FSDP1 = REPO / "fixtures" / "recorded" / "fsdp1"
GPU_TRACE = SHARED / "traces" / "public" / "hta-nccl-allreduce-a100-2ranks" / "rank-0.json.gz"
REAL_SNAPSHOT = SHARED / "snapshots" / "public" / "cs336-a2-torch211-windows" / "memory_snapshot.pickle"

PLOTLY_HEAD = get_plotlyjs()[:200]

needs_gpu_trace = pytest.mark.skipif(not GPU_TRACE.exists(), reason="../shared/traces/public is absent")


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_report():
    return analyze(PER_BLOCK, timeline_step=(0, None))


@pytest.fixture(scope="module")
def gpu_report():
    if not GPU_TRACE.exists():
        pytest.skip("../shared/traces/public is absent")
    return analyze(GPU_TRACE, timeline_step=(0, None))


@pytest.fixture(scope="module")
def fsdp_gpu_dir(generated_run) -> Path:
    """A generated 2-rank GPU FSDP2 run without backward prefetch (exposed all-gathers)."""
    from fixtures.scenarios.generator import PRESETS

    cfg = dataclasses.replace(PRESETS["no-backward-prefetch-fsdp2"], world_size=2, num_layers=4, steps=3)
    return generated_run(cfg)


@pytest.fixture(scope="module")
def fsdp_gpu_report(fsdp_gpu_dir):
    return analyze(fsdp_gpu_dir, timeline_step=(1, None))


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def assert_self_contained(page: str, n_figures: int) -> None:
    """plotly.js inlined exactly once, no external script/style/link, one newPlot per figure."""
    assert page.startswith("<!DOCTYPE html>")
    assert page.count(PLOTLY_HEAD) == 1, "plotly.js must be inlined exactly once"
    rest = page.replace(get_plotlyjs(), "")
    assert not re.search(r"<script[^>]+src\s*=", rest, re.I), "no <script src=...>"
    assert not re.search(r"<link[^>]+href\s*=", rest, re.I), "no <link href=...>"
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", rest, re.I)
    assert "cdn.plot.ly" not in rest and "@import" not in rest
    assert rest.count("Plotly.newPlot(") == n_figures


# ------------------------------------------------------------------------------------------
# pages as text
# ------------------------------------------------------------------------------------------


def test_cpu_recording_page(cpu_report, tmp_path):
    page = render(cpu_report)
    _write(tmp_path, "cpu.html", page)
    # steps, CPU side of the timeline, units: three figures; no memory figure
    assert_self_contained(page, n_figures=3)
    for key in ("findings", "steps", "timeline", "units", "memory", "details"):
        assert htmlmod.escape(TITLES[key], quote=True) in page, key
    assert "No GPU timeline for rank 0" in page and "CPU-only run" in page
    assert "No GPU kernels in these traces (CPU-only run)" in page
    assert "No memory snapshot given (use <code>--memory</code>)" in page
    assert cpu_report.findings, "the per-block recording has findings (fp32 all-gathers)"
    fix_blocks = [
        htmlmod.unescape(re.sub(r"<[^>]+>", "", b))
        for b in re.findall(r'<pre><code class="language-python">(.*?)</code></pre>', page, re.S)
    ]
    for fd in cpu_report.findings:
        assert htmlmod.escape(fd.summary, quote=True) in page
        assert f"<code>{fd.slug}</code>" in page
        for code in fd.fix.values():
            assert code.rstrip() in fix_blocks, code  # highlighted: its text, once the markup is taken off
    for u in cpu_report.facts.fsdp.units:  # unit names reach the units chart
        assert json.dumps(u.fqn or "(root)") in page
    assert 'id="fig-steps"' in page and 'id="fig-units"' in page and 'id="fig-timeline"' in page


@needs_gpu_trace
def test_public_gpu_trace_page(gpu_report, tmp_path):
    page = render(gpu_report)
    _write(tmp_path, "gpu.html", page)
    assert_self_contained(page, n_figures=3)  # steps, waterfall, timeline; not FSDP: no units chart
    assert htmlmod.escape(TITLES["steps"], quote=True) in page
    assert "No GPU timeline" not in page
    tl = gpu_report.timeline
    assert f"rank 0, step index {tl.step_index} (ProfilerStep#{tl.step_number})" in page
    assert '"exposed comm (not overlapped by compute)"' in page
    assert '"all-reduce"' in page  # comm kernels by kind in the legend
    assert "No FSDP units found in the traces." in page
    for fd in gpu_report.findings:
        assert htmlmod.escape(fd.summary, quote=True) in page


def test_generated_fsdp_gpu_page(fsdp_gpu_report, tmp_path):
    page = render(fsdp_gpu_report)
    _write(tmp_path, "fsdp.html", page)
    # steps, the waterfall and its per-rank spread (2 ranks), timeline, compute (the generator records shapes), units
    assert_self_contained(page, n_figures=6)
    assert htmlmod.escape(TITLES["compute"], quote=True) in page and "TFLOP/s by engine" in page
    assert "FSDP unit starts (GPU)" in page and '"layers.0"' in page
    assert '"all-gather"' in page and '"reduce-scatter"' in page
    assert "rank 1, step index" in page
    slugs = {f.slug for f in fsdp_gpu_report.findings}
    assert "missing-backward-prefetch" in slugs
    assert "missing-backward-prefetch" in page


@pytest.fixture(scope="module")
def waterfall_report():
    """The real H200 GPT-2 recording at batch 96 (its waterfall is issue #32's example)."""
    return analyze(Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu-h200" / "gpt2-bf16-b96")


def _waterfall_fig(page: str, div: str) -> dict:
    m = re.search(r'id="' + re.escape(div) + r'".*?var fig = (\{.*?\});\n', page, re.S)
    assert m, f"no figure {div}"
    return json.loads(m.group(1))


def test_waterfall_chart_real_recording(waterfall_report, tmp_path):
    """The step as its parts: one relative bar per part, in the attribution order, at peak first,
    summing to the step the headline states."""
    page = render(waterfall_report)
    _write(tmp_path, "waterfall.html", page)
    assert_self_contained(
        page, n_figures=3
    )  # steps, waterfall, compute (one rank: no spread; world size 1: no units chart)
    assert htmlmod.escape(TITLES["waterfall"], quote=True) in page
    fig = _waterfall_fig(page, "fig-waterfall")
    (tr,) = fig["data"]
    assert tr["type"] == "waterfall" and tr["measure"][-1] == "total"
    e = waterfall_report.facts.efficiency
    assert tr["x"][:2] == ["matmul at peak", "attention at peak"] and tr["x"][-2:] == ["GPU idle", "step"]
    assert sum(tr["y"]) == pytest.approx(waterfall_report.facts.step_clock_ms, rel=1e-6)
    assert dict(zip(tr["x"], tr["y"]))["other kernels"] == pytest.approx(e.parts_ms["other_kernels"])
    assert htmlmod.escape("at peak (31.3% MFU)") in page


def test_waterfall_per_rank_menu_and_spread(fsdp_gpu_report):
    """Several ranks: a menu entry per rank (each rank's own parts, from its summary line) and a
    stacked bar per rank."""
    page = render(fsdp_gpu_report)
    fig = _waterfall_fig(page, "fig-waterfall")
    names = [t["name"] for t in fig["data"]]
    assert names == ["run (mean over ranks)", "rank 0", "rank 1"]
    assert [b["label"] for b in fig["layout"]["updatemenus"][0]["buttons"]] == names
    for t, s in zip(fig["data"][1:], fsdp_gpu_report.facts.rank_summaries):
        assert sum(t["y"]) == pytest.approx(sum(s.waterfall_ms.values()), rel=1e-9)
    spread = _waterfall_fig(page, "fig-waterfall-ranks")
    assert len(spread["data"]) == 9 and all(len(t["x"]) == 2 for t in spread["data"])


def test_untrusted_strings_are_escaped(cpu_report):
    evil = "</script><script>alert(1)</script>"
    rep = dataclasses.replace(cpu_report)
    rep.findings = [
        Finding(
            slug="x-slug",
            code="FSD999",
            severity="critical",
            summary=f"bad {evil}",
            evidence=[f"ev {evil}"],
            cause=evil,
            fix={"fsdp2": f"print('{evil}')"},
        )
    ]
    facts = rep.facts
    old = facts.fsdp.units[1].fqn
    facts.fsdp.units[1].fqn = evil
    try:
        page = render(rep)
    finally:
        facts.fsdp.units[1].fqn = old
    assert "<script>alert(1)" not in page
    assert "&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in page  # findings, via html.escape
    # chart data: JSON with \\u escapes (plotly may also escape "/")
    assert re.search(r"\\u003c(\\u002f|/)script\\u003e\\u003cscript\\u003ealert\(1\)", page)


def test_memory_section_from_memory_facts(cpu_report):
    """The memory section draws MemoryFacts (fsdpdoctor.analysis.memory) when facts.memory is set."""
    from fsdpdoctor.analysis.memory import MemoryFacts

    mem = MemoryFacts(
        source="snapshot",
        path="snap.pickle",
        peak_allocated_bytes=6 * 2**30,
        reserved_at_peak_bytes=7 * 2**30,
        pending_free_at_peak_bytes=2**28,
        external_fragmentation_bytes=7 * 2**30 - 6 * 2**30 - 2**28,
        peak_phase="backward",
        notes=["a note"],
        categories={"parameters_sharded": 2**30, "activations": 4 * 2**30, "gradients": 2**30, "other": 0},
        curve={
            "x_unit": "time_us",
            "x": [10.0, 20.0, 30.0],
            "allocated": [2**30, 6 * 2**30, 3 * 2**30],
            "reserved": [2 * 2**30, 7 * 2**30, 7 * 2**30],
        },
    )
    facts = cpu_report.facts
    old = getattr(facts, "memory", None)
    try:
        facts.memory = mem
        page = render(cpu_report)
    finally:
        facts.memory = old
    assert_self_contained(page, n_figures=5)
    assert TITLES["memory_stack"] in page and TITLES["memory_curve"] in page
    assert "No memory snapshot given" not in page
    assert '"activations"' in page and '"reserved at peak"' in page
    assert "Peak 6.00 GiB allocated during backward, 7.00 GiB reserved" in page
    assert "a note" in page


@pytest.mark.skipif(not REAL_SNAPSHOT.exists(), reason="../shared snapshots not available")
def test_memory_section_real_snapshot(tmp_path):
    rep = analyze(PER_BLOCK, memory=[REAL_SNAPSHOT])
    assert rep.facts.memory is not None
    page = render(rep)
    assert TITLES["memory_stack"] in page and TITLES["memory_curve"] in page
    assert '"allocated"' in page and '"reserved"' in page


# ------------------------------------------------------------------------------------------
# the timeline extract
# ------------------------------------------------------------------------------------------


def _check_extract_matches_facts(report, rank: int) -> None:
    rf = next(r for r in report.facts.rank_facts if r.rank == rank)
    rt = load_trace(rf.path)
    steps = find_steps(rt).steps
    for k, st in enumerate(steps):
        tl = extract_step(rt, st, step_index=k, collectives=rf.collectives)
        sf = rf.steps[k]
        # the same sets as the analysis: totals agree with RunFacts to float precision
        assert tl.exposed_comm_ms == pytest.approx(sf.exposed_comm_ms, abs=1e-9)
        assert tl.compute_ms == pytest.approx(sf.compute_ms, abs=1e-9)
        assert tl.comm_ms == pytest.approx(sf.comm_ms, abs=1e-9)
        assert tl.gpu_window_ms == pytest.approx(sf.gpu_window_ms, abs=1e-9)
        assert sum(b - a for a, b in tl.exposed) / 1e3 == pytest.approx(sf.exposed_comm_ms, abs=1e-6)
        starts = [sp.start_us for sp in tl.kernels]
        assert starts == sorted(starts) and len(tl.kernels) == tl.kernel_count
        assert all(sp.end_us >= sp.start_us for sp in tl.kernels)
        assert set(tl.streams) == {sp.stream for sp in tl.kernels}
        # every exposed piece lies inside a comm kernel on its stream, and inside the exposed set
        comm = [sp for sp in tl.kernels if sp.category == "comm"]
        for ex in tl.exposed_spans:
            assert any(
                c.stream == ex.stream and c.start_us - 1e-6 <= ex.start_us and ex.end_us <= c.end_us + 1e-6
                for c in comm
            )
            assert any(a - 1e-6 <= ex.start_us and ex.end_us <= b + 1e-6 for a, b in tl.exposed)


@needs_gpu_trace
def test_extract_matches_step_facts_public(gpu_report):
    _check_extract_matches_facts(gpu_report, 0)
    tl = gpu_report.timeline
    assert {sp.kind for sp in tl.kernels if sp.category == "comm"} <= {"all_reduce", "broadcast"}
    assert tl.units == []  # not FSDP


def test_extract_matches_step_facts_fsdp(fsdp_gpu_report):
    _check_extract_matches_facts(fsdp_gpu_report, 1)


def test_unit_marks_fsdp2_gpu(fsdp_gpu_report):
    tl = fsdp_gpu_report.timeline
    assert tl.rank == 1
    rf = next(r for r in fsdp_gpu_report.facts.rank_facts if r.rank == 1)
    assert tl.step_index == median_step_index([s.step_ms for s in rf.steps])
    fqns = [u.fqn or "(root)" for u in fsdp_gpu_report.facts.fsdp.units]
    fwd = [u for u in tl.units if u.pass_ == "forward"]
    bwd = [u for u in tl.units if u.pass_ == "backward"]
    assert [u.unit for u in fwd] == fqns  # forward runs the units in order
    assert [u.unit for u in bwd][1:] == [f for f in reversed(fqns) if f != "(root)"]
    # each unit's GPU work starts after its hook began, and forward units start in order on the GPU
    assert all(u.gpu_us is not None and u.gpu_us >= u.cpu_start_us for u in tl.units)
    assert [u.gpu_us for u in fwd] == sorted(u.gpu_us for u in fwd)
    # collectives carry their unit: every all-gather kernel of the step belongs to a known unit
    ags = [sp for sp in tl.kernels if sp.kind == "all_gather"]
    assert ags and all(sp.unit in fqns for sp in ags) and all(sp.bytes for sp in ags)
    # no backward prefetch: backward all-gathers are exposed (hatched)
    assert any(ex.kind == "all_gather" for ex in tl.exposed_spans)


def test_unit_marks_cpu_recordings(cpu_report):
    tl = cpu_report.timeline
    assert not tl.gpu_present and tl.kernels == [] and tl.exposed == []
    fqns = [u.fqn or "(root)" for u in cpu_report.facts.fsdp.units]
    assert [u.unit for u in tl.units if u.pass_ == "forward"] == fqns
    assert all(u.gpu_us is None for u in tl.units)
    assert set(tl.phases) >= {"forward", "backward"}
    # FSDP1 labels carry no FQN: forward hooks are units by order, named as the facts name them
    # (here from the recording's sidecar), else unit<k> as fsdpdoctor.analysis.fsdp does
    rep1 = analyze(FSDP1)
    tl1 = extract_for_facts(rep1.facts, 0, 0)
    names = [u.fqn or "(root)" for u in rep1.facts.fsdp.units]
    assert names[1:] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert [u.unit for u in tl1.units if u.pass_ == "forward"] == names
    assert all(u.label.startswith("FullyShardedDataParallel.") for u in tl1.units)
    rf = rep1.facts.rank_facts[0]
    rt = load_trace(rf.path)
    bare = extract_step(rt, find_steps(rt).steps[0])
    assert [u.unit for u in bare.units if u.pass_ == "forward"] == [f"<unit {k}>" for k in range(len(names))]
    assert [u.unit for u in bare.units if u.pass_ == "backward"][:2] == ["backward #0", "backward #1"]


def test_extract_is_bounded(fsdp_gpu_report):
    rf = next(r for r in fsdp_gpu_report.facts.rank_facts if r.rank == 0)
    rt = load_trace(rf.path)
    st = find_steps(rt).steps[0]
    full = extract_step(rt, st)
    small = extract_step(rt, st, max_events=50)
    assert len(small.kernels) == 50 and small.truncated == full.kernel_count - 50
    assert small.exposed_comm_ms == full.exposed_comm_ms and small.compute_ms == full.compute_ms
    longest = sorted((sp.end_us - sp.start_us for sp in full.kernels), reverse=True)[:50]
    assert sorted((sp.end_us - sp.start_us for sp in small.kernels), reverse=True) == longest
    assert any("longest are drawn" in n for n in small.notes)


def test_timeline_defaults_and_errors(cpu_report):
    from fsdpdoctor.errors import InputError

    rf0 = next(r for r in cpu_report.facts.rank_facts if r.rank == 0)
    assert cpu_report.timeline.step_index == median_step_index([s.step_ms for s in rf0.steps])
    assert median_step_index([5.0, 1.0, 3.0]) == 2 and median_step_index([2.0, 1.0]) == 1
    assert median_step_index([]) is None
    with pytest.raises(InputError, match="not in the input"):
        extract_for_facts(cpu_report.facts, 7, None)
    with pytest.raises(InputError, match="has 2 steps"):
        extract_for_facts(cpu_report.facts, 1, 5)


def test_short_names():
    assert short_name("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, int)") == (
        "at::native::cunn_SoftMaxForward"
    )
    assert short_name("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == (
        "ncclDevKernel_AllGather_RING_LL"
    )
    assert short_name("Memcpy HtoD (Pinned -> Device)") == "Memcpy HtoD (Pinned -> Device)"
    assert len(short_name("x" * 500)) == 64


# ------------------------------------------------------------------------------------------
# compare waterfall
# ------------------------------------------------------------------------------------------


def _cmp_dict(before, after, comps):
    return {
        "step_time_before_ms": before,
        "step_time_after_ms": after,
        "step_time_delta_ms": after - before,
        "components": {n: {"before_ms": 0.0, "after_ms": v, "delta_ms": v} for n, v in comps.items()},
    }


def test_render_comparison_from_its_json():
    comps = {"exposed_all_gather": 15.0, "compute": 3.0, "host_bound_idle": 2.5, "memcpy": -0.5}
    d = _cmp_dict(100.0, 120.0, comps) | {"before": "run <a>", "after": "run b"}
    before, parts, after, total = comparison_parts(d)
    assert (before, after, total) == (100.0, 120.0, 20.0)
    assert dict(parts) == comps
    page = render_comparison(d)
    assert_self_contained(page, n_figures=1)
    assert TITLES["compare"] in page and '"waterfall"' in page
    assert '"exposed all-gather"' in page and '"unexplained"' not in page  # compare's labels
    assert "run &lt;a&gt;" in page and "+20.00 ms (+20.0%)" in page
    # parts that do not add up: the rest shows as "unexplained"
    page = render_comparison(_cmp_dict(50.0, 40.0, {"compute": -4.0}))
    assert '"unexplained"' in page
    empty = render_comparison({})
    assert "holds no step-time delta" in empty and "Plotly.newPlot(" not in empty


def _real_comparison(before: Path, after: Path):
    from fsdpdoctor.analysis.compare import compare
    from fsdpdoctor.api import load_run

    b, a = load_run(str(before)), load_run(str(after))
    return compare(b.facts, a.facts, b.findings, a.findings, before_label=str(before), after_label=str(after))


def _check_real_comparison(cmp) -> str:
    page = render_comparison(cmp)
    d = comparison_dict(cmp)
    # the change by compare's components, and (GPU runs) by the waterfall's parts
    assert_self_contained(page, n_figures=2 if d["waterfall_ms"] else 1)
    if d["waterfall_ms"]:
        assert sum(p["delta_ms"] for p in d["waterfall_ms"].values()) == pytest.approx(
            d["step_time_delta_ms"], abs=1e-6
        )
    before, parts, after, total = comparison_parts(cmp)
    assert before == pytest.approx(d["step_time_before_ms"]) and after == pytest.approx(d["step_time_after_ms"])
    assert total == pytest.approx(d["step_time_delta_ms"])
    # compare's components add up to the delta exactly: no "unexplained" bar
    assert sum(v for _, v in parts) == pytest.approx(total, abs=1e-6)
    assert '"unexplained"' not in page and TITLES["compare"] in page
    assert "Causes, ranked" in page
    return page


def test_render_real_comparison_cpu():
    cmp = _real_comparison(PER_BLOCK, REPO / "fixtures" / "recorded" / "no-backward-prefetch")
    page = _check_real_comparison(cmp)
    # CPU-only runs: the delta by CPU phase, FSDP hook CPU time apart
    assert '"forward outside FSDP hooks (CPU)"' in page and '"FSDP hook CPU time"' in page


def test_render_real_comparison_gpu(fsdp_gpu_dir, generated_run):
    from fixtures.scenarios.generator import PRESETS

    healthy = generated_run(dataclasses.replace(PRESETS["healthy-fsdp2"], world_size=2, num_layers=4, steps=3))
    cmp = _real_comparison(healthy, fsdp_gpu_dir)
    page = _check_real_comparison(cmp)
    assert comparison_dict(cmp)["step_time_delta_ms"] > 0
    assert '"exposed all-gather"' in page and "missing-backward-prefetch" in page


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------


def test_cli_html(tmp_path):
    out = tmp_path / "report.html"
    res = CliRunner().invoke(
        main,
        ["analyze", str(PER_BLOCK), "--format", "html", "-o", str(out), "--timeline-rank", "1", "--timeline-step", "1"],
    )
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert_self_contained(page, n_figures=3)
    assert "rank 1, step index 1 (ProfilerStep#" in page
    bad = CliRunner().invoke(
        main, ["analyze", str(PER_BLOCK), "--format", "html", "-o", str(out), "--timeline-rank", "9"]
    )
    assert bad.exit_code == 2
    assert "rank 9: not in the input" in bad.output and "Traceback" not in bad.output


# ------------------------------------------------------------------------------------------
# a real headless browser
# ------------------------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


CHROMIUM = _chromium()
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")

# Injected first into a copy of the page: collects uncaught errors, rejected promises and
# console.error calls, then reports them with the number of rendered plotly charts in the title.
ERROR_PROBE = """<script>
window.__errs = [];
window.addEventListener("error", function (e) { window.__errs.push("error: " + (e.message || e)); });
window.addEventListener("unhandledrejection", function (e) { window.__errs.push("Unhandled " + e.reason); });
(function () { var ce = console.error; console.error = function () {
  window.__errs.push("console.error " + Array.prototype.join.call(arguments, " ")); return ce.apply(console, arguments); }; })();
window.addEventListener("load", function () { setTimeout(function () {
  var plots = document.querySelectorAll(".js-plotly-plot .main-svg").length ? document.querySelectorAll(".js-plotly-plot").length : 0;
  document.title = "PROBE " + JSON.stringify({plots: plots, errors: window.__errs}); }, 300); });
</script>"""


def _browser(*args: str, user_dir: Path) -> subprocess.CompletedProcess:
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={user_dir}",
        "--hide-scrollbars",
        "--virtual-time-budget=15000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def decode_png(data: bytes) -> np.ndarray:
    """A minimal PNG decoder (8-bit, non-interlaced grey/RGB/RGBA): the test needs no imaging library."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        n, typ = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        if typ == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif typ == b"IDAT":
            idat.append(body)
        elif typ == b"IEND":
            break
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and interlace == 0 and ctype in (0, 2, 4, 6), f"unsupported PNG {ihdr}"
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[ctype]
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(h, 1 + w * bpp)
    out = np.zeros((h, w * bpp), dtype=np.uint8)
    prev = np.zeros(w * bpp, dtype=np.int64)
    for y in range(h):
        f, line = int(raw[y, 0]), raw[y, 1:].astype(np.int64)
        if f == 0:
            cur = line
        elif f == 1:  # Sub: a running sum per channel
            cur = np.cumsum(line.reshape(w, bpp), axis=0).reshape(-1) & 255
        elif f == 2:  # Up
            cur = (line + prev) & 255
        else:  # Average / Paeth depend on the pixel to the left: byte by byte
            lb, pb = line.tolist(), prev.tolist()
            c = [0] * len(lb)
            for i in range(len(lb)):
                a = c[i - bpp] if i >= bpp else 0
                b = pb[i]
                if f == 3:
                    c[i] = (lb[i] + ((a + b) >> 1)) & 255
                else:
                    d = pb[i - bpp] if i >= bpp else 0
                    p = a + b - d
                    pa, pq, pc = abs(p - a), abs(p - b), abs(p - d)
                    c[i] = (lb[i] + (a if pa <= pq and pa <= pc else b if pq <= pc else d)) & 255
            cur = np.array(c, dtype=np.int64)
        out[y] = cur
        prev = cur
    return out.reshape(h, w, bpp)


def _encode_png(img: np.ndarray) -> bytes:
    """Encode with every filter type in turn (to test :func:`decode_png`)."""
    h, w, bpp = img.shape
    rows = []
    prev = np.zeros(w * bpp, dtype=np.int64)
    for y in range(h):
        cur = img[y].reshape(-1).astype(np.int64)
        left = np.concatenate([np.zeros(bpp, np.int64), cur[:-bpp]])
        upleft = np.concatenate([np.zeros(bpp, np.int64), prev[:-bpp]])
        f = y % 5
        if f == 0:
            line = cur
        elif f == 1:
            line = cur - left
        elif f == 2:
            line = cur - prev
        elif f == 3:
            line = cur - (left + prev) // 2
        else:
            p = left + prev - upleft
            pa, pb, pc = np.abs(p - left), np.abs(p - prev), np.abs(p - upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
            line = cur - pred
        rows.append(bytes([f]) + bytes((line & 255).astype(np.uint8)))
        prev = cur

    def chunk(t: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + t + body + struct.pack(">I", zlib.crc32(t + body))

    ctype = {1: 0, 3: 2, 4: 6}[bpp]
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, ctype, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


def test_png_decoder_roundtrip():
    img = np.random.default_rng(0).integers(0, 256, size=(11, 7, 3), dtype=np.uint8)
    assert np.array_equal(decode_png(_encode_png(img)), img)


def _load(page_path: Path, tmp_path: Path) -> tuple[dict, np.ndarray, int, str]:
    """One chromium launch per page: the probed copy is loaded once, its DOM dumped (the probe's
    report in the title) and a screenshot taken of the same load, its console logged to stderr."""
    text = page_path.read_text(encoding="utf-8")
    probed = tmp_path / ("probe-" + page_path.name)
    probed.write_text(text.replace("<head>", "<head>" + ERROR_PROBE, 1), encoding="utf-8")
    png = tmp_path / (page_path.stem + ".png")
    res = _browser(
        "--enable-logging=stderr",
        "--v=0",
        "--dump-dom",
        f"--screenshot={png}",
        "--window-size=1400,3000",
        probed.as_uri(),
        user_dir=tmp_path / "profile",
    )
    m = re.search(r"<title>PROBE (.*?)</title>", res.stdout, re.S)
    assert m, f"the page did not finish loading in chromium:\n{res.stderr[-2000:]}"
    assert png.exists(), f"no screenshot written:\n{res.stderr[-2000:]}"
    data = png.read_bytes()
    return json.loads(htmlmod.unescape(m.group(1))), decode_png(data), len(data), res.stderr


def _page_console_errors(stderr: str) -> list[str]:
    """Console lines chromium logs for the page (``CONSOLE(...)`` / ``Uncaught``) that are errors."""
    return [
        ln
        for ln in stderr.splitlines()
        if ("Uncaught" in ln or ("CONSOLE" in ln and "error" in ln.lower())) and "file://" in ln
    ]


def _check_in_browser(page: str, name: str, n_figures: int, tmp_path: Path) -> np.ndarray:
    path = _write(tmp_path, name, page)
    probe, img, size, stderr = _load(path, tmp_path)
    assert probe["errors"] == [], probe["errors"]
    assert probe["plots"] == n_figures, probe
    assert _page_console_errors(stderr) == []
    assert img.shape[:2] == (3000, 1400)
    assert size > 30_000, "the screenshot is (nearly) empty"
    rgb = img[..., :3].reshape(-1, 3).astype(np.float64)
    assert rgb.std() > 20, "the screenshot is (nearly) blank"
    non_white = (rgb.min(axis=1) < 235).mean()
    assert non_white > 0.03, f"too little drawn ({non_white:.1%} non-white pixels)"
    colours = {tuple(c) for c in img[::9, ::9, :3].reshape(-1, 3).tolist()}
    assert len(colours) > 50, "charts are drawn in many colours"
    return img


@needs_browser
def test_browser_cpu_recording(cpu_report, tmp_path):
    img = _check_in_browser(render(cpu_report), "cpu.html", 3, tmp_path)
    # the steps chart's CPU step bars are dark grey (#333333): charts, not just text, were painted
    assert (np.abs(img[..., :3].astype(int) - 0x33).max(axis=2) < 6).sum() > 20_000


@needs_browser
def test_browser_fsdp_gpu(fsdp_gpu_report, tmp_path):
    img = _check_in_browser(render(fsdp_gpu_report), "fsdp.html", 6, tmp_path)
    rgb = img[..., :3].astype(int)
    for hex_colour in ("#4C78A8", "#54A24B"):  # compute bars and all-gather bars were painted
        target = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(rgb - target).max(axis=2) < 6).sum() > 2_000, hex_colour


@needs_browser
@needs_gpu_trace
def test_browser_public_gpu_trace(gpu_report, tmp_path):
    _check_in_browser(render(gpu_report), "gpu.html", 3, tmp_path)


@needs_browser
def test_browser_waterfall(waterfall_report, tmp_path):
    """The waterfall renders offline: the total bar (#333333) and the relative bars (#4C78A8) painted."""
    img = _check_in_browser(render(waterfall_report), "waterfall.html", 3, tmp_path)
    rgb = img[..., :3].astype(int)
    for hex_colour in ("#4C78A8", "#333333"):
        target = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(rgb - target).max(axis=2) < 6).sum() > 2_000, hex_colour


@needs_browser
def test_browser_comparison(tmp_path):
    page = render_comparison(
        _cmp_dict(100.0, 118.0, {"exposed_all_gather": 12.0, "compute": 4.0, "host_bound_idle": 3.0, "memcpy": -1.0})
    )
    path = _write(tmp_path, "compare.html", page)
    probe, img, size, stderr = _load(path, tmp_path)
    assert probe == {"plots": 1, "errors": []}
    assert _page_console_errors(stderr) == []
    rgb = img[..., :3].astype(int)
    for hex_colour in ("#E45756", "#54A24B", "#4C78A8"):  # slower, faster and total bars were painted
        target = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(rgb - target).max(axis=2) < 6).sum() > 200, hex_colour
