"""The GPU check (``python -m benchmarks.gpu_check``, ``make gpu-check``) by its CPU-visible parts.

Its CUDA rows can run only on a GPU; here: it imports, it says "CUDA is not available" and exits
0 without CUDA, its helpers compute the right numbers on CPU tensors, its table renders any
row, and ``--device cpu`` runs every section end to end (gloo at world 1, the real
megatron-core optimizer under the CPU shim) and writes its files.
"""

from __future__ import annotations

import importlib
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from benchmarks import gpu_check

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
QUICK = gpu_check.Options(warmup=1, repeats=3)


def test_imports_and_has_an_entry_point() -> None:
    assert callable(gpu_check.main)
    doc = gpu_check.__doc__ or ""
    assert "Running it on a GPU machine without network access" in doc
    assert gpu_check.default_out_dir() == ROOT / "benchmarks" / "results"


def test_without_cuda_it_says_so_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("CUDA is not available")
    assert "_foreach_norm" in lines[0] and "NCCL" in lines[0] and "param_l2_norm()" in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written


def test_rel_error() -> None:
    assert gpu_check.rel_error(1.01, 1.0) == pytest.approx(0.01)
    assert gpu_check.rel_error(0.99, 1.0) == pytest.approx(0.01)
    assert gpu_check.rel_error(3.0, 3.0) == 0.0
    assert gpu_check.rel_error(0.5, 0.0) == 0.5  # absolute where the reference is 0
    assert gpu_check.rel_error(math.nan, 1.0) == math.inf
    assert gpu_check.rel_error(math.inf, 1.0) == math.inf


def test_bandwidth_and_peak_fraction() -> None:
    assert gpu_check.bandwidth_gbs(2_000_000_000, 0.5) == pytest.approx(4.0)
    assert gpu_check.bandwidth_gbs(4 * 10**9, 1e-3) == pytest.approx(4000.0)
    assert gpu_check.peak_fraction(2150.0, 4300.0) == pytest.approx(0.5)
    assert gpu_check.peak_fraction(None, 4300.0) is None
    assert gpu_check.peak_fraction(10.0, None) is None
    assert gpu_check.peak_fraction(10.0, 0.0) is None


def test_parse_size() -> None:
    assert gpu_check.parse_size("1e6") == (10**6, 1)
    assert gpu_check.parse_size("1e8x1000") == (10**8, 1000)
    assert gpu_check.parse_size("1000X3") == (1000, 3)
    for bad in ("0", "10x0", "10x11"):
        with pytest.raises(Exception, match="NxK"):
            gpu_check.parse_size(bad)


def test_make_tensors_are_views_of_one_buffer() -> None:
    tensors = gpu_check.make_tensors(10, 3, torch.bfloat16, CPU, seed=1)
    assert [t.numel() for t in tensors] == [4, 4, 2]
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    again = gpu_check.make_tensors(10, 3, torch.bfloat16, CPU, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(tensors, again))


def test_float64_reference_on_known_values() -> None:
    tensors = [torch.ones(10), torch.full((5,), 2.0, dtype=torch.bfloat16), torch.zeros(0)]
    assert gpu_check.float64_sum_of_squares(tensors) == 30.0
    assert gpu_check.float64_sum_of_squares(tensors, chunk=3) == 30.0  # bounded pieces
    x = torch.randn(1000, dtype=torch.float64)
    assert gpu_check.float64_sum_of_squares([x], chunk=7) == pytest.approx(
        float((x * x).sum()), rel=1e-12
    )


def test_median_seconds_calls_and_flushes() -> None:
    calls: list[str] = []
    seconds = gpu_check.median_seconds(
        lambda: calls.append("call"),
        CPU,
        gpu_check.Options(warmup=2, repeats=5),
        before=lambda: calls.append("flush"),
    )
    assert seconds >= 0
    assert calls == ["call"] * 2 + ["flush", "call"] * 5
    assert gpu_check.extra_peak_bytes(lambda: 42, CPU) == (42, None)  # no CUDA memory to read


def test_copy_peak_row_counts_read_and_write() -> None:
    r = gpu_check.copy_peak_row(CPU, QUICK, nbytes=4 << 20)
    assert r["section"] == "peak" and r["numel"] == 1 << 20 and r["of_peak"] == 1.0
    assert r["gbs"] == pytest.approx(2 * (4 << 20) / (r["median_ms"] / 1e3) / 1e9)


def test_kernel_rows_on_cpu() -> None:
    methods = gpu_check.kernel_methods(CPU)
    names = [m.name for m in methods]
    assert names[:2] == ["torch._foreach_norm", "norm_optim SumOfSquaresPlan"]
    skipped = {m.name: m.skip_reason for m in methods if m.prepare is None}
    assert skipped == {
        "apex multi_tensor_l2norm": "CUDA only",
        "transformer_engine multi_tensor_l2norm": "CUDA only",
    }
    for dtype, tolerance in (("fp32", 1e-6), ("bf16", 1e-5)):
        rows = gpu_check.kernel_rows(methods, dtype, 20_000, 7, CPU, QUICK, peak_gbs=10.0)
        assert [r["what"] for r in rows] == names[:2]
        for r in rows:
            assert (r["dtype"], r["numel"], r["tensors"]) == (dtype, 20_000, 7)
            assert r["rel_error"] < tolerance, r
            nbytes = 20_000 * (2 if dtype == "bf16" else 4)
            assert r["gbs"] == pytest.approx(nbytes / (r["median_ms"] / 1e3) / 1e9)
            assert r["of_peak"] == pytest.approx(r["gbs"] / 10.0)
    assert "cpu" in rows[1]["note"]  # the backend norm_optim's plan picked


def test_a_failing_method_is_a_row_not_a_crash() -> None:
    def broken(tensors: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA out of memory. Tried to allocate 4 GiB\nmore detail")

    method = gpu_check.KernelMethod("broken", broken)
    (r,) = gpu_check.kernel_rows([method], "fp32", 100, 1, CPU, QUICK, peak_gbs=None)
    assert r["note"] == "error: RuntimeError: CUDA out of memory. Tried to allocate 4 GiB"


def test_format_table_renders_given_rows() -> None:
    rows = [
        gpu_check.row(
            "kernel",
            "torch._foreach_norm",
            dtype="bf16",
            numel=10**9,
            tensors=1000,
            median_ms=0.61234,
            gbs=3276.4,
            of_peak=0.762,
            rel_error=1.5e-9,
            extra_peak_bytes=1 << 30,
            note="a | b",
        ),
        gpu_check.skipped(
            "megatron", "NormAwareOptimizer.param_l2_norm()", "megatron-core not installed"
        ),
        gpu_check.row("nccl", "nccl all_reduce, world 1", rel_error=0.0, gbs=4.25),
    ]
    lines = gpu_check.format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert lines[0].startswith("| section | what | dtype | elements | tensors | median ms |")
    assert lines[1].count("|") == lines[0].count("|")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == [
        "kernel",
        "torch._foreach_norm",
        "bf16",
        "1e+09",
        "1,000",
        "0.612",
        "3,276",
        "76%",
        "1.5e-09",
        "1.0 GiB",
        "a / b",
    ]
    assert lines[3].endswith(
        "| - | - | - | - | - | - | - | - | skipped: megatron-core not installed |"
    )
    assert "| 4.25 | - | 0 | - |" in lines[4]


def test_megatron_rows_skip_without_megatron_core(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_megatron(name: str):  # type: ignore[no-untyped-def]
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", no_megatron)
    (r,) = gpu_check.megatron_section(CPU, {}, QUICK)
    assert r["section"] == "megatron"
    assert r["note"] == "skipped: megatron-core not installed"


def test_gloo_world_of_one_all_reduce() -> None:
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    with gpu_check.world_of_one(CPU) as init_s:
        r = gpu_check.all_reduce_row(CPU, QUICK, init_s)
    assert not dist.is_initialized()
    assert r["what"] == "gloo all_reduce, world 1"
    assert r["rel_error"] == 0 and r["note"].startswith("ok;")


def test_cpu_dry_run_writes_the_table(tmp_path: pathlib.Path) -> None:
    """Every section on CPU in a fresh interpreter (megatron's global state stays out of this
    one): one table printed and written as text and JSON."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--device",
            "cpu",
            "--sizes",
            "1000",
            "1000x4",
            "--warmup",
            "1",
            "--repeats",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (text,) = tmp_path.glob("gpu-check-*.txt")
    (data,) = tmp_path.glob("gpu-check-*.json")
    assert text.read_text().strip() in result.stdout
    doc = json.loads(data.read_text())
    assert doc["environment"]["device"] == "cpu"
    rows = doc["rows"]
    assert {r["section"] for r in rows} == {"peak", "kernel", "nccl", "megatron"}
    kernels = [r for r in rows if r["section"] == "kernel" and "rel_error" in r]
    assert len(kernels) == 2 * 2 * 2  # two dtypes x two sizes x two CPU methods
    assert all(r["rel_error"] < 1e-5 for r in kernels)
    nccl = [r for r in rows if r["section"] == "nccl"]
    assert [r["what"] for r in nccl] == ["gloo all_reduce, world 1"]
    megatron = [r for r in rows if r["what"] == "NormAwareOptimizer.param_l2_norm()"]
    if megatron and megatron[0]["note"].startswith("skipped"):
        return  # no megatron-core in this environment
    assert len(megatron) == 2, rows  # Float16 and distributed optimizer
    assert all(r["rel_error"] < 1e-6 for r in megatron), megatron
    # An armed step and an audit on each optimizer: measured, no error, the grads' total equal
    # to the grad norm Megatron's step() returns, a clean audit.
    steps = [r for r in rows if r["what"] == "armed step() + step_norms()"]
    assert len(steps) == 2 and all("error" not in r["note"] for r in steps), steps
    # (Megatron's norm sums in fp32: 3.8e-6 off on these constant grads; ours in float64.)
    assert all(r["rel_error"] < 1e-5 and r["median_ms"] > 0 for r in steps), steps
    assert all("extra aten ops per param tensor" in r["note"] for r in steps), steps
    audits = [r for r in rows if r["what"] == "audit()"]
    assert len(audits) == 2 and all(" ok: 0 findings" in r["note"] for r in audits), audits
    # A watched step on each: timed; whether its grads read syncs the host is CUDA's to say.
    watched = [r for r in rows if r["what"] == "watched step()"]
    assert len(watched) == 2 and all(r["median_ms"] > 0 for r in watched), watched
    assert all("not checked (no CUDA)" in r["note"] for r in watched), watched
    # The watch's host time with kernels queued is CUDA's to measure; on CPU the row says so.
    (host,) = [r for r in rows if r["what"] == "a watched step's host time"]
    assert host["note"].startswith("skipped: CUDA only"), host


def _watch_host_row_on_cpu(_: None) -> dict:
    from benchmarks.gpu_check.megatron import _watch_host_row
    from norm_optim.testing import init_parallel

    init_parallel()
    return _watch_host_row("host", "layers-8-h4", CPU, QUICK)


def test_the_watch_host_row_measures_a_real_watched_read() -> None:
    """The CUDA-only row's body, run on one CPU rank (where its time is not the host's alone):
    the 100-tensor model is built, watched and read, its ops and Python calls counted."""
    from norm_optim.testing import run_ranks

    (r,) = run_ranks(_watch_host_row_on_cpu, 1, None, timeout=300)
    assert r["tensors"] == 100 and r["median_ms"] > 0, r
    ops = int(r["note"].split(" aten ops")[0].rsplit(" ", 1)[1])
    assert 0 < ops <= 32, r
