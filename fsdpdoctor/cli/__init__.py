"""Command line: a thin layer over :mod:`fsdpdoctor.api`.

Exit codes: 0 success; 1 reserved for failed gates (``check``); 2 bad input or usage.
Bad input is one line on stderr naming the file and the problem, never a traceback
(set ``FSDPDOCTOR_DEBUG=1`` to see one for an internal error).
"""

from __future__ import annotations

from pathlib import Path

import click

from fsdpdoctor.cli.base import (
    _write,
    guarded,
    input_limit_option,
    main,
    memory_budget_option,
    render_console,
    rule_config,
    scale_options,
    warn_partial,
)
from fsdpdoctor.errors import InputError
from fsdpdoctor.facts import AUTO_FULL_RANKS, RANK_DETAIL


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["terminal", "markdown", "json", "html", "perfetto"]),
    default="terminal",
    show_default=True,
    help="Report format (json: see 'fsdpdoctor schema'; perfetto: the ranks' traces merged with the findings "
    "drawn on them, for ui.perfetto.dev, needs -o FILE.json.gz; --rank-detail picks the ranks merged).",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the report to FILE.")
@click.option(
    "--timeline-rank",
    type=click.IntRange(0),
    default=None,
    metavar="N",
    help="HTML: rank whose step timeline is drawn (default: rank 0).",
)
@click.option(
    "--timeline-step",
    type=click.IntRange(0),
    default=None,
    metavar="K",
    help="HTML: step index (0-based, trace order) to draw (default: the median-length step).",
)
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(1, 256),
    default=None,
    help="Worker processes for several ranks (default: cores).",
)
@click.option("--memory", "memory", multiple=True, type=click.Path(path_type=Path), help="CUDA memory snapshot(s).")
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a rule threshold (see 'fsdpdoctor rules --thresholds').",
)
@click.option("--disable", multiple=True, metavar="RULE", help="Skip a rule (code or slug); repeatable.")
@click.option("--brief", is_flag=True, help="Terminal: one line per finding (CI logs).")
@click.option("--details", is_flag=True, help="Terminal: also print the detail tables and notes.")
@click.option(
    "--save-baseline",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the facts (with findings) for a later 'check --baseline'.",
)
@click.option(
    "--rank-detail",
    type=click.Choice(RANK_DETAIL),
    default="auto",
    show_default=True,
    help="JSON report and baseline: which ranks' per-step and per-collective detail to write (perfetto: which ranks' "
    "events to merge). auto: every rank in "
    f"runs of up to {AUTO_FULL_RANKS} ranks, else the ranks that matter (slowest, fastest, straggler, lowest overlap, worst "
    "replay, first); all: every rank (and every rank's collectives); none: none. Every rank has a summary line.",
)
@click.option(
    "--iteration",
    type=click.IntRange(0),
    default=None,
    metavar="N",
    help="A framework's dump folder (torchtitan): the iteration whose traces and snapshots to read (default: the latest).",
)
@input_limit_option
@scale_options
@guarded
def analyze(
    paths: tuple[str, ...],
    fmt: str,
    output: Path | None,
    jobs: int | None,
    memory: tuple[Path, ...],
    settings: tuple[str, ...],
    disable: tuple[str, ...],
    save_baseline: Path | None,
    timeline_rank: int | None,
    timeline_step: int | None,
    scheduler: str | None,
    strict: bool,
    cycle: int | None,
    allow_mixed_runs: bool,
    brief: bool = False,
    details: bool = False,
    rank_detail: str = "auto",
    iteration: int | None = None,
) -> None:
    """Analyse trace files, directories of rank traces, or globs: local paths or URLs
    (s3://, gs://, az://, http(s)://, file://).

    A rank file that cannot be read is left out with a warning and named in the report
    (--strict: fail on it instead). PyTorch Flight Recorder dumps of a hung job (one per rank,
    found by content, also in a torchtitan comm_trace(s)/ folder) are read alongside or alone:
    the report then opens with the hang (which rank, which collective); a dump that cannot be
    read stops the analysis.
    """
    from fsdpdoctor.api import analyze as run
    from fsdpdoctor.progress import load_progress

    cfg = rule_config(settings, disable)
    if fmt == "perfetto":
        from fsdpdoctor.report.perfetto import check_output

        if output is None:
            raise InputError("--format perfetto", "needs -o FILE (e.g. -o trace.json.gz)")
        check_output(output, paths)
    tl_step = (timeline_rank, timeline_step) if fmt == "html" else None
    with load_progress() as progress:
        report = run(
            list(paths),
            memory=list(memory) or None,
            jobs=jobs,
            config=cfg,
            timeline_step=tl_step,
            progress=progress,
            scheduler=scheduler,
            strict=strict,
            cycle=cycle,
            allow_mixed_runs=allow_mixed_runs,
            rank_detail=rank_detail,
            iteration=iteration,
            spans=fmt == "perfetto",
        )
    warn_partial(report.facts)
    if save_baseline is not None:
        _write(report.to_json_bytes(), save_baseline)
    _emit(report, fmt, output, brief=brief, details=details)


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["terminal", "markdown", "json"]),
    default="terminal",
    show_default=True,
    help="Report format.",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the report to FILE.")
@click.option(
    "--iteration",
    type=click.IntRange(0),
    default=None,
    metavar="N",
    help="A framework's dump folder (torchtitan): the iteration whose snapshots to read (default: the latest).",
)
@input_limit_option
@memory_budget_option
@guarded
def memory(paths: tuple[str, ...], fmt: str, output: Path | None, iteration: int | None = None) -> None:
    """Analyse CUDA memory snapshots (or profiler memory timelines) alone: files, folders of
    them, or a framework's dump folder (torchtitan's memory_snapshot/iteration_<N>)."""
    from fsdpdoctor.api import analyze_memory_only

    _emit(analyze_memory_only(list(paths), config=rule_config(), iteration=iteration), fmt, output, details=True)


def _emit(report, fmt: str, output: Path | None, *, brief: bool = False, details: bool = False) -> None:
    """Write ``report`` in ``fmt`` to ``output`` (stdout when None)."""
    if fmt == "perfetto":
        from fsdpdoctor.report.perfetto import write as write_perfetto

        got = write_perfetto(report, output)
        click.echo(
            f"fsdpdoctor: wrote {output}: {got['ranks']} ranks, {len(got['merged'])} with their trace's events, "
            f"{got['events']} events, {got['bytes']} bytes",
            err=True,
        )
    elif fmt == "html":
        from fsdpdoctor.report.html import render as render_html

        _write(render_html(report), output)
    elif fmt == "json":
        _write(report.to_json_bytes(), output)
    elif fmt == "markdown":
        _write(report.to_markdown(), output)
    else:
        from fsdpdoctor.report.terminal import render

        render_console(lambda con: render(report, con, brief=brief, details=details), output)


@main.command("rules")
@click.option("--thresholds", is_flag=True, help="List the thresholds and their current values instead.")
@guarded
def rules_cmd(thresholds: bool) -> None:
    """List the rules (or their thresholds)."""
    from fsdpdoctor.config import THRESHOLDS, load_config
    from fsdpdoctor.engine import load_rules

    if thresholds:
        cfg = load_config()
        for key, (default, doc) in THRESHOLDS.items():
            mark = "" if cfg[key] == default else f" (default {default:g})"
            click.echo(f"{key:<30} {cfg[key]:<8g}{mark}  {doc}")
        return
    for rule in load_rules():
        click.echo(f"{rule.code}  {rule.slug:<34} {rule.severity:<8} {rule.title}")


@main.command("schema")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the schema to FILE.")
@guarded
def schema_cmd(output: Path | None) -> None:
    """Print the JSON Schema of 'analyze --format json' reports and baselines."""
    import json

    from fsdpdoctor.schema import report_schema

    _write(json.dumps(report_schema(), indent=2), output)


@main.command()
@click.argument("rule")
@guarded
def explain(rule: str) -> None:
    """Print a rule's documentation (by code or slug)."""
    from fsdpdoctor.engine import find_rule

    meta = find_rule(rule)
    if meta is None:
        raise InputError(rule, "no such rule (see 'fsdpdoctor rules')")
    from fsdpdoctor.config import THRESHOLDS, load_config

    click.echo(f"{meta.code} {meta.slug}: {meta.title}\n")
    click.echo(meta.doc)
    keys = meta.thresholds
    if keys:
        cfg = load_config()
        click.echo("\nThresholds (override with --set KEY=VALUE or [tool.fsdpdoctor]):")
        for k in keys:
            click.echo(f"  {k} = {cfg[k]:g}  — {THRESHOLDS[k][1]}")


# Commands that live in their own modules register themselves on ``main`` when imported.
from fsdpdoctor.cli import compare as _compare, plan as _plan  # noqa: E402,F401

if __name__ == "__main__":  # pragma: no cover
    main()
