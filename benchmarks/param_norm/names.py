"""Bytes each rank sends and receives in the first per-param call's names exchange, at simulated
world sizes up to 16,384, on one process.

Each simulated rank holds the layout-independent names a GPTModel (Transformer Engine spec, RMS
norms with q/k layernorm, no biases; MoE layers with TE grouped experts) would give it on its
pipeline stage and expert rank: the names are generated here from the layout (no model is
built), shaped like ``norm_optim._megatron.naming``'s.
:func:`norm_optim._norms.names.exchange_names` then runs as one rank, over a
:class:`~norm_optim.testing.RecordingCommunicator` that plays every other rank (their digests, the
sums of their lists) and counts the bytes as torch.distributed moves them
(``tests/test_name_exchange.py`` checks that count against real gloo runs at 2-8 ranks). Next to it,
the same for the one ``all_gather_object`` of every rank's list that the exchange replaces
(:func:`all_gather_object_traffic`, also checked there).

``python -m benchmarks.param_norm --names-exchange`` prints the table (a few seconds).
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Sequence
from typing import Any, Callable

import torch

from norm_optim._norms.names import digests, encode, exchange_names, name_parts, pack, speakers
from norm_optim.testing import RecordingCommunicator
from norm_optim.testing.comm import Reduce, Traffic

Names = list[tuple[str, bool]]
_SIZE_BYTES = 8  # the int64 size torch's *_object collectives send first

_ATTENTION = (
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.q_layernorm.weight",
    "self_attention.k_layernorm.weight",
    "self_attention.linear_proj.weight",
)
_MLP = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_MOE = ("pre_mlp_layernorm.weight", "mlp.router.weight")


@dataclasses.dataclass(frozen=True)
class NamesModel:
    """A model and the parallel sizes that decide which names a rank holds (TP and DP do not:
    TP shards and replicas share names)."""

    name: str
    layers: int
    pp: int = 1
    experts: int = 0
    ep: int = 1
    tp: int = 1

    def fits(self, world: int) -> bool:
        stage = world // self.pp
        return (
            world % (self.tp * self.pp) == 0
            and stage % self.ep == 0
            and (not self.experts or self.experts % self.ep == 0)
        )

    def coordinates(self, rank: int, world: int) -> tuple[int, int]:
        """(pipeline stage, expert rank) of a global rank, megatron's default order (TP
        fastest, PP slowest; expert ranks next to expert TP, here 1)."""
        stage = world // self.pp
        return rank // stage, (rank % stage) % self.ep

    @functools.lru_cache(maxsize=None)
    def names(self, stage: int, expert_rank: int) -> Names:
        per_stage = self.layers // self.pp
        names: Names = []
        if stage == 0:
            names.append(("embedding.word_embeddings.weight", False))
        if stage == self.pp - 1:
            names += [("decoder.final_layernorm.weight", False), ("output_layer.weight", False)]
        local = self.experts // self.ep
        for layer in range(stage * per_stage, (stage + 1) * per_stage):
            prefix = f"decoder.layers.{layer}."
            names += [(prefix + part, False) for part in _ATTENTION]
            if not self.experts:
                names += [(prefix + part, False) for part in _MLP]
                continue
            names += [(prefix + part, False) for part in _MOE]
            for expert in range(expert_rank * local, (expert_rank + 1) * local):
                names += [
                    (f"{prefix}mlp.experts.linear_fc{fc}.weight{expert}", True) for fc in (1, 2)
                ]
        return sorted(names)

    def rank_names(self, rank: int, world: int) -> Names:
        return self.names(*self.coordinates(rank, world))


MODELS: tuple[NamesModel, ...] = (
    NamesModel("dense 80 layers, TP8", layers=80, tp=8),
    NamesModel("dense 80 layers, TP8 x PP8", layers=80, tp=8, pp=8),
    NamesModel("MoE 48 layers x 128 experts, EP8", layers=48, experts=128, ep=8),
    NamesModel("MoE 48 layers x 128 experts, PP4 x EP16", layers=48, experts=128, ep=16, pp=4),
)
WORLDS: tuple[int, ...] = (64, 1024, 16384)


def group_sums(lists_of: Callable[[int], Names], order: Sequence[tuple[int, int]]) -> Reduce:
    """The two all-reduce SUMs of the exchange as the whole group makes them: every speaker's
    list at its place (``lists_of(rank)``: that rank's names)."""
    blobs = {i: encode(name_parts(lists_of(who))[kind]) for i, (kind, who) in enumerate(order)}
    sums = [torch.tensor(part, dtype=torch.int64) for part in pack(order, blobs)]

    def reduce(op: str, tensor: torch.Tensor, index: int) -> torch.Tensor:
        assert op == "sum", op
        return sums[index]

    return reduce


def simulate_exchange(model: NamesModel, world: int, rank: int) -> Traffic:
    """One rank's traffic in :func:`~norm_optim._norms.names.exchange_names` at ``world``."""
    cpu = torch.device("cpu")

    @functools.lru_cache(maxsize=None)
    def digest_of(coords: tuple[int, int]) -> torch.Tensor:
        return digests(model.names(*coords), cpu)

    gathered = torch.stack([digest_of(model.coordinates(r, world)) for r in range(world)])
    order = speakers(gathered)

    def peers(kind: str, peer: int, index: int) -> Any:
        return digest_of(model.coordinates(peer, world))

    reduce = group_sums(lambda r: model.rank_names(r, world), order)
    comm = RecordingCommunicator(rank=rank, size=world, peers=peers, reduce=reduce)
    exchange_names(model.rank_names(rank, world), comm, None)
    return comm.traffic


def all_gather_object_traffic(lists: Sequence[Names], rank: int) -> Traffic:
    """What torch's ``all_gather_object`` of every rank's list moves on ``rank``: the int64
    sizes (one per rank), then every list padded to the longest pickle."""
    longest = max(len(pickle.dumps(names)) for names in lists)
    world = len(lists)
    return Traffic(sent=_SIZE_BYTES + longest, received=world * (_SIZE_BYTES + longest))


def rows(
    models: Sequence[NamesModel] = MODELS, worlds: Sequence[int] = WORLDS
) -> list[dict[str, Any]]:
    """One row per model and world: names per rank, and the most any rank sends / receives in
    the exchange (of ranks 0, 1, ``ep`` and the last: speakers of every kind, and listeners
    whenever a list has replicas) and in the ``all_gather_object`` it replaced."""
    out = []
    for model in models:
        for world in worlds:
            if not model.fits(world):
                continue
            ranks = sorted({0, 1, model.ep, world - 1} & set(range(world)))
            traffic = [simulate_exchange(model, world, rank) for rank in ranks]
            # All ranks of a stage and expert rank hold one list: the longest of the distinct
            # lists is what all_gather_object pads to.
            distinct = {model.coordinates(r, world) for r in range(world)}
            longest = max(len(pickle.dumps(model.names(*c))) for c in distinct)
            out.append(
                {
                    "model": model.name,
                    "world": world,
                    "names_per_rank": max(len(model.names(*c)) for c in distinct),
                    "distinct_holdings": len(distinct),
                    "sent": max(t.sent for t in traffic),
                    "received": max(t.received for t in traffic),
                    "all_gather_object_sent": _SIZE_BYTES + longest,
                    "all_gather_object_received": world * (_SIZE_BYTES + longest),
                }
            )
    return out


def format_rows(table: Sequence[dict[str, Any]]) -> str:
    from .report import format_bytes

    lines = [
        "| model | world | names / rank | (stage, expert rank) pairs | exchange: sent / received "
        "per rank | all_gather_object: sent / received per rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines.extend(
        f"| {r['model']} | {r['world']:,} | {r['names_per_rank']:,} | {r['distinct_holdings']} "
        f"| {format_bytes(r['sent'])} / {format_bytes(r['received'])} "
        f"| {format_bytes(r['all_gather_object_sent'])} / "
        f"{format_bytes(r['all_gather_object_received'])} |"
        for r in table
    )
    return "\n".join(lines)
