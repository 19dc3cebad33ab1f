"""How the benchmarks write a number of bytes: binary units, named as such (1 << 20 is 1.0 MiB)."""

from __future__ import annotations

from typing import Optional


def format_bytes(n: Optional[int]) -> str:
    """``n`` bytes in the largest binary unit it fills (GiB, MiB, KiB, else B); None: ``n/a``."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
