"""The weights' norms saved beside each checkpoint and compared at its load:
:class:`CheckpointParity` and its file (:data:`NORMS_FILE`)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from .._comm import TorchCommunicator
from .._audit.findings import AuditError
from .._norms.reducer import ParamNorms
from .._wrapper import NormAwareOptimizer
from ._audit_schedule import AUDIT_ACTIONS
from ._log import LOGGER, global_rank
from ._scalars import float_values


AT_LOAD_TAG = "params-norm/at-load"
"""The scalar written once after a checkpoint load: the loaded weights' norm."""
NORMS_FILE = "norm_optim_norms.json"
"""Written beside each checkpoint: the saved weights' total and per-layer norms."""
SHOWN_LAYERS = 8
"""How many differing layers a load's verdict names (the rest are counted)."""


class CheckpointParity:
    """The saved weights' per-layer norms beside each checkpoint, compared at load.

    At each save, every rank reads ``param_l2_norms(per_param=True)`` (one all-reduce) and
    rank 0 writes :data:`NORMS_FILE` in the checkpoint's directory. After a load, every rank
    reads the loaded weights' norms once, before the first step (a log line and the scalar
    :data:`AT_LOAD_TAG`), and global rank 0 compares them per layer with the file, when there
    is one, and broadcasts its verdict, so every rank decides alike.

    Args:
        action: ``"warn"`` (rank 0 logs the layers that differ, :data:`LOGGER` at ERROR) or
            ``"raise"`` (every rank raises :class:`~norm_optim.AuditError`). A load that matches
            is logged at INFO.
        rel: the relative difference above which a layer's norm differs.
    """

    def __init__(self, action: str, rel: float = 1e-6) -> None:
        if action not in AUDIT_ACTIONS:
            raise ValueError(f"audit_action must be one of {AUDIT_ACTIONS}, got {action!r}")
        self.action, self.rel = action, rel
        self.at_load: Optional[dict[str, Any]] = None  # what the last load found

    @staticmethod
    def _norms(optimizer: Any) -> dict[str, Any]:
        norms: ParamNorms = optimizer.param_l2_norms(per_param=True)
        per_layer = norms.per_layer or {}
        return {
            "total": float(norms.total),
            "per_layer": dict(zip(per_layer, float_values(per_layer))),
        }

    def saved(self, optimizer: Any, directory: str, iteration: int) -> None:
        """After a save, on every rank."""
        import json
        import os

        norms = dict(self._norms(optimizer), iteration=iteration)
        if global_rank() == 0:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, NORMS_FILE), "w", encoding="utf-8") as out:
                json.dump(norms, out, indent=1, sort_keys=True)

    def _compare(self, path: str, norms: dict[str, Any]) -> dict[str, Any]:
        """On the one reading rank: the saved total (None without a file) and the layers whose
        norm differs (the first :data:`SHOWN_LAYERS`, and how many): bounded, to broadcast."""
        import json
        import os

        if not os.path.exists(path):
            return {"saved_total": None, "differ": [], "count": 0}
        with open(path, encoding="utf-8") as inp:
            saved = json.load(inp)
        differ: list[str] = []
        for name in sorted(set(saved["per_layer"]) | set(norms["per_layer"])):
            a, b = saved["per_layer"].get(name), norms["per_layer"].get(name)
            if a is None or b is None or abs(a - b) > self.rel * max(abs(a), abs(b)):
                differ.append(name)
        shown = differ[:SHOWN_LAYERS]
        return {"saved_total": float(saved["total"]), "differ": shown, "count": len(differ)}

    def loaded(
        self, optimizer: Any, directory: str, iteration: int, tensorboard: Any, wandb: Any
    ) -> dict[str, Any]:
        """After a load, before the first step, on every rank: the norm, and the layers whose
        norm differs from what was saved (raised with ``"raise"``). Global rank 0 alone reads
        the file and compares; the others get its bounded verdict by one broadcast."""
        import os

        norms = self._norms(optimizer)
        verdict = None
        if global_rank() == 0:  # one reader: not 16,384 opens of one file at load
            verdict = self._compare(os.path.join(directory, NORMS_FILE), norms)
        comm = optimizer._state.comm if isinstance(optimizer, NormAwareOptimizer) else None
        verdict = (comm or TorchCommunicator()).broadcast_object(verdict, 0, None)
        saved, differ, count = verdict["saved_total"], verdict["differ"], verdict["count"]
        self.at_load = dict(
            norms,
            iteration=iteration,
            compared=saved is not None,
            differ=differ,
            differ_count=count,
        )
        if tensorboard is not None:
            tensorboard.add_scalar(AT_LOAD_TAG, norms["total"], iteration)
        if wandb is not None:
            wandb.log({AT_LOAD_TAG: norms["total"]}, iteration)
        line = f"norm_optim: params norm at load (iteration {iteration}): {norms['total']:.6f}"
        if saved is None:
            line += " (no saved norms beside the checkpoint to compare with)"
        elif differ:
            line += (
                f"; differs from the saved weights' in {count} layers: {differ}"
                f" (saved total {saved:.6f})"
            )
        else:
            line += "; every layer equals the saved weights'"
        if differ and self.action == "raise":
            raise AuditError(line)
        if global_rank() == 0:
            LOGGER.log(logging.ERROR if differ else logging.INFO, "%s", line)
        return self.at_load
