"""Every rank enters the one all-reduce, whatever it holds, and nothing is hidden: ranks that count
nothing, pipeline stages with only frozen params, uneven MoE stages, an exception on one rank
before the collective, an empty model; a NaN / Inf on one rank shows on every rank.

Real megatron-core on gloo CPU ranks (``run_ranks``, each with a timeout), tiny models.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytest
import torch

from norm_optim import NormAwareOptimizer
from norm_optim.testing import RankFailedError, RecordingCommunicator, init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer, train_step
from norm_optim.testing.oracle import fill_deterministic_, global_param_shapes, oracle_norm
from tests.support.layouts import DENSE, MOE, SMALL, filled_oracle

SEED = 5
REL = 1e-7  # the CPU kernel accumulates rows of 256 in fp32 (~2e-8)


def _counts_nothing_body() -> dict:
    """DP4 with the (non-distributed) Float16 optimizer: ranks 1-3 hold replicas only."""
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=False, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    oracle = filled_oracle(chunks, optimizer, 1)
    return {
        "oracle": oracle,
        "norm": float(optimizer.param_l2_norm()),
        "counted": len(optimizer.registry.counted),
    }


def test_ranks_that_count_nothing_still_join_the_one_collective() -> None:
    results = run_ranks(_counts_nothing_body, 4, timeout=90)
    for got in results:
        assert got["norm"] == pytest.approx(got["oracle"], rel=REL)
    assert [r["counted"] == 0 for r in results] == [False, True, True, True]


def _frozen_stage_body(count_frozen: bool) -> dict:
    """PP2: stage 0 is frozen whole, so with count_frozen=False it counts nothing."""
    from megatron.core import parallel_state as ps

    init_parallel(pp=2)
    cfg = dataclasses.replace(DENSE, tie_embeddings=False)
    stage = ps.get_pipeline_model_parallel_rank()
    chunks = build_model(
        cfg, use_distributed_optimizer=True, freeze=("*",) if stage == 0 else (), seed=SEED
    )
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks, count_frozen=count_frozen)
    fill_deterministic_(chunks, 1, optimizer=inner)
    shapes = global_param_shapes(chunks, trainable_only=not count_frozen)
    norms = optimizer.param_l2_norms(per_param=True)
    return {
        "norm": float(norms.total),
        "oracle": oracle_norm(shapes, 1),
        "counted": len(optimizer.registry.counted),
    }


@pytest.mark.parametrize("count_frozen", [True, False])
def test_pipeline_stage_with_only_frozen_params(count_frozen: bool) -> None:
    results = run_ranks(_frozen_stage_body, 2, count_frozen, timeout=60)
    for got in results:
        assert got["norm"] == pytest.approx(got["oracle"], rel=REL)
    assert (results[0]["counted"] == 0) == (not count_frozen)


def _uneven_moe_body() -> dict:
    init_parallel(pp=2, ep=2)
    cfg = dataclasses.replace(MOE, moe_layer_freq=(1, 0, 0, 0))  # experts on stage 0 only
    chunks = build_model(cfg, use_distributed_optimizer=True, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    train_step(chunks, optimizer, seed=0)
    oracle = filled_oracle(chunks, optimizer, 1)
    norms = optimizer.param_l2_norms(per_param=True)
    return {
        "oracle": oracle,
        "norm": float(optimizer.param_l2_norm()),
        "per_param_total": float(norms.total),
        "experts": sum(r.expert for r in optimizer.registry),
    }


def test_uneven_moe_layers_per_pipeline_stage() -> None:
    results = run_ranks(_uneven_moe_body, 4, timeout=60)
    for got in results:
        assert got["norm"] == pytest.approx(got["oracle"], rel=REL)
        assert got["per_param_total"] == pytest.approx(got["oracle"], rel=REL)
    assert sorted(r["experts"] > 0 for r in results) == [False, False, True, True], results


def _raise_on_one_rank_body() -> float:
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=True, seed=SEED)
    optimizer = NormAwareOptimizer(build_optimizer(chunks), model=chunks)
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("rank 1 broke before the norm")
    return float(optimizer.param_l2_norm())  # rank 0 waits in the all-reduce


def test_exception_on_one_rank_before_the_collective_does_not_hang() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed.*broke before the norm"):
        run_ranks(_raise_on_one_rank_body, 2, timeout=60)
    assert time.monotonic() - start < 30, "the failing rank was reported only at the timeout"


@pytest.mark.parametrize("model", [[], torch.nn.Module()], ids=["no-chunks", "no-params"])
def test_rank_without_params_gives_zero_warns_and_joins_the_collective(model: Any) -> None:
    """A rank with no trainable params gets an empty ChainedOptimizer from megatron: its norm
    is 0, with a warning, and it still enters the one all-reduce of every call."""
    from megatron.core.optimizer import ChainedOptimizer

    comm = RecordingCommunicator()
    with pytest.warns(UserWarning, match="no params; its norm is 0"):
        optimizer = NormAwareOptimizer(ChainedOptimizer([]), model=model, comm=comm)
    assert float(optimizer.param_l2_norm()) == 0.0
    assert optimizer.param_l2_norms(per_param=True).per_param == {}
    assert comm.num_all_reduces == 2


def _poison_body(value: float, dist_opt: bool) -> dict:
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=dist_opt, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    # Rank 1 owns shards with the distributed optimizer; rank 0 owns all with the Float16 one.
    if torch.distributed.get_rank() == (1 if dist_opt else 0):
        record = optimizer.registry.counted[-1]
        record.tensor.view(-1)[0] = value  # one element of one counted main, on this rank only
    norms = optimizer.param_l2_norms(per_param=True)
    return {
        "total": float(norms.total),
        "dense": float(norms.dense),
        "bad_names": sorted(n for n, v in norms.per_param.items() if not math.isfinite(v)),
    }


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distopt", "fp16opt"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_main_on_one_rank_shows_on_every_rank(value: float, dist_opt: bool) -> None:
    results = run_ranks(_poison_body, 2, value, dist_opt, timeout=60)
    for got in results:
        if math.isnan(value):
            assert math.isnan(got["total"]) and math.isnan(got["dense"])
        else:
            assert got["total"] == math.inf and got["dense"] == math.inf
        assert len(got["bad_names"]) == 1 and got["bad_names"] == results[0]["bad_names"]
