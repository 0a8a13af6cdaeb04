"""Kernels classified by their names (issue #36 item 6): low-precision GEMMs and attention that no
op with recorded shapes launched, collectives outside NCCL, fp32 GEMMs of a trace without shapes.

Truths are read from the raw traces with plain gzip / json (kernel names, durations, counts,
launch times), never with fsdpdoctor's own code:

* tracelens-b200-vllm (gpt-oss on 8 B200s, vLLM, 1 rank, one whole-trace step): TensorRT-LLM's
  MoE GEMMs ``bmm_<out>_MxE2m1MxE4m3_Fp32…`` (MXFP4 weights × MXFP8 activations; the first dtype
  is the output's: MXFP8 for the fused SwiGLU FC1, bf16 for FC2), FP8 paged attention
  ``fmhaSm100aKernel_QkvE4m3…``, NVLS all-reduces ``multimem_all_reduce_kernel`` (symmetric memory).
* hta-df-index-v100 (V100, DDP, 5 ProfilerSteps, no ``Input Dims``): fp32 ``volta_sgemm_*``.
"""

from __future__ import annotations

import gzip
import json
import re

import pytest

import fsdpdoctor
from fsdpdoctor.analysis.compute import engine_in_name, kernel_class
from fsdpdoctor.report.sections import mfu_text


def _events(path) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        return [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]


def _kernels(events) -> list[dict]:
    return [e for e in events if e.get("cat") == "kernel"]


def _union_ms(spans) -> float:
    tot, end = 0.0, None
    start = None
    for a, b in sorted(spans):
        if end is None or a > end:
            if end is not None:
                tot += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        tot += end - start
    return tot / 1e3


_CACHE: dict[str, tuple] = {}  # each trace analysed and read once per session


@pytest.fixture
def vllm(shared_traces):
    if "vllm" not in _CACHE:
        path = shared_traces / "tracelens-b200-vllm" / "eager_trace.json.gz"
        _CACHE["vllm"] = (fsdpdoctor.analyze(path).facts, _kernels(_events(path)))
    return _CACHE["vllm"]


MX_GEMM = re.compile(r"^bmm_\w+?_MxE2m1MxE4m3_Fp32_")
FP8_ATTN = re.compile(r"^fmha\w*QkvE4m3")


def test_vllm_mxfp4_gemms_and_fp8_attention_are_counted_by_engine(vllm):
    """The MoE GEMMs (about half of the GEMM-like time) are FP4 × FP8 tensor-core GEMMs, the
    fmha kernels FP8 attention: the time by engine holds them, to the raw sums."""
    facts, kernels = vllm
    assert len(facts.rank_facts[0].steps) == 1  # one whole-trace step: per step = in the trace
    mx = sum(e["dur"] for e in kernels if MX_GEMM.match(e["name"])) / 1e3
    attn = sum(e["dur"] for e in kernels if FP8_ATTN.match(e["name"])) / 1e3
    nvjet = sum(e["dur"] for e in kernels if e["name"].startswith("nvjet")) / 1e3  # the bf16 addmm / mm GEMMs
    assert mx == pytest.approx(5.215, abs=0.01) and attn == pytest.approx(0.486, abs=0.01)
    c = facts.compute
    assert c.engine_ms_per_step["fp4-fp8"] == pytest.approx(mx, abs=1e-3)
    assert c.engine_ms_per_step["fp8"] == pytest.approx(attn, abs=1e-3)
    assert c.attention_engine_ms_per_step["fp8"] == pytest.approx(attn, abs=1e-3)
    assert c.engine_ms_per_step["bf16"] == pytest.approx(nvjet, abs=1e-3)
    assert c.named_ms_per_step == pytest.approx(mx + attn, abs=1e-3)
    total = mx + attn + nvjet
    assert c.dtype_mix["bf16"] == pytest.approx(100 * nvjet / total, abs=0.05)
    assert c.dtype_mix["fp4-fp8"] == pytest.approx(100 * mx / total, abs=0.05)
    assert c.compute_dtype == "fp4-fp8"


def test_vllm_headline_says_which_dtypes_run(vllm):
    """Not "100.0% of GEMM time on BF16 tensor cores": each engine's share, and a note that the
    MFU leaves the kernels without FLOPs out."""
    facts, kernels = vllm
    text = mfu_text(facts)
    assert "100.0% of GEMM time" not in text
    # the shares are of GEMM time (raw JSON: the MX bmm kernels and the bf16 nvjet GEMMs); the FP8
    # attention is named after them
    mx = sum(k["dur"] for k in kernels if MX_GEMM.match(k["name"]))
    bf = sum(k["dur"] for k in kernels if k["name"].startswith("nvjet"))
    m = re.search(
        r"([\d.]+)% of GEMM time on FP4 × FP8, ([\d.]+)% BF16 tensor cores, attention on FP8 tensor cores", text
    )
    assert m, text
    assert float(m.group(1)) == pytest.approx(100 * mx / (mx + bf), abs=0.2)
    assert float(m.group(2)) == pytest.approx(100 * bf / (mx + bf), abs=0.2)
    assert any("MFU counts the FLOPs of the ops with recorded shapes" in n for n in facts.notes)


def test_vllm_moe_gemms_and_fp8_attention_are_matmul_and_attention_in_the_waterfall(vllm):
    """The waterfall's matmul and attention parts hold those kernels (below peak: no FLOPs known),
    not "other kernels"."""
    facts, kernels = vllm
    e = facts.efficiency
    gemm = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if MX_GEMM.match(k["name"]) or k["name"].startswith("nvjet")]
    attn = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if FP8_ATTN.match(k["name"])]
    assert e.matmul_ms == pytest.approx(_union_ms(gemm), abs=0.01)
    assert e.attention_ms == pytest.approx(_union_ms(attn), abs=0.01)


def test_vllm_multimem_all_reduce_is_communication_not_compute(vllm):
    """The 73 NVLS all-reduces are tensor-parallel collectives: counted as all-reduces (their
    time, their bytes from the symm_mem op's shapes) and left out of compute."""
    facts, kernels = vllm
    mm = [k for k in kernels if "multimem_all_reduce_kernel" in k["name"]]
    assert len(mm) == 73
    rf = facts.rank_facts[0]
    ar = [c for c in rf.collectives if c.kind == "all_reduce"]
    assert len(ar) == len(mm)
    assert {c.role for c in ar} == {"tensor_parallel"} and {c.dtype for c in ar} == {"BFloat16"}
    assert sum(c.gpu_dur_us for c in ar) / 1e3 == pytest.approx(sum(k["dur"] for k in mm) / 1e3, abs=1e-3)
    # compute: the union of every kernel but the collectives (NCCL and NVLS)
    comp = [
        (k["ts"], k["ts"] + k["dur"])
        for k in kernels
        if "multimem_all_reduce_kernel" not in k["name"] and not k["name"].startswith("ncclDevKernel")
    ]
    (step,) = rf.steps
    assert step.compute_ms == pytest.approx(_union_ms(comp), abs=0.01)
    assert step.comm_ms >= sum(k["dur"] for k in mm) / 1e3 - 1e-3


def _step_kernels(events) -> list[dict]:
    """Kernels whose launch (the runtime call with the same correlation id) lies in a ProfilerStep."""
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#")]
    launch = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    out = []
    for k in _kernels(events):
        t = launch.get(k.get("args", {}).get("correlation"))
        if t is not None and any(a <= t <= b for a, b in steps):
            out.append(k)
    return out, len(steps)


@pytest.fixture
def v100(shared_traces):
    if "v100" not in _CACHE:
        path = shared_traces / "hta-df-index-v100" / "rank-1.json.gz"
        events = _events(path)
        assert not any("Input Dims" in e.get("args", {}) for e in events)  # no shapes in this trace
        _CACHE["v100"] = (fsdpdoctor.analyze(path), events)
    return _CACHE["v100"]


def test_v100_fp32_sgemm_time_without_shapes(v100):
    rep, events = v100
    kernels, n = _step_kernels(events)
    volta = sum(k["dur"] for k in kernels if k["name"].startswith("volta_sgemm")) / 1e3 / n
    assert volta == pytest.approx(80.04, abs=0.01)  # about 80 of the ~124 ms of compute per step
    # with MAGMA's sgemmEx (0.14 ms per step): every fp32 GEMM on CUDA cores
    sgemm = sum(k["dur"] for k in kernels if "sgemm" in k["name"]) / 1e3 / n
    c = rep.facts.compute
    assert c is not None and c.source == "names" and c.mfu_pct is None
    assert c.engine_ms_per_step["fp32-simt"] == pytest.approx(sgemm, abs=0.01)
    assert c.dtype_mix["fp32-simt"] == pytest.approx(100.0)


def test_v100_matmul_wrong_engine_fires_from_kernel_names_with_fp16_advice(v100):
    """FSD015 from the kernel names; the V100 has neither bf16 nor TF32: fp16 autocast with a
    GradScaler, no bf16 or allow_tf32 in the fix; the saving's basis is said."""
    rep, events = v100
    kernels, n = _step_kernels(events)
    sgemm = sum(k["dur"] for k in kernels if "sgemm" in k["name"]) / 1e3 / n
    f = next(x for x in rep.findings if x.slug == "matmul-wrong-engine")
    assert "fp16" in f.summary and "bf16 mixed precision" not in f.summary
    fix = "\n".join(f.fix.values())
    assert "GradScaler" in fix and "torch.float16" in fix
    assert "bfloat16" not in fix and "allow_tf32" not in fix
    text = " ".join(f.evidence)
    assert "from kernel time at the engines' peak ratio; no shapes in the trace" in text
    # the GPU time it frees: the sgemm time × (1 − 15.7 / 125), the V100's fp32 and fp16 peaks
    assert f"{sgemm * (1 - 15.7 / 125):.2f} ms less GPU time per step" in text
    assert f.saving_kind == "matmul-wrong-engine/names"
    # the replay also halves the fp32 elementwise kernels (fixes.fix_tensor_cores): its line says so
    assert "0.13 and fp32 elementwise kernels at half the bytes" in text
    # the step is CPU-bound (FSD010 leads): freeing GPU time promises nothing here, and says so
    assert f.est_saving_ms is None and f.saving_range_ms is None
    assert "the step is CPU-bound" in text and "no saving estimated" in text
    # the change it would bring is fp16, not bf16 (this GPU has no bf16)
    assert "what fp16 changes on the CPU" in text and "bf16" not in text.replace("no bf16", "")


def test_v100_matmul_wrong_engine_names_the_fp16_peak(shared_traces):
    """On a GPU without bf16, MFU and the replay's tensor-core rate are against its FP16 peak, and
    FSD015 says so: hta-ddp-v100-2022's test rank (V100, shapes recorded: the replay's path). The
    V100's dense FP16 tensor-core peak is 125 TFLOP/s (NVIDIA's V100 SXM2 datasheet), so the
    assumed rate, half of it, is 62 TFLOP/s (62.5, shown to the TFLOP)."""
    path = shared_traces / "hta-ddp-v100-2022" / "test-rank-1.json.gz"
    events = _events(path)
    assert any("Input Dims" in e.get("args", {}) for e in events)  # shapes: FLOPs, the replay's rate
    rep = fsdpdoctor.analyze(path)
    f = next(x for x in rep.findings if x.slug == "matmul-wrong-engine")
    text = " ".join([f.summary, *f.evidence])
    assert "does 125 TFLOP/s of dense FP16 on tensor cores" in text
    assert "of the FP16 dense peak (62 TFLOP/s, assumed)" in text
    assert "MFU" in text and "% of the FP16 dense peak (" in text
    assert "dense BF16" not in text and "BF16 dense" not in text


def test_matmul_wrong_engine_needs_a_material_part_of_the_step(shared_traces):
    """The 2021 TensorBoard-plugin trace (V100, fp32, no shapes): its GEMM kernels (sgemm /
    gemmSN, read here from the raw JSON) take ~0.01 ms of its one 13.4 ms ProfilerStep, under 5%
    of it: whatever engine they run on changes nothing, and FSD015 stays silent. The same rule
    fires on the V100 traces where fp32 GEMMs are a quarter of the step (tests above)."""
    path = shared_traces / "kineto-tbplugin-2021-computeproperties" / "gpu_metrics_input.json"
    with open(path) as fh:
        ev = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    (step,) = [e["dur"] for e in ev if e.get("name", "").startswith("ProfilerStep#")]
    gemm = sum(e["dur"] for e in ev if e.get("cat") == "Kernel" and "gemm" in e["name"].lower())
    assert 0 < gemm < 0.05 * step
    rep = fsdpdoctor.analyze(path)
    assert rep.facts.compute is not None and rep.facts.compute.fp32_share_pct >= 20  # the share alone would fire
    assert not any(f.slug == "matmul-wrong-engine" for f in rep.findings)


@pytest.mark.parametrize(
    "name, cls, engine",
    [
        (
            "bmm_MxE4m3_MxE2m1MxE4m3_Fp32_t128x16x256u2_s3_et128x16_m128x16x32_cga1x1x1_16dp256b_rM_TN",
            "gemm",
            "fp4-fp8",
        ),
        (
            "bmm_Bfloat16_MxE2m1MxE4m3_Fp32_t128x16x256u2_s3_et128x16_m128x16x32_cga1x1x1_16dp256b_rM_TN",
            "gemm",
            "fp4-fp8",
        ),
        ("bmm_E2m1_E2m1E2m1_Fp32_t128x64x256_s6_et128x64_m128x64x64_cga1x1x1_16dp256b_TN_transOut", "gemm", "fp4"),
        ("GemmGatedActKernel_Bfloat16_E4m3_Fp32_tile128x128x256_epilogueTile128x128_mma128x128x32", "gemm", "fp8"),
        ("fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentContext", "attention", "fp8"),
        ("volta_sgemm_128x32_nt", "gemm", "fp32-simt"),
        ("volta_h884gemm_64x64_ldg8_nn", "gemm", "fp16"),
        ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_64x64_32x4_nn_align1>(Params)", "gemm", "tf32"),
        ("nvjet_tst_64x64_64x16_2x1_2cta_v_bz_bias_TNT", "gemm", None),  # the name does not say
        ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, unsigned char>(...)", None, None),
        (
            "void tensorrt_llm::kernels::quantize_with_block_size<(BlockScaleQuantizationType)2, __nv_bfloat16, 32, "
            "true>(int, __nv_bfloat16 const*, flashinfer::QuantizationSFLayout)",
            None,
            None,
        ),
        ("void fbgemm_gpu::permute_2D_data_kernel<false, int, int>(int, int, int const*)", None, None),
    ],
)
def test_kernel_names(name, cls, engine):
    """Real kernel names (the public traces; TensorRT-LLM's generated GEMMs name the output dtype
    first, then the operands: ``bmm_<out>_<A><B>_<accumulator>``)."""
    assert kernel_class(name) == cls
    if cls is not None:
        assert engine_in_name(name) == engine


@pytest.mark.parametrize(
    "name, comm",
    [
        (
            "void (anonymous namespace)::multimem_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, unsigned long)",
            True,
        ),
        ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, int)", True),
        ("void vllm::cross_device_reduce_2stage<float, 8>(vllm::RankData*, vllm::RankSignals, int)", True),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", False),  # NCCL: HTA's own rule
        ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long)", False),
    ],
)
def test_collective_kernels_outside_nccl(name, comm):
    """All-reduce kernels outside NCCL (symmetric memory's NVLS, vLLM's custom all-reduce): names
    HTA's rule (``^nccl``) counts as compute."""
    from fsdpdoctor.analysis.comms import EXTRA_COMM_NAME_RX, kind_from_kernel_name

    assert (EXTRA_COMM_NAME_RX.match(name) is not None) == comm
    if comm:
        assert kind_from_kernel_name(name) == "all_reduce"
