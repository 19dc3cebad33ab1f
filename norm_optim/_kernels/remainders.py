"""Transformer Engine's remainder-encoded fp32 masters, and what a sum-of-squares plan sums.

TE's precision-aware Adam with ``store_param_remainders`` keeps an fp32 master as the bf16 param
plus an int16 remainder. No kernel reads that pair, and decoding whole tensors would be the fp32
copy norm_optim exists to avoid: :class:`RemainderMaster` decodes bounded blocks on demand.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import ClassVar, Union

import torch
from torch import Tensor

__all__ = ["RemainderMaster", "Summand", "flat_slice"]

# Which int16 half of an int32 holds its high 16 bits (CPUs and GPUs in use are little-endian).
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


@dataclass(frozen=True)
class RemainderMaster:
    """An fp32 master tensor kept as Transformer Engine keeps it with ``store_param_remainders``.

    TE's FusedAdam (megatron's precision-aware optimizer, TE >= 2.1) saves 2 bytes per element by
    storing only the low 16 bits of each fp32 master in its state; the high 16 bits, rounded to
    nearest (plus one when the low half's top bit is set), *are* the bf16 param. This object pairs
    the two views and decodes the exact fp32 values on demand, a bounded block at a time; it owns no
    storage and copies nothing, so in-place updates of either tensor are seen. Its ``dtype`` is the
    logical one, fp32; its storage is that of the two tensors (the optimizer's remainder state
    and the model's bf16 shard), which is where staleness is tracked.

    Attributes:
        param: bf16, contiguous: the rounded high halves (the model param or its shard).
        remainder: int16, contiguous, same shape and device: the low halves.
    """

    param: Tensor
    remainder: Tensor
    dtype: ClassVar[torch.dtype] = torch.float32

    def __post_init__(self) -> None:
        if self.param.dtype != torch.bfloat16 or self.remainder.dtype != torch.int16:
            raise TypeError(
                f"a RemainderMaster pairs a bfloat16 param with an int16 remainder, got "
                f"{self.param.dtype} and {self.remainder.dtype}"
            )
        if self.param.shape != self.remainder.shape or self.param.device != self.remainder.device:
            raise ValueError(
                f"param and remainder must match: {tuple(self.param.shape)} on {self.param.device} "
                f"vs {tuple(self.remainder.shape)} on {self.remainder.device}"
            )
        if not (self.param.is_contiguous() and self.remainder.is_contiguous()):
            raise ValueError("param and remainder must be contiguous (as TE's kernels need them)")

    @property
    def shape(self) -> torch.Size:
        return self.param.shape

    @property
    def device(self) -> torch.device:
        return self.param.device

    def numel(self) -> int:
        return self.param.numel()

    def element_size(self) -> int:
        """Bytes read per element: 2 of param, 2 of remainder."""
        return 4

    def flat_slice(self, start: int, end: int) -> "RemainderMaster":
        """Elements ``[start, end)`` of the flattened master, as views of the same storage."""
        return RemainderMaster(self.param.view(-1)[start:end], self.remainder.view(-1)[start:end])

    def decode_into(self, out: Tensor) -> Tensor:
        """Write the exact fp32 master values into ``out`` (contiguous fp32, ``numel()`` elements).

        TE's decoding is ``bits = ((param_bits - (remainder < 0)) << 16) | (remainder & 0xFFFF)``.
        Copying the remainders into ``out``'s int32 view sign-extends them: the low halves become
        the remainders and the high halves ``-(remainder < 0)``; adding the param bits to the
        high halves (int16, wrapping as TE's does) completes it. Two ops, no temporaries (a
        mixed int16/int32 op would allocate a converted copy on CPU).
        """
        bits = out.view(torch.int32).view(-1)
        bits.copy_(self.remainder.view(-1))
        bits.view(torch.int16)[_HIGH_HALF::2].add_(self.param.view(-1).view(torch.int16))
        return out


Summand = Union[Tensor, RemainderMaster]
"""What a :class:`SumOfSquaresPlan` sums: a floating-point tensor or a :class:`RemainderMaster`."""


def flat_slice(t: Summand, start: int, end: int) -> Summand:
    """Elements ``[start, end)`` of a flattened summand, as views (no copy)."""
    if isinstance(t, RemainderMaster):
        return t.flat_slice(start, end)
    return t.view(-1)[start:end]
