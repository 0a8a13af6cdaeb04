"""Dense peak throughput (TFLOP/s) of the GPUs people train on, per compute dtype.

Matched on the trace's ``deviceProperties`` name (:func:`peak_for`). Figures are the vendors'
dense (no 2:4 sparsity) datasheet numbers, the same torchtitan's ``get_peak_flops`` uses for BF16:

* NVIDIA H100 SXM5 datasheet: FP8 1,979; BF16/FP16 989; TF32 495; FP32 67 (CUDA cores).
* NVIDIA H100 PCIe datasheet: FP8 1,513; BF16/FP16 756; TF32 378; FP32 51.
* NVIDIA H100 NVL datasheet (per GPU): FP8 1,671; BF16/FP16 835; TF32 418; FP32 60.
* NVIDIA H200 SXM datasheet: same Hopper SM counts and clocks as H100 SXM: 1,979 / 989 / 495 / 67.
* NVIDIA B200 (HGX B200 datasheet, per GPU): FP8 4,500; BF16/FP16 2,250; TF32 1,100; FP32 75.
* NVIDIA A100 SXM/PCIe datasheet: BF16/FP16 312; TF32 156; FP32 19.5 (no FP8).
* NVIDIA L40S datasheet: FP8 733; BF16/FP16 362; TF32 183; FP32 91.6.
* NVIDIA V100 SXM2 datasheet: FP16 125 (tensor cores); FP32 15.7 (no BF16, no TF32).
* AMD Instinct MI250X datasheet (per GCD, the device PyTorch sees): BF16/FP16 191.5; FP32
  matrix 47.9; FP32 vector 23.9.
* AMD Instinct MI300X datasheet: FP8 2,615; BF16/FP16 1,307; TF32 654; FP32 matrix 163.4.
"""

from __future__ import annotations

import re

# compute dtypes of a GEMM / attention kernel, as :mod:`.compute` names them
DTYPES = ("fp8", "bf16", "fp16", "tf32", "fp32")
#: the dtype whose peak each engine of :mod:`.compute` is measured against: FP4 × FP8
#: (Blackwell's mixed-operand MMA, ``kind::f8f6f4``) runs at the FP8 rate; FP4 × FP4 has no peak here
ENGINE_PEAK_DTYPE = {
    "fp32-simt": "fp32",
    "fp32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16",
    "fp16": "fp16",
    "fp8": "fp8",
    "fp4-fp8": "fp8",
}

# (pattern on the device name, label, {dtype: dense TFLOP/s}); first match wins (specific first)
PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"H100.*PCIe", "H100 PCIe", {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"H100 NVL", "H100 NVL", {"fp8": 1671.0, "bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    (r"H100", "H100 SXM", {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0}),
    (r"H200", "H200", {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0}),
    (r"B200", "B200", {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    (r"A100", "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", "L40S", {"fp8": 733.0, "bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (r"V100", "V100", {"fp16": 125.0, "fp32": 15.7}),
    (r"MI250X|MI250", "MI250X (per GCD)", {"bf16": 191.5, "fp16": 191.5, "fp32": 47.9}),
    (r"MI300X|MI325X", "MI300X", {"fp8": 2615.0, "bf16": 1307.0, "fp16": 1307.0, "tf32": 654.0, "fp32": 163.4}),
)


def device_peaks(device_name: str | None) -> tuple[str, dict[str, float]] | None:
    """(label, {dtype: TFLOP/s}) for a ``deviceProperties`` name, None when unknown."""
    if not device_name:
        return None
    for rx, label, peaks in PEAKS:
        if re.search(rx, device_name, re.IGNORECASE):
            return label, peaks
    return None


def has_tensor_cores(device_name: str | None) -> bool:
    """Whether the device runs some low-precision GEMM on matrix units much faster than fp32."""
    p = device_peaks(device_name)
    return p is not None and max(p[1].get(d, 0.0) for d in ("bf16", "fp16")) > 2 * p[1].get("fp32", 0.0)
