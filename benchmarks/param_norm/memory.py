"""Extra peak memory of one call: CUDA allocator stats, or the CPU process's peak RSS.

On CPU the kernel's high-water mark (``VmHWM``) is reset by writing 5 to
``/proc/self/clear_refs``; the extra peak is ``VmHWM`` after the call minus ``VmRSS`` before.
glibc serves temporaries from freed heap memory that is still resident, which would hide them;
``malloc_trim(0)`` before the call returns those pages to the kernel, so whatever the call
touches shows up in the RSS. A call that allocates nothing measures 4 KiB at most.
"""

from __future__ import annotations

import ctypes
import gc
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch


class PeakMemory:
    """Measures one device's extra peak; ``method`` says how (it goes into every row)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = "cuda max_memory_allocated" if device.type == "cuda" else _cpu_method()

    @property
    def available(self) -> bool:
        return not self.method.startswith("unavailable")

    def measure(self, fn: Callable[[], Any], repeats: int = 3) -> Optional[int]:
        """Median over ``repeats`` calls of the extra peak bytes, or None if not measurable."""
        if not self.available:
            return None
        return int(statistics.median(self._one(fn) for _ in range(repeats)))

    def _one(self, fn: Callable[[], Any]) -> int:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - before
        trim = _glibc_malloc_trim()
        if trim is not None:
            trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        before = _proc_status_bytes("VmRSS")
        fn()
        return max(0, _proc_status_bytes("VmHWM") - before)


def _cpu_method() -> str:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        return f"unavailable (/proc/self/clear_refs: {exc.strerror})"
    trim = "malloc_trim(0) first" if _glibc_malloc_trim() else "no malloc_trim: may undercount"
    return f"peak RSS: VmHWM after - VmRSS before ({trim})"


def _glibc_malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
        return trim
    except (OSError, AttributeError):
        return None


def _proc_status_bytes(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024
