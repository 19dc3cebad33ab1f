"""How a megatron model declares each of its params split and replicated: its checkpoint's view.

Megatron's distributed checkpointing saves every element of every param exactly once, so each
module's ``sharded_state_dict()`` states, per param, a ``ShardedTensor``: the global shape, this
rank's offset and the number of fragments along every axis, and a ``replica_id`` (components:
0 the pipeline / tied-copy replica, 1 the TP (and GTP) replica, 2 the DP replica; all zero on
the rank that saves it). That is the same fact the counting rule needs, stated by the code that
must get it right for checkpoints to restore, not by a marker set by hand in some layers: a
learnable attention sink (``DotProductAttention.softmax_offset``) has no
``tensor_model_parallel`` marker but is declared split on dim 0 over TP.

The declarations are built the way megatron's checkpoint save builds them (``megatron.training
.checkpointing.generate_state_dict``: each chunk's ``sharded_state_dict(metadata={'dp_cp_group':
...})``), once per registry build. Building them runs no collective (megatron's model-side
``sharded_state_dict`` only reads group ranks and sizes; the test suite checks this on every
model the test kit builds), so a rank may read them whatever the others do.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import torch

from .._versions import megatron_at_least
from .fsdp import model_param


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One param's ``ShardedTensor`` as this rank declares it, without megatron's types.

    Attributes:
        key: the checkpoint key (layer-stacked: no layer index).
        global_shape: the shape of the whole tensor, on the param's own axes (the axes megatron
            prepends for the layer and expert index dropped).
        fragments: how many parts the whole tensor is cut into along each of those axes.
        offset: where this rank's part starts along each of those axes.
        replica_id: megatron's replica id (see the module docstring).
        parts_saved: for a param a factory saves as several tensors (the SwiGLU
            ``linear_fc1`` halves), each part's declaration, in the order they cut the param
            along dim 0; empty for a param saved as one tensor.
    """

    key: str
    global_shape: tuple[int, ...]
    fragments: tuple[int, ...]
    offset: tuple[int, ...]
    replica_id: tuple[int, ...]
    parts_saved: tuple["Declaration", ...] = ()

    @property
    def parts(self) -> int:
        """Into how many parts the param's own axes cut it across the ranks that hold it."""
        return math.prod(self.fragments)

    @property
    def split(self) -> bool:
        """Whether ranks of the param's (expert-)TP group (or GTP group) hold different parts."""
        return self.parts > 1

    def describe(self) -> str:
        """A few words for a registry note: ``split on dim 0 in 2 parts`` / ``replicated``."""
        axes = [str(d) for d, n in enumerate(self.fragments) if n > 1]
        if not axes:
            return "declared replicated across TP"
        return f"declared split on dim {','.join(axes)} in {self.parts} parts"


@dataclasses.dataclass(frozen=True)
class Declarations:
    """What the model's checkpoint declarations say, by param ``id``.

    Attributes:
        by_param: the declaration of every param that has one.
        read: whether the model is a megatron model whose declarations were read; False for
            models without ``sharded_state_dict`` (plain torch), where the markers are the rule.
        unavailable: why a megatron model's declarations could not be read (None if read or
            not a megatron model): the registry shows it on every record.
        caveat: how they were read when megatron's own top-level step failed (None if it
            did not): the registry's summary shows it.
    """

    by_param: Mapping[int, Declaration] = dataclasses.field(default_factory=dict)
    read: bool = False
    unavailable: Optional[str] = None
    caveat: Optional[str] = None


def read_declarations(chunks: Sequence[torch.nn.Module], dp_cp_group: Any = None) -> Declarations:
    """Every param's :class:`Declaration` from the chunks' ``sharded_state_dict``.

    Args:
        chunks: the model chunks (megatron DDP / Float16Module wrappers are fine: they pass
            ``sharded_state_dict`` on to the model).
        dp_cp_group: the DP×CP group megatron puts in the metadata (only the DP component of
            ``replica_id`` depends on it); default: the parallel state's, as megatron does.
    """
    if not chunks or not all(callable(getattr(c, "sharded_state_dict", None)) for c in chunks):
        return Declarations()
    fsdp = any(_is_megatron_fsdp(c) for c in chunks)
    if fsdp and not megatron_at_least(0, 19):
        # megatron/core/utils.py (0.16.1) make_sharded_tensor_for_checkpoint takes every
        # DTensor for a torch FSDP2 shard: it adds a DP axis and may all-gather it.
        return Declarations(
            read=False,
            unavailable=(
                "not read for Megatron-FSDP before megatron-core 0.19 (its sharded_state_dict "
                "treats the DTensor params as torch FSDP2 shards and may gather them)"
            ),
        )
    if not fsdp and any(type(p).__name__ == "DTensor" for c in chunks for p in c.parameters()):
        # torch FSDP2: the DTensor placements state the sharding; that is its own rule.
        return Declarations()
    metadata = {"dp_cp_group": dp_cp_group if dp_cp_group is not None else _dp_cp_group()}
    caveats: list[str] = []
    try:
        # Megatron-FSDP's own sharded_state_dict describes its DTensor buffers (no TP
        # fragments); the model inside it declares the TP split as under DDP, with the
        # DTensor stand-ins as data (model_param maps them back).
        states = [
            _chunk_state(_innermost(chunk) if fsdp else chunk, metadata, caveats)
            for chunk in chunks
        ]
    except Exception as error:  # noqa: BLE001 -- any failure means: count by the markers
        return Declarations(read=False, unavailable=f"sharded_state_dict failed: {error!r}")
    by_param: dict[int, Declaration] = {}
    for state in states:
        for data, declaration in _param_declarations(state):
            by_param.setdefault(id(model_param(data)), declaration)
    return Declarations(by_param, read=True, caveat="; ".join(caveats) or None)


def _chunk_state(chunk: torch.nn.Module, metadata: dict, caveats: list[str]) -> Any:
    """The chunk's sharded state dict as a checkpoint save builds it; where megatron's own
    top-level step raises, what its modules declare (megatron's generic ``MegatronModule``
    implementation on the model: the same per-param declarations, without the language
    model's renaming of tied copies)."""
    build: Any = getattr(chunk, "sharded_state_dict")  # a megatron module's method
    try:
        return build(metadata=metadata)
    except Exception as error:  # noqa: BLE001 -- retried below, and said in the registry
        # Seen on 0.19.2: an MTP stage at PP > 1 with tied embeddings asserts that its
        # output layer has no weight, while the local spec's output layer allocates one.
        from megatron.core.transformer.module import MegatronModule

        model = _innermost(chunk)
        if not isinstance(model, MegatronModule):
            raise
        caveats.append(
            f"read module by module ({type(model).__name__}.sharded_state_dict "
            f"raised {type(error).__name__})"
        )
        # megatron/core/transformer/module.py (0.14-0.19) MegatronModule.sharded_state_dict
        return MegatronModule.sharded_state_dict(model, "", (), metadata)


def _innermost(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside megatron's wrappers (DDP, Megatron-FSDP, Float16Module: ``.module``)."""
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = getattr(chunk, "module")
    return chunk


def _dp_cp_group() -> Any:
    # megatron/training/checkpointing.py (0.16-0.19) generate_state_dict: the default metadata.
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_data_parallel_group(with_context_parallel=True)


def _is_megatron_fsdp(chunk: torch.nn.Module) -> bool:
    # megatron/core/distributed/fsdp (0.16-0.19): its buffer has parameter_groups.
    return hasattr(getattr(chunk, "param_and_grad_buffer", None), "parameter_groups")


def _param_declarations(state: Any) -> Any:
    """(tensor the entry saves, its :class:`Declaration`) for each ShardedTensor in a (nested)
    sharded state dict; a ShardedTensorFactory (e.g. the SwiGLU ``linear_fc1`` halves) is built
    and its parts merged into one declaration of the param it saves; ShardedObjects
    (``_extra_state``) and non-tensor entries are not params."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in _nested_values(state):
        if isinstance(value, ShardedTensor):
            yield value.data, _declaration(value)
        elif isinstance(value, ShardedTensorFactory):
            parts = [
                _declaration(v)
                for v in _nested_values(value.build())
                if isinstance(v, ShardedTensor)
            ]
            if parts:
                yield value.data, _merged(value.key, parts)


def _nested_values(state: Any) -> Any:
    if isinstance(state, dict):
        for value in state.values():
            yield from _nested_values(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _nested_values(value)
    else:
        yield state


def _declaration(tensor: Any) -> Declaration:
    # megatron/core/dist_checkpointing/mapping.py (0.14-0.19) ShardedTensor: the first
    # prepend_axis_num axes are the layer / expert stacking axes megatron adds.
    skip = int(tensor.prepend_axis_num)
    replica = tensor.replica_id if isinstance(tensor.replica_id, tuple) else (tensor.replica_id,)
    return Declaration(
        key=tensor.key,
        global_shape=tuple(tensor.global_shape[skip:]),
        fragments=tuple(tensor.axis_fragmentations[skip:]),
        offset=tuple(tensor.global_offset[skip:]),
        replica_id=tuple(int(r) for r in replica),
    )


def _merged(key: str, parts: list[Declaration]) -> Declaration:
    """One declaration for a param a factory saves as several tensors (each a slice of it):
    split where any part is split."""
    first = max(parts, key=lambda d: d.parts)
    return dataclasses.replace(first, key=key, parts_saved=tuple(parts))
