"""What the data-parallel-mode tests' rank bodies (Megatron-FSDP v1 / v2, torch FSDP2) share
besides the reads: the counting seam, the two closing checks (real steps, moved storage) and
the run that gives every rank one temporary directory (a checkpoint's)."""

from __future__ import annotations

import tempfile
from typing import Any, Callable

from norm_optim.inspection import TorchCommunicator
from norm_optim.testing import run_ranks
from norm_optim.testing.models import train_step
from tests.support.reads import read_norms


class CountingCommunicator(TorchCommunicator):
    """The default communicator, counting the all-reduces it makes (what :func:`read_norms`
    reads)."""

    all_reduces = 0

    def all_reduce_sum(self, tensor, group, async_op):  # type: ignore[no-untyped-def]
        self.all_reduces += 1
        return super().all_reduce_sum(tensor, group, async_op)


def read_after_steps(
    optimizer: Any, chunks: list, refill: Callable[[], None], counting: Any
) -> dict[str, Any]:
    """Two real steps move the weights and keep the registry's tensors valid: the norm after
    them, whether they rebuilt the registry, and (after ``refill`` puts the known values back)
    the norms read again."""
    registry = optimizer.registry
    for step in range(2):
        train_step(chunks, optimizer, seed=step)
    got = {
        "trained_changed": float(optimizer.param_l2_norm()),
        "rebuilt_by_steps": optimizer.registry is not registry,
    }
    refill()
    got["after_steps"] = read_norms(optimizer, counting)
    return got


def read_after_move(
    optimizer: Any, move: Callable[[], None], refill: Callable[[], None]
) -> dict[str, Any]:
    """``move`` gives the fp32 mains new storage behind the wrapper's back and ``refill`` writes
    into it only: the norm then, and whether the registry was rebuilt (it must be)."""
    registry = optimizer.registry
    move()
    refill()
    return {
        "after_move": float(optimizer.param_l2_norm()),
        "rebuilt_after_move": optimizer.registry is not registry,
    }


def run_with_directory(
    body: Callable[..., dict[str, Any]], layout: Any, prefix: str, timeout: float
) -> tuple[dict[str, Any], ...]:
    """``body(layout, directory)`` on ``layout.world`` ranks, all given the same temporary
    directory (removed after the run)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as directory:
        return tuple(run_ranks(body, layout.world, layout, directory, timeout=timeout))
