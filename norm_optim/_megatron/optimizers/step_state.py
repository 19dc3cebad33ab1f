"""When, inside one ``step()``, the grads of the step are ready, whether the step is applied,
and whether it was.

The optimizer-specific facts of step norms (what each leaf steps, its rule, its moments) are in
its descriptor (:mod:`.descriptor`, built once with the registry); this module only runs the
step with the reads in their places: :func:`run_step`.
"""

from __future__ import annotations

from typing import Any, Callable

from ..._patching import attributes_set


def run_step(
    optimizer: Any,
    grads_ready: Callable[[], None],
    step_taken: Callable[[], None],
    veto: Callable[[], bool],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``optimizer.step(*args, **kwargs)``, calling ``grads_ready()`` once the grads are on the
    fp32 mains, unscaled and not yet clipped, ``veto()`` right before the step is applied (True:
    it is not), and ``step_taken()`` when it is.

    Megatron clips the grads in place inside ``step()``, between ``prepare_grads()`` (copy to
    the fp32 mains, unscale, found-inf check) and the clipping; ``step_with_ready_grads()`` (the
    inner step) is never called for a skipped step (found-inf; on megatron-core main also a
    grad-norm threshold). Every megatron-core release from 0.14 to main calls both through
    ``self`` (``MegatronOptimizer.step``, ``ChainedOptimizer.step``, and the layer-wise
    optimizer, a chained one), so for this one step they are set as attributes of the optimizer
    instance, and removed after it. A plain torch optimizer has neither: its grads are ready
    before its ``step()`` (no clipping inside) and its step is never skipped by itself.

    A vetoed step is one whose ``step_with_ready_grads()`` returns False without applying
    anything, as Megatron's own skip paths do: ``step()`` returns ``(False, grad_norm,
    num_zeros)`` (the loop counts a skipped iteration, its scheduler does not advance, and it
    still logs the grad norm); the loss scaler judged the real grads inside ``prepare_grads()``
    and is not moved. ``veto()`` runs after Megatron's grad-norm clipping, which reads its norm on
    the host: a verdict computed before it is ready by then, so reading it stalls nothing. A
    plain torch optimizer's vetoed ``step()`` is not called (None is returned).
    """
    if not hasattr(optimizer, "prepare_grads"):
        grads_ready()
        if veto():
            return None
        step_taken()
        return optimizer.step(*args, **kwargs)
    original_prepare = optimizer.prepare_grads
    original_step = optimizer.step_with_ready_grads

    def prepare_grads(*a: Any, **k: Any) -> Any:
        found_inf = original_prepare(*a, **k)
        grads_ready()
        return found_inf

    def step_with_ready_grads(*a: Any, **k: Any) -> Any:
        if veto():
            return False
        step_taken()
        return original_step(*a, **k)

    with attributes_set(
        optimizer, prepare_grads=prepare_grads, step_with_ready_grads=step_with_ready_grads
    ):
        return optimizer.step(*args, **kwargs)
