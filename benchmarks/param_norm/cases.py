"""The models and layouts the benchmark measures, and how ``--quick`` / ``--cases`` pick them.

One table, so that the full run, the quick run and the plots' sweeps cannot disagree on what a
case is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from norm_optim.testing.models import TinyGPTConfig

Sweep = Literal["elements", "tensors", "table only"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One model on one world size; the layout follows from the kind and the world.

    Dense models are pure data parallel; MoE models add expert parallelism 2 when the world is
    even, so expert params are sharded over a different (expert-DP) group than dense ones. All
    cases use the distributed optimizer, or Megatron-FSDP (``optim_grads_params``) when
    ``megatron_fsdp``, or torch FSDP2 (megatron's ``TorchFullyShardedDataParallel``, the Float16
    optimizer, untied embeddings) when ``torch_fsdp2``.
    """

    name: str
    model: TinyGPTConfig
    world: int
    megatron_fsdp: bool = False
    torch_fsdp2: bool = False

    @property
    def kind(self) -> str:
        return "moe" if self.model.num_experts else "dense"

    @property
    def layout(self) -> dict[str, int]:
        """``init_parallel`` keyword arguments."""
        return {"ep": 2} if self.kind == "moe" and self.world % 2 == 0 else {}

    def at_world(self, world: int) -> Case:
        """The same model on another world size (torchrun runs every model at its world)."""
        return dataclasses.replace(self, world=world)


@dataclasses.dataclass(frozen=True)
class Model:
    """A row of the case table: a model, the worlds it runs on, and the plot it belongs to."""

    name: str
    config: TinyGPTConfig
    worlds: tuple[int, ...]  # the full run
    quick_worlds: tuple[int, ...]  # ``--quick``
    sweep: Sweep = "table only"


def _dense(hidden: int, layers: int, vocab: int) -> TinyGPTConfig:
    return TinyGPTConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=8,
        vocab_size=vocab,
        seq_length=16,
    )


def _moe(hidden: int, layers: int, experts: int, ffn: int) -> TinyGPTConfig:
    # Many small experts: the tensor count grows as 2 x experts x layers.
    return TinyGPTConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=4,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        num_experts=experts,
        vocab_size=1024,
        seq_length=16,
    )


MODELS: tuple[Model, ...] = (
    Model("dense-s", _dense(128, 8, 1024), (1, 4), (1, 4), "elements"),  # 1.7e6 elements, 100 t.
    Model("dense-m", _dense(512, 8, 4096), (1, 4), (1,), "elements"),  # 2.7e7
    Model("dense-l", _dense(1024, 8, 8192), (1, 4), (), "elements"),  # 1.1e8
    Model("dense-xl", _dense(2048, 6, 8192), (1,), (), "elements"),  # 3.2e8
    Model("moe-s", _moe(64, 2, 16, 128), (1, 4), (1,), "tensors"),  # 82 tensors
    Model("moe-m", _moe(64, 4, 128, 64), (1, 4), (4,), "tensors"),  # 1,056 tensors
    Model("moe-l", _moe(64, 4, 640, 64), (1, 4), (1,), "tensors"),  # 5,152 tensors, 2.1e7 elem.
    Model("moe-xl", _moe(256, 4, 640, 256), (1,), (), "table only"),  # 5,152 t., 3.4e8 elements
)
# The same models under Megatron-FSDP, named ``fsdp-<model>``: (model, worlds, quick worlds).
FSDP_MODELS: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = (
    ("dense-m", (4,), ()),
    ("moe-m", (4,), (4,)),
)
# The same dense models under torch FSDP2 (untied embeddings), named ``fsdp2-<model>``.
TORCH_FSDP2_MODELS: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = (
    ("dense-s", (4,), (4,)),
    ("dense-m", (4,), ()),
)


def sweep_of(case_name: str) -> Sweep:
    """The plot a case's rows belong to (Megatron-FSDP cases and unknown names: none)."""
    return next((m.sweep for m in MODELS if m.name == case_name), "table only")


def _all_cases(quick: bool) -> list[Case]:
    cases = [
        Case(m.name, m.config, world)
        for m in MODELS
        for world in (m.quick_worlds if quick else m.worlds)
    ]
    configs = {m.name: m.config for m in MODELS}
    cases += [
        Case(f"fsdp-{name}", configs[name], world, megatron_fsdp=True)
        for name, full, fast in FSDP_MODELS
        for world in (fast if quick else full)
    ]
    cases += [
        Case(
            f"fsdp2-{name}",
            dataclasses.replace(configs[name], tie_embeddings=False),
            world,
            torch_fsdp2=True,
        )
        for name, full, fast in TORCH_FSDP2_MODELS
        for world in (fast if quick else full)
    ]
    return cases


def select_cases(quick: bool, names: Sequence[str], worlds: Sequence[int]) -> list[Case]:
    """The cases to run, in a stable order (world 1 first: it warms nothing for world 4)."""
    cases = [
        c
        for c in _all_cases(quick)
        if (not names or c.name in names) and (not worlds or c.world in worlds)
    ]
    return sorted(cases, key=lambda c: c.world)
