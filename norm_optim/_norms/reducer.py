"""From the registry to a number: prebuilt sums of squares, one all-reduce, a square root.

Every element is counted on exactly one rank, so any breakdown (dense / expert / per param) is
just more slots in the same all-reduced vector: the breakdowns cost no extra collective.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar

import torch

from .._comm import Communicator, Done, ProcessGroup, Work
from .._errors import NormOptimError
from .._kernels import DeviceIndices, SumOfSquaresPlan
from .names import exchange_names
from .._megatron.naming import expert_of, layer_of, natural_key
from .registry import CountedRecord, ParamRecord, ParamRegistry
from .._counting.vocabulary import NotCounted

T = TypeVar("T")

DENSE, EXPERT = 0, 1
"""Slots of the dense and expert sums of squares at the head of every reduced vector; per-param
slots (when asked for) follow."""


class NamedNorms(Mapping[str, torch.Tensor]):
    """Norms by name, backed by one vector (:attr:`vector`, in name order): a read costs one
    view, and a call builds no per-name objects (the name index is built once per reducer and
    shared by every call).

    Args:
        index: name -> position in ``vector``, iterated in name order; kept, not copied (share
            one index between results).
        vector: the norms, one per position of ``index``.
    """

    def __init__(self, index: Mapping[str, int], vector: torch.Tensor) -> None:
        self._index, self.vector = index, vector

    def with_vector(self, vector: torch.Tensor) -> NamedNorms:
        """The same names (the same index, shared) over another vector of their positions: a
        quantity derived from this one slot by slot, e.g. a ratio of two rollups."""
        return NamedNorms(self._index, vector)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.vector[self._index[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"NamedNorms({len(self)} names)"


@dataclasses.dataclass(frozen=True)
class ParamNorms:
    """Global L2 norms of the model's weights (0-dim float64 tensors on the reduction device).

    ``dense**2 + expert**2 == total**2``. With ``per_param``: one norm per layout-independent
    param name, and the rollups ``per_layer`` (by global layer,
    :func:`~norm_optim._megatron.naming.layer_of`) and ``per_expert`` (by ``<layer>.<expert>``,
    :func:`~norm_optim._megatron.naming.expert_of`), each the square root of a sum of per-param
    squares from the same all-reduce. Reading a value (``float(norms.total)``) is the only host
    sync.
    """

    total: torch.Tensor
    dense: torch.Tensor
    expert: torch.Tensor
    per_param: Optional[Mapping[str, torch.Tensor]] = None
    per_layer: Optional[Mapping[str, torch.Tensor]] = None
    per_expert: Optional[Mapping[str, torch.Tensor]] = None

    def largest(self, k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` largest per-parameter norms, largest first (reads the values: one sync)."""
        names, values = self._per_param_vector()
        top = torch.topk(values, min(k, len(names)))
        return [(names[i], v) for v, i in zip(top.values.tolist(), top.indices.tolist())]

    def fastest_growing(self, since: "ParamNorms", k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` params whose norm grew the most since an earlier read, as ratios now/then.

        Params whose earlier norm was 0 are skipped (no ratio). One host sync.
        """
        names, now = self._per_param_vector()
        before_names, before = since._per_param_vector()
        if before_names != names:
            raise ValueError("the two reads have different per-param names (another model?)")
        ratio = torch.where(before > 0, now / before, torch.full_like(now, float("-inf")))
        top = torch.topk(ratio, min(k, len(names)))
        return [
            (names[i], r)
            for r, i in zip(top.values.tolist(), top.indices.tolist())
            if r != float("-inf")
        ]

    def _per_param_vector(self) -> tuple[list[str], torch.Tensor]:
        if self.per_param is None:
            raise ValueError("these norms have no per-param breakdown: ask for per_param=True")
        names = list(self.per_param)
        if isinstance(self.per_param, NamedNorms):
            return names, self.per_param.vector
        return names, torch.stack([self.per_param[n] for n in names]) if names else torch.zeros(0)


@dataclasses.dataclass(frozen=True)
class _Rollup:
    """Which per-param slots add up into which named group (a layer, an expert): built once."""

    index: dict[str, int]  # group name -> position
    groups: torch.Tensor  # the group of each per-param slot; len(index) for none (dropped)
    host: tuple[int, ...] = ()  # the same groups on the host (for plans built from them)

    @classmethod
    def of(
        cls, names: Sequence[str], key: Callable[[str], Optional[str]], device: torch.device
    ) -> "_Rollup":
        keys = [key(name) for name in names]
        index = {
            k: g for g, k in enumerate(sorted({k for k in keys if k is not None}, key=natural_key))
        }
        host = tuple(len(index) if k is None else index[k] for k in keys)
        return cls(index, torch.tensor(host, dtype=torch.long, device=device), host)

    def norms(self, squares: torch.Tensor) -> NamedNorms:
        """The groups' norms from the per-param sums of squares (no copy of them)."""
        sums = squares.new_zeros(len(self.index) + 1).index_add_(0, self.groups, squares)
        return NamedNorms(self.index, sums[:-1].sqrt_())


@dataclasses.dataclass(frozen=True)
class _PerParamSlots:
    """What the per-param slots of a reduced vector mean (built once per reducer)."""

    index: dict[str, int]  # layout-independent name -> position after the dense/expert slots
    layers: _Rollup
    experts: _Rollup


class PendingNorms:
    """Norms whose all-reduce may still be in flight; :meth:`wait` returns them.

    On CUDA, ``wait`` only orders the current stream after the collective: the host never
    blocks until a value is read.
    """

    def __init__(self, squares: torch.Tensor, work: Work, slots: Optional[_PerParamSlots]) -> None:
        self._squares, self._work, self._slots = squares, work, slots
        self._result: Optional[ParamNorms] = None

    def wait(self) -> ParamNorms:
        if self._result is None:
            self._work.wait()
            squares, slots = self._squares, self._slots
            total = squares[: EXPERT + 1].sum().sqrt()
            rollups = {}
            if slots is not None:  # sums of squares first, then the norms in place
                tail = squares[EXPERT + 1 :]
                rollups = dict(
                    per_layer=slots.layers.norms(tail), per_expert=slots.experts.norms(tail)
                )
                rollups["per_param"] = NamedNorms(slots.index, tail)
            norms = squares.sqrt_()  # the reduced vector is the result: no second one
            self._result = ParamNorms(total, norms[DENSE], norms[EXPERT], **rollups)
        return self._result


class _KeptPlans:
    """The last few plans of :meth:`NormReducer.local_squares`, each with weak references to
    the tensor objects it was laid out for: a plan is reused only for the very same objects
    (a dead reference never matches, so a recycled ``id`` cannot alias)."""

    CAPACITY = 4

    def __init__(self) -> None:
        self._kept: collections.OrderedDict[Any, tuple[list[Any], SumOfSquaresPlan]] = (
            collections.OrderedDict()
        )

    @staticmethod
    def _key(per_param: bool, quantities: int, tensors: Sequence[Any]) -> Any:
        return (per_param, quantities, tuple(id(t) for t in tensors))

    def get(
        self, per_param: bool, quantities: int, tensors: Sequence[Any]
    ) -> Optional[SumOfSquaresPlan]:
        key = self._key(per_param, quantities, tensors)
        found = self._kept.get(key)
        if found is None or any(ref() is not t for ref, t in zip(found[0], tensors)):
            return None
        self._kept.move_to_end(key)
        return found[1]

    def keep(
        self, per_param: bool, quantities: int, tensors: Sequence[Any], plan: SumOfSquaresPlan
    ) -> None:
        refs = [weakref.ref(t) for t in tensors]
        self._kept[self._key(per_param, quantities, tensors)] = (refs, plan)
        while len(self._kept) > self.CAPACITY:
            self._kept.popitem(last=False)


def named_records(registry: ParamRegistry) -> list[ParamRecord]:
    """The records that have a per-param slot: tied copies and excluded frozen params are no
    params of their own.

    Raises:
        NormOptimError: the registry has no model (its stand-in names ``param0``, ``param1``...
            mean different params on different ranks: summing them by name would mix params).
    """
    if registry.chunks is None:
        raise NormOptimError(
            "per-param norms need the model: pass NormAwareOptimizer(..., model=chunks) "
            "(this optimizer does not know its model chunks)"
        )
    return [
        r
        for r in registry.records
        if r.reason not in (NotCounted.SHARED, NotCounted.FROZEN_EXCLUDED)
    ]


def local_names(registry: ParamRegistry) -> list[tuple[str, bool]]:
    """This rank's sorted ``(layout-independent name, expert)`` list: what it brings to the
    names exchange."""
    return sorted({(r.global_name, r.expert) for r in named_records(registry)})


class NormReducer:
    """Sums of squares over a registry's counted tensors, reduced once over ``group``.

    Args:
        registry: what this rank counts.
        comm: the communication seam.
        group: a process group that contains every rank that counts anything (default: all).
        names: the gathered ``(layout-independent name, expert)`` list of a previous reducer of
            the same model. A registry may be rebuilt on some ranks only (their optimizer
            replaced tensors); reusing the names keeps the rebuild free of collectives.
        warm_up: run the plan and the result's square roots once now, without a collective,
            so that the first-call costs (lazy imports, the allocator growing for the scratch
            buffers, and torch paging in the code of kernels this process never ran: a first
            float64 ``sqrt`` alone adds 5.6 MiB of file-backed RSS on CPU) land at wrap time,
            not in the first logged norm; a rebuild need not pay them again.
    """

    def __init__(
        self,
        registry: ParamRegistry,
        comm: Communicator,
        group: ProcessGroup,
        names: Optional[list[tuple[str, bool]]] = None,
        warm_up: bool = True,
    ) -> None:
        self.registry, self.comm, self.group = registry, comm, group
        self.device = comm.device(group)
        # The index tensors of every plan built here, kept on the device once per layout: the
        # plans of a step's grads and moments are rebuilt at each step (new tensor objects) and
        # then copy nothing to the device (no host stall: :mod:`norm_optim._kernels.indices`).
        self.indices = DeviceIndices()
        counted = registry.counted
        if not registry.records:
            warnings.warn("norm_optim: the model has no params; its norm is 0", stacklevel=3)
        self._split_plan = SumOfSquaresPlan(
            [r.tensor for r in counted],
            [EXPERT if r.expert else DENSE for r in counted],
            num_slots=2,
            out_device=self.device,
            indices=self.indices,
            packed=True,
        )
        if warm_up:
            PendingNorms(self._split_plan(), Done(), None).wait()
        self._per_param_plan: Optional[SumOfSquaresPlan] = None
        self._per_param_slots: list[int] = []
        self.names = names
        self._slots: Optional[_PerParamSlots] = None
        self._kinds = torch.empty(0, dtype=torch.long)
        self._step_plans: dict[bool, Any] = {}
        self._kept_plans = _KeptPlans()

    def step_plan(self, per_param: bool, build: Callable[["NormReducer", bool], T]) -> T:
        """The step plan of this registry (:class:`norm_optim._step.measurement.StepPlan`), built by
        ``build`` at the first armed step and kept as long as the registry."""
        plan = self._step_plans.get(per_param)
        if plan is None:
            plan = self._step_plans[per_param] = build(self, per_param)
        return plan

    def launch(self, per_param: bool = False, async_op: bool = False) -> PendingNorms:
        """Start the sums and the single all-reduce; return a handle to the result."""
        squares = self.local_weight_squares(per_param)
        work = self.comm.all_reduce_sum(squares, self.group, async_op)
        return PendingNorms(squares, work, self.per_param_slots if per_param else None)

    def local_weight_squares(self, per_param: bool = False) -> torch.Tensor:
        """This rank's sums of squares of the weights, before the all-reduce (prebuilt plans)."""
        if per_param:
            return self.fold(self._per_param()[0]())
        return self._split_plan()

    def num_slots(self, per_param: bool) -> int:
        """Length of the vector one quantity (weights, grads, ...) reduces."""
        return self._per_param()[0].num_slots if per_param else EXPERT + 1

    def counted_slots(self, per_param: bool) -> list[int]:
        """The slot of each of ``registry.counted``, in that order: the layout every quantity
        summed over the counted tensors shares (so that they can share one packet)."""
        if per_param:
            self._per_param()
            return self._per_param_slots
        return [EXPERT if r.expert else DENSE for r in self.registry.counted]

    def local_squares(
        self, *quantities: Sequence[Optional[torch.Tensor]], per_param: bool = False
    ) -> torch.Tensor:
        """This rank's sums of squares of other tensors of the counted params (their grads, their
        optimizer state), one vector per quantity, concatenated: ``quantity[i]`` belongs to
        ``registry.counted[i]`` (None: nothing).

        One plan over all the quantities, with the weights' slots (offset per quantity) and the
        same kernels, kept while the same tensor objects come back (an optimizer's moments do,
        step after step: laying a plan out costs a few ops per tensor, calling it a few per
        block); tensors that are new objects at every step (a step's grads may be) get a new
        plan. Its index tensors are the reducer's (:attr:`indices`), so a call over the same
        layout as an earlier one copies nothing to the device.
        """
        slots, n = self.counted_slots(per_param), self.num_slots(per_param)
        kept = [
            (t, q * n + s)
            for q, tensors in enumerate(quantities)
            for t, s in zip(tensors, slots)
            if t is not None
        ]
        tensors = [t for t, _ in kept]
        plan = self._kept_plans.get(per_param, len(quantities), tensors)
        if plan is None:
            plan = SumOfSquaresPlan(
                tensors,
                [s for _, s in kept],
                num_slots=n * len(quantities),
                out_device=self.device,
                indices=self.indices,
            )
            self._kept_plans.keep(per_param, len(quantities), tensors, plan)
        squares = plan()
        if per_param:
            for part in squares.split(n):
                self.fold(part)
        return squares

    def fold(self, squares: torch.Tensor) -> torch.Tensor:
        """Add the per-param slots into the dense and expert slots, in place (before the reduce,
        no second pass; into a 2-vector first: the tail is not copied)."""
        _, kinds = self._per_param()
        squares[: EXPERT + 1] += torch.zeros_like(squares[: EXPERT + 1]).index_add_(
            0, kinds, squares[EXPERT + 1 :]
        )
        return squares

    @property
    def per_param_slots(self) -> Optional[_PerParamSlots]:
        """What the per-param slots mean (None until the first per-param call builds them)."""
        return self._slots

    def _per_param(self) -> tuple[SumOfSquaresPlan, torch.Tensor]:
        """Build (once) the plan with one slot per layout-independent param name.

        The names of all ranks are exchanged once, by every rank on its first per-param call
        (:func:`~norm_optim._norms.names.exchange_names`: only distinct name lists travel), so
        that slot ``i`` means the same param everywhere.
        """
        if self._per_param_plan is None:
            records = named_records(self.registry)
            local = [r.global_name for r in records]
            if self.names is None:
                self.names = exchange_names(local_names(self.registry), self.comm, self.group)
            labels = [name for name, _ in self.names]
            index = {name: i for i, name in enumerate(labels)}
            self._slots = _PerParamSlots(
                index,
                _Rollup.of(labels, layer_of, self.device),
                _Rollup.of(labels, expert_of, self.device),
            )
            slot = {name: EXPERT + 1 + i for name, i in index.items()}
            counted = [(r, n) for r, n in zip(records, local) if isinstance(r, CountedRecord)]
            # The same records, in the same order, as registry.counted (named_records drops only
            # records that are never counted).
            self._per_param_slots = [slot[n] for _, n in counted]
            self._per_param_plan = SumOfSquaresPlan(
                [r.tensor for r, _ in counted],
                self._per_param_slots,
                num_slots=EXPERT + 1 + len(self.names),
                out_device=self.device,
                indices=self.indices,
                packed=True,
            )
            self._kinds = torch.tensor(  # long even when empty (a model with no params)
                [EXPERT if expert else DENSE for _, expert in self.names],
                dtype=torch.long,
                device=self.device,
            )
        return self._per_param_plan, self._kinds
