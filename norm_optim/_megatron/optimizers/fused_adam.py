"""apex's and Transformer Engine's ``FusedAdam`` in fp32 use: the flags read, their rule
(:class:`FusedAdamRule`) and its builder."""

from __future__ import annotations

import inspect
import math
from collections.abc import Collection, Sequence
from typing import Any, Optional, Union

import torch

from .holdings import qualified_name
from .torch_rules import AdamScalars, adam_updates, decoupled_scalars
from .update_rule import Refused, Stepped, UpdateRule, fp32


# apex's and Transformer Engine's FusedAdam, by ``module.qualname`` (importing them needs CUDA),
# and the constructor flags each may take; a flag outside these is one norm_optim has not read.
# What their step does, and at which commits it was read: docs/step-norms.md, "The derivations".
APEX_FUSED_ADAM = "apex.optimizers.fused_adam.FusedAdam"
TE_FUSED_ADAM = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
_FUSED_ADAM_FLAGS = {
    APEX_FUSED_ADAM: frozenset(
        ("params", "lr", "bias_correction", "betas", "eps", "adam_w_mode", "weight_decay")
        + ("amsgrad", "set_grad_none", "capturable", "master_weights")
    ),
    TE_FUSED_ADAM: frozenset(
        ("params", "lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction")
        + ("adam_w_mode", "capturable", "master_weights", "master_weight_dtype")
        + ("exp_avg_dtype", "exp_avg_sq_dtype", "use_decoupled_grad")
        + ("store_param_remainders", "set_grad_none")
    ),
}
# Flags that must be off (falsy) for the step to be read, and dtypes that must be fp32.
_FUSED_ADAM_OFF = ("capturable", "master_weights", "use_decoupled_grad", "store_param_remainders")
_FUSED_ADAM_FP32 = ("exp_avg_dtype", "exp_avg_sq_dtype")


class FusedAdamRule(UpdateRule):
    """apex's / TE's FusedAdam in fp32 use (see ``_FUSED_ADAM_FLAGS``): one step count per
    group, its own bias-correction switch, the instance's ``adam_w_mode``, never amsgrad; the
    kernel takes lr, betas, eps and weight_decay as C floats (its bias corrections are of the
    fp32 betas: 1 − fp32(0.999) is 1.3e-5 off 0.001, enough to matter)."""

    name = "fused_adam"
    moments = ("exp_avg", "exp_avg_sq")
    hyper_parameters = ("lr", "betas", "eps", "weight_decay", "bias_correction", "step")

    def __init__(self, adam_w_mode: bool) -> None:
        self.decoupled = adam_w_mode

    def check(self, entry: Stepped) -> Optional[str]:
        for key in self.moments:
            value = entry.state.get(key)
            if value is not None and value.dtype != torch.float32:
                return (
                    f"FusedAdam keeps its {key} as {value.dtype}: step norms read fp32 moments only"
                )
        return None

    def stepped(self, entry: Stepped) -> bool:
        return super().stepped(entry) and "step" in entry.group

    def _scalars(self, entry: Stepped) -> AdamScalars:
        group = entry.group
        step = float(group["step"])
        corrected = bool(group["bias_correction"])
        lr, wd, eps = (fp32(float(group[k])) for k in ("lr", "weight_decay", "eps"))
        beta1, beta2 = (fp32(float(b)) for b in group["betas"])
        bias1 = fp32(1 - beta1**step) if corrected else 1.0
        bias2_sqrt = math.sqrt(fp32(1 - beta2**step)) if corrected else 1.0
        return decoupled_scalars(lr, wd, eps, lr / bias1, bias2_sqrt, self.decoupled, False)

    def write_updates(self, entries: Sequence[Stepped], out: Sequence[torch.Tensor]) -> list[float]:
        return adam_updates(entries, out, [self._scalars(e) for e in entries])


def unread_flags(optimizer: Any) -> Optional[str]:
    """Why a FusedAdam's constructor cannot be trusted (it takes a flag norm_optim has not read:
    a later release), else None."""
    known = _FUSED_ADAM_FLAGS[qualified_name(optimizer)]
    taken = [
        p.name
        for p in inspect.signature(type(optimizer).__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    unknown = sorted(set(taken) - known)
    return f"its constructor takes {unknown}, flags norm_optim has not read" if unknown else None


def fused_adam_rule(optimizer: Any, leaf: Any) -> Union[UpdateRule, Refused]:
    why = unread_flags(optimizer)
    if why is not None:
        return Refused(why)
    on = [flag for flag in _FUSED_ADAM_OFF if getattr(optimizer, flag, False)]
    if on:
        # (TE's master weights and decoupled grads are read in the precision-aware optimizer,
        # megatron's one use of them: .precision_aware.)
        return Refused(f"{on} on: its step is not read exactly (fp32 use only)")
    narrow = moments_not_in(optimizer, (torch.float32,))
    if narrow:
        return Refused(f"{narrow}: scaled moments, not read (fp32 moments only)")
    mode = adam_w_mode(optimizer)
    return mode if isinstance(mode, Refused) else FusedAdamRule(mode)


def moments_not_in(optimizer: Any, read: Collection[torch.dtype]) -> list[str]:
    """TE's moment-dtype flags (``exp_avg_dtype``, ``exp_avg_sq_dtype``; fp32 where absent, as
    apex's) set to a dtype outside ``read``, as ``flag=dtype``."""
    return [
        f"{flag}={getattr(optimizer, flag)}"
        for flag in _FUSED_ADAM_FP32
        if getattr(optimizer, flag, torch.float32) not in read
    ]


def adam_w_mode(optimizer: Any) -> Union[bool, Refused]:
    """A FusedAdam's ``adam_w_mode`` (0 / 1 or a bool: decoupled weight decay or L2), or why
    another value is not read."""
    mode = getattr(optimizer, "adam_w_mode", None)
    if mode not in (0, 1, False, True):
        return Refused(f"adam_w_mode={mode!r} is not 0 or 1")
    return bool(mode)
