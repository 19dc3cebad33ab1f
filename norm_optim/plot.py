"""Find the layer that diverged: a picture of the per-layer and per-param norms a run logged.

``install(per_param=True)`` (:mod:`norm_optim.integrations`) writes
``params-norm/layer/<layer>`` and ``params-norm/param/<name>`` to TensorBoard at the loop's
TensorBoard interval. This module draws them::

    python -m norm_optim.plot <tensorboard dir> -o norms.png

- top: every layer's norm over the logged iterations, as a heatmap relative to its first logged
  value (1 = unchanged; a layer drifting away stands out as one bright row);
- bottom: the params whose norm grew the most between the first and the last logged iteration,
  as lines, relative to their first value;
- with ``install(step_norms=True)`` (``grads-norm/layer/<layer>``, ``updates-norm/layer/<layer>``,
  ``update-to-weight/layer/<layer>`` in the directory): beside the weights, a heatmap per
  quantity of its per-layer value over the iterations (log colour scale: what drove the weights,
  and the update-to-weight ratio that learning rates are tuned by).

:func:`load_norms` is what gets drawn (tests compare it with the event file). Needs
``tensorboard`` (to read the event files) and ``matplotlib`` (to draw): the ``plot`` extra,
``pip install norm-optim[plot]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from ._megatron.naming import natural_key

LAYER_TAG = "params-norm/layer/"
PARAM_TAG = "params-norm/param/"
# The per-layer step-norm scalars (install(step_norms=True, per_param=True)), drawn beside the
# weights when present: tag prefix -> panel title.
STEP_LAYER_TAGS = {
    "grads-norm/layer/": "per-layer grad norm (before clipping)",
    "updates-norm/layer/": "per-layer update norm",
    "update-to-weight/layer/": "per-layer update / weight",
}
SIZE = (1200, 900)  # pixels of the PNG
_DPI = 100


@dataclasses.dataclass(frozen=True)
class PlotData:
    """What the picture shows, as logged.

    Attributes:
        steps: the iterations at which layer norms were logged, ascending.
        layers: layer -> its norm at each of ``steps`` (NaN where that step lacks it), layers
            in their natural order (``"2"`` before ``"10"``).
        growing: the fastest-growing params (largest last / first ratio, largest first) ->
            ``(steps, norms)`` as logged.
        step_layers: for each step-norm tag prefix of :data:`STEP_LAYER_TAGS` the run logged,
            layer -> its value at each of ``steps`` (NaN where that step lacks it); empty for a
            run without step norms.
    """

    steps: list[int]
    layers: dict[str, list[float]]
    growing: dict[str, tuple[list[int], list[float]]]
    step_layers: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)

    def relative_layers(self) -> list[list[float]]:
        """The heatmap: each layer's norms divided by its first logged (non-zero) value."""
        return [_relative(values) for values in self.layers.values()]


def load_scalars(
    logdir: Path | str, prefix: str | tuple[str, ...] = "params-norm/"
) -> dict[str, dict[int, float]]:
    """The scalars under ``prefix`` (or any of several) of every event file below ``logdir``:
    tag -> step -> value (a step logged twice, as after a resume: the later value)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer(size_guidance={"scalars": 0})
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    out: dict[str, dict[int, float]] = {}
    for run, tags in sorted(multiplexer.Runs().items()):
        for tag in tags.get("scalars", []):
            if tag.startswith(prefix):
                for event in multiplexer.Scalars(run, tag):
                    out.setdefault(tag, {})[event.step] = event.value
    return out


def load_norms(logdir: Path | str, top_k: int = 6) -> PlotData:
    """Per-layer norms and the ``top_k`` fastest-growing params' norms from ``logdir``.

    Raises:
        ValueError: no ``params-norm/layer/`` scalars there (was the run logged with
            ``install(per_param=True)``, and is this its TensorBoard directory?).
    """
    scalars = load_scalars(logdir, ("params-norm/", *STEP_LAYER_TAGS))
    layers = {
        tag[len(LAYER_TAG) :]: values
        for tag, values in scalars.items()
        if tag.startswith(LAYER_TAG)
    }
    if not layers:
        raise ValueError(
            f"no {LAYER_TAG}<layer> scalars under {logdir}: log the run with "
            "norm_optim.integrations.megatron_lm.install(per_param=True) (or megatron_bridge's) "
            "and pass its TensorBoard directory"
        )
    steps = sorted({step for values in layers.values() for step in values})
    params = {
        tag[len(PARAM_TAG) :]: values
        for tag, values in scalars.items()
        if tag.startswith(PARAM_TAG)
    }
    growth = {name: _growth(values) for name, values in params.items()}
    known = {name: ratio for name, ratio in growth.items() if ratio is not None}
    fastest = sorted(known, key=lambda name: (-known[name], name))[:top_k]
    return PlotData(
        steps=steps,
        layers={
            layer: [layers[layer].get(step, math.nan) for step in steps]
            for layer in sorted(layers, key=natural_key)
        },
        growing={
            name: (sorted(params[name]), [params[name][s] for s in sorted(params[name])])
            for name in fastest
        },
        step_layers=_step_layers(scalars, steps),
    )


def _step_layers(
    scalars: Mapping[str, Mapping[int, float]], steps: Sequence[int]
) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for prefix in STEP_LAYER_TAGS:
        found = {tag[len(prefix) :]: v for tag, v in scalars.items() if tag.startswith(prefix)}
        if found:
            out[prefix] = {
                layer: [found[layer].get(step, math.nan) for step in steps]
                for layer in sorted(found, key=natural_key)
            }
    return out


def plot_norms(
    data: PlotData, out: Path | str, title: Optional[str] = None, size: tuple[int, int] = SIZE
) -> Path:
    """Draw ``data`` into the PNG ``out`` (``size`` pixels); returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out = Path(out)
    figure = plt.figure(figsize=(size[0] / _DPI, size[1] / _DPI), dpi=_DPI)
    panels = len(data.step_layers)
    # Without step norms: the weights' heatmap over the growing params. With them: the weights'
    # and each step quantity's heatmap in a grid of two columns, the lines below, full width.
    columns = 1 if panels == 0 else 2
    rows = math.ceil((1 + panels) / columns)
    grid = figure.add_gridspec(rows + 1, columns, height_ratios=[3] * rows + [2])
    heat = figure.add_subplot(grid[0, 0])
    lines = figure.add_subplot(grid[rows, :])
    for index, (prefix, layers) in enumerate(data.step_layers.items(), start=1):
        _step_heatmap(
            figure,
            figure.add_subplot(grid[index // columns, index % columns]),
            data.steps,
            layers,
            STEP_LAYER_TAGS[prefix],
        )
    relative = data.relative_layers()
    image = heat.imshow(relative, aspect="auto", interpolation="nearest", **_colors(relative))
    heat.set_yticks(range(len(data.layers)), labels=list(data.layers))
    ticks = _tick_positions(len(data.steps))
    heat.set_xticks(ticks, labels=[str(data.steps[i]) for i in ticks])
    heat.set_ylabel("layer")
    heat.set_xlabel("iteration")
    heat.set_title("per-layer params norm / first logged value")
    figure.colorbar(image, ax=heat, label="relative norm")
    for name, (steps, values) in data.growing.items():
        lines.plot(steps, _relative(values), marker=".", label=name)
    lines.set_xlabel("iteration")
    lines.set_ylabel("norm / first logged value")
    lines.set_title("fastest-growing params (first to last logged iteration)")
    if data.growing:
        lines.legend(fontsize="small", loc="best")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=_DPI)
    plt.close(figure)
    return out


def _step_heatmap(
    figure: Any, axes: Any, steps: Sequence[int], layers: Mapping[str, list[float]], title: str
) -> None:
    """One step quantity's per-layer values over the iterations, on a log colour scale."""
    from matplotlib.colors import LogNorm

    values = list(layers.values())
    positive = [v for row in values for v in row if math.isfinite(v) and v > 0] or [1.0]
    norm = LogNorm(vmin=min(positive), vmax=max(max(positive), min(positive) * (1 + 1e-9)))
    image = axes.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis", norm=norm)
    axes.set_yticks(range(len(layers)), labels=list(layers))
    ticks = _tick_positions(len(steps))
    axes.set_xticks(ticks, labels=[str(steps[i]) for i in ticks])
    axes.set_ylabel("layer")
    axes.set_xlabel("iteration")
    axes.set_title(title)
    figure.colorbar(image, ax=axes)


def _colors(relative: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Red above 1 (grew), blue below (shrank), white at 1; one-sided when all moved one way."""
    from matplotlib.colors import Normalize, TwoSlopeNorm

    finite = [v for row in relative for v in row if math.isfinite(v)] or [1.0]
    low, high = min(finite), max(finite)
    if low < 1.0 < high:
        return {"cmap": "RdBu_r", "norm": TwoSlopeNorm(vcenter=1.0, vmin=low, vmax=high)}
    if high <= 1.0:
        return {"cmap": "Blues_r", "norm": Normalize(vmin=low, vmax=1.0)}
    return {"cmap": "Reds", "norm": Normalize(vmin=1.0, vmax=high)}


def _relative(values: Sequence[float]) -> list[float]:
    first = next((v for v in values if math.isfinite(v) and v != 0), None)
    return [math.nan if first is None else v / first for v in values]


def _growth(values: Mapping[int, float]) -> Optional[float]:
    steps = sorted(values)
    first, last = values[steps[0]], values[steps[-1]]
    return last / first if first > 0 and math.isfinite(last) else None


def _tick_positions(n: int, most: int = 12) -> list[int]:
    every = max(1, math.ceil(n / most))
    return list(range(0, n, every))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m norm_optim.plot", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("logdir", type=Path, help="the run's TensorBoard directory")
    parser.add_argument("-o", "--output", type=Path, default=Path("norms.png"))
    parser.add_argument("--top", type=int, default=6, help="fastest-growing params drawn")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        data = load_norms(args.logdir, top_k=args.top)
    except ValueError as exc:
        parser.error(str(exc))
    path = plot_norms(data, args.output, title=args.title)
    print(f"wrote {path} ({len(data.layers)} layers x {len(data.steps)} iterations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
