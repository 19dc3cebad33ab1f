"""Layout-independent, position-sensitive hashes of tensors: the resume proof's kernel.

The fingerprint of a tensor is ``sum_i h(i, b_i, c) mod 2**64`` over its elements, where ``i`` is
the element's index in the flattened *global* tensor (not the shard a rank holds), ``b_i`` its raw
bits (zero-extended to 64 bits) and ``c`` the dtype's code (:data:`DTYPE_CODES`)::

    h(i, b, c) = mix(mix(i * GOLDEN + c) ^ b)

with ``mix`` the splitmix64 finalizer (Steele et al., "Fast splittable pseudorandom number
generators", 2014), all arithmetic wrapping modulo 2**64. Because the combination is a sum, the
fingerprints of the shards of one global tensor add up to the tensor's, however it is sharded
(TP, DP, EP, FSDP, any bucketing): one all-reduce SUM gives it. Because ``h`` mixes the index
with the bits, a changed element, two swapped elements or a shifted shard change the sum, except
with probability ~2**-64 (``h`` behaves as a random function of ``(i, b, c)``); a dtype change
changes every term.

Computed on the tensor's device in bounded blocks (int64 temporaries of :data:`BLOCK` elements),
returned as device tensors: no host sync; the caller reads all results once.
"""

from __future__ import annotations

from typing import Callable, Union

import torch
from torch import Tensor

from .remainders import RemainderMaster

__all__ = ["BLOCK", "DTYPE_CODES", "hash_and_squares", "mix64_", "to_signed"]

BLOCK = 1 << 16  # elements per block: a few int64 temporaries of 512 KiB each


def to_signed(x: int) -> int:
    """An integer modulo 2**64 as the int64 two's-complement value torch holds."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN = to_signed(0x9E3779B97F4A7C15)
_M1 = to_signed(0xBF58476D1CE4E5B9)
_M2 = to_signed(0x94D049BB133111EB)

DTYPE_CODES: dict[torch.dtype, int] = {
    dtype: code
    for code, dtype in enumerate(
        (
            torch.float32,
            torch.bfloat16,
            torch.float16,
            torch.float64,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.bool,
        ),
        start=1,
    )
}
"""The code of each dtype a fingerprint knows; fp8 types join by name where torch has them."""
for _code, _name in enumerate(("float8_e4m3fn", "float8_e5m2"), start=len(DTYPE_CODES) + 1):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _shift_right_(x: Tensor, s: int, scratch: Tensor) -> Tensor:
    """``scratch = x >>> s`` (logical: torch's ``>>`` on int64 is arithmetic)."""
    torch.bitwise_right_shift(x, s, out=scratch)
    return scratch.bitwise_and_((1 << (64 - s)) - 1)


def mix64_(x: Tensor, scratch: Tensor) -> Tensor:
    """The splitmix64 finalizer of every element of int64 ``x``, in place (``scratch``: same
    shape, overwritten)."""
    x.bitwise_xor_(_shift_right_(x, 30, scratch)).mul_(_M1)
    x.bitwise_xor_(_shift_right_(x, 27, scratch)).mul_(_M2)
    return x.bitwise_xor_(_shift_right_(x, 31, scratch))


def _bits(values: Tensor, out: Tensor) -> Tensor:
    """The raw bits of a flat block, zero-extended into int64 ``out``."""
    width = values.element_size()
    raw = values.view(_INT_OF_WIDTH[width]) if values.dtype != torch.bool else values
    out.copy_(raw)
    if width < 8 and values.dtype != torch.bool:
        out.bitwise_and_((1 << (8 * width)) - 1)
    return out


Hashed = Union[Tensor, RemainderMaster]


def hash_and_squares(
    tensor: Hashed, indices: Callable[[int, int], Tensor]
) -> tuple[Tensor, Tensor]:
    """(fingerprint, sum of squares) of a flat tensor whose element ``k`` is global element
    ``indices(k, k + 1)``: a 0-dim int64 and a 0-dim float64 tensor on its device.

    Args:
        tensor: the elements (any layout; read flat), or a remainder-encoded fp32 master
            (decoded block by block: hashed as the fp32 values it stands for).
        indices: ``indices(start, end)`` gives the global flat indices (int64, on the tensor's
            device) of elements ``[start, end)``.
    """
    device, n = tensor.device, tensor.numel()
    dtype = tensor.dtype
    if dtype not in DTYPE_CODES:
        raise TypeError(f"no fingerprint for dtype {dtype}")
    code = DTYPE_CODES[dtype]
    total = torch.zeros((), dtype=torch.int64, device=device)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    size = min(BLOCK, n)
    bits = torch.empty(size, dtype=torch.int64, device=device)
    scratch = torch.empty(size, dtype=torch.int64, device=device)
    decoded = (
        torch.empty(size, dtype=torch.float32, device=device)
        if isinstance(tensor, RemainderMaster)
        else None
    )
    flat = None if isinstance(tensor, RemainderMaster) else tensor.reshape(-1)
    for start in range(0, n, BLOCK):
        end = min(start + BLOCK, n)
        if isinstance(tensor, RemainderMaster):
            assert decoded is not None
            values = tensor.flat_slice(start, end).decode_into(decoded[: end - start])
        else:
            assert flat is not None
            values = flat[start:end]
        b, s = bits[: end - start], scratch[: end - start]
        h = indices(start, end).mul(GOLDEN).add_(code)
        mix64_(h, s)
        mix64_(h.bitwise_xor_(_bits(values, b)), s)
        total += h.sum()
        squares += values.to(torch.float64).square().sum()
    return total, squares
