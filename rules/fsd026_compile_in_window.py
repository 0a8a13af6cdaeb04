"""What it detects
    torch.compile's one-time work inside the profiled steps: compilation (dynamo's bytecode
    tracing, the AOT trace, inductor's lowering), CUDA-graph recording by cudagraph trees
    (``mode="reduce-overhead"``) and autotuning.

Why it matters
    Compiling takes seconds where a step takes milliseconds. A window that opens with a compiled
    model's first steps measures the compilation, not training: on the suite's CPU recording
    (``compiled-cold``, FSDP2 blocks compiled with ``aot_eager``) the first step takes 1.6 s and the
    next ones 52 ms, and without this rule step-time-jitter read the first step as a 520 ms stall
    to fix with ``gc.freeze()`` and DataLoader workers. A step that compiles after steps that did
    not is a recompilation, which recurs as long as its cause does.

How it shows in a trace
    CPU ranges named ``<phase> (dynamo_timed)`` (``_compile.compile_inner``,
    ``OutputGraph.call_user_compiler``, ``CUDAGraphNode.record``, …): torch 2.13 writes them as
    ``cpu_op``, earlier versions as ``user_annotation`` (``RunFacts.compile_window``,
    :mod:`fsdpdoctor.analysis.compile_window`). The leading steps that hold such work, with a step
    after them that holds none, are left out of the steady steps every figure is on, and this
    finding says which (info). Compile work in a steady step is a warning: a recompilation, or a
    window whose every step compiles (the public MI300X Flux trace of a CUDA-graph capture: 558.5
    ms of ``CUDAGraphNode.record`` in a 714.4 ms step, where host-bound would otherwise have offered
    CUDA graphs for the idle GPU). The suite's ``compiled-recompile`` recording runs shorter
    sequences in its second profiled step, whose blocks recompile in it (~1 s against ~55 ms).

Fix
    Profile after the compiled model's first calls: ``torch.profiler.schedule(wait=…, warmup=…)``
    (``fsdpdoctor.capture(wait=…)``) past the first steps, and past the first step of every new
    input shape. For a recompilation, find its cause with ``TORCH_LOGS="recompiles"``: a dimension
    that changes (``torch._dynamo.mark_dynamic``, or pad to a few fixed shapes), a Python value
    the code branches on, a module attribute that changes.

Known problems
    Only compile work that ``dynamo_timed`` annotates is seen: a profile without CPU activity
    (``ProfilerActivity.CPU``) shows none, and a torch too old to record these ranges neither.
    The saving of a recompilation is its compile time per step, as if it stopped; one that is
    not repeated (a last new shape) saves nothing after it. In a window whose every step
    compiles, nothing is left out: its figures are the compilation's, as the finding says.
"""

from fsdpdoctor.fmt import ms, plural

from ._util import finding, of_step

CODE = "FSD026"
SLUG = "compile-in-window"
TITLE = "torch.compile's one-time work inside the profiled steps"
SEVERITY = "info"
THRESHOLDS = ()
SAVES_ON = "step"  # compile work stalls the whole step, CPU side first
# compare: a run that started to compile (recompile) inside its steps: the CPU's forward / backward
# time it grew by, and the GPU's idle meanwhile; before the general findings (FSD001 is 10)
EXPLAINS = {
    "gpu": [("host_bound_idle", None), ("other_idle", None)],
    "cpu": [("cpu_forward", None), ("cpu_backward", None)],
}
CLAIM_PRIORITY = 5

FIX_WINDOW = """# profile after the compiled model's first calls (compilation, CUDA-graph recording, autotuning)
prof = torch.profiler.profile(schedule=torch.profiler.schedule(wait=2, warmup=1, active=3), ...)
# or: with fsdpdoctor.capture("traces/", model=model, wait=2, warmup=1, active=3) as cap:
"""
FIX_RECOMPILE = """# find what makes it recompile (a changing dimension, a Python value branched on):
#   TORCH_LOGS="recompiles" torchrun ...
torch._dynamo.mark_dynamic(batch["input_ids"], 1)   # a dimension that varies: one dynamic graph
# or pad inputs to a few fixed lengths
"""


def _phases(cw, n: int = 3) -> str:
    return "; ".join(f"{name} {ms(v)}" for name, v in list(cw.phases.items())[:n])


def check(facts, cfg):
    cw = facts.compile_window
    if cw is None:
        return []
    who = f"rank {cw.rank}" + (f" (compile work on {cw.ranks} ranks)" if cw.ranks > 1 else "")
    steady = cw.steady_compile_ms
    if not steady:
        steps = ", ".join(map(str, cw.warmup_steps))
        return [
            finding(
                __name__,
                f"Step{'s' if len(cw.warmup_steps) > 1 else ''} {steps} ran torch.compile's one-time work and "
                f"{'were' if len(cw.warmup_steps) > 1 else 'was'} left out: the figures are on the "
                f"{plural(cw.steady_steps, 'steady step')} after {'them' if len(cw.warmup_steps) > 1 else 'it'}.",
                evidence=[
                    f"{who}: step {steps} took {', '.join(f'{v:.1f}' for v in cw.warmup_ms)} ms, "
                    f"{ms(cw.warmup_compile_ms)} of it compile work ({_phases(cw)}); the steady steps "
                    f"{ms(cw.steady_step_ms)} on average"
                ],
                cause="the profiler's window opened with the compiled model's first calls",
                fix={"any": FIX_WINDOW},
                confidence=1.0,
            )
        ]
    per_step = sum(steady.values()) / max(cw.steady_steps, 1)
    every = len(steady) == cw.steady_steps and not cw.warmup_steps
    evidence = [
        f"{who}: compile work in {plural(len(steady), 'step')} of {cw.steady_steps} "
        f"({', '.join(f'step {k}: {v:.1f} ms' for k, v in steady.items())}) = {ms(per_step)} per step, "
        f"{of_step(facts, per_step)} ({_phases(cw)})"
    ]
    if cw.gpu_idle_ms_per_step:
        evidence.append(
            f"the GPU idle {ms(cw.gpu_idle_ms_per_step)} per step inside it (not counted as host-bound idle)"
        )
    if every:
        return [
            finding(
                __name__,
                "Every profiled step runs torch.compile's one-time work "
                f"({ms(per_step)} per step, {of_step(facts, per_step)}): the window holds no steady step, and its "
                "figures describe the compilation.",
                evidence=evidence,
                cause="the profiler's window holds only the compiled model's first calls (compilation, CUDA-graph "
                "recording)",
                fix={"any": FIX_WINDOW},
                confidence=0.9,
                severity="warning",
            )
        ]
    if cw.warmup_steps:
        evidence.append(
            f"step {', '.join(map(str, cw.warmup_steps))} (the first compile, {ms(cw.warmup_compile_ms)}) left out "
            "of the steady steps"
        )
    return [
        finding(
            __name__,
            f"torch.compile recompiles inside the steady steps: {ms(per_step)} per step ({of_step(facts, per_step)}).",
            evidence=evidence,
            cause="a recompilation: a guard of the compiled code failed (a new input shape, a Python value it "
            "branched on, a changed module attribute)",
            fix={"any": FIX_RECOMPILE},
            confidence=0.8,
            est_saving_ms=per_step,
            # the assumption: the window's recompilations recur at its rate; its span: none recur
            # (a last new shape), or as measured
            saving_span_ms=[0.0, per_step],
            saving_assumptions=f"the window's recompilations recur at its rate ({len(steady)} of "
            f"{cw.steady_steps} steps; assumed); none after a last new shape",
            severity="warning",
        )
    ]
