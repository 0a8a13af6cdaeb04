"""Shared test fixtures.

Real inputs live in ``../shared`` beside the repository (never copied into it); tests that need
them skip cleanly when it is absent.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PUBLIC_TRACES = SHARED / "traces" / "public"
PUBLIC_SNAPSHOTS = SHARED / "snapshots" / "public"

if str(REPO) not in sys.path:  # lets tests import fixtures.* (recorders, generators)
    sys.path.insert(0, str(REPO))

pytest_plugins = ["_recording"]


def public_trace_files() -> list[Path]:
    if not PUBLIC_TRACES.is_dir():
        return []
    return sorted(PUBLIC_TRACES.glob("*/*.json.gz"))


@pytest.fixture
def shared_traces() -> Path:
    if not PUBLIC_TRACES.is_dir():
        pytest.skip("../shared/traces/public is absent")
    return PUBLIC_TRACES
