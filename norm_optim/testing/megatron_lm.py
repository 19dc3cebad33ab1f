"""Run Megatron-LM's real training loop (``megatron.training.pretrain``) on CPU gloo ranks.

Since megatron-core 0.17 the wheel ships ``megatron.training``: Megatron-LM's ``pretrain``,
``train``, ``training_log``, checkpointing and argument parsing. This module runs that loop, a
tiny GPT (dense or MoE) on mock data, inside a :func:`~norm_optim.testing.run_ranks` rank, so a
Megatron-LM script (or an integration such as :mod:`norm_optim.integrations.megatron_lm`) can be
tested without a GPU::

    from norm_optim.testing import run_ranks
    from norm_optim.testing.megatron_lm import pretrain_gpt, tiny_gpt_args

    def body():
        return pretrain_gpt(tiny_gpt_args(tp=2, train_iters=3)).log_lines

    print(run_ranks(body, 4)[-1])      # the last rank prints Megatron's log

Megatron-LM's ``pretrain_gpt.py`` is not in the wheel; :func:`pretrain_gpt` does what it does
(parse the arguments, ``gpt_config_from_args``, ``pretrain_cfg_container_from_args``,
``pretrain``) with a forward step and a dataset provider built from the wheel's own pieces
(``MockGPTDataset``, ``get_batch_on_this_tp_rank``, the GPT loss).

**Test-only patches.** On top of the CPU shim (installed by ``run_ranks``), Megatron-LM's loop
needs reversible patches, which :func:`pretrain_gpt` applies for the run and undoes: those any
training loop on megatron-core needs (CUDA device count, dataset helper compilation, CUDA RNG
state in checkpoints, ``torch_dist`` saves in a forked rank) and those of ``megatron.training``
itself, each named after the megatron code it exists for (internal:
``norm_optim.testing._internal.megatron_lm_patches``). MoE with TP needs sequence parallelism,
which the local spec's torch norm refuses: that one is not a patch but a layer spec
(:func:`sequence_parallel_norm_layer_spec`), set on the model config.

Needs megatron-core >= 0.19 (``pretrain`` takes a config container since 0.19); the patches
themselves apply to 0.17+.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from norm_optim.testing.layers import with_sequence_parallel_norms
from norm_optim.testing.logs import recorded_log_lines
from norm_optim._patching import Patch
from norm_optim.testing._internal.megatron_lm_patches import megatron_lm_on_cpu

__all__ = [
    "CPU_FLAGS",
    "PretrainResult",
    "RecordingSummaryWriter",
    "pretrain_gpt",
    "recording_tensorboard_patches",
    "sequence_parallel_norm_layer_spec",
    "tiny_gpt_args",
]

# Megatron-LM flags that keep the loop off CUDA-only code (fused kernels, TE, apex, torch.compile
# of the bias fusions: without the two --no-bias-*-fusion flags the first iteration spends
# ~24 s compiling), with gloo as the backend and the inference RNG tracker (no CUDA RNG).
CPU_FLAGS: tuple[str, ...] = (
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--inference-rng-tracker",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--num-workers",
    "0",
)


# ------------------------------------------------------------------ megatron.training patches


def sequence_parallel_norm_layer_spec(model_config: Any, vp_stage: int | None = None) -> Any:
    """``GPTModelConfig.transformer_layer_spec`` for sequence parallelism with torch norms.

    MoE with TP > 1 requires sequence parallelism, which the local spec's ``WrappedTorchNorm``
    refuses; this is megatron's default spec with
    :class:`~norm_optim.testing.layers.SequenceParallelTorchNorm` instead.
    """
    from megatron.training.models.gpt import default_layer_spec

    return with_sequence_parallel_norms(default_layer_spec(model_config, vp_stage))


class RecordingSummaryWriter:
    """Stands in for TensorBoard's ``SummaryWriter`` (not installed in CI): records every
    ``add_scalar(tag, value, step)`` in :attr:`scalars`; every other writer method is a no-op."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: Any, step: int, *args: Any, **kwargs: Any) -> None:
        self.scalars.append((tag, float(value), int(step)))

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def recording_tensorboard_patches(writer: RecordingSummaryWriter) -> list[Patch]:
    """Megatron's TensorBoard writer is ``writer`` (on the last rank, with ``--tensorboard-dir``).

    ``_set_tensorboard_writer`` (megatron/training/global_vars.py) builds a ``SummaryWriter``
    on the last rank only, and silently none when tensorboard is not installed.
    """
    from megatron.training import global_vars

    def set_writer(args: Any) -> None:
        if getattr(args, "tensorboard_dir", None) and args.rank == args.world_size - 1:
            global_vars._GLOBAL_TENSORBOARD_WRITER = writer

    return [Patch(global_vars, "_set_tensorboard_writer", set_writer)]


# ------------------------------------------------------------------ the model, data and step


def _get_batch(data_iterator: Any, vp_stage: int | None) -> tuple[Any, ...]:
    """pretrain_gpt.py's ``get_batch`` without packed sequences, CP and MTP."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * len(keys)
    args = get_args()
    batch = next(data_iterator) if mpu.get_tensor_model_parallel_rank() == 0 else {}
    batch = get_batch_on_this_tp_rank(
        batch,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=1,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    return tuple(batch.get(key) for key in keys)


def _loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, ...]:
    """pretrain_gpt.py's ``loss_func``: summed token losses, token count, the report."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return (
        loss,
        num_tokens,
        {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])},
    )


def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
    """pretrain_gpt.py's ``forward_step`` (the GPT forward on one micro-batch)."""
    from megatron.core.utils import get_attr_wrapped_model

    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = _get_batch(data_iterator, vp_stage)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(_loss, loss_mask)


def datasets_provider(num_samples: Sequence[int], vp_stage: int | None = None) -> Any:
    """pretrain_gpt.py's provider, mock data only (``MockGPTDataset``)."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split=args.split,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )

    def built_here() -> bool:
        return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(
            vp_stage
        )

    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, built_here, config).build()


# ------------------------------------------------------------------ the run


def tiny_gpt_args(
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    num_experts: int | None = None,
    use_distributed_optimizer: bool = True,
    num_distributed_optimizer_instances: int = 1,
    train_iters: int = 3,
    log_interval: int = 1,
    lr: float = 1e-3,
    micro_batch_size: int = 2,
    global_batch_size: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """Command-line arguments for a tiny bf16 GPT on mock data (hidden 32, 2 layers, 4 heads,
    vocab 128, sequence 16), ``--log-params-norm``, on the given layout, plus :data:`CPU_FLAGS`.

    ``global_batch_size`` defaults to one micro-batch per data-parallel rank and PP stage (the
    world size is read from ``WORLD_SIZE``, which ``run_ranks`` sets in each rank).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // (tp * pp)
    if global_batch_size is None:
        global_batch_size = micro_batch_size * dp * pp
    args = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--vocab-size",
        "128",
        "--tokenizer-type",
        "NullTokenizer",
        "--mock-data",
        "--micro-batch-size",
        str(micro_batch_size),
        "--global-batch-size",
        str(global_batch_size),
        "--train-iters",
        str(train_iters),
        "--log-interval",
        str(log_interval),
        "--eval-iters",
        "0",
        "--eval-interval",
        str(10**6),
        "--lr",
        str(lr),
        "--min-lr",
        str(lr),
        "--lr-decay-style",
        "constant",
        "--weight-decay",
        "0",
        "--clip-grad",
        "1.0",
        "--bf16",
        "--log-params-norm",
        "--seed",
        "1234",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
    ]
    if use_distributed_optimizer:
        args += [
            "--use-distributed-optimizer",
            "--num-distributed-optimizer-instances",
            str(num_distributed_optimizer_instances),
        ]
    if num_experts:
        args += [
            "--num-experts",
            str(num_experts),
            "--moe-router-topk",
            "2",
            "--expert-model-parallel-size",
            str(ep),
            "--moe-ffn-hidden-size",
            "32",
            "--disable-bias-linear",
            "--moe-token-dispatcher-type",
            "allgather",
        ]
        if etp is not None:
            args += ["--expert-tensor-parallel-size", str(etp)]
        if tp > 1:
            args += ["--sequence-parallel"]  # megatron requires it for MoE with TP
    return args + list(CPU_FLAGS) + list(extra)


@dataclass
class PretrainResult:
    """What one rank saw of a :func:`pretrain_gpt` run."""

    stdout: str  # everything the rank printed (Megatron's log is on the last rank)
    # What norm_optim logged: "<LEVEL> <logger>: <message>" per record (recorded_log_lines).
    logged: list[str] = field(default_factory=list)

    @property
    def log_lines(self) -> list[str]:
        """Megatron's per-iteration log lines (`` [date] iteration  N/ M | ...``)."""
        return [
            line
            for line in self.stdout.splitlines()
            if " iteration " in line and "consumed samples" in line
        ]


def pretrain_gpt(argv: Sequence[str], *, capture_stdout: bool = True) -> PretrainResult:
    """Run Megatron-LM's ``pretrain`` on a GPT, as ``pretrain_gpt.py`` does, in this rank.

    Call it inside a :func:`~norm_optim.testing.run_ranks` rank (gloo process group up, CPU
    shim installed). Applies :func:`megatron_lm_on_cpu` for the run. ``argv`` are Megatron-LM
    command-line arguments (see :func:`tiny_gpt_args`).
    """
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    out = io.StringIO()
    saved_argv = sys.argv
    with (
        megatron_lm_on_cpu(torch_fsdp2="--use-torch-fsdp2" in argv),
        contextlib.ExitStack() as stack,
    ):
        if capture_stdout:
            stack.enter_context(contextlib.redirect_stdout(out))
        logged = stack.enter_context(recorded_log_lines())
        sys.argv = [sys.argv[0], *argv]
        try:
            args = parse_and_validate_args()
        finally:
            sys.argv = saved_argv
        model_config = gpt_config_from_args(args)
        if args.sequence_parallel and args.transformer_impl == "local":
            model_config.transformer_layer_spec = sequence_parallel_norm_layer_spec
        setattr(datasets_provider, "is_distributed", True)
        pretrain(
            pretrain_cfg_container_from_args(args, model_config),
            datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
        )
    return PretrainResult(stdout=out.getvalue(), logged=logged)
