"""torch FSDP2 (``fully_shard``): exact norms read from the placements of the DTensors the
optimizer owns, on both routes a user takes, against independent oracles, on every rank.

**Megatron's** ``TorchFullyShardedDataParallel`` (Megatron-LM's ``--use-torch-fsdp2``) over the
tiny GPT (untied embeddings, local spec) with the real ``get_megatron_optimizer``: the Float16
optimizer (bf16; its fp32 main params are DTensors, nudged by ``MAIN_SCALE`` off the bf16 weights
so that a norm of the bf16 weights would be off) or the FP32 optimizer; DP and TP×DP. Oracle: the
layout-independent values and the shapes of the same model built without any parallelism.
Megatron's wrapper trains only on megatron-core >= 0.19 (before, ``finalize_model_grads`` passes
``force_all_reduce=`` to a ``finish_grad_sync()`` that does not take it): there the run checks
the norm again after real steps; everywhere at init and after a DCP save / load. Megatron-LM's
own ``calc_params_l2_norm`` is shown wrong in the same run.

**Torch-native** ``fully_shard`` over the blocks and the root of a plain torch model with
``MixedPrecisionPolicy(param_dtype=bf16)`` and ``torch.optim.AdamW``, no megatron parallel state:
1-D FSDP (on 4 ranks one shard of an odd-sized param is empty), HSDP (replicate × shard), and a
data × tensor mesh (``parallelize_module`` TP, then FSDP: 2-D placements, ``_StridedShard``).
Oracle: the same model before sharding (float64), then every param gathered whole
(``full_tensor()``) after real steps and after a DCP save / load.

Every read is total, dense / expert and per-param (layout-independent names), one all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tempfile
from typing import Any

import pytest
import torch

from norm_optim._errors import ParallelStateError, UnknownParamError, UnsupportedOptimizerError
from norm_optim.testing import RankFailedError, init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer, train_step
from norm_optim.testing.oracle import (
    fill_deterministic_,
    global_param_shapes,
    oracle_sum_of_squares,
)
from norm_optim._versions import megatron_at_least
from tests.support.layouts import SMALL, SMALL_MOE, Layout
from tests.support.fsdp_body import (
    CountingCommunicator,
    read_after_move,
    read_after_steps,
    run_with_directory,
)
from tests.support.reads import MAIN_SCALE, REL, check_read, read_norms

SEED_A, SEED_B = 7, 8
TIMEOUT = 180.0
# 0.16 to 0.18 only: finalize_model_grads there passes force_all_reduce= to a
# finish_grad_sync() that does not take it (0.14 and 0.15 do not pass it; 0.19 takes it).
TRAINS = megatron_at_least(0, 19) or not megatron_at_least(0, 16)
NO_TRAINING = (
    "megatron-core 0.16 to 0.18: TorchFullyShardedDataParallel cannot train "
    "(finalize_model_grads passes force_all_reduce= to its finish_grad_sync())"
)

UNTIED = dataclasses.replace(SMALL, tie_embeddings=False)  # Megatron-LM's FSDP2 requires it
MEGATRON_LAYOUTS = {
    "dp2": Layout(2, UNTIED),
    "dp4": Layout(4, UNTIED),
    "tp2-dp2": Layout(4, UNTIED, tp=2),
    "dp2-fp32": Layout(2, dataclasses.replace(UNTIED, bf16=False)),
    "moe-dp2": Layout(2, dataclasses.replace(SMALL_MOE, tie_embeddings=False)),
}


def _expected(sums: dict[str, float]) -> dict[str, Any]:
    return {
        "total": math.sqrt(math.fsum(sums.values())),
        "expert": math.sqrt(math.fsum(s for n, s in sums.items() if ".experts." in n)),
        "per_param": {n: math.sqrt(s) for n, s in sums.items()},
    }


# ------------------------------------------------------------------ Megatron's wrapper


def _unparallel_shapes(cfg: TinyGPTConfig) -> dict[str, tuple[int, ...]]:
    """Rank body: the same model on one rank, no parallelism, plain DDP (the oracle's shapes)."""
    init_parallel()
    return global_param_shapes(build_model(cfg))


@functools.lru_cache(maxsize=None)
def _megatron_oracle(cfg: TinyGPTConfig, seed: int) -> dict[str, Any]:
    shapes = run_ranks(_unparallel_shapes, 1, cfg)[0]
    sums = oracle_sum_of_squares(shapes, seed)
    return {"shapes": shapes, **_expected({n: s * MAIN_SCALE**2 for n, s in sums.items()})}


def _fp32_tensors(chunks: list) -> dict[int, Any]:
    """``id(model param)`` -> the fp32 DTensor the optimizer steps for it: the Float16
    optimizer's ``main_param`` (set on the bf16 DTensor param), else the fp32 param itself."""
    return {id(p): getattr(p, "main_param", p) for chunk in chunks for p in chunk.parameters()}


def _fill(chunks: list, optimizer: Any, seed: int) -> None:
    """Layout-independent values into every DTensor, main params reloaded, then nudged."""
    fill_deterministic_(chunks, seed, optimizer)
    for main in _fp32_tensors(chunks).values():
        main._local_tensor.mul_(MAIN_SCALE)


def _main_state_dict(chunk: Any) -> dict[str, Any]:
    """What a DCP checkpoint of this model needs for its norm: the module's DTensors and the
    optimizer's fp32 main DTensors (Megatron-LM's ``torch_dcp`` saves both). The DTensors span
    the DP mesh only: keys carry the TP rank, as TP ranks hold different tensors of one name."""
    from megatron.core import parallel_state as ps

    prefix = f"tp{ps.get_tensor_model_parallel_rank()}"
    mains = _fp32_tensors([chunk])
    return {
        f"{prefix}.model": chunk.state_dict(),
        f"{prefix}.main": {n: mains[id(p)] for n, p in chunk.named_parameters()},
    }


def _megatron_norm(chunks: list, bf16: bool) -> float | None:
    """Megatron-LM's own ``calc_params_l2_norm`` under ``--use-torch-fsdp2`` (None where
    megatron-core ships no ``megatron.training``, as 0.16.1)."""
    try:
        from megatron.training import global_vars
        from megatron.training.utils import calc_params_l2_norm
    except ImportError:
        return None
    import types

    global_vars.set_args(
        types.SimpleNamespace(use_megatron_fsdp=False, use_torch_fsdp2=True, bf16=bf16)
    )
    return float(calc_params_l2_norm(chunks))


def _megatron_body(layout: Layout, directory: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from megatron.core import parallel_state as ps

    from norm_optim import NormAwareOptimizer
    from norm_optim.testing.torch_fsdp2 import build_torch_fsdp2_model

    init_parallel(**layout.parallel())
    chunks = build_torch_fsdp2_model(layout.cfg, seed=3)
    inner = build_optimizer(chunks, bf16=layout.cfg.bf16, lr=1e-2)
    counting = CountingCommunicator()
    optimizer = NormAwareOptimizer(inner, model=chunks, comm=counting)
    got: dict[str, Any] = {
        "shapes": global_param_shapes(chunks),
        "optimizer": type(inner.chained_optimizers[0]).__name__,
    }

    _fill(chunks, inner, SEED_A)
    got["init"] = read_norms(optimizer, counting)
    mains = _fp32_tensors(chunks)
    got["views_of_mains"] = all(
        r.tensor.untyped_storage().data_ptr()
        == mains[id(r.param)]._local_tensor.untyped_storage().data_ptr()
        for r in optimizer.registry.counted
    )
    got["counted_numel"] = optimizer.registry.counted_numel
    got["reasons"] = sorted({str(r.reason) for r in optimizer.registry if not r.counted})
    got["tp_rank"] = ps.get_tensor_model_parallel_rank()

    if TRAINS:
        got.update(
            read_after_steps(optimizer, chunks, lambda: _fill(chunks, inner, SEED_A), counting)
        )

    dcp.save(_main_state_dict(chunks[0]), checkpoint_id=directory)
    _fill(chunks, inner, SEED_B)
    got["before_load"] = float(optimizer.param_l2_norm())
    dcp.load(_main_state_dict(chunks[0]), checkpoint_id=directory)
    got["after_load"] = read_norms(optimizer, counting)
    got["megatron"] = _megatron_norm(chunks, layout.cfg.bf16)

    def move() -> None:
        for main in _fp32_tensors(chunks).values():
            main._local_tensor = main._local_tensor.clone()

    got.update(read_after_move(optimizer, move, lambda: _fill(chunks, inner, SEED_B)))
    return got


@functools.lru_cache(maxsize=None)
def _megatron_run(name: str) -> tuple[dict[str, Any], ...]:
    return run_with_directory(_megatron_body, MEGATRON_LAYOUTS[name], "norm_optim_fsdp2_", TIMEOUT)


@pytest.mark.parametrize("name", list(MEGATRON_LAYOUTS))
def test_megatron_torch_fsdp2_matches_unparallel_oracle(name: str) -> None:
    """At init, across a DCP save / load and after the fp32 shards move behind the wrapper."""
    layout = MEGATRON_LAYOUTS[name]
    a = _megatron_oracle(layout.cfg, SEED_A)
    b = _megatron_oracle(layout.cfg, SEED_B)
    results = _megatron_run(name)
    expected_kind = "Float16OptimizerWithFloat16Params" if layout.cfg.bf16 else "FP32Optimizer"
    for rank, got in enumerate(results):
        where = f"rank {rank}"
        assert got["optimizer"] == expected_kind
        assert got["shapes"] == a["shapes"], f"{where}: the layout's model differs"
        check_read(got["init"], a, f"{where}, at init")
        assert got["views_of_mains"], "a summed tensor is not the optimizer's own fp32 shard"
        assert got["before_load"] == pytest.approx(b["total"], rel=REL), where
        check_read(got["after_load"], a, f"{where}, after the DCP load")
        assert got["rebuilt_after_move"], "new local storage must rebuild the registry"
        assert got["after_move"] == pytest.approx(b["total"], rel=REL), f"{where}, after move"
        # FSDP2 shards every param over DP: nothing is a DP replica; TP duplicates remain.
        assert got["reasons"] == (["tp-duplicate"] if got["tp_rank"] > 0 else [])
    numel = sum(math.prod(s) for s in a["shapes"].values())
    assert sum(r["counted_numel"] for r in results) == numel, "each element on one rank"


@pytest.mark.skipif(not TRAINS, reason=NO_TRAINING)
@pytest.mark.parametrize("name", list(MEGATRON_LAYOUTS))
def test_megatron_torch_fsdp2_after_real_steps(name: str) -> None:
    layout = MEGATRON_LAYOUTS[name]
    a = _megatron_oracle(layout.cfg, SEED_A)
    for rank, got in enumerate(_megatron_run(name)):
        assert got["trained_changed"] != pytest.approx(a["total"], rel=1e-4), "no steps"
        assert not got["rebuilt_by_steps"], "steps keep the DTensors: no rebuild"
        check_read(got["after_steps"], a, f"rank {rank}, after 2 steps")


def _train_once() -> None:
    from norm_optim.testing.torch_fsdp2 import build_torch_fsdp2_model

    init_parallel()
    chunks = build_torch_fsdp2_model(UNTIED)
    train_step(chunks, build_optimizer(chunks))


def test_megatron_0_16_to_0_18_torch_fsdp2_cannot_train() -> None:
    """Pins the reason of the skip above; if this starts to pass, drop the skip."""
    if TRAINS:
        pytest.skip("megatron-core >= 0.19 trains TorchFullyShardedDataParallel")
    with pytest.raises(RankFailedError, match="force_all_reduce"):
        run_ranks(_train_once, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("name", ["dp2", "dp4", "tp2-dp2"])
def test_megatron_calc_params_l2_norm_under_torch_fsdp2(name: str) -> None:
    """The same run: Megatron-LM's ``calc_params_l2_norm`` from 0.19 on reports each rank's own
    bf16 shard (``to_local()`` drops ``main_param``; no sum over DP), about 1/sqrt(DP) of the
    truth; 0.17 and 0.18 still sum DTensor params over their group (from the bf16 weights, so
    within 2e-3 of the fp32 mains' norm). norm_optim is exact on all of them."""
    pytest.importorskip(
        "megatron.training",
        reason="megatron-core 0.16.1 ships no "
        "megatron.training (Megatron-LM's calc_params_l2_norm)",
    )
    layout = MEGATRON_LAYOUTS[name]
    expected = _megatron_oracle(layout.cfg, SEED_A)["total"]
    dp = layout.world // layout.tp
    for got in _megatron_run(name):
        assert got["after_load"]["total"] == pytest.approx(expected, rel=REL)
        if megatron_at_least(0, 19):
            assert got["megatron"] == pytest.approx(expected / math.sqrt(dp), rel=0.15)
            assert got["megatron"] != pytest.approx(expected, rel=0.1)
        else:
            assert got["megatron"] == pytest.approx(expected, rel=2e-3)
            assert got["megatron"] != pytest.approx(expected, rel=REL)  # bf16, not the mains


# ------------------------------------------------------------------ torch-native fully_shard


@dataclasses.dataclass(frozen=True)
class NativeLayout:
    mesh: tuple[int, ...]
    tp: bool = False
    megatron_state: bool = False  # also initialize megatron's parallel state (DP = world)

    @property
    def world(self) -> int:
        return math.prod(self.mesh)


NATIVE_LAYOUTS = {
    "fsdp2": NativeLayout((2,)),
    "fsdp4": NativeLayout((4,)),
    "hsdp-2x2": NativeLayout((2, 2)),
    "tp-fsdp-2x2": NativeLayout((2, 2), tp=True),
    "fsdp2-megatron-state": NativeLayout((2,), megatron_state=True),
}


def _full_sums(model: torch.nn.Module) -> dict[str, float]:
    from norm_optim.testing.torch_fsdp2 import full_sum_of_squares

    return {name: full_sum_of_squares([p]) for name, p in model.named_parameters()}


def _native_body(layout: NativeLayout, directory: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from norm_optim import NormAwareOptimizer
    from norm_optim.testing.torch_fsdp2 import build_native_fsdp2, native_train_step

    if layout.megatron_state:
        init_parallel()
    model, inner, before_sharding = build_native_fsdp2(layout.mesh, tp=layout.tp)
    counting = CountingCommunicator()
    optimizer = NormAwareOptimizer(inner, model=model, comm=counting)
    got: dict[str, Any] = {
        "unsharded": before_sharding,
        "init": read_norms(optimizer, counting),
        "counted_numel": optimizer.registry.counted_numel,
        "numel": sum(p.numel() for p in model.parameters()),
    }
    registry = optimizer.registry
    for step in range(2):
        native_train_step(model, optimizer, seed=step)
    got["rebuilt_by_steps"] = optimizer.registry is not registry
    got["trained"], got["trained_oracle"] = read_norms(optimizer, counting), _full_sums(model)

    dcp.save(model.state_dict(), checkpoint_id=directory)
    native_train_step(model, optimizer, seed=5)
    got["moved_on"], got["moved_on_oracle"] = float(optimizer.param_l2_norm()), _full_sums(model)
    dcp.load(model.state_dict(), checkpoint_id=directory)
    got["after_load"] = read_norms(optimizer, counting)

    tokens = torch.zeros(1, model.cfg.seq_length, dtype=torch.long)
    model(tokens)  # forward only: the root keeps its params unsharded until the backward
    got["mid_step"] = float(optimizer.param_l2_norm())  # the registry built before still reads
    try:
        optimizer.refresh()
    except UnknownParamError as error:
        got["mid_step_refresh"] = str(error)
    model.reshard()
    optimizer.refresh()
    got["resharded_refreshed"] = float(optimizer.param_l2_norm())
    return got


@functools.lru_cache(maxsize=None)
def _native_run(name: str) -> tuple[dict[str, Any], ...]:
    layout = NATIVE_LAYOUTS[name]
    with tempfile.TemporaryDirectory(prefix="norm_optim_native_fsdp2_") as directory:
        return tuple(
            run_ranks(
                _native_body,
                layout.world,
                layout,
                directory,
                cpu_shim=layout.megatron_state,
                timeout=TIMEOUT,
            )
        )


@pytest.mark.parametrize("name", list(NATIVE_LAYOUTS))
def test_torch_native_fully_shard_matches_full_tensors(name: str) -> None:
    results = _native_run(name)
    for rank, got in enumerate(results):
        where = f"rank {rank}"
        check_read(got["init"], _expected(got["unsharded"]), f"{where}, at init")
        assert not got["rebuilt_by_steps"], "steps keep the DTensors: no rebuild"
        trained = _expected(got["trained_oracle"])
        assert trained["total"] != pytest.approx(got["init"]["total"], rel=1e-6), "no steps"
        check_read(got["trained"], trained, f"{where}, after 2 steps")
        moved = _expected(got["moved_on_oracle"])["total"]
        assert moved != pytest.approx(trained["total"], rel=1e-6)
        assert got["moved_on"] == pytest.approx(moved, rel=REL), f"{where}, a third step"
        check_read(got["after_load"], trained, f"{where}, after the DCP load")
        assert got["mid_step"] == pytest.approx(trained["total"], rel=REL), where
        assert "unsharded now" in got["mid_step_refresh"], "a rebuild mid-step: a clear error"
        assert got["resharded_refreshed"] == pytest.approx(trained["total"], rel=REL), where
    assert sum(r["counted_numel"] for r in results) == results[0]["numel"], "one rank each"


# ------------------------------------------------------------------ what is refused, clearly


def _refused(kind: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    from norm_optim import NormAwareOptimizer
    from norm_optim.testing.torch_fsdp2 import build_native_fsdp2

    world = torch.distributed.get_world_size()
    if kind == "sub-mesh":
        model, inner, _ = build_native_fsdp2((2, 2), tp=True, tp_every_param=False)
    elif kind == "megatron-dp-outside-mesh":  # megatron's DP is the world, FSDP covers 2 ranks
        init_parallel()
        model, inner = _sharded_on_half()
    elif kind == "megatron-tp-inside-mesh":  # megatron says TP2, FSDP shards over all 4
        init_parallel(tp=2)
        model, inner, _ = build_native_fsdp2((world,))
    else:
        mesh = init_device_mesh("cpu", (world,))
        if kind == "partial":
            tensor = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        else:  # every rank holds 3 rows of what the placements say is a 4-row tensor
            tensor = DTensor.from_local(
                torch.ones(3), mesh, [Shard(0)], shape=torch.Size([4]), stride=(1,)
            )
        model = torch.nn.Module()
        model.weight = torch.nn.Parameter(tensor)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        NormAwareOptimizer(inner, model=model)
    except (UnsupportedOptimizerError, ParallelStateError) as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


def _sharded_on_half() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model ``fully_shard``-ed over the 2 ranks of its half of the world (plain copies on
    the other half, as DDP across FSDP groups would keep them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from norm_optim.testing.torch_fsdp2 import TinyTorchLM

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TinyTorchLM()
    fully_shard(model, mesh=mesh["shard"])
    return model, torch.optim.AdamW(model.parameters())


@pytest.mark.parametrize(
    "kind, world, words",
    [
        ("partial", 2, ["Partial", "pending"]),
        ("uneven", 2, ["local tensor has shape (3,)", "give (2,)"]),
        ("sub-mesh", 4, ["'embed.weight'", "ranks [0, 1, 2, 3]", "Replicate on the TP axis"]),
        (
            "megatron-dp-outside-mesh",
            4,
            ["ParallelStateError", "data-parallel group [0, 1, 2, 3]", "in no placement"],
        ),
        ("megatron-tp-inside-mesh", 4, ["ParallelStateError", "tensor-parallel group"]),
    ],
)
def test_placements_that_cannot_be_counted_are_refused(
    kind: str, world: int, words: list[str]
) -> None:
    """A Partial (pending-sum) placement, local data that is not the placements' shard, a param
    left on the FSDP sub-mesh of a TP × FSDP model (its TP copies are in no placement), and
    meshes that contradict megatron's parallel state (copies in megatron's DP group outside the
    mesh; a mesh across megatron's TP peers): each a clear error naming it, on every rank,
    never a number."""
    cpu_shim = kind.startswith("megatron")
    for message in run_ranks(_refused, world, kind, cpu_shim=cpu_shim, timeout=TIMEOUT):
        for word in words:
            assert word in message, message


def _patches_body() -> list[bool]:
    from megatron.core.distributed import torch_fully_sharded_data_parallel as tfsdp

    from norm_optim.testing._internal.torch_fsdp2_patches import install_torch_fsdp2_cpu_patches

    original = tfsdp.DeviceMesh
    handle = install_torch_fsdp2_cpu_patches()
    again = install_torch_fsdp2_cpu_patches()
    patched = tfsdp.DeviceMesh
    handle.uninstall()
    return [again is handle, patched is not original, tfsdp.DeviceMesh is original]


def test_cpu_patch_is_idempotent_and_reversible() -> None:
    assert run_ranks(_patches_body, 1, timeout=TIMEOUT)[0] == [True, True, True]
