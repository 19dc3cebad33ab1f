"""Test support for norm_optim users: run real megatron-core on CPU ranks.

- :mod:`~norm_optim.testing.shim` — the test-only CPU shim for megatron-core's CUDA code paths.
- :mod:`~norm_optim.testing.launcher` — ``run_ranks``: a function on N gloo ranks, fresh processes.
"""

from norm_optim.testing.launcher import RankFailedError, RankTimeoutError, init_parallel, run_ranks
from norm_optim.testing.shim import (
    CpuShim,
    SequenceParallelTorchNorm,
    cpu_shim,
    init_rng,
    install_cpu_shim,
)

__all__ = [
    "CpuShim",
    "RankFailedError",
    "RankTimeoutError",
    "SequenceParallelTorchNorm",
    "cpu_shim",
    "init_parallel",
    "init_rng",
    "install_cpu_shim",
    "run_ranks",
]
