"""Muon and the orthogonalized emerging optimizers: their update read during the step.

Muon's update is ``−lr · s · NS(momentum)`` (``NS``: a Newton-Schulz orthogonalization, ``s``
a shape-dependent scale), plus a weight-decay term. ``NS`` is an iteration of matrix products
(in the matmul precision of the run, TF32 by default on a GPU; under tensor parallelism, over
a TP all-gather): it cannot be re-derived exactly from the state after the step, and its result
is not stored. What the optimizer does store, param by param, is the weight itself: so for the
armed step, the leaf's per-param hooks are wrapped and each tensor's ``θ_after − θ_before`` is
read there, one tensor at a time (the extra memory is one copy of the largest tensor the leaf
steps, freed after it).

Read in ``emerging_optimizers`` 0.3.0 (``orthogonalized_optimizers/orthogonalized_optimizer.py``
``OrthogonalizedOptimizer.step`` and ``adaptive_muon.py`` ``AdaptiveMuon.step``) and
megatron-core 0.19.2 / main (``megatron/core/optimizer/emerging_optimizers.py``:
``TensorParallelMuon`` and ``TensorParallelAdaptiveMuon`` keep the base ``step``, override
``orthogonalize`` only). Per param with a grad, in this order, nothing else writing ``p``:

1. ``self._apply_weight_decay_inplace(p, grad, lr, wd)`` (called even at ``wd == 0``; it
   scales ``p`` for "decoupled" / "independent" / "palm" decay, or adds to the grad for "l2");
2. ``state["momentum_buffer"].lerp_(grad, 1 − momentum)`` (Nesterov: the orthogonalized input
   is ``grad.lerp(buf, momentum)``, else the buffer);
3. ``self.orthogonalize(p, ...)``, ``self.pre_weight_update_fn_inplace(p, update)``,
   ``p.add_(update, alpha=−lr)``, ``self.post_weight_update_fn_inplace(p)`` (the last write).

So (1) marks where ``p`` is still ``θ_before`` and (3)'s last hook where it is ``θ_after``. A
param without a grad is skipped by the step (no hooks): its update is zero. The pairing is
checked as the step runs; a step that breaks it is an error, never a number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch

from .._errors import NormOptimError
from .._kernels import SumOfSquaresPlan

# The step functions read (``module.qualname``); a subclass that replaces ``step`` is another
# rule, refused by name.
_STEPS_READ = frozenset(
    (
        "emerging_optimizers.orthogonalized_optimizers.orthogonalized_optimizer."
        "OrthogonalizedOptimizer.step",
        "emerging_optimizers.orthogonalized_optimizers.adaptive_muon.AdaptiveMuon.step",
        # megatron-core 0.19 / main: ``return AdaptiveMuon.step(self, closure)``
        "megatron.core.optimizer.emerging_optimizers.TensorParallelAdaptiveMuon.step",
    )
)
MOMENTUM = "momentum_buffer"


def unread_step(optimizer: Any) -> Optional[str]:
    """Why the step of an orthogonalized ``optimizer`` cannot be read in-step, or None."""
    step = getattr(type(optimizer), "step", None)
    unwrapped = getattr(step, "__wrapped__", step)  # torch.no_grad() keeps the original
    name = f"{getattr(unwrapped, '__module__', '?')}.{getattr(unwrapped, '__qualname__', '?')}"
    if name not in _STEPS_READ:
        return f"its step() ({name}) is not one norm_optim has read"
    return None


class InStepUpdates:
    """``‖θ_after − θ_before‖²`` of each tensor an orthogonalized optimizer steps, read during one
    ``step()`` (see the module docstring).

    Inside :meth:`around_step`, the optimizer instance gets two attributes that shadow its
    per-param hooks (removed afterwards): the first copies the tensor about to be stepped into
    one scratch buffer of the step (the size of the largest tensor the optimizer steps), the
    second subtracts that copy from the stepped tensor, in place, and sums its squares (float64,
    no host sync) with one plan per distinct size (a few per model): a dozen ops per tensor.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.squares: dict[int, torch.Tensor] = {}
        """``id(tensor)`` → 0-dim float64 sum of squares of its update (stepped tensors only)."""
        self._pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._scratch: Optional[torch.Tensor] = None
        self._plans: dict[int, SumOfSquaresPlan] = {}

    def _place(self, param: torch.Tensor) -> torch.Tensor:
        """Where ``param``'s copy goes: a flat view of the step's scratch (allocated at the first
        tensor, the size of the largest; a tensor of another dtype or device gets its own)."""
        scratch = self._scratch
        if scratch is None:
            largest = max(
                (p.numel() for g in self.optimizer.param_groups for p in g["params"]), default=0
            )
            scratch = self._scratch = torch.empty(largest, dtype=param.dtype, device=param.device)
        if scratch.dtype != param.dtype or scratch.device != param.device:
            return torch.empty(param.numel(), dtype=param.dtype, device=param.device)
        return scratch[: param.numel()]

    def _begin(self, param: torch.Tensor) -> None:
        if self._pending is not None:
            raise NormOptimError(
                f"{type(self.optimizer).__name__}.step() started a tensor before finishing the "
                "previous one: its update cannot be read in-step (not the step norm_optim read)"
            )
        if id(param) in self.squares:
            raise NormOptimError(
                f"{type(self.optimizer).__name__}.step() stepped one tensor twice in one step: "
                "its update cannot be read in-step"
            )
        place = self._place(param)
        place.copy_(param.detach().reshape(-1))
        self._pending = (param, place)

    def _end(self, param: torch.Tensor) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not param:
            raise NormOptimError(
                f"{type(self.optimizer).__name__}.step() finished a tensor it had not started: "
                "its update cannot be read in-step (not the step norm_optim read)"
            )
        before = pending[1]
        # θ_after − θ_before into the copy (fp32: each element within 2^-24 of the exact
        # difference), then its float64 sum of squares by the registry's kernels.
        delta = torch.sub(param.detach().reshape(-1), before, out=before)
        plan = self._plans.get(delta.numel()) if delta.data_ptr() == self._data_ptr() else None
        if plan is None:
            plan = SumOfSquaresPlan([delta], [0], 1, out_device=delta.device)
            if delta.data_ptr() == self._data_ptr():
                self._plans[delta.numel()] = plan
        self.squares[id(param)] = plan()[0]

    def _data_ptr(self) -> int:
        return -1 if self._scratch is None else self._scratch.data_ptr()

    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        """Run the optimizer's ``step()`` inside: every stepped tensor's update is read."""
        optimizer = self.optimizer
        decay = optimizer._apply_weight_decay_inplace
        post = optimizer.post_weight_update_fn_inplace

        def apply_weight_decay(p: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._begin(p)
            return decay(p, *args, **kwargs)

        def post_weight_update(p: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            result = post(p, *args, **kwargs)
            self._end(p)
            return result

        own = vars(optimizer)
        names = ("_apply_weight_decay_inplace", "post_weight_update_fn_inplace")
        saved = {name: own[name] for name in names if name in own}
        optimizer._apply_weight_decay_inplace = apply_weight_decay
        optimizer.post_weight_update_fn_inplace = post_weight_update
        try:
            yield
        finally:
            for name in names:
                if name in saved:
                    setattr(optimizer, name, saved[name])
                else:
                    delattr(optimizer, name)
            self._scratch, self._plans = None, {}  # nothing stays after the step
        if self._pending is not None:
            self._pending = None
            raise NormOptimError(
                f"{type(optimizer).__name__}.step() left a tensor unfinished: its update cannot "
                "be read in-step (not the step norm_optim read)"
            )
