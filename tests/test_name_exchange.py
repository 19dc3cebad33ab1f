"""The per-param names exchange: the union of every rank's names, with only distinct lists sent.

On real gloo ranks (2-8, real megatron-core models and optimizers), the exchanged names equal
the union gathered the naive way (every list from every rank), every rank makes the same
collectives, and the bytes ``torch.distributed`` moved on each rank (counted at its tensor
collectives) equal what :class:`~norm_optim.testing.RecordingCommunicator` predicts for that rank
from all ranks' lists: the simulation the benchmark runs at 16,384 ranks.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch

from norm_optim._norms.names import digests, encode, exchange_names, name_parts, speakers
from norm_optim.testing import RecordingCommunicator, init_parallel, run_ranks
from norm_optim.testing.comm import Traffic
from norm_optim.testing.models import build_model, build_optimizer
from norm_optim._patching import patches_applied

from benchmarks.param_norm.names import all_gather_object_traffic, group_sums
from norm_optim.testing.comm import counting_patches
from tests.support.layouts import MOE, SMALL, SMALL_MOE, Layout

LAYOUTS = {
    "dense-dp2": Layout(2, SMALL),
    "dense-pp2-dp2": Layout(4, SMALL, pp=2),
    "moe-ep2-dp2-2instances": Layout(4, SMALL_MOE, ep=2, instances=2),
    "moe-tp2-pp2-ep2": Layout(8, MOE, tp=2, pp=2, ep=2),
    # MoE layers on the second stage only: the stages' lists differ in size (uneven PP).
    "moe-pp2-ep2-uneven": Layout(
        4, dataclasses.replace(MOE, moe_layer_freq=(0, 0, 0, 1)), pp=2, ep=2
    ),
}


def simulate(lists: list[list[tuple[str, bool]]], rank: int) -> tuple[Any, Traffic, int]:
    """Rank ``rank`` of a world whose ranks hold ``lists``, on one process: (its exchanged
    names, its traffic, its number of collectives)."""
    device = torch.device("cpu")
    order = speakers(torch.stack([digests(names, device) for names in lists]))

    def peers(kind: str, peer: int, index: int) -> Any:
        assert kind == "all_gather"
        return digests(lists[peer], device)

    reduce = group_sums(lambda peer: lists[peer], order)
    comm = RecordingCommunicator(rank=rank, size=len(lists), peers=peers, reduce=reduce)
    names = exchange_names(lists[rank], comm, None)
    return names, comm.traffic, len(comm.calls)


def _rank_body(layout: Layout) -> dict[str, Any]:
    import torch.distributed as dist

    from norm_optim import NormAwareOptimizer
    from norm_optim._comm import TorchCommunicator
    from norm_optim._norms.reducer import local_names

    init_parallel(**layout.parallel())
    chunks = build_model(
        layout.cfg,
        use_distributed_optimizer=True,
        num_distributed_optimizer_instances=layout.instances,
    )
    optimizer = NormAwareOptimizer(build_optimizer(chunks), model=chunks)
    mine = local_names(optimizer.registry)
    traffic = Traffic()
    with patches_applied(counting_patches(traffic)):  # the exchange alone
        exchange_names(mine, TorchCommunicator(), None)
    norms = optimizer.param_l2_norms(per_param=True)
    everyone: list[Any] = [None] * dist.get_world_size()
    naive = Traffic()
    with patches_applied(counting_patches(naive)):  # what the exchange replaced
        dist.all_gather_object(everyone, mine)
    return {
        "names": list(norms.per_param),
        "everyone": everyone,
        "traffic": traffic,
        "naive": naive,
    }


@pytest.mark.parametrize("name", LAYOUTS)
def test_exchange_on_real_ranks_matches_the_simulation(name: str) -> None:
    layout = LAYOUTS[name]
    results = run_ranks(_rank_body, layout.world, layout, timeout=180)
    lists = results[0]["everyone"]
    union = sorted({n for names in lists for n in names})
    for rank, got in enumerate(results):
        assert got["names"] == [n for n, _ in union], f"rank {rank}"
        names, predicted, _ = simulate(lists, rank)
        assert names == union
        assert got["traffic"] == predicted, f"rank {rank}"
        assert got["naive"] == all_gather_object_traffic(lists, rank), f"rank {rank}"
    # Replicas hold one list: each rank receives less than every rank's list once.
    naive = sum(len(pickle.dumps(names)) for names in lists)
    assert max(got["traffic"].received for got in results) < naive


def test_benchmark_table_at_small_worlds() -> None:
    """The benchmark's simulated ranks: every model's names exchange at 64 ranks moves far
    less than ``all_gather_object`` would, and the digests grow with the world (16 B a rank)."""
    from benchmarks.param_norm.names import MODELS, rows

    table = rows(MODELS, (64, 1024))
    assert {r["model"] for r in table} == {m.name for m in MODELS}
    for row in table:
        assert row["received"] < row["all_gather_object_received"]
    by = {(r["model"], r["world"]): r for r in table}
    for model in (m for m in MODELS if not m.experts):  # listeners at both sizes
        grown = by[(model.name, 1024)]["received"] - by[(model.name, 64)]["received"]
        assert grown == 16 * (1024 - 64)


def test_simulated_world_sends_each_distinct_list_once() -> None:
    """A world of 16 ranks: 2 pipeline stages x 2 expert ranks x 4 replicas. One gather of the
    digests, then two all-reduces (sizes, lists) carry the 2 distinct dense lists and the 4
    expert lists: each list once, in a fixed number of collectives."""

    def names(rank: int) -> list[tuple[str, bool]]:
        stage, expert_rank = rank // 8, rank % 2
        dense = [(f"decoder.layers.{stage}.self_attention.linear_qkv.weight", False)]
        experts = [
            (
                f"decoder.layers.{stage}.mlp.experts.local_experts.{2 * expert_rank + e}."
                "linear_fc1.weight",
                True,
            )
            for e in range(2)
        ]
        return sorted(dense + experts)

    lists = [names(r) for r in range(16)]
    union = sorted({n for names in lists for n in names})
    for rank in range(16):
        got, traffic, calls = simulate(lists, rank)
        assert got == union
        assert calls == 3  # the digests, the sizes, the lists: whatever the lists
        order = speakers(torch.stack([digests(names, torch.device("cpu")) for names in lists]))
        assert [part for part, _ in order] == [0, 0, 1, 1, 1, 1]  # 2 dense, 4 expert lists
        sizes = [len(encode(name_parts(lists[who])[part])) for part, who in order]
        buffer = sum(-(-n // 8) * 8 for n in sizes)
        assert traffic.sent == 16 + 8 * len(order) + buffer
        assert traffic.received == 16 * 16 + 8 * len(order) + buffer
