"""The wrapper is transparent: training with and without it is bitwise identical, and it behaves
as the optimizer it wraps (``isinstance``, attributes, ``param_groups``) without leaking its own
state onto it.

Training runs: real megatron-core on gloo CPU ranks (``run_ranks``), tiny models. The wrapper's
surface: one process (``mocked_state``).
"""

from __future__ import annotations


import pytest
import torch
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

from norm_optim import NormAwareOptimizer
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer, train_step
from tests.support.layouts import DENSE, MOE, Layout
from tests.support.mocked_state import TinyMoE, float16_optimizer, single_process

SEED = 5

LAYOUTS = {
    "dense-tp2-pp2": Layout(4, DENSE, tp=2, pp=2),
    "moe-ep2-dp2": Layout(4, MOE, ep=2),
}


def _training_run(layout: Layout, dist_opt: bool, wrapped: bool) -> dict:
    init_parallel(**layout.parallel())
    losses: list[torch.Tensor] = []
    chunks = build_model(layout.cfg, use_distributed_optimizer=dist_opt, seed=SEED)
    inner = build_optimizer(chunks, lr=1e-2)
    optimizer = NormAwareOptimizer(inner, model=chunks) if wrapped else inner
    grad_norms, norms = [], []
    for step in range(3):
        ok, grad_norm, _ = train_step(chunks, optimizer, seed=step, losses=losses)
        assert ok
        grad_norms.append(grad_norm)
        if wrapped:
            norms.append(float(optimizer.param_l2_norm()))
            optimizer.param_l2_norms(per_param=True)  # the per-param form too (gathers names once)
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "params": [p.detach().clone() for c in chunks for p in c.parameters()],
        "mains": [t.detach().clone() for g in inner.param_groups for t in g["params"]],
        "norms": norms,
    }


@pytest.mark.parametrize("dist_opt", [True, False], ids=["distopt", "fp16opt"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_training_is_bitwise_identical_with_the_wrapper(name: str, dist_opt: bool) -> None:
    layout = LAYOUTS[name]
    plain = run_ranks(_training_run, layout.world, layout, dist_opt, False)
    wrapped = run_ranks(_training_run, layout.world, layout, dist_opt, True)
    for rank, (a, b) in enumerate(zip(plain, wrapped)):
        assert a["grad_norms"] == b["grad_norms"], f"rank {rank}: grad norms differ"
        assert len(a["losses"]) == len(b["losses"])
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])), f"rank {rank}"
        assert len(a["params"]) == len(b["params"]) and len(a["mains"]) == len(b["mains"])
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), f"rank {rank}"
        assert all(torch.equal(x, y) for x, y in zip(a["mains"], b["mains"])), f"rank {rank}"
        assert b["norms"] == wrapped[0]["norms"] and len(set(b["norms"])) == 3
    assert any(r["losses"] for r in plain), "the last stage recorded its losses"


@single_process
def test_wrapper_is_transparent() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    optimizer = NormAwareOptimizer(inner, model=model)
    assert isinstance(optimizer, Float16OptimizerWithFloat16Params)
    assert type(optimizer) is NormAwareOptimizer
    assert optimizer.param_groups is inner.param_groups and optimizer.config is inner.config
    optimizer.custom_flag = 7
    assert inner.custom_flag == 7
    # The wrapper's own state never lands on the wrapped optimizer, whatever its names.
    assert set(vars(optimizer)) == {"_state"}
    assert not any(name.startswith("_state") for name in vars(inner))
    registry, norm = optimizer.registry, float(optimizer.param_l2_norm())
    optimizer.reducer = "written through"  # a name the wrapper's state also uses
    assert inner.reducer == "written through"
    # ... and the wrapper's own reducer and registry are untouched.
    assert optimizer.registry is registry and float(optimizer.param_l2_norm()) == norm
    assert optimizer.wrapped_optimizer is inner
    with pytest.raises(TypeError, match="already a NormAwareOptimizer"):
        NormAwareOptimizer(optimizer)


@single_process
def test_wrapper_refuses_pickle_and_copy() -> None:
    """``__class__`` is the wrapped class (for isinstance): pickle and copy would rebuild the
    wrong object, so they are refused with the way out."""
    import copy
    import pickle

    model = TinyMoE()
    optimizer = NormAwareOptimizer(float16_optimizer(model), model=model)
    for clone in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="state_dict"):
            clone(optimizer)
