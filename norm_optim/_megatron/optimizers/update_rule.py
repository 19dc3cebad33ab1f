"""The interface of an update rule (:class:`UpdateRule`, given :class:`Stepped` tensors, or a
:class:`Refused` reason) and the mechanism that reads a torch step's updates chunk by chunk
(:class:`UpdateReader`), shared by every rule."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import struct
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Hashable, Optional, TypeVar

import torch

from ..._errors import NormOptimError
from .holdings import local
from .in_step import StepReader, StoredDifferences, step_name
from ..._patching import attributes_set


@dataclasses.dataclass(frozen=True)
class Stepped:
    """One tensor a torch optimizer steps, as the registry holds it.

    Attributes:
        held: the fp32 tensor the registry holds (a DTensor's local shard).
        optimizer: the torch optimizer that steps it.
        param: what that optimizer steps (a DTensor under torch FSDP2 / Megatron-FSDP, a CPU
            copy under ``HybridDeviceOptimizer``).
        group: its param group (read at the step: a scheduler changes ``lr`` in place).
        rule: how its step is derived.
        grad_of: whose ``.grad`` the step read, when not ``param``'s.
    """

    held: torch.Tensor
    optimizer: Any
    param: torch.Tensor
    group: dict
    rule: "UpdateRule"
    grad_of: Optional[torch.Tensor] = None

    @property
    def state(self) -> dict:
        """Its optimizer state now (empty before its first step), DTensors as their local
        shards; never creates an entry. ``optimizer.state`` is looked up now, not kept: an
        optimizer may replace the whole mapping at every step (``HybridDeviceOptimizer`` does)."""
        return {k: local(v) for k, v in (self.optimizer.state.get(self.param) or {}).items()}

    @property
    def grad(self) -> Optional[torch.Tensor]:
        grad = (self.param if self.grad_of is None else self.grad_of).grad
        return None if grad is None else local(grad)


@dataclasses.dataclass(frozen=True)
class Counted:
    """The tensors one torch optimizer steps that this rank counts, and where their sums of
    squares go (``slots[i]`` of a vector of ``num_slots`` on ``device``)."""

    entries: Sequence[Stepped]
    slots: Sequence[int]
    num_slots: int
    device: torch.device


@dataclasses.dataclass(frozen=True)
class Refused:
    """No exact rule for this use of an optimizer: ``reason`` says why (shown to the user)."""

    reason: str


class UpdateRule(abc.ABC):
    """How one optimizer's step is read: its moments and its derived update.

    Attributes:
        name: for messages and the descriptor (e.g. ``"adam"``).
        moments: the state keys reported as ``exp_avg`` and ``exp_avg_sq`` (or momentum: one
            key, reported as ``exp_avg``); empty when the rule keeps none.
        hyper_parameters: the param-group keys (and instance flags) the rule reads.
    """

    name: str = ""
    moments: tuple[str, ...] = ()
    hyper_parameters: tuple[str, ...] = ()
    momentum: Optional[str] = None
    """The state key of a momentum buffer reported as ``StepNorms.momentum`` (Muon's)."""
    reads_stored: bool = False
    """True: the step is one torch's ``Adam`` / ``SGD`` runs over its param groups, and it is
    run chunk by chunk to read the difference it stores (:class:`UpdateReader`); the update is
    derived after it (:meth:`write_updates`) only where that read would change the step."""

    def reader(self, optimizer: Any, counted: Counted) -> StepReader:
        """How the updates of the counted tensors ``optimizer`` steps are read at an armed step;
        built once per step plan."""
        return UpdateReader(self, optimizer, counted)

    def check(self, entry: Stepped) -> Optional[str]:
        """Why this tensor's step cannot be read now (e.g. a moment's dtype), else None;
        called when a step is armed, before it runs."""
        return None

    def stepped(self, entry: Stepped) -> bool:
        """Whether the last step changed this tensor (torch skips a param without a grad)."""
        return entry.grad is not None and bool(entry.state)

    def moment_tensors(self, entry: Stepped) -> tuple[Optional[torch.Tensor], ...]:
        """``(exp_avg, exp_avg_sq)`` (None where absent), by :attr:`moments`."""
        state = entry.state
        found = tuple(state.get(key) for key in self.moments)
        return (found + (None, None))[:2]

    @abc.abstractmethod
    def write_updates(self, entries: Sequence[Stepped], out: Sequence[torch.Tensor]) -> list[float]:
        """Write each entry's update, up to a factor, into ``out``; return the factors.

        ``out[i]`` is an fp32 tensor of ``entries[i].held``'s shape (a view of the caller's
        scratch); afterwards ``factor[i] · out[i]`` is ``θ_after − θ_before``. Returning a factor
        instead of applying it saves a pass over the elements (norms scale exactly). Every entry
        was stepped (:meth:`stepped`). Call it right after the step, before anything changes the
        tensors, their state or their param group (a scheduler's ``lr``).
        """


_Key = TypeVar("_Key", bound=Hashable)


def by_key(
    entries: Sequence[Stepped], key: Callable[[Stepped], _Key]
) -> list[tuple[_Key, list[int]]]:
    """Indices of ``entries`` grouped by ``key`` (one list operation per distinct key)."""
    groups: dict[_Key, list[int]] = defaultdict(list)
    for i, entry in enumerate(entries):
        groups[key(entry)].append(i)
    return list(groups.items())


def fp32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what a C ``float`` argument holds)."""
    return struct.unpack("f", struct.pack("f", value))[0]


# torch's steps run chunk by chunk (``module.qualname``): each loops over ``self.param_groups``,
# reads ``group["params"]`` and the group's hyper-parameters, and steps each param with a grad
# once, with per-element arithmetic that does not depend on which other params are stepped with
# it (read in torch 2.13 ``optim/adam.py`` / ``sgd.py``: ``_init_group`` collects the params
# with a grad and creates their state; the single-tensor, foreach and fused functions advance
# each param's ``state["step"]`` once and apply the same scalar-by-tensor operations to each
# tensor; ``_default_to_fused_or_foreach`` picks the path from the tensors' type and device,
# the same for any part of one optimizer whose tensors share them, which is checked;
# ``capturable`` / ``differentiable`` change the scalars' form and the grad mode, per param).
# ``AdamW.step`` is its own function before torch 2.6 (the same loop).
_TORCH_STEPS_READ = frozenset(
    ("torch.optim.adam.Adam.step", "torch.optim.adamw.AdamW.step", "torch.optim.sgd.SGD.step")
)


class UpdateReader:
    """The updates of the counted tensors one torch optimizer steps: read in its step as the
    difference it stores where the rule allows (:attr:`UpdateRule.reads_stored`) and nothing
    else would change, else derived right after it by the rule (:meth:`UpdateRule.write_updates`).

    Reading: for the armed step only, the optimizer instance gets a ``step`` attribute (removed
    after) that runs its class's ``step`` chunk by chunk, the chunks of :class:`StoredDifferences`
    (≤ the byte budget each; a larger tensor alone): the chunk's tensors are copied into their
    places of the scratch (one list operation), every param group's ``"params"`` is narrowed
    to the chunk's members (the group dicts stay: schedulers and hyper-parameters live in them;
    the lists are put back in a ``finally``), the class's step runs, and the differences are
    summed. The params this rank does not count are stepped last, together, unread. Each param
    is stepped once. On CPU a chunk of small tensors stays in cache from the copy to the
    subtraction; a tensor larger than the cache costs the copy's and the subtraction's passes
    over memory (still fewer than the derivation's: docs/step-norms.md, "Cost").

    Derived instead (the fallback; the same chunks and scratch), because reading would change the
    step or what it is known to do:

    - an optimizer step pre- or post-hook is registered (torch's global ones or the instance's):
      running the step per chunk would run the hooks once per chunk, and a hook may change the
      tensors (``HybridDeviceOptimizer`` copies its CPU params back in a post-hook);
    - ``step()`` is given a closure (it would be re-evaluated per chunk);
    - the class's step is not one read here (a subclass overriding it), or the instance already
      has its own ``step`` attribute (e.g. wrapped by a torch LR scheduler);
    - the optimizer's params differ in type or device (torch's choice of its foreach / fused
      path could differ between a chunk and the whole), or a counted tensor is not an fp32
      tensor on the plan's device.
    """

    def __init__(self, rule: UpdateRule, optimizer: Any, counted: Counted) -> None:
        self.rule, self.optimizer, self.entries = rule, optimizer, list(counted.entries)
        tensors = [local(e.param) for e in self.entries]
        self.differences = StoredDifferences(
            optimizer, tensors, counted.slots, counted.num_slots, counted.device
        )
        self._unread = (
            self._unreadable(counted.device) if rule.reads_stored else "its rule derives the update"
        )
        self._read = False
        # Each counted param's batch: its chunk (fixed with the plan); the others go last.
        self._batch_of = {
            id(self.entries[i].param): c
            for c, chunk in enumerate(self.differences.plan.chunks)
            for i in chunk.items
        }

    def _unreadable(self, device: torch.device) -> Optional[str]:
        name = step_name(self.optimizer)
        if name not in _TORCH_STEPS_READ:
            return f"its step() ({name}) is not one read chunk by chunk"
        kinds = {(type(p), p.device.type) for g in self.optimizer.param_groups for p in g["params"]}
        if len(kinds) > 1:
            return f"its params differ in type or device ({sorted(map(str, kinds))})"
        for entry in self.entries:
            shard = local(entry.param)
            if shard.dtype != torch.float32 or shard.device != device:
                return "a counted tensor is not an fp32 tensor on the step plan's device"
        return None

    @property
    def read_in_step(self) -> bool:
        """Whether the last step's updates were read in it (False: derived after it)."""
        return self._read

    def unread_now(self, args: tuple, kwargs: dict) -> Optional[str]:
        """Why this call of ``step()`` is not read chunk by chunk (None: it is)."""
        if self._unread is not None:
            return self._unread
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is not None or len(args) > 1 or set(kwargs) - {"closure"}:
            return "step() was given a closure or other arguments"
        import torch.optim.optimizer as optim

        hooks = (
            optim._global_optimizer_pre_hooks,
            optim._global_optimizer_post_hooks,
            getattr(self.optimizer, "_optimizer_step_pre_hooks", None),
            getattr(self.optimizer, "_optimizer_step_post_hooks", None),
        )
        if any(hooks):
            return "an optimizer step hook is registered"
        return None

    @contextlib.contextmanager
    def around_step(self, out: torch.Tensor) -> Iterator[None]:
        self._read = False
        if self._unread is not None or "step" in vars(self.optimizer):
            yield  # derived after the step (the instance's own step is not ours to split)
            return
        original = self.optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            if self.unread_now(args, kwargs) is not None:
                return original(*args, **kwargs)
            if self._read:  # its sums are in ``out`` already: a second read would add twice
                raise NormOptimError(
                    f"{type(self.optimizer).__name__}.step() ran twice in one armed step: its "
                    "update cannot be read in-step"
                )
            with self.differences.reading(out):
                self._chunked_step()
            self._read = True
            return None  # torch's step returns the closure's loss: there is none

        with attributes_set(self.optimizer, step=step):
            yield

    def _chunked_step(self) -> None:
        optimizer, plan = self.optimizer, self.differences.plan
        step = type(optimizer).step
        groups = optimizer.param_groups
        saved = [group["params"] for group in groups]
        # The groups' params as they are now, by batch (the last: those not counted here), in
        # group order.
        rest = len(plan.chunks)
        batches: list[list[list[torch.Tensor]]] = [[[] for _ in groups] for _ in range(rest + 1)]
        for g, params in enumerate(saved):
            for p in params:
                batches[self._batch_of.get(id(p), rest)][g].append(p)
        try:
            for c, batch in enumerate(batches):
                chunk = plan.chunks[c] if c < rest else None
                if chunk is None and not any(batch):
                    break
                for group, params in zip(groups, batch):
                    group["params"] = params
                self.differences.begin(c, chunk)
                step(optimizer)
                self.differences.end(c, chunk)
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    def after_step(self, out: torch.Tensor) -> None:
        if self._read or not self.entries:
            return
        entries, rule = self.entries, self.rule

        def produce(items: Sequence[int], places: Sequence[torch.Tensor]) -> list[float]:
            factors = [0.0] * len(items)
            chosen = []
            for k, item in enumerate(items):
                if rule.stepped(entries[item]):
                    chosen.append(k)
                else:  # not stepped (no grad): no update
                    places[k].zero_()
            stepped = [entries[items[k]] for k in chosen]
            views = [places[k].view(e.held.shape) for k, e in zip(chosen, stepped)]
            for k, f in zip(chosen, rule.write_updates(stepped, views)):
                factors[k] = f
            return factors

        self.differences.plan(produce, out)
