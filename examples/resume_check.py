#!/usr/bin/env python
"""Prove a resume in your own loop: fingerprint the optimizer's state at save, verify it at load.

The real Megatron-core pieces on CPU gloo ranks: a tiny GPT, ``get_megatron_optimizer``
(Float16 optimizer: each rank's ``state_dict()`` is its whole state), two training steps, a
checkpoint (per rank, ``torch.save`` of the model's and the optimizer's state dicts) and the
state's fingerprints beside it; then a new model and optimizer (another init) load it and
verify, before their first step. ``--corrupt`` swaps two elements of one Adam moment after the
load (the norms stay the same): the report names the pair.

Run it::

    python examples/resume_check.py               # 2 CPU ranks: "... 0 mismatches: ..."
    python examples/resume_check.py --corrupt     # "... 1 mismatches: <param>[exp_avg] ..."

The lines to copy into your own script are the ones with ``state_fingerprint``,
``StateFingerprint`` and ``verify_resume``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from norm_optim import NormAwareOptimizer, StateFingerprint, verify_resume
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer, train_step

FINGERPRINTS = "norm_optim_resume.json"


def _build(seed: int) -> tuple[list, NormAwareOptimizer]:
    chunks = build_model(TinyGPTConfig(), seed=seed)
    return chunks, NormAwareOptimizer(build_optimizer(chunks, lr=1e-2), model=chunks)


def run(directory: str, corrupt: bool) -> str:
    init_parallel()
    rank = dist.get_rank()
    path = os.path.join(directory, f"rank{rank}.pt")

    # ---- the run that saves
    chunks, optimizer = _build(seed=1)
    for step in range(2):
        train_step(chunks, optimizer, seed=step)
    torch.save({"model": chunks[0].state_dict(), "optimizer": optimizer.state_dict()}, path)
    saved = optimizer.state_fingerprint()  # every rank: one all-reduce
    if rank == 0:  # the same on every rank: one writes it
        saved.save(os.path.join(directory, FINGERPRINTS))

    # ---- the run that resumes (another init: everything it holds must come from the load)
    chunks, optimizer = _build(seed=2)
    train_step(chunks, optimizer, seed=0)  # its Adam state exists, as in any run that loads
    checkpoint = torch.load(path, weights_only=False)
    chunks[0].load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if corrupt:
        _swap_two_moment_elements(optimizer)
    loaded = optimizer.state_fingerprint()  # every rank, before the first step
    report = verify_resume(StateFingerprint.load(os.path.join(directory, FINGERPRINTS)), loaded, 2)
    return report.line()


def _swap_two_moment_elements(optimizer: Any) -> None:
    """What no norm sees: two different elements of one exp_avg exchanged, on every rank."""
    inner = optimizer.wrapped_optimizer.chained_optimizers[0].optimizer
    main = max(inner.state, key=lambda t: t.numel())
    exp_avg = inner.state[main]["exp_avg"].view(-1)
    j = int((exp_avg != exp_avg[0]).nonzero()[0])
    with torch.no_grad():
        exp_avg[0], exp_avg[j] = exp_avg[j].clone(), exp_avg[0].clone()


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks")
    parser.add_argument("--corrupt", action="store_true", help="swap two moment elements")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="norm_optim_resume_") as directory:
        lines = run_ranks(run, args.nproc, directory, args.corrupt, timeout=300)
    print(lines[0])
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
