"""Errors raised by norm_optim: each names the problem and what to do about it."""

from __future__ import annotations


class NormOptimError(Exception):
    """Base class of every error norm_optim raises on bad input."""


class UnsupportedOptimizerError(NormOptimError, TypeError):
    """The optimizer (or one of its leaves) is of a kind whose fp32 tensors we cannot read."""


class UnknownParamError(NormOptimError, ValueError):
    """A model param the optimizer does not know, or an optimizer param missing from the model."""


class ParallelStateError(NormOptimError, RuntimeError):
    """The parallel layout is needed but has not been set up (or is inconsistent)."""
