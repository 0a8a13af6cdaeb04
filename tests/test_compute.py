"""Compute efficiency (fsdpdoctor.analysis.compute) against the model's arithmetic, torch's own
FLOP counter and the real H100 recordings.

Truths: the recorder's model (``fixtures.record_gpu``: dims, layers, sequence, batch) gives the
matmul and attention FLOPs per step; ``torch.utils.flop_counter.FlopCounterMode`` (run here on
CPU) gives each formula's FLOPs for the same shapes; the step time for MFU comes from the raw
trace (``tests/test_step_clock.py::raw_clock``, plain json); the real bf16 twin gives the saving
the wrong-engine finding must predict.
"""

from __future__ import annotations

import gzip
import json
import re

from pathlib import Path

import pytest
import torch
from torch.utils import flop_counter as fc
from torch.utils.flop_counter import FlopCounterMode

from _suitegen_cache import committed_report
import fsdpdoctor
from fixtures import record_gpu as rg
from fsdpdoctor.analysis.compute import kernel_engine, op_flops
from test_step_clock import raw_clock

GPU = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu"
H200 = "gpu-h200/"  # variants of the H200 set (fixtures/recorded/gpu-h200): TF32, another model
TRAINING = (
    "fsdp2",
    "fsdp2-bf16",
    "fsdp1",
    "ddp",
    "oom",
    "fsdp2-offload",
    H200 + "fsdp2",
    H200 + "fsdp2-bf16",
    H200 + "fsdp2-tf32",
    H200 + "gpt2-bf16",
    H200 + "gpt2-bf16-b96",
)


def _dir(v: str) -> Path:
    return GPU.parent / v if "/" in v else GPU / v


def model_flops(variant: str = "fsdp2") -> dict[str, float]:
    """Per training step, from the recorder's model for ``variant``: every linear is
    2·tokens·in·out forward and twice that backward; SDPA forward 4·B·H·P·D, backward
    10·B·H·P·D (two batched products forward, five backward, as FlopCounterMode counts them) over
    the P = S²/2 (query, key) pairs a causal kernel computes: the recorder calls
    ``scaled_dot_product_attention(q, k, v, is_causal=True)`` (fixtures/record_gpu.py).
    Both recorded models have four linears per block (qkv / c_attn D→3D, proj / c_proj D→D,
    fc1 / c_fc D→4D, fc2 / c_proj 4D→D) and a head D→vocab (GPT2Like's tied to the embedding)."""
    name = variant.rsplit("/", 1)[-1]
    m = rg.GPT2_MODEL if rg.is_gpt2(name) else rg.GPU_MODEL
    _, seq, batch, _ = rg.shape(name)
    dim, layers, vocab = m["dim"], m["n_layers"], m["vocab"]
    hidden = m.get("mlp_ratio", 4) * dim
    heads = m["heads"]
    tokens = batch * seq
    block_w = dim * 3 * dim + dim * dim + dim * hidden + hidden * dim  # qkv, proj, fc1, fc2
    linear_w = layers * block_w + dim * vocab  # + the head
    fwd = 2.0 * tokens * linear_w
    d = dim // heads
    attn_fwd = layers * 4.0 * batch * heads * (seq * seq / 2) * d  # causal: the lower triangle
    return {
        "matmul": 3 * fwd,
        "attention": attn_fwd + 2.5 * attn_fwd,
        "blocks_fwd": 2.0 * tokens * layers * block_w,
        "attn_fwd": attn_fwd,
    }


@pytest.fixture(scope="module")
def run():
    cache: dict[str, object] = {}

    def get(v: str):
        if v not in cache:
            cache[v] = committed_report(_dir(v))  # fsdpdoctor.analyze, once per process (shared: read only)
        return cache[v]

    return get


def _flop_counter(fn) -> float:
    with FlopCounterMode(display=False) as fc:
        fn()
    return float(fc.get_total_flops())


def test_formulas_equal_torchs_flop_counter():
    """Each op's FLOPs from its recorded Input Dims equal torch's FlopCounterMode on the same shapes."""
    a, b = torch.randn(64, 48), torch.randn(48, 32)
    assert op_flops("aten::mm", [[64, 48], [48, 32]]) == _flop_counter(lambda: torch.mm(a, b))
    bias = torch.randn(32)
    assert op_flops("aten::addmm", [[32], [64, 48], [48, 32], [], []]) == _flop_counter(lambda: torch.addmm(bias, a, b))
    x, y = torch.randn(3, 16, 8), torch.randn(3, 8, 5)
    assert op_flops("aten::bmm", [[3, 16, 8], [3, 8, 5]]) == _flop_counter(lambda: torch.bmm(x, y))
    # attention: on CPU SDPA takes a path the counter does not register; its formulas are torch's own
    q, k, v = (2, 4, 32, 16), (2, 4, 24, 16), (2, 4, 24, 16)
    shapes = [list(q), list(k), list(v)]
    for name in ("efficient", "flash", "cudnn"):
        assert op_flops(f"aten::_scaled_dot_product_{name}_attention", shapes) == fc.sdpa_flop_count(q, k, v)
        assert op_flops(
            f"aten::_scaled_dot_product_{name}_attention_backward", [list(q), *shapes]
        ) == fc.sdpa_backward_flop_count(q, q, k, v)
    conv = torch.nn.Conv2d(8, 16, kernel_size=3, stride=2, padding=1, bias=False)
    img = torch.randn(2, 8, 15, 15)
    got = op_flops(
        "aten::convolution",
        [[2, 8, 15, 15], [16, 8, 3, 3], [], [], [], [], [], [], []],
        ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "False", "[0, 0]", "1"],
    )
    assert got == _flop_counter(lambda: conv(img))


def test_causal_attention_counts_the_triangle_the_kernel_computes():
    """``is_causal`` in an attention op's Concrete Inputs (at its ATen schema's position; the
    recorded cuDNN ops below are copied from the H200 GPT-2 trace) halves the square
    FlopCounterMode counts; without it, or with False, the full square stays."""
    q = (96, 12, 512, 64)
    full_f, full_b = fc.sdpa_flop_count(q, q, q), fc.sdpa_backward_flop_count(q, q, q, q)
    fwd = ["", "", "", "", "True", "0.", "True", "False", ""]
    bwd = ["", "", "", "", "", "", "", "", "", "", "", "512", "512", "0.", "True", ""]
    assert op_flops("aten::_scaled_dot_product_cudnn_attention", [list(q)] * 3, fwd) == full_f / 2
    assert op_flops("aten::_scaled_dot_product_cudnn_attention_backward", [list(q)] * 5, bwd) == full_b / 2
    assert op_flops("aten::_scaled_dot_product_cudnn_attention", [list(q)] * 3, fwd[:6] + ["False"] + fwd[7:]) == full_f
    assert op_flops("aten::_scaled_dot_product_cudnn_attention", [list(q)] * 3) == full_f
    flash = ["", "", "", "0.", "True", "False", ""]  # (q, k, v, dropout_p, is_causal, return_debug_mask, scale)
    assert op_flops("aten::_scaled_dot_product_flash_attention", [list(q)] * 3, flash) == full_f / 2
    # queries beyond the keys (top-left aligned mask): Sk²/2 + (Sq − Sk)·Sk pairs of Sq·Sk
    qq, kk = (1, 1, 96, 64), (1, 1, 32, 64)
    pairs = sum(min(i + 1, 32) for i in range(96))  # the mask's ones, counted
    got = op_flops("aten::_scaled_dot_product_flash_attention", [list(qq), list(kk), list(kk)], flash)
    assert got == pytest.approx(fc.sdpa_flop_count(qq, kk, kk) * pairs / (96 * 32), rel=0.02)


@pytest.mark.parametrize("variant", TRAINING)
def test_flops_per_step_equal_the_models_arithmetic(variant, run):
    c = run(variant).facts.compute
    want = model_flops(variant)
    assert c.matmul_flops_per_step == pytest.approx(want["matmul"], rel=0.01)
    assert c.attention_flops_per_step == pytest.approx(want["attention"], rel=0.01)
    assert c.recompute_flops_per_step == 0.0
    assert c.flops_by_phase["forward"] == pytest.approx((want["matmul"] / 3) + want["attn_fwd"], rel=0.01)


@pytest.mark.parametrize("variant", ["fsdp2-ac", H200 + "gpt2-bf16-b96-ac"])
def test_checkpointing_recompute_is_hardware_not_model_flops(variant, run):
    """The checkpointed runs (fp32 on the H100; bf16, GPT-2's names, on the H200) recompute every
    block's forward (not the head) inside backward."""
    c = run(variant).facts.compute
    want = model_flops(variant)
    assert c.recompute_flops_per_step == pytest.approx(want["blocks_fwd"] + want["attn_fwd"], rel=0.01)
    assert c.model_flops_per_step == pytest.approx(want["matmul"] + want["attention"], rel=0.01)
    assert c.hfu_pct > c.mfu_pct


def test_engines_and_mfu(run):
    fp32, bf16 = run("fsdp2").facts.compute, run("fsdp2-bf16").facts.compute
    assert fp32.compute_dtype == "fp32-simt" and fp32.dtype_mix["fp32-simt"] > 95
    assert bf16.compute_dtype == "bf16" and bf16.dtype_mix["bf16"] > 95
    assert fp32.tensor_cores and fp32.peak_label == "H100 SXM" and bf16.peak_tflops == 989.0
    # MFU of the bf16 run on the step the raw trace says, against the H100 SXM BF16 dense peak
    step = raw_clock(GPU / "fsdp2-bf16" / "rank0.json.gz")["step_ms"]
    want = model_flops()
    mfu = 100 * (want["matmul"] + want["attention"]) / (step * 1e-3) / 989e12
    assert bf16.mfu_pct == pytest.approx(mfu, rel=0.03)
    # fp32 GEMMs on CUDA cores reach well under the H100's 67 TFLOP/s fp32 peak; bf16 ones far above it
    assert fp32.gemm_tflops < 67 < bf16.gemm_tflops
    # MFU is against the BF16 dense peak whatever the dtype (PaLM / torchtitan): the fp32 run is at
    # ≈4.7% of it; against its own fp32 peak (for information) near 70%
    step32 = raw_clock(GPU / "fsdp2" / "rank0.json.gz")["step_ms"]
    assert fp32.peak_tflops == 989.0 and fp32.peak_dtype == "bf16"
    assert fp32.mfu_pct == pytest.approx(
        100 * (want["matmul"] + want["attention"]) / (step32 * 1e-3) / 989e12, rel=0.03
    )
    assert fp32.dtype_peak == "fp32" and fp32.dtype_peak_tflops == 67.0
    assert fp32.dtype_mfu_pct == pytest.approx(fp32.mfu_pct * 989 / 67, rel=1e-9)


@pytest.mark.parametrize("variant", ["fsdp2", "fsdp1", "fsdp2-ac", "oom"])
def test_wrong_engine_is_the_first_finding_of_the_fp32_runs(variant, run):
    rep = run(variant)
    # (the oom run crashed: its OOM leads the ticket — what made the run crash comes first, #24)
    first = [f for f in rep.findings if f.slug != "oom"][0]
    assert first.slug == "matmul-wrong-engine", [f.slug for f in rep.findings]
    fix = first.fix
    want = "fsdp1" if variant == "fsdp1" else "fsdp2"  # the fix for the FSDP version the trace shows, only
    assert list(fix) == [want] and "MixedPrecision" in fix[want] and "allow_tf32" in fix[want]


@pytest.mark.parametrize("device", ["", H200])
def test_wrong_engine_saving_against_the_real_twin(device, run):
    """fsdp2 → fsdp2-bf16 really goes from ≈72 to ≈34 ms on the H100 and from ≈71 to ≈25 ms on
    the H200 (the bf16 run turns CPU-bound): the replayed saving is within 25% of that."""
    fp32, bf16 = device + "fsdp2", device + "fsdp2-bf16"
    real = raw_clock(_dir(fp32) / "rank0.json.gz")["step_ms"] - raw_clock(_dir(bf16) / "rank0.json.gz")["step_ms"]
    f = next(x for x in run(fp32).findings if x.slug == "matmul-wrong-engine")
    assert f.saving_basis == "replay"
    assert f.est_saving_ms == pytest.approx(real, rel=0.25)
    assert "matmul-wrong-engine" not in {x.slug for x in run(bf16).findings}


def test_tf32_runs_the_gemms_on_tensor_cores_and_attention_on_cuda_cores(run):
    """allow_tf32 = True (the recorder's fsdp2-tf32, the fp32 run's twin on the same H200): every
    GEMM kernel runs on TF32 tensor cores, faster than CUDA cores can (the H200's fp32 peak is
    67 TFLOP/s); SDPA on fp32 inputs takes the memory-efficient kernel, on CUDA cores whatever
    TF32 says; in the bf16 runs attention is on tensor cores too. MFU is against the BF16 dense
    peak (989 TFLOP/s) on the step the raw trace says (≈10%), the TF32 figure (495) kept apart."""
    c = run(H200 + "fsdp2-tf32").facts.compute
    # (the attention ops' few other kernels, of no known engine, are "fp32")
    assert set(c.attention_engine_ms_per_step) <= {"fp32-simt", "fp32"}
    assert c.attention_engine_ms_per_step["fp32-simt"] >= 0.9 * sum(c.attention_engine_ms_per_step.values())
    gemm_engines = {e: t - c.attention_engine_ms_per_step.get(e, 0.0) for e, t in c.engine_ms_per_step.items()}
    assert gemm_engines["tf32"] >= 0.95 * sum(gemm_engines.values())
    assert c.engine_tflops["tf32"] > 67
    assert c.compute_dtype == "tf32" and c.peak_tflops == 989.0 and c.peak_label == "H200"
    assert c.dtype_peak == "tf32" and c.dtype_peak_tflops == 495.0
    step = raw_clock(_dir(H200 + "fsdp2-tf32") / "rank0.json.gz")["step_ms"]
    want = model_flops("fsdp2-tf32")
    assert c.mfu_pct == pytest.approx(100 * (want["matmul"] + want["attention"]) / (step * 1e-3) / 989e12, rel=0.03)
    assert 9.0 < c.mfu_pct < 11.0
    assert c.dtype_mfu_pct == pytest.approx(
        100 * (want["matmul"] + want["attention"]) / (step * 1e-3) / 495e12, rel=0.03
    )
    fp32 = run(H200 + "fsdp2").facts.compute
    assert set(fp32.attention_engine_ms_per_step) <= {"fp32-simt", "fp32"} and "tf32" not in fp32.engine_ms_per_step
    for v in ("fsdp2-bf16", "gpt2-bf16"):
        assert set(run(H200 + v).facts.compute.attention_engine_ms_per_step) == {"bf16"}, v


@pytest.mark.parametrize("variant", ["gpt2-bf16", "gpt2-bf16-b96", "gpt2-bf16-b96-ac"])
def test_gpt2_mfu_on_the_raw_step(variant, run):
    """Another model (GPT-2's names, 6 × 768, a tied head), bf16: batch 16 over a 5-step window
    (CPU-bound, MFU ≈8%), batch 96 (the GPU busy most of the step, MFU ≈33%) and batch 96
    checkpointed (HFU counts the recompute, MFU does not): against the H200's BF16 dense peak on
    the step the raw trace says."""
    c = run(H200 + variant).facts.compute
    step = raw_clock(_dir(H200 + variant) / "rank0.json.gz")["step_ms"]
    want = model_flops(variant)
    model = want["matmul"] + want["attention"]
    recompute = want["blocks_fwd"] + want["attn_fwd"] if variant.endswith("-ac") else 0.0
    assert c.compute_dtype == "bf16" and c.peak_tflops == 989.0
    assert c.mfu_pct == pytest.approx(100 * model / (step * 1e-3) / 989e12, rel=0.03)
    assert c.hfu_pct == pytest.approx(100 * (model + recompute) / (step * 1e-3) / 989e12, rel=0.03)


def test_compare_names_the_engine_change(run):
    from fsdpdoctor.analysis.compare import compare

    c = compare(run("fsdp2-bf16").facts, run("fsdp2").facts)
    assert c.primary_cause == "matmul-wrong-engine"


@pytest.mark.parametrize(
    "name,dtype,engine",
    [
        ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x256_8x4_nt_align1>(Params)", "fp32", "fp32-simt"),
        (
            "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute_kernel__5x_cublas",
            "fp32",
            "fp32-simt",
        ),
        (
            "fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, cutlass::arch::Sm80>)",
            "fp32",
            "fp32-simt",
        ),
        ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>(Params)", "fp32", "tf32"),
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "bf16", "bf16"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "bf16", "bf16"),
        ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_64x3_nn", "fp16", "fp16"),
        ("Cijk_Alik_Bljk_BBS_BH_MT128x128x32_MI32x32x8x1_SN", None, "bf16"),
    ],
)
def test_kernel_engines_from_real_names(name, dtype, engine):
    assert kernel_engine(name, dtype) == engine


def test_public_traces_with_shapes_get_flops(shared_traces):
    """The MI300X DDP run (ResNet with activation checkpointing; convolutions counted with their
    recorded strides) and the B200 vLLM run have shapes: both get FLOPs and an MFU."""
    for path in (
        shared_traces / "tracelens-mi300-ddp" / "resnet_act_checkpoint.json.gz",
        shared_traces / "tracelens-b200-vllm" / "eager_trace.json.gz",
    ):
        c = fsdpdoctor.analyze(path).facts.compute
        assert c is not None and c.flops_per_step > 0 and c.mfu_pct is not None, path
    c = fsdpdoctor.analyze(shared_traces / "tracelens-mi300-ddp" / "resnet_act_checkpoint.json.gz").facts.compute
    assert c.peak_label == "MI300X" and c.recompute_flops_per_step > 0  # the checkpointed convolutions


@pytest.mark.parametrize("name", ["healthy-fsdp2", "fp32-collectives", "ac-fsdp2", "ga-fsdp2", "healthy-fsdp1", "ddp"])
def test_generated_runs_flops_equal_the_generators_truth(name, scenario_case):
    """The generator writes record_shapes' Input Dims / Input type on its matmul and attention ops;
    its truth (the model's arithmetic, gen.flops_truth) is what fsdpdoctor must count."""
    rep, truth = scenario_case(name)
    want = truth["model"]["flops_per_step"]
    c = rep.facts.compute
    assert c is not None
    assert c.flops_per_step == pytest.approx(want["matmul"] + want["attention"] + want["recompute"], rel=1e-6)
    assert c.model_flops_per_step == pytest.approx(want["matmul"] + want["attention"], rel=1e-6)
    assert c.recompute_flops_per_step == pytest.approx(want["recompute"], rel=1e-6)
    # MFU on the generator's step time against the H100 SXM's dense BF16 peak, whatever dtype the
    # generated run used (the generator writes an "NVIDIA H100 80GB HBM3" device)
    steps = [s["step_time_ms"] for r in truth["ranks"].values() for s in r["steps"]]
    step = sum(steps) / len(steps)
    assert c.mfu_pct == pytest.approx(100 * (want["matmul"] + want["attention"]) / (step * 1e-3) / 989e12, rel=0.01)


_GEMM_OR_ATTENTION = re.compile(r"gemm|nvjet|fmha|sdpa|flash|attention|xmma", re.I)


def _raw_other_kernels_ms(path) -> float:
    """Per step, the summed time of the compute kernels the steps launched that are neither a
    GEMM nor attention (by kernel name), read from the raw trace with plain json."""
    with gzip.open(path, "rt") as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    spans = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep#")
    ]
    launch = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {})
    }
    total = 0.0
    for e in events:
        if e.get("cat") != "kernel" or "nccl" in e["name"].lower() or _GEMM_OR_ATTENTION.search(e["name"]):
            continue
        t = launch.get((e.get("args") or {}).get("correlation"))
        if t is not None and any(a <= t < b for a, b in spans):
            total += e["dur"]
    return total / 1e3 / len(spans)


def test_compare_splits_the_compute_change(run, generated_run, analyzed_run):
    """compare's compute split, its parts adding up to the GPU compute change: the bf16 → fp32 pair
    is the engine; fsdp2 → fsdp2-ac is the recompute (the recomputed kernels' own time); a
    generated pair whose batch doubles is FLOPs (the generator's FLOPs truth doubles)."""
    import dataclasses

    from fixtures.scenarios import generator as gen
    from fsdpdoctor.analysis.compare import compare

    b, a = run("fsdp2-bf16").facts, run("fsdp2").facts
    c = compare(b, a)
    # the part that is not GEMM or attention (other_kernels, measured on its own kernels) against
    # the raw traces: the change in the time of every other compute kernel the steps launched
    other = _raw_other_kernels_ms(GPU / "fsdp2" / "rank0.json.gz") - _raw_other_kernels_ms(
        GPU / "fsdp2-bf16" / "rank0.json.gz"
    )
    assert c.compute_split["other_kernels"] == pytest.approx(other, rel=0.1, abs=0.3)
    assert c.compute_split["engine"] > 0.9 * (a.timeline.compute_ms - b.timeline.compute_ms)
    b, a = run("fsdp2").facts, run("fsdp2-ac").facts
    c = compare(b, a)
    assert c.compute_split["recompute"] > 0.9 * (a.timeline.compute_ms - b.timeline.compute_ms)
    base = gen.PRESETS["healthy-fsdp2"]
    d0 = generated_run(base)
    d1 = generated_run(dataclasses.replace(base, batch_size=2 * base.batch_size))
    t0, t1 = gen.read_truth(d0)["model"]["flops_per_step"], gen.read_truth(d1)["model"]["flops_per_step"]
    assert t1["matmul"] == pytest.approx(2 * t0["matmul"])
    b, a = analyzed_run(base)[0].facts, analyzed_run(dataclasses.replace(base, batch_size=2 * base.batch_size))[0].facts
    c = compare(b, a)
    gemm_delta = (a.compute.gemm_ms_per_step + a.compute.attention_ms_per_step) - (
        b.compute.gemm_ms_per_step + b.compute.attention_ms_per_step
    )
    assert c.compute_split["flops"] == pytest.approx(gemm_delta, rel=0.1)
