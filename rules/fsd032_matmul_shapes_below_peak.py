"""What it detects
    Matmuls whose shapes keep them far below the tensor cores' peak: dimensions that are not
    multiples of 64 (a vocabulary of 50,257), or products too small to fill the GPU, on a run whose
    other matmuls do run near it.

Why it hurts
    Tensor-core GEMMs work in tiles (64 or 128 wide); a dimension that is not a multiple pads its
    last tile with wasted work or falls back to slower kernels, and a small product leaves most of
    the GPU's multiprocessors idle. The same FLOPs then take longer than they need to.

How it shows in a trace
    The waterfall's ``matmul_below_peak`` part is material, and the shapes furthest below the peak
    (``efficiency.gemm_shapes``, from the ops' recorded ``Input Dims``) are flagged: dimensions
    not multiples of 64, or under 0.27 GFLOP a call; their achieved TFLOP/s against the run's
    other matmuls'.

Fix
    Pad the dimension to a multiple of 64 (128 for the vocabulary: ``vocab = (vocab + 127) // 128 * 128``,
    as GPT-NeoX and nanoGPT do), choose hidden sizes that are multiples of 64, and give small
    matmuls more rows (a larger micro-batch or sequence).

Known problems
    The saving prices the flagged shapes at the achieved rate of the run's unflagged matmuls:
    larger padded shapes run close to that, small ones may not. It is held to a generated twin
    (preset ``vocab-unpadded``: GPT-2's vocabulary of 50,257 against the same run padded to
    50,304): 1.90 ms per step faster, estimated 1.82 ms (0.96x, both regimes); the padded shape's
    extra columns (its larger softmax) are not priced. Its range states no span of its own (no
    assumption is varied): small shapes may reach less than the reference rate.
"""

import statistics

from fsdpdoctor.fmt import ms, pct

from ._util import finding, fix_for, of_step, step_ms

CODE = "FSD032"
SLUG = "matmul-shapes-below-peak"
TITLE = "Matmul shapes that keep the tensor cores below their peak"
SEVERITY = "warning"
THRESHOLDS = ("waterfall_min_part_pct", "gemm_flagged_min_pct", "wrong_engine_min_pct", "severity_warning_pct")

EXPLAINS = {"gpu": [("compute", None)], "cpu": []}
CLAIM_PRIORITY = 45
SUPERSEDED_BY = ("matmul-wrong-engine",)

FIX = """# dimensions in multiples of 64; the vocabulary in multiples of 128 (pad the embedding and the head)
vocab_padded = (vocab_size + 127) // 128 * 128
model = Transformer(vocab_size=vocab_padded, dim=dim)    # logits beyond vocab_size are never targets
# small matmuls: more rows per product (a larger micro-batch or sequence where memory allows)
"""


def check(facts, cfg):
    e = facts.efficiency
    c = facts.compute
    step = step_ms(facts)
    if e is None or c is None or not e.gemm_shapes or not e.peak_tflops or not step:
        return []
    fp32 = c.dtype_mix.get("fp32-simt", 0.0) + c.dtype_mix.get("fp32", 0.0)
    if fp32 >= cfg["wrong_engine_min_pct"]:
        return []  # matmuls on the wrong engine: matmul-wrong-engine's
    below = e.parts_ms["matmul_below_peak"]
    if 100 * below / step < cfg["waterfall_min_part_pct"]:
        return []
    flagged = [g for g in e.gemm_shapes if g.flags and g.tflops]
    plain = [g.tflops for g in e.gemm_shapes if not g.flags and g.tflops]
    ref = statistics.median(plain) if plain else c.gemm_tflops
    if not flagged or not ref:
        return []
    saving = min(sum(max(g.ms_per_step - g.gflop_per_step / ref, 0.0) for g in flagged), below)
    lost = sum(g.below_peak_ms for g in flagged)
    if 100 * lost / step < cfg["gemm_flagged_min_pct"] or 100 * saving / step < cfg["severity_warning_pct"]:
        return []
    evidence = [
        f"matmuls below the {e.peak_tflops:,.0f} TFLOP/s dense BF16 peak: {ms(below)} per step = {of_step(facts, below)}"
    ]
    for g in flagged[:5]:
        evidence.append(
            f"{g.op} {g.shape} ({g.dtype or '?'}, {g.calls_per_step:g} a step): {g.tflops:,.0f} TFLOP/s, "
            f"{ms(g.below_peak_ms)} below peak; {'; '.join(g.flags)}"
        )
    evidence.append(
        f"the run's other matmuls reach {ref:,.0f} TFLOP/s ({pct(100 * ref / e.peak_tflops)} of the peak): "
        "the flagged shapes at that rate save the estimate"
    )
    g0 = flagged[0]
    return [
        finding(
            __name__,
            f"{len(flagged)} matmul shape{'s' if len(flagged) > 1 else ''} run{'' if len(flagged) > 1 else 's'} far below the "
            f"tensor cores' peak ({g0.op} {g0.shape} at {g0.tflops:,.0f} TFLOP/s: {'; '.join(g0.flags)}).",
            evidence=evidence,
            cause="matmul dimensions that are not multiples of 64, or products too small to fill the GPU",
            fix=fix_for(facts, fsdp1=FIX, fsdp2=FIX, ddp=FIX, training=FIX, inference=FIX),
            confidence=0.5,
            est_saving_ms=saving,
            where={"shape": f"{g0.op} {g0.shape}"},
        )
    ]
