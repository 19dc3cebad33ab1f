"""Test support for norm_optim users: run the real megatron-core on CPU gloo ranks.

- :mod:`~norm_optim.testing.launcher` — :func:`run_ranks` (a function on N gloo ranks, fresh
  processes, failures and hangs reported) and :func:`init_parallel`.
- :func:`cpu_shim` / :func:`install_cpu_shim` — the test-only CPU shim for megatron-core's CUDA
  code paths (``run_ranks`` installs it in each rank).
- :mod:`~norm_optim.testing.models` — tiny GPT / MoE models on any layout, the real optimizer,
  one real training step.
- :mod:`~norm_optim.testing.oracle` — layout-independent weight values and their exact norm.
- :mod:`~norm_optim.testing.megatron_lm` — Megatron-LM's real ``pretrain()`` on CPU ranks
  (imported on demand: needs ``megatron.training``, megatron-core >= 0.19).
- :mod:`~norm_optim.testing.megatron_fsdp` — Megatron-FSDP models on CPU ranks (test-only
  patches, :func:`~norm_optim.testing.megatron_fsdp.build_fsdp_model`, deterministic weights
  written into its buffers).

The CPU patches these runners apply (and the CI workarounds behind them) are internal:
``norm_optim.testing._internal``, not part of the API.

A multi-rank test::

    def check(seed):
        init_parallel(tp=2, pp=2)
        chunks = build_model(TinyGPTConfig(), use_distributed_optimizer=True)
        optimizer = build_optimizer(chunks)
        train_step(chunks, optimizer)
        fill_deterministic_(chunks, seed, optimizer)
        return my_global_norm(optimizer), oracle_norm(global_param_shapes(chunks), seed)

    def test_norm():
        for norm, expected in run_ranks(check, 8, 17):
            assert norm == pytest.approx(expected, rel=1e-6)
"""

from norm_optim.testing.comm import RecordingCommunicator
from norm_optim.testing.launcher import RankFailedError, RankTimeoutError, init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer, train_step
from norm_optim.testing.oracle import (
    fill_deterministic_,
    global_param_shapes,
    named_global_parameters,
    oracle_norm,
    oracle_sum_of_squares,
)
from norm_optim.testing.layers import SequenceParallelTorchNorm
from norm_optim.testing._internal.shim import (
    CpuShim,
    cpu_shim,
    init_rng,
    install_cpu_shim,
)

__all__ = [
    "CpuShim",
    "RankFailedError",
    "RankTimeoutError",
    "RecordingCommunicator",
    "SequenceParallelTorchNorm",
    "TinyGPTConfig",
    "build_model",
    "build_optimizer",
    "cpu_shim",
    "fill_deterministic_",
    "global_param_shapes",
    "init_parallel",
    "init_rng",
    "install_cpu_shim",
    "named_global_parameters",
    "oracle_norm",
    "oracle_sum_of_squares",
    "run_ranks",
    "train_step",
]
