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

Fix
    FSDP2 ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``;
    FSDP1 ``MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ...)``; DDP or
    plain models ``torch.autocast("cuda", dtype=torch.bfloat16)``; where bf16 is not wanted, TF32
    (``torch.backends.cuda.matmul.allow_tf32 = True`` or
    ``torch.set_float32_matmul_precision("high")``).

Known problems
    The replay moves fp32 GEMM / attention kernels to tensor cores at half the BF16 peak; it does
    not see CPU-side effects of the change. On the H200 TF32 → bf16 twin it predicts nothing where
    the bf16 run was 9.8 ms faster (its CPU span 7.9 ms shorter); on the two fp32 → bf16 twins the
    real saving was 1.08× and 1.28× the prediction (docs/savings.md).
"""

from fsdpdoctor.fmt import ms, pct

from ._util import MIXED_PRECISION_FSDP1, MIXED_PRECISION_FSDP2, finding, fix_for, replay_evidence, replayed_saving

CODE = "FSD015"
SLUG = "matmul-wrong-engine"
TITLE = "Matmuls run in fp32 on CUDA cores, tensor cores idle"
SEVERITY = "warning"
REPLAY_FIX = "tensor_cores"  # the what-if replay transformation its saving comes from (fsdpdoctor.analysis.whatif)
THRESHOLDS = ("wrong_engine_min_pct",)

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
FP32 = ("fp32-simt", "fp32")


def check(facts, cfg):
    c = facts.compute
    if c is None or not facts.gpu_present or not c.tensor_cores:
        return []
    fp32 = c.fp32_share_pct
    if fp32 < cfg["wrong_engine_min_pct"]:
        return []
    fp32_ms = sum(c.engine_ms_per_step.get(e, 0.0) for e in FP32)
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
            f"(CUDA-core kernels such as simt_sgemm / gemm_f32f32…ffma)",
        ]
    if rate and c.peak_tflops:
        evidence.append(
            f"those kernels achieve {rate:.1f} TFLOP/s; the {c.peak_label} does {c.peak_tflops:.0f} TFLOP/s "
            f"of dense BF16 on tensor cores ({100 * rate / c.peak_tflops:.1f}% of it)"
        )
    if c.mfu_pct is not None:
        evidence.append(
            f"MFU {c.mfu_pct:.1f}% of the BF16 dense peak ({c.model_flops_per_step / 1e9:,.0f} GFLOP per "
            f"{ms(c.step_ms)} step)"
        )
    saving = replayed_saving(facts, REPLAY_FIX)
    if saving is not None:
        from fsdpdoctor.analysis.whatif.fixes import TENSOR_CORE_SHARE

        evidence.append(
            replay_evidence(
                facts,
                REPLAY_FIX,
                f"those kernels at {100 * TENSOR_CORE_SHARE:.0f}% of the BF16 dense peak "
                f"({TENSOR_CORE_SHARE * (c.peak_tflops or 0):.0f} TFLOP/s, assumed) and fp32 elementwise kernels at half "
                "the bytes",
            )
        )
    else:
        saving = fp32_ms * 0.8  # the replay is off or absent: most of that kernel time
    if tf32_on:
        return [
            finding(
                __name__,
                f"TF32 is on, but attention runs in fp32 on CUDA cores ({pct(attn_pct)} of GEMM + "
                "attention time): TF32 covers matmuls only; use bf16 mixed precision.",
                evidence=evidence,
                cause="scaled_dot_product_attention on fp32 inputs: flash and cuDNN attention take only bf16 / fp16, so it "
                "falls back to the memory-efficient kernel on CUDA cores, which TF32 does not change",
                fix=fix_for(
                    facts,
                    fsdp2=MIXED_PRECISION_FSDP2,
                    fsdp1=MIXED_PRECISION_FSDP1,
                    ddp=AUTOCAST,
                    training=AUTOCAST,
                    inference=AUTOCAST,
                ),
                confidence=0.85,
                est_saving_ms=saving,
            )
        ]
    return [
        finding(
            __name__,
            f"Matmuls run in fp32 on CUDA cores ({pct(fp32)} of GEMM + attention time) while the {c.peak_label} tensor cores "
            "sit idle: use bf16 mixed precision (or at least TF32).",
            evidence=evidence,
            cause="no MixedPrecisionPolicy / MixedPrecision / autocast, and TF32 off (PyTorch's default for matmuls)",
            fix=fix_for(
                facts, fsdp2=FIX_FSDP2, fsdp1=FIX_FSDP1, ddp=FIX_AUTOCAST, training=FIX_AUTOCAST, inference=FIX_AUTOCAST
            ),
            confidence=0.85,
            est_saving_ms=saving,
        )
    ]
