"""What the resume proof costs beside the checkpoint save it rides on.

``python -m benchmarks.resume [--hidden 256 512] [--layers 4] [--world 2] [--out FILE]``

On ``--world`` CPU gloo ranks (the real megatron-core GPT, bf16, the distributed optimizer,
one training step so that Adam's moments exist), each rank times, interleaved in the same
processes:

- ``save_s``: megatron's ``dist_checkpointing.save`` of the model and the optimizer
  (``torch_dist``, ``fully_reshardable``: what Megatron-LM's ``--ckpt-format torch_dist`` writes),
  to a fresh directory;
- ``fingerprint_s``: ``optimizer.state_fingerprint()``: every (param, state) hashed with its
  global index, one all-reduce;
- ``fingerprint_over_save``: their ratio, and the elements hashed per second on this rank.

The slowest rank's median over ``--repeats`` (default 3) of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from norm_optim.testing import init_parallel, run_ranks


@dataclasses.dataclass(frozen=True)
class Case:
    hidden: int
    layers: int
    world: int
    repeats: int


def _rank(case: Case) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from norm_optim import NormAwareOptimizer
    from norm_optim._patching import PatchSet
    from norm_optim.testing._internal.loop_patches import torch_dist_save_patches
    from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer, train_step
    from norm_optim.testing.models import unwrap_gpt

    PatchSet.apply(torch_dist_save_patches())  # a fresh rank process: nothing to undo
    init_parallel()
    cfg = TinyGPTConfig(hidden_size=case.hidden, num_layers=case.layers, vocab_size=1024)
    chunks = build_model(cfg, use_distributed_optimizer=True)
    inner = build_optimizer(chunks, lr=1e-3)
    train_step(chunks, inner, seed=0)
    optimizer = NormAwareOptimizer(inner, model=chunks)
    optimizer.state_fingerprint()  # the names exchange and first-call costs, untimed

    def save() -> None:
        model = unwrap_gpt(chunks[0]).sharded_state_dict()
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        state = {"model": model, "optimizer": inner.sharded_state_dict(model, metadata=metadata)}
        with tempfile.TemporaryDirectory() as directory:
            dist_checkpointing.save(state, directory)

    saves, prints = [], []
    for _ in range(case.repeats):
        start = time.perf_counter()
        save()
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        found = optimizer.state_fingerprint()
        prints.append(time.perf_counter() - start)
    held = sum(r.tensor.numel() for r in optimizer.registry.counted)
    return {
        "save_s": statistics.median(saves),
        "fingerprint_s": statistics.median(prints),
        "local_elements": held,
        "pairs": len(found.entries),
    }


def run(case: Case) -> dict[str, Any]:
    ranks = run_ranks(_rank, case.world, case, timeout=900)
    save = max(r["save_s"] for r in ranks)
    fingerprint = max(r["fingerprint_s"] for r in ranks)
    elements = max(r["local_elements"] for r in ranks)
    return {
        **dataclasses.asdict(case),
        "pairs": ranks[0]["pairs"],
        "local_fp32_elements": elements,
        "save_s": save,
        "fingerprint_s": fingerprint,
        "fingerprint_over_save": fingerprint / save,
        "hashed_per_s": elements * 4 / fingerprint,  # weight, main, two moments
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = [run(Case(h, args.layers, args.world, args.repeats)) for h in args.hidden]
    print(
        "| hidden | layers | ranks | (param, state) pairs | fp32 elements per rank | save s "
        "| fingerprint s | fingerprint / save | elements hashed / s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['hidden']} | {r['layers']} | {r['world']} | {r['pairs']} | "
            f"{r['local_fp32_elements']:,} | {r['save_s']:.3f} | {r['fingerprint_s']:.3f} | "
            f"{r['fingerprint_over_save']:.2f} | {r['hashed_per_s']:.3g} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
