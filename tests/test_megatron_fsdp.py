"""Megatron-FSDP (``FullyShardedDataParallel``, ``optim_grads_params``): exact norms from its fp32
main-weight shards, against the layout-independent oracle, on the real megatron-core.

Each layout builds the tiny GPT (dense or MoE) on gloo CPU ranks as one Megatron-FSDP chunk
(test-only CPU patches: ``norm_optim.testing.megatron_fsdp``) with the real
``get_megatron_optimizer``, writes every weight's layout-independent values into this rank's
shards of the model- and main-weight buffers, and scales the fp32 main shards by ``MAIN_SCALE``
(not representable in bf16: a norm read from the bf16 weights would be off by ~1e-3). The norm
must be ``sqrt(MAIN_SCALE² · trainable² + frozen²)`` of the *unparallel* model's shapes, to 1e-6,
on every rank, with the dense / expert / per-param breakdowns, one all-reduce per call, and
every summed tensor a view of Megatron-FSDP's own buffers. The same run checks it again after
real training steps, with the module's params in either state (``start_param_sync`` swaps in
the original params, ``stop_communication`` the DTensors; a registry rebuilt in either state),
after a torch-DCP save / load of the model's (DTensor) state dict, Megatron-LM's
``fsdp_dtensor`` format, which loads into the main weights in place, and after the main weights
move to new storage behind the wrapper's back (the fingerprint must notice).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch

from norm_optim._errors import UnsupportedOptimizerError
from norm_optim.testing import RankFailedError, init_parallel, run_ranks
from norm_optim.testing.megatron_fsdp import build_fsdp_model, fill_fsdp_deterministic_
from norm_optim.testing.models import build_model, build_optimizer
from norm_optim.testing.oracle import global_param_shapes
from tests.support.layouts import SMALL, SMALL_MOE, Layout
from tests.support.fsdp_body import (
    CountingCommunicator,
    read_after_move,
    read_after_steps,
    run_with_directory,
)
from tests.support.reads import MAIN_SCALE, REL, check_read, read_norms, unparallel_oracle

SEED_A, SEED_B = 7, 8
TIMEOUT = 120.0


def _fsdp_options(layout: Layout) -> dict[str, Any]:
    """``build_fsdp_model`` keyword arguments: frozen params, and hybrid FSDP's instances."""
    hybrid = dict(
        num_distributed_optimizer_instances=layout.instances,
        outer_dp_sharding_strategy=layout.outer_dp_sharding,
    )
    return dict(freeze=layout.freeze, **(hybrid if layout.instances > 1 else {}))


LAYOUTS = {
    "dp2": Layout(2, SMALL),
    "dp4": Layout(4, SMALL),
    "tp2-dp2": Layout(4, SMALL, tp=2),
    "moe-ep2-edp1": Layout(2, SMALL_MOE, ep=2),
    "moe-ep2-edp2": Layout(4, SMALL_MOE, ep=2),
    "moe-tp2-ep2": Layout(4, SMALL_MOE, tp=2, ep=2),
    "tp2-dp2-frozen": Layout(4, SMALL, tp=2, freeze=("decoder.layers.0.*", "embedding.*")),
    # Two optimizer instances of DP2: each holds all shards / the shards span both.
    "hsdp-2x2-outer-no_shard": Layout(4, SMALL, instances=2),
    "hsdp-2x2-outer-optim": Layout(4, SMALL, instances=2, outer_dp_sharding="optim"),
}


def _scale_main_shards(optimizer: Any, factor: float) -> None:
    """Scale the fp32 tensors the optimizer steps (the DTensors' local main-weight shards)."""
    for group in optimizer.param_groups:
        for main in group["params"]:
            main._local_tensor.mul_(factor)


def _fill(chunks: list, optimizer: Any, seed: int) -> None:
    fill_fsdp_deterministic_(chunks, seed)
    _scale_main_shards(optimizer, MAIN_SCALE)


def _own_buffers(chunks: list) -> set[int]:
    """Storage of every Megatron-FSDP weight buffer (main and model) of this rank."""
    return {
        buffer.data.untyped_storage().data_ptr()
        for chunk in chunks
        for group in chunk.param_and_grad_buffer.parameter_groups
        for buffer in (group.main_weight_buffer, group.model_weight_buffer)
        if buffer is not None
    }


def _dcp_state_dict(chunk: Any, num_experts: int | None) -> dict[str, Any]:
    """The model part of Megatron-LM's ``fsdp_dtensor`` checkpoint (``checkpointing.py``,
    ``preprocess_fsdp_dtensor_state_dict``): DTensors of the main weights, expert keys made
    global (EP ranks would otherwise write the same local names), uneven shards described."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    chunk.stop_communication()  # as Megatron-LM's save: the module holds the DTensors
    state = {"model": chunk.state_dict()}
    if num_experts:  # (megatron-core 0.15 has no handle_experts_in_state_dict, nor MoE here)
        from megatron.core.transformer.fsdp_dtensor_checkpoint import (
            handle_experts_in_state_dict,
        )

        state["model"] = handle_experts_in_state_dict(state["model"], num_experts)
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def _move_main_weights(chunks: list, optimizer: Any) -> None:
    """Give every bucket's fp32 main weights new storage and re-point the optimizer's DTensors
    at it, behind the wrapper's back, as an offload / reload of the optimizer would."""
    where = {}
    for chunk in chunks:
        for group in chunk.param_and_grad_buffer.parameter_groups:
            if group.main_weight_buffer is not None:
                group.main_weight_buffer.data = group.main_weight_buffer.data.clone()
                for item, param in enumerate(group.params):
                    where[id(param)] = (group.main_weight_buffer, item)
    for group in optimizer.param_groups:
        for main in group["params"]:
            buffer, item = where[id(main.orig_param)]
            main._local_tensor = buffer.get_item(item, only_shard=True).view_as(main._local_tensor)


def _megatron_norm(chunks: list) -> float | None:
    """Megatron-LM's own ``calc_params_l2_norm`` under ``--use-megatron-fsdp`` (None where
    megatron-core ships no ``megatron.training``, as 0.16.1)."""
    try:
        from megatron.training import global_vars
        from megatron.training.utils import calc_params_l2_norm
    except ImportError:
        return None
    import types

    global_vars.set_args(types.SimpleNamespace(use_megatron_fsdp=True, bf16=True))
    return float(calc_params_l2_norm(chunks))


def _rank_body(layout: Layout, directory: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from norm_optim import NormAwareOptimizer

    init_parallel(**layout.parallel())
    chunks = build_fsdp_model(layout.cfg, seed=3, **_fsdp_options(layout))
    inner = build_optimizer(chunks, lr=1e-2)
    counting = CountingCommunicator()
    optimizer = NormAwareOptimizer(inner, model=chunks, comm=counting)
    got: dict[str, Any] = {"shapes": global_param_shapes(chunks, trainable_only=False)}

    _fill(chunks, inner, SEED_A)
    got["init"] = read_norms(optimizer, counting)
    own = _own_buffers(chunks)
    got["views_of_buffers"] = all(
        r.tensor.untyped_storage().data_ptr() in own for r in optimizer.registry.counted
    )
    got["counted_numel"] = optimizer.registry.counted_numel

    got.update(read_after_steps(optimizer, chunks, lambda: _fill(chunks, inner, SEED_A), counting))
    chunks[0].start_param_sync()  # the module now holds the original params
    got["raw_state"] = float(optimizer.param_l2_norm())
    optimizer.refresh()  # a registry built in that state
    got["raw_state_refreshed"] = float(optimizer.param_l2_norm())
    chunks[0].stop_communication()  # the module holds the DTensors again
    got["dtensor_state"] = float(optimizer.param_l2_norm())

    dcp.save(_dcp_state_dict(chunks[0], layout.cfg.num_experts), checkpoint_id=directory)
    _fill(chunks, inner, SEED_B)
    got["before_load"] = float(optimizer.param_l2_norm())
    dcp.load(_dcp_state_dict(chunks[0], layout.cfg.num_experts), checkpoint_id=directory)
    got["after_load"] = read_norms(optimizer, counting)
    got["without_frozen"] = float(
        NormAwareOptimizer(inner, model=chunks, count_frozen=False).param_l2_norm()
    )
    # Megatron-LM's own function on the same weights (it reads the DTensors' local tensors).
    got["megatron"] = _megatron_norm(chunks)

    got.update(
        read_after_move(
            optimizer,
            lambda: _move_main_weights(chunks, inner),
            lambda: _fill(chunks, inner, SEED_B),
        )
    )
    return got


@functools.lru_cache(maxsize=None)
def _run(name: str) -> tuple[dict[str, Any], ...]:
    """One run per layout, shared by the tests that check it."""
    return run_with_directory(_rank_body, LAYOUTS[name], "norm_optim_fsdp_", TIMEOUT)


def _megatron_version() -> tuple[int, ...]:
    from megatron.core import package_info

    return tuple(int(part) for part in package_info.__version__.split("+")[0].split(".")[:2])


# Every test that builds a Megatron-FSDP model.
BUILDS_FSDP = pytest.mark.skipif(
    _megatron_version() < (0, 15),
    reason="Megatron-FSDP of megatron-core 0.14 reads torch's _MeshEnv.child_to_root_mapping "
    "(megatron_fsdp/utils.py get_mesh_names), which this torch no longer has",
)
# Megatron-FSDP with experts (MoE, EP or not).
BUILDS_MOE_FSDP = pytest.mark.skipif(
    (0, 15) <= _megatron_version() < (0, 16),
    reason="Megatron-FSDP of megatron-core 0.15 calls FSDPDistributedIndex.get_expert_dp_group "
    "for any model with experts (megatron_fsdp.py), which 0.15 does not define",
)
FROZEN_BEFORE_0_17 = (
    "Megatron-FSDP of megatron-core 0.16 cannot build a model with frozen "
    "params (test_megatron_0_16_fsdp_cannot_freeze pins it)"
)


@BUILDS_FSDP
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[BUILDS_MOE_FSDP] if layout.cfg.num_experts else [])
        for n, layout in LAYOUTS.items()
    ],
)
def test_megatron_fsdp_norm_matches_unparallel_oracle(name: str) -> None:
    layout = LAYOUTS[name]
    if layout.freeze and (0, 16) <= _megatron_version() < (0, 17):
        pytest.skip(FROZEN_BEFORE_0_17)
    a = unparallel_oracle(layout.cfg, layout.freeze, SEED_A)
    b = unparallel_oracle(layout.cfg, layout.freeze, SEED_B)
    results = _run(name)
    for rank, got in enumerate(results):
        where = f"rank {rank}"
        assert got["shapes"] == a["shapes"], f"{where}: the layout's model differs"
        check_read(got["init"], a, f"{where}, at init")
        assert got["views_of_buffers"], "a summed tensor is a copy, not Megatron-FSDP's own"
        assert got["trained_changed"] != pytest.approx(a["total"], rel=1e-4), "steps did nothing"
        check_read(got["after_steps"], a, f"{where}, after 2 steps")
        for state in ("raw_state", "raw_state_refreshed", "dtensor_state"):
            assert got[state] == pytest.approx(a["total"], rel=REL), f"{where}, {state}"
        assert got["before_load"] == pytest.approx(b["total"], rel=REL), where
        check_read(got["after_load"], a, f"{where}, after the checkpoint load")
        assert got["without_frozen"] == pytest.approx(a["trainable"], rel=REL), "count_frozen"
        assert not got["rebuilt_by_steps"], "steps keep Megatron-FSDP's buffers: no rebuild"
        assert got["rebuilt_after_move"], "new main-weight storage must rebuild the registry"
        assert got["after_move"] == pytest.approx(b["total"], rel=REL), f"{where}, after move"
    # Each element on exactly one rank: the counted elements add up to the model's size
    # (trainable main shards and frozen shards alike).
    numel = sum(math.prod(s) for s in a["shapes"].values())
    assert sum(r["counted_numel"] for r in results) == numel


def _needs_megatron_training() -> None:
    from norm_optim._versions import megatron_core_version_string

    pytest.importorskip(
        "megatron.training",
        reason=f"{megatron_core_version_string()} ships no "
        "megatron.training (Megatron-LM's calc_params_l2_norm; since 0.17)",
    )


EP_LAYOUTS = [n for n, layout in LAYOUTS.items() if layout.ep > 1]


@BUILDS_FSDP
@BUILDS_MOE_FSDP
@pytest.mark.parametrize("name", EP_LAYOUTS)
def test_megatron_calc_params_l2_norm_is_wrong_under_ep(name: str) -> None:
    """The same run: Megatron-LM's ``calc_params_l2_norm`` under Megatron-FSDP sums each EP
    rank's own experts only (the expert mesh has no EP axis); norm_optim is exact there."""
    _needs_megatron_training()
    layout = LAYOUTS[name]
    expected = unparallel_oracle(layout.cfg, layout.freeze, SEED_A)["total"]
    results = _run(name)
    for got in results:
        assert got["after_load"]["total"] == pytest.approx(expected, rel=REL)
        assert got["megatron"] != pytest.approx(expected, rel=1e-3)


@BUILDS_FSDP
def test_megatron_calc_params_l2_norm_is_exact_on_dense() -> None:
    """For fairness: without experts Megatron's DTensor walk is exact too (same run)."""
    _needs_megatron_training()
    expected = unparallel_oracle(SMALL, (), SEED_A)["total"]
    for got in _run("tp2-dp2"):
        assert got["megatron"] == pytest.approx(expected, rel=1e-5)


@BUILDS_FSDP
def test_megatron_0_16_fsdp_cannot_freeze() -> None:
    """Pins the reason of the skip above: in 0.16.1, ``MegatronFSDP._register_fsdp_hooks``
    registers a grad-accumulation hook on every param, frozen ones too. If this starts to pass,
    drop the skip."""
    if _megatron_version()[:2] != (0, 16):
        pytest.skip("megatron-core 0.15 and >= 0.17 build Megatron-FSDP with frozen params")
    with pytest.raises(
        RankFailedError, match="cannot register a hook on a tensor that doesn't require gradient"
    ):
        run_ranks(_build_only, 2, dict(freeze=("embedding.*",)), timeout=TIMEOUT)


# ------------------------------------------------------------------ what is refused, clearly


def _build_only(build: dict[str, Any], parallel: dict[str, int] | None = None) -> None:
    init_parallel(**(parallel or {}))
    build_fsdp_model(SMALL, **build)


def _pipeline_body() -> dict[str, str]:
    """PP = 2: what megatron's own build does, and norm_optim on a chunk that claims PP = 2."""
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.transformer.module import Float16Module

    from norm_optim import NormAwareOptimizer
    from norm_optim.testing.models import build_chunk, transformer_config

    errors = {}
    init_parallel(pp=2)
    try:
        build_fsdp_model(SMALL)
    except ValueError as exc:
        errors["builder"] = str(exc)
    config = transformer_config(SMALL)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        use_distributed_optimizer=True,
        gradient_reduce_div_fusion=False,
    )
    try:  # megatron itself, bypassing the builder's check
        FullyShardedDataParallel(
            config,
            ddp_config,
            Float16Module(config, build_chunk(SMALL, config, None)),
            device=torch.device("cpu"),
        )
    except Exception as exc:  # noqa: BLE001 - whatever megatron raises is the finding
        errors["megatron"] = f"{type(exc).__name__}: {exc}"

    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    init_parallel()  # what megatron can build, then a chunk that says it is one of 2 stages
    chunks = build_fsdp_model(SMALL)
    inner = build_optimizer(chunks)
    chunks[0].config.pipeline_model_parallel_size = 2
    try:
        NormAwareOptimizer(inner, model=chunks)
    except UnsupportedOptimizerError as exc:
        errors["norm_optim"] = str(exc)
    return errors


@BUILDS_FSDP
def test_pipeline_parallelism_is_refused() -> None:
    """Megatron-FSDP builds its device mesh without a pipeline axis, so megatron cannot build
    PP > 1; norm_optim refuses such a chunk by name should a release build one."""
    errors = run_ranks(_pipeline_body, 2, timeout=TIMEOUT)[0]
    assert "pipeline parallelism (2 stages)" in errors["builder"]
    assert "megatron" in errors, "megatron built Megatron-FSDP with PP=2: support it"
    assert "pipeline parallelism (2 stages)" in errors["norm_optim"]


def _plain_ddp_body() -> str:
    from norm_optim import NormAwareOptimizer

    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=True, use_megatron_fsdp=True)
    try:
        NormAwareOptimizer(build_optimizer(chunks), model=chunks)
    except UnsupportedOptimizerError as exc:
        return str(exc)
    return "accepted"


def test_ddp_with_use_megatron_fsdp_is_refused() -> None:
    """``DistributedDataParallel(use_megatron_fsdp=True)`` silently builds ordinary buffers and
    an optimizer that fails at its first step: say what to build instead."""
    message = run_ranks(_plain_ddp_body, 2, timeout=TIMEOUT)[0]
    assert "FullyShardedDataParallel" in message and "DistributedDataParallel" in message


def _hybrid_moe_body() -> str:
    from norm_optim import NormAwareOptimizer

    init_parallel(ep=2, num_distributed_optimizer_instances=2)
    chunks = build_fsdp_model(SMALL_MOE, num_distributed_optimizer_instances=2)
    try:
        NormAwareOptimizer(build_optimizer(chunks), model=chunks)
    except UnsupportedOptimizerError as exc:
        return str(exc)
    return "accepted"


@BUILDS_FSDP
@BUILDS_MOE_FSDP
def test_hybrid_fsdp_with_experts_is_refused() -> None:
    """Two optimizer instances with MoE: megatron-core 0.16.1 shards the experts over dense
    ranks that hold other experts (the norm read from its shards was 4.994 for 5.954), and 0.19
    calls that path untested: refused, where the dense hybrid layouts above are exact."""
    message = run_ranks(_hybrid_moe_body, 4, timeout=TIMEOUT)[0]
    assert "hybrid Megatron-FSDP" in message and "experts" in message


def _patches_body() -> list[bool]:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp

    from norm_optim.testing._internal.megatron_fsdp_patches import install_megatron_fsdp_cpu_patches

    originals = (
        megatron_fsdp.MegatronFSDP.__init__,
        adapter.DeviceMesh,
        torch.cuda.get_rng_state,
        getattr(adapter, "TELinear", None),
    )
    handle = install_megatron_fsdp_cpu_patches()
    again = install_megatron_fsdp_cpu_patches()
    patched = (megatron_fsdp.MegatronFSDP.__init__, adapter.DeviceMesh, torch.cuda.get_rng_state)
    handle.uninstall()
    restored = (
        megatron_fsdp.MegatronFSDP.__init__,
        adapter.DeviceMesh,
        torch.cuda.get_rng_state,
        getattr(adapter, "TELinear", None),
    )
    return [
        again is handle,
        all(p is not o for p, o in zip(patched, originals)),
        all(r is o for r, o in zip(restored, originals)),
    ]


def test_cpu_patches_are_idempotent_and_reversible() -> None:
    assert run_ranks(_patches_body, 1, timeout=TIMEOUT)[0] == [True, True, True]
