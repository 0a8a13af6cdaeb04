"""Large, realistic Kineto traces for benchmarks: a real trace scaled up by repeating its steps.

The source is a real PyTorch profiler trace (by default the public A100 NCCL all-reduce trace in
``../shared/traces/public/``). Its event array is repeated as often as needed to reach the target
size; each repetition shifts timestamps by a fixed span, shifts every id that links or numbers events
(``External id``, ``correlation``, flow ``id``, ``Record function id``, ``Ev Idx``) by the span of
that id in the source (``correlation`` and flow ``id`` together: a flow's id is its correlation),
so that links stay within their repetition and the profiler's op numbers run on without gaps, as
in one long recording, and renumbers ``ProfilerStep#N``. Metadata events (thread names,
``ph == "M"``/``"i"``) and the profiler span appear once. Kineto's own text formatting (one event
over a few lines, ``},\\n  {`` between events) is kept byte for byte, so the files look to a
parser exactly like what the profiler writes.

Used by ``bench_ingest.py``; also runnable on its own::

    python benchmarks/gen_traces.py OUT_DIR --size-mb 200 --ranks 2 [--gz]
"""

from __future__ import annotations

import argparse
import gzip
import re
from dataclasses import dataclass
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
DEFAULT_SOURCE = SHARED / "traces" / "public" / "hta-nccl-allreduce-a100-2ranks" / "rank-0.json.gz"

_EVENT_SPLIT = re.compile(r"(?<=\n  \}),(?=\n  \{)")
_TS = re.compile(r'("ts": )(\d+)')
_IDS = re.compile(r'"(External id|correlation|id|Record function id|Ev Idx)": (\d+)')
# fields shifted together: a flow event's ``id`` is the correlation id of the launch it links
_ID_GROUP = {"External id": "External id", "correlation": "correlation", "id": "correlation"}
_STEP = re.compile(r"(ProfilerStep#)(\d+)")
_RANK = re.compile(r'("rank": )\d+')

SPAN_US = 1_000_000  # timestamp shift per repetition (the source spans < 1 s)


@dataclass
class Template:
    head: str  # up to and including the event array's "["
    repeated: str  # the events repeated per step block, joined by ","
    once: str  # metadata events, written once after the repetitions ("" when none)
    tail: str  # from the array's closing "]" to the end
    steps: int  # ProfilerStep annotations per repetition
    id_spans: dict[str, int]  # per id group: max - min + 1 over the repeated events, the shift per repetition


def load_template(source: Path = DEFAULT_SOURCE) -> Template:
    opener = gzip.open if source.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(source, "rb") as fh:
        text = fh.read().decode()
    start = text.index('"traceEvents": [') + len('"traceEvents": [')
    end = text.rindex("\n  ]")
    events = _EVENT_SPLIT.split(text[start:end])
    if len(events) < 100:
        raise SystemExit(f"{source}: expected Kineto's multi-line formatting (`}},\\n  {{` between events)")
    once_marks = ('"ph": "M"', '"ph": "i"', '"pid": "Spans"', '"pid": "Traces"')
    repeated = [e for e in events if not any(m in e for m in once_marks)]
    once = [e for e in events if any(m in e for m in once_marks)]
    joined = ",".join(repeated)
    steps = len({m.group(2) for m in _STEP.finditer(joined)})
    lo: dict[str, int] = {}
    hi: dict[str, int] = {}
    for m in _IDS.finditer(joined):
        g, v = _ID_GROUP.get(m.group(1), m.group(1)), int(m.group(2))
        lo[g] = min(lo.get(g, v), v)
        hi[g] = max(hi.get(g, v), v)
    spans = {g: hi[g] - lo[g] + 1 for g in lo}
    return Template(text[:start], joined, ",".join(once), text[end:], max(steps, 1), spans)


def _shift(text: str, k: int, steps: int, id_spans: dict[str, int]) -> str:
    if k == 0:
        return text
    dt, ds = k * SPAN_US, k * steps
    di = {
        f: k * id_spans[_ID_GROUP.get(f, f)]
        for f in ("External id", "correlation", "id", "Record function id", "Ev Idx")
        if _ID_GROUP.get(f, f) in id_spans
    }
    text = _TS.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + dt}", text)
    text = _IDS.sub(lambda m: f'"{m.group(1)}": {int(m.group(2)) + di[m.group(1)]}', text)
    return _STEP.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + ds}", text)


def write_trace(path: Path, size_bytes: int, rank: int = 0, gz: bool = False, tpl: Template | None = None) -> int:
    """Write a trace of about ``size_bytes`` uncompressed bytes; returns the uncompressed size."""
    tpl = tpl or load_template()
    head = _RANK.sub(lambda m: f"{m.group(1)}{rank}", tpl.head, count=1)
    reps = max(1, round((size_bytes - len(head) - len(tpl.tail) - len(tpl.once)) / (len(tpl.repeated) + 1)))
    if gz:
        try:
            from isal import igzip

            fh = igzip.open(path, "wb", compresslevel=2)
        except ImportError:  # pragma: no cover
            fh = gzip.open(path, "wb", compresslevel=1)
    else:
        fh = open(path, "wb")
    total = 0
    with fh:
        for piece in _pieces(head, tpl, reps):
            b = piece.encode()
            fh.write(b)
            total += len(b)
    return total


def _pieces(head: str, tpl: Template, reps: int):
    yield head
    for k in range(reps):
        yield ("," if k else "") + _shift(tpl.repeated, k, tpl.steps, tpl.id_spans)
    if tpl.once:
        yield "," + tpl.once
    yield tpl.tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--size-mb", type=float, default=200)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--gz", action="store_true")
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    a = ap.parse_args()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    tpl = load_template(a.source)
    for r in range(a.ranks):
        p = a.out_dir / f"rank-{r}.json{'.gz' if a.gz else ''}"
        n = write_trace(p, int(a.size_mb * 1e6), rank=r, gz=a.gz, tpl=tpl)
        print(f"{p}: {n / 1e6:.0f} MB uncompressed, {p.stat().st_size / 1e6:.0f} MB on disk")


if __name__ == "__main__":
    main()
