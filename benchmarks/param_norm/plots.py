"""Time and extra peak memory per call against model size, log-log, one PNG each.

Two panels per figure, because the two sweeps vary different things: dense models grow in
elements at ~100 tensors, MoE models grow in tensor count at 4k-element experts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from .cases import sweep_of
from .report import TARGET_PEAK_BYTES, Row

# method -> (matplotlib color, marker)
STYLE: tuple[tuple[str, str, str], ...] = (
    ("norm_optim", "C0", "o"),
    ("floor", "C2", "s"),
    ("attribute_walk", "C1", "^"),
    ("fp32_copy", "C3", "x"),
    ("dtensor_walk", "C4", "v"),
)
PANELS = (
    ("elements", "numel", "elements (dense models, ~100 tensors)"),
    ("tensors", "tensors", "tensors (MoE models, 4k-element experts)"),
)
FIGURES = (
    ("median_s", "median seconds per call", "param_norm_time.png"),
    ("extra_peak_bytes", "extra peak bytes per call (0 shown at 1 KiB)", "param_norm_memory.png"),
)
WORLD_LINES = ((1, "-"), (4, ":"))


def plot(rows: Sequence[Row], out_dir: Path) -> list[Path]:
    """Write the figures into ``out_dir``; none (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("# matplotlib is not installed (pip install matplotlib): no plots", file=sys.stderr)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, label, file in FIGURES:
        floor = 1e-6 if metric == "median_s" else 1024  # log axes: 0 cannot be drawn
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
        for ax, (sweep, x_key, x_label) in zip(axes, PANELS):
            for method, color, marker in STYLE:
                for world, line in WORLD_LINES:
                    points = sorted(
                        (r[x_key], max(r[metric] or 0, floor))
                        for r in rows
                        if sweep_of(r["case"]) == sweep
                        and r["world"] == world
                        and r["method"] == method
                    )
                    if points:
                        xs, ys = zip(*points)
                        ax.plot(
                            xs,
                            ys,
                            line,
                            color=color,
                            marker=marker,
                            label=f"{method} (world {world})",
                        )
            if metric == "extra_peak_bytes":
                ax.axhline(TARGET_PEAK_BYTES, color="grey", linestyle="--", linewidth=0.8)
            ax.set(xscale="log", yscale="log", xlabel=x_label, ylabel=label)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / file
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
