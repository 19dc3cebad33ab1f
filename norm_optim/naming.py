"""Layout-independent param names: the same name on every rank and in every parallel layout.

Local names differ across layouts (a pipeline stage numbers its layers from 0, an expert rank
its experts from 0, wrappers add ``module.`` prefixes). Per-parameter norms must line up across
ranks and runs, so names use the global layer number (``TransformerLayer.layer_number``, which
megatron already offsets for PP and VPP) and the global expert index
(``MoELayer.local_expert_indices``). TP and DP shards of one param share its name, so their
squares add up in the same slot.
"""

from __future__ import annotations

import re
from typing import Iterator, Sequence

import torch

from .megatron.fsdp import model_param

_NUMBERED_WEIGHT = re.compile(r"^(weight|bias)(\d+)$")


def global_param_names(chunks: Sequence[torch.nn.Module]) -> dict[int, str]:
    """Map ``id(param)`` to its layout-independent name for every param of the chunks."""
    names: dict[int, str] = {}
    for chunk in chunks:
        for name, param in _walk(chunk, prefix="", experts=None):
            names.setdefault(id(param), name)
    return names


def _walk(
    module: torch.nn.Module, prefix: str, experts: "list[int] | None"
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    experts = getattr(module, "local_expert_indices", experts)
    for pname, param in module.named_parameters(recurse=False):
        param = model_param(param)
        match = _NUMBERED_WEIGHT.match(pname)
        per_expert = hasattr(module, "num_gemms")  # TE grouped linears; not GroupedMLP's weight1/2
        if match and per_expert and experts is not None and int(match.group(2)) < len(experts):
            # Grouped-GEMM experts keep one weight<i> per local expert.
            pname = f"{match.group(1)}{experts[int(match.group(2))]}"
        yield prefix + pname, param
    for cname, child in module.named_children():
        child_name = cname
        if cname.isdigit():
            number = getattr(child, "layer_number", None)
            if isinstance(number, int) and prefix.endswith("layers."):
                child_name = str(number - 1)  # megatron numbers layers from 1, globally
            elif experts is not None and prefix.endswith("local_experts."):
                child_name = str(experts[int(cname)])
        if not prefix and cname == "module":
            # DDP / Float16Module wrappers: not part of the model's own naming.
            yield from _walk(child, "", experts)
            continue
        yield from _walk(child, f"{prefix}{child_name}.", experts)
