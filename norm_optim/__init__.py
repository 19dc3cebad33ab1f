"""norm_optim: exact, cheap global weight norms for Megatron-core optimizers.

Wrap the optimizer once; ask for the norm at log intervals::

    from norm_optim import NormAwareOptimizer
    optimizer = NormAwareOptimizer(get_megatron_optimizer(config, model_chunks), model=model_chunks)
    norm = optimizer.param_l2_norm()   # float(norm) is the global L2 norm of the weights
"""

from ._findings import AuditError, AuditReport, Finding, FindingKind
from ._comm import Communicator, TorchCommunicator
from ._errors import (
    NormOptimError,
    ParallelStateError,
    UnknownParamError,
    UnsupportedOptimizerError,
)
from ._norm import NamedNorms, ParamNorms, PendingNorms
from ._ownership import RankCoords
from ._registry import CountedRecord, ParamRecord, ParamRegistry
from ._resume import StateFingerprint
from ._resume_report import ResumeReport, verify_resume
from ._step import StepNorms
from ._versions import UntestedMegatronWarning
from ._watch import Alarm, Watch, WatchConfig
from ._vocabulary import NotCounted, Source
from ._wrapper import NormAwareOptimizer

__all__ = [
    "Alarm",
    "AuditError",
    "AuditReport",
    "Communicator",
    "CountedRecord",
    "Finding",
    "FindingKind",
    "NamedNorms",
    "NormAwareOptimizer",
    "NotCounted",
    "NormOptimError",
    "ParallelStateError",
    "ParamNorms",
    "ParamRecord",
    "ParamRegistry",
    "PendingNorms",
    "RankCoords",
    "ResumeReport",
    "Source",
    "StateFingerprint",
    "StepNorms",
    "TorchCommunicator",
    "UnknownParamError",
    "UnsupportedOptimizerError",
    "UntestedMegatronWarning",
    "Watch",
    "WatchConfig",
    "verify_resume",
]

__version__ = "0.4.0"
