"""The watch's signals on the device: rolling statistics (:class:`RollingStats`), and the grads
signals of one per-param slot layout made from a step's reduced sums of squares
(:class:`GradsSignals`), judged in buffers and views made once, so that a watched step's ops do
not grow with the number of params; what a step keeps for ``poll()`` (:class:`JudgedStep`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import torch

from .._kernels.indices import to_device
from .watch_config import WatchConfig

GRADS = "grads-norm"
"""The name of the grads signals: ``grads-norm`` (total), ``grads-norm/layer/<layer>``,
``grads-norm/param/<name>`` (the same tags as the step norms' scalars)."""


class RollingStats:
    """The last ``window`` values of ``n`` signals, on the device: mean, σ and each new value's
    excess over them. Holds ``window × n`` float64 values; no host sync.

    Non-finite values are never pushed (they would poison the window): they are judged (as
    non-finite) and replaced by the mean in the window.

    A judgement is the same dozen ops for any ``n``: the value, mean, σ and excess are the rows
    of one matrix (:attr:`columns`) written in place, and every view a judgement reads is made
    here, once. They are overwritten by the next judgement: keep a copy of what must outlive it.

    Its cost is O(n), not O(window × n): the mean and σ come from the window's running sums of
    the values and their squares (the value leaving the window subtracted, the new one added),
    summed again from the window every ``window`` values so that rounding cannot accumulate.
    From power sums σ carries a relative error of up to ~1e-16 · window · (mean/σ)² (float64):
    4e-7 measured for σ = 1e-4 · mean over 8 values, ~1e-10 at the default σ floor
    (:attr:`~norm_optim.WatchConfig.min_rel_std`, 1 % of the mean) over 128.
    """

    def __init__(self, n: int, config: WatchConfig, device: torch.device) -> None:
        self.config = config
        self._values = torch.zeros((config.window, n), dtype=torch.float64, device=device)
        self._rows = self._values.unbind(0)
        # Σ x and Σ x² over the window's rows (rows not filled yet are zeros), and what divides
        # them into the mean and the second moment once f rows are filled: [[f], [f - 1]].
        self._sums = torch.zeros((2, n), dtype=torch.float64, device=device)
        self._sum, self._sum_sq = self._sums.unbind(0)
        counts = [[[f], [max(f - 1, 1)]] for f in range(config.window + 1)]
        self._divisors = to_device(counts, torch.float64, device).unbind(0)
        self.columns = torch.zeros((4, n), dtype=torch.float64, device=device)
        """Rows: the value judged (:attr:`x`), the window's mean and σ before it, its excess."""
        self.x, self.mean, self.std, self.excess = self.columns.unbind(0)
        self._moments = self.columns[1:3]  # the mean and σ rows, written by one division
        self.non_finite = torch.zeros(n, dtype=torch.bool, device=device)
        """Where the last value judged was not finite (a new tensor at each judgement)."""
        self._seen = 0  # values pushed so far: a host count, the same on every rank

    @property
    def warm(self) -> bool:
        """Whether enough values were seen for a verdict (a host decision: no sync)."""
        return self._seen >= self.config.warmup

    def judge(
        self, x: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(excess, mean, σ) of ``x`` (default: the values already written into :attr:`x`)
        against the window before it; the excess is 0 until warm and +inf where ``x`` is not
        finite. Then ``x`` joins the window."""
        if x is not None:
            self.x.copy_(x)
        filled = min(self._seen, self.config.window)
        if filled >= 2:
            # mean = Σx / f; σ² = Σx² / (f - 1) - mean² · f / (f - 1); clamped: rounding may
            # leave a constant signal's σ² a hair below 0.
            torch.div(self._sums, self._divisors[filled], out=self._moments)
            self.std.addcmul_(self.mean, self.mean, value=-filled / (filled - 1))
            self.std.clamp_min_(0).sqrt_()
        elif filled:
            self.mean.copy_(self._rows[0])
            self.std.zero_()
        else:
            self.mean.zero_()
            self.std.zero_()
        non_finite = torch.ne(self.x * 0, 0)  # x·0 is NaN exactly where x is NaN or ±inf
        torch.sub(self.x, self.mean, out=self.excess)
        if self.warm:
            floor = torch.maximum(self.std, self.mean.abs().mul_(self.config.min_rel_std))
            self.excess.div_(floor.clamp_min_(1e-300))
        else:
            self.excess.zero_()
        self.excess.masked_fill_(non_finite, math.inf)
        row = self._rows[self._seen % self.config.window]
        self._sum.sub_(row)  # the value leaving the window (zeros while it fills)
        self._sum_sq.addcmul_(row, row, value=-1)
        torch.where(non_finite, self.mean, self.x, out=row)
        self._sum.add_(row)
        self._sum_sq.addcmul_(row, row)
        self._seen += 1
        if self._seen % self.config.window == 0:
            self._sum_again()
        self.non_finite = non_finite
        return self.excess, self.mean, self.std

    def _sum_again(self) -> None:
        """The running sums from the window's rows (once per ``window`` values, and after a
        restore): O(window × n), so O(n) a value."""
        torch.sum(self._values, dim=0, out=self._sum)
        torch.sum(self._values * self._values, dim=0, out=self._sum_sq)

    def state(self, names: Sequence[str]) -> dict[str, Any]:
        """What a checkpoint keeps of it: the signals' names, the count seen and the window's
        values, oldest first (one host transfer)."""
        filled = min(self._seen, self.config.window)
        order = [(self._seen - filled + i) % self.config.window for i in range(filled)]
        values = self._values[order].cpu() if order else self._values[:0].cpu()
        return {"names": list(names), "seen": self._seen, "values": values}

    def restore(self, state: dict[str, Any], names: Sequence[str]) -> bool:
        """Take a saved :meth:`state` whose signals are ``names`` (in any order; a layout change
        keeps the global names); False, and nothing taken, when the signals differ. Written in
        place: the views made at construction stay valid."""
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
        self._sum_again()
        return True


# The columns of one step's summary (float64, on the device): read in one transfer at poll().
FLAG, NON_FINITE, BEST, VALUE, MEAN, STD, EXCESS, LAYER, PARAM = range(9)
WIDTH = 9


@dataclasses.dataclass(frozen=True)
class Signals:
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


@dataclasses.dataclass(frozen=True)
class JudgedStep:
    """What one watched step keeps until poll(): the value, mean, σ and excess of the judged
    signal with the largest excess (4 × 1), that signal, the layer and the param with the
    largest excess (1-element tensors, or None), where the grads were not finite."""

    at_best: torch.Tensor
    best: torch.Tensor
    layer: Optional[torch.Tensor]
    param: Optional[torch.Tensor]
    non_finite: torch.Tensor
    skipped: bool = False

    def verdict(self, k: float) -> torch.Tensor:
        """Whether the step spiked or had non-finite grads: a 0-dim bool tensor on the device
        (a non-finite grad makes the total non-finite, and its excess +inf)."""
        return self.at_best[3, 0] > k

    def summary(self, k: float, n_layers: int) -> torch.Tensor:
        """The step's summary row (at poll: the step itself makes none)."""
        at = self.at_best.view(4)
        non_finite = self.non_finite[1 + n_layers :].any()
        flags = torch.stack([(at[3] > k) | non_finite, non_finite]).double()
        none = torch.full((1,), -1.0, dtype=torch.float64, device=at.device)
        named = [none if t is None else t.double() for t in (self.layer, self.param)]
        return torch.cat([flags, self.best.double(), at, *named])


class GradsSignals:
    """The grads signals of one per-param slot layout, from a step's reduced sums of squares:
    which slots add into the total, each layer and each param (one ``index_add``), their
    rolling statistics, and the views of the excess the verdict reads; all made once."""

    def __init__(self, slots: Any, config: WatchConfig, device: torch.device) -> None:
        self.signals = Signals(tuple(slots.layers.index), tuple(slots.index))
        n_layers, n_params = len(self.signals.layers), len(self.signals.params)
        source, target = [], []
        for p, layer in enumerate(slots.layers.host):
            slot = 2 + p  # after the dense and expert slots of the reduced vector
            wanted = [0, 1 + n_layers + p] + ([1 + layer] if layer < n_layers else [])
            source += [slot] * len(wanted)
            target += wanted
        self._source = to_device(source, torch.long, device)
        self._target = to_device(target, torch.long, device)
        self.stats = RollingStats(1 + n_layers + n_params, config, device)
        self._zeros = torch.zeros_like(self.stats.x)
        excess = self.stats.excess
        self._judged = excess[: 1 + n_layers]  # the total and the layers alarm
        self._layers = excess[1 : 1 + n_layers] if n_layers else None
        self._params = excess[1 + n_layers :] if n_params else None

    def __call__(self, squares: torch.Tensor) -> JudgedStep:
        x = self.stats.x
        torch.index_add(self._zeros, 0, self._target, squares.index_select(0, self._source), out=x)
        x.sqrt_()
        self.stats.judge()
        best = self._judged.argmax(0, keepdim=True)
        return JudgedStep(
            self.stats.columns.index_select(1, best),
            best,
            None if self._layers is None else self._layers.argmax(0, keepdim=True),
            None if self._params is None else self._params.argmax(0, keepdim=True),
            self.stats.non_finite,
        )
