"""Bad input gets a clear error naming the problem (and the fix), never a silently wrong number.

Unsupported optimizers and formats, a model that does not match the optimizer, missing or partial
parallel state, a reduction group that lacks model ranks, lookups of unknown params. Mostly one
process with real megatron-core optimizers (``mocked_state``); where the error needs ranks, on
gloo CPU ranks (``run_ranks``). Errors of the integrations live with them
(``test_megatron_fsdp.py``, ``test_megatron_lm.py``, ``test_megatron_bridge.py``).
"""

from __future__ import annotations

import re

import pytest
import torch
from megatron.core.optimizer import OptimizerConfig

from norm_optim import (
    NormAwareOptimizer,
    NormOptimError,
    ParallelStateError,
    UnknownParamError,
    UnsupportedOptimizerError,
)
from norm_optim.testing import RankFailedError, init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer
from norm_optim._versions import megatron_at_least
from tests.support.layouts import DENSE, SMALL
from tests.support.mocked_state import TinyMoE, float16_optimizer, mocked_ranks, single_process
from tests.support.precision_aware_standin import build_precision_aware_optimizer

# ------------------------------------------------------------------ optimizers


@single_process
def test_unknown_optimizer_kind_names_the_class() -> None:
    class MysteryOptimizer:
        pass

    with pytest.raises(UnsupportedOptimizerError, match=r"MysteryOptimizer \(megatron-core 0\."):
        NormAwareOptimizer(MysteryOptimizer())


@single_process
def test_a_renamed_megatron_internal_names_itself_and_the_version() -> None:
    """A megatron-core release that renames an attribute a reader relies on: a clear error with
    the attribute and the version, not a bare AttributeError."""

    class RenamedFloat16Optimizer:  # has the Float16 optimizer's main params, not its model params
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        fp32_from_float16_groups: list = []

    with pytest.raises(
        UnsupportedOptimizerError, match=r"\(megatron-core 0\..*lacks 'float16_groups'"
    ):
        NormAwareOptimizer(RenamedFloat16Optimizer())


@single_process
def test_fsdp_sharded_params_are_refused() -> None:
    """FSDP params (``__fsdp_param__``, DTensor shards) in an optimizer that is not Megatron-FSDP's
    (torch FSDP2): a clear error rather than shards counted as replicas."""
    param = torch.nn.Parameter(torch.zeros(4))
    param.__fsdp_param__ = True
    with pytest.raises(UnsupportedOptimizerError, match="FSDP"):
        NormAwareOptimizer(torch.optim.SGD([param], lr=0.1))


@single_process
def test_megatron_fsdp_optimizer_is_refused_by_name() -> None:
    """With use_megatron_fsdp, megatron's DistributedOptimizer builds no shards: norm_optim reads
    Megatron-FSDP's buffers through the model chunks, so an optimizer without them is an error.
    (The real Megatron-FSDP is tested in test_megatron_fsdp.py.)"""

    class DistributedOptimizer:  # the state megatron leaves it in under Megatron FSDP
        ddp_config = type("DDPConfig", (), {"use_megatron_fsdp": True})()

    with pytest.raises(UnsupportedOptimizerError, match="FSDP"):
        NormAwareOptimizer(DistributedOptimizer())


@single_process
@pytest.mark.skipif(
    not megatron_at_least(0, 19), reason="MimoOptimizer exists since megatron-core 0.19"
)
def test_mimo_module_without_process_groups_is_refused() -> None:
    """A MimoOptimizer has ``optimizer = None`` like a stub (read as one it gave a norm of 0);
    each active module is read with its own process groups, so a module without them is an
    error naming it. (Real MIMO models are tested in test_mimo.py.)"""
    from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo

    model = TinyMoE()
    info = ModuleOptimizerInfo(float16_optimizer(model), None, None, True)
    mimo = MimoOptimizer({"language_model": info}, OptimizerConfig(optimizer="adam", bf16=True))
    with pytest.raises(
        UnsupportedOptimizerError, match="'language_model'.*no ProcessGroupCollection"
    ):
        NormAwareOptimizer(mimo, model=model)


def _low_precision_master_body(dtype: torch.dtype, declared: bool) -> str:
    """The precision-aware distributed optimizer (TE's FusedAdam stand-in) with master weights
    that are not fp32: declared up front, or found in its state."""
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=True)
    if declared:  # as TE's FusedAdam(master_weight_dtype=...) says before its first step
        inner = build_precision_aware_optimizer(chunks, main_params_dtype=dtype)
    else:
        inner = build_precision_aware_optimizer(chunks)
        te_adam = inner.chained_optimizers[0].optimizer
        shard = te_adam.param_groups[0]["params"][0]
        te_adam.state[shard]["master_param"] = torch.zeros_like(shard, dtype=dtype)
    try:
        NormAwareOptimizer(inner, model=chunks)
    except UnsupportedOptimizerError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "dtype,declared",
    [(torch.float16, False), (torch.int16, False), (torch.float16, True)],
    ids=["fp16-state", "int16-without-remainders", "fp16-declared-before-any-state"],
)
def test_low_precision_master_weights_are_refused_by_name(
    dtype: torch.dtype, declared: bool
) -> None:
    message = run_ranks(_low_precision_master_body, 1, dtype, declared, timeout=60)[0]
    assert re.search(rf"{dtype} tensors.*fp32 master", message), message


# ------------------------------------------------------------------ the model


@single_process
def test_model_param_unknown_to_the_optimizer_is_named() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    model.extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(UnknownParamError, match="'extra'.*does not know it"):
        NormAwareOptimizer(inner, model=model)


@single_process
def test_model_of_another_optimizer_is_refused() -> None:
    inner = float16_optimizer(TinyMoE())
    with pytest.raises(UnknownParamError, match="not in the given model"):
        NormAwareOptimizer(inner, model=torch.nn.Module())


@single_process
def test_model_must_be_modules() -> None:
    inner = float16_optimizer(TinyMoE())
    with pytest.raises(TypeError, match="torch.nn.Module or a list"):
        NormAwareOptimizer(inner, model=[object()])


def test_param_held_by_two_leaves_is_named() -> None:
    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, OptimizerConfig

    from norm_optim.testing import cpu_shim

    model = torch.nn.Linear(3, 2)
    with cpu_shim():  # FP32Optimizer makes CUDA tensors
        leaf = FP32Optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), OptimizerConfig(lr=0.1), None
        )
    with pytest.raises(UnknownParamError, match=r"held by two optimizer leaves.*FP32Optimizer"):
        NormAwareOptimizer(ChainedOptimizer([leaf, leaf]), model=model)


def test_registry_lookups_name_what_is_missing() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = NormAwareOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert optimizer.registry["weight"].counted
    with pytest.raises(KeyError, match="no param named 'nope'"):
        optimizer.registry["nope"]
    with pytest.raises(KeyError, match="not a param of the registry's model"):
        optimizer.registry.find(torch.zeros(1))


@single_process
def test_per_param_norms_need_the_model() -> None:
    """Without the model, params have no layout-independent names to line up across ranks."""
    optimizer = NormAwareOptimizer(float16_optimizer(TinyMoE()))
    assert not optimizer.registry.sees_frozen_params
    float(optimizer.param_l2_norm())  # the total needs no names
    with pytest.raises(NormOptimError, match="model="):
        optimizer.param_l2_norms(per_param=True)


@single_process
def test_ep1_experts_need_the_model_when_expert_groups_differ() -> None:
    """At EP = 1 megatron leaves expert params unmarked; with ETP != TP only the model's
    structure tells them apart, so a wrapper without the model refuses instead of guessing."""
    model = TinyMoE()
    inner = float16_optimizer(model)
    with mocked_ranks(tp=1, tensor_model_parallel_size=2):
        with pytest.raises(ParallelStateError, match="model="):
            NormAwareOptimizer(inner)
        NormAwareOptimizer(inner, model=model)  # with the model it is fine


# ------------------------------------------------------------------ parallel state


def _pg_collection(**groups: object) -> object:
    """A real megatron ``ProcessGroupCollection`` with only ``groups`` set (placeholders: one
    process without torch.distributed never reads a group)."""
    if not megatron_at_least(0, 15):
        pytest.skip("ProcessGroupCollection exists since megatron-core 0.15")
    from megatron.core.process_groups_config import ProcessGroupCollection

    collection = ProcessGroupCollection()
    for name, group in groups.items():
        setattr(collection, name, group)
    return collection


@single_process
@pytest.mark.parametrize(
    "groups", [None, {}, {"tp": "tp-group"}], ids=["not-a-collection", "empty", "tp-only"]
)
def test_pg_collection_without_groups_is_refused(groups: dict | None) -> None:
    """Since megatron-core 0.19 unset fields of a collection read as None (no AttributeError):
    an empty or partial collection once gave a silently wrong norm there."""
    inner = float16_optimizer(TinyMoE())
    pg_collection = object() if groups is None else _pg_collection(**groups)
    with pytest.raises(ParallelStateError, match="dp_cp"):
        NormAwareOptimizer(inner, pg_collection=pg_collection)


@single_process
def test_pg_collection_without_expert_groups_is_refused_for_moe() -> None:
    """Without expt_tp / expt_dp, expert params would be counted by the dense rules."""

    dense_groups_only = _pg_collection(tp="tp-group", dp_cp="dp-cp-group")
    model = TinyMoE()
    with pytest.raises(ParallelStateError, match="expt_tp"):
        NormAwareOptimizer(float16_optimizer(model), model=model, pg_collection=dense_groups_only)


def test_distributed_run_without_parallel_state_is_refused() -> None:
    def body() -> None:
        model = torch.nn.Linear(3, 2)
        NormAwareOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)

    with pytest.raises(RankFailedError, match="parallel state is not initialized") as e:
        run_ranks(body, 2)
    assert isinstance(e.value.__cause__, ParallelStateError)


def _reduce_over_own_rank_only() -> str:
    import torch.distributed as dist

    init_parallel(tp=2)
    chunks = build_model(DENSE, use_distributed_optimizer=True)
    optimizer = build_optimizer(chunks)
    singletons = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes all
    try:
        NormAwareOptimizer(optimizer, model=chunks, group=singletons[dist.get_rank()])
    except ParallelStateError as error:
        return str(error)
    return "no error"


def test_reduce_group_missing_model_ranks_is_refused() -> None:
    """A group without the other TP rank would silently drop its shards."""
    for rank, message in enumerate(run_ranks(_reduce_over_own_rank_only, 2, timeout=60)):
        assert "group= lacks ranks" in message and str(1 - rank) in message, message
