"""What it detects
    Matrix products (GEMMs) and attention running in fp32 on CUDA cores on a GPU whose tensor
    cores would run them many times faster: no mixed precision, no autocast, TF32 off.

Why it hurts
    An H100 does 67 TFLOP/s of fp32 on CUDA cores and 989 of dense BF16 on tensor cores (495
    TF32). A model trained in fp32 without TF32 leaves the matrix units idle and is usually
    GPU-bound on its matmuls: the step can drop to a third or less.

How it shows in a trace
    GEMM kernels named ``…simt_sgemm…``, ``…gemm_f32f32…ffma…`` (and fp32 memory-efficient
    attention ``fmha_cutlass…f32``) under ``aten::mm`` / ``aten::addmm`` with ``float`` input
    types; achieved TFLOP/s of those kernels near the fp32 peak, far below the BF16 one
    (``RunFacts.compute``: ``dtype_mix``, ``engine_tflops``).

    With TF32 on, the GEMMs run on TF32 tensor cores (``…gemm_f32f32_tf32f32…``) but attention on
    fp32 inputs still runs on CUDA cores: flash and cuDNN attention take only bf16 / fp16, so
    ``scaled_dot_product_attention`` falls back to the memory-efficient kernel, which TF32 does not
    cover (``RunFacts.compute.attention_engine_ms_per_step``). The finding then says so and asks for
    bf16 alone.

    A trace without shapes (no ``Input Dims``) has no FLOPs, but the kernels' names say the
    engine: ``volta_sgemm_*`` / ``ampere_sgemm_*`` / ``*simt*`` / ``*ffma*`` are fp32 on CUDA
    cores, ``*s1688gemm*`` / ``*tf32*`` TF32, ``*h884*`` / ``*hmma*`` / ``*fp16*`` FP16 and
    ``*bf16*`` BF16 tensor cores (``RunFacts.compute.source`` is then "names").

    Only where those fp32 kernels are a material part of the step (``waterfall_min_part_pct``, 5%,
    as for the waterfall's rules): the public 2021 TensorBoard-plugin trace runs its one sgemm for
    0.01 ms of a 13.4 ms step, whose engine changes nothing.

Fix
    FSDP2 ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``;
    FSDP1 ``MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ...)``; DDP or
    plain models ``torch.autocast("cuda", dtype=torch.bfloat16)``; where bf16 is not wanted, TF32
    (``torch.backends.cuda.matmul.allow_tf32 = True`` or
    ``torch.set_float32_matmul_precision("high")``). On a GPU without bf16 (V100: FP16 tensor
    cores, no TF32 either) fp16 with loss scaling: ``torch.autocast("cuda", dtype=torch.float16)``
    with ``torch.amp.GradScaler``, or ``param_dtype=torch.float16`` with FSDP's
    ``ShardedGradScaler``; the TF32 lines are left out where the GPU has no TF32 (before Ampere).

Known problems
    The replay moves fp32 GEMM / attention kernels to tensor cores at half the BF16 peak; it does
    not see CPU-side effects of the change. On the H200 TF32 → bf16 twin it predicts nothing where
    the bf16 run was 9.8 ms faster (its CPU span 7.9 ms shorter); on the two fp32 → bf16 twins the
    real saving was 1.08× and 1.28× the prediction (docs/savings.md).

    Without shapes the kernels are found by name only (``fsdpdoctor.analysis.compute.kernel_class``
    / ``engine_in_name``): a GEMM whose name states no dtype (``nvjet_tst_…``, ``gemmSN_…``) is
    left out of the engine mix, and a GEMM named after none of the known libraries is not seen at
    all. The replay then scales the CUDA-core kernels' time by the ratio of the device's fp32 peak
    to its dense BF16 (FP16) peak (V100: 15.7 / 125), not by FLOPs: the evidence gives the GPU time
    this frees ("from kernel time at the engines' peak ratio; no shapes in the trace"), and the
    saving's range is its own kind (``matmul-wrong-engine/names``, no real twin: ±50%, wider than
    the fp32 → bf16 twins' 1.03–1.33×). Where the replay is off, the saving is that GPU time. On a
    CPU-bound step (hta-df-index-v100) the replay gains nothing until the CPU keeps up, and the
    finding is information only.
"""

from fsdpdoctor.fmt import ms, pct

from ._util import (
    MIXED_PRECISION_FSDP1,
    MIXED_PRECISION_FSDP2,
    finding,
    fix_for,
    replay_evidence,
    replayed_saving,
    step_ms,
)

CODE = "FSD015"
SLUG = "matmul-wrong-engine"
TITLE = "Matmuls run in fp32 on CUDA cores, tensor cores idle"
SEVERITY = "warning"
REPLAY_FIX = "tensor_cores"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = ("wrong_engine_min_pct", "waterfall_min_part_pct")

# compare: when a run's matmuls moved to (off) the tensor cores, the compute change is this
EXPLAINS = {"gpu": [("compute", None)], "cpu": []}
CONFIG_KEYS = ("compute_dtype",)  # it explains a change only when the compute engine changed
CLAIM_PRIORITY = 40

TF32 = """# keep fp32 parameters but run matmuls on tensor cores in TF32 (7x the fp32 FMA rate on Hopper, 8x on Ampere)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
"""
FIX_FSDP2 = MIXED_PRECISION_FSDP2 + "\n" + TF32
FIX_FSDP1 = MIXED_PRECISION_FSDP1 + "\n" + TF32
AUTOCAST = """with torch.autocast("cuda", dtype=torch.bfloat16):   # matmuls and attention on tensor cores
    loss = model(batch).loss
loss.backward()
"""
FIX_AUTOCAST = AUTOCAST + "\n" + TF32
# a GPU with fp16 tensor cores but no bf16 (V100, T4): fp16 needs loss scaling; no TF32 either
AUTOCAST_FP16 = """scaler = torch.amp.GradScaler("cuda")   # fp16 needs loss scaling (this GPU has no bf16)
with torch.autocast("cuda", dtype=torch.float16):   # matmuls on fp16 tensor cores
    loss = model(batch).loss
scaler.scale(loss).backward()
scaler.step(optimizer)
scaler.update()
"""
FSDP2_FP16 = """from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)   # no bf16 on this GPU
for block in model.layers:
    fully_shard(block, mp_policy=mp)
fully_shard(model, mp_policy=mp)
scaler = ShardedGradScaler()   # fp16 needs loss scaling: scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
"""
FSDP1_FP16 = """from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

model = FSDP(model, auto_wrap_policy=policy,   # no bf16 on this GPU: fp16 with loss scaling
             mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32))
scaler = ShardedGradScaler()   # scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
"""
INFERENCE_FP16 = """with torch.autocast("cuda", dtype=torch.float16):   # matmuls on fp16 tensor cores (no bf16 on this GPU)
    out = model(batch)
"""
FP32 = ("fp32-simt", "fp32")


def _engines(c) -> tuple[dict[str, float], bool, bool]:
    """The device's dense peaks by dtype, whether it has bf16 and whether it has TF32 (an unknown
    device: assumed to have both, as the GPUs people train on today do)."""
    p = c.device_peaks_tflops
    if not p:
        return {}, True, True
    return p, "bf16" in p, "tf32" in p


def _peak_name(c) -> str:
    """What MFU and the replay's rate are against: the device's dense BF16 peak, its FP16 one on a
    GPU without BF16 (V100, T4), or the peak given with ``--peak-tflops``."""
    return f"{c.peak_dtype.upper()} dense peak" if c.peak_dtype else "given peak"


def _fixes(facts, bf16: bool, tf32: bool) -> dict[str, str]:
    """The fix for the run's setup and the device's engines: bf16 (and TF32 where it has it), or
    fp16 with loss scaling where it has no bf16."""
    if not bf16:
        return fix_for(
            facts,
            fsdp2=FSDP2_FP16,
            fsdp1=FSDP1_FP16,
            ddp=AUTOCAST_FP16,
            training=AUTOCAST_FP16,
            inference=INFERENCE_FP16,
            lever="mixed_precision_fp16",
        )
    if not tf32:
        return fix_for(
            facts,
            fsdp2=MIXED_PRECISION_FSDP2,
            fsdp1=MIXED_PRECISION_FSDP1,
            ddp=AUTOCAST,
            training=AUTOCAST,
            inference=AUTOCAST,
            lever="mixed_precision",
        )
    return fix_for(
        facts,
        fsdp2=FIX_FSDP2,
        fsdp1=FIX_FSDP1,
        ddp=FIX_AUTOCAST,
        training=FIX_AUTOCAST,
        inference=FIX_AUTOCAST,
        lever="mixed_precision",
    )


def _engine_split(c) -> str:
    """Where the fp32 share splits into kernels named as CUDA-core ones and fp32 kernels whose
    name does not say the engine: "83.5% on CUDA cores by name, 16.5% fp32 of unstated engine"."""
    simt, other = c.dtype_mix.get("fp32-simt", 0.0), c.dtype_mix.get("fp32", 0.0)
    if simt > 0 and other > 0:
        return f"{pct(simt)} on CUDA cores by name, {pct(other)} fp32 kernels whose name does not say the engine"
    return ""


def _where(c) -> str:
    """ "on CUDA cores (83.5% of GEMM + attention time; 16.5% more in fp32 of unstated engine)": the
    shares the headline gives, CUDA-core kernels by name apart from fp32 kernels whose name does
    not say the engine."""
    simt, other = c.dtype_mix.get("fp32-simt", 0.0), c.dtype_mix.get("fp32", 0.0)
    if simt > 0 and other > 0:
        return f"on CUDA cores ({pct(simt)} of GEMM + attention time; {pct(other)} more in fp32 of unstated engine)"
    return f"{'on CUDA cores ' if simt > 0 or not other else ''}({pct(simt + other)} of GEMM + attention time)"


def check(facts, cfg):
    c = facts.compute
    if c is None or not facts.gpu_present or not c.tensor_cores:
        return []
    fp32 = c.fp32_share_pct
    if fp32 < cfg["wrong_engine_min_pct"]:
        return []
    fp32_ms = sum(c.engine_ms_per_step.get(e, 0.0) for e in FP32)
    step = step_ms(facts)
    if step and 100 * fp32_ms / step < cfg["waterfall_min_part_pct"]:
        return []  # too small a part of the step for its engine to matter
    attn_ms = sum(c.attention_engine_ms_per_step.get(e, 0.0) for e in FP32)
    # TF32 on: the GEMMs already use tensor cores; what stays on CUDA cores is fp32 attention
    tf32_on = c.dtype_mix.get("tf32", 0.0) > 0 and attn_ms >= 0.5 * fp32_ms
    attn_pct = fp32 * attn_ms / fp32_ms if fp32_ms else 0.0
    rate = c.engine_tflops.get("fp32-simt") or c.engine_tflops.get("fp32")
    if tf32_on:
        evidence = [
            f"TF32 is on: {pct(c.dtype_mix['tf32'])} of GEMM + attention kernel time runs on TF32 tensor cores "
            f"({ms(c.engine_ms_per_step['tf32'])} per step)",
            f"attention in fp32 on CUDA cores: {ms(attn_ms)} per step = {pct(attn_pct)} of "
            "GEMM + attention kernel time (memory-efficient attention, fmha_cutlass…f32)",
        ]
    else:
        evidence = [
            f"{pct(fp32)} of GEMM + attention kernel time runs in fp32 without tensor cores: {ms(fp32_ms)} per step "
            f"(CUDA-core kernels such as simt_sgemm / gemm_f32f32…ffma)"
            + (f"; {_engine_split(c)}" if _engine_split(c) else ""),
        ]
    peak = _peak_name(c)
    if rate and c.peak_tflops:
        evidence.append(
            f"those kernels achieve {rate:.1f} TFLOP/s; "
            + (
                f"the {c.peak_label} does {c.peak_tflops:.0f} TFLOP/s of dense {c.peak_dtype.upper()} on tensor cores"
                if c.peak_dtype
                else f"the given peak is {c.peak_tflops:.0f} TFLOP/s"
            )
            + f" ({100 * rate / c.peak_tflops:.1f}% of it)"
        )
    if c.mfu_pct is not None:
        evidence.append(
            f"MFU {c.mfu_pct:.1f}% of the {peak} ({c.model_flops_per_step / 1e9:,.0f} GFLOP per {ms(c.step_ms)} step)"
        )
    peaks, bf16, tf32 = _engines(c)
    by_name = c.source == "names"
    saving_kind = ""
    saving = replayed_saving(facts, REPLAY_FIX)
    if by_name:
        # no shapes, no FLOPs: the CUDA-core time at the ratio of the two engines' dense peaks
        tc, f32 = peaks.get("bf16") or peaks.get("fp16"), peaks.get("fp32")
        ratio = f32 / tc if tc and f32 else 0.2
        saving_kind = f"{SLUG}/names"
        evidence[0] = (
            f"{pct(fp32)} of GEMM + attention kernel time runs in fp32: {ms(fp32_ms)} per step "
            "(kernels found by name: sgemm / simt / ffma; the trace has no shapes)"
            + (f"; {_engine_split(c)}" if _engine_split(c) else "")
        )
        basis = (
            f"{f32:g} TFLOP/s fp32 on CUDA cores vs {tc:g} {'BF16' if bf16 else 'FP16'} on tensor cores"
            if tc and f32
            else "an assumed 5x"
        )
        gpu_cut = fp32_ms * (1.0 - ratio)
        evidence.append(
            f"at the engines' peak ratio ({basis}) those kernels would take {ms(fp32_ms * ratio)} instead of "
            f"{ms(fp32_ms)}: {ms(gpu_cut)} less GPU time per step (from kernel time at the engines' peak ratio; "
            "no shapes in the trace, so a wider range than from FLOPs)"
        )
        if saving is not None:
            evidence.append(
                replay_evidence(
                    facts,
                    REPLAY_FIX,
                    f"those kernels' time × {ratio:.2f} and fp32 elementwise kernels at half the bytes",
                )
            )
            if saving < 0.5 * gpu_cut and facts.timeline.bound == "cpu":
                evidence.append(
                    f"the step is CPU-bound: the {ms(gpu_cut)} of GPU time shortens the step only once the CPU "
                    "keeps up with the GPU"
                )
        else:
            saving = gpu_cut
    elif saving is not None:
        from fsdpdoctor.facts.compute import TENSOR_CORE_SHARE

        evidence.append(
            replay_evidence(
                facts,
                REPLAY_FIX,
                f"those kernels at {100 * TENSOR_CORE_SHARE:.0f}% of the {peak} "
                f"({TENSOR_CORE_SHARE * (c.peak_tflops or 0):.0f} TFLOP/s, assumed) and fp32 elementwise kernels at half "
                "the bytes",
            )
        )
    else:
        saving = fp32_ms * 0.8  # the replay is off or absent: most of that kernel time
    if saving is not None and saving < 0.005:
        # the replay finds no saving where the step is bound elsewhere: no "< 0.01 ms" promise
        # (on the H200 TF32 -> bf16 twin the bf16 run was 9.8 ms faster, its CPU span shorter)
        evidence.append(
            f"no saving estimated: the replay moves {ms(fp32_ms)} of fp32 kernel time per step to tensor cores "
            f"without shortening the {'CPU-bound ' if facts.timeline.bound == 'cpu' else ''}step; what {'bf16' if bf16 else 'fp16'} "
            "changes on the CPU (fewer, smaller kernels to launch) is not replayed: measure it"
        )
        saving = None
    if tf32_on:
        return [
            finding(
                __name__,
                f"TF32 is on, but attention runs in fp32 on CUDA cores ({pct(attn_pct)} of GEMM + "
                "attention time): TF32 covers matmuls only; use bf16 mixed precision.",
                evidence=evidence,
                cause="scaled_dot_product_attention on fp32 inputs: flash and cuDNN attention take only bf16 / fp16, so it "
                "falls back to the memory-efficient kernel on CUDA cores, which TF32 does not change",
                fix=_fixes(facts, bf16=True, tf32=False),  # TF32 is on already: bf16, without the TF32 lines
                confidence=0.85,
                est_saving_ms=saving,
                saving_kind=saving_kind,
            )
        ]
    if not bf16:
        advice = "use fp16 mixed precision (autocast with a GradScaler; this GPU has no bf16 and no TF32)."
        cause = "no MixedPrecisionPolicy / MixedPrecision / autocast: the model runs in fp32"
    else:
        advice = "use bf16 mixed precision" + (" (or at least TF32)." if tf32 else ".")
        cause = "no MixedPrecisionPolicy / MixedPrecision / autocast" + (
            ", and TF32 off (PyTorch's default for matmuls)" if tf32 else ""
        )
    return [
        finding(
            __name__,
            f"Matmuls run in fp32 {_where(c)} while the {c.peak_label} tensor cores sit idle: {advice}",
            evidence=evidence,
            cause=cause,
            fix=_fixes(facts, bf16, tf32),
            confidence=0.75 if by_name else 0.85,
            est_saving_ms=saving,
            saving_kind=saving_kind,
        )
    ]
