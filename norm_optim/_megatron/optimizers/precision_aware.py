"""Transformer Engine's ``FusedAdam`` with master weights (megatron's precision-aware optimizer):
its update derived from what its step reads, right before the step runs.

Read at TransformerEngine commit 04912bf02451 (``transformer_engine/pytorch/optimizers/
fused_adam.py``, ``FusedAdam.step``) and commit 0608bdee9158
(``transformer_engine/common/multi_tensor/adam.cu``: ``AdamFunctorMaster``,
``AdamFunctorMasterParamRemainder``, and the fp32 ``AdamFunctor`` for fp32 params, all with the
math of ``adam_update``):

- the kernel steps the fp32 master (``state[p]["master_param"]``; with
  ``store_param_remainders`` the int16 low half beside the bf16 param), or an fp32 param itself;
  it reads the grad from ``p.decoupled_grad`` (megatron's ``main_grad`` shard: fp32, or bf16
  with ``--main-grads-dtype bf16``), as fp32;
- non-fp32 moments are read as fp32 copies (``get_unscaled_state``: bf16 → ``float()``), the
  kernel works on those, and they are written back rounded (bf16) *after* the kernel: the fp32
  moments the update used are never stored, so the update cannot be derived after the step
  from the bf16 moments it leaves (they are off by up to 2⁻⁹ of each element);
- ``group["step"]`` (one per group) is advanced before the kernel; the bias corrections are
  ``1 − pow(β, step)`` in float when ``group["bias_correction"]``; ``lr``, the betas, ``eps``
  and ``weight_decay`` are C floats; ``adam_w_mode`` the instance's:
  L2 (0): ``g += wd·p``; both: ``m = β₁·m + (1−β₁)·g``, ``v = β₂·v + (1−β₂)·g²``,
  ``u = (m/bc₁) / (√(v/bc₂) + eps)``; AdamW (1): ``u += wd·p``; then ``p −= lr·u``.

So for the armed step the inner optimizer's ``step`` is wrapped (an instance attribute, removed
after): just before it runs, every tensor's ``Δ = −lr·u`` is computed from the values it is
about to read (the master, the grad after clipping, the moments in their dtype), in fp32, in
pieces of a byte budget, and its float64 sum of squares kept. The stored difference also carries
the fp32 rounding of the new master: the two differ by at most about one ulp of each weight, as
the derived updates of the other rules (docs/step-norms.md). Scaled fp16 / fp8 moments, fp16
masters and ``capturable`` are refused by the rule's builder.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import torch

from ..._kernels import RemainderMaster
from ..._kernels.chunks import default_budget
from .holdings import local, qualified_name
from ..._patching import attributes_set
from .fused_adam import TE_FUSED_ADAM, adam_w_mode, moments_not_in, unread_flags
from .update_rule import Counted, Refused, Stepped, UpdateRule


class _BeforeStep:
    """The reader of one precision-aware inner optimizer: its ``step`` is wrapped for the armed
    step (an instance attribute, removed after) and each update derived just before it runs."""

    def __init__(
        self,
        rule: "MasterAdamRule",
        optimizer: Any,
        entries: Sequence[Stepped],
        slots: Sequence[int],
    ) -> None:
        self.rule, self.optimizer = rule, optimizer
        self.entries = list(zip(entries, slots))

    @contextlib.contextmanager
    def around_step(self, out: torch.Tensor) -> Iterator[None]:
        original = self.optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            for entry, slot in self.entries:
                if entry.grad is not None and entry.state:
                    out[slot] += self.rule._derived_squares(entry).to(out.device)
            return original(*args, **kwargs)

        with attributes_set(self.optimizer, step=step):
            yield

    def after_step(self, out: torch.Tensor) -> None:
        """Nothing: derived before the step (a skipped step derives none: zero)."""


# The moments' dtypes the derivation reads as they are stored (no scale).
READ_MOMENTS = (torch.float32, torch.bfloat16)


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what a C ``float`` argument holds)."""
    return struct.unpack("f", struct.pack("f", value))[0]


class DecoupledGradStepped(Stepped):
    """A tensor whose step reads its grad from ``param.decoupled_grad`` (TE's
    ``use_decoupled_grad``: a grad of another dtype than the param)."""

    @property
    def grad(self) -> Optional[torch.Tensor]:
        grad = getattr(self.param, "decoupled_grad", None)
        return None if grad is None else local(grad)


def master_rule(optimizer: Any) -> Union[UpdateRule, Refused]:
    """The rule of a precision-aware optimizer's inner optimizer (TE's FusedAdam), or why it
    cannot be read: scaled (fp16 / fp8) moments or masters, ``capturable``, a flag not read."""
    name = qualified_name(optimizer)
    if name != TE_FUSED_ADAM:
        return Refused(f"its inner optimizer is {name}, not Transformer Engine's FusedAdam")
    why = unread_flags(optimizer)
    if why is not None:
        return Refused(why)
    if getattr(optimizer, "capturable", False):
        return Refused(
            "capturable on: the step count and lr are device tensors advanced under a found-inf "
            "no-op, not read"
        )
    master = getattr(optimizer, "master_weight_dtype", torch.float32)
    if getattr(optimizer, "master_weights", False) and master != torch.float32:
        return Refused(f"master_weight_dtype={master}: scaled masters, not read (fp32 only)")
    scaled = moments_not_in(optimizer, READ_MOMENTS)
    if scaled:
        return Refused(f"{scaled}: scaled moments, not read (fp32 and bf16 moments are)")
    mode = adam_w_mode(optimizer)
    return mode if isinstance(mode, Refused) else MasterAdamRule(mode)


def master_stepped(inner: Any, rule: UpdateRule) -> list[Stepped]:
    """Every tensor a FusedAdam with master weights steps, as the registry holds it: the fp32
    master in its state, the pair of a bf16 param and its int16 remainders, or the param itself
    (an fp32 param; or a param before the first step creates its master)."""
    kind = DecoupledGradStepped if getattr(inner, "use_decoupled_grad", False) else Stepped
    stepped: list[Stepped] = []
    for group in inner.param_groups:
        for param in group["params"]:
            master = (inner.state.get(param) or {}).get("master_param")
            held: Any = param
            if master is not None and master.dtype == torch.float32:
                held = master
            elif master is not None and master.dtype == torch.int16:
                held = RemainderMaster(param, master)
            stepped.append(kind(held, inner, param, group, rule))
    return stepped


class MasterAdamRule(UpdateRule):
    """TE's FusedAdam with master weights, decoupled grads or bf16 moments (see the module
    docstring): the update is derived just before the step, from what the step reads."""

    name = "fused_adam_master"
    moments = ("exp_avg", "exp_avg_sq")
    hyper_parameters = ("lr", "betas", "eps", "weight_decay", "bias_correction", "step")

    def __init__(self, adam_w_mode: bool) -> None:
        self.mode = 1 if adam_w_mode else 0

    def check(self, entry: Stepped) -> Optional[str]:
        for key in self.moments:
            value = entry.state.get(key)
            if value is not None and value.dtype not in READ_MOMENTS:
                return f"FusedAdam keeps its {key} as {value.dtype} (scaled): not read"
        return None

    def reader(self, optimizer: Any, counted: Counted) -> "_BeforeStep":
        return _BeforeStep(self, optimizer, counted.entries, counted.slots)

    def write_updates(self, entries: Sequence[Stepped], out: Sequence[torch.Tensor]) -> list[float]:
        raise NotImplementedError("FusedAdam's master-weight updates are derived before its step")

    def _derived_squares(self, entry: Stepped) -> torch.Tensor:
        """``Σ Δ²`` (float64, 0-dim) of the step about to run, in pieces of the byte budget."""
        group, state, held = entry.group, entry.state, entry.held
        step = int(group.get("step", 0)) + 1  # advanced by the step, before its kernel
        beta1, beta2 = (_fp32(float(b)) for b in group["betas"])
        lr, eps, wd = (_fp32(float(group[k])) for k in ("lr", "eps", "weight_decay"))
        corrected = bool(group["bias_correction"])
        bc1 = _fp32(1 - math.pow(beta1, step)) if corrected else 1.0
        bc2 = _fp32(1 - math.pow(beta2, step)) if corrected else 1.0
        keep1, keep2 = _fp32(1 - beta1), _fp32(1 - beta2)  # exact: Sterbenz
        grad = entry.grad
        assert grad is not None
        g_all, m_all, v_all = (t.reshape(-1) for t in (grad, state["exp_avg"], state["exp_avg_sq"]))
        device = g_all.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        n = held.numel()
        piece = max(default_budget(device) // 4, 1)
        decoded = torch.empty(min(piece, n), dtype=torch.float32, device=device)
        for start in range(0, n, piece):
            end = min(start + piece, n)
            if isinstance(held, RemainderMaster):
                p = held.flat_slice(start, end).decode_into(decoded[: end - start])
            else:
                p = held.reshape(-1)[start:end].float()
            g = g_all[start:end].float()
            if self.mode == 0:  # L2: g += wd·p (out of place: g may view the grad)
                g = torch.add(g, p, alpha=wd)
            m = torch.mul(m_all[start:end].float(), beta1).add_(torch.mul(g, keep1))
            v = torch.mul(v_all[start:end].float(), beta2).add_(torch.mul(g, keep2).mul_(g))
            u = m.div_(bc1).div_(v.div_(bc2).sqrt_().add_(eps))
            if self.mode == 1:
                u.add_(torch.mul(p, wd))
            total += torch.linalg.vector_norm(u.mul_(lr), dtype=torch.float64).square()
        return total
