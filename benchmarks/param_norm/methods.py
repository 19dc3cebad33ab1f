"""The ways to compute the global parameter L2 norm that the benchmark compares.

Each method is a function that takes the built :class:`~.bench.Bench` and returns the zero-
argument call that is timed: whatever a real caller would do once (build a list) happens in the
preparation, whatever it does on every call happens in the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .bench import Bench, is_expert
from .cases import Case

NormFn = Callable[[], Union[torch.Tensor, float]]
Prepare = Callable[[Bench], NormFn]
# (expert, sharded) -> the tensors of that bucket
Buckets = dict[tuple[bool, bool], list[torch.Tensor]]
# A param -> the tensor Megatron-LM reads for it, and whether that tensor is a DP shard.
Reader = Callable[[torch.nn.Parameter], tuple[Optional[torch.Tensor], bool]]


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    prepare: Prepare


def fused_sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares (shape ``[1]``, fp32) with one fused multi-tensor kernel, as Megatron does.

    apex's ``multi_tensor_l2norm`` when importable (what Megatron-LM calls on CUDA), else
    ``torch._foreach_norm`` (one kernel per ~chunk on CUDA, ~2 us per tensor on CPU).
    """
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=device)
    if device.type == "cuda":
        with contextlib.suppress(ImportError):
            import amp_C  # type: ignore[import-not-found]
            from apex.multi_tensor_apply import multi_tensor_applier  # type: ignore

            flag = torch.zeros(1, dtype=torch.int, device=device)
            norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [list(tensors)], False)
            return norm.square()
    return torch.stack(torch._foreach_norm(list(tensors))).square().sum().reshape(1)


def norm_optim(bench: Bench) -> NormFn:
    """``NormAwareOptimizer.param_l2_norm()``: what is measured."""
    return bench.wrapped.param_l2_norm


def norm_optim_per_param(bench: Bench) -> NormFn:
    """``param_l2_norms(per_param=True)``: the total and one norm per param (and per layer /
    expert) in the same all-reduce, as ``install(per_param=True)`` reads it at logged
    iterations (the names exchange runs at the first, untimed call)."""
    return lambda: bench.wrapped.param_l2_norms(per_param=True).total


def floor(bench: Bench) -> NormFn:
    """The least any implementation can do: one fused kernel over exactly the fp32 tensors this
    rank counts (norm_optim's own choice, listed once), one all-reduce, a square root."""
    summands = [r.tensor for r in bench.wrapped.registry.counted if r.tensor is not None]
    tensors = [t for t in summands if isinstance(t, torch.Tensor)]
    if len(tensors) != len(summands):  # the benchmark's optimizers never keep them
        raise TypeError(
            "floor sums plain fp32 main params; this optimizer keeps some in "
            "Transformer Engine's remainder format"
        )

    def call() -> torch.Tensor:
        squares = fused_sum_of_squares(tensors, bench.device)
        dist.all_reduce(squares)
        return squares.sqrt()

    return call


def floor_per_param(bench: Bench) -> NormFn:
    """The least a per-param call can do: one fused kernel's per-tensor norms over the counted
    fp32 tensors, their squares added into one slot per param name (one ``index_add_``), one
    all-reduce of that ``8 x (names + 2)``-byte vector, a square root. Next to ``floor`` it
    shows what the longer all-reduce alone costs."""
    names = list(bench.wrapped.param_l2_norms(per_param=True).per_param or {})
    slot = {name: i + 2 for i, name in enumerate(names)}
    counted = [r for r in bench.wrapped.registry.counted if isinstance(r.tensor, torch.Tensor)]
    tensors = [r.tensor for r in counted if r.tensor.numel()]
    index = torch.tensor(
        [slot[r.global_name] for r in counted if r.tensor.numel()],
        dtype=torch.long,
        device=bench.device,
    )

    def call() -> torch.Tensor:
        squares = torch.zeros(len(names) + 2, dtype=torch.float64, device=bench.device)
        if tensors:
            norms = torch.stack(torch._foreach_norm(tensors)).double()
            squares.index_add_(0, index, norms.square_())
        dist.all_reduce(squares)
        return squares[2:].sum().sqrt()

    return call


def read_main_param(param: torch.nn.Parameter) -> tuple[Optional[torch.Tensor], bool]:
    """Megatron-LM's read: the (possibly sharded) fp32 main param, else an fp32 copy."""
    if hasattr(param, "main_param"):
        return param.main_param, bool(getattr(param, "main_param_sharded", False))
    return param.data.float(), False  # fp32 params: .float() is the param itself


def read_fp32_copy(param: torch.nn.Parameter) -> tuple[Optional[torch.Tensor], bool]:
    """``force_create_fp32_copy=True``: a full fp32 copy of every local bf16 param."""
    return param.data.float(), False


def walk(bench: Bench, read: Reader) -> Buckets:
    """One pass over every model param, as ``calc_params_l2_norm`` makes on every call."""
    buckets: Buckets = {(e, s): [] for e in (False, True) for s in (False, True)}
    for chunk in bench.chunks:
        for param in chunk.parameters():
            if bench.groups.is_tp_duplicate(param) or getattr(param, "shared", False):
                continue
            tensor, sharded = read(param)
            if tensor is not None:
                buckets[(is_expert(param), sharded)].append(tensor)
    return buckets


def reduce_buckets(bench: Bench, buckets: Buckets) -> float:
    """Megatron-LM's reductions: sharded buckets over their DP groups, then model-parallel
    (one reduce when dense and expert model-parallel ranks agree), then ``.item()``."""
    groups, device = bench.groups, bench.device
    squares = {key: fused_sum_of_squares(ts, device) for key, ts in buckets.items()}
    dist.all_reduce(squares[(False, True)], group=groups.dp_cp)
    if bench.has_experts:
        dist.all_reduce(squares[(True, True)], group=groups.expert_dp)
    dense = squares[(False, False)] + squares[(False, True)]
    expert = squares[(True, False)] + squares[(True, True)]
    if groups.same_model_parallel_ranks:
        dense += expert
        dist.all_reduce(dense, group=groups.model_parallel)
    else:
        dist.all_reduce(dense, group=groups.model_parallel)
        dist.all_reduce(expert, group=groups.expert_model_parallel)
        dense += expert
    return float(dense.item()) ** 0.5


def attribute_walk_of(read: Reader) -> Prepare:
    """Megatron-LM's ``calc_params_l2_norm``: walk and reduce on every call, reading with
    ``read`` (the main params for ``attribute_walk``, fresh copies for ``fp32_copy``)."""

    def prepare(bench: Bench) -> NormFn:
        return lambda: reduce_buckets(bench, walk(bench, read))

    return prepare


def dtensor_walk(bench: Bench) -> NormFn:
    """Megatron-LM's ``calc_params_l2_norm`` under Megatron-FSDP (``calc_dtensor_params_l2_norm``
    in ``megatron/training/utils``), with this module's fused kernel: the model's DTensors
    grouped by spec, one all-reduce per sharded mesh dim of each spec, ``.item()``. Under EP
    it misses the other EP ranks' experts (their mesh has no EP dim)."""

    def call() -> float:
        by_spec: dict[Any, list[torch.Tensor]] = {}
        for param in bench.dtensors():
            by_spec.setdefault(getattr(param, "_spec"), []).append(getattr(param, "_local_tensor"))
        total = torch.zeros(1, dtype=torch.float32, device=bench.device)
        for spec, local in by_spec.items():
            squares = fused_sum_of_squares([t for t in local if t.numel()], bench.device)
            for group, placement in zip(spec.device_mesh.get_all_groups(), spec.placements):
                if placement.is_shard():
                    dist.all_reduce(squares, group=group)
            total += squares
        return float(total.item()) ** 0.5

    return call


def read_local_shard(param: torch.nn.Parameter) -> tuple[Optional[torch.Tensor], bool]:
    """Megatron-LM's read under torch FSDP2 (``calc_params_l2_norm``, 0.19): ``to_local()`` of
    the DTensor param, which has no ``main_param``, so an fp32 copy of the local bf16 shard,
    counted as not sharded (no sum over DP: about 1/sqrt(DP) of the norm)."""
    return read_main_param(getattr(param, "_local_tensor", param))


def get_total_norm(bench: Bench) -> NormFn:
    """What a torch-native user calls: ``torch.nn.utils.get_total_norm`` over the fp32 DTensors
    the optimizer steps (DTensor's own reductions), gathered to a plain value."""
    tensors = [getattr(p, "main_param", p) for p in bench.dtensors()]

    def call() -> torch.Tensor:
        norm = torch.nn.utils.get_total_norm(tensors)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    return call


METHODS: tuple[Method, ...] = (
    Method("norm_optim", norm_optim),
    Method("norm_optim_per_param", norm_optim_per_param),
    Method("floor", floor),
    Method("floor_per_param", floor_per_param),
    Method("attribute_walk", attribute_walk_of(read_main_param)),
    Method("fp32_copy", attribute_walk_of(read_fp32_copy)),
)
# Megatron-FSDP has no main_param attributes to walk: its own walk replaces the two walks.
FSDP_METHODS: tuple[Method, ...] = (
    Method("norm_optim", norm_optim),
    Method("norm_optim_per_param", norm_optim_per_param),
    Method("norm_optim_per_param", norm_optim_per_param),
    Method("floor", floor),
    Method("floor_per_param", floor_per_param),
    Method("dtensor_walk", dtensor_walk),
)
# torch FSDP2: Megatron-LM's walk as it runs there, and torch's own function.
TORCH_FSDP2_METHODS: tuple[Method, ...] = (
    Method("norm_optim", norm_optim),
    Method("floor", floor),
    Method("fsdp2_walk", attribute_walk_of(read_local_shard)),
    Method("get_total_norm", get_total_norm),
)


def methods_for(case: Case) -> tuple[Method, ...]:
    """The methods that apply to a case."""
    if case.torch_fsdp2:
        return TORCH_FSDP2_METHODS
    return FSDP_METHODS if case.megatron_fsdp else METHODS
