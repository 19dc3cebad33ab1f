"""Tiny Megatron GPT models, optimizers and a training step, built the way Megatron-LM builds them.

Shared by the tests, the examples and the benchmark. Everything here runs inside a rank whose
parallel state is initialized (see :func:`~norm_optim.testing.launcher.init_parallel`); the
model layout (TP, PP, VPP, EP, ETP) is read from that state, so one :class:`TinyGPTConfig`
builds the same logical model on every layout. On CPU, install the shim first
(:func:`~norm_optim.testing.run_ranks` does).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from norm_optim.testing.layers import with_sequence_parallel_norms

__all__ = [
    "TinyGPTConfig",
    "build_chunk",
    "build_model",
    "build_optimizer",
    "cpu_config_fields",
    "train_step",
    "transformer_config",
    "unwrap_gpt",
]


@dataclass(frozen=True)
class TinyGPTConfig:
    """The logical model; the parallel layout comes from megatron's parallel state.

    ``moe_layer_freq`` is megatron's: an int ``k`` puts experts on every k-th layer (from the
    first), a tuple of 0/1 per layer picks them, e.g. ``(0, 1)`` with PP=2 puts experts on the
    second stage only. ``moe_ffn_hidden_size`` defaults to ``ffn_hidden_size``.
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # 4 * hidden_size
    vocab_size: int = 128
    seq_length: int = 16
    num_experts: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_token_dispatcher_type: str = "allgather"
    # Shared experts (dense MLPs beside the routed ones, split over TP): their hidden size.
    moe_shared_expert_intermediate_size: int | None = None
    tie_embeddings: bool = True
    # None: biases for a dense model, none for MoE (Megatron refuses MoE biases when ETP > 1).
    add_bias_linear: bool | None = None
    normalization: str = "LayerNorm"
    bf16: bool = True
    # False: megatron skips weight init (as when loading a checkpoint) and, with it, marking
    # TP-split weights ``tensor_model_parallel``; the weights are then uninitialized memory.
    perform_initialization: bool = True
    # A HybridModel (megatron-core >= 0.19, GPTModel's successor) instead of a GPTModel: one
    # symbol per layer, ``*`` attention, ``-`` MLP, ``E`` MoE (``num_experts`` needed);
    # ``num_layers`` is then the pattern's length, split evenly over the pipeline stages.
    hybrid_layer_pattern: str | None = None
    # Multi-token-prediction layers (on the last pipeline stage, with their own copy of the
    # embedding there: megatron marks it ``shared``).
    mtp_num_layers: int = 0
    # megatron-core >= 0.19: detach the MTP layers' inputs and output head, and tag their params
    # ``grad_norm_group="mtp"``: the optimizer clips them as a group of their own.
    mtp_detach_heads: bool = False
    position_embedding_type: str = "learned_absolute"
    # Attention sinks (megatron's ``softmax_type``): "learnable" gives every attention layer a
    # ``softmax_offset`` param of one value per head, split over TP; "off-by-one" a zero buffer.
    softmax_type: str = "vanilla"
    # SwiGLU MLPs: megatron saves ``linear_fc1`` as two TP-split halves (a ShardedTensorFactory).
    gated_linear_unit: bool = False


def cpu_config_fields(bf16: bool = True) -> dict[str, Any]:
    """The ``TransformerConfig`` fields every CPU test model sets: no dropout (a step is then
    the same on every run), weights made on the CPU, bf16 (else fp32) params and pipeline."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    return dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
    )


def transformer_config(cfg: TinyGPTConfig) -> Any:
    """A megatron ``TransformerConfig`` for ``cfg`` on the current parallel layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    tp = ps.get_tensor_model_parallel_world_size()
    ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    moe = {}
    if cfg.num_experts:
        freq = cfg.moe_layer_freq
        moe = dict(
            num_moe_experts=cfg.num_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or ffn,
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            moe_router_dtype="fp32",  # lets the router weight be kept fp32 (``fp32_params``)
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        )
    pattern = cfg.hybrid_layer_pattern
    return TransformerConfig(
        num_layers=len(pattern) if pattern else cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=ffn,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        # The local (non-TE) attention refuses CP > 1; the optimizer's DP x CP sharding, which
        # is what a norm test needs, comes from the parallel state, not from this config.
        context_parallel_size=1,
        # MoE with TP > 1 requires sequence parallelism (see norm_optim.testing.layers).
        sequence_parallel=tp > 1 and bool(cfg.num_experts),
        add_bias_linear=(
            not cfg.num_experts if cfg.add_bias_linear is None else cfg.add_bias_linear
        ),
        normalization=cfg.normalization,
        perform_initialization=cfg.perform_initialization,
        **({"mtp_num_layers": cfg.mtp_num_layers} if cfg.mtp_num_layers else {}),
        **({"mtp_detach_heads": True} if cfg.mtp_detach_heads else {}),
        **({"softmax_type": cfg.softmax_type} if cfg.softmax_type != "vanilla" else {}),
        **(
            {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu}
            if cfg.gated_linear_unit
            else {}
        ),
        **cpu_config_fields(cfg.bf16),
        **moe,
    )


def build_chunk(cfg: TinyGPTConfig, config: Any, vp_stage: int | None) -> torch.nn.Module:
    """One model chunk (GPTModel or HybridModel, no DDP / Float16Module) of ``cfg`` for the
    current layout and virtual stage ``vp_stage``."""
    from megatron.core import parallel_state as ps

    stage = dict(
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        vp_stage=vp_stage,
    )
    if cfg.hybrid_layer_pattern is not None:
        from megatron.core.models.hybrid import hybrid_block
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        spec = with_sequence_parallel_norms(_hybrid_local_spec(cfg))
        # HybridStack builds its final norm from Transformer Engine's TENorm, whatever the spec
        # says: use the spec's own (torch) norm while it is built.
        original = hybrid_block.TENorm
        hybrid_block.TENorm = spec.submodules.attention_layer.submodules.input_layernorm
        try:
            return HybridModel(
                config=config,
                hybrid_stack_spec=spec,
                hybrid_layer_pattern=_split_by_stage(cfg.hybrid_layer_pattern),
                position_embedding_type="learned_absolute",
                **stage,
            )
        finally:
            hybrid_block.TENorm = original
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block_spec = with_sequence_parallel_norms(
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    )
    if cfg.mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_mtp_block_spec,
        )

        layer_spec = with_sequence_parallel_norms(get_gpt_layer_local_spec())
        stage["mtp_block_spec"] = get_gpt_mtp_block_spec(
            config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        position_embedding_type=cfg.position_embedding_type,
        **stage,
    )


def _split_by_stage(pattern: str) -> str:
    """The logical layer pattern with megatron's ``|`` between equal pipeline stages."""
    from megatron.core import parallel_state as ps

    stages = ps.get_pipeline_model_parallel_world_size()
    if ps.get_virtual_pipeline_model_parallel_world_size():
        raise NotImplementedError("the tiny HybridModel is built without virtual pipelining")
    if len(pattern) % stages:
        raise ValueError(f"{len(pattern)} layers ({pattern!r}) do not split over {stages} stages")
    size = len(pattern) // stages
    return "|".join(pattern[i : i + size] for i in range(0, len(pattern), size))


def _hybrid_local_spec(cfg: TinyGPTConfig) -> Any:
    """HybridModel's stack spec from the local (non-TE) GPT layer pieces; megatron ships only TE
    ones (``hybrid_layer_specs``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    dense = get_gpt_layer_local_spec(normalization=cfg.normalization).submodules
    moe = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts or 1, moe_grouped_gemm=False, normalization=cfg.normalization
    ).submodules

    def layer(module: type, **parts: Any) -> Any:
        return ModuleSpec(module=module, submodules=TransformerLayerSubmodules(**parts))

    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=layer(
                TransformerLayer,
                input_layernorm=dense.input_layernorm,
                self_attention=dense.self_attention,
                self_attn_bda=dense.self_attn_bda,
            ),
            mlp_layer=layer(
                MLPLayer,
                pre_mlp_layernorm=dense.pre_mlp_layernorm,
                mlp=dense.mlp,
                mlp_bda=dense.mlp_bda,
            ),
            moe_layer=layer(
                MoETransformerLayer,
                pre_mlp_layernorm=moe.pre_mlp_layernorm,
                mlp=moe.mlp,
                mlp_bda=moe.mlp_bda,
            ),
        ),
    )


def _matching_params(
    module: torch.nn.Module, patterns: Sequence[str]
) -> Iterator[torch.nn.Parameter]:
    for name, param in module.named_parameters():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            yield param


def build_model(
    cfg: TinyGPTConfig = TinyGPTConfig(),
    *,
    use_distributed_optimizer: bool = False,
    freeze: Sequence[str] = (),
    fp32_params: Sequence[str] = (),
    seed: int = 1234,
    layer_wise_layout: bool = False,
    **ddp_overrides: Any,
) -> list[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage), each in megatron DDP.

    As Megatron-LM does: GPT on the local spec, ``Float16Module`` (bf16), then DDP, with
    bucketing disabled for chunks after the first.

    Args:
        cfg: the logical model.
        use_distributed_optimizer: DDP buffer layout; must match :func:`build_optimizer`.
        freeze: glob patterns over GPTModel param names (``decoder.layers.0.*``, local layer
            indices); matches get ``requires_grad_(False)`` before DDP, so no optimizer sees them.
        fp32_params: glob patterns of params kept fp32 in a bf16 model (a mixed model). The
            forward pass supports this for norms (torch's CPU norms take bf16 inputs with fp32
            weights) and for the MoE router (``moe_router_dtype='fp32'``).
        seed: seeds megatron's weight init.
        layer_wise_layout: build DDP's buffers for ``use_layer_wise_distributed_optimizer`` with
            a distributed-optimizer DDP (megatron-core >= 0.19), as Megatron-LM's
            ``wrap_model_chunks_with_ddp`` does: Muon-managed matrices in shard-aligned
            layer-wise buffers, the other params in distributed-optimizer buffers, so that
            ``get_megatron_optimizer`` returns ``ChainedOptimizer([LayerWise..., Distributed...])``.
        ddp_overrides: extra ``DistributedDataParallelConfig`` fields (``grad_reduce_in_fp32``
            defaults to True; False keeps bf16 main grads, megatron's ``--main-grads-dtype bf16``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from norm_optim.testing.cpu import init_rng

    init_rng(seed)
    config = transformer_config(cfg)
    ddp_overrides.setdefault("grad_reduce_in_fp32", True)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, **ddp_overrides
    )
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for index, vp_stage in enumerate(range(vpp) if vpp else [None]):
        gpt = build_chunk(cfg, config, vp_stage)
        for param in _matching_params(gpt, freeze):
            param.requires_grad_(False)
        model: torch.nn.Module = Float16Module(config, gpt) if cfg.bf16 else gpt
        for param in _matching_params(gpt, fp32_params):
            param.data = param.data.float()
        layout = _layer_wise_param_layout(gpt, ddp_config) if layer_wise_layout else None
        extra = {"full_param_layout": layout} if layout is not None else {}
        chunks.append(
            DistributedDataParallel(config, ddp_config, model, disable_bucketing=index > 0, **extra)
        )
    return chunks


def _layer_wise_param_layout(gpt: torch.nn.Module, ddp_config: Any) -> Any:
    """The buffer layout Megatron-LM's ``wrap_model_chunks_with_ddp`` (0.19) computes for the
    layer-wise optimizer: params tagged for routing, the DDP config switched to the
    distributed-optimizer buffers."""
    from megatron.core.optimizer import layer_wise_optimizer as lw
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not hasattr(lw, "tag_params_for_buffer_routing"):
        raise NotImplementedError("the layer-wise param layout exists since megatron-core 0.19")
    lw.tag_params_for_buffer_routing([gpt])
    ddp_config.use_distributed_optimizer = True
    groups = ProcessGroupCollection.use_mpu_process_groups()
    params = [p for p in gpt.parameters() if p.requires_grad]
    return lw.LayerWiseDistributedOptimizer.compute_full_param_layout(
        params,
        ddp_config.bucket_size,
        groups.intra_dp_cp.size(),
        ddp_config,
        expert_data_parallel_world_size=groups.intra_expt_dp.size(),
    )


def build_optimizer(
    model_chunks: list[torch.nn.Module],
    *,
    use_distributed_optimizer: bool | None = None,
    bf16: bool = True,
    lr: float = 1e-3,
    **extra: Any,
) -> Any:
    """The real ``get_megatron_optimizer`` (Adam) over ``model_chunks``.

    ``use_distributed_optimizer`` defaults to what the chunks' DDP was built for; any other
    ``OptimizerConfig`` field can be passed in ``extra`` (``clip_grad`` defaults to 1.0).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    built_for: bool = getattr(model_chunks[0], "ddp_config").use_distributed_optimizer
    if use_distributed_optimizer is None:
        use_distributed_optimizer = built_for
    if use_distributed_optimizer != built_for:
        raise ValueError(
            f"use_distributed_optimizer={use_distributed_optimizer} but the model's DDP was built "
            f"with use_distributed_optimizer={built_for}; pass the same value to build_model"
        )
    extra.setdefault("clip_grad", 1.0)
    extra.setdefault("optimizer", "adam")
    config = OptimizerConfig(
        lr=lr,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
        **extra,
    )
    return get_megatron_optimizer(config, model_chunks)


def _loss(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.clone().detach()}  # the schedule divides `loss` in place


def _forward_step(
    data_iterator: Iterator[torch.Tensor], model: torch.nn.Module
) -> tuple[torch.Tensor, Any]:
    tokens = next(data_iterator)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    output = model(tokens, positions, None, labels=torch.roll(tokens, -1, dims=1))
    return output, _loss


def train_step(
    model_chunks: list[torch.nn.Module],
    optimizer: Any,
    *,
    seed: int = 0,
    micro_batch_size: int = 2,
    num_microbatches: int | None = None,
    losses: list[torch.Tensor] | None = None,
) -> tuple[bool, float | None, int | None]:
    """One real training iteration on random tokens: megatron's pipeline schedule (forward and
    backward, ``finalize_model_grads``), then ``optimizer.step()``.

    Every rank draws the same tokens from ``seed``. ``num_microbatches`` defaults to the
    pipeline size (the interleaved schedule needs a multiple of it). ``losses``, if given, gets
    each micro-batch's loss appended (on the last pipeline stage; other stages have none).

    Returns:
        ``optimizer.step()``'s ``(update_successful, grad_norm, num_zeros_in_grad)``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(model_chunks[0])
    config.finalize_model_grads_func = finalize_model_grads
    num_microbatches = num_microbatches or ps.get_pipeline_model_parallel_world_size()
    gpt = unwrap_gpt(model_chunks[0])
    seq_length, vocab_size = gpt.max_sequence_length, gpt.vocab_size
    generator = torch.Generator().manual_seed(seed)
    batches = [
        torch.randint(vocab_size, (micro_batch_size, seq_length), generator=generator)
        for _ in range(num_microbatches)
    ]
    iterators = [iter(batches) for _ in model_chunks]

    for chunk in model_chunks:
        getattr(chunk, "zero_grad_buffer")()  # megatron DDP's, not a torch.nn.Module method
    optimizer.zero_grad()
    reduced = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(model_chunks) > 1 else iterators[0],
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    if losses is not None:
        losses.extend(step["lm loss"] for step in reduced)
    return optimizer.step()


def unwrap_gpt(chunk: torch.nn.Module) -> Any:
    """The GPTModel inside a model chunk's DDP (or Megatron-FSDP) and Float16Module wrappers."""
    # DDP and both Megatron-FSDP versions derive from it (on main FullyShardedDataParallel is
    # a factory function, not a class).
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MegatronFSDP
    from megatron.core.transformer.module import Float16Module

    wrappers = (_BaseDataParallel, MegatronFSDP, Float16Module)
    while isinstance(chunk, wrappers):
        chunk = chunk.module
    return chunk
