"""The README's per-layer picture: Megatron-Bridge's real ``pretrain()`` on 2 CPU ranks (a tiny
MoE GPT, EP2, mock data) with ``megatron_bridge.install(per_param=True)``, then
``python -m norm_optim.plot`` on its TensorBoard directory.

Needs Megatron-Bridge (``make test-bridge`` builds an environment with it) and the ``plot``
extra. Usage::

    python examples/per_layer_picture.py --out docs/per-layer-norms.png
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("per-layer-norms.png"))
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    from norm_optim.testing.megatron_bridge import import_bridge, run_pretrain, tiny_config

    import_bridge()  # first: it guards Bridge's import-time checks
    from norm_optim import plot
    from norm_optim.integrations import megatron_bridge

    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_config(
            world_size=2,
            ep=2,
            num_experts=4,
            num_layers=args.layers,
            train_iters=args.iterations,
            lr=args.lr,
            log_interval=10,
            tensorboard_log_interval=1,
            tensorboard_dir=f"{tmp}/tb",
        )
        run_pretrain(
            config, 2, before=lambda: megatron_bridge.install(per_param=True), timeout=1800
        )
        data = plot.load_norms(f"{tmp}/tb")
        plot.plot_norms(
            data,
            args.out,
            size=(1000, 750),
            title=(
                f"Megatron-Bridge pretrain(), tiny MoE GPT ({args.layers} layers, 4 experts, EP2), "
                f"lr {args.lr:g}, {args.iterations} iterations"
            ),
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
