"""Megatron-Bridge's training loop logs ``log_params_norm`` from norm_optim.

Megatron-Bridge (``megatron.bridge``) builds its optimizer in ``setup_optimizer``
(``training/optim.py``), which calls ``optimizer_config.provide(model_chunks=...,
config_overrides=..., use_gloo_process_groups=..., pg_collection=...)`` when the optimizer config
has a ``provide`` method; the LR scheduler is then built on what that returns. Its loop
(``training/train.py``) calls its own ``calc_params_l2_norm(model, model_config,
use_megatron_fsdp=...)`` every iteration under ``config.logger.log_params_norm`` and hands the
value to ``training_log``, which prints it at ``log_interval`` (on the last rank) and writes the
TensorBoard / W&B scalar ``params-norm`` at ``tensorboard_log_interval`` (on the rank that has the
writers, the last one).

Two ways to use it:

- :func:`install` (once, before ``pretrain(...)``): the optimizer is built through
  :class:`NormAwareOptimizerConfig`'s ``provide`` (a copy of your optimizer config, so your
  config and the run config Bridge saves are unchanged), and the loop's params norm comes from
  it. :func:`install` replaces three names Bridge imported by name:

  - ``training.setup.setup_optimizer``: called with a :class:`NormAwareOptimizerConfig` copy of
    the optimizer config (unless the config already has a ``provide``: then the optimizer it
    returns is wrapped, if it is not already a :class:`~norm_optim.NormAwareOptimizer`).
  - ``training.train.calc_params_l2_norm``: does no work; it returns a marker for
    ``training_log``.
  - ``training.train.training_log``: when, and only when, this iteration's log prints or
    writes the params norm (decided from the step and the logger config, which every rank has;
    the print and the writers are on one rank only), every rank reads ``param_l2_norms()`` (one
    all-reduce, one host sync) and passes the total on as a float. Other iterations pass
    ``None``, which ``training_log`` does not read.

- :func:`norm_aware_optimizer_config` (or :class:`NormAwareOptimizerConfig` directly) in your
  recipe, without :func:`install`: ``ctx.optimizer`` in Bridge callbacks is then a
  :class:`~norm_optim.NormAwareOptimizer` (call ``param_l2_norm()`` on every rank); the loop's
  own ``params norm`` stays Bridge's.

Usage::

    from norm_optim.integrations import megatron_bridge

    megatron_bridge.install()                # once, before pretrain(...)
    pretrain(cfg, forward_step)              # cfg.logger.log_params_norm=True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from types import ModuleType
from typing import Any, Mapping, Optional

from .._errors import NormOptimError
from .._versions import distribution_version
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
    "MegatronBridgeIntegration",
    "MegatronBridgeVersionError",
    "LoggedParamsNorm",
    "NormAwareOptimizerConfig",
    "install",
    "log_reads_params_norm",
    "norm_aware_optimizer_config",
]

# Renamed public names (ParamsNormWithBreakdown): served with a DeprecationWarning.
_moved_names = moved_loop_names(__name__)

# training_log parameters the integration reads (megatron-bridge 0.6).
_TRAINING_LOG_PARAMS = ("params_norm", "config", "global_state")
# The instance attribute (not a dataclass field: it stays out of Bridge's saved run config)
# holding NormAwareOptimizer keyword arguments.
_OPTIONS_ATTR = "_norm_optim_options"


class MegatronBridgeVersionError(NormOptimError, RuntimeError):
    """Megatron-Bridge is not installed, or its loop is not the one the integration patches."""


def _versions() -> str:
    return (
        f"megatron-bridge {distribution_version('megatron-bridge')} on megatron-core "
        f"{distribution_version('megatron-core')}"
    )


def _bridge_modules() -> tuple[ModuleType, ModuleType]:
    """``megatron.bridge.training.setup`` and ``.train``."""
    try:
        from megatron.bridge.training import setup, train
    except ImportError as exc:
        raise MegatronBridgeVersionError(
            f"cannot import Megatron-Bridge's training loop ({_versions()}): {exc}. Install "
            f"megatron-bridge, or wrap the optimizer yourself "
            f"(NormAwareOptimizer(optimizer, model=model_chunks))."
        ) from exc
    return setup, train


def _checkpoint_directory(root: str, iteration: int) -> str:
    """The directory Bridge saves iteration ``iteration``'s checkpoint in."""
    from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name

    return str(get_checkpoint_name(root, iteration))


def _check_hooks(setup: ModuleType, train: ModuleType) -> None:
    """Bridge's loop has the names :func:`install` replaces, with the parameters it reads."""
    missing = [
        f"setup.{name}" for name in ("setup_optimizer",) if not callable(getattr(setup, name, None))
    ]
    missing += [
        f"train.{name}"
        for name in ("calc_params_l2_norm", "training_log")
        if not callable(getattr(train, name, None))
    ]
    if not missing:
        missing = missing_parameters("train.training_log", train.training_log, _TRAINING_LOG_PARAMS)
    if missing:
        raise MegatronBridgeVersionError(
            f"megatron.bridge.training of {_versions()} has no {', '.join(missing)}; norm_optim's "
            f"Megatron-Bridge integration knows the loop of megatron-bridge 0.6. Use "
            f"norm_aware_optimizer_config(cfg.optimizer) in your recipe and log "
            f"ctx.optimizer.param_l2_norm() on every rank from a callback instead."
        )


# ---------------------------------------------------------------- the optimizer config


def _build_megatron_optimizer(
    config: Any,
    model_chunks: Any,
    config_overrides: Any,
    use_gloo_process_groups: bool,
    pg_collection: Any,
) -> Any:
    """What Bridge's ``setup_optimizer`` builds for a config without ``provide``
    (``training/optim.py``): megatron's Muon / SOAP optimizer when named, else
    ``get_megatron_optimizer``."""
    from megatron.core.optimizer import get_megatron_optimizer

    kwargs = dict(
        config=config,
        model_chunks=model_chunks,
        config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups,
        pg_collection=pg_collection,
    )
    if "muon" not in config.optimizer and "soap" not in config.optimizer:
        return get_megatron_optimizer(**kwargs)
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer

    return get_megatron_muon_optimizer(
        **kwargs, layer_wise_distributed_optimizer="dist" in config.optimizer
    )


def _wrap(
    optimizer: Any, model_chunks: Any, pg_collection: Any, options: dict[str, Any]
) -> NormAwareOptimizer:
    if isinstance(optimizer, NormAwareOptimizer):
        return optimizer
    if pg_collection is not None:  # Bridge passes one with use_decentralized_pg only
        options = {"pg_collection": pg_collection, **options}
    return NormAwareOptimizer(optimizer, model=model_chunks, **options)


def _provide(
    self: Any,
    model_chunks: Any,
    config_overrides: Any = None,
    use_gloo_process_groups: bool = False,
    pg_collection: Any = None,
) -> NormAwareOptimizer:
    """Build the optimizer as Bridge's ``setup_optimizer`` would, wrapped once in
    :class:`~norm_optim.NormAwareOptimizer` with the model chunks."""
    optimizer = _build_megatron_optimizer(
        self, model_chunks, config_overrides, use_gloo_process_groups, pg_collection
    )
    return _wrap(optimizer, model_chunks, pg_collection, getattr(self, _OPTIONS_ATTR, {}))


@functools.cache
def _config_class() -> type[Any]:
    """:class:`NormAwareOptimizerConfig`, made on first use: it subclasses Bridge's
    ``OptimizerConfig``, and importing Bridge is slow and needs it installed."""
    try:
        from megatron.bridge.training.config import OptimizerConfig
    except ImportError as exc:
        raise MegatronBridgeVersionError(
            f"NormAwareOptimizerConfig subclasses megatron.bridge.training.config."
            f"OptimizerConfig, which does not import ({_versions()}): {exc}"
        ) from exc

    @dataclasses.dataclass
    class NormAwareOptimizerConfig(OptimizerConfig):
        """Bridge's ``OptimizerConfig`` whose ``provide`` (which Bridge's ``setup_optimizer``
        calls) returns the optimizer wrapped in :class:`~norm_optim.NormAwareOptimizer`."""

        provide = _provide

    # Found by this module's __getattr__ under its public name (pickle, Bridge's YAML _target_).
    NormAwareOptimizerConfig.__module__ = __name__
    NormAwareOptimizerConfig.__qualname__ = NormAwareOptimizerConfig.__name__
    return NormAwareOptimizerConfig


def __getattr__(name: str) -> Any:
    # ``NormAwareOptimizerConfig`` resolves on first access (PEP 562), so importing this module
    # does not import Bridge; pickle and Bridge's YAML ``_target_`` find it by this path.
    if name == "NormAwareOptimizerConfig":
        return _config_class()
    return _moved_names(name)


def norm_aware_optimizer_config(config: Any, **wrapper_options: Any) -> Any:
    """A :class:`NormAwareOptimizerConfig` copy of a Bridge / megatron ``OptimizerConfig``.

    Put it in a recipe (``cfg.optimizer = norm_aware_optimizer_config(cfg.optimizer)``) and
    Bridge's ``setup_optimizer`` returns a :class:`~norm_optim.NormAwareOptimizer`.

    Args:
        config: the optimizer config; every attribute is copied as it is (finalized or not:
            ``pretrain`` finalizes the copy as it would the original).
        step_norms: also measure the optimizer step of every iteration whose log reads the
            norms and write ``grads-norm`` (before clipping), ``updates-norm``, ``exp-avg-norm``,
            ``exp-avg-sq-norm`` (with ``per_param`` also their per-param / per-layer /
            per-expert scalars and ``update-to-weight/layer/<layer>``), as
            :func:`norm_optim.integrations.megatron_lm.install` does.
        wrapper_options: passed to :class:`~norm_optim.NormAwareOptimizer` (``count_frozen``,
            ``group``, ``comm``).
    """
    cls = _config_class()
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"expected an OptimizerConfig instance, got {type(config).__name__}")
    # A shallow copy as copy.copy makes it, of the new class: the fields, and also the
    # attributes megatron's __post_init__ (Bridge's finalize) derives, which are not fields.
    copy = object.__new__(cls)
    vars(copy).update(vars(config))
    setattr(copy, _OPTIONS_ATTR, dict(wrapper_options))
    return copy


# ---------------------------------------------------------------- logging


def log_reads_params_norm(logger_config: Any, iteration: int) -> bool:
    """Whether Bridge's ``training_log`` prints or writes ``params_norm`` at this iteration.

    The same answer on every rank, from what every rank has: ``training_log`` prints when
    ``iteration % log_interval == 0`` (on the last rank) and writes TensorBoard / W&B / MLflow /
    Comet when ``iteration % tensorboard_log_interval == 0`` on the rank that has a writer. Only
    the last rank has writers, so every rank looks at the logger config instead.
    """
    if iteration % logger_config.log_interval == 0:
        return True
    writes = any(
        getattr(logger_config, name, None)
        for name in ("tensorboard_dir", "wandb_project", "mlflow_experiment", "comet_project")
    )
    return writes and iteration % logger_config.tensorboard_log_interval == 0


class MegatronBridgeIntegration(LoopIntegration):
    """What :func:`install` returns: the live wrapper (``.optimizer``, ``.model``), and
    :meth:`uninstall` (also as a context manager) to restore Bridge's functions."""

    calc_params_l2_norm_path = "megatron.bridge.training.train.calc_params_l2_norm"
    setup_name = "setup_optimizer"

    def __init__(
        self,
        setup: ModuleType,
        train: ModuleType,
        log: ParamsNormLog,
        wrapper_options: dict[str, Any],
        audit: Optional[AuditSchedule] = None,
        parity: Optional[CheckpointParity] = None,
    ) -> None:
        targets = [
            (setup, "setup_optimizer"),
            (train, "calc_params_l2_norm"),
            (train, "training_log"),
        ]
        if log.arms_steps:
            targets.append((train, "train_step"))
        if parity is not None:
            # pretrain() imported train() by name; save_checkpoint_and_time is train's own.
            from megatron.bridge.training import pretrain

            targets += [(pretrain, "train"), (train, "save_checkpoint_and_time")]
        super().__init__(targets, train.training_log, log, wrapper_options, audit, parity)
        self._train_step_signature = inspect.signature(train.train_step)

    def _train_step(self, *args: Any, **kwargs: Any) -> Any:
        # The loop runs train_step, then train_state.step += 1, then training_log.
        state = self._train_step_signature.bind(*args, **kwargs).arguments["global_state"]
        iteration = state.train_state.step + 1
        self._arm_step(iteration, lambda first: log_reads_params_norm(state.cfg.logger, iteration))
        return self._originals["train_step"](*args, **kwargs)

    def _log_iteration(self, arguments: Mapping[str, Any]) -> Optional[int]:
        step: int = arguments["global_state"].train_state.step
        return step

    def _setup_optimizer(self, optimizer_config: Any, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(optimizer_config, "provide"):
            optimizer_config = norm_aware_optimizer_config(
                optimizer_config, **self._wrapper_options
            )
        original = self._originals["setup_optimizer"]
        optimizer, scheduler = original(optimizer_config, *args, **kwargs)
        bound = inspect.signature(original).bind(optimizer_config, *args, **kwargs)
        model = bound.arguments["model"]
        chunks = model if isinstance(model, list) else [model]
        # A config with its own ``provide`` may return an unwrapped optimizer: wrap it here
        # (the scheduler then holds the unwrapped one, which shares its param groups).
        optimizer = _wrap(
            optimizer, chunks, bound.arguments.get("pg_collection"), self._wrapper_options
        )
        self.optimizer, self.model = optimizer, chunks
        return optimizer, scheduler

    def _reads_params_norm(self, arguments: Mapping[str, Any]) -> bool:
        return log_reads_params_norm(
            arguments["config"].logger, arguments["global_state"].train_state.step
        )

    def _train(self, *args: Any, **kwargs: Any) -> Any:
        # Before the first step of a run that loaded a checkpoint: the loaded weights' norm.
        original = self._originals["train"]
        state = inspect.signature(original).bind(*args, **kwargs).arguments["global_state"]
        step, load = state.train_state.step, state.cfg.checkpoint.load
        if self.parity is not None and self.optimizer is not None and load and step:
            self.parity.loaded(
                self.optimizer,
                _checkpoint_directory(load, step),
                step,
                state.tensorboard_logger,
                state.wandb_logger,
            )
        return original(*args, **kwargs)

    def _save_checkpoint_and_time(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._originals["save_checkpoint_and_time"](state, *args, **kwargs)
        save, step = state.cfg.checkpoint.save, state.train_state.step
        persistent = not kwargs.get("non_persistent_ckpt", False)
        if self.parity is not None and self.optimizer is not None and save and persistent:
            self.parity.saved(self.optimizer, _checkpoint_directory(save, step), step)
        return result

    def _iteration(self, arguments: Mapping[str, Any]) -> int:
        return int(arguments["global_state"].train_state.step)

    def _writers(self, arguments: Mapping[str, Any]) -> tuple[Any, Any]:
        state = arguments["global_state"]
        return state.tensorboard_logger, state.wandb_logger

    def _scalar_writers(self, arguments: Mapping[str, Any]) -> Optional[tuple[int, Any, Any]]:
        # Where and when training_log writes Bridge's params-norm.
        state = arguments["global_state"]
        iteration = state.train_state.step
        if iteration % arguments["config"].logger.tensorboard_log_interval != 0:
            return None
        return iteration, state.tensorboard_logger, state.wandb_logger


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
) -> MegatronBridgeIntegration:
    """Make Megatron-Bridge's training loop serve ``log_params_norm`` from norm_optim.

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
            norms and write ``grads-norm`` (before clipping), ``updates-norm``, ``exp-avg-norm``,
            ``exp-avg-sq-norm`` (with ``per_param`` also their per-param / per-layer /
            per-expert scalars and ``update-to-weight/layer/<layer>``), as
            :func:`norm_optim.integrations.megatron_lm.install` does.
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
            ``group``, ``comm``).

    Returns:
        A :class:`MegatronBridgeIntegration`: ``.optimizer`` is the wrapper once built,
        ``.uninstall()`` (or ``with install(): ...``) restores Bridge's functions.

    Raises:
        MegatronBridgeVersionError: Megatron-Bridge does not import, or its loop lacks what is
            patched; the message names the Bridge and megatron-core versions.
        RuntimeError: already installed (uninstall the first one).
    """
    audit = AuditSchedule(audit_interval, audit_action)  # bad values fail before patching
    parity = CheckpointParity(audit_action) if checkpoint_parity else None
    setup, train = _bridge_modules()
    if installed_integration(train, "calc_params_l2_norm") is not None:
        raise RuntimeError(
            "norm_optim's Megatron-Bridge integration is already installed; call uninstall() "
            "on the handle install() returned before installing again"
        )
    _check_hooks(setup, train)
    if (step_norms or watch) and not callable(getattr(train, "train_step", None)):
        raise MegatronBridgeVersionError(
            f"megatron.bridge.training.train of {_versions()} has no train_step: "
            "install(step_norms=True) and install(watch=...) arm the optimizer step there"
        )
    log = ParamsNormLog(breakdown, per_param, step_norms=step_norms, watch=WatchConfig.of(watch))
    return MegatronBridgeIntegration(setup, train, log, wrapper_options, audit, parity)
