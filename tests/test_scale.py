"""The audit at DP 2, 4 and 8: faults on one rank, on several, and a tie, named the same way at
every size, and the bytes each rank receives during ``audit()`` flat in the group's size.

Real megatron-core Float16 optimizers on CPU gloo ranks (whole fp32 mains, replicated over DP).
Each run trains a step, audits clean, then adds faults one scenario at a time
(``norm_optim.testing.inject_fault_``) and audits again on every rank. The bytes are counted at
``torch.distributed``'s primitives (``norm_optim.testing.comm.counting_patches``): deterministic,
not timed.
"""

from __future__ import annotations

from typing import Any

import pytest

from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.comm import Traffic
from norm_optim.testing.faults import inject_fault_
from norm_optim.testing.models import build_model, build_optimizer, train_step
from tests.support.layouts import SMALL, Layout
from norm_optim.testing.comm import counting_patches

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
PROJ = "decoder.layers.1.self_attention.linear_proj.weight"
LN = "decoder.final_layernorm.weight"
DP = (2, 4, 8)


def _scenarios(world: int) -> list[tuple[str, list[tuple[str, str, str, int]]]]:
    """(scenario, faults: (param, what, how, rank)), added one scenario after the other."""
    last = world - 1
    several = [(FC1, "weight", "nudge", 1), (FC1, "weight", "sign", last)]
    # A tie: half the ranks change the same element alike, the other half keep it.
    tie = [(PROJ, "weight", "sign", r) for r in range(world // 2)]
    return [
        ("one-rank", [(QKV, "weight", "nudge", last)]),
        ("several-ranks", several),
        ("tie", tie),
        ("main", [(QKV, "main", "nudge", 1)]),
        ("stale", [(LN, "main", "sign", 0)]),
    ]


def _body(layout: Layout) -> dict[str, Any]:
    import torch.distributed as dist

    from norm_optim import NormAwareOptimizer
    from norm_optim._patching import patches_applied

    init_parallel(**layout.parallel())
    chunks = build_model(layout.cfg, use_distributed_optimizer=False, seed=3)
    optimizer = NormAwareOptimizer(build_optimizer(chunks, lr=1e-2), model=chunks)
    train_step(chunks, optimizer, seed=0)
    out: dict[str, Any] = {"rank": dist.get_rank(), "audits": {}}

    def audit(label: str) -> None:
        traffic = Traffic()
        with patches_applied(counting_patches(traffic)):
            report = optimizer.audit()
        out["audits"][label] = {
            "findings": [(f.param, str(f.kind), f.ranks, f.num_ranks) for f in report.findings],
            "summary": report.summary(),
            "received": traffic.received,
            "sent": traffic.sent,
        }

    audit("clean")
    for label, faults in _scenarios(layout.world):
        for param, what, how, rank in faults:
            inject_fault_(
                optimizer,
                param,
                what=what,  # type: ignore[arg-type]
                how=how,  # type: ignore[arg-type]
                rank=rank,
                index=4,
            )
        audit(label)
    return out


def _expected(world: int) -> dict[str, tuple[str, str, tuple[int, ...], int]]:
    """scenario: (param, kind, ranks, how many ranks) of the finding it must add."""
    last = world - 1
    two = world == 2  # two copies: no majority, both sides named
    return {
        "one-rank": (QKV, "dp-replicas-differ", (0, 1) if two else (last,), 2 if two else 1),
        # two ranks changed differently: off the majority of 6 at DP8; at DP4 the 2 unchanged
        # copies are no majority (all 4 named); at DP2 one rank took both: a tie of two
        "several-ranks": (
            FC1,
            "dp-replicas-differ",
            *{2: ((0, 1), 2), 4: ((0, 1, 2, 3), 4)}.get(world, ((1, last), 2)),
        ),
        "tie": (PROJ, "dp-replicas-differ", tuple(range(world)), world),  # all named
        "main": (QKV, "main-replicas-differ", (0, 1) if two else (1,), 2 if two else 1),
        "stale": (LN, "weight-stale-against-main", (0,), 1),
    }


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict[str, Any]]]:
    return {world: run_ranks(_body, world, Layout(world, SMALL), timeout=120) for world in DP}


@pytest.mark.parametrize("world", DP)
def test_faults_on_one_rank_several_and_a_tie_are_named_on_every_rank(
    runs: dict[int, list[dict[str, Any]]], world: int
) -> None:
    results = runs[world]
    first = results[0]["audits"]
    for result in results:
        assert result["audits"]["clean"]["findings"] == [], result["audits"]["clean"]
        for label in first:  # the same report on every rank
            assert result["audits"][label]["findings"] == first[label]["findings"], label
    for label, expected in _expected(world).items():
        assert expected in first[label]["findings"], (label, first[label]["summary"])


def test_bytes_received_during_audit_do_not_grow_from_dp2_to_dp8(
    runs: dict[int, list[dict[str, Any]]],
) -> None:
    """A clean audit and one with a fault on one rank: each rank receives the same bytes at
    DP8 as at DP2 (O(params), never O(ranks)); the report's text does not grow either."""
    for label in ("clean", "one-rank"):
        received = {w: max(r["audits"][label]["received"] for r in runs[w]) for w in DP}
        assert received[2] > 0
        assert received[8] <= received[2], (label, received)
        length = {w: len(runs[w][0]["audits"][label]["summary"]) for w in DP}
        assert length[8] <= length[2] + 8, (label, length)  # rank numbers get a digit longer


def test_the_scale_benchmark_sees_flat_bytes_from_64_to_4096_simulated_ranks() -> None:
    """``benchmarks.scale`` on one process: every layout's audits (clean, one drifted rank, a
    drifted replica), weight norm and armed step receive the same bytes per rank at 4,096
    simulated ranks as at 64, and the drifted audits find what was drifted."""
    from benchmarks.scale import LAYOUTS, run_layout

    flat = ("param_l2_norm()", "armed step", "audit() clean", "audit() one drifted rank")
    for layout in LAYOUTS:
        small = {r.operation: r for r in run_layout(layout, 64, 40)}
        large = {r.operation: r for r in run_layout(layout, 4096, 40)}
        for operation in (*flat, "audit() drifted replica"):
            assert large[operation].received == small[operation].received, operation
        assert large["audit() one drifted rank"].findings == 1
        assert large["audit() drifted replica"].findings > 1
        assert large["audit() clean"].findings == 0


def _not_comparable_body() -> dict[str, Any]:
    """Plain fp32 models over DP = world (no megatron): rank 1 holds one layer more, then (a
    second model) rank 2 names its second layer differently."""
    import types

    import torch
    import torch.distributed as dist

    from norm_optim import NormAwareOptimizer

    rank = dist.get_rank()
    groups = types.SimpleNamespace(
        tp=dist.new_group([rank]), dp_cp=dist.group.WORLD, pp=dist.new_group([rank])
    )
    out = {}
    for case, names in (
        ("count", ["a", "b", "c"] if rank == 1 else ["a", "b"]),
        ("names", ["a", "z"] if rank == 2 else ["a", "b"]),
    ):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({name: torch.nn.Linear(4, 4) for name in names})
        inner = torch.optim.AdamW(model.parameters())
        report = NormAwareOptimizer(inner, model=model, pg_collection=groups).audit()
        out[case] = [(f.param, str(f.kind), f.ranks, f.num_ranks) for f in report.findings]
    return out


def test_copies_that_are_not_comparable_are_named_by_the_ranks_off_the_majority() -> None:
    results = run_ranks(_not_comparable_body, 4, cpu_shim=False, timeout=60)
    first = results[0]
    assert all(result == first for result in results)
    kind = "copies-not-comparable"
    assert first["count"] == [("<dp-replicas: 4 to 6 params>", kind, (1,), 1)]
    assert first["names"] == [("b.bias", kind, (2,), 1), ("b.weight", kind, (2,), 1)]
