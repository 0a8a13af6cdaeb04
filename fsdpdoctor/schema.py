"""The JSON contract of ``fsdpdoctor analyze --format json`` (and of ``--save-baseline`` files).

One document, each fact once: every :class:`~fsdpdoctor.facts.RunFacts` field at the top level,
``fsdp.unit_count`` (derived, for convenience) and the rule ``findings``. The JSON Schema is built
from the same dataclasses the analysis fills, so it cannot drift from what is written;
``fsdpdoctor schema`` prints it. Objects are closed (``additionalProperties: false``): a key that
is not in the schema is a contract change, made by adding a field to the dataclass.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fsdpdoctor.engine import Finding
from fsdpdoctor.facts import SCHEMA_VERSION, RunFacts

SCHEMA_ID = f"urn:fsdpdoctor:report:v{SCHEMA_VERSION}"


@dataclass
class ReportDocument(RunFacts):
    """An fsdpdoctor report: the facts of a run and the findings the rules drew from them."""

    findings: list[Finding] = field(default_factory=list)


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a report document."""
    schema = msgspec.json.schema(ReportDocument)
    defs = schema["$defs"]
    fsdp = defs["FsdpFacts"]
    for d in defs.values():
        if d.get("type") == "object" and "properties" in d:
            d["additionalProperties"] = False
            # every field is always written (msgspec writes defaults too): all are required
            d["required"] = sorted(d["properties"])
    # the run's fsdp block also says how many units (derived; not repeated per rank)
    fsdp["properties"]["unit_count"] = {
        "type": "integer",
        "minimum": 0,
        "description": "len(units); top-level fsdp only",
    }
    root = defs["ReportDocument"]
    root["properties"]["schema_version"] = {"const": SCHEMA_VERSION}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "fsdpdoctor report",
        "description": (ReportDocument.__doc__ or "").strip(),
        **{k: v for k, v in schema.items() if k != "$defs"},
        "$defs": defs,
    }


@functools.lru_cache(maxsize=1)
def _validator():
    # jsonschema imports its optional format checkers with the package, and rfc3987_syntax (there
    # wherever jsonschema[format-nongpl] is) compiles a Lark grammar at import: over 1 s of CPU in
    # every process that validates (each CLI run under the test suite). Draft202012Validator checks
    # no format without a format_checker, so that module is kept out while jsonschema loads, and
    # only then (a later `import rfc3987_syntax` works as usual).
    blocked = "rfc3987_syntax" not in sys.modules
    if blocked:
        sys.modules["rfc3987_syntax"] = None  # an ImportError to jsonschema, which skips it
    try:
        import jsonschema  # the test extra installs it; only validate() needs it
    finally:
        if blocked and sys.modules.get("rfc3987_syntax", 0) is None:
            del sys.modules["rfc3987_syntax"]
    return jsonschema.Draft202012Validator(report_schema())


@functools.lru_cache(maxsize=1)
def _fast_validator():
    """The same schema under ``jsonschema_rs`` (compiled; the test extra installs it), or None.
    Under the test suite every report is validated (``FSDPDOCTOR_CHECK_SCHEMA=1``): the pure-Python
    validator took about a quarter of each analysis's CPU there."""
    try:
        import jsonschema_rs
    except ImportError:
        return None
    return jsonschema_rs.Draft202012Validator(report_schema())


def validate(document: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` when ``document`` (decoded JSON) breaks the contract.

    A document the compiled validator accepts is valid; any other is checked again by
    ``jsonschema``, which raises the error (its message and path are the ones users see)."""
    fast = _fast_validator()
    if fast is not None:
        try:
            if fast.is_valid(document):
                return
        except (ValueError, TypeError, OverflowError):  # a value it cannot take: the reference decides
            pass
    _validator().validate(document)
