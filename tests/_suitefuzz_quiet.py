"""A folder for the fuzz suite's case files whose nearest ancestors hold nothing else.

``fsdpdoctor analyze FILE`` looks for a torchtitan dump folder in each of the five folders above
``FILE``, two levels deep (``analysis.framework._layout`` -> ``ingest.layouts.dump_folder``). Under
pytest those folders are ``/tmp/pytest-of-USER/pytest-N/...``, which hold every test's folders and
every recent session's (of every user of the machine sharing /tmp): on this machine ~0.5 s of
``stat`` and ``listdir`` per case, most of what a fuzz case cost (12.9 of 17.7 s of
``test_property_trace_field_replaced`` under cProfile). The cases check how one hostile field is
read, which does not depend on the folder; the layout detection still runs on every case, on
these empty folders (and the cases' own sibling files).
"""

from __future__ import annotations

from pathlib import Path

#: ``framework._layout`` walks ``list(p.parents)[:5]``
_LAYOUT_PARENTS = 5


def quiet_dir(base: Path, name: str) -> Path:
    """``base/name/q/q/q/q``, created: each of the four folders above it holds only the next one,
    so a file in a folder made in it (``gpu_cases(quiet_dir(..))`` writes to ``.../q/gpu/``) has
    five nearest folders that hold only its siblings and each other."""
    d = base / name
    for _ in range(_LAYOUT_PARENTS - 1):
        d = d / "q"
    d.mkdir(parents=True, exist_ok=True)
    return d
