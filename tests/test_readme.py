"""The README as a newcomer meets it (issue 44): its example outputs are what the tool prints now.

``benchmarks/readme_examples.py`` runs every command the README's generated blocks show (the
30-second example, compare, check, memory, plan and a hang from the Flight Recorder generator)
and writes their output between the block's markers; this test regenerates them and compares.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _generator():
    name = "fsdpdoctor_readme_examples"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "readme_examples.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.slow
def test_readme_examples_are_what_the_tool_prints():
    gen = _generator()
    current = (REPO / "README.md").read_text()
    diff = gen.stale_diff(current, gen.generate(current))
    assert not diff, f"README.md's example output is stale; refresh it with `{gen.REFRESH}`:\n{diff[:6000]}"


def test_readme_shows_every_command_and_a_hang():
    gen = _generator()
    shown = [c.argv for ex in gen.EXAMPLES.values() for c in ex.commands]
    for command in ("analyze", "compare", "check", "memory", "plan"):
        assert any(a.startswith(f"fsdpdoctor {command} ") for a in shown), command
    # the hang: dumps written by the Flight Recorder generator, then analysed from that folder
    assert any(a.startswith("python -m fixtures.flight_recorder.gen ") for a in shown)
    assert f"fsdpdoctor analyze {gen.HANG_DIR}" in shown
    text = (REPO / "README.md").read_text()
    for name in gen.EXAMPLES:
        begin, end = gen.markers(name)
        assert text.count(begin) == 1 and text.count(end) == 1, name


def test_brief_findings_cuts_only_later_findings_bodies():
    gen = _generator()
    lines = [
        "panel",
        "critical[FSD024] oom: first",
        "  evidence:",
        "    • kept",
        "",
        "critical[FSD015] matmul-wrong-engine: second,",
        "wrapped headline",
        "  = saves 1 ms/step",
        "  evidence:",
        "    • cut",
        "",
        "info[FSD006] pageable-memcpy: third",
        "(saves < 0.01 ms/step)",
        "",
        "--details adds 1 table.",
    ]
    out = gen.brief_findings(lines)
    assert out == lines[:8] + ["  …", ""] + lines[11:]


def test_install_line_says_where_the_cpu_build_of_torch_comes_from():
    text = (REPO / "README.md").read_text()
    assert re.search(r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu", text)
    assert "CUDA build" in text
