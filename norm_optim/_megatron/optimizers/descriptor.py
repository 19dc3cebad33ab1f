"""One descriptor per leaf optimizer: every question about it answered once, when the registry
is built.

A :class:`LeafDescriptor` says what a leaf is (its kind), what it holds for each model param
(its :class:`~norm_optim._megatron.optimizers.holdings.Holding` list: mains, shards or nothing),
where the grads of its step are, its update rule with the hyper-parameters it reads (or the exact
reason no exact rule exists), its moments and their dtype, and the group its copies are spread over.
An :class:`OptimizerDescriptor` gathers the leaves of one wrapped optimizer with what is true of
the whole (a layout whose step or copies cannot be read). Holdings, step norms and the audit
read these records; none of them classifies an optimizer again. The readers that build them are
in :mod:`.kinds` (one per kind); the rules in :mod:`.rules` (one per optimizer class).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

import torch

from ..._comm import ProcessGroup
from ..._errors import UnsupportedOptimizerError
from ..._versions import megatron_core_version_string
from ..._kernels import RemainderMaster
from .holdings import Holding, is_precision_aware, local, qualified_name
from .precision_aware import master_rule, master_stepped
from .rules import rule_for
from .update_rule import Refused, Stepped, UpdateRule

# megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py (0.14-0.20.dev)
HYBRID_DEVICE_OPTIMIZER = "HybridDeviceOptimizer"


@dataclasses.dataclass(frozen=True)
class LeafDescriptor:
    """What one leaf optimizer is, holds and does at a step.

    Attributes:
        leaf: the megatron optimizer (or plain torch optimizer) this describes.
        kind: how it is read: ``"distributed"``, ``"float16"``, ``"fp32"``, ``"stub"``,
            ``"megatron-fsdp"``...
        inner: the torch optimizer that steps its tensors (None: a stub, nothing held).
        holdings: what it holds for each model param (empty where the layout's reader reads
            the whole optimizer at once: Megatron-FSDP).
        holds: ``"mains"``, ``"shards"``, ``"params"`` (fp32 params, their own mains) or
            ``"nothing"``.
        grads: where the step's grads are (for messages and docs).
        rule: how its step is derived; None with ``refusal`` (or for a stub).
        refusal: the exact reason its step cannot be read (None when it can).
        moments: the state keys of its moments (or momentum), as the rule reports them.
        moment_dtype: their dtype as the optimizer declares it (fp32 unless it says otherwise).
        stepped: every tensor its torch optimizer(s) step, as the registry holds it.
        copy_group: the group its shards partition (distributed optimizer), else None.
        has_moments: whether the optimizer keeps moments, from its config where this rank holds
            nothing (the same answer on every rank).
        has_momentum: whether it keeps a momentum buffer step norms report (Muon's), likewise.
    """

    leaf: Any
    kind: str
    inner: Any
    holdings: tuple[Holding, ...]
    holds: str
    grads: str
    rule: Optional[UpdateRule]
    refusal: Optional[str]
    moments: tuple[str, ...]
    moment_dtype: Optional[torch.dtype]
    stepped: tuple[Stepped, ...]
    copy_group: ProcessGroup
    has_moments: bool
    has_momentum: bool = False


@dataclasses.dataclass(frozen=True)
class OptimizerDescriptor:
    """The leaves of one wrapped optimizer and what holds for the whole.

    Attributes:
        leaves: one :class:`LeafDescriptor` per leaf, in optimizer order.
        holdings: every :class:`Holding`, in optimizer order (the registry's input).
        step_refusal: why no step of this layout can be read (None: look at the leaves).
        audit_refusal: why the audit cannot compare this layout's copies (None: it can).
    """

    leaves: tuple[LeafDescriptor, ...]
    holdings: tuple[Holding, ...]
    step_refusal: Optional[str] = None
    audit_refusal: Optional[str] = None
    _by_tensor: Mapping[int, Stepped] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        by_tensor = {
            id(s.held.param if isinstance(s.held, RemainderMaster) else s.held): s
            for leaf in self.leaves
            for s in leaf.stepped
        }
        object.__setattr__(self, "_by_tensor", by_tensor)

    @property
    def has_moments(self) -> bool:
        """Whether the step keeps moments (the same on every rank)."""
        return any(leaf.has_moments for leaf in self.leaves)

    @property
    def has_momentum(self) -> bool:
        """Whether the step keeps a momentum buffer it reports (Muon's; the same on every rank)."""
        return any(leaf.has_momentum for leaf in self.leaves)

    def stepped(self, tensor: Any) -> Optional[Stepped]:
        """The :class:`Stepped` of a tensor the registry holds (None: no optimizer steps it)."""
        # A remainder-encoded master is a pair made anew by each reader: its param names it.
        key = tensor.param if isinstance(tensor, RemainderMaster) else tensor
        return self._by_tensor.get(id(key))

    def refuse_step(self) -> None:
        """Raise :class:`~norm_optim.UnsupportedOptimizerError` for a layout or a leaf whose
        step cannot be read exactly (on every rank alike: from kinds and configs)."""
        if self.step_refusal is not None:
            raise UnsupportedOptimizerError(self.step_refusal)
        for leaf in self.leaves:
            if leaf.refusal is not None:
                raise UnsupportedOptimizerError(leaf.refusal)


def separate_clip_groups() -> tuple[str, ...]:
    """The param groups megatron-core clips on their own, beside the main group whose grad norm
    ``step()`` returns (0.19: ``("mtp",)``, multi-token prediction with ``mtp_detach_heads``);
    none before."""
    try:
        # megatron/core/optimizer/optimizer.py (0.19-0.20.dev)
        from megatron.core.optimizer.optimizer import SEPARATE_GRAD_NORM_GROUPS
    except ImportError:
        return ()
    return tuple(SEPARATE_GRAD_NORM_GROUPS)


def clip_group_of(param: Any) -> Optional[str]:
    """The separately clipped group a model param is tagged with (None: the main group)."""
    # megatron/core/optimizer/optimizer.py GRAD_NORM_GROUP_ATTR (0.19-0.20.dev)
    return getattr(param, "grad_norm_group", None)


def step_refusal(what: str, why: str) -> str:
    """The message of a refused step: the kind, the megatron-core version, the reason."""
    return f"step norms of a {what} ({megatron_core_version_string()}): {why}"


def describe_leaf(
    leaf: Any,
    kind: str,
    holdings: Sequence[Holding] = (),
    copy_group: ProcessGroup = None,
) -> LeafDescriptor:
    """The :class:`LeafDescriptor` of one leaf: its torch optimizer(s), rule and moments."""
    inner = leaf if isinstance(leaf, torch.optim.Optimizer) else getattr(leaf, "optimizer", None)
    config = getattr(leaf, "config", None)
    holds = _holds(holdings, inner)
    common = dict(leaf=leaf, kind=kind, inner=inner, holdings=tuple(holdings), holds=holds)
    common.update(copy_group=copy_group)
    if inner is None:  # a stub: this rank holds nothing; the config says the kind
        configured = getattr(config, "optimizer", "adam")
        # Muon's config (megatron-core >= 0.19; "dist_muon" its legacy name) also steps Adam
        # (its scalar optimizer) for the params that are not matrices.
        muon = "muon" in configured
        adam = configured == "adam" or (
            muon and getattr(config, "muon_scalar_optimizer", "adam") == "adam"
        )
        return LeafDescriptor(
            **common,
            grads="none on this rank",
            rule=None,
            refusal=None,
            moments=("exp_avg", "exp_avg_sq") if adam else (),
            moment_dtype=torch.float32 if adam else None,
            stepped=(),
            has_moments=adam,
            has_momentum=muon,
        )
    rule, refusal, stepped, grads = _rule_and_stepped(leaf, inner, config)
    moments = rule.moments if rule is not None else ()
    return LeafDescriptor(
        **common,
        grads=grads,
        rule=rule,
        refusal=refusal,
        moments=moments,
        moment_dtype=_moment_dtype(inner) if moments else None,
        stepped=tuple(stepped),
        has_moments=bool(moments),
        has_momentum=rule is not None and rule.momentum is not None,
    )


def _holds(holdings: Sequence[Holding], inner: Any) -> str:
    if inner is None or not any(h.tensor is not None for h in holdings):
        return "nothing" if inner is None or holdings else "params"
    shards = any(h.shard_group is not None for h in holdings)
    mains = any(h.tensor is not h.param for h in holdings if h.tensor is not None)
    return "shards" if shards else "mains" if mains else "params"


def _moment_dtype(inner: Any) -> torch.dtype:
    # TE's FusedAdam declares its moments' dtype; torch's optimizers keep the param's (fp32).
    return getattr(inner, "exp_avg_dtype", torch.float32)


def _rule_and_stepped(
    leaf: Any, inner: Any, config: Any
) -> tuple[Optional[UpdateRule], Optional[str], list[Stepped], str]:
    """(rule, refusal, stepped tensors, where the grads are) of a leaf with a torch optimizer."""
    if is_precision_aware(leaf):
        # TE's FusedAdam keeps the masters in its state and reads decoupled grads: its rule
        # (.precision_aware) says how; the masters are what the registry holds.
        where = "decoupled_grad (the main_grad shard, fp32 or bf16)"
        if type(inner).__name__ == HYBRID_DEVICE_OPTIMIZER:
            why = "CPU offload of its masters is not read yet"
            return None, step_refusal("precision-aware optimizer", why), [], where
        rule = master_rule(inner)
        if isinstance(rule, Refused):
            what = f"precision-aware optimizer ({qualified_name(inner)})"
            return None, step_refusal(what, rule.reason), [], where
        return rule, None, master_stepped(inner, rule), where
    if type(inner).__name__ == HYBRID_DEVICE_OPTIMIZER:
        # CPU offload: its sub-optimizers step copies of the fp32 shards with their own rule,
        # param groups (e.g. decoupled_weight_decay) and state, and copy them back inside
        # step(); the grads reach the copies only inside step(), after the clipping: the
        # shards' own .grad is the step's.
        stepped: list[Stepped] = []
        rules: dict[str, UpdateRule] = {}
        for sub in inner.sub_optimizers:
            rule = rule_for(sub, leaf)
            if isinstance(rule, Refused):
                what = f"{HYBRID_DEVICE_OPTIMIZER} (CPU offload)"
                why = f"its sub-optimizer {qualified_name(sub)}: {rule.reason}"
                return None, step_refusal(what, why), [], "fp32 shard .grad"
            rules[rule.name] = rule
            for group in sub.param_groups:
                for param in group["params"]:
                    shard = inner.inner_param_to_orig_param[param]
                    stepped.append(Stepped(shard, sub, param, group, rule, grad_of=shard))
        first = next(iter(rules.values()), None)
        return first, None, stepped, "fp32 shard .grad (copied to the sub-optimizers' params)"
    rule = rule_for(inner, leaf)
    if isinstance(rule, Refused):
        return None, step_refusal(qualified_name(inner), rule.reason), [], "fp32 main .grad"
    stepped = [
        Stepped(local(param), inner, param, group, rule)
        for group in inner.param_groups
        for param in group["params"]
    ]
    return rule, None, stepped, "fp32 main .grad (a DTensor's local shard under FSDP)"


def all_stepped(leaves: Sequence[LeafDescriptor]) -> Iterator[Stepped]:
    """Every stepped tensor of the leaves, in order."""
    for leaf in leaves:
        yield from leaf.stepped
