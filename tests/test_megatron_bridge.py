"""Megatron-Bridge's real ``pretrain()`` logs its params norm from norm_optim, on CPU gloo ranks.

Each case runs Bridge's own loop (``megatron.bridge.training.pretrain``: its setup, its
``setup_optimizer``, its ``train`` and ``training_log``, mock data, ``gpt_step.forward_step``) on
1-4 forked ranks, with ``megatron_bridge.install()`` in every rank. A callback sets every weight
to its layout-independent value (``fill_deterministic_``) at ``on_train_start``; with ``lr=0``
the weights stay there, so every logged norm must equal the exact oracle computed on one process
from the shapes of the *world-1* run. What is checked is what the loop itself wrote: the
TensorBoard scalar ``params-norm`` (float32) and the printed `` params norm: x.xxx |``.
Bridge's own ``calc_params_l2_norm``, called from a callback on the same weights as its loop
calls it, is recorded and shown where it differs (two distributed-optimizer instances: √2 too
large; Megatron-FSDP with EP: each EP rank counts only its own experts).

Skipped when Megatron-Bridge is not installed (``make test-bridge`` builds an environment
with it).
"""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from norm_optim.testing.megatron_bridge import bridge_available, import_bridge

if not bridge_available():
    pytest.skip(
        "megatron-bridge is not installed (make test-bridge installs it)", allow_module_level=True
    )

import_bridge()  # first (its import-time guards), and once in the parent: forked ranks inherit it

from megatron.bridge.training.callbacks import Callback, CallbackContext  # noqa: E402

from norm_optim import NormAwareOptimizer  # noqa: E402
from norm_optim.inspection import TorchCommunicator  # noqa: E402
from norm_optim.integrations import megatron_bridge  # noqa: E402
from norm_optim.testing.megatron_bridge import RankOutput, run_pretrain, tiny_config  # noqa: E402
from norm_optim.testing.oracle import (  # noqa: E402
    fill_deterministic_,
    global_param_shapes,
    oracle_sum_of_squares,
)
from tests.support.loop_tags import oracle_tags  # noqa: E402

SEED = 5
ITERATIONS = 2
_PRINTED = re.compile(r" params norm: ([0-9.]+) \|")


class _DeterministicWeights(Callback):  # type: ignore[misc]
    """At ``on_train_start``: layout-independent weights (and the fp32 main params reloaded);
    records the global shapes the oracle needs."""

    def on_train_start(self, context: CallbackContext) -> None:
        fill_deterministic_(context.model, SEED, context.optimizer)
        context.user_state["shapes"] = global_param_shapes(context.model)
        context.user_state["wrapper"] = type(context.model[0]).__name__


class _BridgeOwnNorm(Callback):  # type: ignore[misc]
    """At every ``on_train_step_end`` (every rank): Bridge's own ``calc_params_l2_norm`` of the
    weights the loop then logs, called as its loop calls it, for comparison."""

    def on_train_step_end(self, context: CallbackContext) -> None:
        from megatron.bridge.training.utils.train_utils import calc_params_l2_norm
        from megatron.core.utils import get_model_config

        norm = calc_params_l2_norm(
            context.model,
            get_model_config(context.model[0]),
            use_megatron_fsdp=context.state.cfg.dist.use_megatron_fsdp,
        )
        context.user_state.setdefault("bridge", []).append(float(norm))


def _install(
    breakdown: bool = False, per_param: bool = False
) -> megatron_bridge.MegatronBridgeIntegration:
    return megatron_bridge.install(breakdown=breakdown, per_param=per_param)


def _tensorboard(logdir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def _scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files under ``logdir``: tag -> step -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _run(
    tmp_path: Path, world: int, breakdown: bool = False, per_param: bool = True, **layout: Any
) -> list[RankOutput]:
    config = tiny_config(
        world_size=world,
        train_iters=ITERATIONS,
        log_interval=1,
        lr=0.0,
        seed=SEED,
        tensorboard_dir=str(tmp_path / "tb"),
        **layout,
    )
    return run_pretrain(
        config,
        world,
        callbacks=[_DeterministicWeights(), _BridgeOwnNorm()],
        before=lambda: _install(breakdown, per_param),
    )


def _oracle_tags(shapes: dict[str, tuple[int, ...]]) -> dict[str, float]:
    """The oracle's value of every scalar ``install(per_param=True)`` writes, by tag."""
    return oracle_tags(oracle_sum_of_squares(shapes, SEED))


def _assert_per_param_scalars(tmp_path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """The event file holds exactly the oracle's per-param / per-layer / per-expert tags, each
    equal to the oracle at every step (TensorBoard stores float32)."""
    expected = _oracle_tags(shapes)
    written = {
        tag: steps
        for tag, steps in _scalars(tmp_path / "tb").items()
        if tag.startswith("params-norm/")
    }
    assert set(written) == set(expected), set(written) ^ set(expected)
    for tag, steps in written.items():
        assert sorted(steps) == list(range(1, ITERATIONS + 1)), tag
        for value in steps.values():
            assert value == pytest.approx(expected[tag], rel=1e-6), tag


def _oracle(shapes: dict[str, tuple[int, ...]]) -> tuple[float, float, float]:
    sums = oracle_sum_of_squares(shapes, SEED)
    expert = math.fsum(s for name, s in sums.items() if ".mlp.experts." in name)
    total = math.fsum(sums.values())
    return math.sqrt(total), math.sqrt(total - expert), math.sqrt(expert)


@pytest.fixture(scope="module")
def world1_shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The global shapes of the world-1 (unparallel) runs, dense and MoE: the oracle's input."""
    shapes = {}
    for kind, layout in (
        ("dense", {}),
        ("moe", {"num_experts": 4}),
        ("dense 4 layers", {"num_layers": 4}),
    ):
        (rank,) = _run(tmp_path_factory.mktemp("world1"), 1, **layout)
        shapes[kind] = rank.user_state["shapes"]
    return shapes


LAYOUTS = {
    "dense world 1": (1, {}),
    "dense DP2 distributed optimizer": (2, {}),
    "dense DP2 Float16 optimizer": (2, {"use_distributed_optimizer": False}),
    "dense TP2": (2, {"tp": 2}),
    "dense PP2 tied embeddings": (2, {"pp": 2}),
    "dense PP2 x VPP2, 4 layers": (2, {"pp": 2, "vpp": 2, "num_layers": 4}),
    "MoE world 1": (1, {"num_experts": 4}),
    "MoE EP2": (2, {"num_experts": 4, "ep": 2}),
    "MoE TP2 sequence parallel": (2, {"num_experts": 4, "tp": 2}),
    "MoE TP2 x EP2 (4 ranks)": (4, {"num_experts": 4, "tp": 2, "ep": 2}),
}


def _assert_logged_norm(tmp_path: Path, ranks: list, expected: float) -> None:
    """What Bridge's loop logged at every iteration: the TensorBoard ``params-norm`` to 1e-6,
    and the printed ``params norm`` to its 3 decimals."""
    written = _tensorboard(tmp_path / "tb", "params-norm")
    assert sorted(written) == list(range(1, ITERATIONS + 1))
    for value in written.values():
        assert value == pytest.approx(expected, rel=1e-6)
    printed = [float(m.group(1)) for line in ranks[-1].lines if (m := _PRINTED.search(line))]
    assert printed == [pytest.approx(expected, abs=5e-4)] * ITERATIONS


@pytest.mark.parametrize("name", LAYOUTS)
def test_logged_params_norm_is_exact(
    name: str, world1_shapes: dict[str, Any], tmp_path: Path
) -> None:
    world, layout = LAYOUTS[name]
    kind = (
        "moe"
        if layout.get("num_experts")
        else "dense 4 layers"
        if layout.get("num_layers") == 4
        else "dense"
    )
    expected, _, _ = _oracle(world1_shapes[kind])
    ranks = _run(tmp_path, world, **layout)

    _assert_logged_norm(tmp_path, ranks, expected)
    _assert_per_param_scalars(tmp_path, world1_shapes[kind])
    # Bridge's own function agrees on these layouts (float32 sums: to ~1e-6).
    for bridge in ranks[-1].user_state["bridge"]:
        assert bridge == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_two_distributed_optimizer_instances(
    kind: str, world1_shapes: dict[str, Any], tmp_path: Path
) -> None:
    """DP2 split into two distributed-optimizer instances: each instance holds a full copy of
    the fp32 shards. norm_optim counts one; Bridge's own function counts both (√2 too large)."""
    layout = {"num_distributed_optimizer_instances": 2}
    if kind == "moe":
        layout["num_experts"] = 4
    expected, _, _ = _oracle(world1_shapes[kind])
    ranks = _run(tmp_path, 2, **layout)

    for value in _tensorboard(tmp_path / "tb", "params-norm").values():
        assert value == pytest.approx(expected, rel=1e-6)
    _assert_per_param_scalars(tmp_path, world1_shapes[kind])
    bridge = ranks[-1].user_state["bridge"][-1]
    print(
        f"\n{kind}, 2 distributed-optimizer instances: norm_optim {expected:.6f}, "
        f"Bridge's calc_params_l2_norm {bridge:.6f} (ratio {bridge / expected:.6f})"
    )
    assert bridge == pytest.approx(math.sqrt(2) * expected, rel=1e-5)


FSDP_LAYOUTS = {  # name: (world size, layout); MoE ones are where Bridge's own value is wrong
    "dense DP2": (2, {}),
    "dense TP2": (2, {"tp": 2}),
    "MoE EP2": (2, {"num_experts": 4, "ep": 2}),
    "MoE EP2 x expert-DP2 (4 ranks)": (4, {"num_experts": 4, "ep": 2}),
}


@pytest.mark.parametrize("name", FSDP_LAYOUTS)
def test_megatron_fsdp(name: str, world1_shapes: dict[str, Any], tmp_path: Path) -> None:
    """Megatron-FSDP (``optim_grads_params``): the logged norm is exact. Bridge's own function
    (its DTensor walk) is right on dense layouts; with experts each EP rank counts only its own
    experts (the expert mesh has no EP dimension), so its value is too small and differs
    between EP ranks."""
    world, layout = FSDP_LAYOUTS[name]
    moe = bool(layout.get("num_experts"))
    expected, _, _ = _oracle(world1_shapes["moe" if moe else "dense"])
    ranks = _run(tmp_path, world, megatron_fsdp=True, **layout)

    _assert_logged_norm(tmp_path, ranks, expected)
    _assert_per_param_scalars(tmp_path, world1_shapes["moe" if moe else "dense"])
    bridge = [rank.user_state["bridge"][-1] for rank in ranks]
    print(
        f"\nMegatron-FSDP {name}: norm_optim {expected:.6f}, Bridge's calc_params_l2_norm "
        f"on ranks 0..{world - 1}: {', '.join(f'{b:.6f}' for b in bridge)}"
    )
    if not moe:
        assert bridge == [pytest.approx(expected, rel=1e-5)] * world
    else:
        assert all(b < expected * (1 - 1e-3) for b in bridge)
        assert len({round(b, 5) for b in bridge}) > 1  # the ranks disagree


def test_breakdown(world1_shapes: dict[str, Any], tmp_path: Path) -> None:
    """``install(breakdown=True)``: the log line and TensorBoard carry dense and expert norms."""
    total, dense, expert = _oracle(world1_shapes["moe"])
    ranks = _run(tmp_path, 2, breakdown=True, num_experts=4, ep=2)

    for tag, expected in (
        ("params-norm", total),
        ("params-norm-dense", dense),
        ("params-norm-expert", expert),
    ):
        written = _tensorboard(tmp_path / "tb", tag)
        assert sorted(written) == list(range(1, ITERATIONS + 1)), tag
        for value in written.values():
            assert value == pytest.approx(expected, rel=1e-6), tag
    line = ranks[-1].matching(" params norm: ")[-1]
    print("\n" + line)
    assert (
        f" params norm: {total:.3f} | params norm dense: {dense:.3f} | "
        f"params norm expert: {expert:.3f} |"
    ) in line


class _CountedReads(Callback):  # type: ignore[misc]
    """Counts the integration's all-reduces on this rank (its communicator is handed to
    ``install``), and checks the loop's optimizer is the wrapper."""

    def __init__(self) -> None:
        outer = self

        class Counting(TorchCommunicator):
            def all_reduce_sum(self, tensor: Any, group: Any, async_op: bool) -> Any:
                outer.steps.append(outer.step)
                return super().all_reduce_sum(tensor, group, async_op)

        self.comm = Counting()
        self.step = 0
        self.steps: list[int] = []

    def on_train_step_end(self, context: CallbackContext) -> None:
        assert type(context.optimizer) is NormAwareOptimizer
        # Fired before the loop increments train_state.step and then logs that new step.
        self.step = context.state.train_state.step + 1

    def on_train_end(self, context: CallbackContext) -> None:
        context.user_state["reduced at"] = self.steps


@pytest.mark.parametrize(
    "intervals",
    [
        # (log_interval, tensorboard_log_interval, TensorBoard on): steps read, on every rank
        pytest.param((2, 1, False), id="print every 2nd, no writer"),
        pytest.param((2, 1, True), id="print every 2nd, TensorBoard every step"),
        pytest.param((3, 2, True), id="print every 3rd, TensorBoard every 2nd"),
    ],
)
def test_norm_is_read_only_when_logged(intervals: tuple[int, int, bool], tmp_path: Path) -> None:
    """The norm (one all-reduce, per-param norms included) is computed at exactly the
    iterations whose log prints or writes it, on every rank alike (the print and the writer are
    on the last rank only)."""
    log_interval, tensorboard_interval, tensorboard = intervals
    iterations = 4
    counter = _CountedReads()
    config = tiny_config(
        world_size=2,
        pp=2,
        train_iters=iterations,
        log_interval=log_interval,
        tensorboard_log_interval=tensorboard_interval,
        tensorboard_dir=str(tmp_path / "tb") if tensorboard else None,
    )
    ranks = run_pretrain(
        config,
        2,
        callbacks=[counter],
        before=lambda: megatron_bridge.install(comm=counter.comm, per_param=True),
    )

    steps = range(1, iterations + 1)
    printed = [s for s in steps if s % log_interval == 0]
    written = [s for s in steps if tensorboard and s % tensorboard_interval == 0]
    expected = sorted(set(printed) | set(written))
    for rank in ranks:
        assert rank.user_state["reduced at"] == expected
    assert len(ranks[-1].matching(" params norm: ")) == len(printed)
    if tensorboard:
        assert sorted(_tensorboard(tmp_path / "tb", "params-norm")) == written


@pytest.mark.parametrize(
    "writer", [None, "tensorboard_dir", "wandb_project", "mlflow_experiment", "comet_project"]
)
def test_log_reads_params_norm(writer: str | None) -> None:
    """Prints at ``log_interval``; writes at ``tensorboard_log_interval`` only where a writer is
    configured (Bridge creates them on the last rank from these fields)."""
    from megatron.bridge.training.config import LoggerConfig

    logger = LoggerConfig(log_interval=4, tensorboard_log_interval=3)
    if writer is not None:
        setattr(logger, writer, "x")
    read = [i for i in range(1, 13) if megatron_bridge.log_reads_params_norm(logger, i)]
    assert read == ([3, 4, 6, 8, 9, 12] if writer else [4, 8, 12])


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"num_experts": 4, "ep": 2}, id="MoE EP2 distributed optimizer"),
        pytest.param({"megatron_fsdp": True}, id="dense DP2 Megatron-FSDP"),
    ],
)
def test_norm_follows_training(layout: dict[str, Any], tmp_path: Path) -> None:
    """With a learning rate, the logged norm moves; it equals Bridge's own value at every step
    (on layouts where Bridge's function is right)."""
    iterations = 3
    config = tiny_config(
        world_size=2,
        train_iters=iterations,
        lr=1e-2,
        tensorboard_dir=str(tmp_path / "tb"),
        **layout,
    )
    ranks = run_pretrain(config, 2, callbacks=[_BridgeOwnNorm()], before=megatron_bridge.install)

    written = _tensorboard(tmp_path / "tb", "params-norm")
    bridge = ranks[-1].user_state["bridge"]
    assert [written[s] for s in range(1, iterations + 1)] == pytest.approx(bridge, rel=1e-5)
    assert len(set(bridge)) == iterations  # the weights did change


def _install_step_norms() -> megatron_bridge.MegatronBridgeIntegration:
    return megatron_bridge.install(per_param=True, step_norms=True)


def test_step_norms(tmp_path: Path) -> None:
    """``install(step_norms=True, per_param=True)`` on MoE EP2: at every logged step the event
    file has ``grads-norm`` equal to Bridge's own ``grad-norm`` (TensorBoard stores float32),
    the updates and moments, per-param grads and updates that add up to their totals, and the
    update-to-weight ratios; the log line shows the ratio."""
    iterations = 3
    config = tiny_config(
        world_size=2,
        train_iters=iterations,
        lr=1e-2,
        tensorboard_dir=str(tmp_path / "tb"),
        num_experts=4,
        ep=2,
    )
    ranks = run_pretrain(config, 2, before=_install_step_norms)
    scalars = _scalars(tmp_path / "tb")
    for step in range(1, iterations + 1):
        assert scalars["grads-norm"][step] == pytest.approx(scalars["grad-norm"][step], rel=1e-6)
        for tag in ("updates-norm", "exp-avg-norm", "exp-avg-sq-norm"):
            assert scalars[tag][step] > 0, tag
        for quantity in ("grads-norm", "updates-norm"):
            per_param = [v[step] for t, v in scalars.items() if t.startswith(f"{quantity}/param/")]
            total = math.sqrt(math.fsum(x * x for x in per_param))
            assert total == pytest.approx(scalars[quantity][step], rel=1e-5), quantity
        ratios = {t: v[step] for t, v in scalars.items() if t.startswith("update-to-weight/")}
        assert ratios
        for tag, ratio in ratios.items():
            layer = tag.rsplit("/", 1)[1]
            updates = scalars[f"updates-norm/layer/{layer}"][step]
            assert ratio == pytest.approx(
                updates / scalars[f"params-norm/layer/{layer}"][step], rel=1e-5
            )
    logged = [line for line in ranks[-1].lines if " grad norm: " in line]
    assert len(logged) == iterations and all(" | update/weight: " in line for line in logged)
    # Training is the same without step norms, bit for bit.
    config.logger.tensorboard_dir = str(tmp_path / "tb-plain")
    run_pretrain(config, 2, before=lambda: megatron_bridge.install(per_param=True))
    plain = _scalars(tmp_path / "tb-plain")
    for tag in ("grad-norm", "params-norm", "lm loss"):
        assert plain[tag] == scalars[tag], tag


class _ReadInCallback(Callback):  # type: ignore[misc]
    def on_train_step_end(self, context: CallbackContext) -> None:
        norm = context.optimizer.param_l2_norm()  # every rank: it is a collective
        context.user_state.setdefault("norm_optim", []).append(float(norm))


def test_optimizer_config_in_a_recipe(world1_shapes: dict[str, Any], tmp_path: Path) -> None:
    """Without install(): ``norm_aware_optimizer_config`` in the recipe makes Bridge's own
    ``setup_optimizer`` return the wrapper (through ``provide``), for callbacks to read."""
    expected, _, _ = _oracle(world1_shapes["dense"])
    config = tiny_config(
        world_size=2,
        train_iters=ITERATIONS,
        lr=0.0,
        seed=SEED,
        num_distributed_optimizer_instances=2,
    )
    config.optimizer = megatron_bridge.norm_aware_optimizer_config(config.optimizer)
    ranks = run_pretrain(config, 2, callbacks=[_DeterministicWeights(), _ReadInCallback()])

    for rank in ranks:
        assert rank.user_state["norm_optim"] == [pytest.approx(expected, rel=1e-6)] * ITERATIONS
    # The loop itself still prints Bridge's own (here √2 too large) value.
    printed = [float(m.group(1)) for line in ranks[-1].lines if (m := _PRINTED.search(line))]
    assert printed == [pytest.approx(math.sqrt(2) * expected, abs=5e-4)] * ITERATIONS


def test_transformer_engine_stays_absent() -> None:
    """The import-time TE stand-in went to Bridge's LoRA module only: for megatron-core (and
    everyone else) Transformer Engine is still not installed."""
    import sys

    from megatron.bridge.peft import lora_layers
    from megatron.core.extensions import transformer_engine as te_extension

    assert "transformer_engine" not in sys.modules
    assert not getattr(te_extension, "HAVE_TE", False)
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        lora_layers.te.Linear(4, 4)


def test_optimizer_config_copy() -> None:
    """The copy keeps every attribute (derived ones too), pickles by its public name, and
    refuses what is not a config."""
    from megatron.bridge.training.config import OptimizerConfig

    original = OptimizerConfig(optimizer="adam", lr=3e-4, use_distributed_optimizer=True)
    original.finalize()
    copy = megatron_bridge.norm_aware_optimizer_config(original, count_frozen=False)
    assert type(copy) is megatron_bridge.NormAwareOptimizerConfig
    assert isinstance(copy, OptimizerConfig) and not hasattr(original, "provide")
    assert {k: v for k, v in vars(copy).items() if k in vars(original)} == vars(original)
    restored = pickle.loads(pickle.dumps(copy))
    assert type(restored) is megatron_bridge.NormAwareOptimizerConfig and restored == copy
    with pytest.raises(TypeError, match="expected an OptimizerConfig instance, got dict"):
        megatron_bridge.norm_aware_optimizer_config({"lr": 1.0})


def test_megatron_fsdp_patches_are_reversible() -> None:
    from megatron.core.distributed import FullyShardedDataParallel
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    from norm_optim.testing._internal.bridge_patches import install_bridge_megatron_fsdp_cpu_patches

    originals = (FullyShardedDataParallel.__init__, adapter.DeviceMesh)
    with install_bridge_megatron_fsdp_cpu_patches():
        assert FullyShardedDataParallel.__init__ is not originals[0]
        assert adapter.DeviceMesh is not originals[1]
    assert (FullyShardedDataParallel.__init__, adapter.DeviceMesh) == originals


def test_install_uninstall_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.bridge.training import setup, train

    originals = (setup.setup_optimizer, train.calc_params_l2_norm, train.training_log)
    with megatron_bridge.install() as integration:
        assert integration.installed
        assert train.training_log != originals[2]
        with pytest.raises(RuntimeError, match="already installed"):
            megatron_bridge.install()
    assert (setup.setup_optimizer, train.calc_params_l2_norm, train.training_log) == originals
    integration.uninstall()  # twice is fine

    monkeypatch.delattr(train, "training_log")
    with pytest.raises(
        megatron_bridge.MegatronBridgeVersionError,
        match=r"megatron-bridge 0\.6\.\d+ on megatron-core \S+ has no "
        r"train\.training_log;",
    ):
        megatron_bridge.install()


TORCH_FSDP2_LAYOUTS = {"dense DP2": (2, {}), "dense TP2 x DP2 (4 ranks)": (4, {"tp": 2})}


@pytest.mark.parametrize("name", TORCH_FSDP2_LAYOUTS)
def test_torch_fsdp2(name: str, tmp_path: Path) -> None:
    """torch FSDP2 (``dist.use_torch_fsdp2``: megatron's ``TorchFullyShardedDataParallel``,
    Float16 optimizer, untied embeddings): the logged norm is exact. Oracle: the shapes of the
    same untied model at world 1. Bridge's own function (its own DTensor walk) agrees here."""
    world, layout = TORCH_FSDP2_LAYOUTS[name]
    options = dict(torch_fsdp2=True, use_distributed_optimizer=False)
    (alone,) = _run(tmp_path / "world1", 1, **options)
    expected, _, _ = _oracle(alone.user_state["shapes"])
    ranks = _run(tmp_path, world, **options, **layout)

    assert ranks[-1].user_state["wrapper"] == "TorchFullyShardedDataParallel"
    _assert_logged_norm(tmp_path, ranks, expected)
    for bridge in ranks[-1].user_state["bridge"]:
        assert bridge == pytest.approx(expected, rel=1e-5)


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after the 8-byte signature)."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR", header
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_plot_of_a_real_run(tmp_path: Path) -> None:
    """``python -m norm_optim.plot`` on the TensorBoard directory of a real ``pretrain()`` (MoE
    EP2, lr > 0, per-param norms): a PNG of the documented size, and what it draws is what the
    run logged (the per-layer norms at every step; the params whose last / first ratio is
    largest)."""
    pytest.importorskip("matplotlib")
    from norm_optim import plot

    iterations, top = 4, 3
    config = tiny_config(
        world_size=2,
        train_iters=iterations,
        lr=1e-2,
        num_experts=4,
        ep=2,
        tensorboard_dir=str(tmp_path / "tb"),
    )
    run_pretrain(config, 2, before=lambda: megatron_bridge.install(per_param=True))
    out = tmp_path / "norms.png"
    assert plot.main([str(tmp_path / "tb"), "-o", str(out), "--top", str(top)]) == 0

    assert out.is_file() and _png_size(out) == plot.SIZE
    logged = _scalars(tmp_path / "tb")
    data = plot.load_norms(tmp_path / "tb", top_k=top)
    steps = list(range(1, iterations + 1))
    assert data.steps == steps
    layers = {
        tag.removeprefix("params-norm/layer/"): values
        for tag, values in logged.items()
        if tag.startswith("params-norm/layer/")
    }
    assert set(data.layers) == set(layers) == {"0", "1"}
    for layer, values in data.layers.items():
        assert values == [layers[layer][s] for s in steps]
    params = {
        tag.removeprefix("params-norm/param/"): values
        for tag, values in logged.items()
        if tag.startswith("params-norm/param/")
    }
    ratios = {name: v[iterations] / v[1] for name, v in params.items() if v[1] > 0}
    assert list(data.growing) == sorted(ratios, key=lambda n: (-ratios[n], n))[:top]
    for name, (got_steps, values) in data.growing.items():
        assert got_steps == steps and values == [params[name][s] for s in steps]
    assert data.relative_layers()[0][0] == 1.0 and len(set(data.relative_layers()[0])) > 1


def test_plot_of_a_run_with_step_norms(tmp_path: Path) -> None:
    """With ``install(step_norms=True, per_param=True)`` the plot also draws the per-layer grads,
    updates and update-to-weight ratios, exactly as logged, in a PNG of the same size."""
    pytest.importorskip("matplotlib")
    from norm_optim import plot

    iterations = 3
    config = tiny_config(
        world_size=2,
        train_iters=iterations,
        lr=1e-2,
        num_experts=4,
        ep=2,
        tensorboard_dir=str(tmp_path / "tb"),
    )
    run_pretrain(config, 2, before=_install_step_norms)
    out = tmp_path / "norms.png"
    assert plot.main([str(tmp_path / "tb"), "-o", str(out)]) == 0
    assert out.is_file() and _png_size(out) == plot.SIZE
    logged = _scalars(tmp_path / "tb")
    data = plot.load_norms(tmp_path / "tb")
    steps = list(range(1, iterations + 1))
    assert set(data.step_layers) == set(plot.STEP_LAYER_TAGS)
    for prefix, layers in data.step_layers.items():
        assert set(layers) == {"0", "1"}
        for layer, values in layers.items():
            assert values == [logged[prefix + layer][s] for s in steps], (prefix, layer)


def test_plot_refuses_a_run_without_per_param_norms(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from norm_optim import plot

    with pytest.raises(
        ValueError,
        match=r"no params-norm/layer/<layer> scalars under .*"
        r"install\(per_param=True\)",
    ):
        plot.load_norms(tmp_path)
