"""Shared pytest setup.

Import megatron-core once in the parent: ``run_ranks`` forks its ranks, and a forked child that
inherits the imported modules starts in ~0.1 s instead of re-importing megatron (~4 s per rank).

``--share I/N`` runs the I-th of N fixed, disjoint shares of the collected tests (by a hash of
each test's id, so a share does not move when other tests are added): CI's in-between release
lines each run one share, and together they run every test (Makefile, ``SHARE_<line>``).
"""

import warnings
import zlib
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--share",
        default=None,
        metavar="I/N",
        help="run only the I-th (0-based) of N disjoint shares of the collected tests",
    )


def _share(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--share takes I/N (e.g. 0/2), not {text!r}") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"--share {text}: I must be in [0, N)")
    return index, count


def pytest_configure(config: pytest.Config) -> None:
    text = config.getoption("--share")
    if text is not None:
        _share(text)  # a malformed share stops the run before anything is collected


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    text = config.getoption("--share")
    if text is None:
        return
    index, count = _share(text)
    kept, dropped = [], []
    for item in items:
        mine = zlib.crc32(item.nodeid.encode()) % count == index
        (kept if mine else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


@pytest.fixture
def megatron_cpu_shim() -> Iterator[None]:
    """The CPU shim around a single-process test: megatron's Float16 / FP32 optimizers hard-code
    CUDA type strings. (Multi-rank tests install it in each rank: ``init_parallel``.)"""
    with cpu_shim():
        yield
