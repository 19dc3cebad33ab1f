"""Deprecated alias of :mod:`norm_optim._norm` (moved in norm_optim 0.3.0); see ``CHANGELOG.md``."""

from norm_optim._moved import moved_module

moved_module(
    __name__,
    "norm_optim._norm",
    since="0.3.0",
    replacement="norm_optim.ParamNorms / norm_optim.PendingNorms / norm_optim.NamedNorms",
)
