"""What a run shows of its workings, for code that looks inside rather than trains.

The registry and its records with the counting vocabulary (``optimizer.registry``: which
tensor this rank sums for each param, and why it counts it or not), the per-param mapping of
the norms, the reports of the audit and of the resume proof, and the default communicator (to
subclass when counting what crosses the communication seam). A training script needs none of
these names: it gets the values from :class:`~norm_optim.NormAwareOptimizer`'s calls. They were
exported from ``norm_optim`` itself until 0.4.0; that spelling still works, with a
``DeprecationWarning``, until 0.6.0.
"""

from ._comm import TorchCommunicator
from ._audit.findings import AuditReport, Finding, FindingKind
from ._norms.reducer import NamedNorms
from ._counting.ownership import RankCoords
from ._norms.registry import CountedRecord, ParamRecord, ParamRegistry
from ._resume.report import ResumeReport
from ._counting.vocabulary import NotCounted, Source

__all__ = [
    "AuditReport",
    "CountedRecord",
    "Finding",
    "FindingKind",
    "NamedNorms",
    "NotCounted",
    "ParamRecord",
    "ParamRegistry",
    "RankCoords",
    "ResumeReport",
    "Source",
    "TorchCommunicator",
]
