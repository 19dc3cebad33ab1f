"""What the loop integrations share: the deferred params-norm marker and the breakdown value."""

from __future__ import annotations

from typing import Any, Optional

from ..errors import NormOptimError
from ..norm import ParamNorms


class ParamsNormWithBreakdown(float):
    """The total params norm (a ``float``: TensorBoard / W&B get the total) that also shows the
    dense and expert norms wherever it is formatted.

    Megatron-LM's and Megatron-Bridge's ``training_log`` print
    ``f' params norm: {params_norm:.3f} |'``; with this value the line reads
    `` params norm: 20.017 | params norm dense: 18.305 | params norm expert: 8.100 |``.
    """

    dense: float
    expert: float

    def __new__(cls, total: float, dense: float, expert: float) -> "ParamsNormWithBreakdown":
        value = super().__new__(cls, total)
        value.dense = dense
        value.expert = expert
        return value

    def __format__(self, spec: str) -> str:
        total = float.__format__(self, spec)
        return (f"{total} | params norm dense: {self.dense:{spec}} | "
                f"params norm expert: {self.expert:{spec}}")


class DeferredParamsNorm:
    """What a patched ``calc_params_l2_norm`` returns: nothing is computed until the loop's
    ``training_log`` knows, on every rank alike, that the value is read.

    Args:
        patched: the dotted name of the function it stands for (for the error message).
    """

    def __init__(self, patched: str) -> None:
        self._patched = patched

    def __float__(self) -> float:
        raise NormOptimError(
            f"norm_optim defers {self._patched} to training_log, which reads the norm on every "
            "rank at log intervals; elsewhere call integration.optimizer.param_l2_norm() on "
            "every rank"
        )

    def __repr__(self) -> str:
        return "<params norm: read by training_log at log intervals>"


def logged_value(norms: Optional[ParamNorms], breakdown: bool) -> Optional[float]:
    """What a loop's ``training_log`` gets as ``params_norm``: None where it does not read it,
    else the total (a :class:`ParamsNormWithBreakdown` when ``breakdown``)."""
    if norms is None:
        return None
    if breakdown:
        return ParamsNormWithBreakdown(float(norms.total), float(norms.dense), float(norms.expert))
    return float(norms.total)


def write_breakdown(norms: ParamNorms, iteration: int, tensorboard: Any, wandb: Any) -> None:
    """``params-norm-dense`` and ``params-norm-expert`` to the loop's TensorBoard / W&B writers
    (either may be None), next to the ``params-norm`` the loop writes itself."""
    for tag, value in (("params-norm-dense", norms.dense), ("params-norm-expert", norms.expert)):
        if tensorboard is not None:
            tensorboard.add_scalar(tag, float(value), iteration)
        if wandb is not None:
            wandb.log({tag: float(value)}, iteration)


def is_loop_model(model: Any, chunks: Optional[list[Any]]) -> bool:
    """Whether ``model`` (a chunk or a list of them) is exactly the loop's model ``chunks``:
    the deferred norm stands for the wrapped optimizer's model, and no other."""
    given = model if isinstance(model, list) else [model]
    return chunks is not None and len(given) == len(chunks) and all(
        a is b for a, b in zip(given, chunks)
    )
