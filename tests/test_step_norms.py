"""Step norms on real CPU ranks: grads before clipping, updates, Adam moments, in one collective.

Each case trains the tiny GPT one plain step (so Adam state exists), arms the next step with
``measure_next_step(per_param=True)`` and runs it through a probe that stands between
megatron's schedule and the optimizer: right before ``step()`` it snapshots, itself, every
param's ``main_grad`` (unscaled by the loss scale, before megatron clips anything) and its fp32
main (Megatron's ``main_param`` attribute, or the fp32 param itself); after it, the mains again and
the inner optimizer's state read directly. The per-param oracle is the sum over ranks of those
snapshots, each element counted once by the test's own rule (TP split by megatron's marker,
DP rank 0 for whole replicas, every shard of the distributed optimizer): independent of the
registry. The grads' total is also checked against the grad norm megatron's ``step()`` returns.

torch's Adam / SGD updates are read in the step as the difference it stores, a chunk of the byte
budget at a time: they match the snapshots to the fp32 rounding of that difference (≤ 2^-24 of
each element). FusedAdam's updates, and Adam's where a step hook is registered (the fallback),
are derived from the optimizer's post-step state (no copy of the weights), so they are compared
with the stored difference within the bound the derivation documents: one ulp of each weight,
summed in quadrature (``docs/step-norms.md``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any

import pytest
import torch

from norm_optim import NormAwareOptimizer, UnsupportedOptimizerError
from norm_optim.inspection import TorchCommunicator
from norm_optim._versions import megatron_at_least
from norm_optim.integrations._scalars import step_scalars
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer, train_step
from norm_optim.testing.oracle import named_global_parameters
from tests.support.layouts import DENSE, MTP, NEEDS_TORCH_FSDP2, SMALL, SMALL_MOE, Layout
from tests.support.arming import assert_training_unchanged, train_armed
from tests.support.step_oracle import adam_oracle, reduced_norms, sum_of_squares, update_sums

SEED = 7
REL = 1e-6
UPDATE_ROUNDING = 8 * 2.0**-24  # of the update's norm, per param (the rule's fp32 ops)
QUANTITIES = ("weights", "grads", "updates", "exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Case:
    layout: Layout
    dist_opt: bool
    optimizer: str = "adam"
    clip_grad: float = 1.0
    loss_scale: float | None = None
    inf: bool = False  # an inf grad on every rank: the step is skipped
    momentum: float | None = None  # SGD's (megatron's default: 0.9)
    fused: str | None = None  # "apex" / "te": that FusedAdam's CPU stand-in
    decoupled: bool = True  # FusedAdam's adam_w_mode (megatron's decoupled_weight_decay)
    bias_correction: bool = True  # FusedAdam's param-group flag
    hook: bool = False  # a step pre-hook on each torch optimizer: the update is derived
    group_lrs: bool = False  # each param group its own lr

    @property
    def read_in_step(self) -> bool:
        """Whether the update is read in the step (else derived after it)."""
        return self.fused is None and not self.hook and not self.inf


CASES = {
    "dp2-distopt": Case(Layout(2, SMALL), True),
    "tp2-dp2-fp16opt": Case(Layout(4, SMALL, tp=2), False),
    "tp2-dp2-distopt": Case(Layout(4, SMALL, tp=2), True),
    "moe-ep2-distopt": Case(Layout(4, SMALL_MOE, ep=2), True),
    "moe-ep2-fp16opt": Case(Layout(2, SMALL_MOE, ep=2), False),
    "fp32opt-dp2": Case(Layout(2, dataclasses.replace(SMALL, bf16=False)), False),
    "clipping-dp2-loss-scale": Case(Layout(2, SMALL), True, clip_grad=0.05, loss_scale=4.0),
    "sgd-dp2-fp16opt": Case(Layout(2, SMALL), False, optimizer="sgd"),
    "sgd-no-momentum-dp2": Case(Layout(2, SMALL), False, optimizer="sgd", momentum=0.0),
    "skipped-dp2": Case(Layout(2, SMALL), True, loss_scale=4.0, inf=True),
    "dp4-2instances": Case(Layout(4, SMALL, instances=2), True),
    # The in-step read of Adam's update: a chunk of it spans param groups of different lr; with
    # a step hook registered it falls back to the derivation (and the hook runs once).
    "group-lrs-dp2-distopt": Case(Layout(2, SMALL), True, group_lrs=True),
    "group-lrs-sgd-dp2-fp16opt": Case(Layout(2, SMALL), False, optimizer="sgd", group_lrs=True),
    "hook-dp2-distopt": Case(Layout(2, SMALL), True, hook=True),
    "hook-tp2-dp2-fp16opt": Case(Layout(4, SMALL, tp=2), False, hook=True),
    "tp2-pp2-tied-distopt": Case(Layout(4, SMALL, tp=2, pp=2), True),
    "pp2-vpp2-dp2-fp16opt": Case(Layout(4, DENSE, pp=2, vpp=2), False),
    # apex's / TE's FusedAdam (CPU stand-ins, tests/support/fused_adam_standin.py): adam_w_mode
    # on and off, bias correction on and off, weight decay 0.1, both megatron optimizers.
    "apex-adamw-dp2-distopt": Case(Layout(2, SMALL), True, fused="apex"),
    "apex-l2-nobias-dp2-fp16opt": Case(
        Layout(2, SMALL), False, fused="apex", decoupled=False, bias_correction=False
    ),
    "te-adamw-nobias-tp2-dp2-distopt": Case(
        Layout(4, SMALL, tp=2), True, fused="te", bias_correction=False
    ),
    "te-l2-dp2-fp16opt-loss-scale": Case(
        Layout(2, SMALL), False, fused="te", decoupled=False, clip_grad=0.05, loss_scale=4.0
    ),
    # megatron-core >= 0.19: MTP with mtp_detach_heads, its params clipped as a group of their
    # own ("mtp"); step() returns the main group's grad norm.
    "mtp-detached-dp2-distopt": Case(
        Layout(2, dataclasses.replace(MTP, mtp_detach_heads=True)), True
    ),
    "mtp-detached-dp2-fp16opt": Case(
        Layout(2, dataclasses.replace(MTP, mtp_detach_heads=True)), False
    ),
}


def _build(case: Case) -> tuple[list, Any]:
    init_parallel(**case.layout.parallel())
    instances = case.layout.instances
    chunks = build_model(
        case.layout.cfg,
        use_distributed_optimizer=case.dist_opt,
        seed=SEED,
        **({"num_distributed_optimizer_instances": instances} if instances > 1 else {}),
    )
    extra: dict[str, Any] = dict(clip_grad=case.clip_grad, weight_decay=0.1)
    if case.loss_scale is not None:
        extra["loss_scale"] = case.loss_scale
    if case.momentum is not None:
        extra["sgd_momentum"] = case.momentum
    if case.fused is None:
        inner = build_optimizer(
            chunks, lr=1e-2, bf16=case.layout.cfg.bf16, optimizer=case.optimizer, **extra
        )
        return chunks, inner
    from tests.support.fused_adam_standin import use_fused_adam_standin

    with use_fused_adam_standin(case.fused) as fused:
        if megatron_at_least(0, 15):  # 0.14 has no decoupled_weight_decay: always adam_w_mode
            extra["decoupled_weight_decay"] = case.decoupled
        inner = build_optimizer(chunks, lr=1e-2, bf16=case.layout.cfg.bf16, **extra)
    for leaf in _leaves(inner):
        assert type(leaf.optimizer) is fused, "megatron must step the stand-in"
        assert leaf.optimizer.adam_w_mode == int(case.decoupled)
        for group in leaf.optimizer.param_groups:
            group["bias_correction"] = case.bias_correction
    return chunks, inner


def _leaves(inner: Any) -> list[Any]:
    return list(getattr(inner, "chained_optimizers", [inner]))


def _torch_optimizers(inner: Any) -> list[Any]:
    return [leaf.optimizer for leaf in _leaves(inner) if getattr(leaf, "optimizer", None)]


def _readers(optimizer: NormAwareOptimizer) -> list[Any]:
    """The step plan's readers of torch Adam / SGD updates (per-param plan: the tests arm so)."""
    from norm_optim._megatron.optimizers.update_rule import UpdateReader
    from norm_optim._step.measurement import StepPlan

    plan = optimizer._current_reducer().step_plan(True, StepPlan)
    return [r for r in plan.readers if isinstance(r, UpdateReader)]


def _coords(param: torch.Tensor) -> tuple[int, int]:
    """(TP rank, DP rank) of the group that splits / replicates ``param``: megatron's getters."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "allreduce", True):  # an expert param
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank()
    return ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(
        with_context_parallel=True
    )


class Probe:
    """Stands in for the optimizer in ``train_step``: snapshots around the real ``step()``."""

    def __init__(self, optimizer: Any, inner: Any, chunks: list, inf: bool) -> None:
        self.optimizer, self.inner, self.chunks, self.inf = optimizer, inner, chunks, inf
        self.params = list(named_global_parameters(chunks))
        self.sums: dict[str, list[float]] = {}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def _held(self, param: torch.Tensor) -> tuple[torch.Tensor | None, slice, bool]:
        """This rank's fp32 main of ``param`` (or its shard), where it sits in the flat grad,
        and whether it is a distributed-optimizer shard."""
        distributed = False
        for leaf in _leaves(self.inner):
            shards = getattr(leaf, "model_param_gbuf_map", None)
            distributed |= shards is not None
            if shards is not None and param in shards:
                r = leaf._get_model_param_range_map(param)["param"]
                return getattr(param, "main_param", None), slice(r.start, r.end), True
        if distributed:  # no local shard
            return None, slice(0), True
        main = getattr(param, "main_param", None)
        if main is None and param.dtype == torch.float32:
            main = param  # an fp32 param is its own main (Float16 and FP32 optimizers)
        return main, slice(0, param.numel()), False

    def _counts(self, param: torch.Tensor, sharded: bool) -> bool:
        from megatron.core import parallel_state as ps

        if getattr(param, "shared", False):  # the last stage's copy of a tied embedding
            return False
        tp_rank, dp_rank = _coords(param)
        tp_split = bool(getattr(param, "tensor_model_parallel", False))
        # Several distributed-optimizer instances each hold every shard: global rank 0's counts.
        group = ps.get_intra_distributed_optimizer_instance_group()
        first = 0 in torch.distributed.get_process_group_ranks(group)
        return (tp_split or tp_rank == 0) and (sharded and first or dp_rank == 0)

    def step(self) -> Any:
        scale = float(self.optimizer.get_loss_scale())
        if self.inf:
            self.params[0][1].main_grad.fill_(float("inf"))
        before = {}
        for name, param in self.params:
            main, where, sharded = self._held(param)
            if main is None or not param.requires_grad:
                continue
            grad = param.main_grad.detach().reshape(-1)[where].double() / scale
            before[name] = (main, main.detach().clone(), grad, sharded)
        self.result = self.optimizer.step()
        states = {}
        for leaf in _leaves(self.inner):
            if getattr(leaf, "optimizer", None) is not None:
                states.update({id(k): v for k, v in leaf.optimizer.state.items()})
        for name, param in self.params:
            if name not in before:
                continue
            main, old, grad, sharded = before[name]
            if not self._counts(param, sharded):
                continue
            new = main.detach().double()
            state = states.get(id(main), {})
            ulp = torch.nextafter(main.detach(), torch.tensor(math.inf)) - main.detach()
            values = [
                new.square().sum(),
                grad.square().sum(),
                (new - old.double()).square().sum(),
                state["exp_avg"].double().square().sum() if "exp_avg" in state else 0.0,
                state["exp_avg_sq"].double().square().sum() if "exp_avg_sq" in state else 0.0,
                ulp.double().square().sum(),
            ]
            sums = self.sums.setdefault(name, [0.0] * len(values))
            for i, v in enumerate(values):
                sums[i] += float(v)
        return self.result

    def oracle(self) -> dict[str, list[float]]:
        """The snapshots' sums of squares by name, over all ranks."""
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, self.sums)
        total: dict[str, list[float]] = {}
        for sums in gathered:
            for name, values in sums.items():
                acc = total.setdefault(name, [0.0] * len(values))
                for i, v in enumerate(values):
                    acc[i] += v
        return total


class CountingCommunicator(TorchCommunicator):
    """Counts norm_optim's all-reduces."""

    all_reduces = 0

    def all_reduce_sum(self, tensor: torch.Tensor, group: Any, async_op: bool) -> Any:
        self.all_reduces += 1
        return super().all_reduce_sum(tensor, group, async_op)


def _measured_run(case: Case) -> dict:
    chunks, inner = _build(case)
    comm = CountingCommunicator()
    optimizer = NormAwareOptimizer(inner, model=chunks, comm=comm)
    if case.group_lrs:
        for torch_optimizer in _torch_optimizers(inner):
            for k, group in enumerate(torch_optimizer.param_groups):
                group["lr"] = 1e-2 / (k + 1)
    train_step(chunks, optimizer, seed=0)
    before = float(optimizer.param_l2_norm())
    calls = [0] * len(_torch_optimizers(inner))
    if case.hook:
        for k, torch_optimizer in enumerate(_torch_optimizers(inner)):

            def hook(opt: Any, args: Any, kwargs: Any, k: int = k) -> None:
                calls[k] += 1

            torch_optimizer.register_step_pre_hook(hook)
    optimizer.measure_next_step(per_param=True)
    probe = Probe(optimizer, inner, chunks, case.inf)
    reduces = comm.all_reduces
    ok, grad_norm, _ = train_step(chunks, probe, seed=1)
    s = optimizer.step_norms()
    reduces = comm.all_reduces - reduces
    readers = _readers(optimizer)
    groups_of_chunks = [
        {id(r.entries[i].group) for i in chunk.items}
        for r in readers
        for chunk in r.differences.plan.chunks
    ]
    out: dict[str, Any] = {
        "read_in_step": [r.read_in_step for r in readers],
        "hook_calls": calls,
        "chunk_spans_groups": any(len(g) > 1 for g in groups_of_chunks),
        "steps": sorted(
            {
                float(state["step"])
                for torch_optimizer in _torch_optimizers(inner)
                for state in torch_optimizer.state.values()
                if "step" in state
            }
        ),
        "ok": ok,
        "all_reduces": reduces,
        "grad_norm": grad_norm,
        "skipped": s.skipped,
        "weights_before": before,
        "oracle": probe.oracle(),
        "has_moments": s.exp_avg is not None,
        "ratio": {k: float(v) for k, v in (s.update_to_weight or {}).items()},
        "clip_groups": {k: float(v) for k, v in s.clip_groups.items()},
        # What the loops (megatron_lm / megatron_bridge install(step_norms=True)) write.
        "scalars": step_scalars(s, per_param=False),
        "megatron_groups": {
            k: float(v) for k, v in (getattr(inner, "grad_norms_by_group", None) or {}).items()
        },
        "tagged": sorted(
            name
            for name, p in named_global_parameters(chunks)
            if getattr(p, "grad_norm_group", None) is not None
        ),
    }
    out.update(_quantities(s))
    return out


def _quantities(s: Any) -> dict[str, dict]:
    """The quantities of a ``StepNorms`` as plain floats (those it has), by name."""
    out = {}
    for q in QUANTITIES:
        norms = getattr(s, q)
        if norms is None:
            continue
        out[q] = {
            "total": float(norms.total),
            "dense": float(norms.dense),
            "expert": float(norms.expert),
            "per_param": {k: float(v) for k, v in norms.per_param.items()},
            "per_layer": {k: float(v) for k, v in norms.per_layer.items()},
        }
    return out


def _check_updates(got: dict, oracle: dict[str, list[float]], read_in_step: bool) -> None:
    """``got`` (the updates of :func:`_quantities`) against the snapshots' differences."""
    total = math.sqrt(sum(v[2] for v in oracle.values()))
    if read_in_step:
        # Read in the step: the stored difference itself, to the fp32 rounding of the
        # subtraction (2^-24 of each element) and of the row sums.
        assert got["total"] == pytest.approx(total, rel=REL, abs=1e-12)
        for pname, v in oracle.items():
            own = UPDATE_ROUNDING * math.sqrt(v[2])
            assert abs(got["per_param"][pname] - math.sqrt(v[2])) <= own + 1e-12, pname
        return
    # The derived update vs the stored difference: within one ulp of each weight.
    bound = math.sqrt(sum(v[5] for v in oracle.values()))
    assert abs(got["total"] - total) <= bound + REL * total
    # Per param also the fp32 rounding of the rule's few ops on the update itself (in the
    # step and in the derivation): a few 2^-24 of it (docs/step-norms.md).
    for pname, v in oracle.items():
        own = UPDATE_ROUNDING * math.sqrt(v[2])
        assert abs(got["per_param"][pname] - math.sqrt(v[2])) <= math.sqrt(v[5]) + own + 1e-12


@pytest.mark.parametrize("name", list(CASES))
def test_step_norms_against_the_snapshots(name: str) -> None:
    case = CASES[name]
    if case.fused is not None and not case.decoupled and not megatron_at_least(0, 15):
        pytest.skip(
            "megatron-core 0.14 has no decoupled_weight_decay: its FusedAdam is always AdamW"
        )
    if case.layout.cfg.mtp_detach_heads and not megatron_at_least(0, 19):
        pytest.skip("mtp_detach_heads (separately clipped MTP params) is megatron-core >= 0.19")
    results = run_ranks(_measured_run, case.layout.world, case)
    oracle = results[0]["oracle"]
    assert case.fused is not None or any(r["read_in_step"] for r in results)
    if case.group_lrs:
        assert any(r["chunk_spans_groups"] for r in results), "a chunk must span param groups"
    for rank, got in enumerate(results):
        assert got["oracle"] == oracle
        assert got["skipped"] is case.inf and got["ok"] is not case.inf
        assert got["all_reduces"] == 1, "one all-reduce for every quantity of the step"
        assert got["has_moments"] is (case.optimizer == "adam")
        if case.fused is None:  # (a rank that counts nothing reads nothing)
            assert set(got["read_in_step"]) <= {case.read_in_step}, got["read_in_step"]
        if case.optimizer == "adam" and case.fused is None:
            # One plain step, then the armed one (skipped: not stepped): each param stepped once.
            assert got["steps"] == [1.0 if case.inf else 2.0], got["steps"]
        if case.hook:
            assert all(n == 1 for n in got["hook_calls"]) and got["hook_calls"], got["hook_calls"]
        for q in QUANTITIES:
            if case.optimizer != "adam" and q.startswith("exp_avg"):
                assert q not in got
                continue
            i = QUANTITIES.index(q)
            per_param = got[q]["per_param"]
            assert set(per_param) == set(oracle), f"rank {rank} {q}: names differ"
            total = math.sqrt(sum(v[i] for v in oracle.values()))
            if q == "grads" and case.inf:
                assert not math.isfinite(got[q]["total"])
                continue
            if q == "updates":
                _check_updates(got[q], oracle, case.read_in_step)
                if case.inf:
                    assert got[q]["total"] == 0.0 and total == 0.0
                continue
            assert got[q]["total"] == pytest.approx(total, rel=REL, abs=1e-12), (rank, q)
            for pname, v in oracle.items():
                assert per_param[pname] == pytest.approx(math.sqrt(v[i]), rel=REL, abs=1e-12), (
                    rank,
                    q,
                    pname,
                )
            squares = got[q]["dense"] ** 2 + got[q]["expert"] ** 2
            assert squares == pytest.approx(got[q]["total"] ** 2, rel=1e-9)
        if case.inf:
            assert got["weights"]["total"] == pytest.approx(got["weights_before"], rel=1e-12)
        else:
            # Megatron's own grad norm (computed when clip_grad > 0) is the grads' total, or,
            # with separately clipped groups, the main group's; each group's is Megatron's too
            # and the snapshots' over the params tagged with it.
            groups = got["clip_groups"]
            if case.layout.cfg.mtp_detach_heads:
                assert got["tagged"] and set(groups) == {"main", "mtp"}, groups
                mtp = math.sqrt(sum(oracle[n][1] for n in got["tagged"]))
                assert groups["mtp"] == pytest.approx(mtp, rel=REL)
                assert groups["mtp"] == pytest.approx(got["megatron_groups"]["mtp"], rel=REL)
                assert groups["main"] == pytest.approx(got["grad_norm"], rel=REL)
                # megatron.training 0.19 has no flag for mtp_detach_heads: the loops' scalars
                # are checked here, on the same step.
                assert got["scalars"]["grads-norm"] == pytest.approx(got["grad_norm"], rel=REL)
                assert got["scalars"]["grads-norm/mtp"] == groups["mtp"]
                main_squared = got["grads"]["total"] ** 2 - mtp**2
                assert groups["main"] ** 2 == pytest.approx(main_squared, rel=1e-9)
            else:
                assert groups == {}
                assert got["grads"]["total"] == pytest.approx(got["grad_norm"], rel=REL)
            if case.clip_grad < 1.0:
                assert got["grad_norm"] > case.clip_grad, "the case must clip"
            for layer, ratio in got["ratio"].items():
                w, u = got["weights"]["per_layer"][layer], got["updates"]["per_layer"][layer]
                assert ratio == pytest.approx(u / w, rel=1e-12)


# torch optimizers put in place of the one megatron built (its param groups kept, weight decay
# 0.1 and, where megatron's wd_mult is 0, none), with these group flags.
SWAPPED: dict[str, tuple[type, dict[str, Any]]] = {
    "adam-maximize": (torch.optim.Adam, dict(maximize=True, decoupled_weight_decay=False)),
    "adamw-maximize": (torch.optim.AdamW, dict(maximize=True, decoupled_weight_decay=True)),
    "sgd-nesterov": (torch.optim.SGD, dict(momentum=0.9, dampening=0.0, nesterov=True)),
    "sgd-nesterov-maximize": (
        torch.optim.SGD,
        dict(momentum=0.9, dampening=0.0, nesterov=True, maximize=True),
    ),
    # torch's foreach path leaves g + μ·buf in the grads of the groups without weight decay.
    "sgd-nesterov-foreach": (
        torch.optim.SGD,
        dict(momentum=0.9, dampening=0.0, nesterov=True, foreach=True),
    ),
}


def _swapped_run(kind: str, hook: bool) -> list[dict]:
    """Two armed steps from the first one (SGD's first step creates its buffer) of megatron's
    optimizer (distributed for Adam, Float16 for SGD, as megatron builds them) whose inner torch
    optimizer is ``SWAPPED[kind]``; with ``hook``, a step pre-hook on it: derived."""
    from norm_optim._megatron.optimizers.torch_rules import _nesterov_left_in_grads

    cls, flags = SWAPPED[kind]
    adam = issubclass(cls, torch.optim.Adam) or cls is torch.optim.AdamW
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=adam, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2, weight_decay=0.1)
    for leaf in _leaves(inner):
        leaf.optimizer = cls(leaf.optimizer.param_groups)
        for group in leaf.optimizer.param_groups:
            # What megatron's scheduler sets: no decay where wd_mult is 0 (biases, norms).
            group["weight_decay"] *= group.get("wd_mult", 1.0)
            group.update(flags)
        if hook:
            leaf.optimizer.register_step_pre_hook(lambda *args: None)
    groups = [g for o in _torch_optimizers(inner) for g in o.param_groups]
    optimizer = NormAwareOptimizer(inner, model=chunks)
    steps = []
    for step in range(2):
        optimizer.measure_next_step(per_param=True)
        probe = Probe(optimizer, inner, chunks, inf=False)
        train_step(chunks, probe, seed=step)
        steps.append(
            {
                "read_in_step": [r.read_in_step for r in _readers(optimizer)],
                "oracle": probe.oracle(),
                "left_in_grads": [_nesterov_left_in_grads(g) for g in groups if not adam],
                "weight_decays": sorted({float(g["weight_decay"]) for g in groups}),
                **_quantities(optimizer.step_norms()),
            }
        )
    return steps


@pytest.mark.parametrize("hook", [False, True], ids=["read", "derived"])
@pytest.mark.parametrize("kind", list(SWAPPED))
def test_swapped_torch_optimizer_against_the_snapshots(kind: str, hook: bool) -> None:
    """Adam / AdamW with ``maximize``, SGD with Nesterov (and ``maximize``, and torch's foreach
    path), in the real megatron optimizers: read in the step, and derived after it."""
    results = run_ranks(_swapped_run, 2, kind, hook)
    # (Under the Float16 optimizer DP rank 1 counts nothing, so it reads nothing.)
    assert all(any(r[step]["read_in_step"] for r in results) for step in range(2))
    for steps in results:
        for got in steps:
            oracle = got["oracle"]
            assert set(got["read_in_step"]) <= {not hook}, got["read_in_step"]
            assert got["weight_decays"] == [0.0, 0.1], "groups with and without decay"
            if kind == "sgd-nesterov-foreach":
                assert any(got["left_in_grads"]) and not all(got["left_in_grads"])
            else:
                assert not any(got["left_in_grads"])
            _check_updates(got["updates"], oracle, read_in_step=not hook)
            for q in ("grads", "exp_avg", "exp_avg_sq"):
                if q not in got:
                    assert kind.startswith("sgd") and q.startswith("exp_avg")
                    continue
                i = QUANTITIES.index(q)
                assert got[q]["total"] == pytest.approx(
                    math.sqrt(sum(v[i] for v in oracle.values())), rel=REL
                )
                for pname, v in oracle.items():
                    assert got[q]["per_param"][pname] == pytest.approx(
                        math.sqrt(v[i]), rel=REL, abs=1e-12
                    )


def _native_fsdp2(mesh_shape: tuple[int, ...]) -> dict:
    """torch-native ``fully_shard`` with ``torch.optim.AdamW``: the same snapshots, of the
    DTensors' local shards, each counted once by the test's rule (coordinate 0 of every
    ``Replicate`` mesh axis)."""
    from torch.distributed.tensor import Replicate

    from norm_optim.testing.torch_fsdp2 import build_native_fsdp2, native_train_step

    model, inner, _ = build_native_fsdp2(mesh_shape)
    optimizer = NormAwareOptimizer(inner, model=model)
    native_train_step(model, optimizer, 0)  # Adam state exists
    sums: dict[str, list[float]] = {}

    class NativeProbe:
        def zero_grad(self) -> None:
            optimizer.zero_grad()

        def step(self) -> None:
            params = dict(model.named_parameters())
            before = {
                n: (p._local_tensor.clone(), p.grad._local_tensor.clone())
                for n, p in params.items()
            }
            optimizer.step()
            for name, p in params.items():
                coordinate = p.device_mesh.get_coordinate()
                if any(
                    type(pl) is Replicate and coordinate[i] for i, pl in enumerate(p.placements)
                ):
                    continue
                old, grad = before[name]
                new, state = p._local_tensor.double(), inner.state[p]
                ulp = torch.nextafter(p._local_tensor, torch.tensor(math.inf)) - p._local_tensor
                sums[name] = [
                    float(new.square().sum()),
                    float(grad.double().square().sum()),
                    float((new - old.double()).square().sum()),
                    float(state["exp_avg"]._local_tensor.double().square().sum()),
                    float(state["exp_avg_sq"]._local_tensor.double().square().sum()),
                    float(ulp.double().square().sum()),
                ]

    optimizer.measure_next_step(per_param=True)
    native_train_step(model, NativeProbe(), 1)  # type: ignore[arg-type]
    s = optimizer.step_norms()
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, sums)
    oracle = [math.fsum(g[n][i] for g in gathered for n in g) for i in range(6)]
    return {
        "got": [float(getattr(s, q).total) for q in QUANTITIES],
        "oracle": [math.sqrt(v) for v in oracle],
        "skipped": s.skipped,
    }


@NEEDS_TORCH_FSDP2
@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["fsdp2-dp2", "hsdp-2x2"])
def test_torch_native_fsdp2(mesh: tuple[int, ...]) -> None:
    for result in run_ranks(_native_fsdp2, math.prod(mesh), mesh):
        got, oracle = result["got"], result["oracle"]
        assert not result["skipped"]
        for i, q in enumerate(QUANTITIES):
            if q == "updates":
                assert abs(got[i] - oracle[i]) <= oracle[5] + REL * oracle[i], (q, got, oracle)
            else:
                assert got[i] == pytest.approx(oracle[i], rel=REL), q


def _megatron_fsdp2() -> dict:
    """Megatron's ``TorchFullyShardedDataParallel`` (``--use-torch-fsdp2``) with its Float16
    optimizer: the grads' total against megatron's grad norm, the rest against snapshots of the
    inner optimizer's fp32 DTensors (all ``Shard`` placements on DP2: each local shard counts)."""
    from torch.distributed.tensor import Shard

    from norm_optim.testing.torch_fsdp2 import build_torch_fsdp2_model

    init_parallel()
    chunks = build_torch_fsdp2_model(dataclasses.replace(SMALL, tie_embeddings=False), seed=3)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    train_step(chunks, optimizer, seed=0)
    mains = [p for g in inner.param_groups for p in g["params"]]
    assert all(all(type(pl) is Shard for pl in p.placements) for p in mains)
    before = [p._local_tensor.clone() for p in mains]
    optimizer.measure_next_step()
    ok, grad_norm, _ = train_step(chunks, optimizer, seed=1)
    s = optimizer.step_norms()
    local = [p._local_tensor for p in mains]
    moments = inner.chained_optimizers[0].optimizer.state
    exp_avg_sq = (moments[p]["exp_avg_sq"]._local_tensor for p in mains)
    oracle = reduced_norms([sum_of_squares(local), *update_sums(local, before, exp_avg_sq)])
    return {
        "grad_norm": grad_norm,
        "got": [float(s.grads.total), float(s.weights.total), float(s.updates.total)],
        "exp_avg_sq": float(s.exp_avg_sq.total),  # type: ignore[union-attr]
        "oracle": oracle,
    }


@pytest.mark.skipif(
    not megatron_at_least(0, 19),
    reason="TorchFullyShardedDataParallel trains on CPU ranks since megatron-core 0.19 here",
)
@NEEDS_TORCH_FSDP2
def test_megatron_torch_fsdp2() -> None:
    for result in run_ranks(_megatron_fsdp2, 2):
        grads, weights, updates = result["got"]
        w, u, v, ulp = result["oracle"]
        assert grads == pytest.approx(result["grad_norm"], rel=REL)
        assert weights == pytest.approx(w, rel=REL)
        assert result["exp_avg_sq"] == pytest.approx(v, rel=REL)
        assert abs(updates - u) <= ulp + REL * u


def _layer_wise_adam() -> dict:
    """``LayerWiseDistributedOptimizer`` with Adam leaves (as ``get_megatron_muon_optimizer``
    chains them): each param is stepped whole on one DP rank, so the snapshots of every rank's
    leaves, summed over ranks, are the oracle."""
    from tests import test_optimizer_kinds as kinds

    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=False, seed=SEED)
    inner = kinds._layer_wise(chunks)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    train_step(chunks, optimizer, seed=0)
    leaves = [leaf for leaf in _leaves(inner) if getattr(leaf, "optimizer", None) is not None]
    mains = [p for leaf in leaves for g in leaf.optimizer.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in mains]
    optimizer.measure_next_step()
    ok, grad_norm, _ = train_step(chunks, optimizer, seed=1)
    s = optimizer.step_norms()
    states = {id(k): v for leaf in leaves for k, v in leaf.optimizer.state.items()}
    oracle = adam_oracle(mains, mains, before, states)
    return {
        "grad_norm": grad_norm,
        "got": [float(s.grads.total), float(s.updates.total), float(s.exp_avg.total)],  # type: ignore[union-attr]
        "oracle": oracle,
    }


@pytest.mark.skipif(
    not megatron_at_least(0, 16),
    reason="LayerWiseDistributedOptimizer exists since megatron-core 0.16",
)
def test_layer_wise_optimizer_with_adam_leaves() -> None:
    for result in run_ranks(_layer_wise_adam, 2):
        grads, updates, exp_avg = result["got"]
        w, u, m, ulp = result["oracle"]
        assert grads == pytest.approx(result["grad_norm"], rel=REL)
        assert exp_avg == pytest.approx(m, rel=REL)
        assert abs(updates - u) <= ulp + REL * u


def _megatron_fsdp(moe: bool, version: int = 1) -> dict:
    """Megatron-FSDP v1 (``optim_grads_params``) and v2 (``FullyShardedOptimizer``, megatron-core
    main): its optimizer steps DTensors whose local shards view its fp32 buffers; every placement
    is ``Shard`` here (DP2, or EP2 with expert-DP 1), so each rank's local shards, summed over
    ranks, are the oracle."""
    from norm_optim.testing.megatron_fsdp import build_fsdp_model

    init_parallel(ep=2 if moe else 1)
    chunks = build_fsdp_model(SMALL_MOE if moe else SMALL, seed=3, version=version)
    # v2: no clipping, so that the grads are (m_after − β₁·m_before) / (1 − β₁) of Adam's own
    # moments: megatron-core main's v2 grad norm counts each element twice on DP2 (2.296 where
    # that reconstruction gives 1.624, 1/√2 of it), so it is no oracle there.
    clip = dict(clip_grad=0.0) if version == 2 else {}
    inner = build_optimizer(chunks, lr=1e-2, use_distributed_optimizer=version == 1, **clip)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    train_step(chunks, optimizer, seed=0)
    mains = [p for g in inner.param_groups for p in g["params"]]
    assert all(all(type(pl).__name__ in ("Shard", "Flat") for pl in p.placements) for p in mains)
    local = [p._local_tensor for p in mains]
    before = [t.clone() for t in local]
    states = {id(k): v for leaf in _leaves(inner) for k, v in leaf.optimizer.state.items()}
    m_before = {i: v["exp_avg"]._local_tensor.clone() for i, v in states.items()}
    optimizer.measure_next_step()
    ok, grad_norm, _ = train_step(chunks, optimizer, seed=1)
    s = optimizer.step_norms()
    states = {id(k): v for leaf in _leaves(inner) for k, v in leaf.optimizer.state.items()}
    beta1 = _leaves(inner)[0].optimizer.param_groups[0]["betas"][0]
    # A rank whose shard of a param is empty keeps no state for it.
    exp_avg = (states[id(p)]["exp_avg"]._local_tensor for p in mains if id(p) in states)
    moment_grads = (  # the grads Adam's moments took (unclipped: v2)
        (v["exp_avg"]._local_tensor.double() - beta1 * m_before[i].double()) / (1 - beta1)
        for i, v in states.items()
        if i in m_before
    )
    oracle = reduced_norms([*update_sums(local, before, exp_avg), sum_of_squares(moment_grads)])
    return {
        "grad_norm": grad_norm if version == 1 else oracle[3],
        "got": [float(s.grads.total), float(s.updates.total), float(s.exp_avg.total)],  # type: ignore[union-attr]
        "oracle": oracle,
    }


@pytest.mark.parametrize(
    "moe",
    [
        pytest.param(False, id="dense-dp2"),
        pytest.param(
            True,
            id="moe-ep2",
            marks=pytest.mark.skipif(
                megatron_at_least(0, 15) and not megatron_at_least(0, 16),
                reason="Megatron-FSDP of megatron-core 0.15 cannot build a model with experts",
            ),
        ),
    ],
)
@pytest.mark.skipif(
    not megatron_at_least(0, 15),
    reason="Megatron-FSDP of megatron-core 0.14 does not build with this torch",
)
def test_megatron_fsdp(moe: bool) -> None:
    _check_megatron_fsdp(run_ranks(_megatron_fsdp, 2, moe))


def _check_megatron_fsdp(results: list) -> None:
    for result in results:
        grads, updates, exp_avg = result["got"]
        u, m, ulp, _ = result["oracle"]
        assert grads == pytest.approx(result["grad_norm"], rel=REL)
        assert exp_avg == pytest.approx(m, rel=REL)
        assert abs(updates - u) <= ulp + REL * u


@pytest.mark.skipif(
    not megatron_at_least(0, 20), reason="Megatron-FSDP v2 exists on megatron-core main"
)
def test_megatron_fsdp_v2() -> None:
    """v2's FullyShardedOptimizer steps DTensor views of its parameter groups' main-weight
    buffers, with the grads cast to fp32 on them in prepare_grads(): read as v1 is."""
    _check_megatron_fsdp(run_ranks(_megatron_fsdp, 2, False, 2))


def _hybrid_offload() -> dict:
    """``HybridDeviceOptimizer`` (CPU offload of the distributed optimizer's fp32 shards, built
    as test_optimizer_kinds builds it on CPU): its AdamW sub-optimizers step copies of the
    shards and copy them back; the shards' snapshots and its state are the oracle."""
    from tests import test_optimizer_kinds as kinds

    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=True, seed=SEED)
    with kinds._main_params_declared_on_device():
        inner = kinds._hybrid(chunks, precision_aware=False)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    train_step(chunks, optimizer, seed=0)
    hybrid = inner.chained_optimizers[0].optimizer
    assert type(hybrid).__name__ == "HybridDeviceOptimizer"
    mains = [p for g in inner.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in mains]
    optimizer.measure_next_step()
    ok, grad_norm, _ = train_step(chunks, optimizer, seed=1)
    s = optimizer.step_norms()
    exp_avg = (hybrid.state[p]["exp_avg"] for p in mains if p in hybrid.state)
    oracle = reduced_norms(update_sums(mains, before, exp_avg))
    got = [float(s.grads.total), float(s.updates.total), float(s.exp_avg.total)]  # type: ignore[union-attr]
    return {"grad_norm": grad_norm, "got": got, "oracle": oracle}


def test_hybrid_device_optimizer() -> None:
    for result in run_ranks(_hybrid_offload, 2):
        grads, updates, exp_avg = result["got"]
        u, m, ulp = result["oracle"]
        assert grads == pytest.approx(result["grad_norm"], rel=REL)
        assert exp_avg == pytest.approx(m, rel=REL)
        assert abs(updates - u) <= ulp + REL * u


def _training(case: Case, armed: bool) -> dict:
    chunks, inner = _build(case)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    return {
        "returns": train_armed(chunks, optimizer, armed),
        "params": [p.detach().clone() for c in chunks for p in c.parameters()],
        "mains": [t.detach().clone() for g in inner.param_groups for t in g["params"]],
        "own": [sorted(vars(leaf)) for leaf in [inner, *_leaves(inner)]],
    }


@pytest.mark.parametrize("name", ["tp2-dp2-distopt", "moe-ep2-fp16opt"])
def test_arming_changes_no_training_bit(name: str) -> None:
    case = CASES[name]
    plain = run_ranks(_training, case.layout.world, case, False)
    armed = run_ranks(_training, case.layout.world, case, True)
    assert_training_unchanged(plain, armed, "the hooks left attributes behind")


# FusedAdam uses whose step is not read exactly: (stand-in, constructor flags).
FUSED_REFUSED: dict[str, tuple[str, dict[str, Any]]] = {
    # Outside megatron's precision-aware optimizer (where master weights, decoupled grads and
    # bf16 moments are read: test_step_norms_precision_aware.py).
    "te-master-weights": ("te", dict(master_weights=True)),
    "te-exp-avg-bf16": ("te", dict(exp_avg_dtype=torch.bfloat16)),
    "te-exp-avg-sq-fp8": ("te", dict(exp_avg_sq_dtype=torch.uint8)),
    "te-capturable": ("te", dict(capturable=True)),
    "te-decoupled-grad": ("te", dict(use_decoupled_grad=True)),
    "te-new-flag": ("te-new-flag", dict(fused_new_flag=True)),
    "apex-capturable": ("apex", dict(capturable=True)),
    "apex-master-weights": ("apex", dict(capturable=True, master_weights=True)),
}


def _refused(kind: str) -> str:
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=kind != "muon-lion", seed=SEED)
    if kind.startswith("precision-aware-"):
        from tests.support.precision_aware_standin import build_precision_aware_optimizer

        inner = build_precision_aware_optimizer(chunks)
        # TE keeps fp16 moments scaled (a per-tensor factor); capturable advances its step on
        # the device: not read. (The stand-in does not step them; arming is refused first.)
        te = _leaves(inner)[0].optimizer
        if kind == "precision-aware-fp16-moments":
            te.exp_avg_dtype = torch.float16
        else:
            te.capturable = True
    elif kind == "muon-lion":  # Muon reads (test_step_norms_muon.py); Lion for the rest not
        inner = build_optimizer(chunks, optimizer="muon", muon_scalar_optimizer="lion")
    elif kind in FUSED_REFUSED:
        from tests.support import fused_adam_standin as standins

        which, flags = FUSED_REFUSED[kind]
        with standins.use_fused_adam_standin(which if which != "te-new-flag" else "te"):
            inner = build_optimizer(chunks)
        leaf = _leaves(inner)[0]
        cls = standins.TEFusedAdamWithNewFlag if which == "te-new-flag" else standins.standin(which)
        leaf.optimizer = cls(leaf.optimizer.param_groups, **flags)
    else:
        inner = build_optimizer(chunks)
        leaf = _leaves(inner)[0]
        leaf.optimizer = torch.optim.RMSprop(leaf.optimizer.param_groups)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    with pytest.raises(UnsupportedOptimizerError) as error:
        optimizer.measure_next_step()
    return str(error.value)


@pytest.mark.parametrize(
    "kind, words",
    [
        ("precision-aware-fp16-moments", "exp_avg_dtype=torch.float16"),
        ("precision-aware-capturable", "capturable on"),
        pytest.param(
            "muon-lion",
            "Lion",
            marks=pytest.mark.skipif(
                not (megatron_at_least(0, 19) and importlib.util.find_spec("emerging_optimizers")),
                reason="Muon in get_megatron_optimizer needs megatron-core >= 0.19 and "
                "emerging-optimizers",
            ),
        ),
        ("rmsprop", "RMSprop"),
        ("te-master-weights", "'master_weights'"),
        ("te-exp-avg-bf16", "exp_avg_dtype=torch.bfloat16"),
        ("te-exp-avg-sq-fp8", "exp_avg_sq_dtype=torch.uint8"),
        ("te-capturable", "'capturable'"),
        ("te-decoupled-grad", "'use_decoupled_grad'"),
        ("te-new-flag", "'fused_new_flag'"),
        ("apex-capturable", "'capturable'"),
        ("apex-master-weights", "'master_weights'"),
    ],
)
def test_kinds_it_cannot_read_are_refused_by_name(kind: str, words: str) -> None:
    messages = run_ranks(_refused, 1, kind)
    assert all(words in message and "step norms" in message for message in messages), messages


def _mimo() -> dict:
    """A real ``MimoModel`` (encoder on rank 0, language model on rank 1, each its own grid and
    Float16 optimizer): each rank's mains are whole and its own, so their snapshots summed over
    ranks are the oracle; ``clip_grad=0`` leaves the grads as the step read them."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from norm_optim.testing.mimo import MimoLayout, ModuleGrid, build_mimo_model, mimo_modules

    model = build_mimo_model(MimoLayout(2, ModuleGrid(0), ModuleGrid(1)), seed=3)
    config = OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16, clip_grad=0.0
    )
    inner = get_megatron_optimizer(config, [model])
    optimizer = NormAwareOptimizer(inner, model=model)
    active = [i.optimizer for i in inner.module_infos.values() if i.is_active and i.optimizer]
    leaves = [leaf for member in active for leaf in _leaves(member)]
    mains = [p for leaf in leaves for g in leaf.optimizer.param_groups for p in g["params"]]

    def step(seed: int) -> None:
        # Random grads in DDP's grad buffers, then the real MimoOptimizer.step() (as test_mimo).
        generator = torch.Generator().manual_seed(seed)
        for _, module, _ in mimo_modules(model):
            for param in module.parameters():
                if param.requires_grad:
                    param.main_grad.copy_(torch.randn(param.shape, generator=generator))
        assert optimizer.step()[0]

    step(0)
    before = [p.detach().clone() for p in mains]
    optimizer.measure_next_step()
    step(1)
    s = optimizer.step_norms()
    states = {id(k): v for leaf in leaves for k, v in leaf.optimizer.state.items()}
    oracle = adam_oracle((p.grad for p in mains), mains, before, states)
    got = [float(s.grads.total), float(s.updates.total), float(s.exp_avg.total)]  # type: ignore[union-attr]
    return {"got": got, "oracle": oracle}


def test_mimo() -> None:
    from norm_optim.testing.mimo import has_mimo

    if not has_mimo():
        pytest.skip("this megatron-core has no MimoOptimizer (the test kit builds MIMO on 0.19+)")
    for result in run_ranks(_mimo, 2):
        grads, updates, exp_avg = result["got"]
        g, u, m, ulp = result["oracle"]
        assert grads == pytest.approx(g, rel=REL)
        assert exp_avg == pytest.approx(m, rel=REL)
        assert abs(updates - u) <= ulp + REL * u


def _not_measured() -> str:
    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=True, seed=SEED)
    optimizer = NormAwareOptimizer(build_optimizer(chunks), model=chunks)
    train_step(chunks, optimizer)
    try:
        optimizer.step_norms()
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return str(error)
    return "no error"


def test_step_norms_without_an_armed_step_is_an_error() -> None:
    assert "measure_next_step" in run_ranks(_not_measured, 1)[0]


def test_a_param_without_grad_is_not_stepped() -> None:
    """torch skips a param whose grad is None although it has Adam state from earlier steps:
    its update is zero, not one derived from stale moments (one process, plain AdamW)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    optimizer = NormAwareOptimizer(inner, model=model)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    model[1](torch.randn(2, 8)).sum().backward()  # the first layer gets no grad
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.measure_next_step(per_param=True)
    optimizer.step()
    s = optimizer.step_norms()
    moved = [(p.detach() - b).double().square().sum() for p, b in zip(model.parameters(), before)]
    assert float(moved[0]) == 0.0 and float(s.updates.per_param["0.weight"]) == 0.0
    expected = math.sqrt(float(sum(moved)))
    ulp = math.sqrt(
        sum(
            float((torch.nextafter(p, torch.tensor(math.inf)) - p).double().square().sum())
            for p in model.parameters()
        )
    )
    assert abs(float(s.updates.total) - expected) <= ulp
    assert float(s.grads.per_param["0.weight"]) == 0.0 and float(s.grads.total) > 0


@pytest.mark.parametrize("path", ["default", "foreach", "fused"])
def test_sgd_nesterov_is_derived_on_each_torch_path(path: str) -> None:
    """torch's SGD on each of its paths, derived (a step hook registered), three Nesterov
    groups (weight decay, maximize, neither) over three steps, the first creating the buffers.
    The foreach path leaves g + μ·buf in the grads of the group with neither (an in-place add),
    the others leave the grads as they were: checked on the torch that runs the test."""
    flags = {} if path == "default" else {"foreach": path == "foreach", "fused": path == "fused"}
    if path == "fused":  # torch checks the device at the first step
        one = torch.nn.Parameter(torch.zeros(1))
        one.grad = torch.zeros(1)
        try:
            torch.optim.SGD([one], lr=0.1, **flags).step()
        except RuntimeError as error:
            pytest.skip(f"this torch has no fused SGD on CPU: {error}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
    groups = [
        {"params": model[0].parameters(), "weight_decay": 0.1},
        {"params": model[1].parameters(), "maximize": True},
        {"params": model[2].parameters()},
    ]
    inner = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, **flags)
    inner.register_step_pre_hook(lambda *args: None)
    optimizer = NormAwareOptimizer(inner, model=model)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().sum().backward()
        grad = model[2].weight.grad.clone()
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer.measure_next_step(per_param=True)
        optimizer.step()
        s = optimizer.step_norms()
        assert [r.read_in_step for r in _readers(optimizer)] == [False]
        assert torch.equal(model[2].weight.grad, grad) is (path != "foreach")
        for name, p in model.named_parameters():
            moved = math.sqrt(float((p.detach() - before[name]).double().square().sum()))
            ulp = torch.nextafter(p.detach(), torch.tensor(math.inf)) - p.detach()
            bound = math.sqrt(float(ulp.double().square().sum())) + UPDATE_ROUNDING * moved
            assert abs(float(s.updates.per_param[name]) - moved) <= bound + 1e-12, name
