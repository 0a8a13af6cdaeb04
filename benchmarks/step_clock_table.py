"""Regenerate docs/step-clock.md: the step clock and the what-if replay on every real trace.

For each GPU recording in ``fixtures/recorded/gpu/`` and each public trace in
``../shared/traces/public/``: fsdpdoctor's step time (``steps.mean_ms``), the CPU span, what
limits the run, the warm-up backlog, the interval at which steps really finish read from the raw
trace by the test suite's independent reader (``tests/test_step_clock.py::raw_clock``, plain
``json``), and the unchanged replay's largest per-step error.

    python benchmarks/step_clock_table.py            # writes docs/step-clock.md
    python benchmarks/step_clock_table.py --print    # prints the table only
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import fsdpdoctor  # noqa: E402
from test_step_clock import GPU, raw_clock  # noqa: E402

PUBLIC = REPO.parent / "shared" / "traces" / "public"

PROSE = """# The step clock

A well-tuned training job is GPU-bound: nothing synchronizes per step, the CPU runs ahead until
CUDA's launch queue is full, and when the profiler's window opens the GPU is still running work
launched during the warm-up steps. fsdpdoctor measures such runs as follows.

- **Step time** (`steps.mean_ms`, `StepFacts.step_ms`, `RunFacts.step_clock_ms`): the interval
  at which steps complete. A step completes when its CPU `ProfilerStep#N` span has ended *and*
  the GPU work it launched (matched by correlation id) is done. Where the GPU runs behind, this
  is the GPU's step; where the CPU is slower, the CPU's. The first step starts at its CPU start
  or, when the GPU was still busy with the warm-up backlog, when that backlog finished. Every
  share "of the step", severity, saving cap, `compare`, `check` and the strategy advisor use it.
- **Backlog** (`timeline.backlog_ms`, `backlog_ops`): GPU work with no launch call in the trace
  (Kineto drops the runtime events of calls made before the window, and writes their GPU
  activity without `External id`, collective metadata or annotation). It is counted in no step,
  and a note says how much there was.
- **What limits the run** (`timeline.bound`): `gpu` when the GPU is busy with the step's own work
  for ≥ 90% of the step time, else `cpu` when the CPU span fills ≥ 90% of it, else `mixed`; the
  headline gives the GPU busy time and the CPU span beside it.
- **CPU span** (`timeline.cpu_step_ms`, `StepFacts.cpu_span_ms`): the `ProfilerStep` span itself.
- **host-bound** counts GPU idle only while the CPU is not blocked in a synchronization
  (`idle_cpu_blocked_ms` is idle during which both sides wait on something the trace does not
  show, such as another rank).

The what-if replay starts from the GPU's measured state at the window's start (the backlog
where it ran), replays every launched op in CPU launch order, never lets two ops overlap on one
stream or communicator, replays a launch call that waited for room in the queue as blocking on
the GPU work that freed it, infers a cross-stream edge where an op started just as work on
another stream ended, and keeps any other wait the trace cannot explain as measured.
`whatif.error_pct` is its largest per-step error; each finding's saving says whether it comes from
the replay (with that error) or from the rule's heuristic, and says so when the replay was set
aside for missing the measured steps by more than 5%.

## Accuracy on real traces

"Steps finish every" is read from the raw trace by an independent reader (the test suite's
`raw_clock`: plain `json`, none of fsdpdoctor's code). `tests/test_step_clock.py` asserts the
step time within 3% of it and the replay within 2% on every row.

"""


def rows() -> list[list[str]]:
    out = []
    paths = [(f"gpu/{p.name}", p, p / "rank0.json.gz") for p in sorted(GPU.iterdir()) if (p / "rank0.json.gz").is_file()]
    if PUBLIC.is_dir():
        paths += [(f"{p.parent.name}/{p.name}", p, p) for p in sorted(PUBLIC.glob("*/*.json.gz"))]
    for label, target, raw in paths:
        f = fsdpdoctor.analyze(target).facts
        truth = raw_clock(raw)
        finish = truth["finish_every_ms"] if truth else None
        t = f.timeline
        out.append([
            label,
            f.rank_facts[0].device_name or "–",
            f"{f.steps.mean_ms:.2f}" if f.steps.mean_ms else "–",
            f"{finish:.2f}" if finish else "– (no ProfilerStep)",
            f"{100 * (f.steps.mean_ms / finish - 1):+.1f}%" if finish and f.steps.mean_ms else "–",
            f"{t.cpu_step_ms:.2f}" if f.gpu_present else "–",
            t.bound or "–",
            f"{t.backlog_ms:.1f} ms ({t.backlog_ops:.0f})" if t.backlog_ops else "–",
            f"{f.whatif.error_pct:.2f}%" if f.whatif else "–",
        ])
    return out


def table() -> str:
    head = ["trace", "device", "step time (ms)", "steps finish every (ms, raw)", "Δ", "CPU span (ms)", "bound",
            "backlog", "replay error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the table instead of writing docs/step-clock.md")
    args = ap.parse_args()
    t = table()
    if args.print:
        print(t)
        return
    out = REPO / "docs" / "step-clock.md"
    out.parent.mkdir(exist_ok=True)
    stamp = f"\nRegenerated by `python benchmarks/step_clock_table.py` on {datetime.date.today().isoformat()}.\n"
    out.write_text(PROSE + t + stamp)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
