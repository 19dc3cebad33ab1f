"""The Megatron adapter: the one place that knows megatron-core's internals.

Everything below it (ownership, registry, kernels, the reduction) is plain logic over the data it
returns, testable without Megatron. A new megatron-core release should mean a change here only.

- :mod:`.optimizers` — the adapter's optimizers: kinds, descriptors, update rules, in-step reads
  (its modules are listed there).
- :mod:`.grad_buffers` — whether a step's grad is a view of the DDP grad buffer that holds its
  param's ``main_grad`` (what the watch binds its read to, once).
- :mod:`.fsdp` — Megatron-FSDP: its fp32 main-weight shards in its buffers, and the DTensor
  stand-ins it swaps into the module (:func:`model_param` maps them back).
- :mod:`.dtensor` — torch FSDP2 and other DTensor params: local shards and the replicating
  mesh axes from their placements; placements it cannot count exactly are refused by name.
- :mod:`.fsdp_v2` — Megatron-FSDP v2 (megatron-core main): its fp32 main-weight slices in its
  parameter groups' flat buffers, which ``FullyShardedOptimizer`` steps as DTensors.
- :mod:`.mimo` — MIMO: a ``MimoOptimizer``'s per-module optimizers, each read with its module's
  own process groups (per-holding coordinates).
- :mod:`.model` — the registry's one entry point, :func:`read_model`: every model param joined
  with what this rank holds for it (MIMO's modules dispatched there, above the readers it
  builds on), its traits and coordinates, and every layout's checks (FSDP2 params held
  unsharded, DTensor meshes, GTP padding and megatron's own GTP layout bug) done.
- :mod:`.readers` — this rank's coordinates and the reduction group's check, MIMO included.
- :mod:`.parallel_state` — this rank's coordinates on every replicating axis (TP, expert-TP,
  DP×CP, expert-DP, GTP) from the parallel state or a ``ProcessGroupCollection``.
- :mod:`.placement` — where each element a rank holds sits in its param's global tensor (from
  the declarations, DTensor placements, megatron's markers): the resume fingerprint's index.
- :mod:`.declarations` — how the model's checkpoint declarations (``sharded_state_dict``) split
  each param: the source of the TP split.
- :mod:`.params` — per-param traits from the declarations, megatron's markers and the model's
  structure: expert, TP-split (and where that came from), GTP-sharded (and its pad rows), tied
  copy.
- :mod:`.audit` — what the audit needs: the groups whose ranks hold copies, tied weights,
  weights whose all-gather may be in flight, and the layouts it refuses by name.
- :mod:`.naming` — layout-independent param names (global layer numbers, global expert
  indices, the numbered weights of TE grouped linears), the per-param norms' keys.
"""

from .audit import AuditLayout, audit_layout
from .optimizers.descriptor import LeafDescriptor, OptimizerDescriptor
from .declarations import Declaration, Declarations, read_declarations
from .optimizers.holdings import Holding, leaves
from .optimizers.kinds import fingerprint, where
from .model import HeldParam, ModelReading, read_model
from .readers import check_reduce_group, rank_coords
from .params import ModelStructure, ParamTraits, param_traits

__all__ = [
    "AuditLayout",
    "Declaration",
    "Declarations",
    "HeldParam",
    "LeafDescriptor",
    "OptimizerDescriptor",
    "Holding",
    "audit_layout",
    "ModelReading",
    "ModelStructure",
    "ParamTraits",
    "check_reduce_group",
    "fingerprint",
    "leaves",
    "param_traits",
    "rank_coords",
    "read_model",
    "read_declarations",
    "where",
]
