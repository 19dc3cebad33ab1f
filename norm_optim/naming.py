"""Deprecated alias of :mod:`norm_optim._megatron.naming` (moved in norm_optim 0.3.0); see ``CHANGELOG.md``."""

from norm_optim._moved import moved_module

moved_module(
    __name__,
    "norm_optim._megatron.naming",
    since="0.3.0",
    replacement="the registry's global names (record.global_name, param_l2_norms(per_param=True))",
)
