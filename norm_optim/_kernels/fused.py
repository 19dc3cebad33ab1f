"""Accelerator sums of squares: one fused multi-tensor L2 norm per (device, dtype) group.

CUDA reductions are tree-shaped and accurate on whole tensors, so no row splitting is needed:
apex's ``multi_tensor_l2norm`` when apex imports, else Transformer Engine's, else
``torch._foreach_norm``. CPU float64 tensors come here too (they accumulate in float64 already).
The CUDA paths have not yet been run on a GPU; the CPU float64 path and the torch fallback are
tested.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .indices import DeviceIndices
from .rows import BLOCK_NUMEL, split_bounded

# Largest piece handed to a CUDA multi-tensor kernel: a cautious bound that keeps every element count
# well inside 32 bits, whatever the kernel's internal indexing.
_CUDA_MAX_PIECE = 1 << 30

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class FusedBackend(enum.Enum):
    """The fused multi-tensor L2 norm a group uses (its value is the name reported)."""

    APEX = "apex"
    TRANSFORMER_ENGINE = "transformer_engine"
    TORCH = "torch._foreach_norm"

    @property
    def may_copy_low_precision(self) -> bool:
        """torch's foreach norm upcasts bf16/fp16 with a full copy (it does on CPU; unchecked on
        CUDA), so it gets bounded views of them."""
        return self is FusedBackend.TORCH


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _torch_l2norm(tensors: list[Tensor]) -> Tensor:
    # On CUDA the fused foreach kernel reduces in fp32 with a tree; for bf16/fp16 inputs it is
    # given bounded views (see FusedGroup), so even a copying fallback stays bounded.
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=_accumulate_dtype(tensors[0].dtype)))


def _multi_tensor_l2norm(
    device: torch.device,
) -> tuple[FusedBackend, Callable[[list[Tensor]], Tensor]]:
    """Pick the fused per-tensor L2 norm for ``device``: apex, then Transformer Engine, then torch.

    Returns:
        The backend and a function mapping a list of tensors of one dtype
        to their fp32 norms, shape ``[len(tensors)]``, with no host synchronization.
    """
    if device.type == "cuda":
        # Optional packages, typed as Any (setup.cfg: mypy skips them, installed or not).
        applier: Any = None
        l2norm: Any = None
        backend = FusedBackend.TORCH
        try:
            import amp_C
            from apex.multi_tensor_apply import multi_tensor_applier

            applier, l2norm = multi_tensor_applier, amp_C.multi_tensor_l2norm
            backend = FusedBackend.APEX
        except ImportError:
            try:
                from transformer_engine.pytorch.optimizers import (
                    multi_tensor_applier,
                    multi_tensor_l2norm,
                )

                applier, l2norm = multi_tensor_applier, multi_tensor_l2norm
                backend = FusedBackend.TRANSFORMER_ENGINE
            except ImportError:
                pass
        if applier is not None:
            # The kernels skip all work when this flag is set; nothing here ever sets it.
            noop_flag = torch.zeros(1, dtype=torch.int, device=device)

            def fused(tensors: list[Tensor]) -> Tensor:
                _, per_tensor = applier(l2norm, noop_flag, [tensors], True)
                return per_tensor

            return backend, fused
    return FusedBackend.TORCH, _torch_l2norm


class FusedGroup:
    """Accelerator (or CPU float64) tensors of one dtype: one fused multi-tensor norm per call.

    CUDA reductions are tree-shaped, so whole tensors are accurate and need no splitting; only
    bf16/fp16 tensors on the torch fallback are split into bounded views, in case the foreach
    kernel upcasts with a copy (it does on CPU; this cannot be checked without a GPU).
    """

    def __init__(
        self,
        tensors: Sequence[Tensor],
        slots: Sequence[int],
        device: torch.device,
        indices: DeviceIndices,
    ) -> None:
        backend, self._l2norm = _multi_tensor_l2norm(device)
        self.backend = backend.value
        bounded = backend.may_copy_low_precision and tensors[0].dtype in _LOW_PRECISION
        max_piece = BLOCK_NUMEL if bounded else _CUDA_MAX_PIECE
        self._tensors: list[Tensor] = []
        self._strided: list[Tensor] = []
        piece_slots: list[int] = []
        strided_slots: list[int] = []
        for t, slot in zip(tensors, slots):
            if t.is_contiguous():
                pieces = t.view(-1).split(max_piece)
                self._tensors.extend(pieces)
                piece_slots.extend([slot] * len(pieces))
            else:  # multi-tensor kernels want contiguous inputs
                pieces = split_bounded(t, BLOCK_NUMEL)
                self._strided.extend(pieces)
                strided_slots.extend([slot] * len(pieces))
        self._slots = indices(piece_slots + strided_slots, device)
        self.scratch_bytes = max((p.numel() * 4 for p in self._strided), default=0)

    def views(self) -> Iterator[Tensor]:
        """Every tensor a call reads."""
        yield from self._tensors
        yield from self._strided

    def __call__(self, acc: Tensor) -> None:
        parts = []
        if self._tensors:
            parts.append(self._l2norm(self._tensors))
        if self._strided:
            parts.append(_torch_l2norm(self._strided))
        norms = parts[0] if len(parts) == 1 else torch.cat(parts)
        acc.index_add_(0, self._slots, norms.double().square_())
