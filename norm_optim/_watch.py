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
import math
from typing import Any, Callable, Optional, Sequence

import torch


LOGGER = logging.getLogger("norm_optim.watch")
"""Where alarms are said (one line each, starting ``norm_optim watch:``)."""

GRADS = "grads-norm"
"""The name of the grads signals: ``grads-norm`` (total), ``grads-norm/layer/<layer>``,
``grads-norm/param/<name>`` (the same tags as the step norms' scalars)."""
LOSS = "loss"
RATIO = "update-to-weight"


@dataclasses.dataclass(frozen=True)
class WatchConfig:
    """How the watch decides that a value is a spike.

    Attributes:
        k: a value more than ``k`` rolling standard deviations above the rolling mean of the
            values before it is a spike (OLMo-core: 6).
        window: how many past values the mean and σ are taken over (OLMo-core: 128).
        warmup: no verdict before this many values were seen (OLMo-core: half the window).
        min_rel_std: σ is taken as at least this fraction of the mean, so that a signal that
            has been almost constant does not alarm on a tiny move: with the defaults a value
            must also be 6 % above its mean.
        skip: do not apply a step with a spike (or a non-finite grad): the weights, moments
            and the optimizer's step count stay as they were, and Megatron counts a skipped
            iteration. Off by default: watching alone never changes a training bit.
        arm_after_alarm: measure the step after an alarm per param
            (:meth:`~norm_optim.NormAwareOptimizer.measure_next_step`), so that the spike's
            aftermath is recorded in full.
        max_names: at most this many param names in one alarm (non-finite grads), then a count.
    """

    k: float = 6.0
    window: int = 128
    warmup: int = 64
    min_rel_std: float = 0.01
    skip: bool = False
    arm_after_alarm: bool = True
    max_names: int = 8

    def __post_init__(self) -> None:
        if not (isinstance(self.k, (int, float)) and self.k > 0):
            raise ValueError(f"WatchConfig.k must be a number > 0, got {self.k!r}")
        if not (isinstance(self.window, int) and self.window >= 2):
            raise ValueError(f"WatchConfig.window must be an int >= 2, got {self.window!r}")
        if not (isinstance(self.warmup, int) and self.warmup >= 2):
            raise ValueError(f"WatchConfig.warmup must be an int >= 2, got {self.warmup!r}")
        if self.min_rel_std < 0:
            raise ValueError(f"WatchConfig.min_rel_std must be >= 0, got {self.min_rel_std!r}")

    @classmethod
    def of(cls, value: "bool | dict[str, Any] | WatchConfig | None") -> Optional["WatchConfig"]:
        """``install(watch=...)``'s value as a config: True (defaults), a dict of fields, a
        config, or False / None (no watch)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(
                    f"watch: unknown options {unknown}; WatchConfig takes "
                    f"{[f.name for f in dataclasses.fields(cls)]}"
                )
            return cls(**value)
        raise TypeError(f"watch must be True, a dict or a WatchConfig, got {type(value).__name__}")


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


class RollingStats:
    """The last ``window`` values of ``n`` signals, on the device: mean, σ and each new value's
    excess over them. Holds ``window × n`` float64 values; no host sync.

    Non-finite values are never pushed (they would poison the window): they are judged (as
    non-finite) and replaced by the mean in the window.
    """

    def __init__(self, n: int, config: WatchConfig, device: torch.device) -> None:
        self.config = config
        self._values = torch.zeros((config.window, n), dtype=torch.float64, device=device)
        self._seen = 0  # values pushed so far: a host count, the same on every rank

    @property
    def warm(self) -> bool:
        """Whether enough values were seen for a verdict (a host decision: no sync)."""
        return self._seen >= self.config.warmup

    def judge(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(excess, mean, σ) of ``x`` against the window before it; the excess is 0 until warm
        and +inf where ``x`` is not finite. Then ``x`` joins the window."""
        filled = min(self._seen, self.config.window)
        if filled >= 2:
            var, mean = torch.var_mean(self._values[:filled], dim=0, correction=1)
            std = var.sqrt_()
        else:
            mean = self._values[0] if filled else torch.zeros_like(x)
            std = torch.zeros_like(x)
        floor = torch.maximum(std, mean.abs() * self.config.min_rel_std).clamp_min_(1e-300)
        finite = torch.isfinite(x)
        excess = torch.where(finite, (x - mean) / floor, torch.full_like(x, math.inf))
        if not self.warm:
            excess = torch.where(finite, torch.zeros_like(x), excess)
        self._values[self._seen % self.config.window] = torch.where(finite, x, mean)
        self._seen += 1
        return excess, mean, std

    def state(self, names: Sequence[str]) -> dict[str, Any]:
        """What a checkpoint keeps of it: the signals' names, the count seen and the window's
        values, oldest first (one host transfer)."""
        filled = min(self._seen, self.config.window)
        order = [(self._seen - filled + i) % self.config.window for i in range(filled)]
        values = self._values[order].cpu() if order else self._values[:0].cpu()
        return {"names": list(names), "seen": self._seen, "values": values}

    def restore(self, state: dict[str, Any], names: Sequence[str]) -> bool:
        """Take a saved :meth:`state` whose signals are ``names`` (in any order; a layout change
        keeps the global names); False, and nothing taken, when the signals differ."""
        index = {name: i for i, name in enumerate(state["names"])}
        if set(index) != set(names):
            return False
        values = state["values"][:, [index[name] for name in names]]
        values = values[-self.config.window :]
        filled = values.shape[0]
        seen = int(state["seen"])
        rows = [(seen - filled + i) % self.config.window for i in range(filled)]
        self._values.zero_()
        if filled:
            self._values[rows] = values.to(self._values.device, self._values.dtype)
        self._seen = seen
        return True


# The columns of one step's summary (float64, on the device): read in one transfer at poll().
_FLAG, _NON_FINITE, _BEST, _VALUE, _MEAN, _STD, _EXCESS, _LAYER, _PARAM = range(9)
_WIDTH = 9


@dataclasses.dataclass(frozen=True)
class _Signals:
    """The names of the grads signals, in the order of the judged vector: the total, the
    layers, the params (from the reducer's per-param slots: the same on every rank)."""

    layers: tuple[str, ...]
    params: tuple[str, ...]

    def name(self, i: int) -> str:
        if i == 0:
            return GRADS
        if i <= len(self.layers):
            return f"{GRADS}/layer/{self.layers[i - 1]}"
        return f"{GRADS}/param/{self.params[i - 1 - len(self.layers)]}"


class Watch:
    """The watch of one :class:`~norm_optim.NormAwareOptimizer` (see the module docstring).

    Made by :meth:`~norm_optim.NormAwareOptimizer.watch`; every later ``step()`` is watched.
    Call :meth:`poll` after each step (a loop integration does) to get the alarms; feed the
    loss with :meth:`observe_loss`.
    """

    def __init__(self, config: WatchConfig, arm: Callable[[], None]) -> None:
        self.config = config
        self._arm = arm
        self._grads: Optional[RollingStats] = None
        self._signals: Optional[_Signals] = None
        self._key: Any = None  # the reducer's per-param slots the grads stats were built for
        self._loss: Optional[RollingStats] = None
        self._ratios: Optional[RollingStats] = None
        self._ratio_names: tuple[str, ...] = ()
        # What is not polled yet is bounded, whatever the run's length: poll at least once per
        # window, or the oldest steps are dropped. Steps: (summary, non-finite mask, skipped).
        self._pending: collections.deque = collections.deque(maxlen=config.window)
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

    def judge_grads(self, squares: torch.Tensor, slots: Any, device: torch.device) -> torch.Tensor:
        """From the all-reduced per-param sums of squares of a step's grads (dense, expert,
        then one slot per param name): judge every grads signal, queue the step's summary, and
        return the verdict as a 0-dim bool tensor on the device (no host sync)."""
        self.steps += 1
        if self._signals is None or self._key is not slots:
            params = tuple(slots.index)
            layers = tuple(slots.layers.index)
            self._signals = _Signals(layers, params)
            self._grads = RollingStats(1 + len(layers) + len(params), self.config, device)
            self._key = slots
            self._take_restored(GRADS, self._grads, self._grads_names())
        tail = squares[2:]
        layer_squares = tail.new_zeros(len(self._signals.layers) + 1).index_add_(
            0, slots.layers.groups, tail
        )[:-1]
        x = torch.cat([squares[:2].sum().reshape(1), layer_squares, tail]).sqrt_()
        assert self._grads is not None
        excess, mean, std = self._grads.judge(x)
        non_finite = ~torch.isfinite(tail)
        # What alarms: the total and each layer. A param's grads norm alone is too noisy a
        # signal (a layernorm's can triple from one batch to the next); it names the param.
        n_layers = len(self._signals.layers)
        judged = slice(0, 1 + n_layers)
        summary = self._summary(
            excess[judged], x[judged], mean[judged], std[judged], non_finite.any()
        )
        if n_layers:
            summary[_LAYER] = excess[1 : 1 + n_layers].argmax()
        if len(tail):
            summary[_PARAM] = excess[1 + n_layers :].argmax()
        self._pending.append((summary, non_finite, False))
        return summary[_FLAG] > 0

    def mark_skipped(self) -> None:
        """The last judged step was not applied."""
        summary, non_finite, _ = self._pending[-1]
        self._pending[-1] = (summary, non_finite, True)

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
        summary = torch.full((_WIDTH,), -1.0, dtype=torch.float64, device=x.device)
        summary[_FLAG] = (spike | non_finite).double()
        summary[_NON_FINITE] = non_finite.double()
        summary[_BEST] = best
        summary[_VALUE], summary[_MEAN], summary[_STD] = x[best], mean[best], std[best]
        summary[_EXCESS] = excess[best]
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
            (GRADS, self._grads, self._grads_names() if self._signals else ()),
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
        self._grads = self._loss = self._ratios = None
        self._signals, self._key, self._ratio_names = None, None, ()

    def _take_restored(self, key: str, stats: RollingStats, names: Sequence[str]) -> None:
        saved = self._restored.pop(key, None)
        if saved is not None and not stats.restore(saved, names):
            LOGGER.info(
                "norm_optim watch: the saved %s statistics are for other signals (another "
                "model?): they start afresh",
                key,
            )

    def _grads_names(self) -> tuple[str, ...]:
        signals = self._signals
        assert signals is not None
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
        rows = torch.stack([s for s, _, _ in pending] + [s for s, _, _ in extra]).tolist()
        alarms: list[Alarm] = []
        for i, (row, (_, non_finite, skipped)) in enumerate(zip(rows, pending)):
            if not row[_FLAG]:
                continue
            step = self.steps - len(pending) + 1 + i + offset
            alarms.append(self._grads_alarm(step, row, non_finite, skipped))
        for row, (_, signal, step) in zip(rows[len(pending) :], extra):
            if row[_FLAG]:
                name = signal
                if signal == RATIO:
                    name = f"{RATIO}/layer/{self._ratio_names[int(row[_BEST])]}"
                alarms.append(Alarm(step + offset, name, *_judged(row)))
        self.alarms_total += len(alarms)
        self.last_alarms = tuple(alarms)
        # Only what every rank judged alike (the reduced grads and ratios) arms a step: a
        # collective. The loss is a rank's own.
        if arm and self.config.arm_after_alarm and any(a.signal != LOSS for a in alarms):
            self._arm()
        return self.last_alarms

    def _grads_alarm(
        self, step: int, row: list[float], non_finite: torch.Tensor, skipped: bool
    ) -> Alarm:
        signals = self._signals
        assert signals is not None
        names: tuple[str, ...] = ()
        count = 0
        if row[_NON_FINITE]:
            where = non_finite.nonzero().flatten()
            count = int(where.numel())
            names = tuple(signals.params[int(j)] for j in where[: self.config.max_names])
        param = signals.params[int(row[_PARAM])] if row[_PARAM] >= 0 else None
        layer = signals.layers[int(row[_LAYER])] if row[_LAYER] >= 0 else None
        return Alarm(
            step,
            signals.name(int(row[_BEST])),
            *_judged(row),
            layer=layer,
            param=param,
            non_finite=names,
            non_finite_count=count,
            skipped=skipped,
        )


def _judged(row: list[float]) -> tuple[float, float, float, float]:
    return row[_VALUE], row[_MEAN], row[_STD], row[_EXCESS]


def say(alarms: Sequence[Alarm]) -> None:
    """One line per alarm on :data:`LOGGER`, at ERROR: Megatron's loops set up logging with a
    filter that drops every WARNING record (Megatron-Bridge's ``logger.filter_warnings``, on by
    default), and an alarm must not vanish there; with no logging set up at all, Python still
    shows ERROR on stderr. Configure, redirect or silence it with ``logging`` (``norm_optim.watch``
    or its parent ``norm_optim``); norm_optim adds no handler."""
    for alarm in alarms:
        LOGGER.error("%s", alarm)
