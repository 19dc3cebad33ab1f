"""Where each optimizer kind keeps the fp32 tensors of the model's params.

One small reader per kind. Each yields a :class:`Holding` for every model param the optimizer is
responsible for: the fp32 tensor this rank holds for it (a full main param, this rank's shard of
it, the fp32 param itself, or a :class:`~norm_optim._kernels.RemainderMaster` when Transformer
Engine keeps the fp32 master as bf16 param + int16 remainder) or ``None`` when another rank holds
it. Readers only say *what* is held; whether this rank counts it is decided in
:mod:`norm_optim._counting.ownership`.

Kinds are recognised by the attributes megatron-core gives them (duck typing), so subclasses and
newer megatron-core releases keep working; an optimizer we cannot read is an error naming its
class, never a guess.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch

from ..._comm import Communicator
from ..._errors import UnsupportedOptimizerError
from ..._kernels import RemainderMaster, Summand
from ..._versions import megatron_core_version_string
from ..._counting.vocabulary import Source
from ..dtensor import local_holding
from ..fsdp import is_megatron_fsdp, read_megatron_fsdp
from ..fsdp_v2 import is_megatron_fsdp_v2, read_megatron_fsdp_v2
from .descriptor import (
    LeafDescriptor,
    OptimizerDescriptor,
    describe_leaf,
)
from .holdings import Holding, is_precision_aware, leaves, local, qualified_name

Reader = Callable[[Any, "_Context"], Iterator["Holding"]]


@dataclasses.dataclass(frozen=True)
class _Context:
    """What a reader inherits from the optimizers that contain it."""

    # Layer-wise distributed optimizer: each param is assigned whole to one rank of a group
    # (DP×CP for dense params, expert-DP for expert ones): the global ranks of those groups.
    dense_assignment: Optional[frozenset[int]] = None
    expert_assignment: Optional[frozenset[int]] = None
    # Global ranks of a process group, through the communication seam.
    group_ranks: Callable[[Any], frozenset[int]] = lambda group: frozenset({0})
    # The leaves described so far, in optimizer order (each leaf reader appends its own).
    described: list[LeafDescriptor] = dataclasses.field(default_factory=list)


def describe_optimizer(optimizer: Any, comm: Communicator) -> OptimizerDescriptor:
    """The :class:`~.descriptor.OptimizerDescriptor` of ``optimizer``: one record per leaf, and
    every :class:`Holding` in optimizer order, DTensors (torch FSDP2) as their local shards with
    their mesh facts (:mod:`~norm_optim._megatron.dtensor`). One optimizer over one set of process
    groups: a ``MimoOptimizer``'s modules are read one level up
    (:mod:`~norm_optim._megatron.mimo`)."""
    if is_megatron_fsdp_v2(optimizer):  # before v1: a v2 config says use_megatron_fsdp too
        # FullyShardedOptimizer steps DTensors whose local shards are the registry's fp32 views
        # of its parameter groups' main-weight buffers; prepare_grads() casts their DTensor
        # grads to fp32 in place of the originals until the step is done: read like v1.
        return OptimizerDescriptor(
            tuple(describe_leaf(leaf, "megatron-fsdp-v2") for leaf in leaves(optimizer)),
            tuple(read_megatron_fsdp_v2(optimizer, comm.group_ranks)),
            audit_refusal="Megatron-FSDP v2 (its weights live in its parameter groups' flat "
            "buffers)",
        )
    if is_megatron_fsdp(optimizer):
        # v1 steps DTensors whose local shards are the registry's fp32 views of its buffers,
        # with DTensor grads: read like torch FSDP2.
        return OptimizerDescriptor(
            tuple(describe_leaf(leaf, "megatron-fsdp") for leaf in leaves(optimizer)),
            tuple(read_megatron_fsdp(optimizer, comm.group_ranks)),
        )
    ctx = _Context(group_ranks=comm.group_ranks)
    holdings = tuple(_read(optimizer, ctx))
    return OptimizerDescriptor(tuple(ctx.described), holdings)


def read_optimizer_holdings(optimizer: Any, comm: Communicator) -> list[Holding]:
    """Every :class:`Holding` of ``optimizer`` (its descriptor's), in optimizer order."""
    return list(describe_optimizer(optimizer, comm).holdings)


def fingerprint(optimizer: Any) -> tuple:
    """A cheap (O(param groups)) summary that changes when an optimizer replaces its tensors
    (see :mod:`norm_optim._norms.staleness` for what it is for and its limit): per leaf, the leaf
    and its torch optimizer, each param group's list and length, where its first and last param (and
    their precision-aware master weights) keep their data, and how much optimizer state exists."""
    parts: list[Any] = []
    for leaf in leaves(optimizer):
        inner = (
            leaf if isinstance(leaf, torch.optim.Optimizer) else getattr(leaf, "optimizer", None)
        )
        groups = getattr(inner, "param_groups", None) or []
        state = getattr(inner, "state", None) if is_precision_aware(leaf) else None
        parts.append(
            (
                id(leaf),
                id(inner),
                tuple(_group_print(g["params"], state) for g in groups),
                len(state) if state is not None else -1,
            )
        )
    return tuple(parts)


def _group_print(params: list, state: Optional[dict]) -> tuple:
    ends = (params[0], params[-1]) if params else ()
    masters = [state.get(p, {}).get("master_param") for p in ends] if state is not None else []
    return (id(params), len(params), *map(where, ends), *map(where, masters))


def where(tensor: Optional[torch.Tensor]) -> tuple:
    """Where a tensor's data lives now: ``.data`` swaps (offload) and new tensors change it.

    A replaced storage cannot hand its address to the new one while norm_optim's plan still
    holds views of it, which it does until the rebuild this check triggers.
    """
    if tensor is None:
        return ()
    # A DTensor (torch FSDP2 params, Megatron-FSDP's main weights) has no storage of its own:
    # its local shard does.
    tensor = local(tensor)
    return (id(tensor), tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset())


def _read(optimizer: Any, ctx: _Context) -> Iterator[Holding]:
    for matches, why in _REFUSED:
        if matches(optimizer):
            raise UnsupportedOptimizerError(
                f"{qualified_name(optimizer)} ({megatron_core_version_string()}): {why}"
            )
    for matches, reader in _READERS:
        if matches(optimizer):
            try:
                if reader is _read_chained:
                    yield from reader(optimizer, ctx)
                    return
                held = [local_holding(holding) for holding in reader(optimizer, ctx)]
                kind = _KINDS[reader.__name__]
                group = getattr(optimizer, "data_parallel_group", None)
                ctx.described.append(describe_leaf(optimizer, kind, held, group))
                yield from held
            except AttributeError as error:
                # A megatron-core release that renamed what this reader relies on.
                raise UnsupportedOptimizerError(
                    f"{qualified_name(optimizer)} ({megatron_core_version_string()}) looks like a "
                    f"kind norm_optim reads ({reader.__name__}) but lacks {error.name!r}: this "
                    "megatron-core moved it; please report it with the version"
                ) from error
            return
    raise UnsupportedOptimizerError(
        f"norm_optim cannot read the fp32 tensors of a {qualified_name(optimizer)} "
        f"({megatron_core_version_string()}): supported are megatron-core's ChainedOptimizer, "
        "DistributedOptimizer (incl. precision-aware and CPU-offload), "
        "Float16OptimizerWithFloat16Params, FP32Optimizer, LayerWiseDistributedOptimizer, and "
        "plain torch.optim.Optimizer instances"
    )


# --------------------------------------------------------------------------------------------
# Readers, one per kind.
# --------------------------------------------------------------------------------------------


def _is_stub(optimizer: Any) -> bool:
    # A rank with no trainable params gets a stub optimizer that holds nothing.
    return bool(getattr(optimizer, "is_stub_optimizer", False)) or (
        getattr(optimizer, "optimizer", "missing") is None
    )


def _read_chained(optimizer: Any, ctx: _Context) -> Iterator[Holding]:
    # LayerWiseDistributedOptimizer is a ChainedOptimizer that assigns each param to one DP rank;
    # it keeps the per-rank assignment lists (None when it does not shard).
    layer_wise = hasattr(optimizer, "dp_cp_params_list")
    if layer_wise:
        groups = optimizer.pg_collection
        ctx = dataclasses.replace(
            ctx,
            dense_assignment=ctx.group_ranks(groups.dp_cp)
            if optimizer.dp_cp_params_list is not None
            else None,
            expert_assignment=ctx.group_ranks(groups.expt_dp)
            if getattr(optimizer, "expt_dp_params_list", None) is not None
            else None,
        )
    seen: set[int] = set()
    for member in optimizer.chained_optimizers:
        for holding in _read(member, ctx):
            seen.add(id(holding.param))
            yield holding
    if layer_wise:
        # Params assigned to other DP ranks: known to this optimizer, held elsewhere.
        for params in (optimizer.dp_cp_params_list or []) + (optimizer.expt_dp_params_list or []):
            for param in params:
                if id(param) not in seen:
                    seen.add(id(param))
                    yield local_holding(
                        _whole(
                            param, None, Source.ASSIGNED_ELSEWHERE, ctx, type(optimizer).__name__
                        )
                    )


def _read_distributed(optimizer: Any, ctx: _Context) -> Iterator[Holding]:
    name = type(optimizer).__name__
    # Replicas of a shard are told apart by the group the shards partition, not by the
    # optimizer's distributed_optimizer_instance_id: megatron leaves that id at 0 when the
    # parallel state has several instances but the DDP config says one.
    shard_group = ctx.group_ranks(optimizer.data_parallel_group)
    held: set[int] = set()
    pairs = [
        (
            optimizer.model_float16_groups,
            optimizer.shard_fp32_from_float16_groups,
            Source.MAIN_SHARD,
        ),
        (optimizer.model_fp32_groups, optimizer.shard_fp32_groups, Source.FP32_PARAM_SHARD),
    ]
    for model_groups, shard_groups, source in pairs:
        for model_group, shards in zip(model_groups, shard_groups):
            for param, shard in zip(model_group, shards):
                how = source
                if shard is None and is_precision_aware(optimizer):
                    shard, how = _precision_aware_master(optimizer, param)
                held.add(id(param))
                # megatron/core/optimizer/distrib_optimizer.py (0.16-0.20.dev)
                offset = optimizer._get_model_param_range_map(param)["param"].start
                yield Holding(param, shard, how, False, shard_group, name, offset)
    # Params of this optimizer's buffers with no shard on this rank.
    for buffer in getattr(optimizer, "buffers", []):
        for param in buffer.params:
            if id(param) not in held:
                held.add(id(param))
                yield Holding(param, None, Source.NO_LOCAL_SHARD, False, shard_group, name)


def _precision_aware_master(optimizer: Any, param: torch.nn.Parameter) -> tuple[Summand, Source]:
    """The fp32 master shard that a precision-aware inner optimizer keeps in its state.

    Transformer Engine's FusedAdam keeps it as ``state[shard]["master_param"]``, and so does
    ``HybridDeviceOptimizer`` (CPU offload: its fp32 copy, which its sub-optimizer steps); before
    the first step (no state yet) the master weights still equal the bf16 shard, which is then the
    exact tensor to sum. With ``store_param_remainders`` (megatron's default on TE >= 2.1) the state
    of a bf16 shard holds only the master's low 16 bits (int16), the rest being the shard itself:
    the pair is summed as the exact fp32 values it encodes, with no fp32 copy.

    Returns:
        The tensor (or remainder pair) and its source name for :class:`Holding`.
    """
    inner = optimizer.optimizer
    # TE's FusedAdam says its master dtype up front: refuse at wrap time, not after the first step.
    declared = getattr(inner, "master_weight_dtype", torch.float32)
    if declared != torch.float32:
        raise _low_precision_error(declared)
    group_index, order = optimizer.model_param_group_index_map[param]
    shard = inner.param_groups[group_index]["params"][order]
    master = inner.state.get(shard, {}).get("master_param")
    if master is None:
        return shard, Source.MASTER_PARAM_SHARD
    if master.dtype == torch.float32:
        return master, Source.MASTER_PARAM_SHARD
    remainders = getattr(inner, "store_param_remainders", False) and shard.dtype == torch.bfloat16
    if remainders and master.dtype == torch.int16:
        return RemainderMaster(shard, master), Source.MASTER_REMAINDER_SHARD
    raise _low_precision_error(master.dtype)


def _low_precision_error(dtype: torch.dtype) -> UnsupportedOptimizerError:
    return UnsupportedOptimizerError(
        f"the precision-aware optimizer keeps its master weights as {dtype} tensors; norm_optim "
        "reads fp32 master weights (or TE's int16 remainders of bf16 params): build the "
        "optimizer with OptimizerConfig(main_params_dtype=torch.float32)"
    )


def _read_float16(optimizer: Any, ctx: _Context) -> Iterator[Holding]:
    name = type(optimizer).__name__
    for model_group, main_group in zip(
        optimizer.float16_groups, optimizer.fp32_from_float16_groups
    ):
        for param, main in zip(model_group, main_group):
            yield _whole(param, main, Source.MAIN, ctx, name)
    for group in optimizer.fp32_from_fp32_groups:
        for param in group:
            yield _whole(param, param, Source.FP32_PARAM, ctx, name)


def _read_params_of(optimizer: Any, ctx: _Context) -> Iterator[Holding]:
    """FP32Optimizer and plain torch optimizers: the params are their own main params."""
    torch_optimizer = (
        optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer
    )
    name = type(optimizer).__name__
    for group in torch_optimizer.param_groups:
        for param in group["params"]:
            source = Source.FP32_PARAM if param.dtype == torch.float32 else Source.PARAM
            yield _whole(param, param, source, ctx, name)


def _whole(
    param: torch.nn.Parameter,
    tensor: Optional[torch.Tensor],
    source: Source,
    ctx: _Context,
    name: str,
) -> Holding:
    """A whole-param holding: replicated over DP, or assigned to this rank (layer-wise)."""
    # The layer-wise optimizer splits its assignment by megatron's own expert marker.
    expert = not getattr(param, "allreduce", True)
    assignment = ctx.expert_assignment if expert else ctx.dense_assignment
    return Holding(param, tensor, source, assignment is None, assignment, name)


def _read_nothing(optimizer: Any, ctx: _Context) -> Iterator[Holding]:
    return iter(())


def _is_fp32_optimizer(optimizer: Any) -> bool:
    names = {cls.__name__ for cls in type(optimizer).__mro__}
    return "FP32Optimizer" in names or isinstance(optimizer, torch.optim.Optimizer)


# Kinds recognised and refused, each with the reason: reading them as another kind would give a
# silent wrong number (a MimoOptimizer looks like a stub: optimizer is None).
_REFUSED: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (
        # MimoOptimizer: megatron/core/models/mimo/optimizer.py (0.19-0.20.dev)
        lambda o: hasattr(o, "module_infos") and hasattr(o, "_active_optimizers"),
        "a MimoOptimizer inside another optimizer: each of its modules has its own process "
        "groups, which norm_optim reads when the MimoOptimizer itself is wrapped",
    ),
)

# The descriptor's kind of each leaf reader.
_KINDS = {
    "_read_nothing": "stub",
    "_read_distributed": "distributed",
    "_read_float16": "float16",
    "_read_params_of": "fp32",
}

# Order matters: a chained optimizer may itself look like a stub; a stub holds nothing whatever
# its kind.
_READERS: tuple[tuple[Callable[[Any], bool], Reader], ...] = (
    (lambda o: hasattr(o, "chained_optimizers"), _read_chained),
    (_is_stub, _read_nothing),
    (lambda o: hasattr(o, "shard_fp32_from_float16_groups"), _read_distributed),
    (lambda o: hasattr(o, "fp32_from_float16_groups"), _read_float16),
    (_is_fp32_optimizer, _read_params_of),
)
