"""A watched step's cost, and per-param weight norms', do not grow with the number of param
tensors, and the bound read of the grads is exact.

The watch runs on every step, so what it adds to a step is counted in aten ops (torch's
dispatch mode: counts are deterministic, times are not) and in Python calls (``sys.setprofile``:
the host work that is not kernel work), on the real megatron-core optimizers, for the tiny GPT at
two depths, 100 and 1,000 param tensors: the extra ops are at most :data:`MAX_EXTRA_OPS` at both,
and differ by at most the pair of ops of one more read path; the extra Python calls differ by at
most :data:`CALLS_SLACK` (the plain step's grow tenfold);
``param_l2_norms(per_param=True)`` makes the same number of ops at both. The bound read (views
of Megatron's DDP grad buffers) is compared, slot by slot, with the per-tensor sums of the same
grads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from benchmarks.step_norms import NEVER_CLIPS, aten_ops, python_calls
from norm_optim import NormAwareOptimizer
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer, train_step
from tests.support.layouts import SMALL, SMALL_MOE, Layout

MAX_EXTRA_OPS = 32
MAX_PER_PARAM_OPS = 48
# The Python calls a watched step adds may differ by the read path a layout takes (a few calls),
# never by a count per tensor (the plain step makes ~100 per tensor).
CALLS_SLACK = 16
# Hidden 16 with biases: 12 tensors per layer and 4 more (embeddings, final norm).
MANY_SMALL = TinyGPTConfig(
    hidden_size=16, num_layers=8, num_attention_heads=2, vocab_size=32, seq_length=8
)
DEPTHS = {100: 8, 1000: 83}  # param tensors: layers


def _extra_ops(dist_opt: bool) -> dict[int, dict[str, int]]:
    out = {}
    for tensors, layers in DEPTHS.items():
        init_parallel()
        chunks = build_model(
            dataclasses.replace(MANY_SMALL, num_layers=layers), use_distributed_optimizer=dist_opt
        )
        optimizer = NormAwareOptimizer(build_optimizer(chunks, clip_grad=NEVER_CLIPS), model=chunks)
        train_step(chunks, optimizer)  # the step is then re-run on the same grads
        assert len(optimizer.registry.counted) == tensors
        for _ in range(2):  # past the first steps' one-time work (Adam's state, lazy imports)
            optimizer.step()
        plain = aten_ops(optimizer.step)
        per_param = lambda: float(optimizer.param_l2_norms(per_param=True).total)  # noqa: E731
        per_param()  # the names exchange
        norms_ops = aten_ops(per_param)
        watch = optimizer.watch()
        optimizer.step()  # the first watched step binds its reads
        watched = aten_ops(optimizer.step)
        watched_calls = python_calls(optimizer.step)
        loose = optimizer._state.watched_grads.grads.loose
        optimizer.unwatch()
        optimizer.step()
        plain_calls = python_calls(optimizer.step)
        out[tensors] = {
            "plain": plain,
            "extra": watched - plain,
            "loose": loose,
            "per_param": norms_ops,
            "plain_calls": plain_calls,
            "extra_calls": watched_calls - plain_calls,
        }
        assert watch.poll() == ()
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distopt", "fp16opt"])
def test_a_watched_step_adds_the_same_ops_at_100_and_1000_tensors(dist_opt: bool) -> None:
    (seen,) = run_ranks(_extra_ops, 1, dist_opt, timeout=600)
    # Per-param weight norms: their small fp32 mains read as one pack (one copy, one segmented
    # read), whatever their number.
    assert seen[1000]["per_param"] == seen[100]["per_param"] <= MAX_PER_PARAM_OPS, seen
    extra = {n: s["extra"] for n, s in seen.items()}
    assert max(extra.values()) <= MAX_EXTRA_OPS, seen
    # What may differ is which of the read's paths a layout takes (a copy of the rows a
    # boundary crosses, or fine rows in place): a pair of ops, never a count per tensor.
    assert abs(extra[1000] - extra[100]) <= 2, seen
    assert all(s["loose"] == 0 for s in seen.values()), seen  # every grad read in place
    assert seen[1000]["plain"] > 5 * seen[100]["plain"], seen  # the plain step does grow
    # The host work besides the ops: flat too.
    calls = {n: s["extra_calls"] for n, s in seen.items()}
    assert calls[100] > 0 and abs(calls[1000] - calls[100]) <= CALLS_SLACK, seen
    assert seen[1000]["plain_calls"] > 5 * seen[100]["plain_calls"], seen


LAYOUTS = {
    "dp2-distopt": (Layout(2, SMALL), True),
    "dp2-fp16opt": (Layout(2, SMALL), False),
    "tp2-distopt": (Layout(2, SMALL, tp=2), True),
    "moe-ep2-distopt": (Layout(2, SMALL_MOE, ep=2), True),
    # Params of a few hundred elements: the buffers are read as fine rows in place.
    "dp2-distopt-many-small": (Layout(2, MANY_SMALL), True),
    "dp2-fp16opt-many-small": (Layout(2, MANY_SMALL), False),
}


def _bound_against_each_tensor(layout: Layout, dist_opt: bool) -> dict[str, Any]:
    from norm_optim._step.measurement import WatchedGrads

    init_parallel(**layout.parallel())
    chunks = build_model(layout.cfg, use_distributed_optimizer=dist_opt, seed=3)
    optimizer = NormAwareOptimizer(build_optimizer(chunks, lr=1e-2), model=chunks)
    seen: dict[str, Any] = {}
    original = WatchedGrads.grads_ready

    def compare(self: Any) -> None:
        bound = self.grads()
        grads = [None if e is None else e.grad for e in self.grads._entries]
        each = self.reducer.local_squares(grads, per_param=True)[2:]  # the per-param slots
        n = each.numel()
        seen.setdefault("errors", []).append(
            float(((bound[2 : 2 + n] - each).abs() / each.clamp_min(1e-30)).max())
        )
        seen["loose"] = self.grads.loose
        original(self)

    WatchedGrads.grads_ready = compare  # type: ignore[method-assign]
    try:
        optimizer.watch(warmup=2, window=4)
        for step in range(1, 4):
            train_step(chunks, optimizer, seed=step)
    finally:
        WatchedGrads.grads_ready = original  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_bound_read_equals_the_sums_tensor_by_tensor(name: str) -> None:
    layout, dist_opt = LAYOUTS[name]
    for seen in run_ranks(_bound_against_each_tensor, layout.world, layout, dist_opt):
        assert seen["loose"] == 0
        assert max(seen["errors"]) < 1e-6, seen


def test_segmented_squares_against_float64() -> None:
    """Random segments (single elements to whole rows and more, gaps, a buffer ending inside a
    row, tiny buffers) against float64 sums; values read live at each call, nothing made on
    the host."""
    import random

    from norm_optim._kernels.segments import FINE, Segment, SegmentedSquares
    from tests.support.dispatch import host_made

    rng = random.Random(0)
    paths: set[str] = set()
    for _ in range(30):
        buffers, segments = [], []
        for _ in range(rng.randint(1, 3)):
            n = rng.choice([5, 31, 1000, 1500, 4096, 70000, 300000])
            segs, pos = [], rng.randint(0, 3)
            while pos < n:
                m = min(rng.choice([1, 5, 16, 33, 1024, 2000, 5000, 100000]), n - pos)
                if rng.random() < 0.8:
                    segs.append(Segment(pos, m, rng.randrange(7)))
                pos += m + rng.choice([0, 0, 3, 100, 70000])
            rng.shuffle(segs)
            buffers.append(torch.randn(n))
            segments.append(segs)
        plan = SegmentedSquares(buffers, segments, 7, torch.device("cpu"))
        paths |= {"fine rows in place" for rows, _ in plan._reads if rows.shape[1] == FINE}
        paths |= {"copied rows"} if plan._copies else set()
        paths |= {"tails"} if plan._tails else set()
        for b in buffers:
            b.mul_(1.5)
        expected = torch.zeros(7, dtype=torch.float64)
        for b, segs in zip(buffers, segments):
            for s in segs:
                expected[s.slot] += b[s.offset : s.offset + s.numel].double().square().sum()
        got, made = host_made(plan)
        assert made == 0
        assert torch.allclose(got[:7], expected, rtol=1e-6, atol=0)
    assert paths == {"fine rows in place", "copied rows", "tails"}  # every path was taken
