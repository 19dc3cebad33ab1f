"""The test-only CPU shim for megatron-core (every supported release line).

megatron-core hard-codes CUDA in the paths a norm test needs (DDP buffers, the
optimizers, the MoE router and token dispatcher). This module patches exactly
those spots so the *real* megatron code runs on CPU with gloo. Each patch names
the megatron-core code it exists for; each was found by removing it and seeing
that code fail.

The shim makes ``.cuda()`` and ``device='cuda'`` silently succeed on CPU, which
would hide CUDA-only calls in library code. Never install it outside tests, and
keep library code device-agnostic (take the device from the tensors given).

Install it once per process (per rank), before megatron objects are built::

    shim = install_cpu_shim()
    ...
    shim.uninstall()
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from norm_optim._patching import Patch, PatchSet

CpuShim = PatchSet
"""Handle of an installed shim (a :class:`~norm_optim._patching.PatchSet`)."""

__all__ = [
    "CpuShim",
    "cpu_shim",
    "init_rng",
    "install_cpu_shim",
]

# The handle is stored on a patched torch function, so finding out whether the shim is
# installed needs no module-level state.
_HANDLE_ATTR = "_norm_optim_cpu_shim"

# Factory functions megatron calls with a literal ``device='cuda'`` (optimizer ``found_inf``,
# ``_scale_one`` and ``_dummy_overflow_buf``, the grad scaler, ``clip_grads``, DDP's warm-up).
_FACTORY_NAMES = ("tensor", "zeros", "ones", "empty", "full")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _route_to_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


def _current_device() -> torch.device:
    # DDP's ParamAndGradBuffer, the distributed optimizer, the MoE router and experts pass
    # ``device=torch.cuda.current_device()``; a torch.device works wherever an int does there.
    return torch.device("cpu")


def _tensor_type(original: Callable[..., Any]) -> Callable[..., Any]:
    # Float16OptimizerWithFloat16Params, DistributedOptimizer and clip_grads check
    # ``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']`` and
    # ``param.type() == 'torch.cuda.FloatTensor'``: report CPU tensors under the CUDA name.
    @functools.wraps(original)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        # A Tensor subclass (0.19's GTPShardedParam) re-enters this through __torch_function__.
        if args or kwargs or self.device.type != "cpu" or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    return type_


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    # MegatronOptimizer moves the tied embedding with ``weight.data.cuda()`` when PP > 1;
    # the grad scaler's load_state_dict calls ``.cuda(device)``.
    return self


def _no_op(*args: Any, **kwargs: Any) -> None:
    # ``torch.cuda.synchronize()`` in pipeline p2p communication and DDP.
    return None


class _NoOpEvent:
    """Stands in for ``torch.cuda.Event``: on CPU every op is already complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream``: on CPU there is one implicit stream.

    Needed by DDP's ``communication_stream`` with ``num_distributed_optimizer_instances > 1``
    and by ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoOpEvent:
        return event if event is not None else _NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        # Every no-op stream is "the" CPU stream, so the dispatcher sees it is not on a side stream.
        return isinstance(other, _NoOpStream)

    def __hash__(self) -> int:
        return 0


def _stream_context(stream: Any = None) -> contextlib.AbstractContextManager[None]:
    # ``with torch.cuda.stream(...)`` in param_and_grad_buffer.py and token_dispatcher.py.
    return contextlib.nullcontext()


def _maybe_move_tensor_to_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    # moe_utils.maybe_move_tensor_to_cpu converts to numpy only for CUDA tensors, so on CPU the
    # alltoall dispatcher hands tensor split sizes to ``all_to_all_single``, which rejects them.
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _megatron_patches() -> list[Patch]:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    patches = [
        Patch(moe_utils, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu),
        # token_dispatcher imported the function by name, so patch its binding too.
        Patch(token_dispatcher, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu),
    ]
    try:
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    except ImportError:  # the layer-wise optimizer exists since megatron-core 0.16
        pass
    else:
        # gloo's all_gather needs equal sizes, but the layer-wise optimizer all-gathers each
        # rank's (unequal) assigned params; megatron's broadcast_params distributes the same.
        patches.append(
            Patch(
                LayerWiseDistributedOptimizer,
                "allgather_params",
                LayerWiseDistributedOptimizer.broadcast_params,
            )
        )
    patches += _inference_linear_patches()
    if not hasattr(moe_utils, "te_general_gemm"):
        # moe_utils binds ``te_general_gemm`` only when Transformer Engine imports, yet the
        # router's ``router_gemm_with_logits`` reads it unconditionally (NameError without TE).
        patches.append(Patch(moe_utils, "te_general_gemm", None))
    return patches


def _inference_linear_patches() -> list[Patch]:
    try:  # megatron-core main (0.20)
        from megatron.core.tensor_parallel import inference_layers
        from megatron.core.transformer import multi_token_prediction
    except ImportError:
        return []
    checker = getattr(multi_token_prediction, "is_inference_column_parallel_linear", None)
    if checker is None or isinstance(inference_layers.InferenceColumnParallelLinear, type):
        return []
    # Without Transformer Engine the inference linears are MagicMock placeholders, so the
    # isinstance in is_inference_column_parallel_linear (inference_layers.py), which every
    # MultiTokenPredictionLayer calls, raises TypeError; no module is one of them here.
    return [
        Patch(multi_token_prediction, "is_inference_column_parallel_linear", lambda module: False)
    ]


def _torch_patches() -> list[Patch]:
    patches = [
        Patch(torch.cuda, "current_device", _current_device),
        Patch(torch.cuda, "synchronize", _no_op),
        Patch(torch.cuda, "Stream", _NoOpStream),
        Patch(torch.cuda, "Event", _NoOpEvent),
        Patch(torch.cuda, "current_stream", _NoOpStream),
        Patch(torch.cuda, "default_stream", _NoOpStream),
        Patch(torch.cuda, "stream", _stream_context),
        Patch(torch.Tensor, "cuda", _tensor_cuda),
        Patch(torch.Tensor, "type", _tensor_type(torch.Tensor.type)),
    ]
    patches += [Patch(torch, n, _route_to_cpu(getattr(torch, n))) for n in _FACTORY_NAMES]
    return patches


def install_cpu_shim() -> CpuShim:
    """Patch torch and megatron-core so that megatron's CUDA-only code paths run on CPU.

    Process-local and idempotent: a second call returns the handle of the first.

    Returns:
        The :class:`CpuShim` handle; ``uninstall()`` it (or use it as a context manager)
        to restore the originals.
    """
    existing = getattr(torch.cuda.synchronize, _HANDLE_ATTR, None)
    if existing is not None and existing.installed:
        return existing
    handle = PatchSet.apply(_torch_patches() + _megatron_patches())
    setattr(torch.cuda.synchronize, _HANDLE_ATTR, handle)  # the shim's own _no_op function
    return handle


@contextlib.contextmanager
def cpu_shim() -> Iterator[CpuShim]:
    """Context-manager form of :func:`install_cpu_shim`."""
    handle = install_cpu_shim()
    try:
        yield handle
    finally:
        handle.uninstall()


def init_rng(seed: int = 1234) -> None:
    """Seed every RNG a megatron forward pass touches, without CUDA.

    ``model_parallel_cuda_manual_seed`` needs CUDA RNG states; the inference RNG tracker is
    megatron's official CUDA-free alternative (its forks are plain context managers).
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
