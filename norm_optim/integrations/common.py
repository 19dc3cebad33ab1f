"""Deprecated alias of :mod:`norm_optim.integrations._common` (moved in norm_optim 0.3.0); see ``CHANGELOG.md``."""

from norm_optim._moved import moved_module

moved_module(
    __name__,
    "norm_optim.integrations._common",
    since="0.3.0",
    replacement="the names of norm_optim.integrations.megatron_lm / .megatron_bridge",
)
