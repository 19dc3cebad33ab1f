"""Megatron-LM's real training loop serves ``--log-params-norm`` from norm_optim.

Each test runs megatron-core's ``megatron.training.pretrain`` (a tiny GPT on mock data, a few
iterations) on gloo CPU ranks with ``norm_optim.integrations.megatron_lm.install()``, and checks
what the loop logs: the ``params norm`` printed in Megatron's log line (3 decimals), and the
value ``training_log`` received, which it prints and writes to TensorBoard (full precision,
captured by a spy on the real ``training_log`` inside the integration's wrapper).

The expected value is the layout-independent oracle: right after ``setup_model_and_optimizer``
every weight is set by ``fill_deterministic_`` (and the fp32 mains reloaded), and ``--lr 0``
keeps the weights there, so the norm at every logged iteration is ``oracle_norm``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import re
from typing import Any

import pytest

from norm_optim._comm import TorchCommunicator
from norm_optim.testing import run_ranks
from tests.support.loop_tags import oracle_tags


def _skip_reason() -> str | None:
    from norm_optim._versions import megatron_core_version_string

    version = megatron_core_version_string()
    try:
        from megatron.training import argument_utils, training
    except ImportError:
        return (
            f"{version} has no megatron.training (Megatron-LM's loop ships in the wheel since 0.17)"
        )

    if next(
        iter(inspect.signature(training.pretrain).parameters)
    ) != "cfg_container" or not hasattr(argument_utils, "gpt_config_from_args"):  # 0.17 / 0.18
        return (
            f"{version}: the pretrain() runner of norm_optim.testing.megatron_lm drives "
            f"the 0.19 API (pretrain(cfg_container, ...), gpt_config_from_args)"
        )
    return None


_REASON = _skip_reason()
# Every test but the one that checks the error without megatron.training.
needs_loop = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

SEED = 7
REL = 1e-6
TIMEOUT = 120.0
_PRINTED = re.compile(r" params norm: ([0-9.]+) \|")


class CountingCommunicator(TorchCommunicator):
    """torch.distributed, counting norm_optim's all-reduces and its other collectives (the
    per-param names exchange), to see when they run."""

    def __init__(self) -> None:
        self.all_reduces = 0
        self.others = 0

    def all_reduce_sum(self, tensor: Any, group: Any, async_op: bool) -> Any:
        self.all_reduces += 1
        return super().all_reduce_sum(tensor, group, async_op)

    def all_gather_tensor(self, tensor: Any, group: Any) -> Any:
        self.others += 1
        return super().all_gather_tensor(tensor, group)

    def broadcast_object(self, obj: Any, src: int, group: Any) -> Any:
        self.others += 1
        return super().broadcast_object(obj, src, group)

    def all_reduce(self, tensor: Any, group: Any, op: Any) -> None:
        self.others += 1
        return super().all_reduce(tensor, group, op)

    def all_gather_object(self, obj: Any, group: Any) -> Any:
        self.others += 1
        return super().all_gather_object(obj, group)


def _run(
    argv_options: dict,
    *,
    install: dict | None,
    fill: bool = True,
    megatron_reference: bool = False,
    fault: str | None = None,
) -> dict:
    """One rank of a ``pretrain`` run; returns what this rank saw.

    Spies (applied before ``install()``, so they sit inside its wrappers): after
    ``setup_model_and_optimizer`` fill the weights deterministically and compute the oracle;
    record the ``params_norm`` the real ``training_log`` receives (and, with
    ``megatron_reference``, Megatron's own ``calc_params_l2_norm`` at that point, every rank).
    With ``fault``, that param's fp32 main is nudged on rank 1 in the first ``training_log``
    (before the integration's first audit).
    """
    from megatron.training import training
    from megatron.training.utils import calc_params_l2_norm

    from norm_optim.integrations import megatron_lm
    from norm_optim.testing import inject_fault_
    from norm_optim.testing.megatron_lm import (
        RecordingSummaryWriter,
        pretrain_gpt,
        recording_tensorboard_patches,
        tiny_gpt_args,
    )
    from norm_optim.testing.oracle import (
        fill_deterministic_,
        global_param_shapes,
        oracle_norm,
        oracle_sum_of_squares,
    )
    from norm_optim._patching import Patch, patches_applied

    seen: dict[str, Any] = {
        "logged": [],
        "all_reduces": [],
        "others": [],
        "reference": [],
        "values": [],
    }
    setup, training_log = training.setup_model_and_optimizer, training.training_log
    comm = CountingCommunicator()
    model_holder: list = []

    @functools.wraps(setup)
    def setup_spy(*args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = setup(*args, **kwargs)
        if fill:
            fill_deterministic_(model, SEED, optimizer)
        shapes = global_param_shapes(model)
        seen["oracle"] = oracle_norm(shapes, SEED)
        seen["oracle_expert"] = oracle_norm(
            {n: s for n, s in shapes.items() if ".mlp.experts." in n}, SEED
        )
        seen["oracle_sums"] = oracle_sum_of_squares(shapes, SEED)
        model_holder.append(model)
        return model, optimizer, scheduler

    signature = inspect.signature(training_log)

    @functools.wraps(training_log)
    def training_log_spy(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        iteration, params_norm = bound["iteration"], bound["params_norm"]
        seen["logged"].append((iteration, None if params_norm is None else float(params_norm)))
        seen["values"].append(params_norm)
        seen["all_reduces"].append(comm.all_reduces)
        seen["others"].append(comm.others)
        if megatron_reference:
            seen["reference"].append(calc_params_l2_norm(model_holder[-1]))
        if fault is not None and iteration == 1:
            inject_fault_(integrations[0].optimizer, fault, what="main", rank=1)
        return training_log(*args, **kwargs)

    writer = RecordingSummaryWriter()
    patches = [
        Patch(training, "setup_model_and_optimizer", setup_spy),
        Patch(training, "training_log", training_log_spy),
        *recording_tensorboard_patches(writer),
    ]
    # What a user who wants norm_optim's INFO lines does (the test session's root logger is
    # pytest's, at WARNING); this rank is a fresh process: nothing to restore.
    logging.getLogger("norm_optim").setLevel(logging.INFO)
    integrations: list = []
    with patches_applied(patches), contextlib.ExitStack() as stack:
        if install is not None:
            integrations.append(stack.enter_context(megatron_lm.install(comm=comm, **install)))
        result = pretrain_gpt(tiny_gpt_args(**argv_options))
    seen["said"], seen["stdout"] = result.logged, result.stdout.splitlines()
    seen["printed"] = [
        float(m.group(1)) for line in result.log_lines for m in [_PRINTED.search(line)] if m
    ]
    seen["log_lines"] = result.log_lines
    seen["scalars"] = writer.scalars
    return seen


def _last(results: list[dict]) -> dict:
    """The last rank: the one that prints Megatron's log and holds the TensorBoard writer."""
    return results[-1]


def _printed(value: float) -> float:
    """``value`` as Megatron's log line prints it (``{:.3f}``)."""
    return float(f"{value:.3f}")


def _assert_serves_oracle(results: list[dict], iterations: int = 3) -> dict:
    """Every rank's ``training_log`` got the oracle at every iteration; the last rank printed it."""
    for seen in results:
        logged = [value for _, value in seen["logged"]]
        assert len(logged) == iterations and None not in logged, seen["logged"]
        for value in logged:
            assert value == pytest.approx(seen["oracle"], rel=REL)
    last = _last(results)
    assert last["printed"] == [_printed(last["oracle"])] * iterations, last["log_lines"]
    return last


_GROWING = re.compile(r" \| fastest-growing params: ((?:\S+ x[0-9.]+(?:, )?)+) \|")
TENSORBOARD = (
    "--tensorboard-dir",
    "unused-by-the-recording-writer",
    "--tensorboard-log-interval",
    "1",
)


def _assert_per_param_scalars(last: dict, steps: Any) -> None:
    """At every step: exactly the oracle's per-param / per-layer / per-expert tags, each equal
    to the oracle (TensorBoard gets float64 values here: rel 1e-6 holds)."""
    expected = oracle_tags(last["oracle_sums"])
    assert any(tag.startswith("params-norm/expert/") for tag in expected) == (
        last["oracle_expert"] > 0
    )
    for step in steps:
        written = {
            tag: value
            for tag, value, s in last["scalars"]
            if s == step and tag.startswith("params-norm/")
        }
        assert set(written) == set(expected), set(written) ^ set(expected)
        for tag, value in written.items():
            assert value == pytest.approx(expected[tag], rel=REL), tag


def _assert_growing_field(last: dict, names: set[str]) -> None:
    """From the second logged line on: the three fastest-growing params, as the value the loop
    got lists them."""
    lines = last["log_lines"]
    assert _GROWING.search(lines[0]) is None, lines[0]  # nothing to compare with yet
    for line, value in zip(lines[1:], [v for v in last["values"] if v is not None][1:]):
        field = _GROWING.search(line)
        assert field is not None, line
        shown = [item.rsplit(" x", 1) for item in field.group(1).split(", ")]
        assert len(shown) == 3 and {name for name, _ in shown} <= names, shown
        assert [(n, float(r)) for n, r in shown] == [
            (n, pytest.approx(r, abs=1e-4)) for n, r in value.growing
        ]


LAYOUTS = {  # name: (world size, tiny_gpt_args options)
    "dense-dp2": (2, {}),
    "dense-tp2-pp2": (4, dict(tp=2, pp=2)),
    "moe-tp2-ep2": (4, dict(tp=2, ep=2, num_experts=4)),
}


@needs_loop
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pretrain_logs_the_oracle_norm(layout: str) -> None:
    """The total, and with ``per_param`` every per-param / per-layer / per-expert scalar, equal
    the oracle at every iteration; the log line names the fastest-growing params."""
    world, options = LAYOUTS[layout]
    results = run_ranks(
        _run,
        world,
        dict(options, lr=0.0, extra=TENSORBOARD),
        install=dict(per_param=True),
        timeout=TIMEOUT,
    )
    last = _assert_serves_oracle(results)
    _assert_per_param_scalars(last, steps=(1, 2, 3))
    _assert_growing_field(last, set(last["oracle_sums"]))


# Megatron-LM's --use-torch-fsdp2 allows no distributed optimizer and untied embeddings only.
TORCH_FSDP2 = ("--use-torch-fsdp2", "--untie-embeddings-and-output-weights")
TORCH_FSDP2_LAYOUTS = {"dp2": (2, {}), "tp2-dp2": (4, dict(tp=2))}


@needs_loop
@pytest.mark.parametrize("layout", TORCH_FSDP2_LAYOUTS)
def test_pretrain_with_torch_fsdp2_logs_the_oracle_norm(layout: str) -> None:
    """``--use-torch-fsdp2``: Megatron's own loop prints each rank's bf16 shard norm (about
    1/sqrt(DP) of the truth); with install() it prints the oracle, as the same run without
    FSDP2 does."""
    world, layout_options = TORCH_FSDP2_LAYOUTS[layout]
    dp = world // layout_options.get("tp", 1)
    options = dict(layout_options, lr=0.0, use_distributed_optimizer=False, extra=TORCH_FSDP2[1:])
    fsdp2 = dict(options, extra=TORCH_FSDP2)
    plain = _last(run_ranks(_run, world, fsdp2, install=None, timeout=TIMEOUT))
    for printed, (_, logged) in zip(plain["printed"], plain["logged"]):
        assert logged == pytest.approx(plain["oracle"] / math.sqrt(dp), rel=0.15)
        assert abs(printed - plain["oracle"]) > 1.0  # visibly wrong in Megatron's own log
    served = _assert_serves_oracle(run_ranks(_run, world, fsdp2, install={}, timeout=TIMEOUT))
    without = _assert_serves_oracle(run_ranks(_run, world, options, install={}, timeout=TIMEOUT))
    for (it, value), (it_without, value_without) in zip(served["logged"], without["logged"]):
        assert it == it_without and value == pytest.approx(value_without, rel=REL)
    assert served["printed"] == without["printed"]


@needs_loop
def test_two_distributed_optimizer_instances() -> None:
    """Megatron's own loop prints sqrt(2) x the true norm; with install() it prints the oracle."""
    options = dict(lr=0.0, num_distributed_optimizer_instances=2)
    plain = _last(run_ranks(_run, 4, options, install=None, timeout=TIMEOUT))
    assert len(plain["printed"]) == 3
    for printed, (_, logged) in zip(plain["printed"], plain["logged"]):
        assert logged == pytest.approx(math.sqrt(2) * plain["oracle"], rel=1e-5)
        assert printed == _printed(logged)
        assert abs(printed - plain["oracle"]) > 1.0  # visibly wrong in Megatron's own log

    options["extra"] = TENSORBOARD
    last = _assert_serves_oracle(
        run_ranks(_run, 4, options, install=dict(per_param=True), timeout=TIMEOUT)
    )
    _assert_per_param_scalars(last, steps=(1, 2, 3))


@needs_loop
def test_breakdown_in_log_line_and_tensorboard() -> None:
    options = dict(
        tp=2,
        ep=2,
        num_experts=4,
        lr=0.0,
        extra=(
            "--tensorboard-dir",
            "unused-by-the-recording-writer",
            "--tensorboard-log-interval",
            "1",
        ),
    )
    results = run_ranks(_run, 4, options, install=dict(breakdown=True), timeout=TIMEOUT)
    last = _assert_serves_oracle(results)
    total, expert = last["oracle"], last["oracle_expert"]
    dense = math.sqrt(total**2 - expert**2)
    line = last["log_lines"][0]
    assert (
        f" params norm: {total:.3f} | params norm dense: {dense:.3f} | "
        f"params norm expert: {expert:.3f} |"
    ) in line, line
    scalars = {(tag, step): value for tag, value, step in last["scalars"]}
    for step in (1, 2, 3):
        assert scalars[("params-norm", step)] == pytest.approx(total, rel=REL)
        assert scalars[("params-norm-dense", step)] == pytest.approx(dense, rel=REL)
        assert scalars[("params-norm-expert", step)] == pytest.approx(expert, rel=REL)


@needs_loop
def test_norm_is_read_only_when_logged() -> None:
    """One all-reduce at each iteration whose log reads the norm, on every rank, none otherwise,
    with ``per_param`` (whose names exchange runs once, at the first logged iteration).

    ``--log-interval 2 --tensorboard-log-interval 3``, 5 iterations: printed at 1 (the first),
    2 and 4, written to TensorBoard (last rank) at 3; iteration 5 reads nothing. lr > 0, so the
    value follows training; on DP2 it equals Megatron's own ``calc_params_l2_norm``.
    """
    options = dict(
        lr=1e-2,
        train_iters=5,
        log_interval=2,
        extra=(
            "--tensorboard-dir",
            "unused-by-the-recording-writer",
            "--tensorboard-log-interval",
            "3",
        ),
    )
    results = run_ranks(
        _run,
        2,
        options,
        install=dict(per_param=True),
        fill=False,
        megatron_reference=True,
        timeout=TIMEOUT,
    )
    for seen in results:  # every rank decides alike
        assert [it for it, _ in seen["logged"]] == [1, 2, 3, 4, 5]
        assert [v is not None for _, v in seen["logged"]] == [True, True, True, True, False]
        counts = seen["all_reduces"]
        assert [b - a for a, b in zip(counts, counts[1:])] == [1, 1, 1, 0]
        # The names exchange (a digest gather and two all-reduces of the lists' sizes and
        # bytes) ran before the first logged iteration's log, and never again.
        others = seen["others"]
        assert others[0] == 3 and others == [others[0]] * 5, others
        for (_, value), reference in zip(seen["logged"], seen["reference"]):
            if value is not None:
                assert value == pytest.approx(reference, rel=REL)
    last = _last(results)
    values = dict(last["logged"])
    assert len(set(values.values()) - {None}) == 4  # it moved with training
    assert last["printed"] == [_printed(values[it]) for it in (1, 2, 4)]
    written = [(step, value) for tag, value, step in last["scalars"] if tag == "params-norm"]
    assert written == [(3, pytest.approx(values[3], rel=REL))]
    # The per-param scalars, written at 3 only, add up to the total.
    per_param = [
        value for tag, value, step in last["scalars"] if tag.startswith("params-norm/param/")
    ]
    assert math.sqrt(math.fsum(v * v for v in per_param)) == pytest.approx(values[3], rel=REL)
    assert {step for tag, _, step in last["scalars"] if tag.startswith("params-norm/")} == {3}


@needs_loop
@pytest.mark.parametrize("layout", ["dense-dp2", "moe-tp2-ep2"])
def test_step_norms_are_logged_at_logged_iterations_only(layout: str) -> None:
    """``install(step_norms=True, per_param=True)``: at the iterations that log (1, the first;
    2 and 4 with ``--log-interval 2``), the step is measured (one more all-reduce, none at 3);
    TensorBoard (interval 2) gets ``grads-norm`` equal to Megatron's own ``grad-norm``, the
    updates and moments, their per-param / per-layer scalars and the update-to-weight ratios;
    the log line shows the ratio; and training is bitwise the same as without step norms."""
    world, options = LAYOUTS[layout]
    extra = ("--tensorboard-dir", "unused-by-the-recording-writer", "--tensorboard-log-interval")
    options = dict(options, lr=1e-2, train_iters=4, log_interval=2, extra=(*extra, "2"))
    measured = run_ranks(
        _run, world, options, install=dict(per_param=True, step_norms=True), fill=False
    )
    plain = run_ranks(_run, world, options, install=dict(per_param=True), fill=False)
    for seen, reference in zip(measured, plain):
        assert seen["logged"] == reference["logged"], "training changed"
        counts = [0, *seen["all_reduces"]]
        assert [b - a for a, b in zip(counts, counts[1:])][1:] == [2, 0, 2]
    last, reference = _last(measured), _last(plain)
    scalars = {(tag, step): value for tag, value, step in last["scalars"]}
    megatron = {k: v for k, v in scalars.items() if k[0] == "grad-norm"}
    assert megatron == {
        (tag, step): value for tag, value, step in reference["scalars"] if tag == "grad-norm"
    }
    assert {step for tag, step in scalars if tag.startswith("updates-norm")} == {2, 4}
    for step in (2, 4):
        assert scalars[("grads-norm", step)] == pytest.approx(
            megatron[("grad-norm", step)], rel=REL
        )
        for tag in ("updates-norm", "exp-avg-norm", "exp-avg-sq-norm"):
            assert scalars[(tag, step)] > 0
        for quantity in ("grads-norm", "updates-norm"):
            per_param = [
                v
                for (t, s), v in scalars.items()
                if s == step and t.startswith(f"{quantity}/param/")
            ]
            total = math.sqrt(math.fsum(v * v for v in per_param))
            assert total == pytest.approx(scalars[(quantity, step)], rel=REL)
        ratios = {
            t: v for (t, s), v in scalars.items() if s == step and t.startswith("update-to-weight/")
        }
        assert ratios
        for tag, ratio in ratios.items():
            layer = tag.rsplit("/", 1)[1]
            expected = (
                scalars[(f"updates-norm/layer/{layer}", step)]
                / scalars[(f"params-norm/layer/{layer}", step)]
            )
            assert ratio == pytest.approx(expected, rel=1e-6)
    assert all(" | update/weight: " in line for line in last["log_lines"]), last["log_lines"]
    assert len(last["log_lines"]) == 3


RESUMES = {
    # The whole optimizer state is loaded (optimizer.load_state_dict).
    "float16-optimizer": (dict(use_distributed_optimizer=False), ()),
    # Weights only: the loader calls optimizer.reload_model_params(). With the distributed
    # optimizer, loading its parameter state from a torch-format checkpoint fails in megatron
    # whenever the inner optimizer is torch.optim.Adam (no TE / Apex): its per-param 'step'
    # tensor is not saved, and _set_main_param_and_optimizer_states raises KeyError: 'step'.
    "distributed-optimizer-weights": (dict(), ("--no-load-optim",)),
    # Megatron-LM's default format, the whole optimizer state. (Not with the distributed
    # optimizer: building its sharded state dict to load into asserts one Adam 'step' over the
    # torch.optim.Adam state, which a run that has not stepped yet does not have.)
    "float16-optimizer-torch-dist": (
        dict(use_distributed_optimizer=False, ckpt_format="torch_dist"),
        (),
    ),
}


@needs_loop
@pytest.mark.parametrize("resume", RESUMES)
def test_save_and_resume(tmp_path: Any, resume: str) -> None:
    """A checkpoint saved at iteration 2 and loaded by a new run: the resumed run logs the
    oracle of the saved weights (the new run's own init is random: no fill)."""
    options, load_flags = dict(RESUMES[resume][0]), RESUMES[resume][1]
    ckpt_format = options.pop("ckpt_format", "torch")
    save = ["--save", str(tmp_path), "--save-interval", "2", "--ckpt-format", ckpt_format]
    first = run_ranks(
        _run, 2, dict(options, lr=0.0, train_iters=2, extra=save), install={}, timeout=TIMEOUT
    )
    _assert_serves_oracle(first, iterations=2)
    # The LR schedule of the longer resumed run differs from the saved one's (lr stays 0), and
    # the inference RNG tracker (CPU_FLAGS: no CUDA RNG) saves no tracker states, which
    # load_checkpoint refuses unless --no-load-rng.
    load = [
        "--load",
        str(tmp_path),
        "--ckpt-format",
        ckpt_format,
        "--override-opt-param-scheduler",
        "--no-load-rng",
        *load_flags,
    ]
    ranks = run_ranks(
        _run,
        2,
        dict(options, lr=0.0, train_iters=4, extra=load),
        install={},
        fill=False,
        timeout=TIMEOUT,
    )
    resumed = _last(ranks)
    oracle = _last(first)["oracle"]
    assert [it for it, _ in resumed["logged"]] == [3, 4]
    for _, value in resumed["logged"]:
        assert value == pytest.approx(oracle, rel=REL)
    assert resumed["printed"] == [_printed(oracle)] * 2
    # The resume proof (on by default): rank 0 says the state is as saved, then the loaded
    # norm, both at INFO. Without the optimizer, only the weights are compared.
    proof, line = ranks[0]["said"]
    assert proof.startswith(
        "INFO norm_optim.integrations: norm_optim resume (iteration 2): 0 mismatches"
    ), proof
    if "--no-load-optim" in load_flags:
        assert proof.endswith(
            "the optimizer state was not loaded, as asked: only the weights compared"
        )
    else:
        assert proof.endswith("every weight, main param and optimizer state is bitwise as saved")
    head = "INFO norm_optim.integrations: norm_optim: params norm at load (iteration 2): "
    assert line.startswith(head) and line.endswith("; every layer equals the saved weights'")
    assert float(line[len(head) :].split(";")[0]) == pytest.approx(oracle, rel=REL, abs=1e-6)
    assert resumed["said"] == []


AUDITED = "decoder.layers.0.self_attention.linear_qkv.weight"


@needs_loop
def test_audit_findings_are_logged_by_rank_0() -> None:
    """``install(audit_interval=2)``: an fp32 main nudged on one Float16 replica (below bf16
    resolution: training keeps it) is found at the first audit after setup and at iteration 2,
    logged by rank 0 (``norm_optim.integrations``, ERROR) with its name, and counted in
    ``params-audit/findings``; nothing is printed."""
    options = dict(
        use_distributed_optimizer=False,
        lr=0.0,
        train_iters=2,
        extra=("--tensorboard-dir", "unused-by-the-recording-writer"),
    )
    first, last = run_ranks(
        _run, 2, options, install=dict(audit_interval=2), fault=AUDITED, timeout=TIMEOUT
    )
    assert [said.split("; compared")[0] for said in first["said"]] == [
        f"ERROR norm_optim.integrations: norm_optim iteration {it}: audit: 1 findings"
        for it in (1, 2)
    ]
    assert all(f"main-replicas-differ {AUDITED!r} on ranks [0, 1]" in s for s in first["said"])
    assert last["said"] == []  # rank 0 says it
    assert not any("audit" in line for seen in (first, last) for line in seen["stdout"])
    findings = {step: v for tag, v, step in last["scalars"] if tag == "params-audit/findings"}
    assert findings == {1: 1.0, 2: 1.0}


def _imports_megatron_training() -> bool:
    try:
        from megatron.training import training  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_imports_megatron_training(), reason="megatron.training is present")
def test_install_without_megatron_training_names_the_version() -> None:
    from norm_optim.integrations.megatron_lm import MegatronLMVersionError, install

    with pytest.raises(MegatronLMVersionError, match=r"megatron-core \S+ has no megatron.training"):
        install()


@needs_loop
def test_install_refuses_an_unknown_loop(monkeypatch: Any) -> None:
    from megatron.training import training

    from norm_optim.integrations.megatron_lm import MegatronLMVersionError, install

    monkeypatch.setattr(training, "training_log", lambda loss_dict, iteration: None)
    with pytest.raises(
        MegatronLMVersionError,
        match=r"of megatron-core \S+ has no "
        r"training_log\(params_norm=...\)",
    ):
        install()


@needs_loop
def test_uninstall_restores_megatron_functions() -> None:
    from megatron.training import training

    from norm_optim.integrations.megatron_lm import install

    names = ("setup_model_and_optimizer", "calc_params_l2_norm", "training_log")
    before = [getattr(training, name) for name in names]
    with install() as handle:
        assert all(getattr(training, n) is not f for n, f in zip(names, before))
        assert inspect.signature(training.training_log) == inspect.signature(before[2])
        with pytest.raises(RuntimeError, match="already installed"):
            install()
    assert [getattr(training, name) for name in names] == before
    handle.uninstall()  # twice is fine
    assert [getattr(training, name) for name in names] == before


@needs_loop
@pytest.mark.parametrize(
    "iteration, first, tensorboard, expected",
    [
        (5, True, None, True),  # the first iteration of a run always prints
        (10, False, None, True),  # log interval
        (15, False, None, False),
        (15, False, "tb", False),
        (12, False, "tb", True),  # TensorBoard interval, on every rank alike
        (12, False, None, False),  # no --tensorboard-dir: nothing writes it
    ],
)
def test_log_reads_params_norm(
    iteration: int, first: bool, tensorboard: str | None, expected: bool
) -> None:
    from argparse import Namespace

    from norm_optim.integrations.megatron_lm import log_reads_params_norm

    args = Namespace(log_interval=10, tensorboard_log_interval=4, tensorboard_dir=tensorboard)
    assert log_reads_params_norm(args, iteration, first) is expected


@needs_loop
def test_breakdown_value_is_the_total_float() -> None:
    from norm_optim.integrations.megatron_lm import LoggedParamsNorm

    value = LoggedParamsNorm(5.0, 3.0, 4.0)
    assert value == 5.0 and float(value) == 5.0
    assert f" params norm: {value:.3f} |" == (
        " params norm: 5.000 | params norm dense: 3.000 | params norm expert: 4.000 |"
    )
