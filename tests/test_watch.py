"""The watch on real CPU ranks: a spike is named in the step it happens, a skip leaves the step
unapplied, a clean run never alarms, a NaN names its param.

Each case trains the tiny GPT with the real megatron-core optimizer under
``optimizer.watch(...)``; the spike is made by the test itself: right before one ``step()`` it
multiplies one param's ``main_grad`` (what the optimizer copies to its fp32 mains) by
:data:`FACTOR` on every rank, as a bad batch or a flipped bit in one layer's grads would. The
expected param and layer are the ones the test touched; the weights and moments a skipped step
must leave alone are the test's own snapshots, compared bitwise.

The statistics themselves (:class:`~norm_optim._step.watch_signals.RollingStats`) are checked
against Python's ``statistics`` module on one process.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
import torch

from norm_optim import NormAwareOptimizer, WatchConfig
from norm_optim.inspection import TorchCommunicator
from norm_optim._step.watch import RollingStats
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer, train_step
from norm_optim.testing.oracle import named_global_parameters
from tests.support.dispatch import host_made
from tests.support.layouts import SMALL, SMALL_MOE, Layout

SEED = 7
FACTOR = 100.0
SPIKED = "decoder.layers.1.mlp.linear_fc1.weight"
EXPERT_SPIKED = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
# A short window for a short test: warm-up over the steepest first steps of training.
CONFIG = dict(warmup=8, window=16)
SPIKE_AT = 16
LAYOUTS = {  # name: (layout, distributed optimizer, the param spiked)
    "dp2-distopt": (Layout(2, SMALL), True, SPIKED),
    "dp2-fp16opt": (Layout(2, SMALL), False, SPIKED),
    "moe-ep2-distopt": (Layout(2, SMALL_MOE, ep=2), True, EXPERT_SPIKED),
    # Muon's layer-wise optimizer (0.19+): each matrix stepped whole on one DP rank.
    "muon-dp2-layer-wise": (Layout(2, SMALL, optimizer="muon", layer_wise=True), False, SPIKED),
}


class CountingCommunicator(TorchCommunicator):
    """Counts norm_optim's all-reduces."""

    all_reduces = 0

    def all_reduce_sum(self, tensor: torch.Tensor, group: Any, async_op: bool) -> Any:
        self.all_reduces += 1
        return super().all_reduce_sum(tensor, group, async_op)


def _build(layout: Layout, dist_opt: bool) -> tuple[list, Any]:
    init_parallel(**layout.parallel())
    chunks = build_model(layout.cfg, use_distributed_optimizer=dist_opt, seed=SEED)
    extra: dict[str, Any] = {}
    if layout.optimizer != "adam":
        extra = dict(
            optimizer=layout.optimizer, use_layer_wise_distributed_optimizer=layout.layer_wise
        )
    return chunks, build_optimizer(chunks, lr=1e-2, weight_decay=0.1, **extra)


class Spiker:
    """Stands in for the optimizer in ``train_step``: before the real ``step()`` of the chosen
    steps, scales one param's ``main_grad`` (or writes a NaN into it) on this rank."""

    def __init__(self, optimizer: Any, chunks: list, name: str) -> None:
        self.optimizer = optimizer
        self.params = dict(named_global_parameters(chunks))
        self.name = name
        self.spike_at: set[int] = set()
        self.nan_at: set[int] = set()
        self.steps = 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> Any:
        self.steps += 1
        param = self.params.get(self.name)  # an expert param lives on one EP rank only
        if param is not None and self.steps in self.spike_at:
            param.main_grad.mul_(FACTOR)
        if param is not None and self.steps in self.nan_at:
            param.main_grad.view(-1)[0] = float("nan")
        return self.optimizer.step()


def _watched_run(
    layout: Layout,
    dist_opt: bool,
    name: str,
    steps: int,
    spike_at: tuple,
    nan_at: tuple,
    config: dict,
) -> dict:
    chunks, inner = _build(layout, dist_opt)
    comm = CountingCommunicator()
    optimizer = NormAwareOptimizer(inner, model=chunks, comm=comm)
    watch = optimizer.watch(**config)
    spiker = Spiker(optimizer, chunks, name)
    spiker.spike_at, spiker.nan_at = set(spike_at), set(nan_at)
    alarms, reduces, results = [], [], []
    for step in range(1, steps + 1):
        before = comm.all_reduces
        results.append(train_step(chunks, spiker, seed=step)[0])
        reduces.append(comm.all_reduces - before)
        alarms += [
            (a.iteration, a.signal, a.layer, a.param, a.non_finite, a.skipped, str(a))
            for a in watch.poll(step)
        ]
    return {"alarms": alarms, "reduces": reduces, "ok": results}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=layout.marks()) for name, (layout, _, _) in LAYOUTS.items()]
)
def test_a_spike_is_named_in_its_step(name: str) -> None:
    """×100 on one param's grads at step 16: an alarm at step 16, on every rank alike, naming
    that param and its layer; none before (the spike's aftermath may alarm after it). The step
    after it is measured per param (two all-reduces: the watch's and the step norms'); every
    other step makes one."""
    layout, dist_opt, param = LAYOUTS[name]
    results = run_ranks(
        _watched_run, layout.world, layout, dist_opt, param, SPIKE_AT + 1, (SPIKE_AT,), (), CONFIG
    )
    first = results[0]["alarms"]
    assert [r["alarms"] for r in results] == [first] * layout.world, "ranks disagree"
    assert first and first[0][0] == SPIKE_AT, first
    iteration, signal, layer, named, _, skipped, line = first[0]
    assert named == param and layer == "1" and not skipped, line
    assert signal in ("grads-norm", "grads-norm/layer/1"), line
    assert line.startswith(f"norm_optim watch: iteration {SPIKE_AT}: ") and param in line
    for seen in results:
        assert seen["reduces"] == [1] * SPIKE_AT + [2], seen["reduces"]
        assert all(seen["ok"])


def test_a_nan_names_its_param_even_in_warmup() -> None:
    """One NaN in one param's grads at step 2 (in the warm-up): that param, by name. Applied
    (no ``skip``), the NaN reaches every weight through the clipping: step 3's alarm names
    ``max_names`` params and counts the rest."""
    layout, dist_opt, param = LAYOUTS["dp2-distopt"]
    results = run_ranks(_watched_run, 2, layout, dist_opt, param, 3, (), (2,), CONFIG)
    for seen in results:
        first, then = seen["alarms"]
        iteration, _, _, _, non_finite, _, line = first
        assert iteration == 2 and non_finite == (param,), line
        assert "non-finite grads in 1 params: " + param in line
        assert then[0] == 3 and len(then[4]) == WatchConfig().max_names, then[-1]
        assert " more" in then[-1]


def test_a_clean_run_never_alarms() -> None:
    """24 steps of real training (grad norms trend and wander)."""
    layout, dist_opt, param = LAYOUTS["dp2-distopt"]
    results = run_ranks(_watched_run, 2, layout, dist_opt, param, 24, (), (), CONFIG)
    for seen in results:
        assert seen["alarms"] == []


def _snapshot(chunks: list, inner: Any) -> list[torch.Tensor]:
    """Every model weight, every fp32 main and every optimizer state tensor, copied."""
    tensors = [p.detach().clone() for chunk in chunks for p in chunk.parameters()]
    for leaf in getattr(inner, "chained_optimizers", [inner]):
        for group in leaf.optimizer.param_groups:
            for p in group["params"]:
                tensors.append(p.detach().clone())
                state = leaf.optimizer.state.get(p, {}).values()
                tensors += [v.detach().clone() for v in state if isinstance(v, torch.Tensor)]
    return tensors


def _skip_run(dist_opt: bool) -> dict:
    layout = Layout(2, SMALL)
    chunks, inner = _build(layout, dist_opt)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    watch = optimizer.watch(skip=True, **CONFIG)
    spiker = Spiker(optimizer, chunks, SPIKED)
    spiker.spike_at = {SPIKE_AT}
    out: dict[str, Any] = {"ok": [], "unchanged": None, "norms": []}
    for step in range(1, SPIKE_AT + 3):
        before = _snapshot(chunks, inner) if step == SPIKE_AT else None
        out["ok"].append(train_step(chunks, spiker, seed=step)[0])
        if before is not None:
            after = _snapshot(chunks, inner)
            out["unchanged"] = len(before) == len(after) and all(
                torch.equal(a, b) for a, b in zip(before, after)
            )
        out["norms"].append(float(optimizer.param_l2_norm()))
    out["alarms"] = [(a.iteration, a.param, a.skipped) for a in watch.poll(SPIKE_AT + 2)]
    return out


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distopt", "fp16opt"])
def test_skip_leaves_the_spiking_step_unapplied(dist_opt: bool) -> None:
    """``skip=True``: the step with ×100 grads returns update_successful=False and leaves every
    weight, main and moment bitwise as it was (Adam's step count too); training goes on."""
    n = SPIKE_AT
    for seen in run_ranks(_skip_run, 2, dist_opt):
        assert seen["ok"] == [True] * (n - 1) + [False] + [True] * 2
        assert seen["unchanged"] is True
        norms = seen["norms"]
        assert norms[n - 1] == norms[n - 2] and norms[n] != norms[n - 1]
        assert seen["alarms"] == [(n, SPIKED, True)]


def _bitwise_run(watched: bool) -> list[float]:
    layout = Layout(2, SMALL)
    chunks, inner = _build(layout, True)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    if watched:
        optimizer.watch(**CONFIG)
    norms = []
    for step in range(1, 7):
        train_step(chunks, optimizer, seed=step)
        norms.append(optimizer.param_l2_norms(per_param=True))
    return [float(v) for n in norms for v in n.per_param.values()]


def test_watching_alone_changes_no_training_bit() -> None:
    watched, plain = run_ranks(_bitwise_run, 2, True), run_ranks(_bitwise_run, 2, False)
    assert watched == plain


def _host_made_per_read() -> dict[str, list[int]]:
    """Tensors made from host data (``torch.tensor``: ``aten.lift_fresh``; towards a GPU each is
    a copy from pageable memory, which stalls the host) inside the reads of four watched steps,
    the last four armed (two total-only, two per-param): the watch's grads, the armed step's
    grads, and everything it sums after the step (weights, moments, the packet)."""
    from norm_optim._step.measurement import StepMeasurement, WatchedGrads

    made: dict[str, list[int]] = {"watch": [], "armed grads": [], "armed after": []}

    def counted(cls: type, name: str, key: str) -> None:
        original = getattr(cls, name)

        def run(self: Any, *args: Any) -> Any:
            result, n = host_made(lambda: original(self, *args))
            made[key].append(n)
            return result

        setattr(cls, name, run)

    counted(WatchedGrads, "grads_ready", "watch")
    counted(StepMeasurement, "grads_ready", "armed grads")
    counted(StepMeasurement, "launch", "armed after")
    chunks, inner = _build(Layout(2, SMALL), True)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    optimizer.watch(**CONFIG)
    for step in range(1, 7):
        if step > 2:
            optimizer.measure_next_step(per_param=step > 4)
        train_step(chunks, optimizer, seed=step)
        if step > 2:
            optimizer.step_norms()
    return made


def test_reads_after_the_first_make_nothing_on_the_host() -> None:
    """The grads of a watched step and an armed step's sums are new plans each step (the grads
    may be new tensors); their index tensors are kept once per layout, so after the first step
    of each kind nothing is made on the host, nothing copied to the device: on a GPU, no stall."""
    for made in run_ranks(_host_made_per_read, 2):
        assert made["watch"][1:] == [0] * 5, made
        assert made["armed grads"][1] == made["armed grads"][3] == 0, made
        # The first total-only and the first per-param arm lay out the moments' sums.
        assert made["armed after"][0] > 0 and made["armed after"][2] > 0, made
        assert made["armed after"][1] == made["armed after"][3] == 0, made


# ---------------------------------------------------------------- one process


def test_rolling_stats_against_the_statistics_module() -> None:
    config = WatchConfig(window=5, warmup=3, min_rel_std=0.0)
    stats = RollingStats(2, config, torch.device("cpu"))
    rng = torch.Generator().manual_seed(0)
    history: list[list[float]] = []
    for i in range(12):
        x = torch.rand(2, generator=rng, dtype=torch.float64) + i * 0.1
        excess, mean, std = stats.judge(x)
        if len(history) >= config.warmup:
            window = history[-config.window :]
            for j in range(2):
                column = [row[j] for row in window]
                m, s = statistics.mean(column), statistics.stdev(column)
                assert float(mean[j]) == pytest.approx(m, rel=1e-12)
                assert float(std[j]) == pytest.approx(s, rel=1e-12)
                assert float(excess[j]) == pytest.approx((float(x[j]) - m) / s, rel=1e-9)
        else:
            assert torch.equal(excess, torch.zeros(2, dtype=torch.float64))
        history.append(x.tolist())
    excess, _, _ = stats.judge(torch.tensor([math.nan, 1.0], dtype=torch.float64))
    assert excess[0] == math.inf


def test_watch_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="warmup"):
        WatchConfig(warmup=1)
    with pytest.raises(ValueError, match="window"):
        WatchConfig(window=1)
    with pytest.raises(ValueError, match="unknown options"):
        WatchConfig.of({"sigma": 3})
    assert WatchConfig.of(True) == WatchConfig() and WatchConfig.of(False) is None
    assert WatchConfig.of({"skip": True}).skip


def test_loss_and_ratio_alarms_and_what_arms_a_step() -> None:
    """The loss and the armed steps' update-to-weight ratios have windows of their own; a loss
    alarm is this rank's and arms nothing, a ratio alarm (reduced, every rank alike) arms the
    next step per param."""
    from norm_optim import Watch

    armed: list[bool] = []
    watch = Watch(WatchConfig(warmup=3, window=8), arm=lambda: armed.append(True))
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.0, 2.05], start=1):
        watch.observe_loss(loss)
        watch.observe_ratios(["0", "1"], torch.tensor([1e-3, 2e-3]) * (1 + 0.01 * step))
        assert watch.poll(step) == ()
    watch.observe_loss(20.0)
    (alarm,) = watch.poll(6)
    assert (alarm.iteration, alarm.signal, alarm.layer, alarm.param) == (6, "loss", None, None)
    assert alarm.value == 20.0 and str(alarm).startswith("norm_optim watch: iteration 6: loss ")
    assert armed == []
    watch.observe_ratios(["0", "1"], torch.tensor([1e-3, 5e-2]))
    (alarm,) = watch.poll(7)
    assert alarm.signal == "update-to-weight/layer/1" and armed == [True]


def test_loop_loss_reads_megatron_loss_dicts() -> None:
    from norm_optim.integrations._scalars import loop_loss

    assert loop_loss({}) is None and loop_loss(None) is None  # not the last pipeline stage
    assert loop_loss({"lm loss": torch.tensor(2.5)}) == 2.5
    assert loop_loss({"lm loss": torch.tensor([5.0, 2.0])}) == 2.5  # [sum, count]
    assert loop_loss({"mtp loss": 1.0, "lm loss": (6.0, 3.0)}) == 2.0
