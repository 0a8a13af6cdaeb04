"""What it detects
    Step times that vary a lot within a rank.

Why it hurts
    Variable steps usually mean something intermittent: data loading hiccups, garbage
    collection, checkpointing, recompilation, or a noisy neighbour. The mean step is slower than
    the typical one.

How it shows in a trace
    ``ProfilerStep#N`` durations with a high coefficient of variation.

Fix
    Look at the slowest step's CPU timeline; common fixes are more DataLoader workers,
    ``gc.freeze()`` after start-up, and asynchronous checkpointing.

Known problems
    It needs ``jitter_min_steps`` steps on a rank: profiles of two steps, as in all but three of
    the committed recordings, are not judged (the CPU no-backward-prefetch recording's steps of
    52.6 and 69.0 ms, 13.5%, draw nothing). Only the rank with the largest variation is reported,
    and its saving (mean minus median step) assumes the slow steps are avoidable; a stall that
    recurs every N steps (a checkpoint) shows only when it falls inside the profiled window.
    Steps that run torch.compile's one-time work are not judged here: the leading ones are left
    out of the steady steps, and where a steady step compiles, compile-in-window (FSD026) reports
    it instead (a seconds-long compile would swamp any other variation).
"""

import statistics

from fsdpdoctor.fmt import ms, pct

from ._idiom import idiom_parts
from ._util import finding, fix_for

CODE = "FSD013"
SLUG = "step-time-jitter"
TITLE = "Step time varies between steps"
SEVERITY = "info"
THRESHOLDS = ("jitter_cv_pct", "jitter_min_steps")
SAVES_ON = "step"  # a stall of the whole step, CPU side included


FIX_GC = """import gc
gc.freeze()   # after model and optimizer are built: no full collections over them
"""
FIX_LOADER = "loader = DataLoader(ds, num_workers=8, pin_memory=True, persistent_workers=True)\n"
FIX = FIX_GC + FIX_LOADER

FIX_INFERENCE = """import gc
gc.freeze()   # after the model is loaded: no full collections over it
"""


def check(facts, cfg):
    cw = facts.compile_window
    if cw is not None and cw.steady_compile_ms:
        return []  # steps that recompile: compile-in-window says which and what they cost
    worst = None
    for rank, times in facts.step_times().items():
        if len(times) < cfg["jitter_min_steps"]:
            continue
        mean = statistics.fmean(times)
        cv = 100 * statistics.pstdev(times) / mean if mean else 0.0
        if worst is None or cv > worst[1]:
            worst = (rank, cv, times)
    if worst is None or worst[1] < cfg["jitter_cv_pct"]:
        return []
    rank, cv, times = worst
    med = statistics.median(times)
    mean = statistics.fmean(times)
    est = max(mean - med, 0.0)
    # the assumption: the stall-free step is the median. Its span: only the one slowest step's
    # stall removed (the low end), every step as fast as the fastest (the high end)
    low = min(max((max(times) - med) / len(times), 0.0), est)
    high = max(mean - min(times), est)
    return [
        finding(
            __name__,
            f"Step time varies by {pct(cv)} (coefficient of variation) on rank {rank}.",
            evidence=[
                f"rank {rank}: steps {', '.join(f'{t:.1f}' for t in times)} ms; median {ms(med)}, max {ms(max(times))}"
            ],
            cause="an intermittent stall: data loading, garbage collection, checkpointing or recompilation",
            # the loader's workers as the run's framework sets them; gc.freeze() is the user's code anywhere
            fix=idiom_parts(
                facts,
                [(None, FIX_GC), ("dataloader", FIX_LOADER)],
                fix_for(facts, training=FIX, inference=FIX_INFERENCE),
            ),
            confidence=0.5,
            est_saving_ms=est,
            saving_span_ms=[low, high],
            saving_assumptions=(
                f"the step without its stalls is the median ({ms(med)}; assumed), the fastest step "
                f"({ms(min(times))}: {ms(high)} saved) or all but the slowest step's stall left ({ms(low)} saved)"
            ),
            where={"rank": rank},
        )
    ]
