"""The ``megatron`` rows: ``param_l2_norm()``, an armed and a watched step, and ``audit()`` on a
real megatron-core optimizer, next to Megatron-LM's own norm."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from .measure import (
    Options,
    Row,
    extra_peak_bytes,
    first_line,
    median_host_seconds,
    median_seconds,
    median_seconds_to_host,
    rel_error,
    row,
    skipped,
)
from .nccl import all_reduce_row, world_of_one


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
        return None, f"megatron.training does not import ({first_line(error)})"
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
        return row("megatron", what, **fields, note=f"error: {first_line(error)}")
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
        return [row("megatron", what, note=f"{label}; error: {first_line(error)}")]
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
        rows.append(row("megatron", "audit()", note=f"{label}; error: {first_line(error)}"))
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
    from norm_optim._step.measurement import WatchedGrads

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
                        syncs = f"the watch's read synced the host: {first_line(error)}"
        finally:
            wrapped.unwatch()
    except Exception as error:
        return row("megatron", what, note=f"{label}; error: {first_line(error)}")
    note = (
        f"{label}; plain step {plain_s * 1e3:.3g} ms ({watched_s / plain_s:.2f}x); "
        f"{extra_ops} extra aten ops per step, whatever the tensor count; {syncs}"
    )
    return row("megatron", what, **fields, median_ms=watched_s * 1e3, note=note)


# The watch's host time by tensor count (benchmarks.step_norms' rows of hidden 4): param tensors
# of ~20 elements, where kernels read ~nothing; the goal is <= 1 ms at 10,000 tensors.
WATCH_HOST_CASES = ("layers-8-h4", "layers-833-h4")


def _watch_host_rows(device: torch.device, opts: Options) -> list[Row]:
    """What a watched ``step()`` adds on the host (its checks, hooks, read, all-reduce and judging,
    kernels queued, not waited for) on an idle step, at 100 and at 10,000 param tensors: flat
    in the tensor count, with its aten ops and Python calls. CUDA only: on a CPU the kernels run
    on the host (``python -m benchmarks.step_norms --tensors`` measures that)."""
    what = "a watched step's host time"
    if device.type != "cuda":
        return [skipped("megatron", what, "CUDA only (kernels run on the host on a CPU)")]
    rows: list[Row] = []
    for case in WATCH_HOST_CASES:
        try:
            rows.append(_watch_host_row(what, case, device, opts))
        except Exception as error:
            rows.append(row("megatron", what, note=f"{case}; error: {first_line(error)}"))
        torch.cuda.empty_cache()  # the model is gone
    return rows


def _watch_host_row(what: str, case: str, device: torch.device, opts: Options) -> Row:
    from benchmarks.step_norms import TENSOR_CASES, aten_ops, python_calls, watched_path
    from norm_optim import NormAwareOptimizer
    from norm_optim.testing import TinyGPTConfig

    chunks, optimizer = _build_megatron(TinyGPTConfig(**TENSOR_CASES[case]), device, True, 7)
    wrapped = NormAwareOptimizer(optimizer, model=chunks)
    params = [p for c in chunks for p in c.parameters()]
    for p in params:
        p.main_grad.fill_(1e-3)
    watch_only = watched_path(wrapped)
    wrapped.watch()
    try:
        with torch.no_grad():
            wrapped.step()  # the first watched step binds its read
            host_s = median_host_seconds(watch_only, device, opts)
            ops, calls = aten_ops(watch_only), python_calls(watch_only)
    finally:
        wrapped.unwatch()
    return row(
        "megatron",
        what,
        dtype="bf16 params",
        numel=sum(p.numel() for p in params),
        tensors=len(params),
        median_ms=host_s * 1e3,
        note=f"{case}, distributed optimizer, kernels not waited for; {ops} aten ops, "
        f"{calls} Python calls (the bound at 10,000 tensors: 1 ms)",
    )


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
                    note = f"{label}; error: {first_line(error)}"
                    rows.append(row("megatron", what, note=note))
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the model is gone: free its memory for the next
            rows += _watch_host_rows(device, opts)
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
                        rows.append(row(name, "(section)", note=f"error: {first_line(error)}"))
    except Exception as error:  # no process group
        rows.append(row("nccl", "init_process_group, world 1", note=f"error: {first_line(error)}"))
    return rows
