"""Memory categories against the snapshot generator's ground truth (issue 14).

The generator (fixtures/snapshots/gen_snapshot.py) knows the category of every block it hands
out; these tests hold the categorizer to it over the whole matrix (FSDP1/FSDP2, torch 2.4 / 2.6 /
2.11 frame layouts; healthy, reshard_after_forward=False / SHARD_GRAD_OP, optimizer-heavy,
activation OOM in forward, activation checkpointing, gradient accumulation), at the instant the
facts name: the allocated peak, memory_viz's active peak and the OOM.
"""

from __future__ import annotations


import pytest

from fsdpdoctor.analysis.memory import CATEGORIES, analyze_memory
from fsdpdoctor.analysis.memory.stacks import (
    PH_BACKWARD,
    PH_FORWARD,
    PH_IDLE,
    PH_OPTIM,
    PH_RECOMPUTE,
    frame_info,
    summarize,
)

from fixtures.snapshots import gen_snapshot as gen


HISTORY = [n for n, v in gen.VARIANTS.items() if v.history and not v.bare_list]
OOM = [n for n in HISTORY if gen.VARIANTS[n].capacity or any(d.oom_in_loss for d in gen.VARIANTS[n].devices)]


@pytest.fixture(scope="module")
def built():
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            obj, truth = gen.build(name)
            cache[name] = (analyze_memory(obj), truth)
        return cache[name]

    return get


def _error(tool: dict, truth: dict) -> int:
    return sum(abs(tool[c] - truth[c]) for c in CATEGORIES)


def _top(c: dict) -> str:
    return max(CATEGORIES, key=lambda k: c[k])


@pytest.mark.parametrize("name", HISTORY)
def test_categories_at_the_allocated_peak(built, name):
    facts, truth = built(name)
    assert facts.categories_instant == "peak_allocated"
    assert facts.peak_event_index == truth["peak_event_index"]
    assert _error(facts.categories, truth["categories"]) <= 0.02 * truth["peak_allocated_bytes"]
    assert _top(facts.categories) == _top(truth["categories"])


@pytest.mark.parametrize("name", HISTORY)
def test_active_peak_and_its_categories(built, name):
    facts, truth = built(name)
    assert facts.peak_active_bytes == truth["peak_active_bytes"]
    assert facts.peak_active_event_index == truth["peak_active_event_index"]
    assert facts.peak_active_bytes >= facts.peak_allocated_bytes
    assert sum(facts.categories_at_active_peak.values()) == facts.peak_active_bytes
    assert (
        _error(facts.categories_at_active_peak, truth["categories_at_active_peak"]) <= 0.02 * truth["peak_active_bytes"]
    )


def test_the_two_peaks_differ_where_frees_wait_on_another_stream(built):
    """FSDP2 frees its all-gather buffer on the all-gather stream: memory_viz's active peak holds
    it, max_memory_allocated does not."""
    facts, truth = built("fsdp2")
    assert truth["peak_active_bytes"] > truth["peak_allocated_bytes"]
    assert (
        facts.peak_active_bytes - facts.peak_allocated_bytes
        == truth["peak_active_bytes"] - truth["peak_allocated_bytes"]
    )


@pytest.mark.parametrize("name", OOM)
def test_categories_at_the_oom(built, name):
    facts, truth = built(name)
    want = truth["oom"]
    assert facts.oom.event_index == want["event_index"]
    assert _error(facts.oom.categories, want["categories"]) <= 0.02 * want["allocated_bytes"]
    assert _top(facts.oom.categories) == _top(want["categories"])


@pytest.mark.parametrize("name", ["fsdp2_act_oom", "fsdp2_composable_act_oom", "fsdp1_act_oom"])
def test_activation_oom_in_forward(built, name):
    """Saved activations share sizes with forward temporaries (SwiGLU, norm): the ones alive at a
    later FSDP unit boundary are activations, the last unit's take the previous unit's fates."""
    facts, truth = built(name)
    assert truth["oom"] is not None and facts.peak_phase == "forward"
    assert truth["categories"]["activations"] > 0.9 * truth["peak_allocated_bytes"]
    assert (
        abs(facts.categories["activations"] - truth["categories"]["activations"])
        <= 0.01 * truth["peak_allocated_bytes"]
    )
    # no reduce-scatter happened yet: the sharded parameters are found through the unsharded sizes
    assert facts.pre_existing_attributed.get("parameters_sharded") == truth["categories"]["parameters_sharded"]


@pytest.mark.parametrize("name", ["fsdp2_loss_oom", "fsdp1_loss_oom"])
def test_oom_in_the_loss(built, name):
    """cross_entropy(logits.float(), labels) runs out of memory allocating the log-softmax output:
    the fp32 copy of the logits, allocated by the user's line, is the statement's temporary (the
    generator's truth), not an activation, though nothing freed it before the OOM."""
    facts, truth = built(name)
    spec = gen.VARIANTS[name].devices[0]
    cast = gen.round_size(spec.tokens * spec.vocab * 4)
    assert truth["oom"] is not None and facts.peak_phase == "forward"
    assert truth["categories"]["temporary"] >= cast > 0.2 * truth["peak_allocated_bytes"]
    for c in ("activations", "temporary"):
        assert abs(facts.categories[c] - truth["categories"][c]) <= 0.02 * truth["peak_allocated_bytes"], c
        assert abs(facts.oom.categories[c] - truth["oom"]["categories"][c]) <= 0.02 * truth["oom"]["allocated_bytes"], c


def test_checkpoint_recompute_is_backward(built):
    """Recomputation runs module forwards inside backward: the flat gradient and the gradient
    temporaries allocated after it are backward memory, not activations."""
    for name in ("fsdp2_ckpt", "fsdp1_ckpt"):
        facts, truth = built(name)
        assert facts.peak_phase == "backward"
        for c in ("activations", "gradients", "temporary"):
            assert abs(facts.categories[c] - truth["categories"][c]) <= 0.01 * truth["peak_allocated_bytes"], (name, c)


def test_frame_markers():
    site = "/opt/conda/lib/python3.11/site-packages/torch/"
    assert frame_info(site + "utils/checkpoint.py", "unpack_hook", 1141).phase == PH_RECOMPUTE
    assert frame_info(site + "utils/checkpoint.py", "recompute_fn", 1522).phase == PH_RECOMPUTE
    fwd = frame_info(site + "utils/checkpoint.py", "checkpoint", 495)
    assert fwd.label is None and fwd.phase not in (PH_RECOMPUTE, PH_BACKWARD)
    assert frame_info(site + "optim/optimizer.py", "zero_grad", 980).phase == PH_IDLE
    assert frame_info(site + "optim/adam.py", "_init_group", 150).phase == PH_OPTIM
    assert frame_info(site + "nn/modules/module.py", "_call_impl", 1750).phase == PH_FORWARD


def test_without_history_names_the_snapshot_instant():
    obj, _ = gen.build("fsdp2_no_history")
    facts = analyze_memory(obj)
    assert facts.categories_instant == "snapshot" and facts.peak_active_bytes is None


def test_main_thread_stacks_end_a_backward():
    """The next micro-batch's inputs come from the main thread (the stack reaches the script's
    `<module>`); a Python gradient hook runs on the autograd thread (no `<module>`)."""
    user = "/workspace/fsdp-run/train.py"
    batch = ((user, "to_device", 18), (user, "train_step", 50), (user, "main", 97), (user, "<module>", 121))
    hook = ((user, "clip_hook", 30),)
    custom = (
        ("/workspace/fsdp-run/ops.py", "backward", 12),
        ("/usr/lib/python3/site-packages/torch/autograd/function.py", "apply", 307),
        (user, "<module>", 121),
    )
    assert summarize(batch).main_thread
    assert not summarize(hook).main_thread
    assert not summarize(custom).main_thread
