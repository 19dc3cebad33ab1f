"""What both loop integrations' ``install()`` take (:class:`InstallOptions`, whole or by
keyword).

``install()`` runs here on stand-ins of the loop modules it patches (functions with the
signatures it checks): which options it was given and what it patches needs no loop to run.
tests/test_megatron_lm.py and tests/test_megatron_bridge.py run the real loops.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

import pytest

from norm_optim import WatchConfig
from norm_optim.integrations import megatron_bridge, megatron_lm
from norm_optim.integrations._common import InstallOptions


def _module(name: str, **functions: Callable[..., Any]) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(functions)
    return module


def _anything(*args: Any, **kwargs: Any) -> None:
    return None


def _lm_loop(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in of ``megatron.training.training``, handed to ``megatron_lm.install``."""
    training = _module(
        "training",
        setup_model_and_optimizer=_anything,
        calc_params_l2_norm=_anything,
        training_log=lambda loss_dict, iteration, params_norm, grad_norm: None,
        train_step=_anything,
        save_checkpoint=lambda iteration, model, optimizer: None,
    )
    monkeypatch.setattr(megatron_lm, "_training_module", lambda: training)
    return training


def _bridge_loop(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Stand-ins of ``megatron.bridge.training.setup``, ``.train`` and ``.pretrain``, handed to
    ``megatron_bridge.install``; returns ``train``."""
    setup = _module("setup", setup_optimizer=_anything)
    train = _module("train", calc_params_l2_norm=_anything, save_checkpoint_and_time=_anything)
    train.training_log = lambda params_norm, config, global_state: None
    train.train_step = lambda global_state: None
    package = _module("megatron.bridge.training", pretrain=_module("pretrain", train=_anything))
    monkeypatch.setitem(sys.modules, "megatron.bridge", types.ModuleType("megatron.bridge"))
    monkeypatch.setitem(sys.modules, "megatron.bridge.training", package)
    monkeypatch.setattr(megatron_bridge, "_bridge_modules", lambda: (setup, train))
    return train


LOOPS = {"megatron_lm": (megatron_lm, _lm_loop), "megatron_bridge": (megatron_bridge, _bridge_loop)}


@pytest.mark.parametrize("loop", LOOPS)
def test_keywords_and_options_are_the_same_install(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, stand_in = LOOPS[loop]
    patched = stand_in(monkeypatch)
    plain, step = patched.training_log, patched.train_step
    keywords = dict(
        breakdown=True,
        per_param=True,
        step_norms=True,
        audit_interval=3,
        audit_action="raise",
        checkpoint_parity=False,
        watch={"k": 5.0},
    )
    with module.install(**keywords, count_frozen=False) as handle:
        assert patched.training_log is not plain and patched.train_step is not step
        options = handle.options
        assert (handle.audit.interval, handle.audit.action, handle.parity) == (3, "raise", None)
        assert handle.optimizer is None
    assert patched.training_log is plain
    expected = InstallOptions(**keywords, wrapper_options={"count_frozen": False})
    assert options == expected and options.watch_config == WatchConfig(k=5.0)
    # The options whole, and keywords over them: the same install.
    with module.install(expected) as again:
        assert again.options == expected
        with pytest.raises(RuntimeError, match="already installed"):
            module.install()
    with module.install(options=InstallOptions(breakdown=True), per_param=True) as both:
        assert both.options == InstallOptions(breakdown=True, per_param=True)
        assert both.parity is not None  # checkpoint_parity: on by default
        assert patched.train_step is step  # no step norms, no watch: not patched


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    "bad, error, match",
    [
        (dict(breakdwn=True), TypeError, r"unknown options \['breakdwn'\]"),
        (dict(audit_interval=-1), ValueError, "audit_interval must be an int >= 0"),
        (dict(audit_action="print"), ValueError, "audit_action must be one of"),
        (dict(watch={"kk": 1}), ValueError, r"watch: unknown options \['kk'\]"),
        (dict(options=dict(breakdown=True)), TypeError, "options must be an InstallOptions"),
    ],
)
def test_a_bad_option_fails_before_anything_is_patched(
    loop: str, bad: dict, error: type, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, stand_in = LOOPS[loop]
    patched = stand_in(monkeypatch)
    before = dict(vars(patched))
    with pytest.raises(error, match=match):
        module.install(**bad)
    assert dict(vars(patched)) == before
