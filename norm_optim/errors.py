"""Deprecated alias of :mod:`norm_optim._errors` (moved in norm_optim 0.3.0); see ``CHANGELOG.md``."""

from norm_optim._moved import moved_module

moved_module(
    __name__,
    "norm_optim._errors",
    since="0.3.0",
    replacement="the errors at the package root (from norm_optim import UnknownParamError, ...)",
)
