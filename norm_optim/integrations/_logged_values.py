"""The values a loop logs in place of its own: :class:`LoggedParamsNorm` (the norm and its
breakdown on the log line), :class:`DeferredParamsNorm` (what a patched ``calc_params_l2_norm``
returns until ``training_log`` reads it) and :class:`LoggedGradNorm` (the grad norm with the
update-to-weight ratio)."""

from __future__ import annotations

from typing import Optional, Sequence

from .._errors import NormOptimError


class LoggedParamsNorm(float):
    """The total params norm (a ``float``: TensorBoard / W&B get the total) that also shows the
    dense and expert norms, and the params that grew fastest, wherever it is formatted.

    Megatron-LM's and Megatron-Bridge's ``training_log`` print
    ``f' params norm: {params_norm:.3f} |'``; with this value the line reads
    `` params norm: 20.017 | params norm dense: 18.305 | params norm expert: 8.100 |``
    (``breakdown``), and with ``per_param`` ends in
    `` | fastest-growing params: decoder.layers.1.mlp.linear_fc1.weight x1.0123, ... |``.
    """

    dense: Optional[float]
    expert: Optional[float]
    growing: tuple[tuple[str, float], ...]

    def __new__(
        cls,
        total: float,
        dense: Optional[float] = None,
        expert: Optional[float] = None,
        growing: Sequence[tuple[str, float]] = (),
    ) -> "LoggedParamsNorm":
        value = super().__new__(cls, total)
        value.dense, value.expert, value.growing = dense, expert, tuple(growing)
        return value

    def __format__(self, spec: str) -> str:
        parts = [float.__format__(self, spec)]
        if self.dense is not None and self.expert is not None:
            parts += [
                f"params norm dense: {self.dense:{spec}}",
                f"params norm expert: {self.expert:{spec}}",
            ]
        if self.growing:
            parts.append(
                "fastest-growing params: "
                + ", ".join(f"{name} x{ratio:.4f}" for name, ratio in self.growing)
            )
        return " | ".join(parts)


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


class LoggedGradNorm(float):
    """Megatron's grad norm (the ``float`` it logs and writes, unchanged) that also shows the
    measured step's update-to-weight ratio in the log line:
    `` grad norm: 1.234 | update/weight: 1.2e-03 (largest: layer 3 2.1e-03) |``."""

    note: str

    def __new__(cls, value: float, note: str) -> "LoggedGradNorm":
        out = super().__new__(cls, value)
        out.note = note
        return out

    def __format__(self, spec: str) -> str:
        return f"{float.__format__(self, spec)} | {self.note}"
