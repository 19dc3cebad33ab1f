"""norm_optim: exact, cheap global weight norms for Megatron-core optimizers.

Wrap the optimizer once; ask for the norm at log intervals::

    from norm_optim import NormAwareOptimizer
    optimizer = NormAwareOptimizer(get_megatron_optimizer(config, model_chunks), model=model_chunks)
    norm = optimizer.param_l2_norm()   # float(norm) is the global L2 norm of the weights

What a training script names is here; the types for looking inside (the registry, its
records, the audit's and the resume proof's reports) are in :mod:`norm_optim.inspection`.
"""

import functools

from . import inspection
from ._comm import Communicator
from ._errors import (
    NormOptimError,
    ParallelStateError,
    UnknownParamError,
    UnsupportedOptimizerError,
)
from ._audit.findings import AuditError
from ._moved import Moved, moved_names
from ._norms.reducer import ParamNorms, PendingNorms
from ._resume.fingerprint import StateFingerprint
from ._resume.report import verify_resume
from ._step.measurement import StepNorms
from ._versions import UntestedMegatronWarning
from ._step.watch import Alarm, Watch, WatchConfig
from ._wrapper import NormAwareOptimizer

__all__ = [
    "Alarm",
    "AuditError",
    "Communicator",
    "NormAwareOptimizer",
    "NormOptimError",
    "ParallelStateError",
    "ParamNorms",
    "PendingNorms",
    "StateFingerprint",
    "StepNorms",
    "UnknownParamError",
    "UnsupportedOptimizerError",
    "UntestedMegatronWarning",
    "Watch",
    "WatchConfig",
    "verify_resume",
]

# Exported here until 0.4.0; served from norm_optim.inspection with a DeprecationWarning.
__getattr__ = moved_names(
    __name__,
    {
        name: Moved(
            "0.5.0",
            "0.6.0",
            f"norm_optim.inspection.{name}",
            functools.partial(getattr, inspection, name),
        )
        for name in inspection.__all__
    },
)

__version__ = "0.5.0"
