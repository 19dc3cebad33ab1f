"""Megatron-Bridge's real ``pretrain()`` logs its params norm from norm_optim, on CPU gloo ranks.

Each case runs Bridge's own loop (``megatron.bridge.training.pretrain``: its setup, its
``setup_optimizer``, its ``train`` and ``training_log``, mock data, ``gpt_step.forward_step``) on
1-4 forked ranks, with ``megatron_bridge.install()`` in every rank. A callback sets every weight
to its layout-independent value (``fill_deterministic_``) at ``on_train_start``; with ``lr=0``
the weights stay there, so every logged norm must equal the exact oracle computed on one process
from the shapes of the *world-1* run. What is checked is what the loop itself wrote: the
TensorBoard scalar ``params-norm`` (float32) and the printed `` params norm: x.xxx |``.
Bridge's own ``calc_params_l2_norm``, called from a callback on the same weights, is recorded
and shown where it differs (two distributed-optimizer instances: √2 too large).

Skipped when Megatron-Bridge is not installed (``make test-bridge`` builds an environment
with it).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from norm_optim.testing.megatron_bridge import bridge_available

if not bridge_available():
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

from megatron.bridge.training.callbacks import Callback, CallbackContext  # noqa: E402

from norm_optim.integrations import megatron_bridge  # noqa: E402
from norm_optim.testing.megatron_bridge import (  # noqa: E402
    RankOutput,
    import_bridge,
    run_pretrain,
    tiny_config,
)
from norm_optim.testing.oracle import (  # noqa: E402
    fill_deterministic_,
    global_param_shapes,
    oracle_sum_of_squares,
)

import_bridge()  # once in the parent: forked ranks inherit it

SEED = 5
ITERATIONS = 2
_PRINTED = re.compile(r" params norm: ([0-9.]+) \|")


class _DeterministicWeights(Callback):  # type: ignore[misc]
    """At ``on_train_start``: layout-independent weights (and the fp32 main params reloaded);
    records the global shapes the oracle needs."""

    def on_train_start(self, context: CallbackContext) -> None:
        fill_deterministic_(context.model, SEED, context.optimizer)
        context.user_state["shapes"] = global_param_shapes(context.model)


class _BridgeOwnNorm(Callback):  # type: ignore[misc]
    """At every ``on_train_step_end`` (every rank): Bridge's own ``calc_params_l2_norm`` of the
    weights the loop then logs, for comparison."""

    def on_train_step_end(self, context: CallbackContext) -> None:
        from megatron.bridge.training.utils.train_utils import calc_params_l2_norm
        from megatron.core.utils import get_model_config

        norm = calc_params_l2_norm(context.model, get_model_config(context.model[0]))
        context.user_state.setdefault("bridge", []).append(float(norm))


def _install(breakdown: bool = False) -> megatron_bridge.MegatronBridgeIntegration:
    return megatron_bridge.install(breakdown=breakdown)


def _tensorboard(logdir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] \
        else {}


def _run(tmp_path: Path, world: int, breakdown: bool = False, **layout: Any) -> list[RankOutput]:
    config = tiny_config(world_size=world, train_iters=ITERATIONS, log_interval=1, lr=0.0,
                         seed=SEED, tensorboard_dir=str(tmp_path / "tb"), **layout)
    return run_pretrain(config, world, callbacks=[_DeterministicWeights(), _BridgeOwnNorm()],
                        before=lambda: _install(breakdown))


def _oracle(shapes: dict[str, tuple[int, ...]]) -> tuple[float, float, float]:
    sums = oracle_sum_of_squares(shapes, SEED)
    expert = math.fsum(s for name, s in sums.items() if ".mlp.experts." in name)
    total = math.fsum(sums.values())
    return math.sqrt(total), math.sqrt(total - expert), math.sqrt(expert)


@pytest.fixture(scope="module")
def world1_shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The global shapes of the world-1 (unparallel) runs, dense and MoE: the oracle's input."""
    shapes = {}
    for kind, layout in (("dense", {}), ("moe", {"num_experts": 4})):
        (rank,) = _run(tmp_path_factory.mktemp(kind), 1, **layout)
        shapes[kind] = rank.user_state["shapes"]
    return shapes


LAYOUTS = {
    "dense world 1": (1, {}),
    "dense DP2 distributed optimizer": (2, {}),
    "dense DP2 Float16 optimizer": (2, {"use_distributed_optimizer": False}),
    "dense TP2": (2, {"tp": 2}),
    "dense PP2 tied embeddings": (2, {"pp": 2}),
    "MoE world 1": (1, {"num_experts": 4}),
    "MoE EP2": (2, {"num_experts": 4, "ep": 2}),
    "MoE TP2 sequence parallel": (2, {"num_experts": 4, "tp": 2}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_logged_params_norm_is_exact(name: str, world1_shapes: dict[str, Any],
                                     tmp_path: Path) -> None:
    world, layout = LAYOUTS[name]
    kind = "moe" if layout.get("num_experts") else "dense"
    expected, _, _ = _oracle(world1_shapes[kind])
    ranks = _run(tmp_path, world, **layout)

    written = _tensorboard(tmp_path / "tb", "params-norm")
    assert sorted(written) == list(range(1, ITERATIONS + 1))
    for value in written.values():
        assert value == pytest.approx(expected, rel=1e-6)
    printed = [float(m.group(1)) for line in ranks[-1].lines if (m := _PRINTED.search(line))]
    assert printed == [pytest.approx(expected, abs=5e-4)] * ITERATIONS
    # Bridge's own function agrees on these layouts (float32 sums: to ~1e-6).
    for bridge in ranks[-1].user_state["bridge"]:
        assert bridge == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_two_distributed_optimizer_instances(kind: str, world1_shapes: dict[str, Any],
                                             tmp_path: Path) -> None:
    """DP2 split into two distributed-optimizer instances: each instance holds a full copy of
    the fp32 shards. norm_optim counts one; Bridge's own function counts both (√2 too large)."""
    layout = {"num_distributed_optimizer_instances": 2}
    if kind == "moe":
        layout["num_experts"] = 4
    expected, _, _ = _oracle(world1_shapes[kind])
    ranks = _run(tmp_path, 2, **layout)

    for value in _tensorboard(tmp_path / "tb", "params-norm").values():
        assert value == pytest.approx(expected, rel=1e-6)
    bridge = ranks[-1].user_state["bridge"][-1]
    print(f"\n{kind}, 2 distributed-optimizer instances: norm_optim {expected:.6f}, "
          f"Bridge's calc_params_l2_norm {bridge:.6f} (ratio {bridge / expected:.6f})")
    assert bridge == pytest.approx(math.sqrt(2) * expected, rel=1e-5)


def test_breakdown(world1_shapes: dict[str, Any], tmp_path: Path) -> None:
    """``install(breakdown=True)``: the log line and TensorBoard carry dense and expert norms."""
    total, dense, expert = _oracle(world1_shapes["moe"])
    ranks = _run(tmp_path, 2, breakdown=True, num_experts=4, ep=2)

    for tag, expected in (("params-norm", total), ("params-norm-dense", dense),
                          ("params-norm-expert", expert)):
        written = _tensorboard(tmp_path / "tb", tag)
        assert sorted(written) == list(range(1, ITERATIONS + 1)), tag
        for value in written.values():
            assert value == pytest.approx(expected, rel=1e-6), tag
    line = ranks[-1].matching(" params norm: ")[-1]
    print("\n" + line)
    assert (f" params norm: {total:.3f} | params norm dense: {dense:.3f} | "
            f"params norm expert: {expert:.3f} |") in line
