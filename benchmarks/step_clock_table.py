"""Regenerate docs/step-clock.md: the step clock and the what-if replay on every real trace.

For each GPU recording in ``fixtures/recorded/gpu/`` and each public trace in
``../shared/traces/public/``: fsdpdoctor's step time (``steps.mean_ms``), the CPU span, what
limits the run, the warm-up backlog, the CPU step rate and the GPU completion interval read from
the raw trace by the test suite's independent reader (``tests/test_step_clock.py::raw_clock``,
plain ``json``), and the unchanged replay's fidelity.

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

- **Step time** (`steps.mean_ms`, `StepFacts.step_ms`, `RunFacts.step_clock_ms`): the steady rate
  of the slower side over the profiled window. Two clocks run side by side: the CPU's (its
  `ProfilerStep#N` spans end to end) and the completions' (a step completes when its CPU span
  has ended *and* the GPU work it launched, matched by correlation id, is done). Over a short
  window either can look faster than the run really is: the CPU runs ahead into the launch queue,
  or the GPU drains a backlog faster than the CPU refills it. Steady throughput is bounded by the
  slower of the two, so the step time is the larger of the CPU step rate (mean span) and the
  completion interval over steps 2..n (the first step's interval would start at a completion
  before the window; it counts at the rate of the others). Each step's time is the slower clock's
  interval, so their mean is the step time. Every share "of the step", severity, saving cap,
  `compare`, `check` and the strategy advisor use it.
- **Backlog** (`timeline.backlog_ms`, `backlog_ops`): GPU work with no launch call in the trace
  (Kineto drops the runtime events of calls made before the window, and writes their GPU
  activity without `External id`, collective metadata or annotation). It is counted in no step,
  and a note says how much there was.
- **What limits the run** (`timeline.bound`): `gpu` when the GPU is busy with the step's own work
  for ≥ 90% of the step time, else `cpu` when the CPU span fills ≥ 90% of it, else `mixed`; the
  headline gives the GPU busy time and the CPU span beside it. The busy time (`timeline.gpu_busy_ms`)
  counts each GPU instant once: time a step's own work shares with an earlier step's (its
  collectives beside their compute) is the earlier step's, so the steps' busy times add up to the
  GPU's (the HTA DDP V100 rank: 115.47 ms per step of a 124.11 ms step; the sum of each step's own
  union said 122.29 ms). (A CPU whose spans are the slower
  clock only because it blocks on a full launch queue is still waiting for the GPU: `gpu`.)
- **CPU span** (`timeline.cpu_step_ms`, `StepFacts.cpu_span_ms`): the `ProfilerStep` span itself.
- **host-bound** counts GPU idle only while the CPU is not blocked in a synchronization
  (`idle_cpu_blocked_ms` is idle during which both sides wait on something the trace does not
  show, such as another rank).

The what-if replay starts from the GPU's measured state at the window's start (the backlog
where it ran), replays every launched op in CPU launch order, never lets two ops overlap on one
stream or communicator, replays a launch call that waited for room in the queue as blocking on
the GPU work that freed it, infers a cross-stream edge where an op started just as work on
another stream ended, and keeps any other wait the trace cannot explain as measured. It counts
its replayed steps with the same clock. `whatif.error_pct` is its *fidelity*: how closely the
unchanged replay reproduces the measured run (the larger of its error on the step time and its
largest per-step error on the completion clock). That is not the error of a saving: a graph
built from a trace reproduces that trace almost by construction. A saving's range comes from
real twins ([Saving ranges](savings.md)).

## Accuracy on real traces

The CPU rate and the GPU completion interval are read from the raw trace by an independent reader
(the test suite's `raw_clock`: plain `json`, none of fsdpdoctor's code; the GPU interval from the
end of each step's own GPU work). `tests/test_step_clock.py` asserts the step time within 3% of
the larger of the two, and the replay's fidelity within 2% (2.5% on the send/recv trace, whose CPU
blocks in copies that wait on other ranks) on every row.

"""


def rows() -> list[list[str]]:
    out = []
    paths = [
        (f"{d.name}/{p.name}", p, p / "rank0.json.gz")
        for d in (GPU, GPU.with_name("gpu-h200"))
        for p in sorted(d.iterdir())
        if (p / "rank0.json.gz").is_file()
    ]
    if PUBLIC.is_dir():
        paths += [(f"{p.parent.name}/{p.name}", p, p) for p in sorted(PUBLIC.glob("*/*.json.gz"))]
    for label, target, raw in paths:
        f = fsdpdoctor.analyze(target).facts
        truth = raw_clock(raw)
        want = truth["step_ms"] if truth else None
        t = f.timeline
        gpu = truth["gpu_rate_ms"] if truth else None
        out.append(
            [
                label,
                f.rank_facts[0].device_name or "–",
                f"{f.steps.mean_ms:.2f}" if f.steps.mean_ms else "–",
                f"{truth['cpu_span_ms']:.2f}" if truth else "– (no ProfilerStep)",
                f"{gpu:.2f}" if gpu else "–",
                f"{100 * (f.steps.mean_ms / want - 1):+.1f}%" if want and f.steps.mean_ms else "–",
                t.bound or "–",
                f"{t.backlog_ms:.1f} ms ({t.backlog_ops:.0f})" if t.backlog_ops else "–",
                f"{f.whatif.error_pct:.2f}%" if f.whatif else "–",
            ]
        )
    return out


def table() -> str:
    head = [
        "trace",
        "device",
        "step time (ms)",
        "CPU step rate (ms, raw)",
        "GPU completion interval (ms, raw)",
        "Δ to the larger",
        "bound",
        "backlog",
        "replay fidelity",
    ]
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
