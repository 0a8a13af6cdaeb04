"""Rows by name and category from the trace's index of rows by name (``analysis.rows``) against
a row-by-row reading of the same columns in plain Python, on the recorded H100 FSDP2 trace:
rare names, names past the share read by a mask, several categories, none, and absent ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fsdpdoctor.analysis.rows import name_lut, name_rows
from fsdpdoctor.ingest.kineto import load_trace

TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "gpu" / "fsdp2" / "rank0.json.gz"


@pytest.fixture(scope="module")
def rt():
    return load_trace(str(TRACE))


def _reference(rt, pred, cats) -> list[int]:
    names, cat_names = rt.names, rt.cats
    wanted = set(cats)
    return [
        i
        for i, (n, c) in enumerate(zip(rt.name.tolist(), rt.cat.tolist()))
        if pred(names[n]) and (not cats or cat_names[c] in wanted)
    ]


CASES = [
    (lambda n: n.startswith("ProfilerStep#"), ("cpu_op", "user_annotation")),
    (lambda n: n.startswith("aten::"), ("cpu_op",)),  # most of the CPU ops: read through a mask
    (lambda n: not n.startswith("ProfilerStep#"), ("cpu_op", "user_annotation")),
    (lambda n: "Memcpy" in n or "Memset" in n, ("gpu_memcpy", "gpu_memset", "kernel")),
    (lambda n: n.startswith("FSDP::"), ()),  # any category (the GPU copies of the annotations too)
    (lambda n: n.startswith("FSDP::"), ("user_annotation", "no such category")),
    (lambda n: True, ("no such category",)),
    (lambda n: False, ("cpu_op",)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_name_rows_are_the_rows_read_one_by_one(rt, case):
    pred, cats = CASES[case]
    got = name_rows(rt, pred, *cats)
    assert got.dtype == np.int64
    assert got.tolist() == _reference(rt, pred, cats)


def test_name_lut_reads_each_row_by_its_name(rt):
    rows = np.arange(0, len(rt.ts), 7)
    got = name_lut(rt, lambda n: n.startswith("cuda"))[rt.name[rows]]
    assert got.tolist() == [rt.names[rt.name[i]].startswith("cuda") for i in rows.tolist()]
