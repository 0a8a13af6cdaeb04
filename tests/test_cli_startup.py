"""Start-up of commands that analyse nothing: they must not load pandas or the analysis stack.

What is imported is asserted, not how long it takes (timing belongs in benchmarks/).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _imported(*args: str) -> set[str]:
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "fsdpdoctor", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [("rules",), ("explain", "FSD004"), ("--help",), ("analyze", "--help")])
def test_light_commands_do_not_load_pandas_or_the_analysis(args):
    mods = _imported(*args)
    assert "fsdpdoctor.cli" in mods  # the measurement saw the CLI load
    assert "pandas" not in mods
    assert not {
        m
        for m in mods
        if m.startswith("fsdpdoctor.analysis.ranks")
        or m.startswith(("fsdpdoctor.ingest.blocks", "fsdpdoctor.ingest.block_schema"))
    }


def test_dataframes_still_work():
    from pathlib import Path

    import fsdpdoctor

    rep = fsdpdoctor.analyze(Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "per-block")
    df = rep.steps_df()
    assert len(df) == sum(len(r.steps) for r in rep.facts.rank_facts) and "step_ms" in df.columns


def test_cli_reference_page_documents_every_command_and_flag():
    """The manual's CLI reference is generated from the click commands (docs/gen_pages.py renders
    fsdpdoctor.cli.reference): every visible command and flag is on it."""
    import click

    from fsdpdoctor.cli import main
    from fsdpdoctor.cli.reference import render

    page = render()
    ctx = click.Context(main)
    for name in main.list_commands(ctx):
        cmd = main.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        assert f"### `fsdpdoctor {name}`" in page
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                assert f"`{p.opts[0]}`" in page, (name, p.opts)
    gen = (Path(__file__).resolve().parents[1] / "docs" / "gen_pages.py").read_text()
    assert "cli_reference" in gen and "reference/cli.md" in gen


def test_every_option_has_help():
    import click

    from fsdpdoctor.cli import main

    ctx = click.Context(main)
    missing = [
        (n, p.opts)
        for n in main.list_commands(ctx)
        for p in main.get_command(ctx, n).params
        if isinstance(p, click.Option) and not p.help
    ]
    assert missing == []
