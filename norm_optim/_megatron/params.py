"""What a model param *is*, as far as counting goes: expert, TP-split, GTP-sharded, tied.

Whether TP splits a param is taken from the model's own checkpoint declarations
(:mod:`.declarations`: what ``sharded_state_dict`` says every rank saves), which cover every
param megatron saves, learnable attention sinks included. Megatron's markers
(``tensor_model_parallel``, set by hand in a few layers, and only when megatron initializes the
weights before 0.18.2) plus a table of layer classes are the fallback for a param with no
declaration, and a cross-check: where they disagree with the declaration, the declaration wins
and the traits say so. The other traits come from markers (``allreduce=False`` for experts,
``is_gtp_weight_remat`` for GTP shards, ``shared`` for tied copies) and, where megatron leaves
them out (experts are marked only at EP > 1 before 0.19), from the module structure. The
counting rule (:mod:`norm_optim._counting.ownership`) reads only the :class:`ParamTraits` built
here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from .._comm import Communicator
from .._kernels import Summand
from .._kernels.remainders import flat_slice
from .._counting.vocabulary import SplitFrom
from .declarations import Declaration, Declarations, read_declarations
from .fsdp import model_param


@dataclasses.dataclass(frozen=True)
class ModelStructure:
    """What the model's modules say about its params (by ``id``), beyond megatron's markers."""

    experts: frozenset[int] = frozenset()
    tp_split: frozenset[int] = frozenset()
    unused_tied_outputs: frozenset[int] = frozenset()
    declarations: Declarations = Declarations()
    # The (expert-)TP sizes the model was built for: a marker/declaration mismatch at size 1
    # is no disagreement (nothing to split).
    tp_size: int = 1
    expert_tp_size: int = 1

    @classmethod
    def of(cls, chunks: Optional[Sequence[torch.nn.Module]]) -> "ModelStructure":
        if chunks is None:
            return cls()
        tp_size, expert_tp_size = _tp_sizes(chunks)
        return cls(
            frozenset(expert_param_ids(chunks)),
            frozenset(tensor_parallel_split_ids(chunks)),
            frozenset(unused_tied_output_ids(chunks)),
            read_declarations(chunks),
            tp_size,
            expert_tp_size,
        )


@dataclasses.dataclass(frozen=True)
class ParamTraits:
    """The facts about one model param that decide which rank counts which of its elements.

    Attributes:
        expert: lives in an expert layer (split by expert-TP, replicated over expert-DP).
        tp_split: the (expert-)TP group splits it; if not, TP ranks > 0 hold duplicates.
        gtp_sharded: the (expert) GTP weight-remat group shards it on dim 0 (megatron-core
            >= 0.19); if not, GTP ranks > 0 hold copies.
        padding: trailing elements of this rank's local param that are GTP alignment padding
            (zero rows that are not part of the model).
        gtp_peers: global ranks of the GTP group that shards it (empty if none).
        tied_copy: a copy of a tied weight held elsewhere too (megatron's ``shared``), or an
            output weight that tied embeddings leave unused.
        split_from: where ``tp_split`` comes from: the model's checkpoint declaration, or
            megatron's marker and the layer table (no declaration, or not a megatron model).
        note: why the markers were used for a megatron model's param, or how they disagree
            with its declaration (the declaration wins); None when all agree.
    """

    expert: bool
    tp_split: bool
    gtp_sharded: bool = False
    padding: int = 0
    gtp_peers: frozenset[int] = frozenset()
    tied_copy: bool = False
    split_from: SplitFrom = SplitFrom.MARKER
    note: Optional[str] = None


def param_traits(param: torch.Tensor, structure: ModelStructure, comm: Communicator) -> ParamTraits:
    """The :class:`ParamTraits` of a model param, from its declaration, megatron's markers and
    the structure."""
    expert = not getattr(param, "allreduce", True) or id(param) in structure.experts
    split_from, tp_split, note = _tp_split(param, expert, structure)
    tied_copy = bool(getattr(param, "shared", False)) or id(param) in structure.unused_tied_outputs
    traits = ParamTraits(expert, tp_split, tied_copy=tied_copy, split_from=split_from, note=note)
    if not getattr(param, "is_gtp_weight_remat", False):
        return traits
    group = getattr(param, "group", None)
    peers = comm.group_ranks(group) if group is not None else frozenset()
    return dataclasses.replace(
        traits, gtp_sharded=True, padding=_gtp_padding(param, comm), gtp_peers=peers
    )


def marked_tp_split(param: torch.Tensor, structure: ModelStructure) -> bool:
    """What megatron's ``tensor_model_parallel`` marker, or else the layer table, says."""
    marked = getattr(param, "tensor_model_parallel", None)
    return bool(id(param) in structure.tp_split if marked is None else marked)


def _tp_split(
    param: torch.Tensor, expert: bool, structure: ModelStructure
) -> tuple[SplitFrom, bool, Optional[str]]:
    """(where it comes from, whether TP splits the param, a note) -- the declaration wins."""
    marked = marked_tp_split(param, structure)
    declarations = structure.declarations
    declared: Optional[Declaration] = declarations.by_param.get(id(param))
    if declared is None:
        if declarations.unavailable is not None:
            return SplitFrom.MARKER, marked, f"declarations {declarations.unavailable}"
        note = "no sharding declaration" if declarations.read else None
        return SplitFrom.MARKER, marked, note
    size = structure.expert_tp_size if expert else structure.tp_size
    if size == 1 or declared.split == marked:
        # GTP (megatron-core >= 0.19) folds its dim-0 shards into the same fragments where its
        # checkpoint helper is active (with Transformer Engine); it shards only TP-split
        # weights, so at TP > 1 "split" still means split by TP.
        return SplitFrom.DECLARATION, declared.split, None
    flag = getattr(param, "tensor_model_parallel", None)
    source = (
        ("layer table" if marked else "no marker, not in the layer table")
        if flag is None
        else f"tensor_model_parallel={flag}"
    )
    return (
        SplitFrom.DECLARATION,
        declared.split,
        (
            f"{declared.describe()} as {declared.key!r}, but the markers say "
            f"{'TP-split' if marked else 'replicated'} ({source}): the declaration counts"
        ),
    )


def _tp_sizes(chunks: Sequence[torch.nn.Module]) -> tuple[int, int]:
    """The TP and expert-TP sizes in the model's config (1, 1 when it has none)."""
    config = next(
        (
            getattr(m, "config", None)
            for c in chunks
            for m in c.modules()
            if hasattr(getattr(m, "config", None), "tensor_model_parallel_size")
        ),
        None,
    )
    # megatron/core/transformer/transformer_config.py (0.14-0.19): ETP None means TP.
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    expert_tp = getattr(config, "expert_tensor_parallel_size", None)
    return tp, int(expert_tp or tp)


def _gtp_padding(param: Any, comm: Communicator) -> int:
    """Elements of this rank's GTP shard that are pad rows.

    GTP pads dim 0 of the (TP-local) weight to an alignment, appending ``pad_length`` zero rows,
    then gives GTP rank ``r`` rows ``[r·s, (r+1)·s)``; the pad rows are the last ones, on the last
    rank (or the last few ranks when the pad is longer than a shard).
    """
    pad_rows = int(getattr(param, "pad_length", 0) or 0)
    group = getattr(param, "group", None)
    if pad_rows == 0 or group is None or param.dim() == 0 or param.shape[0] == 0:
        return 0
    rows = param.shape[0]
    real_rows = rows * comm.size(group) - pad_rows
    local_real = min(max(real_rows - comm.rank(group) * rows, 0), rows)
    return (rows - local_real) * (param.numel() // rows)


def without_padding(tensor: Summand, offset: int, param: torch.Tensor, padding: int) -> Summand:
    """The part of ``tensor`` (elements ``[offset, offset + n)`` of the flat local param) that is
    not GTP padding: a view, never a copy."""
    if padding == 0:
        return tensor
    keep = min(max(param.numel() - padding - offset, 0), tensor.numel())
    return tensor if keep == tensor.numel() else flat_slice(tensor, 0, keep)


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
    "GroupedMLP": ("weight1", "weight2"),  # megatron-core <= 0.16
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
                (
                    _SPLIT_BY_LAYER[c.__name__]
                    for c in type(module).__mro__
                    if c.__name__ in _SPLIT_BY_LAYER
                ),
                None,
            )
            if split is None:
                continue
            for name, param in module.named_parameters(recurse=False):
                base = name if name in split else name.rstrip("0123456789")
                if base in split:
                    ids.add(id(model_param(param)))
    return ids


def unused_tied_output_ids(chunks: Sequence[torch.nn.Module]) -> set[int]:
    """``id`` of output-layer weights that tied embeddings leave unused.

    With tied embeddings the output layer multiplies by ``shared_embedding_or_output_weight()``.
    On a last pipeline stage that also runs multi-token prediction, megatron (>= 0.17.1) keeps a
    copy of the word embeddings there (marked ``shared``) and returns *it*, while the output
    layer still allocates a weight of its own that nothing reads: not a weight of the model.
    """
    ids: set[int] = set()
    for chunk in chunks:
        for module in chunk.modules():
            if not getattr(module, "share_embeddings_and_output_weights", False):
                continue
            output = getattr(getattr(module, "output_layer", None), "weight", None)
            tied = getattr(module, "shared_embedding_or_output_weight", None)
            if isinstance(output, torch.nn.Parameter) and callable(tied) and tied() is not output:
                ids.add(id(model_param(output)))
    return ids
