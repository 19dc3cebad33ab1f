"""The update rules step norms derive, one small class per rule, found by the optimizer's class.

A rule answers, for the tensors one torch optimizer steps: was this tensor stepped, what are its
moments (or momentum), and what did the step change (``θ_after − θ_before``), derived from what
the optimizer holds *after* the step so that no copy of the weights is ever kept. Each rule
works on a list of tensors at once with ``torch._foreach_*`` operations (one kernel per list on
an accelerator), writing into the views it is given: the caller sizes the lists by bytes
(:mod:`norm_optim._step`).

:data:`RULES` maps an optimizer class (by its qualified name) to a builder; a builder returns an :class:`UpdateRule`, or a :class:`Refused`
with the exact reason the step of that use cannot be derived. A new optimizer is one new rule
class and one entry in :data:`RULES`.

The derivations are exact math on the stored values; the difference the step *stored* also
carries the fp32 rounding of ``θ_after``, so the two differ by at most about one ulp of each
weight (docs/step-norms.md).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import inspect
import math
import struct
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Hashable, Optional, TypeVar, Union

import torch

from .._errors import NormOptimError
from .holdings import local, qualified_name
from .in_step import StepReader, StoredDifferences, step_name
from .orthogonalized import MOMENTUM, InStepUpdates, unread_step
from .._patching import attributes_set


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


def _by_key(
    entries: Sequence[Stepped], key: Callable[[Stepped], _Key]
) -> list[tuple[_Key, list[int]]]:
    """Indices of ``entries`` grouped by ``key`` (one list operation per distinct key)."""
    groups: dict[_Key, list[int]] = defaultdict(list)
    for i, entry in enumerate(entries):
        groups[key(entry)].append(i)
    return list(groups.items())


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what a C ``float`` argument holds)."""
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclasses.dataclass(frozen=True)
class _AdamScalars:
    """The scalars of one Adam update: ``Δ = scale · m / (√v + eps') + decay · θ_after``."""

    scale: float
    eps: float  # eps · √bc2 (the denominator's shift, with √bc2 moved into ``scale``)
    decay: float  # 0 for L2 decay (inside the moments already) or none
    amsgrad: bool


class AdamRule(UpdateRule):
    """torch's Adam / AdamW: every term of the rule is in the state and the param group.

    ``decoupled`` is None to read the group's ``decoupled_weight_decay`` (torch.optim.Adam), True
    for ``torch.optim.AdamW``: on torch < 2.6 ``AdamW`` is its own class and its groups have no
    such key, so it is recognised by its class (an AdamW is always decoupled).
    """

    name = "adam"
    moments = ("exp_avg", "exp_avg_sq")
    hyper_parameters = ("lr", "betas", "eps", "weight_decay", "amsgrad", "decoupled_weight_decay")
    reads_stored = True

    def __init__(self, decoupled: Optional[bool] = None) -> None:
        self.decoupled = decoupled

    # ``maximize`` needs no term here: it negates the grad before the weight decay and the
    # moments, and the update is then -step_size · m̂ / denom (+ the decoupled decay) from the
    # stored moments, as without it. Read in torch 2.13 and 2.14.1 ``optim/adam.py``:
    # ``_single_tensor_adam`` ``grad = grads[i] if not maximize else -grads[i]``,
    # ``_multi_tensor_adam`` ``torch._foreach_neg(device_grads)``, both before the decay and
    # the moments and nowhere after; ``_fused_adam`` hands the flag to its kernel (C++, not
    # read: its steps are read in-step, derived only as the fallback). ``AdamW`` of torch < 2.6,
    # its own class, runs the same loop with the decay decoupled (torch 2.5.1 not read here:
    # the torch-floor tests run it).

    def _scalars(self, entry: Stepped) -> _AdamScalars:
        group, state = entry.group, entry.state
        lr, wd, eps = float(group["lr"]), float(group.get("weight_decay", 0.0)), float(group["eps"])
        beta1, beta2 = (float(b) for b in group["betas"])
        decoupled = (
            self.decoupled
            if self.decoupled is not None
            else bool(group.get("decoupled_weight_decay", False))
        )
        step = float(state["step"])
        bias1, bias2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
        return _decoupled_scalars(
            lr, wd, eps, lr / bias1, bias2_sqrt, decoupled, bool(group.get("amsgrad", False))
        )

    def write_updates(self, entries: Sequence[Stepped], out: Sequence[torch.Tensor]) -> list[float]:
        return _adam_updates(entries, out, [self._scalars(e) for e in entries])


def _decoupled_scalars(
    lr: float,
    wd: float,
    eps: float,
    step_size: float,
    bias2_sqrt: float,
    decoupled: bool,
    amsgrad: bool,
) -> _AdamScalars:
    # u = step_size · m / (√v / √bc2 + eps) is what the step subtracted; with decoupled decay
    # θ_a = θ_b·(1 − lr·wd) − u, so Δ = −(u + lr·wd·θ_a) / (1 − lr·wd). (L2 decay is inside
    # the moments already: Δ = −u.) Written as scale · (m / (√v + eps·√bc2)) + decay · θ_a.
    keep = 1 - lr * wd if decoupled else 1.0
    scale = -step_size * bias2_sqrt / keep
    decay = -lr * wd / keep if decoupled else 0.0
    return _AdamScalars(scale, eps * bias2_sqrt, decay, amsgrad)


def _adam_updates(
    entries: Sequence[Stepped], out: Sequence[torch.Tensor], scalars: Sequence[_AdamScalars]
) -> list[float]:
    """``out[i] = m / (√v + eps') + (decay / scale) · θ_a`` with list operations, one set per
    distinct (eps', decay / scale, amsgrad); the factor is ``scale``."""
    keys = [(s.eps, s.decay / s.scale, s.amsgrad) for s in scalars]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        groups[key].append(i)
    factors = [s.scale for s in scalars]
    for (eps, decay, amsgrad), index in groups.items():
        states = [entries[i].state for i in index]
        o = [out[i] for i in index]
        v = [s["max_exp_avg_sq" if amsgrad else "exp_avg_sq"] for s in states]
        m = [s["exp_avg"] for s in states]
        p = [entries[i].held for i in index]
        if o[0].device.type == "cpu":
            # No kernel launches to save on CPU, but passes over memory: out= ops take three
            # (the list operations, in place only, six: a copy first, 1/x then a product).
            # With decay, θ_a + (1 / decay') · m / denom is written, and its factor is
            # scale · decay'.
            for oi, vi, mi, pi in zip(o, v, m, p):
                torch.sqrt(vi, out=oi)
                oi.add_(eps)
                if decay:
                    torch.addcdiv(pi, mi, oi, value=1 / decay, out=oi)
                else:
                    torch.div(mi, oi, out=oi)
            if decay:
                for i in index:
                    factors[i] *= decay
            continue
        torch._foreach_copy_(o, v)
        torch._foreach_sqrt_(o)
        torch._foreach_add_(o, eps)
        torch._foreach_reciprocal_(o)
        torch._foreach_mul_(o, m)
        if decay:
            torch._foreach_add_(o, p, alpha=decay)
    return factors


class SGDRule(UpdateRule):
    """torch's SGD: with momentum or none, Nesterov, ``maximize``, weight decay.

    Read in torch 2.13 and 2.14.1 ``optim/sgd.py`` (``_single_tensor_sgd``,
    ``_multi_tensor_sgd``, ``_fused_sgd``): ``d = ±g + wd·θ_b``; with momentum
    ``buf = μ·buf + (1 − dampening)·d`` (``buf = d`` at its first step), then ``d = buf``, or
    ``d = d + μ·buf`` with Nesterov; ``θ_a = θ_b − lr·d``. The buffer stored is the one after
    the step, so dampening and the first step need no term of their own.
    """

    name = "sgd"
    moments = ()
    hyper_parameters = (
        "lr",
        "momentum",
        "weight_decay",
        "maximize",
        "nesterov",
        "foreach",
        "fused",
    )
    reads_stored = True

    def stepped(self, entry: Stepped) -> bool:
        # SGD without momentum keeps no state: a tensor with a grad was stepped.
        return entry.grad is not None

    def write_updates(self, entries: Sequence[Stepped], out: Sequence[torch.Tensor]) -> list[float]:
        factors = [0.0] * len(entries)
        left_in_grads: dict[int, bool] = {}  # by param group (one look at its params each)

        def form(entry: Stepped) -> _SGDForm:
            group = entry.group
            if "momentum_buffer" not in entry.state:
                return _SGDForm("terms", group.get("maximize", False), _weight_decay(group))
            if not group.get("nesterov", False):
                return _SGDForm("buffer")
            if id(group) not in left_in_grads:
                left_in_grads[id(group)] = _nesterov_left_in_grads(group)
            if left_in_grads[id(group)]:
                return _SGDForm("grad")
            return _SGDForm(
                "terms",
                group.get("maximize", False),
                _weight_decay(group),
                float(group["momentum"]),
            )

        for f, index in _by_key(entries, form):
            o = [out[i] for i in index]
            lrs = [float(entries[i].group["lr"]) for i in index]
            if f.source == "buffer":  # Δ = −lr · buf (decay and maximize are inside it)
                torch._foreach_copy_(o, [entries[i].state["momentum_buffer"] for i in index])
                for i, lr in zip(index, lrs):
                    factors[i] = -lr
                continue
            grads = [g for g in (entries[i].grad for i in index) if g is not None]
            assert len(grads) == len(o), "stepped() is only true for a tensor with a grad"
            torch._foreach_copy_(o, grads)
            if f.source == "grad":  # Δ = −lr · d, the d the step left in the grad
                for i, lr in zip(index, lrs):
                    factors[i] = -lr
                continue
            # θ_a = θ_b − lr·(±g [+ μ·buf] + wd·θ_b), buf the one stored after the step, so
            # Δ = −lr·(±g [+ μ·buf] + wd·θ_a) / (1 − lr·wd).
            if f.maximize:
                torch._foreach_neg_(o)
            if f.momentum:
                bufs = [entries[i].state["momentum_buffer"] for i in index]
                torch._foreach_add_(o, bufs, alpha=f.momentum)
            if f.weight_decay:
                held = [entries[i].held for i in index]
                torch._foreach_add_(o, held, alpha=f.weight_decay)
            for i, lr in zip(index, lrs):
                factors[i] = -lr / (1 - lr * f.weight_decay)
        return factors


@dataclasses.dataclass(frozen=True)
class _SGDForm:
    """How an SGD update is written, per distinct form (one set of list operations each):
    ``−lr · momentum_buffer`` ("buffer"), ``−lr · grad`` where the step left its Nesterov
    direction in the grad ("grad"), else ``−lr·(±g + μ·buf + wd·θ_a) / (1 − lr·wd)``
    ("terms": ``momentum`` is μ with Nesterov, 0 without a buffer)."""

    source: str
    maximize: bool = False
    weight_decay: float = 0.0
    momentum: float = 0.0


def _weight_decay(group: dict) -> float:
    return float(group.get("weight_decay", 0))


def _nesterov_left_in_grads(group: dict) -> bool:
    """Whether torch's SGD step left its Nesterov direction ``d = g + μ·buf`` in the grads of
    ``group``'s params (then ``Δ = −lr · grad``), rather than leaving them as they were.

    Read in torch 2.13 and 2.14.1 ``optim/sgd.py``: ``_multi_tensor_sgd`` adds ``μ·buf`` to
    its grads in place (``torch._foreach_add_(device_grads, bufs, alpha=momentum)``), and they
    are the params' own ``.grad`` unless ``maximize`` (``_foreach_neg``) or weight decay
    (``_foreach_add``) made new tensors of them first; the single-tensor path makes new tensors
    (``grad.add``), and the fused one leaves the grads on CPU (its kernel is C++, not read; the
    test checks each path on the torch it runs). The path is the one
    ``sgd()`` takes: the group's ``foreach`` / ``fused``, or where both are None, torch's own
    default over the params with a grad (the same call, ``differentiable=False``). On CPU that
    default is the single-tensor path; the foreach one is tested with ``foreach=True``.
    """
    if group.get("maximize", False) or group.get("weight_decay", 0):
        return False
    foreach, fused = group.get("foreach"), group.get("fused")
    if foreach is None and fused is None:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        params = [p for p in group["params"] if p.grad is not None]
        fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return bool(foreach)


# apex's and Transformer Engine's FusedAdam, by ``module.qualname`` (importing them needs CUDA),
# and the constructor flags each may take; a flag outside these is one norm_optim has not read.
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
# - ``capturable`` (step / lr as device tensors, a found-inf no-op): refused; TE's
#   ``master_weights`` (an fp32 copy beside the param), ``use_decoupled_grad``,
#   ``store_param_remainders`` and bf16 ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` change what is
#   stepped or stored: refused here; in megatron's precision-aware optimizer, the one use of
#   them megatron builds, derived before the step by :mod:`.precision_aware`.
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

    def _scalars(self, entry: Stepped) -> _AdamScalars:
        group = entry.group
        step = float(group["step"])
        corrected = bool(group["bias_correction"])
        lr, wd, eps = (_fp32(float(group[k])) for k in ("lr", "weight_decay", "eps"))
        beta1, beta2 = (_fp32(float(b)) for b in group["betas"])
        bias1 = _fp32(1 - beta1**step) if corrected else 1.0
        bias2_sqrt = math.sqrt(_fp32(1 - beta2**step)) if corrected else 1.0
        return _decoupled_scalars(lr, wd, eps, lr / bias1, bias2_sqrt, self.decoupled, False)

    def write_updates(self, entries: Sequence[Stepped], out: Sequence[torch.Tensor]) -> list[float]:
        return _adam_updates(entries, out, [self._scalars(e) for e in entries])


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


def _fused_adam(optimizer: Any, leaf: Any) -> Union[UpdateRule, Refused]:
    why = unread_flags(optimizer)
    if why is not None:
        return Refused(why)
    on = [flag for flag in _FUSED_ADAM_OFF if getattr(optimizer, flag, False)]
    if on:
        # (TE's master weights and decoupled grads are read in the precision-aware optimizer,
        # megatron's one use of them: .precision_aware.)
        return Refused(f"{on} on: its step is not read exactly (fp32 use only)")
    narrow = [
        f"{flag}={getattr(optimizer, flag)}"
        for flag in _FUSED_ADAM_FP32
        if getattr(optimizer, flag, torch.float32) != torch.float32
    ]
    if narrow:
        return Refused(f"{narrow}: scaled moments, not read (fp32 moments only)")
    mode = getattr(optimizer, "adam_w_mode", None)
    if mode not in (0, 1, False, True):
        return Refused(f"adam_w_mode={mode!r} is not 0 or 1")
    return FusedAdamRule(bool(mode))


RULES: tuple[tuple[str, RuleBuilder], ...] = (
    ("torch.optim.adamw.AdamW", _adamw),
    ("torch.optim.adam.Adam", _adam),
    ("torch.optim.sgd.SGD", _sgd),
    (APEX_FUSED_ADAM, _fused_adam),
    (TE_FUSED_ADAM, _fused_adam),
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
