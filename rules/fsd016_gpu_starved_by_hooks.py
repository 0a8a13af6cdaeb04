"""What it detects
    The GPU waiting for FSDP's own Python: the hooks that run before a unit's forward and backward
    (FSDP2 ``FSDP::pre_forward`` / ``pre_backward`` / ``post_backward``, FSDP1's
    ``_pre_forward`` / ``_pre_backward_hook`` …) take longer on the CPU than the GPU work of the
    unit before them, so the GPU runs dry until the hook has launched the next work.

Why it hurts
    Every millisecond the GPU waits is lost whatever the kernels' efficiency; FSDP2's hooks cost
    about a millisecond of Python per call per unit whatever the unit's size, so the smaller the
    GPU work per unit (small models, micro-batches, fast bf16 kernels), the larger the share.

How it shows in a trace
    The waterfall's GPU idle part is material, and much of it falls while the thread that
    launches the GPU's next work is inside an outermost FSDP hook range: per unit and hook, its
    CPU time per call and the GPU's wait beside it (``efficiency.hooks``).

Fix
    ``torch.compile`` the blocks (less Python and fewer, fused kernels between hooks), fewer and
    larger units (two blocks per ``fully_shard`` halves the hooks), a larger micro-batch where
    memory allows (more GPU work per hook), CUDA graphs where shapes are static.

Saving
    The what-if replay of the fix a user can apply: two blocks per unit, half the hooks (each
    hook's CPU time between its launches cut to half; 50-75% kept as the span of the assumption
    that a merged unit's hooks cost what one unit's did). The ceiling ("at most") is the replay
    with every hook's CPU time removed: the part of the step the hooks hold.

Known problems
    torch.compile's and a larger micro-batch's effect on the hooks is not replayed. Real twins have
    measured them (``fixtures/recorded/gpu-h200-levers``, CPU-bound, without the profiler):
    ``block.compile()`` saved 11-13 ms of a 47-50 ms step, batch 4 -> 16 gave 4.2-4.5x the sequences
    per second; two blocks per unit saved 9.9-10.8 ms where this rule's replay said 9.3 (4.6-9.3). The replay matches a wait on another stream to the work that finished last
    before the waiter started; where a hook's delay let later work finish first (heavy
    post-backward hooks), it underestimates (0.7× the generator's twin in that case).
"""

from fsdpdoctor.fmt import mib, ms, pct

from ._idiom import batch_line, blocks_text, idiom_parts
from ._util import finding, fix_for, is_fsdp, of_step, replay_evidence, replayed_saving, step_ms

CODE = "FSD016"
SLUG = "gpu-starved-by-hooks"
TITLE = "The GPU waits for FSDP's hooks on the CPU"
SEVERITY = "warning"
THRESHOLDS = ("waterfall_min_part_pct", "hook_idle_min_pct", "severity_warning_pct")
REPLAY_FIX = "hooks_half"  # two blocks per unit: half the hooks
CEILING_FIX = "hooks_off"  # every hook's CPU gone: the part of the step the hooks hold

# compare: the parts of the step time this finding explains when it appears or goes away
EXPLAINS = {
    "gpu": [("host_bound_idle", None), ("other_idle", None)],
    "cpu": [("cpu_fsdp_hooks", None), ("cpu_forward", None), ("cpu_backward", None)],
}
CLAIM_PRIORITY = 95
SUPERSEDED_BY = ("auto-wrap-too-fine", "cpu-offload-stall")

FIX_FSDP2 = """from torch.distributed.fsdp import fully_shard

# 1. compile each block: less Python and fewer, fused kernels between FSDP's hooks
for block in model.layers:
    block.compile()
# 2. fewer, larger units: two blocks per fully_shard halve the hooks (a list is one unit)
blocks = list(model.layers)
for i in range(0, len(blocks), 2):
    fully_shard(blocks[i:i + 2])
fully_shard(model)
# 3. more GPU work per hook: a larger micro-batch where memory allows
# 4. static shapes: CUDA graphs remove the launch overhead (torch.compile(mode="reduce-overhead"))
"""
FIX_FSDP1 = """import functools
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

# fewer, larger units: wrap every other block (or a module holding two), not each one
pairs = {b for i, b in enumerate(model.layers) if i % 2 == 0}
model = FSDP(model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel: recurse or module in pairs,
             use_orig_params=True)
model = torch.compile(model)  # fewer, fused kernels between the hooks
"""

#: the hooks' levers no framework setting carries, under a framework that wraps the units itself
WHY_IDIOM = (
    "# fewer, larger units: one FSDP unit per two {blocks} halves the hooks (a module holding\n"
    "# two, wrapped instead of each block); more GPU work per hook: a larger micro-batch where memory allows;\n"
    '# static shapes: CUDA graphs remove the launch overhead (torch.compile(mode="reduce-overhead"))\n'
)


def check(facts, cfg):
    e = facts.efficiency
    step = step_ms(facts)
    if e is None or not facts.gpu_present or not is_fsdp(facts) or not step:
        return []
    idle, waited = e.parts_ms["gpu_idle"], e.idle_ms.get("fsdp_hooks", 0.0)
    if 100 * idle / step < cfg["waterfall_min_part_pct"] or 100 * waited / step < cfg["hook_idle_min_pct"]:
        return []
    saving = replayed_saving(facts, REPLAY_FIX)
    ceiling = replayed_saving(facts, CEILING_FIX)
    if ceiling is None:
        ceiling = waited  # no trustworthy replay: the GPU's wait at the hooks
    if saving is None:
        saving = 0.5 * waited  # no trustworthy replay: half the GPU's wait at the hooks (half the hooks)
    if 100 * saving / step < cfg["severity_warning_pct"]:  # the fix must pay
        return []
    evidence = [
        f"GPU idle {ms(idle)} per step = {of_step(facts, idle)}; {ms(waited)} of it while the thread that "
        "launches the GPU's next work is inside an FSDP hook"
    ]
    for hook, hs in _by_hook(e.hooks):
        cpu = [h.cpu_ms_per_step / h.calls_per_step for h in hs if h.calls_per_step]
        wait = sum(h.gpu_wait_ms_per_step for h in hs)
        units = ", ".join(f"{h.unit or '(root)'} {ms(h.gpu_wait_ms_per_step)}" for h in hs[:6])
        evidence.append(
            f"{hook}: {_span(cpu)} of CPU per call; the GPU waits {ms(wait)} per step at {len(hs)} "
            f"unit{'s' if len(hs) > 1 else ''} ({units}{' …' if len(hs) > 6 else ''})"
        )
    cpu_total = sum(h.cpu_ms_per_step for h in e.hooks)
    evidence.append(f"FSDP hooks take {ms(cpu_total)} of CPU per step in all (per unit and call: the --details table)")
    w = facts.whatif
    if w is not None and REPLAY_FIX in w.saving_ms and replayed_saving(facts, REPLAY_FIX) is not None:
        evidence.append(
            replay_evidence(facts, REPLAY_FIX, "two blocks per unit (half the hooks)")
            + f"; at most {ms(ceiling)} per step with no hook CPU at all (the part of the step the hooks hold)"
        )
    # under a framework that wraps the units itself: its compile setting, then what to wrap (no setting
    # of theirs puts two blocks in one unit) and the larger micro-batch
    fix = idiom_parts(
        facts,
        [("compile", ""), (None, WHY_IDIOM.format(blocks=blocks_text(facts)))],
        fix_for(facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1),
    )
    grow = facts.memory_pressure.batch_headroom if facts.memory_pressure is not None else None
    if grow is not None and grow >= 1.5:
        p = facts.memory_pressure
        evidence.append(
            f"memory headroom: the peak reserved {mib(p.peak_reserved_bytes)} is {pct(p.used_pct)} of the "
            f"{mib(p.capacity_bytes)} {'budget' if p.capacity_source == 'budget' else 'GPU'}: a micro-batch up to "
            f"~{grow:.0f}× larger fits (more GPU work per hook)"
        )
        k = min(int(grow), 8)
        fix = {key: batch_line(facts, k, grow) + code for key, code in fix.items()}
    top = max(e.hooks, key=lambda h: h.gpu_wait_ms_per_step, default=None)
    where = {"unit": top.unit, "hook": top.hook} if top is not None else {}
    return [
        finding(
            __name__,
            f"The GPU waits {ms(waited)} per step ({of_step(facts, waited)}) for FSDP's hooks on the CPU: "
            f"{_per_unit(e.hooks)}.",
            evidence=evidence,
            cause="FSDP's Python hooks take longer on the CPU than the GPU work of the unit before them",
            fix=fix,
            confidence=0.7,
            est_saving_ms=saving,
            saving_ceiling_ms=max(ceiling, saving),
            where=where,
        )
    ]


def _by_hook(hooks):
    out: dict[str, list] = {}
    for h in hooks:
        if h.gpu_wait_ms_per_step >= 0.005:  # the hooks the GPU waits at
            out.setdefault(h.hook, []).append(h)
    return sorted(out.items(), key=lambda kv: -sum(h.gpu_wait_ms_per_step for h in kv[1]))[:4]


def _span(vals):
    if not vals:
        return "–"
    lo, hi = min(vals), max(vals)
    return ms(lo) if hi - lo < 0.01 else f"{lo:.2f}–{ms(hi)}"


def _per_unit(hooks) -> str:
    """The hook that makes the GPU wait most, per unit: "each block's pre_forward takes 1.26–1.35 ms of
    CPU per call while the GPU waits 0.27–0.75 ms"."""
    best = _by_hook(hooks)
    if not best:
        return "the hooks' CPU time"
    hook, hs = best[0]
    cpu = [h.cpu_ms_per_step / h.calls_per_step for h in hs if h.calls_per_step]
    wait = [h.gpu_wait_ms_per_step for h in hs]
    return (
        f"{'each of ' + str(len(hs)) + ' units' if len(hs) > 1 else (hs[0].unit or 'the root')}' {hook} takes "
        f"{_span(cpu)} of CPU per call while the GPU waits {_span(wait)} per step"
    )
