"""What one rank sends, receives and computes for every norm_optim operation, at 64 to 16,384 ranks.

``python -m benchmarks.scale [--params N] [--worlds 64 1024 16384] [--validate] [--out FILE]``

One process plays one rank of a large world at the communication seam: a
:class:`SimulatedCommunicator` (a :class:`~norm_optim.testing.RecordingCommunicator` with a size
and a rank per group) answers each collective with what the group would give, and counts what
``torch.distributed`` would move on this rank (logical payloads: a gather's W pieces in, an
all-reduce's tensor out and in). Each simulated rank holds ``--params`` params (a plain torch
model of small linear layers, half of them TP-split, with expert params in the MoE layout),
wrapped in a :class:`~norm_optim.NormAwareOptimizer` over a ``pg_collection`` of named groups.

Operations, each timed in this thread's CPU time minus the simulator's own (``Python s``):
``param_l2_norm()``, ``param_l2_norms(per_param=True)`` first (the names exchange: other
pipeline stages and expert ranks hold other names) and later, an armed step
(``measure_next_step`` + ``step``), ``audit()`` clean, with one drifted rank and with a whole
drifted replica, the resume proof's ``state_fingerprint()``, and checkpoint parity save and load
(``CheckpointParity``).

For the audits with drift, two simulated ranks run in lock step in two threads: this one
(the reporter of its copy groups) and a drifted DP peer; a group's MIN / MAX is the
element-wise one of the two (the other members are like this rank), its SUM this rank's times
the members like it plus the peer's; groups without the peer reduce to this rank's values. The
world-wide findings exchange then holds this copy group's findings only (other groups'
reporters would add theirs into the same fixed-size slots: the bytes do not change).

``--validate`` runs the same model and operations on real gloo ranks (2-16 forked processes),
counts the bytes ``torch.distributed`` moves on each
(``norm_optim.testing.comm.counting_patches``, at the
primitives) and prints them beside the simulation's for the same layout.

Columns: collectives; bytes sent and received; host syncs (blocking collectives whose result
the host reads, plus reading a norm); Python seconds of this rank; the largest receive buffer
of one collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from norm_optim import NormAwareOptimizer
from norm_optim._comm import Done
from norm_optim._norms.names import digests, encode, name_parts, pack, speakers
from norm_optim.integrations._checkpoint_norms import CheckpointParity
from norm_optim.testing.comm import RecordingCommunicator, Traffic

from .units import format_bytes

# The bounds at 16,384 ranks (benchmarks/README.md): bytes one rank receives per operation, the
# audit's seconds of Python, the report's bytes.
BOUNDS = {"received": 1 << 20, "python_s": 1.0, "report": 64 << 10}


# ---------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """A world's parallel sizes as they grow with ``world``: ``dp`` fills what the model-parallel
    sizes leave; ``ep`` splits the experts (expert-DP fills the rest, expert TP is 1)."""

    name: str
    tp: int
    pp: int
    ep: int = 1

    def sizes(self, world: int) -> dict[Any, int]:
        pp = max(1, min(self.pp, world // (self.tp * 2)))
        ep = max(1, min(self.ep, world // 8)) if self.ep > 1 else 1
        return {
            None: world,
            "tp": self.tp,
            "pp": pp,
            "dp": world // (self.tp * pp),
            "ep": ep,
            "etp": 1,
            "edp": world // (pp * ep),
        }

    def label(self, world: int) -> str:
        s = self.sizes(world)
        parts = [f"TP{s['tp']}"] if s["tp"] > 1 else []
        parts += [f"PP{s['pp']}"] if s["pp"] > 1 else []
        parts += [f"EP{s['ep']} (EDP{s['edp']})"] if s["ep"] > 1 else []
        return "×".join(parts + [f"DP{s['dp']}"])


LAYOUTS = (
    Layout("dense TP8×PP16×DP", tp=8, pp=16),
    Layout("MoE TP4×EP64, expert-DP", tp=4, pp=1, ep=64),
    Layout("pure DP", tp=1, pp=1),
)
WORLDS = (64, 1024, 16384)


# ---------------------------------------------------------------- the simulated seam


class Rendezvous:
    """Two simulated ranks meet at each collective and get the same group result."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.slots: list[Optional[torch.Tensor]] = [None, None]


class SimulatedCommunicator(RecordingCommunicator):
    """One rank of a simulated world: a size and a rank per named group.

    ``in_peer``: the groups that hold the lock-step peer (with ``rendezvous``), ``seat``: 0 for
    this rank, 1 for the peer. Time spent synthesizing results is kept in :attr:`sim_seconds`.
    """

    def __init__(
        self,
        sizes: dict[Any, int],
        ranks: dict[Any, int],
        *,
        peers: Any = None,
        reduce: Any = None,
        rendezvous: Optional[Rendezvous] = None,
        seat: int = 0,
        in_peer: frozenset = frozenset(),
    ) -> None:
        super().__init__(rank=ranks.get(None, 0), size=sizes[None], peers=peers, reduce=reduce)
        self.sizes, self.ranks = sizes, ranks
        self.rendezvous, self.seat, self.in_peer = rendezvous, seat, in_peer
        self.sim_seconds = 0.0
        self.syncs = 0

    def rank(self, group: Any) -> int:
        return self.ranks.get(group, 0)

    def size(self, group: Any) -> int:
        return self.sizes[group]

    def group_ranks(self, group: Any) -> frozenset[int]:
        return frozenset(range(self.sizes[group]))

    def all_reduce(self, tensor: torch.Tensor, group: Any, op: Any) -> None:
        self.syncs += 1
        start = time.thread_time()
        self.calls.append((f"all_reduce_{op}", group, tensor.shape))
        self._count("all_reduce")
        self.traffic.sent += tensor.nbytes
        self.traffic.received += tensor.nbytes
        self.peak_receive = max(self.peak_receive, tensor.nbytes)
        if self.rendezvous is not None:
            tensor.copy_(self._meet(tensor, group, op))
        elif self._reduce is not None:
            tensor.copy_(self._reduce(op, tensor, self._counts["all_reduce"] - 1))
        self.sim_seconds += time.thread_time() - start

    def _meet(self, tensor: torch.Tensor, group: Any, op: str) -> torch.Tensor:
        rv = self.rendezvous
        assert rv is not None
        rv.slots[self.seat] = tensor.clone()
        rv.barrier.wait()
        mine, peer = rv.slots  # seat 0 is the clean rank, seat 1 the drifted peer
        assert mine is not None and peer is not None and mine.shape == peer.shape, group
        size = self.sizes[group]
        if group not in self.in_peer:
            out = mine * size if op == "sum" else mine.clone()
        elif op == "sum":
            # Every member but the peer is like this rank; the world's findings count only
            # the two simulated ranks' (the other groups' reporters are not simulated).
            out = mine + peer if group is None else mine * (size - 1) + peer
        else:
            out = torch.minimum(mine, peer) if op == "min" else torch.maximum(mine, peer)
        rv.barrier.wait()
        return out

    def all_reduce_sum(self, tensor: torch.Tensor, group: Any, async_op: bool) -> Any:
        # The norms' all-reduce: its result stays on the device until the caller reads it.
        if self.rendezvous is None:
            start = time.thread_time()
            work = super().all_reduce_sum(tensor, group, async_op)
            self.sim_seconds += time.thread_time() - start
            return work
        self.all_reduce(tensor, group, "sum")
        self.syncs -= 1
        self.calls[-1] = ("all_reduce", group, tensor.shape)
        return Done()

    def all_gather_tensor(self, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        self.syncs += 1
        start = time.thread_time()
        size, self._size = self._size, self.sizes[group]
        try:
            return super().all_gather_tensor(tensor, group)
        finally:
            self._size = size
            self.sim_seconds += time.thread_time() - start

    def broadcast_object(self, obj: Any, src: int, group: Any) -> Any:
        self.syncs += 1
        start = time.thread_time()
        try:
            return super().broadcast_object(obj, src, group)
        finally:
            self.sim_seconds += time.thread_time() - start


# ---------------------------------------------------------------- the simulated rank's model


def build_model(params: int, expert_share: float) -> torch.nn.ModuleList:
    """``params`` small fp32 params: pairs of (weight, bias) of 16×16 linear layers; weights of
    every other layer TP-split (megatron's markers), a share of layers expert
    (``allreduce=False``)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(params // 2))
    experts = int(len(layers) * expert_share)
    for i, layer in enumerate(layers):
        if i % 2:
            layer.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
            layer.weight.partition_dim = 0  # type: ignore[attr-defined]
            layer.weight.partition_stride = 1  # type: ignore[attr-defined]
        if i >= len(layers) - experts:
            for p in layer.parameters():
                p.allreduce = False  # type: ignore[attr-defined]
    return layers


def pg_collection(moe: bool) -> Any:
    groups = dict(tp="tp", dp_cp="dp", pp="pp")
    if moe:
        groups.update(expt_tp="etp", expt_dp="edp", ep="ep")
    return types.SimpleNamespace(**groups)


def wrap(
    params: int, moe: bool, comm: SimulatedCommunicator
) -> tuple[NormAwareOptimizer, torch.nn.ModuleList]:
    model = build_model(params, 0.5 if moe else 0.0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = NormAwareOptimizer(inner, model=model, pg_collection=pg_collection(moe), comm=comm)
    return optimizer, model


# ---------------------------------------------------------------- the names of other ranks


def coordinates(sizes: dict[Any, int], rank: int) -> tuple[int, int]:
    """(pipeline stage, expert rank) of a global rank: TP fastest, then DP, PP slowest; expert
    ranks next to TP inside a stage."""
    stage_size = sizes[None] // sizes["pp"]
    return rank // stage_size, (rank % stage_size) // sizes["tp"] % sizes["ep"]


def renamed(names: Sequence[tuple[str, bool]], stage: int, expert_rank: int) -> list:
    """What a rank of another stage / expert rank holds: the same shapes, other names."""
    return [
        (f"stage{stage}." + (f"experts{expert_rank}." if expert else "") + name, expert)
        if (stage, expert_rank) != (0, 0)
        else (name, expert)
        for name, expert in names
    ]


def names_sim(sizes: dict[Any, int], names: list) -> tuple[Callable, Callable]:
    """``peers`` and ``reduce`` for the names exchange as the whole world makes it."""
    cpu = torch.device("cpu")
    cache: dict[tuple[int, int], list] = {}

    def held(rank: int) -> list:
        coords = coordinates(sizes, rank)
        if coords not in cache:
            cache[coords] = renamed(names, *coords)
        return cache[coords]

    digest_cache: dict[tuple[int, int], torch.Tensor] = {}

    def digest(rank: int) -> torch.Tensor:
        coords = coordinates(sizes, rank)
        if coords not in digest_cache:
            digest_cache[coords] = digests(held(rank), cpu)
        return digest_cache[coords]

    order = speakers(torch.stack([digest(r) for r in range(sizes[None])]))
    blobs = {i: encode(name_parts(held(who))[kind]) for i, (kind, who) in enumerate(order)}
    sums = [torch.tensor(part, dtype=torch.int64) for part in pack(order, blobs)]

    def peers(kind: str, peer: int, index: int) -> Any:
        return digest(peer)

    def reduce(op: str, tensor: torch.Tensor, index: int) -> torch.Tensor:
        return sums[index] if op == "sum" and index < len(sums) else tensor

    return peers, reduce


# ---------------------------------------------------------------- one operation


@dataclasses.dataclass
class Row:
    layout: str
    world: int
    operation: str
    collectives: int
    sent: int
    received: int
    syncs: int
    python_s: float
    peak_receive: int
    report: int = 0
    findings: int = 0


def measure(
    layout: Layout, world: int, operation: str, comm: SimulatedCommunicator, run: Callable
) -> Row:
    calls, traffic = len(comm.calls), Traffic(comm.traffic.sent, comm.traffic.received)
    syncs, sim = comm.syncs, comm.sim_seconds
    comm.peak_receive = 0
    start = time.thread_time()
    extra = run() or {}
    spent = time.thread_time() - start - (comm.sim_seconds - sim)
    return Row(
        layout.label(world),
        world,
        operation,
        len(comm.calls) - calls,
        comm.traffic.sent - traffic.sent,
        comm.traffic.received - traffic.received,
        comm.syncs - syncs + extra.get("reads", 0),
        spent,
        comm.peak_receive,
        extra.get("report", 0),
        extra.get("findings", 0),
    )


def ranks_of(sizes: dict[Any, int], global_rank: int, dp_rank: int) -> dict[Any, int]:
    return {None: global_rank, "dp": dp_rank, "edp": dp_rank}


def run_layout(layout: Layout, world: int, params: int) -> list[Row]:
    """Every operation on rank 0 of ``world`` ranks of ``layout``."""
    sizes = layout.sizes(world)
    moe = layout.ep > 1
    comm = SimulatedCommunicator(sizes, ranks_of(sizes, 0, 0))
    optimizer, model = wrap(params, moe, comm)
    from norm_optim._norms.reducer import local_names

    peers, reduce = names_sim(sizes, local_names(optimizer.registry))
    rows: list[Row] = []

    def add(operation: str, run: Callable) -> None:
        rows.append(measure(layout, world, operation, comm, run))

    add("param_l2_norm()", lambda: {"reads": 1} if float(optimizer.param_l2_norm()) else {})
    comm._peers, comm._reduce = peers, reduce
    comm._counts.clear()  # the simulated sums are the exchange's first two all-reduces
    add("per-param, first call", lambda: _read(optimizer.param_l2_norms(per_param=True)))
    comm._peers, comm._reduce = None, None
    add("per-param, later call", lambda: _read(optimizer.param_l2_norms(per_param=True)))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    add("armed step", lambda: _armed_step(optimizer))
    add("audit() clean", lambda: _report(optimizer.audit()))
    add("state_fingerprint() (resume proof)", lambda: _fingerprint(optimizer))
    rows.append(_drifted(layout, world, params, "audit() one drifted rank", whole=False))
    rows.append(_drifted(layout, world, params, "audit() drifted replica", whole=True))
    parity = CheckpointParity("warn")
    with tempfile.TemporaryDirectory() as directory:
        add("checkpoint parity save", lambda: _save(parity, optimizer, directory))
        add("checkpoint parity load (reader)", lambda: _load(parity, optimizer, directory))
        verdict = {"saved_total": 1.0, "differ": [], "count": 0}
        # A rank that does not read the file: it receives the verdict.
        other = SimulatedCommunicator(sizes, {None: 1}, peers=peers, reduce=reduce)
        listener, _ = wrap(params, moe, other)
        listener.param_l2_norms(per_param=True)  # its names, as on the reader
        other._peers, other._reduce = (lambda kind, src, index: verdict), None
        row = measure(
            layout,
            world,
            "checkpoint parity load (others)",
            other,
            lambda: _load(parity, listener, directory),
        )
        rows.append(row)
    return rows


def _read(norms: Any) -> dict[str, int]:
    float(norms.total)
    return {"reads": 1}


def _armed_step(optimizer: NormAwareOptimizer) -> dict[str, int]:
    optimizer.measure_next_step()
    optimizer.step()
    float(optimizer.step_norms().grads.total)
    return {"reads": 1}


def _fingerprint(optimizer: NormAwareOptimizer) -> dict[str, int]:
    optimizer.state_fingerprint()  # read on the host: one sync, inside its reduce
    return {}


def _report(report: Any) -> dict[str, int]:
    return {"report": len(report.summary().encode()), "findings": len(report.findings)}


def _save(parity: CheckpointParity, optimizer: NormAwareOptimizer, directory: str) -> dict:
    parity.saved(optimizer, directory, 1)
    return {"reads": 1}  # the norms it writes


def _load(parity: CheckpointParity, optimizer: NormAwareOptimizer, directory: str) -> dict:
    # Its verdict (a match) goes to the norm_optim.integrations logger at INFO: not shown
    # unless the caller's logging asks for it.
    parity.loaded(optimizer, directory, 1, None, None)
    return {"reads": 1}  # the norms it compares


def _drifted(layout: Layout, world: int, params: int, operation: str, whole: bool) -> Row:
    """``audit()`` on this rank, in lock step with a DP peer whose copy drifted (one param, or
    every param: a whole drifted replica)."""
    sizes = layout.sizes(world)
    moe = layout.ep > 1
    rendezvous = Rendezvous()
    stride = sizes["tp"]  # the DP peer's global rank: TP is the fastest axis
    in_peer = frozenset({None, "dp", "edp"})
    comms = [
        SimulatedCommunicator(
            sizes, ranks_of(sizes, rank, dp), rendezvous=rendezvous, seat=seat, in_peer=in_peer
        )
        for seat, (rank, dp) in enumerate(((0, 0), (stride, 1)))
    ]
    optimizers = [wrap(params, moe, comm)[0] for comm in comms]
    with torch.no_grad():
        drifted = list(optimizers[1].registry)
        for record in drifted if whole else drifted[:1]:
            record.param.view(-1)[0] += 1.0
    results: list[Any] = [None, None]

    def run(seat: int) -> None:
        if seat == 0:
            results[0] = measure(
                layout, world, operation, comms[0], lambda: _report(optimizers[0].audit())
            )
        else:
            optimizers[1].audit()

    threads = [threading.Thread(target=run, args=(seat,)) for seat in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results[0]


# ---------------------------------------------------------------- real gloo ranks


def _gloo_rank(params: int, drift: bool) -> dict[str, int]:
    """On a real gloo rank: the same model over DP = world (plain DP layout), bytes per
    operation, counted at torch.distributed's primitives."""
    import torch.distributed as dist

    from norm_optim._patching import patches_applied
    from norm_optim.testing.comm import counting_patches

    world = dist.get_world_size()
    groups = types.SimpleNamespace(
        tp=dist.new_group([dist.get_rank()]),
        dp_cp=dist.group.WORLD,
        pp=dist.new_group([dist.get_rank()]),
    )
    model = build_model(params, 0.0)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = NormAwareOptimizer(inner, model=model, pg_collection=groups)
    del world
    out = {}
    operations = (
        ("param_l2_norm()", lambda: float(optimizer.param_l2_norm())),
        ("per-param, first call", lambda: optimizer.param_l2_norms(per_param=True)),
        ("per-param, later call", lambda: optimizer.param_l2_norms(per_param=True)),
        ("audit() clean", optimizer.audit),
    )
    for name, run in operations:
        traffic = Traffic()
        with patches_applied(counting_patches(traffic)):
            run()
        out[name] = traffic.received
    if drift:
        with torch.no_grad():
            if dist.get_rank() == 1:
                next(iter(model.parameters())).view(-1)[0] += 1.0
        traffic = Traffic()
        with patches_applied(counting_patches(traffic)):
            report = optimizer.audit()
        out["audit() one drifted rank"] = traffic.received
        out["report"] = len(report.summary().encode())
    return out


def validate(params: int, worlds: Sequence[int]) -> list[dict[str, Any]]:
    """Real gloo bytes received per rank (the most of any rank) beside the simulation's."""
    from norm_optim.testing import run_ranks

    layout = Layout("pure DP", tp=1, pp=1)
    rows = []
    for world in worlds:
        real = run_ranks(_gloo_rank, world, params, True, cpu_shim=False, timeout=600)
        simulated = {r.operation: r.received for r in run_layout(layout, world, params)}
        for operation in real[0]:
            if operation == "report":
                continue
            rows.append(
                {
                    "world": world,
                    "operation": operation,
                    "real": max(r[operation] for r in real),
                    "simulated": simulated[operation],
                }
            )
    return rows


# ---------------------------------------------------------------- output


def format_rows(rows: Sequence[Row]) -> str:
    lines = [
        "| layout | W | operation | collectives | sent | received | host syncs | Python s "
        "| largest receive | report |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.layout} | {r.world:,} | {r.operation} | {r.collectives} "
        f"| {format_bytes(r.sent)} | {format_bytes(r.received)} | {r.syncs} | {r.python_s:.3f} "
        f"| {format_bytes(r.peak_receive)} "
        f"| {format_bytes(r.report) + f' ({r.findings} findings)' if r.report else ''} |"
        for r in rows
    ]
    return "\n".join(lines)


def format_summary(rows: Sequence[Row]) -> str:
    """Per layout family: each operation's bytes received per rank at every world size, and
    its collectives, host syncs, Python seconds and largest receive at the largest one."""
    out = []
    families = [layout.name for layout in LAYOUTS]
    worlds = sorted({r.world for r in rows})
    for family, layout in zip(families, LAYOUTS):
        mine = [r for r in rows if r.layout in {layout.label(w) for w in worlds}]
        if not mine:
            continue
        top = max(worlds)
        head = " | ".join(f"received, W={w:,}" for w in worlds)
        sizes = "; ".join(f"W={w:,}: {layout.label(w)}" for w in worlds)
        out += [
            f"**{family}** ({sizes}; the last four columns at W={top:,})",
            "",
            f"| operation | {head} | collectives | host syncs | Python s | largest receive "
            "| report |",
            "|---|" + "---:|" * (len(worlds) + 5),
        ]
        for operation in dict.fromkeys(r.operation for r in mine):
            at = {r.world: r for r in mine if r.operation == operation}
            big = at[top]
            report = f"{format_bytes(big.report)} ({big.findings} findings)" if big.report else ""
            out.append(
                f"| {operation} | "
                + " | ".join(format_bytes(at[w].received) for w in worlds)
                + f" | {big.collectives} | {big.syncs} | {big.python_s:.3f} "
                f"| {format_bytes(big.peak_receive)} | {report} |"
            )
        out.append("")
    return "\n".join(out)


def format_validation(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| DP | operation | real gloo received | simulated | equal |",
        "|---:|---|---:|---:|---|",
    ]
    lines += [
        f"| {r['world']} | {r['operation']} | {r['real']:,} B | {r['simulated']:,} B "
        f"| {'yes' if r['real'] == r['simulated'] else 'NO'} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=1000, help="params per rank")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument(
        "--validate",
        type=int,
        nargs="*",
        default=None,
        help="real gloo DP sizes to check the simulation against (e.g. 2 4 8 16)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [
        r for layout in LAYOUTS for w in args.worlds for r in run_layout(layout, w, args.params)
    ]
    print(
        f"{datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, "
        f"{args.params} params per rank"
    )
    print(format_rows(rows))
    print()
    print(format_summary(rows))
    result: dict[str, Any] = {"rows": [dataclasses.asdict(r) for r in rows]}
    if args.validate is not None:
        checked = validate(args.params, args.validate or [2, 4, 8])
        print(format_validation(checked))
        result["validation"] = checked
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
