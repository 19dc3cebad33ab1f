"""MIMO models (``megatron.core.models.mimo.MimoModel``, megatron-core >= 0.19) on CPU ranks.

A :class:`MimoLayout` places each module (a vision encoder and the language model) on its own
``HyperCommGrid``: its ranks, TP and DP sizes. :func:`build_mimo_model` builds the model as
megatron's own MIMO tests do (a ``TransformerBlock`` encoder with an MLP projection, a
``GPTModel`` language model, each module built only on its grid's ranks, each wrapped in
megatron DDP with its own ``ProcessGroupCollection``), on the local (non-TE) spec; then
``get_megatron_optimizer(config, [mimo_model])`` returns megatron's ``MimoOptimizer``. Nothing
here needs a pipeline schedule: the norm tests fill the weights with the oracle's values
(:func:`fill_mimo_deterministic_`) instead of training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from norm_optim.testing._internal.mimo_patches import install_mimo_cpu_patches
from norm_optim.testing.models import cpu_config_fields
from norm_optim.testing.values import deterministic_values, global_shape

__all__ = [
    "ENCODER",
    "MimoLayout",
    "ModuleGrid",
    "build_mimo_model",
    "fill_mimo_deterministic_",
    "has_mimo",
    "mimo_modules",
    "mimo_param_shapes",
]

ENCODER = "images"
_IMAGE_TOKEN = 50
_GRID_DIMS = ["tp", "cp", "pp", "dp", "ep", "expt_dp"]
_EXPERT_VIEW = "expert"
# Every group a module's ProcessGroupCollection (and get_megatron_optimizer) needs.
_GROUPS = {
    "tp": ["tp"],
    "cp": ["cp"],
    "pp": ["pp"],
    "dp": ["dp"],
    "dp_cp": ["dp", "cp"],
    "ep": ["ep"],
    "expt_dp": ["expt_dp"],
    "mp": ["tp", "pp"],
    "tp_ep_pp": ["tp", "ep", "pp"],
    "intra_dist_opt": ["tp", "cp", "dp", "pp"],
}


def has_mimo() -> bool:
    """Whether the installed megatron-core has what this kit builds MIMO models with: MIMO's
    optimizer (``MimoOptimizer``) and grid views (``HyperCommGrid.register_view``), both 0.19+
    (0.17 / 0.18 ship a ``MimoOptimizer`` but no grid views)."""
    try:
        from megatron.core.hyper_comm_grid import HyperCommGrid
        from megatron.core.models.mimo import optimizer  # noqa: F401
    except ImportError:
        return False
    return hasattr(HyperCommGrid, "register_view")


@dataclasses.dataclass(frozen=True)
class ModuleGrid:
    """One module's ranks ``[offset, offset + tp * dp)`` and its TP / DP sizes."""

    offset: int
    tp: int = 1
    dp: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.dp


@dataclasses.dataclass(frozen=True)
class MimoLayout:
    """A MIMO model on ``world`` ranks: the encoder's and the language model's grids.

    Grids on the same ranks are colocated (every rank runs both), disjoint ones are not.
    ``freeze`` names the modules whose params are frozen before the optimizer is built.
    """

    world: int
    encoder: ModuleGrid
    language: ModuleGrid
    hidden_size: int = 32
    num_layers: int = 2
    vocab_size: int = 64
    seq_length: int = 8
    use_distributed_optimizer: bool = False
    freeze: tuple[str, ...] = ()


def _grid(spec: ModuleGrid) -> Any:
    from megatron.core.hyper_comm_grid import HyperCommGrid

    grid = HyperCommGrid(
        shape=[spec.tp, 1, 1, spec.dp, 1, 1],
        dim_names=_GRID_DIMS,
        rank_offset=spec.offset,
        backend="gloo",
    )
    for dims in _GROUPS.values():  # a collective over the world: every rank, same order
        grid.create_pg(dims)
    # megatron-core 0.19's get_mimo_optimizer reads the expert groups from an "expert" view
    # (models/mimo/optimizer.py, _get_pg_collection_for_optimizer).
    grid.register_view(
        _EXPERT_VIEW,
        shape=[spec.tp, 1, spec.dp, 1],
        dim_names=["expt_tp", "pp", "expt_dp", "ep"],
        shared_dims=["pp"],
    )
    grid.create_pg(["expt_tp", "ep", "pp"], view=_EXPERT_VIEW)
    grid.create_pg(["expt_dp"], view=_EXPERT_VIEW)
    return grid


def _pg_collection(grid: Any) -> Any:
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection()
    for name, dims in _GROUPS.items():
        setattr(groups, name, grid.get_pg(dims))
    groups.expt_tp = groups.tp  # no experts: expert TP as TP
    groups.intra_dp_cp, groups.intra_expt_dp = groups.dp_cp, groups.expt_dp
    groups.embd = groups.pos_embd = None  # PP = 1: no embedding groups to sync
    return groups


def _config(layout: MimoLayout, tp: int, num_layers: int) -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        **cpu_config_fields(),
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # variable_seq_lengths refuses the default
    )


def _specs(layout: MimoLayout, encoder_pg: Any, language_pg: Any) -> tuple[Any, Any]:
    """The language model's and the vision submodule's ``ModuleSpec`` (local spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock

    language = ModuleSpec(
        module=GPTModel,
        params=dict(
            config=_config(layout, layout.language.tp, layout.num_layers),
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=layout.vocab_size,
            max_sequence_length=layout.seq_length,
            pg_collection=language_pg,
        ),
    )
    encoder_config = _config(layout, layout.encoder.tp, layout.num_layers)
    projection_config = dataclasses.replace(
        _config(layout, layout.encoder.tp, 1), ffn_hidden_size=layout.hidden_size
    )
    encoder = ModuleSpec(
        module=TransformerBlock,
        params=dict(
            config=encoder_config, spec=get_gpt_layer_local_spec(), pg_collection=encoder_pg
        ),
    )
    projection = ModuleSpec(
        module=MultimodalProjector,
        params=dict(
            config=projection_config,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            projector_type="mlp",
            input_size=layout.hidden_size,
            tp_group=encoder_pg.tp,
        ),
    )
    vision = ModuleSpec(
        module=VisionModalitySubmodules,
        params=dict(pg_collection=encoder_pg),
        submodules=dict(encoders={"clip_encoder": encoder}, input_projections=[projection]),
    )
    return language, vision


def build_mimo_model(layout: MimoLayout, seed: int = 1234) -> Any:
    """This rank's ``MimoModel`` (bf16), each module it holds in megatron DDP with the
    module's own process groups; pass ``[model]`` to ``get_megatron_optimizer``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.mimo import MimoModel, MimoModelConfig
    from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY

    from norm_optim.testing.cpu import init_rng

    grids = {ENCODER: _grid(layout.encoder), MIMO_LANGUAGE_MODULE_KEY: _grid(layout.language)}
    pgs = {name: _pg_collection(grid) for name, grid in grids.items()}
    language_spec, vision_spec = _specs(layout, pgs[ENCODER], pgs[MIMO_LANGUAGE_MODULE_KEY])
    init_rng(seed)
    with install_mimo_cpu_patches():
        model = MimoModel(
            MimoModelConfig(
                language_model_spec=language_spec,
                modality_submodules_spec={ENCODER: vision_spec},
                special_token_ids={ENCODER: _IMAGE_TOKEN},
                module_to_grid_map=grids,
            )
        )
    model.to(torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=layout.use_distributed_optimizer, grad_reduce_in_fp32=True
    )
    for name, module, pg in _modules(model, pgs):
        if name in layout.freeze:
            module.requires_grad_(False)
        wrapped = DistributedDataParallel(
            config=_module_config(module), ddp_config=ddp_config, module=module, pg_collection=pg
        )
        if name == MIMO_LANGUAGE_MODULE_KEY:
            model.language_model = wrapped
        else:
            model.modality_submodules[name] = wrapped
    return model


def _module_config(module: Any) -> Any:
    config = getattr(module, "config", None)
    return config if config is not None else module.encoders["clip_encoder"].config


def _modules(model: Any, pgs: dict[str, Any] | None = None) -> Iterator[tuple[str, Any, Any]]:
    """(name, module, its process groups) for each module this rank holds."""
    from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY
    from megatron.core.utils import unwrap_model

    held = dict(model.modality_submodules.items())
    if model.language_model is not None:
        held[MIMO_LANGUAGE_MODULE_KEY] = model.language_model
    for name, module in held.items():
        pg = pgs[name] if pgs is not None else unwrap_model(module).pg_collection
        yield name, module, pg


def mimo_modules(model: Any) -> list[tuple[str, Any, Any]]:
    """(name, module, its ``ProcessGroupCollection``) for each module this rank holds."""
    return list(_modules(model))


def _named_params(model: Any) -> Iterator[tuple[str, torch.nn.Parameter, Any]]:
    """(layout-independent name, param, its module's TP group) of this rank's params."""
    from megatron.core.utils import unwrap_model

    for name, module, pg in _modules(model):
        for pname, param in unwrap_model(module).named_parameters():
            yield f"{name}.{pname}", param, pg.tp


@torch.no_grad()
def fill_mimo_deterministic_(model: Any, seed: int, optimizer: Any = None) -> None:
    """The oracle's layout-independent values in every param (TP shards placed by their
    module's own TP group); ``optimizer.reload_model_params()`` copies them into the fp32
    masters."""

    for name, param, tp_group in _named_params(model):
        param.copy_(deterministic_values(name, param, seed, tp_group=tp_group))
    if optimizer is not None:
        optimizer.reload_model_params()


def mimo_param_shapes(model: Any, *, trainable_only: bool = False) -> dict[str, tuple[int, ...]]:
    """Global name -> global shape of every param of the MIMO model, gathered over the world
    (each rank knows the modules it holds)."""

    local = {
        name: global_shape(name, param, tp_group=tp_group)
        for name, param, tp_group in _named_params(model)
        if param.requires_grad or not trainable_only
    }
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    merged: dict[str, tuple[int, ...]] = {}
    for shapes in gathered:
        for name, shape in shapes.items():
            if merged.setdefault(name, shape) != shape:
                raise AssertionError(f"{name}: ranks disagree on its global shape")
    return dict(sorted(merged.items()))
