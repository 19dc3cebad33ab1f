"""Step norms of Muon (megatron-core >= 0.19 with emerging-optimizers) against the test's own
snapshots.

Megatron builds Muon for the 2-D weight matrices and Adam for the rest: chained Float16 leaves
(``optimizer="muon"``), the layer-wise optimizer over plain DDP (``use_layer_wise_distributed_
optimizer``, and its legacy name ``dist_muon``: each matrix stepped whole on one DP rank), or
over a distributed-optimizer DDP (``ChainedOptimizer([LayerWise(Muon), DistributedOptimizer(Adam)])``,
the shard-aligned layout). Each case trains one plain step (so the momentum exists), arms the
next and runs it through a probe that, right before ``step()``, copies every fp32 tensor the
inner optimizers step on this rank and the grads (``main_grad``, before megatron clips), and
after it reads the tensors again and the inner optimizers' state directly (Muon's
``momentum_buffer``, Adam's moments). The oracle is the sum over ranks of those snapshots, each
element counted once by the test's own rule (TP split by megatron's marker; a layer-wise matrix
on the one rank that steps it; a distributed-optimizer shard on its rank; a Float16 replica on
DP rank 0): independent of the registry.

Muon's update is read in-step, as the difference the step stored: it matches the snapshots to
the fp32 rounding of that difference (≤ 2^-24 of each element), not only within an ulp of the
weights as the derived Adam updates do.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any

import pytest
import torch

from norm_optim import NormAwareOptimizer
from norm_optim._versions import megatron_at_least
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer, train_step
from norm_optim.testing.oracle import named_global_parameters
from tests.support.layouts import SMALL, SMALL_MOE
from tests.support.arming import assert_training_unchanged, train_armed
from tests.support.step_oracle import differences, sum_of_squares, ulps

pytestmark = pytest.mark.skipif(
    not (megatron_at_least(0, 19) and importlib.util.find_spec("emerging_optimizers")),
    reason="Muon in get_megatron_optimizer needs megatron-core >= 0.19 and emerging-optimizers",
)

SEED = 7
REL = 1e-6
# Per param: Muon's update is the stored difference (fp32 subtraction: 2^-24 of it); Adam's
# is derived (one ulp of each weight, plus a few 2^-24 of the update: docs/step-norms.md).
ROUNDING = 8 * 2.0**-24
QUANTITIES = ("weights", "grads", "updates", "exp_avg", "exp_avg_sq", "momentum")


@dataclasses.dataclass(frozen=True)
class Case:
    world: int
    tp: int = 1
    ep: int = 1
    optimizer: str = "muon"
    layer_wise: bool = False
    shard_aligned: bool = False  # the layer-wise optimizer beside a distributed optimizer
    extra: tuple[tuple[str, Any], ...] = ()  # more OptimizerConfig fields


CASES = {
    "muon-dp2-chained": Case(2),
    "muon-dp2-layer-wise": Case(2, layer_wise=True),
    "dist_muon-dp2": Case(2, optimizer="dist_muon"),
    "muon-dp2-shard-aligned": Case(2, layer_wise=True, shard_aligned=True),
    "muon-tp2-dp2-layer-wise-duplicated-nesterov": Case(
        4, tp=2, layer_wise=True, extra=(("muon_tp_mode", "duplicated"), ("muon_nesterov", True))
    ),
    "muon-tp2-dp2-shard-aligned": Case(4, tp=2, layer_wise=True, shard_aligned=True),
    "muon-moe-ep2-dp2-layer-wise": Case(4, ep=2, layer_wise=True),
    # The legacy layer-wise overlap gathers params of uneven sizes per rank, which gloo
    # cannot (ProcessGroupGloo::allgather: invalid tensor size): the shard-aligned one here.
    "muon-dp2-shard-aligned-overlap-param-gather": Case(
        2, layer_wise=True, shard_aligned=True, extra=(("overlap_param_gather", True),)
    ),
}


def _build(case: Case) -> tuple[list, Any]:
    init_parallel(tp=case.tp, ep=case.ep)
    overlap = dict(case.extra).get("overlap_param_gather", False)
    ddp = {"overlap_param_gather": True, "overlap_grad_reduce": True} if overlap else {}
    chunks = build_model(
        SMALL_MOE if case.ep > 1 else SMALL,
        use_distributed_optimizer=case.shard_aligned,
        seed=SEED,
        layer_wise_layout=case.shard_aligned,
        **ddp,
    )
    extra = dict(case.extra)
    if case.layer_wise and case.optimizer == "muon":
        extra["use_layer_wise_distributed_optimizer"] = True
    inner = build_optimizer(
        chunks, optimizer=case.optimizer, lr=1e-2, weight_decay=0.1, clip_grad=1.0, **extra
    )
    return chunks, inner


def _leaves(optimizer: Any) -> list[Any]:
    members = getattr(optimizer, "chained_optimizers", None)
    return [optimizer] if members is None else [x for m in members for x in _leaves(m)]


def _held(inner: Any) -> dict[int, str]:
    """``id`` of every fp32 tensor an inner optimizer steps on this rank → how it is held:
    "owned" (a layer-wise optimizer steps it whole on this DP rank only), "shard" (a
    distributed-optimizer shard) or "replica" (every DP rank steps the same whole tensor)."""
    held: dict[int, str] = {}

    def walk(optimizer: Any, layer_wise: bool) -> None:
        members = getattr(optimizer, "chained_optimizers", None)
        if members is not None:
            lw = layer_wise or type(optimizer).__name__ == "LayerWiseDistributedOptimizer"
            for member in members:
                walk(member, lw)
            return
        sharded = hasattr(optimizer, "model_param_gbuf_map")
        for group in optimizer.optimizer.param_groups:
            for t in group["params"]:
                held[id(t)] = "shard" if sharded else "owned" if layer_wise else "replica"

    walk(inner, False)
    return held


class MuonProbe:
    """Stands in for the optimizer in ``train_step``: snapshots around the real ``step()``."""

    def __init__(self, optimizer: Any, inner: Any, chunks: list) -> None:
        self.optimizer, self.inner = optimizer, inner
        self.params = list(named_global_parameters(chunks))
        self.sums: dict[str, list[float]] = {}
        self.muon: set[str] = set()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def _main(self, param: torch.Tensor) -> tuple[torch.Tensor | None, slice]:
        """This rank's fp32 tensor for ``param`` (main, or distributed-optimizer shard) and where
        it sits in the flat grad."""
        main = getattr(param, "main_param", None)
        for leaf in _leaves(self.inner):
            shards = getattr(leaf, "model_param_gbuf_map", None)
            if shards is not None and param in shards:
                r = leaf._get_model_param_range_map(param)["param"]
                return main, slice(r.start, r.end)
        return main, slice(0, param.numel())

    def step(self) -> Any:
        from megatron.core import parallel_state as ps

        held = _held(self.inner)
        tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
        before = {}
        for name, param in self.params:
            main, where = self._main(param)
            if main is None or id(main) not in held:
                continue
            how = held[id(main)]
            tp_split = bool(getattr(param, "tensor_model_parallel", False))
            counts = (tp_split or tp_rank == 0) and (how != "replica" or dp_rank == 0)
            if counts:
                grad = param.main_grad.detach().reshape(-1)[where].double()
                before[name] = (main, main.detach().clone(), grad)
        result = self.optimizer.step()
        states = {
            id(k): v
            for leaf in _leaves(self.inner)
            if getattr(leaf, "optimizer", None) is not None
            for k, v in leaf.optimizer.state.items()
        }
        for name, (main, old, grad) in before.items():
            new, state = main.detach().double(), states.get(id(main), {})
            if "momentum_buffer" in state:
                self.muon.add(name)
            values = [
                sum_of_squares([new]),
                sum_of_squares([grad]),
                sum_of_squares(differences([new], [old])),
                *(
                    sum_of_squares([state[key]]) if key in state else 0.0
                    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer")
                ),
                sum_of_squares(ulps([main.detach()])),
            ]
            sums = self.sums.setdefault(name, [0.0] * len(values))
            for i, v in enumerate(values):
                sums[i] += v
        return result

    def oracle(self) -> tuple[dict[str, list[float]], set[str]]:
        """The snapshots' sums of squares by name over all ranks, and the Muon-stepped names."""
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (self.sums, sorted(self.muon)))
        total: dict[str, list[float]] = {}
        muon: set[str] = set()
        for sums, names in gathered:
            muon.update(names)
            for name, values in sums.items():
                acc = total.setdefault(name, [0.0] * len(values))
                for i, v in enumerate(values):
                    acc[i] += v
        return total, muon


def _measured(case: Case) -> dict:
    chunks, inner = _build(case)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    train_step(chunks, optimizer, seed=0)  # the momentum and the moments exist
    optimizer.measure_next_step(per_param=True)
    probe = MuonProbe(optimizer, inner, chunks)
    ok, grad_norm, _ = train_step(chunks, probe, seed=1)
    s = optimizer.step_norms()
    oracle, muon = probe.oracle()
    leaves = [type(getattr(leaf, "optimizer", None)).__name__ for leaf in _leaves(inner)]
    out: dict[str, Any] = {
        "ok": ok,
        "grad_norm": grad_norm,
        "oracle": oracle,
        "muon": muon,
        "leaves": leaves,
        "top": type(inner).__name__,
        "overlap": [
            getattr(m, "overlap_param_gather", False) for m in [inner, *inner.chained_optimizers]
        ],
    }
    for q in QUANTITIES:
        norms = getattr(s, q)
        out[q] = (
            None
            if norms is None
            else {
                "total": float(norms.total),
                "per_param": {k: float(v) for k, v in norms.per_param.items()},
            }
        )
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_muon_step_norms_against_the_snapshots(name: str) -> None:
    case = CASES[name]
    results = run_ranks(_measured, case.world, case)
    oracle, muon = results[0]["oracle"], results[0]["muon"]
    assert "TensorParallelMuon" in results[0]["leaves"], results[0]["leaves"]
    if case.shard_aligned:
        assert results[0]["top"] == "ChainedOptimizer" and "AdamW" in results[0]["leaves"]
    if dict(case.extra).get("overlap_param_gather"):
        assert any(results[0]["overlap"]), "the layer-wise optimizer must overlap its gather"
    assert muon and len(muon) < len(oracle), "Muon steps the matrices, Adam the rest"
    for rank, got in enumerate(results):
        assert got["ok"]
        assert got["grads"]["total"] == pytest.approx(got["grad_norm"], rel=REL), rank
        for i, q in enumerate(QUANTITIES):
            per_param = got[q]["per_param"]
            assert set(per_param) == set(oracle), (rank, q)
            total = math.sqrt(math.fsum(v[i] for v in oracle.values()))
            assert total > 0, q
            if q == "updates":
                ulp = math.sqrt(math.fsum(v[6] for n, v in oracle.items() if n not in muon))
                assert abs(got[q]["total"] - total) <= ulp + REL * total, (rank, got[q], total)
                for pname, v in oracle.items():
                    want = math.sqrt(v[2])
                    slack = ROUNDING * want + (0.0 if pname in muon else math.sqrt(v[6]))
                    assert abs(per_param[pname] - want) <= slack + 1e-12, (rank, pname)
                continue
            assert got[q]["total"] == pytest.approx(total, rel=REL), (rank, q)
            for pname, v in oracle.items():
                want = math.sqrt(v[i])
                assert per_param[pname] == pytest.approx(want, rel=REL, abs=1e-12), (rank, q, pname)
            if q == "momentum":
                assert all(per_param[n] == 0.0 for n in oracle if n not in muon)


def _plain_muon(cls: type) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 8, bias=False)
    )
    return model, cls(model.parameters(), lr=0.02, weight_decay=0.1, nesterov=True)


def test_emerging_optimizers_muon_alone() -> None:
    """emerging-optimizers' own ``Muon`` as a plain torch optimizer (one process): the updates
    against snapshots, the momentum against its state, a param without a grad not stepped."""
    from emerging_optimizers.orthogonalized_optimizers import Muon

    model, inner = _plain_muon(Muon)
    optimizer = NormAwareOptimizer(inner, model=model)
    for step in range(2):
        optimizer.zero_grad()
        layers = model if step == 0 else model[1:]  # the second step: no grad for layer 0
        layers(torch.randn(4, 16 if step == 0 else 32)).square().sum().backward()
        if step == 1:
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.measure_next_step(per_param=True)
        optimizer.step()
    s = optimizer.step_norms()
    moved = [
        float((p.detach().double() - b.double()).norm()) for p, b in zip(model.parameters(), before)
    ]
    momentum = [
        float(inner.state[p]["momentum_buffer"].double().norm()) for p in model.parameters()
    ]
    assert moved[0] == 0.0 and float(s.updates.per_param["0.weight"]) == 0.0
    assert float(s.updates.per_param["1.weight"]) == pytest.approx(moved[1], rel=ROUNDING)
    assert float(s.momentum.per_param["0.weight"]) == pytest.approx(momentum[0], rel=REL)  # type: ignore[union-attr]
    assert float(s.momentum.per_param["1.weight"]) == pytest.approx(momentum[1], rel=REL)  # type: ignore[union-attr]
    assert s.exp_avg is None and s.exp_avg_sq is None
    assert not set(vars(inner)) & {"_apply_weight_decay_inplace", "post_weight_update_fn_inplace"}


def test_a_muon_with_its_own_step_is_refused_by_name() -> None:
    from emerging_optimizers.orthogonalized_optimizers import Muon

    from norm_optim import UnsupportedOptimizerError

    class MyMuon(Muon):
        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    MyMuon.__module__ = Muon.__module__
    MyMuon.__qualname__ = MyMuon.__name__ = "Muon"  # even named as the one read
    model, inner = _plain_muon(MyMuon)
    optimizer = NormAwareOptimizer(inner, model=model)
    with pytest.raises(UnsupportedOptimizerError, match="is not one norm_optim has read"):
        optimizer.measure_next_step()


def _training(case: Case, armed: bool) -> dict:
    chunks, inner = _build(case)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    returns = train_armed(chunks, optimizer, armed)
    leaves = [leaf.optimizer for leaf in _leaves(inner) if getattr(leaf, "optimizer", None)]
    return {
        "returns": returns,
        "params": [p.detach().clone() for c in chunks for p in c.parameters()],
        "state": [
            t.clone()
            for o in leaves
            for s in o.state.values()
            for t in s.values()
            if torch.is_tensor(t)
        ],
        "own": [sorted(vars(o)) for o in leaves],
    }


@pytest.mark.parametrize("name", ["muon-dp2-shard-aligned", "muon-dp2-layer-wise"])
def test_arming_changes_no_training_bit(name: str) -> None:
    case = CASES[name]
    plain = run_ranks(_training, case.world, case, False)
    armed = run_ranks(_training, case.world, case, True)
    assert_training_unchanged(plain, armed, "the in-step hooks left attributes behind")
