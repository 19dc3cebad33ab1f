"""``megatron_lm.install(watch=...)`` in Megatron-LM's real training loop, on CPU ranks.

The test injects the spike itself: the optimizer the loop builds gets, for the run, a
``prepare_grads`` that multiplies one param's ``main_grad`` by :data:`FACTOR` at one iteration
before Megatron's own (so the loop's clipping, grad norm and step all see it), on every rank.
The alarm must name that iteration and that param, on the last rank's log (logger
``norm_optim.watch``), with the scalar ``watch/alarms``; none before it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any

import pytest

from norm_optim.testing import run_ranks
from tests.test_megatron_lm import needs_loop

FACTOR = 100.0
SPIKE_AT = 16
SPIKED = "decoder.layers.1.mlp.linear_fc1.weight"
WATCH = dict(warmup=8, window=16)
TENSORBOARD = ("--tensorboard-dir", "unused-by-the-recording-writer")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _spiking(optimizer: Any, chunks: list, name: str, at: int) -> None:
    """Give ``optimizer`` (for this run) a ``prepare_grads`` that scales ``name``'s grads at
    call ``at`` (iteration ``at``), before Megatron's own."""
    from norm_optim.testing.oracle import named_global_parameters

    params = dict(named_global_parameters(chunks))
    calls = [0]
    prepare = optimizer.prepare_grads

    def prepare_grads(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at and name in params:
            params[name].main_grad.mul_(FACTOR)
        return prepare(*args, **kwargs)

    optimizer.prepare_grads = prepare_grads


def _run(watch: dict, iterations: int) -> dict:
    from megatron.training import training

    from norm_optim._patching import Patch, patches_applied
    from norm_optim.integrations import megatron_lm
    from norm_optim.testing.megatron_lm import (
        RecordingSummaryWriter,
        pretrain_gpt,
        recording_tensorboard_patches,
        tiny_gpt_args,
    )

    setup, training_log = training.setup_model_and_optimizer, training.training_log
    skipped: dict[int, int] = {}

    @functools.wraps(setup)
    def setup_spy(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = setup(*args, **kwargs)
        _spiking(optimizer, model, SPIKED, SPIKE_AT)
        return model, optimizer, scheduler

    signature = inspect.signature(training_log)

    @functools.wraps(training_log)
    def training_log_spy(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        skipped[bound["iteration"]] = int(bound["skipped_iter"])
        return training_log(*args, **kwargs)

    writer = RecordingSummaryWriter()
    lines = _Lines()
    logging.getLogger("norm_optim.watch").addHandler(lines)
    patches = [
        Patch(training, "setup_model_and_optimizer", setup_spy),
        Patch(training, "training_log", training_log_spy),
        *recording_tensorboard_patches(writer),
    ]
    argv = tiny_gpt_args(
        lr=1e-2,
        train_iters=iterations,
        log_interval=4,
        extra=(*TENSORBOARD, "--tensorboard-log-interval", "4"),
    )
    with patches_applied(patches), contextlib.ExitStack() as stack:
        integration = stack.enter_context(megatron_lm.install(watch=watch))
        pretrain_gpt(argv)
        alarms = integration.optimizer.watching.alarms_total
    return {"lines": lines.lines, "scalars": writer.scalars, "skipped": skipped, "alarms": alarms}


@needs_loop
def test_a_spike_in_the_loop_is_named_at_its_iteration() -> None:
    """×100 on one layer's grads at iteration 16 (log interval 4): the last rank logs one
    ``norm_optim watch: iteration 16`` line naming the param, ``watch/alarms`` is 1 at 16 and
    0 at every logged iteration before; iteration 17, the aftermath, is measured per param and
    its step norms written (outside the log interval)."""
    results = run_ranks(_run, 2, WATCH, SPIKE_AT + 1, timeout=300)
    first, last = results
    assert first["lines"] == [], "the alarm line is the last rank's"
    assert first["alarms"] == last["alarms"] >= 1
    line = last["lines"][0]
    assert line.startswith(f"norm_optim watch: iteration {SPIKE_AT}: ") and SPIKED in line, line
    alarms = {step: value for tag, value, step in last["scalars"] if tag == "watch/alarms"}
    assert alarms[SPIKE_AT] == 1 and {alarms[s] for s in (4, 8, 12)} == {0}, alarms
    aftermath = {
        tag for tag, _, step in last["scalars"] if step == SPIKE_AT + 1 and "/param/" in tag
    }
    assert f"grads-norm/param/{SPIKED}" in aftermath and f"updates-norm/param/{SPIKED}" in aftermath
    assert set(last["skipped"].values()) == {0}


@needs_loop
def test_skip_in_the_loop_is_a_skipped_iteration() -> None:
    """``install(watch={"skip": True, ...})``: Megatron's loop gets iteration 16 as skipped (its
    own counter, its scheduler held), the line says so, and training goes on."""
    results = run_ranks(_run, 2, dict(WATCH, skip=True), SPIKE_AT + 2, timeout=300)
    for seen in results:
        assert seen["skipped"][SPIKE_AT] == 1
        assert sum(seen["skipped"].values()) == 1, seen["skipped"]
    line = results[-1]["lines"][0]
    assert f"iteration {SPIKE_AT}: " in line and line.endswith("; step skipped"), line


def test_install_refuses_an_unknown_watch_option() -> None:
    pytest.importorskip("megatron.training")
    from norm_optim.integrations import megatron_lm

    try:
        megatron_lm._training_module()
    except megatron_lm.MegatronLMVersionError:
        pytest.skip("no Megatron-LM loop on this megatron-core")
    with pytest.raises(ValueError, match="unknown options"):
        megatron_lm.install(watch={"sigmas": 3})
