"""MIMO (``MimoModel`` + ``MimoOptimizer``, megatron-core 0.19, main): exact norms, per-module
coordinates, against the layout-independent oracle, on the real megatron-core.

Each layout builds a small vision encoder (``TransformerBlock`` + MLP projection) and a GPT
language model on gloo CPU ranks, each module on its own ``HyperCommGrid`` with its own TP / DP
(``norm_optim.testing.mimo``), and the real ``get_megatron_optimizer`` (which returns megatron's
``MimoOptimizer``: one optimizer per module, active only on that module's ranks). Every weight
gets its layout-independent value (TP shards placed by the module's own TP group), the fp32
masters are reloaded and scaled by ``MAIN_SCALE`` (not representable in bf16). The norm must be
``sqrt(MAIN_SCALE² · trainable² + frozen²)`` of the unparallel model (both modules on one rank),
to 1e-6, on every rank, with per-param norms, one all-reduce per call, the summed tensors the
optimizers' own, every element counted on one rank, and nothing of a module on a rank outside its
grid; again after a real optimizer step. megatron's global parallel state is left uninitialized
(MIMO does not use it), except in one layout where it says something else (the world as one DP
group): the module's own groups must win.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch

from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.mimo import (
    ENCODER,
    MimoLayout,
    ModuleGrid,
    build_mimo_model,
    fill_mimo_deterministic_,
    has_mimo,
    mimo_modules,
    mimo_param_shapes,
)
from norm_optim.testing.oracle import oracle_sum_of_squares

pytestmark = pytest.mark.skipif(
    not has_mimo(),
    reason="this megatron-core has no MimoOptimizer or no HyperCommGrid.register_view "
    "(the test kit builds MIMO grids with both: 0.19+)",
)

SEED_A, SEED_B = 7, 8
MAIN_SCALE = 1.0 + 2.0**-10
REL = 1e-6
TIMEOUT = 240.0

LAYOUTS = {
    # Non-colocated: each rank runs the encoder or the language model.
    "enc1-lm1": MimoLayout(2, ModuleGrid(0), ModuleGrid(1)),
    "enc-dp2-lm-tp2": MimoLayout(4, ModuleGrid(0, dp=2), ModuleGrid(2, tp=2)),
    "enc-tp2-lm-dp2-distopt": MimoLayout(
        4, ModuleGrid(0, tp=2), ModuleGrid(2, dp=2), use_distributed_optimizer=True
    ),
    "enc-dp2-frozen-lm-tp2": MimoLayout(
        4, ModuleGrid(0, dp=2), ModuleGrid(2, tp=2), freeze=(ENCODER,)
    ),
    # Colocated: both modules on the same ranks, with different TP / DP.
    "colocated-enc-dp2-lm-tp2": MimoLayout(2, ModuleGrid(0, dp=2), ModuleGrid(0, tp=2)),
}
WITH_GLOBAL_STATE = "enc-dp2-lm-tp2"
UNPARALLEL = MimoLayout(1, ModuleGrid(0), ModuleGrid(0))


def _oracle_name(name: str) -> str:
    """The test kit's name for a param of the library's per-param names (which keep the
    wrappers' ``module.`` segments and the ``modality_submodules.`` container)."""
    parts = [p for p in name.split(".") if p != "module"]
    if parts[0] == "modality_submodules":
        parts = parts[1:]
    elif parts[0] == "language_model":
        parts[0] = "language"
    return ".".join(parts)


def _optimizer_config(layout: MimoLayout) -> Any:
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=layout.use_distributed_optimizer,
        clip_grad=1.0,
    )


def _fill(model: Any, optimizer: Any, seed: int) -> None:
    fill_mimo_deterministic_(model, seed, optimizer)
    for group in optimizer.param_groups:  # every active module's fp32 masters
        for main in group["params"]:
            main.mul_(MAIN_SCALE)


def _read(optimizer: Any, counting: Any) -> dict[str, Any]:
    counting.all_reduces = 0
    total = float(optimizer.param_l2_norm())
    per_param = optimizer.param_l2_norms(per_param=True)
    return {
        "total": total,
        "expert": float(per_param.expert),
        "per_param": {_oracle_name(k): float(v) for k, v in per_param.per_param.items()},
        "collectives": counting.all_reduces / 2,
    }


def _synthetic_step(model: Any, optimizer: Any) -> None:
    """A real ``MimoOptimizer.step()`` on random gradients in DDP's grad buffers (no pipeline
    schedule needed: the norm only needs the optimizers to move their tensors)."""
    generator = torch.Generator().manual_seed(0)
    for _, module, _ in mimo_modules(model):
        for param in module.parameters():
            if param.requires_grad:
                param.main_grad.copy_(torch.randn(param.shape, generator=generator))
    success, _, _ = optimizer.step()
    assert success


def _megatron_norm(model: Any) -> float:
    """Megatron-LM's own ``calc_params_l2_norm`` on the same weights (it reads megatron's global
    parallel state, not the modules' groups)."""
    import types

    from megatron.training import global_vars
    from megatron.training.utils import calc_params_l2_norm

    global_vars.set_args(types.SimpleNamespace(use_megatron_fsdp=False, bf16=True))
    return float(calc_params_l2_norm([model]))


def _rank_body(layout: MimoLayout, global_state: bool) -> dict[str, Any]:
    from megatron.core.optimizer import get_megatron_optimizer

    from norm_optim import NormAwareOptimizer
    from norm_optim._comm import TorchCommunicator

    class Counting(TorchCommunicator):
        all_reduces = 0

        def all_reduce_sum(self, tensor, group, async_op):  # type: ignore[no-untyped-def]
            self.all_reduces += 1
            return super().all_reduce_sum(tensor, group, async_op)

    if global_state:
        init_parallel()
    model = build_mimo_model(layout, seed=3)
    inner = get_megatron_optimizer(_optimizer_config(layout), [model])
    counting = Counting()
    optimizer = NormAwareOptimizer(inner, model=model, comm=counting)
    got: dict[str, Any] = {
        "optimizer": type(inner).__name__,
        "modules": sorted(name for name, _, _ in mimo_modules(model)),
    }
    _fill(model, inner, SEED_A)
    got["init"] = _read(optimizer, counting)
    registry = optimizer.registry
    got["seen"] = sorted({_oracle_name(r.global_name).split(".")[0] for r in registry})
    owned = {p.untyped_storage().data_ptr() for g in inner.param_groups for p in g["params"]}
    owned |= {p.untyped_storage().data_ptr() for p in model.parameters() if not p.requires_grad}
    got["own_tensors"] = all(
        r.tensor.untyped_storage().data_ptr() in owned for r in registry.counted
    )
    got["counted_numel"] = registry.counted_numel
    got["without_frozen"] = float(
        NormAwareOptimizer(inner, model=model, count_frozen=False).param_l2_norm()
    )

    if global_state:
        got["megatron"] = _megatron_norm(model)
    _synthetic_step(model, inner)
    got["stepped"] = float(optimizer.param_l2_norm())
    got["rebuilt_by_step"] = optimizer.registry is not registry
    _fill(model, inner, SEED_B)
    got["after_step"] = _read(optimizer, counting)
    return got


def _unparallel_shapes() -> dict[str, dict]:
    model = build_mimo_model(UNPARALLEL)
    return {
        "all": mimo_param_shapes(model),
        "trainable": mimo_param_shapes(model, trainable_only=True),
    }


@functools.lru_cache(maxsize=None)
def _shapes() -> dict[str, dict]:
    return run_ranks(_unparallel_shapes, 1, timeout=TIMEOUT)[0]


def _oracle(seed: int, freeze: tuple[str, ...]) -> dict[str, Any]:
    shapes = _shapes()
    sums = oracle_sum_of_squares(shapes["all"], seed)
    trainable = {n for n in shapes["trainable"] if n.split(".")[0] not in freeze}
    scaled = {n: s * (MAIN_SCALE**2 if n in trainable else 1.0) for n, s in sums.items()}
    return {
        "total": math.sqrt(math.fsum(scaled.values())),
        "trainable": math.sqrt(math.fsum(s for n, s in scaled.items() if n in trainable)),
        "per_param": {n: math.sqrt(s) for n, s in scaled.items()},
        "numel": sum(math.prod(s) for s in shapes["all"].values()),
    }


@functools.lru_cache(maxsize=None)
def _run(name: str) -> tuple[dict[str, Any], ...]:
    layout = LAYOUTS[name]
    return tuple(
        run_ranks(_rank_body, layout.world, layout, name == WITH_GLOBAL_STATE, timeout=TIMEOUT)
    )


def _check_read(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert got["total"] == pytest.approx(expected["total"], rel=REL), what
    assert got["expert"] == 0.0, what
    assert set(got["per_param"]) == set(expected["per_param"]), f"{what}: per-param names"
    for param_name, value in got["per_param"].items():
        assert value == pytest.approx(expected["per_param"][param_name], rel=REL), param_name
    assert got["collectives"] == 1, f"{what}: one all-reduce per call, per-param included"


def _grid_ranks(grid: ModuleGrid) -> range:
    return range(grid.offset, grid.offset + grid.size)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mimo_norm_matches_unparallel_oracle(name: str) -> None:
    layout = LAYOUTS[name]
    a, b = _oracle(SEED_A, layout.freeze), _oracle(SEED_B, layout.freeze)
    results = _run(name)
    for rank, got in enumerate(results):
        where = f"rank {rank}"
        assert got["optimizer"] == "MimoOptimizer"
        expected_modules = sorted(
            m
            for m, grid in ((ENCODER, layout.encoder), ("language", layout.language))
            if rank in _grid_ranks(grid)
        )
        assert got["modules"] == expected_modules, f"{where} holds other modules"
        assert got["seen"] == expected_modules, f"{where}: a module outside its grid was read"
        _check_read(got["init"], a, f"{where}, at init")
        assert got["own_tensors"], "a summed tensor is a copy, not an optimizer's own"
        assert got["without_frozen"] == pytest.approx(a["trainable"], rel=REL), "count_frozen"
        assert got["stepped"] != pytest.approx(a["total"], rel=1e-4), "the step did nothing"
        assert not got["rebuilt_by_step"], "a step keeps the optimizers' tensors: no rebuild"
        _check_read(got["after_step"], b, f"{where}, after a step")
    assert sum(r["counted_numel"] for r in results) == a["numel"], "an element counted twice"


def test_megatron_calc_params_l2_norm_is_wrong_on_mimo() -> None:
    """The same run: Megatron-LM's ``calc_params_l2_norm`` (this megatron-core) reduces over
    the global parallel state's groups, so each rank reports the modules it holds, some of
    them TP shards only; norm_optim is exact there."""
    expected = _oracle(SEED_A, ())["total"]
    results = _run(WITH_GLOBAL_STATE)
    assert all(got["init"]["total"] == pytest.approx(expected, rel=REL) for got in results)
    assert all(got["megatron"] != pytest.approx(expected, rel=1e-3) for got in results), [
        got["megatron"] for got in results
    ]


def _subgroup_body() -> str:
    from megatron.core.optimizer import get_megatron_optimizer

    from norm_optim import NormAwareOptimizer
    from norm_optim._errors import ParallelStateError

    layout = LAYOUTS["enc1-lm1"]
    model = build_mimo_model(layout)
    inner = get_megatron_optimizer(_optimizer_config(layout), [model])
    rank = torch.distributed.get_rank()
    alone = [torch.distributed.new_group([r]) for r in range(2)][rank]
    try:
        NormAwareOptimizer(inner, model=model, group=alone)
    except ParallelStateError as exc:
        return str(exc)
    return "accepted"


def test_reduce_group_must_hold_every_module() -> None:
    """A reduction group with one module's ranks only would leave the other module out."""
    for message in run_ranks(_subgroup_body, 2, timeout=TIMEOUT):
        assert "lacks ranks" in message
