"""Rule contract and rule cases.

Each rule module ``rules/fsdNNN_*.py`` has its cases as data in ``rules/cases/<module>.toml``:
inputs that must make it fire and inputs on which it must stay silent.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import fsdpdoctor
import fsdpdoctor.api
from conftest import public_trace_files
from fsdpdoctor.config import THRESHOLDS, defaults
from fsdpdoctor.engine import find_rule, load_rules, run_rules

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RULES_DIR = Path(__file__).resolve().parents[1] / "rules"
CASE_DIR = RULES_DIR / "cases"
SECTIONS = ("What it detects", "Why it", "How it shows in a trace", "Fix")


def test_every_rule_honours_the_contract():
    mods = load_rules()
    assert len(mods) >= 19
    codes = [m.CODE for m in mods]
    slugs = [m.SLUG for m in mods]
    assert len(set(codes)) == len(codes) and len(set(slugs)) == len(slugs)
    for m in mods:
        assert re.fullmatch(r"FSD\d{3}", m.CODE)
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", m.SLUG)
        assert m.SEVERITY in ("critical", "warning", "info")
        doc = m.__doc__ or ""
        for sec in SECTIONS:
            assert sec in doc, f"{m.CODE} docstring lacks '{sec}'"
        for key in getattr(m, "THRESHOLDS", ()):
            assert key in THRESHOLDS, f"{m.CODE} names unknown threshold {key}"
        assert find_rule(m.SLUG) is m and find_rule(m.CODE.lower()) is m
        case_file = CASE_DIR / (Path(m.__file__).stem + ".toml")
        assert case_file.exists(), f"{m.CODE} has no cases file {case_file.name}"


def test_every_rule_has_a_firing_and_a_silent_case():
    for m in load_rules():
        data = tomllib.loads((CASE_DIR / (Path(m.__file__).stem + ".toml")).read_text())
        expects = {c["expect"] for c in data.get("case", [])}
        assert "fires" in expects, f"{m.CODE} {m.SLUG} has no case on which it fires"
        assert "silent" in expects, f"{m.CODE} {m.SLUG} has no case on which it stays silent"


def test_what_each_finding_explains_names_real_parts_of_the_step():
    """compare reads EXPLAINS / EXPLAINS_IF_CHANGED from the rule modules: the parts must exist."""
    from fsdpdoctor.analysis.compare import CPU_COMPONENTS, GPU_COMPONENTS, PHASES

    parts = {"gpu": set(GPU_COMPONENTS), "cpu": set(CPU_COMPONENTS)}
    for m in load_rules():
        tables = [getattr(m, "EXPLAINS", {})] + list(getattr(m, "EXPLAINS_IF_CHANGED", {}).values())
        for t in tables:
            for basis, claims in t.items():
                if basis == "note":
                    continue
                for comp, phase in claims:
                    assert comp in parts[basis], f"{m.CODE}: {comp} is not a {basis} part"
                    assert phase is None or phase in PHASES, f"{m.CODE}: unknown phase {phase}"


def _cases():
    out = []
    for f in sorted(CASE_DIR.glob("*.toml")):
        data = tomllib.loads(f.read_text())
        for i, case in enumerate(data.get("case", [])):
            out.append(pytest.param(f.stem, case, id=f"{f.stem}[{i}]-{case['source']}-{case['input']}-{case['expect']}"))
    return out


def _slug_of(module_stem: str) -> str:
    return next(m.SLUG for m in load_rules() if Path(m.__file__).stem == module_stem)


def _patched_report(base: "fsdpdoctor.Report", patch: dict) -> "fsdpdoctor.Report":
    """A copy of ``base`` with dotted RunFacts fields replaced, findings re-run."""
    import copy

    facts = copy.deepcopy(base.facts)
    for dotted, value in patch.items():
        obj = facts
        *path, last = dotted.split(".")
        for part in path:
            obj = getattr(obj, part)
        assert hasattr(obj, last), dotted
        setattr(obj, last, value)
    return fsdpdoctor.Report(facts=facts, findings=run_rules(facts, defaults()))


@pytest.fixture(scope="module")
def analyzed(recorded_run, hang_recording, tmp_path_factory):
    cache: dict[tuple[str, str], list] = {}

    def get(source: str, name: str, patch: dict | None = None, knobs: dict | None = None):
        if source == "facts":
            return [_patched_report(r, patch or {}) for r in get("recorded", name)]
        key = (source, name, tuple(sorted((knobs or {}).items())))
        if key not in cache:
            if source == "recorded":
                cache[key] = [fsdpdoctor.analyze(recorded_run(name))]
            elif source == "gpu-recorded":  # the committed GPU recordings, snapshots beside them: a bare name is
                # one of the H100 set (fixtures/recorded/gpu), "gpu-h200/NAME" one of the H200 set
                recorded = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
                cache[key] = [fsdpdoctor.analyze(recorded / name if "/" in name else recorded / "gpu" / name)]
            elif source == "public":
                files = public_trace_files()
                if not files:
                    pytest.skip("../shared/traces/public is absent")
                cache[key] = [fsdpdoctor.analyze(f) for f in files]
            elif source == "snapshot":
                from fixtures.snapshots import gen_snapshot as gen

                out = tmp_path_factory.mktemp(f"snap-{name}")
                snap, _truth = gen.write(name, out)
                cache[key] = [fsdpdoctor.api.analyze_memory_only(snap)]
            elif source == "public-snapshot":
                from conftest import PUBLIC_SNAPSHOTS

                path = PUBLIC_SNAPSHOTS / name
                if not path.exists():
                    pytest.skip("../shared/snapshots/public is absent")
                cache[key] = [fsdpdoctor.api.analyze_memory_only(path)]
            elif source == "fr-recorded":  # real Flight Recorder dumps of a hung gloo job (fixtures/record_hang.py)
                cache[key] = [fsdpdoctor.analyze(hang_recording(name) / "dumps")]
            elif source == "fr-generated":  # NCCL-format dumps (fixtures/flight_recorder/gen.py presets)
                from fixtures.flight_recorder import gen as fr_gen

                out = tmp_path_factory.mktemp(f"fr-{name}")
                fr_gen.write(fr_gen.PRESETS[name], out)
                cache[key] = [fsdpdoctor.analyze(out)]
            elif source == "scenario":
                import dataclasses

                from fixtures.scenarios import generator as gen

                out = tmp_path_factory.mktemp(f"scn-{name}")
                gen.generate(dataclasses.replace(gen.PRESETS[name], **(knobs or {})), out)
                cache[key] = [fsdpdoctor.analyze(out)]
            else:
                raise ValueError(source)
        return cache[key]

    return get


@pytest.mark.parametrize("module_stem,case", _cases())
def test_rule_case(module_stem, case, analyzed):
    slug = _slug_of(module_stem)
    for rep in analyzed(case["source"], case["input"], case.get("patch"), case.get("set")):
        fired = [f for f in rep.findings if f.slug == slug]
        if case["expect"] == "fires":
            assert fired, f"{slug} did not fire on {case['source']}:{case['input']}; findings: {[f.slug for f in rep.findings]}"
            f = fired[0]
            assert f.summary and f.evidence and f.fix
            if "min_saving_ms" in case:
                assert f.est_saving_ms is not None and f.est_saving_ms >= case["min_saving_ms"]
            if "summary_contains" in case:
                assert case["summary_contains"] in f.summary, f.summary
            for text in case.get("fix_lacks", []):
                assert all(text not in code for code in f.fix.values()), (text, f.fix)
        else:
            assert not fired, f"{slug} fired on {case['source']}:{case['input']}: {fired[0].summary}"


def test_nothing_fsdp_specific_fires_on_public_traces():
    files = public_trace_files()
    if not files:
        pytest.skip("../shared/traces/public is absent")
    fsdp_specific = {m.SLUG for m in load_rules()} - {"fsdp-not-detected", "low-overlap", "host-bound", "straggler-rank", "step-time-jitter", "pageable-memcpy",
                                                          "activation-recompute"}  # the MI300 DDP run checkpoints for real
    for f in files:
        rep = fsdpdoctor.analyze(f)
        slugs = {x.slug for x in rep.findings}
        assert "fsdp-not-detected" in slugs, f
        assert not slugs & fsdp_specific, (f, slugs & fsdp_specific)


def test_findings_json_shape_and_ranking(recorded_run):
    rep = fsdpdoctor.analyze(recorded_run("per-linear"))
    d = rep.to_dict()
    assert d["findings"], "per-linear has findings"
    for f in d["findings"]:
        for key in ("slug", "code", "severity", "summary", "evidence", "fix", "est_saving_ms"):
            assert key in f
    # the one ranking (engine.rank): by severity, then by the time saved within a severity
    from fsdpdoctor.engine import SEVERITIES

    sev = [SEVERITIES.index(f.severity) for f in rep.findings]
    assert sev == sorted(sev)
    for level in set(sev):
        savings = [f.est_saving_ms for f in rep.findings if SEVERITIES.index(f.severity) == level and f.est_saving_ms is not None]
        assert savings == sorted(savings, reverse=True)


def test_thresholds_override_and_disable(recorded_run):
    rep = fsdpdoctor.analyze(recorded_run("per-linear"))
    cfg = defaults()
    assert any(f.slug == "auto-wrap-too-fine" for f in run_rules(rep.facts, cfg))
    cfg["fine_min_units"] = 1000
    assert not any(f.slug == "auto-wrap-too-fine" for f in run_rules(rep.facts, cfg))
    cfg = defaults() | {"disable": ["FSD003"]}
    assert not any(f.slug == "auto-wrap-too-fine" for f in run_rules(rep.facts, cfg))


def test_pyproject_settings_are_read(tmp_path):
    from fsdpdoctor.config import load_config
    from fsdpdoctor.errors import InputError

    p = tmp_path / "pyproject.toml"
    p.write_text("[tool.fsdpdoctor]\nmin_overlap_pct = 85\ndisable = ['step-time-jitter']\n[tool.fsdpdoctor.check]\nmax_step_regression_pct = 5\n")
    cfg = load_config(["jitter_cv_pct=20"], pyproject=p)
    assert cfg["min_overlap_pct"] == 85 and cfg["jitter_cv_pct"] == 20 and cfg["disable"] == ["step-time-jitter"]
    p.write_text("[tool.fsdpdoctor]\nmin_overlap = 85\n")
    with pytest.raises(InputError, match="unknown setting"):
        load_config(pyproject=p)


def test_explain_and_rules_commands():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "fsdpdoctor", "explain", "missing-backward-prefetch"], capture_output=True, text=True)
    assert out.returncode == 0 and "BACKWARD_PRE" in out.stdout and "prefetch_min_exposed_ms" in out.stdout
    out = subprocess.run([sys.executable, "-m", "fsdpdoctor", "rules"], capture_output=True, text=True)
    assert out.returncode == 0 and "FSD013" in out.stdout
    out = subprocess.run([sys.executable, "-m", "fsdpdoctor", "explain", "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "no such rule" in out.stderr


@pytest.mark.parametrize("fqns,want", [
    (["", "layers.0", "layers.1", "layers.2"], "layers"),
    (["", *(f"transformer.h.{i}" for i in range(6))], "transformer.h"),
    ([f"_fsdp_wrapped_module.model.layers.{i}._fsdp_wrapped_module" for i in range(3)], "model.layers"),
    ([f"layers.{i}._checkpoint_wrapped_module" for i in range(2)], "layers"),
    (["", "layers.0.attn.qkv", "layers.0.mlp.fc1", "layers.1.attn.qkv"], None),  # per-linear units
    (["", "layers.0", "layers.2"], None),  # not 0..n-1
    (["", "layers.0"], None),  # one block
    (["", "<unit 1>", "<unit 2>"], None),
])
def test_block_container_from_unit_fqns(fqns, want):
    from fsdpdoctor.facts import block_container

    assert block_container(fqns) == want


def test_fixes_name_the_models_own_blocks():
    """The GPT-2-named H200 recording keeps its blocks in model.transformer.h: the fix code says
    so instead of the templates' model.layers / TransformerBlock; a model whose blocks are
    model.layers keeps that and gets their class as type(model.layers[0])."""
    recorded = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
    rep = fsdpdoctor.analyze(recorded / "gpu-h200" / "gpt2-bf16")
    f = next(x for x in rep.findings if x.slug == "activation-memory-dominates")
    code = "\n".join(f.fix.values())
    assert "isinstance(m, type(model.transformer.h[0]))" in code
    assert "TransformerBlock" not in code and "model.layers" not in code
    rep = fsdpdoctor.analyze(recorded / "gpu" / "fsdp2")
    code = "\n".join(next(x for x in rep.findings if x.slug == "matmul-wrong-engine").fix.values())
    assert "for block in model.layers:" in code
