"""This rank's coordinates and the reduction group's check, whatever the optimizer's kind.

A ``MimoOptimizer`` is a container of per-module optimizers, each with its own process groups,
built on the coordinates (:mod:`.parallel_state`). So MIMO is dispatched here, one level above
them, and :mod:`.parallel_state` needs not know it exists (its holdings: :mod:`.model`).
"""

from __future__ import annotations

from typing import Any

from .._comm import Communicator
from .._counting.ownership import RankCoords
from .parallel_state import check_model_ranks_in_group, coords_of_rank
from .mimo import is_mimo, mimo_ranks


def rank_coords(comm: Communicator, pg_collection: Any = None, optimizer: Any = None) -> RankCoords:
    """This rank's :class:`RankCoords`, from ``pg_collection`` when given, else megatron's
    global parallel state. A MIMO optimizer's modules carry their own (each holding's), which
    need no global parallel state: the default coordinates then stand for none."""
    if pg_collection is None and optimizer is not None and is_mimo(optimizer):
        return RankCoords()
    return coords_of_rank(comm, pg_collection)


def check_reduce_group(
    comm: Communicator, group: object, pg_collection: object = None, optimizer: Any = None
) -> None:
    """Refuse a reduction group that misses ranks holding parts of this rank's model
    (:func:`.parallel_state.check_model_ranks_in_group`); for a MIMO optimizer, every module's grid,
    active here or not."""
    mimo = pg_collection is None and optimizer is not None and is_mimo(optimizer)
    model_ranks = mimo_ranks(optimizer) if mimo else None
    check_model_ranks_in_group(comm, group, pg_collection, model_ranks)
