"""torch FSDP2 (``fully_shard``) models on CPU gloo ranks: builders, weights, an oracle.

Two routes a user takes to FSDP2:

- **Megatron's** ``TorchFullyShardedDataParallel`` (what Megatron-LM's ``--use-torch-fsdp2``
  builds) over ``Float16Module(GPTModel)`` or an fp32 GPTModel, with the real
  ``get_megatron_optimizer`` (Float16 / FP32 optimizer; FSDP2 takes no distributed optimizer):
  :func:`build_torch_fsdp2_model` (it applies the test kit's internal CPU patch for it).
- **torch-native** ``fully_shard`` over the blocks and the root of a plain torch model
  (:class:`TinyTorchLM`), bf16 compute through ``MixedPrecisionPolicy``, a plain
  ``torch.optim.AdamW``: :func:`build_native_fsdp2` on a 1-D mesh (FSDP), a replicate × shard
  mesh (HSDP) or a data × tensor mesh (``parallelize_module`` TP inside, FSDP across).

:func:`fill_dtensor_deterministic_` writes the oracle's layout-independent values into DTensor
params (each rank its own part; no collective); :func:`full_sum_of_squares` is an independent
oracle for any DTensor model: every param gathered (``full_tensor()``), squared in float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor import Replicate

from norm_optim.testing._internal.torch_fsdp2_patches import install_torch_fsdp2_cpu_patches
from norm_optim.testing.values import deterministic_values, named_global_parameters

__all__ = [
    "TinyTorchLM",
    "build_native_fsdp2",
    "build_torch_fsdp2_model",
    "fill_dtensor_deterministic_",
    "full_sum_of_squares",
    "native_train_step",
]


def build_torch_fsdp2_model(cfg: Any = None, *, seed: int = 1234) -> list[torch.nn.Module]:
    """This rank's model as one ``TorchFullyShardedDataParallel`` chunk, as Megatron-LM builds
    it with ``--use-torch-fsdp2 --transformer-impl local``.

    GPT on the local spec (``cfg.bf16``: in ``Float16Module``), sharded over megatron's DP×CP
    group; TP comes from the parallel state. The config says ``transformer_impl="local"``: with
    the default ``"transformer_engine"`` the wrapper also shards ``ColumnParallelLinear``
    modules inside an already sharded layer, which FSDP2 refuses. Megatron-LM allows PP = 1 and
    EP = 1 only. Pass the chunks to :func:`~norm_optim.testing.models.build_optimizer`
    (``use_distributed_optimizer`` False, ``bf16=cfg.bf16``).
    """
    from megatron.core.distributed import (
        DistributedDataParallelConfig,
        TorchFullyShardedDataParallel,
    )
    from megatron.core.transformer.module import Float16Module

    from norm_optim.testing._internal.megatron_fsdp_patches import cpu_shim_installed
    from norm_optim.testing.models import TinyGPTConfig, build_chunk, transformer_config
    from norm_optim.testing.cpu import init_rng

    if cpu_shim_installed():
        install_torch_fsdp2_cpu_patches()
    cfg = cfg if cfg is not None else TinyGPTConfig(tie_embeddings=False)
    init_rng(seed)
    config = transformer_config(cfg)
    config.transformer_impl = "local"
    gpt = build_chunk(cfg, config, None)
    model: torch.nn.Module = Float16Module(config, gpt) if cfg.bf16 else gpt
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False)
    return [TorchFullyShardedDataParallel(config, ddp_config, model)]


@torch.no_grad()
def fill_dtensor_deterministic_(
    model_chunks: Sequence[torch.nn.Module], seed: int, optimizer: Any = None
) -> None:
    """:func:`~norm_optim.testing.oracle.fill_deterministic_` for DTensor (FSDP2) params.

    Each param's layout-independent values (in its megatron-TP-local shape, which is the
    DTensor's global shape) are split by the DTensor's own placements on every rank, with no
    collective, and copied into its local shard. ``optimizer.reload_model_params()`` then
    refreshes the fp32 main params.
    """
    from torch.distributed.tensor import distribute_tensor

    for name, param in named_global_parameters(model_chunks):
        values = deterministic_values(name, param, seed).to(param.dtype)
        mesh, placements = getattr(param, "device_mesh"), getattr(param, "placements")
        param.copy_(distribute_tensor(values, mesh, placements, src_data_rank=None))
    if optimizer is not None:
        optimizer.reload_model_params()


def full_sum_of_squares(tensors: Sequence[Any]) -> float:
    """Float64 sum of squares of the whole tensors, DTensors gathered in full (a collective over
    each one's mesh: call it on every rank)."""
    sums = []
    for tensor in tensors:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        sums.append(float(full.detach().double().square().sum()))
    return math.fsum(sums)


# ---------------------------------------------------------------------------- torch-native


@dataclasses.dataclass(frozen=True)
class TinyTorchConfig:
    """A tiny language model in plain torch. ``odd`` is a dim that no mesh axis divides: its
    params' shards are uneven (and, on 4 ranks, one is empty)."""

    vocab_size: int = 64
    hidden_size: int = 32
    ffn_hidden_size: int = 64
    num_layers: int = 2
    odd: int = 5
    seq_length: int = 8


class _Block(torch.nn.Module):
    def __init__(self, cfg: TinyTorchConfig) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(cfg.hidden_size)
        self.fc1 = torch.nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.fc2 = torch.nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)
        self.gate = torch.nn.Linear(cfg.hidden_size, cfg.odd)
        self.ungate = torch.nn.Linear(cfg.odd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(h))) + self.ungate(self.gate(h))


class TinyTorchLM(torch.nn.Module):
    """Embedding, ``num_layers`` residual MLP blocks, a final norm and an untied head."""

    def __init__(self, cfg: TinyTorchConfig = TinyTorchConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = torch.nn.LayerNorm(cfg.hidden_size)
        self.head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_native_fsdp2(
    mesh_shape: tuple[int, ...],
    *,
    tp: bool = False,
    tp_every_param: bool = True,
    cfg: TinyTorchConfig = TinyTorchConfig(),
    seed: int = 0,
    lr: float = 1e-2,
) -> tuple[TinyTorchLM, torch.optim.Optimizer, dict[str, float]]:
    """A torch-native FSDP2 model, its AdamW, and each param's exact (float64) sum of squares
    before it was sharded, by name (every rank builds the same fp32 model from ``seed``: an
    independent oracle).

    Args:
        mesh_shape: ``(n,)`` FSDP over ``n`` ranks; ``(r, s)`` HSDP, replicate × shard (or,
            with ``tp``, data × tensor: the blocks' ``fc1`` / ``fc2`` column- / row-parallel over
            the second axis, FSDP over the first).
        tp: whether the second axis of a 2-D mesh is tensor parallelism.
        tp_every_param: with ``tp``, give the params TP does not split ``Replicate`` placements
            on the TP axis too (as torchtitan's ``SequenceParallel`` norms have); False leaves
            them plain copies on every TP rank, on the FSDP sub-mesh only.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = TinyTorchLM(cfg)
    exact = {name: full_sum_of_squares([p]) for name, p in model.named_parameters()}
    names = ("dp", "tp") if tp else (("replicate", "shard") if len(mesh_shape) == 2 else ("dp",))
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    fsdp_mesh = mesh
    if tp:
        _parallelize(model, mesh["tp"], every_param=tp_every_param)
        fsdp_mesh = mesh["dp"]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=fsdp_mesh, mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=lr), exact


def _parallelize(model: TinyTorchLM, tp_mesh: Any, *, every_param: bool) -> None:
    """Megatron-style TP with torch's styles: vocab-parallel embedding, column- then
    row-parallel MLP, a column-parallel head gathered to full logits; the rest replicated."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {}
    for index in range(len(model.layers)):
        plan.update(
            {f"layers.{index}.fc1": ColwiseParallel(), f"layers.{index}.fc2": RowwiseParallel()}
        )
    if every_param:
        plan.update(
            {
                "embed": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate()),
            }
        )
    parallelize_module(model, tp_mesh, plan)
    if every_param:
        # The odd-sized gate pair stays whole on every TP rank (no TP split of 5 rows).
        blocks = [cast(_Block, layer) for layer in model.layers]
        replicated = [model.norm, *(m for b in blocks for m in (b.norm, b.gate, b.ungate))]
        for module in replicated:
            _replicate(module, tp_mesh)


def _replicate(module: torch.nn.Module, mesh: Any) -> None:
    """``module``'s params as ``Replicate`` DTensors on ``mesh``, plain tensors in and out."""
    from torch.distributed.tensor import DTensor, distribute_module

    def inputs(_: Any, args: tuple, device_mesh: Any) -> tuple:
        return tuple(DTensor.from_local(a, device_mesh, [Replicate()]) for a in args)

    def outputs(_: Any, output: Any, device_mesh: Any) -> Any:
        return output.to_local()

    # torch registers input_fn as a forward pre-hook, whose return value replaces the inputs
    # (its annotation says None, hence the cast).
    distribute_module(module, mesh, input_fn=cast(Any, inputs), output_fn=outputs)


def native_train_step(model: TinyTorchLM, optimizer: torch.optim.Optimizer, seed: int) -> float:
    """One real step on random tokens (the same on every rank); returns the loss."""
    cfg = model.cfg
    tokens = torch.randint(
        cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(seed)
    )
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), torch.roll(tokens, -1, dims=1).flatten()
    )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)
