"""The watch: catch a spike in the step it happens, and name the layer and param that moved.

Every watched ``step()`` sums the squares of the grads the step reads (after unscaling, before
clipping) into the per-param slots of the weight norm, and reduces them in **one** all-reduce of
that slot vector (8 bytes per param name: the model's size, never the world's). From it, on the
device: the grad norm in total, per layer and per param. Each of those signals has a rolling
window of its last values (:class:`RollingStats`); a total or per-layer value beyond
``mean + k·σ`` of the window before it is a spike, named by the layer and the param whose value
is furthest above its own window; a non-finite value is named by the params it is in. Nothing is
read on the host until :meth:`Watch.poll` (or, with ``skip``, the step's verdict) asks for it.

Defaults (:class:`WatchConfig`) follow OLMo-core's ``SkipStepOptimizer``: ``k = 6`` over a window
of 128 steps, no verdict before half a window (64 steps) has been seen. See docs/watch.md.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

import torch

from .watch_config import WatchConfig as WatchConfig
from .watch_signals import (
    BEST,
    EXCESS,
    LAYER,
    MEAN,
    NON_FINITE,
    PARAM,
    STD,
    VALUE,
    WIDTH,
    FLAG,
    GRADS as GRADS,
    GradsSignals,
    JudgedStep,
    RollingStats,
)

LOGGER = logging.getLogger("norm_optim.watch")
"""Where alarms are said (one line each, starting ``norm_optim watch:``)."""

LOSS = "loss"
RATIO = "update-to-weight"


@dataclasses.dataclass(frozen=True)
class Alarm:
    """One watched step with a spike or a non-finite grad (the same on every rank).

    Attributes:
        iteration: the loop's iteration (or the watch's own step count) of the step.
        signal: the signal with the largest excess, e.g. ``grads-norm/layer/3``, ``loss``;
            ``grads-norm`` for non-finite grads.
        value, mean, std: its value and the rolling mean and σ it was judged against.
        excess: ``(value - mean) / std`` (inf for a non-finite value).
        layer: the layer whose grads norm has the largest excess (None: not grads).
        param: the param whose grads norm has the largest excess (None: not grads).
        non_finite: the params with non-finite grads (at most ``max_names``).
        non_finite_count: how many params have non-finite grads.
        skipped: the step was not applied (``skip``).
    """

    iteration: int
    signal: str
    value: float
    mean: float
    std: float
    excess: float
    layer: Optional[str] = None
    param: Optional[str] = None
    non_finite: tuple[str, ...] = ()
    non_finite_count: int = 0
    skipped: bool = False

    def __str__(self) -> str:
        if self.non_finite_count:
            more = self.non_finite_count - len(self.non_finite)
            what = (
                f"non-finite grads in {self.non_finite_count} params: "
                + ", ".join(self.non_finite)
                + (f" and {more} more" if more > 0 else "")
            )
        else:
            what = (
                f"{self.signal} spiked to {self.value:.6g} ({self.excess:.1f}σ above its rolling "
                f"mean {self.mean:.6g}, σ {self.std:.3g})"
            )
        where = []
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        if self.param is not None:
            where.append(f"param {self.param}")
        where_text = f"; largest excess: {', '.join(where)}" if where else ""
        tail = "; step skipped" if self.skipped else ""
        return f"norm_optim watch: iteration {self.iteration}: {what}{where_text}{tail}"


class Watch:
    """The watch of one :class:`~norm_optim.NormAwareOptimizer` (see the module docstring).

    Made by :meth:`~norm_optim.NormAwareOptimizer.watch`; every later ``step()`` is watched.
    Call :meth:`poll` after each step (a loop integration does) to get the alarms; feed the
    loss with :meth:`observe_loss`.
    """

    def __init__(self, config: WatchConfig, arm: Callable[[], None]) -> None:
        self.config = config
        self._arm = arm
        self._grads: Optional[GradsSignals] = None
        self._key: Any = None  # the reducer's per-param slots the grads signals were built for
        self._loss: Optional[RollingStats] = None
        self._ratios: Optional[RollingStats] = None
        self._ratio_names: tuple[str, ...] = ()
        # What is not polled yet is bounded, whatever the run's length: poll at least once per
        # window, or the oldest steps are dropped.
        self._pending: collections.deque[JudgedStep] = collections.deque(maxlen=config.window)
        # Loss / ratio summaries, at most one of each per step: (summary, signal, step).
        self._extra: collections.deque[tuple[torch.Tensor, str, int]] = collections.deque(
            maxlen=2 * config.window
        )
        # Saved statistics (load_state_dict) not yet taken: grads signals are built at the
        # first watched step, when their names are known.
        self._restored: dict[str, Any] = {}
        self.steps = 0
        """Watched steps so far (the iteration of an alarm when the caller names none)."""
        self.alarms_total = 0
        self.last_alarms: tuple[Alarm, ...] = ()

    # ------------------------------------------------------------ grads, every step

    def judge_grads(self, squares: torch.Tensor, slots: Any, device: torch.device) -> "JudgedStep":
        """From the all-reduced per-param sums of squares of a step's grads (dense, expert,
        then one slot per param name; any slot after those is ignored): judge every grads
        signal and queue what poll() reads, on the device (no host sync). The same two dozen
        ops whatever the number of params; the summary is made at poll()."""
        self.steps += 1
        if self._grads is None or self._key is not slots:
            self._grads = GradsSignals(slots, self.config, device)
            self._key = slots
            self._take_restored(GRADS, self._grads.stats, self._grads_names())
        judged = self._grads(squares)
        self._pending.append(judged)
        return judged

    def mark_skipped(self) -> None:
        """The last judged step was not applied."""
        self._pending[-1] = dataclasses.replace(self._pending[-1], skipped=True)

    def _summary(
        self,
        excess: torch.Tensor,
        x: torch.Tensor,
        mean: torch.Tensor,
        std: torch.Tensor,
        non_finite: torch.Tensor,
    ) -> torch.Tensor:
        best = excess.argmax()
        spike = excess[best] > self.config.k
        # -1 where nothing is named (layer, param), filled where it is made: no value from the
        # host written into it afterwards.
        summary = torch.full((WIDTH,), -1.0, dtype=torch.float64, device=x.device)
        summary[FLAG] = (spike | non_finite).double()
        summary[NON_FINITE] = non_finite.double()
        summary[BEST] = best
        summary[VALUE], summary[MEAN], summary[STD] = x[best], mean[best], std[best]
        summary[EXCESS] = excess[best]
        return summary

    # ------------------------------------------------------------ other signals

    def observe_loss(self, loss: Any) -> None:
        """Judge a step's loss (a float or a 0-dim tensor) against its rolling window; call it
        once per step, on the ranks that have the loss (Megatron's loops: the last pipeline
        stage). A loss spike is an alarm on those ranks; it never arms or skips a step, which
        every rank must decide alike from the grads (see docs/watch.md)."""
        value = torch.as_tensor(loss, dtype=torch.float64).reshape(1)
        if self._loss is None:
            self._loss = RollingStats(1, self.config, value.device)
            self._take_restored(LOSS, self._loss, (LOSS,))
        excess, mean, std = self._loss.judge(value)
        self._extra.append(
            (self._summary(excess, value, mean, std, ~torch.isfinite(value[0])), LOSS, self.steps)
        )

    def observe_ratios(self, names: Sequence[str], ratios: torch.Tensor) -> None:
        """Judge the per-layer update-to-weight ratios of a measured step (armed steps only)."""
        names = tuple(names)
        if self._ratios is None or names != self._ratio_names:
            self._ratios = RollingStats(len(names), self.config, ratios.device)
            self._ratio_names = names
            self._take_restored(RATIO, self._ratios, names)
        if not names:
            return
        x = ratios.to(torch.float64)
        excess, mean, std = self._ratios.judge(x)
        summary = self._summary(excess, x, mean, std, torch.zeros((), dtype=torch.bool))
        self._extra.append((summary, RATIO, self.steps))

    # ------------------------------------------------------------ across a restart

    def state_dict(self) -> dict[str, Any]:
        """The rolling statistics (by signal name: global, the same on any layout) and the
        counts, for a checkpoint. The loss's are on the ranks that observe the loss only."""
        state: dict[str, Any] = {
            "steps": self.steps,
            "alarms_total": self.alarms_total,
            "window": self.config.window,
        }
        built = (
            (GRADS, None if self._grads is None else self._grads.stats, self._grads_names()),
            (LOSS, self._loss, (LOSS,)),
            (RATIO, self._ratios, self._ratio_names),
        )
        for key, stats, names in built:
            if stats is not None:
                state[key] = stats.state(names)
            elif key in self._restored:  # restored, not used yet: keep it for the next save
                state[key] = self._restored[key]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take saved statistics: each signal's window is restored when the watch first sees
        that signal (the grads' at the next watched step), so the steps after a resume are
        judged as they would have been without the restart."""
        self.steps = int(state.get("steps", 0))
        self.alarms_total = int(state.get("alarms_total", 0))
        self._restored = {k: state[k] for k in (GRADS, LOSS, RATIO) if k in state}
        self._grads, self._loss, self._ratios = None, None, None
        self._key, self._ratio_names = None, ()

    def _take_restored(self, key: str, stats: RollingStats, names: Sequence[str]) -> None:
        saved = self._restored.pop(key, None)
        if saved is not None and not stats.restore(saved, names):
            LOGGER.info(
                "norm_optim watch: the saved %s statistics are for other signals (another "
                "model?): they start afresh",
                key,
            )

    def _grads_names(self) -> tuple[str, ...]:
        if self._grads is None:
            return ()
        signals = self._grads.signals
        return tuple(signals.name(i) for i in range(1 + len(signals.layers) + len(signals.params)))

    # ------------------------------------------------------------ reading

    def poll(self, iteration: Optional[int] = None, arm: bool = True) -> tuple[Alarm, ...]:
        """The alarms of every step judged since the last poll (one host transfer; :func:`say`
        writes them to :data:`LOGGER`). Call it on every rank alike.

        Args:
            iteration: the loop's iteration of the last step (default: the watch's own count);
                earlier unpolled steps are numbered back from it.
            arm: after an alarm of the grads or the ratios, arm the next step per param (with
                ``arm_after_alarm``); a loop integration arms it itself.
        """
        pending, extra = list(self._pending), list(self._extra)
        self._pending.clear()
        self._extra.clear()
        if not pending and not extra:
            self.last_alarms = ()
            return ()
        last = self.steps if iteration is None else int(iteration)
        offset = last - self.steps
        summaries = []
        if pending:
            assert self._grads is not None
            n_layers = len(self._grads.signals.layers)
            summaries = [g.summary(self.config.k, n_layers) for g in pending]
        rows = torch.stack(summaries + [s for s, _, _ in extra]).tolist()
        alarms: list[Alarm] = []
        for i, (row, grads) in enumerate(zip(rows, pending)):
            if not row[FLAG]:
                continue
            step = self.steps - len(pending) + 1 + i + offset
            alarms.append(self._grads_alarm(step, row, grads))
        for row, (_, signal, step) in zip(rows[len(pending) :], extra):
            if row[FLAG]:
                name = signal
                if signal == RATIO:
                    name = f"{RATIO}/layer/{self._ratio_names[int(row[BEST])]}"
                alarms.append(Alarm(step + offset, name, *_judged(row)))
        self.alarms_total += len(alarms)
        self.last_alarms = tuple(alarms)
        # Only what every rank judged alike (the reduced grads and ratios) arms a step: a
        # collective. The loss is a rank's own.
        if arm and self.config.arm_after_alarm and any(a.signal != LOSS for a in alarms):
            self._arm()
        return self.last_alarms

    def _grads_alarm(self, step: int, row: list[float], grads: JudgedStep) -> Alarm:
        assert self._grads is not None
        signals = self._grads.signals
        names: tuple[str, ...] = ()
        count = 0
        if row[NON_FINITE]:
            where = grads.non_finite[1 + len(signals.layers) :].nonzero().flatten()
            count = int(where.numel())
            names = tuple(signals.params[int(j)] for j in where[: self.config.max_names])
        param = signals.params[int(row[PARAM])] if row[PARAM] >= 0 else None
        layer = signals.layers[int(row[LAYER])] if row[LAYER] >= 0 else None
        return Alarm(
            step,
            signals.name(int(row[BEST])),
            *_judged(row),
            layer=layer,
            param=param,
            non_finite=names,
            non_finite_count=count,
            skipped=grads.skipped,
        )


def _judged(row: list[float]) -> tuple[float, float, float, float]:
    return row[VALUE], row[MEAN], row[STD], row[EXCESS]


def say(alarms: Sequence[Alarm]) -> None:
    """One line per alarm on :data:`LOGGER`, at ERROR: Megatron's loops set up logging with a
    filter that drops every WARNING record (Megatron-Bridge's ``logger.filter_warnings``, on by
    default), and an alarm must not vanish there; with no logging set up at all, Python still
    shows ERROR on stderr. Configure, redirect or silence it with ``logging`` (``norm_optim.watch``
    or its parent ``norm_optim``); norm_optim adds no handler."""
    for alarm in alarms:
        LOGGER.error("%s", alarm)
