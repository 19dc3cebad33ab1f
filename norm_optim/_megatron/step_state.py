"""What one optimizer step did to each fp32 tensor: its grad, its update, its Adam moments.

The optimizer-specific half of :meth:`~norm_optim.NormAwareOptimizer.step_norms`, returning plain
data for the tensors the registry already holds (its records' ``tensor``):

- :func:`read_step_state` checks, before the step, that every leaf is a kind whose step it can
  read exactly, and refuses the others by name (never a number);
- :class:`StepState` maps each fp32 main (or shard) to its inner torch optimizer's param group
  and state, and gives its grad, its moments and its update;
- :func:`run_step` runs one ``step()`` and says when the grads are ready (before clipping) and
  whether the step was taken.

The update ``θ_after − θ_before`` is *derived* from what the optimizer holds after the step, so
that no copy of the weights is ever kept (the issue's memory bound): torch's Adam / AdamW and SGD
keep every term of their rule in their state and param groups. The derivation is exact math on
the stored values; the difference the step *stored* also carries the fp32 rounding of
``θ_after``, so the two differ by at most about one ulp of each weight (see docs/step-norms.md).
apex's and Transformer Engine's ``FusedAdam`` keep the same terms (the step count in the param
group), read for fp32 params and fp32 moments only; a rule or a flag this module does not know
(Muon, FusedAdam's master weights, ...) is refused by name; a
``LayerWiseDistributedOptimizer`` is read through its leaves (Adam leaves are exact).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import struct
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from .._errors import UnsupportedOptimizerError
from .._versions import megatron_core_version_string
from .fsdp_v2 import is_megatron_fsdp_v2
from .holdings import leaves
from .mimo import is_mimo

# Elements per piece of the derived update (fp32: 64 KiB): with its temporaries, the most
# the derivation allocates at once, whatever the tensor sizes.
UPDATE_PIECE = 1 << 14

_ADAM = (torch.optim.Adam, torch.optim.AdamW)

# The fused Adams read, by ``module.qualname`` (importing them needs CUDA), and the constructor
# flags each may take; a flag outside these is one norm_optim has not read (refused by name).
#
# Read at apex 25.09-52-g6424da3b (commit 6424da3b4faa) and TransformerEngine commit d0067d0da6cb
# (2026-08-22): ``apex/optimizers/fused_adam.py`` / ``transformer_engine/pytorch/optimizers/
# fused_adam.py`` ``step()`` and the fp32 functor of ``csrc/multi_tensor_adam.cu`` /
# ``transformer_engine/common/multi_tensor/adam.cu`` (``AdamFunctor``, identical in both):
#
# - the step count is ``group["step"]``, one per param group, advanced once per ``step()`` before
#   the kernel (apex: for a non-empty group; TE: for every group); there is no ``state["step"]``;
# - ``bias_correction1/2 = 1 - pow(beta, step)`` when ``group["bias_correction"]``, else 1
#   (host code of ``multi_tensor_adam_cuda``, in float);
# - ``adam_w_mode`` is the instance's (1: decoupled decay, 0: L2), ``lr``, ``betas``, ``eps``,
#   ``weight_decay`` the group's;
# - L2 (mode 0): ``g += wd·p``; ``m = b1·m + (1−b1)·g``; ``v = b2·v + (1−b2)·g²``;
#   ``p -= lr · (m/bc1) / (sqrt(v/bc2) + eps)``;
# - AdamW (mode 1): the same moments of ``g``; ``p -= lr · ((m/bc1) / (sqrt(v/bc2) + eps) + wd·p)``
#   (``p`` the value before the step), i.e. torch AdamW's ``p·(1 − lr·wd) − lr·m̂/denom``;
# - a param whose grad is None is skipped (TE creates its zero state anyway);
# - ``capturable`` (step / lr as device tensors, a found-inf no-op), ``master_weights`` (an fp32
#   copy beside the param) and TE's non-fp32 ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (scaled
#   moments), ``use_decoupled_grad`` and ``store_param_remainders`` change what is stepped or
#   stored: refused.
_FUSED_ADAM_FLAGS = (
    (
        "apex.optimizers.fused_adam.FusedAdam",
        frozenset(
            ("params", "lr", "bias_correction", "betas", "eps", "adam_w_mode", "weight_decay")
            + ("amsgrad", "set_grad_none", "capturable", "master_weights")
        ),
    ),
    (
        "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam",
        frozenset(
            ("params", "lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction")
            + ("adam_w_mode", "capturable", "master_weights", "master_weight_dtype")
            + ("exp_avg_dtype", "exp_avg_sq_dtype", "use_decoupled_grad")
            + ("store_param_remainders", "set_grad_none")
        ),
    ),
)
# Flags that must be off (falsy) for the step to be read, and dtypes that must be fp32.
_FUSED_ADAM_OFF = ("capturable", "master_weights", "use_decoupled_grad", "store_param_remainders")
_FUSED_ADAM_FP32 = ("exp_avg_dtype", "exp_avg_sq_dtype")


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One fp32 tensor the inner torch optimizer steps: its param group and its state."""

    group: dict
    optimizer: Any  # the inner torch optimizer
    param: torch.Tensor  # what it steps (a DTensor under torch FSDP2)
    kind: str  # "adam" (torch's), "fused_adam" (apex's / TE's) or "sgd"
    grad_of: Optional[torch.Tensor] = None  # whose .grad is the step's, if not param's

    @property
    def state(self) -> dict:
        """This tensor's state now (empty before its first step), DTensors as their local
        shards; never creates an entry. ``optimizer.state`` is looked up now, not kept: an
        optimizer may replace the whole mapping at every step (``HybridDeviceOptimizer`` does)."""
        return {k: _local(v) for k, v in (self.optimizer.state.get(self.param) or {}).items()}

    @property
    def grad(self) -> Optional[torch.Tensor]:
        grad = (self.param if self.grad_of is None else self.grad_of).grad
        return None if grad is None else _local(grad)


class StepState:
    """The inner optimizers' param groups and state, by the fp32 tensors they step.

    Built at an armed step (O(params)); holds references only, no copy.
    """

    def __init__(self, entries: dict[int, _Entry], has_moments: bool) -> None:
        self._entries = entries
        self.has_moments = has_moments
        """Whether the optimizer keeps Adam moments (same answer on every rank: from its
        config and kind, not from which state this rank holds)."""

    def _entry(self, tensor: torch.Tensor, name: str) -> _Entry:
        entry = self._entries.get(id(tensor))
        if entry is None:
            raise UnsupportedOptimizerError(
                f"the fp32 tensor norm_optim holds for {name!r} is not a tensor the inner "
                "optimizer steps (a padded or re-encoded shard?): its step cannot be read exactly"
            )
        return entry

    def check(self, tensor: torch.Tensor, name: str) -> None:
        """Refuse, before the step, a counted tensor whose step cannot be read."""
        entry = self._entry(tensor, name)
        if tensor.dtype != torch.float32:
            raise UnsupportedOptimizerError(
                f"{name!r} is stepped as a {tensor.dtype} tensor: step norms derive updates on "
                "fp32 tensors only (its rounding would dominate the update)"
            )
        group = entry.group
        if entry.kind == "fused_adam":
            for key in ("exp_avg", "exp_avg_sq"):
                value = entry.state.get(key)
                if value is not None and value.dtype != torch.float32:
                    raise UnsupportedOptimizerError(
                        f"{name!r}: FusedAdam keeps its {key} as {value.dtype}: step norms read "
                        "fp32 moments only"
                    )
        if entry.kind == "sgd" and group.get("nesterov", False):
            raise UnsupportedOptimizerError(
                "torch.optim.SGD with nesterov=True: its update is not derived by norm_optim"
            )

    def grad(self, tensor: torch.Tensor, name: str) -> Optional[torch.Tensor]:
        """The grad the step reads for ``tensor`` (Megatron writes it onto the fp32 main; a
        DTensor param's grad is a DTensor of the same placements: its local shard)."""
        return self._entry(tensor, name).grad

    def moments(self, tensor: torch.Tensor, name: str) -> tuple[Optional[torch.Tensor], ...]:
        """``(exp_avg, exp_avg_sq)`` of an Adam-stepped tensor (None where there is no state)."""
        entry = self._entry(tensor, name)
        if entry.kind == "sgd":
            return None, None
        return entry.state.get("exp_avg"), entry.state.get("exp_avg_sq")

    def update_pieces(self, tensor: torch.Tensor, name: str) -> Iterator[torch.Tensor]:
        """``θ_after − θ_before`` of ``tensor`` as fp32 pieces of at most ``UPDATE_PIECE``
        elements, derived from the post-step state (see the module docstring): the rule's math
        in fp32, as torch's step computes it, so each element is within an ulp of the update.
        A tensor without a grad was not stepped (torch skips it): no pieces.

        Call it right after the step, before anything else changes the tensor, its state or its
        param group's hyper-parameters (a scheduler's ``lr``).
        """
        entry = self._entry(tensor, name)
        group, state, grad = entry.group, entry.state, entry.grad
        if grad is None:
            return
        lr = float(group["lr"])
        wd = float(group.get("weight_decay", 0.0))
        flat = tensor.detach().reshape(-1)
        if entry.kind != "sgd":
            if not state:  # not stepped yet
                return
            beta1, beta2 = (float(b) for b in group["betas"])
            eps = float(group["eps"])
            corrected = True
            if entry.kind == "fused_adam":
                # FusedAdam (see _FUSED_ADAM_FLAGS): one step count per group, its own
                # bias-correction switch, the instance's adam_w_mode, never amsgrad; the kernel
                # takes lr, betas, eps and weight_decay as C floats (its bias corrections are of
                # the fp32 betas: 1 − fp32(0.999) is 1.3e-5 off 0.001, enough to matter).
                if "step" not in group:
                    return
                step = float(group["step"])
                corrected = bool(group["bias_correction"])
                decoupled = bool(entry.optimizer.adam_w_mode)
                v = state["exp_avg_sq"]
                lr, wd, beta1, beta2, eps = (_fp32(x) for x in (lr, wd, beta1, beta2, eps))
                bias1 = _fp32(1 - beta1**step) if corrected else 1.0
                bias2_sqrt = math.sqrt(_fp32(1 - beta2**step)) if corrected else 1.0
            else:
                step = float(state["step"])
                decoupled = bool(group.get("decoupled_weight_decay", False))
                v = state["max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"]
                bias1, bias2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
            step_size = lr / bias1
            m = state["exp_avg"].reshape(-1)
            v = v.reshape(-1)
            for start in range(0, flat.numel(), UPDATE_PIECE):
                end = min(start + UPDATE_PIECE, flat.numel())
                # u = step_size · m / (√v / √bc2 + eps) is what the step subtracted; with
                # decoupled decay θ_a = θ_b·(1 − lr·wd) − u, so Δ = −(u + lr·wd·θ_a) / (1 − lr·wd).
                # (L2 decay, torch.optim.Adam's or FusedAdam's mode 0, is inside the moments
                # already: Δ = −u.) Written as c·m / (√v + eps·√bc2) + c'·θ_a: four element-wise
                # ops per piece.
                keep = 1 - lr * wd if decoupled else 1.0
                scale = -step_size * bias2_sqrt / keep
                denom = v[start:end].sqrt().add_(eps * bias2_sqrt)
                if decoupled and wd:
                    delta = torch.mul(flat[start:end], -lr * wd / keep)
                    yield delta.addcdiv_(m[start:end], denom, value=scale)
                else:
                    yield torch.div(m[start:end], denom, out=denom).mul_(scale)
        else:
            # SGD without momentum keeps no state: a tensor with a grad was stepped.
            buf = state.get("momentum_buffer")
            sign = -1.0 if group.get("maximize", False) else 1.0
            for start in range(0, flat.numel(), UPDATE_PIECE):
                end = min(start + UPDATE_PIECE, flat.numel())
                if buf is not None:  # Δ = −lr · buf (decay and maximize are inside it)
                    yield buf.reshape(-1)[start:end].mul(-lr)
                else:
                    # θ_a = θ_b − lr·(±g + wd·θ_b), so Δ = −lr·(±g + wd·θ_a) / (1 − lr·wd).
                    g = grad.reshape(-1)[start:end].mul(sign)
                    yield g.add_(flat[start:end], alpha=wd).mul_(-lr / (1 - lr * wd))


def read_step_state(optimizer: Any) -> StepState:
    """The :class:`StepState` of ``optimizer``; refuses, by name, a kind whose step it cannot
    read exactly (call it before the step, on every rank: the answer does not depend on what a
    rank holds)."""
    version = megatron_core_version_string()
    _refuse_containers(optimizer, version)
    entries: dict[int, _Entry] = {}
    has_moments = False
    members = [optimizer]
    if is_mimo(optimizer):
        # A MimoOptimizer steps its active modules' optimizers through its own prepare_grads /
        # step_with_ready_grads; a rank may run none of them: its config says the kind.
        members = [
            info.optimizer
            for info in optimizer.module_infos.values()
            if info.is_active and info.optimizer is not None
        ]
        has_moments = getattr(optimizer.config, "optimizer", "adam") == "adam"
    for leaf in (leaf for member in members for leaf in leaves(member)):
        inner = (
            leaf if isinstance(leaf, torch.optim.Optimizer) else getattr(leaf, "optimizer", None)
        )
        config = getattr(leaf, "config", None)
        if inner is None:  # a stub: this rank holds nothing; the config says the kind
            has_moments |= getattr(config, "optimizer", "adam") == "adam"
            continue
        _refuse_leaf(leaf, inner, config, version)
        for held, optimizer, group, param, grad_of in _stepped(inner):
            kind = _kind(optimizer)
            has_moments |= kind != "sgd"
            entries[id(held)] = _Entry(group, optimizer, param, kind, grad_of)
    return StepState(entries, has_moments)


def _stepped(
    inner: Any,
) -> Iterator[tuple[torch.Tensor, Any, dict, torch.Tensor, Optional[torch.Tensor]]]:
    """(the tensor the registry holds, the torch optimizer that steps it, its param group, the
    tensor that optimizer steps, whose ``.grad`` is the step's grad if not that tensor's) for
    every param of ``inner``.

    Under torch FSDP2 the registry holds a DTensor's local shard (the same object as its
    ``_local_tensor``), and the grad and the state are DTensors alike. A
    ``HybridDeviceOptimizer`` (CPU offload) steps copies of its params in sub-optimizers,
    with their own param groups (e.g. ``decoupled_weight_decay``) and state: those are read.
    """
    if type(inner).__name__ == "HybridDeviceOptimizer":
        # megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py (0.14-0.20.dev)
        for sub in inner.sub_optimizers:
            for group in sub.param_groups:
                for param in group["params"]:
                    shard = inner.inner_param_to_orig_param[param]
                    # Its grad reaches the copy only inside step(), after the clipping.
                    yield shard, sub, group, param, shard
        return
    for group in inner.param_groups:
        for param in group["params"]:
            yield _local(param), inner, group, param, None


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what a C ``float`` argument holds)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _qualified(optimizer: Any) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _kind(optimizer: Any) -> str:
    """How ``update_pieces`` reads a torch optimizer ``_refuse_leaf`` accepted."""
    if type(optimizer) is torch.optim.SGD:
        return "sgd"
    if any(_qualified(optimizer) == name for name, _ in _FUSED_ADAM_FLAGS):
        return "fused_adam"
    return "adam"


def _refuse_fused_adam(inner: Any, version: str) -> bool:
    """Whether ``inner`` is apex's / TE's FusedAdam, refusing (by flag) a use of it whose step
    is not read exactly: master weights, scaled or non-fp32 moments, decoupled grads, CUDA-graph
    capture, or a constructor flag not in ``_FUSED_ADAM_FLAGS``."""
    name = _qualified(inner)
    known = next((flags for fused, flags in _FUSED_ADAM_FLAGS if fused == name), None)
    if known is None:
        return False
    taken = [
        p.name
        for p in inspect.signature(type(inner).__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    unknown = sorted(set(taken) - known)
    if unknown:
        raise _refuse(
            name, version, f"its constructor takes {unknown}, flags norm_optim has not read"
        )
    on = [flag for flag in _FUSED_ADAM_OFF if getattr(inner, flag, False)]
    if on:
        raise _refuse(name, version, f"{on} on: its step is not read exactly (fp32 use only)")
    narrow = [
        f"{flag}={getattr(inner, flag)}"
        for flag in _FUSED_ADAM_FP32
        if getattr(inner, flag, torch.float32) != torch.float32
    ]
    if narrow:
        raise _refuse(name, version, f"{narrow}: scaled moments, not read (fp32 moments only)")
    if getattr(inner, "adam_w_mode", None) not in (0, 1, False, True):
        raise _refuse(name, version, f"adam_w_mode={inner.adam_w_mode!r} is not 0 or 1")
    return True


def _refuse(what: str, version: str, why: str) -> UnsupportedOptimizerError:
    return UnsupportedOptimizerError(f"step norms of a {what} ({version}): {why}")


def _refuse_containers(optimizer: Any, version: str) -> None:
    # Megatron-FSDP v1 steps DTensors whose local shards are the registry's fp32 views of its
    # buffers, with DTensor grads: read like torch FSDP2. v2's FullyShardedOptimizer steps
    # slices of its parameter groups' flat buffers, not read yet.
    if is_megatron_fsdp_v2(optimizer):
        raise _refuse(
            "Megatron-FSDP v2 optimizer (FullyShardedOptimizer)",
            version,
            "its grads and main weights are slices of its flat buffers, not read yet",
        )
    # A LayerWiseDistributedOptimizer is read through its leaves: each steps its assigned params
    # whole, with Adam (exact) or Muon / the emerging optimizers (refused by class below).


def _refuse_leaf(leaf: Any, inner: Any, config: Any, version: str) -> None:
    inner_name = f"{type(inner).__module__}.{type(inner).__qualname__}"
    if bool(getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)):
        raise _refuse(
            "precision-aware optimizer",
            version,
            "its grads are decoupled_grad and its masters live in TE's FusedAdam state; not "
            "read yet",
        )
    if type(inner).__name__ == "HybridDeviceOptimizer":
        # CPU offload: its sub-optimizers step copies of the fp32 shards with torch's rule and
        # copy them back inside step(); its own param groups and state are the shards'.
        rules = {type(sub) for sub in getattr(inner, "sub_optimizers", [])}
        if not rules <= set(_ADAM):
            raise _refuse(
                "HybridDeviceOptimizer (CPU offload)",
                version,
                f"its sub-optimizers ({sorted(r.__name__ for r in rules)}) are not torch's Adam",
            )
        return
    if _refuse_fused_adam(inner, version):
        return
    if type(inner) not in (*_ADAM, torch.optim.SGD):
        raise _refuse(
            inner_name,
            version,
            "its update rule is not one norm_optim derives (torch.optim.Adam, AdamW, SGD, "
            "apex's and TE's FusedAdam): Muon and the emerging optimizers (orthogonalized "
            "momentum), the fused SGDs are not read yet",
        )


def _local(tensor: Any) -> Any:
    """A DTensor's local shard (the same object the registry holds); any other value as is."""
    # DTensor._local_tensor: torch/distributed/tensor/_api.py (torch 2.4-2.13)
    return getattr(tensor, "_local_tensor", tensor)


def run_step(
    optimizer: Any,
    grads_ready: Callable[[], None],
    step_taken: Callable[[], None],
    veto: Callable[[], bool],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``optimizer.step(*args, **kwargs)``, calling ``grads_ready()`` once the grads are on the
    fp32 mains, unscaled and not yet clipped, ``veto()`` right before the step is applied (True:
    it is not), and ``step_taken()`` when it is.

    Megatron clips the grads in place inside ``step()``, between ``prepare_grads()`` (copy to
    the fp32 mains, unscale, found-inf check) and the clipping; ``step_with_ready_grads()`` (the
    inner step) is never called for a skipped step (found-inf; on megatron-core main also a
    grad-norm threshold). Every megatron-core release from 0.14 to main calls both through
    ``self`` (``MegatronOptimizer.step``, ``ChainedOptimizer.step``, and the layer-wise
    optimizer, a chained one), so for this one step they are set as attributes of the optimizer
    instance, and removed after it. A plain torch optimizer has neither: its grads are ready
    before its ``step()`` (no clipping inside) and its step is never skipped by itself.

    A vetoed step is one whose ``step_with_ready_grads()`` returns False without applying
    anything, as Megatron's own skip paths do: ``step()`` returns ``(False, grad_norm,
    num_zeros)`` (the loop counts a skipped iteration, its scheduler does not advance, and it
    still logs the grad norm); the loss scaler judged the real grads inside ``prepare_grads()``
    and is not moved. ``veto()`` runs after Megatron's grad-norm clipping, which reads its norm on
    the host: a verdict computed before it is ready by then, so reading it stalls nothing. A
    plain torch optimizer's vetoed ``step()`` is not called (None is returned).
    """
    if not hasattr(optimizer, "prepare_grads"):
        grads_ready()
        if veto():
            return None
        step_taken()
        return optimizer.step(*args, **kwargs)
    original_prepare = optimizer.prepare_grads
    original_step = optimizer.step_with_ready_grads

    def prepare_grads(*a: Any, **k: Any) -> Any:
        found_inf = original_prepare(*a, **k)
        grads_ready()
        return found_inf

    def step_with_ready_grads(*a: Any, **k: Any) -> Any:
        if veto():
            return False
        step_taken()
        return original_step(*a, **k)

    with _instance_attributes(
        optimizer, prepare_grads=prepare_grads, step_with_ready_grads=step_with_ready_grads
    ):
        return optimizer.step(*args, **kwargs)


@contextlib.contextmanager
def _instance_attributes(target: Any, **values: Callable[..., Any]) -> Iterator[None]:
    """Set attributes on one instance for the ``with`` block, then remove them (or put back
    what the instance itself had): nothing of ours is left on the optimizer."""
    own = vars(target)
    saved = {name: own[name] for name in values if name in own}
    for name, value in values.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name in values:
            if name in saved:
                setattr(target, name, saved[name])
            else:
                delattr(target, name)
