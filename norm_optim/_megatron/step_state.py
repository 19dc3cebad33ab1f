"""When, inside one ``step()``, the grads of the step are ready and whether it was taken.

The optimizer-specific facts of step norms (what each leaf steps, its rule, its moments) are in
its descriptor (:mod:`.descriptor`, built once with the registry); this module only times the
reads: :func:`step_hooks`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable


@contextlib.contextmanager
def step_hooks(
    optimizer: Any, grads_ready: Callable[[], None], step_taken: Callable[[], None]
) -> Iterator[None]:
    """Run one ``optimizer.step()`` inside: ``grads_ready()`` once the grads are on the fp32
    mains, unscaled and not yet clipped; ``step_taken()`` when the step is applied.

    Megatron clips the grads in place inside ``step()``, between ``prepare_grads()`` (copy to
    the fp32 mains, unscale, found-inf check) and the clipping; ``step_with_ready_grads()`` (the
    inner step) is never called for a skipped step (found-inf; on megatron-core main also a
    grad-norm threshold). Every megatron-core release from 0.14 to main calls both through
    ``self`` (``MegatronOptimizer.step``, ``ChainedOptimizer.step``, and the layer-wise
    optimizer, a chained one), so for this one step they are set as attributes of the optimizer
    instance, and removed after it. A plain torch optimizer has neither: its grads are ready
    before its ``step()`` (no clipping inside) and its step is never skipped.
    """
    if not hasattr(optimizer, "prepare_grads"):
        grads_ready()
        step_taken()
        yield
        return
    original_prepare = optimizer.prepare_grads
    original_step = optimizer.step_with_ready_grads

    def prepare_grads(*args: Any, **kwargs: Any) -> Any:
        found_inf = original_prepare(*args, **kwargs)
        grads_ready()
        return found_inf

    def step_with_ready_grads(*args: Any, **kwargs: Any) -> Any:
        step_taken()
        return original_step(*args, **kwargs)

    with _instance_attributes(
        optimizer, prepare_grads=prepare_grads, step_with_ready_grads=step_with_ready_grads
    ):
        yield


@contextlib.contextmanager
def _instance_attributes(target: Any, **values: Callable[..., Any]) -> Iterator[None]:
    """Set attributes on one instance for the ``with`` block, then remove them (or put back
    what the instance itself had): nothing of ours is left on the optimizer."""
    own = vars(target)
    saved = {name: own[name] for name in values if name in own}
    for name, value in values.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name in values:
            if name in saved:
                setattr(target, name, saved[name])
            else:
                delattr(target, name)
