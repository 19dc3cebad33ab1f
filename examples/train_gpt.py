#!/usr/bin/env python
"""Train a tiny Megatron-core GPT (MoE by default) and log its global weight norm.

The real Megatron-core pieces: parallel state, DDP, ``get_megatron_optimizer`` (distributed
optimizer by default), ``OptimizerParamScheduler`` and the pipeline schedule, with
:class:`~norm_optim.NormAwareOptimizer` around the optimizer. The data is synthetic (a noisy
bigram language, so the loss visibly falls); nothing is downloaded.

Run it::

    python examples/train_gpt.py                        # 4 CPU gloo ranks: TP2 x EP2, MoE
    python examples/train_gpt.py --dense --tp 1 --pp 2  # DP2 x PP2, dense
    python examples/train_gpt.py --megatron-fsdp        # Megatron-FSDP, TP2 x EP2, MoE
    torchrun --nproc-per-node 8 examples/train_gpt.py --tp 2 --pp 2 --ep 2   # GPUs, NCCL

Without ``torchrun`` the script starts ``--nproc`` local CPU ranks itself. On CPU every rank
installs ``norm_optim.testing``'s shim for megatron-core's hard-coded CUDA calls: that is for
CPU runs only, and is never installed when CUDA is present. The norm lines are the ones to copy
into your own script; search for ``NormAwareOptimizer`` and ``param_l2_norms``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

with warnings.catch_warnings():
    # Without Transformer Engine or Apex (as on CPU) megatron warns once per module that it
    # falls back to torch implementations; that fallback is what a CPU run wants.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

from norm_optim import NormAwareOptimizer, ParamNorms
from norm_optim.testing import init_parallel, run_ranks
from norm_optim.testing.models import TinyGPTConfig, build_model, build_optimizer

# Warnings megatron-core 0.16.1 itself triggers on every run of this script (its own defaults,
# its torch fallbacks, its use of a deprecated torch collective); not about anything you can set.
_KNOWN_MEGATRON_WARNINGS = (
    r"Apex is not installed",
    r"full scope is deprecated",
    r"CUDA_DEVICE_MAX_CONNECTIONS",
    r"`torch\.distributed\.\w+` is deprecated",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags; the layout ones also answer to Megatron-LM's long names."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--moe",
        dest="moe",
        action="store_true",
        default=True,
        help="mixture of experts (default): logs the dense/expert norm split",
    )
    model.add_argument("--dense", dest="moe", action="store_false", help="a dense GPT")
    for name, default in [
        ("num-experts", 4),
        ("num-layers", 2),
        ("hidden-size", 64),
        ("num-attention-heads", 4),
        ("seq-length", 32),
        ("vocab-size", 128),
    ]:
        p.add_argument(f"--{name}", type=int, default=default)
    for short, long, default in [
        ("tp", "tensor-model-parallel-size", 2),
        ("pp", "pipeline-model-parallel-size", 1),
        ("ep", "expert-model-parallel-size", 2),
        ("cp", "context-parallel-size", 1),
    ]:
        p.add_argument(f"--{short}", f"--{long}", dest=short, type=int, default=default)
    p.add_argument(
        "--vpp",
        "--num-virtual-stages-per-pipeline-rank",
        dest="vpp",
        type=int,
        default=None,
        help="virtual pipeline stages per PP rank",
    )
    p.add_argument(
        "--etp",
        "--expert-tensor-parallel-size",
        dest="etp",
        type=int,
        default=None,
        help="default: --tp",
    )
    p.add_argument(
        "--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=True
    )
    p.add_argument(
        "--megatron-fsdp",
        "--use-megatron-fsdp",
        dest="megatron_fsdp",
        action="store_true",
        help="Megatron-FSDP (FullyShardedDataParallel, "
        "optim_grads_params) instead of DDP; no pipeline parallelism",
    )
    p.add_argument("--iterations", "--train-iters", dest="iterations", type=int, default=100)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup-iters", type=int, default=None, help="default: 10%% of the run")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--init",
        choices=["megatron", "deterministic"],
        default="megatron",
        help="'deterministic' gives every weight a value that depends only on its "
        "logical identity, so the iteration-0 norm is the same on every layout",
    )
    p.add_argument("--tensorboard-dir", default=None)
    p.add_argument(
        "--nproc", type=int, default=4, help="CPU ranks to start when not launched by torchrun"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds, for --nproc runs")
    args = p.parse_args(argv)
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = args.iterations // 10
    if args.cp > 1:  # the local (non-Transformer-Engine) attention does not split sequences
        p.error("--cp > 1 needs Transformer Engine's attention; this example uses the local spec")
    if args.megatron_fsdp and (args.pp > 1 or args.vpp):
        p.error("--megatron-fsdp: Megatron-FSDP has no pipeline axis; use --pp 1")
    if args.megatron_fsdp and not args.use_distributed_optimizer:
        p.error("--megatron-fsdp shards the optimizer itself: drop --no-use-distributed-optimizer")
    return args


def model_config(args: argparse.Namespace) -> TinyGPTConfig:
    """The logical model (the layout comes from the parallel state)."""
    return TinyGPTConfig(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        num_experts=args.num_experts if args.moe else None,
    )


def synthetic_batches(
    args: argparse.Namespace, device: torch.device, first_sample: int
) -> Iterator[torch.Tensor]:
    """Micro-batches of a noisy bigram language: the next token is ``perm[token]`` 90% of the
    time. Sample ``i`` depends only on ``(seed, i)``, so every rank that needs a batch (each
    TP rank, the first and last pipeline stage) draws the same one without a broadcast."""
    perm = torch.randperm(args.vocab_size, generator=torch.Generator().manual_seed(args.seed))
    sample = first_sample
    while True:
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + sample)
        tokens = torch.empty(args.micro_batch_size, args.seq_length, dtype=torch.long)
        tokens[:, 0] = torch.randint(args.vocab_size, (args.micro_batch_size,), generator=g)
        for t in range(1, args.seq_length):
            noise = torch.rand(args.micro_batch_size, generator=g) < 0.1
            random = torch.randint(args.vocab_size, (args.micro_batch_size,), generator=g)
            tokens[:, t] = torch.where(noise, random, perm[tokens[:, t - 1]])
        sample += args.micro_batch_size
        yield tokens.to(device)


def forward_step(data: Iterator[torch.Tensor], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """Megatron's forward-step contract: the output and a loss function over it."""
    tokens = next(data)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    # The last token has no next token to predict; its (rolled) label is masked out.
    labels, mask = torch.roll(tokens, -1, dims=1), torch.ones_like(tokens, dtype=torch.float)
    mask[:, -1] = 0

    def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (per_token_loss.float() * mask).sum() / mask.sum()
        # clone(): the schedule divides the returned loss by num_microbatches in place.
        return loss, {"lm loss": loss.detach().clone()}

    return model(tokens, positions, None, labels=labels), loss_func


@dataclass
class NormCallCost:
    """Wall time and peak memory a block added: CUDA allocator bytes, or the process's peak RSS
    on CPU (``/proc``: writing 5 to ``clear_refs`` resets ``VmHWM`` to the current RSS).
    The time includes waiting for the slowest rank, since the norm is a collective."""

    device: torch.device
    ms: float = 0.0
    added_bytes: int | None = None

    @staticmethod
    def _peak_rss() -> int | None:
        try:
            with open("/proc/self/status") as status:
                return next(int(ln.split()[1]) * 1024 for ln in status if ln.startswith("VmHWM"))
        except (OSError, StopIteration):
            return None

    def __enter__(self) -> NormCallCost:
        self._base: int | None = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as clear_refs:
                    clear_refs.write("5")
                self._base = self._peak_rss()
            except OSError:  # not Linux, or not allowed: reported as n/a
                pass
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the norm is read without a host sync; wait for it here
            self.added_bytes = torch.cuda.max_memory_allocated() - self._base
        elif self._base is not None and (peak := self._peak_rss()) is not None:
            self.added_bytes = peak - self._base
        self.ms = (time.perf_counter() - self._start) * 1e3


def build(args: argparse.Namespace, device: torch.device) -> tuple[list[torch.nn.Module], Any, Any]:
    """Model chunks, the wrapped optimizer and the lr schedule, as Megatron-LM builds them."""
    if args.megatron_fsdp:
        from norm_optim.testing.megatron_fsdp import build_fsdp_model, fill_fsdp_deterministic_

        # Megatron-FSDP copies the weights to the current device itself.
        chunks = build_fsdp_model(model_config(args), seed=args.seed)
        if args.init == "deterministic":  # into its weight shards, fp32 main ones included
            fill_fsdp_deterministic_(chunks, args.seed)
    else:
        chunks = build_model(
            model_config(args),
            seed=args.seed,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        if device.type == "cuda":  # the builder initializes on CPU; DDP's buffers are on the GPU
            chunks = [chunk.cuda() for chunk in chunks]
        if args.init == "deterministic":
            from norm_optim.testing import fill_deterministic_

            fill_deterministic_(chunks, args.seed)  # before the optimizer copies its fp32 params
    # norm_optim (1/2): wrap the optimizer once; it behaves as the optimizer it wraps.
    optimizer = NormAwareOptimizer(
        build_optimizer(chunks, lr=args.lr, min_lr=args.min_lr), model=chunks
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.iterations,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=args.iterations,
        wd_incr_style="constant",
    )
    get_model_config(chunks[0]).finalize_model_grads_func = finalize_model_grads
    return chunks, optimizer, scheduler


def train_step(
    args: argparse.Namespace,
    iteration: int,
    chunks: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
) -> tuple[torch.Tensor | None, float]:
    """One iteration, as Megatron-LM's ``train_step``: forward and backward over this DP rank's
    micro-batches (pipeline schedule; ``finalize_model_grads`` reduces the grads), then the
    optimizer and lr steps. Returns the mean loss (last pipeline stage only) and the grad norm.
    """
    dp = ps.get_data_parallel_world_size()
    num_microbatches, rest = divmod(args.global_batch_size, args.micro_batch_size * dp)
    if rest or not num_microbatches:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size x DP = {args.micro_batch_size} x {dp}"
        )
    first_sample = (
        (iteration - 1) * args.global_batch_size
        + ps.get_data_parallel_rank() * args.micro_batch_size * num_microbatches
    )
    device = next(chunks[0].parameters()).device
    data = [synthetic_batches(args, device, first_sample) for _ in chunks]
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data if len(chunks) > 1 else data[0],
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    _, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    loss = torch.stack([x["lm loss"] for x in losses]).mean() if losses else None
    return loss, grad_norm


class TrainingLog:
    """Megatron-style log lines, TensorBoard scalars and a progress bar, on the logging rank:
    the last, as Megatron-LM's ``print_rank_last`` (it is on the last stage, where the loss is).
    :meth:`write` is a collective (loss over DP, norm-call memory over the world)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.is_logger = dist.get_rank() == dist.get_world_size() - 1
        self.records: list[dict[str, float]] = []
        self.loss_sum, self.steps, self.grad_norm = torch.zeros((), device=device), 0, 0.0
        self.start = self.interval_start = time.perf_counter()
        self.bar = self.is_logger and sys.stderr.isatty()
        if self.is_logger:
            sizes = dict(
                TP=ps.get_tensor_model_parallel_world_size(),
                PP=ps.get_pipeline_model_parallel_world_size(),
                DP=ps.get_data_parallel_world_size(),
                EP=ps.get_expert_model_parallel_world_size(),
                ETP=ps.get_expert_tensor_parallel_world_size(),
            )
            print(
                f"> world {dist.get_world_size()}: "
                + ", ".join(f"{k} {v}" for k, v in sizes.items())
                + f" | {'MoE' if args.moe else 'dense'} GPT, {args.num_layers} layers"
                + (
                    " | Megatron-FSDP (optim_grads_params)"
                    if args.megatron_fsdp
                    else f" | distributed optimizer: {args.use_distributed_optimizer}"
                ),
                flush=True,
            )
        self.writer = None
        if args.tensorboard_dir and self.is_logger:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(args.tensorboard_dir)
            except ImportError:
                print(
                    "--tensorboard-dir: tensorboard is not installed "
                    "(pip install 'norm-optim[tensorboard]'); not writing scalars",
                    flush=True,
                )

    def step(self, iteration: int, loss: torch.Tensor | None, grad_norm: float) -> None:
        self.steps, self.grad_norm = self.steps + 1, grad_norm
        if loss is not None:
            self.loss_sum += loss
        if self.bar:
            total = self.args.iterations
            eta = (time.perf_counter() - self.start) / iteration * (total - iteration)
            sys.stderr.write(
                f"\r[{'#' * (30 * iteration // total):<30}] {iteration}/{total} eta {eta:.0f} s"
            )

    def write(self, iteration: int, norms: ParamNorms, cost: NormCallCost, lr: float) -> None:
        mem = torch.tensor(
            -1.0 if cost.added_bytes is None else float(cost.added_bytes),
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # the most any rank's call added
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            dist.all_reduce(self.loss_sum, group=ps.get_data_parallel_group())
        total, dense, expert = float(norms.total), float(norms.dense), float(norms.expert)
        values = dict(
            iteration=iteration,
            params_norm=total,
            params_norm_dense=dense,
            params_norm_expert=expert,
            norm_ms=cost.ms,
            norm_mem_bytes=float(mem),
        )
        line = [
            f" iteration {iteration:8d}/{self.args.iterations:8d}",
            f"consumed samples: {iteration * self.args.global_batch_size:10d}",
        ]
        if self.steps:
            dp = ps.get_data_parallel_world_size()
            values.update(
                loss=float(self.loss_sum) / self.steps / dp,
                grad_norm=self.grad_norm,
                lr=lr,
                ms_per_iteration=(time.perf_counter() - self.interval_start) * 1e3 / self.steps,
            )
            line += [
                f"elapsed time per iteration (ms): {values['ms_per_iteration']:.1f}",
                f"learning rate: {lr:.6E}",
                f"lm loss: {values['loss']:.6E}",
                f"grad norm: {self.grad_norm:.3f}",
            ]
        split = f" (dense {dense:.6f}, expert {expert:.6f})" if self.args.moe else ""
        added = "n/a" if float(mem) < 0 else f"+{float(mem) / 1024:.0f} KiB"
        line += [f"params norm: {total:.6f}{split}", f"norm call: {cost.ms:.2f} ms, {added}"]
        if self.is_logger:
            self.records.append(values)
            sys.stderr.write("\r\033[K" if self.bar else "")
            print(" | ".join(line) + " |", flush=True)
            for name, value in values.items():
                if self.writer is not None and name != "iteration":
                    self.writer.add_scalar(name.replace("_", "-"), value, iteration)
        self.loss_sum.zero_()
        self.steps, self.interval_start = 0, time.perf_counter()

    def finish(self) -> list[dict[str, float]]:
        """Print a summary; return the logged values (``[]`` on all ranks but the logger)."""
        if self.writer is not None:
            self.writer.close()
        if self.is_logger and len(self.records) > 1:
            first, last = self.records[0], self.records[-1]
            print(
                f"[after training] {self.args.iterations} iterations in "
                f"{time.perf_counter() - self.start:.1f} s | lm loss: "
                f"{self.records[1]['loss']:.4f} -> {last['loss']:.4f} | params norm: "
                f"{first['params_norm']:.6f} -> {last['params_norm']:.6f} | norm call: mean "
                f"{sum(r['norm_ms'] for r in self.records) / len(self.records):.2f} ms",
                flush=True,
            )
        return self.records


def train(args: argparse.Namespace) -> list[dict[str, float]]:
    """The training run on this rank (its process group is up; megatron's parallel state is
    initialized here). Returns the logged values on the logging rank, ``[]`` elsewhere."""
    init_parallel(
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        ep=args.ep if args.moe else 1,
        etp=args.etp,
        vpp=args.vpp,
    )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    chunks, optimizer, scheduler = build(args, device)
    log = TrainingLog(args, device)
    if log.is_logger:  # what this rank sums for the norm, and why it skips the rest
        print(f"> norm_optim on rank {dist.get_rank()}: {optimizer.registry.summary()}", flush=True)
    for iteration in range(args.iterations + 1):  # iteration 0 logs the initial weights only
        if iteration > 0:
            log.step(iteration, *train_step(args, iteration, chunks, optimizer, scheduler))
        if iteration % args.log_interval == 0 or iteration == args.iterations:
            with NormCallCost(device) as cost:
                # norm_optim (2/2): every rank calls it (one small all-reduce), at log time.
                norms = optimizer.param_l2_norms()
            log.write(iteration, norms, cost, lr=optimizer.param_groups[0]["lr"])
    return log.finish()


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Run as one rank under ``torchrun``, else start ``--nproc`` CPU gloo ranks here.

    Returns the logged values (see :func:`train`).
    """
    args = parse_args(argv)
    with warnings.catch_warnings():  # the filters also reach the ranks forked below
        for message in _KNOWN_MEGATRON_WARNINGS:
            warnings.filterwarnings("ignore", message=f".*{message}")
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            # Local CPU ranks: forked gloo processes, each with the CPU shim (run_ranks does it).
            results = run_ranks(train, args.nproc, args, timeout=args.timeout)
            return next((r for r in results if r), [])
        # One rank of torchrun: NCCL on GPUs; gloo and the CPU shim without CUDA.
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        else:
            from norm_optim.testing import install_cpu_shim  # CPU runs only

            install_cpu_shim()
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            return train(args)
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
