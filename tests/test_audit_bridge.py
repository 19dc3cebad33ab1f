"""``megatron_bridge.install(audit_interval=N)`` in Megatron-Bridge's real ``pretrain()``
(``make test-bridge``; skipped where Bridge is not installed).

A clean run writes ``params-audit/findings`` = 0 at the first iteration and every interval; an
fp32 main nudged on one Float16 replica (a drift below bf16 resolution, which training keeps)
is logged by rank 0 with its name (logger ``norm_optim.integrations``, ERROR;
``audit_action="warn"``) or stops the run (``audit_action="raise"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from norm_optim.testing.megatron_bridge import bridge_available, import_bridge

if not bridge_available():
    pytest.skip("Megatron-Bridge is not installed (make test-bridge)", allow_module_level=True)

import_bridge()  # once in the parent: forked ranks inherit it

from megatron.bridge.training.callbacks import Callback, CallbackContext  # noqa: E402

from norm_optim.integrations import megatron_bridge  # noqa: E402
from norm_optim.testing import inject_fault_  # noqa: E402
from norm_optim.testing.megatron_bridge import run_pretrain, tiny_config  # noqa: E402

ITERATIONS = 3
PARAM = "decoder.layers.0.self_attention.linear_qkv.weight"


class _Fault(Callback):  # type: ignore[misc]
    """Right after step 2's update (0-based step 1), before its log and audit, on rank 1: one
    fp32 main's lowest bit. (Injected before the update, the drift can be rounded away by it:
    a lowest bit is below the resolution of ``θ − u`` wherever ``|u| > |θ|``.)"""

    def on_train_step_end(self, context: CallbackContext) -> None:
        if context.state.train_state.step == 1:
            inject_fault_(context.optimizer, PARAM, what="main", rank=1)


def _run(tmp_path: Path, action: str, fault: bool) -> Any:
    config = tiny_config(
        world_size=2,
        train_iters=ITERATIONS,
        use_distributed_optimizer=False,
        tensorboard_dir=str(tmp_path / "tb"),
    )
    return run_pretrain(
        config,
        2,
        callbacks=[_Fault()] if fault else [],
        before=lambda: megatron_bridge.install(audit_interval=2, audit_action=action),
    )


def _findings_scalars(logdir: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    tag = "params-audit/findings"
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def test_a_clean_run_writes_zero_findings(tmp_path: Path) -> None:
    results = _run(tmp_path, "warn", fault=False)
    assert _findings_scalars(tmp_path / "tb") == {1: 0.0, 2: 0.0}
    assert not any(r.logged_matching("norm_optim iteration") for r in results)


def test_a_drifted_main_is_logged_by_rank_0_or_stops_the_run(tmp_path: Path) -> None:
    results = _run(tmp_path, "warn", fault=True)
    said = results[0].logged_matching("norm_optim iteration 2: audit: 1 findings")
    assert said, results[0].logged
    assert said[0].startswith("ERROR norm_optim.integrations: ")
    assert f"main-replicas-differ {PARAM!r} on ranks [0, 1]" in said[0]
    assert results[1].logged == []  # rank 0 says it
    assert _findings_scalars(tmp_path / "tb") == {1: 0.0, 2: 1.0}
    with pytest.raises(Exception, match="main-replicas-differ"):
        _run(tmp_path / "raise", "raise", fault=True)


def _parity_run(directory: Path, iterations: int, load: bool, action: str) -> Any:
    config = tiny_config(world_size=2, train_iters=iterations, use_distributed_optimizer=False)
    config.checkpoint.save = str(directory)
    config.checkpoint.save_interval = 2
    if load:
        config.checkpoint.load = str(directory)
        # The resumed run is longer: its LR schedule is its own, not the checkpoint's.
        config.scheduler.override_opt_param_scheduler = True
        config.scheduler.use_checkpoint_opt_param_scheduler = False
        config.checkpoint.load_rng = False  # the inference RNG tracker saves no states
    return run_pretrain(config, 2, before=lambda: _saving_install(action))


def _saving_install(action: str) -> Any:
    """In the rank: the test-only patches a torch_dist save needs there, then install()."""
    from norm_optim._patching import PatchSet
    from norm_optim.testing._internal.loop_patches import torch_dist_save_patches

    PatchSet.apply(torch_dist_save_patches())  # the rank is a fresh process: nothing to undo
    return megatron_bridge.install(resume_proof=True, audit_action=action)


def test_checkpoint_parity_at_load(tmp_path: Path) -> None:
    import json

    _parity_run(tmp_path, 2, load=False, action="warn")
    saved_file = tmp_path / "iter_0000002" / "norm_optim_norms.json"
    saved = json.loads(saved_file.read_text())
    assert saved["iteration"] == 2 and saved["per_layer"]
    results = _parity_run(tmp_path, 4, load=True, action="warn")
    # Bridge's setup_logging sets the root logger to INFO: the match is said at INFO.
    line = results[0].logged_matching("norm_optim: params norm at load (iteration 2)")
    assert line and "every layer equals the saved weights'" in line[0], results[0].logged
    assert line[0].startswith("INFO norm_optim.integrations: ")
    # The resume proof (the same default): every (param, state) as saved.
    proof = results[0].logged_matching("norm_optim resume (iteration 2): 0 mismatches")
    assert proof and proof[0].startswith("INFO "), results[0].logged
    assert (tmp_path / "iter_0000002" / "norm_optim_resume.json").exists()
    # The resumed run saved iteration 4 with its norms; edit them as if saved from another
    # model, and resume from there.
    later_file = tmp_path / "iter_0000004" / "norm_optim_norms.json"
    later = json.loads(later_file.read_text())
    layer = sorted(later["per_layer"])[-1]
    later["per_layer"][layer] *= 1.01
    later_file.write_text(json.dumps(later))
    results = _parity_run(tmp_path, 6, load=True, action="warn")
    differs = results[0].logged_matching(f"in 1 layers: [{layer!r}]")
    assert differs and differs[0].startswith("ERROR "), results[0].logged
