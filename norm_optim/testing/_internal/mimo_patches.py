"""Test-only patch that lets colocated MIMO modules with different DP build on CPU ranks
(internal).

Reversible and named after the megatron code it exists for; applied by
:mod:`norm_optim.testing.mimo`. Never install it outside tests.
"""

from __future__ import annotations

from typing import Any

import torch

from norm_optim._patching import Patch, PatchSet


class _GlooSubgroups:
    """``torch.distributed`` as models/mimo/comm/colocated_communicator.py sees it, except that
    the subgroups it builds with a literal ``backend='nccl'`` (the colocated bridge's gather
    group, where modules differ in DP) use the default backend (gloo on CPU ranks)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    @staticmethod
    def new_subgroups_by_enumeration(ranks: Any, **kwargs: Any) -> Any:
        kwargs.pop("backend", None)
        return torch.distributed.new_subgroups_by_enumeration(ranks, **kwargs)


def install_mimo_cpu_patches() -> PatchSet:
    """Patch megatron-core so that colocated MIMO modules with different DP build on CPU
    ranks (see :class:`_GlooSubgroups`); ``uninstall()`` the handle to restore it. Test-only."""
    from megatron.core.models.mimo.comm import colocated_communicator

    return PatchSet.apply([Patch(colocated_communicator, "dist", _GlooSubgroups())])
