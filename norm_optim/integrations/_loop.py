"""The skeleton of an installed loop integration: :class:`LoopIntegration` (the patched
names, ``uninstall``, the deferred ``calc_params_l2_norm`` and the ``training_log`` that reads the
norm only where it is logged), and the refusal of a second install."""

from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any, Callable, Mapping, Optional, Sequence

from .._errors import NormOptimError
from .._norms.reducer import ParamNorms
from .._step.measurement import StepNorms
from .._patching import Patch, PatchSet
from .._step.watch import LOSS, Alarm, say
from .._wrapper import NormAwareOptimizer
from ._resume import ResumeProof
from ._audit_schedule import AuditSchedule
from ._checkpoint_norms import CheckpointParity
from ._guards import is_loop_model
from ._log import is_logging_rank
from ._logged_values import DeferredParamsNorm, LoggedGradNorm
from ._options import InstallOptions
from ._scalars import ParamsNormLog, WATCH_TAG, loop_loss, ratio_note, step_scalars, write_scalars


# Attribute of each installed replacement: the integration that installed it.
_OWNER_ATTR = "__norm_optim_integration__"


def installed_integration(module: ModuleType, name: str) -> Optional["LoopIntegration"]:
    """The integration whose replacement ``module.name`` is now, or None."""
    return getattr(getattr(module, name, None), _OWNER_ATTR, None)


def refuse_second_install(module: ModuleType, names: Sequence[str], loop: str) -> None:
    """RuntimeError where one of ``module``'s ``names`` is an installed integration's already."""
    if any(installed_integration(module, name) is not None for name in names):
        raise RuntimeError(
            f"norm_optim's {loop} integration is already installed; call uninstall() on the "
            "handle install() returned before installing again"
        )


class LoopIntegration:
    """An installed loop integration: the live wrapper, and :meth:`uninstall` (also as a context
    manager) to restore the loop's functions.

    A subclass names what it patches (``(module, name)`` pairs; each name has a method
    ``_<name>`` here or in the subclass), builds and wraps the optimizer in its setup
    replacement, and says when its ``training_log`` reads the norm (:meth:`_reads_params_norm`)
    and where it writes scalars (:meth:`_scalar_writers`).

    Attributes:
        optimizer: the :class:`~norm_optim.NormAwareOptimizer` of the latest setup (``None``
            before it, or when the loop builds none).
        model: the model chunks it was built with.
        options: the :class:`InstallOptions` it was installed with.
        audit: its :class:`AuditSchedule` (``audit.reports``: the latest audits' findings).
        parity: its :class:`CheckpointParity` (None without ``resume_proof``): the norms.
        resume: its :class:`~norm_optim.integrations._resume.ResumeProof` (None without
            ``resume_proof``): ``resume.report`` is the last load's report.
    """

    #: The dotted name of the loop's ``calc_params_l2_norm`` (for the deferred value's errors).
    calc_params_l2_norm_path: str = "calc_params_l2_norm"
    #: The loop's setup function that builds the optimizer (for error messages).
    setup_name: str = "setup"

    def __init__(
        self,
        targets: Sequence[tuple[ModuleType, str]],
        training_log: Callable[..., Any],
        options: InstallOptions,
    ) -> None:
        self._optimizer: Optional[NormAwareOptimizer] = None
        self.model: Optional[list[Any]] = None
        self.options = options
        self.audit = AuditSchedule(options.audit_interval, options.audit_action)
        self.parity = CheckpointParity(options.audit_action) if options.resume_proof else None
        self.resume = ResumeProof(options.audit_action) if options.resume_proof else None
        self._log = ParamsNormLog(
            options.breakdown,
            options.per_param,
            step_norms=options.step_norms,
            watch=options.watch_config,
        )
        self._armed_iteration: Optional[int] = None  # the iteration whose step is measured
        self._aftermath = False  # the next step is armed per param: the last one alarmed
        self._armed_aftermath = False  # the armed step is an alarm's aftermath
        self._first_step = True
        self._wrapper_options = dict(options.wrapper_options)
        self._log_signature = inspect.signature(training_log)
        self._originals = {name: getattr(module, name) for module, name in targets}
        self._patches = PatchSet.apply(
            [Patch(module, name, self._replacement(name)) for module, name in targets]
        )

    @property
    def optimizer(self) -> Optional[NormAwareOptimizer]:
        """The :class:`~norm_optim.NormAwareOptimizer` of the latest setup (None before it)."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: Optional[NormAwareOptimizer]) -> None:
        # A watched install watches every optimizer a setup builds (each rank alike).
        if optimizer is not None and self._log.watch is not None and optimizer.watching is None:
            optimizer.watch(self._log.watch)
        self._optimizer = optimizer

    def _replacement(self, name: str) -> Callable[..., Any]:
        """``self._<name>`` under the original's name, signature and docstring, marked as ours."""
        method = getattr(self, f"_{name}")

        @functools.wraps(self._originals[name])
        def replacement(*args: Any, **kwargs: Any) -> Any:
            return method(*args, **kwargs)

        setattr(replacement, _OWNER_ATTR, self)
        return replacement

    @property
    def installed(self) -> bool:
        return self._patches.installed

    def uninstall(self) -> None:
        """Restore the loop's functions. Safe to call twice. The optimizer already built stays
        wrapped (it behaves as the optimizer it wraps)."""
        self._patches.uninstall()

    def __enter__(self) -> "LoopIntegration":
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ------------------------------------------------------------ shared replacements

    def _calc_params_l2_norm(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if self.optimizer is None:  # no optimizer to read: the loop's own function
            return self._originals["calc_params_l2_norm"](model, *args, **kwargs)
        if not is_loop_model(model, self.model):
            raise NormOptimError(
                f"calc_params_l2_norm was called with a model that {self.setup_name} did not "
                "build the optimizer for; norm_optim's loop integration serves the training "
                "loop's model only"
            )
        return DeferredParamsNorm(self.calc_params_l2_norm_path)

    def _arm_step(self, iteration: int, reads: Callable[[bool], bool]) -> None:
        """Before the optimizer step whose ``training_log`` call logs ``iteration``: arm it when
        ``reads(first)`` says that log reads the norms (every rank alike; ``first``: this is the
        run's first step). Only with ``install(step_norms=True)``."""
        first, self._first_step = self._first_step, False
        aftermath, self._aftermath = self._aftermath, False
        if self.optimizer is None:
            return
        if aftermath or (self._log.step_norms and reads(first)):
            self.optimizer.measure_next_step(per_param=self._log.per_param or aftermath)
            self._armed_iteration, self._armed_aftermath = iteration, aftermath

    def _training_log(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._log_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        norms: Optional[ParamNorms] = None
        if isinstance(bound.arguments.get("params_norm"), DeferredParamsNorm):
            assert self.optimizer is not None  # the marker is only returned with an optimizer
            if self._reads_params_norm(bound.arguments):
                norms = self._log.read(self.optimizer)  # every rank: one all-reduce
            bound.arguments["params_norm"] = self._log.value(norms)
        step: Optional[StepNorms] = None
        armed = self._armed_iteration
        if armed is not None and armed == self._log_iteration(bound.arguments):
            assert self.optimizer is not None
            self._armed_iteration = None
            try:
                step = self.optimizer.step_norms()  # launched in step(): no collective here
            except NormOptimError:  # the loop skipped the step it was armed for (a rerun)
                step = None
        if step is not None:
            grad_norm = bound.arguments.get("grad_norm")
            if isinstance(grad_norm, float):
                bound.arguments["grad_norm"] = LoggedGradNorm(grad_norm, ratio_note(step))
        result = self._originals["training_log"](*bound.args, **bound.kwargs)
        writers = None
        if (norms is not None and self._log.writes_scalars) or step is not None:
            writers = self._scalar_writers(bound.arguments)
        if writers is not None and norms is not None and self._log.writes_scalars:
            self._log.write(norms, *writers)
        if step is not None:
            if writers is None and self._armed_aftermath:
                # A watch's aftermath: written whatever the interval.
                writers = (self._iteration(bound.arguments), *self._writers(bound.arguments))
            if writers is not None:
                per_param = self._log.per_param or self._armed_aftermath
                write_scalars(step_scalars(step, per_param), *writers)
        if self.optimizer is not None:
            iteration = self._iteration(bound.arguments)
            if self.optimizer.watching is not None:
                self._poll_watch(iteration, bound.arguments)
            if self.audit.due(self.optimizer, iteration):  # every rank alike
                self.audit.run(self.optimizer, iteration, *self._writers(bound.arguments))
        return result

    def _poll_watch(self, iteration: int, arguments: Mapping[str, Any]) -> tuple[Alarm, ...]:
        """After each ``training_log``: feed the loss (where this rank has it), read the
        watch's alarms, say them on the logging rank, write ``watch/alarms``, and arm the next
        step per param after an alarm every rank judged alike (the grads')."""
        assert self.optimizer is not None and self.optimizer.watching is not None
        watch = self.optimizer.watching
        loss = loop_loss(arguments.get("loss_dict"))
        if loss is not None:
            watch.observe_loss(loss)
        alarms = watch.poll(iteration, arm=False)
        if watch.config.arm_after_alarm and any(a.signal != LOSS for a in alarms):
            self._aftermath = True
        if alarms and is_logging_rank():
            say(alarms)
        writers = self._scalar_writers(arguments)
        if alarms and writers is None:
            writers = (iteration, *self._writers(arguments))
        if writers is not None:
            write_scalars({WATCH_TAG: float(len(alarms))}, *writers)
        return alarms

    # ------------------------------------------------------------ checkpoint parity

    def _after_save(self, root: Optional[str], iteration: int, kwargs: Mapping[str, Any]) -> None:
        """After the loop saved iteration ``iteration``'s checkpoint under ``root`` (its save
        function's keyword arguments ``kwargs``), on every rank: the saved weights' norms beside
        a persistent checkpoint."""
        persistent = not kwargs.get("non_persistent_ckpt", False)
        if self.parity is not None and self.optimizer is not None and root and persistent:
            directory = self._checkpoint_directory(root, iteration)
            self.parity.saved(self.optimizer, directory, iteration)
            if self.resume is not None:
                self.resume.saved(self.optimizer, directory, iteration)

    def _after_load(
        self,
        root: Optional[str],
        iteration: int,
        writers: Callable[[], tuple[Any, Any]],
        optimizer_loaded: bool = True,
    ) -> None:
        """Before the first step of a run that loaded iteration ``iteration`` from ``root``, on
        every rank (collectives): the state proven against the saved fingerprints (only the
        weights where the load skipped the optimizer on purpose: ``optimizer_loaded``), the
        watch's statistics restored, the loaded weights' norm compared with the saved one, and
        written to ``writers()`` (TensorBoard, W&B; asked for only then)."""
        if self.parity is not None and self.optimizer is not None and root and iteration:
            directory = self._checkpoint_directory(root, iteration)
            if self.resume is not None:
                self.resume.loaded(
                    self.optimizer, directory, iteration, *writers(), optimizer_loaded
                )
            self.parity.loaded(self.optimizer, directory, iteration, *writers())

    # ------------------------------------------------------------ what each loop says

    def _checkpoint_directory(self, root: str, iteration: int) -> str:
        """The directory the loop saves iteration ``iteration``'s checkpoint in, under ``root``."""
        raise NotImplementedError

    def _log_iteration(self, arguments: Mapping[str, Any]) -> Optional[int]:
        """The iteration this ``training_log`` call logs."""
        value: Optional[int] = arguments.get("iteration")
        return value

    def _reads_params_norm(self, arguments: Mapping[str, Any]) -> bool:
        """Whether this ``training_log`` call prints or writes ``params_norm``: the same answer
        on every rank (the norm is a collective, the print and the writers on one rank)."""
        raise NotImplementedError

    def _scalar_writers(self, arguments: Mapping[str, Any]) -> Optional[tuple[int, Any, Any]]:
        """(iteration, TensorBoard writer, W&B writer) where this call writes the loop's own
        ``params-norm`` scalar, else None (either writer may be None)."""
        raise NotImplementedError

    def _iteration(self, arguments: Mapping[str, Any]) -> int:
        """This ``training_log`` call's iteration (the same on every rank)."""
        raise NotImplementedError

    def _writers(self, arguments: Mapping[str, Any]) -> tuple[Any, Any]:
        """This rank's (TensorBoard writer, W&B writer), either None where it has none."""
        raise NotImplementedError
