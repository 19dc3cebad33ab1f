"""``megatron_bridge.install(watch=...)`` in Megatron-Bridge's real ``pretrain()``
(``make test-bridge``; skipped where Bridge is not installed).

A callback gives the optimizer Bridge built, for the run, a ``prepare_grads`` that multiplies
one layer's ``main_grad`` by :data:`FACTOR` at one step before Megatron's own; the watch must
name that step and that param on the last rank (logger ``norm_optim.watch``) and write
``watch/alarms``, and with ``skip`` leave the step unapplied (the logged params norm of that
step is the previous one's, bit for bit).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from norm_optim.testing.megatron_bridge import bridge_available, import_bridge

if not bridge_available():
    pytest.skip("Megatron-Bridge is not installed (make test-bridge)", allow_module_level=True)

import_bridge()  # once in the parent: forked ranks inherit it

from megatron.bridge.training.callbacks import Callback, CallbackContext  # noqa: E402

from norm_optim.integrations import megatron_bridge  # noqa: E402
from norm_optim.testing.megatron_bridge import run_pretrain, tiny_config  # noqa: E402
from norm_optim.testing.oracle import named_global_parameters  # noqa: E402

FACTOR = 100.0
SPIKE_AT = 16
SPIKED = "decoder.layers.1.mlp.linear_fc1.weight"
WATCH = dict(warmup=8, window=16, skip=True)


class _Lines(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


class _Spike(Callback):  # type: ignore[misc]
    """At train start: the optimizer's ``prepare_grads`` scales :data:`SPIKED`'s grads at step
    :data:`SPIKE_AT`; the watch's lines are kept in ``user_state``."""

    def on_train_start(self, context: CallbackContext) -> None:
        raw = context.optimizer.wrapped_optimizer
        param = dict(named_global_parameters(context.model))[SPIKED]
        prepare, calls = raw.prepare_grads, [0]

        def prepare_grads(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == SPIKE_AT:
                param.main_grad.mul_(FACTOR)
            return prepare(*args, **kwargs)

        raw.prepare_grads = prepare_grads
        lines = context.user_state.setdefault("watch", [])
        logging.getLogger("norm_optim.watch").addHandler(_Lines(lines))


def _scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_a_spike_is_named_and_skipped(tmp_path: Path) -> None:
    config = tiny_config(
        world_size=2, train_iters=SPIKE_AT + 1, lr=1e-2, tensorboard_dir=str(tmp_path / "tb")
    )
    ranks = run_pretrain(
        config,
        2,
        callbacks=[_Spike()],
        before=lambda: megatron_bridge.install(watch=WATCH),
        timeout=300,
    )
    assert ranks[0].user_state["watch"] == [], "the alarm line is the last rank's"
    line = ranks[-1].user_state["watch"][0]
    assert line.startswith(f"norm_optim watch: iteration {SPIKE_AT}: ") and SPIKED in line, line
    assert line.endswith("; step skipped"), line
    scalars = _scalars(tmp_path / "tb")
    alarms = scalars["watch/alarms"]
    assert alarms[SPIKE_AT] == 1 and all(alarms[s] == 0 for s in range(1, SPIKE_AT)), alarms
    norms = scalars["params-norm"]
    assert norms[SPIKE_AT] == norms[SPIKE_AT - 1] and norms[SPIKE_AT + 1] != norms[SPIKE_AT]
    # The aftermath: the next step measured per param, its grads named.
    assert SPIKE_AT + 1 in scalars[f"grads-norm/param/{SPIKED}"]
