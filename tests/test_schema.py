"""The JSON contract: one document, each fact once, valid against the published JSON Schema.

(Every report the suite produces is also validated as it is made: conftest sets
FSDPDOCTOR_CHECK_SCHEMA=1, see fsdpdoctor.api._checked.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

import fsdpdoctor
from fsdpdoctor.facts import SCHEMA_VERSION, RunFacts
from fsdpdoctor.schema import report_schema, validate

REPO = Path(__file__).resolve().parents[1]
PER_BLOCK = REPO / "fixtures" / "recorded" / "per-block"
DDP = REPO / "fixtures" / "recorded" / "ddp"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fsdpdoctor", *map(str, args)], capture_output=True, text=True)


def test_schema_command_prints_the_schema():
    r = _cli("schema")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(json.dumps(report_schema()))
    jsonschema.Draft202012Validator.check_schema(report_schema())


def test_cli_json_is_one_document_valid_against_the_schema():
    r = _cli("analyze", PER_BLOCK, "--format", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    validate(doc)
    assert doc["schema_version"] == SCHEMA_VERSION == 6
    assert "facts" not in doc  # no second copy
    # each summary once: the per-rank facts are under rank_facts only
    assert doc["fsdp"]["unit_count"] == len(doc["fsdp"]["units"])
    assert [r["rank"] for r in doc["rank_facts"]] == doc["ranks"]


def test_schema_is_closed_a_stray_key_is_refused():
    doc = json.loads(fsdpdoctor.analyze(PER_BLOCK).to_json())
    doc["fsdp"]["made_up"] = 1
    with pytest.raises(jsonschema.ValidationError, match="made_up"):
        validate(doc)
    doc = json.loads(fsdpdoctor.analyze(PER_BLOCK).to_json())
    doc["steps"]["count"] = "3"
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


def test_the_compiled_validator_agrees_with_jsonschema():
    """validate() trusts jsonschema_rs when it accepts a document: it must refuse what jsonschema
    refuses (a stray key, a wrong type, a missing field) and accept what jsonschema accepts."""
    from fsdpdoctor.schema import _fast_validator, _validator

    fast, ref = _fast_validator(), _validator()
    assert fast is not None, "jsonschema_rs is in the test extra"
    good = json.loads(fsdpdoctor.analyze(PER_BLOCK).to_json())
    assert fast.is_valid(good) and ref.is_valid(good)
    bad = []
    for patch in (
        lambda d: d["fsdp"].__setitem__("made_up", 1),
        lambda d: d["steps"].__setitem__("count", "3"),
        lambda d: d["steps"].__setitem__("count", 2.5),
        lambda d: d["steps"].pop("count"),
        lambda d: d.__setitem__("schema_version", 1),
        lambda d: d["rank_facts"][0].__setitem__("rank", None),
    ):
        d = json.loads(json.dumps(good))
        patch(d)
        bad.append(d)
    assert [fast.is_valid(d) for d in bad] == [ref.is_valid(d) for d in bad] == [False] * len(bad)


def test_report_round_trips_as_a_baseline(tmp_path):
    rep = fsdpdoctor.analyze(PER_BLOCK)
    p = tmp_path / "baseline.json"
    p.write_text(rep.to_json())
    back = RunFacts.load(p)
    assert back.to_dict() == rep.facts.to_dict(rep.rank_detail)


def test_version_1_reports_still_load(tmp_path):
    """A version-1 report (summaries at the top level, all facts again under 'facts') loads as a baseline."""
    rep = fsdpdoctor.analyze(PER_BLOCK)
    facts = rep.facts.to_dict()
    facts["schema_version"] = 1
    v1 = {"schema_version": 1, "tool": facts["tool"], "fsdp": facts["fsdp"], "steps": facts["steps"], "facts": facts}
    p = tmp_path / "v1.json"
    p.write_text(json.dumps(v1))
    back = RunFacts.load(p)
    assert back.steps.mean_ms == rep.facts.steps.mean_ms and back.fsdp.unit_count == rep.facts.fsdp.unit_count


def test_version_5_reports_with_other_parallelism_still_load(tmp_path):
    """Version 5 wrote ``fsdp.other_parallelism`` beside ``parallelism.run_kind``; 6 keeps the kind
    only (one classifier). A version-5 baseline still loads, its kind intact."""
    rep = fsdpdoctor.analyze(DDP)
    doc = json.loads(rep.to_json())
    doc["schema_version"] = 5
    doc["fsdp"]["other_parallelism"] = "DDP (DistributedDataParallel labels)"
    for r in doc["rank_facts"]:
        r["fsdp"]["other_parallelism"] = "DDP (DistributedDataParallel labels)"
    p = tmp_path / "v5.json"
    p.write_text(json.dumps(doc))
    back = RunFacts.load(p)
    assert back.parallelism.run_kind == "ddp" and back.parallelism.ddp
    assert not hasattr(back.fsdp, "other_parallelism")
    doc["schema_version"] = 6
    with pytest.raises(jsonschema.ValidationError, match="other_parallelism"):
        validate(doc)  # the key is not in schema 6


def test_docs_key_table_matches_the_schema():
    section = (REPO / "docs" / "json-report.md").read_text()  # the manual's page on the report's keys
    keys = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)
    root = report_schema()["$defs"]["ReportDocument"]["properties"]
    assert keys == list(root)
