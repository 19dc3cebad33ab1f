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
from .._wrapper import NormAwareOptimizer
from ._guards import missing_hooks
from ._logged_values import LoggedParamsNorm
from ._loop import LoopIntegration, refuse_second_install
from ._options import InstallOptions

__all__ = [
    "MegatronBridgeIntegration",
    "MegatronBridgeVersionError",
    "InstallOptions",
    "LoggedParamsNorm",
    "NormAwareOptimizerConfig",
    "install",
    "log_reads_params_norm",
    "norm_aware_optimizer_config",
]

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


def _check_hooks(setup: ModuleType, train: ModuleType, options: InstallOptions) -> None:
    """Bridge's loop has the names :func:`install` replaces, with the parameters it reads."""
    steps = ("train_step",) if options.arms_steps else ()  # step_norms and watch arm it
    missing = missing_hooks("setup.", setup, ("setup_optimizer",)) + missing_hooks(
        "train.", train, ("calc_params_l2_norm", "training_log", *steps), _TRAINING_LOG_PARAMS
    )
    if missing:
        raise MegatronBridgeVersionError(
            f"megatron.bridge.training of {_versions()} has no {', '.join(missing)}; norm_optim's "
            "Megatron-Bridge integration knows the loop of megatron-bridge 0.6. Use norm_aware_"
            "optimizer_config(cfg.optimizer) in your recipe and log ctx.optimizer.param_l2_norm() "
            "on every rank from a callback instead."
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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def norm_aware_optimizer_config(config: Any, **wrapper_options: Any) -> Any:
    """A :class:`NormAwareOptimizerConfig` copy of a Bridge / megatron ``OptimizerConfig``.

    Put it in a recipe (``cfg.optimizer = norm_aware_optimizer_config(cfg.optimizer)``) and
    Bridge's ``setup_optimizer`` returns a :class:`~norm_optim.NormAwareOptimizer`.

    Args:
        config: the optimizer config; every attribute is copied as it is (finalized or not:
            ``pretrain`` finalizes the copy as it would the original).
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

    def __init__(self, setup: ModuleType, train: ModuleType, options: InstallOptions) -> None:
        targets = [
            (setup, "setup_optimizer"),
            (train, "calc_params_l2_norm"),
            (train, "training_log"),
        ]
        if options.arms_steps:
            targets.append((train, "train_step"))
        if options.resume_proof:
            # pretrain() imported train() by name; save_checkpoint_and_time is train's own.
            from megatron.bridge.training import pretrain

            targets += [(pretrain, "train"), (train, "save_checkpoint_and_time")]
        super().__init__(targets, train.training_log, options)
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
        arguments = inspect.signature(original).bind(*args, **kwargs).arguments
        state = arguments["global_state"]
        checkpoint = state.cfg.checkpoint
        loaded = getattr(checkpoint, "load_optim", True) and not getattr(
            checkpoint, "finetune", False
        )
        self._after_load(
            checkpoint.load, state.train_state.step, lambda: self._writers(arguments), loaded
        )
        return original(*args, **kwargs)

    def _save_checkpoint_and_time(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._originals["save_checkpoint_and_time"](state, *args, **kwargs)
        self._after_save(state.cfg.checkpoint.save, state.train_state.step, kwargs)
        return result

    def _checkpoint_directory(self, root: str, iteration: int) -> str:
        from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name

        return str(get_checkpoint_name(root, iteration))

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


def install(options: Optional[InstallOptions] = None, **kwargs: Any) -> MegatronBridgeIntegration:
    """Make Megatron-Bridge's ``pretrain()`` serve ``logger.log_params_norm`` from norm_optim.

    Call it on every rank before ``pretrain(...)``, once: Bridge's printed ``params norm`` and
    its ``params-norm`` scalar are then norm_optim's
    (:meth:`~norm_optim.NormAwareOptimizer.param_l2_norms`), read only at the iterations
    whose log shows them.

    Args:
        options, kwargs: as :func:`norm_optim.integrations.megatron_lm.install` takes them
            (:class:`InstallOptions`; ``install(per_param=True)``), the same for both loops;
            Bridge hands the wrapper its own ``pg_collection`` with ``use_decentralized_pg``.

    Returns:
        A :class:`MegatronBridgeIntegration` (``.optimizer``: the wrapper Bridge's setup built;
        ``.uninstall()`` or ``with install(): ...`` puts Bridge's functions back).

    Raises:
        MegatronBridgeVersionError: Megatron-Bridge does not import, or its loop lacks what is
            patched; the message names the Bridge and megatron-core versions.
        ValueError, TypeError: a bad or unknown option, before anything is patched.
        RuntimeError: installed already: uninstall the first one.
    """
    options = InstallOptions.of(options, kwargs)
    setup, train = _bridge_modules()
    refuse_second_install(train, ("calc_params_l2_norm",), "Megatron-Bridge")
    _check_hooks(setup, train, options)
    return MegatronBridgeIntegration(setup, train, options)
