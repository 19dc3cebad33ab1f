"""``optimizer.audit()`` beside megatron's ``check_param_hashes_across_dp_replicas``.

``python -m benchmarks.audit [--calls N] [--out results/audit.json]``: the same model, optimizer
and ranks for both (forked gloo CPU ranks, one torch thread each), interleaved call by call
after a barrier; per method the slowest rank's median seconds per call and the largest extra
peak RSS of a call (``benchmarks.param_norm.memory``). Then what each detects: one fault per
kind (``norm_optim.testing.inject_fault_``) on one rank, each method called on every rank,
"detected" when any rank's answer says so (megatron's returns a per-rank bool;
``cross_check=True`` so that every rank compares with every replica).

``python -m benchmarks.audit --kernel [--device cuda] [--numel N ...]``: the per-tensor work
alone, in one process, without megatron-core (what one GPU runs without a distributed setup): the audit's
device fingerprint of a bf16 weight, and its staleness check against an fp32 main, beside what
megatron's check does per weight (a host fp32 copy, then SHA-1), median of ``--calls``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.param_norm.memory import PeakMemory
from norm_optim.testing import TinyGPTConfig, init_parallel, run_ranks
from norm_optim.testing.models import build_model, build_optimizer, train_step

# ~1.9e7 elements: 4 layers of hidden 512 and a 8,192-word embedding.
MODEL = TinyGPTConfig(hidden_size=512, num_layers=4, num_attention_heads=8, vocab_size=8192)


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    world: int
    tp: int = 1
    distributed: bool = True


LAYOUTS = (
    Layout("dp2-float16", 2, distributed=False),
    Layout("dp2-distributed", 2),
    Layout("tp2-dp2-distributed", 4, tp=2),
)
# (what, how, param, ranks, what the fault is)
FAULTS = (
    ("weight", "nudge", "decoder.layers.1.mlp.linear_fc1.weight", (1,), "DP replica, lowest bit"),
    ("weight", "swap", "decoder.layers.1.mlp.linear_fc1.weight", (1,), "DP replica, two swapped"),
    # TP rank 1 on both DP replicas: an unmarked TP split looks like this (DP replicas agree)
    ("weight", "nudge", "decoder.final_layernorm.weight", (1, 3), "TP duplicate on all replicas"),
    ("main", "nudge", "decoder.layers.0.mlp.linear_fc2.weight", (1,), "fp32 main, lowest bit"),
    ("main", "sign", "*", (0,), "fp32 main, sign flip"),
)


def _megatron_check(chunks: list) -> bool:
    from megatron.core.utils import check_param_hashes_across_dp_replicas

    return bool(check_param_hashes_across_dp_replicas(chunks, cross_check=True))


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rank(layout: Layout, calls: int) -> dict[str, Any]:
    import torch.distributed as dist

    from norm_optim import NormAwareOptimizer
    from norm_optim.testing.faults import inject_fault_

    init_parallel(tp=layout.tp)
    chunks = build_model(MODEL, use_distributed_optimizer=layout.distributed, seed=3)
    optimizer = NormAwareOptimizer(build_optimizer(chunks, lr=1e-3), model=chunks)
    train_step(chunks, optimizer)
    methods: dict[str, Callable[[], Any]] = {
        "norm_optim audit()": optimizer.audit,
        "megatron check_param_hashes": lambda: _megatron_check(chunks),
    }
    for fn in methods.values():  # warm-up: first collectives, first kernels
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(calls):
        for name, fn in methods.items():
            times[name].append(_timed(fn))
    memory = PeakMemory(torch.device("cpu"))
    out: dict[str, Any] = {
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "extra_peak_bytes": {name: memory.measure(fn) for name, fn in methods.items()},
        "local_numel": sum(p.numel() for c in chunks for p in c.parameters()),
        "detects": {},
    }
    registry = optimizer.registry
    for what, how, param, ranks, label in FAULTS:
        if max(ranks) >= layout.world:
            continue
        if layout.distributed and what == "main" and how == "nudge":
            continue  # a shard has no replica in one instance: nothing can compare it
        if not layout.distributed and what == "main" and how == "sign":
            continue
        name = param
        if param == "*":
            name = next(r.global_name for r in registry if r.tensor is not None)
        saved = {id(r.param): r.param.detach().clone() for r in registry}
        mains = {
            id(r.param): r.tensor.detach().clone()
            for r in registry
            if isinstance(r.tensor, torch.Tensor)
        }
        for rank in ranks:
            inject_fault_(optimizer, name, what=what, how=how, rank=rank)  # type: ignore[arg-type]
        report = optimizer.audit()
        megatron_ok = torch.tensor([float(_megatron_check(chunks))])
        dist.all_reduce(megatron_ok, op=dist.ReduceOp.MIN)
        out["detects"][label] = {
            "norm_optim audit()": sorted({str(f.kind) for f in report.findings}),
            "megatron check_param_hashes": not bool(megatron_ok.item()),
        }
        for r in registry:  # undo the fault
            r.param.data.copy_(saved[id(r.param)])
            if id(r.param) in mains:
                r.tensor.data.copy_(mains[id(r.param)])  # type: ignore[union-attr]
    return out


def _median_s(fn: Callable[[], Any], device: torch.device, calls: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_rows(device: torch.device, sizes: list[int], calls: int) -> list[dict[str, Any]]:
    """Per-tensor cost on ``device``: fingerprint, staleness check, megatron's host SHA-1."""
    import hashlib

    from norm_optim._kernels.fingerprint import FingerprintPass, stale_elements

    prints = FingerprintPass()
    rows = []
    for numel in sizes:
        main = torch.randn(numel, device=device)
        weight = main.to(torch.bfloat16)
        times = {
            "audit fingerprint (bf16 weight)": _median_s(
                lambda: prints.fingerprint(weight).tolist(), device, calls
            ),
            "audit staleness (weight vs fp32 main)": _median_s(
                lambda: int(stale_elements(weight, main)), device, calls
            ),
            "megatron: host fp32 copy + SHA-1": _median_s(
                lambda: hashlib.sha1(weight.data.to("cpu").float().numpy(force=True)).digest(),
                device,
                calls,
            ),
        }
        rows.append({"device": str(device), "numel": numel, "median_s": times})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.audit", description=__doc__)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernel", action="store_true", help="per-tensor costs, one process")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, nargs="+", default=[2 * 10**7, 10**8])
    args = parser.parse_args()
    if args.kernel:
        if args.device == "cpu":
            torch.set_num_threads(1)
        found = kernel_rows(torch.device(args.device), args.numel, args.calls)
        if args.out is not None:
            args.out.write_text(json.dumps(found, indent=1) + "\n")
        return
    rows = []
    for layout in LAYOUTS:
        results = run_ranks(_rank, layout.world, layout, args.calls, timeout=900.0)
        row: dict[str, Any] = {"layout": layout.name, "world": layout.world}
        for key in ("median_s", "extra_peak_bytes"):
            row[key] = {name: max(r[key][name] or 0 for r in results) for name in results[0][key]}
        row["local_numel"] = max(r["local_numel"] for r in results)
        row["detects"] = results[0]["detects"]
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.out is not None:
        env = {
            "machine": platform.machine(),
            "cpus": len(__import__("os").sched_getaffinity(0)),
            "torch": torch.__version__,
            "threads_per_rank": 1,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        }
        args.out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
