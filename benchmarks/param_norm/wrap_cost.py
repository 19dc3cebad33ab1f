"""What wrapping costs once: building the registry, and the part of it that reads the model's
sharding declarations (``sharded_state_dict``, the source of every param's TP split)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from norm_optim._comm import TorchCommunicator
from norm_optim._megatron import rank_coords, read_declarations
from norm_optim._norms.registry import ParamRegistry

BUILDS = 3


def _median_s(build: Callable[[], Any]) -> float:
    times = []
    for _ in range(BUILDS):
        start = time.perf_counter()
        build()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def wrap_cost(bench: Any) -> dict[str, float]:
    """This rank's median seconds to build the registry (``registry_build_s``, declarations
    included) and to read the declarations alone (``declarations_s``); no collective in either,
    so the ranks need not be in step."""
    comm = TorchCommunicator()
    coords = rank_coords(comm)
    return {
        "registry_build_s": _median_s(
            lambda: ParamRegistry(bench.optimizer, bench.chunks, coords=coords, comm=comm)
        ),
        "declarations_s": _median_s(lambda: read_declarations(bench.chunks)),
    }
