"""Saving ranges: one point estimate, and how far it can be trusted.

A finding's estimated saving comes from the what-if replay of its fix or from its rule's
heuristic. Its range ``[low, high]`` always contains it and combines two things, nothing else:

* **what this run leaves uncertain**: the replay of the same fix with each of the fix's stated
  assumptions at the ends of its plausible span (the tensor cores' rate, the hooks a merged unit
  keeps, a pinned link's bandwidth, a fused optimizer's traffic …: ``WhatIfFacts.assumption_ms``),
  and without the waits the trace does not explain (``WhatIfFacts.sensitivity_ms``); each one
  stated in the basis;
* **the error measured out of sample on real twins**: the same run recorded with and without the
  fix (``fixtures/recorded/``, :mod:`fsdpdoctor.savings.twins`), on the same device class and model
  family only. A twin is never used for the range of its own run (leave-one-out: a twin whose
  prediction is this estimate on this device is that run). The range's ends move by the twins'
  worst under- and over-prediction (measured / predicted − 1).

Where no such twin exists the basis says "not validated on a real run" (twins on another device
class or model family are named as not used, never cited). Where a same-class twin shows the fix
made the step *slower*, the point estimate is withdrawn: the finding promises no saving. The
engine caps the range's top at the part of the step the fix acts on (the finding's ceiling).

The unchanged replay's agreement with the trace it was built from is *fidelity*
(``replay_fidelity_pct``), never a saving's error bar.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fsdpdoctor.savings.twins import TWINS, Twin

#: device classes: twins transfer within a class (the same SMs / engines), never across
_CLASSES = (
    (r"GH200|H100|H200|H800|H20\b", "Hopper"),
    (r"GB200|B200|B100|B300", "Blackwell"),
    (r"A100|A800|A10\b|A30|A40|A6000|RTX 30", "Ampere"),
    (r"L4\b|L40|RTX 40|RTX 6000 Ada", "Ada"),
    (r"V100|Titan V", "Volta"),
    (r"T4\b|RTX 20", "Turing"),
    (r"MI300|MI325", "CDNA3"),
    (r"MI250|MI210|MI200", "CDNA2"),
    (r"MTIA", "MTIA"),
)


def device_class(name: str | None) -> str:
    """The device class of a device name ("NVIDIA H100 80GB HBM3" → "Hopper"); the name itself
    where it is none of the known ones, "" when unknown."""
    if not name:
        return ""
    for rx, cls in _CLASSES:
        if re.search(rx, name, re.IGNORECASE):
            return cls
    return name


def run_family(facts) -> str:
    """The model family twins are matched on: "transformer" where the run has attention kernels,
    else "other" (a recommender, a CNN: the fix's effect on them is not a transformer's)."""
    c = getattr(facts, "compute", None)
    return "transformer" if c is not None and c.attention_ms_per_step > 0 else "other"


@dataclass(frozen=True)
class SavingRange:
    low_ms: float
    high_ms: float
    basis: str  # what the range rests on, each part stated
    withdrawn: bool = False  # a same-class twin went the other way: no saving is promised
    twins: int = 0  # real twins (same device class and family, out of sample) the range rests on


def twins_of(kind: str) -> list[Twin]:
    """The real twins of a saving kind (a rule's slug, or ``slug/context``)."""
    return [t for t in TWINS if t.kind == kind]


def usable_twins(
    kind: str, device: str | None, family: str, step_ms: float | None = None, exclude: str = ""
) -> list[Twin]:
    """The twins of ``kind`` a range on ``device`` / ``family`` may rest on: the same device class
    and model family, a prediction to compare with, and not the run itself (``exclude`` names a
    pair; a twin whose problem run has this run's step clock ``step_ms`` on the same device is
    this run)."""
    cls = device_class(device)
    out = []
    for t in twins_of(kind):
        if t.predicted_ms <= 0 or not cls or device_class(t.device) != cls or t.family != family:
            continue
        if t.pair == exclude:
            continue
        if step_ms is not None and t.device == device and abs(t.problem_step_ms - step_ms) < 0.005:
            continue  # the twin's own run: never its own basis
        out.append(t)
    return out


def saving_range(
    kind: str,
    est_ms: float,
    low_ms: float | None = None,
    high_ms: float | None = None,
    device: str | None = None,
    family: str = "transformer",
    assumptions: str = "",
    exclude: str = "",
    step_ms: float | None = None,
) -> SavingRange:
    """The range of a saving ``est_ms`` of kind ``kind`` (see the module doc). ``low_ms`` /
    ``high_ms``: the saving's span over the fix's assumptions (this run's own uncertainty,
    ``assumptions`` says which); ``device`` / ``family``: the run's, for the twins; ``step_ms``:
    the run's step clock (a twin recorded on this very run is left out)."""
    lo = min(est_ms, low_ms if low_ms is not None else est_ms)
    hi = max(est_ms, high_ms if high_ms is not None else est_ms)
    parts = [assumptions] if assumptions else []
    twins = usable_twins(kind, device, family, step_ms, exclude)
    if twins:
        errs = [t.measured_ms / t.predicted_ms - 1 for t in twins]
        lo *= 1 + min(min(errs), 0.0)
        hi *= 1 + max(max(errs), 0.0)
        n = len(twins)
        spread = f"{1 + min(errs):.2f}x" if n == 1 else f"{1 + min(errs):.2f}-{1 + max(errs):.2f}x"
        cls = device_class(device)
        parts.insert(
            0,
            f"{n} real twin{'s' if n > 1 else ''} on {cls} ({', '.join(t.pair for t in twins)}): "
            f"measured {spread} the prediction, out of sample",
        )
    else:
        cls = device_class(device)
        other = sorted(
            {
                f"{device_class(t.device)} {t.family}"
                for t in twins_of(kind)
                if t.predicted_ms > 0 and (device_class(t.device) != cls or t.family != family)
            }
        )
        why = f" (its twins ran on {', '.join(other)}: another device class or model family, not used)" if other else ""
        parts.insert(0, f"not validated on a real run{why}")
    # a same-class twin where the fix made the step slower (its own run's included: a measured
    # contrary result is not a range to check, it is what the fix did)
    same = usable_twins(kind, device, family, exclude=exclude)
    slower = [t for t in same if t.measured_ms < 0]
    if slower:
        t = slower[0]
        basis = (
            f"on {len(slower)} of {len(same)} real twin{'s' if len(same) > 1 else ''} on {device_class(device)} "
            f"the fix made the step slower ({t.pair}: predicted {t.predicted_ms:.1f} ms saved, measured "
            f"{-t.measured_ms:.1f} ms slower{'; ' + t.why if t.why else ''})"
        )
        r = t.measured_ms / t.predicted_ms
        return SavingRange(est_ms * r, est_ms * r, basis, withdrawn=True, twins=len(same))
    return SavingRange(max(lo, 0.0), hi, "; ".join(parts), twins=len(twins))
