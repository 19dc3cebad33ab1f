"""The model configs and parallel layouts the multi-rank tests share: one table format for all.

A :class:`Layout` is a world size, a tiny model and the parallel sizes (plus the few build
options that change what a rank holds: frozen params, fp32 params, optimizer instances, GTP,
the optimizer); ``init_parallel(**layout.parallel())`` sets it up and ``layout.marks()`` skips
it, with the reason, on a megatron-core that cannot build it. A test file keeps its own table of
named layouts (what it needs to prove differs), always in this format and on these models;
:func:`filled_oracle` is the fill-then-oracle step of the multi-rank tests.

Sizes: ``DENSE`` / ``MOE`` have 4 layers so that PP2×VPP2, PP4 and MoE on some stages only have
a layer for every chunk; ``SMALL`` / ``SMALL_MOE`` have 2, for tests that need no deeper
pipeline (faster). Hidden 32 with 4 heads and vocab 64 keep every TP / EP split non-trivial.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest


from norm_optim.testing.models import TinyGPTConfig
from norm_optim.testing.oracle import fill_deterministic_, global_param_shapes, oracle_norm
from norm_optim._versions import megatron_at_least


def _has_torch_fsdp2() -> bool:
    import torch.distributed.fsdp as fsdp

    return hasattr(fsdp, "MixedPrecisionPolicy")


NEEDS_TORCH_FSDP2 = pytest.mark.skipif(
    not _has_torch_fsdp2(),
    reason="torch FSDP2's public API (torch.distributed.fsdp.fully_shard, what torch-native "
    "FSDP2 and megatron's TorchFullyShardedDataParallel use) is torch >= 2.6",
)

DENSE = TinyGPTConfig(hidden_size=32, num_layers=4, num_attention_heads=4, vocab_size=64)
MOE = dataclasses.replace(DENSE, num_experts=4, moe_ffn_hidden_size=32)
SMALL = dataclasses.replace(DENSE, num_layers=2)
SMALL_MOE = dataclasses.replace(SMALL, num_experts=4, moe_ffn_hidden_size=32)
# GTP pads dim 0 of each weight it shards to a multiple of 16 x GTP size: hidden 48 leaves pad rows
# (qkv 144 -> 160 rows, proj / fc2 48 -> 64), some shards all padding at TP2.
GTP_DENSE = dataclasses.replace(DENSE, hidden_size=48, ffn_hidden_size=96)
GTP_MOE = dataclasses.replace(GTP_DENSE, num_experts=4, moe_ffn_hidden_size=40)
# Multi-token prediction with RoPE, as MTP models use: a learned position embedding would get a
# second, untied copy on the MTP stage.
MTP = dataclasses.replace(DENSE, mtp_num_layers=1, position_embedding_type="rope")
# HybridModel (GPTModel's successor since 0.19): attention, MLP and MoE layers in one stack.
HYBRID = dataclasses.replace(MOE, hybrid_layer_pattern="*-E*-E")
# Learnable attention sinks (gpt-oss style): a softmax_offset per attention layer, one value per
# head, split over TP but without megatron's tensor_model_parallel marker.
SINKS = dataclasses.replace(SMALL, softmax_type="learnable")
SINKS_MOE = dataclasses.replace(SMALL_MOE, softmax_type="learnable")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout on ``world`` ranks and the model built on it."""

    world: int
    cfg: TinyGPTConfig = DENSE
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    instances: int = 1
    ddp_instances: int | None = None  # None: as ``instances`` (what Megatron-LM configures)
    freeze: tuple[str, ...] = ()
    fp32_params: tuple[str, ...] = ()
    # Read the coordinates from an explicit ProcessGroupCollection, not the global state.
    pg_collection: bool = False
    # GTP weight remat (megatron-core >= 0.19): dense and expert GTP sizes (part of DP).
    gtp: int = 1
    egtp: int = 1
    dist_opt_refused: bool = False
    # get_megatron_optimizer's optimizer and use_layer_wise_distributed_optimizer; with the
    # distributed optimizer (megatron-core >= 0.19) the layer-wise one gets its own DDP layout
    # and the result is ChainedOptimizer([LayerWiseDistributedOptimizer, DistributedOptimizer]).
    optimizer: str = "adam"
    layer_wise: bool = False
    # Hybrid Megatron-FSDP (instances > 1): "no_shard" keeps all main-weight shards in every
    # instance, "optim" shards them across the instances too.
    outer_dp_sharding: str = "no_shard"

    def parallel(self) -> dict[str, Any]:
        """``init_parallel`` keyword arguments."""
        gtp = {"gtp_remat_size": self.gtp} if self.gtp > 1 else {}
        if self.egtp > 1:
            gtp["expert_gtp_remat_size"] = self.egtp
        return dict(
            tp=self.tp,
            pp=self.pp,
            vpp=self.vpp,
            cp=self.cp,
            ep=self.ep,
            etp=self.etp,
            num_distributed_optimizer_instances=self.instances,
            **gtp,
        )

    def marks(self) -> list[Any]:
        """Skips, with the reason, where this megatron-core cannot build the layout."""
        if self.cfg.softmax_type != "vanilla" and not _has_config_field("softmax_type"):
            return [pytest.mark.skip(reason="this megatron-core has no softmax_type")]
        if self.cfg.hybrid_layer_pattern and not megatron_at_least(0, 19):
            return [pytest.mark.skip(reason="HybridModel exists since megatron-core 0.19")]
        if (self.gtp > 1 or self.egtp > 1) and not megatron_at_least(0, 19):
            return [pytest.mark.skip(reason="GTP weight remat exists since megatron-core 0.19")]
        if self.pg_collection and not megatron_at_least(0, 15):
            return [
                pytest.mark.skip(reason="ProcessGroupCollection exists since megatron-core 0.15")
            ]
        if self.optimizer != "adam" and not (megatron_at_least(0, 19) and _has_emerging()):
            return [
                pytest.mark.skip(
                    reason=f"{self.optimizer} in get_megatron_optimizer needs "
                    "megatron-core >= 0.19 and emerging-optimizers (Python >= 3.12)"
                )
            ]
        return []


def filled_oracle(chunks: list, optimizer: Any, seed: int) -> float:
    """Fill every weight (and the optimizer's fp32 copies) with its layout-independent values for
    ``seed``; return the exact norm they must give."""
    fill_deterministic_(chunks, seed, optimizer=optimizer)
    return oracle_norm(global_param_shapes(chunks), seed)


def _has_config_field(name: str) -> bool:
    from megatron.core.transformer import TransformerConfig

    return name in {f.name for f in dataclasses.fields(TransformerConfig)}


def _has_emerging() -> bool:
    return importlib.util.find_spec("emerging_optimizers") is not None
