"""The manual (issue 24): a MkDocs site built with --strict, a page per rule generated from the
rule modules, the README short enough to read first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpdoctor.engine import load_rules

REPO = Path(__file__).resolve().parents[1]


def test_readme_is_short_and_has_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 240  # with the generated example outputs (issue 44)
    assert "pip install -e '.[test]'" in text and re.search(r"^pytest( +#.*)?$", text, re.M)
    ci = (REPO / ".ci" / "run").read_text()
    # CI runs the README's `pytest` as it stands (only timed: `pytest || ...`), no arguments added
    assert "pip install -e '.[test]'" in ci
    assert re.search(r"^pytest(\n| \|\| )", ci, re.M), "CI must run the README's bare `pytest`"
    # the manual is built once, by test_site_builds_strict_with_a_page_per_rule below (a second
    # `mkdocs build` in CI cost 19 s and checked nothing more)
    assert not re.search(r"^[^#]*mkdocs build", ci, re.M)


@pytest.mark.slow
def test_site_builds_strict_with_a_page_per_rule(tmp_path):
    """CI's build of the manual (.ci/run builds it only here): MkDocs, Material and mkdocs-gen-files
    are in the test extra, so a missing one fails rather than skips."""
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1", **__import__("os").environ},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for rule in load_rules():
        page = site / "rules" / f"{rule.code.lower()}-{rule.slug}" / "index.html"
        assert page.exists(), rule.code
        html = page.read_text()
        assert rule.title.split()[0] in html and "What it detects" in html and "Fix" in html
    # the example on the OOM rule's page comes from the real recording and names the outside memory
    oom = (site / "rules" / "fsd024-oom" / "index.html").read_text()
    assert "fixtures/recorded/gpu/oom" in oom and "outside PyTorch" in oom
    assert (site / "reference" / "cli" / "index.html").exists()
    assert (site / "reference" / "schema" / "index.html").exists()
    # moved from the README: the accuracy and the benchmark tables
    assert "Accuracy against ground truth" in (site / "memory" / "index.html").read_text()
    assert (site / "performance" / "index.html").exists()
