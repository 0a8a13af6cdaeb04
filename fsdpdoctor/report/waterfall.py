"""The efficiency waterfall as format-neutral text and tables (every reporter draws them)."""

from __future__ import annotations

from fsdpdoctor.facts import RunFacts
from fsdpdoctor.facts.efficiency import FAMILY_LABEL, EfficiencyFacts
from fsdpdoctor.fmt import ms, pct
from fsdpdoctor.report.tables import Table

PART_LABEL = {
    "matmul_at_peak": "matmul at peak",
    "matmul_below_peak": "matmul below peak",
    "attention_at_peak": "attention at peak",
    "attention_below_peak": "attention below peak",
    "recompute": "recompute",
    "other_kernels": "other kernels",
    "exposed_comm": "exposed comm",
    "exposed_copies": "exposed copies",
    "gpu_idle": "GPU idle",
    "unattributed": "unattributed",
}
#: a part this small (ms per step) is not shown (the unattributed part where the parts tile the step)
SHOWN_MIN_MS = 0.0005
CAUSE_LABEL = {
    "sync_drain": "synchronizations (the launch queue drained)",
    "fsdp_hooks": "FSDP hooks",
    "data_loading": "data loading",
    "optimizer_cpu": "the optimizer step's CPU side",
    "launch": "kernel launch calls",
    "python": "Python and ops outside FSDP hooks",
    "gpu_dependency": "queued work waiting on another stream, an event or a peer",
    "unattributed": "not attributed",
}
HEADLINE_MIN_SHARE = 0.03  # parts under this share of the step are summed as "… more"


def _n(v: float) -> str:
    return f"{v:.1f}" if v >= 0.05 or v == 0 else f"{v:.2f}"


def waterfall_line(f: RunFacts) -> str | None:
    """ "55.1 ms = 17.2 at peak (31% MFU) + 21.9 other kernels + 7.3 GPU idle + … ": the step
    as its parts, at peak first, then the largest; None without a waterfall."""
    e = f.efficiency
    if e is None or not e.step_ms:
        return None
    p = dict(e.parts_ms)
    at = p.pop("matmul_at_peak") + p.pop("attention_at_peak")
    un = p.pop("unattributed", 0.0)
    items = []
    if e.flops_known and e.peak_tflops:
        items.append(f"{_n(at)} at peak ({pct(100 * at / e.step_ms)} MFU)")
    rest = sorted(((k, v) for k, v in p.items() if v > 0), key=lambda kv: -kv[1])
    shown = [(k, v) for k, v in rest if v >= HEADLINE_MIN_SHARE * e.step_ms]
    items += [f"{_n(v)} {PART_LABEL[k]}" for k, v in shown]
    more = sum(v for k, v in rest if (k, v) not in shown)
    if more >= 0.05:
        items.append(f"{_n(more)} more")
    line = f"{ms(e.step_ms)} = " + " + ".join(items)
    if abs(un) >= 0.05:
        line += f" {'+' if un > 0 else '−'} {_n(abs(un))} unattributed"
    return line


def cause_label(key: str, e: EfficiencyFacts) -> str:
    """The GPU-idle cause in words; "outside FSDP hooks" only where the trace has FSDP hooks."""
    if key == "python" and not e.hooks:
        return "Python and ops"
    return CAUSE_LABEL.get(key, key)


def _contributors(e: EfficiencyFacts, part: str) -> str:
    if part == "other_kernels":
        top = sorted(e.other_kernels_ms.items(), key=lambda kv: -kv[1])[:3]
        return ", ".join(f"{FAMILY_LABEL.get(k, k)} {ms(v)}" for k, v in top if v >= 0.005)
    if part == "gpu_idle":
        top = sorted(e.idle_ms.items(), key=lambda kv: -kv[1])[:3]
        return ", ".join(f"{cause_label(k, e)} {ms(v)}" for k, v in top if v >= 0.005)
    if part == "matmul_below_peak" and e.gemm_shapes:
        g = e.gemm_shapes[0]
        return f"furthest below: {g.op} {g.shape} at {g.tflops or 0:,.0f} TFLOP/s"
    if part in ("matmul_at_peak", "attention_at_peak") and e.peak_tflops and e.flops_known:
        return f"the FLOPs at the {e.peak_tflops:,.0f} TFLOP/s dense BF16 peak"
    if part == "unattributed":
        return UNATTRIBUTED_WHY[e.parts_ms[part] > 0]
    return ""


UNATTRIBUTED_WHY = {
    True: "the step less every measured part (time no part covers)",
    False: "negative: the measured parts over-count the step by this much (at-peak time above its kernels' time)",
}


def waterfall_tables(f: RunFacts) -> list[Table]:
    """--details: the parts with their largest contributors, then each contributor list."""
    e = f.efficiency
    if e is None or not e.step_ms:
        return []
    rows = [
        [PART_LABEL[k], ms(v), pct(100 * v / e.step_ms), _contributors(e, k)]
        for k, v in e.parts_ms.items()
        if k != "unattributed" or abs(v) >= SHOWN_MIN_MS
    ]
    note = (
        "each part measured from its kernels' intervals in the step's interval on the step clock, each GPU "
        "instant counted once, in this order, none scaled; at-peak parts are the model FLOPs at the dense BF16 "
        "peak (attention: the causal triangle the kernel computes), so their share of the step is the MFU"
    )
    if abs(e.parts_ms.get("unattributed", 0.0)) < SHOWN_MIN_MS:
        note += "; the parts cover the whole step (nothing unattributed)"
    out = [
        Table(
            "Where the step goes (per step)",
            ["part", "time", "of step", "largest contributors"],
            rows,
            "; ".join([note, *e.notes]),
        )
    ]
    if e.other_kernels_ms:
        fam = sorted(e.other_kernels_ms.items(), key=lambda kv: -kv[1])
        tot = e.parts_ms["other_kernels"] or 1.0
        note = (
            f"the optimizer runs {e.optimizer} kernels ({e.optimizer_kernels_per_step:,.0f} per step)"
            if e.optimizer
            else ""
        )
        out.append(
            Table(
                "Other kernels by family (per step)",
                ["family", "time", "share"],
                [[FAMILY_LABEL.get(k, k), ms(v), pct(100 * v / tot)] for k, v in fam if v >= 0.005],
                note,
            )
        )
    if e.idle_ms:
        tot = e.parts_ms["gpu_idle"] or 1.0
        rows = [
            [cause_label(k, e), ms(v), pct(100 * v / tot)] for k, v in sorted(e.idle_ms.items(), key=lambda kv: -kv[1])
        ]
        rows += [
            [f"  {s.site}", ms(s.gpu_idle_ms_per_step), pct(100 * s.gpu_idle_ms_per_step / tot)]
            for s in e.syncs
            if s.gpu_idle_ms_per_step >= 0.005
        ]
        out.append(
            Table(
                "GPU idle: what the CPU was doing (per step)",
                ["cause", "time", "share"],
                rows,
                f"{e.launch_bound_kernels_per_step:,.0f} of the {e.kernels_per_step:,.0f} GPU activities a step "
                "launches run shorter than their own launch call",
            )
        )
    hooks = [h for h in e.hooks if h.cpu_ms_per_step >= 0.005][:12]
    if hooks:
        out.append(
            Table(
                "FSDP hooks: CPU time and the GPU's wait (per step)",
                ["unit", "hook", "calls", "CPU per call", "CPU", "GPU waits"],
                [
                    [
                        h.unit or "(root)",
                        h.hook,
                        f"{h.calls_per_step:g}",
                        ms(h.cpu_ms_per_step / h.calls_per_step) if h.calls_per_step else "–",
                        ms(h.cpu_ms_per_step),
                        ms(h.gpu_wait_ms_per_step),
                    ]
                    for h in hooks
                ],
                "CPU: the outermost hook ranges, blocking calls inside them left out; GPU waits: the GPU idle "
                "while the thread that launched its next work was inside the hook",
            )
        )
    if e.gemm_shapes and e.peak_tflops:
        why = any(g.flags for g in e.gemm_shapes)
        out.append(
            Table(
                "Matmul shapes furthest below peak (per step)",
                ["matmul", "dtype", "calls", "time", "TFLOP/s", "of peak", "below peak"] + (["why"] if why else []),
                [
                    [
                        f"{g.op.removeprefix('aten::')} {g.shape}",
                        g.dtype or "?",
                        f"{g.calls_per_step:g}",
                        ms(g.ms_per_step),
                        f"{g.tflops:,.0f}" if g.tflops else "–",
                        pct(100 * g.tflops / e.peak_tflops) if g.tflops else "–",
                        ms(g.below_peak_ms),
                    ]
                    + (["; ".join(g.flags)] if why else [])
                    for g in e.gemm_shapes
                ],
                "shape: M×K · K×N of the product (batched: B× both)",
            )
        )
    return out
