"""What both loop integrations' ``install()`` take (:class:`InstallOptions`, whole or by keyword),
what they say and where (the ``norm_optim`` loggers, seen with ``caplog``), and the state they keep
bounded over a run of any length.

``install()`` runs here on stand-ins of the loop modules it patches (functions with the
signatures it checks): which options it was given and what it patches needs no loop to run.
tests/test_megatron_lm.py and tests/test_megatron_bridge.py run the real loops.
"""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from norm_optim import AuditError, WatchConfig
from norm_optim.inspection import AuditReport, Finding, FindingKind
from norm_optim._norms.reducer import ParamNorms
from norm_optim._step.watch import Watch
from norm_optim.integrations import megatron_bridge, megatron_lm
from norm_optim.integrations._audit_schedule import KEPT_REPORTS, AuditSchedule
from norm_optim.integrations._checkpoint_norms import CheckpointParity
from norm_optim.integrations._options import InstallOptions

LOGGER = "norm_optim.integrations"


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
        resume_proof=False,
        watch={"k": 5.0},
    )
    with module.install(**keywords, count_frozen=False) as handle:
        assert patched.training_log is not plain and patched.train_step is not step
        options = handle.options
        assert (handle.audit.interval, handle.audit.action, handle.parity) == (3, "raise", None)
        assert handle.resume is None
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
        assert both.parity is not None and both.resume is not None  # on by default
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


# ---------------------------------------------------------------- what the integrations say


class _Audited:
    """An optimizer whose ``audit()`` returns the reports it is given, in turn."""

    def __init__(self, *findings: tuple[Finding, ...]) -> None:
        self._reports = [AuditReport(f, compared=(("dp", 1),)) for f in findings]

    def audit(self) -> AuditReport:
        return self._reports.pop(0)


DRIFT = Finding("decoder.layers.0.mlp.linear_fc1.weight", FindingKind.MAIN_REPLICAS_DIFFER, (0, 1))


def test_audit_findings_are_logged_at_error_not_printed(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    schedule = AuditSchedule(1, "warn")
    schedule.run(_Audited((DRIFT,)), 5, None, None)
    (record,) = caplog.records
    assert (record.name, record.levelno) == (LOGGER, logging.ERROR)
    assert record.getMessage().startswith("norm_optim iteration 5: audit: 1 findings")
    assert f"main-replicas-differ {DRIFT.param!r} on ranks [0, 1]" in record.getMessage()
    assert capsys.readouterr() == ("", "")
    caplog.clear()
    schedule.run(_Audited(()), 6, None, None)  # clean: nothing said
    assert caplog.records == []


def test_audit_findings_are_silenced_and_raised_the_usual_way(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.CRITICAL, logger="norm_optim"):
        AuditSchedule(1, "warn").run(_Audited((DRIFT,)), 5, None, None)
    assert caplog.records == []
    with pytest.raises(AuditError, match="main-replicas-differ"):
        AuditSchedule(1, "raise").run(_Audited((DRIFT,)), 5, None, None)
    assert caplog.records == []  # raised, not also logged


class _Norms:
    """An optimizer whose per-layer norms are ``layers`` (the total: their root sum of squares)."""

    def __init__(self, layers: dict[str, float]) -> None:
        self.layers = layers

    def param_l2_norms(self, per_param: bool = False) -> ParamNorms:
        values = {name: torch.tensor(v, dtype=torch.float64) for name, v in self.layers.items()}
        total = torch.stack(list(values.values())).square().sum().sqrt()
        return ParamNorms(total, total, torch.zeros(()), per_layer=values)


def test_checkpoint_parity_says_a_match_at_info_and_a_difference_at_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO, logger="norm_optim")
    parity, optimizer = CheckpointParity("warn"), _Norms({"0": 3.0, "1": 4.0})
    parity.loaded(optimizer, str(tmp_path), 2, None, None)
    parity.saved(optimizer, str(tmp_path), 2)
    parity.loaded(optimizer, str(tmp_path), 2, None, None)
    saved = json.loads((tmp_path / "norm_optim_norms.json").read_text())
    saved["per_layer"]["1"] *= 1.01
    (tmp_path / "norm_optim_norms.json").write_text(json.dumps(saved))
    parity.loaded(optimizer, str(tmp_path), 2, None, None)
    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    head = "norm_optim: params norm at load (iteration 2): 5.000000"
    assert said[:2] == [
        (LOGGER, logging.INFO, f"{head} (no saved norms beside the checkpoint to compare with)"),
        (LOGGER, logging.INFO, f"{head}; every layer equals the saved weights'"),
    ]
    assert said[2:] == [  # the file's total is as saved: one layer was edited
        (
            LOGGER,
            logging.ERROR,
            f"{head}; differs from the saved weights' in 1 layers: ['1'] (saved total 5.000000)",
        )
    ]
    assert capsys.readouterr() == ("", "")
    caplog.clear()
    with pytest.raises(AuditError, match=r"in 1 layers: \['1'\]"):
        CheckpointParity("raise").loaded(optimizer, str(tmp_path), 2, None, None)
    assert caplog.records == []


# ---------------------------------------------------------------- bounded state


def test_audit_reports_keep_the_latest_only() -> None:
    schedule = AuditSchedule(1, "warn")
    runs = 3 * KEPT_REPORTS + 1
    optimizer = _Audited(*[()] * runs)
    for iteration in range(1, runs + 1):
        schedule.run(optimizer, iteration, None, None)
    assert list(schedule.reports) == [(i, 0) for i in range(runs - KEPT_REPORTS + 1, runs + 1)]
    assert schedule.reports[-1] == (runs, 0) and schedule.audits == runs


def test_unpolled_losses_are_bounded_by_the_window() -> None:
    watch = Watch(WatchConfig(window=4, warmup=2), arm=lambda: None)
    for _ in range(100):
        watch.observe_loss(1.0)
    assert len(watch._extra) == 2 * 4
    watch.observe_loss(1e6)
    (alarm,) = watch.poll()
    assert alarm.signal == "loss" and alarm.value == 1e6
    assert len(watch._extra) == 0


def test_checkpoint_parity_is_resume_proofs_old_name() -> None:
    with pytest.warns(DeprecationWarning, match="resume_proof"):
        options = InstallOptions(checkpoint_parity=False)
    assert options.resume_proof is False
    assert options == InstallOptions(resume_proof=False)  # one spelling, whichever was used
    with pytest.warns(DeprecationWarning):
        assert InstallOptions.of(None, {"checkpoint_parity": False}).resume_proof is False
