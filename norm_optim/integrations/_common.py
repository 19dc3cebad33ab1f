"""What the loop integrations share: the skeleton of an installed integration
(:class:`LoopIntegration`: the patched names, ``uninstall``, the deferred ``calc_params_l2_norm``
and the ``training_log`` that reads the norm only where it is logged), the logged value and the
scalars written next to the loops' own ``params-norm``, the options both ``install()`` take
(:class:`InstallOptions`) and where they say what they find (:data:`LOGGER`). Each loop's module
holds only what differs: which names it patches, how its optimizer is built and wrapped, and
when its ``training_log`` prints or writes the norm."""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
import warnings
from types import ModuleType
from typing import Any, Callable, Mapping, Optional, Sequence

from .._comm import TorchCommunicator
from .._findings import AuditError, AuditReport
from .._errors import NormOptimError
from .._moved import moved_names
from .._norm import NamedNorms, ParamNorms
from .._step import StepNorms
from .._patching import Patch, PatchSet
from .._watch import LOSS, Alarm, WatchConfig, say
from .._wrapper import NormAwareOptimizer
from ._resume import ResumeProof

LOGGER = logging.getLogger("norm_optim.integrations")
"""Where the loop integrations say what they find, on one rank (global rank 0): an audit's
findings and a checkpoint load's differing layers at ERROR (as the watch's alarms on
``norm_optim.watch``: Megatron-Bridge drops every WARNING record by default, and Python shows
ERROR without any logging set up), the norm at a load that matches at INFO. Both are children of
``norm_optim``: configure, redirect or silence them there."""


class LoggedParamsNorm(float):
    """The total params norm (a ``float``: TensorBoard / W&B get the total) that also shows the
    dense and expert norms, and the params that grew fastest, wherever it is formatted.

    Megatron-LM's and Megatron-Bridge's ``training_log`` print
    ``f' params norm: {params_norm:.3f} |'``; with this value the line reads
    `` params norm: 20.017 | params norm dense: 18.305 | params norm expert: 8.100 |``
    (``breakdown``), and with ``per_param`` ends in
    `` | fastest-growing params: decoder.layers.1.mlp.linear_fc1.weight x1.0123, ... |``.
    """

    dense: Optional[float]
    expert: Optional[float]
    growing: tuple[tuple[str, float], ...]

    def __new__(
        cls,
        total: float,
        dense: Optional[float] = None,
        expert: Optional[float] = None,
        growing: Sequence[tuple[str, float]] = (),
    ) -> "LoggedParamsNorm":
        value = super().__new__(cls, total)
        value.dense, value.expert, value.growing = dense, expert, tuple(growing)
        return value

    def __format__(self, spec: str) -> str:
        parts = [float.__format__(self, spec)]
        if self.dense is not None and self.expert is not None:
            parts += [
                f"params norm dense: {self.dense:{spec}}",
                f"params norm expert: {self.expert:{spec}}",
            ]
        if self.growing:
            parts.append(
                "fastest-growing params: "
                + ", ".join(f"{name} x{ratio:.4f}" for name, ratio in self.growing)
            )
        return " | ".join(parts)


def moved_loop_names(module: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of each loop integration's module: the public names that were
    renamed, served with a ``DeprecationWarning`` (the same in every integration)."""
    return moved_names(
        module,
        {"ParamsNormWithBreakdown": ("0.3.0", "LoggedParamsNorm", lambda: LoggedParamsNorm)},
    )


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


class DeferredParamsNorm:
    """What a patched ``calc_params_l2_norm`` returns: nothing is computed until the loop's
    ``training_log`` knows, on every rank alike, that the value is read.

    Args:
        patched: the dotted name of the function it stands for (for the error message).
    """

    def __init__(self, patched: str) -> None:
        self._patched = patched

    def __float__(self) -> float:
        raise NormOptimError(
            f"norm_optim defers {self._patched} to training_log, which reads the norm on every "
            "rank at log intervals; elsewhere call integration.optimizer.param_l2_norm() on "
            "every rank"
        )

    def __repr__(self) -> str:
        return "<params norm: read by training_log at log intervals>"


TAG = "params-norm"
"""The scalar the loops write themselves; norm_optim's own scalars are named under it."""


def scalars(norms: ParamNorms, breakdown: bool) -> dict[str, float]:
    """The scalars norm_optim writes next to the loop's own ``params-norm``.

    ``params-norm-dense`` / ``params-norm-expert`` with ``breakdown``; with per-param norms,
    ``params-norm/param/<name>`` (layout-independent name), ``params-norm/layer/<layer>`` and
    ``params-norm/expert/<layer>.<expert>`` (:mod:`norm_optim._megatron.naming`). Reads every value in
    one host transfer per mapping.
    """
    out: dict[str, float] = {}
    if breakdown:
        out[f"{TAG}-dense"], out[f"{TAG}-expert"] = float(norms.dense), float(norms.expert)
    out.update(named_scalars(TAG, norms))
    return out


def named_scalars(tag: str, norms: ParamNorms) -> dict[str, float]:
    """``<tag>/param/<name>``, ``<tag>/layer/<layer>`` and ``<tag>/expert/<layer>.<expert>`` of
    the per-param, per-layer and per-expert norms that ``norms`` holds (none without them)."""
    out: dict[str, float] = {}
    for kind, named in (
        ("param", norms.per_param),
        ("layer", norms.per_layer),
        ("expert", norms.per_expert),
    ):
        if named is not None:
            out.update(zip((f"{tag}/{kind}/{name}" for name in named), _values(named)))
    return out


def _values(named: Mapping[str, Any]) -> list[float]:
    if isinstance(named, NamedNorms):
        return named.vector.tolist()
    return [float(v) for v in named.values()]


class ParamsNormLog:
    """What a loop integration logs of the params norm, beyond the total: one per integration.

    Args:
        breakdown: the dense / expert norms in the log line and as scalars.
        per_param: per-param, per-layer and per-expert scalars, and the ``top_k`` params whose
            norm grew fastest since the previous read (the previous logged iteration) in the
            log line.
    """

    def __init__(
        self,
        breakdown: bool,
        per_param: bool,
        top_k: int = 3,
        step_norms: bool = False,
        watch: Optional[WatchConfig] = None,
    ) -> None:
        self.breakdown, self.per_param, self.top_k = breakdown, per_param, top_k
        self.step_norms, self.watch = step_norms, watch
        self._previous: Optional[ParamNorms] = None

    @property
    def writes_scalars(self) -> bool:
        return self.breakdown or self.per_param

    def read(self, optimizer: Any) -> ParamNorms:
        """The norms, from every rank alike (one all-reduce)."""
        norms: ParamNorms = optimizer.param_l2_norms(per_param=self.per_param)
        return norms

    def value(self, norms: Optional[ParamNorms]) -> Optional[float]:
        """What a loop's ``training_log`` gets as ``params_norm``: None where it does not read
        it, else the total (a :class:`LoggedParamsNorm` with ``breakdown`` or ``per_param``)."""
        if norms is None:
            return None
        if not self.writes_scalars:
            return float(norms.total)
        growing: list[tuple[str, float]] = []
        if self.per_param:
            if self._previous is not None:
                growing = norms.fastest_growing(self._previous, self.top_k)
            self._previous = norms
        dense, expert = (
            (float(norms.dense), float(norms.expert)) if self.breakdown else (None, None)
        )
        return LoggedParamsNorm(float(norms.total), dense, expert, growing)

    def write(self, norms: ParamNorms, iteration: int, tensorboard: Any, wandb: Any) -> None:
        """:func:`scalars` to the loop's TensorBoard / W&B writers (either may be None)."""
        write_scalars(scalars(norms, self.breakdown), iteration, tensorboard, wandb)


def write_scalars(values: dict[str, float], iteration: int, tensorboard: Any, wandb: Any) -> None:
    """``values`` to the loop's TensorBoard / W&B writers (either may be None)."""
    if tensorboard is not None:
        for tag, value in values.items():
            tensorboard.add_scalar(tag, value, iteration)
    if wandb is not None:
        wandb.log(values, iteration)


STEP_TAGS = {
    "grads": "grads-norm",
    "updates": "updates-norm",
    "exp_avg": "exp-avg-norm",
    "exp_avg_sq": "exp-avg-sq-norm",
}
"""The scalar of each :class:`~norm_optim.StepNorms` quantity (beside Megatron's ``grad-norm``)."""
RATIO_TAG = "update-to-weight"


def step_scalars(step: StepNorms, per_param: bool) -> dict[str, float]:
    """The scalars of one measured step: each quantity's total (``grads-norm`` ...; for the
    grads, that of the main clip group, as Megatron's ``grad-norm``, and ``grads-norm/<group>``
    of each group Megatron clips on its own, e.g. ``grads-norm/mtp``), and with
    ``per_param`` the grads' and updates' per-param / per-layer / per-expert norms and
    ``update-to-weight/layer/<layer>``."""
    out: dict[str, float] = {}
    for field, tag in STEP_TAGS.items():
        norms: Optional[ParamNorms] = getattr(step, field)
        if norms is None:
            continue
        out[tag] = float(norms.total)
        if field == "grads" and step.clip_groups:
            # Megatron's grad-norm is its main group's; each separately clipped group beside it.
            for group, value in step.clip_groups.items():
                out[tag if group == "main" else f"{tag}/{group}"] = float(value)
        if per_param and field in ("grads", "updates"):
            out.update(named_scalars(tag, norms))
    if step.update_to_weight is not None:
        ratios = step.update_to_weight
        out.update(zip((f"{RATIO_TAG}/layer/{n}" for n in ratios), _values(ratios)))
    return out


class LoggedGradNorm(float):
    """Megatron's grad norm (the ``float`` it logs and writes, unchanged) that also shows the
    measured step's update-to-weight ratio in the log line:
    `` grad norm: 1.234 | update/weight: 1.2e-03 (largest: layer 3 2.1e-03) |``."""

    note: str

    def __new__(cls, value: float, note: str) -> "LoggedGradNorm":
        out = super().__new__(cls, value)
        out.note = note
        return out

    def __format__(self, spec: str) -> str:
        return f"{float.__format__(self, spec)} | {self.note}"


def ratio_note(step: StepNorms) -> str:
    """The log line's field: the total update-to-weight ratio, and the layer of the largest."""
    note = f"update/weight: {float(step.update_to_weight_total):.2e}"
    ratios = step.update_to_weight
    if ratios is not None and len(ratios):
        values = _values(ratios)
        layer, value = max(zip(ratios, values), key=lambda kv: kv[1])
        note += f" (largest: layer {layer} {value:.2e})"
    return note


WATCH_TAG = "watch/alarms"
"""The scalar of the watch: the number of alarms at an iteration (0 at logged iterations)."""


def loop_loss(loss_dict: Any) -> Optional[float]:
    """The loss in a Megatron loop's ``training_log`` ``loss_dict`` (``lm loss`` or its first
    entry; a ``[sum, count]`` pair is divided), or None where this rank has none (every stage
    but the last)."""
    if not isinstance(loss_dict, Mapping) or not loss_dict:
        return None
    value = loss_dict.get("lm loss", next(iter(loss_dict.values())))
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return float(value[0]) / float(value[1])
    if hasattr(value, "numel") and value.numel() == 2:
        return float(value.reshape(-1)[0] / value.reshape(-1)[1])
    return float(value)


AUDIT_TAG = "params-audit/findings"
"""The scalar written at each audit: the number of findings (0 when clean)."""
AUDIT_ACTIONS = ("warn", "raise")
KEPT_REPORTS = 16
"""How many audits :attr:`AuditSchedule.reports` remembers (the latest)."""


def check_audit_options(interval: Any, action: Any) -> None:
    """``audit_interval`` and ``audit_action``, checked (ValueError naming the bad one)."""
    if not isinstance(interval, int) or interval < 0:
        raise ValueError(f"audit_interval must be an int >= 0, got {interval!r}")
    if action not in AUDIT_ACTIONS:
        raise ValueError(f"audit_action must be one of {AUDIT_ACTIONS}, got {action!r}")


class AuditSchedule:
    """When a loop integration audits (:meth:`~norm_optim.NormAwareOptimizer.audit`) and what
    it does with findings: one per integration.

    Args:
        interval: audit every ``interval`` iterations, and at the first logged iteration after
            each setup (so after every checkpoint load); 0 never.
        action: ``"warn"``: rank 0 logs the findings (:data:`LOGGER`, ERROR), the run goes on;
            ``"raise"``: every rank raises :class:`~norm_optim.AuditError` (the report is the
            same everywhere), so the run stops before the bad weights are saved.

    Attributes:
        reports: ``(iteration, number of findings)`` of the latest :data:`KEPT_REPORTS` audits,
            oldest first (a bounded deque: a long run keeps no more); ``reports[-1]`` is the
            last audit's.
        audits: how many audits ran in all.
    """

    def __init__(self, interval: int, action: str) -> None:
        check_audit_options(interval, action)
        self.interval, self.action = interval, action
        self._audited: Optional[Any] = None  # the optimizer audited last (a new setup resets)
        self.reports: collections.deque[tuple[int, int]] = collections.deque(maxlen=KEPT_REPORTS)
        self.audits = 0

    def due(self, optimizer: Any, iteration: int) -> bool:
        """The same answer on every rank (the audit is a collective)."""
        if self.interval == 0:
            return False
        return optimizer is not self._audited or iteration % self.interval == 0

    def run(self, optimizer: Any, iteration: int, tensorboard: Any, wandb: Any) -> AuditReport:
        """Audit on every rank; write the count, print or raise the findings."""
        report: AuditReport = optimizer.audit()
        self._audited = optimizer
        self.reports.append((iteration, len(report.findings)))
        self.audits += 1
        if tensorboard is not None:
            tensorboard.add_scalar(AUDIT_TAG, len(report.findings), iteration)
        if wandb is not None:
            wandb.log({AUDIT_TAG: len(report.findings)}, iteration)
        if report.findings:
            message = f"iteration {iteration}: {report.summary()}"
            if self.action == "raise":
                raise AuditError(message)
            if _global_rank() == 0:
                LOGGER.error("norm_optim %s", message)
        return report


AT_LOAD_TAG = "params-norm/at-load"
"""The scalar written once after a checkpoint load: the loaded weights' norm."""
NORMS_FILE = "norm_optim_norms.json"
"""Written beside each checkpoint: the saved weights' total and per-layer norms."""
SHOWN_LAYERS = 8
"""How many differing layers a load's verdict names (the rest are counted)."""


class CheckpointParity:
    """The saved weights' per-layer norms beside each checkpoint, compared at load.

    At each save, every rank reads ``param_l2_norms(per_param=True)`` (one all-reduce) and
    rank 0 writes :data:`NORMS_FILE` in the checkpoint's directory. After a load, every rank
    reads the loaded weights' norms once, before the first step (a log line and the scalar
    :data:`AT_LOAD_TAG`), and global rank 0 compares them per layer with the file, when there
    is one, and broadcasts its verdict, so every rank decides alike.

    Args:
        action: ``"warn"`` (rank 0 logs the layers that differ, :data:`LOGGER` at ERROR) or
            ``"raise"`` (every rank raises :class:`~norm_optim.AuditError`). A load that matches
            is logged at INFO.
        rel: the relative difference above which a layer's norm differs.
    """

    def __init__(self, action: str, rel: float = 1e-6) -> None:
        if action not in AUDIT_ACTIONS:
            raise ValueError(f"audit_action must be one of {AUDIT_ACTIONS}, got {action!r}")
        self.action, self.rel = action, rel
        self.at_load: Optional[dict[str, Any]] = None  # what the last load found

    @staticmethod
    def _norms(optimizer: Any) -> dict[str, Any]:
        norms: ParamNorms = optimizer.param_l2_norms(per_param=True)
        per_layer = norms.per_layer or {}
        return {"total": float(norms.total), "per_layer": dict(zip(per_layer, _values(per_layer)))}

    def saved(self, optimizer: Any, directory: str, iteration: int) -> None:
        """After a save, on every rank."""
        import json
        import os

        norms = dict(self._norms(optimizer), iteration=iteration)
        if _global_rank() == 0:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, NORMS_FILE), "w", encoding="utf-8") as out:
                json.dump(norms, out, indent=1, sort_keys=True)

    def _compare(self, path: str, norms: dict[str, Any]) -> dict[str, Any]:
        """On the one reading rank: the saved total (None without a file) and the layers whose
        norm differs (the first :data:`SHOWN_LAYERS`, and how many): bounded, to broadcast."""
        import json
        import os

        if not os.path.exists(path):
            return {"saved_total": None, "differ": [], "count": 0}
        with open(path, encoding="utf-8") as inp:
            saved = json.load(inp)
        differ: list[str] = []
        for name in sorted(set(saved["per_layer"]) | set(norms["per_layer"])):
            a, b = saved["per_layer"].get(name), norms["per_layer"].get(name)
            if a is None or b is None or abs(a - b) > self.rel * max(abs(a), abs(b)):
                differ.append(name)
        shown = differ[:SHOWN_LAYERS]
        return {"saved_total": float(saved["total"]), "differ": shown, "count": len(differ)}

    def loaded(
        self, optimizer: Any, directory: str, iteration: int, tensorboard: Any, wandb: Any
    ) -> dict[str, Any]:
        """After a load, before the first step, on every rank: the norm, and the layers whose
        norm differs from what was saved (raised with ``"raise"``). Global rank 0 alone reads
        the file and compares; the others get its bounded verdict by one broadcast."""
        import os

        norms = self._norms(optimizer)
        verdict = None
        if _global_rank() == 0:  # one reader: not 16,384 opens of one file at load
            verdict = self._compare(os.path.join(directory, NORMS_FILE), norms)
        comm = optimizer._state.comm if isinstance(optimizer, NormAwareOptimizer) else None
        verdict = (comm or TorchCommunicator()).broadcast_object(verdict, 0, None)
        saved, differ, count = verdict["saved_total"], verdict["differ"], verdict["count"]
        self.at_load = dict(
            norms,
            iteration=iteration,
            compared=saved is not None,
            differ=differ,
            differ_count=count,
        )
        if tensorboard is not None:
            tensorboard.add_scalar(AT_LOAD_TAG, norms["total"], iteration)
        if wandb is not None:
            wandb.log({AT_LOAD_TAG: norms["total"]}, iteration)
        line = f"norm_optim: params norm at load (iteration {iteration}): {norms['total']:.6f}"
        if saved is None:
            line += " (no saved norms beside the checkpoint to compare with)"
        elif differ:
            line += (
                f"; differs from the saved weights' in {count} layers: {differ}"
                f" (saved total {saved:.6f})"
            )
        else:
            line += "; every layer equals the saved weights'"
        if differ and self.action == "raise":
            raise AuditError(line)
        if _global_rank() == 0:
            LOGGER.log(logging.ERROR if differ else logging.INFO, "%s", line)
        return self.at_load


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_logging_rank() -> bool:
    """The rank Megatron's loops print their log line on: the last one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def is_loop_model(model: Any, chunks: Optional[list[Any]]) -> bool:
    """Whether ``model`` (a chunk or a list of them) is exactly the loop's model ``chunks``:
    the deferred norm stands for the wrapped optimizer's model, and no other."""
    given = model if isinstance(model, list) else [model]
    return (
        chunks is not None
        and len(given) == len(chunks)
        and all(a is b for a, b in zip(given, chunks))
    )


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


def missing_parameters(label: str, function: Callable[..., Any], names: Sequence[str]) -> list[str]:
    """``label(name=...)`` for each of ``names`` that ``function`` does not take."""
    params = inspect.signature(function).parameters
    return [f"{label}({name}=...)" for name in names if name not in params]


def missing_hooks(
    prefix: str, module: ModuleType, names: Sequence[str], log_params: Sequence[str] = ()
) -> list[str]:
    """What a loop's ``module`` lacks of what an integration patches: ``<prefix><name>`` for
    each of ``names`` it has no function of, else ``<prefix>training_log(<param>=...)`` for
    each of ``log_params`` its ``training_log`` does not take."""
    missing = [f"{prefix}{name}" for name in names if not callable(getattr(module, name, None))]
    if not missing and log_params:
        missing = missing_parameters(f"{prefix}training_log", module.training_log, log_params)
    return missing


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
        if alarms and _is_logging_rank():
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
