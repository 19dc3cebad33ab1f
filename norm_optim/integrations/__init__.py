"""Training-loop integrations: serve a loop's params-norm logging from :class:`NormAwareOptimizer`.

They sit above the wrapper and hold no counting logic; importing this package imports no
training framework (each submodule imports its own when used).

- :mod:`norm_optim.integrations.megatron_lm` — Megatron-LM's ``megatron.training`` loop
  (``--log-params-norm``): ``megatron_lm.install()`` before ``pretrain(...)``.
- :mod:`norm_optim.integrations.megatron_bridge` — Megatron-Bridge's ``pretrain()`` loop
  (``logger.log_params_norm``): ``megatron_bridge.install()`` before ``pretrain(...)``.
"""
