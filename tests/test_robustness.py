"""The wrapper is invisible, survives checkpoints and reloads, and never hides a NaN or hangs.

Real megatron-core on gloo CPU ranks (``run_ranks``), tiny models. Each group of tests maps to one
promise of issue #7:

1. invisible: training with and without the wrapper is bitwise identical;
2. checkpoints and reloads: after loads (through the wrapper or behind its back), reloads,
   offload-style tensor swaps and rebuilt optimizers the norm follows the new tensors;
4. non-numbers: a NaN / Inf on one rank shows on every rank; an empty model gives 0 and warns;
5. no hangs: ranks that count nothing, uneven MoE stages, an exception before the collective;
6. bad input: every error of the public API names the problem.

Optimizer kinds (3.) are in ``test_optimizer_kinds.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import time
import weakref
from typing import Any

import pytest
import torch

from norm_optim.testing import RankFailedError, init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer, train_step
from norm_optim.testing.oracle import fill_deterministic_, global_param_shapes, oracle_norm
from precision_aware_standin import build_precision_aware_optimizer

SEED = 5
REL = 1e-7  # the CPU kernel accumulates rows of 256 in fp32 (~2e-8)
DENSE = TinyGPTConfig(hidden_size=32, num_layers=4, num_attention_heads=4, vocab_size=64)
SMALL = dataclasses.replace(DENSE, num_layers=2)
MOE = dataclasses.replace(DENSE, num_experts=4, moe_ffn_hidden_size=32)


def _wrap(inner: Any, chunks: list) -> Any:
    from norm_optim import NormAwareOptimizer

    return NormAwareOptimizer(inner, model=chunks)


def _filled_oracle(chunks: list, optimizer: Any, seed: int) -> float:
    fill_deterministic_(chunks, seed, optimizer=optimizer)
    return oracle_norm(global_param_shapes(chunks), seed)


# ================================================================ 1. invisible


INVISIBLE = {
    "dense-tp2-pp2": (4, DENSE, dict(tp=2, pp=2)),
    "moe-ep2-dp2": (4, MOE, dict(ep=2)),
}


def _training_run(cfg: TinyGPTConfig, parallel: dict, dist_opt: bool, wrapped: bool) -> dict:
    import norm_optim.testing.models as models

    init_parallel(**parallel)
    losses: list[torch.Tensor] = []
    original_loss = models._loss

    def recording_loss(output: torch.Tensor) -> Any:
        loss, extra = original_loss(output)
        losses.append(loss.detach().clone())
        return loss, extra

    models._loss = recording_loss  # the forward step looks it up at call time
    chunks = build_model(cfg, use_distributed_optimizer=dist_opt, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = _wrap(inner, chunks) if wrapped else inner
    grad_norms, norms = [], []
    for step in range(3):
        ok, grad_norm, _ = train_step(chunks, optimizer, seed=step)
        assert ok
        grad_norms.append(grad_norm)
        if wrapped:
            norms.append(float(optimizer.param_l2_norm()))
            optimizer.param_l2_norms(per_param=True)  # the per-param form too (gathers names once)
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "params": [p.detach().clone() for c in chunks for p in c.parameters()],
        "mains": [t.detach().clone() for g in inner.param_groups for t in g["params"]],
        "norms": norms,
    }


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distopt", "fp16opt"])
@pytest.mark.parametrize("name", list(INVISIBLE))
def test_training_is_bitwise_identical_with_the_wrapper(name: str, dist_opt: bool) -> None:
    world, cfg, parallel = INVISIBLE[name]
    plain = run_ranks(_training_run, world, cfg, parallel, dist_opt, False)
    wrapped = run_ranks(_training_run, world, cfg, parallel, dist_opt, True)
    for rank, (a, b) in enumerate(zip(plain, wrapped)):
        assert a["grad_norms"] == b["grad_norms"], f"rank {rank}: grad norms differ"
        assert len(a["losses"]) == len(b["losses"])
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])), f"rank {rank}"
        assert len(a["params"]) == len(b["params"]) and len(a["mains"]) == len(b["mains"])
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), f"rank {rank}"
        assert all(torch.equal(x, y) for x, y in zip(a["mains"], b["mains"])), f"rank {rank}"
        assert b["norms"] == wrapped[0]["norms"] and len(set(b["norms"])) == 3
    assert any(r["losses"] for r in plain), "the last stage recorded its losses"


# ================================================================ 2. checkpoints and reloads


def _checkpoint_body(dist_opt: bool, through_wrapper: bool) -> dict:
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=dist_opt, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = _wrap(inner, chunks)
    loader = optimizer if through_wrapper else inner
    train_step(chunks, optimizer, seed=0)
    result = {"oracle1": _filled_oracle(chunks, optimizer, 1)}
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
    result["oracle2"] = _filled_oracle(chunks, optimizer, 2)
    result["before_load"] = float(optimizer.param_l2_norm())
    loader.load_state_dict(saved)
    if dist_opt:
        leaf.load_parameter_state_from_dp_reshardable(param_state)
    result["loaded"] = float(optimizer.param_l2_norm())
    return result


@pytest.mark.parametrize("through_wrapper", [True, False], ids=["wrapper", "inner"])
@pytest.mark.parametrize("dist_opt", [True, False], ids=["distopt", "fp16opt"])
def test_load_state_dict_and_parameter_state(dist_opt: bool, through_wrapper: bool) -> None:
    for got in run_ranks(_checkpoint_body, 2, dist_opt, through_wrapper):
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
    optimizer = _wrap(inner, chunks)
    oracle = _filled_oracle(chunks, optimizer, 1)
    old_registry = weakref.ref(optimizer.registry)
    _swap_storage(optimizer if through_wrapper else inner)
    for group in inner.param_groups:  # write through the new storage only
        for main in group["params"]:
            main.mul_(2.0)
    released = through_wrapper and (gc.collect() or old_registry() is None)
    norm = float(optimizer.param_l2_norm())
    train_step(chunks, optimizer, seed=3)  # the optimizer keeps stepping the new tensors
    stepped = sum(float(m.double().pow(2).sum()) for g in inner.param_groups for m in g["params"])
    return {"oracle": oracle, "norm": norm, "released": released,
            "counted_after_step": float(optimizer.param_l2_norm()), "stepped": stepped}


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
    optimizer = _wrap(inner, chunks)
    train_step(chunks, optimizer, seed=0)
    leaf = inner.chained_optimizers[0]
    te_adam = leaf.optimizer
    before = float(optimizer.param_l2_norm())
    state = copy.deepcopy(te_adam.state_dict())
    for values in state["state"].values():
        if "master_param" in values:
            values["master_param"].mul_(2.0)
    te_adam.load_state_dict(state)
    masters = [te_adam.get_unscaled_state(p, "master_param")
               for p, m in te_adam.state.items() if "master_param" in m]
    fp32_shards = [s for g in leaf.shard_fp32_groups for s in g]
    total = torch.tensor([sum(float(m.double().pow(2).sum()) for m in masters + fp32_shards)],
                         dtype=torch.float64)
    torch.distributed.all_reduce(total)
    return {"before": before, "after": float(optimizer.param_l2_norm()),
            "reference": math.sqrt(float(total))}


@pytest.mark.parametrize("remainders", [False, True], ids=["fp32-masters", "remainders"])
def test_precision_aware_master_weights_replaced_by_an_inner_load(remainders: bool) -> None:
    for got in run_ranks(_precision_aware_reload_body, 2, remainders):
        assert got["after"] == pytest.approx(got["reference"], rel=REL)
        assert got["after"] > 1.5 * got["before"]


def _rebuilt_optimizer_body() -> dict:
    init_parallel(ep=2)
    chunks = build_model(MOE, use_distributed_optimizer=True, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = _wrap(inner, chunks)
    oracle = _filled_oracle(chunks, optimizer, 1)
    first = float(optimizer.param_l2_norm())
    # Rebuild the expert leaf (as a resumed run re-creating its optimizer would) with scaled mains.
    rebuilt = build_optimizer(chunks, lr=1e-2).chained_optimizers[1]
    for group in rebuilt.param_groups:
        for main in group["params"]:
            main.mul_(3.0)
    inner.chained_optimizers[1] = rebuilt
    norms = optimizer.param_l2_norms()
    return {"oracle": oracle, "first": first, "total": float(norms.total),
            "dense": float(norms.dense), "expert": float(norms.expert)}


def test_rebuilt_leaf_optimizer_is_noticed() -> None:
    for got in run_ranks(_rebuilt_optimizer_body, 2):
        assert got["first"] == pytest.approx(got["oracle"], rel=REL)
        expected = math.hypot(got["dense"], got["expert"])
        assert got["total"] == pytest.approx(expected, rel=REL)
        # Only the expert part was scaled by 3: the total moved accordingly.
        assert got["total"] ** 2 == pytest.approx(
            got["oracle"] ** 2 + 8 * got["expert"] ** 2 / 9, rel=1e-6
        )


# ================================================================ 4. numbers that are not numbers


def _poison_body(value: float, dist_opt: bool) -> dict:
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=dist_opt, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = _wrap(inner, chunks)
    # Rank 1 owns shards with the distributed optimizer; rank 0 owns all with the Float16 one.
    if torch.distributed.get_rank() == (1 if dist_opt else 0):
        record = optimizer.registry.counted[-1]
        record.tensor.view(-1)[0] = value  # one element of one counted main, on this rank only
    norms = optimizer.param_l2_norms(per_param=True)
    return {"total": float(norms.total), "dense": float(norms.dense),
            "bad_names": sorted(n for n, v in norms.per_param.items() if not math.isfinite(v))}


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


def test_empty_model_gives_zero_with_a_warning() -> None:
    from megatron.core.optimizer import ChainedOptimizer

    from norm_optim import NormAwareOptimizer

    with pytest.warns(UserWarning, match="no params; its norm is 0"):
        optimizer = NormAwareOptimizer(ChainedOptimizer([]), model=[])
    assert float(optimizer.param_l2_norm()) == 0.0
    assert optimizer.param_l2_norms(per_param=True).per_param == {}


# ================================================================ plain torch.optim


def test_plain_torch_optimizer_single_process() -> None:
    from norm_optim import NormAwareOptimizer

    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    model[2].weight.requires_grad_(False)  # frozen: counted from the model, not the optimizer
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    optimizer = NormAwareOptimizer(sgd, model=model)
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    expected = math.sqrt(sum(float(p.double().pow(2).sum()) for p in model.parameters()))
    assert float(optimizer.param_l2_norm()) == pytest.approx(expected, rel=REL)
    assert {r.source for r in optimizer.registry} == {"fp32-param", "frozen"}
    assert isinstance(optimizer, torch.optim.SGD)


def _plain_torch_dp_body() -> dict:
    from norm_optim import NormAwareOptimizer

    init_parallel()  # DP2: params replicated on both ranks
    torch.manual_seed(0)  # the same replica everywhere
    model = torch.nn.Linear(6, 4)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    optimizer = NormAwareOptimizer(adam, model=model)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    local = math.sqrt(sum(float(p.double().pow(2).sum()) for p in model.parameters()))
    return {"norm": float(optimizer.param_l2_norm()), "local": local,
            "reasons": sorted({str(r.reason) for r in optimizer.registry})}


def test_plain_torch_optimizer_replicated_over_dp_is_counted_once() -> None:
    results = run_ranks(_plain_torch_dp_body, 2)
    for got in results:
        assert got["norm"] == pytest.approx(results[0]["local"], rel=REL)
    assert results[0]["reasons"] == ["None"] and results[1]["reasons"] == ["dp-replica"]


# ================================================================ 5. no hangs


def _frozen_stage_body(count_frozen: bool) -> dict:
    """PP2: stage 0 is frozen whole, so with count_frozen=False it counts nothing."""
    from megatron.core import parallel_state as ps

    init_parallel(pp=2)
    cfg = dataclasses.replace(DENSE, tie_embeddings=False)
    stage = ps.get_pipeline_model_parallel_rank()
    chunks = build_model(cfg, use_distributed_optimizer=True, freeze=("*",) if stage == 0 else (),
                         seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    from norm_optim import NormAwareOptimizer

    optimizer = NormAwareOptimizer(inner, model=chunks, count_frozen=count_frozen)
    fill_deterministic_(chunks, 1, optimizer=inner)
    shapes = global_param_shapes(chunks, trainable_only=not count_frozen)
    norms = optimizer.param_l2_norms(per_param=True)
    return {"norm": float(norms.total), "oracle": oracle_norm(shapes, 1),
            "counted": len(optimizer.registry.counted)}


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
    optimizer = _wrap(inner, chunks)
    train_step(chunks, optimizer, seed=0)
    oracle = _filled_oracle(chunks, optimizer, 1)
    norms = optimizer.param_l2_norms(per_param=True)
    return {"oracle": oracle, "norm": float(optimizer.param_l2_norm()),
            "per_param_total": float(norms.total),
            "experts": sum(r.expert for r in optimizer.registry)}


def test_uneven_moe_layers_per_pipeline_stage() -> None:
    results = run_ranks(_uneven_moe_body, 4, timeout=60)
    for got in results:
        assert got["norm"] == pytest.approx(got["oracle"], rel=REL)
        assert got["per_param_total"] == pytest.approx(got["oracle"], rel=REL)
    assert sorted(r["experts"] > 0 for r in results) == [False, False, True, True], results


def _raise_on_one_rank_body() -> float:
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=True, seed=SEED)
    optimizer = _wrap(build_optimizer(chunks), chunks)
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("rank 1 broke before the norm")
    return float(optimizer.param_l2_norm())  # rank 0 waits in the all-reduce


def test_exception_on_one_rank_before_the_collective_does_not_hang() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed.*broke before the norm"):
        run_ranks(_raise_on_one_rank_body, 2, timeout=60)
    assert time.monotonic() - start < 30, "the failing rank was reported only at the timeout"


def _counts_nothing_body() -> dict:
    """DP4 with the (non-distributed) Float16 optimizer: ranks 1-3 hold replicas only."""
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=False, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = _wrap(inner, chunks)
    oracle = _filled_oracle(chunks, optimizer, 1)
    return {"oracle": oracle, "norm": float(optimizer.param_l2_norm()),
            "counted": len(optimizer.registry.counted)}


def test_ranks_that_count_nothing_still_join_the_one_collective() -> None:
    results = run_ranks(_counts_nothing_body, 4, timeout=90)
    for got in results:
        assert got["norm"] == pytest.approx(got["oracle"], rel=REL)
    assert [r["counted"] == 0 for r in results] == [False, True, True, True]


# ================================================================ 6. bad input


@pytest.mark.parametrize(
    "dtype,declared", [(torch.float16, False), (torch.int16, False), (torch.float16, True)],
    ids=["fp16-state", "int16-without-remainders", "fp16-declared-before-any-state"],
)
def test_low_precision_master_weights_are_refused_by_name(dtype: torch.dtype, declared: bool) -> None:
    from norm_optim.megatron.optimizers import _precision_aware_master
    from norm_optim import UnsupportedOptimizerError

    shard = torch.zeros(4, dtype=torch.bfloat16)
    inner = torch.optim.SGD([shard], lr=0.1)
    if declared:  # as TE's FusedAdam(master_weight_dtype=...) says before its first step
        inner.master_weight_dtype = dtype
    else:
        inner.state[shard]["master_param"] = torch.zeros(4, dtype=dtype)
    leaf = type("Leaf", (), {"optimizer": inner, "model_param_group_index_map": {shard: (0, 0)}})
    with pytest.raises(UnsupportedOptimizerError, match=rf"{dtype} tensors.*fp32 master"):
        _precision_aware_master(leaf, shard)


def test_param_held_by_two_leaves_is_named() -> None:
    from megatron.core.optimizer import ChainedOptimizer, FP32Optimizer, OptimizerConfig

    from norm_optim import NormAwareOptimizer, UnknownParamError

    from norm_optim.testing import cpu_shim

    model = torch.nn.Linear(3, 2)
    with cpu_shim():  # FP32Optimizer makes CUDA tensors
        leaf = FP32Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), OptimizerConfig(lr=0.1),
                             None)
    with pytest.raises(UnknownParamError, match=r"held by two optimizer leaves.*FP32Optimizer"):
        NormAwareOptimizer(ChainedOptimizer([leaf, leaf]), model=model)


def test_registry_lookups_name_what_is_missing() -> None:
    from norm_optim import NormAwareOptimizer

    model = torch.nn.Linear(3, 2)
    optimizer = NormAwareOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert optimizer.registry["weight"].counted
    with pytest.raises(KeyError, match="no param named 'nope'"):
        optimizer.registry["nope"]
    with pytest.raises(KeyError, match="not a param of the registry's model"):
        optimizer.registry.find(torch.zeros(1))


def test_distributed_run_without_parallel_state_is_refused() -> None:
    from norm_optim import ParallelStateError

    def body() -> None:
        from norm_optim import NormAwareOptimizer

        model = torch.nn.Linear(3, 2)
        NormAwareOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)

    with pytest.raises(RankFailedError, match="parallel state is not initialized") as e:
        run_ranks(body, 2)
    assert isinstance(e.value.__cause__, ParallelStateError)


def _reduce_over_own_rank_only() -> str:
    import torch.distributed as dist

    from norm_optim import NormAwareOptimizer, ParallelStateError

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
