"""The report's content as format-neutral tables; each reporter only decides how to draw them."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fsdpdoctor.facts import RunFacts
from fsdpdoctor.fmt import mib, ms, pct, plural
from fsdpdoctor.report.tables import Table
from fsdpdoctor.report.hang_sections import hang_headline, hang_table  # noqa: F401  (re-exported)
from fsdpdoctor.report.memory_sections import BAR_WIDTH, memory_headline, memory_tables  # noqa: F401  (re-exported)
from fsdpdoctor.report.waterfall import waterfall_line, waterfall_tables

if TYPE_CHECKING:
    from fsdpdoctor.engine import Finding


_SHELL_LINE = re.compile(
    r"^(export\s|[A-Z_][A-Z0-9_]*=|nvidia-smi\b|torchrun\b|pip\s|python3?\s+-m\b|kill\b|ps\b|\$\s)"
)


def fix_language(code: str) -> str:
    """The language a fix is written in, for syntax highlighting: "bash" when every line that is
    not a comment is a shell command (``export PYTORCH_CUDA_ALLOC_CONF=...``, ``nvidia-smi``),
    else "python"."""
    lines = [ln.strip() for ln in code.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return "bash" if lines and all(_SHELL_LINE.match(ln) for ln in lines) else "python"


def saving_text(fd: "Finding", f: RunFacts) -> str:
    """What a finding saves, in its own unit: the range of milliseconds per step it can be trusted
    to (measured on real twins, :mod:`fsdpdoctor.savings`) with where the figure comes from (the
    what-if replay, or the rule's estimate — and that the replay was set aside when it missed the
    measured steps), or bytes freed at the memory peak; "" when the finding has no estimate."""
    if fd.est_saving_ms is not None:
        rng = fd.saving_range_ms
        est = fd.est_saving_ms
        if est < 0.005:
            out = "saves < 0.01 ms/step"
        else:
            out = f"saves ~{ms(est)}/step"
            if rng is not None and rng[1] - rng[0] >= 0.01:
                out += f" ({_num(rng[0])}–{ms(rng[1])})"
        if fd.saving_basis == "replay":
            src = "what-if replay"
        elif fd.saving_basis == "heuristic-replay-off":
            src = f"estimate: the replay misses the measured steps by {fd.replay_fidelity_pct or 0.0:.1f}%"
        else:
            src = "estimate"
        if rng is not None and fd.saving_range_basis and est >= 0.005:
            b = fd.saving_range_basis
            src += "; " + (
                "not validated on a real run"
                if b.startswith("not validated")
                else b.split(" (")[0].split(":")[0].strip()
            )
        ceiling = fd.saving_ceiling_ms
        if ceiling is not None and est >= 0.005 and ceiling - (rng[1] if rng else est) >= 0.01:
            src += f"; at most {ms(ceiling)}"
        out += f" ({src})"
        if fd.saving_pct_of_step is not None:
            out += f", {pct(fd.saving_pct_of_step)} of the step"
        return out
    if fd.est_saving_bytes:
        return f"frees ~{mib(fd.est_saving_bytes)} at the memory peak"
    return ""


def _num(v: float) -> str:
    return f"{v:.2f}" if v >= 0 else f"−{-v:.2f}"


def limit_text(f: RunFacts) -> str:
    """What limits the step (:attr:`TimelineSummary.bound`) with its figures."""
    if not f.gpu_present and any(i.ledger is not None and i.ledger.device_events for i in f.inputs):
        return "no GPU timeline (the trace's device work is not read)"
    if not f.gpu_present or not f.timeline.bound:
        return "CPU-only trace (no GPU timeline)"
    return bound_text(f)


def mfu_text(f: RunFacts) -> str:
    """ "10.0% of the H100 SXM's 989 TFLOP/s BF16 dense peak (99.0 TFLOP/s; 3,367 GFLOP per step;
    GEMMs on bf16 tensor cores)"."""
    c = f.compute
    if c.peak_label == "--peak-tflops":
        out = f"{pct(c.mfu_pct)} of the {c.peak_tflops:,.0f} TFLOP/s peak given with --peak-tflops"
    else:
        ref = (c.peak_dtype or "bf16").upper()
        out = f"{pct(c.mfu_pct)} of the {c.peak_label}'s {c.peak_tflops:,.0f} TFLOP/s {ref} dense peak"
        if c.dtype_peak not in (None, c.peak_dtype) and c.dtype_mfu_pct is not None:
            # for information: an fp32 run near its own fp32 peak still leaves the tensor cores idle
            out += f", {pct(c.dtype_mfu_pct)} of its {c.dtype_peak_tflops:,.0f} TFLOP/s {c.dtype_peak.upper()} peak"
    out += f" ({c.achieved_tflops:.1f} TFLOP/s; {c.model_flops_per_step / 1e9:,.0f} GFLOP per step"
    if c.recompute_flops_per_step:
        out += f", HFU {pct(c.hfu_pct)} with the recompute"
    mix = engine_mix_text(c)
    if mix:
        out += "; " + mix
    return out + ")"


MIX_MIN_PCT = 1.0  # engines with less of the GEMM time are left out of the headline's mix


def _engine_kind(engine: str) -> str:
    """fp32 on CUDA cores and fp32 of no known engine read alike in the headline."""
    return "fp32" if engine.startswith("fp32") else engine


def engine_mix_text(c) -> str:
    """ "100.0% of GEMM time on BF16 tensor cores" where one engine runs (nearly) all of it; else
    each engine's share: "86.9% of GEMM time on FP4 × FP8, 13.1% BF16 tensor cores". The shares
    are of the GEMMs' time; attention, where it runs on another engine, is named after them."""
    mix = c.gemm_mix
    if not mix:
        return ""
    shown = sorted(((v, e) for e, v in mix.items() if v >= MIX_MIN_PCT), reverse=True)
    top = max(mix, key=mix.get)
    if len(shown) <= 1:
        text = f"{pct(mix[top])} of GEMM time {ENGINE_TEXT.get(top, top)}"
    elif all(e in ENGINE_SHORT for _, e in shown):  # all on tensor cores
        parts = [f"{pct(v)} {ENGINE_SHORT[e]}" for v, e in shown]
        head, rest = parts[0].split(" ", 1)
        text = f"{head} of GEMM time on {rest}" + "".join(", " + p for p in parts[1:]) + " tensor cores"
    else:
        parts = [f"{pct(v)} {ENGINE_TEXT.get(e, e)}" for v, e in shown]
        head, rest = parts[0].split(" ", 1)
        text = f"{head} of GEMM time {rest}" + "".join(", " + p for p in parts[1:])
    attn = c.attention_engine_ms_per_step
    a_top = max(attn, key=attn.get) if attn else None
    if a_top and _engine_kind(a_top) != _engine_kind(top):  # attention on another engine: say so
        text += f", attention {ENGINE_TEXT.get(a_top, a_top)}"
    return vendor_words(c.peak_label, text)


def vendor_words(peak_label: str | None, text: str) -> str:
    """NVIDIA's words for the matrix and vector units, in AMD's where the device is an Instinct
    (MI*): "tensor cores" → "matrix cores", "CUDA cores" → "SIMD units"."""
    if (peak_label or "").startswith("MI"):
        return text.replace("tensor cores", "matrix cores").replace("CUDA cores", "SIMD units")
    return text


ENGINE_LABEL = {
    "fp32-simt": "fp32, CUDA cores",
    "fp32": "fp32, engine unknown",
    "tf32": "TF32 tensor cores",
    "bf16": "BF16 tensor cores",
    "fp16": "FP16 tensor cores",
    "fp8": "FP8 tensor cores",
    "fp4-fp8": "FP4 × FP8 tensor cores",
    "fp4": "FP4 tensor cores",
}
#: tensor-core engines by their operands, for a mix ("12.1% BF16, 80.4% FP4 × FP8 tensor cores")
ENGINE_SHORT = {"tf32": "TF32", "bf16": "BF16", "fp16": "FP16", "fp8": "FP8", "fp4-fp8": "FP4 × FP8", "fp4": "FP4"}
ENGINE_TEXT = {
    "fp32-simt": "in fp32 on CUDA cores",
    "fp32": "in fp32",
    "tf32": "on TF32 tensor cores",
    "bf16": "on BF16 tensor cores",
    "fp16": "on FP16 tensor cores",
    "fp8": "on FP8 tensor cores",
    "fp4-fp8": "on FP4 × FP8 tensor cores",
    "fp4": "on FP4 tensor cores",
}


def ticket_headline(f: RunFacts) -> list[tuple[str, str]]:
    """The few lines the terminal ticket opens with: what was analysed, the step time and what
    limits it, MFU where known, overlap, exposed communication, memory peak. Extend here: each
    item is a (label, text) pair, in display order."""
    if not f.rank_facts:
        return hang_headline(f) + memory_headline(f) or [("Run", "no traces")]
    full = dict(headline(f))
    items = [("Run", full["Run"] + " · " + full["FSDP"])]
    for key in ("Not read", "Trace"):
        if key in full:
            items.append((key, full[key]))
    if f.step_clock_ms:
        cw = f.compile_window
        left = (
            f"; step {', '.join(map(str, cw.warmup_steps))} left out: torch.compile's warm-up, {ms(max(cw.warmup_ms))}"
            if cw is not None and cw.warmup_steps
            else ""
        )
        items.append(
            ("Step", f"{ms(f.step_clock_ms)} ({plural(f.steps.count, 'step')} per rank{left}) · {limit_text(f)}")
        )
    if f.compute is not None and f.compute.mfu_pct is not None:
        items.append(("MFU", mfu_text(f)))
    if waterfall_line(f):
        items.append(("Where", waterfall_line(f)))
    if not f.collectives:
        items.append(("Comm", f"no collectives in the traces (world size {f.world_size or len(f.ranks)})"))
    elif f.gpu_present and f.overlap.pct is not None:
        items.append(
            (
                "Comm",
                f"{pct(f.overlap.pct)} hidden behind compute · exposed {ms(f.exposed_comm.mean_ms_per_step)} per step",
            )
        )
    elif f.gpu_present:
        items.append(
            ("Comm", f"no collective kernel in the GPU window · exposed {ms(f.exposed_comm.mean_ms_per_step)} per step")
        )
    return hang_headline(f) + items + memory_headline(f)


#: a framework as the Run line names it (FrameworkFacts.name; libraries not listed by their own name)
_FRAMEWORKS = {
    "transformers": "HF Transformers",
    "lightning": "Lightning Trainer",
    "accelerate": "Accelerate",
    "torchtitan": "torchtitan",
}
#: FrameworkFacts.evidence's source prefixes as the Run line names them
_SOURCES = {
    "sidecar": "sidecar",
    "folder": "dump folder",
    "trace": "Python frames",
    "memory snapshot": "snapshot stacks",
}


def framework_text(f: RunFacts) -> str:
    """`` · HF Transformers Trainer (sidecar)``: the framework that drove the run and what said so,
    where evidence named one; nothing for plain PyTorch (the default, not a finding)."""
    fw = f.framework
    if fw is None or fw.name == "pytorch" or not fw.evidence:
        return ""
    name = _FRAMEWORKS.get(fw.name, fw.name)
    if fw.name == "transformers" and fw.trainer == "Trainer":
        name += " Trainer"
    if fw.peft:
        name += " + PEFT"
    seen = [v for k, v in _SOURCES.items() if any(e.startswith(k + ":") for e in fw.evidence)]
    return f" · {name}" + (f" ({', '.join(seen)})" if seen else "")


def headline(f: RunFacts) -> list[tuple[str, str]]:
    """Key/value lines for the top of every report."""
    if not f.rank_facts:
        return hang_headline(f) + memory_headline(f) or [("Run", "no traces")]
    fs = f.fsdp
    ws = f.world_size
    ranks = f.ranks
    rank_txt = f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}" + (f" of {ws}" if ws else "")
    dev = next((r.device_name for r in f.rank_facts if r.device_name), None)
    if fs.version is None and f.parallelism.run_kind:
        fsdp_txt = f"{f.parallelism.run_kind} (no FSDP)"
    elif fs.version is None:
        fsdp_txt = "not detected (" + fs.version_evidence + ")"
    else:
        fsdp_txt = (
            f"FSDP{fs.version}"
            + (f" {fs.sharding_strategy}" if fs.sharding_strategy else "")
            + f", {plural(fs.unit_count, 'unit')}"
        )
        if fs.backward_prefetch:
            fsdp_txt += f", backward prefetch {fs.backward_prefetch}"
        if fs.forward_prefetch:
            fsdp_txt += ", forward prefetch on"
        if fs.reshard_after_forward is False:
            fsdp_txt += ", no reshard after forward"
        if fs.cpu_offload.detected:
            fsdp_txt += ", CPU offload"
        if fs.mixed_precision is not None and any(c.kind == "all_gather" for c in f.collectives):
            fsdp_txt += ", " + ("low-precision" if fs.mixed_precision else "fp32") + " all-gathers"
    if f.inputs_excluded:  # a partial run: "7 of 8 ranks", whatever the traces say the world size is
        rank_txt = f"{len(ranks)} of {f.ranks_expected} ranks" + (
            f" (world size {ws})" if ws and ws != f.ranks_expected else ""
        )
    unread = [i.ledger for i in f.inputs if i.ledger is not None and i.ledger.warning]
    if f.gpu_present:
        gpu_txt = ""
    elif any(i.ledger is not None and i.ledger.device_events for i in f.inputs):
        gpu_txt = " · device work not read (see Not read)"
    else:
        gpu_txt = " · no GPU activity"
    lines = [
        ("Run", rank_txt + (f" · {dev}" if dev else "") + gpu_txt + framework_text(f)),
        ("Steps", steps_text(f)),
        ("FSDP", fsdp_txt),
    ]
    if f.sampled:
        lines.insert(1, ("Trace", sampled_text(f)))
    if unread:  # the input ledger: what looks like GPU work, steps or communication and was not read
        more = f" (and {len(unread) - 1} more input(s) alike)" if len(unread) > 1 else ""
        lines.insert(1, ("Not read", unread[0].warning + more))
    if f.inputs_excluded:
        lines.insert(
            1,
            (
                "Left out",
                "; ".join(
                    (f"rank {e.rank}" if e.rank is not None else "?")
                    + (f" {e.path}" if e.path else "")
                    + f": {e.reason}"
                    for e in f.inputs_excluded
                ),
            ),
        )
    shape = shape_text(f)
    if shape:
        lines.append(("Shape", shape))
    if no_collectives(f):
        lines.append(("Comm", no_collectives(f)))
    elif f.gpu_present and f.overlap.pct is not None:
        lines.append(("Overlap", f"{pct(f.overlap.pct)} of communication hidden behind compute (mean over ranks)"))
        lines.append(("Exposed comm", f"{ms(f.exposed_comm.mean_ms_per_step)} per step"))
    elif f.gpu_present:  # collectives issued, none of their kernels in the GPU window: no overlap to give
        lines.append(("Overlap", "no collective kernel in the GPU window"))
        lines.append(("Exposed comm", f"{ms(f.exposed_comm.mean_ms_per_step)} per step"))
    if f.compute is not None and f.compute.mfu_pct is not None:
        lines.append(("MFU", mfu_text(f)))
    if waterfall_line(f):
        lines.append(("Where the step goes", waterfall_line(f)))
    return hang_headline(f) + lines + memory_headline(f)


def sampled_text(f: RunFacts) -> str:
    """What a sampled trace's headline says: how much of it is there, and what that does to the figures."""
    return (
        f"sampled or trimmed: it holds {pct(f.ops_recorded_pct)} of the CPU ops the profiler numbered between its "
        "first and last; the dropped ops' kernels and launches are missing, so GPU idle, overlap and the "
        "findings' savings are not what the run did"
    )


def steps_text(f: RunFacts) -> str:
    """Step count, the step time (the interval at which steps complete: what shares "of the step"
    in findings are of) and what limits it, with the CPU span and the GPU's busy time per step."""
    out = f"{f.steps.count} per rank ({f.steps.method})"
    t = f.timeline
    if f.gpu_present and f.steps.mean_ms:
        out += f"; step time {ms(f.steps.mean_ms)}, {bound_text(f)}"
        if t.backlog_ms >= 0.05 * f.steps.mean_ms:  # (a smaller backlog is only in the notes)
            out += f"; {ms(t.backlog_ms)} of GPU work launched before the window (warm-up backlog) counted in no step"
    elif f.steps.mean_ms:
        out += f", step time {ms(f.steps.mean_ms)} (CPU)"
    return out


def bound_text(f: RunFacts) -> str:
    """ "GPU-bound (GPU busy 71.43 ms of it; CPU span 36.74 ms)" and the like."""
    t = f.timeline
    figures = f"GPU busy {ms(t.gpu_busy_ms)} of it; CPU span {ms(t.cpu_step_ms)}"
    label = {"gpu": "GPU-bound", "cpu": "CPU-bound", "mixed": "neither side saturated"}.get(t.bound, "")
    return f"{label} ({figures})" if label else figures


def shape_text(f: RunFacts) -> str:
    """Micro-batches, mesh sizes, activation checkpointing and torch.compile, as found."""
    fs, p = f.fsdp, f.parallelism
    parts = []
    if fs.microbatches_per_step > 1:
        parts.append(f"{fs.microbatches_per_step} micro-batches per step (gradient accumulation)")
    mesh = [
        f"{name} {v}"
        for name, v in (("shard", p.shard_size), ("replicate", p.replicate_size), ("tensor parallel", p.tp_size))
        if v
    ]
    if p.replicate_size or p.tp_size:
        parts.append("mesh: " + " × ".join(mesh))
    if fs.activation_checkpointing:
        gpu = f", {ms(fs.recompute_gpu_ms_per_step)} GPU" if f.gpu_present else ""
        parts.append(f"activation checkpointing (recompute {ms(fs.recompute_cpu_ms_per_step)} CPU{gpu} per step)")
    if fs.compiled:
        parts.append("torch.compile regions")
    return "; ".join(parts)


def breakdown_table(f: RunFacts) -> Table | None:
    if not f.gpu_present:
        return None
    t = f.timeline
    if t.clock_parts_ms:
        return clock_table(f)
    w = t.gpu_window_ms or 0.0
    t_rows = [
        ["compute", ms(t.compute_ms), pct(100 * t.compute_ms / w if w else None)],
    ]
    for kind, v in sorted(f.exposed_comm.by_kind.items(), key=lambda kv: -kv[1]):
        t_rows.append([f"exposed {kind.replace('_', '-')}", ms(v), pct(100 * v / w if w else None)])
    t_rows.append(["exposed memcpy/memset", ms(t.memcpy_ms), pct(100 * t.memcpy_ms / w if w else None)])
    if t.other_steps_ms > 0.0005 * w:
        t_rows.append(
            [
                "other steps' GPU work (GPU behind the CPU)",
                ms(t.other_steps_ms),
                pct(100 * t.other_steps_ms / w if w else None),
            ]
        )
    t_rows += [
        ["idle (nothing running)", ms(t.idle_ms), pct(100 * t.idle_ms / w if w else None)],
        ["GPU step window", ms(w), "100%"],
    ]
    note = f"step time {ms(f.steps.mean_ms)} (shares 'of the step' in findings are of it); CPU step span {ms(t.cpu_step_ms)}"
    return Table(
        "Where a step's GPU window goes (mean per step over ranks; shares of the GPU window)",
        ["part", "time", "share"],
        t_rows,
        note,
    )


CLOCK_ROWS = {
    "compute": "compute",
    "exposed_comm": "exposed communication",
    "memcpy": "exposed memcpy/memset",
    "other_steps": "other steps' GPU work",
    "idle": "idle (nothing running)",
}


def clock_table(f: RunFacts) -> Table:
    """The step time split on the step clock (each step's interval ends at its completion), so
    that its shares are shares of the step; the GPU window, which can run into later steps'
    intervals, is said beside it."""
    t = f.timeline
    step = sum(t.clock_parts_ms.values())
    rows = [
        [label, ms(t.clock_parts_ms.get(k, 0.0)), pct(100 * t.clock_parts_ms.get(k, 0.0) / step if step else None)]
        for k, label in CLOCK_ROWS.items()
    ]
    rows.append(["step time", ms(step), "100%"])
    w = t.gpu_window_ms or 0.0
    note = (
        "each step's interval of one step time, ending when the step completes (its CPU span and the GPU "
        f"work it launched done); CPU step span {ms(t.cpu_step_ms)}. The GPU window of a step's own work "
        f"(first to last GPU activity it launched) is {ms(w)}"
    )
    if w > 1.05 * step:
        note += (
            f", longer than the step: the GPU runs behind the CPU ({ms(t.gpu_behind_ms)} at the last step), so "
            "consecutive steps' windows overlap and the window is no measure of the step"
        )
    return Table(
        "Where a step's time goes on the GPU (mean per step over ranks; shares of the step time)",
        ["part", "time", "share"],
        rows,
        note + ".",
    )


def no_collectives(f: RunFacts) -> str:
    """One line saying why there is no communication to show, "" when there is some."""
    if not f.rank_facts or f.collectives:
        return ""
    ws = f.world_size or len(f.ranks)
    why = (
        "one GPU: FSDP has nothing to gather or reduce across ranks"
        if ws == 1
        else "the traces record no NCCL/Gloo kernels"
    )
    return f"no collectives in the traces (world size {ws}; {why})"


def phase_table(f: RunFacts) -> Table | None:
    if not f.gpu_present or f.exposed_comm.mean_ms_per_step is None:
        return None
    if no_collectives(f):  # the collectives table says why
        return None
    rows = [[p, ms(v)] for p, v in f.exposed_comm.by_phase.items() if v > 0 or p != "other"]
    roles = {k: v for k, v in f.exposed_comm.by_role.items() if v > 0}
    if len(roles) > 1:  # several process groups (HSDP, TP, ...): say which one the time is on
        rows += [[f"group: {k.replace('_', ' ')}", ms(v)] for k, v in roles.items()]
    return Table("Exposed communication by phase (per step)", ["phase", "exposed"], rows)


def collectives_table(f: RunFacts) -> Table | None:
    if not f.collectives:
        why = no_collectives(f)
        return Table("Collectives (per step, mean over ranks)", [], [], why) if why else None
    rows = []
    for c in f.collectives:
        # communication outside NCCL and gloo is named: DeepEP, NVSHMEM, RCCL, symmetric memory …
        libs = [lib for lib in c.libraries if lib not in ("NCCL", "gloo", "unknown")]
        held = f", {c.sms} SMs" if libs and c.sms else ""
        rows.append(
            [
                c.kind.replace("_", "-") + (f" ({', '.join(libs)}{held})" if libs else ""),
                f"{c.count_per_step:.1f}",
                mib(c.bytes_per_step),
                ms(c.gpu_ms_per_step) if f.gpu_present else "–",
                ms(c.exposed_ms_per_step) if f.gpu_present else "–",
                ms(c.transfer_ms_per_step),
                gbps(c.mean_busbw_gbps),
                gbps(c.pure_busbw_gbps),
            ]
        )
    return Table(
        "Collectives (per step, mean over ranks)",
        ["kind", "count", "bytes", "GPU time", "exposed", "transfer", "bw+wait", "bw pure"],
        rows,
        bandwidth_note(f),
    )


def gbps(v: float | None) -> str:
    """A bus bandwidth in GB/s, unit in the column's header."""
    if v is None:
        return "–"
    return f"{v:.1f}" if v >= 0.95 else f"{v:.2f}"


def bandwidth_note(f: RunFacts) -> str:
    """What the two bus bandwidths are, and why the pure one is missing where it is."""
    dtypes = "; ".join(f"{c.kind.replace('_', '-')} {', '.join(c.dtypes)}" for c in f.collectives if c.dtypes)
    if not f.gpu_present:
        return f"Dtypes: {dtypes}." if dtypes else ""
    line = (
        "GPU time holds each rank's wait for the last rank to arrive; transfer is the time after "
        "the last arrival (each rank's kernel end − the last rank's kernel start, mean over ranks). "
        "Bus bandwidth (nccl-tests convention) in GB/s, over the whole kernel (bw+wait) and over the transfer alone (bw pure)"
    )
    cr = f.cross_rank
    if cr is None or not cr.transfer_collectives:
        # one rank's file, or ranks missing from every collective's group: the last arrival is unknown
        line += "; the pure figures need every rank's trace"
    elif cr.transfer_clock_skipped:
        n = cr.transfer_clock_skipped
        line += (
            f"; {n} collective{'s' if n != 1 else ''} left out of them: "
            "the ranks' kernels end before the last arrival (the hosts' clocks disagree)"
        )
    return line + "." + (f" Dtypes: {dtypes}." if dtypes else "")


def units_table(f: RunFacts, limit: int = 12) -> Table | None:
    units = f.fsdp.units
    if not units:
        return None
    if no_collectives(f):
        return Table(
            f"FSDP units ({f.fsdp.unit_source})",
            [],
            [],
            f"{len(units)} units, no all-gathers or reduce-scatters to show (no collectives in the traces)",
        )
    rows = []
    for u in units[:limit]:
        rows.append(
            [
                str(u.index),
                (u.fqn or "(root)") + (f" [{u.param_groups} param groups]" if u.param_groups > 1 else ""),
                f"{u.forward_all_gathers + u.backward_all_gathers:.1f}",
                mib(u.all_gather_bytes),
                f"{u.reduce_scatters:.1f}",
                mib(u.reduce_scatter_bytes),
                ms(u.all_gather_exposed_ms + u.reduce_scatter_exposed_ms) if f.gpu_present else "–",
            ]
        )
    note = f"… and {len(units) - limit} more units" if len(units) > limit else ""
    return Table(
        f"FSDP units ({f.fsdp.unit_source})",
        ["#", "module", "AG/step", "AG bytes", "RS/step", "RS bytes", "exposed"],
        rows,
        note,
    )


def ranks_table(f: RunFacts) -> Table | None:
    if len(f.ranks) < 2:
        return None
    rows = []
    cr = f.cross_rank
    straggler = (
        cr.ranks[0].rank
        if cr is not None and cr.ranks and cr.ranks[0].last_arrivals * 2 >= max(cr.collectives_matched, 1)
        else None
    )
    for r in f.all_ranks():
        steps = [s.step_ms for s in r.steps]
        exp = [s.exposed_comm_ms for s in r.steps]
        rows.append(
            [
                str(r.rank),
                ms(sum(steps) / len(steps) if steps else None),
                pct(r.overlap_pct) if r.gpu_present else "–",
                ms(sum(exp) / len(exp) if exp and r.gpu_present else None),
                r.rank_source,
                "straggler: the others wait for it" if r.rank == straggler else "",
            ]
        )
    return Table("Per rank", ["rank", "step", "overlap", "exposed comm", "rank from", "note"], rows)


def strategy_tables(f: RunFacts) -> list[Table]:
    st = f.strategy
    if st is None:
        return []
    rows = []
    for c in st.candidates:
        mark = " ← current" if c.name == st.current else ""
        mark += " ← recommended" if c.name == st.recommended and st.trusted and c.name != st.current else ""
        rows.append(
            [
                c.name + mark,
                mib(c.memory_bytes),
                "yes" if c.fits else "no",
                ms(c.comm_ms),
                ms(c.exposed_ms),
                ms(c.step_ms),
            ]
        )
    return [
        Table(
            "Sharding strategy (estimates per GPU and step)",
            ["strategy", "memory", "fits", "comm", "exposed", "step"],
            rows,
            st.reasoning,
        )
    ]


def compute_table(f: RunFacts) -> Table | None:
    """GEMM + attention kernel time and achieved TFLOP/s by engine, against the device's dense
    peak for that engine's dtype (a roofline's ceiling per kernel family)."""
    c = f.compute
    if c is None or not c.engine_ms_per_step:
        return None
    from fsdpdoctor.analysis.peaks import ENGINE_PEAK_DTYPE, device_peaks

    peaks = (device_peaks(c.device) or ("", {}))[1]
    rows = []
    for e, t in sorted(c.engine_ms_per_step.items(), key=lambda kv: -kv[1]):
        rate = c.engine_tflops.get(e)
        peak = peaks.get(ENGINE_PEAK_DTYPE.get(e, e))
        rows.append(
            [
                vendor_words(c.peak_label, ENGINE_LABEL.get(e, e)),
                ms(t),
                pct(c.dtype_mix.get(e)),
                f"{rate:.1f}" if rate else "–",
                f"{peak:,.0f}" if peak else "–",
                pct(100 * rate / peak) if rate and peak else "–",
            ]
        )
    note = (
        f"{c.model_flops_per_step / 1e9:,.1f} GFLOP per step of matmuls and attention (model; "
        f"{c.recompute_flops_per_step / 1e9:,.1f} recomputed); by phase: "
        + ", ".join(f"{k} {v / 1e9:,.1f}" for k, v in c.flops_by_phase.items())
    )
    if c.source == "names":
        note = "no recorded shapes: kernels and their engines found by the kernels' names, no FLOPs"
    elif c.named_ms_per_step >= 0.005:
        note += (
            f"; {ms(c.named_ms_per_step)} of the kernel time is of kernels found by name that no op with "
            "recorded shapes launched (no FLOPs)"
        )
    return Table(
        "GEMM and attention kernels by engine (per step)",
        ["engine", "time", "share", "TFLOP/s", "peak", "of peak"],
        rows,
        note,
    )


def all_tables(f: RunFacts) -> list[Table]:
    tables = [
        hang_table(f),
        breakdown_table(f),
        compute_table(f),
        phase_table(f),
        collectives_table(f),
        units_table(f),
        ranks_table(f),
    ]
    return waterfall_tables(f) + [t for t in tables if t] + memory_tables(f) + strategy_tables(f)
