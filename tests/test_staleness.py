"""The norm follows the optimizer's tensors when they change: loads (through the wrapper or behind
its back), parameter state, offload storage swaps, replaced precision-aware masters, a rebuilt
leaf optimizer, ``refresh()`` and the ``param_groups`` setter, frozen params whose data moves.

Multi-rank: real megatron-core on gloo CPU ranks (``run_ranks``), tiny models, each value against
the layout-independent oracle or the tensors the optimizer holds. Single-process: the real
Float16 optimizer (``mocked_state``). Megatron's ``dist_checkpointing``: ``test_checkpoint.py``.
"""

from __future__ import annotations

import copy
import gc
import math
import weakref
from typing import Any

import pytest
import torch

from norm_optim import NormAwareOptimizer
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer, train_step
from norm_optim._versions import megatron_at_least
from tests.support.layouts import MOE, SMALL, filled_oracle
from tests.support.mocked_state import TinyMoE, float16_optimizer, oracle, single_process
from tests.support.precision_aware_standin import build_precision_aware_optimizer

SEED = 5
REL = 1e-7  # the CPU kernel accumulates rows of 256 in fp32 (~2e-8)


def _load_state_dict_body(dist_opt: bool, through_wrapper: bool) -> dict:
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=dist_opt, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    loader = optimizer if through_wrapper else inner
    train_step(chunks, optimizer, seed=0)
    result = {"oracle1": filled_oracle(chunks, optimizer, 1)}
    result["saved"] = float(optimizer.param_l2_norm())
    saved = copy.deepcopy(optimizer.state_dict())
    leaf = inner.chained_optimizers[0]
    if dist_opt:
        # The parameter state of the distributed optimizer, as megatron's dp_reshardable
        # checkpoints hold it (the dp_zero file format cannot reload torch Adam's 'step').
        param_state = copy.deepcopy(leaf.get_parameter_state_dp_reshardable())
        for gbuf_index in range(len(leaf.gbuf_ranges)):  # the key megatron's sharded save adds
            for buckets in param_state[gbuf_index].values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)
    # Other values everywhere (model and mains), then load the checkpoint's mains back: the model
    # params keep seed 2, so only a norm read from the loaded mains gives the seed-1 oracle.
    result["oracle2"] = filled_oracle(chunks, optimizer, 2)
    result["before_load"] = float(optimizer.param_l2_norm())
    loader.load_state_dict(saved)
    if dist_opt:
        leaf.load_parameter_state_from_dp_reshardable(param_state)
    result["loaded"] = float(optimizer.param_l2_norm())
    return result


@pytest.mark.parametrize("through_wrapper", [True, False], ids=["wrapper", "inner"])
@pytest.mark.parametrize(
    "dist_opt",
    [
        pytest.param(
            True,
            id="distopt",
            marks=pytest.mark.skipif(
                not megatron_at_least(0, 15),
                reason="the dp_reshardable parameter state exists since megatron-core 0.15",
            ),
        ),
        pytest.param(False, id="fp16opt"),
    ],
)
def test_load_state_dict_and_parameter_state(dist_opt: bool, through_wrapper: bool) -> None:
    for got in run_ranks(_load_state_dict_body, 2, dist_opt, through_wrapper):
        assert got["saved"] == pytest.approx(got["oracle1"], rel=REL)
        assert got["before_load"] == pytest.approx(got["oracle2"], rel=REL)
        assert got["loaded"] == pytest.approx(got["oracle1"], rel=REL)


def _swap_storage(optimizer: Any) -> None:
    """What megatron's ``offload_to_cpu`` / ``restore_from_cpu`` do on a GPU machine: every
    param of the inner optimizers (and its state) gets new storage through ``p.data = ...``.
    On CPU ``.cpu()`` would keep the storage, so it is made to copy."""
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.Tensor, "is_cuda", property(lambda t: True), raising=False)
    mp.setattr(torch.Tensor, "cpu", lambda t, *a, **k: t.clone())
    mp.setattr(torch.cuda, "empty_cache", lambda: None)
    try:
        optimizer.offload_to_cpu()
    finally:
        mp.undo()


def _offload_body(dist_opt: bool, through_wrapper: bool) -> dict:
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=dist_opt, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    oracle = filled_oracle(chunks, optimizer, 1)
    old_registry = weakref.ref(optimizer.registry)
    _swap_storage(optimizer if through_wrapper else inner)
    for group in inner.param_groups:  # write through the new storage only
        for main in group["params"]:
            main.mul_(2.0)
    released = through_wrapper and (gc.collect() or old_registry() is None)
    norm = float(optimizer.param_l2_norm())
    train_step(chunks, optimizer, seed=3)  # the optimizer keeps stepping the new tensors
    stepped = sum(float(m.double().pow(2).sum()) for g in inner.param_groups for m in g["params"])
    return {
        "oracle": oracle,
        "norm": norm,
        "released": released,
        "counted_after_step": float(optimizer.param_l2_norm()),
        "stepped": stepped,
    }


@pytest.mark.skipif(
    not megatron_at_least(0, 16),
    reason="the optimizers' offload_to_cpu exists since megatron-core 0.15, and "
    "there logs with a `logging` that optimizer.py does not import",
)
@pytest.mark.parametrize("through_wrapper", [True, False], ids=["wrapper", "inner"])
@pytest.mark.parametrize("dist_opt", [True, False], ids=["distopt", "fp16opt"])
def test_offload_swapped_storage_is_followed(dist_opt: bool, through_wrapper: bool) -> None:
    results = run_ranks(_offload_body, 2, dist_opt, through_wrapper)
    for got in results:
        assert got["norm"] == pytest.approx(2.0 * got["oracle"], rel=REL), "read stale storage"
        if through_wrapper:
            assert got["released"], "the old tensors stay referenced after offload_to_cpu"
    if dist_opt:  # shards partition the params: the sum of the ranks' squares is the total
        stepped = math.sqrt(sum(r["stepped"] for r in results))
    else:  # every DP rank holds all the mains
        stepped = math.sqrt(results[0]["stepped"])
    assert results[0]["counted_after_step"] == pytest.approx(stepped, rel=REL)


def _precision_aware_reload_body(remainders: bool) -> dict:
    """TE FusedAdam's (stand-in's) own ``load_state_dict``, behind the wrapper's back, creates
    new master tensors (with remainders: new int16 remainders, and new bf16 param values)."""
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=True, seed=SEED)
    inner = build_precision_aware_optimizer(chunks, store_param_remainders=remainders)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    train_step(chunks, optimizer, seed=0)
    leaf = inner.chained_optimizers[0]
    te_adam = leaf.optimizer
    before = float(optimizer.param_l2_norm())
    state = copy.deepcopy(te_adam.state_dict())
    for values in state["state"].values():
        if "master_param" in values:
            values["master_param"].mul_(2.0)
    te_adam.load_state_dict(state)
    masters = [
        te_adam.get_unscaled_state(p, "master_param")
        for p, m in te_adam.state.items()
        if "master_param" in m
    ]
    fp32_shards = [s for g in leaf.shard_fp32_groups for s in g]
    total = torch.tensor(
        [sum(float(m.double().pow(2).sum()) for m in masters + fp32_shards)], dtype=torch.float64
    )
    torch.distributed.all_reduce(total)
    return {
        "before": before,
        "after": float(optimizer.param_l2_norm()),
        "reference": math.sqrt(float(total)),
    }


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32-masters", "remainders"])
def test_precision_aware_master_weights_replaced_by_an_inner_load(remainders: bool) -> None:
    for got in run_ranks(_precision_aware_reload_body, 2, remainders):
        assert got["after"] == pytest.approx(got["reference"], rel=REL)
        assert got["after"] > 1.5 * got["before"]


def _rebuilt_optimizer_body() -> dict:
    init_parallel(ep=2)
    chunks = build_model(MOE, use_distributed_optimizer=True, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    oracle = filled_oracle(chunks, optimizer, 1)
    first = float(optimizer.param_l2_norm())
    # Rebuild the expert leaf (as a resumed run re-creating its optimizer would) with scaled mains.
    rebuilt = build_optimizer(chunks, lr=1e-2).chained_optimizers[1]
    for group in rebuilt.param_groups:
        for main in group["params"]:
            main.mul_(3.0)
    inner.chained_optimizers[1] = rebuilt
    norms = optimizer.param_l2_norms()
    return {
        "oracle": oracle,
        "first": first,
        "total": float(norms.total),
        "dense": float(norms.dense),
        "expert": float(norms.expert),
    }


def test_rebuilt_leaf_optimizer_is_noticed() -> None:
    for got in run_ranks(_rebuilt_optimizer_body, 2):
        assert got["first"] == pytest.approx(got["oracle"], rel=REL)
        expected = math.hypot(got["dense"], got["expert"])
        assert got["total"] == pytest.approx(expected, rel=REL)
        # Only the expert part was scaled by 3: the total moved accordingly.
        assert got["total"] ** 2 == pytest.approx(
            got["oracle"] ** 2 + 8 * got["expert"] ** 2 / 9, rel=1e-6
        )


@single_process
def test_refresh_and_param_groups_setter_rebuild_the_registry() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    optimizer = NormAwareOptimizer(inner, model=model)
    first = optimizer.registry
    optimizer.refresh()
    assert optimizer.registry is not first
    expected = float(optimizer.param_l2_norm())
    # The documented limit (norm_optim._norms.staleness): a main param in the middle of a group gets
    # new storage while the group's ends stay put. The fingerprint cannot see it, refresh() can.
    group = next(g for g in inner.fp32_from_float16_groups if len(g) >= 3)
    middle = group[len(group) // 2]
    middle_squares = float(middle.double().square().sum())
    assert middle_squares > 0
    middle.data = middle.data * 2
    assert float(optimizer.param_l2_norm()) == pytest.approx(expected, rel=1e-7)  # stale
    optimizer.refresh()
    assert float(optimizer.param_l2_norm()) == pytest.approx(
        math.sqrt(expected**2 + 3 * middle_squares), rel=1e-7
    )
    # The setter hands the groups to the wrapped optimizer and rebuilds.
    before = optimizer.registry
    optimizer.param_groups = inner.param_groups
    assert optimizer.registry is not before and inner.param_groups is optimizer.param_groups


@single_process
def test_registry_rebuilds_after_load_state_dict() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    optimizer = NormAwareOptimizer(inner, model=model)
    before = optimizer.registry
    state = optimizer.state_dict()
    for group in state["fp32_from_fp16_params"]:
        for main in group:
            main.mul_(2.0)
    optimizer.load_state_dict(state)
    assert optimizer.registry is not before
    counted = [p.main_param for n, p in model.named_parameters() if n != "tied_copy"]
    assert float(optimizer.param_l2_norm()) == pytest.approx(oracle(counted), rel=1e-7)


@single_process
def test_frozen_params_whose_data_is_replaced_are_followed() -> None:
    """``Module.to()`` / offloading a frozen reference model swap ``.data``: no optimizer holds
    those params, so the registry watches them itself."""
    model = TinyMoE(dtype=torch.float32)
    model.norm.requires_grad_(False)
    model.expert_norm.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = NormAwareOptimizer(torch.optim.SGD(trainable, lr=0.1), model=model)
    float(optimizer.param_l2_norm())
    model.norm.data = model.norm.data * 10.0
    model.expert_norm.data = model.expert_norm.data * 10.0
    counted = [p for n, p in model.named_parameters() if n != "tied_copy"]
    assert float(optimizer.param_l2_norm()) == pytest.approx(oracle(counted), rel=1e-7)


@single_process
def test_a_replacement_costs_one_rebuild_and_no_second_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the wrapper drops its registry (here: new param-group lists through the setter),
    the next call rebuilds once and records the optimizer as it is now: the call after it must
    not rebuild again. The kernels are warmed up at the first build only."""
    import norm_optim._wrapper as wrapper

    warm_ups: list[bool] = []
    reducer_class = wrapper.NormReducer

    def recording_reducer(*args: Any, warm_up: bool, **kwargs: Any) -> Any:
        warm_ups.append(warm_up)
        return reducer_class(*args, warm_up=warm_up, **kwargs)

    monkeypatch.setattr(wrapper, "NormReducer", recording_reducer)
    model = TinyMoE()
    inner = float16_optimizer(model)
    optimizer = NormAwareOptimizer(inner, model=model)
    expected = float(optimizer.param_l2_norm())
    optimizer.param_groups = [{**g, "params": list(g["params"])} for g in inner.param_groups]
    assert float(optimizer.param_l2_norm()) == pytest.approx(expected, rel=1e-7)
    rebuilt = optimizer.registry
    assert float(optimizer.param_l2_norm()) == pytest.approx(expected, rel=1e-7)
    assert optimizer.registry is rebuilt
    assert warm_ups == [True, False]
