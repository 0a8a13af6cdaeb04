"""Markdown: reads like a support ticket and pastes into an issue or PR."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdpdoctor.report.sections import Table, all_tables, fix_language, headline, saving_text

if TYPE_CHECKING:
    from fsdpdoctor.api import Report


def table(t: Table, level: str = "###") -> str:
    """The one Markdown table renderer (analyze, compare and check reports use it).

    Cells are escaped (``|`` and line breaks would break the row); a table without a title gets no
    heading, one without rows shows only its note.
    """

    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\r", " ").replace("\n", " ")

    out = [f"{level} {t.title}", ""] if t.title else []
    if t.rows:
        out += ["| " + " | ".join(esc(h) for h in t.headers) + " |", "|" + "---|" * len(t.headers)]
        out += ["| " + " | ".join(esc(c) for c in row) + " |" for row in t.rows]
    if t.note:
        out += ([""] if out and out[-1] else []) + [f"_{t.note}_"]
    return "\n".join(out)


def render(report: "Report") -> str:
    f = report.facts
    lines = ["# fsdpdoctor report", ""]
    lines += [f"- **{k}:** {v}" for k, v in headline(f)]
    lines.append("")
    lines.append("## Findings")
    lines.append("")
    if not report.findings:
        lines.append("No findings.")
    for i, fd in enumerate(report.findings, 1):
        saving = saving_text(fd, f)
        saving = f" — {saving}" if saving else ""
        lines.append(f"### {i}. [{fd.severity}] {fd.code} `{fd.slug}`{saving}")
        lines.append("")
        lines.append(fd.summary)
        if fd.evidence:
            lines.append("")
            lines.append("**Evidence**")
            lines += [f"- {e}" for e in fd.evidence]
        if fd.cause:
            lines += ["", f"**Likely cause:** {fd.cause}"]
        for flavour, code in fd.fix.items():
            lines += ["", f"**Fix ({flavour}):**", "", f"```{fix_language(code)}", code.rstrip(), "```"]
        lines.append("")
    lines.append("## Details")
    lines.append("")
    for t in all_tables(f):
        lines.append(table(t))
        lines.append("")
    if f.notes:
        lines.append("## Notes")
        lines.append("")
        lines += [f"- {n}" for n in f.notes]
        lines.append("")
    return "\n".join(lines)
