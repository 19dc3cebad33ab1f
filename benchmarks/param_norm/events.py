"""Collectives and host syncs of one call, counted by wrapping the functions that do them.

Counting rather than profiling: the numbers are exact, do not depend on the machine's load, and
are what the targets (1 collective, 0 host syncs) are stated in.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from norm_optim._patching import Patch, patches_applied

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
    "broadcast",
    "all_gather_object",
    "all_to_all_single",
    "barrier",
)
# Reading a tensor's value on the host: a device sync on accelerators.
HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


class Counter:
    """Counts outermost calls only (a counted function calling another is one event)."""

    def __init__(self) -> None:
        self.count = 0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += self._depth == 0
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


@contextlib.contextmanager
def patched(owner: Any, names: Sequence[str], counter: Counter) -> Iterator[None]:
    """Route ``owner.<name>`` through ``counter`` for the duration of the block; an inherited
    attribute is shadowed, then deleted again, so the owner ends as it began."""
    patches = [Patch(owner, n, counter.wrap(getattr(owner, n))) for n in names if hasattr(owner, n)]
    with patches_applied(patches):
        yield


@contextlib.contextmanager
def cuda_sync_counter(counter: Counter) -> Iterator[None]:
    """Count the synchronizing CUDA operations torch reports in sync-debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counter.count += sum("synchroniz" in str(w.message) for w in caught)


def count_events(fn: Callable[[], Any], device: torch.device) -> tuple[int, int]:
    """(collectives, host syncs) of one call.

    Collectives: calls into ``torch.distributed`` (the library's seam calls it too). Host syncs:
    on CUDA what torch's sync-debug mode reports; on CPU, where nothing is asynchronous, the
    calls that would sync on a device (``item``, ``float(t)``, ``bool(t)``, ``tolist``...).
    """
    collectives, syncs = Counter(), Counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(dist, COLLECTIVES, collectives))
        if device.type == "cuda":
            stack.enter_context(cuda_sync_counter(syncs))
        else:
            stack.enter_context(patched(torch.Tensor, HOST_READS, syncs))
        fn()
    return collectives.count, syncs.count
