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

    megatron_lm.install()            # once, before pretrain(...); options: InstallOptions
    pretrain(...)
"""

from __future__ import annotations

import os

from types import ModuleType
from typing import Any, Mapping, Optional

from .._errors import NormOptimError
from .._versions import megatron_core_version_string
from .._wrapper import NormAwareOptimizer
from ._guards import missing_hooks
from ._logged_values import LoggedParamsNorm
from ._loop import LoopIntegration, refuse_second_install
from ._options import InstallOptions

__all__ = [
    "MegatronLMIntegration",
    "MegatronLMVersionError",
    "InstallOptions",
    "LoggedParamsNorm",
    "install",
    "log_reads_params_norm",
]

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
    missing = missing_hooks("", training, (*_PATCHED, "train_step"), _TRAINING_LOG_PARAMS)
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


def _loaded_iteration(run: Any) -> int:
    """The iteration of the checkpoint the setup loaded (0: none). ``--finetune`` loads one and
    restarts the count at 0: its iteration is the tracker's (every rank reads it, as
    megatron's load does: ``read_metadata`` reduces it over the world)."""
    if not (getattr(run, "finetune", False) and run.load):
        return int(run.iteration or 0)
    from megatron.training.checkpointing import get_checkpoint_tracker_filename, read_metadata

    tracker = get_checkpoint_tracker_filename(run.load)
    if not os.path.isfile(tracker):
        return 0
    iteration, release = read_metadata(tracker)
    step = getattr(run, "ckpt_step", None)
    return 0 if release else int(step if step is not None else iteration)


class MegatronLMIntegration(LoopIntegration):
    """What :func:`install` returns: the live wrapper (``.optimizer``, ``.model``), and
    :meth:`uninstall` (also as a context manager) to restore Megatron-LM's functions."""

    calc_params_l2_norm_path = "megatron.training.training.calc_params_l2_norm"
    setup_name = "setup_model_and_optimizer"

    def __init__(self, training: ModuleType, options: InstallOptions) -> None:
        names = _PATCHED + (("train_step",) if options.arms_steps else ())
        names += ("save_checkpoint",) if options.resume_proof else ()
        super().__init__([(training, name) for name in names], training.training_log, options)

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
        skipped = bool(getattr(run, "no_load_optim", False) or getattr(run, "finetune", False))
        self._after_load(run.load, _loaded_iteration(run), lambda: self._writers({}), not skipped)
        return model, optimizer, scheduler

    def _save_checkpoint(
        self, iteration: int, model: Any, optimizer: Any, *a: Any, **kw: Any
    ) -> Any:
        result = self._originals["save_checkpoint"](iteration, model, optimizer, *a, **kw)
        self._after_save(_global_vars().get_args().save, iteration, kw)
        return result

    def _checkpoint_directory(self, root: str, iteration: int) -> str:
        # Every checkpoint format's directory.
        from megatron.training.checkpointing import get_checkpoint_name

        return str(get_checkpoint_name(root, iteration, return_base_dir=True))

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


def install(options: Optional[InstallOptions] = None, **kwargs: Any) -> MegatronLMIntegration:
    """Make Megatron-LM's training loop serve ``--log-params-norm`` from norm_optim.

    Call once, before ``pretrain(...)``, on every rank. The printed ``params norm`` and the
    TensorBoard / W&B scalar ``params-norm`` then come from
    :meth:`~norm_optim.NormAwareOptimizer.param_l2_norms` (each element counted once, on every
    layout), computed only at the iterations whose log reads them.

    Args:
        options, kwargs: what else to log, audit and watch (:class:`InstallOptions`, whole and
            / or by field name: ``install(breakdown=True)``) and
            :class:`~norm_optim.NormAwareOptimizer`'s keyword arguments (``comm=...``).

    Returns:
        A :class:`MegatronLMIntegration`: ``.optimizer`` is the wrapper once built,
        ``.uninstall()`` (or ``with install(): ...``) restores Megatron-LM's functions.

    Raises:
        MegatronLMVersionError: megatron-core has no ``megatron.training`` (before 0.17), or its
            loop lacks what is patched; the message names the version.
        ValueError, TypeError: a bad or unknown option, before anything is patched.
        RuntimeError: already installed (uninstall the first one).
    """
    options = InstallOptions.of(options, kwargs)
    training = _training_module()
    refuse_second_install(training, (*_PATCHED, "train_step"), "Megatron-LM")
    return MegatronLMIntegration(training, options)
