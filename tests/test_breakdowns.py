"""What one call returns and costs: dense / expert / per-param breakdowns in the single
all-reduce, the asynchronous form, the largest and fastest-growing weights, no host sync.

One process, real megatron-core optimizers (``mocked_state``). The breakdowns on every parallel
layout, and the asynchronous form on real ranks (gloo's asynchronous all-reduce):
``test_layouts.py``.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

from norm_optim import NormAwareOptimizer
from norm_optim.testing import RecordingCommunicator
from tests.support.mocked_state import TinyMoE, float16_optimizer, oracle, single_process

pytestmark = single_process


def test_breakdowns_share_the_single_all_reduce() -> None:
    model = TinyMoE()
    comm = RecordingCommunicator()
    optimizer = NormAwareOptimizer(float16_optimizer(model), model=model, comm=comm)
    norms = optimizer.param_l2_norms(per_param=True)
    comm.calls.clear()
    norms = optimizer.param_l2_norms(per_param=True)
    assert comm.num_all_reduces == 1 and len(comm.calls) == 1
    assert float(norms.dense**2 + norms.expert**2) == pytest.approx(float(norms.total**2))
    assert float(norms.expert) == pytest.approx(
        oracle([model.expert.main_param, model.expert_norm.main_param])
    )
    # The tied copy is not a param of its own: its original carries the name.
    assert set(norms.per_param) == {"column", "norm", "expert", "expert_norm"}
    assert float(norms.per_param["column"]) == pytest.approx(oracle([model.column.main_param]))


def test_async_form_returns_pending_norms() -> None:
    model = TinyMoE()
    optimizer = NormAwareOptimizer(float16_optimizer(model), model=model)
    pending = optimizer.param_l2_norms_async()
    assert float(pending.wait().total) == pytest.approx(float(optimizer.param_l2_norm()))


def test_top_k_reports_largest_and_fastest_growing() -> None:
    model = TinyMoE()
    inner = float16_optimizer(model)
    optimizer = NormAwareOptimizer(inner, model=model)
    before = optimizer.param_l2_norms(per_param=True)
    model.norm.main_param.mul_(10.0)
    model.expert.main_param.mul_(2.0)
    after = optimizer.param_l2_norms(per_param=True)
    expected = sorted(((n, float(v)) for n, v in after.per_param.items()), key=lambda nv: -nv[1])[
        :2
    ]
    assert [n for n, _ in after.largest(2)] == [n for n, _ in expected]
    growing = after.fastest_growing(before, k=2)
    assert [n for n, _ in growing] == ["norm", "expert"]
    assert growing[0][1] == pytest.approx(10.0) and growing[1][1] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="per_param=True"):
        optimizer.param_l2_norms().largest()


def test_no_host_sync_inside_the_call() -> None:
    """No op reads a tensor value back to the host (``aten::_local_scalar_dense``: ``.item()``,
    ``float(t)``, validation of lengths...): on CUDA each would stall the pipeline. The CPU
    profile shows the same ops the CUDA path would run for these tensors' kernels."""
    from torch.profiler import profile

    model = TinyMoE()
    model.norm.requires_grad_(False)  # a frozen bf16 param: the blocked low-precision path too
    trainable = [p for p in model.parameters() if p.requires_grad]
    group = dict(
        params=trainable, wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False
    )
    inner = Float16OptimizerWithFloat16Params(
        torch.optim.Adam([group], lr=1e-3), OptimizerConfig(bf16=True), None, lambda *_: None
    )
    optimizer = NormAwareOptimizer(inner, model=model)
    optimizer.param_l2_norms(per_param=True)  # builds the per-param plan
    with profile() as prof:
        optimizer.param_l2_norm()
        optimizer.param_l2_norms(per_param=True)
        optimizer.param_l2_norms_async().wait()
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_local_scalar_dense" not in ops and "aten::item" not in ops
