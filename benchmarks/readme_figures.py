"""Regenerate figures that the READMEs quote, from the inputs they describe.

Each figure is printed with where it is quoted and how it was obtained, so a stale claim is
found by running this and reading the diff:

* the GPU corpus README (fixtures/recorded/gpu/README.md), ``fsdp2-offload`` row: the CPU
  optimizer step's share of the step, read from the raw trace (``Optimizer.step#…`` and
  ``ProfilerStep#N`` spans, json/gzip only), and ``cpu-offload-stall``'s estimate from the tool;
* the README's what-if section: the unchanged replay's error per public trace
  (``facts.whatif.error_pct``, the worst rank) — needs ../shared/traces/public.

    python benchmarks/readme_figures.py [--json FILE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "fixtures" / "recorded" / "gpu"
PUBLIC = REPO.parent / "shared" / "traces" / "public"
sys.path.insert(0, str(REPO))


def _spans(path: Path, prefix: str) -> list[float]:
    """Durations (ms) of the CPU-side X events whose name starts with ``prefix``."""
    with gzip.open(path, "rb") as f:
        events = json.load(f)["traceEvents"]
    return [
        e["dur"] / 1e3
        for e in events
        if e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation" and str(e.get("name", "")).startswith(prefix)
    ]


def offload_figures() -> dict:
    import fsdpdoctor

    trace = GPU / "fsdp2-offload" / "rank0.json.gz"
    step = statistics.fmean(_spans(trace, "ProfilerStep#"))
    opt = statistics.fmean(_spans(trace, "Optimizer.step#"))
    rep = fsdpdoctor.analyze(GPU / "fsdp2-offload")
    stall = next((x.est_saving_ms for x in rep.findings if x.slug == "cpu-offload-stall"), None)
    return {
        "where": "fixtures/recorded/gpu/README.md, fsdp2-offload row",
        "optimizer_step_ms": round(opt, 1),
        "profiler_step_ms": round(step, 1),
        "cpu_offload_stall_saving_ms": None if stall is None else round(stall, 1),
    }


def replay_errors() -> dict:
    import fsdpdoctor

    out = {}
    if not PUBLIC.is_dir():
        return out
    for d in sorted(p for p in PUBLIC.iterdir() if p.is_dir()):
        files = sorted(d.glob("*.json.gz"))
        targets = [d] if d.name not in ("hta-ddp-v100-2022",) else files  # two runs: one file each
        for t in targets:
            try:
                w = fsdpdoctor.analyze(t).facts.whatif
            except Exception as exc:  # noqa: BLE001 - a figure that cannot be made is reported, not fatal
                out[str(t.relative_to(PUBLIC))] = f"error: {exc}"
                continue
            out[str(t.relative_to(PUBLIC))] = None if w is None else round(w.error_pct, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    figs = {"offload": offload_figures(), "replay_error_pct": replay_errors()}
    o = figs["offload"]
    print(
        f"fsdp2-offload: CPU optimizer step {o['optimizer_step_ms']} ms of a {o['profiler_step_ms']} ms step "
        f"(raw trace); cpu-offload-stall saves {o['cpu_offload_stall_saving_ms']} ms/step"
    )
    for k, v in figs["replay_error_pct"].items():
        print(f"replay error {k}: {v}%")
    if args.json:
        args.json.write_text(json.dumps(figs, indent=1) + "\n")


if __name__ == "__main__":
    main()
