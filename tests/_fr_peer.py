"""Run PyTorch's own Flight Recorder analyzer (``python -m torch.distributed.flight_recorder.fr_trace``)
on a folder of dumps and read its verdict, for the tests that put it beside ours."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class PeerVerdict:
    rc: int
    seq: int | None = None  # the first sequence number it reports
    missing: list[int] = field(default_factory=list)  # "missing ranks: {2}"
    culprits: list[int] = field(default_factory=list)  # "Culprit rank N"
    error: str | None = None  # the last line when it failed

    def text(self) -> str:
        if self.error:
            return f"fails: {self.error}"
        parts = []
        if self.seq is not None:
            parts.append(f"#{self.seq}")
        if self.missing:
            parts.append(f"missing ranks {self.missing}")
        if self.culprits:
            parts.append(f"culprit ranks {self.culprits}")
        return ", ".join(parts) or "no verdict"


def run_fr_trace(dumps: Path, *args: str, timeout: float = 120) -> PeerVerdict:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + "\n" + proc.stderr
    v = PeerVerdict(proc.returncode)
    if m := re.search(r"sequence number: (\d+)", out):
        v.seq = int(m.group(1))
    if m := re.search(r"missing ranks: \{([\d, ]+)\}", out):
        v.missing = sorted(int(x) for x in m.group(1).split(","))
    v.culprits = sorted({int(x) for x in re.findall(r"Culprit rank (\d+)", out)})
    if proc.returncode != 0:
        lines = [ln for ln in out.splitlines() if ln.strip()]
        v.error = lines[-1].strip()[:200] if lines else f"exit {proc.returncode}"
    return v
