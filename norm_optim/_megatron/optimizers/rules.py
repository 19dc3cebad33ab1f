"""The update rules step norms derive, one small class per rule, found by the optimizer's class
(the rules: :mod:`.update_rule`, :mod:`.torch_rules`, :mod:`.fused_adam`; Muon's is here).

A rule answers, for the tensors one torch optimizer steps: was this tensor stepped, what are its
moments (or momentum), and what did the step change (``θ_after − θ_before``), derived from what
the optimizer holds *after* the step so that no copy of the weights is ever kept. Each rule
works on a list of tensors at once with ``torch._foreach_*`` operations (one kernel per list on
an accelerator), writing into the views it is given: the caller sizes the lists by bytes
(:mod:`norm_optim._step.measurement`).

:data:`RULES` maps an optimizer class (by its qualified name) to a builder; a builder returns an :class:`UpdateRule`, or a :class:`Refused`
with the exact reason the step of that use cannot be derived. A new optimizer is one new rule
class and one entry in :data:`RULES`.

The derivations are exact math on the stored values; the difference the step *stored* also
carries the fp32 rounding of ``θ_after``, so the two differ by at most about one ulp of each
weight (docs/step-norms.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Union

import torch

from .holdings import qualified_name
from .in_step import StepReader
from .orthogonalized import MOMENTUM, InStepUpdates, unread_step
from .fused_adam import APEX_FUSED_ADAM, TE_FUSED_ADAM, fused_adam_rule
from .torch_rules import AdamRule, SGDRule
from .update_rule import Counted, Refused, Stepped, UpdateRule


class OrthogonalizedRule(UpdateRule):
    """Muon and the orthogonalized emerging optimizers (:mod:`.orthogonalized`): the update is
    read during the step, one tensor at a time, as the difference the step stored; the momentum
    buffer is reported as ``momentum``."""

    name = "orthogonalized"
    moments = ()
    momentum = MOMENTUM
    hyper_parameters = ("lr", "momentum", "weight_decay", "nesterov", "weight_decay_method")

    def reader(self, optimizer: Any, counted: Counted) -> StepReader:
        params = [e.param for e in counted.entries]
        return InStepUpdates(optimizer, params, counted.slots, counted.num_slots, counted.device)

    def write_updates(self, entries: Sequence[Stepped], out: Sequence[torch.Tensor]) -> list[float]:
        raise NotImplementedError("the orthogonalized optimizers' updates are read in-step")


# ---------------------------------------------------------------------------------------------
# Builders, by optimizer class.
# ---------------------------------------------------------------------------------------------

RuleBuilder = Callable[[Any, Any], Union[UpdateRule, Refused]]
"""``builder(torch_optimizer, leaf)`` (``leaf``: the megatron optimizer around it, for its
config) -> the rule of that optimizer, or why there is none."""


def _adam(optimizer: Any, leaf: Any) -> Union[UpdateRule, Refused]:
    return AdamRule()


def _adamw(optimizer: Any, leaf: Any) -> Union[UpdateRule, Refused]:
    return AdamRule(decoupled=True)


def _sgd(optimizer: Any, leaf: Any) -> Union[UpdateRule, Refused]:
    return SGDRule()


def _orthogonalized(optimizer: Any, leaf: Any) -> Union[UpdateRule, Refused]:
    why = unread_step(optimizer)
    return OrthogonalizedRule() if why is None else Refused(why)


RULES: tuple[tuple[str, RuleBuilder], ...] = (
    ("torch.optim.adamw.AdamW", _adamw),
    ("torch.optim.adam.Adam", _adam),
    ("torch.optim.sgd.SGD", _sgd),
    (APEX_FUSED_ADAM, fused_adam_rule),
    (TE_FUSED_ADAM, fused_adam_rule),
    # Muon as megatron-core (0.19, main) builds it, and the emerging_optimizers classes it and
    # users build on (emerging_optimizers 0.3): their step functions are read (.orthogonalized).
    ("megatron.core.optimizer.emerging_optimizers.TensorParallelMuon", _orthogonalized),
    ("megatron.core.optimizer.emerging_optimizers.TensorParallelAdaptiveMuon", _orthogonalized),
    ("emerging_optimizers.orthogonalized_optimizers.muon.Muon", _orthogonalized),
    ("emerging_optimizers.orthogonalized_optimizers.adaptive_muon.AdaptiveMuon", _orthogonalized),
)
"""Optimizer class (qualified name) -> its rule builder. The class itself must be listed: a
subclass may step otherwise (``torch.optim.AdamW`` is a subclass of ``Adam`` on torch >= 2.6,
its own class before; both are listed)."""

NO_RULE = (
    "its update rule is not one norm_optim reads (torch.optim.Adam, AdamW, SGD, apex's and "
    "TE's FusedAdam, Muon and AdaptiveMuon): the other emerging optimizers (SOAP, Lion, ...) "
    "and the fused SGDs are not read yet"
)


def rule_for(optimizer: Any, leaf: Any = None) -> Union[UpdateRule, Refused]:
    """The rule of a torch optimizer (by its exact class), or why there is none."""
    builder = dict(RULES).get(qualified_name(optimizer))
    return Refused(NO_RULE) if builder is None else builder(optimizer, leaf)
