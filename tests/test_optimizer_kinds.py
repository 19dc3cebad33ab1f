"""Every optimizer kind megatron-core 0.16 builds, on real CPU ranks, after real training steps.

For each kind the tiny GPT trains a few steps (so optimizer state exists and main params differ
from their initial values), then ``param_l2_norm()`` is checked against a reference computed in
the test from the tensors that kind updates (independent of norm_optim's registry), and, where
megatron can refresh its main params from the model, against the layout-independent oracle after
``fill_deterministic_`` + ``reload_model_params()``.

Kinds that cannot run on CPU as they are are built as close to production as possible, and say so:
- ``HybridDeviceOptimizer`` offloads only CUDA params; here the main shards are *declared* on the
  device while its sub-optimizer works on CPU copies (main params on CPU, model elsewhere).
- The precision-aware optimizer uses :class:`PrecisionAwareAdamStandIn`, which reproduces TE
  FusedAdam's state layout, fp32 masters or int16 remainders (TE cannot run on CPU).
- The layer-wise distributed optimizer is tested here with the Adam leaves
  ``get_megatron_muon_optimizer`` also chains into it; Muon itself (``emerging_optimizers``,
  megatron-core >= 0.19) through ``get_megatron_optimizer`` is in ``test_layouts.py`` (``muon-*``).

Also a plain ``torch.optim`` optimizer, in one process and replicated over DP2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator

import pytest
import torch

from norm_optim import NormAwareOptimizer
from norm_optim.testing import init_parallel, run_ranks
from norm_optim._versions import megatron_at_least
from norm_optim.testing.models import build_model, build_optimizer, train_step
from norm_optim.testing.oracle import fill_deterministic_, global_param_shapes, oracle_norm
from tests.support.layouts import SMALL, SMALL_MOE, Layout
from tests.support.precision_aware_standin import (
    PrecisionAwareAdamStandIn,
    build_precision_aware_optimizer,
)

SEED = 11
STEPS = 2
REL = 1e-7  # the CPU kernel accumulates rows of <= 1024 in fp32 (norms: <= ~8e-8)


# ------------------------------------------------------------------------ kind builders


def _config(**fields: Any) -> Any:
    from megatron.core.optimizer import OptimizerConfig

    fields.setdefault("bf16", True)
    return OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        clip_grad=1.0,
        params_dtype=torch.bfloat16 if fields["bf16"] else torch.float32,
        **fields,
    )


@contextlib.contextmanager
def _main_params_declared_on_device() -> Iterator[None]:
    """Let ``HybridDeviceOptimizer`` offload the main shards it is given, as it does on a GPU.

    It moves only params with ``is_cuda`` to CPU copies (and pins them); on a CPU-only machine it
    would therefore offload nothing and then fail looking up the CPU copies. During its grouping,
    the params it is given report ``is_cuda`` (its copies do not) and pinning is the identity.
    """
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    original = HybridDeviceOptimizer._get_sub_optimizer_param_groups

    def grouping(self: Any, offload_fraction: float) -> Any:
        on_device = {id(p) for g in self.param_groups for p in g["params"]}
        mp = pytest.MonkeyPatch()
        mp.setattr(torch.Tensor, "is_cuda", property(lambda t: id(t) in on_device), raising=False)
        mp.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: t)
        try:
            return original(self, offload_fraction)
        finally:
            mp.undo()

    mp = pytest.MonkeyPatch()
    mp.setattr(HybridDeviceOptimizer, "_get_sub_optimizer_param_groups", grouping)
    try:
        yield
    finally:
        mp.undo()


def _hybrid(chunks: list, precision_aware: bool) -> Any:
    import megatron.core.optimizer.optimizer_config as oc
    from megatron.core.optimizer import get_megatron_optimizer

    mp = pytest.MonkeyPatch()
    mp.setattr(oc, "is_te_min_version", lambda *a, **k: True)  # no TE to ask
    try:
        # megatron-core 0.14 has no decoupled_weight_decay: its offloaded Adam is always AdamW.
        adamw = {"decoupled_weight_decay": True} if megatron_at_least(0, 15) else {}
        config = _config(
            use_distributed_optimizer=True,
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=1.0,
            pin_cpu_grads=False,
            pin_cpu_params=False,
            use_precision_aware_optimizer=precision_aware,
            **adamw,
        )
    finally:
        mp.undo()
    return get_megatron_optimizer(config, chunks)


def _layer_wise(chunks: list) -> Any:
    """``LayerWiseDistributedOptimizer`` as ``get_megatron_muon_optimizer`` builds it for its Adam
    leaves: unwrapped fp32 leaves, then bf16 master weights created after the layer split."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = _config(bf16=False, use_distributed_optimizer=False)
    leaves = get_megatron_optimizer(config, chunks).chained_optimizers
    if megatron_at_least(0, 18, 2):
        # Since 0.18.2 it takes the base torch optimizers and wraps them itself (it refuses
        # FP32Optimizer / Float16 leaves).
        leaves = [leaf.optimizer for leaf in leaves]
    config.bf16 = True
    return LayerWiseDistributedOptimizer(
        leaves, config, ProcessGroupCollection.use_mpu_process_groups()
    )


@dataclasses.dataclass(frozen=True)
class Kind:
    layout: Layout
    dist_opt: bool = True
    bf16: bool = True
    build: str = "standard"
    # Whether megatron's reload_model_params() refreshes the fp32 tensors from the model params
    # (not for the precision-aware optimizer, whose master weights are the truth; not for
    # HybridDeviceOptimizer with fp32 shards, which refreshes only its bf16 -> fp32 copies).
    reloads: bool = True


DP2, TP2_DP2 = Layout(2, SMALL), Layout(4, SMALL, tp=2)
MOE_EP2 = Layout(2, SMALL_MOE, ep=2)
KINDS = {
    "float16-dp2": Kind(DP2, dist_opt=False),
    "distributed-dp2": Kind(DP2),
    "fp32-dp2": Kind(DP2, dist_opt=False, bf16=False),
    "fp32-distributed-dp2": Kind(DP2, bf16=False),
    "chained-dense-expert-ep2-dp2": Kind(Layout(4, SMALL_MOE, ep=2)),
    "chained-dense-expert-float16-ep2": Kind(MOE_EP2, dist_opt=False),
    "layer-wise-dp2": Kind(DP2, dist_opt=False, build="layer_wise"),
    "layer-wise-tp2-dp2": Kind(TP2_DP2, dist_opt=False, build="layer_wise"),
    "layer-wise-moe-ep2-dp2": Kind(Layout(4, SMALL_MOE, ep=2), dist_opt=False, build="layer_wise"),
    "hybrid-offload-dp2": Kind(DP2, build="hybrid", reloads=False),
    "hybrid-offload-precision-aware-dp2": Kind(DP2, build="hybrid-pa"),
    "precision-aware-standin-dp2": Kind(DP2, build="precision_aware", reloads=False),
    "precision-aware-standin-tp2-dp2": Kind(TP2_DP2, build="precision_aware", reloads=False),
    "precision-aware-remainders-tp2-dp2": Kind(
        TP2_DP2, build="precision_aware_remainders", reloads=False
    ),
}


def _build(kind: Kind, chunks: list) -> Any:
    if kind.build == "standard":
        return build_optimizer(chunks, bf16=kind.bf16, lr=1e-2)
    if kind.build == "layer_wise":
        return _layer_wise(chunks)
    if kind.build in ("hybrid", "hybrid-pa"):
        return _hybrid(chunks, precision_aware=kind.build == "hybrid-pa")
    if kind.build in ("precision_aware", "precision_aware_remainders"):
        return build_precision_aware_optimizer(
            chunks, clip_grad=1.0, store_param_remainders=kind.build.endswith("remainders")
        )
    raise AssertionError(kind.build)


# ------------------------------------------------------------------------ references


def _reference_tensors(optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """(model param, fp32 tensor the optimizer *updates*, replicated over DP?) per kind.

    Read from the optimizer's own update path (what its step writes), not from norm_optim.
    """
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    pairs = []
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = leaf.optimizer
        if inner is None:
            continue
        if hasattr(leaf, "shard_fp32_from_float16_groups"):
            model_groups = leaf.model_float16_groups + leaf.model_fp32_groups
            for group in model_groups:
                for param in group:
                    gi, order = leaf.model_param_group_index_map[param]
                    shard = inner.param_groups[gi]["params"][order]
                    if isinstance(inner, HybridDeviceOptimizer):
                        # The CPU copy its CPU sub-optimizer steps (bf16 shards: the fp32 copy).
                        updated = inner.param_to_inner_param[shard]
                    elif (
                        isinstance(inner, PrecisionAwareAdamStandIn)
                        and shard.dtype != torch.float32
                    ):
                        updated = inner.get_unscaled_state(shard, "master_param")
                    else:
                        updated = shard
                    pairs.append((param, updated, False))
        elif hasattr(leaf, "fp32_from_float16_groups"):
            for model, mains in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                pairs.extend((p, m, True) for p, m in zip(model, mains))
            for group in leaf.fp32_from_fp32_groups:
                pairs.extend((p, p, True) for p in group)
        else:
            pairs.extend((p, p, True) for g in inner.param_groups for p in g["params"])
    return pairs


def _reference_norm(optimizer: Any, layer_wise: bool) -> float:
    """Global norm of the updated fp32 tensors: each element once (TP dups and DP replicas out)."""
    from megatron.core import parallel_state as ps

    total = torch.zeros(1, dtype=torch.float64)
    for param, tensor, replicated in _reference_tensors(optimizer):
        replicated = replicated and not layer_wise  # layer-wise: each param on one DP rank
        expert = not getattr(param, "allreduce", True)
        tp = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
        if tp != 0 and not getattr(param, "tensor_model_parallel", False):
            continue
        dp = ps.get_expert_data_parallel_rank() if expert else ps.get_data_parallel_rank()
        if replicated and dp != 0:
            continue
        total += tensor.double().pow(2).sum()
    torch.distributed.all_reduce(total)
    return math.sqrt(float(total))


def _kind_body(kind: Kind) -> dict[str, Any]:
    init_parallel(**kind.layout.parallel())
    cfg = dataclasses.replace(kind.layout.cfg, bf16=kind.bf16)
    chunks = build_model(cfg, use_distributed_optimizer=kind.dist_opt, seed=SEED)
    with _main_params_declared_on_device():
        inner = _build(kind, chunks)
        optimizer = NormAwareOptimizer(inner, model=chunks)
        norms, references = [], []
        for step in range(STEPS):
            ok, _, _ = train_step(chunks, optimizer, seed=step)
            assert ok
            norms.append(float(optimizer.param_l2_norm()))
            references.append(_reference_norm(inner, kind.build == "layer_wise"))
        result = {
            "norms": norms,
            "references": references,
            "leaves": sorted(
                {
                    type(getattr(leaf, "optimizer", leaf)).__name__
                    for leaf in getattr(inner, "chained_optimizers", [inner])
                }
            ),
            "sources": sorted({r.source for r in optimizer.registry.counted}),
        }
        if kind.reloads:
            fill_deterministic_(chunks, SEED, optimizer=optimizer)
            result["filled"] = float(optimizer.param_l2_norm())
            result["oracle"] = oracle_norm(global_param_shapes(chunks), SEED)
            train_step(chunks, optimizer, seed=99)  # and it keeps following after the reload
            result["after"] = float(optimizer.param_l2_norm())
            result["after_reference"] = _reference_norm(inner, kind.build == "layer_wise")
        if kind.build == "hybrid-pa":
            # Its own load_state_dict, behind the wrapper's back, re-creates its fp32 copies.
            hybrid = inner.chained_optimizers[0].optimizer
            hybrid.load_state_dict(hybrid.state_dict())
            train_step(chunks, optimizer, seed=7)
            result["inner_load"] = float(optimizer.param_l2_norm())
            result["inner_load_reference"] = _reference_norm(inner, False)
    return result


def _kinds() -> list[Any]:
    """KINDS, each skipped with the reason where this megatron-core lacks the optimizer."""
    lacks_layer_wise = pytest.mark.skipif(
        not megatron_at_least(0, 16),
        reason="LayerWiseDistributedOptimizer exists since megatron-core 0.16",
    )
    return [
        pytest.param(name, marks=[lacks_layer_wise] if kind.build == "layer_wise" else [])
        for name, kind in KINDS.items()
    ]


@pytest.mark.parametrize("name", _kinds())
def test_every_kind_matches_its_updated_tensors_and_the_oracle(name: str) -> None:
    kind = KINDS[name]
    results = run_ranks(_kind_body, kind.layout.world, kind, timeout=120)
    for rank, got in enumerate(results):
        assert got["norms"] == pytest.approx(got["references"], rel=REL), f"rank {rank}"
        assert got["norms"] == results[0]["norms"], "every rank gets the same number"
        assert len(set(got["norms"])) == STEPS, "the norm follows the training steps"
        if kind.reloads:
            assert got["filled"] == pytest.approx(got["oracle"], rel=REL), f"rank {rank}"
            assert got["after"] == pytest.approx(got["after_reference"], rel=REL)
        if "inner_load" in got:
            assert got["inner_load"] == pytest.approx(got["inner_load_reference"], rel=REL)
    print(name, results[0]["leaves"], results[0]["sources"])


# ------------------------------------------------------------------------ plain torch.optim


def test_plain_torch_optimizer_single_process() -> None:
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
    init_parallel()  # DP2: params replicated on both ranks
    torch.manual_seed(0)  # the same replica everywhere
    model = torch.nn.Linear(6, 4)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    optimizer = NormAwareOptimizer(adam, model=model)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    local = math.sqrt(sum(float(p.double().pow(2).sum()) for p in model.parameters()))
    return {
        "norm": float(optimizer.param_l2_norm()),
        "local": local,
        "reasons": sorted({str(r.reason) for r in optimizer.registry}),
    }


def test_plain_torch_optimizer_replicated_over_dp_is_counted_once() -> None:
    results = run_ranks(_plain_torch_dp_body, 2)
    for got in results:
        assert got["norm"] == pytest.approx(results[0]["local"], rel=REL)
    assert results[0]["reasons"] == ["None"] and results[1]["reasons"] == ["dp-replica"]
