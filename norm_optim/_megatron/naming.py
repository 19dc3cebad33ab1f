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
from typing import Any, Iterator, Sequence

import torch

from .fsdp import model_param

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


# A global name's layer: ``<stack>.layers.<global layer>.`` (the first such part of the name).
_LAYER_PART = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# An indexed expert inside a layer: SequentialMLP's ``local_experts.<e>.`` (renamed to the global
# expert above), or a TE grouped linear's ``weight<e>`` / ``bias<e>`` (renamed likewise).
_EXPERT_PART = re.compile(
    r"\.experts\.(?:local_experts\.(\d+)\.|linear_fc\d\.(?:weight|bias)(\d+)$)"
)


def layer_of(name: str) -> "str | None":
    """The global layer a layout-independent param name belongs to, or None (embeddings,
    final norms, output layer).

    The decoder's layers are named by their number (``decoder.layers.3.mlp...`` -> ``"3"``);
    another stack's keep its path (``mtp.layers.0...`` -> ``"mtp.0"``,
    ``vision_model.decoder.layers.1...`` -> ``"vision_model.decoder.1"``), so that two stacks'
    layers never share a key.
    """
    match = _LAYER_PART.search(name)
    if match is None:
        return None
    stack = name[: match.start()]
    return match.group(1) if stack == "decoder" else f"{stack}.{match.group(1)}"


def expert_of(name: str) -> "str | None":
    """The global expert a layout-independent param name belongs to, as ``<layer>.<expert>``
    (expert 5 of layer 3: ``"3.5"``; experts of different layers are different weights), or
    None: not an expert param, or a grouped weight that holds every local expert at once
    (megatron's legacy ``GroupedMLP``)."""
    layer = layer_of(name)
    match = _EXPERT_PART.search(name)
    if layer is None or match is None:
        return None
    return f"{layer}.{match.group(1) or match.group(2)}"


def natural_key(key: str) -> list[Any]:
    """Sort key for layer / expert keys and names: ``"10"`` after ``"9"``, ``"3.12"`` after
    ``"3.2"``, ``decoder.layers.10.`` after ``decoder.layers.9.``."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[./]", key)]
