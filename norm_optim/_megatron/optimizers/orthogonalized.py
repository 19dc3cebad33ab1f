"""Muon and the orthogonalized emerging optimizers: their update read during the step.

Muon's update is ``−lr · s · NS(momentum)`` (``NS``: a Newton-Schulz orthogonalization, ``s``
a shape-dependent scale), plus a weight-decay term. ``NS`` is an iteration of matrix products
(in the matmul precision of the run, TF32 by default on a GPU; under tensor parallelism, over
a TP all-gather): it cannot be re-derived exactly from the state after the step, and its result
is not stored. What the optimizer does store, param by param, is the weight itself: so for the
armed step, the leaf's per-param hooks are wrapped and each tensor's ``θ_after − θ_before`` is
read there, one tensor at a time
(:class:`~norm_optim._megatron.optimizers.in_step.StoredDifferences`: the extra memory is one copy
of the largest tensor this rank counts, freed after the step).

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
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

from .holdings import local
from .in_step import StoredDifferences, step_name
from ..._patching import attributes_set

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
    name = step_name(optimizer)
    if name not in _STEPS_READ:
        return f"its step() ({name}) is not one norm_optim has read"
    return None


class InStepUpdates:
    """``‖θ_after − θ_before‖²`` of each tensor this rank counts that an orthogonalized optimizer
    steps, read during one ``step()`` (see the module docstring).

    Inside :meth:`around_step`, the optimizer instance gets two attributes that shadow its
    per-param hooks (removed afterwards): the first copies the tensor about to be stepped into
    the step's scratch (the size of the largest counted tensor), the second subtracts the copy
    from the stepped tensor, in place, and sums its squares into the tensor's slot (float64, no
    host sync): about a dozen ops per tensor. A tensor this rank does not count is stepped
    unread (its pairing is still checked).

    Args:
        optimizer: the orthogonalized torch optimizer.
        params: the params it steps that this rank counts (DTensors: their local shards are
            read).
        slots, num_slots, device: where each one's sum of squares goes.
    """

    def __init__(
        self,
        optimizer: Any,
        params: Sequence[torch.Tensor],
        slots: Sequence[int],
        num_slots: int,
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        # A zero-size tensor changes nothing: it is not read (and shares no chunk).
        read = [(p, s) for p, s in zip(params, slots) if p.numel()]
        self.differences = StoredDifferences(
            optimizer,
            [local(p) for p, _ in read],
            [s for _, s in read],
            num_slots,
            device,
            budget_bytes=0,  # one tensor per chunk: the step writes them one at a time
        )
        self._chunk_of = {id(read[c.first][0]): c for c in self.differences.plan.chunks}

    @contextlib.contextmanager
    def around_step(self, out: torch.Tensor) -> Iterator[None]:
        """Run the optimizer's ``step()`` inside: every counted tensor's update goes into
        ``out``."""
        optimizer, differences = self.optimizer, self.differences
        decay = optimizer._apply_weight_decay_inplace
        post = optimizer.post_weight_update_fn_inplace

        def apply_weight_decay(p: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            differences.begin(id(p), self._chunk_of.get(id(p)))
            return decay(p, *args, **kwargs)

        def post_weight_update(p: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            result = post(p, *args, **kwargs)
            differences.end(id(p), self._chunk_of.get(id(p)))
            return result

        with (
            differences.reading(out),
            attributes_set(
                optimizer,
                _apply_weight_decay_inplace=apply_weight_decay,
                post_weight_update_fn_inplace=post_weight_update,
            ),
        ):
            yield

    def after_step(self, out: torch.Tensor) -> None:
        """Nothing: every update was read in the step (a skipped step reads none: zero)."""
