"""What a run reports: the markdown table, the targets, and the JSON document with
the environment and a fingerprint of the library sources the rows belong to.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..units import format_bytes

Row = Mapping[str, Any]

TARGET_PEAK_BYTES = 1 << 20
TARGET_REL_ERROR = 1e-6
TARGET_X_FLOOR = 1.1
TARGET_PER_PARAM_X_TOTAL = 1.3  # MoE cases (benchmarks/README.md)
# A GPU has far more bandwidth to spare for a walk's many small kernels than a CPU core.
TARGET_WALK_SPEEDUP: Mapping[str, float] = types.MappingProxyType({"cpu": 2.0, "cuda": 10.0})
MANY_TENSORS = 5000


def by_case(rows: Sequence[Row]) -> dict[tuple[str, int], dict[str, Row]]:
    """``{(case, world): {method: row}}``, in the order of the rows."""
    cases: dict[tuple[str, int], dict[str, Row]] = {}
    for row in rows:
        cases.setdefault((row["case"], row["world"]), {})[row["method"]] = row
    return cases


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table, one line per case x method, with each time relative to ``floor``."""
    lines = [
        "| case | world | elements | tensors | method | median ms | x floor | extra peak "
        "| collectives | host syncs | rel. error |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (case, world), methods in by_case(rows).items():
        floor = methods.get("floor", {}).get("median_s")
        for name, r in methods.items():
            ratio = f"{r['median_s'] / floor:.2f}" if floor else "-"
            lines.append(
                f"| {case} | {world} | {r['numel']:.3g} | {r['tensors']} | {name} | "
                f"{r['median_s'] * 1e3:.3g} | {ratio} | {format_bytes(r['extra_peak_bytes'])} | "
                f"{r['collectives']} | {r['host_syncs']} | {r['rel_error']:.1e} |"
            )
    return "\n".join(lines)


def format_wrap_table(rows: Sequence[Row]) -> str:
    """Once per case: the registry build (at wrap time, and after the optimizer replaced its
    tensors), and the part of it that reads the model's sharding declarations."""
    lines = [
        "| case | world | tensors | registry build ms | of which declarations ms | "
        "x without them |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (case, world), methods in by_case(rows).items():
        r = next(iter(methods.values()))
        if "registry_build_s" not in r:
            continue  # rows of a run before this was measured
        build, decl = r["registry_build_s"], r["declarations_s"]
        lines.append(
            f"| {case} | {world} | {r['tensors']} | {build * 1e3:.3g} | "
            f"{decl * 1e3:.3g} | {build / max(build - decl, 1e-12):.2f} |"
        )
    return "\n".join(lines)


def _verdict(bad: Sequence[Row], show: Callable[[Row], str]) -> str:
    return (
        "met"
        if not bad
        else "MISSED: " + ", ".join(f"{r['case']}/w{r['world']} {show(r)}" for r in bad)
    )


def check_targets(rows: Sequence[Row]) -> list[str]:
    """One line per target (``benchmarks/README.md``) of ``norm_optim`` and of
    ``norm_optim_per_param``: met, or missed and where."""
    ours = [r for r in rows if r["method"] == "norm_optim"]
    per_param = [r for r in rows if r["method"] == "norm_optim_per_param"]
    moe_per_param = [r for r in per_param if r["kind"] == "moe"]
    cases = by_case(rows)

    def x_floor_all_reduce(r: Row) -> float:
        methods = cases[(r["case"], r["world"])]
        if "floor_per_param" not in methods:
            return math.nan
        return float(methods["floor_per_param"]["median_s"] / methods["floor"]["median_s"])

    def x_total(r: Row) -> float:
        return float(r["median_s"] / cases[(r["case"], r["world"])]["norm_optim"]["median_s"])

    def x_floor(r: Row) -> float:
        return float(r["median_s"] / cases[(r["case"], r["world"])]["floor"]["median_s"])

    def x_walk(r: Row) -> float:
        return float(cases[(r["case"], r["world"])]["attribute_walk"]["median_s"] / r["median_s"])

    # Megatron-FSDP cases have no attribute_walk to compare with.
    many = [
        r
        for r in ours
        if r["tensors"] >= MANY_TENSORS and "attribute_walk" in cases[(r["case"], r["world"])]
    ]
    speedup = {d: TARGET_WALK_SPEEDUP.get(d, 2.0) for d in {r["device"] for r in ours}}
    return [
        "extra peak <= 1 MiB: "
        + _verdict(
            [r for r in ours if (r["extra_peak_bytes"] or 0) > TARGET_PEAK_BYTES],
            lambda r: format_bytes(r["extra_peak_bytes"]),
        ),
        "rel. error <= 1e-6: "
        + _verdict(
            [r for r in ours if r["rel_error"] > TARGET_REL_ERROR],
            lambda r: f"{r['rel_error']:.1e}",
        ),
        "time <= 1.1x floor: "
        + _verdict(
            [r for r in ours if x_floor(r) > TARGET_X_FLOOR], lambda r: f"{x_floor(r):.2f}x"
        ),
        f"faster than attribute_walk at >= {MANY_TENSORS} tensors "
        f"({', '.join(f'{d}: {s:g}x' for d, s in speedup.items())}): "
        + (
            "no such case"
            if not many
            else _verdict(
                [r for r in many if x_walk(r) < speedup[r["device"]]], lambda r: f"{x_walk(r):.2f}x"
            )
        ),
        "1 collective, 0 host syncs: "
        + _verdict(
            [r for r in ours + per_param if r["collectives"] != 1 or r["host_syncs"] != 0],
            lambda r: f"{r['method']} {r['collectives']} / {r['host_syncs']}",
        ),
        f"per-param <= {TARGET_PER_PARAM_X_TOTAL}x total-only (MoE): "
        + (
            "no such case"
            if not moe_per_param
            else _verdict(
                [r for r in moe_per_param if x_total(r) > TARGET_PER_PARAM_X_TOTAL],
                lambda r: (
                    f"{x_total(r):.2f}x (floor_per_param / floor: {x_floor_all_reduce(r):.2f}x)"
                ),
            )
        ),
    ]


def library_fingerprint() -> str:
    """sha1 of norm_optim's sources as imported here (subpackages included): which library
    code a result belongs to."""
    import norm_optim

    root = Path(norm_optim.__file__).parent
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def environment() -> dict[str, Any]:
    """The machine and software a run measured, for the JSON."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def summary(rows: Sequence[Row], env: Mapping[str, Any]) -> str:
    """The table, the targets and one line on the run, as printed after a run."""
    targets = "\n".join(f"- {line}" for line in check_targets(rows))
    memory = rows[0]["memory_method"] if rows else "-"
    return (
        f"{format_table(rows)}\n\n{format_wrap_table(rows)}\n\n{targets}\n\n"
        f"# {len(rows)} rows in {env['wall_s']:.0f} s "
        f"on {env['cpus']} CPUs ({env['processor']}), torch {env['torch']}; memory: {memory}"
    )


def write_json(path: Path, rows: Sequence[Row], env: Mapping[str, Any]) -> None:
    """``{"environment", "targets", "rows"}``: what ``--replot`` and the README tables read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"environment": dict(env), "targets": check_targets(rows), "rows": list(rows)}, indent=1
        )
    )


def read_rows(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The rows of earlier runs' JSON files, in order."""
    return [row for p in paths for row in json.loads(p.read_text())["rows"]]
