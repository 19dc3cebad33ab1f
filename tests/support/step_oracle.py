"""The step-norms tests' oracle and their check that arming changes nothing.

The oracle of a step's norms is a snapshot of what the optimizer holds around the step, summed
exactly: each tensor's squares in float64, the tensors' sums with ``math.fsum``, one all-reduce
over the ranks. The rounding of an update (θ after − θ before, in fp32) is bounded by the mains'
ulps, which the tests sum the same way.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch


def sum_of_squares(tensors: Iterable[torch.Tensor]) -> float:
    """Σ of the tensors' squares: each in float64, their sums added with ``math.fsum``."""
    return math.fsum(float(t.double().square().sum()) for t in tensors)


def differences(
    after: Iterable[torch.Tensor], before: Iterable[torch.Tensor]
) -> Iterator[torch.Tensor]:
    """``a − b`` in float64, pair by pair (a step's updates from two snapshots)."""
    return (a.double() - b.double() for a, b in zip(after, before))


def ulps(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each tensor's distance to the next float up: what rounding an update may change."""
    return (torch.nextafter(t, torch.tensor(math.inf)) - t for t in tensors)


def reduced_norms(sums: Sequence[float]) -> list[float]:
    """The square roots of ``sums`` summed over all ranks (one all-reduce)."""
    total = torch.tensor(list(sums), dtype=torch.float64)
    torch.distributed.all_reduce(total)
    return total.sqrt().tolist()


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


def adam_step_oracle(
    first: Iterable[torch.Tensor],
    mains: Sequence[torch.Tensor],
    before: Sequence[torch.Tensor],
    states: Mapping[int, Mapping[str, Any]],
) -> list[float]:
    """Over all ranks: the norms of ``first`` (the weights or the grads), of the updates
    (``mains`` after the step − ``before``), of Adam's ``exp_avg`` (``states`` by the main's
    ``id``) and the bound on the updates' rounding (the mains' ulps)."""
    return reduced_norms(
        [
            sum_of_squares(first),
            sum_of_squares(differences(mains, before)),
            sum_of_squares(states[id(p)]["exp_avg"] for p in mains),
            sum_of_squares(ulps(mains)),
        ]
    )
