"""Where the ranks come from: gloo ranks forked per case on CPU, or the processes torchrun
started (CUDA + NCCL, or gloo), and what every rank does for one case.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .bench import build_bench
from .cases import Case
from .measure import Options, measure_methods, merge_ranks
from .memory import PeakMemory
from .methods import methods_for
from .reference import reference_norm
from .wrap_cost import wrap_cost

Row = dict[str, Any]


def run_case(case: Case, opts: Options) -> list[Row]:
    """Body of every rank: build, measure every method, gather; returns the case's rows."""
    torch.set_num_threads(opts.threads)
    device = (
        torch.device(opts.device, torch.cuda.current_device())
        if opts.device == "cuda"
        else torch.device("cpu")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        bench = build_bench(case, device)
    reference, numel, tensors = reference_norm(bench)
    methods = [(m.name, m.prepare(bench)) for m in methods_for(case)]
    with torch.no_grad():
        local = measure_methods(methods, device, opts)
    counted = bench.wrapped.registry.counted
    mine = {
        "local_numel": sum(r.numel for r in counted),
        "local_tensors": len(counted),
        "measurements": local,
        **wrap_cost(bench),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    meta = dict(
        case=case.name,
        kind=case.kind,
        world=dist.get_world_size(),
        numel=numel,
        tensors=tensors,
        layout=case.layout,
        device=device.type,
        threads=opts.threads,
        calls=opts.calls,
        memory_method=PeakMemory(device).method,
        local_numel=max(g["local_numel"] for g in gathered),
        local_tensors=max(g["local_tensors"] for g in gathered),
        registry_build_s=max(g["registry_build_s"] for g in gathered),
        declarations_s=max(g["declarations_s"] for g in gathered),
    )
    return [
        {
            **meta,
            "method": name,
            **merge_ranks([g["measurements"][name] for g in gathered], reference),
        }
        for name, _ in methods
    ]


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _import_megatron() -> None:
    """Import megatron once in the parent, so forked ranks start in ~0.1 s instead of ~4 s."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401


def run_forked(cases: Sequence[Case], opts: Options, timeout: float) -> list[Row]:
    """CPU: each case on fresh gloo ranks forked by ``run_ranks`` (fresh megatron state)."""
    from norm_optim.testing import run_ranks

    _import_megatron()
    rows: list[Row] = []
    for case in cases:
        start = time.perf_counter()
        case_rows = run_ranks(run_case, case.world, case, opts, timeout=timeout)[0]
        print(
            f"# {case.name} world={case.world}: {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        rows.extend(case_rows)
    return rows


def run_torchrun(cases: Sequence[Case], opts: Options) -> list[Row]:
    """Under torchrun: every selected model at the launched world size, one after another.

    Returns the rows on rank 0 and nothing elsewhere, so that only rank 0 reports.
    """
    from megatron.core import parallel_state

    if opts.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from norm_optim.testing import install_cpu_shim

        install_cpu_shim()
    dist.init_process_group("nccl" if opts.device == "cuda" else "gloo")
    world = dist.get_world_size()
    models = {c.name: c for c in cases}  # each model once, whatever worlds were selected
    rows: list[Row] = []
    try:
        for case in models.values():
            rows.extend(run_case(case.at_world(world), opts))
            parallel_state.destroy_model_parallel()
            gc.collect()
            if opts.device == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return rows if int(os.environ["RANK"]) == 0 else []
