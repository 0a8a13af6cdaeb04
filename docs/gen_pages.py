"""Generated pages of the documentation site (run by the mkdocs-gen-files plugin at build time).

Nothing here is copied by hand: a page per rule from the rule modules (their docstring, metadata
and thresholds) with an example finding from a real recording in ``fixtures/recorded``, the CLI
reference from the click commands, and the JSON Schema reference from ``fsdpdoctor schema``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mkdocs_gen_files

from fsdpdoctor.cli.reference import render as cli_reference
from fsdpdoctor.config import THRESHOLDS, defaults
from fsdpdoctor.engine import load_rules
from fsdpdoctor.report.sections import fix_language, saving_text
from fsdpdoctor.schema import report_schema

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "fixtures" / "recorded"
SHARED = REPO.parent / "shared"  # the public traces and snapshots, when checked out beside the repo


def rule_page_name(rule) -> str:
    return f"rules/{rule.code.lower()}-{rule.slug}.md"


def examples() -> dict[str, tuple[str, object, object]]:
    """The first finding of each rule on the committed real recordings: slug → (recording, finding, facts)."""
    import fsdpdoctor

    out: dict[str, tuple[str, object, object]] = {}
    dirs = sorted(p for p in RECORDED.glob("*") if p.is_dir() and p.name != "gpu")
    dirs += sorted(p for p in (RECORDED / "gpu").glob("*") if p.is_dir())
    dirs += sorted(p for p in (SHARED / "traces" / "public").glob("*") if p.is_dir())
    runs = [("analyze", d) for d in dirs]
    runs += [("memory", p) for p in sorted((SHARED / "snapshots" / "public").rglob("*.pickle"))]
    for how, d in runs:
        try:
            rep = fsdpdoctor.analyze(d, jobs=1) if how == "analyze" else fsdpdoctor.api.analyze_memory_only(d)
        except Exception:  # an input that cannot be read gives no example; the build goes on
            continue
        name = str(d.relative_to(REPO)) if d.is_relative_to(REPO) else "../shared/" + str(d.relative_to(SHARED))
        for f in rep.findings:
            out.setdefault(f.slug, (f"{how} {name}", f, rep.facts))
    return out


def sections(doc: str) -> list[tuple[str, str]]:
    """The rule docstring's *What it detects / Why it hurts / How it shows in a trace / Fix* parts."""
    out: list[tuple[str, list[str]]] = []
    for line in doc.strip().splitlines():
        if (
            line
            and not line.startswith(" ")
            and line.strip()
            in (
                "What it detects",
                "Why it hurts",
                "How it shows in a trace",
                "Fix",
                "Fix (FSDP1)",
                "Fix (FSDP2)",
                "Saving",
                "Known problems",
            )
            or (line and not line.startswith(" ") and not out)
        ):
            out.append((line.strip(), []))
        else:
            out[-1][1].append(line[4:] if line.startswith("    ") else line)
    return [(h, "\n".join(body).strip()) for h, body in out]


def rule_page(rule, example) -> str:
    lines = [
        f"# {rule.code} `{rule.slug}`",
        "",
        f"**{rule.title}** · default severity `{rule.severity}` · `fsdpdoctor explain {rule.slug}`",
        "",
    ]
    for head, body in sections(rule.doc):
        lines += [f"## {head}", "", body, ""]
    keys = rule.thresholds
    if keys:
        cfg = defaults()
        lines += ["## Thresholds", "", "| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{k}` | {cfg[k]:g} | {THRESHOLDS[k][1]} |" for k in keys]
        lines += ["", "Override with `--set KEY=VALUE` or `[tool.fsdpdoctor]` in `pyproject.toml`.", ""]
    lines += ["## Example from a real recording", ""]
    if example is None:
        lines += [
            "None of the real recordings (`fixtures/recorded`, `../shared/traces/public`) makes this "
            "rule fire; its firing and silent cases are in "
            f"`rules/cases/{Path(rule.path).stem}.toml`.",
            "",
        ]
    else:
        where, f, facts = example
        lines += [f"`fsdpdoctor {where}`:", "", f"> **{f.severity}** {f.summary}", ""]
        s = saving_text(f, facts)
        if s:
            lines += [f"*{s}*", ""]
        if f.evidence:
            lines += ["Evidence:", ""] + [f"- {e}" for e in f.evidence] + [""]
        if f.cause:
            lines += [f"Likely cause: {f.cause}", ""]
        for flavour, code in f.fix.items():
            lines += [f"Fix ({flavour}):", "", f"```{fix_language(code)}", code.rstrip(), "```", ""]
    return "\n".join(lines)


def main() -> None:
    rules = load_rules()
    ex = examples()
    index = [
        "# Rules",
        "",
        "One page per rule, generated from the rule modules in `rules/`. "
        "`fsdpdoctor rules` lists them; `fsdpdoctor explain CODE` prints a page's text.",
        "",
        "| code | rule | title | default severity |",
        "|---|---|---|---|",
    ]
    for rule in rules:
        name = rule_page_name(rule)
        index.append(f"| {rule.code} | [`{rule.slug}`]({Path(name).name}) | {rule.title} | {rule.severity} |")
        with mkdocs_gen_files.open(name, "w") as fh:
            fh.write(rule_page(rule, ex.get(rule.slug)))
        mkdocs_gen_files.set_edit_path(name, Path(rule.path).relative_to(REPO).as_posix())
    with mkdocs_gen_files.open("rules/index.md", "w") as fh:
        fh.write("\n".join(index) + "\n")
    with mkdocs_gen_files.open("reference/cli.md", "w") as fh:
        fh.write(
            "# CLI reference\n\nGenerated from the click commands (`fsdpdoctor COMMAND --help` prints the same).\n\n"
            + "\n".join(ln for ln in cli_reference().splitlines() if not ln.startswith("<!--"))
            + "\n"
        )
    schema = report_schema()
    root = schema.get("$defs", {}).get("ReportDocument", {}).get("properties", {})

    def kind(v: dict) -> str:
        if "$ref" in v:
            return "`" + v["$ref"].rsplit("/", 1)[-1] + "`"
        if "anyOf" in v:
            return " or ".join(kind(x) for x in v["anyOf"])
        if "const" in v:
            return f"`{json.dumps(v['const'])}`"
        t = v.get("type", "any")
        if t == "array" and isinstance(v.get("items"), dict):
            return f"array of {kind(v['items'])}"
        return str(t)

    rows = [f"| `{k}` | {kind(v)} |" for k, v in root.items()]
    with mkdocs_gen_files.open("reference/schema.md", "w") as fh:
        fh.write(
            "# JSON Schema reference\n\nGenerated from `fsdpdoctor schema` (the schema "
            "`analyze --format json` reports and baselines are validated against).\n\n"
            "## Top-level keys\n\nWhat each key means: [the JSON report](../json-report.md).\n\n| key | type |\n|---|---|\n"
            + "\n".join(rows)
            + "\n\n## The schema\n\n```json\n"
            + json.dumps(schema, indent=2)
            + "\n```\n"
        )


main()
