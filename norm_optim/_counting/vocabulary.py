"""The vocabularies of a :class:`~norm_optim.inspection.ParamRecord`, one definition each.

All are ``str`` enums: they compare equal to, and print as, the words the summary and
``docs/counting.md`` use (``main-shard``, ``tp-duplicate``, ``declaration``...).
"""

from __future__ import annotations

import enum


class _Word(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Source(_Word):
    """What the tensor a rank holds for a model param is."""

    MAIN = "main"  # the Float16 optimizer's whole fp32 main param
    MAIN_SHARD = "main-shard"  # the distributed optimizer's fp32 shard of a bf16/fp16 param
    FP32_PARAM = "fp32-param"  # an fp32 model param, its own main param
    FP32_PARAM_SHARD = "fp32-param-shard"  # the distributed optimizer's shard of one
    PARAM = "param"  # a non-fp32 param a plain torch optimizer steps directly
    MASTER_PARAM_SHARD = "master-param-shard"  # precision-aware: fp32 master in the inner state
    MASTER_REMAINDER_SHARD = "master-remainder-shard"  # precision-aware: bf16 + int16 remainder
    NO_LOCAL_SHARD = "no-local-shard"  # distributed optimizer: another rank holds every shard
    ASSIGNED_ELSEWHERE = "assigned-elsewhere"  # layer-wise: the param is another rank's
    FROZEN = "frozen"  # in no optimizer: the model param itself
    FROZEN_SHARD = "frozen-shard"  # Megatron-FSDP: this rank's shard of a frozen param

    @property
    def is_frozen(self) -> bool:
        """Whether the param is in no optimizer (counted only with ``count_frozen``)."""
        return self in (Source.FROZEN, Source.FROZEN_SHARD)


class NotCounted(_Word):
    """Why a rank does not add a param's tensor to the norm (another rank does, or nobody)."""

    SHARED = "shared"  # a tied copy: the other copy counts
    TP_DUPLICATE = "tp-duplicate"  # (expert-)TP rank > 0 holds a copy of a param TP does not split
    GTP_DUPLICATE = "gtp-duplicate"  # GTP rank > 0 holds a copy of a param GTP does not shard
    DP_REPLICA = "dp-replica"  # DP rank > 0 holds a whole replica
    MESH_REPLICA = "mesh-replica"  # a DTensor replicated on a mesh axis where this rank is not 0
    OTHER_INSTANCE = "other-instance"  # another distributed-optimizer instance's shards count
    HELD_ELSEWHERE = "held-elsewhere"  # this rank holds nothing of it
    FROZEN_EXCLUDED = "frozen-excluded"  # frozen, and count_frozen=False


class SplitFrom(_Word):
    """Where a param's TP split (split or replicated across TP) is taken from."""

    DECLARATION = "declaration"  # the model's checkpoint declaration (sharded_state_dict)
    MARKER = "marker"  # megatron's tensor_model_parallel marker, or else the layer table
