"""Bitwise fingerprints of tensors, and the check that a weight is the rounding of its main.

The audit compares copies that the counting rule assumes equal, so what it compares must change
with any change of the bits: a sum of squares would not see a sign flip or two swapped elements.
A fingerprint here is two int64 sums over the tensor's raw bits ``b_i`` (its elements viewed as
integers of their width): ``sum(b_i)`` and ``sum(b_i * (i * GOLDEN))``, both wrapping modulo
2**64. One changed element (a sign flip included) changes the first sum by ``b'_i - b_i``, which is
never a multiple of 2**64. Two swapped elements keep the first and change the second by
``GOLDEN * (i - j) * (b_j - b_i)``, which with an odd ``GOLDEN`` is a multiple of 2**64 only when
the powers of two in ``i - j`` and ``b_j - b_i`` add up to 64: never for tensors below 2**32
elements with elements of at most 32 bits.

Both are computed on the tensor's device in bounded blocks (a 2**16-element int64 block and the
reused index weights: no copy of the tensor, no host transfer), and returned as device tensors:
the caller syncs once, for all tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BLOCK", "FingerprintPass", "largest_difference", "raw_bits", "stale_elements"]

# Odd (the swap argument above needs it); 2**64 / golden ratio, as a signed int64.
GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
BLOCK = 1 << 16
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _wrap(value: int) -> int:
    """``value`` modulo 2**64, as the signed int64 torch multiplies with."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def raw_bits(t: Tensor) -> Tensor:
    """The flattened tensor's elements as same-width integers (a view, no copy)."""
    flat = t.reshape(-1)
    return flat.view(_INT_OF_WIDTH[flat.element_size()]) if flat.is_floating_point() else flat


class FingerprintPass:
    """Fingerprints many tensors with one set of scratch buffers per device.

    ``fingerprint(t)`` returns a 2-element int64 tensor on ``t``'s device (no host sync).
    """

    def __init__(self) -> None:
        self._weights: dict[torch.device, Tensor] = {}

    def _index_weights(self, device: torch.device) -> Tensor:
        weights = self._weights.get(device)
        if weights is None:
            weights = torch.arange(BLOCK, dtype=torch.int64, device=device).mul_(GOLDEN)
            self._weights[device] = weights
        return weights

    def fingerprint(self, t: Tensor) -> Tensor:
        bits = raw_bits(t)
        device = bits.device
        weights = self._index_weights(device)
        plain = torch.zeros((), dtype=torch.int64, device=device)
        weighted = torch.zeros((), dtype=torch.int64, device=device)
        block = torch.empty(min(BLOCK, bits.numel()), dtype=torch.int64, device=device)
        for start in range(0, bits.numel(), BLOCK):
            part = bits[start : start + BLOCK]
            n = part.numel()
            values = block[:n]
            values.copy_(part)  # widen to int64 in the reused block
            block_sum = values.sum()
            plain += block_sum
            # sum((i + start) * GOLDEN * b_i) = sum(i * GOLDEN * b_i) + start * GOLDEN * sum(b_i)
            weighted += values.mul_(weights[:n]).sum()
            weighted += block_sum * _wrap(start * GOLDEN)
        return torch.stack([plain, weighted])


def stale_elements(weight: Tensor, main: Tensor) -> Tensor:
    """How many elements of ``weight`` are not bitwise the rounding of ``main`` to the weight's
    dtype (a 0-dim int64 device tensor, no host sync). ``weight`` and ``main`` are flat and of
    the same length; one reused block of the weight's dtype is the only scratch."""
    count = torch.zeros((), dtype=torch.int64, device=weight.device)
    rounded = torch.empty(min(BLOCK, weight.numel()), dtype=weight.dtype, device=weight.device)
    for start in range(0, weight.numel(), BLOCK):
        w = weight[start : start + BLOCK]
        r = rounded[: w.numel()]
        r.copy_(main[start : start + BLOCK])  # round to nearest, as the optimizers copy mains
        count += (raw_bits(r) != raw_bits(w)).sum()
    return count


def largest_difference(weight: Tensor, main: Tensor) -> float:
    """The largest absolute difference between ``weight`` and the rounding of ``main`` (one
    host sync; called only for the weights found stale, to say how far apart they are)."""
    largest = 0.0
    for start in range(0, weight.numel(), BLOCK):
        w = weight[start : start + BLOCK].float()
        r = main[start : start + BLOCK].to(weight.dtype).float()
        largest = max(largest, float((w - r).abs().max()))
    return largest
