"""The norm follows megatron distributed checkpoints (``dist_checkpointing``).

Real megatron-core 0.16.1 ``dist_checkpointing.save`` / ``load`` (``torch_dist`` backend, the
default) on gloo CPU ranks, distributed optimizer, tiny models on DP2, TP2xDP2 and EP2xDP2
(MoE). Each test: fill the model (and the fp32 mains) with seed A, save, fill with seed B, wrap
the optimizer and read the norm (oracle B), load the checkpoint, read again (oracle A) on every
rank. Values are exact in bf16, so the fp32 mains equal the bf16 values after fill or reload.

(a) model only: ``GPTModel.sharded_state_dict()`` saved and loaded into the model, then
    ``optimizer.reload_model_params()`` (load weights, re-init mains). A model-only load does not
    touch the mains, so until the reload the norm still reads B.
(b) model + optimizer: ``optimizer.sharded_state_dict(model_sd, metadata=
    {"distrib_optim_sharding_type": "dp_reshardable"})`` (what Megatron-LM uses by default), then
    ``optimizer.load_state_dict``. ``dp_reshardable`` hands the mains themselves to the loader, so
    ``dist_checkpointing.load`` already overwrites them in place, behind the wrapper's back.

What does not run on CPU with megatron-core 0.16.1, and why (``test_unsupported_*`` pins it):

- ``torch_dist`` save in a ``run_ranks`` rank needs two test-only changes
  (``norm_optim.testing._internal.loop_patches.torch_dist_save_patches``):
  1. The rank must not be daemonic: ``FileSystemWriterAsync`` starts a ``spawn`` Manager for its
     results queue and forks one writer process per file, and a daemonic process
     (``run_ranks`` starts ranks with ``daemon=True``) raises ``AssertionError: daemonic
     processes are not allowed to have children``. We clear the flag in the rank, and give the
     writer a ``fork`` queue with a synchronous ``put`` instead of the Manager: the spawned
     Manager server outlives a rank that ``run_ranks`` kills (timeout, or another rank failed;
     seen left running), and costs ~3 s per save.
  2. The hang (``torch_dist`` save stuck for the whole timeout): without ``psutil``
     (not installed here), each forked writer raises ``RuntimeError: psutil is not installed``
     from ``_process_memory()`` in ``FileSystemWriterAsync.write_preloaded_data``, which is
     called *outside* its ``try``, so the writer dies before ``count_queue.task_done()``; the
     rank that writes blocks forever in ``count_queue.join()`` in
     ``write_preloaded_data_multiproc`` and the others in the ``barrier`` of
     ``AsyncRequest.execute_sync``. Not CPU- or gloo-specific: any megatron save without psutil
     hangs. We stub ``_process_memory`` when psutil is missing.
- ``fully_sharded_model_space`` (the 0.16.1 default of ``DistributedOptimizer.sharded_state_dict``
  when no sharding type is given): ``CheckpointingException: ShardedTensor.flattened_range is
  not supported.`` on save (the format is deprecated; ``ShardedTensor`` no longer accepts it).
- ``fully_reshardable``: save works, ``optimizer.load_state_dict`` raises ``KeyError: 'step'`` in
  ``_set_main_param_and_optimizer_states``: without TE/Apex the optimizer is ``torch.optim.Adam``,
  whose per-param ``'step'`` state ``load_parameter_state_from_fully_reshardable`` skips but the
  setter copies. (The distributed optimizer asserts Adam, so no other optimizer avoids it.)
"""

from __future__ import annotations

from typing import Any

import pytest

from norm_optim.testing import RankFailedError, init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer, train_step, unwrap_gpt
from norm_optim.testing._internal.loop_patches import torch_dist_save_patches
from norm_optim.testing.oracle import fill_deterministic_, global_param_shapes, oracle_norm
from norm_optim._versions import megatron_at_least
from norm_optim._patching import PatchSet
from tests.support.layouts import SMALL, SMALL_MOE, Layout

SEED_A, SEED_B = 1, 2
REL = 1e-7  # the CPU kernel's fp32 row accumulation (~2e-8)
TIMEOUT = 60.0
SINCE_0_15 = pytest.mark.skipif(
    not megatron_at_least(0, 15),
    reason="the dp_reshardable / fully_reshardable formats exist since megatron-core 0.15",
)
# Without TE / Apex the distributed optimizer's Adam is torch.optim.Adam, whose 'step' state
# is a scalar tensor.
DP_RESHARDABLE_SAVES = pytest.mark.skipif(
    not megatron_at_least(0, 16),
    reason="megatron-core 0.15's dp_reshardable save asserts that every optimizer state is a "
    "flat shard, which torch Adam's scalar 'step' is not "
    "(sharded_param_state_dp_reshardable)",
)
LAYOUTS = {
    "dp2": Layout(2, SMALL),
    "tp2-dp2": Layout(4, SMALL, tp=2),
    "moe-ep2-dp2": Layout(4, SMALL_MOE, ep=2),
}


def _sharded_state_dict(
    chunks: list, optimizer: Any, sharding: str | None, is_loading: bool
) -> dict:
    """As Megatron-LM's ``generate_state_dict``: the unwrapped GPTModel's sharded state dict,
    and with ``sharding`` the optimizer's, built over it."""
    state = {"model": unwrap_gpt(chunks[0]).sharded_state_dict()}
    if sharding is not None:
        metadata = {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": True}
        state["optimizer"] = optimizer.sharded_state_dict(
            state["model"], is_loading=is_loading, metadata=metadata
        )
    return state


def _save_load_body(directory: str, layout: Layout, sharding: str | None) -> dict:
    from megatron.core import dist_checkpointing

    from norm_optim import NormAwareOptimizer

    # The rank is a fresh process: nothing to undo.
    PatchSet.apply(torch_dist_save_patches())
    init_parallel(**layout.parallel())
    chunks = build_model(layout.cfg, use_distributed_optimizer=True, seed=5)
    inner = build_optimizer(chunks, lr=1e-2)
    train_step(chunks, inner, seed=0)  # Adam state exists, as in any saved run
    fill_deterministic_(chunks, SEED_A, optimizer=inner)
    shapes = global_param_shapes(chunks)
    dist_checkpointing.save(_sharded_state_dict(chunks, inner, sharding, False), directory)

    fill_deterministic_(chunks, SEED_B, optimizer=inner)  # model and mains
    optimizer = NormAwareOptimizer(inner, model=chunks)
    got = {
        "oracle_a": oracle_norm(shapes, SEED_A),
        "oracle_b": oracle_norm(shapes, SEED_B),
        "before": float(optimizer.param_l2_norm()),
    }
    loaded = dist_checkpointing.load(_sharded_state_dict(chunks, inner, sharding, True), directory)
    got["after_dist_load"] = float(optimizer.param_l2_norm())
    unwrap_gpt(chunks[0]).load_state_dict(loaded["model"])
    if sharding is None:
        got["model_loaded"] = float(optimizer.param_l2_norm())
        inner.reload_model_params()
    else:
        inner.load_state_dict(loaded["optimizer"])
    got["loaded"] = float(optimizer.param_l2_norm())
    return got


@pytest.mark.parametrize(
    "sharding",
    [
        pytest.param(None, id="model-only"),
        pytest.param(
            "dp_reshardable", id="dp_reshardable", marks=[SINCE_0_15, DP_RESHARDABLE_SAVES]
        ),
    ],
)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_norm_follows_dist_checkpoint_load(
    tmp_path: Any, layout: str, sharding: str | None
) -> None:
    results = run_ranks(
        _save_load_body,
        LAYOUTS[layout].world,
        str(tmp_path),
        LAYOUTS[layout],
        sharding,
        timeout=TIMEOUT,
    )
    assert (tmp_path / "metadata.json").exists() and any(tmp_path.glob("*.distcp"))
    for rank, got in enumerate(results):
        assert got["oracle_a"] != pytest.approx(got["oracle_b"], rel=1e-4), "seeds too close"
        assert got["before"] == pytest.approx(got["oracle_b"], rel=REL), f"rank {rank}"
        if sharding is None:  # the model-only load leaves the mains at B until the reload
            assert got["after_dist_load"] == pytest.approx(got["oracle_b"], rel=REL)
            assert got["model_loaded"] == pytest.approx(got["oracle_b"], rel=REL)
        else:  # dp_reshardable loads into the mains in place
            assert got["after_dist_load"] == pytest.approx(got["oracle_a"], rel=REL), f"rank {rank}"
        assert got["loaded"] == pytest.approx(got["oracle_a"], rel=REL), f"rank {rank}"
    assert len({r["loaded"] for r in results}) == 1, "ranks disagree"


# megatron-core 0.14 and 0.15 fail earlier: their save validates the flattened shards with
# np.product, which numpy 2 removed.
FLATTENED_RANGE_ERROR = (
    r"CheckpointingException: ShardedTensor\.flattened_range is not supported"
    if megatron_at_least(0, 16)
    else r"module 'numpy' has no attribute 'product'"
)


@pytest.mark.parametrize(
    "sharding,error",
    [
        ("fully_sharded_model_space", FLATTENED_RANGE_ERROR),
        pytest.param("fully_reshardable", r"KeyError: 'step'", marks=SINCE_0_15),
    ],
    ids=["fully_sharded_model_space", "fully_reshardable"],
)
def test_unsupported_optimizer_formats_fail_in_megatron(
    tmp_path: Any, sharding: str, error: str
) -> None:
    """Pins what megatron-core 0.16.1 cannot do here (module docstring); if this starts to pass,
    move the format into ``test_norm_follows_dist_checkpoint_load``."""
    with pytest.raises(RankFailedError, match=error):
        run_ranks(_save_load_body, 2, str(tmp_path), LAYOUTS["dp2"], sharding, timeout=TIMEOUT)
