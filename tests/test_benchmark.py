"""The benchmark (``python -m benchmarks.param_norm``) runs end to end (smallest case, both
worlds) and writes what it promises.

Timings are not asserted (shared, noisy machines); the structural facts are: one row per case ×
method with the documented fields, the documented environment, and norm_optim's one collective,
no host sync, and accuracy.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIELDS = {
    "case",
    "kind",
    "world",
    "numel",
    "tensors",
    "layout",
    "device",
    "threads",
    "calls",
    "memory_method",
    "local_numel",
    "local_tensors",
    "method",
    "median_s",
    "extra_peak_bytes",
    "collectives",
    "host_syncs",
    "rel_error",
    "value",
    "reference",
    "registry_build_s",
    "declarations_s",
}
ENVIRONMENT = {
    "date",
    "machine",
    "processor",
    "cpus",
    "python",
    "torch",
    "cuda",
    "norm_optim_sources_sha1",
    "wall_s",
    "argv",
}


def test_benchmark_quick_smallest_case(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "rows.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.param_norm",
            "--cases",
            "moe-s",
            "--worlds",
            "1",
            "4",
            "--calls",
            "3",
            "--warmup",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    document = json.loads(out.read_text())
    assert set(document) == {"environment", "targets", "rows"}
    assert set(document["environment"]) == ENVIRONMENT
    rows = document["rows"]
    assert {(r["world"], r["method"]) for r in rows} == {
        (w, m)
        for w in (1, 4)
        for m in (
            "norm_optim",
            "norm_optim_per_param",
            "floor",
            "floor_per_param",
            "attribute_walk",
            "fp32_copy",
        )
    }
    for row in rows:
        assert set(row) == FIELDS, set(row) ^ FIELDS
        if row["method"] in ("norm_optim", "norm_optim_per_param"):
            assert row["collectives"] == 1 and row["host_syncs"] == 0
            assert row["rel_error"] <= 1e-6
        # Reading the declarations is part of the registry build.
        assert row["declarations_s"] > 0 and row["registry_build_s"] > 0


def _step_norms_rows(out: pathlib.Path, *args: str) -> list[dict]:
    """The rows ``python -m benchmarks.step_norms *args`` writes to ``out``."""
    subprocess.run(
        [sys.executable, "-m", "benchmarks.step_norms", *args, "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    rows: list[dict] = json.loads(out.read_text())
    return rows


def test_step_norms_benchmark_writes_its_rows(tmp_path: pathlib.Path) -> None:
    """``python -m benchmarks.step_norms --quick`` runs and writes one row of the documented
    fields (timings and memory are reported, not asserted)."""
    (row,) = _step_norms_rows(tmp_path / "step.json", "--quick")
    assert set(row) == {
        "case",
        "numel",
        "tensors",
        "largest_fp32_tensor_bytes",
        "plain_step_s",
        "armed_step_s",
        "armed_per_param_step_s",
        "param_l2_norm_s",
        "memory_method",
        "extra_peak_bytes",
        "bytes_read_param_l2_norm",
        "bytes_read_armed_step",
        "armed_over_plain",
        "bound_bytes",
        "aten_ops_plain_step",
        "extra_aten_ops_per_tensor",
        "extra_aten_ops_per_tensor_per_param",
        "watched_step_s",
        "watched_over_plain",
        "armed_per_param_over_plain",
        "in_step_scratch_bytes",
        "armed_minus_plain_peak_bytes",
        "reads_s",
        "difference_s",
        "floor_step_s",
        "floor_over_plain",
        "armed_over_floor",
    }
    # Weights, grads and both moments: Adam's update is read in its step, from cache.
    assert row["bytes_read_armed_step"] == 4 * row["bytes_read_param_l2_norm"]
    # The in-step read's scratch is within the bound, and counted in the extra peak.
    assert 0 < row["in_step_scratch_bytes"] <= row["bound_bytes"]
    if row["extra_peak_bytes"] is not None:
        assert row["extra_peak_bytes"] >= row["in_step_scratch_bytes"]
    # Deterministic (counted, not timed): the ops an armed step adds per param tensor.
    assert 0 < row["extra_aten_ops_per_tensor"] <= 40


def test_step_norms_benchmark_by_tensor_count(tmp_path: pathlib.Path) -> None:
    """``python -m benchmarks.step_norms --tensors --quick`` writes the 100-tensor row: the ops a
    watched step, an armed per-param step and per-param weight norms add (counted, so
    asserted), and the times (reported only)."""
    (row,) = _step_norms_rows(tmp_path / "tensors.json", "--tensors", "--quick")
    assert set(row) == {
        "case",
        "tensors",
        "numel",
        "aten_ops_plain_step",
        "extra_aten_ops_watched_step",
        "extra_aten_ops_per_tensor_armed_per_param",
        "python_calls_plain_step",
        "extra_python_calls_watched_step",
        "python_calls_watch_only",
        "aten_ops_param_l2_norms_per_param",
        "plain_step_s",
        "watched_step_s",
        "watched_minus_plain_s",
        "watched_over_plain",
        "watch_read_s",
        "watch_host_s",
        "wrap_s",
        "armed_per_param_step_s",
        "armed_per_param_over_plain",
        "param_l2_norms_per_param_s",
    }
    assert row["tensors"] == 100
    assert 0 < row["extra_aten_ops_watched_step"] <= 32
    assert 0 < row["extra_python_calls_watched_step"] < row["python_calls_plain_step"]
    assert 0 < row["extra_aten_ops_per_tensor_armed_per_param"] <= 4
