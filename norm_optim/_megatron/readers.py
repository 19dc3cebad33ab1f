"""The adapter's entry points over a whole optimizer, whatever its kind.

A ``MimoOptimizer`` is a container of per-module optimizers, each with its own process groups,
built on the per-optimizer readers (:mod:`.optimizers`) and the coordinates
(:mod:`.parallel_state`). So MIMO is dispatched here, one level above all three, and none of
them needs to know it exists.
"""

from __future__ import annotations

from typing import Any

from .._comm import Communicator
from .._ownership import RankCoords
from . import optimizers, parallel_state
from .holdings import Holding
from .mimo import is_mimo, mimo_ranks, read_mimo


def read_holdings(optimizer: Any, comm: Communicator) -> list[Holding]:
    """Every :class:`Holding` of ``optimizer``, in optimizer order (a MIMO optimizer's: its
    modules', each with its module's coordinates)."""
    if is_mimo(optimizer):
        return list(read_mimo(optimizer, comm))
    return optimizers.read_holdings(optimizer, comm)


def rank_coords(comm: Communicator, pg_collection: Any = None, optimizer: Any = None) -> RankCoords:
    """This rank's :class:`RankCoords`, from ``pg_collection`` when given, else megatron's
    global parallel state. A MIMO optimizer's modules carry their own (each holding's), which
    need no global parallel state: the default coordinates then stand for none."""
    if pg_collection is None and optimizer is not None and is_mimo(optimizer):
        return RankCoords()
    return parallel_state.rank_coords(comm, pg_collection)


def check_reduce_group(
    comm: Communicator, group: object, pg_collection: object = None, optimizer: Any = None
) -> None:
    """Refuse a reduction group that misses ranks holding parts of this rank's model
    (:func:`.parallel_state.check_reduce_group`); for a MIMO optimizer, every module's grid,
    active here or not."""
    mimo = pg_collection is None and optimizer is not None and is_mimo(optimizer)
    model_ranks = mimo_ranks(optimizer) if mimo else None
    parallel_state.check_reduce_group(comm, group, pg_collection, model_ranks)
