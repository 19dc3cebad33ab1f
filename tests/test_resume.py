"""The resume proof's fingerprints: bitwise, position-sensitive, and the same on every layout.

Real megatron-core optimizers on gloo CPU ranks. Each layout builds the same logical model and
optimizer state: weights and fp32 mains from ``fill_deterministic_`` and the Adam moments from
``fill_optimizer_state_deterministic_`` (both functions of each element's global name and index,
written wherever megatron's own attributes say the layout keeps it), then one step count. The
oracle is independent of the code under test: the same hash written again in numpy
(``tests/support/fingerprint_oracle.py``) over the whole global tensors, regenerated on one
process with no parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import pytest
import torch

from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer, train_step
from norm_optim.testing.oracle import fill_deterministic_, global_param_shapes
from norm_optim.testing.resume import (
    fill_optimizer_state_deterministic_,
    init_optimizer_state_,
    state_name,
)
from norm_optim.testing.values import global_values, named_global_parameters
from tests.support.fingerprint_oracle import fingerprint
from tests.support.layouts import NEEDS_TORCH_FSDP2, SMALL, SMALL_MOE, Layout
from tests.test_megatron_fsdp import BUILDS_FSDP, BUILDS_MOE_FSDP

UNTIED = dataclasses.replace(SMALL, tie_embeddings=False)  # FSDP2 ties no weights

SEED = 3
TIMEOUT = 120.0
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class Case:
    layout: Layout
    distributed: bool = True
    fsdp2: bool = False  # Megatron's torch FSDP2 wrapper (Float16 optimizer over DTensors)
    # get_megatron_optimizer's fields beyond the defaults (SGD's momentum, Muon's layer-wise
    # optimizer), or "precision-aware" / "remainders": megatron's precision-aware distributed
    # optimizer on the stand-in for TE's FusedAdam (bf16 moments; int16 master remainders).
    optimizer: tuple[tuple[str, Any], ...] = ()
    precision_aware: str = ""
    megatron_fsdp: bool = False  # Megatron-FSDP v1 (optim_grads_params)


CASES = {
    "float16-dp2": Case(Layout(2, SMALL), distributed=False),
    "distributed-dp2": Case(Layout(2, SMALL)),
    "distributed-dp4": Case(Layout(4, SMALL)),
    "distributed-tp2-dp2": Case(Layout(4, SMALL, tp=2)),
    "float16-tp2-pp2": Case(Layout(4, SMALL, tp=2, pp=2), distributed=False),
    "distributed-cp2-dp2": Case(Layout(4, SMALL, cp=2)),
    "moe-distributed-dp2": Case(Layout(2, SMALL_MOE)),
    "moe-distributed-ep2-dp2": Case(Layout(4, SMALL_MOE, ep=2)),
    "moe-float16-ep2-tp2": Case(Layout(4, SMALL_MOE, ep=2, tp=2), distributed=False),
    "torch-fsdp2-dp2": Case(Layout(2, UNTIED), distributed=False, fsdp2=True),
    "torch-fsdp2-tp2-dp2": Case(Layout(4, UNTIED, tp=2), distributed=False, fsdp2=True),
    "untied-float16-dp1": Case(Layout(1, UNTIED), distributed=False),
    "sgd-momentum-float16-dp2": Case(
        Layout(2, SMALL), distributed=False, optimizer=(("optimizer", "sgd"), ("sgd_momentum", 0.9))
    ),
    "muon-layer-wise-dp2": Case(
        Layout(2, SMALL, optimizer="muon", layer_wise=True),
        distributed=False,
        optimizer=(("optimizer", "muon"), ("use_layer_wise_distributed_optimizer", True)),
    ),
    # Stand-in for TE's FusedAdam (TE cannot run on a CPU): tests/support/precision_aware_standin.
    "precision-aware-standin-dp2": Case(Layout(2, SMALL), precision_aware="bf16-moments"),
    "precision-aware-standin-remainders-dp2": Case(Layout(2, SMALL), precision_aware="remainders"),
    "megatron-fsdp-dp2": Case(Layout(2, SMALL), megatron_fsdp=True),
    "megatron-fsdp-tp2-dp2": Case(Layout(4, SMALL, tp=2), megatron_fsdp=True),
    "megatron-fsdp-moe-ep2-dp2": Case(Layout(4, SMALL_MOE, ep=2), megatron_fsdp=True),
}


def _filled(case: Case) -> tuple[list, Any]:
    """This rank's model and optimizer, every weight, main and moment at its global value."""
    init_parallel(**case.layout.parallel())
    if case.fsdp2:
        from norm_optim.testing.torch_fsdp2 import build_torch_fsdp2_model

        chunks = build_torch_fsdp2_model(case.layout.cfg, seed=5)
    elif case.megatron_fsdp:
        from norm_optim.testing.megatron_fsdp import build_fsdp_model

        chunks = build_fsdp_model(case.layout.cfg, seed=5)
    else:
        chunks = build_model(case.layout.cfg, use_distributed_optimizer=case.distributed, seed=5)
    if case.precision_aware:
        from tests.support.precision_aware_standin import build_precision_aware_optimizer

        inner = build_precision_aware_optimizer(
            chunks,
            store_param_remainders=case.precision_aware == "remainders",
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
        )
    else:
        inner = build_optimizer(chunks, lr=1e-2, **dict(case.optimizer))
    init_optimizer_state_(inner)  # the state (and a step count of 1) exists
    fill_deterministic_(chunks, SEED, optimizer=inner)
    filled = fill_optimizer_state_deterministic_(chunks, inner, SEED)
    return chunks, inner, filled


def _fingerprint_body(case: Case) -> dict[str, Any]:
    from norm_optim import NormAwareOptimizer

    chunks, inner, filled = _filled(case)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    found = optimizer.state_fingerprint().to_json()
    dtypes = {name: p.dtype for name, p in named_global_parameters(chunks)}
    return {
        "found": found,
        "shapes": global_param_shapes(chunks),
        "dtypes": dtypes,
        "filled": filled,
    }


def _oracle(
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    filled: dict[tuple[str, str], torch.dtype],
) -> dict:
    """(name, state) -> (fingerprint, numel, norm) over the global tensors: the weight in the
    model's dtype, its fp32 main, and each state tensor the optimizer keeps, in its dtype."""
    out = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        weight = global_values(name, SEED, numel)
        tensors = {"param": (weight, dtypes[name]), "main_param": (weight, torch.float32)}
        for (param, key), dtype in filled.items():
            if param == name:
                values = global_values(state_name(name, key), SEED, numel)
                tensors[key] = (values.abs() if key == "exp_avg_sq" else values, dtype)
        for state, (values, dtype) in tensors.items():
            rounded = values.to(dtype).double()
            out[(name, state)] = (fingerprint(values, dtype), numel, float(rounded.norm()))
    return out


def _marks(case: Case) -> list:
    marks = case.layout.marks() + ([NEEDS_TORCH_FSDP2] if case.fsdp2 else [])
    if case.megatron_fsdp:  # what each release's Megatron-FSDP can build on CPU
        marks += [BUILDS_FSDP] + ([BUILDS_MOE_FSDP] if case.layout.cfg.num_experts else [])
    return marks


@functools.lru_cache(maxsize=None)
def _run(name: str) -> tuple[dict[str, Any], ...]:
    """Every rank's fingerprint of case ``name`` (each case runs once per session)."""
    case = CASES[name]
    return tuple(run_ranks(_fingerprint_body, case.layout.world, case, timeout=TIMEOUT))


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(c)) for n, c in CASES.items()])
def test_fingerprint_equals_the_oracle_on_every_layout(name: str) -> None:
    results = _run(name)
    first = results[0]
    assert all(r["found"] == first["found"] for r in results), "ranks disagree"
    dtypes = {n: d for r in results for n, d in r["dtypes"].items()}  # every stage's
    filled = {k: d for r in results for k, d in r["filled"].items()}
    assert filled, "no optimizer state"
    oracle = _oracle(first["shapes"], dtypes, filled)
    params = first["found"]["params"]
    found = {
        (param, state): (int(h, 16), n, norm)
        for param, states in params.items()
        for state, (h, n, _dtype, norm) in states.items()
    }
    assert set(found) == set(oracle), "not every (param, state) exactly once"
    for key, (h, numel, norm) in oracle.items():
        assert found[key][:2] == (h, numel), key
        assert found[key][2] == pytest.approx(norm, rel=1e-9), key
    # SGD keeps no step count; every other optimizer here stepped once.
    assert first["found"]["scalars"]["step"] == (None if "sgd" in name else 1.0)
    assert first["found"]["scalars"]["loss_scale"] == 1.0


def _found(*names: str) -> list[dict]:
    return [_run(n)[0]["found"] for n in names]


@pytest.mark.parametrize(
    "names",
    [
        pytest.param(("distributed-tp2-dp2", "distributed-dp4", "float16-dp2"), id="dense"),
        pytest.param(
            ("moe-distributed-ep2-dp2", "moe-distributed-dp2", "moe-float16-ep2-tp2"), id="moe-ep"
        ),
        pytest.param(
            ("megatron-fsdp-tp2-dp2", "megatron-fsdp-dp2", "distributed-dp4"),
            id="megatron-fsdp",
            marks=BUILDS_FSDP,
        ),
        pytest.param(
            ("torch-fsdp2-tp2-dp2", "torch-fsdp2-dp2", "untied-float16-dp1"),
            id="torch-fsdp2",
            marks=NEEDS_TORCH_FSDP2,
        ),
    ],
)
def test_same_state_same_fingerprint_across_layouts(names: tuple[str, ...]) -> None:
    """A reshard's promise: one state, held on three layouts, one fingerprint."""
    found = _found(*names)
    assert found[0] == found[1] == found[2]


def _tamper_body(case: Case) -> dict[str, Any]:
    """Fingerprint, tamper with one element pair or shard on one rank, fingerprint again."""
    import torch.distributed as dist

    from norm_optim import NormAwareOptimizer, verify_resume
    from norm_optim.testing.resume import held_mains

    chunks, inner, _ = _filled(case)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    names = {id(p): n for n, p in named_global_parameters(chunks)}
    saved = optimizer.state_fingerprint()
    # The largest main this rank holds (rank 1): swap two different elements of its exp_avg.
    held = sorted(held_mains(inner), key=lambda h: h[1].numel())
    param, main, _, torch_optimizer = held[-1]
    target = names[id(param)]
    reports = {}
    with torch.no_grad():
        exp_avg = torch_optimizer.state[main]["exp_avg"].view(-1)
        i, j = 0, int((exp_avg != exp_avg[0]).nonzero()[0])
        if dist.get_rank() == 1:
            exp_avg[i], exp_avg[j] = exp_avg[j].clone(), exp_avg[i].clone()
        reports["swap"] = verify_resume(saved, optimizer.state_fingerprint(), 7)
        if dist.get_rank() == 1:  # undo, then shift the main's shard by one element
            exp_avg[i], exp_avg[j] = exp_avg[j].clone(), exp_avg[i].clone()
            main.view(-1).copy_(main.view(-1).roll(1))
        reports["shift"] = verify_resume(saved, optimizer.state_fingerprint(), 7)
        for _, m, _, opt in held_mains(inner):  # every moment reset, on every rank
            for key in MOMENTS:
                opt.state[m][key].zero_()
        reports["reset"] = verify_resume(saved, optimizer.state_fingerprint(), 7)
    return {
        "target": target if dist.get_rank() == 1 else None,
        "params": len(saved.entries) // 4,
        "reports": {
            k: (r.count, [str(m) for m in r.shown], r.causes, r.line()) for k, r in reports.items()
        },
    }


def test_a_swap_a_shift_and_a_reset_are_named() -> None:
    case = CASES["distributed-dp2"]
    results = run_ranks(_tamper_body, 2, case, timeout=TIMEOUT)
    target = results[1]["target"]
    reports = results[0]["reports"]
    assert all(r["reports"] == reports for r in results), "ranks disagree"
    count, shown, _, line = reports["swap"]
    assert count == 1 and shown[0].startswith(f"{target}[exp_avg]"), line
    assert line.startswith("norm_optim resume (iteration 7): 1 mismatches")
    count, shown, causes, line = reports["shift"]
    assert count == 1 and shown[0].startswith(f"{target}[main_param]"), line
    assert any("weights are as saved" in c for c in causes), line
    count, shown, causes, line = reports["reset"]
    assert count == 2 * results[0]["params"] + 1, line  # and the main still shifted
    assert any("reset to zero" in c for c in causes), line


def _restart_body(restore: bool, directory: str) -> list[tuple[int, str, Any, Any]]:
    """Train 12 watched steps, save the watch's state through a file, then a new wrapper and
    watch over the same model and optimizer (the state a checkpoint load restores exactly):
    a spike 5 steps after the restart, with or without the saved statistics."""
    import os

    from norm_optim import NormAwareOptimizer
    from tests.test_watch import CONFIG, SEED as WATCH_SEED, SPIKED, Spiker

    init_parallel()
    chunks = build_model(SMALL, use_distributed_optimizer=True, seed=WATCH_SEED)
    inner = build_optimizer(chunks, lr=1e-2, weight_decay=0.1)
    before = NormAwareOptimizer(inner, model=chunks)
    watch = before.watch(**CONFIG)
    for step in range(1, 13):
        train_step(chunks, before, seed=step)
        assert watch.poll(step) == ()
    path = os.path.join(directory, "watch.pt")
    torch.save(watch.state_dict(), path)

    after = NormAwareOptimizer(inner, model=chunks)  # the restarted run's wrapper
    resumed = after.watch(**CONFIG)
    if restore:
        resumed.load_state_dict(torch.load(path))
    spiker = Spiker(after, chunks, SPIKED)
    spiker.spike_at = {5}
    alarms = []
    for step in range(13, 18):
        train_step(chunks, spiker, seed=step)
        alarms += [(a.iteration, a.signal, a.layer, a.param) for a in resumed.poll(step)]
    return alarms


@pytest.mark.parametrize("restore", [True, False], ids=["restored", "fresh"])
def test_the_watch_judges_the_first_steps_after_a_restart(tmp_path: Any, restore: bool) -> None:
    alarms = run_ranks(_restart_body, 1, restore, str(tmp_path), timeout=TIMEOUT)[0]
    if restore:
        assert [(a[0], a[3]) for a in alarms] == [(17, "decoder.layers.1.mlp.linear_fc1.weight")]
        assert alarms[0][2] == "1"
    else:  # a fresh watch is still warming up (8 steps): the spike goes unjudged
        assert alarms == []


def _failing_body(case: Case) -> str:
    """A fingerprint that fails on rank 1 only (a bug, an odd tensor): every rank must still
    enter the reduce, then raise alike."""
    import torch.distributed as dist

    import norm_optim._resume.fingerprint as resume
    from norm_optim import NormAwareOptimizer, UnsupportedOptimizerError

    chunks, inner, _ = _filled(case)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    if dist.get_rank() == 1:

        def broken(*args: Any) -> Any:
            raise RuntimeError("an odd tensor")

        resume.hash_and_squares = broken
    with pytest.raises(UnsupportedOptimizerError) as raised:
        optimizer.state_fingerprint()
    return str(raised.value)


def test_a_failure_on_one_rank_is_an_error_on_every_rank_not_a_hang() -> None:
    said = run_ranks(_failing_body, 2, CASES["distributed-dp2"], timeout=TIMEOUT)
    assert "another rank" in said[0]
    assert "RuntimeError: an odd tensor" in said[1]
