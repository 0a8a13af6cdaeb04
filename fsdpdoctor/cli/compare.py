"""``fsdpdoctor compare`` and ``fsdpdoctor check``; registered on the ``main`` group on import.

Both take anything ``analyze`` accepts (trace files, directories, globs) or a saved facts/report
JSON (``analyze --save-baseline FILE``). Exit codes: 0 success / all gates passed, 1 a gate
failed (``check``), 2 bad input or usage.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from fsdpdoctor.cli.base import (
    _write,
    guarded,
    input_limit_option,
    main,
    render_console,
    rule_config,
    scale_options,
    warn_partial,
)

_FORMATS = click.Choice(["terminal", "markdown", "json", "html"])


@main.command()
@click.argument("before")
@click.argument("after")
@click.option("--format", "fmt", type=_FORMATS, default="terminal", show_default=True, help="Comparison format.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the comparison to FILE.")
@click.option("-j", "--jobs", type=click.IntRange(1, 256), default=None, help="Worker processes for several ranks.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="Override a rule threshold.")
@click.option("--disable", multiple=True, metavar="RULE", help="Skip a rule (code or slug); repeatable.")
@input_limit_option
@scale_options
@guarded
def compare(
    before: str,
    after: str,
    fmt: str,
    output: Path | None,
    jobs: int | None,
    settings: tuple[str, ...],
    disable: tuple[str, ...],
    scheduler: str | None,
    strict: bool,
    cycle: int | None,
    allow_mixed_runs: bool,
) -> None:
    """Explain the step-time change from BEFORE to AFTER.

    BEFORE and AFTER are trace files, directories of rank traces, globs, or facts JSON saved
    with 'analyze --save-baseline'. The delta is split into compute, exposed all-gather,
    exposed reduce-scatter, other exposed comm, memcpy, host-bound idle and other idle (CPU
    phases for CPU-only traces), and the causes are ranked.
    """
    from fsdpdoctor.analysis.compare import compare as run_compare
    from fsdpdoctor.api import load_run
    from fsdpdoctor.report.comparison import render_markdown, to_json

    cfg = rule_config(settings, disable)
    scale = dict(scheduler=scheduler, strict=strict, cycle=cycle, allow_mixed_runs=allow_mixed_runs)
    b = load_run(before, cfg, jobs, **scale)
    a = load_run(after, cfg, jobs, **scale)
    warn_partial(b.facts)
    warn_partial(a.facts)
    cmp = run_compare(b.facts, a.facts, b.findings, a.findings, before_label=before, after_label=after)
    if fmt == "json":
        _write(to_json(cmp), output)
    elif fmt == "markdown":
        _write(render_markdown(cmp), output)
    elif fmt == "html":
        from fsdpdoctor.report.html import render_comparison

        _write(render_comparison(cmp), output)
    else:
        from fsdpdoctor.report.comparison import render_terminal

        render_console(lambda con: render_terminal(cmp, con), output, width=120)


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "--baseline",
    "baseline",
    metavar="FILE",
    help="Facts JSON from 'analyze --save-baseline' (or traces) to compare against.",
)
@click.option("--min-overlap", metavar="PCT", help="Fail when overlap is below PCT % (absolute gate).")
@click.option(
    "--max-exposed-comm-ms", metavar="MS", help="Fail when exposed communication per step exceeds MS (absolute gate)."
)
@click.option(
    "--max-step-regression-pct",
    metavar="PCT",
    help="Fail when step time rose more than PCT % over the baseline (default 5; 'off').",
)
@click.option(
    "--max-overlap-drop-pts", metavar="PTS", help="Fail when overlap dropped more than PTS points (default 5; 'off')."
)
@click.option(
    "--max-exposed-comm-regression-pct",
    metavar="PCT",
    help="Fail when exposed comm rose more than PCT % (default 10; 'off').",
)
@click.option(
    "--max-memory-regression-pct", metavar="PCT", help="Fail when peak memory rose more than PCT % (default 5; 'off')."
)
@click.option(
    "--min-mfu", metavar="PCT", help="Fail when MFU is below PCT % (absolute gate; traces with recorded shapes)."
)
@click.option(
    "--max-mfu-drop-pct",
    metavar="PCT",
    help="Fail when MFU fell more than PCT % below the baseline's (default 5; 'off').",
)
@click.option(
    "--fail-on-new",
    type=click.Choice(["critical", "warning", "never"]),
    default=None,
    help="Fail on new findings of this severity or worse (default critical).",
)
@click.option(
    "--markdown",
    "markdown_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write a Markdown summary (PR comment) to FILE.",
)
@click.option(
    "--junit",
    "junit_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write JUnit XML (one test case per gate) to FILE.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["terminal", "json"]),
    default="terminal",
    show_default=True,
    help="Verdict format on stdout.",
)
@click.option("-j", "--jobs", type=click.IntRange(1, 256), default=None, help="Worker processes for several ranks.")
@click.option(
    "--memory", "memory", multiple=True, type=click.Path(path_type=Path), help="CUDA memory snapshot(s) of this run."
)
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="Override a rule threshold.")
@click.option("--disable", multiple=True, metavar="RULE", help="Skip a rule (code or slug); repeatable.")
@input_limit_option
@click.option(
    "--allow-missing-ranks",
    is_flag=True,
    help="Pass although ranks were left out (unreadable files, gaps in the rank ids).",
)
@scale_options
@guarded
def check(
    paths: tuple[str, ...],
    baseline: str | None,
    min_overlap: str | None,
    max_exposed_comm_ms: str | None,
    max_step_regression_pct: str | None,
    max_overlap_drop_pts: str | None,
    max_exposed_comm_regression_pct: str | None,
    max_memory_regression_pct: str | None,
    min_mfu: str | None,
    max_mfu_drop_pct: str | None,
    fail_on_new: str | None,
    markdown_out: Path | None,
    junit_out: Path | None,
    fmt: str,
    jobs: int | None,
    memory: tuple[Path, ...],
    settings: tuple[str, ...],
    disable: tuple[str, ...],
    allow_missing_ranks: bool,
    scheduler: str | None,
    strict: bool,
    cycle: int | None,
    allow_mixed_runs: bool,
) -> None:
    """Gate a run for CI: exit 1 when a threshold is crossed, 0 when all gates pass.

    Thresholds come from the command line, else [tool.fsdpdoctor.check] in pyproject.toml,
    else the defaults. Without --baseline only the absolute gates (--min-overlap,
    --max-exposed-comm-ms) and the findings gate apply.
    """
    from fsdpdoctor.check import load_check_config, run_check
    from fsdpdoctor.api import load_run

    settings_ = load_check_config(
        {
            "min_overlap": min_overlap,
            "max_exposed_comm_ms": max_exposed_comm_ms,
            "max_step_regression_pct": max_step_regression_pct,
            "max_overlap_drop_pts": max_overlap_drop_pts,
            "max_exposed_comm_regression_pct": max_exposed_comm_regression_pct,
            "max_memory_regression_pct": max_memory_regression_pct,
            "min_mfu": min_mfu,
            "max_mfu_drop_pct": max_mfu_drop_pct,
            "fail_on_new": fail_on_new,
        }
    )
    cfg = rule_config(settings, disable)
    scale = dict(scheduler=scheduler, strict=strict, cycle=cycle, allow_mixed_runs=allow_mixed_runs)
    base = load_run(baseline, cfg, jobs, **scale) if baseline else None
    cur = load_run(list(paths), cfg, jobs, memory=list(memory) or None, **scale)
    warn_partial(cur.facts)
    result = run_check(cur, base, settings_, allow_missing_ranks=allow_missing_ranks)
    if markdown_out is not None:
        _write(result.to_markdown(), markdown_out)
    if junit_out is not None:
        _write(result.to_junit(), junit_out)
    if fmt == "json":
        _write(result.to_json(), None)
    else:
        result.render_terminal(Console(highlight=False))
    raise SystemExit(result.exit_code)
