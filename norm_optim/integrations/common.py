"""What the loop integrations share: the deferred params-norm marker and the breakdown value."""

from __future__ import annotations

from ..errors import NormOptimError


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
