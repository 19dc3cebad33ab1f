"""The resume proof in the loops: fingerprints beside every checkpoint, proven after every load,
and the watch's statistics carried across the restart.

At each save, every rank computes :meth:`~norm_optim.NormAwareOptimizer.state_fingerprint` (one
all-reduce) and global rank 0 writes :data:`RESUME_FILE` in the checkpoint's directory, with the
watch's statistics (:data:`WATCH_FILE`; the loss's come from the last rank, which has the loss).
After a load, before the first step, every rank computes the fingerprint again; global rank 0
alone reads the file, compares (:func:`~norm_optim.verify_resume`) and broadcasts the bounded
report, so every rank acts alike: one line ``norm_optim resume (iteration I): N mismatches...``
from rank 0, the scalar :data:`RESUME_TAG`, and with ``audit_action="raise"``
:class:`~norm_optim.AuditError` on every rank. See docs/resume.md.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import torch

from .._comm import TorchCommunicator
from .._errors import UnsupportedOptimizerError
from .._audit.findings import AuditError
from .._resume.fingerprint import StateFingerprint
from .._resume.report import ResumeReport, verify_resume
from .._wrapper import NormAwareOptimizer
from ._log import LOGGER, global_rank

RESUME_FILE = "norm_optim_resume.json"
"""Written beside each checkpoint: the state's fingerprints (:class:`~norm_optim.StateFingerprint`)."""
WATCH_FILE = "norm_optim_watch.pt"
"""Written beside each checkpoint of a watched run: the watch's rolling statistics."""
RESUME_TAG = "resume/mismatches"
"""The scalar written once after a load: how many (param, state) pairs differ."""


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return global_rank(), world


def _comm(optimizer: NormAwareOptimizer) -> Any:
    return getattr(optimizer, "_state").comm or TorchCommunicator()


class ResumeProof:
    """Fingerprints saved with each checkpoint and proven after each load.

    Args:
        action: ``"warn"`` (rank 0 logs a differing load at ERROR) or ``"raise"`` (every rank
            raises :class:`~norm_optim.AuditError`). A load that matches is logged at INFO.

    Attributes:
        report: the last load's :class:`~norm_optim.ResumeReport` (None before one).
    """

    def __init__(self, action: str) -> None:
        self.action = action
        self.report: Optional[ResumeReport] = None
        self._refused = False

    def _fingerprint(self, optimizer: NormAwareOptimizer) -> Optional[StateFingerprint]:
        """The fingerprint, or None for a layout it refuses (said once; every rank alike)."""
        if self._refused:
            return None
        try:
            return optimizer.state_fingerprint()
        except UnsupportedOptimizerError as error:
            self._refused = True
            if _rank_and_world()[0] == 0:
                LOGGER.warning("norm_optim resume: no state fingerprints for this run: %s", error)
            return None

    def saved(self, optimizer: NormAwareOptimizer, directory: str, iteration: int) -> None:
        """After a save, on every rank (collectives): the fingerprints and the watch's state."""
        fingerprint = self._fingerprint(optimizer)
        watch_state = self._watch_state(optimizer)
        if _rank_and_world()[0] != 0:
            return
        os.makedirs(directory, exist_ok=True)
        if fingerprint is not None:
            with open(os.path.join(directory, RESUME_FILE), "w", encoding="utf-8") as out:
                json.dump(dict(fingerprint.to_json(), iteration=iteration), out, sort_keys=True)
        if watch_state is not None:
            torch.save(watch_state, os.path.join(directory, WATCH_FILE))

    @staticmethod
    def _watch_state(optimizer: NormAwareOptimizer) -> Optional[dict[str, Any]]:
        """The watch's state (None unwatched), the loss's statistics from the last rank."""
        watch = optimizer.watching
        if watch is None:
            return None
        state = watch.state_dict()
        rank, world = _rank_and_world()
        if world > 1:
            loss = state.get("loss") if rank == world - 1 else None
            loss = _comm(optimizer).broadcast_object(loss, world - 1, None)
            if loss is not None:
                state["loss"] = loss
        return state

    def loaded(
        self,
        optimizer: NormAwareOptimizer,
        directory: str,
        iteration: int,
        tensorboard: Any,
        wandb: Any,
        optimizer_loaded: bool = True,
    ) -> Optional[ResumeReport]:
        """After a load, before the first step, on every rank (collectives): the report of what
        the load put into the optimizer, and the watch's statistics restored."""
        fingerprint = self._fingerprint(optimizer)
        rank, _ = _rank_and_world()
        comm = _comm(optimizer)
        report: Optional[ResumeReport] = None
        if rank == 0 and fingerprint is not None:  # one reader, not 16,384 opens of one file
            path = os.path.join(directory, RESUME_FILE)
            if not os.path.exists(path):
                report = ResumeReport(iteration, compared=False)
            else:
                saved = StateFingerprint.load(path)
                report = verify_resume(
                    saved, fingerprint, iteration, optimizer_loaded=optimizer_loaded
                )
        report = comm.broadcast_object(report, 0, None)
        self._restore_watch(optimizer, directory, rank, comm)
        if report is None:
            return None
        self.report = report
        if report.compared:
            if tensorboard is not None:
                tensorboard.add_scalar(RESUME_TAG, float(report.count), iteration)
            if wandb is not None:
                wandb.log({RESUME_TAG: float(report.count)}, iteration)
        line = report.line()
        if not report.ok and self.action == "raise":
            raise AuditError(line)
        if rank == 0:
            LOGGER.log(logging.INFO if report.ok else logging.ERROR, "%s", line)
        return report

    @staticmethod
    def _restore_watch(optimizer: NormAwareOptimizer, directory: str, rank: int, comm: Any) -> None:
        watch = optimizer.watching
        if watch is None:
            return
        state = None
        path = os.path.join(directory, WATCH_FILE)
        if rank == 0 and os.path.exists(path):
            state = torch.load(path, map_location="cpu", weights_only=True)
        state = comm.broadcast_object(state, 0, None)
        if state is not None:
            watch.load_state_dict(state)
