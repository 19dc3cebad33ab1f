"""Where the loop integrations say what they find (:data:`LOGGER`), and on which rank."""

from __future__ import annotations

import logging


LOGGER = logging.getLogger("norm_optim.integrations")
"""Where the loop integrations say what they find, on one rank (global rank 0): an audit's
findings and a checkpoint load's differing layers at ERROR (as the watch's alarms on
``norm_optim.watch``: Megatron-Bridge drops every WARNING record by default, and Python shows
ERROR without any logging set up), the norm at a load that matches at INFO. Both are children of
``norm_optim``: configure, redirect or silence them there."""


def global_rank() -> int:
    """This process's global rank (0 without ``torch.distributed``): the one that speaks."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_logging_rank() -> bool:
    """The rank Megatron's loops print their log line on: the last one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == dist.get_world_size() - 1
