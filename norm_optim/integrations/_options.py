"""What both loops' ``install()`` take: :class:`InstallOptions`."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Mapping, Optional

from .._watch import WatchConfig
from .._wrapper import NormAwareOptimizer
from ._audit_schedule import check_audit_options


@dataclasses.dataclass(frozen=True)
class InstallOptions:
    """What a loop integration's ``install()`` does beyond serving the total params norm: the
    same options for Megatron-LM's (:func:`norm_optim.integrations.megatron_lm.install`) and
    Megatron-Bridge's (:func:`norm_optim.integrations.megatron_bridge.install`) loop.

    ``install(InstallOptions(breakdown=True))`` and ``install(breakdown=True)`` are the same
    call: ``install()`` takes these fields (and :class:`~norm_optim.NormAwareOptimizer`'s
    keyword arguments) by name too, over the fields of the options it is given.

    Attributes:
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
            The loop's own ``grad-norm``, clipping and training are unchanged.
        audit_interval: audit (:meth:`~norm_optim.NormAwareOptimizer.audit`, on every rank)
            every ``audit_interval`` iterations and at the first iteration after each setup
            (after any checkpoint load), after ``training_log``; write the number of findings
            as the TensorBoard / W&B scalar ``params-audit/findings`` (0 when clean). 0 (the
            default) never audits.
        audit_action: ``"warn"``: rank 0 logs the findings with their param names (logger
            ``norm_optim.integrations``, ERROR); ``"raise"``: every rank raises
            :class:`~norm_optim.AuditError`, stopping the run before the bad weights are saved.
        resume_proof: prove every checkpoint load (docs/resume.md). Beside every checkpoint
            the loop saves, write the state's fingerprints (``norm_optim_resume.json``: every
            (param, state) -- weight, fp32 main, each optimizer moment -- bitwise and
            layout-independent, one all-reduce per save), the saved weights' per-layer norms
            (``norm_optim_norms.json``) and, when watched, the watch's statistics; after a
            load, before the first step, compare: global rank 0 logs ``norm_optim resume
            (iteration I): N mismatches...`` (INFO when 0, ERROR naming the pairs otherwise),
            ``resume/mismatches`` and ``params-norm/at-load`` are written, the watch resumes
            with its statistics, and with ``audit_action="raise"`` every rank raises
            :class:`~norm_optim.AuditError`. On by default.
        checkpoint_parity: the 0.4 name of ``resume_proof`` (a ``DeprecationWarning``; removed
            in 0.6.0).
        watch: watch every step (:meth:`~norm_optim.NormAwareOptimizer.watch`; docs/watch.md):
            True, a dict of :class:`~norm_optim.WatchConfig` fields (``{"skip": True}``) or a
            config. Each iteration's grads (before clipping) in total, per layer and per param
            are judged against their rolling statistics (one all-reduce per step, no host sync
            of its own), and the loss where this rank has it; an alarm is a line
            ``norm_optim watch: iteration <N>: ...`` on the last rank (logger
            ``norm_optim.watch``, ERROR) naming the signal, the layer and the param, the scalar
            ``watch/alarms``, and the next step measured per param (its step norms written).
            With ``skip``, a spiking step is not applied (a skipped iteration to the loop).
        wrapper_options: keyword arguments of :class:`~norm_optim.NormAwareOptimizer`
            (``count_frozen``, ``pg_collection``, ``group``, ``comm``) for the optimizer each
            setup builds.
    """

    breakdown: bool = False
    per_param: bool = False
    step_norms: bool = False
    audit_interval: int = 0
    audit_action: str = "warn"
    checkpoint_parity: Optional[bool] = None
    resume_proof: bool = True
    watch: "bool | dict[str, Any] | WatchConfig | None" = False
    wrapper_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.checkpoint_parity is not None:
            warnings.warn(
                "install(checkpoint_parity=...) is now install(resume_proof=...); the old name "
                "is removed in 0.6.0",
                DeprecationWarning,
                stacklevel=4,
            )
            object.__setattr__(self, "resume_proof", bool(self.checkpoint_parity))
            object.__setattr__(self, "checkpoint_parity", None)
        # Bad values fail here, before install() patches anything.
        check_audit_options(self.audit_interval, self.audit_action)
        WatchConfig.of(self.watch)
        unknown = sorted(set(self.wrapper_options) - set(_WRAPPER_KEYWORDS))
        if unknown:
            raise TypeError(
                f"install() got unknown options {unknown}: it takes "
                f"{[f.name for f in dataclasses.fields(self)]} and NormAwareOptimizer's "
                f"{list(_WRAPPER_KEYWORDS)}"
            )
        object.__setattr__(self, "wrapper_options", dict(self.wrapper_options))

    @classmethod
    def of(cls, options: Optional["InstallOptions"], kwargs: Mapping[str, Any]) -> "InstallOptions":
        """What ``install(options, **kwargs)`` was given, as one value: ``options`` (default:
        every default) with the fields that ``kwargs`` names replaced, and its other names added
        to ``wrapper_options``."""
        if options is None:
            options = cls()
        elif not isinstance(options, cls):
            raise TypeError(f"options must be an InstallOptions, got {type(options).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        own = {k: v for k, v in kwargs.items() if k in fields}
        wrapper = {k: v for k, v in kwargs.items() if k not in fields}
        if wrapper:
            own["wrapper_options"] = {
                **own.get("wrapper_options", options.wrapper_options),
                **wrapper,
            }
        return dataclasses.replace(options, **own) if own else options

    @property
    def watch_config(self) -> Optional[WatchConfig]:
        """:attr:`watch` as a :class:`~norm_optim.WatchConfig` (None: no watch)."""
        return WatchConfig.of(self.watch)

    @property
    def arms_steps(self) -> bool:
        """Whether the loop's step function is patched: to arm steps (step norms, a watch's
        aftermath)."""
        return self.step_norms or self.watch_config is not None


# NormAwareOptimizer's keyword arguments: what install() passes on to it.
_WRAPPER_KEYWORDS = tuple(
    name
    for name, p in inspect.signature(NormAwareOptimizer.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)
