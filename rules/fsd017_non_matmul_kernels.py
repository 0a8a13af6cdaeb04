"""What it detects
    A step whose GPU time goes to kernels that are neither matmuls nor attention — elementwise
    ops, norms, softmax and the loss, casts, copies, the optimizer — where a fix removes part of
    it: the optimizer step runs per-parameter or foreach kernels (``AdamW(fused=True)`` runs one
    fused kernel per group), or the chains of small ops between the matmuls are not fused
    (``torch.compile``).

Why it hurts
    These kernels move memory and do little arithmetic: each reads and writes whole activations,
    so a chain of them costs several passes over memory where one fused kernel makes one. Every
    one of them is also a launch on the CPU; an optimizer running ~8 kernels per parameter tensor
    launches thousands a step.

How it shows in a trace
    The waterfall's ``other_kernels`` part is material, split by family
    (``efficiency.other_kernels_ms``: elementwise, norms, softmax / loss, casts, copies,
    reductions, embedding, the optimizer fused / foreach / per-parameter), and the optimizer
    step's kernels say how it runs (``aten::_fused_adamw_`` vs ``aten::_foreach_*`` vs one
    ``aten::mul_`` / ``addcdiv_`` … per tensor).

Fix
    ``AdamW(..., fused=True)`` where the optimizer runs per-parameter or foreach kernels;
    ``torch.compile`` (of each block, under FSDP2) to fuse elementwise chains; fused RMSNorm /
    RoPE / SwiGLU / cross-entropy kernels (e.g. Liger Kernel) for what compile does not fuse.

Known problems
    The optimizer's saving is the what-if replay of a fused step: its CPU time kept for one op per
    tensor (the rarest of its kernels) instead of one per op, and a third of the kernels' time
    (the bytes a fused AdamW moves against ~8 separate ops). Fusion by ``torch.compile`` is priced
    at half the fusable families' time, an assumption (the range is ±50%); where the optimizer
    lever applies, the saving counts it alone and states the fusion's bound beside it; where the
    optimizer's replay saves less than a material part of the step, the finding is the fusion lever.
"""

from fsdpdoctor.facts.efficiency import FUSED_OPTIMIZERS
from fsdpdoctor.fmt import ms
from fsdpdoctor.facts.efficiency import FAMILY_LABEL

from ._util import finding, fix_for, of_step, replay_evidence, replayed_saving, step_ms

CODE = "FSD017"
SLUG = "non-matmul-kernels"
TITLE = "Kernels that are not matmuls take much of the step, and a fix can fuse them"
SEVERITY = "warning"
THRESHOLDS = ("waterfall_min_part_pct", "fusion_min_pct")
REPLAY_FIX = "fused_optimizer"

EXPLAINS = {"gpu": [("compute", None)], "cpu": [("cpu_optimizer", None)]}
CLAIM_PRIORITY = 40
SUPERSEDED_BY = ("matmul-wrong-engine",)

#: the families torch.compile fuses into the matmuls' neighbours, and the share of their time
#: assumed to go (an estimate: the saving's range is ±50%)
FUSABLE = ("elementwise", "norm", "softmax_loss", "casts")
FUSION_SHARE = 0.5
OPTIMIZER = ("optimizer_per_parameter", "optimizer_foreach")

FIX_OPT = "optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)  # one fused kernel per group\n"
FIX_FSDP2 = """# fuse the elementwise / norm / softmax chains between the matmuls: compile each block
for block in model.layers:
    block.compile()
# fused RMSNorm / RoPE / SwiGLU / cross-entropy where compile does not fuse them, e.g. Liger Kernel:
# from liger_kernel.transformers import LigerRMSNorm, LigerFusedLinearCrossEntropyLoss
"""
FIX_FSDP1 = """# fuse the elementwise / norm / softmax chains between the matmuls
model = FSDP(model, auto_wrap_policy=policy, use_orig_params=True)   # compile needs the original parameters
model = torch.compile(model)
"""
FIX_ANY = """# fuse the elementwise / norm / softmax chains between the matmuls
model = torch.compile(model)
"""


def check(facts, cfg):
    e = facts.efficiency
    step = step_ms(facts)
    if e is None or not facts.gpu_present or not step or facts.workload == "inference":
        return []
    other = e.parts_ms["other_kernels"]
    if 100 * other / step < cfg["waterfall_min_part_pct"]:
        return []
    fam = e.other_kernels_ms
    fusable = sum(fam.get(k, 0.0) for k in FUSABLE) if facts.fsdp.compiled is not True else 0.0
    opt_ms = sum(fam.get(k, 0.0) for k in OPTIMIZER)
    names = {r.optimizer for r in facts.rank_facts if r.optimizer}
    # only an optimizer PyTorch can fuse (not Shampoo …)
    optimizer = e.optimizer in ("per-parameter", "foreach") and opt_ms > 0 and names <= FUSED_OPTIMIZERS
    replayed = replayed_saving(facts, REPLAY_FIX) if optimizer else None
    opt_saving = (replayed if replayed is not None else opt_ms * (1 - 1 / 3)) if optimizer else 0.0
    if optimizer and 100 * opt_saving / step < cfg["waterfall_min_part_pct"] and fusable:
        # a fused optimizer would not pay here, fusing the chains between the matmuls may: the fusion
        # lever (a GPU-bound H200 twin: fused AdamW saved 2.6 ms of 84.7, block.compile() 15.2 ms)
        optimizer = False
    if optimizer:
        saving, kind = opt_saving, "optimizer"
    else:
        saving, kind = FUSION_SHARE * fusable, "fusion"
    # the fix must pay: a saving that is itself a material part of the step; the fusion lever only on
    # a large share of fusable kernels
    if 100 * saving / step < cfg["waterfall_min_part_pct"] or (
        kind == "fusion" and 100 * fusable / step < cfg["fusion_min_pct"]
    ):
        return []
    top = sorted(fam.items(), key=lambda kv: -kv[1])
    evidence = [
        f"kernels that are not matmuls or attention: {ms(other)} per step = {of_step(facts, other)}: "
        + ", ".join(f"{FAMILY_LABEL.get(k, k)} {ms(v)}" for k, v in top[:6] if v >= 0.005)
    ]
    if optimizer:
        evidence.append(
            f"the optimizer step runs {e.optimizer} kernels: {e.optimizer_kernels_per_step:,.0f} a step taking "
            f"{ms(opt_ms)} of GPU time; AdamW(fused=True) runs one kernel per parameter group"
        )
        if replayed is not None:
            evidence.append(replay_evidence(facts, REPLAY_FIX, "a fused optimizer step"))
        if fusable:
            evidence.append(
                f"not counted in the saving: torch.compile's fusion of {ms(fusable)} of elementwise / norm / "
                f"softmax kernels (about half of it, an estimate)"
            )
        summary = (
            f"The optimizer runs {e.optimizer_kernels_per_step:,.0f} {e.optimizer} kernels a step: "
            f"AdamW(fused=True) saves about {ms(saving)} ({of_step(facts, saving)})."
        )
    else:
        evidence.append(
            f"fusable by torch.compile: {ms(fusable)} of elementwise / norm / softmax / cast kernels; the "
            f"saving assumes {FUSION_SHARE:.0%} of it goes (an estimate)"
        )
        if opt_saving:
            evidence.append(
                f"the optimizer step runs {e.optimizer} kernels ({ms(opt_ms)} of GPU time), but a fused step would "
                f"save only {ms(opt_saving)} ({of_step(facts, opt_saving)}): not counted"
            )
        summary = (
            f"Kernels that are not matmuls take {ms(other)} ({of_step(facts, other)}); fusing the "
            f"elementwise, norm and softmax chains saves about {ms(saving)}."
        )
    if e.optimizer == "fused":
        evidence.append("the optimizer step is fused already")
    fix = fix_for(
        facts,
        fsdp2=(FIX_OPT if optimizer else "") + FIX_FSDP2,
        fsdp1=(FIX_OPT if optimizer else "") + FIX_FSDP1,
        ddp=(FIX_OPT if optimizer else "") + FIX_ANY,
        training=(FIX_OPT if optimizer else "") + FIX_ANY,
        lever=("fused_optimizer", "compile") if optimizer else "compile",
    )
    f = finding(
        __name__,
        summary,
        evidence=evidence,
        cause=(
            "the optimizer step is not fused"
            if optimizer
            else "elementwise, norm and softmax kernels run one by one between the matmuls"
        ),
        fix=fix,
        confidence=0.6,
        est_saving_ms=saving,
    )
    f.saving_kind = f"{SLUG}/{kind}"
    if kind == "fusion":
        f.saving_basis = "heuristic"  # its own estimate, not the fused optimizer's replay
        f.saving_span_ms = [0.5 * saving, min(1.5 * saving, fusable)]
        f.saving_assumptions = (
            f"the share of the {ms(fusable)} of fusable kernels torch.compile removes: "
            f"{FUSION_SHARE:.0%} assumed, {FUSION_SHARE / 2:.0%}-{min(1.5 * FUSION_SHARE, 1.0):.0%}"
        )
    elif replayed is None:
        f.saving_span_ms = [opt_ms * 0.5, opt_ms * 0.75]
        f.saving_assumptions = "a fused optimizer step keeps 25-50% of the per-op kernels' time (33% assumed)"
    return [f]
