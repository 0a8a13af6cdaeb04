"""Regenerate the validation of predicted savings on real twins: docs/savings.md and fsdpdoctor/savings/twins.py.

A twin pair is two real recordings in ``fixtures/recorded/`` that differ by one fix. For each,
the saving fsdpdoctor predicts on the run with the problem (the finding's ``model_saving_ms``,
from the what-if replay or the rule's heuristic) is set against the difference of the two runs'
step times, read from the raw traces by the test suite's independent reader
(``tests/test_step_clock.py::raw_clock``: plain ``json``, none of fsdpdoctor's code).

    python benchmarks/savings_table.py           # prints the tables
    python benchmarks/savings_table.py --write   # writes fsdpdoctor/savings/twins.py and docs/savings.md

Run it again after recording a new twin, or after changing a rule's saving or the replay: the
test suite fails while fsdpdoctor/savings/twins.py disagrees with what the tool predicts today.
"""

from __future__ import annotations

import argparse
import re
import datetime
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import fsdpdoctor  # noqa: E402
from fsdpdoctor.savings import device_class, run_family  # noqa: E402
from test_step_clock import raw_clock  # noqa: E402

REC = REPO / "fixtures" / "recorded"
LEVERS = "gpu-h200-levers"  # the twins of the typical run's levers (fixtures/record_gpu_levers.py)

#: (saving kind, rule slug, problem run, fixed run, what the twin showed that the model does not see)
GPU_PAIRS = [
    ("matmul-wrong-engine", "matmul-wrong-engine", "gpu/fsdp2", "gpu/fsdp2-bf16", ""),
    ("matmul-wrong-engine", "matmul-wrong-engine", "gpu-h200/fsdp2", "gpu-h200/fsdp2-bf16", ""),
    (
        "matmul-wrong-engine/tf32",
        "matmul-wrong-engine",
        "gpu-h200/fsdp2-tf32",
        "gpu-h200/fsdp2-bf16",
        "the bf16 twin's CPU span is 7.9 ms shorter; the replay moves only the fp32 attention kernels",
    ),
    ("activation-recompute", "activation-recompute", "gpu/fsdp2-ac", "gpu/fsdp2", ""),
    ("activation-recompute", "activation-recompute", "gpu-h200/gpt2-bf16-b96-ac", "gpu-h200/gpt2-bf16-b96", ""),
    ("cpu-offload-stall", "cpu-offload-stall", "gpu/fsdp2-offload", "gpu/fsdp2", ""),
    ("cpu-offload-stall", "cpu-offload-stall", "gpu/fsdp2-offload-pageable", "gpu/fsdp2", ""),
    # the levers' twins (fixtures/recorded/gpu-h200-levers, another model): the GPU-bound ones only,
    # whose two calls agree (the CPU-bound pairs are in LEVER_PAIRS' table, not in any range)
    (
        "non-matmul-kernels/fusion",
        "non-matmul-kernels",
        f"{LEVERS}/llama-bf16-b64",
        f"{LEVERS}/llama-bf16-b64-compile",
        "",
    ),
    (
        "non-matmul-kernels/optimizer",
        "non-matmul-kernels",
        f"{LEVERS}/llama-bf16-b64",
        f"{LEVERS}/llama-bf16-b64-fused",
        "a fused step saves 3% of this GPU-bound step, below the finding's threshold: the finding is the fusion lever",
    ),
    ("gpu-starved-by-hooks", "gpu-starved-by-hooks", f"{LEVERS}/llama-bf16-b64", f"{LEVERS}/llama-bf16-b64-pairs", ""),
    (
        "matmul-wrong-engine",
        "matmul-wrong-engine",
        f"{LEVERS}/llama-fp32-b64",
        f"{LEVERS}/llama-bf16-b64",
        "the replay's steady steps take ~120 ms where bf16 ran 84.7 (its GEMMs at ~75% of the BF16 peak; the replay assumes 50%)",
    ),
    ("matmul-wrong-engine", "matmul-wrong-engine", f"{LEVERS}/llama-tf32-b64", f"{LEVERS}/llama-bf16-b64", ""),
    (
        "pageable-memcpy/cpu-offload",
        "pageable-memcpy",
        "gpu/fsdp2-offload-pageable",
        "gpu/fsdp2-offload",
        "the pinned twin's CPU AdamW step ran 525 vs 333 ms per step (pinned host memory), which the replay does not see",
    ),
]
#: CPU recordings (gloo): no saving is estimated on a trace without GPU activity; the measured
#: differences say what each fix did there
CPU_PAIRS = [
    ("missing-backward-prefetch", "no-backward-prefetch", "per-block"),
    ("auto-wrap-too-coarse", "root-only", "per-block"),
    ("auto-wrap-too-fine", "per-linear", "per-block"),
    ("no-mixed-precision-collectives", "per-block", "bf16-mp"),
    ("(reshard_after_forward=False)", "per-block", "no-reshard"),
]


#: every twin of the levers' set (fixtures/recorded/gpu-h200-levers): (saving kind, slug, problem, fixed)
LEVER_PAIRS = [
    ("non-matmul-kernels/optimizer", "non-matmul-kernels", "llama-bf16", "llama-bf16-fused"),
    ("gpu-starved-by-hooks", "gpu-starved-by-hooks", "llama-bf16", "llama-bf16-pairs"),
    ("non-matmul-kernels/fusion", "non-matmul-kernels", "llama-bf16", "llama-bf16-compile"),
    ("matmul-wrong-engine/tf32", "matmul-wrong-engine", "llama-tf32", "llama-bf16"),
    ("non-matmul-kernels/optimizer", "non-matmul-kernels", "llama-bf16-b64", "llama-bf16-b64-fused"),
    ("gpu-starved-by-hooks", "gpu-starved-by-hooks", "llama-bf16-b64", "llama-bf16-b64-pairs"),
    ("non-matmul-kernels/fusion", "non-matmul-kernels", "llama-bf16-b64", "llama-bf16-b64-compile"),
    ("matmul-wrong-engine", "matmul-wrong-engine", "llama-fp32-b64", "llama-bf16-b64"),
    ("matmul-wrong-engine", "matmul-wrong-engine", "llama-tf32-b64", "llama-bf16-b64"),
]


def _spread(a: list[float], b: list[float]) -> str:
    """The fix's saving over every call: per call where both runs were recorded in the same calls
    (paired), else the problem's calls less the twin's mean; mean ± standard error (n)."""
    d = [x - y for x, y in zip(a, b)] if len(a) == len(b) else [x - sum(b) / len(b) for x in a]
    m = sum(d) / len(d)
    if len(d) < 2:
        return f"{m:+.1f} (1)"
    se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
    return f"{m:+.1f} ± {se:.1f} ({len(d)})"


def lever_table() -> str:
    """The levers' twins, each with every call's measurements (repeats.json): what each finding predicts
    on the problem run against what the fix saved, traced and without the profiler."""
    import json

    calls = json.loads((REC / LEVERS / "repeats.json").read_text())["variants"]
    head = ["pair (problem → fixed)", "finding (lever)", "predicted (ms)", "range (ms)", "saved, committed traces (ms)"]
    head += ["saved, traced, every call (ms)", "saved, unprofiled, every call (ms)", "in the ranges"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cache: dict = {}
    for kind, slug, problem, fixed in LEVER_PAIRS:
        rep = cache.setdefault(problem, fsdpdoctor.analyze(REC / LEVERS / problem))
        f = finding_of(rep, slug, kind)
        pred = f.model_saving_ms if f is not None and f.model_saving_ms else None
        rng = f.saving_range_ms if pred and f.saving_range_ms else None
        traced = measured_ms(f"{LEVERS}/{problem}", f"{LEVERS}/{fixed}")
        a, b = calls[problem], calls[fixed]
        used = any(p == f"{LEVERS}/{problem}" and x == f"{LEVERS}/{fixed}" for _, _, p, x, _ in GPU_PAIRS)
        lever = kind.split("/")[1] if "/" in kind else {"gpu-starved-by-hooks": "two blocks per unit"}.get(slug, "bf16")
        lines.append(
            f"| {problem} → {fixed} | {slug} ({lever}) | "
            + (f"{pred:.1f}" if pred else "– (none)")
            + f" | {f'{rng[0]:.1f} – {rng[1]:.1f}' if rng else '–'} | {traced:+.1f} | "
            f"{_spread(a['trace_step_ms'], b['trace_step_ms'])} | {_spread(a['unprofiled_step_ms'], b['unprofiled_step_ms'])} | "
            f"{'yes' if used else 'no: the calls disagree by more than the effect'} |"
        )
    return "\n".join(lines) + "\n"


def measured_ms(problem: str, fixed: str) -> float:
    return raw_clock(REC / problem / "rank0.json.gz")["step_ms"] - raw_clock(REC / fixed / "rank0.json.gz")["step_ms"]


def finding_of(rep, slug: str, kind: str):
    """The finding of ``slug`` whose saving is of ``kind`` (a rule with two levers, FSD017's optimizer
    and fusion, predicts for one of them: the other's twin then has no prediction)."""
    f = next((x for x in rep.findings if x.slug == slug), None)
    if f is not None and "/" in kind and (f.saving_kind or "").startswith(slug + "/") and f.saving_kind != kind:
        return None
    return f


def predictions() -> list[dict]:
    """One row per GPU twin pair: the finding's prediction and the measured difference."""
    cache: dict[str, object] = {}
    out = []
    for kind, slug, problem, fixed, why in GPU_PAIRS:
        rep = cache.setdefault(problem, fsdpdoctor.analyze(REC / problem))
        f = finding_of(rep, slug, kind)
        out.append(
            {
                "kind": kind,
                "slug": slug,
                "problem": problem,
                "fixed": fixed,
                "why": why,
                "device": rep.facts.rank_facts[0].device_name or "",
                "family": run_family(rep.facts),
                "predicted": f.model_saving_ms if f is not None and f.model_saving_ms is not None else 0.0,
                "basis": f.saving_basis if f is not None else "no finding",
                # the finding's own range: its run's twin is never part of it (leave-one-out)
                "range": f.saving_range_ms if f is not None else None,
                "range_basis": f.saving_range_basis if f is not None else "",
                "measured": measured_ms(problem, fixed),
                "step": rep.facts.step_clock_ms,
            }
        )
    return out


def gpu_table(rows: list[dict]) -> str:
    head = [
        "pair (problem → fixed)",
        "device",
        "finding",
        "basis",
        "predicted (ms)",
        "measured (ms)",
        "measured / predicted",
        "range out of sample (ms)",
        "holds",
        "what the range rests on",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        rng = r["range"]
        if p > 0 and rng and "the fix made the step slower" in r["range_basis"]:
            cells = [f"{m / p:.2f}", "– (estimate withdrawn)", "yes: no saving promised"]
        elif p > 0 and rng:
            lo, hi = rng
            cells = [f"{m / p:.2f}", f"{lo:.1f} – {hi:.1f}", "yes" if lo <= m <= hi else "**no**"]
        else:
            cells = ["–", "– (no saving predicted)", "**no**" if m > 0.05 * abs(p or 1) else "yes"]
        rests = r["range_basis"].split(";")[0] if r["range_basis"] else "–"
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['problem']} → {r['fixed']}",
                    f"{r['device'].replace('NVIDIA ', '')} ({device_class(r['device'])})",
                    r["slug"] + (f" ({r['kind'].split('/')[1]})" if "/" in r["kind"] else ""),
                    r["basis"],
                    f"{p:.1f}",
                    f"{m:+.1f}",
                    *cells,
                    rests,
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def out_of_sample(rows: list[dict]) -> str:
    """The leave-one-out figure: on how many pairs with a promised saving the finding's range,
    made without that pair, held what the fix really saved; and each pair's ratio."""
    scored = [
        r for r in rows if r["predicted"] > 0 and r["range"] and "the fix made the step slower" not in r["range_basis"]
    ]
    held = [r for r in scored if r["range"][0] <= r["measured"] <= r["range"][1]]
    validated = [r for r in scored if not r["range_basis"].startswith("not validated")]
    ratios = "; ".join(f"{r['slug']} {r['problem']}: {r['measured'] / r['predicted']:.2f}x" for r in scored)
    return (
        f"\n**Out of sample (leave-one-out), the range held what the fix really saved on {len(held)} of "
        f"{len(scored)} twin pairs** with a promised saving ({len(validated)} of them had a same-class twin "
        f'other than their own to rest on; the others say "not validated on a real run"). Measured / '
        f"predicted per pair: {ratios}. Two pairs per rule at most is too few to trust a range's ends: each "
        "new twin of the same device class is what narrows or corrects them.\n"
    )


def cpu_table() -> str:
    head = ["rule", "problem", "fixed", "measured difference (ms per step)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for slug, problem, fixed in CPU_PAIRS:
        lines.append(f"| {slug} | {problem} | {fixed} | {measured_ms(problem, fixed):+.2f} |")
    return "\n".join(lines) + "\n"


def twins_module(rows: list[dict]) -> str:
    src = (REPO / "fsdpdoctor" / "savings/twins.py").read_text()
    head = src[: src.index("TWINS: tuple[Twin, ...] = ")]
    body = ["TWINS: tuple[Twin, ...] = ("]
    for r in rows:
        body.append(
            f"    Twin({r['kind']!r}, {r['problem'] + ' -> ' + r['fixed']!r}, {r['device']!r}, "
            f"{r['predicted']:.3f}, {r['measured']:.3f}, {r['why']!r}, {r['family']!r}, {r['step']:.3f}),"
        )
    body.append(")")
    return head + "\n".join(body) + "\n"


PROSE = """# Saving ranges: predictions against real twins

Every time saving a finding prints is a prediction: the [what-if replay](metrics.md) of a fix a
user can apply (the one the finding's fix code shows), or the rule's own estimate. It is one
point estimate, inside its range (`saving_range_ms` in the JSON report), and never above the
part of the step the fix acts on (the finding's `saving_ceiling_ms`, "at most").

**The range** combines two things, each stated in `saving_range_basis`:

* *what this run leaves uncertain*: the replay of the same fix with each of its stated
  assumptions at the ends of its span (`whatif.assumption_ms`, `whatif.assumptions`): the fp32
  matmuls' rate on tensor cores (35–70% of the BF16 peak), bf16 elementwise kernels (0.4–0.75 of
  their fp32 time), the hook CPU two blocks per unit keep (50–75%), an assumed pinned link's
  bandwidth (12.5–50 GB/s), a fused AdamW step's traffic (25–50%); and the replay without the
  waits the trace does not explain (`whatif.sensitivity_ms`). A rule's own estimate (no replay)
  states the assumption its formula makes and spans it (`saving_range_basis` names both ends):
  the stall-free step of a jittery run (the median; the fastest step, or only the slowest step's
  stall gone), the overlap a fix reaches (the threshold; half way there, or all exposed
  communication hidden), the GPU idle left after a host-bound fix (5%; 0–10% of its window), the
  exposed reduce-scatter a fix hides (all of it; the worst unit's left), torch.compile's fusion
  share (50%; 25–75%). A zero-width range is claimed only where nothing was assumed;
* *the error measured out of sample on real twins*: the same run recorded with and without the
  fix, on the same device class (Hopper: H100 / H200; Volta; CDNA3 …) and model family only. The
  range's ends move by the twins' worst under- and over-prediction. A twin is never part of the
  range of its own run (leave-one-out): the ranges below are the findings' own, on the twin's
  problem run, so each is checked against a pair it was not made from.

Without such a twin the basis says "not validated on a real run" and names the twins of another
device class or model family it did not use. A same-class twin whose fix made the step slower
withdraws the estimate (`est_saving_ms` null, `model_saving_ms` kept). The unchanged replay's
agreement with the trace it was built from is *fidelity* (`replay_fidelity_pct`), not the error
of a saving. Each rule rests on two real pairs or fewer today; a "no" below is an honest miss of
the out-of-sample check, and recording more twins is how the ranges narrow.

## GPU twins (H100, H200)

Step times read from the raw traces by `tests/test_step_clock.py::raw_clock` (the slower of the
CPU step rate and the GPU completion interval). `tests/test_savings.py` checks that
`fsdpdoctor/savings/twins.py` still equals these predictions and measurements.

"""

LEVER_PROSE = """
## The levers' twins (another model, H200, recorded after the savings were built)

`fixtures/recorded/gpu-h200-levers` (its README has the runs): a Llama-shaped model fsdpdoctor had
not met, each lever a finding names recorded as a twin of the same run, in several calls minutes
apart (`repeats.json`). At batch 4 the run is CPU-bound and the profiled step of one run varies by
up to 40% between calls, so a pair there measures a lever only as the mean of its calls (four,
each call recording both runs: "saved" per call, mean ± standard error); at batch 64 (GPU-bound)
two calls agree within 2.5 ms traced and 0.3 ms unprofiled, and only the batch-64 pairs enter the
ranges above. "saved" is the problem run's step less the fixed run's (negative: the fix made it
slower); the ranges shown are today's (after these twins joined the others).

"""

LEVER_AFTER = """
**The first, untouched check (main at d81d137, nothing yet changed against this set)**:

* `block.compile()`, GPU-bound: saved 15.2 ms (14.7 in the other call, 18% of the step) where
  fsdpdoctor found nothing. FSD017 priced only the foreach optimizer's fused step (3% here, below
  its threshold) and then dropped the finding, never trying its fusion lever. Now the fusion lever
  takes over where the optimizer's would not pay: 13.9 ms predicted, 1.10× measured (a fix made on
  this pair, so no longer out of sample; no other recording or public trace changed).
* bf16 instead of fp32 / TF32, GPU-bound (FSD015's replay): predicted 267.7 ms where bf16 saved
  530.2 ms (1.98×), and 57.5 ms where it saved 102.9 ms (1.79×): both under-predicted, the largest
  errors of any twin. Two causes, read from the replay and fixed: (1) a `cudaMemcpyAsync` that
  blocked because the launch queue was full (183 device-to-device copies a step, FSDP2's at world
  size 1, 141 ms of CPU a step) was replayed as fixed CPU time, since only a copy's own transfer
  counted as what it waits for; it now waits, like a launch that found the queue full, for the GPU
  work that freed the queue, and a blocked call may wait for the warm-up backlog too (it was left
  out as "not launched in the window"); the replayed first step went from the measured 617.7 ms
  to 207.9, the steady ones from 257 to ~120 ms; (2) a TF32 run's TF32 GEMMs were left at their
  rate, though bf16 runs them at the BF16 rate (twice TF32's peak); (3) the backlog's first op on
  FSDP's copy stream was pinned at its measured start (330.9 ms into the window, where it had
  waited for a `chunk_cat` kernel on the compute stream); it now starts with the window's first GPU
  work and waits on an edge inferred as the window's ops' are (the second replayed step 245 → 122
  ms); (4) the backlog's fp32 GEMMs took the elementwise kernels' factor (0.5) instead of their
  namesakes' in the window (their kernels have no FLOPs: no launching op in the window), so the
  backlog drained at 196 ms where its GEMMs at the window's rate take 83 (first replayed step
  207.9 → 97.8 ms). Now 499.9 ms (1.06×) and 78.8 ms (1.31×): fixes made on these pairs, so no
  longer out of sample. The tuned-on H100 / H200
  fp32 twins did not move (1.08×, 1.28×); FSD015 on the H100 DDP run went from 26.5 to 51.7 ms and
  on the pageable-offload run from 26.9 to 47.9 ms (no twin of either); (3) moved nothing else but a
  sensitivity replay of the public HTA send/recv trace (its unchanged replay 2.15 → 2.12% off).
* Two blocks per unit: GPU-bound, FSD016 silent and the fix saved nothing (−1.6 / +0.2 ms traced),
  right; CPU-bound, FSD016 predicted 9.3 ms (4.6–9.3) where the four calls saved 13.4 ± 2.0 ms
  unprofiled: under-predicted by about a third.
* The fused optimizer: CPU-bound, FSD017 predicted 4.4 ms where the four calls saved −1.6 ± 3.0 ms
  unprofiled (no saving a user can count on); GPU-bound, no finding and 2.6 ms saved (3%).
* TF32 → bf16 on the CPU-bound run: no saving predicted, none measured beyond the noise
  (−4.7 ± 4.9 ms unprofiled). `block.compile()` on the CPU-bound run saved 11.7 ± 0.8 ms unprofiled,
  which FSD016 does not price (torch.compile's effect on the hooks is not replayed).
* A larger micro-batch (4 → 16, CPU-bound): 4.2–4.5× the sequences per second; no finding prices it.
"""

CPU_PROSE = """
## CPU twins (gloo, 2 processes)

No saving is estimated on a trace without GPU activity (there is no GPU timeline to replay). The
measured differences of the CPU recordings say what each fix did on this tiny model on CPU: the
per-block wrap and bf16 made it *slower* there (FSDP's hooks cost more than they hide; bf16 has
no fast path on CPU), which is why the CPU-only tickets carry no saving.

"""


INFLATE_BEGIN, INFLATE_END = "<!-- inflate_rules: begin -->", "<!-- inflate_rules: end -->"
INFLATE_PROSE = """
## Every rule's estimate against a truth it did not make

A test that holds a rule's estimate to the tool's own output cannot fail. Each rule with an
estimated saving is held by tests to a truth it did not make: a generated twin (the run with the
problem and the same run with the fix, `fixtures/scenarios`, the difference read from the
generator's truth, in the step-synced and the GPU-bound regime), a real twin's raw step times, or
the generator's / an independent raw reading of the part of the step the fix acts on
(`tests/test_saving_truth.py`, `tests/test_whatif.py`, `tests/test_savings.py`).
`python benchmarks/inflate_rules.py --write` multiplies one rule's estimate by 1.25 at a time
(`FSDPDOCTOR_TEST_INFLATE=CODE`, tests/conftest.py) and lists the tests that then fail:

"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write fsdpdoctor/savings/twins.py and docs/savings.md")
    args = ap.parse_args()
    rows = predictions()
    gpu, cpu = gpu_table(rows), cpu_table()
    if not args.write:
        print(gpu)
        print(cpu)
        return
    (REPO / "fsdpdoctor" / "savings/twins.py").write_text(twins_module(rows))
    import subprocess

    subprocess.run(
        [sys.executable, "-m", "ruff", "format", "-q", str(REPO / "fsdpdoctor" / "savings/twins.py")], check=False
    )
    stamp = f"\nRegenerated by `python benchmarks/savings_table.py --write` on {datetime.date.today().isoformat()}.\n"
    doc = REPO / "docs" / "savings.md"
    old = doc.read_text() if doc.exists() else ""
    # the inflation check's table (benchmarks/inflate_rules.py --write) is kept as it was written
    m = re.search(re.escape(INFLATE_BEGIN) + ".*?" + re.escape(INFLATE_END), old, re.S)
    inflate = INFLATE_PROSE + (m.group(0) if m else f"{INFLATE_BEGIN}\n(not run yet)\n{INFLATE_END}") + "\n"
    levers = LEVER_PROSE + lever_table() + LEVER_AFTER
    doc.write_text(PROSE + gpu + out_of_sample(rows) + levers + CPU_PROSE + cpu + inflate + stamp)
    print("wrote fsdpdoctor/savings/twins.py and docs/savings.md")


if __name__ == "__main__":
    main()
