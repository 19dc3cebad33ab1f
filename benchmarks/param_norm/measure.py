"""Time, extra peak memory, events and value of every method of one case, on one rank; and how
the ranks' measurements merge into one row.

Calls are interleaved (method A, B, C, D, A, B, ...) so that load from other processes hits
every method alike; each timed call starts after a barrier and ends when the device is done.
Memory and events come from separate, untimed calls, so counting never slows a timed one.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .events import count_events
from .memory import PeakMemory
from .methods import NormFn


@dataclasses.dataclass(frozen=True)
class Options:
    """How each case is measured (the same on every rank)."""

    device: str
    calls: int
    warmup: int
    threads: int


@dataclasses.dataclass
class Measurement:
    """One method on one rank."""

    times: list[float] = dataclasses.field(default_factory=list)
    extra_peak_bytes: int | None = None
    collectives: int = 0
    host_syncs: int = 0
    value: float = math.nan


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_methods(
    methods: Sequence[tuple[str, NormFn]], device: torch.device, opts: Options
) -> dict[str, Measurement]:
    """Every method's value, then ``opts.warmup`` untimed and ``opts.calls`` timed rounds, then
    its memory and events."""
    results = {name: Measurement() for name, _ in methods}
    for name, fn in methods:
        results[name].value = float(fn())
    for _ in range(opts.warmup):
        for _, fn in methods:
            fn()
    for _ in range(opts.calls):
        for name, fn in methods:
            dist.barrier()
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            results[name].times.append(time.perf_counter() - start)
    peak = PeakMemory(device)
    for name, fn in methods:
        dist.barrier()
        results[name].extra_peak_bytes = peak.measure(fn)
        results[name].collectives, results[name].host_syncs = count_events(fn, device)
    return results


def merge_ranks(per_rank: Sequence[Measurement], reference: float) -> dict[str, Any]:
    """One method's row fields over all ranks: the slowest rank's median, the largest peak and
    counts (a call costs what its slowest rank costs), and rank 0's value against
    ``reference``."""
    peaks = [m.extra_peak_bytes for m in per_rank]
    value = per_rank[0].value
    return {
        "median_s": max(statistics.median(m.times) for m in per_rank),
        "extra_peak_bytes": None
        if any(p is None for p in peaks)
        else max(p for p in peaks if p is not None),
        "collectives": max(m.collectives for m in per_rank),
        "host_syncs": max(m.host_syncs for m in per_rank),
        "rel_error": abs(value - reference) / reference if reference else abs(value),
        "value": value,
        "reference": reference,
    }
