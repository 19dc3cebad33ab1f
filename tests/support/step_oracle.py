"""The step-norms tests' oracle.

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


def update_sums(
    mains: Sequence[torch.Tensor], before: Sequence[torch.Tensor], moment: Iterable[torch.Tensor]
) -> list[float]:
    """This rank's sums of squares of the updates (``mains`` after the step − ``before``), of a
    moment's tensors, and of the mains' ulps (the bound on the updates' rounding)."""
    return [
        sum_of_squares(differences(mains, before)),
        sum_of_squares(moment),
        sum_of_squares(ulps(mains)),
    ]


def adam_oracle(
    first: Iterable[torch.Tensor],
    mains: Sequence[torch.Tensor],
    before: Sequence[torch.Tensor],
    states: Mapping[int, Mapping[str, Any]],
) -> list[float]:
    """Over all ranks: the norms of ``first`` (the weights or the grads), then
    :func:`update_sums`' with Adam's ``exp_avg`` (``states`` by the main's ``id``)."""
    moment = (states[id(p)]["exp_avg"] for p in mains)
    return reduced_norms([sum_of_squares(first), *update_sums(mains, before, moment)])
