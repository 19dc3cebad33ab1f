"""Deprecated alias of :mod:`norm_optim.testing.cpu` (moved in norm_optim 0.3.0); see ``CHANGELOG.md``."""

from norm_optim._moved import moved_module

moved_module(
    __name__,
    "norm_optim.testing.cpu",
    since="0.3.0",
    replacement="norm_optim.testing.cpu (or install_cpu_shim / cpu_shim from norm_optim.testing)",
)
