"""A progress bar for long trace loads: rich, on stderr, only on a terminal, only after a second.

Usage (what ``fsdpdoctor analyze`` does)::

    from fsdpdoctor.progress import load_progress

    with load_progress() as progress:
        report = fsdpdoctor.analyze(paths, progress=progress)

``progress(done, total)`` takes bytes of the input files read so far and in all; it is cheap to
call often. ``progress.ranks(done, total)`` (called by the fan-out as each rank finishes) adds
"k/n ranks" to the bar. Nothing is drawn when stderr is not a TTY (pipes, CI logs, ``2>file``) or when the
load finishes within ``delay`` seconds; the bar is removed when the block ends, so the report that
follows starts on a clean line. No thread is started (the bar is redrawn from the callback, at
most ten times a second), so worker processes can be forked while it is shown.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

Callback = Callable[[int, int], None]


def _noop(done: int, total: int) -> None:
    pass


class _Bar:
    def __init__(self, description: str, stream: IO[str], delay: float):
        self.description = description
        self.stream = stream
        self.delay = delay
        self.t0 = time.monotonic()
        self.last_draw = 0.0
        self.progress = None
        self.task = None
        self.rank_text = description

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.progress is None:
            if now - self.t0 < self.delay:
                return
            self._start(total)
        assert self.progress is not None
        self.progress.update(self.task, completed=min(done, total) if total else done, total=total or None)
        if now - self.last_draw >= 0.1 or (total and done >= total):
            self.last_draw = now
            self.progress.refresh()

    def ranks(self, done: int, total: int) -> None:
        """Ranks finished so far, shown beside the bytes (called as each rank completes)."""
        self.rank_text = f"{self.description} · {done}/{total} ranks"
        if self.progress is not None:
            self.progress.update(self.task, description=self.rank_text)
            self.progress.refresh()

    def _start(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        console = Console(file=self.stream, stderr=self.stream is sys.stderr)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            auto_refresh=False,  # no refresh thread: redrawn from the callback
        )
        self.progress.start()
        self.task = self.progress.add_task(self.rank_text, total=total or None)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


@contextmanager
def load_progress(
    description: str = "reading traces",
    *,
    stream: IO[str] | None = None,
    delay: float = 1.0,
    enabled: bool | None = None,
) -> Iterator[Callback]:
    """Yield a ``progress(done, total)`` callback that draws a bar on ``stream`` (stderr).

    ``enabled`` forces the bar on or off; by default it is on when the stream is a terminal.
    """
    stream = stream if stream is not None else sys.stderr
    if enabled is None:
        try:
            enabled = stream.isatty()
        except (AttributeError, ValueError):
            enabled = False
    if not enabled:
        yield _noop
        return
    bar = _Bar(description, stream, delay)
    try:
        yield bar
    finally:
        bar.close()
