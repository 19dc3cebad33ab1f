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

from norm_optim.testing.values import deterministic_values, global_values, named_global_parameters

__all__ = ["fill_optimizer_state_deterministic_", "global_values", "held_mains", "state_name"]


def state_name(name: str, key: str) -> str:
    """The name whose values a state ``key`` of param ``name`` is filled with."""
    return f"{name}#{key}"


def _leaves(optimizer: Any) -> Iterator[Any]:
    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is None:
        yield optimizer
        return
    for member in inner:
        yield from _leaves(member)


def held_mains(optimizer: Any) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor, int, Any]]:
    """(model param, the fp32 tensor its optimizer steps for it on this rank, where that tensor
    starts in the flattened param, the torch optimizer) of every param this rank holds a main of,
    read from megatron's optimizer attributes (distributed: the shard groups and range map;
    Float16: the fp32-from-float16 groups; FP32 and fp32 params: the param itself)."""
    for leaf in _leaves(optimizer):
        inner = getattr(leaf, "optimizer", leaf)
        if hasattr(leaf, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            pairs = [
                *zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups),
                *zip(leaf.model_fp32_groups, leaf.shard_fp32_groups),
            ]
            for models, shards in pairs:
                for param, shard in zip(models, shards):
                    start = leaf._get_model_param_range_map(param)["param"].start
                    yield param, shard, start, inner
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


@torch.no_grad()
def fill_optimizer_state_deterministic_(
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    seed: int,
    keys: Sequence[str] = ("exp_avg", "exp_avg_sq"),
) -> None:
    """Overwrite each ``keys`` state tensor of every main this rank holds with its
    layout-independent values (``exp_avg_sq`` made non-negative). The states must exist (run a
    step first)."""
    names = {id(p): n for n, p in named_global_parameters(model_chunks)}
    for param, main, start, inner in held_mains(optimizer):
        state = inner.state.get(main)
        if state is None:
            raise ValueError("fill_optimizer_state_deterministic_: run a step first")
        name = names[id(param)]
        for key in keys:
            values = deterministic_values(state_name(name, key), param, seed).reshape(-1)
            values = values[start : start + main.numel()]
            if key == "exp_avg_sq":
                values = values.abs()
            state[key].copy_(values.view_as(state[key]))
