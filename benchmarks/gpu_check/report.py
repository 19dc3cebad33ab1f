"""The GPU check's table, its environment, and the files it writes."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.metadata
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from ..param_norm.report import environment
from ..units import format_bytes
from .measure import Row

# ----------------------------------------------------------------------------------------------
# The table and the files.

COLUMNS = (
    ("section", "section"),
    ("what", "what"),
    ("dtype", "dtype"),
    ("numel", "elements"),
    ("tensors", "tensors"),
    ("median_ms", "median ms"),
    ("gbs", "GB/s"),
    ("of_peak", "of peak"),
    ("rel_error", "rel. error"),
    ("extra_peak_bytes", "extra peak"),
    ("note", "note"),
)
_RIGHT = {"numel", "tensors", "median_ms", "gbs", "of_peak", "rel_error", "extra_peak_bytes"}


def _cell(key: str, value: Any) -> str:
    if value is None or value == "":
        return "-"
    if key == "numel":
        return f"{value:.3g}"
    if key == "tensors":
        return f"{value:,}"
    if key == "median_ms":
        return f"{value:.3g}"
    if key == "gbs":
        return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
    if key == "of_peak":
        return f"{value:.0%}"
    if key == "rel_error":
        return f"{value:.1e}" if value else "0"
    if key == "extra_peak_bytes":
        return format_bytes(value)
    return str(value).replace("|", "/")


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table, one line per row, ``-`` where a field does not apply."""
    header = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "|".join("---:" if key in _RIGHT else "---" for key, _ in COLUMNS) + "|"
    body = ["| " + " | ".join(_cell(key, r.get(key)) for key, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([header, rule, *body])


def _version(module: str) -> Optional[str]:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "?"))
    except Exception:
        return None


def run_environment(device: torch.device) -> dict[str, Any]:
    """The machine and software of the run, for the JSON."""
    import norm_optim

    env = environment()
    env.update(
        device=str(device),
        torch_cuda=torch.version.cuda,
        norm_optim=norm_optim.__version__,
        megatron_core=_version("megatron.core"),
        apex=_version("apex"),
        transformer_engine=_version("transformer_engine"),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_memory_bytes=props.total_memory,
        )
        with contextlib.suppress(Exception):
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def default_out_dir() -> Path:
    """``benchmarks/results/`` (next to this package): where the project keeps measured figures."""
    return Path(__file__).resolve().parents[1] / "results"


def write_outputs(
    out_dir: Path, rows: Sequence[Row], env: dict[str, Any], table: str
) -> list[Path]:
    """``gpu-check-DATE.txt`` (the table) and ``gpu-check-DATE.json`` (environment and rows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-check-{datetime.date.today().isoformat()}"
    text, data = out_dir / f"{stem}.txt", out_dir / f"{stem}.json"
    text.write_text(table + "\n")
    clean = [
        {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
        for r in rows
    ]
    data.write_text(json.dumps({"environment": env, "rows": clean}, indent=1) + "\n")
    return [text, data]
