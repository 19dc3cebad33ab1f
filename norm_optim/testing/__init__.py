"""Test support for norm_optim users: run the real megatron-core on CPU gloo ranks.

Every public module (each name below them is public; the package re-exports the common ones):

- :mod:`~norm_optim.testing.launcher` — :func:`run_ranks` (a function on N gloo ranks, fresh
  processes, failures and hangs reported) and :func:`init_parallel`.
- :mod:`~norm_optim.testing.cpu` — the test-only CPU shim for megatron-core's CUDA code paths
  (:func:`cpu_shim`, :func:`install_cpu_shim`, :func:`init_rng`); ``run_ranks`` installs it in
  each rank.
- :mod:`~norm_optim.testing.comm` — :class:`RecordingCommunicator`, a communication seam that
  records every collective (a mocked parallel state's view of what the norm reduces).
- :mod:`~norm_optim.testing.faults` — :func:`inject_fault_`: one element of one copy (a
  replica, a TP duplicate, a main) changed on one rank, for testing
  :meth:`~norm_optim.NormAwareOptimizer.audit` on your layout.
- :mod:`~norm_optim.testing.models` — tiny GPT / MoE models on any layout, the real optimizer,
  one real training step.
- :mod:`~norm_optim.testing.layers` — :class:`SequenceParallelTorchNorm`, the torch norm that
  lets MoE models with TP run without Transformer Engine.
- :mod:`~norm_optim.testing.values` — layout-independent param names, global shapes, the
  deterministic values and their exact norm (a leaf: the fill modules build on it).
- :mod:`~norm_optim.testing.oracle` — :func:`fill_deterministic_` on every data-parallel mode,
  and the exact norms of :mod:`~norm_optim.testing.values` again.
- :mod:`~norm_optim.testing.resume` — :func:`fill_optimizer_state_deterministic_`: Adam moments
  (any state key) at layout-independent values on every layout, for testing a resume or a
  reshard against the oracle of :func:`~norm_optim.testing.values.global_values`.
- :mod:`~norm_optim.testing.megatron_fsdp` — Megatron-FSDP (v1 and v2) models on CPU ranks,
  deterministic weights written into their buffers.
- :mod:`~norm_optim.testing.torch_fsdp2` — torch FSDP2 models (Megatron's and torch-native
  ``fully_shard``), their DTensors filled.
- :mod:`~norm_optim.testing.mimo` — MIMO models (``MimoModel`` / ``MimoOptimizer``) on CPU ranks.
- :mod:`~norm_optim.testing.logs` — :func:`recorded_log_lines`: what norm_optim logs
  (``norm_optim.*`` loggers) inside a rank, as lines (pytest's ``caplog`` does not reach ranks).
- :mod:`~norm_optim.testing.megatron_lm` — Megatron-LM's real ``pretrain()`` on CPU ranks
  (imported on demand: needs ``megatron.training``, megatron-core >= 0.19).
- :mod:`~norm_optim.testing.megatron_bridge` — Megatron-Bridge's real ``pretrain()`` on CPU
  ranks (imported on demand: needs Megatron-Bridge).

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
from norm_optim.testing.faults import inject_fault_
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
from norm_optim.testing.cpu import (  # the shim's public home
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
    "inject_fault_",
    "install_cpu_shim",
    "named_global_parameters",
    "oracle_norm",
    "oracle_sum_of_squares",
    "run_ranks",
    "train_step",
]
