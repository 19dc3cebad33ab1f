"""The audit: no false alarm on real layouts, every injected fault caught on every rank, named.

Real megatron-core optimizers on CPU gloo ranks. Each case builds a layout, trains real steps
(so replicas, TP duplicates and mains are what training makes them), audits on every rank,
then injects one fault on one rank (``norm_optim.testing.inject_fault_``) and audits again:
every rank's report must be the same and name the param, the kind and the rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.faults import inject_fault_
from norm_optim.testing.models import build_model, build_optimizer, train_step
from norm_optim.testing.oracle import fill_deterministic_
from norm_optim._versions import megatron_at_least
from tests.support.layouts import GTP_DENSE, NEEDS_TORCH_FSDP2, SMALL, SMALL_MOE, Layout

TIMEOUT = 90.0


@dataclasses.dataclass(frozen=True)
class Fault:
    """One element of one copy changed on one rank, and the finding that must name it."""

    param: str  # ANY_MAIN: the first dense param whose fp32 main (shard) the rank holds
    kind: str  # the FindingKind that must appear
    rank: int
    what: str = "weight"
    how: str = "nudge"
    index: int = 0


@dataclasses.dataclass(frozen=True)
class Case:
    layout: Layout
    distributed: bool
    faults: tuple[Fault, ...]
    # a check whose copy groups must have been compared (proof the case exercises it)
    compares: tuple[str, ...] = ("dp-replicas",)
    ddp: tuple[tuple[str, Any], ...] = ()  # DistributedDataParallelConfig overrides
    exact_ranks: bool = False  # a majority exists: only the faulty rank is named
    # Real training steps first; 0: the layout-independent fill instead (GTP's forward needs
    # a CUDA-only all-gather of megatron-core 0.19.2 on CPU ranks)
    steps: int = 2


ANY_MAIN = "*"
LN = "decoder.final_layernorm.weight"
EMB = "embedding.word_embeddings.weight"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
ROUTER = "decoder.layers.0.mlp.router.weight"
EXPERT = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"

CASES = {
    "dp2-float16": Case(
        Layout(2, SMALL),
        False,
        (
            Fault(QKV, "dp-replicas-differ", 1),
            Fault(QKV, "dp-replicas-differ", 0, how="sign", index=5),
            Fault(QKV, "dp-replicas-differ", 1, how="swap", index=3),
            Fault(QKV, "main-replicas-differ", 1, what="main"),
            Fault(LN, "weight-stale-against-main", 0),
        ),
    ),
    "dp2-distributed": Case(
        Layout(2, SMALL),
        True,
        (
            Fault(QKV, "dp-replicas-differ", 1, index=7),
            Fault(ANY_MAIN, "weight-stale-against-main", 0, what="main", how="sign"),
        ),
    ),
    "dp4-distributed": Case(
        Layout(4, SMALL),
        True,
        (Fault(LN, "dp-replicas-differ", 2), Fault(EMB, "dp-replicas-differ", 3, how="swap")),
        exact_ranks=True,
    ),
    "cp2-dp2-distributed": Case(
        Layout(4, SMALL, cp=2),
        True,
        (Fault(QKV, "dp-replicas-differ", 1),),
    ),
    "dp4-2instances": Case(
        Layout(4, SMALL, instances=2),
        True,
        # ranks 0 and 2 (1 and 3) hold the same shard, one in each instance
        (
            Fault(ANY_MAIN, "main-replicas-differ", 2, what="main"),
            Fault(ANY_MAIN, "main-replicas-differ", 3, what="main"),
        ),
        ddp=(("num_distributed_optimizer_instances", 2),),
    ),
    "dp2-overlap-param-gather": Case(
        Layout(2, SMALL),
        True,
        (Fault(ANY_MAIN, "weight-stale-against-main", 0, what="main", how="sign"),),
        compares=(),
        ddp=(("overlap_grad_reduce", True), ("overlap_param_gather", True)),
    ),
    "tp2-dp2-float16": Case(
        Layout(4, SMALL, tp=2),
        False,
        (
            Fault(LN, "tp-duplicates-differ", 1),
            Fault(LN, "main-tp-duplicates-differ", 3, what="main"),
            Fault(QKV, "dp-replicas-differ", 2),
        ),
        ("dp-replicas", "tp-duplicates"),
    ),
    "tp2-dp2-distributed": Case(
        Layout(4, SMALL, tp=2),
        True,
        (
            Fault(LN, "tp-duplicates-differ", 3, index=1),
            Fault(QKV, "dp-replicas-differ", 1),
        ),
        ("dp-replicas", "tp-duplicates"),
    ),
    "moe-ep2": Case(
        Layout(2, SMALL_MOE, ep=2),
        True,
        (Fault(QKV, "dp-replicas-differ", 1),),
        ("dp-replicas",),  # EP2 on 2 ranks: no expert-DP replicas
    ),
    "moe-ep2-dp2": Case(
        Layout(4, SMALL_MOE, ep=2),
        False,
        (
            Fault(EXPERT, "expert-dp-replicas-differ", 2),
            Fault(ROUTER, "dp-replicas-differ", 1),
        ),
        ("dp-replicas", "expert-dp-replicas"),
    ),
    "moe-tp2-ep2": Case(
        Layout(4, SMALL_MOE, tp=2, ep=2),
        True,
        (
            Fault(LN, "tp-duplicates-differ", 1),
            Fault(ROUTER, "tp-duplicates-differ", 1),
        ),
        ("dp-replicas", "tp-duplicates"),  # expert-TP 2 x EP 2: no expert-DP replicas
    ),
    "dp2-frozen-layer": Case(
        Layout(2, SMALL, freeze=("decoder.layers.0.*",)),
        True,
        (Fault("decoder.layers.0.mlp.linear_fc1.weight", "dp-replicas-differ", 1, how="sign"),),
    ),
    "gtp2-dp2": Case(
        Layout(4, GTP_DENSE, gtp=2),
        True,
        (Fault(LN, "gtp-copies-differ", 1), Fault(QKV, "dp-replicas-differ", 2)),
        ("dp-replicas", "gtp-copies"),
        steps=0,
    ),
    "tp2-gtp2": Case(
        Layout(4, GTP_DENSE, tp=2, gtp=2),
        True,
        (Fault(LN, "gtp-copies-differ", 3), Fault(LN, "tp-duplicates-differ", 2)),
        ("tp-duplicates", "gtp-copies"),
        steps=0,
    ),
    # The layer-wise optimizer (Muon, megatron-core 0.19 with emerging-optimizers): each param
    # stepped whole on its assigned DP rank, then broadcast (Megatron-LM #7131's layout).
    "muon-dp2-layer-wise": Case(
        Layout(2, SMALL, optimizer="muon", layer_wise=True),
        False,
        (Fault(QKV, "dp-replicas-differ", 1),),
    ),
    "muon-tp2-dp2-layer-wise-distributed": Case(
        Layout(4, SMALL, tp=2, optimizer="muon", layer_wise=True),
        True,
        (Fault(LN, "tp-duplicates-differ", 1), Fault(QKV, "dp-replicas-differ", 2)),
        ("dp-replicas", "tp-duplicates"),
    ),
    "pp2-tied": Case(
        Layout(2, SMALL, pp=2),
        False,
        (Fault(EMB, "tied-copies-differ", 0),),
        ("tied-copies",),
    ),
    "tp2-pp2-tied-distributed": Case(
        Layout(4, SMALL, tp=2, pp=2),
        True,
        (Fault(EMB, "tied-copies-differ", 3), Fault(LN, "tp-duplicates-differ", 3)),
        ("tied-copies", "tp-duplicates"),
    ),
}


def _audit_body(case: Case, fault: Fault | None) -> dict[str, Any]:
    import torch.distributed as dist

    from norm_optim import NormAwareOptimizer

    init_parallel(**case.layout.parallel())
    layout = case.layout
    chunks = build_model(
        layout.cfg,
        use_distributed_optimizer=case.distributed,
        seed=3,
        freeze=layout.freeze,
        layer_wise_layout=layout.layer_wise and case.distributed,
        **dict(case.ddp),
    )
    extra = {"use_layer_wise_distributed_optimizer": True} if layout.layer_wise else {}
    inner = build_optimizer(chunks, lr=1e-2, optimizer=layout.optimizer, **extra)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    for step in range(case.steps):
        train_step(chunks, optimizer, seed=step)
    if not case.steps:
        fill_deterministic_(chunks, 11, optimizer=optimizer.wrapped_optimizer)
    clean = optimizer.audit()
    out: dict[str, Any] = {
        "rank": dist.get_rank(),
        "clean": [str(f) for f in clean.findings],
        "compared": dict(clean.compared),
        "left_out": len(clean.left_out),
    }
    if fault is not None:
        name = fault.param
        if name == ANY_MAIN:
            name = next(
                (
                    r.global_name
                    for r in optimizer.registry
                    if not r.expert and r.tensor is not None and r.tensor.numel() > 1
                ),
                "",
            )
            out["injected"] = name
        if name == EMB and case.layout.pp > 1 and dist.get_rank() != 0:
            name = "output_layer.weight"  # the tied copy's name on the last stage
        present = any(name in (r.global_name, r.name) for r in optimizer.registry)
        if present:
            inject_fault_(
                optimizer,
                name,
                what=fault.what,  # type: ignore[arg-type]
                how=fault.how,  # type: ignore[arg-type]
                rank=fault.rank,
                index=fault.index,
            )
        report = optimizer.audit()
        out["faulty"] = [(f.param, str(f.kind), f.ranks, str(f)) for f in report.findings]
        out["ok"] = report.ok
    return out


def _params(cases: dict[str, Case]) -> list[Any]:
    return [pytest.param(name, marks=case.layout.marks(), id=name) for name, case in cases.items()]


@pytest.mark.parametrize("name", _params(CASES))
def test_no_false_alarm_after_real_steps(name: str) -> None:
    case = CASES[name]
    results = run_ranks(_audit_body, case.layout.world, case, None, timeout=TIMEOUT)
    for result in results:
        assert result["clean"] == [], (result["rank"], result["clean"])
    for check in case.compares:
        assert any(r["compared"].get(check, 0) > 0 for r in results), (check, results[0])
    gathering = dict(case.ddp).get("overlap_param_gather", False)
    # Under overlap-param-gather the weights are left out, and said so; nowhere else.
    assert all((r["left_out"] > 0) == gathering for r in results)


FAULTS = [
    pytest.param(name, i, marks=case.layout.marks(), id=f"{name}-{f.kind}-{f.what}-{f.how}")
    for name, case in CASES.items()
    for i, f in enumerate(case.faults)
]


@pytest.mark.parametrize(("name", "index"), FAULTS)
def test_an_injected_fault_is_caught_on_every_rank_and_named(name: str, index: int) -> None:
    case = CASES[name]
    fault = case.faults[index]
    results = run_ranks(_audit_body, case.layout.world, case, fault, timeout=TIMEOUT)
    first = results[0]["faulty"]
    param = results[fault.rank].get("injected", fault.param)
    for result in results:
        assert result["ok"] is False
        assert result["faulty"] == first  # the same report on every rank
    assert any(
        kind == fault.kind
        and (ranks == (fault.rank,) if case.exact_ranks else fault.rank in ranks)
        and name == param
        for name, kind, ranks, _ in first
    ), first


# ------------------------------------------------------------------ the fingerprint itself


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_fingerprint_sees_one_changed_element_a_sign_flip_and_a_swap(dtype: str) -> None:
    import torch

    from norm_optim._kernels.fingerprint import BLOCK, FingerprintPass

    prints = FingerprintPass()
    base = torch.randn(3 * BLOCK + 5, generator=torch.Generator().manual_seed(0))
    base = base.to(getattr(torch, dtype))
    before = prints.fingerprint(base)
    assert torch.equal(prints.fingerprint(base.clone()), before)  # a function of the bits
    for i, j in [(0, 1), (BLOCK - 1, BLOCK), (7, 2 * BLOCK + 3), (3 * BLOCK + 3, 3 * BLOCK + 4)]:
        swapped = base.clone()
        swapped[i], swapped[j] = base[j], base[i]
        assert not torch.equal(prints.fingerprint(swapped), before), (i, j)
    for i in [0, BLOCK, 3 * BLOCK + 4]:
        flipped = base.clone()
        flipped[i] = -flipped[i]
        assert not torch.equal(prints.fingerprint(flipped), before)
        nudged = base.clone()
        bits = nudged.view({2: torch.int16, 4: torch.int32}[nudged.element_size()])
        bits[i] ^= 1  # the lowest bit: what a sum of squares in fp32 may not see
        assert not torch.equal(prints.fingerprint(nudged), before)


def test_a_stale_weight_is_counted_element_by_element() -> None:
    import torch

    from norm_optim._kernels.fingerprint import largest_difference, stale_elements

    main = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    weight = main.to(torch.bfloat16)
    assert int(stale_elements(weight, main)) == 0
    weight[[3, 70_000]] += 1.0
    assert int(stale_elements(weight, main)) == 2
    assert largest_difference(weight, main) == pytest.approx(1.0, abs=0.02)


# ------------------------------------------------------------------ after a checkpoint load

CHECKPOINT_LAYOUTS = {"dp2": Layout(2, SMALL), "tp2-dp2": Layout(4, SMALL, tp=2)}


def _checkpoint_body(directory: str, layout: Layout) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from norm_optim import NormAwareOptimizer
    from norm_optim._patching import PatchSet
    from norm_optim.testing._internal.loop_patches import torch_dist_save_patches
    from norm_optim.testing.models import unwrap_gpt

    def state(sharding: str | None, is_loading: bool) -> dict[str, Any]:
        out = {"model": unwrap_gpt(chunks[0]).sharded_state_dict()}
        if sharding is not None:
            metadata = {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True}
            out["optimizer"] = inner.sharded_state_dict(
                out["model"], is_loading=is_loading, metadata=metadata
            )
        return out

    PatchSet.apply(torch_dist_save_patches())  # the rank is a fresh process: nothing to undo
    init_parallel(**layout.parallel())
    chunks = build_model(layout.cfg, use_distributed_optimizer=True, seed=5)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    train_step(chunks, optimizer, seed=0)
    dist_checkpointing.save(state("dp_reshardable", False), directory)
    train_step(chunks, optimizer, seed=1)  # the run moves on; then it resumes
    got: dict[str, Any] = {}

    # A model-only load that forgets the mains: the weights are the checkpoint's, the mains
    # the later step's. That is what the audit exists to catch.
    loaded = dist_checkpointing.load(state(None, True), directory)
    unwrap_gpt(chunks[0]).load_state_dict(loaded["model"])
    got["forgot_mains"] = sorted({str(f.kind) for f in optimizer.audit().findings})
    got["reloaded"] = None
    optimizer.reload_model_params()
    got["reloaded"] = [str(f) for f in optimizer.audit().findings]

    # The full resume: model and optimizer (the mains) from the checkpoint.
    train_step(chunks, optimizer, seed=2)
    loaded = dist_checkpointing.load(state("dp_reshardable", True), directory)
    unwrap_gpt(chunks[0]).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    got["resumed"] = [str(f) for f in optimizer.audit().findings]
    train_step(chunks, optimizer, seed=3)
    got["stepped"] = [str(f) for f in optimizer.audit().findings]
    return got


@pytest.mark.skipif(
    not megatron_at_least(0, 16),
    reason="the dp_reshardable save of torch Adam's scalar 'step' needs megatron-core 0.16",
)
@pytest.mark.parametrize("layout", list(CHECKPOINT_LAYOUTS))
def test_no_false_alarm_after_a_dist_checkpoint_load_and_a_bad_load_caught(
    tmp_path: Any, layout: str
) -> None:
    case = CHECKPOINT_LAYOUTS[layout]
    results = run_ranks(_checkpoint_body, case.world, str(tmp_path), case, timeout=TIMEOUT)
    for got in results:
        assert got["forgot_mains"] == ["weight-stale-against-main"]
        assert got["reloaded"] == []
        assert got["resumed"] == []
        assert got["stepped"] == []


# ------------------------------------------------------------------ what it costs, what it refuses


def _collectives_body(layout: Layout) -> dict[str, Any]:
    from norm_optim import NormAwareOptimizer
    from norm_optim._comm import TorchCommunicator

    class Counting(TorchCommunicator):
        calls: list[tuple[str, tuple[int, ...]]] = []

        def all_reduce_sum(self, tensor, group, async_op):  # type: ignore[no-untyped-def]
            self.calls.append(("all_reduce_sum", tuple(tensor.shape)))
            return super().all_reduce_sum(tensor, group, async_op)

        def all_reduce(self, tensor, group, op):  # type: ignore[no-untyped-def]
            self.calls.append((f"all_reduce_{op}", tuple(tensor.shape)))
            return super().all_reduce(tensor, group, op)

        def all_gather_tensor(self, tensor, group):  # type: ignore[no-untyped-def]
            self.calls.append(("all_gather", tuple(tensor.shape)))
            return super().all_gather_tensor(tensor, group)

        def all_gather_object(self, obj, group):  # type: ignore[no-untyped-def]
            self.calls.append(("all_gather_object", ()))
            return super().all_gather_object(obj, group)

    init_parallel(**layout.parallel())
    chunks = build_model(layout.cfg, use_distributed_optimizer=True, seed=3)
    comm = Counting()
    optimizer = NormAwareOptimizer(build_optimizer(chunks), model=chunks, comm=comm)
    train_step(chunks, optimizer)
    comm.calls.clear()
    report = optimizer.audit()
    return {"calls": list(comm.calls), "params": len(optimizer.registry), "ok": report.ok}


def test_the_audit_costs_a_few_collectives_sized_by_params() -> None:
    """TP2 x DP2 MoE: DP and TP groups of 2 (expert-DP and expert-TP of 1 need nothing): per
    group a MIN of the param count and a MIN of the ``[params, 4]`` table (each with its
    order-reversed copy: MIN and MAX at once), then one SUM of the findings' count; no gather,
    no object collective when clean."""
    layout = Layout(4, SMALL_MOE, tp=2, ep=2, etp=1)
    for got in run_ranks(_collectives_body, 4, layout, timeout=TIMEOUT):
        assert got["ok"]
        kinds = [kind for kind, _ in got["calls"]]
        assert kinds.count("all_reduce_sum") == 1
        assert not {"all_gather", "all_gather_object", "all_reduce_max"} & set(kinds)
        mins = [shape for kind, shape in got["calls"] if kind == "all_reduce_min"]
        assert 2 <= len(mins) <= 8
        assert all(shape == (2,) or shape[1:] == (4,) for shape in mins)
        assert all(shape[0] <= 2 * got["params"] for shape in mins)


MEGATRON_FSDP = {  # name: (layout, fault: (param, what, how, rank, kind))
    "dp2": (Layout(2, SMALL), (ANY_MAIN, "main", "sign", 0, "weight-stale-against-main")),
    "tp2-dp2": (Layout(4, SMALL, tp=2), (LN, "weight", "nudge", 3, "tp-duplicates-differ")),
}


def _megatron_fsdp_body(name: str) -> dict[str, Any]:
    from norm_optim import NormAwareOptimizer
    from norm_optim.testing.megatron_fsdp import build_fsdp_model

    layout, (param, what, how, rank, _) = MEGATRON_FSDP[name]
    init_parallel(**layout.parallel())
    chunks = build_fsdp_model(layout.cfg, seed=3)
    optimizer = NormAwareOptimizer(build_optimizer(chunks, lr=1e-2), model=chunks)
    for step in range(2):
        train_step(chunks, optimizer, seed=step)
    clean = optimizer.audit()
    if param == ANY_MAIN:
        param = next(
            r.global_name
            for r in optimizer.registry
            if isinstance(r.tensor, torch.Tensor) and r.tensor.numel() > 1
        )
    inject_fault_(optimizer, param, what=what, how=how, rank=rank)  # type: ignore[arg-type]
    faulty = optimizer.audit()
    return {
        "clean": [str(f) for f in clean.findings],
        "compared": dict(clean.compared),
        "param": param,
        "faulty": [(f.param, str(f.kind), f.ranks) for f in faulty.findings],
    }


@pytest.mark.skipif(not megatron_at_least(0, 15), reason="Megatron-FSDP builds since 0.15")
@pytest.mark.parametrize("name", list(MEGATRON_FSDP))
def test_megatron_fsdp_shards_against_mains_and_tp_duplicates(name: str) -> None:
    """Megatron-FSDP (optim_grads_params): each rank's bf16 weight shard against its fp32 main
    shard, and TP duplicates' shards; its DP ranks hold other shards (nothing to compare)."""
    layout, (_, _, _, rank, kind) = MEGATRON_FSDP[name]
    results = run_ranks(_megatron_fsdp_body, layout.world, name, timeout=TIMEOUT)
    for got in results:
        assert got["clean"] == [], got["clean"]
        assert got["faulty"] == results[0]["faulty"]
    param = results[rank]["param"]
    first = results[0]["faulty"]
    assert any(p == param and k == kind and rank in r for p, k, r in first), first


def _refused_body(kind: str) -> str:
    from norm_optim import NormAwareOptimizer, UnsupportedOptimizerError
    from norm_optim.testing.megatron_fsdp import build_fsdp_model

    init_parallel()
    chunks = build_fsdp_model(SMALL, seed=3, version=2)
    optimizer = NormAwareOptimizer(build_optimizer(chunks, lr=1e-2), model=chunks)
    with pytest.raises(UnsupportedOptimizerError) as raised:
        optimizer.audit()
    return str(raised.value)


def _has_fsdp_v2() -> bool:
    from norm_optim.testing.megatron_fsdp import has_megatron_fsdp_v2

    return bool(has_megatron_fsdp_v2())


@pytest.mark.skipif(not _has_fsdp_v2(), reason="Megatron-FSDP v2 exists on megatron-core main")
def test_megatron_fsdp_v2_is_refused_by_name() -> None:
    for message in run_ranks(_refused_body, 2, "megatron-fsdp-v2", timeout=TIMEOUT):
        assert "Megatron-FSDP v2" in message and "audit()" in message


# ------------------------------------------------------------------ torch FSDP2 (DTensor params)

FSDP2 = {  # name: (world, how it is built, mesh shape or TP size, fault: (param, rank, kind))
    "native-fsdp2": (2, "native", (2,), None),
    "native-hsdp-2x2": (4, "native", (2, 2), ("norm.weight", 2, "mesh-replicas-differ")),
    "megatron-fsdp2-tp2-dp2": (4, "megatron", 2, (LN, 1, "tp-duplicates-differ")),
}


def _fsdp2_body(name: str) -> dict[str, Any]:
    from norm_optim import NormAwareOptimizer
    from norm_optim.testing.torch_fsdp2 import (
        build_native_fsdp2,
        build_torch_fsdp2_model,
        native_train_step,
    )

    world, how, shape, fault = FSDP2[name]
    if how == "native":
        model, inner, _ = build_native_fsdp2(shape)  # type: ignore[arg-type]
        optimizer = NormAwareOptimizer(inner, model=model)
        for step in range(2):
            native_train_step(model, optimizer, seed=step)
    else:
        init_parallel(tp=shape)  # type: ignore[arg-type]
        chunks = build_torch_fsdp2_model(dataclasses.replace(SMALL, tie_embeddings=False), seed=3)
        optimizer = NormAwareOptimizer(build_optimizer(chunks, lr=1e-2), model=chunks)
        if megatron_at_least(0, 19):
            for step in range(2):
                train_step(chunks, optimizer, seed=step)
        else:  # 0.16's TorchFullyShardedDataParallel does not train (test_torch_fsdp2.py)
            fill_deterministic_(chunks, 11, optimizer=optimizer.wrapped_optimizer)
    clean = optimizer.audit()
    out: dict[str, Any] = {"clean": [str(f) for f in clean.findings], "compared": clean.compared}
    if fault is not None:
        param, rank, _ = fault
        inject_fault_(optimizer, param, rank=rank)
        out["faulty"] = [(f.param, str(f.kind), f.ranks) for f in optimizer.audit().findings]
    return out


@NEEDS_TORCH_FSDP2
@pytest.mark.parametrize("name", list(FSDP2))
def test_torch_fsdp2_replicas_and_duplicates(name: str) -> None:
    """DTensor params are compared over their Replicate mesh axes (megatron's DP ranks hold
    other shards of them) and megatron's TP duplicates: no false alarm after real steps, a
    fault named on every rank."""
    world, _, _, fault = FSDP2[name]
    results = run_ranks(_fsdp2_body, world, name, timeout=40.0)
    for got in results:
        assert got["clean"] == [], got
    if fault is not None:
        param, rank, kind = fault
        first = results[0]["faulty"]
        assert all(r["faulty"] == first for r in results)
        assert any(p == param and k == kind and rank in ranks for p, k, ranks in first), first
