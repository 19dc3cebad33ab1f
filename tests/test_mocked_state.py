"""Registry and reduction in one process: real megatron-core optimizers, mocked parallel state.

No ``torch.distributed`` here. megatron's parallel-state rank getters are patched to put this
process at a chosen position (e.g. TP rank 1 of 2, expert-DP rank 1), and a recording
communicator stands in for the all-reduce, so the tests see which tensors a rank counts, which
groups are used and how many collectives run. The optimizers are the real
``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer`` built under the CPU shim (they
hard-code CUDA type strings).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch
from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from norm_optim import (
    NormOptimError,
    NormAwareOptimizer,
    ParallelStateError,
    UnknownParamError,
    UnsupportedOptimizerError,
)
from norm_optim.testing import RecordingCommunicator, cpu_shim
from norm_optim.versions import megatron_at_least


class TinyMoE(torch.nn.Module):
    """Params with the attributes megatron gives them: TP-split, TP-duplicate, expert, tied."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def param(*shape: int, **attrs: object) -> torch.nn.Parameter:
            p = torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))
            for key, value in attrs.items():
                setattr(p, key, value)
            return p

        self.column = param(8, 4, tensor_model_parallel=True, partition_dim=0)
        self.norm = param(4)  # no TP attribute: a TP duplicate on tp_rank > 0
        self.expert = param(6, 4, tensor_model_parallel=True, partition_dim=0, allreduce=False)
        self.expert_norm = param(4, allreduce=False)
        self.tied_copy = param(5, 4, tensor_model_parallel=True, partition_dim=0, shared=True)


@contextlib.contextmanager
def mocked_ranks(**ranks: int) -> Iterator[None]:
    """Patch megatron's rank getters (tp, expert_tp, dp_cp, expert_dp) for one process, and its
    world-size getters (``<name>_size`` keys, e.g. ``tensor_model_parallel_size``; default 1)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(ps, "model_parallel_is_initialized", lambda: True)
    mp.setattr(ps, "get_tensor_model_parallel_rank", lambda: ranks.get("tp", 0))
    mp.setattr(ps, "get_expert_tensor_parallel_rank", lambda: ranks.get("expert_tp", 0))
    mp.setattr(ps, "get_data_parallel_rank", lambda **_: ranks.get("dp_cp", 0))
    mp.setattr(ps, "get_expert_data_parallel_rank", lambda **_: ranks.get("expert_dp", 0))
    for getter in ("tensor_model_parallel", "expert_tensor_parallel", "expert_model_parallel",
                   "data_parallel", "expert_data_parallel"):
        size = ranks.get(f"{getter}_size", 1)
        mp.setattr(ps, f"get_{getter}_world_size", lambda size=size, **_: size)
    # No process groups exist: the replicating groups' first ranks read as 0.
    mp.setattr(ps, "get_data_parallel_group", lambda **_: None)
    mp.setattr(ps, "get_expert_data_parallel_group", lambda **_: None)
    try:
        yield
    finally:
        mp.undo()


def float16_optimizer(model: torch.nn.Module) -> Float16OptimizerWithFloat16Params:
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True)
    # The keys megatron's param-group matching expects (as _get_param_groups sets them).
    group = dict(params=list(model.parameters()), wd_mult=1.0, lr_mult=1.0,
                 is_expert_parallel=False, is_decoupled_lr=False)
    inner = torch.optim.Adam([group], lr=1e-3)
    return Float16OptimizerWithFloat16Params(inner, config, None, lambda *_: None)


def oracle(tensors: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum(t.detach().double().pow(2).sum() for t in tensors)))


@pytest.fixture(autouse=True)
def shim() -> Iterator[None]:
    with cpu_shim():
        yield


def test_plain_single_process_counts_everything_but_tied_copy() -> None:
    model = TinyMoE()
    optimizer = NormAwareOptimizer(float16_optimizer(model), model=model)
    expected = oracle([p.main_param for n, p in model.named_parameters() if n != "tied_copy"])
    assert float(optimizer.param_l2_norm()) == pytest.approx(expected, rel=1e-7)
    assert optimizer.registry["tied_copy"].reason == "shared"


def test_fp32_main_values_are_used_not_the_bf16_params() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    optimizer = NormAwareOptimizer(inner, model=model)
    for group in inner.fp32_from_float16_groups:
        for main in group:
            main.mul_(3.0)  # the bf16 params no longer match their mains
    counted = [p.main_param for n, p in model.named_parameters() if n != "tied_copy"]
    assert float(optimizer.param_l2_norm()) == pytest.approx(oracle(counted), rel=1e-7)
    for record in optimizer.registry.counted:
        # Storage identity: what is summed is the optimizer's own main param, not a copy.
        assert record.tensor is record.param.main_param


def test_tp_rank1_and_expert_dp_rank1_count_only_their_own_elements() -> None:
    model = TinyMoE()
    comm = RecordingCommunicator(rank=5, size=8)
    with mocked_ranks(tp=1, expert_tp=0, dp_cp=0, expert_dp=1):
        optimizer = NormAwareOptimizer(float16_optimizer(model), model=model, comm=comm)
    reasons = {r.name: r.reason for r in optimizer.registry}
    assert reasons == {
        "column": None,  # TP-split dense: every TP rank counts its part
        "norm": "tp-duplicate",
        "expert": "dp-replica",  # whole main param replicated over expert-DP, rank 1 skips
        "expert_norm": "dp-replica",
        "tied_copy": "shared",
    }
    assert float(optimizer.param_l2_norm()) == pytest.approx(oracle([model.column.main_param]))


def test_expert_tp_rank_decides_expert_duplicates_when_etp_differs_from_tp() -> None:
    model = TinyMoE()
    with mocked_ranks(tp=0, expert_tp=1, dp_cp=3, expert_dp=0):
        optimizer = NormAwareOptimizer(
            float16_optimizer(model), model=model, comm=RecordingCommunicator()
        )
    reasons = {r.name: r.reason for r in optimizer.registry}
    assert reasons["expert"] is None and reasons["expert_norm"] == "tp-duplicate"
    assert reasons["column"] == "dp-replica" and reasons["norm"] == "dp-replica"


def test_simulated_ranks_sum_to_the_oracle_with_one_all_reduce_each() -> None:
    """Four simulated ranks (TP2 x EP-DP2) with their own registries: the sum is exact."""
    model = TinyMoE()
    inner = float16_optimizer(model)
    total = torch.zeros((), dtype=torch.float64)
    for tp in range(2):
        for expert_dp in range(2):
            comm = RecordingCommunicator()
            with mocked_ranks(tp=tp, expert_tp=tp, dp_cp=expert_dp, expert_dp=expert_dp):
                optimizer = NormAwareOptimizer(inner, model=model, comm=comm)
            # Every rank enters exactly one all-reduce per call, whatever it counts.
            norm = optimizer.param_l2_norm()
            assert comm.num_all_reduces == 1
            total += norm.double() ** 2
    # In this simulation each "TP rank" holds the same full tensors, so TP-split params are
    # counted on both TP ranks: the oracle is what the layout rule says each rank owns.
    split = [model.column, model.expert]
    expected = 2 * sum(float(p.main_param.double().pow(2).sum()) for p in split)
    expected += float(model.norm.main_param.double().pow(2).sum())
    expected += float(model.expert_norm.main_param.double().pow(2).sum())
    assert float(total) == pytest.approx(expected, rel=1e-7)


def test_breakdowns_share_the_single_all_reduce() -> None:
    model = TinyMoE()
    comm = RecordingCommunicator()
    optimizer = NormAwareOptimizer(float16_optimizer(model), model=model, comm=comm)
    norms = optimizer.param_l2_norms(per_param=True)
    comm.calls.clear()
    norms = optimizer.param_l2_norms(per_param=True)
    assert comm.num_all_reduces == 1 and len(comm.calls) == 1
    assert float(norms.dense**2 + norms.expert**2) == pytest.approx(float(norms.total**2))
    assert float(norms.expert) == pytest.approx(
        oracle([model.expert.main_param, model.expert_norm.main_param])
    )
    # The tied copy is not a param of its own: its original carries the name.
    assert set(norms.per_param) == {"column", "norm", "expert", "expert_norm"}
    assert float(norms.per_param["column"]) == pytest.approx(oracle([model.column.main_param]))


def test_async_form_returns_pending_norms() -> None:
    model = TinyMoE()
    optimizer = NormAwareOptimizer(float16_optimizer(model), model=model)
    pending = optimizer.param_l2_norms_async()
    assert float(pending.wait().total) == pytest.approx(float(optimizer.param_l2_norm()))


def test_fp32_optimizer_and_frozen_bf16_params() -> None:
    model = TinyMoE(dtype=torch.float32)
    model.norm.requires_grad_(False)
    model.norm.data = model.norm.data.bfloat16()
    trainable = [p for p in model.parameters() if p.requires_grad]
    inner = FP32Optimizer(torch.optim.SGD(trainable, lr=0.1), OptimizerConfig(lr=0.1), None)
    optimizer = NormAwareOptimizer(inner, model=model)
    assert optimizer.registry["norm"].source == "frozen"
    counted = [p for n, p in model.named_parameters() if n != "tied_copy"]
    assert float(optimizer.param_l2_norm()) == pytest.approx(oracle(counted), rel=1e-7)
    excluded = NormAwareOptimizer(inner, model=model, count_frozen=False)
    assert excluded.registry["norm"].reason == "frozen-excluded"
    counted = [p for n, p in model.named_parameters() if n not in ("tied_copy", "norm")]
    assert float(excluded.param_l2_norm()) == pytest.approx(oracle(counted), rel=1e-7)


def test_wrapper_is_transparent() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    optimizer = NormAwareOptimizer(inner, model=model)
    assert isinstance(optimizer, Float16OptimizerWithFloat16Params)
    assert type(optimizer) is NormAwareOptimizer
    assert optimizer.param_groups is inner.param_groups and optimizer.config is inner.config
    optimizer.custom_flag = 7
    assert inner.custom_flag == 7
    # The wrapper's own state never lands on the wrapped optimizer, whatever its names.
    assert set(vars(optimizer)) == {"_state"}
    assert not any(name.startswith("_state") for name in vars(inner))
    optimizer.reducer = "written through"  # a name the wrapper's state also uses
    assert inner.reducer == "written through" and optimizer.registry is not None
    assert optimizer.wrapped_optimizer is inner
    with pytest.raises(TypeError, match="already a NormAwareOptimizer"):
        NormAwareOptimizer(optimizer)


def test_wrapper_refuses_pickle_and_copy() -> None:
    """``__class__`` is the wrapped class (for isinstance): pickle and copy would rebuild the
    wrong object, so they are refused with the way out."""
    import copy
    import pickle

    model = TinyMoE()
    optimizer = NormAwareOptimizer(float16_optimizer(model), model=model)
    for clone in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="state_dict"):
            clone(optimizer)


def test_refresh_and_param_groups_setter_rebuild_the_registry() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    optimizer = NormAwareOptimizer(inner, model=model)
    first = optimizer.registry
    optimizer.refresh()
    assert optimizer.registry is not first
    expected = float(optimizer.param_l2_norm())
    # Replace every fp32 main param behind the wrapper's back, in place of the group's list
    # (same list object, same storage: only refresh() can tell).
    for group in inner.fp32_from_float16_groups:
        for main in group:
            main.data = main.data * 2
    optimizer.refresh()
    assert float(optimizer.param_l2_norm()) == pytest.approx(2 * expected, rel=1e-7)
    # The setter hands the groups to the wrapped optimizer and rebuilds.
    before = optimizer.registry
    optimizer.param_groups = inner.param_groups
    assert optimizer.registry is not before and inner.param_groups is optimizer.param_groups


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


# ------------------------------------------------------------------------------ bad input


def test_unknown_optimizer_kind_names_the_class() -> None:
    class MysteryOptimizer:
        pass

    with pytest.raises(UnsupportedOptimizerError, match=r"MysteryOptimizer \(megatron-core 0\."):
        NormAwareOptimizer(MysteryOptimizer())


def test_a_renamed_megatron_internal_names_itself_and_the_version() -> None:
    """A megatron-core release that renames an attribute a reader relies on: a clear error with
    the attribute and the version, not a bare AttributeError."""

    class RenamedFloat16Optimizer:  # has the Float16 optimizer's main params, not its model params
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        fp32_from_float16_groups: list = []

    with pytest.raises(UnsupportedOptimizerError, match=r"\(megatron-core 0\..*lacks 'float16_groups'"):
        NormAwareOptimizer(RenamedFloat16Optimizer())


def test_model_param_unknown_to_the_optimizer_is_named() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    model.extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(UnknownParamError, match="'extra'.*does not know it"):
        NormAwareOptimizer(inner, model=model)


def test_model_of_another_optimizer_is_refused() -> None:
    inner = float16_optimizer(TinyMoE())
    with pytest.raises(UnknownParamError, match="not in the given model"):
        NormAwareOptimizer(inner, model=torch.nn.Module())


def test_model_must_be_modules() -> None:
    inner = float16_optimizer(TinyMoE())
    with pytest.raises(TypeError, match="torch.nn.Module or a list"):
        NormAwareOptimizer(inner, model=[object()])


def _pg_collection(**groups: object) -> object:
    """A real megatron ``ProcessGroupCollection`` with only ``groups`` set (placeholders: one
    process without torch.distributed never reads a group)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    collection = ProcessGroupCollection()
    for name, group in groups.items():
        setattr(collection, name, group)
    return collection


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


def test_empty_model_warns_and_gives_zero() -> None:
    from megatron.core.optimizer import ChainedOptimizer

    # A rank with no trainable params gets an empty ChainedOptimizer from megatron.
    with pytest.warns(UserWarning, match="no params"):
        optimizer = NormAwareOptimizer(ChainedOptimizer([]), model=torch.nn.Module())
    assert float(optimizer.param_l2_norm()) == 0.0


def test_fsdp_sharded_params_are_refused() -> None:
    """FSDP params (``__fsdp_param__``, DTensor shards) in an optimizer that is not Megatron-FSDP's
    (torch FSDP2): a clear error rather than shards counted as replicas."""
    param = torch.nn.Parameter(torch.zeros(4))
    param.__fsdp_param__ = True
    with pytest.raises(UnsupportedOptimizerError, match="FSDP"):
        NormAwareOptimizer(torch.optim.SGD([param], lr=0.1))


def test_top_k_reports_largest_and_fastest_growing() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    optimizer = NormAwareOptimizer(inner, model=model)
    before = optimizer.param_l2_norms(per_param=True)
    model.norm.main_param.mul_(10.0)
    model.expert.main_param.mul_(2.0)
    after = optimizer.param_l2_norms(per_param=True)
    expected = sorted(
        ((n, float(v)) for n, v in after.per_param.items()), key=lambda nv: -nv[1]
    )[:2]
    assert [n for n, _ in after.largest(2)] == [n for n, _ in expected]
    growing = after.fastest_growing(before, k=2)
    assert [n for n, _ in growing] == ["norm", "expert"]
    assert growing[0][1] == pytest.approx(10.0) and growing[1][1] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="per_param=True"):
        optimizer.param_l2_norms().largest()


def test_per_param_norms_need_the_model() -> None:
    """Without the model, params have no layout-independent names to line up across ranks."""
    optimizer = NormAwareOptimizer(float16_optimizer(TinyMoE()))
    assert not optimizer.registry.sees_frozen_params
    float(optimizer.param_l2_norm())  # the total needs no names
    with pytest.raises(NormOptimError, match="model="):
        optimizer.param_l2_norms(per_param=True)


def test_no_host_sync_inside_the_call() -> None:
    """No op reads a tensor value back to the host (``aten::_local_scalar_dense``: ``.item()``,
    ``float(t)``, validation of lengths...): on CUDA each would stall the pipeline. The CPU
    profile shows the same ops the CUDA path would run for these tensors' kernels."""
    from torch.profiler import profile

    model = TinyMoE()
    model.norm.requires_grad_(False)  # a frozen bf16 param: the blocked low-precision path too
    trainable = [p for p in model.parameters() if p.requires_grad]
    group = dict(params=trainable, wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False,
                 is_decoupled_lr=False)
    inner = Float16OptimizerWithFloat16Params(
        torch.optim.Adam([group], lr=1e-3), OptimizerConfig(bf16=True), None, lambda *_: None
    )
    optimizer = NormAwareOptimizer(inner, model=model)
    optimizer.param_l2_norms(per_param=True)  # builds the per-param plan
    with profile() as prof:
        optimizer.param_l2_norm()
        optimizer.param_l2_norms(per_param=True)
        optimizer.param_l2_norms_async().wait()
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_local_scalar_dense" not in ops and "aten::item" not in ops


def test_megatron_fsdp_optimizer_is_refused_by_name() -> None:
    """With use_megatron_fsdp, megatron's DistributedOptimizer builds no shards: norm_optim reads
    Megatron-FSDP's buffers through the model chunks, so an optimizer without them is an error.
    (The real Megatron-FSDP is tested in test_megatron_fsdp.py.)"""

    class DistributedOptimizer:  # the state megatron leaves it in under Megatron FSDP
        ddp_config = type("DDPConfig", (), {"use_megatron_fsdp": True})()

    with pytest.raises(UnsupportedOptimizerError, match="FSDP"):
        NormAwareOptimizer(DistributedOptimizer())


@pytest.mark.skipif(not megatron_at_least(0, 19), reason="MimoOptimizer exists since megatron-core 0.19")
def test_mimo_optimizer_is_refused_by_class() -> None:
    """A MimoOptimizer has ``optimizer = None`` like a stub: read as one it gave a norm of 0."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo

    model = TinyMoE()
    info = ModuleOptimizerInfo(float16_optimizer(model), None, None, True)
    mimo = MimoOptimizer({"language_model": info}, OptimizerConfig(optimizer="adam", bf16=True))
    with pytest.raises(UnsupportedOptimizerError, match=r"MimoOptimizer \(megatron-core 0\.\d+"):
        NormAwareOptimizer(mimo, model=model)


def test_pg_collection_without_expert_groups_is_refused_for_moe() -> None:
    """Without expt_tp / expt_dp, expert params would be counted by the dense rules."""

    dense_groups_only = _pg_collection(tp="tp-group", dp_cp="dp-cp-group")
    model = TinyMoE()
    with pytest.raises(ParallelStateError, match="expt_tp"):
        NormAwareOptimizer(float16_optimizer(model), model=model, pg_collection=dense_groups_only)


def test_ep1_experts_need_the_model_when_expert_groups_differ() -> None:
    """At EP = 1 megatron leaves expert params unmarked; with ETP != TP only the model's
    structure tells them apart, so a wrapper without the model refuses instead of guessing."""
    model = TinyMoE()
    inner = float16_optimizer(model)
    with mocked_ranks(tp=1, tensor_model_parallel_size=2):
        with pytest.raises(ParallelStateError, match="model="):
            NormAwareOptimizer(inner)
        NormAwareOptimizer(inner, model=model)  # with the model it is fine


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
