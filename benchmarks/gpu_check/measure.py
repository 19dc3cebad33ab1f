"""What every measurement of the GPU check shares: the options, timing (CUDA events,
or the host clock to a host float), extra peak memory, the float64 reference, the rows."""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

Row = dict[str, Any]

SECTIONS = ("kernels", "nccl", "megatron")
GPU_SIZES = ("1e6", "1e7", "1e8", "1e8x1000", "1e9")
CPU_SIZES = ("1e4", "1e5", "1e5x100")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The float64 reference copies this many elements at a time (512 MiB of float64).
_REFERENCE_CHUNK = 1 << 26


@dataclasses.dataclass(frozen=True)
class Options:
    """What every measurement shares."""

    warmup: int = 3
    repeats: int = 10


# ----------------------------------------------------------------------------------------------
# Device-agnostic helpers (the tests run them on CPU tensors).


def rel_error(value: float, reference: float) -> float:
    """``|value - reference| / |reference|`` (the absolute error when the reference is 0)."""
    if not math.isfinite(value):
        return math.inf
    return abs(value - reference) / (abs(reference) or 1.0)


def bandwidth_gbs(nbytes: int, seconds: float) -> float:
    """Bytes moved per second, in GB/s (10⁹ bytes)."""
    return nbytes / seconds / 1e9


def peak_fraction(gbs: Optional[float], peak_gbs: Optional[float]) -> Optional[float]:
    """``gbs`` as a fraction of the copy's ``peak_gbs`` (None where either is unknown)."""
    if gbs is None or not peak_gbs:
        return None
    return gbs / peak_gbs


def parse_size(text: str) -> tuple[int, int]:
    """``"1e8"`` -> (10⁸ elements, 1 tensor); ``"1e8x1000"`` -> (10⁸ elements, 1000 tensors)."""
    numel, _, tensors = text.lower().partition("x")
    n, k = int(float(numel)), int(tensors or 1)
    if n < 1 or not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"{text!r}: want N or NxK with 1 <= K <= N")
    return n, k


def make_tensors(
    numel: int, pieces: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> list[torch.Tensor]:
    """Standard-normal values in one buffer of ``numel`` elements, as ``pieces`` contiguous
    views of (nearly) equal size."""
    generator = torch.Generator(device=device).manual_seed(seed)
    flat = torch.empty(numel, dtype=dtype, device=device).normal_(generator=generator)
    return list(flat.split(-(-numel // pieces)))


def float64_sum_of_squares(tensors: Sequence[torch.Tensor], chunk: int = _REFERENCE_CHUNK) -> float:
    """The reference: every element squared and summed in float64, a bounded copy at a time."""
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for t in tensors:
        for piece in t.reshape(-1).split(chunk):
            d = piece.double()
            total += torch.dot(d, d)
    return float(total)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], Any],
    device: torch.device,
    opts: Options,
    before: Optional[Callable[[], Any]] = None,
) -> float:
    """Median device time of ``fn()`` over ``opts.repeats`` calls after ``opts.warmup``: CUDA
    events around each call on CUDA, the wall clock elsewhere. ``before`` runs untimed before
    each timed call (the L2 flush)."""
    for _ in range(opts.warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(opts.repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_host_seconds(fn: Callable[[], Any], device: torch.device, opts: Options) -> float:
    """Median host time of ``fn()`` with its kernels queued, not waited for (the device is idle
    before each call): what a call costs the host where kernels run asynchronously."""
    for _ in range(opts.warmup):
        fn()
    times = []
    for _ in range(opts.repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    synchronize(device)
    return statistics.median(times)


def median_seconds_to_host(fn: Callable[[], Any], device: torch.device, opts: Options) -> float:
    """Median wall time of ``float(fn())``: what a training loop pays to log the value."""
    return median_host_seconds(lambda: float(fn()), device, opts)


def extra_peak_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[Any, Optional[int]]:
    """``fn()``'s result and the GPU memory one call allocated above what was allocated before
    it (``torch.cuda.max_memory_allocated``); None off CUDA."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def free_bytes(device: torch.device) -> Optional[int]:
    """Free memory on ``device`` (None off CUDA: the sizes are then not capped)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def row(section: str, what: str, **fields: Any) -> Row:
    """One table row; missing fields print as ``-``."""
    return {"section": section, "what": what, **fields}


def skipped(section: str, what: str, reason: str) -> Row:
    return row(section, what, note=f"skipped: {reason}")
