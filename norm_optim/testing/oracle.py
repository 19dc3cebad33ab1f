"""A layout-independent oracle for global weight norms: fill a model, know its exact norm.

1. :func:`fill_deterministic_` overwrites each element of each param with
   ``value(seed, global name, global flat index)`` (:mod:`norm_optim.testing.values`), wherever
   the layout keeps it: the params themselves, Megatron-FSDP's buffers, torch FSDP2's local
   shards. It dispatches to those layouts' fill modules, which it sits above.
2. :func:`oracle_sum_of_squares` / :func:`oracle_norm` regenerate the values over the *global*
   shapes on one process (:func:`global_param_shapes`).

After :func:`fill_deterministic_`, pass the optimizer (or call its ``reload_model_params()``)
so the fp32 main params pick up the new values. Nothing here uses norm_optim library code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from norm_optim.testing.megatron_fsdp import (
    fill_fsdp_deterministic_,
    fill_fsdp_v2_deterministic_,
    fsdp_v2_parameter_groups,
)
from norm_optim.testing.torch_fsdp2 import fill_dtensor_deterministic_
from norm_optim.testing.values import (
    deterministic_values,
    global_param_shapes,
    global_shape,
    named_global_parameters,
    oracle_norm,
    oracle_sum_of_squares,
)

__all__ = [
    "deterministic_values",
    "fill_deterministic_",
    "global_param_shapes",
    "global_shape",
    "named_global_parameters",
    "oracle_norm",
    "oracle_sum_of_squares",
]


@torch.no_grad()
def fill_deterministic_(
    model_chunks: Sequence[torch.nn.Module], seed: int, optimizer: Any = None
) -> None:
    """Overwrite every model param in place with its layout-independent deterministic values.

    Args:
        model_chunks: this rank's model chunks (as from ``build_model``).
        seed: selects the values; :func:`oracle_sum_of_squares` with the same seed agrees.
        optimizer: if given, its ``reload_model_params()`` is called so fp32 main params (whole
            or sharded) are refreshed from the new model values; otherwise call it yourself.
            Megatron-FSDP chunks get their values written into their weight buffers, fp32 main
            weights included (:func:`~norm_optim.testing.megatron_fsdp.fill_fsdp_deterministic_`);
            torch FSDP2 (DTensor) params into their local shards
            (:func:`~norm_optim.testing.torch_fsdp2.fill_dtensor_deterministic_`).
    """
    if fsdp_v2_parameter_groups(model_chunks):
        fill_fsdp_v2_deterministic_(model_chunks, seed)
        return
    if any(
        hasattr(getattr(c, "param_and_grad_buffer", None), "parameter_groups") for c in model_chunks
    ):
        # Megatron-FSDP: its params' data are not the weights; write into its buffers.
        fill_fsdp_deterministic_(model_chunks, seed)
        return
    if any(hasattr(p, "device_mesh") for c in model_chunks for p in c.parameters()):
        # torch FSDP2: each rank writes its own part of every DTensor.
        fill_dtensor_deterministic_(model_chunks, seed, optimizer)
        return
    for name, param in named_global_parameters(model_chunks):
        param.copy_(deterministic_values(name, param, seed))
    if optimizer is not None:
        optimizer.reload_model_params()
