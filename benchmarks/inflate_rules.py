"""Inflate each rule's estimated saving by 25% and list the tests that then fail (issue #42).

For every rule whose findings carry ``est_saving_ms``, the tests that hold its estimate to a truth
it did not make (a generated twin's truth, a real twin's raw step times, or an independent raw
reading of the part the fix acts on) are run with ``FSDPDOCTOR_TEST_INFLATE=CODE`` (tests/conftest.py
multiplies that rule's estimate, ceiling and span by 1.25 as they leave its check). A rule is
held where at least one of them fails; a rule with no such test is listed as such.

    python benchmarks/inflate_rules.py              # every rule, prints the table
    python benchmarks/inflate_rules.py FSD007 FSD013
    python benchmarks/inflate_rules.py --write      # also writes the table into docs/savings.md

Each rule's tests run in a pytest process of their own (``-n0``), a few seconds to a minute each.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "savings.md"
BEGIN, END = "<!-- inflate_rules: begin -->", "<!-- inflate_rules: end -->"

W = "tests/test_whatif.py::"
T = "tests/test_saving_truth.py::"
S = "tests/test_savings.py::"
#: rule -> the tests that hold its estimate to an independent truth
TRUTH: dict[str, list[str]] = {
    "FSD002": [
        f"{W}test_primary_saving_matches_the_twin_within_15pct[too-coarse]",
        f"{W}test_gpu_bound_twins[too-coarse]",
    ],
    "FSD003": [
        f"{T}test_saving_matches_the_generated_twin[too-fine-synced]",
        f"{T}test_saving_matches_the_generated_twin[too-fine-gpu-bound]",
    ],
    "FSD004": [
        f"{W}test_primary_saving_matches_the_twin_within_15pct[no-backward-prefetch-fsdp2]",
        f"{W}test_gpu_bound_twins[no-backward-prefetch-fsdp2]",
        f"{W}test_gpu_bound_twins[no-backward-prefetch-fsdp2-slow-link]",
    ],
    "FSD005": [
        f"{W}test_primary_saving_matches_the_twin_within_15pct[cpu-offload-pinned]",
        f"{W}test_gpu_bound_twins[cpu-offload-pinned]",
    ],
    "FSD006": [
        f"{T}test_saving_matches_the_generated_twin[pageable-synced]",
        f"{T}test_saving_matches_the_generated_twin[pageable-gpu-bound]",
    ],
    "FSD007": [
        f"{T}test_exposed_reduce_scatter_is_the_part_its_fix_acts_on[too-fine-synced]",
        f"{T}test_exposed_reduce_scatter_is_the_part_its_fix_acts_on[ga-fsdp2-sync-gpu-bound]",
    ],
    "FSD008": [f"{T}test_low_overlap_hides_what_raising_overlap_to_the_threshold_hides"],
    "FSD009": [
        f"{W}test_primary_saving_matches_the_twin_within_15pct[slow-rank]",
        f"{W}test_gpu_bound_twins[slow-rank]",
    ],
    "FSD010": [
        f"{T}test_saving_matches_the_generated_twin[host-bound-synced]",
        f"{T}test_saving_matches_the_generated_twin[host-bound-gpu-bound]",
        f"{T}test_saving_matches_the_generated_twin[host-bound-ceiling-gpu-bound]",
    ],
    "FSD011": [
        f"{W}test_primary_saving_matches_the_twin_within_15pct[fp32-collectives]",
        f"{W}test_gpu_bound_twins[fp32-collectives]",
    ],
    "FSD012": [
        f"{T}test_saving_matches_the_generated_twin[rate-limiter-synced]",
        f"{T}test_saving_matches_the_generated_twin[rate-limiter-gpu-bound]",
    ],
    "FSD013": [f"{T}test_jitter_saving_is_the_mean_step_above_the_median"],
    "FSD014": [
        f"{T}test_saving_matches_the_generated_twin[ga-sync-synced]",
        f"{T}test_saving_matches_the_generated_twin[ga-sync-gpu-bound]",
    ],
    "FSD015": [f"{S}test_the_range_is_out_of_sample_and_holds_its_estimate"],
    "FSD016": [f"{W}test_hook_saving_is_two_blocks_per_unit_not_all_hooks_gone"],
    "FSD017": ["tests/test_waterfall_scenarios.py::test_optimizer_rule_saving_is_its_twins_difference"],
    "FSD018": [
        f"{T}test_saving_matches_the_generated_twin[item-readback-synced]",
        f"{T}test_saving_matches_the_generated_twin[item-readback-gpu-bound]",
    ],
    "FSD019": [f"{S}test_the_range_is_out_of_sample_and_holds_its_estimate"],
    "FSD030": [
        f"{T}test_saving_matches_the_generated_twin[inter-node-synced]",
        f"{T}test_saving_matches_the_generated_twin[inter-node-gpu-bound]",
        f"{T}test_saving_matches_the_generated_twin[shard-grad-op-synced]",
        f"{T}test_saving_matches_the_generated_twin[shard-grad-op-gpu-bound]",
    ],
    "FSD031": [
        f"{T}test_saving_matches_the_generated_twin[ddp-slow-link-synced]",
        f"{T}test_saving_matches_the_generated_twin[ddp-slow-link-gpu-bound]",
    ],
    "FSD032": [
        f"{T}test_saving_matches_the_generated_twin[vocab-unpadded-synced]",
        f"{T}test_saving_matches_the_generated_twin[vocab-unpadded-gpu-bound]",
    ],
    "FSD033": ["tests/test_run_kinds.py::test_dataloader_bound_on_the_dlrm_run"],
    "FSD026": ["tests/test_compile_window.py::test_a_recompilation_in_a_steady_step_is_named_and_costed"],
}
#: why a rule has no test with an independent truth yet (what was measured instead)
MISSING: dict[str, str] = {}


#: what a rule's failing test says, where it is not plain
NOTES = {
    "FSD015": "its real twins measured 1.09x (H100) and 1.27x (H200) of the estimate: x1.25 moves it closer to both; "
    "what fails is the H100 range held out of sample (its low end passes the saving the fix really made)",
}


def rules_with_savings() -> list[str]:
    """Codes of the rules whose findings can carry est_saving_ms (read from their source)."""
    out = []
    for p in sorted((REPO / "rules").glob("fsd*.py")):
        text = p.read_text()
        if re.search(r"est_saving_ms=(?!None)", text):
            out.append(re.search(r'^CODE = "(FSD\d+)"', text, re.M).group(1))
    return out


def run(code: str, tests: list[str]) -> list[str]:
    """The tests of ``tests`` that fail with ``code``'s estimate inflated by 25%."""
    env = dict(os.environ, FSDPDOCTOR_TEST_INFLATE=f"{code}:1.25")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", "-rf", *tests],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    return sorted({m.group(1) for m in re.finditer(r"^FAILED (\S+)", r.stdout, re.M)})


def table(results: dict[str, list[str]]) -> str:
    rows = ["| rule | tests held to an independent truth | fail with the estimate x1.25 |", "|---|---|---|"]
    for code in sorted(results):
        tests = TRUTH.get(code, [])
        failed = results[code]
        if not tests:
            rows.append(f"| {code} | none: {MISSING.get(code, '')} | **not held** |")
            continue
        names = "<br>".join(t.split("::", 1)[1] for t in tests)
        got = "<br>".join(t.split("::", 1)[1] for t in failed) if failed else "**none: not held**"
        rows.append(f"| {code} | {names} | {got} |")
    for code, note in NOTES.items():
        if code in results:
            rows.append(f"\n{code}: {note}.")
    held = sum(1 for c in results if results[c])
    rows.append("")
    rows.append(f"{held} of {len(results)} rules with an estimated saving fail a test when it is inflated by 25%.")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("codes", nargs="*")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    codes = a.codes or rules_with_savings()
    results = {}
    for code in codes:
        tests = TRUTH.get(code, [])
        results[code] = run(code, tests) if tests else []
        print(code, "->", results[code] or "none", flush=True)
    text = table(results)
    print(text)
    if a.write:
        doc = DOC.read_text()
        block = f"{BEGIN}\n{text}\n{END}"
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
        DOC.write_text(doc)


if __name__ == "__main__":
    main()
