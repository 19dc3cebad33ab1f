"""Which of a step's grads live in a buffer that outlives the step: Megatron DDP's.

Megatron's DDP gives every param a ``main_grad``, a view of its ``ParamAndGradBuffer``'s
``grad_data`` made once when DDP is built and kept for the run (``offload_grad_buffers`` frees
and restores the storage in place: the views stay). Each step the optimizer points the
``.grad`` of its fp32 mains into it again: ``main_grad.float()`` (the Float16 optimizer; the
same tensor when the buffer is fp32) or a slice of it (the distributed optimizer's shard). A
grad that shares that storage can be read through views made once; any other (a bf16 buffer's
``.float()`` copy, a plain torch optimizer's grads) is a new tensor each step.
"""

from __future__ import annotations

from typing import Any

import torch


def in_grad_buffer(model_param: Any, grad: torch.Tensor) -> bool:
    """Whether ``grad`` (an fp32 main's grad at this step) is a view of the DDP grad buffer
    that holds ``model_param.main_grad``."""
    # megatron/core/distributed/param_and_grad_buffer.py: param.main_grad (0.14-0.20.dev)
    main_grad = getattr(model_param, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.device != grad.device:
        return False
    buffer = main_grad.untyped_storage()
    return buffer.nbytes() > 0 and grad.untyped_storage().data_ptr() == buffer.data_ptr()
