"""The step-norms tests' check that arming a step changes no bit of the training."""

from __future__ import annotations

from typing import Any

import torch


def train_armed(
    chunks: Any, optimizer: Any, armed: bool, *, first_armed: int = 0, steps: int = 3
) -> list[Any]:
    """``steps`` training steps, each from ``first_armed`` on armed (per param every other
    step) when ``armed``, its updates read: the run arming must leave bitwise unchanged."""
    from norm_optim.testing.models import train_step

    returns = []
    for step in range(steps):
        arm = armed and step >= first_armed
        if arm:
            optimizer.measure_next_step(per_param=step % 2 == 1)
        returns.append(train_step(chunks, optimizer, seed=step))
        if arm:
            float(optimizer.step_norms().updates.total)
    return returns


def assert_training_unchanged(plain: list[dict], armed: list[dict], left: str) -> None:
    """Each rank's plain and armed runs (``returns``, ``params`` and any of ``mains`` /
    ``state``: tensors, ``own``: attribute names) are the same, bit for bit; ``left`` says what
    a difference in ``own`` means."""
    for rank, (a, b) in enumerate(zip(plain, armed)):
        assert a["returns"] == b["returns"], f"rank {rank}: step() returned something else"
        for key in ("params", "mains", "state"):
            if key in a:
                assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), (rank, key)
        assert a["own"] == b["own"], f"rank {rank}: {left}"
