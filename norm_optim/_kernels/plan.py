"""Accurate, bounded-memory sums of squares over a fixed list of tensors: :class:`SumOfSquaresPlan`.

Built once from the tensors whose norms are wanted (fp32 main params, fp32 shards, bf16/fp16
params with no fp32 copy, remainder-encoded masters), then called every step: one float64 sum of
squares per *slot* (total, dense/expert split, per-parameter norms...), with one reduction per
(device, dtype) group. CPU groups use short row norms (:mod:`.rows`, accurate where CPU norm
kernels are not); accelerator groups one fused multi-tensor norm (:mod:`.fused`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Union, cast

import torch
from torch import Tensor

from .fused import FusedGroup
from .indices import DeviceIndices
from .remainders import RemainderMaster, Summand
from .rows import RowNormGroup


def _default_out_device(tensors: Sequence[Summand]) -> torch.device:
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


_GroupKey = tuple[torch.device, torch.dtype, Union[type[RowNormGroup], type[FusedGroup]]]


def _group_key(t: Summand) -> _GroupKey:
    """(device, dtype, group type): CUDA tree reductions are accurate on whole tensors, and CPU
    float64 accumulates in float64 already (fused); CPU fp32/bf16/fp16 need row norms, and
    remainder masters must be decoded block by block anywhere (row norms)."""
    row_norms = isinstance(t, RemainderMaster) or (
        t.device.type == "cpu" and t.dtype != torch.float64
    )
    return t.device, t.dtype, RowNormGroup if row_norms else FusedGroup


def _build_group(
    key: _GroupKey,
    tensors: list[Summand],
    slots: list[int],
    indices: DeviceIndices,
    packed_slots: int | None,
) -> RowNormGroup | FusedGroup:
    device, _, kind = key
    if kind is FusedGroup:
        # _group_key sends every RemainderMaster to row norms: a fused group's are all tensors.
        return FusedGroup(cast(list[Tensor], tensors), slots, device, indices)
    return RowNormGroup(tensors, slots, device, indices, packed_slots)


class SumOfSquaresPlan:
    """Per-slot float64 sums of squares of a fixed list of tensors, built once and called often.

    Tensors are grouped once by (device, dtype); each call runs one fused reduction per group (on
    CPU, and for remainder masters everywhere: a few ops per 256 KiB block, see the module
    docstring) and moves each group's partial result to ``out_device``. Views share storage with
    the given tensors: nothing is copied at construction and each call's temporaries are bounded
    (``scratch_bytes``), whatever the sizes.

    Args:
        tensors: floating-point tensors (fp32, bf16, fp16, fp64) or :class:`RemainderMaster`
            pairs (summed as the fp32 masters they encode), on any mix of devices. Zero-size
            tensors are allowed and contribute nothing. The plan holds views of them: if a tensor is
            later replaced (not updated in place), build a new plan.
        slots: ``slots[i]`` is the output slot tensor ``i`` adds into; several tensors may share one.
        num_slots: length of the output.
        out_device: where the result lives. Defaults to the first non-CPU device among the tensors,
            else CPU.
        indices: where the plan's index tensors are kept; give the same one to plans rebuilt
            over the same layout (a step's grads) so that they copy nothing to the device again
            (:class:`~norm_optim._kernels.indices.DeviceIndices`). Default: the plan's own.
        packed: for a plan built once and called often (the weights'): CPU tensors that are
            small or views of one storage are laid out over flat buffers
            (:class:`~norm_optim._kernels.packed.PackedSquares`), so that a call's ops do not
            grow with their number; the build then costs O(elements) host work, and the plan
            keeps a pack buffer of at most 8 MiB (:attr:`kept_bytes`).

    Example::

        >>> plan = SumOfSquaresPlan([w, b], slots=[0, 0], num_slots=1)
        >>> total_norm = plan().sqrt()
    """

    def __init__(
        self,
        tensors: Sequence[Summand],
        slots: Sequence[int],
        num_slots: int,
        out_device: torch.device | None = None,
        indices: DeviceIndices | None = None,
        packed: bool = False,
    ) -> None:
        tensors, slots = list(tensors), [int(s) for s in slots]
        if len(tensors) != len(slots):
            raise ValueError(
                f"got {len(tensors)} tensors but {len(slots)} slots; pass one slot per tensor"
            )
        for i, (t, slot) in enumerate(zip(tensors, slots)):
            if not (0 <= slot < num_slots):
                raise ValueError(f"slots[{i}] = {slot} is outside [0, num_slots={num_slots})")
            if not (isinstance(t, RemainderMaster) or t.is_floating_point()):
                raise TypeError(
                    f"tensors[{i}] has dtype {t.dtype}; only floating-point tensors have norms here"
                )
        self.num_slots = num_slots
        self.out_device = (
            torch.device(out_device) if out_device is not None else _default_out_device(tensors)
        )
        self._num_tensors = len(tensors)
        self._numel = sum(t.numel() for t in tensors)
        self._nbytes = sum(t.numel() * t.element_size() for t in tensors)

        buckets: dict[_GroupKey, tuple[list[Summand], list[int]]] = defaultdict(lambda: ([], []))
        for t, slot in zip(tensors, slots):
            if t.numel():  # zero-size tensors add nothing; some fused kernels reject them
                bucket = buckets[_group_key(t)]
                bucket[0].append(t if isinstance(t, RemainderMaster) else t.detach())
                bucket[1].append(slot)
        indices = DeviceIndices() if indices is None else indices
        self._groups: dict[_GroupKey, RowNormGroup | FusedGroup] = {
            key: _build_group(
                key, group_tensors, group_slots, indices, num_slots if packed else None
            )
            for key, (group_tensors, group_slots) in buckets.items()
        }

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def backends(self) -> dict[tuple[torch.device, torch.dtype], str]:
        """Which reduction each (device, dtype) group uses, for reporting.

        On an accelerator, fp32 tensors and remainder masters are two groups of one key; their
        names are joined.
        """
        names: dict[tuple[torch.device, torch.dtype], str] = {}
        for (device, dtype, _), group in self._groups.items():
            previous = names.get((device, dtype))
            names[(device, dtype)] = f"{previous} + {group.backend}" if previous else group.backend
        return names

    def views(self) -> Iterator[Summand]:
        """Every tensor a call reads: views of the given tensors (and, for packing, one shared
        row of zeros). For inspection: the plan copies nothing at construction."""
        for group in self._groups.values():
            yield from group.views()

    @property
    def kept_bytes(self) -> int:
        """What the plan keeps between calls beyond its views and index tensors (``packed``:
        the pack buffers and their reads' norms)."""
        return sum(getattr(group, "kept_bytes", 0) for group in self._groups.values())

    @property
    def scratch_bytes(self) -> int:
        """Upper bound of the extra memory one call allocates (groups run one after another)."""
        return max((group.scratch_bytes for group in self._groups.values()), default=0)

    def __call__(self) -> Tensor:
        """Return the float64 sums of squares, shape ``[num_slots]``, on ``out_device``.

        No host synchronization: on accelerators the result is ready when the stream says so.
        NaN or Inf in a tensor shows up in its slot.
        """
        total = torch.zeros(self.num_slots, dtype=torch.float64, device=self.out_device)
        for (device, _, _), group in self._groups.items():
            acc = total if device == self.out_device else torch.zeros_like(total, device=device)
            group(acc)
            if acc is not total:
                # non_blocking is only safe towards an accelerator: a device-to-host copy would
                # return before the data arrived, so that direction blocks (the caller asked for it).
                total += acc.to(self.out_device, non_blocking=self.out_device.type != "cpu")
        return total
