"""Time and memory of ``NormAwareOptimizer.param_l2_norm()`` next to the alternatives.

Every method runs on the **same** model, optimizer and parallel layout, in the same processes,
interleaved call by call (so machine noise hits them alike):

=================  ==============================================================================
``norm_optim``     ``NormAwareOptimizer.param_l2_norm()``.
``floor``          one fused sum of squares over exactly the fp32 tensors this rank counts (a list
                   built once), one all-reduce, a square root: the least any implementation can do.
``attribute_walk`` what Megatron-LM's ``calc_params_l2_norm`` does today: walk every model param on
                   each call, read ``main_param`` / ``main_param_sharded``, sum each bucket (dense /
                   expert x sharded / whole), reduce the sharded buckets over DP x CP (dense) and
                   expert-DP (expert), then over the model-parallel groups, and ``.item()``.
``fp32_copy``      Megatron-LM's fallback (``force_create_fp32_copy=True``, and its expert path
                   before #2249): ``.float()`` of every local param, then the same reductions.
``dtensor_walk``   Megatron-FSDP cases (``fsdp-*``) only, in place of the two walks: what
                   ``calc_params_l2_norm`` does under ``--use-megatron-fsdp``
                   (``stop_communication``, the model's DTensors grouped by spec, one all-reduce
                   per sharded mesh dim of each spec, ``.item()``). Under EP it misses the
                   other EP ranks' experts.
=================  ==============================================================================

Per case and method it reports the median seconds per call, the extra peak memory of one call,
the collectives and host syncs of one call, and the relative error against a float64 reference.

Usage (CPU, gloo ranks forked by :func:`norm_optim.testing.run_ranks`)::

    python benchmarks/param_norm.py --quick                     # < 3 min on 2 cores
    python benchmarks/param_norm.py --json benchmarks/results/cpu-DATE.json --plot-dir benchmarks/results

On CUDA (NCCL), launch one process per GPU with torchrun; every model runs at the launched world::

    torchrun --nproc-per-node 4 benchmarks/param_norm.py --device cuda --json cuda-4.json
    torchrun --nproc-per-node 1 benchmarks/param_norm.py --device cuda --json cuda-1.json

``--replot JSON...`` redraws the plots from earlier results without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from norm_optim import NormAwareOptimizer
from norm_optim.testing.models import TinyGPTConfig

NormFn = Callable[[], Union[torch.Tensor, float]]

# ---------------------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One model on one world size; the layout follows from the kind and the world.

    Dense models are pure data parallel; MoE models add expert parallelism 2 when the world is
    even, so expert params are sharded over a different (expert-DP) group than dense ones. All
    cases use the distributed optimizer.
    """

    name: str
    model: TinyGPTConfig
    world: int
    megatron_fsdp: bool = False

    @property
    def kind(self) -> str:
        return "moe" if self.model.num_experts else "dense"

    @property
    def layout(self) -> dict[str, int]:
        """``init_parallel`` keyword arguments."""
        return {"ep": 2} if self.kind == "moe" and self.world % 2 == 0 else {}


def _dense(hidden: int, layers: int, vocab: int) -> TinyGPTConfig:
    return TinyGPTConfig(hidden_size=hidden, num_layers=layers, num_attention_heads=8,
                         vocab_size=vocab, seq_length=16)


def _moe(hidden: int, layers: int, experts: int, ffn: int) -> TinyGPTConfig:
    # Many small experts: the tensor count grows as 2 x experts x layers.
    return TinyGPTConfig(hidden_size=hidden, num_layers=layers, num_attention_heads=4,
                         ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, num_experts=experts,
                         vocab_size=1024, seq_length=16)


# (name, model, worlds of the full run, worlds of --quick, sweep it is plotted in)
_MODELS: tuple[tuple[str, TinyGPTConfig, tuple[int, ...], tuple[int, ...], str], ...] = (
    ("dense-s", _dense(128, 8, 1024), (1, 4), (1, 4), "elements"),  # 1.7e6 elements, 100 tensors
    ("dense-m", _dense(512, 8, 4096), (1, 4), (1,), "elements"),  # 2.7e7
    ("dense-l", _dense(1024, 8, 8192), (1, 4), (), "elements"),  # 1.1e8
    ("dense-xl", _dense(2048, 6, 8192), (1,), (), "elements"),  # 3.2e8
    ("moe-s", _moe(64, 2, 16, 128), (1, 4), (1,), "tensors"),  # 82 tensors
    ("moe-m", _moe(64, 4, 128, 64), (1, 4), (4,), "tensors"),  # 1,056 tensors
    ("moe-l", _moe(64, 4, 640, 64), (1, 4), (1,), "tensors"),  # 5,152 tensors, 2.1e7 elements
    ("moe-xl", _moe(256, 4, 640, 256), (1,), (), "table only"),  # 5,152 tensors, 3.4e8 elements
)
# The same models under Megatron-FSDP (optim_grads_params), named fsdp-<model>.
_FSDP_MODELS = (("dense-m", (4,), ()), ("moe-m", (4,), (4,)))


def select_cases(quick: bool, names: Sequence[str], worlds: Sequence[int]) -> list[Case]:
    """The cases to run, in a stable order (world 1 first: it warms nothing for world 4)."""
    models = {name: model for name, model, *_ in _MODELS}
    candidates = [Case(name, model, world)
                  for name, model, full, fast, _ in _MODELS for world in (fast if quick else full)]
    candidates += [Case(f"fsdp-{name}", models[name], world, megatron_fsdp=True)
                   for name, full, fast in _FSDP_MODELS for world in (fast if quick else full)]
    cases = [c for c in candidates
             if (not names or c.name in names) and (not worlds or c.world in worlds)]
    return sorted(cases, key=lambda c: c.world)


# ---------------------------------------------------------------------------------- the layout


@dataclasses.dataclass(frozen=True)
class Groups:
    """This rank's groups and coordinates, read once from megatron's parallel state."""

    dp_cp: Any
    expert_dp: Any
    model_parallel: Any
    expert_model_parallel: Any
    same_model_parallel_ranks: bool
    tp_rank: int
    expert_tp_rank: int
    dp_cp_rank: int
    expert_dp_rank: int

    @classmethod
    def from_parallel_state(cls) -> "Groups":
        from megatron.core import parallel_state as ps

        mp = ps.get_model_parallel_group()
        expert_mp = ps.get_expert_tensor_model_pipeline_parallel_group()
        return cls(
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            expert_dp=ps.get_expert_data_parallel_group(),
            model_parallel=mp,
            expert_model_parallel=expert_mp,
            same_model_parallel_ranks=(
                dist.get_process_group_ranks(mp) == dist.get_process_group_ranks(expert_mp)
            ),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            expert_tp_rank=ps.get_expert_tensor_parallel_rank() or 0,
            dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
        )

    def is_tp_duplicate(self, param: torch.Tensor) -> bool:
        """Megatron's ``param_is_not_tensor_parallel_duplicate``, negated, aware of expert TP."""
        if getattr(param, "tensor_model_parallel", False):
            return False
        return (self.expert_tp_rank if _is_expert(param) else self.tp_rank) > 0


def _is_expert(param: torch.Tensor) -> bool:
    return not getattr(param, "allreduce", True)


@dataclasses.dataclass(frozen=True)
class Bench:
    """What every method is built from: one model, one optimizer, one layout."""

    chunks: list[torch.nn.Module]
    optimizer: Any
    wrapped: NormAwareOptimizer
    groups: Groups
    device: torch.device
    has_experts: bool
    megatron_fsdp: bool = False


# ------------------------------------------------------------------------- sums of squares


def _fused_sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
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


# ------------------------------------------------------------------------------ the methods


def _prepare_norm_optim(bench: Bench) -> NormFn:
    return bench.wrapped.param_l2_norm


def _prepare_floor(bench: Bench) -> NormFn:
    tensors = [r.tensor for r in bench.wrapped.registry.counted if r.tensor is not None]

    def floor() -> torch.Tensor:
        squares = _fused_sum_of_squares(tensors, bench.device)
        dist.all_reduce(squares)
        return squares.sqrt()

    return floor


# (expert, sharded) -> the tensors of that bucket
Buckets = dict[tuple[bool, bool], list[torch.Tensor]]
Reader = Callable[[torch.nn.Parameter], tuple[Optional[torch.Tensor], bool]]


def _read_main_param(param: torch.nn.Parameter) -> tuple[Optional[torch.Tensor], bool]:
    """Megatron-LM's read: the (possibly sharded) fp32 main param, else an fp32 copy."""
    if hasattr(param, "main_param"):
        return param.main_param, bool(getattr(param, "main_param_sharded", False))
    return param.data.float(), False  # fp32 params: .float() is the param itself


def _read_fp32_copy(param: torch.nn.Parameter) -> tuple[Optional[torch.Tensor], bool]:
    """``force_create_fp32_copy=True``: a full fp32 copy of every local bf16 param."""
    return param.data.float(), False


def _walk(bench: Bench, read: Reader) -> Buckets:
    """One pass over every model param, as ``calc_params_l2_norm`` makes on every call."""
    buckets: Buckets = {(e, s): [] for e in (False, True) for s in (False, True)}
    for chunk in bench.chunks:
        for param in chunk.parameters():
            if bench.groups.is_tp_duplicate(param) or getattr(param, "shared", False):
                continue
            tensor, sharded = read(param)
            if tensor is not None:
                buckets[(_is_expert(param), sharded)].append(tensor)
    return buckets


def _reduce_buckets(bench: Bench, buckets: Buckets) -> float:
    """Megatron-LM's reductions: sharded buckets over their DP groups, then model-parallel."""
    groups, device = bench.groups, bench.device
    squares = {key: _fused_sum_of_squares(ts, device) for key, ts in buckets.items()}
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
    return dense.item() ** 0.5


def _prepare_walk(read: Reader) -> Callable[[Bench], NormFn]:
    def prepare(bench: Bench) -> NormFn:
        return lambda: _reduce_buckets(bench, _walk(bench, read))

    return prepare


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    prepare: Callable[[Bench], NormFn]


def _module_dtensors(bench: Bench) -> list[torch.Tensor]:
    params: list[torch.Tensor] = []
    for chunk in bench.chunks:
        getattr(chunk, "stop_communication")()  # the module holds its DTensors from here on
        params.extend(chunk.parameters())
    return params


def _prepare_dtensor_walk(bench: Bench) -> NormFn:
    """Megatron-LM's ``calc_params_l2_norm`` under Megatron-FSDP (``calc_dtensor_params_l2_norm``
    in ``megatron/training/utils``), with this file's fused kernel."""

    def dtensor_walk() -> float:
        by_spec: dict[Any, list[torch.Tensor]] = {}
        for param in _module_dtensors(bench):
            by_spec.setdefault(getattr(param, "_spec"), []).append(getattr(param, "_local_tensor"))
        total = torch.zeros(1, dtype=torch.float32, device=bench.device)
        for spec, local in by_spec.items():
            squares = _fused_sum_of_squares([t for t in local if t.numel()], bench.device)
            for group, placement in zip(spec.device_mesh.get_all_groups(), spec.placements):
                if placement.is_shard():
                    dist.all_reduce(squares, group=group)
            total += squares
        return total.item() ** 0.5

    return dtensor_walk


METHODS: tuple[Method, ...] = (
    Method("norm_optim", _prepare_norm_optim),
    Method("floor", _prepare_floor),
    Method("attribute_walk", _prepare_walk(_read_main_param)),
    Method("fp32_copy", _prepare_walk(_read_fp32_copy)),
)
FSDP_METHODS: tuple[Method, ...] = (
    Method("norm_optim", _prepare_norm_optim),
    Method("floor", _prepare_floor),
    Method("dtensor_walk", _prepare_dtensor_walk),
)

# ------------------------------------------------------------------------ instrumentation


class _Counter:
    """Counts outermost calls only (a counted function calling another is one event)."""

    def __init__(self) -> None:
        self.count = 0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += self._depth == 0
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted


@contextlib.contextmanager
def _patched(owner: Any, names: Sequence[str], counter: _Counter) -> Iterator[None]:
    """Route ``owner.<name>`` through ``counter`` for the duration of the block."""
    saved = {n: (n in vars(owner), getattr(owner, n)) for n in names if hasattr(owner, n)}
    try:
        for name, (_, original) in saved.items():
            setattr(owner, name, counter.wrap(original))
        yield
    finally:
        for name, (own, original) in saved.items():
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "reduce", "broadcast", "all_gather_object", "all_to_all_single", "barrier")
# Reading a tensor's value on the host: a device sync on accelerators.
_HOST_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def _cuda_sync_counter(counter: _Counter) -> Iterator[None]:
    """Count the synchronizing CUDA operations torch reports in sync-debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counter.count += sum("synchroniz" in str(w.message) for w in caught)


def count_events(fn: NormFn, device: torch.device) -> tuple[int, int]:
    """(collectives, host syncs) of one call.

    Collectives: calls into ``torch.distributed`` (the library's seam calls it too). Host syncs:
    on CUDA what torch's sync-debug mode reports; on CPU, where nothing is asynchronous, the
    calls that would sync on a device (``item``, ``float(t)``, ``bool(t)``, ``tolist``...).
    """
    collectives, syncs = _Counter(), _Counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(dist, _COLLECTIVES, collectives))
        if device.type == "cuda":
            stack.enter_context(_cuda_sync_counter(syncs))
        else:
            stack.enter_context(_patched(torch.Tensor, _HOST_READS, syncs))
        fn()
    return collectives.count, syncs.count


class PeakMemory:
    """Extra peak memory of one call: CUDA allocator stats, or the CPU process's peak RSS.

    On CPU the kernel's high-water mark (``VmHWM``) is reset by writing 5 to
    ``/proc/self/clear_refs``; the extra peak is ``VmHWM`` after the call minus ``VmRSS`` before.
    glibc serves temporaries from freed heap memory that is still resident, which would hide
    them; ``malloc_trim(0)`` before the call returns those pages to the kernel, so whatever the
    call touches shows up in the RSS.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = "cuda max_memory_allocated" if device.type == "cuda" else self._cpu_method()

    @staticmethod
    def _cpu_method() -> str:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError as exc:
            return f"unavailable (/proc/self/clear_refs: {exc.strerror})"
        trim = "malloc_trim(0) first" if _glibc_malloc_trim() else "no malloc_trim: may undercount"
        return f"peak RSS: VmHWM after - VmRSS before ({trim})"

    @property
    def available(self) -> bool:
        return not self.method.startswith("unavailable")

    def measure(self, fn: NormFn, repeats: int = 3) -> Optional[int]:
        """Median over ``repeats`` calls of the extra peak bytes, or None if not measurable."""
        if not self.available:
            return None
        return int(statistics.median(self._one(fn) for _ in range(repeats)))

    def _one(self, fn: NormFn) -> int:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - before
        trim = _glibc_malloc_trim()
        if trim is not None:
            trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        before = _proc_status_bytes("VmRSS")
        fn()
        return max(0, _proc_status_bytes("VmHWM") - before)


def _glibc_malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _proc_status_bytes(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


# --------------------------------------------------------------------------------- the harness


@dataclasses.dataclass(frozen=True)
class Options:
    device: str
    calls: int
    warmup: int
    threads: int


@dataclasses.dataclass
class Measurement:
    """One method on one rank."""

    times: list[float] = dataclasses.field(default_factory=list)
    extra_peak_bytes: Optional[int] = None
    collectives: int = 0
    host_syncs: int = 0
    value: float = math.nan


def _to_float(value: Union[torch.Tensor, float]) -> float:
    return float(value)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_methods(
    methods: Sequence[tuple[str, NormFn]], device: torch.device, opts: Options
) -> dict[str, Measurement]:
    """Time, memory, events and value of each method.

    Calls are interleaved (method A, B, C, D, A, B, ...) so that load from other processes
    affects every method alike; each timed call starts after a barrier and ends when the
    device is done. Memory and events come from separate, untimed calls.
    """
    results = {name: Measurement() for name, _ in methods}
    for name, fn in methods:
        results[name].value = _to_float(fn())
    for _ in range(opts.warmup):
        for _, fn in methods:
            fn()
    for _ in range(opts.calls):
        for name, fn in methods:
            dist.barrier()
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            results[name].times.append(time.perf_counter() - start)
    peak = PeakMemory(device)
    for name, fn in methods:
        dist.barrier()
        results[name].extra_peak_bytes = peak.measure(fn)
        results[name].collectives, results[name].host_syncs = count_events(fn, device)
    return results


@torch.no_grad()
def reference_norm(bench: Bench) -> tuple[float, int, int]:
    """(float64 norm, elements, tensors) of the whole model, each element counted once.

    Independent of norm_optim: read from the bf16 model params (which the fp32 main params
    equal right after the optimizer is built), owners chosen by TP / ``shared`` / DP rank 0.
    """
    if bench.megatron_fsdp:
        return _reference_norm_fsdp(bench)
    groups = bench.groups
    totals = torch.zeros(3, dtype=torch.float64)
    for chunk in bench.chunks:
        for param in chunk.parameters():
            dp_rank = groups.expert_dp_rank if _is_expert(param) else groups.dp_cp_rank
            if groups.is_tp_duplicate(param) or getattr(param, "shared", False) or dp_rank:
                continue
            flat = param.detach().reshape(-1)
            for piece in flat.split(1 << 22):
                piece64 = piece.to(device="cpu", dtype=torch.float64)
                totals[0] += torch.dot(piece64, piece64)
            totals[1] += flat.numel()
            totals[2] += 1
    totals = totals.to(bench.device)
    dist.all_reduce(totals)
    return math.sqrt(totals[0].item()), int(totals[1].item()), int(totals[2].item())


@torch.no_grad()
def _reference_norm_fsdp(bench: Bench) -> tuple[float, int, int]:
    """The same for Megatron-FSDP, from the DTensors' own placements: a rank adds its local
    shard when it is coordinate 0 of every mesh dim that replicates the tensor, then everything
    is summed over the world (the expert mesh has no EP dim: EP ranks hold other experts)."""
    totals = torch.zeros(3, dtype=torch.float64)
    for param in _module_dtensors(bench):
        spec = getattr(param, "_spec")
        mesh = spec.device_mesh
        if any(p.is_replicate() and mesh.get_local_rank(d) for d, p in enumerate(spec.placements)):
            continue
        local = getattr(param, "_local_tensor").detach().reshape(-1).to("cpu", torch.float64)
        totals += torch.tensor([torch.dot(local, local).item(), local.numel(), 0.0])
        totals[2] += all(mesh.get_local_rank(d) == 0 for d in range(mesh.ndim))
    totals = totals.to(bench.device)
    dist.all_reduce(totals)
    return math.sqrt(totals[0].item()), int(totals[1].item()), int(totals[2].item())


def _build(case: Case, device: torch.device) -> Bench:
    from norm_optim.testing import init_parallel
    from norm_optim.testing.models import build_model, build_optimizer

    init_parallel(**case.layout)
    if case.megatron_fsdp:  # it moves the weights to the current device itself
        from norm_optim.testing.megatron_fsdp import build_fsdp_model

        chunks = build_fsdp_model(case.model)
    else:
        with torch.device(device):  # megatron allocates its buffers on the current CUDA device
            chunks = build_model(case.model, use_distributed_optimizer=True)
    optimizer = build_optimizer(chunks)
    on_wrong_device = [n for c in chunks for n, p in c.named_parameters()
                       if p.device.type != device.type]
    if on_wrong_device:
        raise RuntimeError(f"params not on {device}: {on_wrong_device[:3]}...")
    return Bench(chunks, optimizer, NormAwareOptimizer(optimizer, chunks),
                 Groups.from_parallel_state(), device, bool(case.model.num_experts),
                 case.megatron_fsdp)


def run_case(case: Case, opts: Options) -> list[dict[str, Any]]:
    """Body of every rank: build, measure every method, gather; returns the case's rows."""
    torch.set_num_threads(opts.threads)
    device = torch.device(opts.device, torch.cuda.current_device()) if opts.device == "cuda" \
        else torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        bench = _build(case, device)
    reference, numel, tensors = reference_norm(bench)
    methods = [(m.name, m.prepare(bench)) for m in (FSDP_METHODS if case.megatron_fsdp
                                                    else METHODS)]
    with torch.no_grad():
        local = measure_methods(methods, device, opts)
    counted = bench.wrapped.registry.counted
    mine = {"local_numel": sum(r.numel for r in counted), "local_tensors": len(counted),
            "measurements": local}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    meta = dict(case=case.name, kind=case.kind, world=dist.get_world_size(), numel=numel,
                tensors=tensors, layout=case.layout, device=device.type, threads=opts.threads,
                calls=opts.calls, memory_method=PeakMemory(device).method,
                local_numel=max(g["local_numel"] for g in gathered),
                local_tensors=max(g["local_tensors"] for g in gathered))
    return [_row(meta, name, [g["measurements"][name] for g in gathered], reference)
            for name, _ in methods]


def _row(meta: dict[str, Any], method: str, per_rank: list[Measurement],
         reference: float) -> dict[str, Any]:
    """Merge the ranks: the slowest rank's median, the largest peak and counts."""
    peaks = [m.extra_peak_bytes for m in per_rank]
    value = per_rank[0].value
    return {
        **meta,
        "method": method,
        "median_s": max(statistics.median(m.times) for m in per_rank),
        "extra_peak_bytes": None if None in peaks else max(peaks),  # type: ignore[type-var]
        "collectives": max(m.collectives for m in per_rank),
        "host_syncs": max(m.host_syncs for m in per_rank),
        "rel_error": abs(value - reference) / reference if reference else abs(value),
        "value": value,
        "reference": reference,
    }


# ----------------------------------------------------------------------------------- launching


def _launched_by_torchrun() -> bool:
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


def run_forked(cases: Sequence[Case], opts: Options, timeout: float) -> list[dict[str, Any]]:
    """CPU: each case on fresh gloo ranks forked by ``run_ranks`` (fresh megatron state)."""
    from norm_optim.testing import run_ranks

    _import_megatron()
    rows: list[dict[str, Any]] = []
    for case in cases:
        start = time.perf_counter()
        case_rows = run_ranks(run_case, case.world, case, opts, timeout=timeout)[0]
        print(f"# {case.name} world={case.world}: {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
        rows.extend(case_rows)
    return rows


def run_torchrun(cases: Sequence[Case], opts: Options) -> list[dict[str, Any]]:
    """Under torchrun: every selected model at the launched world size, one after another."""
    from megatron.core import parallel_state

    if opts.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from norm_optim.testing import install_cpu_shim

        install_cpu_shim()
    dist.init_process_group("nccl" if opts.device == "cuda" else "gloo")
    world = dist.get_world_size()
    models = {c.name: c for c in cases}
    rows: list[dict[str, Any]] = []
    try:
        for name, case in models.items():
            rows.extend(run_case(Case(name, case.model, world, case.megatron_fsdp), opts))
            parallel_state.destroy_model_parallel()
            gc.collect()
            if opts.device == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return rows if int(os.environ["RANK"]) == 0 else []


# ------------------------------------------------------------------------------------ reporting

TARGET_PEAK_BYTES = 1 << 20
TARGET_REL_ERROR = 1e-6
TARGET_X_FLOOR = 1.1
TARGET_WALK_SPEEDUP = {"cpu": 2.0, "cuda": 10.0}
MANY_TENSORS = 5000


def _by_case(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    cases: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        cases.setdefault((row["case"], row["world"]), {})[row["method"]] = row
    return cases


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one line per case x method, with each time relative to ``floor``."""
    lines = ["| case | world | elements | tensors | method | median ms | x floor | extra peak "
             "| collectives | host syncs | rel. error |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for (case, world), methods in _by_case(rows).items():
        floor = methods.get("floor", {}).get("median_s")
        for name, r in methods.items():
            ratio = f"{r['median_s'] / floor:.2f}" if floor else "-"
            lines.append(
                f"| {case} | {world} | {r['numel']:.3g} | {r['tensors']} | {name} | "
                f"{r['median_s'] * 1e3:.3g} | {ratio} | {_bytes(r['extra_peak_bytes'])} | "
                f"{r['collectives']} | {r['host_syncs']} | {r['rel_error']:.1e} |")
    return "\n".join(lines)


def check_targets(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per target of issue #4 for ``norm_optim``: met, or missed and where."""
    ours = [r for r in rows if r["method"] == "norm_optim"]
    cases = _by_case(rows)

    def where(bad: list[dict[str, Any]], show: Callable[[dict[str, Any]], str]) -> str:
        return "met" if not bad else "MISSED: " + ", ".join(
            f"{r['case']}/w{r['world']} {show(r)}" for r in bad)

    def x_floor(r: dict[str, Any]) -> float:
        return r["median_s"] / cases[(r["case"], r["world"])]["floor"]["median_s"]

    def x_walk(r: dict[str, Any]) -> float:
        return cases[(r["case"], r["world"])]["attribute_walk"]["median_s"] / r["median_s"]

    many = [r for r in ours if r["tensors"] >= MANY_TENSORS]
    speedup = {d: TARGET_WALK_SPEEDUP.get(d, 2.0) for d in {r["device"] for r in ours}}
    return [
        "extra peak <= 1 MiB: " + where(
            [r for r in ours if (r["extra_peak_bytes"] or 0) > TARGET_PEAK_BYTES],
            lambda r: _bytes(r["extra_peak_bytes"])),
        "rel. error <= 1e-6: " + where(
            [r for r in ours if r["rel_error"] > TARGET_REL_ERROR],
            lambda r: f"{r['rel_error']:.1e}"),
        "time <= 1.1x floor: " + where(
            [r for r in ours if x_floor(r) > TARGET_X_FLOOR], lambda r: f"{x_floor(r):.2f}x"),
        f"faster than attribute_walk at >= {MANY_TENSORS} tensors "
        f"({', '.join(f'{d}: {s:g}x' for d, s in speedup.items())}): " + (
            "no such case" if not many else where(
                [r for r in many if x_walk(r) < speedup[r["device"]]],
                lambda r: f"{x_walk(r):.2f}x")),
        "1 collective, 0 host syncs: " + where(
            [r for r in ours if r["collectives"] != 1 or r["host_syncs"] != 0],
            lambda r: f"{r['collectives']} / {r['host_syncs']}"),
    ]


def library_fingerprint() -> str:
    """sha1 of norm_optim's sources as imported here: which library code a result belongs to."""
    import hashlib

    import norm_optim

    digest = hashlib.sha1()
    for path in sorted(Path(norm_optim.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


# -------------------------------------------------------------------------------------- plots

_STYLE = {"norm_optim": ("C0", "o"), "floor": ("C2", "s"), "attribute_walk": ("C1", "^"),
          "fp32_copy": ("C3", "x"), "dtensor_walk": ("C4", "v")}


def plot(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Time and extra peak memory against elements (dense) and tensor count (MoE), log-log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("# matplotlib is not installed (pip install matplotlib): no plots", file=sys.stderr)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    sweeps = {name: sweep for name, *_, sweep in _MODELS}
    panels = (("elements", "numel", "elements (dense models, ~100 tensors)"),
              ("tensors", "tensors", "tensors (MoE models, 4k-element experts)"))
    written = []
    for metric, label, file in (("median_s", "median seconds per call", "param_norm_time.png"),
                                ("extra_peak_bytes", "extra peak bytes per call (0 shown at 1 KiB)",
                                 "param_norm_memory.png")):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=80)
        for ax, (sweep, x_key, x_label) in zip(axes, panels):
            for method, (color, marker) in _STYLE.items():
                for world, line in ((1, "-"), (4, ":")):
                    points = sorted((r[x_key], max(r[metric] or 0, 1024 if metric != "median_s"
                                                   else 1e-6))
                                    for r in rows if sweeps.get(r["case"]) == sweep
                                    and r["world"] == world and r["method"] == method)
                    if points:
                        xs, ys = zip(*points)
                        ax.plot(xs, ys, line, color=color, marker=marker,
                                label=f"{method} (world {world})")
            if metric == "extra_peak_bytes":
                ax.axhline(TARGET_PEAK_BYTES, color="grey", linestyle="--", linewidth=0.8)
            ax.set(xscale="log", yscale="log", xlabel=x_label, ylabel=label)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / file
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


# ----------------------------------------------------------------------------------------- CLI


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small cases only (< 3 min, 2 cores)")
    parser.add_argument("--cases", nargs="*", default=[], help="model names to run (default: all)")
    parser.add_argument("--worlds", nargs="*", type=int, default=[],
                        help="world sizes to run on CPU (default: those of each case)")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per method")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per method first")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (1: every method on the same footing)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per case (CPU)")
    parser.add_argument("--json", type=Path, help="write the rows (and the environment) here")
    parser.add_argument("--plot-dir", type=Path, help="write PNG plots here (needs matplotlib)")
    parser.add_argument("--replot", type=Path, nargs="+",
                        help="plot rows from these JSON files instead of running")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.replot:
        rows = [row for p in args.replot for row in json.loads(p.read_text())["rows"]]
        for path in plot(rows, args.plot_dir or Path(".")):
            print(f"# wrote {path}")
        return 0
    sources = library_fingerprint()  # now: the files may change while the run goes on
    opts = Options(args.device, args.calls, args.warmup, args.threads)
    cases = select_cases(args.quick, args.cases, args.worlds)
    start = time.perf_counter()
    if _launched_by_torchrun():
        rows = run_torchrun(cases, opts)
        if not rows:
            return 0  # not rank 0
    elif args.device == "cuda":
        raise SystemExit("on CUDA, launch one process per GPU: torchrun --nproc-per-node N "
                         "benchmarks/param_norm.py --device cuda ...")
    else:
        rows = run_forked(cases, opts, args.timeout)
    wall = time.perf_counter() - start
    env = {**environment(), "norm_optim_sources_sha1": sources, "wall_s": round(wall, 1),
           "argv": sys.argv[1:]}
    print(format_table(rows))
    print()
    for line in check_targets(rows):
        print(f"- {line}")
    print(f"\n# {len(rows)} rows in {wall:.0f} s on {env['cpus']} CPUs ({env['processor']}), "
          f"torch {env['torch']}; memory: {rows[0]['memory_method'] if rows else '-'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "targets": check_targets(rows),
                                         "rows": rows}, indent=1))
        print(f"# wrote {args.json}")
    if args.plot_dir:
        for path in plot(rows, args.plot_dir):
            print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
