"""Category accuracy of ``fsdpdoctor memory`` over the generated snapshot matrix.

For every variant of fixtures/snapshots/gen_snapshot.py with allocation history, compare the
categories the tool reports at the peak (and at memory_viz's active peak, and at the OOM) with the
generator's ground truth. Error = Σ over categories |tool − truth| / peak (a block put in the wrong
category counts twice). Prints a Markdown table.

``--sweep N`` instead draws N random configurations (flavor, frame layout, recording start,
world size, depth, sequence length, device capacity, reshard, checkpointing, micro-batches) the
categorizer was not developed on, and reports how many stay within 2% at each instant.

Usage: python benchmarks/memory_categories.py [VARIANT ...] | --sweep N [--seed S]
"""

from __future__ import annotations

import sys
from pathlib import Path

from fsdpdoctor.analysis.memory import analyze_memory
from fsdpdoctor.facts import MEMORY_CATEGORIES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # fixtures.* (the snapshot generator)

from fixtures.snapshots import gen_snapshot  # noqa: E402


def error_pct(tool: dict, truth: dict, total: int) -> float:
    return 100 * sum(abs(tool.get(c, 0) - truth.get(c, 0)) for c in MEMORY_CATEGORIES) / max(total, 1)


def top(c: dict) -> str:
    return max(MEMORY_CATEGORIES, key=lambda k: c.get(k, 0))


def measure(names: list[str] | None = None) -> list[dict]:
    rows = []
    for name, v in gen_snapshot.VARIANTS.items():
        if names and name not in names:
            continue
        if not v.history or v.bare_list:
            continue
        obj, truth = gen_snapshot.build(name)
        m = analyze_memory(obj)
        row = {
            "variant": name,
            "peak_mib": truth["peak_allocated_bytes"] / 2**20,
            "error_pct": error_pct(m.categories, truth["categories"], truth["peak_allocated_bytes"]),
            "top_truth": top(truth["categories"]),
            "top_tool": top(m.categories),
        }
        active = m.categories_at_active_peak
        if active:
            row["active_error_pct"] = error_pct(active, truth["categories_at_active_peak"], truth["peak_active_bytes"])
        if truth.get("oom") and m.oom:
            row["oom_error_pct"] = error_pct(
                m.oom["categories"], truth["oom"]["categories"], truth["oom"]["allocated_bytes"]
            )
        rows.append(row)
    return rows


def sweep(n: int, seed: int) -> None:
    import dataclasses
    import random

    rng = random.Random(seed)
    done = within = 0
    worst = []
    for k in range(n):
        flavor = rng.choice(["fsdp2", "fsdp2_composable", "fsdp1"])
        spec = gen_snapshot.Spec(
            world_size=rng.choice([2, 4, 8]),
            layers=rng.choice([2, 3, 5, 8]),
            tokens=rng.choice([256, 1000, 3000, 7000]),
            big_backward_temp=rng.choice([0, 100, 300]) * gen_snapshot.MiB,
            big_temp_layer=rng.choice([0, 1]),
            reshard_after_forward=rng.random() < 0.7,
            checkpointing=rng.random() < 0.3,
            microbatches=1 if flavor == "fsdp1" else rng.choice([1, 1, 2, 3]),
        )
        capacity = rng.choice([None, None, rng.randint(300, 2500) * gen_snapshot.MiB])
        v = gen_snapshot.Variant(
            flavor=flavor,
            layout=rng.choice(["2.11", "2.6", "2.4"]),
            capacity=capacity,
            devices=(spec,),
            record_from=rng.choice(["after_build", "build", "step1"]),
        )
        name = f"sweep{seed}_{k}"
        gen_snapshot.VARIANTS[name] = v
        try:
            obj, truth = gen_snapshot.build(name)
        except TypeError:  # the OOM came before the recording started: nothing to analyse
            continue
        m = analyze_memory(obj)
        errs = [error_pct(m.categories, truth["categories"], truth["peak_allocated_bytes"])]
        errs.append(
            error_pct(m.categories_at_active_peak, truth["categories_at_active_peak"], truth["peak_active_bytes"])
        )
        if truth["oom"] and m.oom:
            errs.append(error_pct(m.oom["categories"], truth["oom"]["categories"], truth["oom"]["allocated_bytes"]))
        done += 1
        within += max(errs) <= 2
        if max(errs) > 2:
            worst.append((max(errs), name, dataclasses.asdict(spec), v.flavor, v.layout, v.record_from, capacity))
    print(f"{within} of {done} random configurations within 2% of peak at every instant (seed {seed})")
    for e, name, spec, *rest in sorted(worst, reverse=True):
        print(f"  {e:6.1f}%  {name} {rest} {spec}")


def main(argv: list[str] | None = None) -> None:
    argv = list(argv or [])
    if argv and argv[0] == "--sweep":
        seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
        sweep(int(argv[1]), seed)
        return
    rows = measure(argv or None)
    print("| variant | peak MiB | error % of peak | top (truth) | top (tool) | active-peak error % | OOM error % |")
    print("|---|---:|---:|---|---|---:|---:|")
    for r in rows:
        ok = "" if r["top_truth"] == r["top_tool"] else " ✗"
        act = f"{r['active_error_pct']:.2f}" if "active_error_pct" in r else "–"
        oom = f"{r['oom_error_pct']:.2f}" if "oom_error_pct" in r else "–"
        print(
            f"| {r['variant']} | {r['peak_mib']:.0f} | {r['error_pct']:.2f} | {r['top_truth']} | {r['top_tool']}{ok} | {act} | {oom} |"
        )
    errs = [r["error_pct"] for r in rows]
    print(f"\nmean error {sum(errs) / len(errs):.2f}% of peak, max {max(errs):.2f}% over {len(rows)} snapshots")


if __name__ == "__main__":
    main(sys.argv[1:])
