"""Tests of norm_optim.testing: the launcher, the CPU shim, the model builders and the oracle.

Every multi-rank case runs the real megatron-core (model, DDP, ``get_megatron_optimizer``,
pipeline schedule) on forked gloo ranks.
"""

from __future__ import annotations

import math
import pathlib
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from norm_optim.testing import (
    RankFailedError,
    RankTimeoutError,
    init_parallel,
    install_cpu_shim,
    run_ranks,
)
from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer, train_step
from norm_optim.testing.oracle import (
    fill_deterministic_,
    global_param_shapes,
    named_global_parameters,
    oracle_sum_of_squares,
)
from tests.support.layouts import Layout

# The builders' defaults, as a user of norm_optim.testing gets them.
DEFAULT = TinyGPTConfig()
DEFAULT4 = TinyGPTConfig(num_layers=4)
DEFAULT_MOE = TinyGPTConfig(num_experts=4)
MOE_ON_LAST_STAGE = TinyGPTConfig(num_experts=4, moe_layer_freq=(0, 1))

LAYOUTS = {
    "w1": Layout(1, DEFAULT),
    "tp2": Layout(2, DEFAULT, tp=2),
    "tp2-pp2": Layout(4, DEFAULT, tp=2, pp=2),
    "pp2-vpp2-dp2": Layout(4, DEFAULT4, pp=2, vpp=2),
    "tp2-pp2-dp2": Layout(8, DEFAULT, tp=2, pp=2),
    "ep2": Layout(2, DEFAULT_MOE, ep=2),
    "tp2-ep2": Layout(4, DEFAULT_MOE, tp=2, ep=2),
    "ep4-alltoall": Layout(
        4, TinyGPTConfig(num_experts=4, moe_token_dispatcher_type="alltoall"), ep=4
    ),
    "tp2-pp2-ep2-etp1-moe-last-stage": Layout(8, MOE_ON_LAST_STAGE, tp=2, pp=2, ep=2, etp=1),
}
EXTRA_LAYOUTS = {
    "cp2-tp2": Layout(4, DEFAULT, cp=2, tp=2),
    "instances2": Layout(4, DEFAULT, instances=2),
    "ep2-frozen-mixed-fp32": Layout(
        2,
        TinyGPTConfig(num_experts=2),
        ep=2,
        freeze=("decoder.layers.0.self_attention.*",),
        fp32_params=("*layernorm*", "*router*"),
    ),
}
ORACLE_LAYOUTS = {
    **{name: LAYOUTS[name] for name in ("w1", "tp2", "pp2-vpp2-dp2", "ep2")},
    "tp2-pp2-ep2-vpp2-untied": Layout(
        8,
        TinyGPTConfig(
            num_experts=4, num_layers=4, moe_layer_freq=(0, 1, 0, 1), tie_embeddings=False
        ),
        tp=2,
        pp=2,
        ep=2,
        vpp=2,
    ),
    "ep2-frozen-mixed-fp32": EXTRA_LAYOUTS["ep2-frozen-mixed-fp32"],
}


def _params(layouts: dict[str, Layout], dist_opt: tuple[bool, ...] = (False, True)) -> list[Any]:
    return [
        pytest.param(layout, d, id=f"{name}-{'distopt' if d else 'fp16opt'}")
        for name, layout in layouts.items()
        for d in dist_opt
    ]


def _build_and_step(layout: Layout, dist_opt: bool) -> tuple[list[torch.nn.Module], Any, tuple]:
    init_parallel(**layout.parallel())
    chunks = build_model(
        layout.cfg,
        use_distributed_optimizer=dist_opt,
        freeze=layout.freeze,
        fp32_params=layout.fp32_params,
        num_distributed_optimizer_instances=layout.instances,
    )
    optimizer = build_optimizer(chunks)
    return chunks, optimizer, train_step(chunks, optimizer)


def _step_result(layout: Layout, dist_opt: bool) -> tuple[bool, float, str]:
    _, optimizer, (ok, grad_norm, _) = _build_and_step(layout, dist_opt)
    return ok, grad_norm, type(optimizer.chained_optimizers[0]).__name__


@pytest.mark.parametrize("layout, dist_opt", _params(LAYOUTS) + _params(EXTRA_LAYOUTS, (True,)))
def test_real_optimizer_steps(layout: Layout, dist_opt: bool) -> None:
    results = run_ranks(_step_result, layout.world, layout, dist_opt, timeout=60)
    assert all(ok for ok, _, _ in results)
    grad_norms = {grad_norm for _, grad_norm, _ in results}
    assert len(grad_norms) == 1, f"the global grad norm differs across ranks: {grad_norms}"
    assert math.isfinite(grad_norms.pop())
    expected = "DistributedOptimizer" if dist_opt else "Float16OptimizerWithFloat16Params"
    assert {kind for _, _, kind in results} == {expected}


# --- the oracle -------------------------------------------------------------------------------


def _shard_key(name: str, param: torch.Tensor) -> tuple[str, int]:
    """(global name, TP shard): equal on every rank that holds a copy of the same elements."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return name, 0
    if getattr(param, "allreduce", True):
        return name, ps.get_tensor_model_parallel_rank()
    return name, ps.get_expert_tensor_parallel_rank()


def _main_params_match(optimizer: Any) -> bool:
    """Whether every fp32 main param (whole or this rank's shard) equals its model param."""
    for inner in optimizer.chained_optimizers:
        for model_group in getattr(inner, "float16_groups", None) or inner.model_float16_groups:
            for param in model_group:
                main = getattr(param, "main_param", None)
                if main is None:
                    continue
                if getattr(param, "main_param_sharded", False):
                    shard = inner._get_model_param_range_map(param)["param"]
                    expected = param.detach().view(-1)[shard.start : shard.end].float()
                else:
                    expected = param.detach().float()
                if not torch.equal(main, expected):
                    return False
    return True


def _dedup_sums_after_fill(layout: Layout, dist_opt: bool, seed: int) -> tuple[dict, dict, bool]:
    chunks, optimizer, _ = _build_and_step(layout, dist_opt)
    fill_deterministic_(chunks, seed, optimizer)
    local = {
        _shard_key(name, p): torch.sum(p.detach().double() ** 2).item()
        for name, p in named_global_parameters(chunks)
        if p.requires_grad
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered, global_param_shapes(chunks), _main_params_match(optimizer)


@pytest.mark.parametrize(
    "layout, dist_opt",
    _params(ORACLE_LAYOUTS, (True,)) + _params({n: LAYOUTS[n] for n in ("w1", "tp2")}, (False,)),
)
def test_oracle_equals_deduplicated_sum_of_actual_params(layout: Layout, dist_opt: bool) -> None:
    seed = 17
    gathered, shapes, main_match = run_ranks(
        _dedup_sums_after_fill, layout.world, layout, dist_opt, seed, timeout=60
    )[0]
    shards: dict[tuple[str, int], float] = {}
    for rank, sums in enumerate(gathered):
        for key, value in sums.items():
            # Replicas, TP duplicates and the tied embedding copy must hold identical values.
            assert shards.setdefault(key, value) == value, f"{key} differs on rank {rank}"
    per_name: dict[str, float] = {}
    for (name, _), value in shards.items():
        per_name[name] = per_name.get(name, 0.0) + value
    oracle = oracle_sum_of_squares(shapes, seed)
    assert per_name.keys() == oracle.keys()
    for name, value in per_name.items():
        assert value == pytest.approx(oracle[name], rel=1e-12), name
    assert main_match, "reload_model_params did not carry the filled values to the main params"


def test_oracle_is_layout_independent() -> None:
    """The same logical model on 1 and on 8 ranks: the same names, shapes and oracle."""
    model = TinyGPTConfig(num_experts=4, num_layers=4)

    def shapes(layout: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        init_parallel(**layout)
        return global_param_shapes(build_model(model))

    single = run_ranks(shapes, 1, {})[0]
    assert run_ranks(shapes, 8, dict(tp=2, pp=2, ep=2, vpp=2))[0] == single
    assert sum(oracle_sum_of_squares(single, 3).values()) > 0


# --- failures ---------------------------------------------------------------------------------


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("planted failure")
    dist.barrier()


def _exit_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def _exit_on_rank_1_then_fail_on_rank_0() -> None:
    """Rank 0 fails because rank 1 is gone (as a collective with a dead peer does)."""
    if dist.get_rank() == 1:
        os._exit(7)
    raise ConnectionResetError("peer gone")  # at once: the parent may read this first


def _hang_on_rank_0() -> None:
    if dist.get_rank() == 0:
        time.sleep(600)
    dist.barrier()


def test_failing_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RankFailedError, match="rank 1 failed: ValueError: planted failure") as err:
        run_ranks(_raise_on_rank_1, 4, timeout=30)
    assert err.value.rank == 1
    assert "_raise_on_rank_1" in err.value.remote_traceback
    assert isinstance(err.value.__cause__, ValueError)


def test_dead_rank_is_reported_not_awaited() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed: process died with exit code 7"):
        run_ranks(_exit_on_rank_1, 2, timeout=30)
    assert time.monotonic() - start < 10


def test_a_dead_rank_is_reported_not_the_peer_it_broke() -> None:
    for _ in range(3):  # whichever of the two the parent reads first
        with pytest.raises(RankFailedError, match="rank 1 failed: process died with exit code 7"):
            run_ranks(_exit_on_rank_1_then_fail_on_rank_0, 2, timeout=30)


def test_hanging_rank_times_out_with_stacks() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as err:
        run_ranks(_hang_on_rank_0, 2, timeout=2)
    assert time.monotonic() - start < 10
    assert err.value.pending == [0, 1]
    assert "_hang_on_rank_0" in err.value.stacks[0]


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def test_spawn_start_method() -> None:
    assert run_ranks(_rank_and_world, 2, start_method="spawn", cpu_shim=False) == [(0, 2), (1, 2)]


# --- the shim ---------------------------------------------------------------------------------


def test_shim_is_idempotent_and_reversible() -> None:
    originals = (torch.cuda.current_device, torch.Tensor.type, torch.zeros)
    shim = install_cpu_shim()
    try:
        assert install_cpu_shim() is shim
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(1).type(torch.float64).dtype == torch.float64
        assert torch.ones(1).cuda().device.type == "cpu"
    finally:
        shim.uninstall()
    assert (torch.cuda.current_device, torch.Tensor.type, torch.zeros) == originals
    assert torch.ones(1).type() == "torch.FloatTensor"
    assert install_cpu_shim() is not shim
    install_cpu_shim().uninstall()


def _segfault_on_rank_1_first_time(marker: str) -> int:
    """Rank 1 dies of SIGSEGV the first time the world runs (``marker`` not yet written)."""
    import ctypes

    rank = dist.get_rank()
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        ctypes.string_at(0)  # a read of address 0: SIGSEGV in native code
    dist.barrier()
    return rank


def _segfault_on_rank_1(_: object = None) -> int:
    import ctypes

    if dist.get_rank() == 1:
        ctypes.string_at(0)
    dist.barrier()
    return dist.get_rank()


def test_crashed_rank_reruns_the_world_once_with_a_warning(tmp_path: "pathlib.Path") -> None:
    marker = str(tmp_path / "crashed")
    with pytest.warns(RuntimeWarning, match=r"rank 1 failed: .*signal SIGSEGV"):
        assert run_ranks(_segfault_on_rank_1_first_time, 2, marker, timeout=30) == [0, 1]


def test_crash_that_recurs_is_reported_with_its_stacks() -> None:
    crash = pytest.raises(RankFailedError, match="rank 1 failed: .*signal SIGSEGV")
    with pytest.warns(RuntimeWarning, match="running all 2 ranks again"), crash as err:
        run_ranks(_segfault_on_rank_1, 2, timeout=30)
    assert "_segfault_on_rank_1" in err.value.remote_traceback  # faulthandler's Python stack
    with pytest.raises(RankFailedError, match="signal SIGSEGV"):  # no retry asked for
        run_ranks(_segfault_on_rank_1, 2, timeout=30, crash_retries=0)


def _compile_is_disabled(_: object = None) -> bool:
    import torch._dynamo

    return bool(torch._dynamo.config.disable)


def test_ranks_run_torch_compile_only_when_asked() -> None:
    assert run_ranks(_compile_is_disabled, 1, timeout=30) == [True]
    assert run_ranks(_compile_is_disabled, 1, timeout=30, compile=True) == [False]
