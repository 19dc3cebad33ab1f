"""The resume proof: a fingerprint of the optimizer's whole state, the same on any layout.

One fingerprint per (param, state): ``param`` (the model's weight as the model holds it),
``main_param`` (the fp32 master, or this rank's shard of it) and every tensor of the inner
optimizer's state under its own key (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...), plus
the scalars ``step`` and ``loss_scale``. Each is a sum over the param's elements of a hash of
(global index, bits, dtype) (:mod:`norm_optim._kernels.position_hash`), computed by the rank that
counts those elements (the registry's rule: every element exactly once) and summed over the world
in **one** all-reduce of a ``[params x states, 9]`` float64 table (each 64-bit hash travels as four
16-bit limbs, whose sums stay exact in float64 up to 2**37 ranks). So a save at TP2 x DP2 and a
load at TP1 x DP4 give the same fingerprints when, and only when, every element at every global
position is bitwise the same. Bytes per rank grow with the params, never with the world.

:func:`~norm_optim._resume.report.verify_resume` says what differs and, where it can tell,
why.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from .._comm import Communicator, ProcessGroup
from .._errors import UnsupportedOptimizerError
from .._kernels.position_hash import DTYPE_CODES, hash_and_squares
from .._megatron.optimizers.holdings import local
from .._megatron.placement import megatron_fsdp_shards, placement_of
from .._norms.reducer import EXPERT, NormReducer
from .._counting.ownership import RankCoords

PARAM, MAIN = "param", "main_param"
STATES: tuple[str, ...] = (
    PARAM,
    MAIN,
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "momentum_buffer",
)
"""The states a fingerprint has a slot for (the same on every rank: the table's shape)."""
MOMENTS = STATES[2:]
# Optimizer state keys that are another name of what is already hashed: TE's FusedAdam keeps its
# fp32 masters in its state (the registry holds them as ``main_param``).
_SAME_AS_MAIN = frozenset({"master_param"})
SCALARS = ("step", "loss_scale")
# Table columns of a (param, state) row; a scalar row uses the first three (sum, count, sumsq).
_LIMBS, _NUMEL, _HOLDERS, _CODE_SUM, _CODE_SQ, _SQUARES = slice(0, 4), 4, 5, 6, 7, 8
_WIDTH = 9
_UNKNOWN_ROW = len(SCALARS)  # after the scalar rows: how many unknown state tensors ranks hold
_CODE_DTYPE = {code: str(dtype).replace("torch.", "") for dtype, code in DTYPE_CODES.items()}
FORMAT = "norm_optim-state-fingerprint/1"


@dataclasses.dataclass(frozen=True)
class Entry:
    """The fingerprint of one (param, state) over the whole model.

    Attributes:
        fingerprint: the sum of its elements' hashes modulo 2**64 (an unsigned integer).
        numel: how many elements were hashed (the global tensor's size).
        dtype: their dtype (``"bfloat16"``...), or ``"mixed"`` where ranks hold it in different
            dtypes.
        norm: its L2 norm (for the report; not part of the equality).
    """

    fingerprint: int
    numel: int
    dtype: str
    norm: float

    def same(self, other: "Entry") -> bool:
        return (self.fingerprint, self.numel, self.dtype) == (
            other.fingerprint,
            other.numel,
            other.dtype,
        )


@dataclasses.dataclass(frozen=True)
class StateFingerprint:
    """Every (param, state)'s :class:`Entry`, and the scalars (``step``, ``loss_scale``: the
    mean over what holds them, None when nothing does; ``"mixed"`` when holders disagree).

    The same on every rank (all-reduced); :meth:`to_json` / :meth:`from_json` write and read it.
    """

    entries: Mapping[tuple[str, str], Entry]
    scalars: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        params: dict[str, dict[str, list[Any]]] = {}
        for (name, state), e in sorted(self.entries.items()):
            params.setdefault(name, {})[state] = [f"{e.fingerprint:016x}", e.numel, e.dtype, e.norm]
        return {"format": FORMAT, "scalars": dict(self.scalars), "params": params}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "StateFingerprint":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a state fingerprint of format {FORMAT}: {data.get('format')!r}")
        entries = {
            (name, state): Entry(int(h, 16), int(n), str(d), float(norm))
            for name, states in data["params"].items()
            for state, (h, n, d, norm) in states.items()
        }
        return cls(entries, dict(data["scalars"]))

    def save(self, path: str) -> None:
        """Write it as JSON (call it on one rank: the fingerprint is the same on all)."""
        with open(path, "w", encoding="utf-8") as out:
            json.dump(self.to_json(), out, indent=1, sort_keys=True)

    @classmethod
    def load(cls, path: str) -> "StateFingerprint":
        """Read what :meth:`save` wrote."""
        with open(path, encoding="utf-8") as inp:
            return cls.from_json(json.load(inp))


@torch.no_grad()
def fingerprint_state(
    reducer: NormReducer, coords: RankCoords, comm: Communicator, group: ProcessGroup
) -> StateFingerprint:
    """The :class:`StateFingerprint` of the registry's model and optimizer: a collective (one
    all-reduce, and the names exchange on a reducer's first per-param call); every rank must
    call it. A layout this rank cannot place is refused on every rank alike, after the reduce.
    """
    registry = reducer.registry
    slots = reducer.counted_slots(per_param=True)  # gathers the names on a first call
    names = [name for name, _ in reducer.names or ()]
    device = reducer.device
    rows: list[int] = []
    hashes: list[torch.Tensor] = []
    squares: list[torch.Tensor] = []
    facts: list[tuple[float, float, float, float]] = []  # numel, holders, dtype code, its square
    scalars = _Scalars()
    refusal = _refusal(registry)
    if refusal is None:
        try:
            # Megatron-FSDP: where each shard starts, and its bf16 weight shard.
            shards = megatron_fsdp_shards(registry.chunks or ())
            for record, slot in zip(registry.counted, slots):
                base = (slot - EXPERT - 1) * len(STATES)
                for state, tensor, indices in _hashed(record, registry, coords, scalars, shards):
                    h, sq = hash_and_squares(tensor, indices)
                    code = float(DTYPE_CODES[tensor.dtype])
                    rows.append(base + STATES.index(state))
                    hashes.append(h.to(device))
                    squares.append(sq.to(device))
                    facts.append((float(tensor.numel()), 1.0, code, code * code))
            scalars.from_leaves(registry.descriptor.leaves)
        except UnsupportedOptimizerError as error:  # said on every rank, after the reduce
            refusal, rows = str(error), []
        except Exception as error:  # noqa: BLE001 -- never a hang: every rank reduces, then raises
            refusal, rows = f"failed on a rank: {type(error).__name__}: {error}", []
    head = len(names) * len(STATES)
    table = torch.zeros(head + len(SCALARS) + 1, _WIDTH, dtype=torch.float64, device=device)
    if rows:
        table.index_add_(0, torch.tensor(rows, device=device), _rows(hashes, squares, facts))
    table[head:, :3] = scalars.table(device)
    table[head + _UNKNOWN_ROW, 3] = float(refusal is not None)
    comm.all_reduce_sum(table, group, False).wait()
    return _read(table.cpu(), names, head, refusal, scalars.unknown)


def _refusal(registry: Any) -> Optional[str]:
    if any(leaf.kind == "megatron-fsdp-v2" for leaf in registry.descriptor.leaves):
        return (
            "the resume fingerprint does not read Megatron-FSDP v2's shards yet (megatron-core "
            "main); Megatron-FSDP v1, the distributed optimizer, DDP and torch FSDP2 are read"
        )
    return None


class _Scalars:
    """This rank's values of each scalar (numbers or device tensors: read after the reduce
    only), and the state keys it holds tensors of that no slot is for."""

    def __init__(self) -> None:
        self.values: dict[str, list[Any]] = {name: [] for name in SCALARS}
        self.unknown: set[str] = set()

    def add(self, name: str, value: Any) -> None:
        self.values[name].append(value)

    def from_leaves(self, leaves: Iterable[Any]) -> None:
        for leaf in leaves:
            get = getattr(leaf.leaf, "get_loss_scale", None)
            if callable(get) and leaf.inner is not None:
                self.add("loss_scale", get())
            groups = getattr(leaf.inner, "param_groups", None) or ()
            for group in groups:  # FusedAdam keeps its step in the param groups
                if "step" in group and group.get("params"):
                    self.add("step", group["step"])

    def table(self, device: torch.device) -> torch.Tensor:
        """Rows (sum, count, sum of squares) of each scalar, then (unknown keys, 0, 0)."""
        rows = []
        for name in SCALARS:
            found = [
                torch.as_tensor(v).to(device, torch.float64).reshape(()) for v in self.values[name]
            ]
            x = torch.stack(found) if found else torch.zeros(0, dtype=torch.float64, device=device)
            rows.append(torch.stack([x.sum(), x.new_tensor(float(len(found))), x.square().sum()]))
        unknown = torch.tensor([float(len(self.unknown)), 0.0, 0.0], dtype=torch.float64)
        return torch.stack(rows + [unknown.to(device)])


def _hashed(
    record: Any,
    registry: Any,
    coords: RankCoords,
    scalars: _Scalars,
    shards: Mapping[int, tuple[int, torch.Tensor]],
) -> Iterable[Any]:
    """(state, tensor, global indices of its elements) of each tensor hashed for a record; the
    scalars it finds go to ``scalars``."""
    tensor, offset, n = record.tensor, record.offset, record.tensor.numel()
    if id(record.param) in shards:  # Megatron-FSDP: the shard's own start and weights
        offset, weight = shards[id(record.param)]
    else:
        weight = local(record.param).reshape(-1)[offset : offset + n]
    placement = placement_of(
        record.name,
        record.param,
        registry.declarations,
        coords,
        record.expert,
        record.tp_split,
    )
    device = tensor.device

    def indices(start: int, end: int) -> torch.Tensor:
        return placement.indices(offset + start, offset + end, device)

    yield PARAM, weight, indices
    if record.source.is_frozen:
        return
    yield MAIN, tensor, indices
    stepped = registry.descriptor.stepped(tensor)
    state = stepped.state if stepped is not None else {}
    for key in sorted(state):
        value = state[key]
        if key == "step":
            scalars.add("step", value)
        elif key in _SAME_AS_MAIN or not isinstance(value, torch.Tensor):
            continue
        elif key in MOMENTS and value.numel() == n:
            yield key, value, indices
        elif value.numel() > 1:
            scalars.unknown.add(key)


def _rows(
    hashes: Sequence[torch.Tensor],
    squares: Sequence[torch.Tensor],
    facts: Sequence[tuple[float, float, float, float]],
) -> torch.Tensor:
    """The table rows of the hashed tensors, built at once on the device (no host sync): each
    hash as four 16-bit limbs, then numel, one holder, the dtype code and its square, the sum
    of squares."""
    h = torch.stack(list(hashes))
    limbs = torch.stack([(h >> (16 * k)) & 0xFFFF for k in range(4)], dim=1).to(torch.float64)
    known = torch.tensor(facts, dtype=torch.float64).to(h.device)
    return torch.cat([limbs, known, torch.stack(list(squares)).reshape(-1, 1)], dim=1)


def _read(
    table: torch.Tensor,
    names: Sequence[str],
    head: int,
    refusal: Optional[str],
    unknown: Iterable[str],
) -> StateFingerprint:
    rows = table.tolist()
    if rows[head + _UNKNOWN_ROW][3]:
        raise UnsupportedOptimizerError(
            refusal or "the resume fingerprint was refused on another rank (see its error)"
        )
    if rows[head + _UNKNOWN_ROW][0]:
        here = f" (here: {sorted(unknown)})" if unknown else ""
        raise UnsupportedOptimizerError(
            "the optimizer keeps state tensors under keys the resume fingerprint has no slot "
            f"for{here}; it knows {list(MOMENTS)}: a state it cannot place is never called equal"
        )
    entries: dict[tuple[str, str], Entry] = {}
    for p, name in enumerate(names):
        for s, state in enumerate(STATES):
            row = rows[p * len(STATES) + s]
            holders = row[_HOLDERS]
            if not holders:
                continue
            value = sum(int(limb) << (16 * k) for k, limb in enumerate(row[_LIMBS]))
            code_sum, code_sq = row[_CODE_SUM], row[_CODE_SQ]
            uniform = code_sum * code_sum == holders * code_sq
            dtype = _CODE_DTYPE[int(code_sum / holders)] if uniform else "mixed"
            norm = math.sqrt(row[_SQUARES])
            entries[(name, state)] = Entry(value % (1 << 64), int(row[_NUMEL]), dtype, norm)
    scalars: dict[str, Any] = {}
    for i, name in enumerate(SCALARS):
        total, count, sq = rows[head + i][:3]
        if not count:
            scalars[name] = None
        else:
            mean = total / count
            scalars[name] = mean if abs(sq / count - mean * mean) <= 1e-9 * (1 + sq) else "mixed"
    return StateFingerprint(entries, scalars)
