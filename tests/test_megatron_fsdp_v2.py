"""Megatron-FSDP v2 (``megatron_fsdp_version=2``, ``FullyShardedOptimizer``; megatron-core main):
exact norms from its fp32 main-weight slices, against the layout-independent oracle, on the real
megatron-core.

Each layout builds the tiny GPT (dense or MoE) on gloo CPU ranks as one v2 chunk (test-only CPU
patches: ``norm_optim.testing.megatron_fsdp``) with the real ``get_megatron_optimizer``, writes
every weight's layout-independent values into this rank's slices of the groups' fp32
``main_weight`` and bf16 ``model_weight`` buffers, and scales the fp32 slices the optimizer steps
by ``MAIN_SCALE`` (not representable in bf16: a norm read from the bf16 weights would be off by
~1e-3). The norm must be ``sqrt(MAIN_SCALE² · trainable² + frozen²)`` of the *unparallel*
model's shapes, to 1e-6, on every rank, with the dense / expert / per-param breakdowns, one
all-reduce per call, every summed tensor a view of v2's own buffers, and every element counted
on one rank. The same run checks it after real training steps and after the main weights move
to new storage behind the wrapper's back (the fingerprint must notice), and shows Megatron-LM's
own ``calc_params_l2_norm`` on the same weights: exact on dense, wrong under EP.

v2 refuses TP / PP / CP > 1 itself; it trains with EP only without grad clipping on CPU
(megatron's grad-norm helper asserts on dense and expert grads living on different meshes), and
cannot train a unit module with no trainable params (so the frozen layouts freeze parts of
units).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch

from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.megatron_fsdp import has_megatron_fsdp_v2
from norm_optim.testing.megatron_fsdp import (
    build_fsdp_model,
    fill_fsdp_v2_deterministic_,
    fsdp_v2_parameter_groups,
)
from norm_optim.testing.models import build_optimizer
from norm_optim.testing.oracle import global_param_shapes
from tests.support.layouts import SMALL, SMALL_MOE, Layout
from tests.support.fsdp_body import CountingCommunicator, read_after_move, read_after_steps
from tests.support.reads import MAIN_SCALE, REL, check_read, read_norms, unparallel_oracle

pytestmark = pytest.mark.skipif(
    not has_megatron_fsdp_v2(),
    reason="this megatron-core has no Megatron-FSDP v2 (megatron_fsdp_version=2, main only)",
)

SEED_A, SEED_B = 7, 8
TIMEOUT = 240.0
FROZEN = ("embedding.*", "decoder.layers.0.self_attention.*")

LAYOUTS = {
    "dp2": Layout(2, SMALL),
    "dp4": Layout(4, SMALL),
    "moe-ep1-dp2": Layout(2, SMALL_MOE),
    "moe-ep2-edp1": Layout(2, SMALL_MOE, ep=2),
    "moe-ep2-edp2": Layout(4, SMALL_MOE, ep=2),
    "dp2-frozen": Layout(2, SMALL, freeze=FROZEN),
    "moe-ep2-edp2-frozen": Layout(4, SMALL_MOE, ep=2, freeze=FROZEN),
}


def _fill(chunks: list, optimizer: Any, seed: int) -> None:
    fill_fsdp_v2_deterministic_(chunks, seed)
    for group in optimizer.param_groups:  # the fp32 slices the optimizer steps
        for main in group["params"]:
            main._local_tensor.mul_(MAIN_SCALE)


def _own_buffers(chunks: list) -> set[int]:
    """Storage of every v2 weight buffer (main and model) of this rank."""
    return {
        buffer.local_buffer.untyped_storage().data_ptr()
        for group in fsdp_v2_parameter_groups(chunks)
        for buffer in (group.main_weight, group.model_weight)
    }


def _move_main_weights(chunks: list) -> None:
    """Give every group's fp32 main weights new storage and re-point the sharded params (the
    optimizer's DTensors) at it, behind the wrapper's back."""
    for group in fsdp_v2_parameter_groups(chunks):
        if not group.requires_grad:
            continue
        group.main_weight.local_buffer = group.main_weight.local_buffer.clone()
        for index, pair in enumerate(group.fsdp_parameters):
            pair.sharded._local_tensor = group.main_weight.get_local_tensor(index)


def _megatron_norm(chunks: list) -> float:
    """Megatron-LM's own ``calc_params_l2_norm`` under ``--use-megatron-fsdp``."""
    import types

    from megatron.training import global_vars
    from megatron.training.utils import calc_params_l2_norm

    global_vars.set_args(types.SimpleNamespace(use_megatron_fsdp=True, bf16=True))
    return float(calc_params_l2_norm(chunks))


def _rank_body(layout: Layout) -> dict[str, Any]:
    from norm_optim import NormAwareOptimizer

    init_parallel(**layout.parallel())
    chunks = build_fsdp_model(layout.cfg, seed=3, freeze=layout.freeze, version=2)
    inner = build_optimizer(chunks, lr=1e-2, clip_grad=0.0 if layout.ep > 1 else 1.0)
    counting = CountingCommunicator()
    optimizer = NormAwareOptimizer(inner, model=chunks, comm=counting)
    got: dict[str, Any] = {
        "shapes": global_param_shapes(chunks, trainable_only=False),
        "optimizer": type(inner).__name__,
    }

    _fill(chunks, inner, SEED_A)
    got["init"] = read_norms(optimizer, counting)
    own = _own_buffers(chunks)
    got["views_of_buffers"] = all(
        r.tensor.untyped_storage().data_ptr() in own for r in optimizer.registry.counted
    )
    got["counted_numel"] = optimizer.registry.counted_numel
    got["sources"] = sorted({str(r.source) for r in optimizer.registry})
    got["megatron"] = _megatron_norm(chunks)  # the same weights

    got.update(read_after_steps(optimizer, chunks, lambda: _fill(chunks, inner, SEED_A), counting))
    got["without_frozen"] = float(
        NormAwareOptimizer(inner, model=chunks, count_frozen=False).param_l2_norm()
    )
    got.update(
        read_after_move(
            optimizer, lambda: _move_main_weights(chunks), lambda: _fill(chunks, inner, SEED_B)
        )
    )
    return got


@functools.lru_cache(maxsize=None)
def _run(name: str) -> tuple[dict[str, Any], ...]:
    """One run per layout, shared by the tests that check it."""
    layout = LAYOUTS[name]
    return tuple(run_ranks(_rank_body, layout.world, layout, timeout=TIMEOUT))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_fsdp_v2_norm_matches_unparallel_oracle(name: str) -> None:
    layout = LAYOUTS[name]
    a = unparallel_oracle(layout.cfg, layout.freeze, SEED_A)
    b = unparallel_oracle(layout.cfg, layout.freeze, SEED_B)
    results = _run(name)
    for rank, got in enumerate(results):
        where = f"rank {rank}"
        assert got["optimizer"] == "FullyShardedOptimizer", "not the v2 optimizer"
        assert got["shapes"] == a["shapes"], f"{where}: the layout's model differs"
        check_read(got["init"], a, f"{where}, at init")
        assert got["views_of_buffers"], "a summed tensor is a copy, not Megatron-FSDP v2's own"
        assert got["trained_changed"] != pytest.approx(a["total"], rel=1e-4), "steps did nothing"
        assert not got["rebuilt_by_steps"], "steps keep v2's main weights: no rebuild"
        check_read(got["after_steps"], a, f"{where}, after 2 steps")
        assert got["without_frozen"] == pytest.approx(a["trainable"], rel=REL), "count_frozen"
        assert got["rebuilt_after_move"], "new main-weight storage must rebuild the registry"
        assert got["after_move"] == pytest.approx(b["total"], rel=REL), f"{where}, after move"
        assert ("frozen-shard" in got["sources"]) == bool(layout.freeze), got["sources"]
    # Each element on exactly one rank: the counted elements add up to the model's size
    # (trainable main slices and frozen slices alike).
    numel = sum(math.prod(s) for s in a["shapes"].values())
    assert sum(r["counted_numel"] for r in results) == numel


EP_LAYOUTS = [n for n, layout in LAYOUTS.items() if layout.ep > 1]


@pytest.mark.parametrize("name", EP_LAYOUTS)
def test_megatron_calc_params_l2_norm_is_wrong_under_ep(name: str) -> None:
    """The same run: Megatron-LM's ``calc_params_l2_norm`` on v2 sums each EP rank's own
    experts only (the expert mesh has no EP axis); norm_optim is exact there."""
    layout = LAYOUTS[name]
    expected = unparallel_oracle(layout.cfg, layout.freeze, SEED_A)["total"]
    for got in _run(name):
        assert got["init"]["total"] == pytest.approx(expected, rel=REL)
        assert got["megatron"] != pytest.approx(expected, rel=1e-3), got["megatron"]


@pytest.mark.parametrize("name", ["dp2", "dp4"])
def test_megatron_calc_params_l2_norm_is_exact_on_dense(name: str) -> None:
    """For fairness: without experts Megatron's DTensor walk is exact on v2 too (same run)."""
    expected = unparallel_oracle(SMALL, (), SEED_A)["total"]
    for got in _run(name):
        assert got["megatron"] == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------ what is refused, clearly


def _bf16_main_body() -> str:
    from norm_optim import NormAwareOptimizer
    from norm_optim._errors import UnsupportedOptimizerError

    init_parallel()
    chunks = build_fsdp_model(SMALL, version=2, megatron_fsdp_main_params_dtype=torch.bfloat16)
    try:
        NormAwareOptimizer(build_optimizer(chunks), model=chunks)
    except UnsupportedOptimizerError as exc:
        return str(exc)
    return "accepted"


def test_bf16_main_weights_are_refused_naming_v2() -> None:
    """v2 with bf16 main weights has no fp32 master to read: refused with the v2 setting, never
    with Megatron-FSDP v1's advice."""
    message = run_ranks(_bf16_main_body, 2, timeout=TIMEOUT)[0]
    assert "Megatron-FSDP v2" in message and "megatron_fsdp_main_params_dtype" in message
    assert "ordinary DDP buffers" not in message


def _patches_body() -> list[bool]:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import dbuffer, module

    from norm_optim.testing._internal.megatron_fsdp_patches import install_megatron_fsdp_cpu_patches

    def v2() -> tuple:
        return (
            adapter.fully_shard_context,
            module.FsdpContext.current_stream,
            dbuffer.DBuffer.__init__,
        )

    originals = v2()
    handle = install_megatron_fsdp_cpu_patches()
    patched = v2()
    handle.uninstall()
    return [
        all(p is not o for p, o in zip(patched, originals)),
        all(r is o for r, o in zip(v2(), originals)),
    ]


def test_v2_cpu_patches_are_reversible() -> None:
    assert run_ranks(_patches_body, 1, timeout=TIMEOUT)[0] == [True, True]
