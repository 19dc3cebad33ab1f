"""CPU stand-ins for apex's and Transformer Engine's ``FusedAdam`` (tests only).

Both real optimizers need CUDA (their ``__init__`` builds a CUDA buffer and their step is a
``multi_tensor_apply`` kernel), so these CPU machines cannot build them. :class:`ApexFusedAdam`
and :class:`TEFusedAdam` are *stand-ins*: each is a class named ``FusedAdam`` whose
``__module__`` is the real one's (``apex.optimizers.fused_adam`` /
``transformer_engine.pytorch.optimizers.fused_adam``), with the real constructor's flags, its
param-group keys (``lr``, ``bias_correction``, ``betas``, ``eps``, ``weight_decay``, and
``step`` once stepped, one count per group) and its state layout (``exp_avg`` and
``exp_avg_sq`` in fp32, no ``state["step"]``). Their step is the fp32 ``AdamFunctor`` of the
kernels (apex ``csrc/multi_tensor_adam.cu``, TE ``common/multi_tensor/adam.cu``), written in
torch, in the kernel's order, with fp32 scalars:

- L2 (``adam_w_mode=False``): ``g += wd·p``; ``m = b1·m + (1−b1)·g``; ``v = b2·v + (1−b2)·g²``;
  ``p -= lr · (m/bc1) / (sqrt(v/bc2) + eps)``;
- AdamW (``adam_w_mode=True``): ``p -= lr · ((m/bc1) / (sqrt(v/bc2) + eps) + wd·p)``;
- ``bc = 1 − pow(beta, step)`` (double pow of the fp32 beta, rounded to fp32) when the group's
  ``bias_correction``, else 1.

Only the fp32 path is implemented: the flags the adapter refuses (``capturable``,
``master_weights``, TE's non-fp32 moment dtypes, ``use_decoupled_grad``,
``store_param_remainders``) are stored as the real ones store them, and ``step()`` raises on
them. :func:`use_fused_adam_standin` makes megatron-core build one where it would build the
real ``FusedAdam`` (the Float16 and distributed optimizers run on it unchanged).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import pytest
import torch


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def adam_kernel(
    g: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: dict, mode: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One element-wise step of the kernels' ``adam_update`` / ``AdamFunctor`` (and TE's
    ``AdamFunctorMaster``, whose ``p`` is the fp32 master), in fp32, in the kernel's order, for
    a group whose ``step`` was already advanced: returns the new ``(p, m, v)`` in fp32 (the
    caller stores them in its dtypes). ``g``, ``p``, ``m``, ``v`` are read as fp32 values."""
    step = group["step"]
    beta1, beta2 = (_f32(b) for b in group["betas"])
    lr, eps, decay = _f32(group["lr"]), _f32(group["eps"]), _f32(group["weight_decay"])
    one = _f32(1.0)
    if group["bias_correction"]:
        # host code: float bias_correction = 1 - std::pow(beta, step) (double pow)
        bc1 = _f32(1 - float(beta1.double() ** step))
        bc2 = _f32(1 - float(beta2.double() ** step))
    else:
        bc1 = bc2 = one
    g, p, m, v = (t.float() for t in (g, p, m, v))
    if mode == 0:  # L2
        g = g + decay * p
    m = beta1 * m + (one - beta1) * g
    v = beta2 * v + (one - beta2) * g * g
    denom = torch.sqrt(v / bc2) + eps
    update = (m / bc1) / denom
    if mode == 1:  # decoupled weight decay
        update = update + decay * p
    return p - lr * update, m, v


class _FusedAdamMath(torch.optim.Optimizer):
    """The kernel's fp32 math and the group-step bookkeeping shared by both stand-ins."""

    adam_w_mode: int
    capturable: bool
    master_weights: bool
    # TE advances the step of an empty group too; apex skips the group first.
    steps_empty_groups = False

    def _unsupported(self) -> list[str]:
        return [f for f in ("capturable", "master_weights") if getattr(self, f)]

    def _init_state(self, param: torch.Tensor) -> None:
        state = self.state[param]
        state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Optional[float]:  # type: ignore[override]
        if self._unsupported():
            raise NotImplementedError(f"the stand-in does not step with {self._unsupported()}")
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"] and not self.steps_empty_groups:
                continue
            group["step"] = group.get("step", 0) + 1
            if not group["params"]:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32:
                    raise NotImplementedError("the stand-in steps fp32 params only")
                if not self.state[p]:
                    self._init_state(p)
                state = self.state[p]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                new_p, new_m, new_v = adam_kernel(
                    p.grad.detach().float(), p.detach(), m, v, group, self.adam_w_mode
                )
                m.copy_(new_m)
                v.copy_(new_v)
                p.copy_(new_p)
        return loss


class ApexFusedAdam(_FusedAdamMath):
    """Stand-in for ``apex.optimizers.FusedAdam`` (needs CUDA): same constructor, param-group
    keys and state; its state is created when a param is first stepped, as apex does."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if master_weights and not capturable:
            raise RuntimeError(
                "Master weights is currently only supported with the capturable version."
            )
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable
        self.master_weights = master_weights


def init_te_fused_adam(
    self: Any,
    params: Any,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    bias_correction: bool = True,
    adam_w_mode: bool = True,
    capturable: bool = False,  # megatron-core >= 0.17.1 passes it (CUDA graphs); off here
    master_weights: bool = False,
    master_weight_dtype: torch.dtype = torch.float32,
    exp_avg_dtype: torch.dtype = torch.float32,
    exp_avg_sq_dtype: torch.dtype = torch.float32,
    use_decoupled_grad: bool = False,
    store_param_remainders: bool = False,
    set_grad_none: Optional[bool] = None,
) -> None:
    """TE ``FusedAdam``'s constructor: its flags, defaults and checks, and the attributes it
    stores them in. Both TE stand-ins (this module's fp32 one, the precision-aware one) take it
    whole, so that the adapter, which reads the constructor's signature, sees TE's."""
    if amsgrad:
        raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
    defaults = dict(
        lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
    )
    torch.optim.Optimizer.__init__(self, params, defaults)
    self.adam_w_mode = 1 if adam_w_mode else 0
    self.capturable = capturable
    self.master_weights = master_weights
    self.master_weight_dtype = master_weight_dtype
    self.exp_avg_dtype = exp_avg_dtype
    self.exp_avg_sq_dtype = exp_avg_sq_dtype
    self.use_decoupled_grad = use_decoupled_grad
    self.store_param_remainders = (
        store_param_remainders and master_weights and master_weight_dtype == torch.float32
    )
    self.set_grad_none = set_grad_none


class TEFusedAdam(_FusedAdamMath):
    """Stand-in for ``transformer_engine.pytorch.optimizers.FusedAdam`` (needs CUDA): same
    constructor, param-group keys and state; every param of a group gets its zero state at the
    group's step, stepped or not, as TE's ``initialize_state`` does."""

    steps_empty_groups = True
    __init__ = init_te_fused_adam

    def _unsupported(self) -> list[str]:
        flags = super()._unsupported()
        flags += [f for f in ("use_decoupled_grad", "store_param_remainders") if getattr(self, f)]
        flags += [
            f for f in ("exp_avg_dtype", "exp_avg_sq_dtype") if getattr(self, f) != torch.float32
        ]
        return flags

    @torch.no_grad()
    def step(self, closure: Any = None) -> Optional[float]:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self._init_state(p)
        return super().step(closure)


class TEFusedAdamWithNewFlag(TEFusedAdam):
    """TE's stand-in as a later release might be: one more constructor flag
    (``fused_new_flag``), whose effect on the step norm_optim cannot know."""

    def __init__(self, params: Any, lr: float = 1e-3, *, fused_new_flag: bool = False) -> None:
        super().__init__(params, lr)
        self.fused_new_flag = fused_new_flag


# The real classes' names: what the adapter recognises.
for _cls, _module in (
    (ApexFusedAdam, "apex.optimizers.fused_adam"),
    (TEFusedAdam, "transformer_engine.pytorch.optimizers.fused_adam"),
    (TEFusedAdamWithNewFlag, "transformer_engine.pytorch.optimizers.fused_adam"),
):
    _cls.__name__ = _cls.__qualname__ = "FusedAdam"
    _cls.__module__ = _module
del _cls, _module


def standin(which: str) -> type:
    """The stand-in class for ``which``: "apex" or "te"."""
    return {"apex": ApexFusedAdam, "te": TEFusedAdam}[which]


@contextlib.contextmanager
def use_fused_adam_standin(which: str) -> Iterator[type]:
    """Make megatron-core build the ``which`` ("apex" or "te") stand-in where it would build the
    real ``FusedAdam`` (as when apex or TE is installed), in this process only."""
    import megatron.core.optimizer as mo
    import megatron.core.optimizer.distrib_optimizer as do

    cls = standin(which)
    patches = pytest.MonkeyPatch()
    patches.setattr(mo, "Adam", cls)
    if hasattr(mo, "USING_PYTORCH_OPTIMIZER"):  # since megatron-core 0.15 (0.14: Adam alone)
        patches.setattr(mo, "USING_PYTORCH_OPTIMIZER", False)
    patches.setattr(do, "Adam", cls)
    try:
        yield cls
    finally:
        patches.undo()
