"""Layout-independent optimizer state for resume tests: every moment a known function of its
param's global name and each element's global index, wherever the layout keeps it.

:func:`fill_optimizer_state_deterministic_` writes ``value(seed, "<name>#<key>", index)`` (the
same values as :func:`~norm_optim.testing.oracle.fill_deterministic_` gives weights, under
another name) into the inner optimizer's state of every fp32 main (or main shard) that megatron's
optimizers hold, found from their own attributes (``main_param`` groups, the distributed
optimizer's shard ranges): so the same model state can be built on any layout, and an oracle
regenerates each global tensor on one process (:func:`global_values`). Nothing here uses
norm_optim library code.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from norm_optim._megatron import leaves
from norm_optim.testing.values import deterministic_values, global_values, named_global_parameters

__all__ = [
    "fill_optimizer_state_deterministic_",
    "global_values",
    "held_mains",
    "init_optimizer_state_",
    "state_name",
]


def state_name(name: str, key: str) -> str:
    """The name whose values a state ``key`` of param ``name`` is filled with."""
    return f"{name}#{key}"


def held_mains(optimizer: Any) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor, int, Any]]:
    """(model param, the fp32 tensor its optimizer steps for it on this rank, where that tensor
    starts in the flattened param, the torch optimizer) of every param this rank holds a main of,
    read from megatron's optimizer attributes (distributed: its param-to-group map and range map;
    Float16: the fp32-from-float16 groups; FP32 and fp32 params: the param itself)."""
    for leaf in leaves(optimizer):
        inner = getattr(leaf, "optimizer", leaf)
        if inner is None:  # a stub: nothing held here
            continue
        fsdp = _megatron_fsdp_items(leaf)
        if fsdp:  # Megatron-FSDP: DTensors whose local tensors view its main-weight shards
            for group in inner.param_groups:
                for stepped in group["params"]:
                    param = getattr(stepped, "orig_param")
                    buffer, item = fsdp[id(param)]
                    start, _ = buffer._get_item_slice_in_shard(item)
                    yield param, stepped, int(start), inner
        elif hasattr(leaf, "model_param_group_index_map"):  # DistributedOptimizer
            # The map megatron's own checkpoint load writes through: model param -> the place
            # of the tensor its torch optimizer steps (an fp32 shard; precision-aware: the bf16
            # shard, its master in the state).
            for param, (group, order) in leaf.model_param_group_index_map.items():
                main = inner.param_groups[group]["params"][order]
                start = leaf._get_model_param_range_map(param)["param"].start
                yield param, main, start, inner
        elif hasattr(leaf, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for models, mains in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                for param, main in zip(models, mains):
                    yield param, main, 0, inner
            for group in leaf.fp32_from_fp32_groups:
                for param in group:
                    yield param, param, 0, inner
        else:  # FP32Optimizer, a torch optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    yield param, param, 0, inner


def _megatron_fsdp_items(leaf: Any) -> dict[int, tuple[Any, int]]:
    """``id(param)`` -> (its bucket's main-weight buffer, its item there) for a leaf built for
    Megatron-FSDP chunks; empty otherwise."""
    items: dict[int, tuple[Any, int]] = {}
    for chunk in getattr(leaf, "model_chunks", None) or ():
        buffer = getattr(chunk, "param_and_grad_buffer", None)
        for group in getattr(buffer, "parameter_groups", None) or ():
            for item, param in enumerate(group.params):
                items[id(param)] = (group.main_weight_buffer, item)
    return items


@torch.no_grad()
def init_optimizer_state_(optimizer: Any) -> None:
    """One step of each leaf's torch optimizer over zero grads: its state exists (a step
    count of 1), whatever the layout, without a training step (which some layouts of some
    releases cannot take on CPU). Then fill the weights and the state."""
    for leaf in leaves(optimizer):
        inner = getattr(leaf, "optimizer", leaf)
        if inner is None:
            continue
        # TE's FusedAdam in precision-aware mode reads ``decoupled_grad``.
        grad = "decoupled_grad" if getattr(inner, "use_decoupled_grad", False) else "grad"
        for group in inner.param_groups:
            for param in group["params"]:
                setattr(param, grad, torch.zeros_like(param, dtype=torch.float32))
        inner.step()
        for group in inner.param_groups:
            for param in group["params"]:
                setattr(param, grad, None)


@torch.no_grad()
def fill_optimizer_state_deterministic_(
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    seed: int,
    keys: Sequence[str] = ("exp_avg", "exp_avg_sq", "momentum_buffer"),
) -> dict[tuple[str, str], torch.dtype]:
    """Overwrite each of ``keys`` that a main's state holds, for every main this rank holds,
    with its layout-independent values (``exp_avg_sq`` made non-negative). The states must
    exist (a step, or :func:`init_optimizer_state_`, first).

    Returns:
        ``(global name, key) -> dtype`` of every state tensor written (Muon keeps a momentum
        for its matrices and Adam's moments for the rest: the optimizer says which).
    """
    names = {id(p): n for n, p in named_global_parameters(model_chunks)}
    filled: dict[tuple[str, str], torch.dtype] = {}
    for param, main, start, inner in held_mains(optimizer):
        state = inner.state.get(main)
        if state is None:
            raise ValueError("fill_optimizer_state_deterministic_: run a step first")
        name = names[id(param)]
        if "master_param" in state and hasattr(inner, "set_scaled_state"):
            # TE's FusedAdam keeps the fp32 masters in its state (the precision-aware
            # optimizer): they take the weights' own values, as after a reload.
            weights = deterministic_values(name, param, seed).reshape(-1)
            inner.set_scaled_state(main, "master_param", weights[start : start + main.numel()])
        for key in keys:
            if key not in state:
                continue
            filled[(name, key)] = state[key].dtype
            values = deterministic_values(state_name(name, key), param, seed)
            if key == "exp_avg_sq":
                values = values.abs()
            target = state[key]
            if hasattr(main, "orig_param"):  # Megatron-FSDP: the flat slice its shard holds
                local = getattr(target, "_local_tensor").view(-1)
                flat = values.reshape(-1)[start : start + local.numel()]
                local.copy_(flat)
                continue
            if hasattr(target, "device_mesh"):  # torch FSDP2: this rank's part, by placements
                from torch.distributed.tensor import distribute_tensor

                mesh, placements = getattr(target, "device_mesh"), getattr(target, "placements")
                values = values.to(target.dtype).view(target.shape)
                target.copy_(distribute_tensor(values, mesh, placements, src_data_rank=None))
                continue
            values = values.reshape(-1)[start : start + main.numel()]
            target.copy_(values.view_as(target))
    return filled
