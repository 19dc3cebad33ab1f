"""What an armed step costs: ``python -m benchmarks.step_norms [--quick] [--out FILE]``.

For each case (a tiny GPT with the distributed optimizer, on one CPU rank and one thread), the
median of a plain ``step()`` and of an armed one (``measure_next_step()`` + ``step()`` +
``step_norms()``, total-only and per-param), each armed / plain ratio the median over adjacent
(plain, armed) pairs (the machine is shared: separate medians drift with its load), the
total-only ``param_l2_norm()`` beside them, the extra peak memory of the armed step's own work
(``benchmarks.param_norm.memory``: the grads' sums, the sums after the step, and the scratch
the in-step read of Adam's update holds during the step), the largest fp32 tensor the rank holds
(the bound is that + the update scratch's byte budget, 1 MiB on CPU), the bytes each call reads,
the aten ops an armed step adds per param tensor (torch's dispatch mode), and a watched step
(``watch()``: the grads judged every step), timed in pairs with a plain one. The step is re-run
on the same grads (no forward / backward): what is timed is the step.

The **floor** of an exact armed step, from medians of the same run: a plain step plus the sums
of squares every armed step returns besides the update (the grads, the weights, both moments:
the same calls, on the same tensors; ``reads_s``) plus the three passes the cheapest exact update
read makes over each weight (copy it, subtract it after, sum the difference; ``difference_s``:
here without a step between, so the subtraction gives 0 in the same time). A sum, not a paired
run: timed together, the allocator's page faults move between the parts. ``armed_over_floor``
is what the armed machinery adds on top (the step run chunk by chunk, its Python, the packet).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

CASES = {  # name: TinyGPTConfig fields
    "h64-l2": dict(hidden_size=64, num_layers=2),
    "h256-l4": dict(hidden_size=256, num_layers=4, vocab_size=1024),
    "h512-l4": dict(hidden_size=512, num_layers=4, vocab_size=4096),
}
QUICK = ("h64-l2",)
# By tensor count (``--tensors``): many small layers (hidden 16, 12 param tensors per layer and 4
# more), and MoE layers of many experts (2 tensors per expert): what grows with the number of
# tensors shows there, where each tensor is cheap.
_SMALL = dict(hidden_size=16, num_attention_heads=2, vocab_size=32, seq_length=8)
_TINY = dict(_SMALL, hidden_size=4, num_attention_heads=1, ffn_hidden_size=16)
TENSOR_CASES: dict[str, dict[str, Any]] = {
    "layers-8": dict(_SMALL, num_layers=8),
    "layers-83": dict(_SMALL, num_layers=83),
    "layers-833": dict(_SMALL, num_layers=833),
    "moe-8x64": dict(_SMALL, num_layers=8, num_experts=64, moe_ffn_hidden_size=16),
    "moe-8x640": dict(_SMALL, num_layers=8, num_experts=640, moe_ffn_hidden_size=16),
    # Tensors of ~20 elements (hidden 4): 100 of them, where the watch's kernels read ~nothing, so
    # its time there is its host work (the ops' dispatch and its Python calls, both counted and
    # the same at 10,000 tensors); and 10,000, where on a CPU its kernels add what they read.
    "layers-8-h4": dict(_TINY, num_layers=8),
    "layers-833-h4": dict(_TINY, num_layers=833),
}
# Megatron clips the grads in place and these cases re-run the step on the same grads: at the
# default clip_grad the norm then hovers at the threshold, and some steps scale every grad (two
# ops per tensor) and some do not. Far above the norm every step computes it and none scales,
# so the plain step's op count is the same at every step.
NEVER_CLIPS = 1e6
QUICK_TENSORS = ("layers-8",)
REPEATS = 5
TENSOR_REPEATS = 21  # a watched step's extra host time is a small difference: more pairs
# Bytes each element of a counted fp32 tensor costs a call to read from memory: the weights (4),
# and at an armed step also the grads (4) and the two moments (4 + 4). Adam's update is read in
# its step, a cache-sized chunk at a time (copy, step, subtract, sum): no extra pass over memory
# (deriving it after the step, the fallback, would read the weight and both moments again: 12).
READ_BYTES = {"param_l2_norm": 4, "armed": 4 + 4 + 8}


def aten_ops(fn: Callable[[], Any]) -> int:
    """How many aten ops ``fn`` dispatches (torch's dispatch mode: a ``torch._foreach_*`` call
    over a list is one op, as it is one kernel launch per list on an accelerator)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def python_calls(fn: Callable[[], Any]) -> int:
    """How many Python and builtin function calls ``fn`` makes (``sys.setprofile``): with
    :func:`aten_ops`, the host work of a call that is not kernel work. On an accelerator, where
    kernels run asynchronously, a call whose ops and Python calls are both flat in the tensor
    count takes a flat host time."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return calls


def _pairs(
    plain: Callable[[], Any], other: Callable[[], Any], repeats: int = REPEATS
) -> list[tuple[float, float]]:
    """(other's seconds, plain's seconds) of adjacent runs."""
    pairs = []
    for _ in range(repeats):
        start = time.perf_counter()
        plain()
        between = time.perf_counter()
        other()
        pairs.append((time.perf_counter() - between, between - start))
    return pairs


def _paired(plain: Callable[[], Any], other: Callable[[], Any]) -> tuple[float, float]:
    """(median of ``other``, median of other / plain over adjacent pairs)."""
    pairs = _pairs(plain, other)
    return statistics.median(o for o, _ in pairs), statistics.median(o / p for o, p in pairs)


def _median(fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _case(fields: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.param_norm.memory import PeakMemory
    from norm_optim import NormAwareOptimizer
    from norm_optim._kernels.chunks import default_budget
    from norm_optim._step.measurement import StepMeasurement, observed_step
    from norm_optim.testing import init_parallel
    from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer, train_step

    init_parallel()
    chunks = build_model(TinyGPTConfig(**fields), use_distributed_optimizer=True)
    optimizer = NormAwareOptimizer(build_optimizer(chunks), model=chunks)
    train_step(chunks, optimizer)

    def armed(per_param: bool) -> Callable[[], Any]:
        def run() -> None:
            optimizer.measure_next_step(per_param=per_param)
            optimizer.step()
            float(optimizer.step_norms().updates.total)

        return run

    plain, total_only, per_param = optimizer.step, armed(False), armed(True)
    for fn in (plain, total_only, per_param):  # warm up (per-param: the names exchange)
        fn()
    ops = {name: aten_ops(fn) for name, fn in (("plain", plain), ("armed", total_only))}
    ops["armed_per_param"] = aten_ops(per_param)
    # The armed step's own work, isolated (Adam's temporaries vary by megabytes from one plain
    # step to the next, so "armed minus plain" measures noise): the grads' sums as the hook
    # takes them, and everything after the step (weights, derived updates, moments, packet).
    peak = PeakMemory(torch.device("cpu"))
    measurement = StepMeasurement(optimizer._current_reducer(), optimizer.wrapped_optimizer, False)
    observed_step(optimizer.wrapped_optimizer, measurement, None)
    hook_peak = peak.measure(measurement._grad_squares)
    after_peak = peak.measure(lambda: measurement.launch().wait())
    # During the step: the readers' scratch (one reader's at a time, each freed after its step),
    # beside Adam's own temporaries; and, as a cross-check, the measured peak of a whole armed
    # step minus a plain one's.
    in_step_scratch = max(
        (
            r.differences.plan.scratch_bytes
            for r in measurement.plan.readers
            if getattr(r, "differences", None) is not None
        ),
        default=0,
    )
    reads, difference = _reads(optimizer, measurement)
    plain_peak = peak.measure(plain)
    armed_peak = peak.measure(total_only)
    # The always-on watch (grads per param judged every step; no alarm in a clean run), timed
    # in pairs with a plain step: the machine's load drifts between separate medians.
    watched_s, watched_ratio = _watched(optimizer)
    counted = optimizer.registry.counted
    numel = sum(r.numel for r in counted)
    row = {
        "numel": numel,
        "tensors": len(counted),
        "largest_fp32_tensor_bytes": max(r.numel for r in counted) * 4,
        # The bound on an armed step's extra memory: the largest fp32 tensor + the scratch budget.
        "bound_bytes": max(r.numel for r in counted) * 4 + default_budget(torch.device("cpu")),
        "plain_step_s": _median(plain),
        "watched_step_s": watched_s,
        "param_l2_norm_s": _median(lambda: float(optimizer.param_l2_norm())),
        "aten_ops_plain_step": ops["plain"],
        "extra_aten_ops_per_tensor": (ops["armed"] - ops["plain"]) / len(counted),
        "extra_aten_ops_per_tensor_per_param": (ops["armed_per_param"] - ops["plain"])
        / len(counted),
        "memory_method": peak.method,
        "extra_peak_bytes": None
        if hook_peak is None or after_peak is None
        else max(hook_peak, after_peak, in_step_scratch),
        "in_step_scratch_bytes": in_step_scratch,
        "armed_minus_plain_peak_bytes": None
        if plain_peak is None or armed_peak is None
        else armed_peak - plain_peak,
        "bytes_read_param_l2_norm": numel * READ_BYTES["param_l2_norm"],
        "bytes_read_armed_step": numel * READ_BYTES["armed"],
    }
    row["armed_step_s"], row["armed_over_plain"] = _paired(plain, total_only)
    row["armed_per_param_step_s"], row["armed_per_param_over_plain"] = _paired(plain, per_param)
    row["watched_over_plain"] = watched_ratio
    row["reads_s"], row["difference_s"] = _median(reads), _median(difference)
    row["floor_step_s"] = row["plain_step_s"] + row["reads_s"] + row["difference_s"]
    row["floor_over_plain"] = row["floor_step_s"] / row["plain_step_s"]
    row["armed_over_floor"] = row["armed_step_s"] / row["floor_step_s"]
    return row


def _reads(optimizer: Any, measurement: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """(the sums of squares an armed step returns besides the updates — grads, weights,
    moments — as its own calls take them; the passes of the cheapest exact update read: each
    fp32 weight copied, subtracted, its difference summed): together, the least an exact armed
    step adds to a plain one."""
    import torch

    reducer, plan = optimizer._current_reducer(), measurement.plan
    weights = [r.tensor.view(-1) for r in reducer.registry.counted if r.tensor.is_contiguous()]

    def reads() -> None:
        reducer.local_squares(plan.grads())
        reducer.local_weight_squares()
        if plan.has_moments:
            reducer.local_squares(*plan.moments())

    scratch = torch.empty(max(w.numel() for w in weights))  # the reader's, made once here

    def difference() -> None:
        for w in weights:
            place = scratch[: w.numel()]
            place.copy_(w)
            place.sub_(w)
            torch.linalg.vector_norm(place)

    return reads, difference


def _watched(optimizer: Any) -> tuple[float, float]:
    """(median watched step, median of watched / plain over adjacent pairs)."""
    pairs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        optimizer.step()
        plain = time.perf_counter() - start
        watch = optimizer.watch()  # builds its reads (not timed)
        optimizer.step()  # the first watched step binds them (not timed)
        start = time.perf_counter()
        optimizer.step()
        pairs.append((time.perf_counter() - start, plain))
        optimizer.unwatch()
        assert watch.poll() == (), "a clean benchmark run must not alarm"
    return (
        statistics.median(w for w, _ in pairs),
        statistics.median(w / p for w, p in pairs),
    )


class _Idle:
    """A Megatron optimizer's ``step()`` with nothing in it (``prepare_grads`` then
    ``step_with_ready_grads``): a watched step of it costs only what the watch adds."""

    def prepare_grads(self) -> bool:
        return False  # found no inf

    def step_with_ready_grads(self) -> bool:
        return True

    def step(self) -> bool:
        return self.prepare_grads() or self.step_with_ready_grads()


def watched_path(optimizer: Any) -> Callable[[], None]:
    """``NormAwareOptimizer.step``'s watched path (the wrapper's checks, the hooks, the read, the
    all-reduce, the judging, the veto) on an idle step: what a watched step adds, alone."""
    from norm_optim._step.measurement import observed_step

    idle = _Idle()

    def run() -> None:
        observed_step(idle, None, optimizer._watched_grads(optimizer._current_reducer()))

    return run


def _tensor_case(fields: dict[str, Any]) -> dict[str, Any]:
    """What grows with the number of param tensors: the aten ops a watched step, an armed
    per-param step and ``param_l2_norms(per_param=True)`` add (counted), and the host time of
    a watched step above a plain one: the median of adjacent pairs (the watch is switched off
    and on between them, its reads kept), its read alone, and everything the watched step
    adds (the wrapper's checks, the hooks, the read, the veto) timed on an idle step."""
    from norm_optim import NormAwareOptimizer
    from norm_optim.testing import init_parallel
    from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer, train_step

    init_parallel()
    chunks = build_model(TinyGPTConfig(**fields), use_distributed_optimizer=True)
    start = time.perf_counter()
    optimizer = NormAwareOptimizer(build_optimizer(chunks, clip_grad=NEVER_CLIPS), model=chunks)
    wrap_s = time.perf_counter() - start
    train_step(chunks, optimizer)
    plain = optimizer.step

    def armed() -> None:
        optimizer.measure_next_step(per_param=True)
        optimizer.step()
        float(optimizer.step_norms().updates.total)

    def per_param() -> None:
        float(optimizer.param_l2_norms(per_param=True).total)

    for fn in (plain, plain, armed, per_param):  # past every first call's one-time work
        fn()
    ops = {"plain": aten_ops(plain), "armed": aten_ops(armed), "per_param": aten_ops(per_param)}
    watch = optimizer.watch()
    plain()  # the first watched step binds its reads
    ops["watched"] = aten_ops(plain)
    calls = {"watched": python_calls(plain)}
    state = optimizer._state

    def unwatched() -> None:
        state.watch = None
        try:
            plain()
        finally:
            state.watch = watch

    pairs = _pairs(unwatched, plain, TENSOR_REPEATS)
    # The watch's own read (sum, all-reduce, judge), timed alone: the paired difference above is
    # a small difference of two large, noisy times.
    assert state.watched_grads is not None
    watched = state.watched_grads
    read_s = min(_median(watched.grads_ready) for _ in range(3))
    watch_only = watched_path(optimizer)
    watch_host_s = min(_median(watch_only) for _ in range(3))
    calls["plain"] = python_calls(unwatched)
    calls["watch_only"] = python_calls(watch_only)
    armed_s, armed_ratio = _paired(unwatched, armed)
    assert watch.poll() == (), "a clean benchmark run must not alarm"
    tensors = len(optimizer.registry.counted)
    return {
        "tensors": tensors,
        "numel": sum(r.numel for r in optimizer.registry.counted),
        "aten_ops_plain_step": ops["plain"],
        "extra_aten_ops_watched_step": ops["watched"] - ops["plain"],
        "extra_aten_ops_per_tensor_armed_per_param": (ops["armed"] - ops["plain"]) / tensors,
        "python_calls_plain_step": calls["plain"],
        "extra_python_calls_watched_step": calls["watched"] - calls["plain"],
        "python_calls_watch_only": calls["watch_only"],
        "aten_ops_param_l2_norms_per_param": ops["per_param"],
        "plain_step_s": statistics.median(p for _, p in pairs),
        "watched_step_s": statistics.median(w for w, _ in pairs),
        "watched_minus_plain_s": statistics.median(w - p for w, p in pairs),
        "watched_over_plain": statistics.median(w / p for w, p in pairs),
        "watch_read_s": read_s,
        "watch_host_s": watch_host_s,
        "wrap_s": wrap_s,
        "armed_per_param_step_s": armed_s,
        "armed_per_param_over_plain": armed_ratio,
        "param_l2_norms_per_param_s": _median(per_param),
    }


def _tensor_rows(quick: bool, only: Sequence[str] = ()) -> list[dict[str, Any]]:
    from norm_optim.testing import run_ranks

    rows = []
    for name, fields in TENSOR_CASES.items():
        if (quick and name not in QUICK_TENSORS) or (only and name not in only):
            continue
        (row,) = run_ranks(_tensor_case, 1, fields, timeout=1800)
        rows.append({"case": name, **row})
        print(
            f"{name}: {row['tensors']} tensors, plain {row['plain_step_s'] * 1e3:.3g} ms "
            f"({row['aten_ops_plain_step']} ops); watched +{row['extra_aten_ops_watched_step']} "
            f"ops, +{row['extra_python_calls_watched_step']} Python calls, "
            f"+{row['watched_minus_plain_s'] * 1e3:.2f} ms ({row['watched_over_plain']:.2f}x; "
            f"its read alone {row['watch_read_s'] * 1e3:.2f} ms, all it adds on an idle step "
            f"{row['watch_host_s'] * 1e3:.2f} ms)"
            f"; armed per-param +{row['extra_aten_ops_per_tensor_armed_per_param']:.2f} ops per "
            f"tensor ({row['armed_per_param_over_plain']:.2f}x); param_l2_norms(per_param) "
            f"{row['aten_ops_param_l2_norms_per_param']} ops, "
            f"{row['param_l2_norms_per_param_s'] * 1e3:.3g} ms"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    from norm_optim.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument(
        "--tensors",
        action="store_true",
        help=f"the cases by tensor count instead ({', '.join(TENSOR_CASES)})",
    )
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        choices=[*CASES, *TENSOR_CASES],
        help="only this case (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.tensors:
        rows = _tensor_rows(args.quick, args.case)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    rows = []
    for name, fields in CASES.items():
        if (args.quick and name not in QUICK) or (args.case and name not in args.case):
            continue
        (row,) = run_ranks(_case, 1, fields, timeout=600)
        rows.append({"case": name, **row})
        print(
            f"{name}: {row['numel']} elements, plain {row['plain_step_s'] * 1e3:.3g} ms, "
            f"armed {row['armed_step_s'] * 1e3:.3g} ms ({row['armed_over_plain']:.2f}x paired; "
            f"per-param {row['armed_per_param_step_s'] * 1e3:.3g} ms, "
            f"{row['armed_per_param_over_plain']:.2f}x), watched "
            f"{row['watched_step_s'] * 1e3:.3g} ms ({row['watched_over_plain']:.2f}x), param_l2_norm "
            f"{row['param_l2_norm_s'] * 1e3:.3g} ms, extra peak {row['extra_peak_bytes']} B "
            f"(bound {row['bound_bytes']} B; in-step scratch {row['in_step_scratch_bytes']} B, "
            f"armed - plain peak measured {row['armed_minus_plain_peak_bytes']} B), extra aten ops per "
            f"tensor {row['extra_aten_ops_per_tensor']:.1f} (per-param "
            f"{row['extra_aten_ops_per_tensor_per_param']:.1f}); floor {row['floor_over_plain']:.2f}x "
            f"(plain + the sums of grads, weights, moments {row['reads_s'] * 1e3:.3g} ms + an "
            f"update's copy, subtraction and sum {row['difference_s'] * 1e3:.3g} ms), armed / "
            f"floor {row['armed_over_floor']:.2f}x"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
