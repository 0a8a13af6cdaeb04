"""Rule contract and rule cases.

Each rule module ``rules/fsdNNN_*.py`` has its cases as data in ``rules/cases/<module>.toml``, one
named table each (``[case.NAME]``, typed by :class:`RuleCase`, with a ``why``):
inputs that must make it fire and inputs on which it must stay silent.
"""

from __future__ import annotations

import re
from typing import Any, Literal
import sys
from pathlib import Path

import msgspec
import pytest

from _suitegen_cache import committed_report
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
SECTIONS = ("What it detects", "Why it", "How it shows in a trace", "Fix", "Known problems")


def test_every_rule_honours_the_contract():
    rules = load_rules()
    assert len(rules) >= 19
    codes = [r.code for r in rules]
    slugs = [r.slug for r in rules]
    assert len(set(codes)) == len(codes) and len(set(slugs)) == len(slugs)
    for r in rules:
        assert re.fullmatch(r"FSD\d{3}", r.code)
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", r.slug)
        assert r.severity in ("critical", "warning", "info")
        for sec in SECTIONS:
            assert sec in r.doc, f"{r.code} docstring lacks '{sec}'"
        for key in r.thresholds:
            assert key in THRESHOLDS, f"{r.code} names unknown threshold {key}"
        assert find_rule(r.slug) == r and find_rule(r.code.lower()) == r
        case_file = CASE_DIR / (Path(r.path).stem + ".toml")
        assert case_file.exists(), f"{r.code} has no cases file {case_file.name}"


class RuleCase(msgspec.Struct, forbid_unknown_fields=True):
    """One case of a rule, a named table ``[case.NAME]`` in ``rules/cases/<rule module>.toml``
    (sqlfluff's rule-case YAML, as typed TOML): what it is an example of (``why``), the input,
    whether the rule fires, and what the finding must (not) say. A misspelt key is an error."""

    why: str
    source: Literal[
        "recorded",
        "gpu-recorded",
        "scenario",
        "snapshot",
        "public",
        "public-snapshot",
        "facts",
        "fr-recorded",
        "fr-generated",
    ]
    input: str
    expect: Literal["fires", "silent"]
    min_saving_ms: float | None = None
    summary_contains: str | None = None
    fix_lacks: list[str] = []
    patch: dict[str, Any] | None = None
    set: dict[str, Any] | None = None


def load_cases(path: Path) -> dict[str, RuleCase]:
    data = tomllib.loads(path.read_text())
    assert set(data) <= {"case"}, f"{path.name}: only [case.NAME] tables"
    cases = msgspec.convert(data.get("case", {}), dict[str, RuleCase])
    for name, c in cases.items():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name), f"{path.name}: case name {name!r}"
        assert c.why.strip(), f"{path.name}: case {name} says not why"
    return cases


def test_every_rule_has_a_firing_and_a_silent_case():
    for r in load_rules():
        cases = load_cases(CASE_DIR / (Path(r.path).stem + ".toml"))
        expects = {c.expect for c in cases.values()}
        assert "fires" in expects, f"{r.code} {r.slug} has no case on which it fires"
        assert "silent" in expects, f"{r.code} {r.slug} has no case on which it stays silent"


def test_what_each_finding_explains_names_real_parts_of_the_step():
    """compare reads EXPLAINS / EXPLAINS_IF_CHANGED from the rule modules: the parts must exist."""
    from fsdpdoctor.analysis.compare import CPU_COMPONENTS, GPU_COMPONENTS, PHASES

    parts = {"gpu": set(GPU_COMPONENTS), "cpu": set(CPU_COMPONENTS)}
    for m in load_rules():
        tables = [m.explains] + list(m.explains_if_changed.values())
        for t in tables:
            for basis, claims in t.items():
                if basis == "note":
                    continue
                for comp, phase in claims:
                    assert comp in parts[basis], f"{m.code}: {comp} is not a {basis} part"
                    assert phase is None or phase in PHASES, f"{m.code}: unknown phase {phase}"


def _cases():
    out = []
    for f in sorted(CASE_DIR.glob("*.toml")):
        for name, case in load_cases(f).items():
            out.append(pytest.param(f.stem, case, id=f"{f.stem}[{name}]"))
    return out


def _slug_of(module_stem: str) -> str:
    return next(r.slug for r in load_rules() if Path(r.path).stem == module_stem)


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
        if isinstance(value, dict) and not isinstance(getattr(obj, last), dict):  # a facts dataclass, as a table
            import typing

            value = msgspec.convert(value, typing.get_type_hints(type(obj), vars(fsdpdoctor.facts))[last])
        setattr(obj, last, value)
    return fsdpdoctor.Report(facts=facts, findings=run_rules(facts, defaults()))


@pytest.fixture(scope="module")
def analyzed(recorded_report, hang_recording, tmp_path_factory, public_report, analyzed_run):
    cache: dict[tuple[str, str], list] = {}

    def get(source: str, name: str, patch: dict | None = None, knobs: dict | None = None):
        if source == "facts":
            return [_patched_report(r, patch or {}) for r in get("recorded", name)]
        key = (source, name, tuple(sorted((knobs or {}).items())))
        if key not in cache:
            if source == "recorded":  # (_recording.recorded_report: once per process, shared with other modules)
                cache[key] = [recorded_report(name)]
            elif source == "gpu-recorded":  # the committed GPU recordings, snapshots beside them: a bare name is
                # one of the H100 set (fixtures/recorded/gpu), "gpu-h200/NAME" one of the H200 set
                recorded = Path(__file__).resolve().parents[1] / "fixtures" / "recorded"
                # (_suitegen_cache.committed_report: fsdpdoctor.analyze, once per process, shared)
                cache[key] = [committed_report(recorded / name if "/" in name else recorded / "gpu" / name)]
            elif source == "public":  # every public trace ("*"), or one of them by its path there
                files = public_trace_files()
                if not files:
                    pytest.skip("../shared/traces/public is absent")
                if name != "*":
                    files = [f for f in files if f.as_posix().endswith("/" + name)]
                    assert files, f"no public trace {name}"
                cache[key] = [public_report(f) for f in files]  # (conftest: once per process)
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

                # (_presets.analyzed_run: the same default analysis, once per session, shared)
                cache[key] = [analyzed_run(dataclasses.replace(gen.PRESETS[name], **(knobs or {})))[0]]
            else:
                raise ValueError(source)
        return cache[key]

    return get


@pytest.mark.parametrize("module_stem,case", _cases())
def test_rule_case(module_stem, case, analyzed):
    slug = _slug_of(module_stem)
    for rep in analyzed(case.source, case.input, case.patch, case.set):
        fired = [f for f in rep.findings if f.slug == slug]
        if case.expect == "fires":
            assert fired, (
                f"{slug} did not fire on {case.source}:{case.input} ({case.why}); findings: {[f.slug for f in rep.findings]}"
            )
            f = fired[0]
            assert f.summary and f.evidence and f.fix
            if case.min_saving_ms is not None:
                assert f.est_saving_ms is not None and f.est_saving_ms >= case.min_saving_ms
            if case.summary_contains is not None:
                assert case.summary_contains in f.summary, f.summary
            for text in case.fix_lacks:
                assert all(text not in code for code in f.fix.values()), (text, f.fix)
        else:
            assert not fired, f"{slug} fired on {case.source}:{case.input} ({case.why}): {fired[0].summary}"


def test_nothing_fsdp_specific_fires_on_public_traces(public_report):
    files = public_trace_files()
    if not files:
        pytest.skip("../shared/traces/public is absent")
    fsdp_specific = {r.slug for r in load_rules()} - {
        "fsdp-not-detected",
        "low-overlap",
        "host-bound",
        "straggler-rank",
        "step-time-jitter",
        "pageable-memcpy",
        "activation-recompute",  # the MI300 DDP run checkpoints for real
        # the waterfall's levers hold for any training run
        "non-matmul-kernels",
        "sync-in-step",
        "matmul-shapes-below-peak",
        # fp32 GEMMs on CUDA cores, by kernel name where there are no shapes (the V100 traces)
        "matmul-wrong-engine",
        # any training or inference loop: the DataLoader, Megatron's tensor parallelism
        "dataloader-bound",
        "tensor-parallel-on-critical-path",
        # torch.compile's one-time work in any run's window (the MI300X Flux capture)
        "compile-in-window",
    }
    for f in files:
        rep = public_report(f)
        slugs = {x.slug for x in rep.findings}
        assert "fsdp-not-detected" in slugs, f
        assert not slugs & fsdp_specific, (f, slugs & fsdp_specific)


def test_findings_json_shape_and_ranking(recorded_report):
    rep = recorded_report("per-linear")  # fsdpdoctor.analyze of the recording, shared: read only
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
        savings = [
            f.est_saving_ms
            for f in rep.findings
            if SEVERITIES.index(f.severity) == level and f.est_saving_ms is not None
        ]
        assert savings == sorted(savings, reverse=True)


def test_thresholds_override_and_disable(recorded_report):
    rep = recorded_report("per-linear")  # shared: the rules below run on its facts, never change them
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
    p.write_text(
        "[tool.fsdpdoctor]\nmin_overlap_pct = 85\ndisable = ['step-time-jitter']\n[tool.fsdpdoctor.check]\nmax_step_regression_pct = 5\n"
    )
    cfg = load_config(["jitter_cv_pct=20"], pyproject=p)
    assert cfg["min_overlap_pct"] == 85 and cfg["jitter_cv_pct"] == 20 and cfg["disable"] == ["step-time-jitter"]
    p.write_text("[tool.fsdpdoctor]\nmin_overlap = 85\n")
    with pytest.raises(InputError, match="unknown setting"):
        load_config(pyproject=p)


def test_explain_and_rules_commands():
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "fsdpdoctor", "explain", "missing-backward-prefetch"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "BACKWARD_PRE" in out.stdout and "prefetch_min_exposed_ms" in out.stdout
    out = subprocess.run([sys.executable, "-m", "fsdpdoctor", "rules"], capture_output=True, text=True)
    assert out.returncode == 0 and "FSD013" in out.stdout
    out = subprocess.run([sys.executable, "-m", "fsdpdoctor", "explain", "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "no such rule" in out.stderr


@pytest.mark.parametrize(
    "fqns,want",
    [
        (["", "layers.0", "layers.1", "layers.2"], "layers"),
        (["", *(f"transformer.h.{i}" for i in range(6))], "transformer.h"),
        ([f"_fsdp_wrapped_module.model.layers.{i}._fsdp_wrapped_module" for i in range(3)], "model.layers"),
        ([f"layers.{i}._checkpoint_wrapped_module" for i in range(2)], "layers"),
        (["", "layers.0.attn.qkv", "layers.0.mlp.fc1", "layers.1.attn.qkv"], None),  # per-linear units
        (["", "layers.0", "layers.2"], None),  # not 0..n-1
        (["", "layers.0"], None),  # one block
        (["", "<unit 1>", "<unit 2>"], None),
    ],
)
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


def test_rule_metadata_is_declared_once_and_checked():
    """load_rules reads each rule's metadata into one frozen RuleMeta with its defaults; a
    misspelt name or a value of the wrong kind is an error, not a silently ignored default."""
    import dataclasses
    import types

    from fsdpdoctor.rulemeta import RuleError, RuleMeta, rule_meta

    r = find_rule("cpu-offload-stall")
    assert isinstance(r, RuleMeta) and r.saves_on == "step" and r.replay_fix == "offload_off"
    assert find_rule("host-bound").saves_on == "gpu" and find_rule("host-bound").memory_advice is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.severity = "info"

    def module(**names):
        m = types.ModuleType("acme_rule", "What it detects\n    x\n")
        m.check = lambda facts, cfg: []
        for k, v in dict(CODE="FSD900", SLUG="acme", **names).items():
            setattr(m, k, v)
        return m

    assert rule_meta(module()).severity == "warning" and rule_meta(module()).claim_priority == 1000
    for bad, why in (
        (dict(SAVE_ON="step"), "did you mean SAVES_ON"),
        (dict(SEVERITY="high"), "SEVERITY"),
        (dict(SAVES_ON="cpu"), "SAVES_ON"),
        (dict(THRESHOLDS="min_overlap_pct"), "THRESHOLDS"),
        (dict(MEMORY_ADVICE=1), "MEMORY_ADVICE"),
    ):
        with pytest.raises(RuleError, match=why):
            rule_meta(module(**bad))
    m = module()
    m.check = lambda facts: []
    with pytest.raises(RuleError, match="check"):
        rule_meta(m)
    assert rule_meta(module(FIX_FSDP2="...", KIND_WORDS={})).slug == "acme"  # a rule's own constants are its own
