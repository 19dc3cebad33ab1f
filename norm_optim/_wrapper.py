"""``NormAwareOptimizer``: a Megatron-core optimizer that also knows its weights' global norm.

The wrapper holds no layout logic: it delegates everything to the wrapped optimizer, keeps a
:class:`~norm_optim.inspection.ParamRegistry` up to date, and asks a
:class:`~norm_optim._norms.reducer.NormReducer` for the norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import torch

from ._audit.run import AuditReport, run_audit
from ._comm import Communicator, ProcessGroup, TorchCommunicator
from ._errors import NormOptimError
from ._norms.reducer import NormReducer, ParamNorms, PendingNorms
from ._megatron import audit_layout, check_reduce_group, rank_coords
from ._counting.ownership import RankCoords
from ._norms.registry import ParamRegistry
from ._resume.fingerprint import StateFingerprint, fingerprint_state
from ._norms.staleness import Staleness
from ._step.measurement import (
    PendingStepNorms,
    StepMeasurement,
    StepNorms,
    WatchedGrads,
    observed_step,
)
from ._step.watch import Watch, WatchConfig
from ._versions import warn_if_untested


@dataclasses.dataclass
class _State:
    """Everything the wrapper itself holds, kept in one object so that no attribute of its own
    can ever be written onto (or read from) the wrapped optimizer by mistake: every other
    attribute, get or set, is the wrapped optimizer's."""

    optimizer: Any
    model: Any
    count_frozen: bool
    group: ProcessGroup
    comm: Communicator
    coords: RankCoords
    staleness: Staleness
    reducer: Optional[NormReducer] = None
    names: Optional[list[tuple[str, bool]]] = None  # gathered per-param names, kept across rebuilds
    armed: Optional[StepMeasurement] = None  # measure_next_step() was called
    measured: Optional[PendingStepNorms] = None  # the last armed step's packet
    watch: Optional[Watch] = None  # watch() was called
    watched_grads: Optional[WatchedGrads] = None  # the watch's reads, for the current reducer
    ratios_judged: Optional[PendingStepNorms] = None  # the measured step the watch has seen
    pg_collection: Any = None  # the audit reads its groups from it too


def _replaces_tensors(name: str) -> Callable[..., Any]:
    """The wrapped optimizer's method ``name``, after which its tensors may be new objects:
    the registry is dropped (and rebuilt at the next call) whatever the method returns."""

    def method(self: "NormAwareOptimizer", *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self._state.optimizer, name)(*args, **kwargs)
        finally:
            self._drop_reducer()

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The wrapped optimizer's ``{name}``; the registry is then rebuilt."
    return method


class NormAwareOptimizer:
    """Wraps a megatron-core optimizer and adds :meth:`param_l2_norm`.

    It behaves as the optimizer it wraps (``step``, ``zero_grad``, state dicts, ``param_groups``,
    ``get_grad_norm``, every attribute; ``isinstance`` checks against the wrapped class pass).

    Args:
        optimizer: the result of ``get_megatron_optimizer(...)`` (a ``ChainedOptimizer`` of
            ``DistributedOptimizer`` / ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``
            leaves, a ``LayerWiseDistributedOptimizer``...), one such leaf, or a plain
            ``torch.optim.Optimizer``.
        model: the model (a module or the list of model chunks). Optional when the optimizer
            knows its chunks (the distributed optimizer does); with it, frozen params (in no
            optimizer) are counted too, as Megatron-LM counts them.
        count_frozen: set False to leave params no optimizer holds out of the norm.
        pg_collection: an explicit megatron ``ProcessGroupCollection`` to read this rank's TP /
            DP coordinates from, instead of megatron's global parallel state.
        group: the process group to reduce over; it must contain every rank (default: all).
        comm: the communication seam (default: ``torch.distributed``); tests pass a fake.
    """

    def __init__(
        self,
        optimizer: Any,
        model: Union[torch.nn.Module, list[torch.nn.Module], None] = None,
        *,
        count_frozen: bool = True,
        pg_collection: Any = None,
        group: ProcessGroup = None,
        comm: Optional[Communicator] = None,
    ) -> None:
        if isinstance(optimizer, NormAwareOptimizer):
            raise TypeError("the optimizer is already a NormAwareOptimizer; wrap it once")
        warn_if_untested()
        comm = comm if comm is not None else TorchCommunicator()
        coords = rank_coords(comm, pg_collection, optimizer)
        check_reduce_group(comm, group, pg_collection, optimizer)
        object.__setattr__(
            self,
            "_state",
            _State(
                optimizer,
                model,
                count_frozen,
                group,
                comm,
                coords,
                Staleness(optimizer),
                pg_collection=pg_collection,
            ),
        )
        self._current_reducer()  # build now: bad input fails at wrap time, not at log time

    # ---------------------------------------------------------------- the norm

    @torch.no_grad()
    def param_l2_norm(self) -> torch.Tensor:
        """Global L2 norm of the model's weights, from the optimizer's fp32 tensors.

        Every rank must call it (it makes one all-reduce). Returns a 0-dim float64 tensor on the
        reduction device; ``float(norm)`` reads it. Equivalent to Megatron-LM's
        ``calc_params_l2_norm(model)``, but each element is counted exactly once in every layout
        and nothing is copied.
        """
        return self._current_reducer().launch().wait().total

    @torch.no_grad()
    def param_l2_norms(self, *, per_param: bool = False) -> ParamNorms:
        """Total, dense and expert norms (and, with ``per_param``, one norm per param name).

        Per-param names are layout-independent (global layer number, global expert index,
        TP/DP shards combined). Still one all-reduce per call; the first ``per_param`` call
        also gathers the names once.
        """
        return self._current_reducer().launch(per_param=per_param).wait()

    @torch.no_grad()
    def param_l2_norms_async(self, *, per_param: bool = False) -> PendingNorms:
        """Launch the sums and the all-reduce and return at once; ``.wait()`` gives the norms."""
        return self._current_reducer().launch(per_param=per_param, async_op=True)

    @torch.no_grad()
    def audit(self) -> AuditReport:
        """Check the copies the norm assumes equal, bitwise: DP×CP and expert-DP replicas of
        every weight and of replicated fp32 mains, (expert-)TP duplicates, tied copies, and on
        every rank each model weight against the rounding of the main it holds.

        A collective: every rank must call it. ``report.ok`` and ``report.findings`` are the
        same on every rank (see ``docs/audit.md``). One pass over the tensors, a few
        collectives sized by the number of params.
        """
        state = self._state
        registry = self._current_reducer().registry
        layout = audit_layout(
            state.comm,
            state.optimizer,
            registry.chunks,
            [r.param for r in registry],
            state.pg_collection,
            registry.descriptor,
        )
        return run_audit(registry.records, layout, state.comm, state.group)

    @torch.no_grad()
    def state_fingerprint(self) -> StateFingerprint:
        """Bitwise, layout-independent fingerprints of the optimizer's whole state: per model
        param, its weight, its fp32 main and every optimizer state tensor, plus the step and
        the loss scale (see ``docs/resume.md``).

        A collective: every rank must call it (one all-reduce of a table of O(params) slots),
        and every rank gets the same result. Compare a saved one with a loaded one with
        :func:`~norm_optim.verify_resume`; save it with :meth:`StateFingerprint.save`.
        """
        state = self._state
        return fingerprint_state(self._current_reducer(), state.coords, state.comm, state.group)

    # ---------------------------------------------------------------- step norms

    @torch.no_grad()
    def measure_next_step(self, *, per_param: bool = False) -> None:
        """Arm the next :meth:`step`: its grads, updates and moments become :meth:`step_norms`.

        Every rank must call it (the armed step makes one extra all-reduce, and a first
        ``per_param`` call gathers the names). A kind whose step cannot be read exactly is refused
        here, before the step, by name. A step that is not armed costs nothing.
        """
        self._state.armed = StepMeasurement(
            self._current_reducer(), self._state.optimizer, per_param
        )
        self._state.measured = None  # step_norms() now waits for this step, never an older one

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``step``: same arguments, same return value, same training.

        When armed by :meth:`measure_next_step`, it also reads the grads before clipping and,
        after the step, launches the one all-reduce of :meth:`step_norms`. When watched
        (:meth:`watch`), it sums and judges the grads before clipping (one all-reduce), and with
        ``skip`` does not apply a step with a spike.
        """
        state = self._state
        measurement, state.armed = state.armed, None
        if measurement is None and state.watch is None:
            return state.optimizer.step(*args, **kwargs)
        reducer = self._current_reducer()
        if measurement is not None and reducer is not measurement.reducer:
            # Tensors replaced since arming (a load).
            measurement = StepMeasurement(reducer, state.optimizer, measurement.per_param)
        watched = self._watched_grads(reducer)
        result = observed_step(state.optimizer, measurement, watched, *args, **kwargs)
        if measurement is not None:
            with torch.no_grad():
                state.measured = measurement.launch()
        return result

    def step_norms(self) -> StepNorms:
        """The :class:`StepNorms` of the last armed step (waits for its all-reduce). A watched
        optimizer's watch judges its per-layer update-to-weight ratios (once per step)."""
        state = self._state
        if state.measured is None:
            raise NormOptimError(
                "no step was measured: call measure_next_step() before step(), on every rank"
            )
        norms = state.measured.wait()
        if state.watch is not None and state.ratios_judged is not state.measured:
            state.ratios_judged = state.measured
            ratios = norms.update_to_weight
            if ratios is not None and not norms.skipped:
                state.watch.observe_ratios(list(ratios), ratios.vector)
        return norms

    # ---------------------------------------------------------------- the watch

    def watch(self, config: Optional[WatchConfig] = None, **options: Any) -> Watch:
        """Watch every later :meth:`step`: its grads (before clipping) in total, per layer and
        per param, judged on the device against their rolling statistics (docs/watch.md).

        Every rank must call it (a watched step makes one all-reduce of the per-param slots; the
        first one gathers the names). Call :meth:`Watch.poll` after steps for the alarms, and
        :meth:`Watch.observe_loss` to watch the loss too.

        Args:
            config: a :class:`~norm_optim.WatchConfig`; or its fields as keyword arguments
                (``k``, ``window``, ``warmup``, ``skip``...).

        Returns:
            The :class:`~norm_optim.Watch` (also :attr:`watching`).
        """
        if config is None:
            config = WatchConfig(**options)
        elif options:
            raise TypeError("pass a WatchConfig or its fields as keywords, not both")
        state = self._state
        # Refuse now, on every rank, a kind whose grads cannot be read (not at the first step).
        reducer = self._current_reducer()
        state.watch = Watch(config, arm=lambda: self.measure_next_step(per_param=True))
        state.watched_grads = WatchedGrads(reducer, state.watch)
        return state.watch

    @property
    def watching(self) -> Optional[Watch]:
        """The :class:`~norm_optim.Watch` of this optimizer, or None."""
        return self._state.watch

    def unwatch(self) -> None:
        """Stop watching (steps cost nothing extra again)."""
        self._state.watch = self._state.watched_grads = None

    def _watched_grads(self, reducer: NormReducer) -> Optional[WatchedGrads]:
        state = self._state
        if state.watch is None:
            return None
        if state.watched_grads is None or state.watched_grads.reducer is not reducer:
            state.watched_grads = WatchedGrads(reducer, state.watch)
        return state.watched_grads

    @property
    def registry(self) -> ParamRegistry:
        """What this rank holds and counts for every model param (inspectable)."""
        return self._current_reducer().registry

    @property
    def wrapped_optimizer(self) -> Any:
        """The optimizer this one wraps."""
        return self._state.optimizer

    def refresh(self) -> None:
        """Rebuild the registry now (after replacing optimizer tensors behind our back)."""
        self._drop_reducer()
        self._current_reducer()

    def _drop_reducer(self) -> None:
        """Forget the registry: the optimizer may have replaced (or freed) its tensors.

        The reducer's plan holds views of the old tensors; dropping it at once lets memory that
        ``offload_to_cpu`` moved away actually be freed. The gathered per-param names stay valid.
        """
        state = self._state
        if state.reducer is not None:
            state.names = state.reducer.names
        state.reducer = None

    def _current_reducer(self) -> NormReducer:
        # Rebuild only when the optimizer replaced its tensors (see norm_optim._norms.staleness).
        state = self._state
        check = state.staleness.check()
        if check.stale or state.reducer is None:
            registry = ParamRegistry(
                state.optimizer,
                state.model,
                coords=state.coords,
                comm=state.comm,
                count_frozen=state.count_frozen,
            )
            # The kernels' one-time costs are paid at the first build, not at every rebuild.
            first_build = not state.staleness.recorded_before
            self._drop_reducer()  # keeps the gathered per-param names
            state.reducer = NormReducer(
                registry, state.comm, state.group, state.names, warm_up=first_build
            )
            state.staleness.record(registry, check)
        return state.reducer

    # ---------------------------------------------------------------- delegation
    # Everything not defined here (step, zero_grad, state_dict, sharded_state_dict,
    # get_grad_norm, ...) reaches the wrapped optimizer through __getattr__. These may replace
    # the optimizer's tensors, so the registry is rebuilt after them:

    load_state_dict = _replaces_tensors("load_state_dict")
    reload_model_params = _replaces_tensors("reload_model_params")
    load_parameter_state = _replaces_tensors("load_parameter_state")
    offload_to_cpu = _replaces_tensors("offload_to_cpu")
    restore_from_cpu = _replaces_tensors("restore_from_cpu")

    @property
    def param_groups(self) -> Any:
        return self._state.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self._state.optimizer.param_groups = value
        self._drop_reducer()

    # isinstance(wrapper, ChainedOptimizer) etc. must keep passing in training code, so
    # ``__class__`` is the wrapped optimizer's; ``type(wrapper)`` is still NormAwareOptimizer.
    # What that implies: ``isinstance`` sees both classes; pickle and ``copy`` would rebuild
    # an object of the wrapped class from the wrapper's fields, so both are refused below
    # (checkpoint the optimizer through ``state_dict()`` / ``sharded_state_dict()``, as megatron
    # does; its optimizers hold process groups and are not picklable either).
    def _wrapped_class(self) -> type:
        return type(self._state.optimizer)

    # Read-only, built with property() rather than the decorator, which mypy refuses over
    # object's writable ``__class__``: no write reaches it (__setattr__ forwards them all).
    __class__ = property(_wrapped_class)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a NormAwareOptimizer cannot be pickled or copied: save the optimizer with "
            "state_dict() / sharded_state_dict() and wrap the restored optimizer again"
        )

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found on the wrapper itself.
        if name == "_state":  # during unpickling-like construction paths: no recursion
            raise AttributeError(name)
        return getattr(self._state.optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "param_groups":
            object.__setattr__(self, name, value)  # the property above
        else:
            setattr(self._state.optimizer, name, value)

    def __repr__(self) -> str:
        return f"NormAwareOptimizer({self._state.optimizer!r})"
