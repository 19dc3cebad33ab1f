"""The counting rule, table-driven: ``why_not_counted`` against the rows of docs/counting.md.

Each case is one layout of the documented table, the holding and traits a rank sees in it, the
rank's coordinates, and what the table says: counted (None) or the reason it is not. The rule is
called directly (pure logic, no megatron, no ranks); the multi-rank tests check the same rule end
to end against the oracle. Two checks keep the table and the cases together: every row of the
docs table has a case, and every reason the rule can give is given by some case.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Optional

import pytest

from norm_optim.inspection import NotCounted, RankCoords
from norm_optim._counting.ownership import Copies, why_not_counted

COUNTING_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "counting.md"

# Decided by the registry before the rule is asked: this rank holds no tensor of the param
# (held-elsewhere), or it is frozen and count_frozen=False (frozen-excluded).
DECIDED_BEFORE_THE_RULE = {NotCounted.HELD_ELSEWHERE, NotCounted.FROZEN_EXCLUDED}

DENSE_DP = frozenset({0, 1, 2, 3})  # the shard group of a distributed optimizer, one instance
OTHER_INSTANCE_DP = frozenset({4, 5, 6, 7})


@dataclasses.dataclass(frozen=True)
class Case:
    layout: str  # the docs table's first column, up to its first " ("
    what: str  # the case, in words (the test id)
    expected: Optional[NotCounted]  # None: this rank counts it
    coords: RankCoords = RankCoords()
    expert: bool = False
    tp_split: bool = False
    replicated: bool = False
    tied_copy: bool = False
    shard_group: Optional[frozenset[int]] = None
    gtp_sharded: bool = False
    replica_coords: tuple[int, ...] = ()


CASES = [
    # ---- tensor parallelism: TP rank 0 counts what TP does not split
    Case(
        "tensor parallelism",
        "unsplit param on TP rank 1",
        NotCounted.TP_DUPLICATE,
        RankCoords(tp=1),
    ),
    Case("tensor parallelism", "unsplit param on TP rank 0", None, RankCoords(tp=0)),
    Case("tensor parallelism", "split param on TP rank 1", None, RankCoords(tp=1), tp_split=True),
    Case(
        "tensor parallelism",
        "unsplit expert on expert-TP rank 1, TP rank 0 (ETP != TP)",
        NotCounted.TP_DUPLICATE,
        RankCoords(tp=0, expert_tp=1),
        expert=True,
    ),
    Case(
        "tensor parallelism",
        "unsplit expert on expert-TP rank 0, TP rank 1 (ETP != TP)",
        None,
        RankCoords(tp=1, expert_tp=0),
        expert=True,
    ),
    Case(
        "tensor parallelism",
        "split expert on expert-TP rank 1",
        None,
        RankCoords(expert_tp=1),
        expert=True,
        tp_split=True,
    ),
    # ---- learnable attention sinks: split by their declaration, so every TP rank counts its own
    Case(
        "learnable attention sinks",
        "this TP rank's heads' sinks, TP rank 1",
        None,
        RankCoords(tp=1),
        tp_split=True,
        replicated=True,
    ),
    Case(
        "learnable attention sinks",
        "the sinks of a DP replica, TP rank 1, DP×CP rank 1",
        NotCounted.DP_REPLICA,
        RankCoords(tp=1, dp_cp=1),
        tp_split=True,
        replicated=True,
    ),
    Case(
        "learnable attention sinks",
        "a distributed-optimizer shard of them on TP rank 1",
        None,
        RankCoords(tp=1, dp_cp=2),
        tp_split=True,
        shard_group=DENSE_DP,
    ),
    # ---- tied embeddings: the copy marked shared is never counted, on any rank
    Case(
        "tied embeddings",
        "the shared copy, on rank 0 of everything",
        NotCounted.SHARED,
        tied_copy=True,
    ),
    Case(
        "tied embeddings",
        "the shared copy that is also a TP duplicate",
        NotCounted.SHARED,
        RankCoords(tp=1),
        tied_copy=True,
    ),
    Case("tied embeddings", "the other copy", None, replicated=True),
    # ---- data / context parallelism: whole replicated main params count on DP×CP rank 0
    Case(
        "data / context parallelism",
        "whole main param on DP×CP rank 1",
        NotCounted.DP_REPLICA,
        RankCoords(dp_cp=1),
        replicated=True,
    ),
    Case(
        "data / context parallelism",
        "whole main param on DP×CP rank 0",
        None,
        RankCoords(dp_cp=0),
        replicated=True,
    ),
    Case(
        "data / context parallelism",
        "whole expert on expert-DP rank 1, DP×CP rank 0",
        NotCounted.DP_REPLICA,
        RankCoords(dp_cp=0, expert_dp=1),
        expert=True,
        replicated=True,
    ),
    Case(
        "data / context parallelism",
        "whole expert on expert-DP rank 0, DP×CP rank 1",
        None,
        RankCoords(dp_cp=1, expert_dp=0),
        expert=True,
        replicated=True,
    ),
    Case(
        "data / context parallelism",
        "unsplit replica on TP rank 1 and DP rank 1",
        NotCounted.TP_DUPLICATE,
        RankCoords(tp=1, dp_cp=1),
        replicated=True,
    ),
    # ---- distributed optimizer: every rank counts its own shard
    Case(
        "distributed optimizer",
        "this rank's shard on DP×CP rank 3",
        None,
        RankCoords(dp_cp=3),
        shard_group=DENSE_DP,
    ),
    Case(
        "distributed optimizer",
        "this rank's shard of an unsplit param on TP rank 1",
        NotCounted.TP_DUPLICATE,
        RankCoords(tp=1, dp_cp=2),
        shard_group=DENSE_DP,
    ),
    # ---- several distributed-optimizer instances: the instance holding DP×CP's first rank
    Case(
        "several distributed-optimizer instances",
        "a shard of the instance without rank 0",
        NotCounted.OTHER_INSTANCE,
        RankCoords(dp_cp=5, dp_cp_first=0),
        shard_group=OTHER_INSTANCE_DP,
    ),
    Case(
        "several distributed-optimizer instances",
        "a shard of the instance with rank 0",
        None,
        RankCoords(dp_cp=2, dp_cp_first=0),
        shard_group=DENSE_DP,
    ),
    Case(
        "several distributed-optimizer instances",
        "a replicating group that starts at rank 8",
        None,
        RankCoords(dp_cp=1, dp_cp_first=8),
        shard_group=frozenset({8, 9}),
    ),
    # ---- experts at EP = 1, ETP != TP: sharded over dense DP, replicated over expert-DP
    Case(
        "experts at EP = 1 with ETP ≠ TP",
        "the shard group holding expert-DP's first rank",
        None,
        RankCoords(dp_cp=1, expert_dp=0, dp_cp_first=0, expert_dp_first=0),
        expert=True,
        shard_group=frozenset({0, 2}),
    ),
    Case(
        "experts at EP = 1 with ETP ≠ TP",
        "a shard group without expert-DP's first rank",
        NotCounted.OTHER_INSTANCE,
        RankCoords(dp_cp=0, expert_dp=1, dp_cp_first=1, expert_dp_first=0),
        expert=True,
        shard_group=frozenset({1, 3}),
    ),
    # ---- layer-wise distributed optimizer: the DP rank the param is assigned to counts it
    Case(
        "layer-wise distributed optimizer",
        "a param assigned to DP×CP rank 1",
        None,
        RankCoords(dp_cp=1),
        shard_group=DENSE_DP,
    ),
    Case(
        "layer-wise distributed optimizer",
        "an unsplit param assigned to this TP rank 1",
        NotCounted.TP_DUPLICATE,
        RankCoords(tp=1, dp_cp=1),
        shard_group=DENSE_DP,
    ),
    # ---- GTP weight remat: every GTP rank its shard; GTP rank 0 what GTP does not shard
    Case(
        "GTP weight remat",
        "a GTP shard on GTP rank 1",
        None,
        RankCoords(gtp=1),
        tp_split=True,
        gtp_sharded=True,
    ),
    Case(
        "GTP weight remat",
        "a param GTP does not shard, on GTP rank 1",
        NotCounted.GTP_DUPLICATE,
        RankCoords(gtp=1),
    ),
    Case(
        "GTP weight remat",
        "a param GTP does not shard, on GTP rank 0",
        None,
        RankCoords(gtp=0, tp=0),
    ),
    Case(
        "GTP weight remat",
        "an expert expert-GTP does not shard, on expert-GTP rank 1",
        NotCounted.GTP_DUPLICATE,
        RankCoords(gtp=0, expert_gtp=1),
        expert=True,
    ),
    Case(
        "GTP weight remat",
        "an expert on expert-GTP rank 0, GTP rank 1",
        None,
        RankCoords(gtp=1, expert_gtp=0),
        expert=True,
    ),
    Case(
        "GTP weight remat",
        "an unsplit param on TP rank 1 and GTP rank 1",
        NotCounted.TP_DUPLICATE,
        RankCoords(tp=1, gtp=1),
    ),
    # ---- multi-token prediction at PP > 1: the MTP layers count; the stage's copies do not
    Case("multi-token prediction at PP > 1", "an MTP layer's weight", None, replicated=True),
    Case(
        "multi-token prediction at PP > 1",
        "the MTP stage's embedding copy (shared)",
        NotCounted.SHARED,
        replicated=True,
        tied_copy=True,
    ),
    Case(
        "multi-token prediction at PP > 1",
        "the output weight tied embeddings leave unused",
        NotCounted.SHARED,
        shard_group=DENSE_DP,
        tied_copy=True,
    ),
    # ---- Megatron-FSDP: the rank whose shard of the bucket it is
    Case(
        "Megatron-FSDP",
        "this rank's shard of a bucket, DP×CP rank 2",
        None,
        RankCoords(dp_cp=2),
        shard_group=DENSE_DP,
    ),
    Case(
        "Megatron-FSDP",
        "this rank's shard of an expert bucket, expert-DP rank 1",
        None,
        RankCoords(expert_dp=1),
        expert=True,
        shard_group=frozenset({0, 2}),
    ),
    Case(
        "Megatron-FSDP",
        "a shard of an unsplit param on TP rank 1",
        NotCounted.TP_DUPLICATE,
        RankCoords(tp=1),
        shard_group=DENSE_DP,
    ),
    # ---- Megatron-FSDP v2: the rank whose slice of the group's flat buffer it is
    Case(
        "Megatron-FSDP v2",
        "this rank's slice of a parameter group, DP×CP rank 3",
        None,
        RankCoords(dp_cp=3),
        shard_group=DENSE_DP,
    ),
    Case(
        "Megatron-FSDP v2",
        "this rank's slice of an expert group, expert-DP rank 1",
        None,
        RankCoords(dp_cp=3, expert_dp=1, expert_dp_first=1),
        expert=True,
        shard_group=frozenset({1, 3}),
    ),
    # ---- torch FSDP2 / DTensor: Shard axes partition, Replicate axes count on coordinate 0
    Case(
        "torch FSDP2 / any DTensor param",
        "a Shard-placed local shard (1-D FSDP), rank 3",
        None,
        RankCoords(parallel_state=False),
    ),
    Case(
        "torch FSDP2 / any DTensor param",
        "HSDP: replicate coordinate 1",
        NotCounted.MESH_REPLICA,
        RankCoords(parallel_state=False),
        replica_coords=(1,),
    ),
    Case(
        "torch FSDP2 / any DTensor param",
        "HSDP: replicate coordinate 0",
        None,
        RankCoords(parallel_state=False),
        replica_coords=(0,),
    ),
    Case(
        "torch FSDP2 / any DTensor param",
        "two Replicate axes at (0, 1)",
        NotCounted.MESH_REPLICA,
        RankCoords(parallel_state=False),
        replica_coords=(0, 1),
    ),
    Case(
        "torch FSDP2 / any DTensor param",
        "Megatron TP on top: unsplit param on TP rank 1",
        NotCounted.TP_DUPLICATE,
        RankCoords(tp=1),
    ),
    Case(
        "torch FSDP2 / any DTensor param",
        "Megatron TP on top: split param on TP rank 1",
        None,
        RankCoords(tp=1),
        tp_split=True,
    ),
    # ---- MIMO: every row within the module's own groups (the coords are the module's)
    Case(
        "MIMO",
        "an encoder param on the encoder's DP rank 1 (global rank 3)",
        NotCounted.DP_REPLICA,
        RankCoords(dp_cp=1),
        replicated=True,
    ),
    Case(
        "MIMO",
        "an encoder param on the encoder's DP rank 0 (global rank 2)",
        None,
        RankCoords(dp_cp=0),
        replicated=True,
    ),
    Case(
        "MIMO",
        "an unsplit language-model param on its TP rank 1",
        NotCounted.TP_DUPLICATE,
        RankCoords(tp=1),
    ),
    Case(
        "MIMO",
        "a language-model shard, distributed optimizer over its DP group",
        None,
        RankCoords(dp_cp=1, dp_cp_first=2),
        shard_group=frozenset({2, 3}),
    ),
    Case(
        "MIMO",
        "a language-model shard of the instance without its DP group's first rank",
        NotCounted.OTHER_INSTANCE,
        RankCoords(dp_cp=1, dp_cp_first=2),
        shard_group=frozenset({4, 5}),
    ),
    # ---- pipeline / expert parallelism: stages and expert ranks hold different params
    Case("pipeline / expert parallelism", "a dense param on any stage", None, replicated=True),
    Case(
        "pipeline / expert parallelism",
        "an expert on any EP rank",
        None,
        expert=True,
        replicated=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.layout}: {c.what}" for c in CASES])
def test_rule(case: Case) -> None:
    copies = Copies(
        expert=case.expert,
        tp_split=case.tp_split,
        replicated=case.replicated,
        tied_copy=case.tied_copy,
        shard_group=case.shard_group,
        gtp_sharded=case.gtp_sharded,
        replica_coords=case.replica_coords,
    )
    reason = why_not_counted(copies, case.coords)
    assert reason == case.expected


def _docs_layouts() -> list[str]:
    """The first column of docs/counting.md's counting table, each up to its first " (" ."""
    rows = re.findall(r"^\| ([^|]+?) \|", COUNTING_MD.read_text(encoding="utf-8"), re.M)
    return [row.split(" (")[0] for row in rows if row not in ("replicated over", "---")]


def test_every_docs_row_has_a_case() -> None:
    layouts = _docs_layouts()
    assert len(layouts) >= 10, layouts  # the table was found
    assert sorted(set(layouts) - {c.layout for c in CASES}) == []
    assert sorted({c.layout for c in CASES} - set(layouts)) == []  # no case for a stale row


def test_every_reason_is_given_by_some_case() -> None:
    assert {c.expected for c in CASES} - {None} == set(NotCounted) - DECIDED_BEFORE_THE_RULE
