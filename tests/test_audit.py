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

from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.faults import inject_fault_
from norm_optim.testing.models import build_model, build_optimizer, train_step
from tests.support.layouts import SMALL, SMALL_MOE, Layout

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
        # ranks 0 and 2 hold the same shard, one in each instance
        (Fault(ANY_MAIN, "main-replicas-differ", 2, what="main"),),
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
    "pp2-tied": Case(
        Layout(2, SMALL, pp=2),
        False,
        (Fault(EMB, "tied-copies-differ", 0),),
        ("tied-copies",),
    ),
}


def _audit_body(case: Case, fault: Fault | None) -> dict[str, Any]:
    import torch.distributed as dist

    from norm_optim import NormAwareOptimizer

    init_parallel(**case.layout.parallel())
    chunks = build_model(
        case.layout.cfg, use_distributed_optimizer=case.distributed, seed=3, **dict(case.ddp)
    )
    optimizer = NormAwareOptimizer(build_optimizer(chunks, lr=1e-2), model=chunks)
    for step in range(2):
        train_step(chunks, optimizer, seed=step)
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
