"""The update rules of torch's ``Adam`` / ``AdamW`` (:class:`AdamRule`) and ``SGD``
(:class:`SGDRule`), derived from what the optimizer holds after the step."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Optional

import torch


from .update_rule import Stepped, UpdateRule, by_key


@dataclasses.dataclass(frozen=True)
class AdamScalars:
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
    # the moments and nowhere after; ``fused_adam_rule`` hands the flag to its kernel (C++, not
    # read: its steps are read in-step, derived only as the fallback). ``AdamW`` of torch < 2.6,
    # its own class, runs the same loop with the decay decoupled (torch 2.5.1 not read here:
    # the torch-floor tests run it).

    def _scalars(self, entry: Stepped) -> AdamScalars:
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
        return decoupled_scalars(
            lr, wd, eps, lr / bias1, bias2_sqrt, decoupled, bool(group.get("amsgrad", False))
        )

    def write_updates(self, entries: Sequence[Stepped], out: Sequence[torch.Tensor]) -> list[float]:
        return adam_updates(entries, out, [self._scalars(e) for e in entries])


def decoupled_scalars(
    lr: float,
    wd: float,
    eps: float,
    step_size: float,
    bias2_sqrt: float,
    decoupled: bool,
    amsgrad: bool,
) -> AdamScalars:
    # u = step_size · m / (√v / √bc2 + eps) is what the step subtracted; with decoupled decay
    # θ_a = θ_b·(1 − lr·wd) − u, so Δ = −(u + lr·wd·θ_a) / (1 − lr·wd). (L2 decay is inside
    # the moments already: Δ = −u.) Written as scale · (m / (√v + eps·√bc2)) + decay · θ_a.
    keep = 1 - lr * wd if decoupled else 1.0
    scale = -step_size * bias2_sqrt / keep
    decay = -lr * wd / keep if decoupled else 0.0
    return AdamScalars(scale, eps * bias2_sqrt, decay, amsgrad)


def adam_updates(
    entries: Sequence[Stepped], out: Sequence[torch.Tensor], scalars: Sequence[AdamScalars]
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

        for f, index in by_key(entries, form):
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
