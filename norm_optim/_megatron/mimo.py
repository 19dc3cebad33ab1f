"""MIMO: one optimizer per module, each with its own process groups.

For a ``MimoModel`` (megatron-core 0.19 and main), ``get_megatron_optimizer`` returns a
``MimoOptimizer``: ``module_infos[name]`` holds, per module (the language model, each modality
encoder), the module's own optimizer (any kind norm_optim reads: distributed, Float16,
Megatron-FSDP...), its ``HyperCommGrid`` and the ``ProcessGroupCollection`` it was built with,
and whether this rank is in that module's grid. A rank outside a module's grid holds nothing of
it. Non-colocated modules live on disjoint ranks; colocated ones share ranks with different
TP / DP.

So the coordinates that decide who counts an element are per module: each module's holdings
carry the :class:`~norm_optim.inspection.RankCoords` read from its own groups
(:attr:`Holding.coords`), frozen params the coordinates of the module that owns them
(:func:`mimo_param_coords`), and :func:`~norm_optim._counting.ownership.why_not_counted` stays the
one rule. The reduction is still one all-reduce, over a group that must hold every module's ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional, Sequence

import torch

from .._comm import Communicator
from .._errors import ParallelStateError, UnsupportedOptimizerError
from .._counting.ownership import RankCoords
from .fsdp import model_param
from .optimizers.holdings import Holding
from .optimizers.descriptor import LeafDescriptor, OptimizerDescriptor, describe_leaf
from .optimizers.kinds import describe_optimizer
from .parallel_state import coords_from_pg_collection


def is_mimo(optimizer: Any) -> bool:
    """Whether ``optimizer`` is megatron's ``MimoOptimizer`` (models/mimo/optimizer.py)."""
    # MimoOptimizer: megatron/core/models/mimo/optimizer.py (0.19-0.20.dev)
    return hasattr(optimizer, "module_infos") and hasattr(optimizer, "_active_optimizers")


def describe_mimo(optimizer: Any, comm: Communicator) -> OptimizerDescriptor:
    """The descriptor of a ``MimoOptimizer``: its active modules' leaves, and every
    :class:`Holding` of this rank's active modules, each with its module's coords. A rank may run
    none of them: then one stub leaf of its config says whether the step keeps moments."""
    holdings: list[Holding] = []
    described: list[LeafDescriptor] = [describe_leaf(_ConfigOnly(optimizer.config), "stub")]
    for name, info in sorted(optimizer.module_infos.items()):
        if not info.is_active or info.optimizer is None:
            continue  # not this rank's module (or a fully frozen one): nothing held here
        coords = _module_coords(name, info.pg_collection, comm)
        module = describe_optimizer(info.optimizer, comm)
        described.extend(module.leaves)
        holdings.extend(dataclasses.replace(h, coords=coords) for h in module.holdings)
    return OptimizerDescriptor(
        tuple(described),
        tuple(holdings),
        audit_refusal="a MimoOptimizer (each module's own process groups)",
    )


@dataclasses.dataclass(frozen=True)
class _ConfigOnly:
    """A leaf that holds nothing, with the MimoOptimizer's config (what every rank knows)."""

    config: Any
    optimizer: Any = None


def read_mimo(optimizer: Any, comm: Communicator) -> Iterator[Holding]:
    """Every :class:`Holding` of this rank's active modules, each with its module's coords."""
    yield from describe_mimo(optimizer, comm).holdings


def mimo_param_coords(
    chunks: Optional[Sequence[torch.nn.Module]], comm: Communicator
) -> dict[int, RankCoords]:
    """``id(param)`` -> its module's coords, for every param of the ``MimoModel`` chunks this
    rank holds (empty for other models): what frozen params, in no optimizer, are counted by."""
    coords: dict[int, RankCoords] = {}
    for chunk in chunks or []:
        for name, module in _held_modules(chunk):
            # models/mimo/optimizer.py reads the module's groups the same way.
            groups = getattr(_unwrap(module), "pg_collection", None)
            if groups is None:
                raise ParallelStateError(
                    f"MIMO module {name!r} has no pg_collection: megatron's MimoOptimizer "
                    "needs one per module, and so does norm_optim"
                )
            module_coords = _module_coords(name, groups, comm)
            for param in module.parameters():
                coords[id(model_param(param))] = module_coords
    return coords


def mimo_ranks(optimizer: Any) -> frozenset[int]:
    """Global ranks of every module's grid (known on every rank, active or not)."""
    ranks: set[int] = set()
    for info in optimizer.module_infos.values():
        grid = info.grid
        if grid is None:  # colocated without a grid map: the global parallel state's ranks
            return frozenset()
        ranks.update(range(grid.rank_offset, grid.rank_offset + grid.size))
    return frozenset(ranks)


def _module_coords(name: str, groups: Any, comm: Communicator) -> RankCoords:
    if groups is None:
        raise UnsupportedOptimizerError(
            f"MimoOptimizer's module {name!r} is active on this rank but has no "
            "ProcessGroupCollection: norm_optim reads each module's coordinates from it"
        )
    return coords_from_pg_collection(groups, comm)


def _held_modules(chunk: Any) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of the MIMO modules this rank holds (models/mimo/model/base.py keeps
    them in ``language_model`` and ``modality_submodules``)."""
    if not (hasattr(chunk, "modality_submodules") and hasattr(chunk, "mimo_config")):
        return
    for name, module in chunk.modality_submodules.items():
        if module is not None:
            yield name, module
    if getattr(chunk, "language_model", None) is not None:
        yield "language", chunk.language_model


def _unwrap(module: Any) -> Any:
    # DDP / Float16Module / Megatron-FSDP wrappers keep the module in ``.module``.
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module
