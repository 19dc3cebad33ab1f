"""A CPU stand-in for Transformer Engine's ``FusedAdam`` in precision-aware mode (tests only).

Transformer Engine cannot run on these CPU machines, so the precision-aware optimizer
(``OptimizerConfig(use_precision_aware_optimizer=True)``) cannot be built with the real FusedAdam.
:class:`PrecisionAwareAdamStandIn` is a class named ``FusedAdam`` whose ``__module__`` is TE's
(``transformer_engine.pytorch.optimizers.fused_adam``), with TE's constructor flags, its state
layout and its step, written in torch from the sources (TransformerEngine commit 04912bf02451,
``transformer_engine/pytorch/optimizers/fused_adam.py`` ``FusedAdam.step``, and commit
0608bdee9158, ``transformer_engine/common/multi_tensor/adam.cu`` ``AdamFunctorMaster`` /
``AdamFunctorMasterParamRemainder``, whose math is ``adam_update``, the same as the fp32
``AdamFunctor``: ``tests/support/fused_adam_standin.py::adam_kernel``):

- one step count per param group (``group["step"]``, advanced before the kernel for a non-empty
  group; no ``state["step"]``), ``group["bias_correction"]``, the instance's ``adam_w_mode``;
- a param without a grad is skipped (its state is created anyway);
- non-fp32 moments (here bf16: TE's ``exp_avg_dtype`` / ``exp_avg_sq_dtype``) are read as fp32
  copies (``get_unscaled_state``), the kernel runs on those, and the results are stored back
  rounded to the moments' dtype after the kernel (``_apply_scale``: ``copy_(x.bfloat16())``);
  fp16 and fp8 moments (scaled) are not emulated;

- the optimizer's params are the bf16 shards of the model params (views of the model weights);
  gradients arrive in ``param.decoupled_grad`` (fp32);
- the fp32 master weights live in ``state[param]["master_param"]`` (created by the first step or
  ``initialize_state``); with ``store_param_remainders=True`` a bf16 param's master is instead the
  int16 low half of its fp32 bits, the bf16 param being the round-to-nearest high half, as TE's
  ``adam_functor_master_param_remainder`` stores it (a negative remainder means the high half was
  rounded up by one ulp);
- ``get_unscaled_state`` / ``set_scaled_state`` read and write fp32 views of that state, and
  ``state_dict`` holds those fp32 values (not the int16 remainders), as TE's does;
- the kernel steps the fp32 master (or a param that is fp32 itself), then writes the bf16 param
  rounded to nearest (with remainders: the high half of the new master, rounded).

:func:`use_precision_aware_standin` plugs it into megatron-core where TE's FusedAdam would be;
:func:`build_precision_aware_optimizer` builds megatron's precision-aware distributed optimizer on it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from tests.support.fused_adam_standin import init_te_fused_adam


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 high half rounded to nearest, int16 remainder), TE's remainder encoding."""
    bits = master.view(torch.int32)
    high = (bits >> 16).to(torch.int16)
    low = (bits & 0xFFFF).to(torch.int32)
    remainder = torch.where(low >= 0x8000, low - 0x10000, low).to(torch.int16)
    high = high + (remainder < 0).to(torch.int16)  # round up when the low half is >= half an ulp
    return high.view(torch.bfloat16), remainder


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 param, int16 remainder) -> the exact fp32 master (inverse of :func:`split_master`)."""
    high = param.view(torch.int16).to(torch.int32) - (remainder < 0).to(torch.int32)
    bits = (high << 16) | (remainder.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


class PrecisionAwareAdamStandIn(torch.optim.AdamW):
    """Stand-in for TE's ``FusedAdam`` with master weights on CPU (see the module docstring).

    Subclasses ``torch.optim.AdamW`` only so that megatron's ``DistributedOptimizer`` accepts it
    (it checks ``isinstance(optimizer, (Adam, AdamW, HybridDeviceOptimizer))``); the step is
    TE's, not AdamW's.
    """

    @functools.wraps(init_te_fused_adam)  # TE's signature, which the adapter reads
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init_te_fused_adam(self, *args, **kwargs)
        for dtype in (self.exp_avg_dtype, self.exp_avg_sq_dtype):
            if dtype not in (torch.float32, torch.bfloat16):
                raise NotImplementedError(f"the stand-in does not emulate {dtype} (scaled) moments")

    def __setstate__(self, state: dict) -> None:
        # TE's FusedAdam is a plain Optimizer: no per-param "step" for AdamW's to convert.
        torch.optim.Optimizer.__setstate__(self, state)

    def _remainders(self, param: torch.Tensor) -> bool:
        return self.store_param_remainders and param.dtype == torch.bfloat16

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        state = self.state[param]
        state["exp_avg"] = torch.zeros(param.shape, dtype=self.exp_avg_dtype)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=self.exp_avg_sq_dtype)
        if self.master_weights and param.dtype != torch.float32:
            if self._remainders(param):
                state["master_param"] = torch.zeros(param.shape, dtype=torch.int16)
            else:
                state["master_param"] = param.detach().clone().to(self.master_weight_dtype)

    def get_unscaled_state(self, param: torch.Tensor, name: str) -> torch.Tensor:
        value = self.state[param][name]
        if name == "master_param" and self._remainders(param):
            return join_master(param.detach(), value)
        return value.float()

    def set_scaled_state(self, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        if name not in self.state[param]:
            self.initialize_state(param)
        if name == "master_param" and self._remainders(param):
            high, remainder = split_master(value.float().contiguous())
            param.data.copy_(high)
            self.state[param][name].copy_(remainder)
        else:  # TE's _apply_scale for bf16: copy_(unscaled.bfloat16()); fp32: copy_
            self.state[param][name].copy_(value)

    def state_dict(self) -> dict:
        """As TE does: every state tensor unscaled to fp32 (remainders joined with the params)."""
        state_dict = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in state_dict["state"].items():
            state_dict["state"][index] = {
                name: self.get_unscaled_state(params[index], name) for name in values
            }
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """As TE does: torch's load casts state to the param dtype (bf16), so the fp32 values are
        taken from the dict and written into freshly created state tensors."""
        saved = {
            index: {k: v.detach().clone() for k, v in values.items() if torch.is_tensor(v)}
            for index, values in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, values in saved.items():
            param = params[index]
            self.state[param] = {}
            self.initialize_state(param)
            for name, value in values.items():
                if name != "step":  # an older stand-in's per-param step: TE keeps none
                    self.set_scaled_state(param, name, value)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        from tests.support.fused_adam_standin import adam_kernel

        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            for param in group["params"]:
                state = self.state[param]
                if not state:
                    self.initialize_state(param)
                grad = param.decoupled_grad if self.use_decoupled_grad else param.grad
                if grad is None:
                    continue
                has_master = "master_param" in state
                master = self.get_unscaled_state(param, "master_param") if has_master else param
                m = self.get_unscaled_state(param, "exp_avg")  # fp32 copies of bf16 moments
                v = self.get_unscaled_state(param, "exp_avg_sq")
                new_p, new_m, new_v = adam_kernel(
                    grad.detach(), master.detach(), m, v, group, self.adam_w_mode
                )
                self.set_scaled_state(param, "exp_avg", new_m)
                self.set_scaled_state(param, "exp_avg_sq", new_v)
                if has_master:
                    self.set_scaled_state(param, "master_param", new_p)
                    if not self._remainders(param):
                        param.data.copy_(new_p)  # bf16 round to nearest, as the kernel writes p
                else:
                    param.data.copy_(new_p)


# What the adapter recognises: TE's class name and module.
PrecisionAwareAdamStandIn.__name__ = PrecisionAwareAdamStandIn.__qualname__ = "FusedAdam"
PrecisionAwareAdamStandIn.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"


@contextlib.contextmanager
def use_precision_aware_standin() -> Iterator[None]:
    """Make megatron-core build :class:`PrecisionAwareAdamStandIn` where it would build TE's
    FusedAdam (for ``use_precision_aware_optimizer=True``), in this process only."""
    import megatron.core.optimizer as mo
    import megatron.core.optimizer.distrib_optimizer as do

    patches = pytest_monkeypatch()
    patches.setattr(mo, "Adam", PrecisionAwareAdamStandIn)
    if hasattr(mo, "USING_PYTORCH_OPTIMIZER"):  # since megatron-core 0.15 (0.14: Adam alone)
        patches.setattr(mo, "USING_PYTORCH_OPTIMIZER", False)
    patches.setattr(mo, "is_te_min_version", lambda *args, **kwargs: True)
    patches.setattr(do, "Adam", PrecisionAwareAdamStandIn)
    try:
        yield
    finally:
        patches.undo()


def precision_aware_config(**fields: Any) -> Any:
    """An ``OptimizerConfig`` with the precision-aware optimizer on, without importing TE.

    ``OptimizerConfig.__post_init__`` imports TE's FusedAdam to check its signature; the config is
    therefore built with the flag off and switched on afterwards, exactly as ``__post_init__``
    would have set the derived flag.
    """
    from megatron.core.optimizer import OptimizerConfig

    remainders = fields.pop("store_param_remainders", False)
    # TE's bf16 moments and megatron's bf16 main grads: OptimizerConfig accepts them only with
    # the precision-aware optimizer on.
    narrow = ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype")
    moments = {k: fields.pop(k) for k in narrow if k in fields}
    # Only the precision-aware optimizer may keep other master dtypes (TE's master_weight_dtype).
    main_params_dtype = fields.pop("main_params_dtype", torch.float32)
    config = OptimizerConfig(use_precision_aware_optimizer=False, **fields)
    config.main_params_dtype = main_params_dtype
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    config.store_param_remainders = remainders
    for key, dtype in moments.items():
        setattr(config, key, dtype)
    return config


def build_precision_aware_optimizer(
    chunks: list, *, store_param_remainders: bool = False, **fields: Any
) -> Any:
    """megatron-core's precision-aware distributed optimizer for ``chunks``, on the stand-in.

    ``fields`` override the ``OptimizerConfig`` defaults used here (adam, lr 1e-2, bf16).
    """
    from megatron.core.optimizer import get_megatron_optimizer

    config = dict(
        optimizer="adam",
        lr=1e-2,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
    )
    config.update(fields)
    with use_precision_aware_standin():
        return get_megatron_optimizer(
            precision_aware_config(store_param_remainders=store_param_remainders, **config), chunks
        )


def pytest_monkeypatch() -> Any:
    import pytest

    return pytest.MonkeyPatch()
