"""The test kit's layout-independent values: names, shapes, values and their exact norm.

The idea: make every weight a known function of its *logical* identity, so the exact norm can
be computed on one process without the model, whatever the layout that holds it.

1. :func:`named_global_parameters` names each param by its logical identity: local layer and
   expert indices become global ones; the global flat index (:func:`deterministic_values`)
   places a TP shard in the unpartitioned tensor (``partition_dim``, ``partition_stride``, the TP
   rank, or the expert-TP rank for experts). So TP duplicates, tied embeddings and replicas get
   identical values, and the values do not depend on TP/PP/VPP/EP/ETP/DP.
2. :func:`oracle_sum_of_squares` regenerates the values over the *global* shapes on one process.

Values are ``k / 2**11`` with integer ``|k| <= 127``: exact in bf16 and fp32, so fp32 main params
copied from bf16 params are exact too, and the oracle (an integer sum of ``k**2``) is exact.

A leaf: it imports no other module of the kit but the model unwrapping, so the fill modules of
each data-parallel mode (:mod:`.megatron_fsdp`, :mod:`.torch_fsdp2`, :mod:`.mimo`) build on it
and :func:`~norm_optim.testing.oracle.fill_deterministic_` dispatches to them from above.
Nothing here uses norm_optim library code.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from norm_optim.testing.models import unwrap_gpt

__all__ = [
    "deterministic_values",
    "global_values",
    "global_param_shapes",
    "global_shape",
    "named_global_parameters",
    "oracle_norm",
    "oracle_sum_of_squares",
    "original_param",
]

_SCALE_LOG2 = -11
_HASH_MOD = 2**31
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_TIED_OUTPUT = "output_layer.weight"
_WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
# What fill_deterministic_ writes into GTP pad rows (megatron keeps them zero).
_PADDING_VALUE = 1.0
# Generate the oracle in slices of this many elements, to bound its memory.
_ORACLE_SLICE = 1 << 22


def _is_expert(name: str) -> bool:
    # By the global name, not megatron's ``allreduce=False`` marker: megatron sets that only when
    # EP > 1, but expert weights are split by the expert-TP group at any EP size.
    return ".mlp.experts." in name


def _global_name(gpt: Any, name: str) -> str:
    if name == _TIED_OUTPUT and gpt.share_embeddings_and_output_weights:
        return _WORD_EMBEDDINGS  # the last stage's copy of the tied embedding
    match = _LAYER.match(name)
    if match is None:
        return name
    # ``layer_number`` is global and 1-based; ``get_global_unique_param_name`` is not used
    # because in megatron-core 0.16.1 it returns local layer numbers for all but one VPP chunk.
    layer = gpt.decoder.layers[int(match.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}.{name[match.end() :]}"
    expert = _EXPERT.search(name)
    if expert is None:
        return name
    from megatron.core import parallel_state as ps

    offset = ps.get_expert_model_parallel_rank() * layer.mlp.experts.num_local_experts
    return (
        f"{name[: expert.start()]}.mlp.experts.local_experts.{offset + int(expert.group(1))}."
        f"{name[expert.end() :]}"
    )


def original_param(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """The model param behind a Megatron-FSDP stand-in: v1's DTensors keep ``orig_param``; v2's
    sharded params are paired with it in their parameter group
    (``experimental/parameter_group.py``, ``_mfsdp_parameter_group``)."""
    original = getattr(param, "orig_param", None)
    if original is not None:
        return original
    group_ref = getattr(param, "_mfsdp_parameter_group", None)
    group = group_ref() if group_ref is not None else None
    for pair in getattr(group, "fsdp_parameters", ()):
        if pair.sharded is param:
            return pair.unsharded
    return param


def named_global_parameters(
    model_chunks: Sequence[torch.nn.Module],
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Like ``named_parameters``, but with layout-independent names.

    Names are GPTModel's, with global layer and expert indices, e.g.
    ``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight``; a tied output layer is
    named ``embedding.word_embeddings.weight``. Every rank holding a piece of the same logical
    tensor (a TP shard, a duplicate, a replica, a tied copy) yields the same name.
    """
    for chunk in model_chunks:
        gpt = unwrap_gpt(chunk)
        for name, param in gpt.named_parameters():
            # Megatron-FSDP swaps the module's params for DTensors of its main weights between
            # steps; each leads back to the original param (TP-local shape, megatron's markers).
            yield _global_name(gpt, name), original_param(param)


# Learnable attention sinks: one value per attention head, each TP rank holding its heads'
# values (megatron builds ``num_attention_heads / TP`` of them per rank and sets no
# ``tensor_model_parallel`` marker, so the oracle knows them by name).
_SINK = ".self_attention.core_attention.softmax_offset"


@dataclasses.dataclass(frozen=True)
class _Split:
    """How TP splits a param: this rank's index, the group size, the dim and its stride."""

    rank: int = 0
    size: int = 1
    dim: int = 0
    stride: int = 1


def _tp_split(name: str, param: torch.Tensor, tp_group: Any = None) -> _Split:
    from megatron.core import parallel_state as ps

    def group_split(dim: int = 0, stride: int = 1) -> _Split:
        # a module with TP groups of its own (MIMO)
        return _Split(
            torch.distributed.get_rank(tp_group),
            torch.distributed.get_world_size(tp_group),
            dim,
            stride,
        )

    if name.endswith(_SINK):
        if tp_group is not None:
            return group_split()
        return _Split(
            ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        )
    if not getattr(param, "tensor_model_parallel", False):
        return _Split()
    if tp_group is not None:
        return group_split(getattr(param, "partition_dim"), getattr(param, "partition_stride", 1))
    if _is_expert(name):
        rank, size = (
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
        )
    else:
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    return _Split(
        rank, size, getattr(param, "partition_dim"), getattr(param, "partition_stride", 1)
    )


def _gtp_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """For a GTP weight-remat shard (megatron-core >= 0.19): (its first row in the TP-local
    weight, the TP-local weight's real row count); None for other params.

    GTP pads dim 0 of the TP-local weight with ``pad_length`` rows and gives GTP rank ``r`` rows
    ``[r·s, (r+1)·s)``: the pad rows are the last ones.
    """
    if not getattr(param, "is_gtp_weight_remat", False):
        return None
    group = getattr(param, "group")
    rows = param.shape[0]
    size = torch.distributed.get_world_size(group)
    return torch.distributed.get_rank(group) * rows, rows * size - int(getattr(param, "pad_length"))


def _tp_local_shape(param: torch.Tensor) -> list[int]:
    """The param's shape before GTP sharded it (its shape, for other params)."""
    shape = list(param.shape)
    gtp = _gtp_rows(param)
    if gtp is not None:
        shape[0] = gtp[1]
    return shape


def _global_shape(name: str, param: torch.Tensor, tp_group: Any = None) -> tuple[int, ...]:
    split = _tp_split(name, param, tp_group)
    shape = _tp_local_shape(param)
    if split.size > 1:
        shape[split.dim] *= split.size
    return tuple(shape)


def _global_flat_index(
    name: str, param: torch.Tensor, tp_group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The index of each local element in the flattened global tensor (local shape, int64), and
    a mask of the local elements that are GTP padding (not part of the model).

    Megatron splits the partition dim into ``size * stride`` blocks and gives rank ``r`` blocks
    ``r, r + size, ...`` (``_initialize_affine_weight_cpu``); GTP then shards dim 0 of that.
    """
    split = _tp_split(name, param, tp_group)
    global_shape = _global_shape(name, param, tp_group)
    tp_local = _tp_local_shape(param)
    gtp = _gtp_rows(param)
    strides = torch.empty(global_shape, device="meta").stride()
    index = torch.zeros(param.shape, dtype=torch.int64)
    padding = torch.zeros(param.shape, dtype=torch.bool)
    for dim, length in enumerate(param.shape):
        coord = torch.arange(length, dtype=torch.int64)
        view = [1] * param.dim()
        view[dim] = length
        if dim == 0 and gtp is not None:
            coord = coord + gtp[0]
            padding |= (coord >= gtp[1]).view(view)
            coord = coord.clamp(max=gtp[1] - 1)
        if split.size > 1 and dim == split.dim:
            block = tp_local[dim] // split.stride
            coord = ((coord // block) * split.size + split.rank) * block + coord % block
        index += coord.view(view) * strides[dim]
    return index, padding


def _integer_values(name: str, seed: int, flat_index: torch.Tensor) -> torch.Tensor:
    """Integers in [-127, 127], a hash of (seed, name, index); int64 math that cannot overflow."""
    x = (flat_index + zlib.crc32(f"{seed}:{name}".encode())) % _HASH_MOD
    x = (x * 1103515245 + 12345) % _HASH_MOD
    x = x ^ (x >> 13)
    x = (x * 1103515245 + 12345) % _HASH_MOD
    return (x >> 8) % 255 - 127


def deterministic_values(
    name: str, param: torch.Tensor, seed: int, *, tp_group: Any = None
) -> torch.Tensor:
    """The values :func:`~norm_optim.testing.oracle.fill_deterministic_` gives this rank's ``param`` (its global ``name``):
    float64, in the param's (local) shape, exact in bf16 and fp32. ``tp_group``: the TP group
    that splits the param, where it is not megatron's global one (a MIMO module's)."""
    index, padding = _global_flat_index(name, param, tp_group)
    values = _integer_values(name, seed, index).to(torch.float64) * 2.0**_SCALE_LOG2
    # GTP pad rows are not part of the model: a value there that a norm counted would show.
    return values.masked_fill(padding, _PADDING_VALUE)


def global_values(name: str, seed: int, numel: int) -> torch.Tensor:
    """The values of the flattened global tensor of ``name`` (float64, ``numel`` elements): what
    :func:`deterministic_values` gives each rank's part of it, on one process."""
    index = torch.arange(numel, dtype=torch.int64)
    return _integer_values(name, seed, index).to(torch.float64) * 2.0**_SCALE_LOG2


def global_shape(name: str, param: torch.Tensor, *, tp_group: Any = None) -> tuple[int, ...]:
    """The unpartitioned shape of this rank's ``param`` (TP split by ``tp_group`` when given)."""
    return _global_shape(name, param, tp_group)


def global_param_shapes(
    model_chunks: Sequence[torch.nn.Module], *, trainable_only: bool = True
) -> dict[str, tuple[int, ...]]:
    """Global name -> global shape of every logical param of the model, on every rank.

    A collective over the world (``all_gather_object``); without ``torch.distributed`` it sees
    this process only. ``trainable_only`` drops params with ``requires_grad=False``.
    """
    local = {
        name: (_global_shape(name, p), p.requires_grad)
        for name, p in named_global_parameters(model_chunks)
    }
    gathered: list[Any] = [local]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, local)
    merged: dict[str, tuple[tuple[int, ...], bool]] = {}
    for rank, shapes in enumerate(gathered):
        for name, entry in shapes.items():
            if merged.setdefault(name, entry) != entry:
                raise AssertionError(
                    f"{name}: rank {rank} has (global shape, trainable) {entry}, another rank "
                    f"{merged[name]}; the global naming or shape rule is wrong for this layout"
                )
    return {
        n: shape
        for n, (shape, trainable) in sorted(merged.items())
        if trainable or not trainable_only
    }


def oracle_sum_of_squares(
    global_shapes: Mapping[str, Sequence[int]], seed: int
) -> dict[str, float]:
    """Exact sum of squares of each param filled with :func:`deterministic_values`, by name."""
    sums = {}
    for name, shape in global_shapes.items():
        numel = math.prod(shape)
        total = 0
        for start in range(0, numel, _ORACLE_SLICE):
            index = torch.arange(start, min(numel, start + _ORACLE_SLICE), dtype=torch.int64)
            total += int((_integer_values(name, seed, index) ** 2).sum())
        sums[name] = math.ldexp(total, 2 * _SCALE_LOG2)
    return sums


def oracle_norm(global_shapes: Mapping[str, Sequence[int]], seed: int) -> float:
    """Exact global L2 norm of the params in ``global_shapes`` filled with their values."""
    return math.sqrt(math.fsum(oracle_sum_of_squares(global_shapes, seed).values()))
