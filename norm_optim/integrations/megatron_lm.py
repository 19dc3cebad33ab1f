"""Megatron-LM's own training loop logs ``--log-params-norm`` from norm_optim.

Megatron-LM's loop (``megatron.training``, in the megatron-core wheel since 0.17) builds its
optimizer in ``setup_model_and_optimizer``, calls ``calc_params_l2_norm(model)`` every iteration
under ``--log-params-norm`` and hands the value to ``training_log``, which prints it at log
intervals (on the last rank) and writes the TensorBoard / W&B scalar ``params-norm`` at
TensorBoard intervals. There is no hook, so :func:`install` replaces those three names in
``megatron.training.training`` (which imported them by name):

- ``setup_model_and_optimizer``: the optimizer it returns is wrapped once in
  :class:`~norm_optim.NormAwareOptimizer` with the model chunks (after any checkpoint load, so
  the registry is built from the loaded state; later loads are followed by the wrapper).
- ``calc_params_l2_norm``: does no work; it returns a marker for ``training_log``.
- ``training_log``: when, and only when, this iteration's log prints or writes the params norm
  (decided from the iteration number, ``is_first_iteration`` and the intervals in ``args``,
  which every rank has: the print happens on one rank only), every rank reads
  ``param_l2_norms()`` (one all-reduce, one host sync) and passes the total on as a float.
  Other iterations pass ``None``, which ``training_log`` does not read.

Usage, in a ``pretrain_gpt.py``-style script::

    from norm_optim.integrations import megatron_lm

    megatron_lm.install()            # once, before pretrain(...)
    pretrain(...)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping, Optional

from .._errors import NormOptimError
from .._versions import megatron_core_version_string
from .._watch import WatchConfig
from .._wrapper import NormAwareOptimizer
from ._common import (
    AuditSchedule,
    CheckpointParity,
    LoggedParamsNorm,
    LoopIntegration,
    ParamsNormLog,
    moved_loop_names,
    installed_integration,
    missing_parameters,
)

__all__ = [
    "MegatronLMIntegration",
    "MegatronLMVersionError",
    "LoggedParamsNorm",
    "install",
    "log_reads_params_norm",
]

# Renamed public names (ParamsNormWithBreakdown): served with a DeprecationWarning.
__getattr__ = moved_loop_names(__name__)

# The names patched in megatron/training/training.py, in the order they are applied.
_PATCHED = ("setup_model_and_optimizer", "calc_params_l2_norm", "training_log")
# training_log parameters the integration reads (present in megatron-core 0.17 to 0.19).
_TRAINING_LOG_PARAMS = ("iteration", "params_norm")


class MegatronLMVersionError(NormOptimError, RuntimeError):
    """This megatron-core has no Megatron-LM loop, or not the one the integration patches."""


def _training_module() -> ModuleType:
    """``megatron.training.training``, checked to have what :func:`install` patches."""
    found = megatron_core_version_string()
    try:
        from megatron.training import training
    except ImportError as exc:
        raise MegatronLMVersionError(
            f"{found} has no megatron.training (Megatron-LM's training loop): the "
            f"wheel ships it since 0.17. Upgrade megatron-core, or run from a Megatron-LM "
            f"checkout; with megatron-core alone, wrap the optimizer yourself "
            f"(NormAwareOptimizer(optimizer, model=model_chunks)). Import error: {exc}"
        ) from exc
    missing = [
        name for name in (*_PATCHED, "train_step") if not callable(getattr(training, name, None))
    ]
    if not missing:
        missing = missing_parameters("training_log", training.training_log, _TRAINING_LOG_PARAMS)
    if missing:
        raise MegatronLMVersionError(
            f"megatron.training.training of {found} has no {', '.join(missing)}; "
            f"norm_optim's Megatron-LM integration knows the loop of megatron-core 0.17 to 0.19. "
            f"Wrap the optimizer yourself (NormAwareOptimizer(optimizer, model=model_chunks)) "
            f"and log optimizer.param_l2_norm() on every rank at log intervals."
        )
    return training


def _global_vars() -> ModuleType:
    from megatron.training import global_vars

    return global_vars


def _checkpoint_directory(root: str, iteration: int) -> str:
    """The directory Megatron-LM saves iteration ``iteration``'s checkpoint in, every format."""
    from megatron.training.checkpointing import get_checkpoint_name

    return str(get_checkpoint_name(root, iteration, return_base_dir=True))


def log_reads_params_norm(args: Any, iteration: int, is_first_iteration: bool) -> bool:
    """Whether ``training_log`` prints or writes ``params_norm`` at this iteration.

    The same answer on every rank, from what every rank has: ``training_log`` prints when
    ``iteration % log_interval == 0`` or on the first iteration of the run (on the last rank),
    and writes TensorBoard (and W&B, inside the same block) when ``iteration %
    tensorboard_log_interval == 0`` on the rank that has a writer. Only the last rank has the
    writer, so every rank looks at ``args.tensorboard_dir`` instead.
    """
    if is_first_iteration or iteration % args.log_interval == 0:
        return True
    return bool(getattr(args, "tensorboard_dir", None)) and (
        iteration % args.tensorboard_log_interval == 0
    )


class MegatronLMIntegration(LoopIntegration):
    """What :func:`install` returns: the live wrapper (``.optimizer``, ``.model``), and
    :meth:`uninstall` (also as a context manager) to restore Megatron-LM's functions."""

    calc_params_l2_norm_path = "megatron.training.training.calc_params_l2_norm"
    setup_name = "setup_model_and_optimizer"

    def __init__(
        self,
        training: ModuleType,
        log: ParamsNormLog,
        wrapper_options: dict[str, Any],
        audit: Optional[AuditSchedule] = None,
        parity: Optional[CheckpointParity] = None,
    ) -> None:
        names = _PATCHED + (("train_step",) if log.arms_steps else ())
        names += ("save_checkpoint",) if parity is not None else ()
        super().__init__(
            [(training, name) for name in names],
            training.training_log,
            log,
            wrapper_options,
            audit,
            parity,
        )

    def _train_step(self, *args: Any, **kwargs: Any) -> Any:
        # The loop sets args.curr_iteration, runs train_step, then logs iteration + 1.
        loop_args = _global_vars().get_args()
        iteration = loop_args.curr_iteration + 1
        self._arm_step(iteration, lambda first: log_reads_params_norm(loop_args, iteration, first))
        return self._originals["train_step"](*args, **kwargs)

    def _setup_model_and_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        model, optimizer, scheduler = self._originals["setup_model_and_optimizer"](*args, **kwargs)
        if optimizer is not None:  # None with --skip-train
            optimizer = NormAwareOptimizer(optimizer, model=model, **self._wrapper_options)
        self.optimizer, self.model = optimizer, model
        run = _global_vars().get_args()
        if self.parity is not None and optimizer is not None and run.load and run.iteration:
            # The loaded weights, before the first step: on every rank (a collective).
            self.parity.loaded(
                optimizer,
                _checkpoint_directory(run.load, run.iteration),
                run.iteration,
                _global_vars().get_tensorboard_writer(),
                _global_vars().get_wandb_writer(),
            )
        return model, optimizer, scheduler

    def _save_checkpoint(
        self, iteration: int, model: Any, optimizer: Any, *a: Any, **kw: Any
    ) -> Any:
        result = self._originals["save_checkpoint"](iteration, model, optimizer, *a, **kw)
        run = _global_vars().get_args()
        persistent = not kw.get("non_persistent_ckpt", False)
        if self.parity is not None and self.optimizer is not None and run.save and persistent:
            self.parity.saved(self.optimizer, _checkpoint_directory(run.save, iteration), iteration)
        return result

    def _reads_params_norm(self, arguments: Mapping[str, Any]) -> bool:
        return log_reads_params_norm(
            _global_vars().get_args(),
            arguments["iteration"],
            bool(arguments.get("is_first_iteration", False)),
        )

    def _scalar_writers(self, arguments: Mapping[str, Any]) -> Optional[tuple[int, Any, Any]]:
        # Where and when training_log writes Megatron's params-norm (the last rank has them).
        global_vars, iteration = _global_vars(), arguments["iteration"]
        writer = global_vars.get_tensorboard_writer()
        if writer is None or iteration % global_vars.get_args().tensorboard_log_interval != 0:
            return None
        return iteration, writer, global_vars.get_wandb_writer()

    def _iteration(self, arguments: Mapping[str, Any]) -> int:
        return int(arguments["iteration"])

    def _writers(self, arguments: Mapping[str, Any]) -> tuple[Any, Any]:
        global_vars = _global_vars()
        return global_vars.get_tensorboard_writer(), global_vars.get_wandb_writer()


def install(
    *,
    breakdown: bool = False,
    per_param: bool = False,
    step_norms: bool = False,
    audit_interval: int = 0,
    audit_action: str = "warn",
    checkpoint_parity: bool = True,
    watch: "bool | dict[str, Any] | WatchConfig" = False,
    **wrapper_options: Any,
) -> MegatronLMIntegration:
    """Make Megatron-LM's training loop serve ``--log-params-norm`` from norm_optim.

    Call once, before ``pretrain(...)``, on every rank. The printed ``params norm`` and the
    TensorBoard / W&B scalar ``params-norm`` then come from
    :meth:`~norm_optim.NormAwareOptimizer.param_l2_norms` (each element counted once, on every
    layout), computed only at the iterations whose log reads them.

    Args:
        breakdown: also log the dense and expert norms: the log line reads
            ``params norm: T | params norm dense: D | params norm expert: E |``, and TensorBoard
            / W&B get ``params-norm-dense`` and ``params-norm-expert`` (same single all-reduce).
        per_param: also write ``params-norm/param/<name>`` for every param (layout-independent
            name), ``params-norm/layer/<global layer>`` and ``params-norm/expert/<layer>.<expert>``
            (same single all-reduce; the names are exchanged once, at the first logged
            iteration), and end the log line with the params whose norm grew fastest since the
            previous logged iteration (``| fastest-growing params: <name> x1.0123, ... |``).
        step_norms: also measure the optimizer step of every iteration whose log reads the
            norms (:meth:`~norm_optim.NormAwareOptimizer.measure_next_step`; others cost
            nothing) and write ``grads-norm`` (before clipping), ``updates-norm``,
            ``exp-avg-norm``, ``exp-avg-sq-norm``; with ``per_param`` also
            ``grads-norm/{param,layer,expert}/...``, the same for ``updates-norm``, and
            ``update-to-weight/layer/<layer>``. The log line's grad norm is followed by the
            update-to-weight ratio (``| update/weight: 1.2e-03 (largest: layer 3 2.1e-03) |``).
            Megatron's own ``grad-norm``, clipping and training are unchanged.
        audit_interval: audit (:meth:`~norm_optim.NormAwareOptimizer.audit`, on every rank)
            every ``audit_interval`` iterations and at the first iteration after each setup
            (after any checkpoint load), after ``training_log``; write the number of findings
            as the TensorBoard / W&B scalar ``params-audit/findings`` (0 when clean). 0 (the
            default) never audits.
        audit_action: ``"warn"``: rank 0 prints the findings with their param names;
            ``"raise"``: every rank raises :class:`~norm_optim.AuditError`, stopping the run
            before the bad weights are saved.
        checkpoint_parity: write the saved weights' total and per-layer norms beside every
            checkpoint the loop saves (``norm_optim_norms.json``, one per-param norm read per
            save) and, after a load, log the loaded weights' norm once before the first step
            (``params-norm/at-load`` and a line from rank 0) and name the layers whose norm
            differs from what was saved (warned or raised as ``audit_action`` says). On by
            default; a checkpoint saved without it just gets the at-load line.
        watch: watch every step (:meth:`~norm_optim.NormAwareOptimizer.watch`; docs/watch.md):
            True, a dict of :class:`~norm_optim.WatchConfig` fields (``{"skip": True}``) or a
            config. Each iteration's grads (before clipping) in total, per layer and per param
            are judged against their rolling statistics (one all-reduce per step, no host sync
            of its own), and the loss where this rank has it; an alarm is a line
            ``norm_optim watch: iteration <N>: ...`` on the last rank (logger
            ``norm_optim.watch``) naming the signal, the layer and the param, the scalar
            ``watch/alarms``, and the next step measured per param (its step norms written).
            With ``skip``, a spiking step is not applied (a skipped iteration to the loop).
        wrapper_options: passed to :class:`~norm_optim.NormAwareOptimizer` (``count_frozen``,
            ``pg_collection``, ``group``, ``comm``).

    Returns:
        A :class:`MegatronLMIntegration`: ``.optimizer`` is the wrapper once built,
        ``.uninstall()`` (or ``with install(): ...``) restores Megatron-LM's functions.

    Raises:
        MegatronLMVersionError: megatron-core has no ``megatron.training`` (before 0.17), or its
            loop lacks what is patched; the message names the version.
        RuntimeError: already installed (uninstall the first one).
    """
    audit = AuditSchedule(audit_interval, audit_action)  # bad values fail before patching
    parity = CheckpointParity(audit_action) if checkpoint_parity else None
    training = _training_module()
    if any(installed_integration(training, name) is not None for name in (*_PATCHED, "train_step")):
        raise RuntimeError(
            "norm_optim's Megatron-LM integration is already installed; call uninstall() on the "
            "handle install() returned before installing again"
        )
    log = ParamsNormLog(breakdown, per_param, step_norms=step_norms, watch=WatchConfig.of(watch))
    return MegatronLMIntegration(training, log, wrapper_options, audit, parity)
