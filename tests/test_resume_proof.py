"""The loops' resume proof (``integrations._resume.ResumeProof``) on one process: what it
writes beside a checkpoint and says after a load, on a real torch model and optimizer wrapped
in :class:`~norm_optim.NormAwareOptimizer` (no parallelism: the layouts are tests/test_resume*)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from norm_optim import AuditError, NormAwareOptimizer
from norm_optim.integrations._resume import RESUME_FILE, RESUME_TAG, WATCH_FILE, ResumeProof


class _Writer:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))


def _trained() -> tuple[torch.nn.Module, NormAwareOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = NormAwareOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model=model)
    for _ in range(2):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_faithful_load_a_swap_a_missing_file_and_a_skipped_optimizer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = _trained()
    proof = ResumeProof("warn")
    proof.saved(optimizer, str(tmp_path), 2)
    assert (tmp_path / RESUME_FILE).exists() and not (tmp_path / WATCH_FILE).exists()
    writer = _Writer()
    with caplog.at_level(logging.INFO, logger="norm_optim"):
        report = proof.loaded(optimizer, str(tmp_path), 2, writer, None)
    assert report is not None and report.ok and writer.scalars == [(RESUME_TAG, 0.0, 2)]
    assert caplog.records[-1].levelno == logging.INFO
    assert (
        caplog.records[-1].getMessage().startswith("norm_optim resume (iteration 2): 0 mismatches")
    )

    state = optimizer.wrapped_optimizer.state[model[0].weight]
    with torch.no_grad():
        state["exp_avg"].view(-1)[[0, 1]] = state["exp_avg"].view(-1)[[1, 0]].clone()
    report = proof.loaded(optimizer, str(tmp_path), 2, None, None)
    assert report is not None and report.count == 1
    assert str(report.shown[0]).startswith("0.weight[exp_avg] ")
    assert caplog.records[-1].levelno == logging.ERROR
    with pytest.raises(AuditError, match=r"1 mismatches: 0\.weight\[exp_avg\]"):
        ResumeProof("raise").loaded(optimizer, str(tmp_path), 2, None, None)
    # The optimizer skipped on purpose: the weights are compared, and they are as saved.
    report = proof.loaded(optimizer, str(tmp_path), 2, None, None, optimizer_loaded=False)
    assert report is not None and report.ok
    assert "the optimizer state was not loaded, as asked" in report.line()

    (tmp_path / RESUME_FILE).unlink()
    report = proof.loaded(optimizer, str(tmp_path), 2, writer, None)
    assert report is not None and not report.compared and report.ok
    assert report.line().endswith(
        "no saved state fingerprints beside the checkpoint to compare with"
    )
    assert writer.scalars[-1] == (RESUME_TAG, 0.0, 2)  # nothing new written


def test_the_watch_state_goes_beside_the_checkpoint_and_comes_back(tmp_path: Path) -> None:
    model, optimizer = _trained()
    watch = optimizer.watch(warmup=2, window=4)
    for _ in range(3):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    watch.poll()
    ResumeProof("warn").saved(optimizer, str(tmp_path), 5)
    assert (tmp_path / WATCH_FILE).exists()
    _, again = _trained()
    resumed: Any = again.watch(warmup=2, window=4)
    ResumeProof("warn").loaded(again, str(tmp_path), 5, None, None)
    assert resumed.steps == 3 and resumed.state_dict()["grads-norm"]["seen"] == 3
