"""The ``nccl`` row: a default process group of one rank and an ``all_reduce`` over it."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator

import torch

from .measure import Options, Row, median_seconds, row, synchronize


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
    synchronize(device)
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
