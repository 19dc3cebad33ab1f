"""Audit: every param of every model the test kit builds is classified as megatron declares it.

For each model (GPTModel and HybridModel; dense, MoE, shared experts, SwiGLU, MTP, GTP,
learnable and off-by-one sinks, tied and untied; TP, ETP, EP, PP, VPP, CP; DDP and, since 0.19,
Megatron-FSDP), at TP = 2, on real gloo ranks:

- each param's TP classification in the registry (``ParamRecord.tp_split``) equals the truth,
  taken from shapes alone: a param is split when this rank holds fewer of its elements (before
  GTP sharding) than the same model built on one rank has; and it comes from its declaration
  (``split_from == "declaration"``): megatron declares every param it has;
- the params where megatron's ``tensor_model_parallel`` marker disagrees with that truth are
  exactly the expected ones (today: the learnable attention sink ``softmax_offset``), and the
  registry notes exactly those records;
- reading the declarations runs no collective.

Then the rule itself in one process: the declaration wins, a disagreement is noted, a param
without one falls back to the markers and says why, a plain torch model keeps the markers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Iterator

import pytest
import torch

from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer
from norm_optim.testing.oracle import global_param_shapes, named_global_parameters
from tests.support.layouts import (
    DENSE,
    GTP_DENSE,
    HYBRID,
    MTP,
    SINKS,
    SINKS_MOE,
    SMALL,
    SMALL_MOE,
    Layout,
)
from norm_optim._versions import megatron_at_least
from tests.support.mocked_state import TinyMoE, float16_optimizer, single_process

SINK = {"decoder.layers.*.self_attention.core_attention.softmax_offset"}
MTP_SINK = {"mtp.layers.*.*.self_attention.core_attention.softmax_offset"}


def _learnable(cfg: TinyGPTConfig, **changes: Any) -> TinyGPTConfig:
    return dataclasses.replace(cfg, softmax_type="learnable", **changes)


@dataclasses.dataclass(frozen=True)
class Audit:
    """A layout and the params (layer indices as ``*``) whose marker disagrees with the truth."""

    layout: Layout
    unmarked: frozenset[str] = frozenset()
    # False where megatron sets no markers at all (no weight init before 0.18.2): then only
    # the registry's notes (markers plus layer table) are checked against ``unmarked``.
    raw_markers: bool = True
    # Built as one Megatron-FSDP chunk (its DTensor stand-ins; declarations read since 0.19).
    megatron_fsdp: bool = False

    def marks(self) -> list[Any]:
        if self.megatron_fsdp and not megatron_at_least(0, 19):
            return [pytest.mark.skip(reason="Megatron-FSDP declarations are read since 0.19")]
        return self.layout.marks()


AUDITS = {
    "gpt-tp2": Audit(Layout(2, SMALL, tp=2)),
    "gpt-tp2-sinks": Audit(Layout(2, SINKS, tp=2), SINK),
    "gpt-tp2-off-by-one": Audit(
        Layout(2, dataclasses.replace(SMALL, softmax_type="off-by-one"), tp=2)
    ),
    "gpt-tp2-untied-sinks": Audit(Layout(2, _learnable(SMALL, tie_embeddings=False), tp=2), SINK),
    "gpt-tp2-swiglu-sinks": Audit(Layout(2, _learnable(SMALL, gated_linear_unit=True), tp=2), SINK),
    "gpt-tp2-no-init-sinks": Audit(
        Layout(2, _learnable(SMALL, perform_initialization=False), tp=2), SINK, raw_markers=False
    ),
    "gpt-tp2-pp2-sinks": Audit(Layout(4, SINKS, tp=2, pp=2), SINK),
    "gpt-tp2-pp2-vpp2-sinks": Audit(Layout(4, _learnable(DENSE), tp=2, pp=2, vpp=2), SINK),
    "gpt-tp2-cp2-sinks": Audit(Layout(4, SINKS, tp=2, cp=2), SINK),
    "mtp-tp2-pp2-sinks": Audit(
        Layout(4, _learnable(MTP, num_layers=2), tp=2, pp=2), SINK | MTP_SINK
    ),
    "mtp-tp2-untied-sinks": Audit(
        Layout(2, _learnable(MTP, num_layers=2, tie_embeddings=False), tp=2), SINK | MTP_SINK
    ),
    "moe-tp2-ep2-etp2-sinks": Audit(Layout(4, SINKS_MOE, tp=2, ep=2), SINK),
    "moe-tp2-ep2-etp1-sinks": Audit(Layout(4, SINKS_MOE, tp=2, ep=2, etp=1), SINK),
    "moe-tp2-ep1-etp1-sinks": Audit(Layout(2, SINKS_MOE, tp=2, etp=1), SINK),
    "moe-tp2-ep1-etp2": Audit(Layout(2, SMALL_MOE, tp=2)),
    "moe-shared-experts-tp2-ep2-sinks": Audit(
        Layout(4, _learnable(SMALL_MOE, moe_shared_expert_intermediate_size=32), tp=2, ep=2), SINK
    ),
    "gtp-tp2-gtp2-sinks": Audit(Layout(4, _learnable(GTP_DENSE, num_layers=2), tp=2, gtp=2), SINK),
    "hybrid-tp2-ep2-sinks": Audit(Layout(4, _learnable(HYBRID), tp=2, ep=2, etp=1), SINK),
    "megatron-fsdp-tp2-dp2-sinks": Audit(Layout(4, SINKS, tp=2), SINK, megatron_fsdp=True),
    "megatron-fsdp-moe-tp2-ep2-sinks": Audit(
        Layout(4, SINKS_MOE, tp=2, ep=2), SINK, megatron_fsdp=True
    ),
}


def _pattern(name: str) -> str:
    """A global name with its layer index as ``*`` (expert indices kept: none disagree), and an
    MTP layer's inner layer as ``*`` (``transformer_layer``, ``mtp_model_layer`` since 0.19)."""
    name = re.sub(r"^mtp\.layers\.\d+\.\w+\.", "mtp.layers.*.*.", name)
    return re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.*.", name)


def _unparallel_numels(cfg: TinyGPTConfig) -> dict[str, int]:
    """Rank body: each param's element count in the same model built on one rank."""
    init_parallel()
    return {n: int(torch.Size(s).numel()) for n, s in global_param_shapes(build_model(cfg)).items()}


def _tp_local_numel(param: torch.Tensor) -> int:
    """Elements of the param this rank's TP shard has, before GTP cut it into dim-0 shards
    (megatron-core >= 0.19: ``pad_length`` zero rows appended, then split over the GTP group)."""
    if not getattr(param, "is_gtp_weight_remat", False):
        return param.numel()
    group = getattr(param, "group")
    rows = param.shape[0] * torch.distributed.get_world_size(group) - int(param.pad_length)
    return rows * (param.numel() // param.shape[0])


@contextlib.contextmanager
def _counting_collectives() -> Iterator[list[str]]:
    """Counts every torch.distributed collective or point-to-point call made inside."""
    names = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
        "send",
        "recv",
        "isend",
        "irecv",
        "new_group",
    )
    calls: list[str] = []
    originals = {n: getattr(torch.distributed, n) for n in names}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(torch.distributed, name, counted(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.distributed, name, original)


def _rank_body(layout: Layout, megatron_fsdp: bool) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from norm_optim import NormAwareOptimizer
    from norm_optim._megatron.declarations import read_declarations
    from norm_optim.testing.megatron_fsdp import build_fsdp_model

    init_parallel(**layout.parallel())
    chunks = (
        build_fsdp_model(layout.cfg)
        if megatron_fsdp
        else build_model(layout.cfg, use_distributed_optimizer=True)
    )
    with _counting_collectives() as calls:
        declarations = read_declarations(chunks)
    registry = NormAwareOptimizer(build_optimizer(chunks), model=chunks).registry
    records = {id(r.param): r for r in registry}
    params = []
    for name, param in named_global_parameters(chunks):
        record = records[id(param)]
        params.append(
            dict(
                name=name,
                numel=_tp_local_numel(param),
                marked=bool(getattr(param, "tensor_model_parallel", False)),
                # The group that would split it: nothing to disagree about at size 1.
                group_size=ps.get_expert_tensor_parallel_world_size()
                if ".mlp.experts." in name
                else ps.get_tensor_model_parallel_world_size(),
                tp_split=record.tp_split,
                split_from=str(record.split_from),
                note=record.note,
            )
        )
    return {
        "collectives": calls,
        "read": declarations.read or declarations.unavailable,
        "params": params,
    }


@pytest.mark.parametrize("name", [pytest.param(n, marks=a.marks()) for n, a in AUDITS.items()])
def test_every_param_classified_as_declared(name: str) -> None:
    audit = AUDITS[name]
    whole = run_ranks(_unparallel_numels, 1, audit.layout.cfg)[0]
    results = run_ranks(
        _rank_body, audit.layout.world, audit.layout, audit.megatron_fsdp, timeout=240
    )

    unmarked: set[str] = set()
    noted: set[str] = set()
    for rank, got in enumerate(results):
        assert got["read"] is True, f"rank {rank}: {got['read']}"
        assert got["collectives"] == [], f"rank {rank}"
        for p in got["params"]:
            split = p["numel"] < whole[p["name"]]
            where = f"rank {rank}: {p['name']}"
            assert p["tp_split"] == split, where
            assert p["split_from"] == "declaration", where
            if p["marked"] != split and p["group_size"] > 1:
                unmarked.add(_pattern(p["name"]))
            if p["note"] is not None:
                assert "declared split" in p["note"] or "declared replicated" in p["note"], where
                noted.add(_pattern(p["name"]))
    assert noted == audit.unmarked
    if audit.raw_markers:
        assert unmarked == audit.unmarked


# ------------------------------------------------------------------ the rule, in one process


def _param(**markers: Any) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(4))
    for key, value in markers.items():
        setattr(param, key, value)
    return param


def _declared(split: bool) -> Any:
    from norm_optim._megatron import Declaration

    return Declaration("layer.weight", (8,), (2,) if split else (1,), (0,), (0, 0, 0))


def _traits(param: torch.nn.Parameter, tp_size: int = 2, **declarations: Any) -> Any:
    from norm_optim._comm import TorchCommunicator
    from norm_optim._megatron import ModelStructure, param_traits

    structure = ModelStructure(declarations=_declarations(**declarations), tp_size=tp_size)
    return param_traits(param, structure, TorchCommunicator())


def _declarations(**fields: Any) -> Any:
    from norm_optim._megatron import Declarations

    return Declarations(**fields)


@pytest.mark.parametrize(
    "declared,marker,note",
    [
        (
            True,
            None,
            "declared split on dim 0 in 2 parts as 'layer.weight', but the markers say "
            "replicated (no marker, not in the layer table): the declaration counts",
        ),
        (
            False,
            True,
            "declared replicated across TP as 'layer.weight', but the markers say "
            "TP-split (tensor_model_parallel=True): the declaration counts",
        ),
        (True, True, None),
        (False, None, None),
    ],
)
def test_the_declaration_wins_and_a_disagreement_is_noted(
    declared: bool, marker: bool | None, note: str | None
) -> None:
    param = _param(**({} if marker is None else {"tensor_model_parallel": marker}))
    traits = _traits(param, by_param={id(param): _declared(declared)}, read=True)
    assert (traits.tp_split, traits.split_from, traits.note) == (declared, "declaration", note)


def test_nothing_to_disagree_about_at_tp1() -> None:
    param = _param(tensor_model_parallel=True)
    traits = _traits(param, tp_size=1, by_param={id(param): _declared(False)}, read=True)
    assert (traits.tp_split, traits.split_from, traits.note) == (False, "declaration", None)


@pytest.mark.parametrize(
    "declarations,note",
    [
        # A megatron model that declares other params but not this one.
        (dict(by_param={}, read=True), "no sharding declaration"),
        # A megatron model whose declarations could not be built.
        (
            dict(unavailable="sharded_state_dict failed: boom"),
            "declarations sharded_state_dict failed: boom",
        ),
        # Not a megatron model (plain torch): the markers are its rule, silently.
        (dict(), None),
    ],
)
def test_without_a_declaration_the_markers_decide_and_the_record_says_why(
    declarations: dict, note: str | None
) -> None:
    param = _param(tensor_model_parallel=True)
    traits = _traits(param, **declarations)
    assert (traits.tp_split, traits.split_from, traits.note) == (True, "marker", note)


@single_process
def test_a_plain_torch_model_keeps_the_markers_without_notes() -> None:
    from norm_optim import NormAwareOptimizer

    model = TinyMoE()
    registry = NormAwareOptimizer(float16_optimizer(model), model=model).registry
    assert not registry.declarations.read and registry.noted == []
    assert all(r.split_from == "marker" for r in registry)
    assert registry["column"].tp_split and not registry["norm"].tp_split
