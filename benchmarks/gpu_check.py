"""The GPU check: norm_optim's CUDA path measured in one run, printed as one table.

``python -m benchmarks.gpu_check`` (``make gpu-check``) on a machine with one CUDA GPU, in
under 5 minutes. Each row of the table is one measurement:

===============  ==================================================================================
``peak``         a device-to-device copy (read + write bytes over its time): the practical ceiling
                 of a kernel that reads each byte once, measured in the same run; the ``of peak``
                 column of every kernel row is relative to it.
``kernel``       the sum of squares of a tensor list (one tensor, or one buffer split into
                 ``K`` tensors: ``--sizes 1e8x1000``), bf16 and fp32, 10⁶ to 10⁹ elements (capped
                 by free GPU memory), by ``torch._foreach_norm``, norm_optim's own path
                 (:class:`norm_optim._kernels.SumOfSquaresPlan`, the backend it picked in the
                 note), apex's ``multi_tensor_l2norm`` and Transformer Engine's (each skipped, with
                 the reason, where it does not import). Median time of several calls (CUDA
                 events, after warm-up, L2 flushed before each), achieved GB/s (bytes read once
                 over that time) and its fraction of ``peak``, the relative error of the norm
                 against a float64 reference of the same values, and the extra peak GPU memory
                 of one call (``torch.cuda.max_memory_allocated`` above what was allocated).
``nccl``         ``init_process_group("nccl")`` at world size 1 (a FileStore), then a small
                 ``all_reduce``: median time, and whether the sum came back unchanged.
``megatron``     ``NormAwareOptimizer.param_l2_norm()`` on a real megatron-core optimizer on CUDA
                 (a GPT built with :mod:`norm_optim.testing`'s pieces, weights set by
                 :func:`~norm_optim.testing.fill_deterministic_`; the Float16 and the distributed
                 optimizer), against the float64 oracle of those weights
                 (:func:`~norm_optim.testing.oracle_norm`); next to it Megatron-LM's own
                 ``megatron.training.utils.calc_params_l2_norm`` (as is and with
                 ``force_create_fp32_copy=True``; skipped where ``megatron.training`` does not
                 import) and a naive ``[p.float() for p in params]`` norm: time to a host float,
                 relative error and extra peak GPU memory of one call. Then an armed ``step()``
                 (``measure_next_step()`` + ``step()`` + ``step_norms()``) against a plain one on
                 the same grads: its time and the ratio, the aten ops it adds per param tensor
                 (each a kernel launch), its extra ``max_memory_allocated``, the grads' total
                 against the grad norm ``step()`` returns; and ``audit()``: its time, extra
                 memory and verdict. Without megatron-core the row says ``skipped: megatron-core
                 not installed``.
===============  ==================================================================================

Without CUDA it prints one line saying so (and what it would run) and exits 0. ``--device cpu``
runs the same code on CPU (gloo, small sizes) to check the script itself; its numbers mean
nothing.

The table is also written, as text and as JSON (rows and environment), to the folder ``--out``
names (default ``benchmarks/results/``).

Running it on a GPU machine without network access
--------------------------------------------------
Plan for the hardest case: Python 3.12 and torch (CUDA build), no megatron-core, no apex or
Transformer Engine, and no package registry. The script needs no install of norm_optim: run from the repository root,
``python3 -m benchmarks.gpu_check`` imports the working tree. For the ``megatron`` rows, carry
the megatron-core wheel (it needs only torch, numpy and packaging, which are there), e.g. 0.19.2
(Python >= 3.12). Once, in the repository root of the machine you work on::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        -d .whl megatron-core==0.19.2

then run, on the GPU machine, with ``.whl`` carried along (one command, well under 5 minutes)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
    PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_check --out benchmarks/results

(``make gpu-check`` builds the project's virtual environment first, which needs a package
registry: on a machine without network call the module directly.) See ``docs/gpu-check.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib
import importlib.metadata
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from .param_norm.report import environment, format_bytes, library_fingerprint

Row = dict[str, Any]

SECTIONS = ("kernels", "nccl", "megatron")
GPU_SIZES = ("1e6", "1e7", "1e8", "1e8x1000", "1e9")
CPU_SIZES = ("1e4", "1e5", "1e5x100")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Flushed before each timed kernel call so that small inputs are read from memory, not from L2
# (an H200 has 60 MiB of it).
_L2_FLUSH_BYTES = 256 << 20
# The float64 reference copies this many elements at a time (512 MiB of float64).
_REFERENCE_CHUNK = 1 << 26
# Free memory kept aside, beyond the inputs, for the references, copies and kernels' temporaries.
_HEADROOM_BYTES = 2 << 30
_COPY_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Options:
    """What every measurement shares."""

    warmup: int = 3
    repeats: int = 10


# ----------------------------------------------------------------------------------------------
# Device-agnostic helpers (the tests run them on CPU tensors).


def rel_error(value: float, reference: float) -> float:
    """``|value - reference| / |reference|`` (the absolute error when the reference is 0)."""
    if not math.isfinite(value):
        return math.inf
    return abs(value - reference) / (abs(reference) or 1.0)


def bandwidth_gbs(nbytes: int, seconds: float) -> float:
    """Bytes moved per second, in GB/s (10⁹ bytes)."""
    return nbytes / seconds / 1e9


def peak_fraction(gbs: Optional[float], peak_gbs: Optional[float]) -> Optional[float]:
    """``gbs`` as a fraction of the copy's ``peak_gbs`` (None where either is unknown)."""
    if gbs is None or not peak_gbs:
        return None
    return gbs / peak_gbs


def parse_size(text: str) -> tuple[int, int]:
    """``"1e8"`` -> (10⁸ elements, 1 tensor); ``"1e8x1000"`` -> (10⁸ elements, 1000 tensors)."""
    numel, _, tensors = text.lower().partition("x")
    n, k = int(float(numel)), int(tensors or 1)
    if n < 1 or not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"{text!r}: want N or NxK with 1 <= K <= N")
    return n, k


def make_tensors(
    numel: int, pieces: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> list[torch.Tensor]:
    """Standard-normal values in one buffer of ``numel`` elements, as ``pieces`` contiguous
    views of (nearly) equal size."""
    generator = torch.Generator(device=device).manual_seed(seed)
    flat = torch.empty(numel, dtype=dtype, device=device).normal_(generator=generator)
    return list(flat.split(-(-numel // pieces)))


def float64_sum_of_squares(tensors: Sequence[torch.Tensor], chunk: int = _REFERENCE_CHUNK) -> float:
    """The reference: every element squared and summed in float64, a bounded copy at a time."""
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for t in tensors:
        for piece in t.reshape(-1).split(chunk):
            d = piece.double()
            total += torch.dot(d, d)
    return float(total)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], Any],
    device: torch.device,
    opts: Options,
    before: Optional[Callable[[], Any]] = None,
) -> float:
    """Median device time of ``fn()`` over ``opts.repeats`` calls after ``opts.warmup``: CUDA
    events around each call on CUDA, the wall clock elsewhere. ``before`` runs untimed before
    each timed call (the L2 flush)."""
    for _ in range(opts.warmup):
        fn()
    _synchronize(device)
    times = []
    for _ in range(opts.repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_seconds_to_host(fn: Callable[[], Any], device: torch.device, opts: Options) -> float:
    """Median wall time of ``float(fn())``: what a training loop pays to log the value."""
    for _ in range(opts.warmup):
        float(fn())
    times = []
    for _ in range(opts.repeats):
        _synchronize(device)
        t0 = time.perf_counter()
        float(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def extra_peak_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[Any, Optional[int]]:
    """``fn()``'s result and the GPU memory one call allocated above what was allocated before
    it (``torch.cuda.max_memory_allocated``); None off CUDA."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def free_bytes(device: torch.device) -> Optional[int]:
    """Free memory on ``device`` (None off CUDA: the sizes are then not capped)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def row(section: str, what: str, **fields: Any) -> Row:
    """One table row; missing fields print as ``-``."""
    return {"section": section, "what": what, **fields}


def skipped(section: str, what: str, reason: str) -> Row:
    return row(section, what, note=f"skipped: {reason}")


# ----------------------------------------------------------------------------------------------
# Kernels: the sum of squares of a tensor list.


@dataclasses.dataclass(frozen=True)
class KernelMethod:
    """A way to get the global norm of a tensor list: ``prepare(tensors)`` returns the call
    (built once, outside the timing), whose result is a 0-dim tensor holding the norm."""

    name: str
    prepare: Optional[Callable[[list[torch.Tensor]], Callable[[], torch.Tensor]]]
    skip_reason: Optional[str] = None


def _foreach_norm(tensors: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        return torch.stack(norms).double().square().sum().sqrt()

    return call


def _norm_optim_plan(tensors: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    from norm_optim._kernels import SumOfSquaresPlan

    plan = SumOfSquaresPlan(tensors, [0] * len(tensors), 1)

    def call() -> torch.Tensor:
        return plan()[0].sqrt()

    call.backend = ", ".join(sorted(set(plan.backends.values())))  # type: ignore[attr-defined]
    return call


def _multi_tensor(applier: Any, l2norm: Any) -> Callable[..., Callable[[], torch.Tensor]]:
    def prepare(tensors: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
        noop_flag = torch.zeros(1, dtype=torch.int, device=tensors[0].device)

        def call() -> torch.Tensor:
            total, _ = applier(l2norm, noop_flag, [tensors], False)
            return total.reshape(())

        return call

    return prepare


def _apex() -> Callable[..., Callable[[], torch.Tensor]]:
    import amp_C  # type: ignore[import-not-found]
    from apex.multi_tensor_apply import multi_tensor_applier  # type: ignore[import-not-found]

    return _multi_tensor(multi_tensor_applier, amp_C.multi_tensor_l2norm)


def _transformer_engine() -> Callable[..., Callable[[], torch.Tensor]]:
    from transformer_engine.pytorch.optimizers import (  # type: ignore[import-not-found]
        multi_tensor_applier,
        multi_tensor_l2norm,
    )

    return _multi_tensor(multi_tensor_applier, multi_tensor_l2norm)


def kernel_methods(device: torch.device) -> list[KernelMethod]:
    """The methods compared; apex and Transformer Engine only where they import (on CUDA)."""
    methods = [
        KernelMethod("torch._foreach_norm", _foreach_norm),
        KernelMethod("norm_optim SumOfSquaresPlan", _norm_optim_plan),
    ]
    for name, load, package in (
        ("apex multi_tensor_l2norm", _apex, "apex"),
        ("transformer_engine multi_tensor_l2norm", _transformer_engine, "transformer_engine"),
    ):
        if device.type != "cuda":
            methods.append(KernelMethod(name, None, "CUDA only"))
            continue
        try:
            methods.append(KernelMethod(name, load()))
        except Exception as error:  # ImportError, or a broken build's OSError / RuntimeError
            methods.append(KernelMethod(name, None, f"{package} does not import ({error})"))
    return methods


def copy_peak_row(device: torch.device, opts: Options, nbytes: Optional[int] = None) -> Row:
    """A device-to-device copy of ``nbytes`` (default 1 GiB; 64 MiB on CPU): read + write bytes
    over its median time."""
    if nbytes is None:
        nbytes = _COPY_BYTES if device.type == "cuda" else 64 << 20
    free = free_bytes(device)
    if free is not None:
        nbytes = min(nbytes, max(free - _HEADROOM_BYTES, 0) // 2)
    numel = nbytes // 4
    if numel < 1:
        return skipped("peak", "device-to-device copy", "no free memory")
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, opts)
    moved = 2 * numel * 4
    return row(
        "peak",
        "device-to-device copy (read + write)",
        dtype="fp32",
        numel=numel,
        tensors=1,
        median_ms=seconds * 1e3,
        gbs=bandwidth_gbs(moved, seconds),
        of_peak=1.0,
        note=f"{format_bytes(moved)} moved per copy",
    )


def kernel_rows(
    methods: Sequence[KernelMethod],
    dtype_name: str,
    numel: int,
    pieces: int,
    device: torch.device,
    opts: Options,
    peak_gbs: Optional[float],
) -> list[Row]:
    """Every available method on one input: time, bandwidth, accuracy, extra memory."""
    dtype = DTYPES[dtype_name]
    element_size = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * element_size
    common = dict(dtype=dtype_name, numel=numel, tensors=pieces)
    free = free_bytes(device)
    # The inputs, plus room for a method that upcasts a full fp32 copy of them.
    needed = numel * (element_size + 4) + _HEADROOM_BYTES
    if free is not None and needed > free:
        return [
            skipped(
                "kernel",
                "all methods",
                f"needs {format_bytes(needed)}, {format_bytes(free)} free",
            )
            | common
        ]
    tensors = make_tensors(numel, pieces, dtype, device)
    reference = math.sqrt(float64_sum_of_squares(tensors))
    flush = (
        torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        if device.type == "cuda"
        else None
    )
    before = flush.zero_ if flush is not None else None
    rows = []
    for method in methods:
        if method.prepare is None:
            continue
        try:
            call = method.prepare(tensors)
            seconds = median_seconds(call, device, opts, before)
            out, extra = extra_peak_bytes(call, device)
            gbs = bandwidth_gbs(nbytes, seconds)
            rows.append(
                row(
                    "kernel",
                    method.name,
                    **common,
                    median_ms=seconds * 1e3,
                    gbs=gbs,
                    of_peak=peak_fraction(gbs, peak_gbs),
                    rel_error=rel_error(float(out), reference),
                    extra_peak_bytes=extra,
                    note=getattr(call, "backend", ""),
                )
            )
        except Exception as error:  # an out-of-memory or a kernel's refusal: a row, not a crash
            rows.append(row("kernel", method.name, **common, note=f"error: {_first_line(error)}"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del tensors, flush
    return rows


def kernel_section(
    device: torch.device, sizes: Sequence[tuple[int, int]], dtypes: Sequence[str], opts: Options
) -> list[Row]:
    """The copy peak, then every method on every (dtype, size), then the skipped methods."""
    peak = copy_peak_row(device, opts)
    rows = [peak]
    methods = kernel_methods(device)
    for dtype_name in dtypes:
        for numel, pieces in sizes:
            rows += kernel_rows(methods, dtype_name, numel, pieces, device, opts, peak.get("gbs"))
    rows += [skipped("kernel", m.name, m.skip_reason or "") for m in methods if m.prepare is None]
    return rows


# ----------------------------------------------------------------------------------------------
# NCCL (gloo on CPU) at world size 1.


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[float]:
    """A default process group of one rank (NCCL on CUDA, gloo on CPU) over a FileStore in a
    temporary directory; yields the seconds ``init_process_group`` took, destroys it after."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialized in this process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        t0 = time.perf_counter()
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            yield time.perf_counter() - t0
        finally:
            dist.destroy_process_group()


def all_reduce_row(device: torch.device, opts: Options, init_s: float) -> Row:
    """An ``all_reduce`` (sum) of 1,024 fp32 ones at world 1: the first call (communicator
    setup) and the median of later ones; the sum must come back as it went in."""
    import torch.distributed as dist

    backend = dist.get_backend()
    x = torch.ones(1024, dtype=torch.float32, device=device)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    _synchronize(device)
    first_s = time.perf_counter() - t0
    seconds = median_seconds(lambda: dist.all_reduce(x), device, opts)
    error = float((x - 1).abs().max())
    version = ""
    if backend == "nccl":
        with contextlib.suppress(Exception):
            version = " " + ".".join(map(str, torch.cuda.nccl.version()))
    return row(
        "nccl",
        f"{backend}{version} all_reduce, world 1",
        dtype="fp32",
        numel=x.numel(),
        tensors=1,
        median_ms=seconds * 1e3,
        rel_error=error,
        note=(
            f"{'ok' if error == 0 else 'WRONG SUM'}; init_process_group {init_s * 1e3:.0f} ms, "
            f"first all_reduce {first_s * 1e3:.0f} ms"
        ),
    )


# ----------------------------------------------------------------------------------------------
# param_l2_norm() on a real megatron-core optimizer.


def _build_megatron(
    cfg: Any, device: torch.device, distributed: bool, seed: int
) -> tuple[list[torch.nn.Module], Any]:
    """One GPT chunk on ``device`` in megatron DDP and its ``get_megatron_optimizer``, the way
    Megatron-LM builds them on a GPU (weights initialized on the device)."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from norm_optim.testing import build_optimizer, init_rng
    from norm_optim.testing.models import build_chunk, transformer_config

    config = transformer_config(cfg)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        config.use_cpu_initialization = False
    else:
        init_rng(seed)
    gpt = build_chunk(cfg, config, None).to(device)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True
    )
    chunks = [DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))]
    return chunks, build_optimizer(chunks)


def _megatron_calc() -> tuple[Optional[Callable[..., Any]], str]:
    """Megatron-LM's ``calc_params_l2_norm`` with the global args it reads (bf16, no
    Megatron-FSDP) set where none are; or None and why not."""
    try:
        from megatron.training import global_vars
        from megatron.training.utils import calc_params_l2_norm
    except Exception as error:
        return None, f"megatron.training does not import ({_first_line(error)})"
    if getattr(global_vars, "_GLOBAL_ARGS", None) is None:
        global_vars.set_args(argparse.Namespace(bf16=True, use_megatron_fsdp=False))
    return calc_params_l2_norm, ""


def _megatron_measure(
    what: str, fn: Callable[[], Any], oracle: float, device: torch.device, opts: Options, **fields
) -> Row:
    try:
        with torch.no_grad():
            value, extra = extra_peak_bytes(lambda: float(fn()), device)
            seconds = median_seconds_to_host(fn, device, opts)
    except Exception as error:
        return row("megatron", what, **fields, note=f"error: {_first_line(error)}")
    return row(
        "megatron",
        what,
        **fields,
        median_ms=seconds * 1e3,
        rel_error=rel_error(value, oracle),
        extra_peak_bytes=extra,
        note=f"{value:.6g} (oracle {oracle:.6g})",
    )


def _optimizer_rows(
    cfg: Any,
    distributed: bool,
    oracles: dict[Any, float],
    label: str,
    calc: Optional[Callable[..., Any]],
    calc_reason: str,
    device: torch.device,
    opts: Options,
    seed: int = 7,
) -> list[Row]:
    """Build one model and optimizer, set its weights, and measure norm_optim's call, Megatron-LM's
    function (as is and with fp32 copies) and the naive fp32-copy norm on it. The model is freed
    on return."""
    from norm_optim import NormAwareOptimizer
    from norm_optim.testing import fill_deterministic_, global_param_shapes, oracle_norm

    chunks, optimizer = _build_megatron(cfg, device, distributed, seed)
    fill_deterministic_(chunks, seed, optimizer)
    if cfg not in oracles:  # the same model and seed: the same weights for both optimizers
        oracles[cfg] = float(oracle_norm(global_param_shapes(chunks), seed))
    oracle = oracles[cfg]
    wrapped = NormAwareOptimizer(optimizer, model=chunks)
    params = [p for c in chunks for p in c.parameters()]
    fields = dict(dtype="bf16 params", numel=sum(p.numel() for p in params), tensors=len(params))

    def naive() -> torch.Tensor:
        copies = [p.float() for p in params]  # 4 bytes per param, all alive at once
        norms = torch._foreach_norm(copies, 2)
        return torch.stack(norms).double().square().sum().sqrt()

    first = _megatron_measure(
        "NormAwareOptimizer.param_l2_norm()", wrapped.param_l2_norm, oracle, device, opts, **fields
    )
    first["note"] = f"{label}; {first['note']}"
    rows = [first]
    if calc is None:
        rows.append(skipped("megatron", "calc_params_l2_norm", calc_reason))
    else:
        rows += [
            _megatron_measure(
                "calc_params_l2_norm" + ("(force_create_fp32_copy=True)" if force else ""),
                functools.partial(calc, chunks, force_create_fp32_copy=force),
                oracle,
                device,
                opts,
                **fields,
            )
            for force in (False, True)
        ]
    rows.append(
        _megatron_measure(
            "naive [p.float() for p in params]", naive, oracle, device, opts, **fields
        )
    )
    rows += _step_rows(wrapped, params, label, device, opts, fields)
    return rows


def _step_rows(
    wrapped: Any,
    params: Sequence[torch.nn.Parameter],
    label: str,
    device: torch.device,
    opts: Options,
    fields: dict[str, Any],
) -> list[Row]:
    """An armed ``step()`` (+ ``step_norms()``) against a plain one on the same grads: time,
    extra aten ops per param tensor (each a kernel launch on CUDA), extra peak GPU memory, and
    the grads' total against the grad norm Megatron's ``step()`` returns; then ``audit()``."""
    from benchmarks.step_norms import aten_ops

    trainable = [p for p in params if getattr(p, "main_grad", None) is not None]

    def set_grads() -> None:  # the same grads before every step
        for i, p in enumerate(trainable):
            p.main_grad.fill_(1e-3 * (1 + i % 7))

    def plain() -> Any:
        set_grads()
        return wrapped.step()

    def armed() -> Any:
        set_grads()
        wrapped.measure_next_step()
        out = wrapped.step()
        return out, wrapped.step_norms()

    rows: list[Row] = []
    what = "armed step() + step_norms()"
    try:
        with torch.no_grad():
            plain()  # the optimizer's state exists from here on
            (_, grad_norm, _), norms = armed()
            plain_s = median_seconds(plain, device, opts)
            armed_s = median_seconds(lambda: float(armed()[1].updates.total), device, opts)
            _, plain_peak = extra_peak_bytes(plain, device)
            _, armed_peak = extra_peak_bytes(armed, device)
            extra_ops = (aten_ops(armed) - aten_ops(plain)) / max(len(trainable), 1)
    except Exception as error:
        return [row("megatron", what, note=f"{label}; error: {_first_line(error)}")]
    extra = None if armed_peak is None or plain_peak is None else armed_peak - plain_peak
    grads = float(norms.grads.total)
    rows.append(
        row(
            "megatron",
            what,
            **fields,
            median_ms=armed_s * 1e3,
            rel_error=rel_error(grads, float(grad_norm)) if grad_norm else None,
            extra_peak_bytes=extra,
            note=f"{label}; plain step {plain_s * 1e3:.3g} ms ({armed_s / plain_s:.2f}x); "
            f"{extra_ops:.1f} extra aten ops per param tensor; grads {grads:.6g} "
            f"(step() returned {grad_norm})",
        )
    )
    try:
        with torch.no_grad():
            report, peak = extra_peak_bytes(wrapped.audit, device)
            seconds = median_seconds(wrapped.audit, device, opts)
    except Exception as error:
        rows.append(row("megatron", "audit()", note=f"{label}; error: {_first_line(error)}"))
        return rows
    note = f"{label}; {'ok' if report.ok else 'FINDINGS'}: {len(report.findings)} findings"
    rows.append(
        row(
            "megatron",
            "audit()",
            **fields,
            median_ms=seconds * 1e3,
            extra_peak_bytes=peak,
            note=note,
        )
    )
    rows.append(_watched_row(wrapped, plain, plain_s, label, device, opts, fields))
    return rows


def _watched_row(
    wrapped: Any,
    step: Callable[[], Any],
    plain_s: float,
    label: str,
    device: torch.device,
    opts: Options,
    fields: dict[str, Any],
) -> Row:
    """A watched ``step()`` against the plain one, and on CUDA whether the watch's read of the
    grads synchronizes the host (CUDA's sync debug mode set to raise inside that read only:
    Megatron's own step reads its grad norm on the host)."""
    from benchmarks.step_norms import aten_ops
    from norm_optim._patching import Patch, patches_applied
    from norm_optim._step import WatchedGrads

    what = "watched step()"
    original = WatchedGrads.grads_ready

    def strict(self: Any) -> None:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            original(self)
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    syncs = "host syncs in the watch's read not checked (no CUDA)"
    try:
        with torch.no_grad():
            plain_ops = aten_ops(step)
        wrapped.watch()
        try:
            with torch.no_grad():
                step()  # the first watched step binds its reads
                extra_ops = aten_ops(step) - plain_ops  # each a kernel launch on CUDA
                watched_s = median_seconds(step, device, opts)
                if device.type == "cuda":
                    try:
                        with patches_applied([Patch(WatchedGrads, "grads_ready", strict)]):
                            step()
                        syncs = "no host sync in the watch's read"
                    except RuntimeError as error:
                        syncs = f"the watch's read synced the host: {_first_line(error)}"
        finally:
            wrapped.unwatch()
    except Exception as error:
        return row("megatron", what, note=f"{label}; error: {_first_line(error)}")
    note = (
        f"{label}; plain step {plain_s * 1e3:.3g} ms ({watched_s / plain_s:.2f}x); "
        f"{extra_ops} extra aten ops per step, whatever the tensor count; {syncs}"
    )
    return row("megatron", what, **fields, median_ms=watched_s * 1e3, note=note)


def megatron_section(device: torch.device, cfg_fields: dict[str, Any], opts: Options) -> list[Row]:
    """param_l2_norm() on the Float16 and the distributed optimizer, next to Megatron-LM's own
    norm and a naive fp32-copy norm, all against the float64 oracle of the same weights. Runs
    inside a process group of one rank (:func:`world_of_one`); on CPU inside the test kit's CPU
    shim."""
    what = "NormAwareOptimizer.param_l2_norm()"
    try:
        megatron_core = importlib.import_module("megatron.core")
    except ImportError:
        return [skipped("megatron", what, "megatron-core not installed")]
    from megatron.core import parallel_state as ps

    from norm_optim.testing import TinyGPTConfig, cpu_shim

    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path
        version = str(getattr(megatron_core, "__version__", "?"))
    cfg = TinyGPTConfig(**cfg_fields)
    rows: list[Row] = []
    oracles: dict[Any, float] = {}
    shim = cpu_shim() if device.type == "cpu" else contextlib.nullcontext()
    with shim:
        ps.initialize_model_parallel(1, 1)
        try:
            calc, calc_reason = _megatron_calc()
            for distributed in (False, True):
                kind = "distributed" if distributed else "Float16"
                label = f"megatron-core {version}, {kind} optimizer"
                try:
                    rows += _optimizer_rows(
                        cfg, distributed, oracles, label, calc, calc_reason, device, opts
                    )
                except Exception as error:
                    note = f"{label}; error: {_first_line(error)}"
                    rows.append(row("megatron", what, note=note))
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the model is gone: free its memory for the next
        finally:
            ps.destroy_model_parallel()
    return rows


def process_group_sections(
    device: torch.device, sections: Sequence[str], model_fields: dict[str, Any], opts: Options
) -> list[Row]:
    """The ``nccl`` and ``megatron`` rows, inside one process group of one rank; an error in
    either (or in making the group) is a row that says so, not a crash."""
    rows: list[Row] = []
    try:
        with world_of_one(device) as init_s:
            for name, section in (
                ("nccl", lambda: [all_reduce_row(device, opts, init_s)]),
                ("megatron", lambda: megatron_section(device, model_fields, opts)),
            ):
                if name in sections:
                    try:
                        rows += section()
                    except Exception as error:
                        rows.append(row(name, "(section)", note=f"error: {_first_line(error)}"))
    except Exception as error:  # no process group
        rows.append(row("nccl", "init_process_group, world 1", note=f"error: {_first_line(error)}"))
    return rows


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
    """``benchmarks/results/`` (next to this file): where the project keeps measured figures."""
    return Path(__file__).resolve().parent / "results"


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


# ----------------------------------------------------------------------------------------------
# The command line.

_WHAT_RUNS = (
    "fused sum-of-squares kernels (torch._foreach_norm, norm_optim's SumOfSquaresPlan, apex / "
    "Transformer Engine multi_tensor_l2norm) on bf16 and fp32 up to 1e9 elements against a "
    "device copy's bandwidth and a float64 reference, an NCCL all_reduce at world 1, and "
    "param_l2_norm() on a real megatron-core optimizer against a float64 oracle"
)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: run the same code on CPU with small sizes (checks the script, not the GPU)",
    )
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to run"
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        help=f"kernel inputs, N or NxK (N elements in K tensors); default {' '.join(GPU_SIZES)} "
        f"(CPU: {' '.join(CPU_SIZES)})",
    )
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument(
        "--max-numel", type=float, default=1e9, help="drop kernel inputs larger than this"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls (the median)")
    parser.add_argument(
        "--hidden-size", type=int, help="the megatron GPT's width (default 1024; CPU 64)"
    )
    parser.add_argument("--num-layers", type=int, help="its layers (default 4; CPU 2)")
    parser.add_argument("--vocab-size", type=int, help="its vocabulary (default 32768; CPU 128)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the folder the table goes to (default: benchmarks/results/)",
    )
    return parser.parse_args(argv)


def _model_fields(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    gpu = device.type == "cuda"
    hidden = args.hidden_size or (1024 if gpu else 64)
    return dict(
        hidden_size=hidden,
        num_layers=args.num_layers or (4 if gpu else 2),
        num_attention_heads=max(hidden // 64, 1),
        vocab_size=args.vocab_size or (32768 if gpu else 128),
        seq_length=512 if gpu else 16,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"CUDA is not available (torch {torch.__version__}): nothing was run. On a machine "
            f"with a CUDA GPU this measures {_WHAT_RUNS} (--device cpu runs it on CPU to check "
            "the script)."
        )
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
    if device is None:
        device = torch.device("cpu")
        # One thread, as the CPU benchmark runs: several contend with gloo's threads on a small
        # machine (a 0.1 ms call took 10 ms on 2 cores).
        torch.set_num_threads(1)
    opts = Options(warmup=args.warmup, repeats=args.repeats)
    sizes = args.sizes or [
        parse_size(s) for s in (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    ]
    sizes = [(n, k) for n, k in sizes if n <= args.max_numel]
    sources = library_fingerprint()
    start = time.perf_counter()
    rows: list[Row] = []
    if "kernels" in args.sections:
        rows += kernel_section(device, sizes, args.dtypes, opts)
    if {"nccl", "megatron"} & set(args.sections):
        rows += process_group_sections(device, args.sections, _model_fields(args, device), opts)
    env = {
        **run_environment(device),
        "norm_optim_sources_sha1": sources,
        "wall_s": round(time.perf_counter() - start, 1),
        "argv": list(sys.argv[1:] if argv is None else argv),
    }
    table = format_table(rows)
    where = env.get("gpu") or env.get("processor") or device.type
    print(
        f"{table}\n\n# {len(rows)} rows in {env['wall_s']:.0f} s on {where}, torch {env['torch']}"
    )
    for path in write_outputs(args.out or default_out_dir(), rows, env, table):
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
