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

from .megatron_fsdp import model_param

_WRAPPER_PREFIX = "module."
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


def expert_param_ids(chunks: Sequence[torch.nn.Module]) -> set[int]:
    """``id`` of every param that lives in an expert layer, whatever the expert-parallel size.

    megatron marks expert params ``allreduce=False`` only when EP > 1; at EP = 1 they look dense
    but are still split by the expert-TP group and replicated over expert-DP (which differ from
    TP and DP when ETP != TP). Expert layers are the modules megatron builds with
    ``is_expert=True`` and those under a ``.experts`` submodule of an MoE layer.
    """
    ids: set[int] = set()
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if getattr(module, "is_expert", False) is True or name.split(".")[-1] == "experts":
                ids.update(id(model_param(p)) for p in module.parameters())
    return ids


# Megatron's tensor-parallel layers and which of their params they split over the TP (or, in
# expert layers, the expert-TP) group. Megatron marks split params ``tensor_model_parallel=True``
# only inside its weight-initialization helpers, so with ``perform_initialization=False`` (as when
# loading a checkpoint) the weights carry no marker; the layer type still says how it splits.
_SPLIT_BY_LAYER: dict[str, tuple[str, ...]] = {
    "VocabParallelEmbedding": ("weight",),
    "ColumnParallelLinear": ("weight", "bias"),
    "RowParallelLinear": ("weight",),
    "TEColumnParallelLinear": ("weight", "bias"),
    "TELayerNormColumnParallelLinear": ("weight", "bias"),
    "TERowParallelLinear": ("weight",),
    "TEColumnParallelGroupedLinear": ("weight", "bias"),
    "TERowParallelGroupedLinear": ("weight",),
    "GroupedMLP": ("weight1", "weight2"),
}


def tensor_parallel_split_ids(chunks: Sequence[torch.nn.Module]) -> set[int]:
    """``id`` of every param that a megatron tensor-parallel layer splits across its TP group.

    Grouped layers number their params (``weight0``, ``weight1``...): a name counts when it is a
    split name followed by digits, except for ``GroupedMLP``, whose ``weight1``/``weight2`` are
    the names themselves.
    """
    ids: set[int] = set()
    for chunk in chunks:
        for module in chunk.modules():
            split = next(
                (_SPLIT_BY_LAYER[c.__name__] for c in type(module).__mro__
                 if c.__name__ in _SPLIT_BY_LAYER),
                None,
            )
            if split is None:
                continue
            for name, param in module.named_parameters(recurse=False):
                base = name if name in split else name.rstrip("0123456789")
                if base in split:
                    ids.add(id(model_param(param)))
    return ids
