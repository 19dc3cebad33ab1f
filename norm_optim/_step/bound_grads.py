"""A step's grads, per slot, read through views of the buffers they live in: :class:`BoundGrads`.

What a watched step sums runs on every step of a long job, so its cost must not grow with the
number of param tensors. Megatron's DDP keeps the grads in a few flat buffers
(:mod:`norm_optim._megatron.grad_buffers`), and the optimizer's ``.grad`` of each fp32 main is a
view into one; so the read is laid out once over those buffers
(:class:`~norm_optim._kernels.segments.SegmentedSquares`: a fixed handful of ops per buffer
stretch), not over the tensors. A grad that is no such view (a bf16 buffer's fp32 copy, a plain
torch optimizer's grads, Megatron-FSDP's shards) is summed by a plan of its own each step, as
before.

The binding is checked on every call at the cost of a few attribute reads: the first and the
last grad bound to each buffer must still be the same view of it. When one is not (the optimizer
pointed its grads elsewhere), the whole binding is rebuilt; a registry rebuild makes a new
:class:`BoundGrads`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from .._kernels import DeviceIndices, SumOfSquaresPlan
from .._kernels.segments import Segment, SegmentedSquares
from .._megatron.grad_buffers import in_grad_buffer
from .._megatron.optimizers.update_rule import Stepped


@dataclasses.dataclass
class _Buffer:
    """One grad buffer: a flat view of its whole storage, its segments, and the first and the
    last grad bound to it (entry, element offset), which check the binding at each call."""

    flat: Tensor
    first: tuple[Stepped, int]
    last: tuple[Stepped, int]
    segments: list[Segment] = dataclasses.field(default_factory=list)


class BoundGrads:
    """Per-slot float64 sums of squares of the grads of ``entries`` at each call.

    Args:
        entries: the :class:`~norm_optim._megatron.optimizers.update_rule.Stepped` of each counted
        tensor
            (None: nothing to read, a frozen param).
        params: the model param of each (whose DDP buffer its grad may be a view of).
        slots: the slot each grad adds into.
        num_slots: the result's slots; it has one more, the last: elements read between the
            bound grads (padding, other ranks' shards), for no reader.
        device: where the result lives.
        indices: the reducer's index tensors, for the grads summed one by one.
    """

    def __init__(
        self,
        entries: Sequence[Optional[Stepped]],
        params: Sequence[Any],
        slots: Sequence[int],
        num_slots: int,
        device: torch.device,
        indices: DeviceIndices,
    ) -> None:
        self._entries, self._params, self._slots = list(entries), list(params), list(slots)
        self.num_slots, self.device, self._indices = num_slots, device, indices
        self._plans: list[SegmentedSquares] = []
        self._checks: list[tuple[Stepped, Tensor, int]] = []
        self._loose: list[int] = []
        self._bound = False

    @property
    def loose(self) -> int:
        """How many grads the last binding could not bind (each summed on its own)."""
        return len(self._loose)

    def __call__(self) -> Tensor:
        """The sums of squares now, ``[num_slots + 1]``; binds (again) when needed."""
        if not (self._bound and self._still_bound()):
            self._bind()
        if self._plans:
            out = self._plans[0]().to(self.device)  # a no-op on the buffers' device
            for plan in self._plans[1:]:  # buffers on another device (rare)
                out += plan().to(self.device)
        else:
            out = torch.zeros(self.num_slots + 1, dtype=torch.float64, device=self.device)
        if self._loose:
            kept = [(g, self._slots[i]) for i in self._loose if (g := self._grad(i)) is not None]
            loose = SumOfSquaresPlan(
                [g for g, _ in kept],
                [s for _, s in kept],
                self.num_slots + 1,
                out_device=self.device,
                indices=self._indices,
            )
            out += loose()
        return out

    def _grad(self, i: int) -> Optional[Tensor]:
        entry = self._entries[i]
        return None if entry is None else entry.grad

    def _still_bound(self) -> bool:
        for entry, flat, offset in self._checks:
            grad = entry.grad
            if grad is None or grad.data_ptr() != flat.data_ptr() + offset * flat.element_size():
                return False
        return True

    def _bind(self) -> None:
        """Find each grad's buffer and lay the read out over the buffers (once per layout)."""
        buffers: dict[tuple[torch.device, int], _Buffer] = {}
        self._loose = []
        for i, (param, slot) in enumerate(zip(self._params, self._slots)):
            entry, grad = self._entries[i], self._grad(i)
            if entry is None:
                continue
            if grad is None or not _bindable(param, grad):
                self._loose.append(i)
                continue
            storage = grad.untyped_storage()
            key = (grad.device, storage.data_ptr())
            offset = int(grad.storage_offset())
            buffer = buffers.get(key)
            if buffer is None:
                numel = storage.nbytes() // grad.element_size()
                flat = grad.detach().as_strided((numel,), (1,), 0)  # the whole buffer, in place
                buffer = buffers[key] = _Buffer(flat, (entry, offset), (entry, offset))
            buffer.segments.append(Segment(offset, grad.numel(), slot))
            buffer.last = (entry, offset)
        by_device: dict[torch.device, list[_Buffer]] = {}
        for (device, _), buffer in buffers.items():
            by_device.setdefault(device, []).append(buffer)
        ordered = sorted(by_device.items(), key=lambda kv: kv[0] != self.device)
        self._plans = [
            SegmentedSquares(
                [b.flat for b in group], [b.segments for b in group], self.num_slots, device
            )
            for device, group in ordered
        ]
        self._checks = [
            (entry, b.flat, offset) for b in buffers.values() for entry, offset in (b.first, b.last)
        ]
        self._bound = True


def _bindable(param: Any, grad: Tensor) -> bool:
    """An fp32, contiguous view of the param's DDP grad buffer."""
    return grad.dtype == torch.float32 and grad.is_contiguous() and in_grad_buffer(param, grad)
