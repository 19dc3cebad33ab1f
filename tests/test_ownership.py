"""Which elements each rank counts, and why: the counting rule in one process.

Real megatron-core optimizers over :class:`TinyMoE` (params with the attributes megatron gives
them: TP-split, TP-duplicate, expert, tied), megatron's rank getters mocked to put the process
at a chosen TP / expert-TP / DP / expert-DP position (``mocked_state``). The oracle is the
tensors the layout rule says the rank owns, summed in float64 by the test. Every layout on real
ranks: ``test_layouts.py``.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import FP32Optimizer

from norm_optim import NormAwareOptimizer
from norm_optim.testing import RecordingCommunicator
from tests.support.mocked_state import (
    TinyMoE,
    float16_optimizer,
    mocked_ranks,
    oracle,
    single_process,
)

pytestmark = single_process


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


def test_dtensor_replica_axes_and_mesh_checks() -> None:
    """The DTensor row of the rule, on plain data: a ``Replicate`` mesh axis counts on its
    coordinate 0 only; a mesh that spans megatron TP peers, or leaves out ranks of megatron's DP
    group, is a conflict (the registry refuses it)."""
    from norm_optim._counting.ownership import Copies, RankCoords, mesh_conflict, why_not_counted
    from norm_optim._counting.vocabulary import NotCounted

    def reason(replica_coords: tuple[int, ...]) -> object:
        copies = Copies(
            expert=False, tp_split=True, replicated=False, replica_coords=replica_coords
        )
        return why_not_counted(copies, RankCoords())

    assert reason(()) is None and reason((0, 0)) is None
    assert reason((1,)) is NotCounted.MESH_REPLICA and reason((0, 1)) is NotCounted.MESH_REPLICA
    coords = RankCoords(
        tp_peers=frozenset({0, 1}),
        dp_cp_peers=frozenset({0, 2}),
        expert_dp_peers=frozenset({0, 2, 4, 6}),
    )
    assert mesh_conflict(frozenset({0, 2}), expert=False, coords=coords) is None
    assert "tensor-parallel" in mesh_conflict(frozenset({0, 1, 2, 3}), expert=False, coords=coords)
    assert "ranks [4, 6]" in mesh_conflict(frozenset({0, 2}), expert=True, coords=coords)
    assert mesh_conflict(frozenset({0, 1}), expert=False, coords=RankCoords()) is None  # unknown
