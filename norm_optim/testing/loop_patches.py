"""Deprecated alias of :mod:`norm_optim.testing._internal.loop_patches` (moved in norm_optim 0.3.0); see ``CHANGELOG.md``."""

from norm_optim._moved import moved_module

moved_module(
    __name__,
    "norm_optim.testing._internal.loop_patches",
    since="0.3.0",
    replacement="the runners of norm_optim.testing.megatron_lm / .megatron_bridge (the loops' CPU patches are internal)",
)
