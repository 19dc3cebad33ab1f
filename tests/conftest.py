"""Shared pytest setup.

Import megatron-core once in the parent: ``run_ranks`` forks its ranks, and a forked child that
inherits the imported modules starts in ~0.1 s instead of re-importing megatron (~4 s per rank).
"""

import warnings
from typing import Iterator

import pytest

from norm_optim.testing import cpu_shim
from norm_optim.testing.megatron_bridge import bridge_available, import_bridge

if bridge_available():
    # Where Megatron-Bridge is installed, so is nvidia-resiliency-ext 0.4.1, whose missing
    # ``__version__`` breaks megatron-core's first import unless it happens under
    # import_bridge()'s guard (which also imports Bridge once for the forked ranks).
    import_bridge()

with warnings.catch_warnings():
    # Without Transformer Engine or Apex, megatron warns once per module that it falls back to
    # torch implementations; that is the intended setup for CPU tests.
    warnings.simplefilter("ignore", UserWarning)
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401


@pytest.fixture
def megatron_cpu_shim() -> Iterator[None]:
    """The CPU shim around a single-process test: megatron's Float16 / FP32 optimizers hard-code
    CUDA type strings. (Multi-rank tests install it in each rank: ``init_parallel``.)"""
    with cpu_shim():
        yield
