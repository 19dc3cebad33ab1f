"""The command line: ``python -m benchmarks.param_norm`` (under torchrun: ``torchrun ... -m
benchmarks.param_norm``); see the package docstring or ``--help``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

from . import __doc__ as _PACKAGE_DOC
from . import names
from .cases import select_cases
from .measure import Options
from .plots import plot
from .report import environment, library_fingerprint, read_rows, summary, write_json
from .runners import launched_by_torchrun, run_forked, run_torchrun


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.param_norm",
        description=(_PACKAGE_DOC or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--quick", action="store_true", help="small cases only (< 3 min, 2 cores)")
    parser.add_argument("--cases", nargs="*", default=[], help="model names to run (default: all)")
    parser.add_argument(
        "--worlds",
        nargs="*",
        type=int,
        default=[],
        help="world sizes to run on CPU (default: those of each case)",
    )
    parser.add_argument("--calls", type=int, default=20, help="timed calls per method")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per method first")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank (1: every method on the same footing)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per case (CPU)")
    parser.add_argument("--json", type=Path, help="write the rows (and the environment) here")
    parser.add_argument("--plot-dir", type=Path, help="write PNG plots here (needs matplotlib)")
    parser.add_argument(
        "--replot", type=Path, nargs="+", help="plot rows from these JSON files instead of running"
    )
    parser.add_argument(
        "--names-exchange",
        action="store_true",
        help="only the bytes of the per-param names exchange at simulated "
        "world sizes up to 16,384 (one process, seconds)",
    )
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.names_exchange:
        table = names.rows()
        print(names.format_rows(table))
        if args.json:
            write_json(args.json, [], {**environment(), "names_exchange": table})
            print(f"# wrote {args.json}")
        return 0
    if args.replot:
        for path in plot(read_rows(args.replot), args.plot_dir or Path(".")):
            print(f"# wrote {path}")
        return 0
    sources = library_fingerprint()  # now: the files may change while the run goes on
    opts = Options(args.device, args.calls, args.warmup, args.threads)
    cases = select_cases(args.quick, args.cases, args.worlds)
    start = time.perf_counter()
    if launched_by_torchrun():
        rows = run_torchrun(cases, opts)
        if not rows:
            return 0  # not rank 0
    elif args.device == "cuda":
        raise SystemExit(
            "on CUDA, launch one process per GPU: torchrun --nproc-per-node N "
            "-m benchmarks.param_norm --device cuda ..."
        )
    else:
        rows = run_forked(cases, opts, args.timeout)
    env = {
        **environment(),
        "norm_optim_sources_sha1": sources,
        "wall_s": round(time.perf_counter() - start, 1),
        "argv": sys.argv[1:],
    }
    print(summary(rows, env))
    if args.json:
        write_json(args.json, rows, env)
        print(f"# wrote {args.json}")
    if args.plot_dir:
        for path in plot(rows, args.plot_dir):
            print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
