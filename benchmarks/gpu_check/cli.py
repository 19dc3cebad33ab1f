"""The command line: ``python -m benchmarks.gpu_check`` (``make gpu-check``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from .measure import CPU_SIZES, DTYPES, GPU_SIZES, Options, Row, SECTIONS, parse_size

from ..param_norm.report import library_fingerprint
from .kernels import kernel_section
from .megatron import process_group_sections
from .report import default_out_dir, format_table, run_environment, write_outputs

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
        description=(sys.modules[__package__].__doc__ or "").split("\n\n")[0],
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
