"""The ``peak`` and ``kernel`` rows: a device copy's bandwidth, and the sum of squares of a
tensor list by each fused kernel against a float64 reference."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from ..units import format_bytes
from .measure import (
    DTYPES,
    Options,
    Row,
    bandwidth_gbs,
    extra_peak_bytes,
    first_line,
    float64_sum_of_squares,
    free_bytes,
    make_tensors,
    median_seconds,
    peak_fraction,
    rel_error,
    row,
    skipped,
)


# ----------------------------------------------------------------------------------------------
# Kernels: the sum of squares of a tensor list.

# Flushed before each timed kernel call so that small inputs are read from memory, not from L2
# (an H200 has 60 MiB of it).
_L2_FLUSH_BYTES = 256 << 20
# Free memory kept aside, beyond the inputs, for the references, copies and kernels' temporaries.
_HEADROOM_BYTES = 2 << 30
_COPY_BYTES = 1 << 30


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
            rows.append(row("kernel", method.name, **common, note=f"error: {first_line(error)}"))
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
