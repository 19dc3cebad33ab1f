"""Model pieces for megatron models on CPU: a torch norm that allows sequence parallelism.

MoE with TP > 1 requires ``sequence_parallel=True``, which the local spec's ``WrappedTorchNorm``
refuses. Megatron-LM's, Megatron-Bridge's and the tiny builders' specs get
:class:`SequenceParallelTorchNorm` through :func:`with_sequence_parallel_norms`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["SequenceParallelTorchNorm", "with_sequence_parallel_norms"]


class SequenceParallelTorchNorm:
    """Drop-in for megatron's ``WrappedTorchNorm`` that allows sequence parallelism.

    MoE with TP > 1 requires ``sequence_parallel=True``, which ``WrappedTorchNorm`` refuses. A
    plain torch LayerNorm/RMSNorm is correct under sequence parallelism as long as its params
    carry ``sequence_parallel=True``, so that ``finalize_model_grads`` all-reduces their grads
    over the TP group (each TP rank saw only its slice of the sequence).
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> Any:
        # Returns a torch norm, not an instance of this class (megatron's spec calls the class):
        # typed Any, which is what the spec's submodule slot takes.
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(
                f"SequenceParallelTorchNorm supports {sorted(norms)}, got {config.normalization!r}"
            )
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)  # megatron's marker
        return norm


def with_sequence_parallel_norms(spec: Any) -> Any:
    """A copy of a layer/block spec with ``WrappedTorchNorm`` swapped for one that allows SP."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelTorchNorm
    if isinstance(spec, list):
        return [with_sequence_parallel_norms(s) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {
            f.name: with_sequence_parallel_norms(getattr(spec, f.name))
            for f in dataclasses.fields(spec)
            if f.init
        }
        return dataclasses.replace(spec, **changes)
    return spec
