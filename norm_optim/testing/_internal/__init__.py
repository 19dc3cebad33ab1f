"""Internal to :mod:`norm_optim.testing`: the patches that run megatron-core on CPU ranks.

The patches the public runners apply in each rank (the training loops' CPU patches,
Megatron-FSDP's, torch FSDP2's, MIMO's, Megatron-Bridge's import guards). Not public API: names
and behaviour may change in any release; use the runners in :mod:`norm_optim.testing` (the CPU
shim itself is public: :mod:`norm_optim.testing.cpu`).
"""
