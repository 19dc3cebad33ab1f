"""Run Megatron-Bridge's real ``pretrain(cfg, forward_step)`` on CPU gloo ranks (test support).

Megatron-Bridge (``megatron.bridge``, 0.6.2 on megatron-core 0.19.2) is NVIDIA's recipe library
on megatron-core. Its training loop runs unchanged on CPU with norm_optim's CPU shim plus
test-only patches, each named after the Bridge or megatron code it exists for and each
reversible (internal: ``norm_optim.testing._internal.bridge_patches``):

- at import (:func:`import_bridge`): a Transformer Engine stand-in handed to
  ``megatron.bridge.peft.lora_layers`` only, and NVRx's async checkpointing hidden from
  megatron-core's probe;
- per rank (:func:`run_pretrain`): ``initialize_megatron(allow_no_cuda=True)``, one CUDA device
  that ``set_device`` ignores, the dataset helpers' compile and the JIT fusion warm-up skipped,
  and ``torch.cuda`` RNG state read from the CPU generator; when the config asks for
  Megatron-FSDP, its CPU patches and the CPU device for the ``FullyShardedDataParallel`` that
  Bridge's ``get_model`` builds without one.

A Bridge model for CPU uses the local (non-TE) layer spec with a sequence-parallel torch norm
(:func:`cpu_layer_spec`) and ``RNGConfig(inference_rng_tracker=True)``; :func:`tiny_config`
builds a whole ``ConfigContainer`` on mock data. :func:`run_pretrain` runs it on N ranks and
returns what each rank printed, plus what the callbacks recorded.

Installing the packages: ``pip install megatron-bridge`` does not install on a CPU machine
(a source-only CUDA extension; a pin on an ``nvidia-resiliency-ext`` release the registry
lacks); see the ``bridge-test`` extra in ``setup.cfg`` and ``make test-bridge`` for the recipe
that works.
"""

from __future__ import annotations

import contextlib
import io
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from norm_optim.testing.layers import with_sequence_parallel_norms
from norm_optim.testing.logs import recorded_log_lines
from norm_optim.testing.models import cpu_config_fields
from norm_optim.testing._internal.torch_fsdp2_patches import install_torch_fsdp2_cpu_patches
from norm_optim.testing._internal.bridge_patches import (
    transformer_engine_for_lora_layers,
    without_nvrx_async_checkpointing,
    install_bridge_cpu_patches,
    install_bridge_megatron_fsdp_cpu_patches,
)

__all__ = [
    "RankOutput",
    "bridge_available",
    "cpu_layer_spec",
    "import_bridge",
    "run_pretrain",
    "tiny_config",
]


def bridge_available() -> bool:
    """Whether ``megatron.bridge`` is installed (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        return False


def import_bridge() -> types.ModuleType:
    """Import ``megatron.bridge.training.pretrain`` on a machine without TE or a GPU.

    Idempotent. Importing it first in the test process (before forking ranks) also saves each
    rank the ~10 s import.

    Returns:
        The ``megatron.bridge.training.pretrain`` module.
    """
    import importlib
    import warnings

    if "megatron.bridge.training.pretrain" in sys.modules:
        return sys.modules["megatron.bridge.training.pretrain"]
    with warnings.catch_warnings():
        # Without TE or Apex, megatron and Bridge warn once per module that they fall back to
        # torch implementations; that is the intended setup on CPU.
        warnings.simplefilter("ignore")
        with transformer_engine_for_lora_layers(), without_nvrx_async_checkpointing():
            for name in (
                "megatron.bridge.training.pretrain",
                "megatron.bridge.training.gpt_step",
                "megatron.bridge.training.utils.train_utils",
            ):
                importlib.import_module(name)
    return sys.modules["megatron.bridge.training.pretrain"]


# ---------------------------------------------------------------- a tiny model and config


def cpu_layer_spec(config: Any, vp_stage: Optional[int] = None) -> Any:
    """``GPTModelProvider.transformer_layer_spec`` for CPU: megatron's local (non-TE) decoder
    block spec, with a torch norm that allows sequence parallelism (MoE with TP needs SP; the
    local spec's ``WrappedTorchNorm`` refuses it)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    return with_sequence_parallel_norms(spec)


# The provider's fused kernels (CUDA or apex only), all off on the CPU.
_FUSED_KERNELS = (
    "gradient_accumulation_fusion",
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "cross_entropy_loss_fusion",
    "persist_layer_norm",
)


def tiny_config(
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    ep: int = 1,
    num_layers: int = 2,
    num_experts: Optional[int] = None,
    use_distributed_optimizer: bool = True,
    num_distributed_optimizer_instances: int = 1,
    megatron_fsdp: bool = False,
    torch_fsdp2: bool = False,
    train_iters: int = 2,
    log_interval: int = 1,
    tensorboard_log_interval: Optional[int] = None,
    lr: float = 1e-3,
    seed: int = 1234,
    tensorboard_dir: Optional[str] = None,
    world_size: int = 1,
) -> Any:
    """A Bridge ``ConfigContainer`` for a tiny GPT (hidden 64) on mock data, for CPU.

    Config notes for Bridge 0.6.2: ``GPTModelProvider`` has no ``max_position_embeddings``
    (``seq_length`` is used); ``SchedulerConfig`` needs ``start_weight_decay`` /
    ``end_weight_decay``; MoE with TP needs ``add_bias_linear=False`` and sequence parallelism.
    ``lr=0`` keeps the weights where they start (Adam's update is scaled by ``lr``).
    ``tensorboard_log_interval`` defaults to ``log_interval``; ``world_size`` sets the global
    batch size (one micro-batch of 2 per data-parallel rank). ``megatron_fsdp``: Megatron-FSDP
    (``ddp.use_megatron_fsdp``, ``optim_grads_params``; Bridge turns on the distributed
    optimizer and ``dist.use_megatron_fsdp`` itself), with ``gradient_reduce_div_fusion=False``
    (gloo has no ``PREMUL_SUM``). ``torch_fsdp2``: torch FSDP2 (``dist.use_torch_fsdp2``, megatron's
    ``TorchFullyShardedDataParallel``), which needs untied embeddings, no distributed optimizer,
    and ``transformer_impl="local"`` for the local spec.
    """
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )

    seq_length, micro_batch_size = 16, 2
    dp = world_size // (tp * pp)
    moe: dict[str, Any] = {}
    fsdp: dict[str, Any] = {}
    if megatron_fsdp:
        fsdp = dict(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy="optim_grads_params",
            gradient_reduce_div_fusion=False,
        )
    if num_experts:
        moe = dict(
            num_moe_experts=num_experts,
            moe_router_topk=2,
            moe_ffn_hidden_size=128,
            moe_token_dispatcher_type="allgather",
            moe_router_dtype="fp32",
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp,
        )
    model = GPTModelProvider(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        vocab_size=128,
        seq_length=seq_length,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=tp > 1 and bool(num_experts),
        add_bias_linear=not num_experts,
        normalization="LayerNorm",
        **cpu_config_fields(),
        transformer_layer_spec=cpu_layer_spec,
        **dict.fromkeys(_FUSED_KERNELS, False),
        share_embeddings_and_output_weights=not torch_fsdp2,
        position_embedding_type="learned_absolute",
        **({"transformer_impl": "local"} if torch_fsdp2 else {}),
        **moe,
    )
    return ConfigContainer(
        model=model,
        # The interleaved (VPP) schedule needs a multiple of PP micro-batches.
        train=TrainingConfig(
            train_iters=train_iters,
            micro_batch_size=micro_batch_size,
            global_batch_size=micro_batch_size * dp * (pp if vpp else 1),
        ),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=0.0,
            weight_decay=0.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            clip_grad=1.0,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        scheduler=SchedulerConfig(
            lr_decay_style="constant",
            lr_warmup_iters=0,
            start_weight_decay=0.0,
            end_weight_decay=0.0,
        ),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=use_distributed_optimizer,
            grad_reduce_in_fp32=True,
            num_distributed_optimizer_instances=num_distributed_optimizer_instances,
            **fsdp,
        ),
        dataset=MockGPTDatasetConfig(
            seq_length=seq_length,
            random_seed=seed,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            num_dataset_builder_threads=1,
            split="1,0,0",
            dataloader_type="single",
            num_workers=0,
            skip_getting_attention_mask_from_dataset=True,
        ),
        logger=LoggerConfig(
            log_interval=log_interval,
            log_params_norm=True,
            tensorboard_dir=tensorboard_dir,
            tensorboard_log_interval=tensorboard_log_interval or log_interval,
        ),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        checkpoint=CheckpointConfig(save=None, load=None),
        rng=RNGConfig(seed=seed, inference_rng_tracker=True),
        dist=DistributedInitConfig(distributed_backend="gloo", use_torch_fsdp2=torch_fsdp2),
    )


# ---------------------------------------------------------------- running pretrain()


@dataclass
class RankOutput:
    """What one rank of :func:`run_pretrain` returns: its stdout lines (Bridge prints its log
    line on the last rank), the callbacks' ``user_state`` (picklable values only), and what
    norm_optim logged (:func:`~norm_optim.testing.logs.recorded_log_lines`: one
    ``"<LEVEL> <logger>: <message>"`` per record)."""

    lines: list[str]
    user_state: dict[str, Any]
    logged: list[str] = field(default_factory=list)

    def matching(self, text: str) -> list[str]:
        """The stdout lines that contain ``text``."""
        return [line for line in self.lines if text in line]

    def logged_matching(self, text: str) -> list[str]:
        """What norm_optim logged that contains ``text``."""
        return [line for line in self.logged if text in line]


def _flush_tensorboard(context: Any) -> None:
    # Bridge never closes its SummaryWriter, and a forked rank ends with ``os._exit``: without
    # a flush the last events would be lost. ``_tensorboard_logger``: the property would create one.
    writer = getattr(context.state, "_tensorboard_logger", None)
    if writer is not None:
        writer.flush()


def _pretrain_rank(
    config: Any, callbacks: Sequence[Any], before: Optional[Callable[[], Any]]
) -> RankOutput:
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.gpt_step import forward_step

    pretrain = import_bridge().pretrain
    manager = CallbackManager()
    manager.add(list(callbacks))
    manager.register("on_train_end", _flush_tensorboard)
    out = io.StringIO()
    fsdp = config.ddp.use_megatron_fsdp or config.dist.use_megatron_fsdp
    with (
        install_bridge_cpu_patches(),
        install_bridge_megatron_fsdp_cpu_patches() if fsdp else contextlib.nullcontext(),
        (
            install_torch_fsdp2_cpu_patches()
            if config.dist.use_torch_fsdp2
            else contextlib.nullcontext()
        ),
    ):
        undo = before() if before is not None else None
        try:
            with contextlib.redirect_stdout(out), recorded_log_lines() as logged:
                pretrain(config, forward_step, callbacks=manager)
        finally:
            if undo is not None:
                undo.uninstall()
    return RankOutput(out.getvalue().splitlines(), dict(manager.user_state), logged)


def run_pretrain(
    config: Any,
    world_size: int,
    *,
    callbacks: Sequence[Any] = (),
    before: Optional[Callable[[], Any]] = None,
    timeout: float = 120.0,
) -> list[RankOutput]:
    """Run Bridge's ``pretrain(config, gpt_step.forward_step)`` on ``world_size`` CPU gloo ranks.

    Each rank is a forked child (:func:`~norm_optim.testing.run_ranks`) with the CPU shim and
    Bridge's CPU patches (and Megatron-FSDP's when the config uses it); ``before()`` runs in the rank first (e.g. an
    integration's ``install``; what it returns is ``uninstall()``-ed after).

    Returns:
        One :class:`RankOutput` per rank: the lines it printed (Bridge prints its log line on
        the last rank) and the callbacks' ``user_state``.
    """
    from norm_optim.testing.launcher import run_ranks

    import_bridge()
    return run_ranks(_pretrain_rank, world_size, config, list(callbacks), before, timeout=timeout)
