"""Regenerate the validation of predicted savings on real twins: docs/savings.md and fsdpdoctor/twins.py.

A twin pair is two real recordings in ``fixtures/recorded/`` that differ by one fix. For each,
the saving fsdpdoctor predicts on the run with the problem (the finding's ``model_saving_ms``,
from the what-if replay or the rule's heuristic) is set against the difference of the two runs'
step times, read from the raw traces by the test suite's independent reader
(``tests/test_step_clock.py::raw_clock``: plain ``json``, none of fsdpdoctor's code).

    python benchmarks/savings_table.py           # prints the tables
    python benchmarks/savings_table.py --write   # writes fsdpdoctor/twins.py and docs/savings.md

Run it again after recording a new twin, or after changing a rule's saving or the replay: the
test suite fails while fsdpdoctor/twins.py disagrees with what the tool predicts today.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import fsdpdoctor  # noqa: E402
from fsdpdoctor.savings import NO_TWIN, NOISE  # noqa: E402
from test_step_clock import raw_clock  # noqa: E402

REC = REPO / "fixtures" / "recorded"

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


def measured_ms(problem: str, fixed: str) -> float:
    return raw_clock(REC / problem / "rank0.json.gz")["step_ms"] - raw_clock(REC / fixed / "rank0.json.gz")["step_ms"]


def predictions() -> list[dict]:
    """One row per GPU twin pair: the finding's prediction and the measured difference."""
    cache: dict[str, object] = {}
    out = []
    for kind, slug, problem, fixed, why in GPU_PAIRS:
        rep = cache.setdefault(problem, fsdpdoctor.analyze(REC / problem))
        f = next((x for x in rep.findings if x.slug == slug), None)
        out.append(
            {
                "kind": kind,
                "slug": slug,
                "problem": problem,
                "fixed": fixed,
                "why": why,
                "device": rep.facts.rank_facts[0].device_name or "",
                "predicted": f.model_saving_ms if f is not None and f.model_saving_ms is not None else 0.0,
                "basis": f.saving_basis if f is not None else "no finding",
                "measured": measured_ms(problem, fixed),
            }
        )
    return out


def _range(rows: list[dict], kind: str, est: float, skip: dict | None = None) -> tuple[float, float] | None:
    """The range :mod:`fsdpdoctor.savings` gives an estimate ``est`` of ``kind`` from ``rows``'
    twins (``skip`` left out: the out-of-sample check)."""
    rs = [r["measured"] / r["predicted"] for r in rows if r["kind"] == kind and r["predicted"] > 0 and r is not skip]
    if not rs:
        return est * (1 - NO_TWIN), est * (1 + NO_TWIN)
    return est * (min(rs) - NOISE), est * (max(rs) + NOISE)


def gpu_table(rows: list[dict]) -> str:
    head = [
        "pair (problem → fixed)",
        "device",
        "finding",
        "basis",
        "predicted (ms)",
        "measured (ms)",
        "measured / predicted",
        "range (ms)",
        "holds",
        "range without this twin",
        "holds",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        if p > 0:
            lo, hi = _range(rows, r["kind"], p)
            lo2, hi2 = _range(rows, r["kind"], p, skip=r)
            cells = [
                f"{m / p:.2f}",
                f"{lo:.1f} – {hi:.1f}",
                "yes" if lo <= m <= hi else "**no**",
                f"{lo2:.1f} – {hi2:.1f}",
                "yes" if lo2 <= m <= hi2 else "**no**",
            ]
        else:
            cells = ["–", "– (no saving predicted)", "**no**" if m > 0.05 * abs(p or 1) else "yes", "–", "–"]
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['problem']} → {r['fixed']}",
                    r["device"].replace("NVIDIA ", ""),
                    r["slug"] + (f" ({r['kind'].split('/')[1]})" if "/" in r["kind"] else ""),
                    r["basis"],
                    f"{p:.1f}",
                    f"{m:+.1f}",
                    *cells,
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def cpu_table() -> str:
    head = ["rule", "problem", "fixed", "measured difference (ms per step)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for slug, problem, fixed in CPU_PAIRS:
        lines.append(f"| {slug} | {problem} | {fixed} | {measured_ms(problem, fixed):+.2f} |")
    return "\n".join(lines) + "\n"


def twins_module(rows: list[dict]) -> str:
    src = (REPO / "fsdpdoctor" / "twins.py").read_text()
    head = src[: src.index("TWINS: tuple[Twin, ...] = ")]
    body = ["TWINS: tuple[Twin, ...] = ("]
    for r in rows:
        body.append(
            f"    Twin({r['kind']!r}, {r['problem'] + ' -> ' + r['fixed']!r}, {r['device']!r}, "
            f"{r['predicted']:.3f}, {r['measured']:.3f},{' ' + repr(r['why']) if r['why'] else ''}),"
        )
    body.append(")")
    return head + "\n".join(body) + "\n"


PROSE = """# Saving ranges: predictions against real twins

Every time saving a finding prints is a prediction: the [what-if replay](metrics.md) of the fix,
or the rule's own estimate. How far a prediction can be trusted is measured, not assumed: on
*real twins*, the same run recorded with and without the fix (`fixtures/recorded/`). The
unchanged replay's agreement with the trace it was built from is *fidelity*
(`replay_fidelity_pct`), not the error of a saving: a graph built from a trace reproduces that
trace almost by construction.

**The range.** For a saving `s` of a rule with real twins, the JSON report's
`saving_range_ms` is `[s × (min r − 5%), s × (max r + 5%)]`, `r` = measured / predicted over the
rule's twins, the 5% for run-to-run variation of the twins themselves; where the saving is the
replay's it is widened by the replay's sensitivity to what the trace does not show
(`whatif.sensitivity_ms`: the saving replayed again without the waits kept as measured and the
inferred cross-stream edges). A rule with no real twin yet gets `s × [0.5, 1.5]` and says so. A
rule whose twin went the other way (the fix made the real run slower) promises no saving: its
estimate is withdrawn (`est_saving_ms` null, `model_saving_ms` kept) and the finding says what
the twin showed. The terminal prints "saves 31.3–41.8 ms/step (what-if replay; 2 real twins)".

The ranges below are in-sample: each pair is one of the twins its range is made from. The
"without this twin" column is the out-of-sample check, the range the rule's *other* twins alone
would give; with two twins per rule it shows how much one more recording moves the range. Each
rule's range rests on two real pairs or fewer today; recording more twins (TF32 ↔ bf16 ↔ fp32,
prefetch on/off, reshard on/off on a GPU) is how they narrow.

## GPU twins (H100, H200)

Step times read from the raw traces by `tests/test_step_clock.py::raw_clock` (the slower of the
CPU step rate and the GPU completion interval). `tests/test_savings.py` checks that
`fsdpdoctor/twins.py` still equals these predictions and measurements, and that each finding's
range holds its twin's measured difference.

"""

CPU_PROSE = """
## CPU twins (gloo, 2 processes)

No saving is estimated on a trace without GPU activity (there is no GPU timeline to replay). The
measured differences of the CPU recordings say what each fix did on this tiny model on CPU: the
per-block wrap and bf16 made it *slower* there (FSDP's hooks cost more than they hide; bf16 has
no fast path on CPU), which is why the CPU-only tickets carry no saving.

"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write fsdpdoctor/twins.py and docs/savings.md")
    args = ap.parse_args()
    rows = predictions()
    gpu, cpu = gpu_table(rows), cpu_table()
    if not args.write:
        print(gpu)
        print(cpu)
        return
    (REPO / "fsdpdoctor" / "twins.py").write_text(twins_module(rows))
    stamp = f"\nRegenerated by `python benchmarks/savings_table.py --write` on {datetime.date.today().isoformat()}.\n"
    (REPO / "docs" / "savings.md").write_text(PROSE + gpu + CPU_PROSE + cpu + stamp)
    print("wrote fsdpdoctor/twins.py and docs/savings.md")


if __name__ == "__main__":
    main()
