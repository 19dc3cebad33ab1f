"""Fault injection: break one copy on one rank, to see :meth:`NormAwareOptimizer.audit` catch it.

Test your own layout: train a step, ``inject_fault_`` on one rank, call ``audit()`` on every
rank and check that every rank's report names the param, the kind and the rank::

    inject_fault_(optimizer, "decoder.final_layernorm.weight", rank=1)        # a TP duplicate
    report = optimizer.audit()
    assert any(f.param == "decoder.final_layernorm.weight" and 1 in f.ranks
               for f in report.findings)

Nothing here is a collective: ranks other than ``rank`` do nothing.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

__all__ = ["inject_fault_"]

What = Literal["weight", "main"]
How = Literal["nudge", "sign", "swap"]


@torch.no_grad()
def inject_fault_(
    target: Any,
    param_name: str,
    *,
    what: What = "weight",
    how: How = "nudge",
    rank: int = 0,
    index: int = 0,
) -> bool:
    """Change one element of one copy of a param, on global rank ``rank`` only.

    Args:
        target: a :class:`~norm_optim.NormAwareOptimizer` (the param is found in its registry)
            or the model (a module or list of chunks; ``what="weight"`` only).
        param_name: the param's local name (``registry[...]`` keys) or its layout-independent
            name.
        what: ``"weight"``: the model weight this rank holds (a DP replica, a TP duplicate...;
            under Megatron-FSDP its shard in the model-weight buffer, a DTensor's local shard);
            ``"main"``: the fp32 main param, or main shard, this rank holds for it.
        how: ``"nudge"``: the element's next representable value (its lowest bit); ``"sign"``:
            its sign flipped (non-zero values change); ``"swap"``: elements ``index`` and
            ``index + 1`` exchanged (they must differ to change anything).
        rank: the global rank whose copy changes.
        index: the element, in the flattened tensor this rank holds (a DTensor's local shard).

    Returns:
        True on the rank that changed its copy, False elsewhere.

    Raises:
        KeyError: no such param; ValueError: this rank holds no main of it, or ``index`` is out
        of range.
    """
    if _global_rank() != rank:
        return False
    tensor = _target_tensor(target, param_name, what)
    # A DTensor (torch FSDP2): this rank's local shard; a view of the DTensor itself would
    # redistribute it, a collective on this rank alone.
    # DTensor._local_tensor: torch/distributed/tensor/_api.py (torch 2.4-2.13)
    tensor = getattr(tensor, "_local_tensor", tensor)
    flat = tensor.view(-1)
    last = index + 1 if how == "swap" else index
    if not (index >= 0 and last < flat.numel()):
        raise ValueError(f"index {last} is outside the {flat.numel()} elements of {param_name!r}")
    if how == "swap":
        pair = flat[index : index + 2].clone()
        flat[index], flat[index + 1] = pair[1], pair[0]
    elif how == "sign":
        flat[index] = -flat[index]
    elif how == "nudge":
        bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[flat.element_size()])
        bits[index] ^= 1
    else:
        raise ValueError(f"how must be 'nudge', 'sign' or 'swap', got {how!r}")
    return True


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _target_tensor(target: Any, name: str, what: What) -> torch.Tensor:
    registry = getattr(target, "registry", None)
    if registry is not None:
        record = registry[name]
        if what == "weight":
            from norm_optim._megatron.fsdp import is_megatron_fsdp, weight_shards

            inner = getattr(target, "wrapped_optimizer", None)
            if inner is not None and is_megatron_fsdp(inner):
                # Megatron-FSDP: this rank's shard in the model-weight buffer (the param's
                # own data is the unsharded buffer, released between gathers).
                return weight_shards(inner)[id(record.param)]
            return record.param.data
        if not isinstance(record.tensor, torch.Tensor) or record.tensor.numel() == 0:
            raise ValueError(f"this rank holds no fp32 main of {name!r} ({record.source})")
        return record.tensor.data
    if what == "main":
        raise ValueError("what='main' needs the NormAwareOptimizer (its registry knows the mains)")
    chunks = [target] if isinstance(target, torch.nn.Module) else list(target)
    for chunk in chunks:
        for local, param in chunk.named_parameters():
            if name in (local, local.removeprefix("module.").removeprefix("module.")):
                return param.data
    raise KeyError(f"no param named {name!r} in the model")
